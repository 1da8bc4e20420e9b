"""What scoring needs besides the weights, and how new rows are turned into model inputs.

A model maps raw rows to ids and dense values exactly as its training conversion did: the
format and its transforms, the table sizes, the hash rule, and under
``data.categorical_mapping: vocabulary`` the training split's vocabulary. All of it is
recorded in ``preprocessing.json`` (:class:`Preprocessing`), with the vocabulary beside it in
``vocabulary.parquet``, in every export; scoring reads only those files and the rows to
score, never the training data.

A checkpoint does not hold these files when written. The first time one is scored or
exported (:func:`for_checkpoint`), its training conversion is looked up in the conversion
cache: the entry of ``data.raw_path`` as it is now, accepted only if it was written before
the checkpoint and has the checkpoint's table sizes; its record is then pinned next to the
checkpoint, so later changes to the training file no longer matter. If the entry is gone or
the file changed since, scoring refuses (rebuilding the vocabulary from other data would
silently give other ids).

Input files: a Parquet file is a converted split only when a ``manifest.json`` in its
directory lists it (:func:`converted_manifest`), never by its name; its conversion must then
match the model's (:func:`check_conversion`). Anything else is raw data in the model's
format, converted with the model's own record (:func:`prepare_for_scoring`). A raw file
without the label column (Criteo's 39-field test layout, or a schema file lacking
``data.schema.label``) is scored with placeholder labels and reported as unlabelled.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pyarrow as pa

from recsys_dist.data.config import DataConfig, describe_raw_path, raw_paths
from recsys_dist.data.convert import prepare
from recsys_dist.data.convert.manifest import check_cache_format
from recsys_dist.data.formats.base import TRANSFORM_VERSION
from recsys_dist.data.record import (
    MANIFEST_FILE,
    PREPROCESSING_FILE,
    VOCABULARY_FILE,
    Preprocessing,
    vocabulary_digest,
)
from recsys_dist.data.resolve import cached_conversion, conversion_spec, data_format
from recsys_dist.data.text import LINE_COLUMN
from recsys_dist.errors import DataError
from recsys_dist.train.job import load_job


def is_unlabelled(format_name: str) -> bool:
    """Whether a conversion's ``format`` is a format's unlabelled variant (``<name>_unlabelled``,
    ``RawFormat.unlabelled``): its labels are placeholders."""
    return format_name.endswith("_unlabelled")


# Transform texts that must agree between the model's record and a converted split it scores:
# the dense transform and the multi-hot separator. (The label may differ: an unlabelled file
# has a placeholder. The mapping is compared by its kind, table sizes and vocabulary digest,
# the rest of the code's transforms by TRANSFORM_VERSION.)
_COMPARED_TRANSFORMS = ("dense", "multi_hot")


def training_conversion(d: DataConfig) -> Path | None:
    """The conversion-cache entry of the ``data`` section's training data as the files are
    now (the entry ``prepare`` would reuse, named as the conversion names it), or None when
    it is not cached or a file is gone. Nothing is converted or read besides the files'
    sizes and times."""
    return cached_conversion(d)[0]


def for_checkpoint(ckpt: Path, meta: dict) -> Preprocessing:
    """The preprocessing record of a checkpoint: the one pinned beside it, else (hash
    mapping) made from its config, else (vocabulary) from its training conversion if that is
    still cached unchanged, then pinned beside the checkpoint (when writable).

    Raises:
        DataError: a vocabulary-mapped checkpoint whose vocabulary can no longer be found as
            it was (training data changed, moved or deleted, or the cache cleared).
    """
    ckpt = Path(ckpt)
    job = load_job(meta["config"], f"{ckpt}/meta.json")  # as trained: the configured sizes
    d = job.data
    sizes = list(meta.get("num_embeddings") or job.table_sizes)
    pinned = Preprocessing.load(ckpt)
    if pinned is not None:
        if pinned.num_embeddings != sizes:
            raise DataError(
                f"{ckpt / PREPROCESSING_FILE}: table sizes {pinned.num_embeddings} differ from the checkpoint's "
                f"{sizes}; delete {PREPROCESSING_FILE} and {VOCABULARY_FILE} there"
            )
        return pinned
    if d.categorical_mapping == "hash":
        return Preprocessing.describe(d, job.fmt, sizes)
    raw = describe_raw_path(d.raw_path)
    entry = training_conversion(d)
    problem = None
    if entry is None:
        gone = [p for p in raw_paths(d) if not Path(p).is_file()]
        problem = (
            f"the training data {gone[0]} is gone"
            if gone
            else f"the conversion cache holds no conversion of {raw} as the file is now (it changed since "
            "training, or the cache was cleared)"
        )
    else:
        try:
            manifest = json.loads((entry / MANIFEST_FILE).read_text())
        except ValueError:
            manifest = None
        if not isinstance(manifest, dict):  # JSON but not an object, or not JSON
            problem = f"{entry / MANIFEST_FILE} is not a conversion's manifest (a JSON object)"
        elif manifest.get("num_embeddings") != sizes:
            problem = (
                f"the cached conversion of {raw} as it is now ({entry}) has vocabulary sizes "
                f"{manifest.get('num_embeddings')}, the checkpoint {sizes} (the file changed since training)"
            )
        elif (entry / MANIFEST_FILE).stat().st_mtime > (ckpt / "meta.json").stat().st_mtime:
            problem = (
                f"the cached conversion of {raw} as it is now ({entry}) was made after this checkpoint was "
                "written (the file changed since training and was converted again)"
            )
        elif not (entry / VOCABULARY_FILE).is_file():
            problem = f"{entry / VOCABULARY_FILE} is missing"
    if problem:
        raise DataError(
            f"checkpoint {ckpt} maps categories through a vocabulary built on its training data and holds no "
            f"copy of it ({PREPROCESSING_FILE}, {VOCABULARY_FILE}), and {problem}. Rebuilding it from other data "
            "would give other ids, so it is not scored. Restore the training data as it was when this checkpoint "
            "was trained (and its cached conversion), then `recsys-dist export` it once: the export carries the "
            "vocabulary from then on. Or train again."
        )
    found = Preprocessing.describe(d, job.fmt, sizes, entry, manifest)
    try:  # pin it: from now on this checkpoint no longer depends on the training data
        found.save(ckpt)
        found.directory = ckpt
    except OSError:
        pass
    return found


# ---------------------------------------------------------------- input files


def _listed(manifest: dict, name: str) -> bool:
    """Whether a conversion manifest's file list names ``name``."""
    for entries in (manifest.get("files") or {}).values():
        for e in entries if isinstance(entries, list) else [entries]:
            listed = next((e[k] for k in ("name", "file", "path") if k in e), None) if isinstance(e, dict) else e
            if listed is not None and Path(str(listed)).name == name:
                return True
    return False


