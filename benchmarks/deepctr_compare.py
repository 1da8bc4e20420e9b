"""recsys_dist's models vs DeepCTR-Torch on the same splits, ids and hyperparameters.

DeepCTR-Torch (PyPI ``deepctr-torch``) is never a dependency of the library: it runs in its
own environment, e.g.

    python3.11 -m venv /tmp/dctr && /tmp/dctr/bin/pip install torch==2.13.0 deepctr-torch scikit-learn pyarrow requests
    .venv/bin/python benchmarks/deepctr_compare.py --deepctr-python /tmp/dctr/bin/python [--seeds 0 1 2]

Both sides read the Parquet splits recsys_dist converts (same rows, same hashed ids), with
embedding dim 16, deep MLP 256-128, batch 64, one epoch, Adagrad at 0.02, no L2. Differences
that remain: recsys_dist trains its tables with fused row-wise Adagrad on 2 ranks (global
batch 64) and initialises them uniform(+-0.1); DeepCTR-Torch uses dense Adagrad on one
process and its own initialisation. Prints test AUC and logloss, mean over seeds.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# ours (config) -> DeepCTR-Torch model
PAIRS = {"deepfm": "DeepFM", "wide_deep": "WDL", "dcnv2": "DCN-M", "xdeepfm": "xDeepFM"}

WORKER = r"""
import json, sys, numpy as np, pyarrow.parquet as pq, torch
from sklearn.metrics import log_loss, roc_auc_score
from deepctr_torch.inputs import DenseFeat, SparseFeat, get_feature_names
from deepctr_torch import models
spec = json.loads(sys.argv[1])
tables = {s: pq.read_table(spec["files"][s]) for s in ("train", "test")}
dense, sparse, sizes = spec["dense"], spec["sparse"], spec["sizes"]
cols = [SparseFeat(n, vocabulary_size=v, embedding_dim=16) for n, v in zip(sparse, sizes)] + [DenseFeat(n, 1) for n in dense]
names = get_feature_names(cols)
def inputs(t):
    return {n: t.column(n).to_numpy() for n in names}
out = {}
for seed in spec["seeds"]:
    torch.manual_seed(seed); np.random.seed(seed)
    kw = dict(linear_feature_columns=cols, dnn_feature_columns=cols, dnn_hidden_units=(256, 128),
              l2_reg_linear=0.0, l2_reg_embedding=0.0, l2_reg_dnn=0.0, seed=seed, task="binary", device="cpu")
    name = spec["model"]
    if name == "DeepFM": m = models.DeepFM(**kw)
    elif name == "WDL": m = models.WDL(**kw)
    elif name == "DCN-M": m = models.DCN(cross_num=3, cross_parameterization="matrix", **kw)
    else: m = models.xDeepFM(cin_layer_size=(32, 32), **kw)
    m.compile(torch.optim.Adagrad(m.parameters(), lr=0.02), "binary_crossentropy", metrics=[])
    m.fit(inputs(tables["train"]), tables["train"].column("label").to_numpy(), batch_size=64, epochs=1, verbose=0, shuffle=True)
    p = m.predict(inputs(tables["test"]), batch_size=4096).ravel()
    y = tables["test"].column("label").to_numpy()
    out[seed] = {"auc": roc_auc_score(y, p), "logloss": log_loss(y, np.clip(p, 1e-7, 1 - 1e-7))}
print(json.dumps(out))
"""


def ours(config: Path, name: str, seeds: list[int], tmp: str) -> list[dict]:
    res = []
    for seed in seeds:
        run = Path(tmp) / f"{config.stem}-{name}-{seed}"
        cmd = [
            sys.executable,
            "-m",
            "recsys_dist.cli.main",
            "train",
            "--config",
            str(config),
            "--run-dir",
            str(run),
            f"model.name={name}",
            f"train.seed={seed}",
            "checkpoint.enabled=false",
            "train.progress_bar=false",
            "model.cin_layer_sizes=[32,32]",
        ]
        r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
        if r.returncode:
            print(f"  (run failed once, retrying: {r.stderr.strip().splitlines()[-1:]})", file=sys.stderr)
            r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=True)
        res.append(json.loads((run / "summary.json").read_text())["test"])
    return res


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--deepctr-python", required=True, help="python of an environment with deepctr-torch")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--data", nargs="+", choices=["criteo", "avazu"], default=["criteo", "avazu"])
    parser.add_argument("--models", nargs="+", choices=list(PAIRS), default=list(PAIRS))
    args = parser.parse_args()
    if shutil.which(args.deepctr_python) is None:  # a clear error, not a FileNotFoundError from the first run
        parser.error(f"--deepctr-python: {args.deepctr_python} is neither an executable file nor a command on PATH")
    sys.path.insert(0, str(ROOT))
    from recsys_dist.config.loader import load_config
    from recsys_dist.data.resolve import feature_names, prepare_from_config
    from recsys_dist.models.build import table_sizes

    print(
        f"{'data':<8}{'model':<11}{'ours AUC':>10}{'DeepCTR AUC':>13}{'diff':>8}{'ours logloss':>14}{'DeepCTR logloss':>17}"
    )
    with tempfile.TemporaryDirectory() as tmp:
        for data, base in (("criteo", "criteo_deepfm.yaml"), ("avazu", "avazu_deepfm.yaml")):
            if data not in args.data:
                continue
            config = ROOT / "configs" / base
            cfg = load_config(config)
            prepared = prepare_from_config(cfg)
            dense, sparse = feature_names(cfg)
            for name, theirs_name in PAIRS.items():
                if name not in args.models:
                    continue
                spec = {
                    "files": {k: str(v) for k, v in prepared.files.items()},
                    "dense": dense,
                    "sparse": sparse,
                    "sizes": table_sizes(cfg),
                    "seeds": args.seeds,
                    "model": theirs_name,
                }
                r = subprocess.run(
                    [args.deepctr_python, "-c", WORKER, json.dumps(spec)], capture_output=True, text=True
                )
                if r.returncode:
                    print(f"{data:<8}{name:<11} DeepCTR-Torch failed: {r.stderr.strip().splitlines()[-1]}")
                    continue
                theirs = list(json.loads(r.stdout.strip().splitlines()[-1]).values())
                mine = ours(config, name, args.seeds, tmp)
                mean = lambda rows, k: statistics.mean(x[k] for x in rows)  # noqa: E731
                print(
                    f"{data:<8}{name:<11}{mean(mine, 'auc'):>10.4f}{mean(theirs, 'auc'):>13.4f}"
                    f"{mean(mine, 'auc') - mean(theirs, 'auc'):>+8.4f}{mean(mine, 'logloss'):>14.4f}"
                    f"{mean(theirs, 'logloss'):>17.4f}"
                )


if __name__ == "__main__":
    main()
