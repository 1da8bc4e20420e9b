import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from recsys_dist.data.criteo import DataError
from recsys_dist.data.loader import ParquetBatchLoader

DENSE, SPARSE = ["I1", "I2"], ["C1", "C2", "C3"]


def make_parquet(tmp_path, n):
    t = pa.table({
        "label": pa.array(np.arange(n) % 2, pa.float32()),
        "I1": pa.array(np.arange(n), pa.float32()),
        "I2": pa.array(-np.arange(n), pa.float32()),
        **{c: pa.array(np.arange(n) * 10 + j, pa.int64()) for j, c in enumerate(SPARSE)},
    })
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
    assert kjt.values().dtype.is_floating_point is False and kjt.values().tolist() == [0, 10, 1, 11, 2, 12]
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
        ParquetBatchLoader(p, 2, 0, 1, DENSE, SPARSE, num_embeddings=[5, 100, 100])
    with pytest.raises(DataError, match=r"missing columns \['C9'\]"):
        ParquetBatchLoader(p, 2, 0, 1, DENSE, ["C9"])