def converted_manifest(path: Path) -> dict | None:
    """The conversion manifest of ``path`` if it is a converted split (a conversion's
    ``manifest.json`` in its directory lists it by name), else None.

    Raises:
        DataError: the conversion beside ``path`` is of another cache format
            (``recsys_dist.data.convert.manifest.check_cache_format``).
    """
    path = Path(path)
    m = path.parent / MANIFEST_FILE
    if not m.is_file():
        return None
    try:
        manifest = json.loads(m.read_text())
    except ValueError:
        return None
    if not isinstance(manifest, dict) or not {"format", "rows", "num_embeddings"} <= manifest.keys():
        return None  # not a conversion's manifest
    check_cache_format(manifest, path.parent)
    return manifest if _listed(manifest, path.name) else None


def check_conversion(manifest: dict, entry: Path, prep: Preprocessing, what: str) -> None:
    """Refuse a conversion (``entry`` with ``manifest``) that made ids or dense values other
    than the model's record says: format, features, table sizes, mapping, vocabulary, transforms.

    Raises:
        DataError: naming ``what`` and each difference.
    """
    r = prep.record
    diffs = []
    if r.get("transform_version", TRANSFORM_VERSION) != TRANSFORM_VERSION:
        raise DataError(
            f"the model's preprocessing.json was written with transform version {r['transform_version']}; this "
            f"recsys_dist converts with version {TRANSFORM_VERSION}, which gives other inputs. Score it with the "
            f"recsys_dist that wrote it ({r.get('written_by', {}).get('recsys_dist')}), or retrain"
        )
    fmt = manifest.get("format")
    if fmt not in (r["format"], f"{r['format']}_unlabelled"):
        diffs.append(f"format {fmt} (the model's: {r['format']})")
    for key in ("dense", "sparse", "num_embeddings"):
        if key in manifest and list(manifest[key]) != list(r[key]):
            diffs.append(f"{key} {manifest[key]} (the model's: {r[key]})")
    kind = (manifest.get("categorical_mapping") or {}).get("kind", "hash")
    if kind != r["categorical_mapping"]["kind"]:
        diffs.append(f"categorical mapping {kind} (the model's: {r['categorical_mapping']['kind']})")
    elif kind == "vocabulary":
        vocab = Path(entry) / VOCABULARY_FILE
        if not vocab.is_file() or vocabulary_digest(vocab, r["sparse"]) != r["categorical_mapping"]["digest"]:
            diffs.append("another vocabulary (not the one the model was trained with)")
    t = manifest.get("transforms") or {}
    for key in _COMPARED_TRANSFORMS:
        if key in t and key in r["transforms"] and t[key] != r["transforms"][key]:
            diffs.append(f"{key} transform {t[key]!r} (the model's: {r['transforms'][key]!r})")
    if diffs:
        raise DataError(
            f"{what} was converted with other settings than the model: {'; '.join(diffs)}. Its ids or values "
            "would not mean what the model learnt; score the raw file instead (it is converted with the model's "
            "own settings)"
        )


