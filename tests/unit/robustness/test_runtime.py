"""Runtime faults stop cleanly, naming the step / row / column, and keep good checkpoints."""

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from recsys_dist.data.loader import ParquetBatchLoader
from recsys_dist.errors import DataError


def test_non_finite_dense_value_in_parquet_names_row_and_column(tmp_path):
    t = pa.table(
        {
            "label": pa.array([0.0, 1.0], pa.float32()),
            "I1": pa.array([1.0, np.inf], pa.float32()),
            "C1": pa.array([1, 2], pa.int64()),
        }
    )
    pq.write_table(t, tmp_path / "d.parquet")
    with pytest.raises(DataError, match=r"d.parquet, row 1, column I1: inf is not finite"):
        list(ParquetBatchLoader(str(tmp_path / "d.parquet"), 2, 0, 1, ["I1"], ["C1"]))
