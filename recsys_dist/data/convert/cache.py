"""The conversion cache: entry names (:func:`cache_key`), one process per entry (a lock file
beside it), and the integrity check of an entry's files against its manifest (sizes always,
checksums once per process tree: ``CHECKED_ENV``)."""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

from recsys_dist.data.convert import manifest
from recsys_dist.data.convert.manifest import (
    MANIFEST_FILE,
    check_cache_format,
    emit_warnings,
    entry_files,
    log,
)
from recsys_dist.data.formats.base import TRANSFORM_VERSION
from recsys_dist.data.splits import Split
from recsys_dist.errors import DataError, UnsafeFile
from recsys_dist.files import open_in_place

# Checked entries of this process and the processes it starts (a training run's ranks): the
# entry's path and a signature of its files' stat (size, mtime, ctime, inode). See open_entry.
CHECKED_ENV = "RECSYS_DIST_CHECKED_CACHE"

try:  # a fast checksum when xxhash is installed, else BLAKE2b (both stream the file)
    import xxhash

    _HASHERS = {"xxh3_64": xxhash.xxh3_64}
except ImportError:  # pragma: no cover - depends on the environment
    _HASHERS = {}
_HASHERS["blake2b"] = lambda: hashlib.blake2b(digest_size=16)
CHECKSUM = next(iter(_HASHERS))


def cache_key(
    raws: list[Path],
    sizes: list[int],
    num_rows: int | None,
    split: Split,
    on_bad_row: str,
    fmt,
    mapping: str,
    min_count: int,
    vocabulary: Path | None,
    row_group_size: int = 65536,
    managed: list[bool] | None = None,
) -> str:
    """The name of a conversion's cache entry: a digest of the raw files (path, size, mtime)
    and every option that changes the converted output. Computing it converts nothing."""
    files = [[str(r.resolve()), r.stat().st_size, r.stat().st_mtime_ns] for r in raws]
    key = json.dumps(
        [
            manifest.CACHE_FORMAT,
            files,
            sizes,
            num_rows,
            split.fingerprint(),
            TRANSFORM_VERSION,
            on_bad_row,
            fmt.fingerprint,
            mapping,
            min_count,
            [str(vocabulary.resolve()), vocabulary.stat().st_mtime_ns] if vocabulary else None,
            row_group_size,
            managed if managed and any(managed) and mapping != "managed" else None,
        ]
    )
    return hashlib.sha256(key.encode()).hexdigest()[:16]


def default_cache_dir() -> Path:
    return Path(os.environ.get("RECSYS_DIST_CACHE", Path.home() / ".cache" / "recsys_dist"))


@contextmanager
def entry_lock(out: Path, raws: list[Path]):
    """Hold the cache entry ``out`` alone: an exclusive ``flock`` on ``<out>.lock`` beside it
    (created if need be, never removed: removing a lock file races with its next user). A
    second process waits here until the first has converted, then reuses its result. The
    lock goes with the process (the kernel drops it when the process dies, however it dies).

    A cache directory where the lock file cannot be created (read only) is used without the
    lock when the entry is complete already."""
    lock_path = out.parent / f"{out.name}.lock"
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        fd = open_in_place(lock_path, os.O_RDWR | os.O_CREAT)  # never through a planted link
    except OSError as err:
        if isinstance(err, UnsafeFile):
            raise DataError(str(err)) from None
        if (out / MANIFEST_FILE).is_file():
            yield
            return
        raise DataError(
            f"{lock_path}: cannot create the cache entry's lock file ({err.strerror}); data.cache_dir "
            "(or $RECSYS_DIST_CACHE) must be a writable directory"
        ) from None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            what = raws[0] if len(raws) == 1 else f"{len(raws)} files"
            log.warning(
                f"another process is converting {what} into {out} (it holds {lock_path}); waiting for it to finish"
            )
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


def _checksums(paths: list[Path], algorithm: str) -> list[str]:
    """The checksum of each file, read in 8 MB pieces (files in parallel: hashing releases the GIL)."""

    def one(path: Path) -> str:
        h = _HASHERS[algorithm]()
        with open(path, "rb") as f:
            while chunk := f.read(8 << 20):
                h.update(chunk)
        return h.hexdigest()

    if len(paths) <= 1:
        return [one(p) for p in paths]
    with ThreadPoolExecutor(min(len(paths), os.cpu_count() or 1)) as pool:
        return list(pool.map(one, paths))


