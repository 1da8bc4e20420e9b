import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from recsys_dist.data.loader import ParquetBatchLoader
from recsys_dist.data.loader.columns import take_bags
from recsys_dist.errors import DataError

DENSE, SPARSE = ["I1", "I2"], ["C1", "C2", "C3"]


def make_parquet(tmp_path, n):
    t = pa.table(
        {
            "label": pa.array(np.arange(n) % 2, pa.float32()),
            "I1": pa.array(np.arange(n), pa.float32()),
            "I2": pa.array(-np.arange(n), pa.float32()),
            **{c: pa.array(np.arange(n) * 10 + j, pa.int64()) for j, c in enumerate(SPARSE)},
        }
    )
    p = tmp_path / "d.parquet"
    pq.write_table(t, p)
    return str(p)


def loaders(path, ws, bs, **kw):
    return [ParquetBatchLoader(path, bs, r, ws, DENSE, SPARSE, **kw) for r in range(ws)]


@pytest.mark.parametrize("n,ws,bs", [(10, 3, 2), (4, 2, 4), (7, 1, 3), (0, 2, 2)])
def test_same_steps_every_rank_and_every_row_once(tmp_path, n, ws, bs):
    ls = loaders(make_parquet(tmp_path, n), ws, bs)
    per_rank = [list(l) for l in ls]
    assert len({len(b) for b in per_rank}) == 1
    seen = []
    for batches in per_rank:
        for b in batches:
            assert b.dense_features.shape == (bs, 2) and b.labels.shape == (bs,)
            real = b.weights > 0
            seen += b.dense_features[real, 0].int().tolist()
    assert sorted(seen) == list(range(n))


def test_kjt_layout_is_key_major(tmp_path):
    (l,) = loaders(make_parquet(tmp_path, 4), 1, 2)
    b = next(iter(l))
    kjt = b.sparse_features
    assert kjt.keys() == SPARSE
    assert kjt.values().dtype == torch.int64 and kjt.values().tolist() == [0, 10, 1, 11, 2, 12]
    assert kjt.lengths().tolist() == [1] * 6


def test_drop_remainder_and_shuffle_is_seeded(tmp_path):
    p = make_parquet(tmp_path, 10)
    (l,) = loaders(p, 1, 3, remainder="drop", shuffle=True, seed=5)
    assert len(l) == 3
    first = [b.dense_features[:, 0].tolist() for b in l]
    (again,) = loaders(p, 1, 3, remainder="drop", shuffle=True, seed=5)
    assert [b.dense_features[:, 0].tolist() for b in again] == first
    l.set_epoch(1)
    assert [b.dense_features[:, 0].tolist() for b in l] != first


def test_ids_out_of_range_and_missing_column(tmp_path):
    p = make_parquet(tmp_path, 4)
    with pytest.raises(DataError, match=r"column C1: ids must lie in \[0, 5\)"):
        list(ParquetBatchLoader(p, 2, 0, 1, DENSE, SPARSE, num_embeddings=[5, 100, 100]))
    with pytest.raises(DataError, match=r"missing columns \['C9'\]"):
        ParquetBatchLoader(p, 2, 0, 1, DENSE, ["C9"])


def write_files(tmp_path, sizes, row_group_size=4, multi_hot=False):
    """Files of consecutive row ids (I1 = global row id), small row groups."""
    paths, start = [], 0
    for k, n in enumerate(sizes):
        ids = np.arange(start, start + n)
        cols = {
            "label": pa.array(ids % 2, pa.float32()),
            "I1": pa.array(ids, pa.float32()),
            "I2": pa.array(-ids, pa.float32()),
        }
        for j, c in enumerate(SPARSE):
            if multi_hot and c == "C2":
                cols[c] = pa.array([[int(i)] * int(i % 6) for i in ids], pa.list_(pa.int64()))
            else:
                cols[c] = pa.array(ids * 10 + j, pa.int64())
        p = tmp_path / f"part{k}.parquet"
        pq.write_table(pa.table(cols), p, row_group_size=row_group_size)
        paths.append(str(p))
        start += n
    return paths


def rows_seen(loaders):
    return [[b.dense_features[b.weights > 0, 0].int().tolist() for b in l] for l in loaders]


