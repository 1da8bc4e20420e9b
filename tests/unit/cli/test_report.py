"""recsys_dist.cli.report on synthetic run directories written here (no training)."""

import json
import math

import pytest

from recsys_dist.cli import report as rpt

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def make_run(path, *, timing=True, summary=True, plan=True, auc_shift=0.0, batch_size=32, bad_tail=False):
    """A run directory like the trainer writes: 40 steps, train lines every 5, 2 evals, test."""
    path.mkdir(parents=True)
    lines = []
    for step in range(5, 45, 5):
        rec = {"split": "train", "step": step, "epoch": 0, "loss": 0.7 - step / 200, "samples_per_s": 1000.0 + step}
        if timing:
            rec.update(time_data_ms=1.0, time_forward_ms=2.0 + step / 40, time_backward_ms=3.0, time_optimizer_ms=0.5)
        lines.append(rec)
        if step % 20 == 0:
            lines.append(
                {
                    "split": "validation",
                    "step": step,
                    "epoch": 0,
                    "auc": 0.70 + step / 1000 + auc_shift,
                    "logloss": 0.5 - step / 1000,
                    "ne": 0.95,
                    "calibration": 1.01,
                    "accuracy": 0.77,
                    "num_examples": 1000,
                }
            )
    lines.append(
        {
            "split": "test",
            "step": 40,
            "epoch": 0,
            "auc": 0.75 + auc_shift,
            "logloss": 0.46,
            "ne": None,
            "calibration": 0.99,
            "accuracy": 0.8,
            "num_examples": 1000,
        }
    )
    text = "".join(json.dumps(r) + "\n" for r in lines)
    if bad_tail:
        text += '{"split": "train", "st'  # cut short by a crash
    (path / "metrics.jsonl").write_text(text)
    if summary:
        (path / "summary.json").write_text(
            json.dumps(
                {
                    "run_dir": str(path),
                    "world_size": 3,
                    "steps": 40,
                    "rows_trained": 3840,
                    "train_seconds": 3.5,
                    "samples_per_s": 1097.1,
                    "validation": {"auc": 0.74},
                    "test": {"auc": 0.75},
                }
            )
        )
    if plan:
        (path / "plan.json").write_text(
            json.dumps(
                [
                    {
                        "module": "m",
                        "table": "t0",
                        "sharding_type": "row_wise",
                        "compute_kernel": "fused",
                        "ranks": [0, 1, 2],
                    },
                    {
                        "module": "m",
                        "table": "t1",
                        "sharding_type": "table_wise",
                        "compute_kernel": "fused",
                        "ranks": [1],
                    },
                    {
                        "module": "m",
                        "table": "t2",
                        "sharding_type": "table_wise",
                        "compute_kernel": "fused",
                        "ranks": [2],
                    },
                    {
                        "module": "m",
                        "table": "t3",
                        "sharding_type": "data_parallel",
                        "compute_kernel": "dense",
                        "ranks": [0, 1, 2],
                    },
                ]
            )
        )
    (path / "config.yaml").write_text(f"train:\n  batch_size: {batch_size}\n  seed: 0\nmodel:\n  name: dlrm\n")
    return path


def test_report_summary_and_all_plots(tmp_path):
    run = make_run(tmp_path / "run")
    text = rpt.report(run)
    assert "steps 40" in text and "rows trained 3,840" in text and "samples/s 1097.1" in text and "ranks 3" in text
    val = next(l for l in text.splitlines() if l.strip().startswith("validation"))
    assert val.split()[1:4] == ["40", "0.7400", "0.4600"]  # final validation line, not the first
    test = next(l for l in text.splitlines() if l.strip().startswith("test"))
    assert "0.7500" in test and "n/a" in test  # NE null (NaN in the run) shows as n/a
    assert "plan: 4 tables (data_parallel 1, row_wise 1, table_wise 2)" in text
    assert "tables per rank: r0 2, r1 3, r2 3" in text
    assert "mean step time: data 1.00 ms" in text
    for name in ("loss.png", "validation.png", "throughput.png", "step_time.png", "plan.png"):
        assert (run / name).read_bytes()[:8] == PNG_MAGIC, name
        assert str(run / name) in text


