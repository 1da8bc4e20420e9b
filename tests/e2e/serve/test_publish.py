"""Publishing (recsys_dist.serve.publish): a full version, then deltas of the changed rows, folded
back bit for bit; int8 / int4 rows through TorchRec's quantized modules; resume and damage.

One 2-rank training run (gloo) of the quickstart's DLRM on 2,000 Criteo rows saves checkpoints at
steps 2, 4 and 6; every test publishes those checkpoints itself (a Publisher per test).
"""

import json
import os
import re
import shutil

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from torchrec.quant.embedding_modules import EmbeddingBagCollection as QuantEBC

from recsys_dist.errors import CheckpointError
from recsys_dist.serve.export import load, score
from recsys_dist.serve.publish import Publisher, export_from_publish, latest_version, load_published
from recsys_dist.serve.quantize import published_state
from recsys_dist.train.config import PublishConfig
from tests.cli import run_cli
from tests.conftest import QUICKSTART
from tests.e2e.serve.conftest import cli, converted_test_split, logits
from tests.unit.serve.test_publish import FP32

TABLE = "model.sparse_arch.embedding_bag_collection.embedding_bags.t_C{}.weight"


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    """(tmp, [checkpoint at step 2, 4, 6], their state dicts as serve.export.load reads them, test split)."""
    tmp = tmp_path_factory.mktemp("publish")
    run = tmp / "run"
    cli(
        ["train", "--config", QUICKSTART, "--run-dir", run, "distributed.nproc_per_node=2"]
        + ["train.progress_bar=false", "data.num_rows=2000", "train.max_steps=6", "train.batch_size=32"]
        + ["checkpoint.every_n_steps=2", "checkpoint.keep=5"],
        tmp,
    )
    paths = sorted((run / "checkpoints").glob("step_*"))
    assert [p.name for p in paths] == ["step_00000002", "step_00000004", "step_00000006"]
    states = [load(p, preprocessing=False).model.state_dict() for p in paths]
    return tmp, paths, states, converted_test_split(tmp, "criteo")


def _publish_all(ckpts, d, cfg=FP32):
    p = Publisher(d, cfg)
    return p, [p.publish(c) for c in ckpts[1]]


@pytest.mark.slow  # the 2-rank training run of the fixture
def test_full_then_two_deltas_fold_bit_exactly_to_each_checkpoint(ckpts, tmp_path):
    d = tmp_path / "pub"
    p, dirs = _publish_all(ckpts, d)
    assert [x.name for x in dirs] == ["v000001", "v000002", "v000003"] and p.version == 3
    manifest = json.loads((d / "manifest.json").read_text())
    assert manifest["latest"] == 3 == latest_version(d)
    got = [(e["version"], e["kind"], e["step"], e["base"], e["dir"]) for e in manifest["versions"]]
    assert got == [(1, "full", 2, None, "v000001"), (2, "delta", 4, 1, "v000002"), (3, "delta", 6, 2, "v000003")]
    assert {"config.yaml", "preprocessing.json", "model.safetensors", "version.json"} <= {
        f.name for f in dirs[0].iterdir()
    }
    assert sorted(f.name for f in dirs[1].iterdir()) == ["delta.safetensors", "version.json"]
    for version, want in zip((1, 2, 3), ckpts[2]):
        m, v = load_published(d, version)
        assert v == version and not m.model.training and m.preprocessing is not None
        have = m.model.state_dict()
        assert have.keys() == want.keys()
        for k in want:
            assert torch.equal(have[k], want[k]), (version, k)
    assert load_published(d)[1] == 3


@pytest.mark.slow  # the 2-rank training run of the fixture
def test_a_delta_holds_only_the_changed_rows_and_every_dense_tensor(ckpts, tmp_path):
    _, dirs = _publish_all(ckpts, tmp_path / "pub")
    old, new = ckpts[2][0], ckpts[2][1]
    delta = load_file(str(dirs[1] / "delta.safetensors"))
    info = json.loads((dirs[1] / "version.json").read_text())
    assert info["kind"] == "delta" and info["base"] == 1 and info["step"] == 4
    tables = [TABLE.format(i) for i in range(1, 27)]
    total = 0
    for k in tables:
        want_ids = torch.nonzero((old[k] != new[k]).any(dim=1)).flatten()  # rows the 2 steps trained
        assert torch.equal(delta[f"ids/{k}"], want_ids) and delta[f"ids/{k}"].dtype == torch.int64
        assert torch.equal(delta[f"rows/{k}"], new[k][want_ids])
        assert info["rows"][k] == len(want_ids)
        assert f"state/{k}" not in delta
        total += len(want_ids)
    # 2 steps x 64 rows x 26 features touch at most 3,328 of the 260,000 rows
    assert 0 < total <= 2 * 64 * 26
    dense = [k for k in new if k not in tables]
    assert dense and all(torch.equal(delta[f"state/{k}"], new[k]) for k in dense)
    assert set(delta) == {f"ids/{k}" for k in tables} | {f"rows/{k}" for k in tables} | {f"state/{k}" for k in dense}


