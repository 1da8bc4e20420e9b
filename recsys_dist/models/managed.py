"""Managed-collision tables: TorchRec's MCH module, its state replicated and kept equal on every rank.

Under ``data.categorical_mapping: managed`` the loader feeds raw 63-bit ids and
:class:`ManagedRemap` maps each feature's ids to rows of its ``num_embeddings``-row tables
(``t_<feature>``, ``w_<feature>`` with first-order tables; a sequence feature's ``s_<feature>``
in the EmbeddingCollection, all its positions' ids) before the model sees the KeyedJaggedTensor. Each feature has one TorchRec ``MCHManagedCollisionModule``
(``torchrec.modules.mc_modules``; eviction ``LFU_EvictionPolicy``, ``LRU_EvictionPolicy`` or
``DistanceLFU_EvictionPolicy``): row ``num_embeddings - 1`` is the default row that every id
without a row reads; the other rows belong to admitted ids.

Why not TorchRec's sharded ``ManagedCollisionEmbeddingBagCollection``: it runs on gloo/CPU
(row-wise only, with ``buckets = world size``), but each rank then manages its own slice of
the id space with ``num_embeddings / world size`` rows and its own default row, so the
remapping depends on the world size, a checkpoint cannot be resharded to another world size
without moving ids between ranks, and table-wise / column-wise sharding are refused
(``ManagedCollisionCollectionSharder.sharding_types`` is row-wise only). Here the id -> row
state (sorted raw ids, row per id, counts / last access, the pending history) is replicated:
each training step all-gathers the ids of the global batch once, and every rank applies the
same TorchRec update to the same history, so every rank holds the same state, equal to that
of one process training on the global batch. The embedding rows themselves stay in the
ordinary EmbeddingBagCollection, sharded by any plan (table-, row-, column-wise, data
parallel), checkpointed and resharded like every other table; the replicated state is plain
tensors in the model's state dict, so a checkpoint loads at any world size.

Eviction: an evicted id's row is handed to the admitted id as it is (weights and optimizer
state), as TorchRec's unsharded ``ManagedCollisionEmbeddingBagCollection`` does (its
``evict`` is a no-op); rows are not reinitialised.

Costs: 24-32 bytes per row per feature on every rank (raw id, row, count / last access),
the history (8-16 bytes per id value of ``eviction_interval`` global batches), one
all_gather of the step's ids of all features (8 bytes per id value per rank) and, per step,
one batched lookup and (lfu) one batched eviction round for all features together
(:func:`batched_lookup`, :func:`batched_lfu_round`: the same state as TorchRec's per-feature
calls, which cost more in per-call overhead than the work on small tables; in
``recsys_dist.models.managed_ops``). In training the lookup is of the global batch's ids (for
the ``collided`` counter, the same on every rank), this rank's rows being its slice. TTL (``data.managed.ttl_steps``) and counters (:meth:`ManagedRemap.counters`): docs/managed_collision.md.
"""

from __future__ import annotations

import threading
import time

import torch
import torch.distributed as dist
from torch import nn
from torchrec.modules.mc_modules import (
    DistanceLFU_EvictionPolicy,
    LFU_EvictionPolicy,
    LRU_EvictionPolicy,
    MCHManagedCollisionModule,
)
from torchrec.sparse.jagged_tensor import JaggedTensor, KeyedJaggedTensor

from recsys_dist.data.config import ManagedConfig
from recsys_dist.data.spec import FeatureSpec
from recsys_dist.models.managed_ops import (
    batched_lfu_round,
    batched_lookup,
    batched_mark_seen,
    batched_ttl_expire,
    row_of_value,
    segment_sums,
)

MANAGED_ID_SPACE = 2**63 - 1  # raw ids lie in [0, 2^63 - 1); 2^63 - 1 marks an empty slot
_GATHERING = threading.local()  # .on: a ManagedRemap is issuing its id all_gather in this thread


def _policy(eviction: str, decay_exponent: float, admission_min_count: int):
    threshold = None
    if admission_min_count > 1:
        k = admission_min_count

        def threshold(counts: torch.Tensor):  # TorchRec's threshold_filtering_func contract
            return counts >= k, k - 1

    if eviction == "lfu":
        return LFU_EvictionPolicy(threshold_filtering_func=threshold)
    if eviction == "lru":
        return LRU_EvictionPolicy(decay_exponent=decay_exponent, threshold_filtering_func=threshold)
    if eviction == "distance_lfu":
        return DistanceLFU_EvictionPolicy(decay_exponent=decay_exponent, threshold_filtering_func=threshold)
    raise ValueError(f"data.managed.eviction: {eviction!r} is not lfu, lru or distance_lfu")


