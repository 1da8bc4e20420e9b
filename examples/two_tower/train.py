"""Train the two-tower retrieval model on the MovieLens sample with 2 CPU ranks, then rank the
whole movie corpus for every test user and print recall@10 next to a most-popular baseline.

    python examples/two_tower/train.py [--nproc 2] [--run-dir DIR] [dotted.key=value ...]

Only recsys_dist's public API: ``load_config``, ``prepare`` and ``feature_spec`` (the converted
splits and table sizes), ``launch`` (the ranks), ``Trainer`` (fit, checkpoint, predict on the
sharded model), ``load_model`` (the unsharded model back from the checkpoint), and
``recsys_dist.models.retrieval``'s ``read_rows`` (a split's ids), ``embed`` (a tower over users or
items), ``make_kjt`` and ``rank_metrics`` (recall@K), for the retrieval evaluation.

Evaluation protocol (the same for the model and the baselines):
- positives: a test user's held-out ratings >= 4 (test rows with label 1); a user counts when
  they have at least one. A positive movie absent from the training split (it maps to the
  out-of-vocabulary id) can be found by no method and stays in the denominator as a miss.
- candidates (the corpus): every movie of the training split, minus the movies the user rated
  in the training split (those are known, and never test positives: each (user, movie) pair
  is one row of the file, in one split).
- recall@10 of a user: positives among their top 10 / their positives; averaged over users.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
import warnings
from pathlib import Path

import numpy as np

T0 = time.perf_counter()
# TorchRec's, torch.fx's and torch.distributed's notices about their internals, in this
# process and in the ranks (a spawned rank imports this file again), as recsys-dist does.
for category in (FutureWarning, UserWarning, DeprecationWarning):
    warnings.filterwarnings("ignore", category=category)
for name in ("torch.fx._symbolic_trace", "torchrec", "torch.distributed", "fbgemm_gpu"):
    logging.getLogger(name).setLevel(logging.ERROR)

HERE = Path(__file__).resolve().parent
CONFIG = HERE / "config.yaml"
# two_tower.py by import path (model.name: two_tower:TwoTower), here and in the ranks: a
# spawned rank starts with its parent's sys.path.
sys.path.insert(0, str(HERE))

import torch  # noqa: E402

import recsys_dist  # noqa: E402
from recsys_dist.data.loader.columns import take_bags  # noqa: E402
from recsys_dist.models.retrieval import Entities, embed, make_kjt, rank_metrics, read_rows  # noqa: E402

K = 10


def top_k(scores: torch.Tensor, seen: list[np.ndarray], corpus: np.ndarray, k: int = K) -> np.ndarray:
    """int64 [U, k], for retrieval.json: the ids of the k best corpus movies per user by
    ``scores`` [U, C] (a column per ``corpus`` id, ascending), each user's ``seen`` movies left
    out; ties to the lower id (the order ``rank_metrics`` ranks in)."""
    s = scores.double().clone()
    for u, ids in enumerate(seen):
        s[u, np.searchsorted(corpus, ids)] = float("-inf")
    return corpus[torch.sort(-s, dim=1, stable=True).indices[:, :k].numpy()]


def job(config: str, overrides: list[str], run_dir: str, split: str):
    """Every rank: train, checkpoint, and score ``split``'s rows with the sharded model."""
    cfg = recsys_dist.load_config(config, overrides)
    with recsys_dist.Trainer(cfg, run_dir) as trainer:
        summary = trainer.fit()  # writes the final checkpoint
        logits = trainer.predict(split)["logit"]  # pair scores <u, v> / temperature, row order
    return summary, logits


