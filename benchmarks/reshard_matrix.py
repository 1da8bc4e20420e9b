"""Issue 18's done-when, by hand: each sequence / multi-task / retrieval config trains on 2 CPU
ranks with a mid-run checkpoint, resumes from it on 2 (exactness), 1 and 3 ranks (resharding)
with the same global batch, then exports and predicts. Per config: the largest absolute
difference of every final validation/test metric (summary.json) and of the step-N train loss
(metrics.jsonl) between each resumed run and the uninterrupted 2-rank run, export/predict
checks and wall times. Results: benchmarks/results/reshard_matrix_cpu2core_20261202.md.

Run from the repository root: PYTHONPATH=$PWD .venv/bin/python benchmarks/reshard_matrix.py OUT_DIR [NAME ...]
(names: CONFIGS; per config 4 trainings, 1 export, 2 predictions; about 2 CPU-minutes each on 2
cores); ``--table OUT_DIR`` prints the table of the results already in OUT_DIR.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import harness

CONFIGS = {  # name: (config, extra overrides)
    "movielens_din": ("configs/movielens_din.yaml", []),
    # dropout 0: with dropout each rank draws masks for its own rows, so another world size
    # continues correctly but not bit for bit (docs/models.md); bst_dropout shows by how much
    "movielens_bst": ("configs/movielens_bst.yaml", ["model.transformer_dropout=0.0"]),
    "movielens_multitask": ("configs/movielens_multitask.yaml", []),
    "movielens_ple": ("configs/movielens_ple.yaml", []),
    "movielens_two_tower": ("configs/movielens_two_tower.yaml", []),
    "movielens_bst_dropout": ("configs/movielens_bst.yaml", []),  # the shipped dropout 0.1
}
STEPS, MID, GLOBAL_BATCH = 40, 20, 96
DATA = "datasets/movielens/ratings_genres_first20000_by_time.csv"


def cli(*args: str) -> float:
    """Run ``recsys-dist ARGS`` (from the repository root); the wall seconds. Raises
    RuntimeError on a non-zero exit (log shown)."""
    return harness.cli(*args)[1]


def metrics(run: Path, steps: int = STEPS) -> dict[str, float]:
    """validation/test metrics of summary.json plus the train loss logged at step ``steps``."""
    summary = json.loads((run / "summary.json").read_text())
    out = {}
    for split in ("validation", "test"):
        stack = [(split, summary[split])]
        while stack:
            key, value = stack.pop()
            if isinstance(value, dict):
                stack += [(f"{key}.{k}", v) for k, v in value.items()]
            elif isinstance(value, (int, float)):
                out[key] = float(value)
    for line in (run / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        if row.get("split") == "train" and row.get("step") == steps:
            out[f"train.loss@{steps}"] = row["loss"]
    return out


def rewind(ref: Path, dst: Path, mid: int = MID) -> None:
    """A copy of the finished run as it stood at the step-``mid`` checkpoint."""
    shutil.copytree(ref, dst)
    root = dst / "checkpoints"
    for p in root.glob("step_*"):
        if int(p.name.split("_")[1].split(".")[0]) > mid:
            shutil.rmtree(p)
    (root / "latest").write_text(f"step_{mid:08d}")
    (dst / "summary.json").unlink()
    lines = (dst / "metrics.jsonl").read_text().splitlines()
    keep = [x for x in lines if json.loads(x).get("step", 0) <= mid]
    (dst / "metrics.jsonl").write_text("".join(x + "\n" for x in keep))


def check_predictions(path: Path):
    """(rows, prediction columns, their values [rows, columns] float64) of a predictions file.

    Raises:
        RuntimeError: no prediction column, or a non-finite value."""
    import numpy as np
    import pyarrow.parquet as pq

    table = pq.read_table(path)
    keys = ("logit", "probability", "prediction", "score")
    cols = [c for c in table.column_names if any(k in c for k in keys)]
    if not cols:
        raise RuntimeError(f"{path}: no prediction column among {table.column_names}")
    values = np.stack([np.asarray(table[c], dtype=np.float64) for c in cols], axis=1)
    if not np.isfinite(values).all():
        raise RuntimeError(f"{path}: non-finite predictions")
    return table.num_rows, cols, values


def one(name: str, config: str, extra: list[str], out: Path, steps: int = STEPS, mid: int = MID) -> dict:
    """Train, resume on 2, 1 and 3 ranks, export and predict one config (module doc)."""
    import numpy as np

    base = out / name
    shutil.rmtree(base, ignore_errors=True)
    base.mkdir(parents=True)
    common = [f"train.max_steps={steps}", f"checkpoint.every_n_steps={mid}", "checkpoint.keep=5", *extra]
    res: dict = {"config": name, "overrides": common, "wall": {}, "diff": {}}
    ref = base / "ref_ws2"
    res["wall"]["train_ws2"] = cli(
        "train", "--config", config, "--run-dir", str(ref), *common,
        "distributed.nproc_per_node=2", f"train.batch_size={GLOBAL_BATCH // 2}",
    )  # fmt: skip
    want = metrics(ref, steps)
    res["ref"] = want
    for ws in (2, 1, 3):
        run = base / f"resume_ws{ws}"
        rewind(ref, run, mid)
        res["wall"][f"resume_ws{ws}"] = cli(
            "train", "--config", config, "--run-dir", str(run), "--resume", "auto", *common,
            f"distributed.nproc_per_node={ws}", f"train.batch_size={GLOBAL_BATCH // ws}",
        )  # fmt: skip
        got = metrics(run, steps)
        summary = harness.summary(run)
        assert summary["resumed_at_step"] == mid and summary["steps"] == steps, summary
        res["diff"][ws] = {k: abs(got[k] - v) if k in got else math.nan for k, v in want.items()}
    export = base / "export"
    res["wall"]["export"] = cli("export", str(ref), "--out", str(export))
    res["wall"]["predict"] = cli("predict", str(export), "--data", DATA, "--out", str(base / "pred_export.parquet"))
    cli("predict", str(ref), "--data", DATA, "--out", str(base / "pred_run.parquet"))
    rows, cols, a = check_predictions(base / "pred_export.parquet")
    _, _, b = check_predictions(base / "pred_run.parquet")
    res["predict"] = {"rows": rows, "columns": cols, "export_vs_checkpoint": float(np.abs(a - b).max())}
    if (export / "item_embeddings.npy").exists():
        emb = np.load(export / "item_embeddings.npy")
        ids = np.load(export / "item_ids.npy")
        norms = np.linalg.norm(emb, axis=1)
        res["item_embeddings"] = {
            "shape": list(emb.shape), "ids": int(ids.size), "finite": bool(np.isfinite(emb).all()),
            "max_abs(norm-1)": float(np.abs(norms - 1).max()),
        }  # fmt: skip
    return res


def table(results: list[dict]) -> str:
    """Markdown: per config the largest metric difference to the uninterrupted run per world size."""
    head = "| config | resume ws2 | resume ws1 | resume ws3 | export / predict | wall s (train ws2, resume ws2/1/3, export, predict) |"
    lines = [head, "| --- | --- | --- | --- | --- | --- |"]
    for r in results:
        if "error" in r:
            lines.append(f"| {r['config']} | error: {r['error'].splitlines()[0]} | | | | |")
            continue
        cells = []
        for ws in ("2", "1", "3"):
            diff = r["diff"][ws]
            worst = max(diff, key=lambda k: -1.0 if math.isnan(diff[k]) else diff[k])
            nan = [k for k, v in diff.items() if math.isnan(v)]
            cell = f"{diff[worst]:.1e} ({worst})" if diff[worst] else f"0 (all {len(diff)} equal)"
            cells.append(cell + (f"; missing {nan}" if nan else ""))
        p = r["predict"]
        ok = f"ok: {p['rows']} rows, {', '.join(p['columns'])}; export vs checkpoint {p['export_vs_checkpoint']:.1e}"
        if "item_embeddings" in r:
            e = r["item_embeddings"]
            ok += f"; item_embeddings {e['shape']}, finite {e['finite']}, max abs(norm-1) {e['max_abs(norm-1)']:.1e}"
        w = r["wall"]
        walls = ", ".join(
            f"{w[k]:.0f}" for k in ("train_ws2", "resume_ws2", "resume_ws1", "resume_ws3", "export", "predict")
        )
        lines.append(f"| {r['config']} | {cells[0]} | {cells[1]} | {cells[2]} | {ok} | {walls} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = harness.parser(__doc__, "reshard_matrix", "movielens_din only (unless NAMEs are given), 4 steps, resumed at 2")
    p.add_argument("out", type=Path, help="run directories; results.jsonl is appended to")
    p.add_argument("names", nargs="*", metavar="NAME", help=f"configs among {', '.join(CONFIGS)} (default: all)")
    p.add_argument("--table", action="store_true", help="only print the table of OUT/results.jsonl")
    args = p.parse_args(argv)
    if unknown := [n for n in args.names if n not in CONFIGS]:
        p.error(f"unknown config name(s) {unknown}; choose among {list(CONFIGS)}")
    with harness.Results(args, argv):
        if args.table:
            rows = [json.loads(x) for x in (args.out / "results.jsonl").read_text().splitlines()]
            print(table(rows))
            return
        out = args.out.resolve()  # the commands run from the repository root
        names = args.names or (["movielens_din"] if args.smoke else list(CONFIGS))
        steps, mid = (4, 2) if args.smoke else (STEPS, MID)
        for name in names:
            try:
                res = one(name, *CONFIGS[name], out, steps, mid)
            except Exception as exc:  # report and go on with the next config
                res = {"config": name, "error": str(exc)}
            print(json.dumps(res, default=str), flush=True)
            with open(out / "results.jsonl", "a") as f:
                f.write(json.dumps(res, default=str) + "\n")


if __name__ == "__main__":
    main()
