"""``recsys-dist serve``: an HTTP scoring server (starlette) that reloads its model while serving.

Endpoints (``create_app``):

- ``POST /score`` with ``{"rows": [row, ...]}`` (``recsys_dist.serve.request_rows``) ->
  ``{"scores": [...], "logits": [...], "version": V, "model": SOURCE}``; a malformed body or
  row -> 400 ``{"error": MESSAGE}`` naming the row and column; past the server's limits
  (``recsys_dist.serve.limits``) 408, 413 or 503 with ``Retry-After`` (``recsys_dist.serve.score_request``).
- ``GET /health`` -> ``{"status": "ok", "version": V, "source": SOURCE, "loaded_at": ISO-8601 UTC,
  "scoring": "in-memory" | "file", "latest": N | null, "stuck": null | {"version", "error", "since"}}``
  (how its requests are converted: ``recsys_dist.serve.inmemory``; a publish directory's newest
  version, and why it is not the one served: :attr:`ModelHolder.stuck`).
- While a waiting source (``serve --wait``, :class:`WaitingSource`) holds no model yet: ``GET
  /health`` -> 503 ``{"status": "waiting", "source": DIR, "version": null}`` and ``POST /score``
  -> 503 ``{"error": "no model yet: waiting for DIR to hold ..."}``; the reload thread loads
  the model as soon as DIR holds an export or a publish, and serves it from then on.

The model comes from a source (:func:`open_source`): an export directory (``model.safetensors``)
or a publish directory (``manifest.json``, ``recsys_dist.serve.publish``). A :class:`ModelHolder`
keeps the model being served as one reference to an immutable :class:`Served`. Its reload
thread polls the source every ``reload_seconds``; when the source changed (an export's files
replaced: another inode, mtime or size; a publish's ``latest`` version) it loads the new model
completely, off the request path (a publish's: only the new deltas, folded into a copy of the
served model), then swaps the reference. A request reads the reference
once, so it is scored entirely by one model and answers with that model's version; requests
in flight when a swap happens finish on the old one. A load that fails (a damaged or half
written file) is logged as a warning and the old model keeps serving; the same files are not
tried again until they change. A publish directory whose latest version cannot be loaded is
served at its newest intact version newer than the one served (also at start), with a warning;
one whose manifest cannot be read (damaged) keeps its model, and says so once in the log and
in ``/health``'s ``stuck`` until the manifest is readable again.
"""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from recsys_dist.errors import CheckpointError, ConfigError
from recsys_dist.serve import publish
from recsys_dist.serve.export import MODEL_FILE, LoadedModel, load
from recsys_dist.serve.inmemory import row_scorer
from recsys_dist.serve.limits import InFlight, Limits
from recsys_dist.serve.score_inputs import PREPROCESSING_FILE, VOCABULARY_FILE
from recsys_dist.serve.score_request import score_request

log = logging.getLogger("recsys_dist.serve")

PUBLISH_MANIFEST = publish.MANIFEST


class ExportSource:
    """An export directory; its version counts the models loaded from it (1, 2, ...)."""

    def __init__(self, path: Path) -> None:
        self.path, self.loads = path, 0

    def describe(self) -> str:
        return f"export {self.path}"

    def token(self):
        """What identifies the files now: (inode, mtime ns, size) of each file of the export
        (None for an absent one). Replacing a file by rename changes its inode."""
        out = []
        for name in (MODEL_FILE, "config.yaml", PREPROCESSING_FILE, VOCABULARY_FILE):
            try:
                st = os.stat(self.path / name)
                out.append((st.st_ino, st.st_mtime_ns, st.st_size))
            except FileNotFoundError:
                out.append(None)
        return tuple(out)

    def load(self, token) -> tuple[LoadedModel, int]:
        loaded = load(self.path)
        self.loads += 1
        return loaded, self.loads


