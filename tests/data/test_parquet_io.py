import pyarrow as pa
import pytest

from recsys_dist.data.loader import ParquetBatchLoader
from recsys_dist.data.parquet_io import open_parquet, read_pool
from tests.data.test_loader import DENSE, SPARSE, write_files

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
    open_parquet(path).read()
    assert default.max_memory() > 0 and system.max_memory() == 0
