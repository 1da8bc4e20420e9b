"""Models and losses by name, by registration and by import path; per-model options."""

import sys
from pathlib import Path

import pytest
import torch

from recsys_dist.config import ConfigError
from recsys_dist.config.loader import load_config
from tests.conftest import QUICKSTART

ROOT = Path(__file__).resolve().parents[3]
EXAMPLE = ROOT / "examples" / "custom_model"
MOVIELENS = ROOT / "configs" / "movielens_deepfm.yaml"


@pytest.fixture
def example_on_path(monkeypatch):
    monkeypatch.syspath_prepend(str(EXAMPLE))
    yield
    sys.modules.pop("my_model", None)


def test_an_option_the_model_does_not_take_is_an_error():
    with pytest.raises(ConfigError, match=r"model\.dropout: unknown key"):
        load_config(QUICKSTART, ["model.dropout=0.5"])  # quickstart is dlrm
    with pytest.raises(ConfigError, match=r"model\.cin_layer_sizes: unknown key"):
        load_config(MOVIELENS, ["model.cin_layer_sizes=[8]"])  # deepfm
    assert load_config(MOVIELENS, ["model.dropout=0.5"]).model.dropout == 0.5


def test_switching_model_on_the_command_line_leaves_out_the_files_options_of_the_old_one():
    with pytest.warns(UserWarning, match="dense_arch_layer_sizes, over_arch_layer_sizes"):
        cfg = load_config(QUICKSTART, ["model.name=deepfm"])
    assert cfg.model.name == "deepfm" and not hasattr(cfg.model, "dense_arch_layer_sizes")
    with pytest.raises(ConfigError, match=r"model\.dense_arch_layer_sizes: unknown key"):
        load_config(QUICKSTART, ["model.name=deepfm", "model.dense_arch_layer_sizes=[8]"])


def test_unknown_model_name_lists_the_registered_ones():
    with pytest.raises(
        ConfigError, match=r"model\.name: unknown model 'dlrn'; registered: bst, dcnv2, deepfm, din, dlrm"
    ):
        load_config(QUICKSTART, ["model.name=dlrn"])


def test_import_path_model_args_are_checked_against_the_factory(example_on_path):
    cfg = load_config(QUICKSTART, ["model.name=my_model:DotTower", "model.args={hidden: 8}"])
    assert cfg.model.args == {"hidden": 8}
    with pytest.raises(ConfigError, match=r"model\.args\.width: my_model:DotTower takes no argument 'width'"):
        load_config(QUICKSTART, ["model.name=my_model:DotTower", "model.args={width: 8}"])
    with pytest.raises(ConfigError, match=r"cannot import module 'no_such_module'.*PYTHONPATH"):
        load_config(QUICKSTART, ["model.name=no_such_module:Model"])
    with pytest.raises(ConfigError, match=r"has no attribute 'Nope'"):
        load_config(QUICKSTART, ["model.name=my_model:Nope"])


def test_a_mapping_on_the_command_line_replaces_the_files(example_on_path):
    """model.args={} was merged into the file's {hidden: 64} (a no-op); now a mapping given
    whole replaces the file's, and a dotted key changes one entry."""
    cfg = ROOT / "examples" / "custom_model" / "config.yaml"
    assert load_config(cfg).model.args == {"hidden": 64}
    assert load_config(cfg, ["model.args={}"]).model.args == {}
    assert load_config(cfg, ["model.args.hidden=8"]).model.args == {"hidden": 8}
    assert load_config(cfg, ["model.args={}", "model.args.hidden=8"]).model.args == {"hidden": 8}
    early = load_config(QUICKSTART, ["train.early_stopping={metric: logloss, patience: 3}"]).train.early_stopping
    assert (early.metric, early.patience) == ("logloss", 3)


def test_import_path_model_trains_like_a_shipped_one_without_sharding(example_on_path):
    from recsys_dist import resolve_job
    from recsys_dist.data.loader import CTRBatch
    from recsys_dist.models.build import build_model

    cfg = load_config(QUICKSTART, ["model.name=my_model:DotTower", "train.loss=my_model:focal_loss"])
    job = resolve_job(cfg, sizes=[50] * 26)
    spec = job.features.on(torch.device("cpu"))
    task = build_model(job.model, spec, job.train)
    g = torch.Generator().manual_seed(0)
    from torchrec import KeyedJaggedTensor

    kjt = KeyedJaggedTensor.from_lengths_sync(
        spec.sparse_names, torch.randint(0, 50, (26 * 8,), generator=g), torch.ones(26 * 8, dtype=torch.int32)
    )
    batch = CTRBatch(torch.randn(8, 13, generator=g), kjt, torch.randint(0, 2, (8,)).float(), torch.ones(8))
    loss, (_, logits, _, _) = task(batch)
    assert logits.shape == (8,) and loss.shape == () and torch.isfinite(loss)
    loss.backward()
    assert all(p.grad is not None for p in task.model.top.parameters())


