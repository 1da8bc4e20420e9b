"""``Trainer(model=..., dense_optimizer=..., lr_scheduler=..., callbacks=...)``: a model, a dense
optimizer and an LR scheduler given from Python train exactly as the same ones named in the
config; an option given both ways is refused; callbacks see every step."""

import pytest
import torch
import yaml

import recsys_dist
from recsys_dist.config import ConfigError
from recsys_dist.config.loader import load_config
from tests.cli import read_metrics, run_cli
from tests.unit.api import test_trainer_parts as unit_test_trainer_parts
from tests.unit.api.test_trainer_parts import (
    LAUNCHER_ENV,
    NAMED,
    ROOT,
    TOY,
    sgd_at,
)

base_config = unit_test_trainer_parts.base_config  # the fixture, shared with tests.unit.api.test_trainer_parts


def losses(run_dir) -> list[float]:
    return [m["loss"] for m in read_metrics(run_dir, "train")]


class Recorder(recsys_dist.Callback):
    def __init__(self) -> None:
        self.steps: list[int] = []
        self.losses: list[float] = []
        self.validations: list[tuple[int, float]] = []

    def on_step_end(self, trainer, step, loss):
        assert trainer.step == step
        self.steps.append(step)
        self.losses.append(float(loss))

    def on_validation_end(self, trainer, step, metrics):
        self.validations.append((step, metrics["auc"]))


@pytest.mark.slow
def test_a_model_optimizer_and_scheduler_from_python_train_as_named_in_the_config(tmp_path, base_config):
    from my_model import DotTower

    def fit(overrides, name, **parts):
        cfg = load_config(base_config, [*TOY, *overrides])
        with recsys_dist.Trainer(cfg, tmp_path / name, **parts) as trainer:
            trainer.fit()
        return losses(tmp_path / name)

    named = fit(NAMED, "named")
    assert len(named) == 12
    # A factory spec -> module, called with the run's FeatureSpec.
    recorder = Recorder()
    factory = fit([], "factory", model=lambda spec: DotTower(spec, hidden=32), callbacks=[recorder])
    assert factory == named
    assert recorder.steps == list(range(1, 13))
    assert recorder.losses == pytest.approx(named, abs=1e-6)  # one rank, no padding: the logged loss
    assert [s for s, _ in recorder.validations] == [12]
    # An already built module (tables on meta, as spec.embedding_device says).
    cfg = load_config(base_config, TOY)
    torch.manual_seed(cfg.train.seed)  # the Trainer seeds before it builds; a module built here is seeded here
    built = fit([], "built", model=DotTower(recsys_dist.feature_spec(cfg), hidden=32))
    assert built == named

    # A dense optimizer factory: the same as train.dense_optimizer=sgd at that rate, and not the default.
    sgd_named = fit([*NAMED, "train.dense_optimizer=sgd", "train.dense_lr=0.05"], "sgd_named")
    sgd = fit([], "sgd", model=lambda spec: DotTower(spec, hidden=32), dense_optimizer=sgd_at(0.05))
    assert sgd == sgd_named
    assert sgd[1:] != named[1:]
    # An LR scheduler over it: half of 0.1 from the first step is 0.05.
    halved = fit(
        [],
        "halved",
        model=lambda spec: DotTower(spec, hidden=32),
        dense_optimizer=sgd_at(0.1),
        lr_scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.5),
    )
    assert halved == sgd_named

    # Resumed mid-run, a momentum optimizer's state and a step-dependent schedule continue:
    # steps 7-12 from the step-6 checkpoint equal the uninterrupted run's.
    def parts():
        return dict(
            model=lambda spec: DotTower(spec, hidden=32),
            dense_optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
            lr_scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1 + step)),
        )

    every_6 = ["checkpoint.enabled=true", "checkpoint.every_n_steps=6"]
    whole = fit(every_6, "whole", **parts())
    resumed = fit(every_6, "resumed", resume=tmp_path / "whole" / "checkpoints" / "step_00000006", **parts())
    assert resumed == whole[6:]
    assert whole != halved
    # Its config names no model (model.name is dlrm's default): export and load_model would rebuild
    # another model, so they refuse, and so does a resume into the config's model.
    from recsys_dist.errors import CheckpointError
    from recsys_dist.serve.export import load

    with pytest.raises(CheckpointError, match=r"holds a model given to Trainer\(model=...\)"):
        load(tmp_path / "whole")
    with pytest.raises(
        CheckpointError, match=r"model given to Trainer\(model=...\) -> named by the config's model.name"
    ):
        fit([*NAMED, *every_6], "named_resumed", resume=tmp_path / "whole" / "checkpoints" / "step_00000006")


class SparseOnlyTower(torch.nn.Module):
    """A model that reads no dense features: the pooled embeddings, concatenated, to one logit."""

    def __init__(self, spec) -> None:
        super().__init__()
        from torchrec.modules.embedding_modules import EmbeddingBagCollection

        self.ebc = EmbeddingBagCollection(tables=spec.tables, device=spec.embedding_device)
        self.top = torch.nn.Linear(len(spec.tables) * spec.embedding_dim, 1, device=spec.device)

    def forward(self, dense, sparse):
        return self.top(self.ebc(sparse).values()).squeeze(-1)


def test_a_given_model_is_checked_as_itself_not_as_the_default_model_name(tmp_path, monkeypatch, cache_dir):
    # MovieLens has no dense features: model.name's default, dlrm, needs them, so its check
    # refused every Trainer(model=...) on this data before the given model was considered.
    for name in LAUNCHER_ENV:
        monkeypatch.delenv(name, raising=False)
    movielens = ROOT / "configs" / "movielens_deepfm.yaml"
    tree = yaml.safe_load(movielens.read_text())
    tree["data"]["raw_path"] = str((movielens.parent / tree["data"]["raw_path"]).resolve())
    # embedding_dim 8: not what dlrm's bottom MLP gives (16), which load_config refused before
    # any model was considered; that check too is dlrm's, run once the run trains dlrm.
    tree["model"] = {"embedding_dim": 8}
    path = tmp_path / "no_dense.yaml"
    path.write_text(yaml.safe_dump(tree))
    cfg = load_config(path, [*TOY, "train.max_steps=4"])
    dot = "model.dense_arch_layer_sizes[-1] (16) must equal model.embedding_dim (8) for dlrm's dot interaction"
    with pytest.raises(ConfigError, match="model.name: dlrm needs dense features") as err:
        recsys_dist.Trainer(cfg, tmp_path / "named")  # dlrm itself is still refused
    assert dot in str(err.value)
    # The command line trains model.name's default: refused before any rank starts, naming the keys.
    out = run_cli(["train", "--config", path, "--run-dir", tmp_path / "cli", *TOY], inprocess=True)
    assert out.returncode == 2 and dot in out.stderr and "needs dense features" in out.stderr
    assert not (tmp_path / "cli" / "metrics.jsonl").exists()
    with recsys_dist.Trainer(cfg, tmp_path / "given", model=SparseOnlyTower) as trainer:
        assert trainer.spec.num_dense == 0 and trainer.spec.embedding_dim == 8
        summary = trainer.fit()
    assert summary["steps"] == 4 and 0.0 < summary["test"]["logloss"] < 1.0
