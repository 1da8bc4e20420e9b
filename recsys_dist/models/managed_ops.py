"""Batched tensor operations of the managed-collision tables (``recsys_dist.models.managed``):
one lookup, one lfu round, one last-seen update and one TTL expiry for several features at
once, each a handful of torch operations on the features' concatenated state instead of a
Python loop of TorchRec calls per feature.

State per feature (a ``ReplicatedMCH``'s buffers): ``_mch_sorted_raw_ids`` (int64 [rows],
ascending, empty slots and the last, default, slot hold ``2^63 - 1``),
``_mch_remapped_ids_mapping`` (int64 [rows], the row of each slot), policy metadata per slot
(``_mch_counts``, ``_mch_last_access_iter``), and, under a TTL, ``_row_last_seen`` (int64
[rows], indexed by row, not slot, so it needs no re-sort when the table is re-sorted).
"""

from __future__ import annotations

import torch

_MAX = torch.iinfo(torch.int64).max


def row_of_value(lengths: torch.Tensor, n: int) -> torch.Tensor:
    """int64 [n]: the bag (index into ``lengths``) of each value."""
    return torch.repeat_interleave(torch.arange(lengths.numel(), device=lengths.device), lengths.long(), output_size=n)


def _segment_ids(sizes: list[int], device: torch.device) -> torch.Tensor:
    """int64 [sum(sizes)]: for each element of a concatenation of segments, its segment."""
    n = torch.tensor(sizes, dtype=torch.int64, device=device)
    return torch.repeat_interleave(torch.arange(len(sizes), device=device), n, output_size=sum(sizes))


def segment_sums(x: torch.Tensor, sizes: list[int]) -> torch.Tensor:
    """int64 [len(sizes)]: the sum of a bool / int tensor over each of its consecutive segments."""
    c = torch.cat([x.new_zeros(1, dtype=torch.int64), torch.cumsum(x.long(), 0)])
    n = torch.tensor(sizes, dtype=torch.int64, device=x.device)
    ends = n.cumsum(0)
    return c[ends] - c[ends - n]


def _pad(parts: list[torch.Tensor], value: int) -> torch.Tensor:
    """int64 [len(parts), longest]: the parts as rows, padded with ``value`` (exact for int64,
    unlike ``pad_sequence``'s float padding value)."""
    n = [p.numel() for p in parts]
    dev = parts[0].device if parts else None
    sizes = torch.tensor(n, device=dev)
    out = torch.full((len(parts), max(n, default=0)), value, dtype=torch.int64, device=dev)
    out[torch.arange(out.shape[1], device=dev).unsqueeze(0) < sizes.unsqueeze(1)] = torch.cat(parts)
    return out


def batched_lookup(
    tables: list[torch.Tensor], mappings: list[torch.Tensor], queries: list[torch.Tensor], defaults: list[int]
) -> tuple[list[torch.Tensor], torch.Tensor]:
    """TorchRec's ``_mch_remap`` for several features at once.

    Args:
        tables: per feature, its MCH ``_mch_sorted_raw_ids`` (int64 [rows], ascending, the last
            one ``2^63 - 1``).
        mappings: per feature, ``_mch_remapped_ids_mapping`` (int64 [rows]).
        queries: per feature, raw ids (int64 [n_f], below ``2^63 - 1``).
        defaults: per feature, the default row.
    Returns:
        per feature the rows (int64 [n_f]), and a bool [sum n_f] (concatenated in feature
        order): True where the id has no row (it reads the default row).
    """
    t = _pad(tables, _MAX)  # padding past a table's last (2^63 - 1) entry changes no search
    q = _pad(queries, 0)
    idx = torch.searchsorted(t, q)
    hit = torch.gather(t, 1, idx) == q
    dev = q.device
    rows = torch.where(hit, torch.gather(_pad(mappings, 0), 1, idx), torch.tensor(defaults, device=dev).unsqueeze(1))
    sizes = [x.numel() for x in queries]
    valid = torch.arange(q.shape[1], device=dev).unsqueeze(0) < torch.tensor(sizes, device=dev).unsqueeze(1)
    return list(torch.split(rows[valid], sizes)), ~hit[valid]


def _lex_order(keys: torch.Tensor, segments: torch.Tensor, descending: bool = False) -> torch.Tensor:
    """The stable order by (segment ascending, key), ties kept in input order."""
    o = torch.argsort(keys, descending=descending, stable=True)
    return o[torch.argsort(segments[o], stable=True)]


