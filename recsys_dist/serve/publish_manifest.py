"""A publish directory's manifest and version directories, read and checked (the format:
``recsys_dist.serve.publish``): which versions it lists, the chain of deltas a version folds,
whether a version's files match their checksums, and its newest intact version; the version
list rebuilt from the version directories when ``manifest.json`` is damaged
(:func:`rebuilt_entries`), and the run that publishes into a directory (:func:`publishing_run`).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from recsys_dist.data.record import file_sha256
from recsys_dist.errors import CheckpointError

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
VERSION_FILE = "version.json"
# How a reader is told to get past a damaged publish: what exists (no "publish again" command does).
RESUME_FIX = (
    "resume the run that publishes there (recsys-dist train ... --resume auto --run-dir RUN): it goes on from the "
    "newest intact version with a full one, numbered after every version"
)


def repair_hint(publish_dir) -> str:
    """How to rebuild a damaged ``manifest.json`` of ``publish_dir`` (a real call, not a command that does not exist)."""
    return (
        f"python -c \"from recsys_dist.serve.publish import repair_manifest; repair_manifest('{publish_dir}')\" "
        "rebuilds it from the version directories (each v*/version.json), as a resumed run that publishes "
        "there does by itself"
    )


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
            f"{path}: damaged or not a manifest of format_version {FORMAT_VERSION}; {repair_hint(publish_dir)}"
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


def version_chain(publish_dir: Path, manifest: dict, version: int | None) -> list[dict]:
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
                f"not published there (a gap in the chain); ask for a version before the gap (--version N of serve "
                f"or export --from-publish), or {RESUME_FIX}"
            )
        chain.append(entries[base])
    return chain[::-1]


def checked_version_dir(publish_dir: Path, entry: dict) -> Path:
    """``DIR/v00000k`` of manifest ``entry``, every file checked against its version.json.

    Raises:
        CheckpointError: the directory or a file is missing, or a file differs from its checksum.
    """
    vdir = publish_dir / entry["dir"]
    earlier = entry["version"] - 1
    fix = (
        f"ask for an earlier version (--version {earlier} of serve or export --from-publish; version={earlier} of "
        f"load_published), or {RESUME_FIX}"
        if earlier >= 1
        else RESUME_FIX
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


def newest_intact(
    publish_dir: str | Path, below: int | None = None, among: list[int] | None = None
) -> tuple[int | None, dict[int, str]]:
    """(the newest published version whose chain is whole and whose files match their
    checksums, or None; for each newer version, why it is not): what a server or an export
    falls back to when the latest version cannot be loaded. ``below``: only versions under it;
    ``among``: only these version numbers (default: every listed one). Each version directory
    is checked at most once (sha256 of its files), newest first, until one chain is intact.

    Raises:
        CheckpointError: no manifest, or a damaged one (as :func:`read_manifest`).
    """
    publish_dir = Path(publish_dir)
    manifest = read_manifest(publish_dir)
    numbers = among if among is not None else [e["version"] for e in manifest["versions"]]
    checked: dict[str, str | None] = {}  # version dir -> why it is damaged (None: intact)
    broken: dict[int, str] = {}
    for version in sorted((v for v in numbers if below is None or v < below), reverse=True):
        try:
            for entry in version_chain(publish_dir, manifest, version):
                if entry["dir"] not in checked:
                    try:
                        checked_version_dir(publish_dir, entry)
                        checked[entry["dir"]] = None
                    except CheckpointError as err:
                        checked[entry["dir"]] = str(err)
                if checked[entry["dir"]] is not None:
                    raise CheckpointError(checked[entry["dir"]])
        except CheckpointError as err:
            broken[version] = str(err)
            continue
        return version, broken
    return None, broken


def chain_files_state(publish_dir: str | Path, version: int) -> tuple:
    """What identifies the files of ``version``'s chain now: (name, inode, mtime ns, size) of
    ``manifest.json`` and of every file in each version directory of the chain. A repair (a
    file copied back, a directory restored) changes it; a server retries a version that
    failed to load only then."""
    publish_dir = Path(publish_dir)
    paths = [publish_dir / MANIFEST]
    try:
        paths += [
            p
            for e in version_chain(publish_dir, read_manifest(publish_dir), version)
            for p in _files(publish_dir / e["dir"])
        ]
    except CheckpointError:
        pass  # a gap or a damaged manifest: the manifest's own state tells a repair
    out = []
    for path in paths:
        try:
            st = path.stat()
            out.append((str(path), st.st_ino, st.st_mtime_ns, st.st_size))
        except OSError:
            out.append((str(path), None))
    return tuple(out)


def _files(directory: Path) -> list[Path]:
    try:
        return sorted(p for p in directory.rglob("*") if p.is_file())
    except OSError:
        return []


def _entry_of(vdir: Path) -> tuple[dict, dict]:
    """(the manifest entry of version directory ``vdir``, its version.json) as its
    ``version.json`` records them.

    Raises:
        CheckpointError: no version.json, or one that is not a version of this directory name.
    """
    try:
        info = json.loads((vdir / VERSION_FILE).read_text())
        entry = {k: info[k] for k in ("version", "kind", "step", "base")}
        entry.update(quantize=info.get("quantize", "none"), format=info.get("format", "safetensors"), dir=vdir.name)
    except (OSError, ValueError, KeyError, TypeError):
        raise CheckpointError(f"{vdir / VERSION_FILE}: missing or not the JSON a publish writes") from None
    if not _entry_ok(entry) or vdir.name != f"v{entry['version']:06d}":
        raise CheckpointError(f"{vdir / VERSION_FILE}: does not describe version {vdir.name}")
    return entry, info


def _version_dirs(publish_dir: Path) -> list[Path]:
    return sorted(p for p in publish_dir.glob("v*") if re.fullmatch(r"v\d+", p.name) and p.is_dir())


def rebuilt_entries(publish_dir: str | Path) -> tuple[list[dict], dict[str, str], list[int]]:
    """What a damaged ``manifest.json`` listed, rebuilt from the directory itself: (the
    manifest entries of each ``v*`` directory whose ``version.json`` is whole and describes
    that directory, in version order; for each other ``v*`` directory, why not; the version
    numbers moved to ``dropped/`` (``v00000k-TIME``), which later versions number after).
    Only ``version.json`` is read: a version whose files are damaged is listed, as the manifest
    listed it, and found out as any damaged version is (:func:`newest_intact`, a server's or
    a Publisher's load), so that the latest version listed never goes back."""
    publish_dir = Path(publish_dir)
    entries, bad = [], {}
    for vdir in _version_dirs(publish_dir):
        try:
            entries.append(_entry_of(vdir)[0])
        except CheckpointError as err:
            bad[vdir.name] = str(err)
    dropped = sorted(
        {int(m.group(1)) for p in (publish_dir / "dropped").glob("v*") if (m := re.match(r"v(\d+)-", p.name))}
    )
    return sorted(entries, key=lambda e: e["version"]), bad, dropped


def publishing_run(publish_dir: str | Path, manifest: dict | None) -> str | None:
    """The run directory that publishes into ``publish_dir``: as ``manifest`` records it
    (``run_dir``), or, for a manifest written before it did (or a damaged one: None), the run
    of its newest version's checkpoint (``version.json``'s ``checkpoint``: ``RUN/checkpoints/step_N``);
    None when unknown."""
    if manifest is not None and manifest.get("run_dir"):
        return str(manifest["run_dir"])
    publish_dir = Path(publish_dir)
    dirs = (
        [publish_dir / e["dir"] for e in manifest["versions"]] if manifest is not None else _version_dirs(publish_dir)
    )
    for vdir in reversed(dirs):
        try:
            checkpoint = Path(_entry_of(vdir)[1]["checkpoint"])
        except (CheckpointError, KeyError, TypeError):
            continue
        if checkpoint.parent.name == "checkpoints":
            return str(checkpoint.parent.parent)
    return None
