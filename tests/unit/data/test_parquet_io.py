import os
import threading
import time

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from recsys_dist.data.loader import ParquetBatchLoader
from recsys_dist.data.parquet_io import open_parquet, read_pool
from recsys_dist.errors import DataError
from tests.unit.data.test_loader import DENSE, SPARSE, write_files

_ALIVE: list = []  # Arrow keeps raw pointers to pools: the test's pools must outlive every buffer


@pytest.fixture
def track(monkeypatch):
    """``track()`` -> (default, system): fresh pools from now on, counting only the
    allocations after the call, standing in for pyarrow's default pool and its system pool."""
    monkeypatch.delenv("ARROW_DEFAULT_MEMORY_POOL", raising=False)
    before = pa.default_memory_pool()

    def start():
        default, system = pa.proxy_memory_pool(before), pa.proxy_memory_pool(pa.system_memory_pool())
        _ALIVE.extend((default, system))
        monkeypatch.setattr(pa, "system_memory_pool", lambda: system)
        pa.set_memory_pool(default)
        return default, system

    yield start
    pa.set_memory_pool(before)


@pytest.mark.parametrize("prefetch", [0, 2])
def test_windows_decode_into_the_system_pool_and_the_default_is_restored(tmp_path, track, prefetch):
    files = write_files(tmp_path, [20_000, 20_000], row_group_size=5_000, multi_hot=True)
    loader = ParquetBatchLoader(files, 1_000, 0, 1, DENSE, SPARSE, prefetch=prefetch)
    default, system = track()
    assert sum(1 for _ in loader) == len(loader)
    # Each window's Arrow buffers (label, 2 dense and 3 id columns, a multi-hot list: > 1 MB)
    # came from the system pool; the default pool held only the bag lengths (4 bytes a row).
    assert system.max_memory() > 1_000_000
    assert default.max_memory() < system.max_memory() / 4
    assert pa.default_memory_pool().max_memory() == default.max_memory()  # the default is back


def test_a_pool_named_in_the_environment_is_respected(tmp_path, track, monkeypatch):
    path = write_files(tmp_path, [1000])[0]
    default, system = track()
    monkeypatch.setenv("ARROW_DEFAULT_MEMORY_POOL", "mimalloc")
    assert read_pool().max_memory() == default.max_memory()
    open_parquet(path).read_row_groups([0], ["label", "I1", "C1"])
    assert default.max_memory() > 0 and system.max_memory() == 0


def bag_files(tmp_path, value_type):
    """Two files of 4-row groups whose multi-hot C2 has empty lists, null lists and null slots
    backed by non-empty sub-lists (which hold no ids); I1 = the row's position in the files."""
    rng, paths, start = np.random.default_rng(0), [], 0
    for k, n in enumerate([13, 11]):
        offsets = np.concatenate([[0], np.cumsum(rng.integers(0, 4, n))]).astype(np.int32)
        values = pa.array(rng.integers(0, 50, offsets[-1]), value_type)
        c2 = pa.ListArray.from_arrays(pa.array(offsets), values, mask=pa.array(np.arange(n) % 3 == 1))
        pos = np.arange(start, start + n)
        t = pa.table(
            {
                "label": pa.array(pos % 2, pa.float32()),
                "I1": pa.array(pos, pa.float32()),
                "C1": pa.array(pos % 7, pa.int64()),
                "C2": c2,
            }
        )
        paths.append(str(tmp_path / f"bags{k}.parquet"))
        pq.write_table(t, paths[-1], row_group_size=4)
        start += n
    return paths


@pytest.mark.parametrize("value_type", [pa.int64(), pa.int32()])
@pytest.mark.parametrize("prefetch,buffer", [(0, 8), (2, 8), (0, 1 << 20)])
def test_multi_hot_bags_read_chunk_by_chunk_match_pyarrow(tmp_path, value_type, prefetch, buffer):
    """Each row's C2 bag (over row groups, files and windows; nulls -> empty) is the row's list
    as pyarrow reads it, in shuffled order too."""
    paths = bag_files(tmp_path, value_type)
    truth = [v or [] for p in paths for v in pq.read_table(p).column("C2").to_pylist()]
    loader = ParquetBatchLoader(
        paths, 3, 0, 1, ["I1"], ["C1", "C2"], shuffle=True, shuffle_buffer_rows=buffer, prefetch=prefetch
    )
    seen = []
    for b in loader:
        bags = b.sparse_features["C2"]
        assert bags.values().dtype == torch.int64
        for row, bag in zip(b.dense_features[b.weights > 0, 0].int().tolist(), bags.to_dense()):
            seen.append(row)
            assert bag.tolist() == truth[row], row
    assert sorted(seen) == list(range(24))


