"""Published model versions: a full export first, then deltas of the rows that changed.

A publish directory (``publish.dir``, docs/serving.md#publishing)::

    DIR/manifest.json   {"format_version": 1, "latest": N, "versions": [{"version": 1, "kind": "full",
                         "step": s, "dir": "v000001", "base": null, "quantize": ..., "format": ...}, ...],
                         "dropped": [...]}
    DIR/v000001/        full: an export (model.safetensors, config.yaml, preprocessing.json, and
                        quantization.json / the TorchScript files as configured) + version.json
    DIR/v00000k/        delta: delta.safetensors + version.json {version, kind: "delta", base: k-1,
                        step, rows: {table key: rows}, files: {name: sha256}}

``delta.safetensors`` holds, for each embedding table (its state-dict key ``K``), ``ids/K``
(int64 [n], ascending) and ``rows/K`` (the new rows, [n, dim] float32, or uint8
[n, row_bytes] when quantized: ``recsys_dist.serve.quantize``) for the n rows whose stored
bytes differ from the previous version's; and ``state/K`` for every other tensor of the state
dict (dense weights, managed-collision buffers) in full. Folding the full version and the
deltas up to k gives version k's state bit for bit. With ``publish.full_every: N`` a full
version follows every N deltas (compaction: a chain is a full version and at most N deltas). A
server holding version k of a chain reaches a later version m of the same chain by folding
only the deltas k+1..m into a copy of its model (:func:`apply_versions`).

Each version is written into ``DIR/.tmp-v00000k-<pid>`` and renamed into place, then
``manifest.json`` is replaced (tmp + rename): a reader sees a version only once it is whole.
"""

from __future__ import annotations

import copy
import dataclasses
import fcntl
import json
import logging
import os
import shutil
import time
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from recsys_dist.checkpoint.meta import is_complete, latest_checkpoint, read_meta
from recsys_dist.data.record import file_sha256
from recsys_dist.errors import CheckpointError
from recsys_dist.files import fresh_dir, open_in_place, write_atomic
from recsys_dist.serve.config import PublishConfig
from recsys_dist.serve.export import LoadedModel, load, write_export
from recsys_dist.serve.quantize import load_published_state, published_state, quantize_model, table_keys

log = logging.getLogger("recsys_dist")

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
VERSION_FILE = "version.json"
DELTA_FILE = "delta.safetensors"
DROPPED_DIR = "dropped"


def version_dir(version: int) -> str:
    """The directory name of ``version``: ``v000001``."""
    return f"v{version:06d}"


def resolve_publish_dir(cfg: PublishConfig, run_dir: str | Path) -> Path:
    """Where a run publishes: ``publish.dir``, relative to ``run_dir`` unless absolute;
    ``RUN_DIR/publish`` when it is None."""
    return Path(run_dir) / (cfg.dir if cfg.dir is not None else "publish")


def _write_json_atomic(path: Path, obj: dict) -> None:
    write_atomic(path, json.dumps(obj, indent=1) + "\n")  # a link at path is replaced, never written through


def read_manifest(publish_dir: str | Path) -> dict:
    """``DIR/manifest.json`` as a dict.

    Raises:
        CheckpointError: no manifest (not a publish directory, or nothing published yet), or
            one that is not a manifest of this format.
    """
    path = Path(publish_dir) / MANIFEST
    if not path.is_file():
        raise CheckpointError(
            f"{path}: not found, so {publish_dir} holds no published model (not a publish directory, or the run "
            "has not published yet); give the publish.dir of a run trained with publish.enabled: true"
        )
    try:
        manifest = json.loads(path.read_text())
        ok = manifest["format_version"] == FORMAT_VERSION and isinstance(manifest["versions"], list)
        ok = ok and all(_entry_ok(e) for e in manifest["versions"])
        ok = ok and (manifest.get("latest") is None or type(manifest["latest"]) is int)
    except (ValueError, KeyError, TypeError):
        ok = False
    if not ok:
        raise CheckpointError(
            f"{path}: damaged or not a manifest of format_version {FORMAT_VERSION}; delete {publish_dir} and "
            "publish again from the run's checkpoints"
        )
    return manifest


