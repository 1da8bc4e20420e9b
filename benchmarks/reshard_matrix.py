"""Issue 18's done-when, by hand: each sequence / multi-task / retrieval config trains on 2 CPU
ranks with a mid-run checkpoint, resumes from it on 2 (exactness), 1 and 3 ranks (resharding)
with the same global batch, then exports and predicts. Per config: the largest absolute
difference of every final validation/test metric (summary.json) and of the step-N train loss
(metrics.jsonl) between each resumed run and the uninterrupted 2-rank run, export/predict
checks and wall times. Results: benchmarks/results/reshard_matrix_cpu2core_20261202.md.

Run from the repository root: python benchmarks/reshard_matrix.py OUT_DIR [NAME ...] (names: CONFIGS)
(per config 4 trainings, 1 export, 2 predictions; about 2 CPU-minutes each on 2 cores).
"""

from __future__ import annotations

import json
import math
import shutil
import sys
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
from benchmarks.side_by_side import recsys_dist  # noqa: E402

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
    return recsys_dist(*args)[1]


def metrics(run: Path) -> dict[str, float]:
    """validation/test metrics of summary.json plus the train loss logged at step STEPS."""
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
        if row.get("split") == "train" and row.get("step") == STEPS:
            out[f"train.loss@{STEPS}"] = row["loss"]
    return out


def rewind(ref: Path, dst: Path) -> None:
    """A copy of the finished run as it stood at the step-MID checkpoint."""
    shutil.copytree(ref, dst)
    root = dst / "checkpoints"
    for p in root.glob("step_*"):
        if int(p.name.split("_")[1].split(".")[0]) > MID:
            shutil.rmtree(p)
    (root / "latest").write_text(f"step_{MID:08d}")
    (dst / "summary.json").unlink()
    lines = (dst / "metrics.jsonl").read_text().splitlines()
    keep = [x for x in lines if json.loads(x).get("step", 0) <= MID]
    (dst / "metrics.jsonl").write_text("".join(x + "\n" for x in keep))


def check_predictions(path: Path) -> tuple[int, list[str], np.ndarray]:
    table = pq.read_table(path)
    keys = ("logit", "probability", "prediction", "score")
    cols = [c for c in table.column_names if any(k in c for k in keys)]
    if not cols:
        raise RuntimeError(f"{path}: no prediction column among {table.column_names}")
    values = np.stack([np.asarray(table[c], dtype=np.float64) for c in cols], axis=1)
    if not np.isfinite(values).all():
        raise RuntimeError(f"{path}: non-finite predictions")
    return table.num_rows, cols, values


def one(name: str, config: str, extra: list[str], out: Path) -> dict:
    base = out / name
    shutil.rmtree(base, ignore_errors=True)
    base.mkdir(parents=True)
    common = [f"train.max_steps={STEPS}", f"checkpoint.every_n_steps={MID}", "checkpoint.keep=5", *extra]
    res: dict = {"config": name, "overrides": common, "wall": {}, "diff": {}}
    ref = base / "ref_ws2"
    res["wall"]["train_ws2"] = cli(
        "train", "--config", config, "--run-dir", str(ref), *common,
        "distributed.nproc_per_node=2", f"train.batch_size={GLOBAL_BATCH // 2}",
    )  # fmt: skip
    want = metrics(ref)
    res["ref"] = want
    for ws in (2, 1, 3):
        run = base / f"resume_ws{ws}"
        rewind(ref, run)
        res["wall"][f"resume_ws{ws}"] = cli(
            "train", "--config", config, "--run-dir", str(run), "--resume", "auto", *common,
            f"distributed.nproc_per_node={ws}", f"train.batch_size={GLOBAL_BATCH // ws}",
        )  # fmt: skip
        got = metrics(run)
        summary = json.loads((run / "summary.json").read_text())
        assert summary["resumed_at_step"] == MID and summary["steps"] == STEPS, summary
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


def main() -> None:
    if sys.argv[1] == "--table":  # python benchmarks/reshard_matrix.py --table OUT_DIR
        rows = [json.loads(x) for x in (Path(sys.argv[2]) / "results.jsonl").read_text().splitlines()]
        print(table(rows))
        return
    out = Path(sys.argv[1]).resolve()  # the commands run from the repository root
    for name in sys.argv[2:] or list(CONFIGS):
        try:
            res = one(name, *CONFIGS[name], out)
        except Exception as exc:  # report and go on with the next config
            res = {"config": name, "error": str(exc)}
        print(json.dumps(res, default=str), flush=True)
        with open(out / "results.jsonl", "a") as f:
            f.write(json.dumps(res, default=str) + "\n")


if __name__ == "__main__":
    main()
