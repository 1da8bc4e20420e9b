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
Reading the manifest and checking a version's files: ``recsys_dist.serve.publish_manifest`` (its public
names are importable from here too).
"""

from __future__ import annotations

import copy
import dataclasses
import errno
import json
import logging
import os
import shutil
import time
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from recsys_dist.checkpoint.integrity import describe_error
from recsys_dist.checkpoint.meta import is_complete, latest_checkpoint, read_meta
from recsys_dist.data.record import file_sha256
from recsys_dist.errors import CheckpointError
from recsys_dist.faults import maybe_fault
from recsys_dist.files import fresh_dir, write_atomic
from recsys_dist.serve.export import LoadedModel, load, with_state, write_export

# F401: re-exported, the publish API: http.PublishSource reads MANIFEST, latest_version, newest_intact and
# chain_files_state through this module; manifest.repair_hint's fix imports repair_manifest from here.
from recsys_dist.serve.publish_manifest import (  # noqa: F401 - read_manifest, latest_version, newest_intact, chain_files_state
    FORMAT_VERSION,
    MANIFEST,
    RESUME_FIX,
    VERSION_FILE,
    chain_files_state,
    checked_version_dir,
    latest_version,
    newest_intact,
    publishing_run,
    read_manifest,
    version_chain,
)
from recsys_dist.serve.publish_owner import (  # noqa: F401 - check_new_run, check_owner, repair_manifest: public here too
    DROPPED_DIR,
    check_new_run,
    check_owner,
    lock_dir,
    read_listing,
    repair_manifest,
)
from recsys_dist.serve.quantize import load_published_state, published_state, quantize_model, table_keys
from recsys_dist.train.config import PublishConfig

log = logging.getLogger("recsys_dist")

DELTA_FILE = "delta.safetensors"


def version_dir(version: int) -> str:
    """The directory name of ``version``: ``v000001``."""
    return f"v{version:06d}"


def resolve_publish_dir(cfg: PublishConfig, run_dir: str | Path) -> Path:
    """Where a run publishes: ``publish.dir``, relative to ``run_dir`` unless absolute;
    ``RUN_DIR/publish`` when it is None."""
    return Path(run_dir) / (cfg.dir if cfg.dir is not None else "publish")


def _write_json_atomic(path: Path, obj: dict) -> None:
    # A link at path is replaced, never written through; an error leaves no temporary behind.
    write_atomic(path, json.dumps(obj, indent=1) + "\n")


def _apply_delta(state: dict[str, torch.Tensor], path: Path) -> None:
    """Fold ``delta.safetensors`` at ``path`` into ``state`` in place.

    Raises:
        CheckpointError: the file cannot be read, or its keys do not fit ``state``.
    """
    try:
        delta = load_file(str(path))
    except (SafetensorError, OSError) as err:
        raise CheckpointError(f"{path}: cannot be read ({err}); {RESUME_FIX}") from None
    covered = set()
    for key, value in delta.items():
        kind, _, name = key.partition("/")
        if name not in state or kind not in ("state", "ids", "rows"):
            raise CheckpointError(f"{path}: tensor {key} fits no tensor of the model; {RESUME_FIX}")
        covered.add(name)
        if kind == "state":
            state[name] = value
        elif kind == "ids":
            rows = delta.get(f"rows/{name}")
            if rows is None or len(rows) != len(value) or rows.shape[1:] != state[name].shape[1:]:
                raise CheckpointError(f"{path}: the rows of {name} do not fit its ids or table; {RESUME_FIX}")
            state[name][value] = rows
    if covered != set(state):
        raise CheckpointError(f"{path}: holds nothing for {sorted(set(state) - covered)[:5]}; {RESUME_FIX}")


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
    chain = version_chain(publish_dir, read_manifest(publish_dir), version)
    dirs = [checked_version_dir(publish_dir, e) for e in chain]
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
    chain = version_chain(publish_dir, read_manifest(publish_dir), to_version)
    numbers = [e["version"] for e in chain]
    if from_version not in numbers:  # another chain since (or an older version): fold it whole
        return load_published(publish_dir, numbers[-1])
    dirs = [checked_version_dir(publish_dir, e) for e in chain[numbers.index(from_version) + 1 :]]
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


def _remove_leftovers(publish_dir: Path) -> None:
    """Remove what a publish killed mid-write left: its version's ``.tmp-v00000k-<pid>``
    directory and a ``.manifest.json.tmp-<pid>`` file (the caller holds the directory)."""
    for tmp in [*publish_dir.glob(".tmp-*"), *publish_dir.glob(f".{MANIFEST}.*tmp*")]:
        if tmp.is_dir() and not tmp.is_symlink():
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            tmp.unlink(missing_ok=True)
        log.warning("publish: removed %s, left by a publish that was interrupted", tmp)


def _write_failed(err: Exception) -> bool:
    """Whether ``err`` is a write the file system refused (full, read-only, a file-size limit):
    an OSError, or how safetensors (``SafetensorError``: "I/O error: No space left on device (os
    error 28)") and torch's TorchScript writer ("unexpected pos", "file write failed") report one."""
    text = str(err)
    return isinstance(err, (OSError, SafetensorError)) or (
        isinstance(err, RuntimeError) and ("unexpected pos" in text or "file write failed" in text)
    )


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


