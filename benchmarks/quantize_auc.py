"""The AUC cost of publishing int8 / int4 embedding rows, vs fp32, on the shipped Criteo sample.

Trains the quickstart (configs/criteo_quickstart.yaml, 2 ranks, one run per seed; a run
directory already under ``--work`` is reused), publishes its last checkpoint with
``publish.quantize`` none / int8 / int4 (``recsys_dist.serve.publish.Publisher``), writes
``export --from-publish`` of each, loads the export and scores the test split of the training
conversion (1,000 rows). Reports test AUC (sklearn roc_auc_score) and logloss per variant, the
largest |logit - fp32 logit|, and the size of the published weights.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/quantize_auc.py [--seeds 0 1 2] [--work DIR] [--out FILE.md]
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import harness

MODES = ("none", "int8", "int4")


def train(run: Path, seed: int, extra: list[str]) -> None:
    """The quickstart with ``seed`` into ``run`` (unless it has a summary.json)."""
    if not (run / "summary.json").is_file():
        harness.train(harness.CONFIGS / "criteo_quickstart.yaml", run, f"train.seed={seed}", *extra)


def test_split(m) -> Path:
    conversion = Path(m.preprocessing.record["training_conversion"]["directory"])
    files = json.loads((conversion / "manifest.json").read_text())["files"]["test"]
    return conversion / files[0]


def measure(run: Path, work: Path) -> dict:
    """Per mode: test AUC, logloss, logits, rows, export MB, publish + export seconds; the
    fp32 export vs the checkpoint's own scores."""
    import numpy as np
    from sklearn.metrics import log_loss, roc_auc_score

    from recsys_dist.serve.export import MODEL_FILE, load, score
    from recsys_dist.serve.publish import Publisher, export_from_publish
    from recsys_dist.train.config import PublishConfig

    out = {}
    for mode in MODES:
        pub, exp = work / f"publish_{mode}", work / f"export_{mode}"
        shutil.rmtree(pub, ignore_errors=True), shutil.rmtree(exp, ignore_errors=True)
        t0 = time.perf_counter()
        Publisher(pub, PublishConfig(enabled=True, every_n_steps=1, quantize=mode)).publish(run)
        export_from_publish(pub, exp)
        seconds = time.perf_counter() - t0
        m = load(exp)
        s = score(m.job, m.model, test_split(m), preprocessing=m.preprocessing)
        p = 1.0 / (1.0 + np.exp(-s["logit"].astype(np.float64)))
        out[mode] = {
            "auc": float(roc_auc_score(s["label"], p)),
            "logloss": float(log_loss(s["label"], p)),
            "logit": s["logit"],
            "rows": len(p),
            "mb": (exp / MODEL_FILE).stat().st_size / 1e6,
            "publish_export_s": seconds,
        }
    ref = load(run)  # the checkpoint as `recsys-dist predict` scores it
    s = score(ref.job, ref.model, test_split(ref), preprocessing=ref.preprocessing)
    out["none"]["vs_checkpoint"] = float(np.abs(s["logit"] - out["none"]["logit"]).max())
    for mode in MODES:
        out[mode]["max_dlogit"] = float(np.abs(out[mode]["logit"] - out["none"]["logit"]).max())
    return out


def report(results: dict[int, dict]) -> str:
    """The markdown report: setup, a row per seed and variant, the mean changes."""
    import numpy as np

    lines = [
        "Quickstart DLRM (26 tables x 10,000 rows x dim 16), trained 1 epoch on 2 ranks on the shipped 10,000-row",
        "Criteo sample; its last checkpoint published with `publish.quantize` none / int8 / int4, exported with",
        "`export_from_publish`, loaded with `serve.export.load` and scored on the 1,000-row test split. int8 / int4:",
        "row-wise, an fp16 scale and bias per row (FBGEMM via TorchRec's quantized EmbeddingBagCollection);",
        "dense layers fp32.",
        "",
        "| seed | variant | test AUC | AUC - fp32 | logloss | logloss - fp32 | max abs logit diff vs fp32 | weights MB |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for seed, r in results.items():
        for mode in MODES:
            v = r[mode]
            lines.append(
                f"| {seed} | {'fp32' if mode == 'none' else mode} | {v['auc']:.4f} | {v['auc'] - r['none']['auc']:+.4f} "
                f"| {v['logloss']:.4f} | {v['logloss'] - r['none']['logloss']:+.4f} | {v['max_dlogit']:.2e} "
                f"| {v['mb']:.1f} |"
            )
    lines.append("")
    for mode in ("int8", "int4"):
        d_auc = [r[mode]["auc"] - r["none"]["auc"] for r in results.values()]
        d_ll = [r[mode]["logloss"] - r["none"]["logloss"] for r in results.values()]
        lines.append(
            f"- {mode}: mean AUC change {np.mean(d_auc):+.4f} (worst {min(d_auc):+.4f}), mean logloss change "
            f"{np.mean(d_ll):+.4f} over {len(results)} seed(s)."
        )
    worst = max(r["none"]["vs_checkpoint"] for r in results.values())
    lines.append(f"- fp32 publish vs the checkpoint scored directly (predict): max abs logit diff {worst:.1e}.")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    ap = harness.parser(__doc__, "quantize_auc", "4 training steps, in WORK/smoke")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0])
    ap.add_argument("--work", type=Path, default=Path("/tmp/quantize_auc"))
    ap.add_argument("--out", type=Path, default=None, help="write the results file here (else --record names it)")
    args = ap.parse_args(argv)
    extra = []
    if args.smoke:
        args.work, extra = args.work / "smoke", harness.SMOKE_TRAIN
    title = "Quantized publish: test AUC / logloss of int8 and int4 embedding rows vs fp32"
    with harness.Results(args, argv, path=args.out, title=title) as res:
        results = {}
        for seed in args.seeds:
            run = args.work / f"run_seed{seed}"
            train(run, seed, extra)
            results[seed] = measure(run, args.work / f"seed{seed}")
        res.markdown = report(results)
        print(res.markdown)


if __name__ == "__main__":
    main()
