"""The cache entry's manifest (``manifest.json``): what the conversion wrote, how, and what it
warns about; written last, so an entry without one is incomplete. Also the data warnings' logger."""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from recsys_dist.data import mapping as mp
from recsys_dist.data.convert.passes import SEPARATOR_CANDIDATES, Totals
from recsys_dist.data.coverage import coverage_warning
from recsys_dist.data.splits import SPLITS, Split
from recsys_dist.errors import DataError
from recsys_dist.files import write_atomic
from recsys_dist.logs import StderrHandler

VOCABULARY_FILE = "vocabulary.parquet"
MANIFEST_FILE = "manifest.json"
# The layout of a cache entry and its manifest, part of the entry's key. 1: recsys_dist 0.1.0
# (keys without the defaults, "files" and "integrity" optional); 2: both always there.
CACHE_FORMAT = 2
OOV_WARN_RATE = 0.5  # warn when more of a feature's validation / test values are out of vocabulary


# Data warnings go to stderr whatever the root logger's level (the planner sets it to ERROR).
log = logging.getLogger("recsys_dist.data")
if not log.handlers:
    _handler = StderrHandler()
    _handler.setFormatter(logging.Formatter("recsys-dist: warning: %(message)s"))
    log.addHandler(_handler)
    log.setLevel(logging.WARNING)
    log.propagate = False


@dataclass(frozen=True)
class PreparedData:
    """Paths of the converted splits (a list of paths for a split converted from several
    files), rows per split, and the table size per categorical feature (the configured sizes
    under hash mapping, the vocabulary sizes otherwise)."""

    directory: Path
    files: dict[str, Path | list[Path]]
    rows: dict[str, int]
    num_embeddings: list[int] | None = None

    def paths(self, split: str) -> list[str]:
        """The Parquet file(s) of ``split``, as the loader takes them."""
        f = self.files[split]
        return [str(p) for p in f] if isinstance(f, list) else [str(f)]


def check_cache_format(m: dict, out: Path) -> None:
    """Refuse a conversion (cache entry ``out`` with manifest ``m``) of another cache format
    than :data:`CACHE_FORMAT`.

    Raises:
        DataError: naming the entry, the format found, the one expected and the fix.
    """
    found = m.get("cache_format", 1)
    if found == CACHE_FORMAT:
        return
    who = "a newer" if isinstance(found, int) and found > CACHE_FORMAT else "an older"
    raise DataError(
        f"{out}: this conversion was written by {who} recsys_dist (cache format {found!r}; this one reads format "
        f"{CACHE_FORMAT} only): re-run the conversion: delete {out}"
    )


def manifest_result(out: Path, m: dict) -> PreparedData:
    names = m["files"]
    files = {s: out / names[s][0] if len(names[s]) == 1 else [out / n for n in names[s]] for s in SPLITS}
    return PreparedData(out, files, m["rows"], m["num_embeddings"])


def describe_mapping(
    mapping: str, managed: list[bool], sparse_names: list[str], vocabulary: dict | None, transforms: dict
) -> dict:
    """The manifest's ``categorical_mapping``; under vocabulary mapping ``vocabulary`` holds
    ``vocab_features`` ([(feature index, name)]), ``min_count``, ``sizes``, ``source``,
    ``distinct`` (or None) and ``ids`` (the totals' [split, (present, OOV), feature] counts),
    and ``transforms["sparse"]`` is rewritten to say how ids are given."""
    info: dict = {"kind": mapping, "missing_id": mp.MISSING_ID}
    if mapping != "managed" and any(managed):
        info["managed"] = [n for n, m in zip(sparse_names, managed) if m]  # raw 63-bit ids
    if vocabulary is None:
        return info
    v = vocabulary
    features, min_count, ids = v["vocab_features"], v["min_count"], v["ids"]
    transforms["sparse"] = (
        f"id = 2 + rank of the value's key ({transforms.get('key', 'see mapping')}) among "
        f"the training split's keys seen >= {min_count} times, by count then key; "
        f"other values -> {mp.OOV_ID} (OOV); empty -> {mp.MISSING_ID}"
    )
    info.update(
        oov_id=mp.OOV_ID,
        min_count=min_count,
        file=VOCABULARY_FILE,
        source=v["source"],
        vocabulary_size={n: v["sizes"][j] for j, n in features},
    )
    if v["distinct"] is not None:
        info["distinct_train_values"] = {n: v["distinct"][j] for j, n in features}
    # Per split and feature: the fraction of present values (not missing) that are out of vocabulary.
    info["oov_rate"] = {
        s: {n: float(ids[k, 1, j] / ids[k, 0, j]) if ids[k, 0, j] else None for j, n in features}
        for k, s in enumerate(SPLITS)
    }
    return info