@pytest.mark.slow  # the 2-rank training run of the fixture
def test_export_from_publish_scores_equal_predict_on_the_last_checkpoint(ckpts, tmp_path):
    tmp, paths, _, test = ckpts
    d = tmp_path / "pub"
    _publish_all(ckpts, d)
    out = tmp_path / "export"
    r = cli(["export", "--from-publish", d, "--out", out], tmp)
    assert "model.safetensors" in r.stdout and (out / "preprocessing.json").is_file()
    cli(["predict", out, "--data", test, "--out", tmp_path / "a.parquet"], tmp)
    cli(["predict", paths[-1], "--data", test, "--out", tmp_path / "b.parquet"], tmp)
    a, b = logits(tmp_path / "a.parquet"), logits(tmp_path / "b.parquet")
    assert len(a) == 200 and np.abs(a - b).max() <= 1e-6
    r = cli(["export", paths[-1], "--from-publish", d, "--out", out], tmp, check=False)
    assert r.returncode != 0 and "not both" in r.stderr


def _dequantize(rows: torch.Tensor, dim: int, bits: int) -> torch.Tensor:
    """FBGEMM's fused row-wise layout, read independently: fp16 scale, fp16 bias, then the
    values (int4: two per byte, low nibble first)."""
    sb = rows[:, :4].contiguous().view(torch.float16).float()
    if bits == 8:
        q = rows[:, 4 : 4 + dim].float()
    else:
        d = rows[:, 4 : 4 + dim // 2]
        q = torch.stack([d & 15, d >> 4], dim=-1).reshape(len(rows), dim).float()
    return q * sb[:, :1] + sb[:, 1:2]


@pytest.mark.slow  # the 2-rank training run of the fixture
@pytest.mark.parametrize("mode,bits,bound", [("int8", 8, 0.02), ("int4", 4, 0.3)])
def test_quantized_publish_scores_close_and_its_export_scores_the_same(ckpts, tmp_path, mode, bits, bound):
    _, paths, states, test = ckpts
    d = tmp_path / "pub"
    _publish_all(ckpts, d, PublishConfig(enabled=True, every_n_steps=2, quantize=mode))
    m, v = load_published(d)
    assert v == 3
    assert isinstance(m.model.model.sparse_arch.embedding_bag_collection, QuantEBC)
    # every published row is the last checkpoint's row to within half a quantization step
    rows = json.loads((d / "v000003" / "version.json").read_text())["rows"]
    assert 0 < sum(rows.values()) < 26 * 10000
    published = published_state(m.model)
    for i in (1, 7, 26):
        k = TABLE.format(i)
        fp = states[-1][k]
        got = _dequantize(published[k], 16, bits)
        step = (fp.max(1).values - fp.min(1).values) / (2**bits - 1)
        assert ((got - fp).abs().max(1).values <= step / 2 + 1e-3 * fp.abs().max(1).values + 1e-6).all()
    q = score(m.job, m.model, test, preprocessing=m.preprocessing)["logit"]
    ref = load(paths[-1])
    fp32 = score(ref.job, ref.model, test, preprocessing=ref.preprocessing)["logit"]
    # documented in docs/serving.md: int8 moves a logit by < 0.02 here, int4 by < 0.3
    assert 0 < np.abs(q - fp32).max() < bound
    out = tmp_path / "export"
    export_from_publish(d, out)
    e = load(out)
    assert isinstance(e.model.model.sparse_arch.embedding_bag_collection, QuantEBC)
    assert np.array_equal(score(e.job, e.model, test, preprocessing=e.preprocessing)["logit"], q)
    with pytest.raises(CheckpointError, match="quantized"):
        export_from_publish(d, tmp_path / "ts", format="torchscript")


@pytest.mark.slow  # the 2-rank training run of the fixture
def test_a_resumed_publisher_continues_numbering_and_drops_versions_past_its_step(ckpts, tmp_path, caplog):
    paths, states = ckpts[1], ckpts[2]
    d = tmp_path / "pub"
    p = Publisher(d, FP32)
    p.publish(paths[0]), p.publish(paths[1])
    p = Publisher(d, FP32, resume_step=4)  # nothing to drop: a delta on the folded state follows
    assert p.version == 2
    assert p.publish(paths[2]).name == "v000003"
    assert json.loads((d / "v000003" / "version.json").read_text())["kind"] == "delta"
    caplog.set_level("WARNING", logger="recsys_dist")
    p = Publisher(d, FP32, resume_step=2)  # the run resumes from step 2: versions 2 and 3 go ...
    assert p.version == 1 and "after the resumed step 2" in caplog.text
    # ... once a new version replaces them: until then a server keeps the newest (never an older one).
    assert latest_version(d) == 3 and (d / "v000003").is_dir() and not (d / "dropped").exists()
    assert load_published(d)[1] == 3
    new = p.publish(paths[1])
    assert new.name == "v000004" and json.loads((new / "version.json").read_text())["kind"] == "full"
    assert sorted(x.name.split("-")[0] for x in (d / "dropped").iterdir()) == ["v000002", "v000003"]
    assert not (d / "v000002").exists() and latest_version(d) == 4
    m, v = load_published(d)
    assert v == 4 and all(torch.equal(m.model.state_dict()[k], states[1][k]) for k in states[1])
    assert [e["version"] for e in json.loads((d / "manifest.json").read_text())["versions"]] == [1, 4]


@pytest.mark.slow  # the 2-rank training run of the fixture
def test_missing_damaged_or_gapped_versions_are_named_with_the_fix(ckpts, tmp_path):
    tmp = ckpts[0]
    d = tmp_path / "pub"
    _publish_all(ckpts, d)
    bad = tmp_path / "bad"
    shutil.copytree(d, bad)
    delta = bad / "v000003" / "delta.safetensors"
    data = bytearray(delta.read_bytes())
    data[-1] ^= 0xFF
    delta.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"v000003/delta.safetensors: damaged.*version=2"):
        load_published(bad)
    assert load_published(bad, version=2)[1] == 2  # an earlier version still loads
    shutil.rmtree(bad / "v000002")
    with pytest.raises(CheckpointError, match=r"v000002/version.json: missing"):
        load_published(bad, version=2)
    manifest = json.loads((d / "manifest.json").read_text())
    manifest["versions"] = [e for e in manifest["versions"] if e["version"] != 2]
    (bad / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match="builds on version 2, which is not published there"):
        load_published(bad)
    (bad / "manifest.json").unlink()
    with pytest.raises(CheckpointError, match="manifest.json: not found"):
        load_published(bad)
    assert latest_version(bad) is None
    r = cli(["export", "--from-publish", bad, "--out", tmp_path / "x"], tmp, check=False)
    assert r.returncode != 0 and "manifest.json: not found" in r.stderr