def _entry_ok(e) -> bool:
    """Whether ``e`` is a manifest entry as a publish writes it (a hand edit may break one)."""
    return (
        isinstance(e, dict)
        and type(e.get("version")) is int
        and e.get("kind") in ("full", "delta")
        and isinstance(e.get("dir"), str)
        and (e.get("base") is None or type(e.get("base")) is int)
        and type(e.get("step")) is int
    )


def latest_version(publish_dir: str | Path) -> int | None:
    """The newest published version of ``publish_dir`` (reads ``manifest.json`` only), or None
    when nothing is published there yet (no manifest, or an empty one).

    Raises:
        CheckpointError: a manifest that cannot be read.
    """
    if not (Path(publish_dir) / MANIFEST).is_file():
        return None
    return read_manifest(publish_dir).get("latest")


def _chain(publish_dir: Path, manifest: dict, version: int | None) -> list[dict]:
    """The manifest entries to fold for ``version`` (None: the latest): its full version, then
    each delta up to it.

    Raises:
        CheckpointError: no such version, or a delta whose base is not the version before it.
    """
    entries = {e["version"]: e for e in manifest["versions"]}
    want = manifest.get("latest") if version is None else version
    if want not in entries:
        raise CheckpointError(
            f"{publish_dir / MANIFEST}: no version {want} (published: {sorted(entries) or 'none'}); ask for one "
            "of those"
        )
    chain = [entries[want]]
    while chain[-1]["kind"] != "full":
        base = chain[-1].get("base")
        if base not in entries or base != chain[-1]["version"] - 1:
            raise CheckpointError(
                f"{publish_dir / MANIFEST}: delta version {chain[-1]['version']} builds on version {base}, which is "
                f"not published there (a gap in the chain); load a version before the gap, or delete {publish_dir} "
                "and publish again from the run's checkpoints"
            )
        chain.append(entries[base])
    return chain[::-1]


def _checked_version_dir(publish_dir: Path, entry: dict) -> Path:
    """``DIR/v00000k`` of manifest ``entry``, every file checked against its version.json.

    Raises:
        CheckpointError: the directory or a file is missing, or a file differs from its checksum.
    """
    vdir = publish_dir / entry["dir"]
    fix = (
        f"load an earlier version (load_published(..., version={entry['version'] - 1})), or delete {publish_dir} "
        "and publish again from the run's checkpoints"
    )
    info_path = vdir / VERSION_FILE
    if not info_path.is_file():
        raise CheckpointError(f"{info_path}: missing (version {entry['version']} is listed in {MANIFEST}); {fix}")
    try:
        info = json.loads(info_path.read_text())
        files = dict(info["files"])
    except (ValueError, KeyError, TypeError):
        raise CheckpointError(f"{info_path}: damaged (not the JSON a publish writes); {fix}") from None
    for name, digest in files.items():
        path = vdir / name
        if not path.is_file():
            raise CheckpointError(f"{path}: missing (version {entry['version']} lists it); {fix}")
        if file_sha256(path) != digest:
            raise CheckpointError(f"{path}: damaged (its sha256 differs from {info_path}'s); {fix}")
    return vdir


def _apply_delta(state: dict[str, torch.Tensor], path: Path) -> None:
    """Fold ``delta.safetensors`` at ``path`` into ``state`` in place.

    Raises:
        CheckpointError: the file cannot be read, or its keys do not fit ``state``.
    """
    try:
        delta = load_file(str(path))
    except (SafetensorError, OSError) as err:
        raise CheckpointError(
            f"{path}: cannot be read ({err}); delete the publish directory and publish again"
        ) from None
    covered = set()
    for key, value in delta.items():
        kind, _, name = key.partition("/")
        if name not in state or kind not in ("state", "ids", "rows"):
            raise CheckpointError(f"{path}: tensor {key} fits no tensor of the model; publish again from the run")
        covered.add(name)
        if kind == "state":
            state[name] = value
        elif kind == "ids":
            rows = delta.get(f"rows/{name}")
            if rows is None or len(rows) != len(value) or rows.shape[1:] != state[name].shape[1:]:
                raise CheckpointError(f"{path}: the rows of {name} do not fit its ids or table; publish again")
            state[name][value] = rows
    if covered != set(state):
        raise CheckpointError(
            f"{path}: holds nothing for {sorted(set(state) - covered)[:5]}; publish again from the run"
        )