def dense_stats(dense_names: list[str], stats: np.ndarray, missing: np.ndarray, seen: int) -> dict:
    """The manifest's ``dense_stats_train``: mean, std (training rows) and missing fraction (all rows)."""
    return {
        n: {
            "mean": float(stats[1, j] / stats[0, j]) if stats[0, j] else None,
            "std": float(np.sqrt(max(stats[2, j] / stats[0, j] - (stats[1, j] / stats[0, j]) ** 2, 0)))
            if stats[0, j]
            else None,
            "missing_fraction": float(missing[j] / seen) if seen else None,
        }
        for j, n in enumerate(dense_names)
    }


# ------------------------------------------------------------------------- warnings


def conversion_warnings(
    fmt,
    raw: Path,
    split: Split,
    rows: dict,
    train_labels,
    totals: Totals,
    mapping_info: dict,
    vocab_path,
    coverage: bool = True,
) -> list[dict]:
    """What a conversion warns about, as ``{"kind", "message"}`` entries: stored in the
    manifest, so a cached conversion that is reused repeats them (:func:`emit_warnings`).
    ``coverage``: warn about tables that give too few training values a row of their own."""
    out = []
    if train_labels[0] and train_labels[1] in (0, train_labels[0]):
        out.append(
            {
                "kind": "one_class",
                "message": _one_class_message(fmt, raw, int(train_labels[0]), int(train_labels[1] > 0)),
            }
        )
    wants_test = split.by in ("time", "files", "leave_last_out") or split.fractions[2] > 0
    if rows["test"] == 0 and rows["train"] and wants_test:
        if split.by == "time":
            hint = (
                f"no value of {split.column} is >= data.split.thresholds[1] ({split.thresholds[1]:g}); "
                "lower the threshold"
            )
        elif split.by == "files":
            hint = f"the test file {split.test_path} holds no rows"
        elif split.by == "leave_last_out":
            hint = f"no {split.user} has 3 rows (users with fewer rows are all training rows)"
        else:
            hint = "give more rows or a larger test fraction in data.split"
        out.append(
            {
                "kind": "empty_test",
                "message": f"{raw}: the test split is empty (train {rows['train']}, validation "
                f"{rows['validation']}, test 0 rows), so no test metrics will be reported: {hint}",
            }
        )
    tables = mapping_info.get("coverage")
    if coverage and tables:
        message = coverage_warning(raw, mapping_info["kind"], tables, mapping_info.get("min_count"))
        if message is not None:
            out.append({"kind": "coverage", "message": message})
    if mapping_info.get("oov_rate") and vocab_path is None:
        out += _oov_warnings(raw, mapping_info, totals, list(fmt.sparse_names))
    out += _separator_warnings(raw, totals)
    return out


def _oov_warnings(raw: Path, mapping_info: dict, totals: Totals, names: list[str]) -> list[dict]:
    """Validation / test splits where most of a feature's values are out of vocabulary, with
    why: never seen in the training split (the split keeps them out), seen there but left out
    by the size cap (``data.num_embeddings``), or seen fewer than ``data.min_count`` times."""
    out = []
    rates, min_count = mapping_info["oov_rate"], mapping_info["min_count"]
    index = {n: j for j, n in enumerate(names)}
    for k, s in enumerate(SPLITS[1:], start=1):
        high = {n: r for n, r in rates[s].items() if r is not None and r > OOV_WARN_RATE}
        if not high:
            continue
        causes, parts = set(), []
        for n, r in high.items():
            present = totals.ids[k, 0, index[n]]
            cut, rare = (totals.causes[k, c, index[n]] / present for c in (0, 1))
            unseen = max(r - cut - rare, 0.0)
            why = [(unseen, "never in the training split", "split"), (cut, "left out by the size cap", "cap")]
            why.append((rare, f"seen fewer than min_count {min_count} times", "min_count"))
            shown = [f"{x:.0%} {what}" for x, what, _ in why if x > 0]
            causes |= {c for x, _, c in why if x > 0}
            parts.append(f"{n} {r:.0%} ({', '.join(shown)})")
        fixes = {
            "split": "Check that data.split leaves such values in the training rows (new users / items / days are "
            "out of vocabulary by nature; data.categorical_mapping: hash gives them rows)",
            "cap": "Raise data.num_embeddings (the coverage warning and categorical_mapping.coverage suggest sizes)",
            "min_count": "Lower data.min_count",
        }
        out.append(
            {
                "kind": "oov_rate",
                "message": f"{raw}: in the {s} split, most values of {'; '.join(parts)} are out of vocabulary: they "
                f"all share the out-of-vocabulary id {mp.OOV_ID}, so the model cannot tell them apart. "
                + ". ".join(f for c, f in fixes.items() if c in causes)
                + ". Rates per feature: categorical_mapping.oov_rate in manifest.json",
            }
        )
    return out