@pytest.mark.parametrize("ws,bs", [(1, 6), (2, 3), (3, 2)])
def test_streamed_windows_and_files_every_row_once_same_global_batches(tmp_path, ws, bs):
    """37 rows in 3 files of 4-row groups, 8-row shuffle windows: every rank the same number
    of steps, every row exactly once, and global batch g holds the same rows at any world size."""
    paths = write_files(tmp_path, [13, 11, 13])
    kw = dict(shuffle=True, seed=3, shuffle_buffer_rows=8)
    single = rows_seen([ParquetBatchLoader(paths, 6, 0, 1, DENSE, SPARSE, **kw)])[0]
    per_rank = rows_seen([ParquetBatchLoader(paths, bs, r, ws, DENSE, SPARSE, **kw) for r in range(ws)])
    assert len({len(b) for b in per_rank}) == 1
    flat = sorted(x for batches in per_rank for b in batches for x in b)
    assert flat == list(range(37))
    for g, global_rows in enumerate(single):
        assert sorted(x for batches in per_rank for x in batches[g]) == sorted(global_rows)


def test_shuffle_changes_with_epoch_and_window_order(tmp_path):
    paths = write_files(tmp_path, [20, 20])
    loader = ParquetBatchLoader(paths, 5, 0, 1, DENSE, SPARSE, shuffle=True, seed=1, shuffle_buffer_rows=8)
    e0 = rows_seen([loader])[0]
    loader.set_epoch(1)
    e1 = rows_seen([loader])[0]
    assert e0 != e1 and sorted(sum(e0, [])) == sorted(sum(e1, [])) == list(range(40))


def test_iter_from_restores_the_exact_stream(tmp_path):
    paths = write_files(tmp_path, [30])
    loader = ParquetBatchLoader(paths, 4, 1, 2, DENSE, SPARSE, shuffle=True, seed=9, shuffle_buffer_rows=8)
    full = [b.dense_features.tolist() for b in loader]
    assert [b.dense_features.tolist() for b in loader.iter_from(2)] == full[2:]


def test_multi_hot_bags_of_variable_length(tmp_path):
    (path,) = write_files(tmp_path, [12], multi_hot=True)
    loader = ParquetBatchLoader(path, 6, 0, 1, DENSE, SPARSE)
    b = next(iter(loader))
    jt = b.sparse_features["C2"]
    assert jt.lengths().tolist() == [0, 1, 2, 3, 4, 5]  # row i holds i % 6 copies of id i
    assert jt.values().tolist() == [1, 2, 2, 3, 3, 3, 4, 4, 4, 4, 5, 5, 5, 5, 5]
    assert b.sparse_features["C1"].lengths().tolist() == [1] * 6


def test_schema_mismatch_and_errors_from_the_prefetch_thread(tmp_path):
    paths = write_files(tmp_path, [8, 8])
    pq.write_table(pq.read_table(paths[1]).set_column(1, "I1", pa.array(np.arange(8), pa.int64())), paths[1])
    with pytest.raises(DataError, match="part1.parquet: schema differs from .*part0.parquet"):
        ParquetBatchLoader(paths, 4, 0, 1, DENSE, SPARSE)
    (bad,) = write_files(tmp_path / "x" if (tmp_path / "x").mkdir() is None else tmp_path, [8])
    loader = ParquetBatchLoader(bad, 4, 0, 1, DENSE, SPARSE, num_embeddings=[10, 10, 10], prefetch=2)
    with pytest.raises(DataError, match="ids must lie in"):
        list(loader)


def test_ids_beyond_int32_and_multi_hot_bags_survive_shuffled_windows(tmp_path):
    """One-hot ids are gathered as int32 when they fit; a column that does not fit keeps its
    exact int64 values. Multi-hot bags stay attached to their rows across windows and padding."""
    paths = write_files(tmp_path, [23, 14], multi_hot=True)
    big = pq.read_table(paths[0])
    pq.write_table(
        big.set_column(big.schema.get_field_index("C3"), "C3", pa.array(np.arange(23) + (1 << 40), pa.int64())),
        paths[0],
        row_group_size=4,
    )
    loader = ParquetBatchLoader(paths, 5, 0, 1, DENSE, SPARSE, shuffle=True, seed=2, shuffle_buffer_rows=8)
    seen = []
    for b in loader:
        ids = b.dense_features[:, 0].long()
        assert torch.equal(b.sparse_features["C1"].values(), ids * 10)
        c3 = b.sparse_features["C3"].values()
        assert c3.dtype == torch.int64 and torch.equal(c3, torch.where(ids < 23, ids + (1 << 40), ids * 10 + 2))
        c2 = b.sparse_features["C2"]
        assert c2.lengths().tolist() == (ids % 6).tolist()
        assert c2.values().tolist() == [int(i) for i in ids for _ in range(int(i) % 6)]
        seen += ids[b.weights > 0].tolist()
    assert sorted(seen) == list(range(37))


