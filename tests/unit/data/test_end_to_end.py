"""Vocabulary mapping and a schema-described multi-hot dataset through the real CLI (1 rank)."""


def test_row_group_size_from_the_config(tmp_path):
    import json

    import pyarrow.parquet as pq
    import pytest

    from recsys_dist.config.loader import load_config
    from recsys_dist.data.resolve import prepare_from_config
    from tests.conftest import QUICKSTART

    cfg = load_config(QUICKSTART, ["data.row_group_size=1000", f"data.cache_dir={tmp_path}"])
    with pytest.raises(TypeError, match=r"expected the data section \(DataConfig\), got RunConfig"):
        prepare_from_config(cfg)  # the data section only
    p = prepare_from_config(cfg.data)
    f = pq.ParquetFile(p.files["train"])
    assert [f.metadata.row_group(i).num_rows for i in range(f.num_row_groups)] == [1000] * 8
    assert json.loads((p.directory / "manifest.json").read_text())["row_group_size"] == 1000
    default = prepare_from_config(load_config(QUICKSTART, [f"data.cache_dir={tmp_path}"]).data)
    assert default.directory != p.directory  # a different row-group size is another conversion