class Publisher:
    """Publishes the checkpoints of a run into ``publish_dir`` (module docstring): a full version
    first, then a delta per checkpoint, against the last published state held in memory.

    With ``publish.full_every: N`` every (N+1)-th version of a chain is full again (compaction),
    so a fresh load folds at most N deltas.

    On construction an existing directory is taken up: numbering continues, and versions of a
    step after ``resume_step`` (the step the run resumes from: it will train them again) are
    moved to ``DIR/dropped/`` with a warning once the next version is published, as are versions
    a killed publish left out of the manifest; after such a drop the next version is a full one.
    Likewise when the newest versions cannot be loaded (a damaged or missing file, a gap): the
    publisher goes on from the newest intact one (:func:`newest_intact`), publishes a full
    version next and drops the damaged ones once it is published; and when ``manifest.json``
    itself is damaged: it is rebuilt from the version directories (``publish_dir.read_listing``)
    and the next version is a full one. Numbers always grow (after every version ever
    published), so a server following the directory never goes back.
    What a killed publish left (``.tmp-*``) is removed. ``version``: the newest intact
    published version (None before the first). ``lock``: hold ``DIR/.lock`` while it lives
    (``PublishCallback`` does: one run at a time publishes into a directory). ``new_run``: the
    run starts from scratch (resumes no checkpoint): a directory holding versions is refused
    unless ``publish.overwrite``. ``run_dir``: the run's directory, recorded in the manifest; a
    resumed run (not ``new_run``) finding another run's versions is refused unless
    ``publish.overwrite`` (``publish_dir.check_owner``), which takes them over as a new run does.

    Raises:
        CheckpointError: with ``lock``, another process holding the directory; with
            ``new_run``, a directory holding versions; with ``run_dir``, another run's directory.
    """

    def __init__(
        self,
        publish_dir: Path,
        cfg: PublishConfig,
        resume_step: int | None = None,
        lock: bool = False,
        new_run: bool = False,
        run_dir: str | Path | None = None,
    ):
        self.dir = Path(publish_dir)
        self.cfg = cfg
        self.dir.mkdir(parents=True, exist_ok=True)
        self._lock = lock_dir(self.dir) if lock else None
        if new_run:
            check_new_run(self.dir, cfg)
        manifest, bad = read_listing(self.dir)  # bad: None, or the manifest was rebuilt (why dirs were left out)
        foreign = not new_run and run_dir is not None and check_owner(self.dir, cfg, run_dir, manifest)
        self._owner = str(Path(run_dir).resolve()) if run_dir is not None else publishing_run(self.dir, manifest)
        self._versions: list[dict] = list(manifest["versions"]) if manifest else []
        self._dropped: list[dict] = list(manifest.get("dropped", [])) if manifest else []
        self._why: dict[int, str] = {}  # version -> why it moves to dropped/ once the next version is published
        for e in self._versions:
            if foreign:
                self._why[e["version"]] = "another run's version, taken over (publish.overwrite)"
            elif resume_step is not None and e["step"] > resume_step:
                self._why[e["version"]] = f"its step {e['step']} was trained again after the resume from {resume_step}"
        drop = [e for e in self._versions if e["version"] in self._why]
        listed = {e["dir"] for e in self._versions}
        orphans = sorted(p.name for p in self.dir.glob("v*") if p.is_dir() and p.name not in listed)
        _remove_leftovers(self.dir)
        self._force_full = bool(drop or orphans or bad is not None)
        for name in orphans:
            self._move_aside(
                name, (bad or {}).get(name, f"not in {MANIFEST} (a publish interrupted before its manifest)")
            )
            if name[1:].isdigit():
                self._dropped.append({"version": int(name[1:]), "step": None})
        numbers = [e["version"] for e in self._versions + self._dropped]
        self._next = max(numbers, default=0) + 1
        self._warn_drop(drop, "are another run's" if foreign else f"are after the resumed step {resume_step}")
        if (orphans and manifest is not None) or bad is not None:
            self._write_manifest()
        self._state: dict | None = None
        self._float_model = None  # publish(state=...): the unsharded model the state is loaded into
        self.version: int | None = None
        damaged = self._take_up([e for e in self._versions if e not in drop])
        self._pending_drop = [e for e in self._versions if e in drop or e in damaged]

    def _take_up(self, kept: list[dict]) -> list[dict]:
        """Set ``version`` to the newest intact of ``kept`` (and, to publish a delta next, the
        published state it folds to); return the kept versions newer than it, which cannot be
        loaded (then the next version is a full one)."""
        if not kept:
            return []
        newest = kept[-1]["version"]
        failed = None
        if not self._force_full:
            try:
                m, _ = load_published(self.dir, newest)
                self._state = published_state(m.model, clone=False)  # m is this state's only user
                self.version = newest
                return []
            except CheckpointError as err:
                failed = str(err)
        # Checksums only (no model is built): the newest itself too, unless its load just failed.
        candidates = [e["version"] for e in kept if failed is None or e["version"] != newest]
        intact, broken = newest_intact(self.dir, among=candidates)
        if failed is not None:
            broken[newest] = failed
        self.version = intact
        damaged = [e for e in kept if intact is None or e["version"] > intact]
        if damaged:
            self._force_full = True
            base = f"version {intact} (step {self.step}), the newest intact one" if intact else "no intact version"
            log.warning(
                "publish: version(s) %s in %s cannot be loaded (%s); publishing goes on from %s: the next version "
                "is a full one, numbered %d, and the damaged ones move to %s/ once it is published",
                ", ".join(str(e["version"]) for e in damaged),
                self.dir,
                str(broken.get(newest, next(iter(broken.values()), "")))[:500],
                base,
                self._next,
                DROPPED_DIR,
            )
        for e in damaged:
            self._why.setdefault(e["version"], "it could not be loaded")
        return damaged

    def _warn_drop(self, drop: list[dict], why: str) -> None:
        """Say which listed versions this run replaces (``why``: "are after the resumed step 4")."""
        if not drop:
            return
        missing = [e["dir"] for e in drop if not (self.dir / e["dir"]).is_dir()]
        log.warning(
            "publish: version(s) %s in %s %s; they stay listed (a server keeps what it serves) until this run's "
            "next version, a full one numbered %d, replaces them, then move to %s/%s",
            ", ".join(f"{e['version']} (step {e['step']})" for e in drop),
            self.dir,
            why,
            self._next,
            DROPPED_DIR,
            f" ({', '.join(missing)}: missing already, so not loadable)" if missing else "",
        )

    @property
    def step(self) -> int | None:
        """The training step of the newest published version (None before the first)."""
        return next((e["step"] for e in self._versions if e["version"] == self.version), None)

    def _move_aside(self, name: str, why: str) -> None:
        if not (self.dir / name).exists():  # a version directory deleted by hand: nothing to move
            log.warning("publish: %s is no longer listed (%s); it was missing already", self.dir / name, why)
            return
        target = self.dir / DROPPED_DIR / f"{name}-{int(time.time())}"
        target.parent.mkdir(exist_ok=True)
        os.replace(self.dir / name, target)
        log.warning("publish: moved %s to %s: %s", self.dir / name, target, why)

    def _write_manifest(self, versions: list[dict] | None = None, dropped: list[dict] | None = None) -> None:
        versions = self._versions if versions is None else versions
        _write_json_atomic(
            self.dir / MANIFEST,
            {
                "format_version": FORMAT_VERSION,
                "latest": versions[-1]["version"] if versions else None,
                "versions": versions,
                "dropped": self._dropped if dropped is None else dropped,
                "run_dir": self._owner,  # whose directory it is (publish_dir.check_owner)
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

    def publish(self, checkpoint: Path, state: dict[str, torch.Tensor] | None = None) -> Path:
        """Publish ``checkpoint`` (a checkpoint directory, or a run directory: its newest one) as
        the next version: full for the first (or after a drop, when the tables changed shape or
        quantization, or after ``publish.full_every`` deltas), a delta afterwards. Returns the version's directory.

        ``state``: the checkpoint's model weights as the training ranks hold them in memory
        (unsharded: ``recsys_dist.checkpoint.gather.gather_full_state``, what
        ``PublishCallback`` passes); then the checkpoint's tensors are not read back (only its
        ``meta.json`` and preprocessing record), and the unsharded model is built once per
        Publisher. The version is the same, bit for bit.

        Raises:
            CheckpointError: the checkpoint cannot be loaded (``serve.export.load``); the version
                cannot be written (a full disk, too little free space for its estimated size, a
                read-only directory: the message names the directory, the bytes needed and what
                is still the latest; nothing of the version is left behind).
        """
        checkpoint = Path(checkpoint)
        ckpt = checkpoint if is_complete(checkpoint) else latest_checkpoint(checkpoint)
        m = self._model(ckpt if ckpt is not None else checkpoint, state)
        step = int(read_meta(ckpt)["step"])
        if self.cfg.quantize != "none":  # in place: on a copy of the model this Publisher keeps
            model = copy.deepcopy(m.model) if state is not None else m.model
            m = dataclasses.replace(m, model=quantize_model(model, self.cfg.quantize))
        state = published_state(m.model)
        number = self._next
        name = version_dir(number)
        full = self._state is None or self._force_full or self.version != number - 1
        full = full or not _same_layout(self._state, state) or self._compact()
        info = {"format_version": FORMAT_VERSION, "version": number, "kind": "full" if full else "delta"}
        info.update(base=None if full else self.version, step=step, checkpoint=str(ckpt))
        info.update(quantize=self.cfg.quantize, format=self.cfg.format, created=time.time())
        delta = None if full else _delta(self._state, state, set(table_keys(m.model)))
        tensors = state if full else delta[0]
        need = sum(t.numel() * t.element_size() for t in tensors.values()) * (
            2 if full and self.cfg.format == "torchscript" else 1
        )
        try:
            self._write_version(m, ckpt, info, delta, need)
            entry = {k: info[k] for k in ("version", "kind", "step", "base", "quantize", "format")}
            drop = self._pending_drop
            versions = [e for e in self._versions if e not in drop] + [{**entry, "dir": name}]
            dropped = self._dropped + [{"version": e["version"], "step": e["step"]} for e in drop]
            self._write_manifest(versions, dropped)
        except Exception as err:
            shutil.rmtree(self.dir / name, ignore_errors=True)  # written, never listed: no reader saw it
            if not _write_failed(err):
                raise
            failure = CheckpointError(self._not_written(number, step, need, err))
            failure.resumable = True  # the checkpoint is kept: a resume publishes it (PublishCallback)
            raise failure from None
        self._versions, self._dropped, self._pending_drop = versions, dropped, []
        self.version, self._next, self._state, self._force_full = number, number + 1, state, False
        for e in drop:  # no longer listed: moved aside only now
            self._move_aside(e["dir"], f"replaced by version {number} ({self._why.get(e['version'], 'damaged')})")
        log.info("publish: version %d (%s, step %d) in %s", number, info["kind"], step, self.dir / name)
        return self.dir / name

    def _model(self, ckpt: Path, state: dict[str, torch.Tensor] | None) -> LoadedModel:
        """The float model to publish: ``ckpt`` loaded (``serve.export.load``), or ``state``
        loaded into this Publisher's unsharded model of ``ckpt``'s config (built on first use)."""
        if state is None:
            return load(ckpt)
        m = with_state(ckpt, state, self._float_model)
        self._float_model = m.model
        return m

    def _write_version(self, m: LoadedModel, ckpt: Path, info: dict, delta, need: int) -> None:
        """Write version ``info["version"]`` into ``DIR/.tmp-v00000k-<pid>``, then rename it into
        place; on any failure the temporary directory is removed. ``delta``: (tensors, rows per
        table), None for a full version; ``need``: its estimated bytes.

        Raises:
            OSError: the disk has less than ``need`` (+5 %) free; OSError / SafetensorError /
                RuntimeError: the write failed (:func:`_write_failed`).
        """
        name = version_dir(info["version"])
        tmp = self.dir / f".tmp-{name}-{os.getpid()}"
        fresh_dir(tmp)  # new and empty: a link planted at this name is removed, never written through
        try:
            free = shutil.disk_usage(self.dir).free
            if free < need * 1.05:
                raise OSError(errno.ENOSPC, "not enough free space for this version", str(self.dir))
            if delta is None:
                written = write_export(m, tmp, self.cfg.format, ckpt)
            else:
                write_atomic(tmp / DELTA_FILE, lambda p: save_file(delta[0], str(p)))  # mode as a plain open's
                written, info["rows"] = [tmp / DELTA_FILE], delta[1]
            maybe_fault("publish_full", info["step"], 0)
            info["files"] = {p.relative_to(tmp).as_posix(): file_sha256(p) for p in written}
            _write_json_atomic(tmp / VERSION_FILE, info)
            os.replace(tmp, self.dir / name)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)  # gone by the rename, or the space of a failed write given back

    def _not_written(self, number: int, step: int, need: int, err: Exception) -> str:
        try:
            free = f", {_mib(shutil.disk_usage(self.dir).free)} free there"
        except OSError:
            free = ""
        latest = (
            f"version {self._versions[-1]['version']} is still the latest published"
            if self._versions
            else "nothing is published there yet"
        )
        return (
            f"publish: version {number} (the checkpoint of step {step}) could not be written to {self.dir} "
            f"({describe_error(err)}; it needs about {_mib(need)}{free}). Nothing of it was left there, and "
            f"{latest}; free space there, or set publish.dir to a directory on another disk"
        )