def test_report_without_optional_files_skips_their_plots(tmp_path):
    run = make_run(tmp_path / "run", timing=False, summary=False, plan=False, bad_tail=True)
    text = rpt.report(run)
    assert "steps 40" in text  # from metrics.jsonl when summary.json is missing
    assert "rows trained n/a" in text
    assert "missing: summary.json, plan.json" in text
    assert "skipped 1 unreadable line(s)" in text
    assert not (run / "step_time.png").exists() and not (run / "plan.png").exists()
    assert (run / "loss.png").exists() and (run / "validation.png").exists()


def test_report_no_plots_and_out_dir(tmp_path):
    run = make_run(tmp_path / "run")
    assert "plots:" not in rpt.report(run, plots=False)
    assert not list(run.glob("*.png"))
    rpt.report(run, out_dir=tmp_path / "figs")
    assert (tmp_path / "figs" / "loss.png").exists() and not list(run.glob("*.png"))


def test_compare_side_by_side_with_deltas_and_config_diff(tmp_path):
    a = make_run(tmp_path / "a")
    b = make_run(tmp_path / "b", auc_shift=0.01, batch_size=64, plan=False)
    text = rpt.compare(a, b)
    assert text.splitlines()[0] == f"A {a}" and text.splitlines()[1] == f"B {b}"
    row = next(l for l in text.splitlines() if l.strip().startswith("validation auc"))
    assert row.split()[2:] == ["0.7400", "0.7500", "+0.0100"]
    row = next(l for l in text.splitlines() if l.strip().startswith("test ne"))
    assert row.split()[2:] == ["n/a", "n/a"]  # no delta of undefined values
    assert "train.batch_size: 32 -> 64" in text and "seed" not in text
    assert "B missing: plan.json" in text


def restored(path, weights_step=20, in_metrics=True):
    """make_run's run as if early stopping put back the weights of ``weights_step`` (validated
    at 20 and 40, trained to 40): the test line and summary.json name that step."""
    make_run(path)
    lines = [json.loads(l) for l in (path / "metrics.jsonl").read_text().splitlines()]
    for rec in lines:
        if rec["split"] == "test":
            rec["weights_step"] = weights_step
    if not in_metrics:  # e.g. an eval.every_n_steps line left out: only summary.json has it
        lines = [r for r in lines if not (r["split"] == "validation" and r["step"] == weights_step)]
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    summary = json.loads((path / "summary.json").read_text())
    summary.update(weights_step=weights_step, validation={"auc": 0.72, "logloss": 0.48, "ne": 0.95})
    (path / "summary.json").write_text(json.dumps(summary))
    return path


@pytest.mark.parametrize("in_metrics", [True, False])
def test_report_and_compare_show_the_validation_of_the_weights_scored(tmp_path, in_metrics):
    """Issue 40: after restore_best the test line scored step 20's weights; the validation
    next to it is step 20's (0.72), not the last, discarded weights' (step 40, 0.74)."""
    run = restored(tmp_path / "run", in_metrics=in_metrics)
    text = rpt.report(run, plots=False)
    val = next(l for l in text.splitlines() if l.strip().startswith("validation "))
    assert val.split()[1:4] == ["20", "0.7200", "0.4800"]
    assert (
        "validation and test: the weights of step 20, the best validation's (train.early_stopping.restore_best); "
        "trained to step 40; the last validation (step 40, weights not kept): AUC 0.7400, logloss 0.4600"
    ) in text
    plain = make_run(tmp_path / "plain", auc_shift=0.01)  # no early stopping: the last validation
    assert "weights of step" not in rpt.report(plain, plots=False)
    out = rpt.compare(run, plain).splitlines()
    assert next(l for l in out if l.strip().startswith("validation auc")).split()[2:] == ["0.7200", "0.7500", "+0.0300"]
    assert next(l for l in out if l.strip().startswith("weights of step")).split()[3:] == ["20", "n/a"]
    assert any("scored with the weights of the step shown" in l for l in out)
    rpt.report(run, out_dir=tmp_path / "figs")  # the test point drawn at step 20 does not break the plot
    assert (tmp_path / "figs" / "validation.png").exists()


def test_bad_summary_json_is_named(tmp_path):
    run = make_run(tmp_path / "run")
    (run / "summary.json").write_text("{oops")
    with pytest.raises(rpt.RunDirError, match="summary.json is not valid JSON"):
        rpt.report(run)