@torch.no_grad()
def batched_lfu_round(
    tsizes: list[int], state: dict[str, list[torch.Tensor]], hists: list[torch.Tensor], k: int
) -> None:
    """One lfu round (TorchRec's ``MCHManagedCollisionModule._coalesce_history`` with
    ``LFU_EvictionPolicy`` and the ``counts >= k`` admission filter) of several features at
    once, updating their sorted raw ids, rows and counts in place and their eviction /
    admission counters. ``tsizes``: per feature, its rows (zch_size); ``state``: per feature its
    ``ReplicatedMCH`` tensors ``_mch_sorted_raw_ids``, ``_mch_remapped_ids_mapping``,
    ``_mch_counts`` and ``_counters``; ``hists``: per feature, the pending history (int64,
    non-empty).

    Same result as the per-feature TorchRec round, step for step: per feature the distinct
    ids by count (descending, ties by ascending id), the table's counts updated, the last
    (default) slot pinned at the highest count, table and new ids ranked by count (stable:
    table entries before new ids, each in order), the best ``rows`` kept, the i-th evicted
    slot given to the i-th admitted id, the table re-sorted by raw id."""
    f_all = len(tsizes)
    dev = state["_mch_sorted_raw_ids"][0].device
    tf = _segment_ids(tsizes, dev)
    tstart = torch.tensor([0] + tsizes[:-1], dtype=torch.int64, device=dev).cumsum(0)
    tsz = torch.tensor(tsizes, dtype=torch.int64, device=dev)
    ids = torch.cat(state["_mch_sorted_raw_ids"])
    rows = torch.cat(state["_mch_remapped_ids_mapping"])
    counts = torch.cat(state["_mch_counts"])
    # distinct ids and counts per feature (torch.unique per feature: ascending ids)
    h = torch.cat(hists)
    hf = _segment_ids([x.numel() for x in hists], dev)
    o = _lex_order(h, hf)
    hs, hfs = h[o], hf[o]
    first = torch.ones_like(hs, dtype=torch.bool)
    first[1:] = (hs[1:] != hs[:-1]) | (hfs[1:] != hfs[:-1])
    starts = torch.nonzero(first).squeeze(1)
    uid, uf = hs[starts], hfs[starts]
    ucnt = torch.diff(starts, append=torch.tensor([hs.numel()], device=dev))
    if k > 1:  # admission: ids seen fewer than k times in the window are dropped
        m = ucnt >= k
        uid, uf, ucnt = uid[m], uf[m], ucnt[m]
    # by count, descending, per feature
    o = _lex_order(ucnt, uf, descending=True)
    qid, qf, qcnt = uid[o], uf[o], ucnt[o]
    # ids that already hold a row: add their counts
    qn = torch.bincount(qf, minlength=f_all)
    qrank = torch.arange(qid.numel(), device=dev) - (torch.cumsum(qn, 0) - qn)[qf]
    qpad = torch.zeros(f_all, int(qn.max()) if qid.numel() else 0, dtype=torch.int64, device=dev)
    qpad[qf, qrank] = qid
    tpad = _pad(list(torch.split(ids, tsizes)), _MAX)
    at = torch.searchsorted(tpad, qpad)[qf, qrank]
    hit = tpad[qf, at] == qid
    counts[tstart[qf[hit]] + at[hit]] += qcnt[hit]
    nid, nf, ncnt = qid[~hit], qf[~hit], qcnt[~hit]
    counts[tstart + tsz - 1] = _MAX  # the default slot is never evicted
    # rank table slots and new ids per feature; the best zch_size keep / take a slot
    nn_ = torch.bincount(nf, minlength=f_all)
    mf = torch.cat([tf, nf])
    o = _lex_order(torch.cat([counts, ncnt]), mf, descending=True)
    gsize = tsz + nn_
    r = torch.arange(o.numel(), device=dev) - (torch.cumsum(gsize, 0) - gsize)[mf[o]]
    top = r < tsz[mf[o]]
    is_new = o >= counts.numel()
    admitted = o[top & is_new] - counts.numel()
    evicted = o[~top & ~is_new]
    was_empty = ids[evicted] == _MAX
    ids[evicted] = nid[admitted]
    counts[evicted] = ncnt[admitted]
    # re-sort each table by raw id
    o = _lex_order(ids, tf)
    ids, rows, counts = ids[o], rows[o], counts[o]
    torch._foreach_copy_(state["_mch_sorted_raw_ids"], list(torch.split(ids, tsizes)))
    torch._foreach_copy_(state["_mch_remapped_ids_mapping"], list(torch.split(rows, tsizes)))
    torch._foreach_copy_(state["_mch_counts"], list(torch.split(counts, tsizes)))
    got = torch.bincount(tf[evicted], minlength=f_all)
    filled = torch.bincount(tf[evicted][was_empty], minlength=f_all)
    # [evictions, admissions] per feature, added to _counters[2:4]
    torch._foreach_add_([c[2:] for c in state["_counters"]], list(torch.stack([got - filled, got], 1).unbind(0)))


