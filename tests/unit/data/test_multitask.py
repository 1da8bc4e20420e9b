"""Multi-task labels and sample weights (issue 18, part 2): conversion, loader, loss, metrics."""

import json

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
import torch.nn.functional as F
from sklearn.metrics import log_loss, mean_absolute_error, mean_squared_error, roc_auc_score

from recsys_dist.config import ConfigError
from recsys_dist.config.job import resolve_job
from recsys_dist.config.loader import config_from_dict
from recsys_dist.data.config import SchemaConfig
from recsys_dist.data.convert import ConversionSpec, prepare
from recsys_dist.data.formats.schema import SchemaFormat
from recsys_dist.data.loader import ParquetBatchLoader
from recsys_dist.errors import DataError
from recsys_dist.models.losses import bce, mse
from recsys_dist.models.task import MultiTaskLoss
from recsys_dist.train.metrics import task_metrics, weighted_auc
from recsys_dist.train.preflight import check_sections

LABELS = {"like": {"column": "rating", "threshold": 4.0}, "score": {"column": "rating", "kind": "regression"}}
SPEC = SchemaConfig(labels=LABELS, weight="w", categorical=["user"])
CSV = """user,rating,w
u1,4.5,1
u2,2.0,0.5
u1,4.0,2
u3,1,0
u4,5,3
"""


def test_labels_and_weights_converted_and_batched(tmp_path, cache_dir):
    raw = tmp_path / "r.csv"
    raw.write_text(CSV)
    p = prepare(ConversionSpec(SchemaFormat(SPEC), raw, 100, split=(1.0, 0.0, 0.0)))
    t = pq.read_table(p.files["train"])
    assert t.schema.names == ["label:like", "label:score", "user", "weight"]
    assert t.column("label:like").to_pylist() == [1.0, 0.0, 1.0, 0.0, 1.0]
    assert t.column("label:score").to_pylist() == [4.5, 2.0, 4.0, 1.0, 5.0]
    m = json.loads((p.directory / "manifest.json").read_text())
    assert m["tasks"] == {"like": "binary", "score": "regression"} and m["weight"] == "weight"
    # 5 rows, batch 4: the second batch has 1 real row and 3 padding rows (weight 0)
    loader = ParquetBatchLoader(
        str(p.files["train"]),
        4,
        0,
        1,
        [],
        ["user"],
        label_columns=["label:like", "label:score"],
        weight_column="weight",
    )
    b1, b2 = list(loader)
    assert b1.labels.shape == (4, 2)
    assert b1.labels[:, 1].tolist() == [4.5, 2.0, 4.0, 1.0]
    assert b1.weights.tolist() == [1.0, 0.5, 2.0, 0.0]
    assert b2.weights.tolist() == [3.0, 0.0, 0.0, 0.0]  # the sample weight times the real-row mask
    assert b2.labels[0].tolist() == [1.0, 5.0]


def test_single_label_conversion_key_and_columns_unchanged():
    """The one-task form keeps its Parquet layout and cache key (no 'labels'/'weight' in it)."""
    fmt = SchemaFormat(SchemaConfig(label="rating", label_threshold=4.0, categorical=["user"]))
    assert fmt.output_schema().names == ["label", "user"] and fmt.label_columns == ["label"]
    assert '"labels"' not in fmt.fingerprint and '"weight"' not in fmt.fingerprint


@pytest.mark.parametrize(("value", "why"), [("-1", "not a finite number >= 0"), ("abc", "not a number")])
def test_bad_weight_names_file_line_and_column(tmp_path, cache_dir, value, why):
    raw = tmp_path / "r.csv"
    raw.write_text(CSV.replace("u2,2.0,0.5", f"u2,2.0,{value}"))
    with pytest.raises(DataError) as err:
        prepare(ConversionSpec(SchemaFormat(SPEC), raw, 100, split=(1.0, 0.0, 0.0)))
    msg = str(err.value)
    assert "r.csv" in msg and "line 3" in msg and (" w" in msg or "column w" in msg) and why in msg


def _cfg(**over):
    d = {
        "data": {"format": "schema", "raw_path": "x.csv", "schema": {"labels": LABELS, "categorical": ["user"]}},
        "model": {"name": "mmoe"},
    }
    for k, v in over.items():
        d.setdefault(k, {}).update(v)
    return d