def _separator_warnings(raw: Path, totals: Totals) -> list[dict]:
    """A multi-hot text column in which almost no value holds the configured separator but
    many hold another common one: every combination would silently be one token."""
    out = []
    for (name, sep), counts, examples in zip(totals.multi_hot, totals.separators, totals.separator_examples):
        n = counts.get("values", 0)
        if not n or counts.get(sep, 0) > 0.01 * n:
            continue
        found = [(counts.get(c, 0), c) for c in SEPARATOR_CANDIDATES if c != sep and counts.get(c, 0) >= 0.2 * n]
        if not found:
            continue
        # A space is the weakest sign (values may be phrases): any other candidate first.
        best = max(found, key=lambda nc: (nc[1] != " ", nc[0]))[1]
        out.append(
            {
                "kind": "separator",
                "message": f"{raw}: multi-hot column {name}: {counts.get(sep, 0)} of {n} values contain the "
                f"separator {sep!r} (data.schema.separator), but {counts[best]} contain {best!r} (e.g. "
                f"{examples[best]!r}), so each whole value is one token; if {best!r} separates the "
                f"elements, set data.schema.separator: {best!r}",
            }
        )
    return out


def _one_class_message(fmt, raw: Path, n: int, label: int) -> str:
    """Every training row has the same label: say which column and threshold made it so."""
    column = fmt.label_column
    spec = fmt.spec
    threshold = getattr(spec, "label_threshold", None)
    if threshold is not None:
        rule = (
            f"label = 1 if {column} >= {threshold:g} (data.schema.label_threshold); if {column} already holds "
            "0/1, remove label_threshold"
        )
    else:
        rule = f"label = the {column} column"
    return (
        f"{raw}: all {n} training rows have label {label} ({rule}); the model will only see one class. "
        "Check the label column and the split."
    )


def emit_warnings(manifest: dict, warn_one_class: bool) -> None:
    for w in manifest.get("warnings", []):
        if w.get("kind") != "one_class" or warn_one_class:
            log.warning(w["message"])
    mapping = manifest.get("categorical_mapping") or {}
    if "coverage" not in mapping:  # written before coverage was counted: what its OOV rates tell
        tables = table_coverage(manifest)
        message = coverage_warning(manifest.get("source"), "vocabulary", tables or {}, mapping.get("min_count"))
        if message is not None:
            log.warning(
                f"{message}. (This conversion was written by an older recsys_dist, which did not count the "
                "sizes to suggest: delete its cache entry to convert again and count them.)"
            )


def table_coverage(manifest: dict) -> dict | None:
    """Per table, how many of its training values get a row of their own
    (``categorical_mapping.coverage``, see ``recsys_dist.data.coverage``); for a vocabulary
    counted by an older recsys_dist, what its manifest knows (the share out of vocabulary, no
    suggested sizes: None); None when not counted (managed mapping, a stream's partition,
    scoring, or a hash conversion written before coverage was counted)."""
    mapping = manifest.get("categorical_mapping") or {}
    if "coverage" in mapping:
        return mapping["coverage"]
    if mapping.get("kind") != "vocabulary" or mapping.get("source") != "training split":
        return None
    rates = (mapping.get("oov_rate") or {}).get("train") or {}
    sizes, distinct = mapping.get("vocabulary_size") or {}, mapping.get("distinct_train_values") or {}
    return {
        n: {
            "table_rows": sizes.get(n),
            "train_values": None,
            "distinct": distinct.get(n),
            "outside_share": r,
            "cut_by_size": None,
            "below_min_count": None,
            "suggested_num_embeddings": None,
        }
        for n, r in rates.items()
    }


def entry_files(m: dict) -> list[str]:
    """The data files of a manifest's entry: every split file, and the vocabulary if any."""
    names = m["files"]
    vocab = (m.get("categorical_mapping") or {}).get("file")
    return [n for s in SPLITS for n in names[s]] + ([vocab] if vocab else [])


def train_identity(directory: Path) -> dict | None:
    """What a checkpoint records of the training split it was trained on: ``fingerprint``
    (16 hex digits over the size and checksum of each training file, as the entry's manifest
    records them: the content, whatever the raw file's name, date or cache directory),
    ``rows``, ``algorithm`` (the checksum's) and ``entry`` (the cache entry's name); None
    for an entry whose manifest lists no training file.

    Raises:
        DataError: an entry of another cache format (:func:`check_cache_format`).
    """
    m = json.loads((Path(directory) / MANIFEST_FILE).read_text())
    check_cache_format(m, Path(directory))
    names = m["files"]["train"]
    integrity = m["integrity"]
    files = integrity["files"]
    if not names:
        return None
    h = hashlib.blake2b(digest_size=8)
    for n in names:
        h.update(f"{files[n]['size']}:{files[n]['checksum']};".encode())
    return {
        "fingerprint": h.hexdigest(),
        "rows": int(m["rows"]["train"]),
        "algorithm": integrity.get("algorithm"),
        "entry": Path(directory).name,
    }


def write_manifest(out: Path, manifest: dict) -> None:
    """Write ``manifest.json`` under a temporary name and rename it into place (a reader sees
    the old manifest or the new one, never half of one; ``recsys_dist.files.write_atomic``)."""
    write_atomic(out / MANIFEST_FILE, json.dumps(manifest, indent=2))