class ReplicatedMCH(MCHManagedCollisionModule):
    """TorchRec's ``MCHManagedCollisionModule`` whose history is a persistent buffer fed with
    the global batch's ids, so its state is the same on every rank and survives a checkpoint.

    Args:
        zch_size: rows of the feature's tables; row ``zch_size - 1`` is the default row.
        eviction / decay_exponent / admission_min_count / eviction_interval: ``data.managed``.
        history_capacity: id values the history holds (``eviction_interval`` global batches of
            one-hot ids); when a step's ids would not fit, the eviction round runs early
            (the same on every world size, since the global batch is).
        ttl_steps: ``data.managed.ttl_steps``: at each scheduled round, ids not seen in the
            last ``ttl_steps`` training steps lose their rows (None: no TTL).

    Persistent state beyond TorchRec's: the history, ``_counters`` (int64 [4]: history
    length, step of the last round, policy evictions, admissions), ``_totals`` (int64 [2]:
    TTL evictions, collided lookups, both since training started) and, under a TTL,
    ``_row_last_seen`` (int64 [zch_size]: per row, the last training step its id was seen).
    """

    def __init__(
        self,
        zch_size: int,
        eviction: str,
        eviction_interval: int,
        admission_min_count: int = 1,
        decay_exponent: float = 1.0,
        history_capacity: int = 1 << 16,
        device: torch.device | None = None,
        name: str | None = None,
        ttl_steps: int | None = None,
    ) -> None:
        super().__init__(
            zch_size=zch_size,
            device=device or torch.device("cpu"),
            eviction_policy=_policy(eviction, decay_exponent, admission_min_count),
            eviction_interval=eviction_interval,
            input_hash_size=MANAGED_ID_SPACE,
            name=name,
        )
        self.admission_min_count = int(admission_min_count)
        cap = max(int(history_capacity), 1)
        dev = self.device
        # The pending history, persistent (TorchRec keeps it in non-persistent lazily sized
        # buffers, so a checkpoint between two rounds would lose it).
        self.register_buffer("_hist_ids", torch.zeros(cap, dtype=torch.int64, device=dev))
        self.register_buffer("_hist_iter", torch.zeros(cap, dtype=torch.int64, device=dev))
        # [history length, iteration of the last round, evictions so far, admissions so far]
        self.register_buffer("_counters", torch.zeros(4, dtype=torch.int64, device=dev))
        # [TTL evictions, collided: training lookups of real ids that read the default row]
        self.register_buffer("_totals", torch.zeros(2, dtype=torch.int64, device=dev))
        self.ttl_steps = None if ttl_steps is None else int(ttl_steps)
        if self.ttl_steps is not None:
            # by row, not by slot: the table's re-sorts leave it in place
            self.register_buffer("_row_last_seen", torch.zeros(zch_size, dtype=torch.int64, device=dev))
        self._input_history_buffer_size = cap

    # TorchRec reads these two while coalescing; they alias the persistent buffers.
    def _bind_history(self, n: int) -> None:
        self._history_accumulator = self._hist_ids
        self._history_metadata = {
            m.metadata_name: self._hist_iter for m in self._eviction_policy.metadata_info if m.is_history_metadata
        }
        self._current_history_buffer_offset = n

    @torch.no_grad()
    def record(self, global_ids: torch.Tensor) -> None:
        """Training step: count ``global_ids`` (int64 [N], the global batch's ids of this
        feature, in rank order) and run an eviction round every ``eviction_interval`` steps."""
        it = int(self._current_iter_tensor.item()) + 1
        self._current_iter_tensor.fill_(it)
        self._current_iter = it
        n, last = int(self._counters[0]), int(self._counters[1])
        cap = self._hist_ids.numel()
        k = 0
        while k < global_ids.numel():  # normally once; more when a step's ids overflow the history
            if n == cap:
                self._round(n)
                n = 0
            take = min(cap - n, global_ids.numel() - k)
            self._hist_ids[n : n + take] = global_ids[k : k + take]
            self._hist_iter[n : n + take] = it
            n, k = n + take, k + take
        if it - last >= self._eviction_interval:
            self._round(n)
            self.expire(it)
            n, last = 0, it
        self._counters[0], self._counters[1] = n, last

    def _round(self, n: int) -> None:
        if n == 0:
            return
        before = int(self.open_slots())
        self._bind_history(n)
        self._coalesce_history()
        replaced = self.evict()  # consume TorchRec's pending evicted rows (counted, not reset)
        filled = before - int(self.open_slots())
        got = 0 if replaced is None else int(replaced.numel())
        self._counters[2] += got - filled
        self._counters[3] += got
        if self.ttl_steps is not None:
            batched_mark_seen(
                [self._mch_sorted_raw_ids],
                [self._mch_remapped_ids_mapping],
                [self._row_last_seen],
                [self._hist_ids[:n]],
                [self._hist_iter[:n]],
            )

    def metadata_buffers(self) -> list[torch.Tensor]:
        """The policy's per-slot metadata buffers (``_mch_counts`` and / or ``_mch_last_access_iter``)."""
        return [
            getattr(self, "_mch_" + m.metadata_name) for m in self._eviction_policy.metadata_info if m.is_mch_metadata
        ]

    def expire(self, step: int) -> None:
        """TTL eviction at a scheduled round of training step ``step`` (no-op without a TTL):
        :func:`batched_ttl_expire` of this feature."""
        if self.ttl_steps is None:
            return
        batched_ttl_expire(
            [self._mch_sorted_raw_ids],
            [self._mch_remapped_ids_mapping],
            [[b] for b in self.metadata_buffers()],
            [self._row_last_seen],
            [self._totals[:1]],
            step,
            self.ttl_steps,
        )

    def counters(self) -> dict[str, int]:
        """Cumulative since training started (replicated: the same on every rank): ``admitted``
        (ids given a row), ``evicted`` (ids that lost their row: by the policy or the TTL),
        ``evicted_ttl`` (by the TTL; part of ``evicted``), ``collided`` (training lookups of
        real ids, padding excluded, that read the default row, over the global batch)."""
        c, t = self._counters.tolist(), self._totals.tolist()
        return {"admitted": c[3], "evicted": c[2] + t[0], "evicted_ttl": t[0], "collided": t[1]}

    def remap_values(self, values: torch.Tensor) -> torch.Tensor:
        """int64 raw ids [N] -> int64 rows [N] in ``[0, zch_size)`` (``zch_size - 1``: no row)."""
        jt = JaggedTensor(values=values, lengths=torch.ones_like(values, dtype=torch.int32))
        return self.remap({"f": jt})["f"].values()

    def stats(self) -> dict:
        """Occupancy (admitted ids / usable rows), evictions and admissions so far."""
        usable = self._zch_size - 1
        used = usable - int(self.open_slots())
        return {
            "occupancy": round(used / usable, 6) if usable else None,
            "rows_used": used,
            "evictions": int(self._counters[2]),
            "admissions": int(self._counters[3]),
        }


