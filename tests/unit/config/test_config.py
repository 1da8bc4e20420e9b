from pathlib import Path

import pytest
import yaml

import recsys_dist
from recsys_dist.config import ConfigError
from recsys_dist.config.job import resolve_job
from recsys_dist.config.loader import load_config, parse_overrides
from recsys_dist.config.run import RunConfig
from recsys_dist.train import trainer
from recsys_dist.train.job import SECTIONS
from recsys_dist.train.preflight import check_before_launch, check_sections
from tests.conftest import QUICKSTART, ROOT


def write_cfg(tmp_path, tree) -> Path:
    p = tmp_path / "c.yaml"
    p.write_text(yaml.safe_dump(tree))
    return p


def minimal(**sections):
    tree = {"data": {"raw_path": str(ROOT / "datasets/criteo_kaggle/dac_train_first10000.txt")}}
    tree.update(sections)
    return tree


@pytest.mark.parametrize("path", sorted((ROOT / "configs").rglob("*.yaml")), ids=lambda p: p.name)
def test_every_shipped_config_validates(path):
    cfg = load_config(path)
    if cfg.data.raw_path is not None:  # trainable configs: the data file must ship too
        check_before_launch(resolve_job(cfg))


def test_plan_only_config_refuses_to_train():
    cfg = load_config(ROOT / "configs" / "mlperf_dlrmv2.yaml")
    with pytest.raises(ConfigError, match="data.raw_path: not set"):
        check_before_launch(resolve_job(cfg))


def test_quickstart_values_and_path_resolution():
    cfg = load_config(QUICKSTART)
    assert cfg.distributed.nproc_per_node == 2
    assert Path(cfg.data.raw_path).is_absolute() and Path(cfg.data.raw_path).is_file()


def test_overrides_apply_and_parse_yaml_values():
    cfg = load_config(
        QUICKSTART,
        [
            "train.batch_size=64",
            "sharding.sharding_types=[row_wise, table_wise]",
            "train.max_steps=5",
            "train.embedding_lr=1e-3",
        ],
    )
    assert cfg.train.batch_size == 64 and cfg.train.max_steps == 5
    assert cfg.sharding.sharding_types == ["row_wise", "table_wise"]
    assert cfg.train.embedding_lr == pytest.approx(1e-3)


def test_all_errors_reported_together(tmp_path):
    tree = minimal(train={"batch_size": -1, "epochs": "two", "bogus": 1}, distributed={"nproc_per_node": 0})
    with pytest.raises(ConfigError) as e:
        load_config(write_cfg(tmp_path, tree))
    msg = str(e.value)
    assert "train.batch_size" in msg and "greater than 0" in msg
    assert "train.epochs" in msg and "'two'" in msg
    assert "train.bogus: unknown key" in msg
    assert "distributed.nproc_per_node" in msg


def test_unknown_section_and_bad_override(tmp_path):
    with pytest.raises(ConfigError, match="trian: unknown key"):
        load_config(write_cfg(tmp_path, minimal(trian={"batch_size": 1})))
    with pytest.raises(ConfigError, match="expected dotted.key=value"):
        parse_overrides(["train.batch_size"])
    with pytest.raises(ConfigError, match=r"sharding.sharding_types.0: .*; set on the command line, not in the file"):
        load_config(QUICKSTART, ["sharding.sharding_types=[diagonal]"])
    with pytest.raises(ConfigError) as err:
        load_config(write_cfg(tmp_path, minimal(train={"batch_size": 0})), ["train.precision=fp16"])
    batch, precision = err.value.args[0].splitlines()[1:]
    assert "train.batch_size" in batch and "command line" not in batch
    assert "'fp32' or 'bf16-mixed' (got 'fp16'); set on the command line" in precision


def test_cross_field_errors_name_keys():
    with pytest.raises(ConfigError, match=r"dense_arch_layer_sizes\[-1\] \(8\) must equal model.embedding_dim \(16\)"):
        load_config(QUICKSTART, ["model.dense_arch_layer_sizes=[32,8]"])
    with pytest.raises(ConfigError, match="over_arch_layer_sizes\\[-1\\] must be 1"):
        load_config(QUICKSTART, ["model.over_arch_layer_sizes=[4,2]"])
    with pytest.raises(ConfigError, match="num_embeddings must be >= 2"):
        load_config(QUICKSTART, ["data.num_embeddings=1"])
    with pytest.raises(ConfigError, match="summing to 1"):
        load_config(QUICKSTART, ["data.split=[0.5,0.1,0.1]"])


def test_missing_data_file_and_config(tmp_path):
    """load_config accepted a data file that does not exist (only the CLI's preflight refused
    it): now both refuse it, naming the key; `plan` (which reads no data) still loads it."""
    with pytest.raises(ConfigError, match="data.raw_path: file .*nope.txt does not exist"):
        load_config(QUICKSTART, [f"data.raw_path={tmp_path}/nope.txt"])
    with pytest.raises(ConfigError, match="data.raw_path: .* is a directory"):
        load_config(QUICKSTART, [f"data.raw_path={tmp_path}"])
    cfg = load_config(QUICKSTART, [f"data.raw_path={tmp_path}/nope.txt"], check_files=False)
    with pytest.raises(ConfigError, match="data.raw_path: file .*nope.txt does not exist"):
        check_before_launch(resolve_job(cfg))
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.yaml")