def main(argv: list[str] | None = None) -> dict:
    """Train and evaluate; prints the table and returns everything it measured."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--run-dir", default=None)
    p.add_argument("--no-logq", action="store_true", help="train without the logQ correction")
    p.add_argument("--split", default="test", choices=["test", "validation"], help="held-out split to rank for")
    p.add_argument("overrides", nargs="*", help="config overrides, e.g. train.epochs=3")
    a = p.parse_args(argv)
    run_dir = Path(a.run_dir or f"runs/two_tower-{time.strftime('%Y%m%d-%H%M%S')}").resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    overrides = [f"distributed.nproc_per_node={a.nproc}", *a.overrides]

    # The converted splits (rank 0 of the job finds them in the cache) and the table sizes.
    cfg = recsys_dist.load_config(CONFIG, overrides)
    prepared = recsys_dist.prepare(cfg)
    spec = recsys_dist.feature_spec(cfg, prepared.num_embeddings)
    names, sizes = spec.sparse_names, spec.num_embeddings
    train, held = (read_rows(prepared.paths(s), spec) for s in ("train", a.split))
    t_user, t_item, h_user, h_item = (r.one_hot(f) for r in (train, held) for f in ("userId", "movieId"))
    num_items = sizes[names.index("movieId")]
    counts = np.bincount(t_item, minlength=num_items)  # training ratings per movie id
    if not a.no_logq:
        np.save(run_dir / "item_counts.npy", counts)
        overrides.append(f"model.args.item_counts={run_dir / 'item_counts.npy'}")

    summary, ranks_logits = recsys_dist.launch(job, a.nproc, str(CONFIG), overrides, str(run_dir), a.split)[0]

    # The unsharded model, from the checkpoint the ranks wrote.
    _, task, _ = recsys_dist.load_model(run_dir)
    model = task.model
    # The corpus: every movie of the training split (ascending ids), with its first training row's genres.
    corpus, first = np.unique(t_item, return_index=True)
    items = Entities(corpus, {f: take_bags(*train.ids[f], first) for f in ("movieId", "genres")})
    users = np.unique(h_user[held.labels == 1])
    positives = [h_item[(h_user == u) & (held.labels == 1)] for u in users]
    seen = [np.unique(t_item[t_user == u]) for u in users]  # rated in training: not candidates
    # One batch per tower (as many rows as entities), on this process's CPU.
    cpu, user_ids = torch.device("cpu"), Entities(users, {"userId": (np.ones_like(users), users)})
    user_vecs = embed(model, "user_vectors", names, user_ids, len(users), cpu)  # [U, D]
    item_vecs = embed(model, "item_vectors", names, items, len(corpus), cpu)  # [C, D]
    scores = user_vecs @ item_vecs.T  # [U, C]; the temperature does not change a ranking
    with torch.no_grad():  # the same pair scores two ways: the sharded model on the ranks, this unsharded copy
        rows = np.arange(len(h_user))
        pairs = model(torch.zeros(len(rows), 0), make_kjt(names, Entities(rows, held.ids), rows))
    pair_diff = float((pairs - ranks_logits).abs().max())
    if not pair_diff < 1e-3:  # the checkpoint is not the model the ranks trained: no numbers from it
        raise SystemExit(f"the unsharded model from the checkpoint scores pairs {pair_diff} away from the ranks' model")

    liked = np.bincount(t_item[train.labels == 1], minlength=num_items)
    methods = {
        "two-tower": scores,
        "most popular (train ratings)": torch.as_tensor(counts[corpus], dtype=torch.float64).expand(len(users), -1),
        "most popular (train ratings>=4)": torch.as_tensor(liked[corpus], dtype=torch.float64).expand(len(users), -1),
    }
    recall = {name: rank_metrics(s, corpus, positives, seen, [K])[f"recall@{K}"] for name, s in methods.items()}
    tops = {name: top_k(s, seen, corpus) for name, s in methods.items()}
    result = {
        "split": a.split,
        "k": K,
        "users": len(users),
        "items": len(corpus),
        "positives": int(sum(len(p) for p in positives)),
        "recall": recall,
        "pair_score_max_diff": pair_diff,
        "trainer_test_auc": summary["test"]["auc"],
        "seconds": round(time.perf_counter() - T0, 1),
        "nproc": a.nproc,
        "run_dir": str(run_dir),
        # per user, for checking by hand (tests/e2e/examples/test_examples.py does)
        "per_user": [
            {"user": int(u), "positives": positives[i].tolist(), "top": {n: t[i].tolist() for n, t in tops.items()}}
            for i, u in enumerate(users)
        ],
    }
    (run_dir / "retrieval.json").write_text(json.dumps(result, indent=1))
    lines = [
        f"two-tower retrieval on MovieLens, {a.split} split: {result['users']} users, {result['items']} movies "
        f"ranked, {result['positives']} held-out positives ({a.nproc} ranks, {result['seconds']} s)"
    ]
    lines += [f"  recall@{K}  {name:<32} {r:.4f}" for name, r in result["recall"].items()]
    lines += [
        f"  the Trainer's test AUC (pair scores, liked vs not): {result['trainer_test_auc']:.4f}",
        f"  pair scores, sharded model on the ranks vs unsharded checkpoint: max |diff| {pair_diff:.1e}",
        f"  run directory: {run_dir} (per-user lists in retrieval.json)",
    ]
    print("\n".join(lines))
    return result


if __name__ == "__main__":
    main()
