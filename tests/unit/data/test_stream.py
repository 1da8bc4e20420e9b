"""recsys_dist.data.stream: what a stream run says about user histories (docs/online.md, "User
histories"): each partition is converted on its own, so a user's history starts empty in it."""

import yaml

from recsys_dist.data.config import DataConfig
from recsys_dist.data.stream import history_note
from tests.conftest import QUICKSTART, ROOT


def _data(path: str, stream: bool, config=ROOT / "configs" / "movielens_hstu.yaml") -> DataConfig:
    d = yaml.safe_load(config.read_text())["data"]
    if stream:
        for key in ("raw_path", "split", "min_count", "num_rows"):
            d.pop(key, None)
        d.update(categorical_mapping="hash", num_embeddings=2000, stream={"path": path})
    else:
        d["raw_path"] = str(path)
    return DataConfig.model_validate(d)


def test_a_stream_with_user_histories_says_they_start_afresh_in_each_partition(tmp_path):
    """Before, nothing at run time said so: a user's events of earlier partitions were left out of
    its training rows' histories silently (a request to the server carries them)."""
    note = history_note(_data(str(tmp_path), stream=True))
    assert note.startswith("data.stream with data.schema.history (history): each partition's histories start empty")
    assert "its userId's earlier rows of the same partition only" in note and "docs/online.md" in note
    assert history_note(_data(str(tmp_path / "log.csv"), stream=False)) is None  # a batch run: the whole file
    assert history_note(_data(str(tmp_path), stream=True, config=QUICKSTART)) is None  # no history