class ManagedRemap(nn.Module):
    """Raw-id KeyedJaggedTensor -> row-id KeyedJaggedTensor, one :class:`ReplicatedMCH` per
    managed feature (keys not managed pass through unchanged).

    ``forward(kjt, weights=None)``: values int64 raw ids in ``[0, 2^63 - 1)``, ``weights``
    float [B] row weights (0 = padding: not recorded, not counted); returns the same keys,
    lengths and weights with values int64 rows in ``[0, num_embeddings)``. In training mode
    it first records the global batch's ids (one ``all_gather`` of sizes and one of ids, for
    all features together, when the job has several ranks and ``gather``: collectives, every
    rank must call them) and may run an eviction round.
    It also counts lookups and default-row lookups for :meth:`metrics`.

    Every step works on all managed features at once (a handful of torch operations on the
    features' concatenated ids, not a Python loop of TorchRec calls per feature): the lookup
    is :func:`batched_lookup`, and the lfu round :func:`batched_lfu_round`, which gives the
    same state as TorchRec's per-feature ``_coalesce_history`` (``tests/unit/models/test_managed.py``
    checks it against TorchRec). lru and distance_lfu rounds run through TorchRec per feature.
    """

    def __init__(self, modules: dict[str, ReplicatedMCH], gather: bool = True) -> None:
        super().__init__()
        self.mch = nn.ModuleDict(modules)
        self.gather = gather  # False: record only this process's ids (a reference model, one process)
        self.train_seconds, self.train_calls = 0.0, 0  # remapping time in training (incl. all_gather)
        # [train lookups, train default, eval lookups, eval default] per feature, this rank, since last read
        self.register_buffer("_lookups", torch.zeros(len(modules), 4, dtype=torch.int64), persistent=False)
        mods = list(modules.values())
        self._sizes = [m._zch_size for m in mods]
        # The lfu round of every feature as one batched operation (same interval and threshold).
        self._batched_round = bool(mods) and all(
            type(m._eviction_policy) is LFU_EvictionPolicy
            and m._eviction_interval == mods[0]._eviction_interval
            and m.admission_min_count == mods[0].admission_min_count
            and m.ttl_steps == mods[0].ttl_steps
            for m in mods
        )
        self._key_index: dict[tuple, list[int]] = {}
        self._bufs: dict[str, list[torch.Tensor]] | None = None

    def forward(self, kjt: KeyedJaggedTensor, weights: torch.Tensor | None = None) -> KeyedJaggedTensor:
        t0 = time.perf_counter()
        out = self._remap(kjt, weights)
        if self.training:
            self.train_seconds += time.perf_counter() - t0
            self.train_calls += 1
        return out

    def _buffers_of(self, mods: list[ReplicatedMCH]) -> dict[str, list[torch.Tensor]]:
        """The modules' state tensors by name, in feature order (cached: reading a buffer
        through ``nn.Module.__getattr__`` per feature per step costs more than the step's
        tensor work on small tables; refreshed when a buffer object changes, e.g. ``.to``)."""
        cached = getattr(self, "_bufs", None)
        if (
            cached is None
            or any(cached["_mch_sorted_raw_ids"][i] is not m._mch_sorted_raw_ids for i, m in enumerate(mods))
            or any(cached["_hist_ids"][i] is not m._hist_ids for i, m in enumerate(mods))
        ):
            names = ["_mch_sorted_raw_ids", "_mch_remapped_ids_mapping", "_hist_ids", "_hist_iter", "_counters"]
            names += ["_current_iter_tensor", "_totals"] + (["_mch_counts"] if self._batched_round else [])
            names += ["_row_last_seen"] if self._batched_round and mods[0].ttl_steps is not None else []
            cached = {n: [getattr(m, n) for m in mods] for n in names}
            cached["_collided"] = [t[1:] for t in cached["_totals"]]  # views made once, not per step
            self._bufs = cached
        return cached

    def _positions(self, keys: list[str]) -> list[int]:
        """Per managed feature, its index in ``keys`` (-1: absent); cached per key list."""
        t = tuple(keys)
        if t not in self._key_index:
            self._key_index[t] = [keys.index(f) if f in keys else -1 for f in self.mch]
        return self._key_index[t]

    def _remap(self, kjt: KeyedJaggedTensor, weights: torch.Tensor | None) -> KeyedJaggedTensor:
        keys = kjt.keys()
        values = kjt.values()
        parts = list(torch.split(values, kjt.length_per_key()))
        pos = self._positions(keys)
        # Padding rows (weight 0) are neither recorded nor counted: they repeat a real row, and
        # where they fall depends on the world size.
        keep = None
        if weights is not None and keys and not bool((weights > 0).all()):
            per_row = (weights > 0).repeat(len(keys))
            lengths = kjt.lengths()
            keep = per_row if values.numel() == lengths.numel() else per_row[row_of_value(lengths, values.numel())]
        keeps = list(torch.split(keep, kjt.length_per_key())) if keep is not None else [None] * len(keys)
        mods = list(self.mch.values())
        bufs = self._buffers_of(mods)
        present = [i for i, j in enumerate(pos) if j >= 0]
        found = None
        if self.training:
            mine = [_real(parts[j], keeps[j]) if j >= 0 else values.new_zeros(0) for j in pos]
            _GATHERING.on = True  # issuing_collective: its all_gathers are the managed phase
            try:
                glob, offsets = _gather_per_key(mine) if self.gather else (mine, [0] * len(mine))
            finally:
                _GATHERING.on = False
            work = None
            if self._batched_round:
                work = _record_all(mods, bufs, glob)
            else:
                for m, g in zip(mods, glob):
                    m.record(g)
            found = _count_collided(mods, bufs, glob)
            if work is not None:
                _ttl_all(mods[0].ttl_steps, bufs, work, found, [g.numel() for g in glob])
            if keep is None and len(present) == len(mods):  # no padding: this rank's ids are a slice of glob's
                rows_g, miss_g = found
                split = torch.split(miss_g, [g.numel() for g in glob])
                found = (
                    [r[o : o + q.numel()] for r, o, q in zip(rows_g, offsets, mine)],
                    torch.cat([m[o : o + q.numel()] for m, o, q in zip(split, offsets, mine)]),
                )
            else:
                found = None
        if present:
            self._lookup(parts, pos, present, keep, keeps, bufs, mods, found)
        return KeyedJaggedTensor(
            keys=keys,
            values=torch.cat(parts) if parts else values,
            lengths=kjt.lengths(),
            weights=kjt.weights_or_none(),
            stride=kjt.stride(),
        )

    def _lookup(self, parts, pos, present, keep, keeps, bufs, mods, found) -> None:
        """Replaces ``parts`` (per key, raw ids) of the ``present`` managed features by their
        rows, and counts lookups / default-row lookups of real ids (``keep``). ``found``:
        the rows and misses already looked up (training without padding), else None."""
        queries = [parts[pos[i]] for i in present]
        if found is None:
            found = batched_lookup(
                [bufs["_mch_sorted_raw_ids"][i] for i in present],
                [bufs["_mch_remapped_ids_mapping"][i] for i in present],
                queries,
                [mods[i]._zch_size - 1 for i in present],
            )
        rows, miss = found
        sizes = [q.numel() for q in queries]
        if keep is not None:  # count real rows only
            k = torch.cat([keeps[pos[i]] for i in present])
            looked, default = segment_sums(k, sizes), segment_sums(miss & k, sizes)
        else:
            looked, default = torch.tensor(sizes, dtype=torch.int64, device=miss.device), segment_sums(miss, sizes)
        col = 0 if self.training else 2
        at = self._lookups.device
        idx = torch.tensor(present, dtype=torch.int64, device=at)
        self._lookups[idx, col] += looked.to(at)
        self._lookups[idx, col + 1] += default.to(at)
        for r, i in zip(rows, present):
            parts[pos[i]] = r

    @staticmethod
    def issuing_collective() -> bool:
        """Whether this thread issues a remap's id all_gather now (CommCounter: managed_all_gather)."""
        return getattr(_GATHERING, "on", False)

    def counters(self) -> dict[str, dict[str, int]]:
        """Per managed feature, its cumulative counters since training started:
        ``{feature: {"admitted": int, "evicted": int, "evicted_ttl": int, "collided": int}}``
        (:meth:`ReplicatedMCH.counters`). The counters are persistent buffers, the same on every
        rank, so this reads local state: not a collective; a resumed run continues them exactly."""
        return {f: m.counters() for f, m in self.mch.items()}

    def metrics(self, split: str = "train") -> dict:
        """``{"managed": {feature: {occupancy, rows_used, evictions, admissions, default_share}}}``
        (``default_share``: of this split's lookups since the last call, all ranks); for ``train``
        also ``managed_remap_ms_per_step`` (this rank's remap time per step since the last call,
        all_gather included) and the :meth:`counters` as ``<counter>_total``. A collective."""
        counts = self.read_lookups(split)
        extra = {}
        if split == "train" and self.train_calls:
            # This rank's remapping time per training step (history, all_gather, round, lookup).
            extra["managed_remap_ms_per_step"] = round(1000 * self.train_seconds / self.train_calls, 3)
            self.train_seconds, self.train_calls = 0.0, 0
        out = {}
        for i, (f, m) in enumerate(self.mch.items()):
            looked, default = int(counts[i, 0]), int(counts[i, 1])
            out[f] = {**m.stats(), "default_share": round(default / looked, 6) if looked else None}
            if split == "train":
                out[f].update({f"{k}_total": v for k, v in m.counters().items()})
        return {"managed": out, **extra}

    def read_lookups(self, split: str = "train", reduce: bool = True) -> torch.Tensor:
        """[features, 2] (lookups, default-row lookups) of ``split`` (train, or any
        evaluation) since the last read, summed over ranks when ``reduce`` (a collective);
        then reset."""
        cols = slice(0, 2) if split == "train" else slice(2, 4)
        out = self._lookups[:, cols].clone()
        self._lookups[:, cols] = 0
        if reduce and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(out)
        return out


