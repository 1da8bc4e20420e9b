"""The one place a process group is created, and what every rank learns about itself."""

from __future__ import annotations

import logging
import os
import select
import signal
import sys
import threading
import time
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from recsys_dist.distributed.config import DistributedConfig
from recsys_dist.logs import StderrHandler, dump_stacks_on_sigusr1, quiet_third_party, set_rank


@dataclass(frozen=True)
class DistContext:
    """This rank's place in the job: rank, world size, local rank, device, backend."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    device: torch.device
    backend: str

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def under_launcher() -> bool:
    """True inside a torchrun / torch.distributed.run worker."""
    return "TORCHELASTIC_RUN_ID" in os.environ or ("RANK" in os.environ and "WORLD_SIZE" in os.environ)


def die_with_launcher() -> None:
    """Under an elastic agent (``recsys-dist train``, :func:`recsys_dist.launch`, torchrun):
    make this rank end when the agent's process dies, even by SIGKILL, instead of training on
    for nobody (writing metrics, pruning checkpoints beside an operator's ``--resume``).

    Linux: ``prctl(PR_SET_PDEATHSIG, SIGKILL)`` (the kernel kills this process when its
    parent exits). Everywhere: a daemon thread that checks once a second whether the parent
    process changed (``os.getppid()``: orphans are re-parented) or the launcher named by
    ``$RECSYS_DIST_LAUNCHER_PID`` ended, and then ends this process. The launcher need not be
    the parent: ranks started by a forkserver are its children, and the forkserver outlives a
    killed launcher while the ranks hold its liveness pipe. Idempotent; does nothing outside an
    elastic agent (``$TORCHELASTIC_RUN_ID`` unset).
    """
    global _watching
    dump_stacks_on_sigusr1()
    if _watching or "TORCHELASTIC_RUN_ID" not in os.environ:
        return
    _watching = True
    parent = os.getppid()
    launcher = int(os.environ.get(LAUNCHER_PID_ENV) or parent)
    if launcher != parent and not _alive(launcher):  # the launcher died before we got here
        os.kill(os.getpid(), signal.SIGKILL)
    if sys.platform.startswith("linux"):
        try:
            import ctypes

            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG = 1
        except (OSError, AttributeError):
            pass
    gone = _exit_watch(launcher) if launcher != parent else (lambda: False)

    def watch() -> None:
        while True:
            if os.getppid() != parent or gone():  # the launcher is gone
                os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(1.0)

    threading.Thread(target=watch, name="recsys_dist-launcher-watch", daemon=True).start()


_watching = False
LAUNCHER_PID_ENV = "RECSYS_DIST_LAUNCHER_PID"  # set by recsys_dist.launch and recsys-dist train


def _exit_watch(pid: int):
    """A function telling whether process ``pid`` has ended: through a pidfd where Linux has
    one (exact, whatever reuses the number later), else by ``kill(pid, 0)``."""
    try:
        fd = os.pidfd_open(pid)
    except (AttributeError, OSError):
        return lambda: not _alive(pid)
    return lambda: bool(select.select([fd], [], [], 0)[0])


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


_STORE: dist.Store | None = None  # this process's connection to the launcher's store
_GROUPS_MADE = 0  # process groups this process has made from it
REUSE_WAIT_S = 60.0  # how long a new Trainer waits for every rank to report the same failure


@dataclass
class _MadeGroup:
    """The last process group :func:`init_distributed` made under a launcher, its keys in the
    launcher's store, and the Trainers that failed on it here and left it open. Failures are
    recorded only for this group, never for one the caller made."""

    group: object
    store: dist.Store
    failures: int = 0


_MADE: _MadeGroup | None = None


def _attempt_store(rank: int, world: int, timeout_s: float) -> dist.Store:
    """The launcher's TCPStore, with keys prefixed by the restart attempt and the group.

    After an elastic restart the agent's store still holds the previous attempt's gloo
    addresses under the same keys, and the new ranks connect to dead ports (seen with
    torch 2.13: "Gloo connectFullMesh failed ... Connection refused"). A per-attempt prefix
    keeps the attempts apart. Likewise a second process group in the same ranks (a second
    Trainer after the first one closed its group) read the first group's keys and hung in
    its first collective: each group made in this process gets its own prefix (every rank
    makes its groups in the same order, so the numbers agree). Without an agent store (e.g.
    Slurm), rank 0 hosts the store, once per process.
    """
    global _STORE, _GROUPS_MADE
    if _STORE is None:
        agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
        _STORE = dist.TCPStore(
            os.environ["MASTER_ADDR"],
            int(os.environ["MASTER_PORT"]),
            world,
            is_master=(not agent and rank == 0),
            timeout=timedelta(seconds=timeout_s),
        )
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    _GROUPS_MADE += 1
    return dist.PrefixStore(f"recsys_dist/attempt_{attempt}/group_{_GROUPS_MADE}", _STORE)


def _current_made_group() -> _MadeGroup | None:
    return _MADE if _MADE is not None and dist.is_initialized() and dist.group.WORLD is _MADE.group else None


def note_failure(rank: int) -> None:
    """Record in the launcher's store that a Trainer failed on this rank and left the group
    open (a peer may be inside a collective, so it is neither synchronised nor destroyed)."""
    made = _current_made_group()
    if made is not None:
        made.failures += 1
        made.store.set(f"failed_{made.failures}/rank_{rank}", "1")


def check_reusable(rank: int, world: int) -> bool:
    """Before a new Trainer trains on the existing group: True when a failed Trainer left it
    open and every rank reported that same failure (all ranks stopped alike, none is inside a
    collective: the group can be used, and the new Trainer takes it over); False when no
    failure is on record (a group the caller made, or one in use).

    Raises:
        RuntimeError: a failure on this rank that not every rank reported within
            ``REUSE_WAIT_S`` seconds: the other ranks may still wait in a collective the failed
            Trainer never joined, and a new Trainer on this group would wait with them.
    """
    made = _current_made_group()
    if made is None or not made.failures:
        return False
    keys = [f"failed_{made.failures}/rank_{r}" for r in range(world)]
    try:
        made.store.wait(keys, timedelta(seconds=REUSE_WAIT_S))
    except (RuntimeError, dist.DistError):  # the store's timeout
        missing = [r for r, k in enumerate(keys) if not made.store.check([k])]
        raise RuntimeError(
            f"rank {rank}: a Trainer failed on this rank and left its process group open, but rank(s) "
            f"{missing} did not fail within {REUSE_WAIT_S:g} s; they may be waiting in a collective, so a "
            "new Trainer on this group would wait with them. Let the exception end the function that "
            "runs on every rank (the launcher then stops the ranks and reports it), or fail every rank alike."
        ) from None
    return True


def resolve_device(name: str, local_rank: int = 0) -> torch.device:
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(f"cuda:{local_rank}") if name == "cuda" else torch.device("cpu")


def init_distributed(cfg: DistributedConfig, timeout_s: float = 600.0) -> DistContext:
    """Create the default process group (gloo on CPU, nccl on CUDA).

    Under a launcher the rank and world size come from its environment; when a group
    already exists (made by the caller) it is used as it is, its rank and size read from it;
    otherwise a single-rank group is made in-process. On CPU each rank runs
    ``distributed.cpu_threads_per_rank`` intra-op threads, by default an equal share of
    this machine's cores.
    """
    global _MADE
    die_with_launcher()
    if under_launcher():
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    elif dist.is_initialized():
        rank, world = dist.get_rank(), dist.get_world_size()
        local_rank = int(os.environ.get("LOCAL_RANK", rank))
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    else:
        rank, world, local_rank, local_world = 0, 1, 0, 1
    device = resolve_device(cfg.device, local_rank)
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(cfg.cpu_threads_per_rank or max(1, (os.cpu_count() or 1) // local_world))
    if not dist.is_initialized():
        if under_launcher():
            store = _attempt_store(rank, world, timeout_s)
            dist.init_process_group(
                backend, store=store, rank=rank, world_size=world, timeout=timedelta(seconds=timeout_s)
            )
            _MADE = _MadeGroup(dist.group.WORLD, store)
        else:
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    _setup_logging(rank)
    return DistContext(rank, world, local_rank, local_world, device, backend)


def _setup_logging(rank: int) -> None:
    """``recsys_dist`` log lines carry the rank and are printed by rank 0 (``recsys_dist.logs``);
    level from $RECSYS_DIST_LOG (default WARNING). Third-party noise is hidden
    (``recsys_dist.logs.quiet_third_party``)."""
    quiet_third_party()
    set_rank(rank)
    logger = logging.getLogger("recsys_dist")
    if not logger.handlers:
        handler = StderrHandler()
        handler.setFormatter(logging.Formatter(f"%(asctime)s [rank {rank}] %(levelname)s %(name)s: %(message)s"))
        logger.addHandler(handler)
        logger.propagate = False
    logger.setLevel(os.environ.get("RECSYS_DIST_LOG", "WARNING").upper())


def broadcast_result(ctx: DistContext, fn):
    """Run ``fn()`` on rank 0 and give its result, or its exception, to every rank.

    Used for work only rank 0 should do (data conversion): if it fails, every rank raises
    the same error instead of the others waiting forever at a barrier.
    """
    box: list = [None]
    if ctx.is_main:
        try:
            box[0] = ("ok", fn())
        except Exception as err:  # noqa: BLE001 - re-raised on every rank below
            box[0] = ("err", err)
    if ctx.world_size > 1:
        dist.broadcast_object_list(box, src=0)
    status, value = box[0]
    if status == "err":
        raise value
    return value