def test_yaml_is_loaded_safely(tmp_path):
    p = tmp_path / "evil.yaml"
    p.write_text("data: !!python/object/apply:os.system ['echo pwned']\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(p)


def test_sharding_problems_found_before_launch():
    cfg = load_config(QUICKSTART, ["sharding.per_table={t_C99: {sharding_types: [row_wise]}}"])
    with pytest.raises(ConfigError, match=r"unknown tables \['t_C99'\]"):
        check_before_launch(resolve_job(cfg))
    cfg = load_config(QUICKSTART, ["sharding.sharding_types=[data_parallel]", "sharding.compute_kernels=[fused]"])
    with pytest.raises(ConfigError, match="data_parallel tables need the dense kernel"):
        check_before_launch(resolve_job(cfg))
    cfg = load_config(QUICKSTART, ["train.embedding_optimizer=adam"])
    with pytest.raises(ConfigError, match="no Adam for sharded tables"):
        check_before_launch(resolve_job(cfg))


def test_fixed_plan_validation():
    with pytest.raises(ConfigError, match="table_wise needs exactly one rank"):
        load_config(QUICKSTART, ["sharding.fixed_plan={t_C1: {sharding_type: table_wise, ranks: [0, 1]}}"])
    with pytest.raises(ConfigError, match="column_wise needs ranks"):
        load_config(QUICKSTART, ["sharding.fixed_plan={t_C1: {sharding_type: column_wise}}"])
    cfg = load_config(QUICKSTART, ["sharding.fixed_plan={t_C1: {sharding_type: table_wise, ranks: [2]}}"])
    with pytest.raises(ConfigError) as e:
        check_before_launch(resolve_job(cfg))
    assert "must place exactly the model's tables" in str(e.value) and "'t_C2'" in str(e.value)
    assert "fixed_plan.t_C1.ranks: [2] but the job has 2 rank(s)" in str(e.value)


def test_pooling_default_and_per_table():
    from torchrec.modules.embedding_configs import PoolingType

    cfg = load_config(QUICKSTART, ["data.pooling=mean", "data.feature_pooling={C3: sum}"])
    pools = {t.name: t.pooling for t in resolve_job(cfg).features.tables}
    assert pools["t_C1"] == PoolingType.MEAN and pools["t_C3"] == PoolingType.SUM
    # The keys of 0.1.0 (sharding.pooling, sharding.per_table.<table>.pooling) are unknown keys now.
    with pytest.raises(ConfigError, match=r"sharding\.per_table\.t_C3\.pooling: unknown key") as e:
        load_config(QUICKSTART, ["sharding.pooling=mean", "sharding.per_table={t_C3: {pooling: sum}}"])
    assert "sharding.pooling: unknown key" in str(e.value)


def test_more_ranks_than_tables_with_only_table_wise():
    cfg = load_config(QUICKSTART, ["sharding.sharding_types=[table_wise]", "distributed.nproc_per_node=27"])
    with pytest.raises(ConfigError, match="27 ranks but only 26 tables"):
        check_before_launch(resolve_job(cfg))


def test_non_utf8_config_and_infinite_values_are_config_errors(tmp_path):
    p = tmp_path / "binary.yaml"
    p.write_bytes(b"\xff\xfe\x00garbage")
    with pytest.raises(ConfigError, match="is not UTF-8 text"):
        load_config(p)
    with pytest.raises(ConfigError, match="train.embedding_lr"):
        load_config(QUICKSTART, ["train.embedding_lr=.inf"])
    with pytest.raises(ConfigError, match="is a directory"):
        load_config(tmp_path)


def test_types_are_strict_and_numbers_in_e_notation_are_numbers(tmp_path):
    for bad, want in (
        ("train.batch_size=true", "train.batch_size: Input should be a valid integer (got True)"),
        ("train.batch_size=64.0", "train.batch_size: Input should be a valid integer"),
        ("train.embedding_lr='0.1'", "train.embedding_lr: Input should be a valid number"),
        ("data.split=[true,0,0]", "data.split.fractions.0"),
    ):
        with pytest.raises(ConfigError, match=want.replace("(", r"\(").replace(")", r"\)")):
            load_config(QUICKSTART, [bad])
    # YAML 1.1 reads 1e-3 as a string; a config means the number
    cfg = load_config(QUICKSTART, ["train.embedding_lr=1e-3", "train.dense_lr=2E-2", "data.split=[0.8,0.1,0.1]"])
    assert (cfg.train.embedding_lr, cfg.train.dense_lr, cfg.data.split.fractions) == (1e-3, 2e-2, (0.8, 0.1, 0.1))
    text = QUICKSTART.read_text().replace("  embedding_lr: 0.02", "  embedding_lr: 1e-3")
    (tmp_path / "c.yaml").write_text(text.replace("../datasets", str(ROOT / "datasets")))
    assert load_config(tmp_path / "c.yaml").train.embedding_lr == 1e-3


def test_a_key_given_twice_is_an_error(tmp_path):
    text = QUICKSTART.read_text().replace("  batch_size: 32", "  batch_size: 32\n  batch_size: 64")
    (tmp_path / "c.yaml").write_text(text)
    with pytest.raises(
        ConfigError, match=r"c.yaml is not valid YAML: key 'batch_size' on line 16 is given twice \(also on line 15\)"
    ):
        load_config(tmp_path / "c.yaml")
    with pytest.raises(ConfigError, match="given twice"):
        parse_overrides(["sharding.constraints={a: 1, a: 2}"])


def test_yaml_numbers_are_decimal_and_merge_keys_work(tmp_path):
    from recsys_dist.config.loader import yaml_load

    got = yaml_load("a: 1e-3\nb: .5e3\nc: 010\nd: 1:04\ne: 0b11\nf: 1_000\ng: -.5\nh: 0x10\n")
    assert got == {"a": 1e-3, "b": 500.0, "c": 10, "d": "1:04", "e": "0b11", "f": 1000, "g": -0.5, "h": "0x10"}
    text = "d: &d {batch_size: 64}\neval:\n  <<: *d\n"
    assert yaml_load(text)["eval"] == {"batch_size": 64}
    assert yaml_load("base: &b {x: 1, y: 2}\nt:\n  <<: *b\n  y: 3\n")["t"] == {"x": 1, "y": 3}  # own keys win
    for bad in ("? [a, b]\n: 1\n", "train: {[1]: 2}\n"):
        (tmp_path / "c.yaml").write_text(bad)
        with pytest.raises(ConfigError, match="a key must be a plain name"):
            load_config(tmp_path / "c.yaml")
    with pytest.raises(ConfigError, match="a key must be a plain name"):
        parse_overrides(["train.batch_size={[1]: 2}"])


def test_integers_beyond_int64_and_absurd_batches_are_config_errors():
    for bad, key in (
        ("data.num_embeddings=9223372036854775808", "data.num_embeddings: an integer here must lie within int64"),
        ("train.seed=18446744073709551616", "train.seed: an integer"),
        ("data.num_embeddings=[1,99999999999999999999]", "data.num_embeddings: an integer"),
        ("train.batch_size=1000000000000", "train.batch_size: Input should be less than or equal"),
    ):
        with pytest.raises(ConfigError, match=key):
            load_config(QUICKSTART, [bad])


def test_a_config_file_holding_a_scalar_says_so(tmp_path):
    for text in ("0\n", "false\n", "[1, 2]\n"):
        (tmp_path / "c.yaml").write_text(text)
        with pytest.raises(ConfigError, match="must hold a mapping of sections"):
            load_config(tmp_path / "c.yaml")


def test_cross_section_problems_come_from_preflight_and_the_trainer(tmp_path):
    """RunConfig validation checks each section alone (config does not call train/preflight);
    the cross-section rules run once on the resolved Job: by `recsys-dist train` before any rank,
    and by the Trainer for a config given to it directly, before it takes the run directory."""
    cfg = load_config(ROOT / "configs" / "avazu_deepfm.yaml", ["model.name=dlrm"])  # no dense features
    with pytest.raises(ConfigError, match="model.name: dlrm needs dense features and avazu_csv has none"):
        check_sections(resolve_job(cfg))
    with pytest.raises(ConfigError, match="model.name: dlrm needs dense features"):
        recsys_dist.Trainer(cfg, tmp_path / "run")
    assert not (tmp_path / "run").exists()
    # Below the public API the Trainer takes the resolved Job only.
    with pytest.raises(TypeError, match="takes a resolved Job, got RunConfig"):
        trainer.Trainer(load_config(QUICKSTART), tmp_path / "run")
    assert not (tmp_path / "run").exists()


def test_the_job_sections_are_the_run_configs_fields_in_order():
    """One source of section names: the Job's SECTIONS are RunConfig's fields, in config order,
    each of the same class (``model``: the base of every model's config class)."""
    assert list(SECTIONS) == list(RunConfig.model_fields)
    cfg = load_config(QUICKSTART)
    job = resolve_job(cfg)
    assert list(job.sections()) == list(RunConfig.model_fields)
    assert all(isinstance(getattr(cfg, n), cls) for n, cls in SECTIONS.items())
    assert job.to_dict() == cfg.to_dict()
    with pytest.raises(TypeError, match="expected a RunConfig"):
        resolve_job(cfg.data)


def test_an_import_path_whose_module_raises_is_a_config_error_naming_the_key(tmp_path, monkeypatch):
    from recsys_dist.section import import_object

    (tmp_path / "broken_loss.py").write_text("raise RuntimeError('boom at import')\n")
    (tmp_path / "bad_syntax.py").write_text("def f(:\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ValueError, match="train.loss: importing module 'broken_loss' failed: RuntimeError: boom"):
        import_object("broken_loss:f", "train.loss")
    with pytest.raises(ValueError, match="train.loss: importing module 'bad_syntax' failed: SyntaxError"):
        import_object("bad_syntax:f", "train.loss")
