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

import json
import shutil
import statistics
import tempfile
from pathlib import Path

import harness

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


def ours(config: Path, name: str, seeds: list[int], tmp: str, extra: list[str]) -> list[dict]:
    """Test metrics of our model ``name`` trained from ``config``, one run per seed (a failed
    run is tried once more)."""
    cin = ["model.cin_layer_sizes=[32,32]"] if name == "xdeepfm" else []  # an option no other model takes
    overrides = [f"model.name={name}", "checkpoint.enabled=false", *cin, *extra]
    return [
        harness.train(config, Path(tmp) / f"{config.stem}-{name}-{seed}", f"train.seed={seed}", *overrides, retries=1)[
            "test"
        ]
        for seed in seeds
    ]


def main(argv: list[str] | None = None) -> None:
    parser = harness.parser(__doc__, "deepctr_compare", "Criteo, deepfm, the first seed; ours 4 steps")
    parser.add_argument("--deepctr-python", required=True, help="python of an environment with deepctr-torch")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--data", nargs="+", choices=["criteo", "avazu"], default=["criteo", "avazu"])
    parser.add_argument("--models", nargs="+", choices=list(PAIRS), default=list(PAIRS))
    args = parser.parse_args(argv)
    if shutil.which(args.deepctr_python) is None:  # a clear error, not a FileNotFoundError from the first run
        parser.error(f"--deepctr-python: {args.deepctr_python} is neither an executable file nor a command on PATH")
    extra = []
    if args.smoke:
        args.seeds, args.data, args.models, extra = args.seeds[:1], ["criteo"], ["deepfm"], harness.SMOKE_TRAIN
    with harness.Results(args, argv):
        run(args, extra)


def run(args, extra: list[str]) -> None:
    """Both sides of every (data, model) pair; prints one line each."""
    from recsys_dist.config.job import resolve_job
    from recsys_dist.config.loader import load_config
    from recsys_dist.data.resolve import prepare_from_config

    print(
        f"{'data':<8}{'model':<11}{'ours AUC':>10}{'DeepCTR AUC':>13}{'diff':>8}{'ours logloss':>14}{'DeepCTR logloss':>17}"
    )
    with tempfile.TemporaryDirectory() as tmp:
        for data, base in (("criteo", "criteo_deepfm.yaml"), ("avazu", "avazu_deepfm.yaml")):
            if data not in args.data:
                continue
            config = harness.CONFIGS / base
            job = resolve_job(load_config(config))
            prepared = prepare_from_config(job.data, fmt=job.fmt)
            dense, sparse = job.features.dense_names, job.features.keys
            for name, theirs_name in PAIRS.items():
                if name not in args.models:
                    continue
                spec = {
                    "files": {k: str(v) for k, v in prepared.files.items()},
                    "dense": dense,
                    "sparse": sparse,
                    "sizes": job.table_sizes,
                    "seeds": args.seeds,
                    "model": theirs_name,
                }
                mine = ours(config, name, args.seeds, tmp, extra)
                mean = lambda rows, k: statistics.mean(x[k] for x in rows)  # noqa: E731
                try:
                    out = harness.python(WORKER, json.dumps(spec), executable=args.deepctr_python)
                except RuntimeError as err:
                    failed = (str(err).strip().splitlines() or ["?"])[-1]
                    print(f"{data:<8}{name:<11}{mean(mine, 'auc'):>10.4f} DeepCTR-Torch failed: {failed}")
                    continue
                theirs = list(harness.last_json(out).values())
                print(
                    f"{data:<8}{name:<11}{mean(mine, 'auc'):>10.4f}{mean(theirs, 'auc'):>13.4f}"
                    f"{mean(mine, 'auc') - mean(theirs, 'auc'):>+8.4f}{mean(mine, 'logloss'):>14.4f}"
                    f"{mean(theirs, 'logloss'):>17.4f}"
                )


if __name__ == "__main__":
    main()