def test_config_errors_name_the_key():
    with pytest.raises(ConfigError, match=r"train\.loss_weights\.nope: no task 'nope'"):
        check_sections(resolve_job(config_from_dict(_cfg(train={"loss_weights": {"nope": 1.0}}))))
    with pytest.raises(ConfigError, match=r"train\.loss\.score: bce needs 0/1 labels"):
        check_sections(resolve_job(config_from_dict(_cfg(train={"loss": {"score": "bce"}}))))
    with pytest.raises(ConfigError, match=r"model\.name: dcnv2 gives one logit"):
        check_sections(resolve_job(config_from_dict(_cfg(model={"name": "dcnv2"}))))
    with pytest.raises(ConfigError, match="either label"):
        config_from_dict(_cfg(data={"schema": {"label": "rating", "labels": LABELS, "categorical": ["user"]}}))
    cfg = config_from_dict(_cfg(train={"loss_weights": {"score": 0.5}}))
    check_sections(resolve_job(cfg))
    assert cfg.train.task_losses(["like", "score"], ["binary", "regression"]) == [
        ("bce", {}, 1.0),
        ("mse", {}, 0.5),
    ]


def test_multi_task_loss_is_the_weighted_sum_of_weighted_means():
    g = torch.Generator().manual_seed(0)
    logits, w = torch.randn(16, 2, generator=g), torch.rand(16, generator=g)
    w[12:] = 0  # padding
    labels = torch.stack([(torch.rand(16, generator=g) > 0.5).float(), torch.randn(16, generator=g) * 2], 1)
    loss = MultiTaskLoss([("like", bce, {}, 1.0), ("score", mse, {}, 0.25)])(logits, labels, w)
    ref_bce = (w * F.binary_cross_entropy_with_logits(logits[:, 0], labels[:, 0], reduction="none")).sum() / w.sum()
    ref_mse = (w * (logits[:, 1] - labels[:, 1]) ** 2).sum() / w.sum()
    torch.testing.assert_close(loss, ref_bce + 0.25 * ref_mse)
    with pytest.raises(ValueError, match=r"must return \[B, 2\]"):
        MultiTaskLoss([("like", bce, {}, 1.0), ("score", mse, {}, 1.0)])(logits[:, :1], labels, w)


@pytest.mark.parametrize("seed", [0, 1])
def test_weighted_task_metrics_match_sklearn(seed):
    rng = np.random.default_rng(seed)
    n = 3000
    y = (rng.random(n) < 0.3).astype(np.float64)
    x = np.round(rng.normal(size=n) + y, 1)  # rounded: many ties
    w = rng.random(n) * 3
    w[:100] = 0
    t = lambda a: torch.from_numpy(a)  # noqa: E731
    m = task_metrics(t(x), t(y), t(w), "binary")
    p = 1 / (1 + np.exp(-x))
    assert m["auc"] == pytest.approx(roc_auc_score(y, x, sample_weight=w), abs=1e-12)
    assert weighted_auc(t(x), t(y), torch.ones(n)) == pytest.approx(roc_auc_score(y, x), abs=1e-12)
    assert m["logloss"] == pytest.approx(log_loss(y, p, sample_weight=w), rel=1e-9)
    ctr = np.average(y, weights=w)
    assert m["ne"] == pytest.approx(m["logloss"] / -(ctr * np.log(ctr) + (1 - ctr) * np.log(1 - ctr)), rel=1e-12)
    assert m["calibration"] == pytest.approx((w * p).sum() / (w * y).sum(), rel=1e-12)
    target = rng.normal(size=n) * 2
    r = task_metrics(t(x), t(target), t(w), "regression")
    assert r["rmse"] == pytest.approx(np.sqrt(mean_squared_error(target, x, sample_weight=w)), rel=1e-12)
    assert r["mae"] == pytest.approx(mean_absolute_error(target, x, sample_weight=w), rel=1e-12)


def test_resume_refuses_other_tasks(tmp_path):
    from recsys_dist.checkpoint.compat import check_compatible
    from recsys_dist.errors import CheckpointError

    one = {"data": {"schema": {"label": "rating"}}}
    two = {"data": {"schema": {"labels": LABELS}}}
    swapped = {"data": {"schema": {"labels": dict(reversed(list(LABELS.items())))}}}
    check_compatible(tmp_path, {"config": two}, two, tables=False)
    check_compatible(tmp_path, {"config": {}}, one, tables=False)  # before data.schema.labels: one task
    for old, new in ((one, two), (two, swapped)):
        with pytest.raises(CheckpointError, match=r"tasks \(data.schema.labels\)"):
            check_compatible(tmp_path, {"config": old}, new, tables=False)