def test_partition_row_groups_balances_rows():
    from recsys_dist.data.loader import partition_row_groups

    # largest first, each to the lightest rank (ties: lowest): 0->r0, 1->r1, 2->r0, 3->r1
    assert partition_row_groups([4, 4, 4, 1], 2) == [[0, 2], [1, 3]]
    assert partition_row_groups([4, 4, 4, 1], 3) == [[0, 3], [1], [2]]
    assert partition_row_groups([3], 2) == [[0], []]


@pytest.mark.parametrize("ws", [2, 3])
@pytest.mark.parametrize("remainder", ["pad", "drop"])
@pytest.mark.parametrize("shuffle", [False, True])
def test_row_groups_mode_reads_own_groups_equal_steps_every_row_once(tmp_path, ws, remainder, shuffle, monkeypatch):
    """41 rows in 3 files of 4-row groups (11 groups, the last of each file short). Each rank
    reads only its own row groups; all ranks run the same number of steps; with pad every row
    is seen exactly once, with drop every rank stops after the smallest share's full batches."""
    paths = write_files(tmp_path, [13, 11, 17])
    read = {}
    orig = ParquetBatchLoader._read

    def spy(self, groups, handles):
        read.setdefault(self.rank, []).extend(groups)
        return orig(self, groups, handles)

    monkeypatch.setattr(ParquetBatchLoader, "_read", spy)
    bs = 3
    ls = [
        ParquetBatchLoader(
            paths,
            bs,
            r,
            ws,
            DENSE,
            SPARSE,
            shuffle=shuffle,
            seed=4,
            remainder=remainder,
            shuffle_buffer_rows=8,
            rank_reads="row_groups",
        )
        for r in range(ws)
    ]
    per_rank = rows_seen(ls)
    sizes = [n for *_, n in ls[0].row_groups]
    owned = [sorted(read.get(r, [])) for r in range(ws)]
    assert sorted(g for o in owned for g in o) == list(range(len(sizes)))  # disjoint, all read once
    rows = [sum(sizes[g] for g in o) for o in owned]
    assert rows == {2: [21, 20], 3: [15, 13, 13]}[ws]  # nine 4-row groups, one of 3, two of 1
    steps = {len(b) for b in per_rank}
    assert steps == {len(ls[0])}
    flat = [x for batches in per_rank for b in batches for x in b]
    assert len(flat) == len(set(flat))
    if remainder == "pad":  # as many steps as the largest share needs
        assert len(ls[0]) == {2: 7, 3: 5}[ws] and sorted(flat) == list(range(41))
    else:  # as many as the smallest share fills: 2 x 6 x 3 or 3 x 4 x 3 = 36 rows
        assert len(ls[0]) == {2: 6, 3: 4}[ws] and len(flat) == 36
    for r, batches in enumerate(per_rank):  # a rank's rows come from its own groups only
        mine = {i for g in owned[r] for i in range(*_group_rows(ls[r], g))}
        assert {x for b in batches for x in b} <= mine


def _group_rows(loader, g):
    """Global row ids [start, end) of row group g (files hold consecutive ids)."""
    start = sum(n for *_, n in loader.row_groups[:g])
    return start, start + loader.row_groups[g][2]


def test_row_groups_mode_is_seeded_and_resumable(tmp_path):
    paths = write_files(tmp_path, [30, 10])
    kw = dict(shuffle=True, seed=6, shuffle_buffer_rows=8, rank_reads="row_groups")
    a, b = (ParquetBatchLoader(paths, 4, 1, 2, DENSE, SPARSE, **kw) for _ in range(2))
    full = [x.dense_features.tolist() for x in a]
    assert [x.dense_features.tolist() for x in b] == full
    assert [x.dense_features.tolist() for x in a.iter_from(2)] == full[2:]
    a.set_epoch(1)
    assert [x.dense_features.tolist() for x in a] != full
    (tmp_path / "small").mkdir()
    (small,) = write_files(tmp_path / "small", [5])  # row groups of 4 and 1 rows: rank 1 owns 1 row
    with pytest.raises(DataError, match=r"fewest rows a rank owns \(1, data.rank_reads: row_groups\)"):
        ParquetBatchLoader(small, 4, 0, 2, DENSE, SPARSE, remainder="drop", rank_reads="row_groups")