class PublishSource:
    """A publish directory (``manifest.json`` names the ``latest`` version); its version is
    the published version number. Reads it through ``recsys_dist.serve.publish``
    (``latest_version``, ``load_published``, ``apply_versions``): the first load folds the
    full version and its deltas; a reload applies only the deltas after the version it last
    loaded, to a copy of that model (a full fold when a new full version started another
    chain: a compaction, a drop, a quantize change). ``api``: that module, or a stand-in with its
    ``latest_version`` and ``load_published`` (tests). ``version``: serve that version only
    (``serve --version N``), never another."""

    def __init__(self, path: Path, api=publish, version: int | None = None) -> None:
        self.path, self.api, self.pinned = path, api, version
        self._last: tuple[LoadedModel, int] | None = None  # the model this source last loaded, its version

    def describe(self) -> str:
        return f"publish {self.path}"

    def token(self):
        return self.pinned if self.pinned is not None else self.api.latest_version(self.path)

    def load(self, token) -> tuple[LoadedModel, int]:
        apply = getattr(self.api, "apply_versions", None)  # an api without it (a stand-in) folds whole
        if self._last is None or apply is None:
            self._last = self.api.load_published(self.path, version=token)
        else:
            self._last = apply(self._last[0], self.path, self._last[1], token)
        return self._last

    def fallback(self, token, served: int | None) -> tuple[LoadedModel, int] | None:
        """When ``token`` (the latest version) failed to load: the newest intact version under it
        and newer than ``served`` (a server never goes back), loaded; None when there is none
        (or the version is pinned)."""
        find = getattr(self.api, "newest_intact", None)
        if self.pinned is not None or find is None:
            return None
        version, _ = find(self.path, below=token)
        if version is None or (served is not None and version <= served):
            return None
        return self.load(version)

    def fingerprint(self, token):
        """The state of ``token``'s files (``publish.chain_files_state``): a failed version is
        tried again once it changes (repaired)."""
        state = getattr(self.api, "chain_files_state", None)
        return state(self.path, token) if state is not None and token is not None else None


def _no_model_fix(path: Path) -> str:
    if (path / "checkpoints").is_dir():  # a run directory: its export or its publish directory is served
        return (
            f"{path} is a training run's directory: serve its publish directory ({path / 'publish'}, with "
            f"publish.enabled), or export it first: recsys-dist export {path} --out DIR, then serve DIR"
        )
    return (
        f"export a run first (recsys-dist export RUN --out {path}), or, for the publish directory of a "
        "training run that has not published yet, add --wait to serve its model once it appears"
    )


def open_source(path: str | Path, wait: bool = False, version: int | None = None):
    """The model source at ``path``: :class:`PublishSource` for a directory holding
    ``manifest.json``, :class:`ExportSource` for one holding ``model.safetensors``; with
    ``wait``, a :class:`WaitingSource` that also accepts a directory holding neither yet (or
    not existing yet) and becomes one of the two when its model appears. ``version``: that
    published version only (a publish directory, not with ``wait``).

    Raises:
        ConfigError: ``path`` is a file; without ``wait``, a directory holding neither (or none
            at all); ``version`` with ``wait`` or for an export directory.
    """
    if version is not None and wait:
        raise ConfigError(f"--version {version} serves a version already published; it does not go with --wait")
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise ConfigError(
            f"serve {path}: is a file; give an export directory (recsys-dist export RUN --out DIR) or a "
            "publish directory"
        )
    if wait:
        return WaitingSource(path)
    if not path.is_dir():
        raise ConfigError(f"serve {path}: does not exist; {_no_model_fix(path)}")
    if (path / PUBLISH_MANIFEST).is_file():
        return PublishSource(path, version=version)
    if (path / MODEL_FILE).is_file():
        if version is not None:
            raise ConfigError(
                f"--version {version}: {path} is an export directory (one model); --version picks a version of a "
                "publish directory"
            )
        return ExportSource(path)
    raise ConfigError(
        f"serve {path}: neither an export directory ({MODEL_FILE}) nor a publish directory ({PUBLISH_MANIFEST}); "
        + _no_model_fix(path)
    )


class WaitingSource:
    """A directory that may hold no model yet (``serve --wait``): ``token()`` is None until it
    holds ``manifest.json`` or ``model.safetensors``; then the kind is decided once
    (:func:`open_source`: a manifest makes it a publish directory) and this source reads
    through that one (``inner``) from then on."""

    def __init__(self, path: Path) -> None:
        self.path, self.inner = path, None

    def describe(self) -> str:
        return self.inner.describe() if self.inner is not None else str(self.path)

    def waiting_for(self) -> str:
        return f"waiting for {self.path} to hold an export or a publish ({PUBLISH_MANIFEST})"

    def token(self):
        if self.inner is None:
            if not ((self.path / PUBLISH_MANIFEST).is_file() or (self.path / MODEL_FILE).is_file()):
                return None
            self.inner = open_source(self.path)
        return self.inner.token()

    def load(self, token) -> tuple[LoadedModel, int]:
        return self.inner.load(token)

    def fallback(self, token, served: int | None):
        fallback = getattr(self.inner, "fallback", None)
        return fallback(token, served) if fallback is not None else None

    def fingerprint(self, token):
        fingerprint = getattr(self.inner, "fingerprint", None)
        return fingerprint(token) if fingerprint is not None else None


