"""Publishing does not move the training's random stream: an online HSTU run with its
dropout (``configs/movielens_hstu.yaml``'s ``layer_dropout: 0.2``) stopped between two
partitions (after its first publish) and resumed trains the uninterrupted run's numbers. Before, rank 0 built (and, on a
resume, loaded) unsharded models to publish, whose initialisation drew from the global RNG that
the dropout masks come from: the resumed run's masks, so its losses and weights, were others,
with exit code 0."""

import os

import pytest
import torch
import yaml

from recsys_dist.serve.publish import load_published
from tests.cli import read_metrics, run_cli
from tests.conftest import ROOT

HSTU = ROOT / "configs" / "movielens_hstu.yaml"
RAW = ROOT / "datasets" / "movielens" / "ratings_genres_first20000_by_time.csv"
PARTS = ["day=0/part-0.csv", "day=1/part-0.csv", "day=2/part-0.csv"]
PART_ROWS = 320  # 5 global batches of 64


def land(landing, names) -> None:
    lines = RAW.read_text().splitlines(keepends=True)
    for name in names:
        i = PARTS.index(name)
        target = landing / name
        target.parent.mkdir(parents=True, exist_ok=True)
        hidden = target.parent / f".{target.name}.tmp"
        hidden.write_text("".join([lines[0], *lines[1 + i * PART_ROWS : 1 + (i + 1) * PART_ROWS]]))
        os.replace(hidden, target)


def config(tmp, landing):
    cfg = yaml.safe_load(HSTU.read_text())
    d = cfg["data"]
    for key in ("raw_path", "split", "min_count"):
        del d[key]
    d.update(
        categorical_mapping="hash",
        num_embeddings=2000,
        stream={"path": str(landing), "pattern": "*/*.csv", "poll_seconds": 0.2, "stop_after_idle_seconds": 0},
    )
    assert cfg["model"]["layer_dropout"] > 0  # the dropout draws the masks
    cfg["train"] = {k: v for k, v in cfg["train"].items() if k not in ("epochs", "early_stopping")}
    cfg["train"].update(log_every_n_steps=1, progress_bar=False)
    cfg["distributed"]["nproc_per_node"] = 1
    cfg["checkpoint"] = {"enabled": True, "every_n_steps": 100}
    cfg["eval"] = {"batch_size": 256}
    cfg["publish"] = {"enabled": True, "every_partition": True}
    path = tmp / f"{landing.name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def train(args, tmp):
    r = run_cli(["train", *args], tmp)
    assert r.returncode == 0, r.stderr[-3000:]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_stream_resumed_between_partitions_trains_the_uninterrupted_runs_dropout(tmp_path):
    ref_landing, landing = tmp_path / "ref_landing", tmp_path / "landing"
    land(ref_landing, PARTS)
    train(["--config", config(tmp_path, ref_landing), "--run-dir", tmp_path / "ref"], tmp_path)
    land(landing, PARTS[:2])
    cfg = config(tmp_path, landing)
    run = tmp_path / "run"
    train(["--config", cfg, "--run-dir", run], tmp_path)  # two partitions, each published; idle
    land(landing, PARTS[2:])
    train(["--config", cfg, "--run-dir", run, "--resume", "auto"], tmp_path)
    losses = [(m["step"], m["loss"]) for m in read_metrics(run, "train")]
    want = [(m["step"], m["loss"]) for m in read_metrics(tmp_path / "ref", "train")]
    assert [s for s, _ in losses] == list(range(1, 16))
    assert losses == want  # the resumed partition's steps 11..15 included, bit for bit
    model, version = load_published(run / "publish")
    ref, _ = load_published(tmp_path / "ref" / "publish")
    assert version == 3
    for key, value in ref.model.state_dict().items():
        assert torch.equal(model.model.state_dict()[key], value), key