def test_sliced_chunks_of_a_list_column(tmp_path):
    """A window whose list chunks are slices (offsets not from 0, a null slot backed by ids,
    an empty chunk) gives the bags of the slices."""
    (path,) = write_files(tmp_path, [6], multi_hot=True)
    loader = ParquetBatchLoader(path, 2, 0, 1, DENSE, ["C1", "C2"])
    whole = pa.array([[9, 9], [1], None, [], [2, 3], [4], [5, 6, 7], [8]], pa.list_(pa.int64()))
    whole = pa.ListArray.from_arrays(whole.offsets, whole.values, mask=pa.array([i == 6 for i in range(8)]))
    chunks = [whole.slice(1, 3), whole.slice(4, 0), whole.slice(4, 3)]  # rows 1..3, none, 4..6

    class Handle:
        def read_row_groups(self, run, columns):
            t = pq.read_table(path, columns=columns)
            return t.set_column(t.schema.get_field_index("C2"), "C2", pa.chunked_array(chunks))

    lengths, values = loader._read([0], {0: Handle()}).ids[1]
    assert lengths.tolist() == [1, 0, 0, 2, 1, 0] and values.tolist() == [1, 2, 3, 4]


@pytest.mark.parametrize("shuffle", [False, True])
def test_errors_name_the_file_and_row_that_hold_the_bad_value(tmp_path, shuffle):
    """A window spans row groups of several files (here both, in 8-row windows of shuffled row
    groups too): an error names the file and row holding the value, not the window's first file."""
    paths = bag_files(tmp_path, pa.int64())
    bad = pq.read_table(paths[1])
    c2 = bad.column("C2").to_pylist()
    c2[6] = [1, 99]  # file 1, row 6 (its second row group)
    pq.write_table(bad.set_column(3, "C2", pa.array(c2, pa.list_(pa.int64()))), paths[1], row_group_size=4)
    kw = dict(shuffle=shuffle, seed=1, shuffle_buffer_rows=1 << 20)
    with pytest.raises(DataError, match=r"bags1.parquet, row 6, column C2: ids must lie in \[0, 50\), found 99"):
        list(ParquetBatchLoader(paths, 3, 0, 1, ["I1"], ["C1", "C2"], num_embeddings=[7, 50], **kw))
    dense = bad.column("I1").to_numpy().copy()
    dense[9] = np.inf  # file 1, row 9 (its third row group)
    pq.write_table(bad.set_column(1, "I1", pa.array(dense)), paths[1], row_group_size=4)
    with pytest.raises(DataError, match=r"bags1.parquet, row 9, column I1: inf is not finite"):
        list(ParquetBatchLoader(paths, 3, 0, 1, ["I1"], ["C1", "C2"], **kw))


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs a FIFO")
def test_opening_a_file_changes_no_process_wide_pool(tmp_path, monkeypatch):
    """While a loader thread opens a file (here held in open() on a FIFO, as a slow file
    system would), other threads keep their default pool, and a ``pa.set_memory_pool`` made
    meanwhile stands (swapping the default for the open undid it)."""
    monkeypatch.delenv("ARROW_DEFAULT_MEMORY_POOL", raising=False)
    before = pa.default_memory_pool()
    fifo = str(tmp_path / "slow.parquet")
    os.mkfifo(fifo)
    errors: list = []
    opener = threading.Thread(
        target=lambda: errors.append(pytest.raises((OSError, pa.ArrowInvalid), open_parquet, fifo)), daemon=True
    )
    opener.start()
    mine = pa.proxy_memory_pool(before)
    _ALIVE.append(mine)
    try:
        time.sleep(0.3)  # the opener waits in open() until a writer opens the FIFO
        assert pa.default_memory_pool().backend_name == before.backend_name
        pa.set_memory_pool(mine)
        for _ in range(200):  # let it go: it reads an empty file and fails
            try:
                os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
                break
            except OSError:  # no reader yet
                time.sleep(0.05)
        opener.join(10)
        assert errors and not opener.is_alive()
        arr = pa.array(list(range(1000)), pa.int64())  # allocated by pyarrow (not a view of numpy)
        assert mine.bytes_allocated() >= 8000  # still the default pool
        del arr
    finally:
        pa.set_memory_pool(before)