def file_integrity(out: Path, names: list[str]) -> dict:
    """The manifest's ``integrity`` entry: size and checksum of each file of the entry."""
    sums = _checksums([out / n for n in names], CHECKSUM)
    return {
        "algorithm": CHECKSUM,
        "files": {n: {"size": (out / n).stat().st_size, "checksum": c} for n, c in zip(names, sums)},
    }


def entry_signature(out: Path, names: list[str]) -> str:
    """The stat (size, mtime, ctime, inode) of the entry's files and manifest, hashed with the
    entry's path: a file written or replaced since changes it."""
    h = hashlib.blake2b(str(out.resolve()).encode(), digest_size=12)
    for n in [*names, MANIFEST_FILE]:
        st = (out / n).stat()
        h.update(f"{n}:{st.st_size}:{st.st_mtime_ns}:{st.st_ctime_ns}:{st.st_ino};".encode())
    return h.hexdigest()


def _checked_before(signature: str) -> bool:
    return signature in os.environ.get(CHECKED_ENV, "").split(",")


def mark_checked(out: Path, signature: str) -> None:
    """Record in the environment (inherited by the ranks this process starts) that the entry,
    as its files are now, was checked and its warnings shown."""
    seen = [s for s in os.environ.get(CHECKED_ENV, "").split(",") if s and s != signature]
    os.environ[CHECKED_ENV] = ",".join([*seen[-31:], signature])


def _check_entry(out: Path, m: dict, names: list[str], full: bool) -> tuple[str, str] | None:
    """``(file, what is wrong)`` for the first missing or damaged file of the entry, or None.
    Sizes are always compared with the manifest's; checksums when ``full``."""
    for n in names:
        if not (out / n).is_file():
            return n, "the file is missing"
    integrity = m["integrity"]
    for n in names:
        want = integrity["files"].get(n, {}).get("size")
        got = (out / n).stat().st_size
        if want != got:
            return (
                n,
                f"{got:,} bytes where the manifest records {want:,}" if want is not None else "not in the manifest",
            )
    algorithm = integrity.get("algorithm")
    if full and algorithm in _HASHERS:
        for n, c in zip(names, _checksums([out / n for n in names], algorithm)):
            if c != integrity["files"][n].get("checksum"):
                return n, f"its {algorithm} checksum differs from the one recorded when it was written"
    return None


def open_entry(out: Path, raw: Path, warn_one_class: bool) -> dict | None:
    """The manifest of the cache entry ``out`` if the entry is complete and intact, else None
    (no entry, or a damaged one, whose files are then removed so that it is converted again).

    Every file must be there with the size the manifest records. Its checksum is compared too,
    unless this process or the one that started it (a training run's launcher) checked the
    entry already and no file was written since (the files' stat, ``CHECKED_ENV``): so the
    process that opens the cache before any rank starts reads every file once, and the ranks
    after it only compare sizes. A checked entry's warnings are shown again (they were shown by
    the conversion that wrote it)."""
    path = out / MANIFEST_FILE
    if not path.is_file():
        return None
    try:
        m = json.loads(path.read_text())
        if not isinstance(m, dict):  # JSON, but not the object a conversion writes
            raise ValueError(f"a JSON {type(m).__name__}, not an object")
        old = {"format", "rows", "num_embeddings"} <= m.keys() and m.get("cache_format") != manifest.CACHE_FORMAT
        if not old:
            names = entry_files(m)
            m["rows"], m["num_embeddings"], m["integrity"]["files"]  # noqa: B018 - present in every manifest
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
        _discard(out, [], MANIFEST_FILE, f"not a readable manifest ({err})", raw)
        return None
    if old:  # a conversion of another format: refused, not rebuilt over
        check_cache_format(m, out)
    problem = _check_entry(out, m, names, full=False)
    if problem is None:
        signature = entry_signature(out, names)
        if not _checked_before(signature):
            problem = _check_entry(out, m, names, full=True)
            if problem is None:
                emit_warnings(m, warn_one_class)
                mark_checked(out, signature)
    if problem is not None:
        _discard(out, names, *problem, raw)
        return None
    return m


def _discard(out: Path, names: list[str], name: str, why: str, raw: Path) -> None:
    """Remove a damaged entry's manifest (first: the entry is incomplete from then on) and
    files, saying which file was damaged; it is then converted again."""
    log.warning(f"{out / name}: {why}; the cached conversion in {out} is damaged: converting {raw} again")
    try:
        for n in [MANIFEST_FILE, *names]:
            (out / n).unlink(missing_ok=True)
    except OSError as err:
        raise DataError(
            f"{out / name}: {why}, so the cached conversion in {out} is damaged, and it cannot be removed "
            f"({err.strerror}): delete {out} and run again"
        ) from None