@pytest.mark.slow  # three 2-rank runs (one refused before its ranks start)
def test_a_full_disk_while_publishing_is_one_message_and_a_resume_publishes_on(tmp_path):
    """Was: two OSError tracebacks (one per rank), "training failed on rank 1" for rank 0's
    publish, the version's .tmp directory left on the full disk. And a new run given that
    publish.dir took it over, moving the versions to dropped/."""
    run = tmp_path / "run"
    args = ["train", "--config", QUICKSTART, "--run-dir", run, "train.progress_bar=false", "data.num_rows=2000"]
    args += ["train.max_steps=6", "checkpoint.every_n_steps=2", "checkpoint.keep=5"]
    args += ["publish.enabled=true", "publish.every_n_steps=2"]
    r = run_cli(args, tmp_path, env={"RECSYS_DIST_FAULT": "publish_full:4:0"})
    err = r.stderr
    assert r.returncode == 1 and "Traceback" not in err and err.count("could not be written") == 1, err
    assert "training failed on rank 0:" in err and "rank 0 (the rank that publishes)" in err
    assert f"version 2 (the checkpoint of step 4) could not be written to {run / 'publish'} ([Errno 28]" in err
    assert re.search(r"it needs about \d+\.\d MiB, \d+\.\d MiB free there\)", err)
    assert f"continue with --resume auto --run-dir {run}" in err
    assert sorted(os.listdir(run / "publish")) == [".lock", "manifest.json", "v000001"]  # no .tmp left
    r = run_cli([*args, "--resume", "auto"], tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    manifest = json.loads((run / "publish" / "manifest.json").read_text())
    assert [(e["version"], e["kind"], e["step"]) for e in manifest["versions"]] == [
        (1, "full", 2),
        (2, "delta", 4),
        (3, "delta", 6),
    ]
    for version, step in ((2, 4), (3, 6)):
        want = load(run / "checkpoints" / f"step_{step:08d}", preprocessing=False).model.state_dict()
        have = load_published(run / "publish", version)[0].model.state_dict()
        assert all(torch.equal(have[k], want[k]) for k in want), version
    other = tmp_path / "other"
    other_args = [*args[:4], other, *args[5:], f"publish.dir={run / 'publish'}"]  # a new run, the same publish.dir
    r = run_cli(other_args, tmp_path)
    assert r.returncode != 0 and f"publish.dir {run / 'publish'} already holds versions 1..3 of another run" in r.stderr
    assert "publish.overwrite: true" in r.stderr and not (other / "checkpoints").exists()
    assert latest_version(run / "publish") == 3 and not (run / "publish" / "dropped").exists()