@pytest.mark.parametrize("column", ["C1", "C2"])
def test_a_null_id_is_an_error_naming_file_row_and_column(tmp_path, column):
    """A null id (one-hot, or an item of a multi-hot list) stops the read: it was read as a
    float NaN and cast to -2**63, an id without a bound check and a bogus one with it."""
    paths = bag_files(tmp_path, pa.int64())
    t = pq.read_table(paths[0])
    if column == "C1":
        t = t.set_column(2, "C1", pa.array([None if i == 5 else 1 for i in range(13)], pa.int64()))
    else:
        c2 = t.column("C2").to_pylist()
        c2[5] = [1, None]
        t = t.set_column(3, "C2", pa.array(c2, pa.list_(pa.int64())))
    pq.write_table(t, paths[0], row_group_size=4)
    for bounds in (None, [7, 50]):
        loader = ParquetBatchLoader(paths, 3, 0, 1, ["I1"], ["C1", "C2"], num_embeddings=bounds)
        with pytest.raises(DataError, match=rf"bags0.parquet, row 5, column {column}: a null id"):
            list(loader)


@pytest.mark.parametrize("tasks", [1, 2])
def test_a_null_or_nan_label_is_an_error_naming_file_row_and_column(tmp_path, tasks):
    """A label read as NaN (null or NaN) made a NaN loss and NaN metrics without a word."""
    paths = bag_files(tmp_path, pa.int64())
    t = pq.read_table(paths[1])
    labels = [None if i == 3 else 1.0 for i in range(11)]
    t = t.append_column("label:b", pa.array(labels, pa.float32()))
    t = t.append_column("label:a", pa.array([float("nan") if i == 7 else 0.0 for i in range(11)], pa.float32()))
    pq.write_table(t, paths[1], row_group_size=4)
    t0 = pq.read_table(paths[0])
    for name in ("label:b", "label:a"):
        t0 = t0.append_column(name, pa.array(np.zeros(13, np.float32)))
    pq.write_table(t0, paths[0], row_group_size=4)
    columns, match = (
        (["label:a"], r"bags1.parquet, row 7, column label:a: label nan")
        if tasks == 1
        else (
            ["label:a", "label:b"],
            r"bags1.parquet, row 3, column label:b: label nan",
        )
    )
    loader = ParquetBatchLoader(paths, 3, 0, 1, ["I1"], ["C1", "C2"], label_columns=columns)
    with pytest.raises(DataError, match=match):
        list(loader)


@pytest.mark.parametrize(
    "column, values, words",
    [
        ("C1", pa.array([1.7, 2.2] * 4), "C1: a sparse feature's ids must be integers .* found double"),
        ("C2", pa.array(["a", "b"] * 4), "C2: a sparse feature's ids must be integers .* found string"),
        ("I1", pa.array(["x", "y"] * 4), "I1: must be numeric, found string"),
        ("label", pa.array(["1", "0"] * 4), "label: must be numeric, found string"),
    ],
)
def test_columns_of_the_wrong_type_are_refused_naming_file_and_column(tmp_path, column, values, words):
    # A float id column was truncated to integer ids silently (exit 0); strings failed in numpy.
    import pyarrow.parquet as pq

    from recsys_dist.errors import DataError

    path = write_files(tmp_path, [8])[0]
    table = pq.read_table(path)
    table = table.set_column(table.schema.get_field_index(column), column, values)
    pq.write_table(table, path)
    with pytest.raises(DataError, match=f"{path}, column {words}"):
        ParquetBatchLoader(path, 4, 0, 1, DENSE, SPARSE)