def _record_all(mods: list[ReplicatedMCH], bufs: dict[str, list[torch.Tensor]], glob: list[torch.Tensor]):
    """:meth:`ReplicatedMCH.record` of every feature, with one batched lfu round for all
    features due (per feature through TorchRec when a step's ids overflow a history, TTL
    included). ``bufs``: the modules' state tensors by name (:meth:`ManagedRemap._buffers_of`).
    Returns the TTL's work left for :func:`_ttl_all` (under a TTL, when the batched round ran),
    else None."""
    ctr = torch.stack(bufs["_counters"]).tolist()
    iters = torch.stack(bufs["_current_iter_tensor"]).view(-1).tolist()
    it = int(iters[0]) + 1
    hist, hist_iter = bufs["_hist_ids"], bufs["_hist_iter"]
    fits = all(c[0] + g.numel() <= h.numel() for h, g, c in zip(hist, glob, ctr))
    if not (fits and all(i + 1 == it for i in iters)):
        for m, g in zip(mods, glob):
            m.record(g)
        return None
    due, hists, ticks, fresh = [], [], [], []
    torch._foreach_add_(bufs["_current_iter_tensor"], 1)
    for i, (m, g, c) in enumerate(zip(mods, glob, ctr)):
        n = c[0]
        hist[i][n : n + g.numel()] = g
        hist_iter[i][n : n + g.numel()] = it
        c[0] = n + g.numel()
        if it - c[1] >= m._eviction_interval:
            ticks.append(i)
            if c[0]:
                due.append(i)
                hists.append((hist[i][: c[0]], hist_iter[i][: c[0]]))
                fresh.append(n == 0)  # the history is this step's ids: glob[i]
            c[0], c[1] = 0, it
    if due:
        sub = {
            k: [bufs[k][i] for i in due] for k in ("_mch_sorted_raw_ids", "_mch_remapped_ids_mapping", "_mch_counts")
        }
        sub["_counters"] = [bufs["_counters"][i] for i in due]
        batched_lfu_round([mods[i]._zch_size for i in due], sub, [h for h, _ in hists], mods[0].admission_min_count)
    new = torch.tensor([c[:2] for c in ctr], dtype=torch.int64, device=bufs["_counters"][0].device)
    torch._foreach_copy_([c[:2] for c in bufs["_counters"]], list(new.unbind(0)))
    return (due, hists, fresh, ticks, it) if mods[0].ttl_steps is not None else None


