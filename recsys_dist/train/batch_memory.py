"""Does one batch fit in this machine's memory? Checked before any rank starts, so that a
``train.batch_size`` far too large is a config error naming it, not ranks killed by the
out-of-memory killer ("Signal 9").

The estimate is a lower bound of what one step holds per rank, for CPU ranks (whose tensors
live in host memory): the batch's inputs (dense values, labels, int64 ids and int32 lengths
of the KeyedJaggedTensor), the embeddings looked up (one pooled ``embedding_dim`` vector per
pooled feature, one per position of a sequence feature) and the activations of the model's
MLP layers (the sum of every ``*_sizes`` list of ``model``), twice for training (the
gradients of the embeddings and activations are as large) and once for evaluation. Embedding
tables, optimizer state, all-to-all buffers and the data loader's prefetched batches come on
top, so a batch refused here could never run, and one accepted may still not.
"""

from __future__ import annotations

import os
from pathlib import Path

from recsys_dist.distributed.env import resolve_device
from recsys_dist.train.job import Job

GIB = 1 << 30


def available_memory() -> tuple[int, str] | None:
    """``(bytes, where)``: the memory this machine (or this process's cgroup, if less) can
    still give, from ``/proc/meminfo``'s MemAvailable and the cgroup's limit less its use
    (:func:`cgroup_memory_dir`); None when neither can be read (not Linux)."""
    found = []
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                found.append((int(line.split()[1]) * 1024, "MemAvailable in /proc/meminfo"))
    except (OSError, ValueError, IndexError):
        pass
    cg = cgroup_memory_dir()
    if cg is not None:
        v2 = (cg / "memory.max").is_file()
        try:
            limit = (cg / ("memory.max" if v2 else "memory.limit_in_bytes")).read_text().strip()
            used = int((cg / ("memory.current" if v2 else "memory.usage_in_bytes")).read_text())
            if limit != "max" and int(limit) < 1 << 60:  # v1 writes "no limit" as a huge number
                found.append(
                    (max(int(limit) - used, 0), f"the memory limit of this process's cgroup ({cg}) less its use")
                )
        except (OSError, ValueError):
            pass
    return min(found) if found else None


def cgroup_memory_dir() -> Path | None:
    """The directory of this process's memory cgroup: v2 (``memory.max``, ``memory.events``)
    or v1 (``memory.limit_in_bytes``, ``memory.oom_control``), at its path from
    ``/proc/self/cgroup`` under the mount, or the mount itself (a container's own cgroup); None
    when there is none."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, rel = parts
        if controllers in ("", "memory") or "memory" in controllers.split(","):
            mount = Path("/sys/fs/cgroup") / ("memory" if controllers else "")
            for d in (mount / rel.lstrip("/"), mount):
                if (d / "memory.max").is_file() or (d / "memory.limit_in_bytes").is_file():
                    return d
    return None


def bytes_per_example(job: Job, training: bool) -> int:
    """The lower bound of the module docstring, in bytes, for one example of ``job``'s model."""

    dense, sparse = job.features.dense_names, job.features.keys
    d = job.data
    hot = d.multi_hot_sizes or [1] * len(sparse)
    lengths = {}
    schema = d.schema
    if schema is not None:
        lengths = {name: s.max_length for name, s in schema.sequence.items()}
        if schema.history is not None:
            lengths[schema.history.name] = schema.history.max_length
    ids = sum(lengths.get(f, h) for f, h in zip(sparse, hot))
    vectors = sum(lengths.get(f, 1) for f in sparse)  # one pooled vector, or one per position
    inputs = 4 * len(dense) + 4 * 2 + 8 * ids + 4 * len(sparse)  # dense, label + weight, ids, lengths
    widths = sum(sum(v) for k, v in job.model if k.endswith("_sizes") and isinstance(v, list))
    computed = 4 * job.model.embedding_dim * vectors + 4 * widths
    return inputs + computed * (2 if training else 1)


def batch_memory_problems(job: Job, local_ranks: int, available: tuple[int, str] | None = None) -> list[str]:
    """``key: what is wrong`` when one training or evaluation batch of ``local_ranks`` CPU ranks
    needs more memory than this machine has available (:func:`available_memory`); [] when it
    fits, on CUDA (batches live in device memory) or when the memory cannot be read."""

    if resolve_device(job.distributed.device).type != "cpu":
        return []
    available = available if available is not None else available_memory()
    if available is None:
        return []
    free, where = available
    problems = []
    for key, batch, training in (
        ("train.batch_size", job.train.batch_size, True),
        ("eval.batch_size", job.eval.batch_size, False),
    ):
        if batch is None:
            continue
        per = bytes_per_example(job, training)
        need = per * batch * local_ranks
        if need > free:
            fits = max(free // (per * local_ranks), 1)
            problems.append(
                f"{key}: {batch:,} examples per rank need at least {need / GIB:,.1f} GiB for one batch's tensors "
                f"on {local_ranks} rank(s) ({per:,} bytes per example: inputs, embeddings and MLP activations"
                f"{' with their gradients' if training else ''}), but this machine has {free / GIB:,.1f} GiB "
                f"available ({where}); set {key} well below {fits:,}, or run fewer ranks per machine"
            )
    return problems


def local_rank_count(job: Job) -> int:
    """The ranks that share this machine: torchrun's LOCAL_WORLD_SIZE, else nproc_per_node."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", job.distributed.nproc_per_node))
