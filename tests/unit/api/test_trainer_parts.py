"""``Trainer(model=..., dense_optimizer=..., lr_scheduler=..., callbacks=...)``: a model, a dense
optimizer and an LR scheduler given from Python train exactly as the same ones named in the
config; an option given both ways is refused; callbacks see every step."""

import os

import pytest
import torch
import yaml

import recsys_dist
from recsys_dist.config import ConfigError
from recsys_dist.config.loader import load_config
from tests.cli import read_metrics
from tests.conftest import QUICKSTART

ROOT = QUICKSTART.parents[1]
LAUNCHER_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "TORCHELASTIC_RUN_ID")
TOY = [
    "data.num_rows=2000",
    "train.max_steps=12",
    "train.log_every_n_steps=1",
    "train.progress_bar=false",
    "distributed.nproc_per_node=1",
    "checkpoint.enabled=false",
]
NAMED = ["model.name=my_model:DotTower", "model.args={hidden: 32}"]


@pytest.fixture
def base_config(tmp_path, monkeypatch, cache_dir):
    """The quickstart's data and training, without a model or a dense optimizer chosen (the
    quickstart names dlrm, adagrad and dense_lr)."""
    for name in LAUNCHER_ENV:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.syspath_prepend(str(ROOT / "examples" / "custom_model"))
    tree = yaml.safe_load(QUICKSTART.read_text())
    tree["data"]["raw_path"] = str((QUICKSTART.parent / tree["data"]["raw_path"]).resolve())
    tree["model"] = {"embedding_dim": 16, "embedding_init_scale": 0.1}
    del tree["train"]["dense_optimizer"], tree["train"]["dense_lr"]
    path = tmp_path / "base.yaml"
    path.write_text(yaml.safe_dump(tree))
    return path


def sgd_at(lr):
    return lambda params: torch.optim.SGD(params, lr=lr)


def test_an_option_given_in_the_config_and_as_an_argument_is_refused(tmp_path, base_config):
    import torch.distributed as dist

    module = lambda spec: torch.nn.Linear(1, 1)  # noqa: E731 - never called
    with pytest.raises(ConfigError, match=r"model.args, model.name in the config and Trainer\(model=...\)"):
        recsys_dist.Trainer(load_config(base_config, [*TOY, *NAMED]), tmp_path / "a", model=module)
    with pytest.raises(ConfigError, match=r"train.dense_lr in the config and Trainer\(dense_optimizer=...\)"):
        recsys_dist.Trainer(
            load_config(base_config, [*TOY, "train.dense_lr=0.1"]), tmp_path / "b", dense_optimizer=sgd_at(0.1)
        )
    with pytest.raises(ConfigError, match=r"train.warmup_steps in the config and Trainer\(lr_scheduler=...\)"):
        recsys_dist.Trainer(
            load_config(base_config, [*TOY, "train.warmup_steps=3"]), tmp_path / "c", lr_scheduler=lambda o: None
        )
    with pytest.raises(TypeError, match="callbacks must be recsys_dist.Callback objects, got function"):
        recsys_dist.Trainer(load_config(base_config, TOY), tmp_path / "d", callbacks=[lambda *a: None])
    # model.embedding_dim / embedding_init_scale size the spec's tables: not a conflict (refused
    # here only for the callback above).
    assert not dist.is_initialized() and not any((tmp_path / n).exists() for n in "abcd")
    assert os.environ.get("RECSYS_DIST_RUN_LOCK") is None


def test_a_scheduler_the_trainer_cannot_step_is_refused_before_training(tmp_path, base_config):
    # ReduceLROnPlateau steps on a metric: was a TypeError from its step() at the first step.
    plateau = lambda opt: torch.optim.lr_scheduler.ReduceLROnPlateau(opt)  # noqa: E731
    for i, (factory, match) in enumerate(((plateau, "made a ReduceLROnPlateau"), (lambda opt: None, "got NoneType"))):
        with pytest.raises(TypeError, match=match):
            with recsys_dist.Trainer(
                load_config(base_config, [*TOY, *NAMED]),
                tmp_path / str(i),
                dense_optimizer=sgd_at(0.1),
                lr_scheduler=factory,
            ) as trainer:
                trainer.fit()
        assert not (tmp_path / str(i) / "metrics.jsonl").exists() or not read_metrics(tmp_path / str(i), "train")