def _ttl_all(ttl: int, bufs: dict[str, list[torch.Tensor]], work: tuple, found: tuple, sizes: list[int]) -> None:
    """The batched lfu step's TTL (``work`` from :func:`_record_all`): last-seen steps of the
    rounds' (``due``) histories (``hists``: per due feature, ids and steps), then the TTL expiry
    of the features whose round was scheduled this step (``ticks``, also those with an empty
    history). A history that is this step's ids (``fresh``, e.g. every history under
    eviction_interval 1) reuses the step's lookup of the global batch (``found``, per feature
    ``sizes`` ids), which the expiry cannot change: those ids were seen now, none expires."""
    due, hists, fresh, ticks, it = work
    if not ticks:  # no round this step (due is part of ticks): nothing to mark or expire
        return
    tables, mappings = bufs["_mch_sorted_raw_ids"], bufs["_mch_remapped_ids_mapping"]
    misses = torch.split(found[1], sizes)
    for reuse in (True, False):
        sel = [k for k, f in enumerate(fresh) if f == reuse]
        if not sel:
            continue
        batched_mark_seen(
            [tables[due[k]] for k in sel],
            [mappings[due[k]] for k in sel],
            [bufs["_row_last_seen"][due[k]] for k in sel],
            [hists[k][0] for k in sel],
            [hists[k][1] for k in sel],
            ([found[0][due[k]] for k in sel], torch.cat([misses[due[k]] for k in sel])) if reuse else None,
        )
    batched_ttl_expire(
        [tables[i] for i in ticks],
        [mappings[i] for i in ticks],
        [[bufs["_mch_counts"][i] for i in ticks]],
        [bufs["_row_last_seen"][i] for i in ticks],
        [bufs["_totals"][i][:1] for i in ticks],
        it,
        ttl,
    )