def _describe(publish_dir: Path, chain: list[dict]) -> str:
    last = chain[-1]
    return f"publish {publish_dir} version {last['version']} (step {last['step']}: full v{chain[0]['version']}" + (
        f" + {len(chain) - 1} delta(s))" if len(chain) > 1 else ")"
    )


def load_published(publish_dir: str | Path, version: int | None = None) -> tuple[LoadedModel, int]:
    """(the model of published ``version``, that version): the full version with the deltas up
    to ``version`` (None: the latest) folded in, as ``serve.export.load`` returns a model (eval
    mode, with its preprocessing record). A quantized publish gives a model whose lookups run
    through TorchRec's quantized EmbeddingBagCollection holding the published rows.

    Raises:
        CheckpointError: no manifest, a missing or damaged version, a gap in the chain (each
            message names the file and the fix).
    """
    publish_dir = Path(publish_dir)
    chain = _chain(publish_dir, read_manifest(publish_dir), version)
    dirs = [_checked_version_dir(publish_dir, e) for e in chain]
    m = load(dirs[0])  # the full version is an export (quantized tables, if any, as published)
    if len(chain) > 1:
        state = published_state(m.model, clone=False)  # a model of its own, not served yet: fold in place
        for d in dirs[1:]:
            _apply_delta(state, d / DELTA_FILE)
        load_published_state(m.model, state, str(dirs[-1] / DELTA_FILE))
    m.source = _describe(publish_dir, chain)
    return m, chain[-1]["version"]


def apply_versions(
    loaded: LoadedModel, publish_dir: str | Path, from_version: int, to_version: int | None = None
) -> tuple[LoadedModel, int]:
    """(the model of published ``to_version`` (None: the latest), that version), built from
    ``loaded``, the model of ``from_version`` of the same directory (as :func:`load_published` or
    this function returned it): what a server following a publish directory reloads.

    When ``from_version`` is on ``to_version``'s chain (the same full version, no compaction,
    drop or quantize change since), only the deltas after it are read (checksums checked) and
    folded into a copy of ``loaded``'s model; otherwise it is :func:`load_published`'s full
    fold. Either way the state is bit for bit ``load_published(publish_dir, to_version)``'s and
    ``source`` reads the same. ``loaded`` is never changed (requests may be scoring it); the new
    model shares its config and preprocessing record. Relies on a version number naming one
    version for the life of a directory (the Publisher numbers after every version ever published).

    Raises:
        CheckpointError: as :func:`load_published` (a missing or damaged delta among those read).
    """
    publish_dir = Path(publish_dir)
    chain = _chain(publish_dir, read_manifest(publish_dir), to_version)
    numbers = [e["version"] for e in chain]
    if from_version not in numbers:  # another chain since (or an older version): fold it whole
        return load_published(publish_dir, numbers[-1])
    dirs = [_checked_version_dir(publish_dir, e) for e in chain[numbers.index(from_version) + 1 :]]
    if not dirs:
        return dataclasses.replace(loaded, source=_describe(publish_dir, chain)), numbers[-1]
    model = copy.deepcopy(loaded.model)  # built off the request path; the served model is untouched
    state = published_state(model, clone=False)  # the copy's own tensors: deltas land in place
    for d in dirs:
        _apply_delta(state, d / DELTA_FILE)
    load_published_state(model, state, str(dirs[-1] / DELTA_FILE))  # the dense tensors the deltas replaced
    return dataclasses.replace(loaded, model=model, source=_describe(publish_dir, chain)), numbers[-1]


def export_from_publish(
    publish_dir: str | Path, out: str | Path, format: str | None = None, version: int | None = None
) -> list[Path]:
    """Write the folded ``version`` (default: the latest) of ``publish_dir`` as a self-contained
    export into ``out`` (what ``recsys-dist export`` writes; a quantized publish keeps its
    quantized rows). ``format``: safetensors / torchscript, None = the publish's
    ``publish.format``. Returns the paths written.

    Raises:
        CheckpointError: as :func:`load_published`; torchscript asked of a quantized publish.
    """
    m, version = load_published(publish_dir, version)
    if format is None:  # as the publish was configured (its manifest records it per version)
        entry = {e["version"]: e for e in read_manifest(publish_dir)["versions"]}.get(version, {})
        format = entry.get("format", "safetensors")
    return write_export(m, out, format, f"{publish_dir} version {version}")