@dataclass(frozen=True)
class Served:
    """One loaded model as served: never changed, only replaced. ``scorer``: how its requests
    are scored, chosen once at load (``recsys_dist.serve.inmemory.row_scorer``: in memory, or
    through files for a model the in-memory route does not cover)."""

    loaded: LoadedModel
    version: int
    token: object
    loaded_at: str = field(default_factory=lambda: datetime.now(UTC).isoformat(timespec="seconds"))
    scorer: object = None

    @classmethod
    def of(cls, loaded: LoadedModel, version: int, token) -> Served:
        return cls(loaded, version, token, scorer=row_scorer(loaded))


class ModelHolder:
    """The model being served (``current``: a :class:`Served`, or None while a
    :class:`WaitingSource` holds no model yet) and the thread that reloads it from ``source``.

    The first load happens in the constructor (its errors propagate: nothing to serve), unless
    the source is a waiting one with no model yet: then the first ``poll()`` that finds one
    loads it. A publish directory whose latest version cannot be loaded (a damaged or missing
    file, a gap in its chain) is served at its newest intact version instead, with a warning
    (never one older than the version served). ``poll()`` checks the source once (the reload
    thread calls it every ``reload_seconds``); ``start()`` / ``stop()`` run and end that thread.

    Attributes:
        latest: the newest version the source holds as last seen (a publish directory's
            ``latest``; None for an export directory).
        stuck: None, or why the source's newest model is not the one served: ``{"version": the
            version that failed to load (None for an export, or when the source itself cannot
            be read: a damaged ``manifest.json``), "error": its message, "since": ISO-8601 UTC
            of the first failure}``. A failed version is tried again when its files change (a
            repair) or a newer one appears.
    """

    def __init__(self, source, reload_seconds: float = 2.0) -> None:
        self.source, self.reload_seconds = source, reload_seconds
        self.current: Served | None = None
        self.latest: int | None = None
        self.stuck: dict | None = None
        self._failed = None  # (token, its files' state) whose load failed: not tried again until either changes
        self._unreadable: str | None = None  # why the source cannot be read now (logged once)
        self._stuck_before: dict | None = None  # what stuck said before the source became unreadable
        token = source.token()
        if token is not None or not isinstance(source, WaitingSource):
            self.latest = _version(token)
            try:
                loaded, version = source.load(token)
            except CheckpointError as err:  # a damaged latest version: its newest intact one, if any
                if not self._fall_back(token, err):
                    raise
            else:
                self.current = Served.of(loaded, version, token)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def describe(self) -> str:
        """What is served, for people: ``"publish DIR version 6 (in-memory scoring)"``, or
        ``"no model yet, waiting for DIR ..."``."""
        if self.current is None:
            return f"no model yet, {self.source.waiting_for()}"
        return f"{self.source.describe()} version {self.current.version} ({self.current.scorer.kind} scoring)"

    def poll(self) -> bool:
        """Load the source's model if it changed since the one served; whether it swapped.
        A failed load is logged and leaves the served model (or none, while waiting) as it is,
        or, for a publish directory, moves on to a newer intact version than the one served.
        A source that cannot be read (a damaged manifest) keeps the served model: said once."""
        try:
            token = self.source.token()
        except Exception as err:  # noqa: BLE001 - whatever the source's failure, what is served stays
            self._source_unreadable(err)
            return False
        if self._unreadable is not None:  # readable again
            log.warning("recsys-dist serve: %s can be read again", self.source.describe())
            self._unreadable, self.stuck = None, self._stuck_before
        served = self.current
        if token is None or (served is not None and token == served.token):
            return False
        self.latest = _version(token)
        if served is not None and type(token) is int and token < served.version:  # e.g. a manifest rebuilt by hand
            self._older(token, served.version)
            return False
        if self._failed is not None and self._failed == (token, self._fingerprint(token)):
            return False
        try:
            loaded, version = self.source.load(token)
        except Exception as err:  # noqa: BLE001 - any failure keeps the old model serving
            if self._fall_back(token, err):
                return True
            log.warning(
                "recsys-dist serve: %s %s failed, %s: %s",
                "loading" if served is None else "reloading",
                self.source.describe(),
                "still waiting for a model" if served is None else f"still serving version {served.version}",
                str(err)[:500],
            )
            return False
        self.current = Served.of(loaded, version, token)  # one reference: requests in flight keep theirs
        self._failed = self.stuck = None
        log.warning("recsys-dist serve: now serving %s", self.describe())
        return True

    def _source_unreadable(self, err: Exception) -> None:
        """Note that the source cannot be read (``stuck``, version None); logged once per error,
        not at every reload tick."""
        text = str(err)[:500]
        if self._unreadable is None:
            self._stuck_before = self.stuck
            self.stuck = {"version": None, "error": text, "since": datetime.now(UTC).isoformat(timespec="seconds")}
        if text != self._unreadable:
            served = self.current
            log.warning(
                "recsys-dist serve: %s cannot be read, %s (said once; checked again every %g s): %s",
                self.source.describe(),
                "still waiting for a model" if served is None else f"still serving version {served.version}",
                self.reload_seconds,
                text,
            )
            self.stuck = {**self.stuck, "error": text}
        self._unreadable = text

    def _older(self, token: int, served: int) -> None:
        """The latest version listed is older than the one served: never loaded (a server never
        goes back); said once (``stuck``)."""
        if self._failed == (token, "older"):
            return
        self._failed = (token, "older")
        text = (
            f"the latest version listed, {token}, is older than version {served}, which is served; a server never "
            f"goes back (restart it to serve version {token}), and serves the next version published"
        )
        self.stuck = {"version": token, "error": text, "since": datetime.now(UTC).isoformat(timespec="seconds")}
        log.warning("recsys-dist serve: %s: %s", self.source.describe(), text)

    def _fingerprint(self, token):
        fingerprint = getattr(self.source, "fingerprint", None)
        return fingerprint(token) if fingerprint is not None else None

    def _fall_back(self, token, err: Exception) -> bool:
        """After ``token`` failed to load with ``err``: note it (``stuck``; not tried again until
        its files change) and serve the source's newest intact version if it is newer than the
        one served (a publish directory). Whether it swapped."""
        self._failed = (token, self._fingerprint(token))
        since = self.stuck["since"] if self.stuck else datetime.now(UTC).isoformat(timespec="seconds")
        self.stuck = {"version": _version(token), "error": str(err)[:500], "since": since}
        fallback = getattr(self.source, "fallback", None)
        served = self.current
        try:
            got = fallback(token, served.version if served else None) if fallback is not None else None
        except Exception as other:  # noqa: BLE001 - nothing intact newer: keep what is served
            log.warning(
                "recsys-dist serve: looking for an intact version of %s failed: %s", self.source.describe(), other
            )
            got = None
        if got is None:
            return False
        loaded, version = got
        self.current = Served.of(loaded, version, version)  # its token is not the latest: that stays failed
        log.warning(
            "recsys-dist serve: %s version %s cannot be loaded (%s); now serving version %d, the newest intact one "
            "(version %s is tried again once its files change, and a newer version is taken when it appears)",
            self.source.describe(),
            token,
            str(err)[:500],
            version,
            token,
        )
        return True

    def _run(self) -> None:
        while not self._stop.wait(self.reload_seconds):
            try:
                self.poll()
            except Exception as err:  # noqa: BLE001 - the thread must outlive a bad poll (e.g. a stat error)
                log.warning("recsys-dist serve: checking %s failed: %s", self.source.describe(), err)

    def start(self) -> None:
        if self._thread is None and self.reload_seconds > 0:
            self._thread = threading.Thread(target=self._run, name="recsys-serve-reload", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
            self._thread = None


def _version(token) -> int | None:
    """A publish directory's token is its latest version number; an export's is file stats."""
    return token if type(token) is int else None


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": message}, status_code=status)


def create_app(holder: ModelHolder, limits: Limits | None = None) -> Starlette:
    """The starlette application serving ``holder``'s model (see the module doc); its reload
    thread runs while the application runs (lifespan). ``limits``: what it takes on at once
    (``recsys_dist.serve.limits``; default ``Limits()``), its memory budget kept in
    ``app.state.in_flight``."""
    limits = limits or Limits()
    in_flight = InFlight(limits.memory_bytes, limits.retry_after)

    async def score(request: Request) -> Response:
        served = holder.current  # read once: the whole request is scored by this model
        if served is None:
            return _error(503, f"no model yet: {holder.source.waiting_for()}")
        return await score_request(request, served, limits, in_flight)

    async def health(request: Request) -> JSONResponse:
        served = holder.current
        if served is None:
            return JSONResponse(
                {"status": "waiting", "source": holder.source.describe(), "version": None}, status_code=503
            )
        return JSONResponse(
            {
                "status": "ok",
                "version": served.version,
                "source": served.loaded.source,
                "loaded_at": served.loaded_at,
                "scoring": served.scorer.kind,
                "latest": holder.latest,  # a publish's newest version: a reload may be stuck below it
                "stuck": holder.stuck,  # why the newest is not served (null: it is)
            }
        )

    def lifespan(app):
        return _Lifespan(holder)

    app = Starlette(routes=[Route("/score", score, methods=["POST"]), Route("/health", health)], lifespan=lifespan)
    app.state.limits, app.state.in_flight = limits, in_flight
    return app


class _Lifespan:
    """Runs the holder's reload thread for as long as the application runs."""

    def __init__(self, holder: ModelHolder) -> None:
        self.holder = holder

    async def __aenter__(self):
        self.holder.start()

    async def __aexit__(self, *exc):
        self.holder.stop()