def test_register_model_by_name(monkeypatch):
    from recsys_dist.models import registry

    registry.model_names()  # the zoo loaded into the real table, not into the copy
    monkeypatch.setattr(registry, "_MODELS", dict(registry._MODELS))

    @registry.register_model("tiny_test_model")
    def tiny(spec, width: int = 4):
        return torch.nn.Linear(spec.num_dense, 1)

    cfg = load_config(QUICKSTART, ["model.name=tiny_test_model", "model.args={width: 2}"])
    assert cfg.model.args == {"width": 2}
    with pytest.raises(ConfigError, match="takes no argument 'depth'"):
        load_config(QUICKSTART, ["model.name=tiny_test_model", "model.args={depth: 2}"])
    with pytest.raises(ValueError, match="registered already"):
        registry.register_model("dlrm")(tiny)


def test_a_registered_model_brings_its_own_checks(monkeypatch):
    from recsys_dist import resolve_job
    from recsys_dist.models import registry
    from recsys_dist.models.checks import needs_dense
    from recsys_dist.train.preflight import check_sections

    registry.model_names()  # the zoo loaded into the real table, not into the copy
    monkeypatch.setattr(registry, "_MODELS", dict(registry._MODELS))

    def no_avazu(job):
        return [f"data.format: {job.model.name} refuses {job.data.format}"] if "avazu" in job.data.format else []

    @registry.register_model("dense_only_test_model", checks=(needs_dense, no_avazu))
    def tiny(spec):
        return torch.nn.Linear(spec.num_dense, 1)

    check_sections(resolve_job(load_config(QUICKSTART, ["model.name=dense_only_test_model"])))  # criteo: dense
    avazu = load_config(ROOT / "configs" / "avazu_deepfm.yaml", ["model.name=dense_only_test_model"])
    with pytest.raises(ConfigError) as err:
        check_sections(resolve_job(avazu))
    assert "dense_only_test_model needs dense features and avazu_csv has none" in str(err.value)
    assert "data.format: dense_only_test_model refuses avazu_csv" in str(err.value)


def test_the_core_calls_model_hooks_and_never_names_retrieval():
    """ModelSpec carries functions, not capability flags: the trainer, preflight and export call
    the hooks and neither import the retrieval plugin nor branch on a model kind."""
    import dataclasses

    from recsys_dist.models.registry import ModelSpec, get_model

    assert not [f.name for f in dataclasses.fields(ModelSpec) if f.type in (bool, "bool", "bool | None")]
    for rel in ("train/trainer.py", "train/preflight.py", "serve/export.py", "models/build.py"):
        text = (ROOT / "recsys_dist" / rel).read_text()
        assert "models.retrieval import" not in text and ".retrieval:" not in text, rel
        assert ".first_order_tables:" not in text and ".needs_dense" not in text, rel
    two_tower = get_model("two_tower")
    assert None not in (two_tower.read_data, two_tower.on_data, two_tower.evaluator, two_tower.export_extras)
    assert get_model("deepfm").on_features is not None and get_model("dlrm").on_features is None


def test_losses_by_name_and_path(example_on_path):
    from recsys_dist.models.losses import bce, focal, get_loss, mse

    g = torch.Generator().manual_seed(1)
    logits, labels = torch.randn(64, generator=g), torch.randint(0, 2, (64,), generator=g).float()
    weights = torch.ones(64)
    weights[-5:] = 0  # padding rows count for nothing
    ref = torch.nn.functional.binary_cross_entropy_with_logits(logits[:-5], labels[:-5])
    assert torch.allclose(bce(logits, labels, weights), ref)
    assert torch.allclose(focal(logits, labels, weights, gamma=0.0), ref)
    p = torch.sigmoid(logits[:-5])
    p_t = torch.where(labels[:-5] == 1, p, 1 - p)
    want = (-((1 - p_t) ** 2) * torch.log(p_t)).mean()  # Lin et al., 2017, eq. 5 without alpha
    assert torch.allclose(focal(logits, labels, weights), want, atol=1e-6)
    assert torch.allclose(mse(logits, labels, weights), ((logits[:-5] - labels[:-5]) ** 2).mean())
    assert torch.allclose(get_loss("my_model:focal_loss")(logits, labels, weights, gamma=2.0), want, atol=1e-6)
    assert bce(logits, labels, torch.zeros(64)) == 0


