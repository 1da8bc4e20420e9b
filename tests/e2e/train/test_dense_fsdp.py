"""Issue 38 item 1 from the CLI: ``recsys-dist train ... distributed.dense.strategy=fsdp`` on the
quickstart (2 ranks, TrainPipelineSparseDist, validation, keep_best checkpoints) trains as ``ddp``
does, and ``recsys-dist export`` of its run is one unsharded model, the same as ddp's."""

from safetensors.torch import load_file

from tests.cli import read_metrics, run_cli, run_train
from tests.conftest import QUICKSTART

STEPS = ["train.max_steps=30", "train.log_every_n_steps=10", "checkpoint.keep_best=true"]


def test_fsdp_run_and_export_match_ddp(tmp_path):
    runs = {}
    for strategy in ("ddp", "fsdp"):
        run = tmp_path / strategy
        r = run_train(QUICKSTART, run, f"distributed.dense.strategy={strategy}", *STEPS, tmp=tmp_path)
        assert r.returncode == 0, r.stderr[-3000:]
        out = tmp_path / f"{strategy}.export"
        e = run_cli(["export", str(run), "--out", str(out)], tmp_path)
        assert e.returncode == 0, e.stderr[-3000:]
        runs[strategy] = (read_metrics(run), load_file(str(out / "model.safetensors")))
    ddp_w, fsdp_w = runs["ddp"][1], runs["fsdp"][1]
    losses = {s: [m["loss"] for m in runs[s][0] if m["split"] == "train"] for s in runs}
    assert len(losses["ddp"]) == 3
    assert all(abs(a - b) <= 1e-5 * abs(b) for a, b in zip(losses["fsdp"], losses["ddp"], strict=True)), losses
    val = {s: [m["auc"] for m in runs[s][0] if m["split"] == "validation"] for s in runs}
    assert val["ddp"] and all(abs(a - b) < 1e-6 for a, b in zip(val["fsdp"], val["ddp"], strict=True)), val
    # One unsharded model: the same keys, shapes and (to float rounding) values as ddp's export.
    assert fsdp_w.keys() == ddp_w.keys()
    for k, v in ddp_w.items():
        assert fsdp_w[k].shape == v.shape, k
        assert (fsdp_w[k] - v).abs().max().item() < 1e-4, k
    assert any("dense_arch" in k for k in ddp_w)