def scoring_format(d: DataConfig, data: Path):
    """A new format object that reads ``data`` for scoring: the ``data`` section's, or its
    unlabelled variant when the file has no label (Criteo: 39 fields; schema: no label column).
    New for each file: a format deriving user histories keeps state while a file streams by, so
    it is never the run's own ``job.fmt``."""
    fmt = data_format(d)
    return fmt.unlabelled(data) or fmt


def prepare_for_scoring(d: DataConfig, data, vocabulary: Path | None = None, fmt=None):
    """Convert a raw file of the model's format (``d``: the model's ``data`` section,
    ``job.data``), every row as one split (``files["train"]``, in file order), with the model's
    mapping: its table sizes, and under vocabulary mapping ``vocabulary`` (the model's own
    ``vocabulary.parquet``). ``fmt``: the format object to read it with (default
    :func:`scoring_format`). The training data is never read.

    Raises:
        DataError: malformed input, or a vocabulary-mapped model without ``vocabulary``.
    """
    if d.categorical_mapping == "vocabulary" and vocabulary is None:
        raise DataError(
            f"{data}: the model maps categories through its training vocabulary, and none was given; load the model "
            "with recsys_dist.serve.export.load (its export or checkpoint carries the vocabulary)"
        )
    rows = replace(
        conversion_spec(d),
        fmt=fmt or scoring_format(d, Path(data)),
        raw_path=data,
        split=(1.0, 0.0, 0.0),
        num_rows=None,  # every row of the file, in file order; a bad one is an error naming it
        on_bad_row="error",
        vocabulary=vocabulary if d.categorical_mapping == "vocabulary" else None,
    )
    return prepare(
        rows,
        warn_one_class=False,  # scoring: one class is no problem
        coverage=False,  # the tables' coverage is the training data's (preprocessing.json)
    )


def read_raw_columns(fmt, path: Path, names: list[str]) -> dict[str, pa.Array]:
    """Columns ``names`` of a raw file, every row in file order, as the format reads them
    (text for CSV / TSV, the stored type for Parquet).

    Raises:
        DataError: a column that is not in the file (naming the file and its columns).
    """
    parts: dict[str, list] = {n: [] for n in names}
    seen = None
    for _, table in fmt.read_chunks(str(path)):
        if seen is None:
            seen = [c for c in table.column_names if c != LINE_COLUMN]
            if is_unlabelled(fmt.name):
                seen = [c for c in seen if c != fmt.label_column]  # a placeholder the reader added
            missing = [n for n in names if n not in seen]
            if missing:
                raise DataError(
                    f"--keep-columns: {', '.join(missing)} {'is not a column' if len(missing) == 1 else 'are not columns'}"
                    f" of {path} (its columns: {', '.join(seen)})"
                )
        for n in names:
            parts[n].extend(table.column(n).chunks)
    return {n: pa.chunked_array(parts[n]).combine_chunks() if parts[n] else pa.array([], pa.string()) for n in names}