@torch.no_grad()
def batched_mark_seen(
    tables: list[torch.Tensor],
    mappings: list[torch.Tensor],
    last_seen: list[torch.Tensor],
    hists: list[torch.Tensor],
    hist_iters: list[torch.Tensor],
    found: tuple[list[torch.Tensor], torch.Tensor] | None = None,
) -> None:
    """After a round: per feature, every row whose id is in the history gets the last step
    that id was seen (``last_seen[row] = max(last_seen[row], step)``, in place).

    Args:
        tables / mappings: per feature, the table after the round (as :func:`batched_lookup`).
        last_seen: per feature, its ``_row_last_seen`` (int64 [rows], a step per row).
        hists / hist_iters: per feature, the round's history: ids (int64 [n_f]) and the
            training step each was seen at (int64 [n_f]).
        found: the history's :func:`batched_lookup` in the tables after the round, if done
            already (rows per feature, misses concatenated); None: looked up here.
    Every sighting counts, also one below ``admission_min_count`` of an id that holds a row:
    the id was looked up and read its row, so it is not cold.
    """
    if not tables:
        return
    sizes = [t.numel() for t in tables]
    rows, miss = found or batched_lookup(tables, mappings, hists, [0] * len(tables))
    dev = tables[0].device
    start = torch.tensor([0] + sizes[:-1], dtype=torch.int64, device=dev).cumsum(0)
    flat = torch.cat(last_seen)
    idx = torch.cat(rows) + start[_segment_ids([h.numel() for h in hists], dev)]
    hit = ~miss
    flat.scatter_reduce_(0, idx[hit], torch.cat(hist_iters)[hit], reduce="amax", include_self=True)
    torch._foreach_copy_(last_seen, list(torch.split(flat, sizes)))


@torch.no_grad()
def batched_ttl_expire(
    tables: list[torch.Tensor],
    mappings: list[torch.Tensor],
    metadata: list[list[torch.Tensor]],
    last_seen: list[torch.Tensor],
    expired: list[torch.Tensor],
    step: int,
    ttl: int,
) -> None:
    """TTL eviction of several features at once, in place: a slot holding an id whose row was
    last seen ``ttl`` or more steps before ``step`` (not seen in the last ``ttl`` training
    steps) becomes empty, as a slot never filled is: raw id ``2^63 - 1``, policy metadata 0
    (so the next round's admitted ids take it first); the table is re-sorted by raw id (stable,
    as TorchRec's ``_sort_mch_buffers``, so the default slot stays last). The row keeps its
    weights and goes to the next admitted id, as a policy eviction's does.

    Args:
        tables / mappings: per feature, ``_mch_sorted_raw_ids`` / ``_mch_remapped_ids_mapping``.
        metadata: per policy metadata name, per feature its per-slot tensor (int64 [rows]).
        last_seen: per feature, ``_row_last_seen`` (int64 [rows], by row).
        expired: per feature, an int64 [1] counter, increased by the slots emptied.
    """
    if not tables:
        return
    sizes = [t.numel() for t in tables]
    dev = tables[0].device
    tf = _segment_ids(sizes, dev)
    start = torch.tensor([0] + sizes[:-1], dtype=torch.int64, device=dev).cumsum(0)
    ids, rows = torch.cat(tables), torch.cat(mappings)
    seen = torch.cat(last_seen)[start[tf] + rows]
    gone = (ids != _MAX) & (step - seen >= ttl)
    if not bool(gone.any()):
        return
    ids[gone] = _MAX
    metas = [torch.cat(m) for m in metadata]
    for m in metas:
        m[gone] = 0
    o = _lex_order(ids, tf)
    torch._foreach_copy_(tables, list(torch.split(ids[o], sizes)))
    torch._foreach_copy_(mappings, list(torch.split(rows[o], sizes)))
    for per_feature, m in zip(metadata, metas):
        torch._foreach_copy_(per_feature, list(torch.split(m[o], sizes)))
    torch._foreach_add_(expired, list(torch.bincount(tf[gone], minlength=len(sizes)).view(-1, 1).unbind(0)))