def _count_collided(mods: list[ReplicatedMCH], bufs: dict[str, list[torch.Tensor]], glob: list[torch.Tensor]):
    """Looks up the global batch's real ids (``glob``, per feature) after this step's round and
    adds to each feature's ``_totals[1]`` those that read the default row: the sum over ranks
    of their training default-row lookups, counted the same on every rank without a
    collective (the ids are all-gathered already). Returns :func:`batched_lookup`'s rows and
    misses (None without managed features)."""
    if not mods:
        return None
    tables, mappings = bufs["_mch_sorted_raw_ids"], bufs["_mch_remapped_ids_mapping"]
    rows, miss = batched_lookup(tables, mappings, glob, [m._zch_size - 1 for m in mods])
    got = segment_sums(miss, [g.numel() for g in glob])
    torch._foreach_add_(bufs["_collided"], list(got.view(-1, 1).unbind(0)))
    return rows, miss


def _real(values: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    return values if mask is None else values[mask]


def _gather_per_key(parts: list[torch.Tensor]) -> tuple[list[torch.Tensor], list[int]]:
    """Per feature, the ids of every rank concatenated in rank order (the global batch's),
    and where this rank's ``parts`` start in them."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return parts, [0] * len(parts)
    ws = dist.get_world_size()
    dev = parts[0].device if parts else None  # the ids' device: NCCL gathers CUDA tensors only
    sizes = torch.tensor([p.numel() for p in parts], dtype=torch.int64, device=dev)
    all_sizes = [torch.zeros_like(sizes) for _ in range(ws)]
    dist.all_gather(all_sizes, sizes)
    per_rank = torch.stack(all_sizes).tolist()  # one device-to-host read of every rank's sizes
    totals = [sum(n) for n in per_rank]
    width = max(totals)
    flat = torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64)
    buf = torch.zeros(width, dtype=torch.int64, device=flat.device)
    buf[: flat.numel()] = flat
    bufs = [torch.empty_like(buf) for _ in range(ws)]
    dist.all_gather(bufs, buf)
    out: list[list[torch.Tensor]] = [[] for _ in parts]
    for r in range(ws):
        pieces = torch.split(bufs[r][: totals[r]], per_rank[r])
        for i, p in enumerate(pieces):
            out[i].append(p)
    offsets = [sum(n) for n in zip(*per_rank[: dist.get_rank()])] or [0] * len(parts)
    return [torch.cat(o) for o in out], offsets


def build_remap(
    managed: ManagedConfig, features: FeatureSpec, global_batch: int, multi_hot_sizes: list[int] | None = None
) -> ManagedRemap:
    """The :class:`ManagedRemap` of ``features.managed``: one module per managed feature of
    ``features.keys`` (values excepted), its table's rows each, on ``features.device``; the history holds
    ``managed.eviction_interval`` global batches (``global_batch`` rows: ``train.batch_size`` x
    ranks) of ``multi_hot_sizes`` (``data.multi_hot_sizes``, default one) ids per feature (a
    sequence feature's, ``s_<feature>`` table: its ``max_length``, ``features.sequence_lengths``).
    A checkpoint resumes at another world size when the global batch stays the same."""
    m, names, seq = managed, set(features.managed), features.sequence_names
    hot = [*(multi_hot_sizes or [1] * len(features.sparse_names)), *(features.sequence_lengths.get(f, 1) for f in seq)]
    rows = [*features.num_embeddings, *(t.num_embeddings for t in features.sequence_tables)]
    return ManagedRemap(
        {
            f: ReplicatedMCH(
                zch_size=n,
                eviction=m.eviction,
                eviction_interval=m.eviction_interval,
                admission_min_count=m.admission_min_count,
                decay_exponent=m.decay_exponent,
                history_capacity=m.eviction_interval * global_batch * h,
                device=features.device,
                name=f,
                ttl_steps=m.ttl_steps,
            )
            for f, n, h in zip([*features.sparse_names, *seq], rows, hot)
            if f in names
        }
    )


def find_remap(model: nn.Module) -> ManagedRemap | None:
    """The model's :class:`ManagedRemap`, or None."""
    return next((m for m in model.modules() if isinstance(m, ManagedRemap)), None)


def managed_counters(model: nn.Module) -> dict[str, dict[str, int]]:
    """:meth:`ManagedRemap.counters` of ``model``'s remap (``{}`` without managed tables)."""
    return {} if (remap := find_remap(model)) is None else remap.counters()


def managed_metrics(model: nn.Module, split: str = "train") -> dict:
    """:meth:`ManagedRemap.metrics` of ``model``'s remap (``{}`` without managed tables)."""
    return {} if (remap := find_remap(model)) is None else remap.metrics(split)