def test_loss_config_is_checked():
    assert load_config(QUICKSTART, ["train.loss=focal", "train.loss_args={gamma: 1.5}"]).train.loss == "focal"
    with pytest.raises(ConfigError, match=r"train\.loss_args\.beta: focal takes no argument 'beta'"):
        load_config(QUICKSTART, ["train.loss=focal", "train.loss_args={beta: 1}"])
    with pytest.raises(
        ConfigError, match=r"train.loss: unknown loss 'hinge'; registered: bce, focal, in_batch_softmax, mse"
    ):
        load_config(QUICKSTART, ["train.loss=hinge"])


def test_pooling_belongs_to_the_feature_and_the_0_1_keys_are_refused(tmp_path):
    cfg = load_config(MOVIELENS)
    pooling = {t.name: t.pooling.value for t in __import__("recsys_dist").feature_spec(cfg).all_tables()}
    assert pooling == {"t_userId": "SUM", "t_movieId": "SUM", "t_genres": "MEAN", "w_userId": "SUM"} | {
        "w_movieId": "SUM",
        "w_genres": "MEAN",
    }
    old = tmp_path / "old.yaml"
    text = MOVIELENS.read_text().replace("../datasets", str(ROOT / "datasets"))
    text = text.replace("  feature_pooling:\n    genres: mean ", "  pooling: sum ")
    text = text.replace("  sharding_types: []", "  sharding_types: []\n  per_table:\n    t_genres: {pooling: mean}")
    old.write_text(text)
    # The key of 0.1.0 (sharding.per_table.<table>.pooling) is no longer moved to
    # data.feature_pooling: it is an unknown key, named with where it is.
    with pytest.raises(ConfigError, match=r"sharding\.per_table\.t_genres\.pooling: unknown key"):
        load_config(old)
    with pytest.raises(ConfigError, match=r"data\.feature_pooling: \['C99'\] are not categorical features"):
        load_config(QUICKSTART, ["data.feature_pooling={C99: mean}"])


def test_resume_refuses_other_pooling():
    from recsys_dist.checkpoint.compat import check_compatible
    from recsys_dist.errors import CheckpointError

    saved = load_config(MOVIELENS).to_dict()
    now = load_config(MOVIELENS, ["data.feature_pooling={genres: sum}"]).to_dict()
    with pytest.raises(CheckpointError, match="data.feature_pooling"):
        check_compatible(Path("ckpt"), {"config": saved}, now)
    with pytest.raises(CheckpointError, match=r"table sizes \[1, 2\] -> \[3, 4\]"):
        check_compatible(Path("ckpt"), {"config": saved, "num_embeddings": [1, 2]}, saved, sizes=[3, 4])


def test_shipped_model_configs_are_the_registrys_without_the_zoo():
    from recsys_dist.models.config import SHIPPED_MODEL_CONFIGS
    from recsys_dist.models.registry import get_model, model_config_class, model_names

    shipped = {n: get_model(n) for n in model_names()}
    shipped = {n: m.config for n, m in shipped.items() if m.build.__module__.startswith("recsys_dist.models.zoo.")}
    assert SHIPPED_MODEL_CONFIGS == shipped
    assert all(model_config_class(n) is cls for n, cls in shipped.items())


def test_a_registered_loss_is_checked_by_its_signature():
    from recsys_dist.models.config import REGISTERED_LOSSES
    from recsys_dist.models.losses import register_loss

    @register_loss("tiny_test_loss")
    def tiny(logits, labels, weights, margin: float):
        return (logits * weights).sum()

    try:
        cfg = load_config(QUICKSTART, ["train.loss=tiny_test_loss", "train.loss_args={margin: 1.0}"])
        assert cfg.train.loss == "tiny_test_loss"
        with pytest.raises(ConfigError, match=r"train\.loss_args\.margin: required by tiny_test_loss, missing"):
            load_config(QUICKSTART, ["train.loss=tiny_test_loss"])
        with pytest.raises(ConfigError, match=r"registered: bce, focal, in_batch_softmax, mse, tiny_test_loss"):
            load_config(QUICKSTART, ["train.loss=hinge"])
    finally:
        REGISTERED_LOSSES.pop("tiny_test_loss")