def test_step_time_stacked_area_for_many_points(tmp_path):
    run = tmp_path / "long"
    run.mkdir()
    recs = [
        {
            "split": "train",
            "step": s,
            "loss": math.exp(-s / 100),
            "samples_per_s": 500.0,
            "time_forward_ms": 2.0,
            "time_backward_ms": 3.0,
            "time_comm_ms": 1.0,
        }
        for s in range(1, 200)
    ]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    text = rpt.report(run)
    assert (run / "step_time.png").exists() and not (run / "validation.png").exists()
    assert "comm 1.00 ms" in text  # an unknown phase key is still shown, after the known ones


def test_hand_damaged_run_files_are_clear_errors_or_skipped_lines(tmp_path):
    from recsys_dist.cli.report import RunDirError, load_run

    (tmp_path / "metrics.jsonl").write_text(
        '{"split": "train", "step": 1, "loss": 0.5}\n{"split": "train", "step": "abc", "loss": "x"}\n'
    )
    run = load_run(tmp_path)
    assert len(run.records) == 1 and run.bad_lines == 1
    (tmp_path / "summary.json").write_text("[1, 2]")
    with pytest.raises(RunDirError, match="summary.json holds a list, not the JSON dict"):
        load_run(tmp_path)


def test_report_shows_the_ledger_line(tmp_path):
    run = tmp_path / "run"
    make_run(run)
    zero = {"sent": 0, "received": 0}
    ledger = {
        "split": "ledger",
        "step": 0,
        "epoch": 0,
        "forward_precision": "fp16",
        "backward_precision": "fp32",
        "per_rank": [
            {
                "rank": 0,
                "input_dist": {"sent": 2048, "received": 2048},
                "output_dist_forward": zero,
                "output_dist_backward": zero,
                "allreduce": zero,
            },
            {
                "rank": 1,
                "input_dist": {"sent": 1024, "received": 4096},
                "output_dist_forward": {"sent": 4096, "received": 0},
                "output_dist_backward": zero,
                "allreduce": {"sent": 512, "received": 512},
            },
        ],
    }
    with (run / "metrics.jsonl").open("a") as f:
        f.write(json.dumps(ledger) + "\n")
    text = rpt.report(run, plots=False)
    assert (
        "wire KiB sent per step (ledger, busiest rank r1, output_dist fp16/fp32): input_dist 1.0, "
        "output_dist_forward 4.0, output_dist_backward 0.0, allreduce 0.5" in text
    )
    assert "unreadable" not in text and "managed_all_gather" not in text
    # managed-collision tables: their all_gathers are shown when the ledger has them
    ledger["per_rank"][1]["managed_all_gather"] = {"sent": 3072, "received": 3072}
    ledger["step"] = 5
    with (run / "metrics.jsonl").open("a") as f:
        f.write(json.dumps(ledger) + "\n")
    assert "allreduce 0.5, managed_all_gather 3.0" in rpt.report(run, plots=False)
    # the dense tower under distributed.dense.strategy: fsdp: FSDP's all-gather and reduce-scatter
    ledger["per_rank"][1]["fsdp_all_gather"] = {"sent": 2048, "received": 2048}
    ledger["per_rank"][1]["fsdp_reduce_scatter"] = {"sent": 1024, "received": 1024}
    ledger["step"] = 6
    with (run / "metrics.jsonl").open("a") as f:
        f.write(json.dumps(ledger) + "\n")
    assert "managed_all_gather 3.0, fsdp_all_gather 2.0, fsdp_reduce_scatter 1.0" in rpt.report(run, plots=False)
    # multi-hot features whose bag size the ledger did not know are named (counted as 1 id)
    ledger["unsized_multi_hot"], ledger["step"] = ["genres"], 7
    with (run / "metrics.jsonl").open("a") as f:
        f.write(json.dumps(ledger) + "\n")
    assert "(multi-hot genres counted as 1 id per example)" in rpt.report(run, plots=False)


def test_report_shows_each_tasks_train_loss(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    lines = [
        {"split": "train", "step": s, "epoch": 0, "loss": 0.9 - s / 100, "loss/like": 0.6, "loss/rating": 3.0 - s / 10}
        for s in (5, 10)
    ]
    lines.append({"split": "test", "step": 10, "epoch": 0, "like/auc": 0.74, "rating/rmse": 0.95, "num_examples": 9})
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    text = rpt.report(run, out_dir=tmp_path / "plots")
    assert "last train loss 0.8000 (per task before loss_weights: like 0.6000, rating 2.0000) at step 10" in text
    assert (tmp_path / "plots" / "loss.png").read_bytes()[:8] == PNG_MAGIC