@pytest.mark.parametrize("multi_hot", [False, True])
def test_blocks_of_any_size_give_the_same_batches(tmp_path, monkeypatch, multi_hot):
    """The background thread hands over blocks of up to BLOCK_BATCHES batches: the batches
    (values, lengths, dense, labels, weights, padding) do not depend on the block size, nor on
    prefetch (in the calling thread) or resuming mid-epoch."""
    import recsys_dist.data.loader as loader_mod

    paths = write_files(tmp_path, [23, 14], multi_hot=multi_hot)

    def batches(block: int, prefetch: int, start: int = 0) -> list:
        monkeypatch.setattr(loader_mod, "BLOCK_BATCHES", block)
        out = []
        for rank in range(2):
            loader = ParquetBatchLoader(
                paths, 3, rank, 2, DENSE, SPARSE, shuffle=True, seed=1, shuffle_buffer_rows=16, prefetch=prefetch
            )
            loader.set_epoch(1)
            for b in loader.iter_from(start):
                kjt = b.sparse_features
                out.append(
                    [kjt.values().tolist(), kjt.lengths().tolist(), b.dense_features.tolist()]
                    + [b.labels.tolist(), b.weights.tolist()]
                )
        return out

    reference = batches(64, 0)
    assert len(reference) == 2 * 7 and reference[-1][4] != [1.0, 1.0, 1.0]  # 37 rows: the last batch pads
    for block, prefetch in ((1, 2), (2, 2), (3, 0), (64, 2), (64, 200)):
        assert batches(block, prefetch) == reference, (block, prefetch)
    assert batches(2, 2, start=3) == reference[3:7] + reference[7 + 3 :]


def test_reopen_keeps_every_setting_but_the_changed_ones(tmp_path):
    p = make_parquet(tmp_path, 10)
    (l,) = loaders(p, 1, 3, remainder="drop", shuffle=True, seed=5)
    same = l.reopen()
    assert [b.dense_features[:, 0].tolist() for b in same] == [b.dense_features[:, 0].tolist() for b in l]
    ordered = l.reopen(shuffle=False, remainder="pad")
    assert len(ordered) == 4 and not ordered.shuffle and ordered.seed == 5
    real = [x for b in ordered for x, w in zip(b.dense_features[:, 0].tolist(), b.weights.tolist()) if w > 0]
    assert real == list(range(10))  # file order, every row once; the padding rows weigh 0
    with pytest.raises(TypeError, match="unknown options"):
        l.reopen(shufle=False)


def test_take_bags_matches_slicing_with_empty_bags_repeats_and_any_order():
    rng = np.random.default_rng(0)
    lengths = rng.integers(0, 4, size=50)  # zeros: empty bags
    values = rng.integers(0, 1000, size=int(lengths.sum()))
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    for idx in (rng.integers(0, 50, size=80), np.arange(50)[::-1], np.zeros(0, np.int64)):
        got_lengths, got_values = take_bags(lengths, values, idx)
        want = [values[starts[i] : starts[i] + lengths[i]] for i in idx]
        assert np.array_equal(got_lengths, lengths[idx])
        assert np.array_equal(got_values, np.concatenate(want) if want else np.zeros(0, np.int64))


def test_options_built_once_or_given_by_name_read_the_same_rows(tmp_path):
    """A loader's options are one ``LoaderOptions``, built once and passed (the Trainer builds
    it from the ``data`` section; the constructor took 17 parameters); its fields given by name
    still work, over the options or alone, and give the same batches."""
    import dataclasses
    import typing

    from recsys_dist.data.loader import LoaderOptions
    from recsys_dist.data.loader.options import LoaderKeywords

    p = make_parquet(tmp_path, 23)
    opts = LoaderOptions(shuffle=True, seed=3, remainder="drop", shuffle_buffer_rows=8, num_embeddings=[300] * 3)
    by_name = ParquetBatchLoader(p, 4, 1, 2, DENSE, SPARSE, **dataclasses.asdict(opts))
    built = ParquetBatchLoader(p, 4, 1, 2, DENSE, SPARSE, opts)
    over = ParquetBatchLoader(p, 4, 1, 2, DENSE, SPARSE, dataclasses.replace(opts, seed=0), seed=3)
    rows = [[b.dense_features[:, 0].tolist() for b in loader] for loader in (by_name, built, over)]
    assert rows[0] == rows[1] == rows[2] and len(rows[0]) == 2
    assert sorted(x for r in rows[0] for x in r) != sorted(range(8))  # shuffled: not the first rows
    assert built.options == opts and built.reopen(seed=4).options == dataclasses.replace(opts, seed=4)
    with pytest.raises(TypeError, match=r"unknown options \['shufle'\]"):
        ParquetBatchLoader(p, 4, 0, 1, DENSE, SPARSE, shufle=True)
    with pytest.raises(ValueError, match="remainder must be 'pad' or 'drop', got 'keep'"):
        ParquetBatchLoader(p, 4, 0, 1, DENSE, SPARSE, remainder="keep")
    # The keywords type checkers see are the options' fields, with their types.
    hints = typing.get_type_hints(LoaderOptions)
    assert list(hints) == [f.name for f in dataclasses.fields(LoaderOptions)]
    assert typing.get_type_hints(LoaderKeywords) == hints