def _delta(old: dict, new: dict, tables: set[str]) -> tuple[dict[str, torch.Tensor], dict[str, int]]:
    """(the tensors of ``delta.safetensors`` from published state ``old`` to ``new``, rows per
    table). A row is changed when any of its bytes differ (exact: -0.0 vs 0.0 and NaNs too)."""
    out, rows = {}, {}
    for key, value in new.items():
        if key in tables:
            changed = (old[key].view(torch.uint8) != value.view(torch.uint8)).any(dim=1)
            ids = changed.nonzero().flatten().to(torch.int64)
            out[f"ids/{key}"] = ids
            out[f"rows/{key}"] = value[ids].contiguous()
            rows[key] = int(ids.numel())
        else:
            out[f"state/{key}"] = value
    return out, rows


def _same_layout(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(a[k].shape == b[k].shape and a[k].dtype == b[k].dtype for k in a)


def _lock(publish_dir: Path):
    """An exclusive lock on ``DIR/.lock`` for as long as the returned file is open (the process
    lives: a killed one releases it).

    Raises:
        CheckpointError: another process holds it (another run publishes into ``publish_dir``).
    """
    fd = open_in_place(publish_dir / ".lock", os.O_WRONLY | os.O_APPEND | os.O_CREAT)  # never through a link
    f = os.fdopen(fd, "a")  # noqa: SIM115 - held open for the publisher's life
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.close()
        raise CheckpointError(
            f"{publish_dir}: another process publishes into it now (it holds {publish_dir / '.lock'}); two runs "
            "may not publish into one directory (each would number, drop and overwrite the other's versions): "
            "give this run another publish.dir"
        ) from None
    return f


class Publisher:
    """Publishes the checkpoints of a run into ``publish_dir`` (module docstring): a full version
    first, then a delta per checkpoint, against the last published state held in memory.

    With ``publish.full_every: N`` every (N+1)-th version of a chain is full again (compaction),
    so a fresh load folds at most N deltas.

    On construction an existing directory is taken up: numbering continues, and versions of a
    step after ``resume_step`` (the step the run resumes from: it will train them again) are
    moved to ``DIR/dropped/`` with a warning, as are versions a killed publish left out of the
    manifest; after such a drop the next version is a full one. ``version``: the newest
    published version (None before the first). ``lock``: hold ``DIR/.lock`` while it lives
    (``PublishCallback`` does: one run at a time publishes into a directory).

    Raises:
        CheckpointError: an existing directory that cannot be read (as :func:`load_published`);
            with ``lock``, another process holding the directory.
    """

    def __init__(self, publish_dir: Path, cfg: PublishConfig, resume_step: int | None = None, lock: bool = False):
        self.dir = Path(publish_dir)
        self.cfg = cfg
        self.dir.mkdir(parents=True, exist_ok=True)
        self._lock = _lock(self.dir) if lock else None
        for tmp in self.dir.glob(".tmp-*"):  # a publish killed before its rename
            shutil.rmtree(tmp, ignore_errors=True)
        manifest = read_manifest(self.dir) if (self.dir / MANIFEST).is_file() else None
        self._versions: list[dict] = list(manifest["versions"]) if manifest else []
        self._dropped: list[dict] = list(manifest.get("dropped", [])) if manifest else []
        drop = [e for e in self._versions if resume_step is not None and e["step"] > resume_step]
        listed = {e["dir"] for e in self._versions}
        orphans = [p.name for p in self.dir.glob("v*") if p.is_dir() and p.name not in listed]
        self._force_full = bool(drop or orphans)
        for name in orphans:
            self._move_aside(name, f"not in {MANIFEST} (a publish interrupted before its manifest)")
            if name[1:].isdigit():
                self._dropped.append({"version": int(name[1:]), "step": None})
        # Versions past the resumed step stay listed (and served) until the next version replaces
        # them: the run trains those steps again, and a server must never fall back to an older model.
        self._pending_drop = drop
        for e in drop:
            log.warning(
                "publish: version %d (step %d) is after the resumed step %s; it stays the latest until the next "
                "version (a full one) replaces it, then moves to %s/",
                e["version"],
                e["step"],
                resume_step,
                DROPPED_DIR,
            )
        kept = [e for e in self._versions if e not in drop]
        self.version: int | None = kept[-1]["version"] if kept else None
        numbers = [e["version"] for e in self._versions + self._dropped]
        self._next = max(numbers, default=0) + 1
        if orphans and manifest is not None:
            self._write_manifest()
        self._state: dict | None = None
        if self.version is not None and not self._force_full:
            m, _ = load_published(self.dir, self.version)
            self._state = published_state(m.model, clone=False)  # m is this state's only user

    @property
    def step(self) -> int | None:
        """The training step of the newest published version (None before the first)."""
        return next((e["step"] for e in self._versions if e["version"] == self.version), None)

    def _move_aside(self, name: str, why: str) -> None:
        target = self.dir / DROPPED_DIR / f"{name}-{int(time.time())}"
        target.parent.mkdir(exist_ok=True)
        os.replace(self.dir / name, target)
        log.warning("publish: moved %s to %s: %s", self.dir / name, target, why)

    def _write_manifest(self) -> None:
        _write_json_atomic(
            self.dir / MANIFEST,
            {
                "format_version": FORMAT_VERSION,
                "latest": self._versions[-1]["version"] if self._versions else None,
                "versions": self._versions,
                "dropped": self._dropped,
            },
        )

    def _compact(self) -> bool:
        """Whether ``publish.full_every`` deltas follow the last full version (then the next is full)."""
        n = self.cfg.full_every
        if n is None:
            return False
        since = 0
        for e in reversed(self._versions):
            if e["kind"] == "full":
                break
            since += 1
        return since >= n

    def publish(self, checkpoint: Path) -> Path:
        """Publish ``checkpoint`` (a checkpoint directory, or a run directory: its newest one) as
        the next version: full for the first (or after a drop, when the tables changed shape or
        quantization, or after ``publish.full_every`` deltas), a delta afterwards. Returns the version's directory.

        Raises:
            CheckpointError: the checkpoint cannot be loaded (``serve.export.load``).
        """
        checkpoint = Path(checkpoint)
        ckpt = checkpoint if is_complete(checkpoint) else latest_checkpoint(checkpoint)
        m = load(ckpt if ckpt is not None else checkpoint)
        step = int(read_meta(ckpt)["step"])
        if self.cfg.quantize != "none":
            quantize_model(m.model, self.cfg.quantize)
        state = published_state(m.model)
        number = self._next
        name = version_dir(number)
        tmp = self.dir / f".tmp-{name}-{os.getpid()}"
        fresh_dir(tmp)  # new and empty: a link planted at this name is removed, never written through
        full = self._state is None or self._force_full or not _same_layout(self._state, state) or self._compact()
        info = {"format_version": FORMAT_VERSION, "version": number, "kind": "full" if full else "delta"}
        info.update(base=None if full else self.version, step=step, checkpoint=str(ckpt))
        info.update(quantize=self.cfg.quantize, format=self.cfg.format, created=time.time())
        if full:
            written = write_export(m, tmp, self.cfg.format, ckpt)
        else:
            tensors, rows = _delta(self._state, state, set(table_keys(m.model)))
            save_file(tensors, str(tmp / DELTA_FILE))
            written, info["rows"] = [tmp / DELTA_FILE], rows
        info["files"] = {p.relative_to(tmp).as_posix(): file_sha256(p) for p in written}
        _write_json_atomic(tmp / VERSION_FILE, info)
        os.replace(tmp, self.dir / name)
        entry = {k: info[k] for k in ("version", "kind", "step", "base", "quantize", "format")}
        drop, self._pending_drop = self._pending_drop, []
        self._versions = [e for e in self._versions if e not in drop] + [{**entry, "dir": name}]
        self._dropped += [{"version": e["version"], "step": e["step"]} for e in drop]
        self.version, self._next, self._state, self._force_full = number, number + 1, state, False
        self._write_manifest()
        for e in drop:  # no longer listed: moved aside only now
            self._move_aside(e["dir"], f"replaced by version {number} (its step {e['step']} was trained again)")
        log.info("publish: version %d (%s, step %d) in %s", number, info["kind"], step, self.dir / name)
        return self.dir / name
