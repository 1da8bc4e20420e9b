"""Taking up a publish directory (the format: ``recsys_dist.serve.publish``) before a run
publishes into it: whose it is, and what it lists.

- A publish directory belongs to one run: ``manifest.json`` records its run directory
  (``run_dir``; for a manifest from before, the run of its newest version's checkpoint). A run
  from scratch finding versions there (:func:`check_new_run`), or a resumed run finding another
  run's (:func:`check_owner`: its ``publish.dir`` was changed to that directory), is refused
  unless ``publish.overwrite``, which takes the directory over.
- A damaged ``manifest.json`` is rebuilt from the version directories (each ``v*/version.json``;
  a version whose files are damaged is found out when loaded, as always): :func:`read_listing`
  for a Publisher, :func:`repair_manifest` by hand.
- One process publishes into a directory at a time (:func:`lock_dir`).
- :func:`check_path` refuses, before a run trains, a ``publish.dir`` that cannot be one.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import shutil
import time
from pathlib import Path

from recsys_dist.errors import CheckpointError, UnsafeFile
from recsys_dist.files import open_in_place, refuse_planted, write_atomic
from recsys_dist.serve.publish_manifest import FORMAT_VERSION, MANIFEST, publishing_run, read_manifest, rebuilt_entries
from recsys_dist.train.config import PublishConfig

log = logging.getLogger("recsys_dist")

DROPPED_DIR = "dropped"
LOCK_FILE = ".lock"


def lock_dir(publish_dir: Path):
    """An exclusive lock on ``DIR/.lock`` for as long as the returned file is open (the process
    lives: a killed one releases it).

    Raises:
        CheckpointError: another process holds it (another run publishes into ``publish_dir``).
        UnsafeFile: ``.lock`` is a link, a directory or not a plain file.
    """
    fd = open_in_place(publish_dir / LOCK_FILE, os.O_WRONLY | os.O_APPEND | os.O_CREAT)  # never through a link
    f = os.fdopen(fd, "a")  # noqa: SIM115 - held open for the publisher's life
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.close()
        raise CheckpointError(
            f"{publish_dir}: another process publishes into it now (it holds {publish_dir / LOCK_FILE}); two runs "
            "may not publish into one directory (each would number, drop and overwrite the other's versions): "
            "give this run another publish.dir"
        ) from None
    return f


def check_path(publish_dir: str | Path) -> None:
    """Refuse, before a run trains, a ``publish.dir`` that a publish could not take: a file
    (not a directory), or a directory whose ``.lock`` is a link, a directory or not a plain
    file, or whose ``manifest.json`` is a directory. A missing directory is fine (created).

    Raises:
        CheckpointError: naming the path and the fix.
    """
    d = Path(publish_dir)
    if os.path.lexists(d) and not d.is_dir():
        raise CheckpointError(
            f"publish.dir {d} is a file, not a directory; give publish.dir a directory (created if missing)"
        )
    try:
        refuse_planted(d / LOCK_FILE, in_place=True)
        refuse_planted(d / MANIFEST)
    except UnsafeFile as err:
        raise CheckpointError(f"publish.dir {d}: {err}") from None


def _taken_message(publish_dir: Path, versions: list[dict], orphans: list[str]) -> str:
    held = f"versions {versions[0]['version']}..{versions[-1]['version']}" if versions else f"{', '.join(orphans)}"
    return (
        f"publish.dir {publish_dir} already holds {held} of another run, and this run starts from scratch (it "
        "resumes no checkpoint): publishing there would number after them and move them to "
        f"{DROPPED_DIR}/, under a server that may be following them. Give this run its own publish.dir, or "
        "resume the run that published them (--resume auto --run-dir ITS_RUN_DIR), or set publish.overwrite: "
        f"true to take the directory over (its versions stay served until this run's first version, a full one "
        f"numbered after them, replaces them; then they move to {DROPPED_DIR}/)"
    )


def check_new_run(publish_dir: str | Path, cfg: PublishConfig) -> None:
    """Refuse ``publish_dir`` to a run that starts from scratch when it already holds versions
    (listed in ``manifest.json``, or left unlisted by a killed publish; with a damaged
    manifest, every ``v*`` directory), unless ``publish.overwrite``: they are another run's,
    and publishing there would replace them.

    Raises:
        CheckpointError: such a directory (the message names it and the fixes).
    """
    d = Path(publish_dir)
    if cfg.overwrite or not d.is_dir():
        return
    try:
        versions = read_manifest(d)["versions"] if (d / MANIFEST).is_file() else []
    except CheckpointError:  # damaged: its version directories tell what it holds
        versions = []
    listed = {e["dir"] for e in versions}
    orphans = sorted(p.name for p in d.glob("v*") if p.is_dir() and p.name not in listed)
    if versions or orphans:
        raise CheckpointError(_taken_message(d, versions, orphans))


def _same_run(owner: str, run_dir: str | Path, publish_dir: Path) -> bool:
    """Whether ``owner`` (the run directory a manifest records) is ``run_dir``: the same
    directory, or ``publish_dir`` lies inside ``run_dir`` (a run directory moved or copied
    along with its publish directory stays its owner)."""
    run = Path(run_dir).resolve()
    return Path(owner).resolve() == run or run in publish_dir.resolve().parents


def check_owner(publish_dir: str | Path, cfg: PublishConfig, run_dir: str | Path, manifest: dict | None = None) -> bool:
    """For a resumed run publishing into ``publish_dir``: whether the directory holds versions
    of another run (its ``publish.dir`` was changed to a directory another run publishes into):
    then publishing deltas there would build this run's versions on the other run's. With
    ``publish.overwrite`` it may take the directory over (True: its next version is a full one
    and the other run's versions are dropped once it is published). A directory with no
    versions, or whose run is unknown (nothing records it), is this run's (False).
    ``manifest``: the listing already read (default: read here; a damaged one counts its
    ``v*`` directories).

    Raises:
        CheckpointError: another run's directory without ``publish.overwrite`` (the message
            names both runs and the fixes).
    """
    d = Path(publish_dir)
    if manifest is None:
        if not (d / MANIFEST).is_file():
            return False
        try:
            manifest = read_manifest(d)
        except CheckpointError:
            manifest = None  # damaged: rebuilt by the Publisher; its version directories tell whose it is
    if manifest is not None:
        numbers = [e["version"] for e in manifest["versions"]]
    else:
        numbers = sorted(int(p.name[1:]) for p in d.glob("v*") if p.name[1:].isdigit() and p.is_dir())
    owner = publishing_run(d, manifest)
    if not numbers or owner is None or _same_run(owner, run_dir, d):
        return False
    if cfg.overwrite:
        return True
    raise CheckpointError(
        f"publish.dir {d} holds versions {numbers[0]}..{numbers[-1]} of another run ({owner}), and this run "
        f"({run_dir}) resumes into it: its next version would be a delta on the other run's, a model neither run "
        f"trained. Give this run back the publish.dir it published into (by default RUN_DIR/publish), or another "
        f"one of its own, or set publish.overwrite: true to take the directory over (its versions stay served "
        f"until this run's next version, a full one numbered after them, replaces them; then they move to "
        f"{DROPPED_DIR}/; also when {owner} is this run's directory before it was moved)"
    )


def read_listing(publish_dir: Path) -> tuple[dict | None, dict[str, str] | None]:
    """(the manifest of ``publish_dir``, None): as read; None when there is none. A damaged
    ``manifest.json`` is rebuilt from the version directories (``manifest.rebuilt_entries``),
    with a warning, and a copy of it kept in ``dropped/``: then (the rebuilt manifest, why each
    ``v*`` directory left out cannot be listed). The rebuilt manifest is not written here."""
    path = publish_dir / MANIFEST
    if not path.is_file():
        return None, None
    try:
        return read_manifest(publish_dir), None
    except CheckpointError:
        pass
    versions, bad, dropped = rebuilt_entries(publish_dir)
    (publish_dir / DROPPED_DIR).mkdir(exist_ok=True)
    kept = publish_dir / DROPPED_DIR / f"{MANIFEST}-{int(time.time())}"
    shutil.copyfile(path, kept)
    log.warning(
        "publish: %s is damaged; rebuilt from the version directories' %s: %s listed%s; the damaged file is kept as %s",
        path,
        "version.json",
        f"versions {', '.join(str(e['version']) for e in versions)}" if versions else "no version",
        f", {', '.join(sorted(bad))} left out ({next(iter(bad.values()))[:300]})" if bad else "",
        kept,
    )
    manifest = {
        "format_version": FORMAT_VERSION,
        "latest": versions[-1]["version"] if versions else None,
        "versions": versions,
        "dropped": [{"version": n, "step": None} for n in dropped],
    }
    return manifest, bad


def repair_manifest(publish_dir: str | Path) -> list[int]:
    """Rebuild a damaged ``manifest.json`` of ``publish_dir`` from its version directories
    (:func:`read_listing`) and write it, holding the directory's lock; a readable manifest is
    left as it is. The versions left out stay unlisted (the next run publishing there moves
    them to ``dropped/``). Returns the versions listed. What a resumed run that publishes
    there does by itself (then its next version is a full one).

    Raises:
        CheckpointError: another process publishes there now, or ``publish_dir`` holds no
            manifest at all.
    """
    d = Path(publish_dir)
    if not (d / MANIFEST).is_file():
        read_manifest(d)  # raises, naming it
    with lock_dir(d):
        manifest, bad = read_listing(d)
        if bad is not None:
            owner = publishing_run(d, manifest)
            write_atomic(d / MANIFEST, json.dumps({**manifest, "run_dir": owner}, indent=1) + "\n")
    return [e["version"] for e in manifest["versions"]]
