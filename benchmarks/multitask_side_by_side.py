"""MMoE and PLE (two tasks) vs two single-task models on the shipped MovieLens sample: 3 seeds
each on the same split, then per variant the test metrics per seed and a paired bootstrap 95%
interval of the mean (over seeds) difference to the single-task models on the test rows
(like AUC, rating RMSE). Results: benchmarks/results/multitask_ple_cpu2core_20261202.md.

Run from the repository root: PYTHONPATH=$PWD .venv/bin/python benchmarks/multitask_side_by_side.py OUT_DIR
(trains up to 18 runs of 2 CPU ranks, then predicts each run's test split; a run directory
with a summary.json is reused).
"""

from __future__ import annotations

from pathlib import Path

import harness

MMOE, PLE = harness.CONFIGS / "movielens_multitask.yaml", harness.CONFIGS / "movielens_ple.yaml"
LIKE = {"like": {"column": "rating", "kind": "binary", "threshold": 4.0}}
RATING = {"rating": {"column": "rating", "kind": "regression"}}
VARIANTS = {  # name: (config, data.schema.labels or None (both tasks), rating loss weight)
    "single_like": (MMOE, LIKE, None),
    "single_rating": (MMOE, RATING, None),
    "mmoe_w0.1": (MMOE, None, 0.1),
    "mmoe_w1": (MMOE, None, 1.0),
    "ple_w0.1": (PLE, None, 0.1),
    "ple_w1": (PLE, None, 1.0),
}
SEEDS = (0, 1, 2)


def config(out: Path, name: str) -> Path:
    """The variant's config file: the shipped one with an absolute raw_path, its labels and loss weights."""
    import yaml

    base, labels, w = VARIANTS[name]
    cfg = yaml.safe_load(base.read_text())
    cfg["data"]["raw_path"] = str((base.parent / cfg["data"]["raw_path"]).resolve())
    if labels is not None:
        (task,) = labels
        cfg["data"]["schema"]["labels"] = labels
        cfg["train"]["loss"] = {task: cfg["train"]["loss"][task]}
        cfg["train"]["loss_weights"] = {task: 1.0}
    else:
        cfg["train"]["loss_weights"]["rating"] = w
    path = out / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


def column(t: dict, kind: str, task: str):
    import numpy as np

    return np.array(t[f"{kind}:{task}"] if f"{kind}:{task}" in t else t[kind], dtype=np.float64)


def main(argv: list[str] | None = None) -> None:
    p = harness.parser(__doc__, "multitask", "single-task and MMoE (rating weight 1) only, seed 0, 4 steps a run")
    p.add_argument("out", type=Path, help="run directories (a run with a summary.json is reused)")
    args = p.parse_args(argv)
    variants, seeds, extra = list(VARIANTS), SEEDS, []
    if args.smoke:
        variants, seeds, extra = ["single_like", "single_rating", "mmoe_w1"], (0,), harness.SMOKE_TRAIN
    with harness.Results(args, argv):
        run(args.out, variants, seeds, extra)


def run(out: Path, variants: list[str], seeds: tuple, extra: list[str]) -> None:
    """Train and predict every variant and seed (reusing what is there); print the comparison."""
    import numpy as np
    import pyarrow.parquet as pq
    import yaml
    from sklearn.metrics import roc_auc_score

    out = out.resolve()  # the commands run from the repository root
    out.mkdir(parents=True, exist_ok=True)
    preds, seconds = {}, {}
    for name in variants:
        cfg = config(out, name)
        tasks = list(yaml.safe_load(cfg.read_text())["data"]["schema"]["labels"])
        test = None
        for seed in seeds:
            rd = out / f"{name}_s{seed}"
            if not (rd / "summary.json").exists():
                seconds[name, seed] = harness.train(cfg, rd, f"train.seed={seed}", *extra)["wall_s"]
            path = rd / "test_preds.parquet"
            if not path.exists():
                test = test or harness.converted_test_split(cfg)
                harness.cli("predict", rd, "--data", test, "--out", path)
            t = pq.read_table(path).to_pydict()
            for task in tasks:
                kind = "probability" if task == "like" else "logit"
                preds[name, task, seed] = (column(t, "label", task), column(t, kind, task))
    y = {task: preds[f"single_{task}", task, 0][0] for task in ("like", "rating")}
    for (name, task, seed), (lab, _) in preds.items():
        assert np.array_equal(lab, y[task]), f"{name} seed {seed}: other test rows than the single-task runs"

    def rmse(label, p):
        return float(np.sqrt(np.mean((p - label) ** 2)))

    for task, label, metric in (("like", "AUC", roc_auc_score), ("rating", "RMSE", rmse)):
        ref = f"single_{task}"
        for name in variants:
            if (name, task, 0) not in preds:
                continue
            scores = [preds[name, task, s][1] for s in seeds]
            per_seed = [metric(y[task], p) for p in scores]
            line = f"{task} {label} {name}: " + " ".join(f"{v:.4f}" for v in per_seed)
            line += f"  mean {np.mean(per_seed):.4f}"
            if name != ref:
                refs = [preds[ref, task, s][1] for s in seeds]
                diff, (lo, hi) = harness.paired_bootstrap(y[task], scores, refs, metric)
                line += f"  - single: {diff:+.4f} [{lo:+.4f}, {hi:+.4f}]"
            print(line, flush=True)
    print("wall seconds per new run:", {f"{k}_s{s}": round(v, 1) for (k, s), v in seconds.items()})


if __name__ == "__main__":
    main()
