"""Train the two-tower retrieval model on the MovieLens sample with 2 CPU ranks, then rank the
whole movie corpus for every test user and print recall@10 next to a most-popular baseline.

    python examples/two_tower/train.py [--nproc 2] [--run-dir DIR] [dotted.key=value ...]

Only recsys_dist's public API: ``load_config``, ``prepare``, ``feature_spec`` and
``ParquetBatchLoader`` (read the converted splits), ``launch`` (the ranks), ``Trainer`` (fit,
checkpoint, predict on the sharded model), ``load_model`` (the unsharded model back from the
checkpoint, for the retrieval evaluation).

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
from dataclasses import dataclass
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
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor  # noqa: E402

import recsys_dist  # noqa: E402

K = 10


@dataclass
class Split:
    """One converted split, every row, in file order: ids as the model sees them."""

    user: np.ndarray  # int64 [N] userId ids
    item: np.ndarray  # int64 [N] movieId ids (the out-of-vocabulary id for a movie train lacks)
    genre_lengths: np.ndarray  # int64 [N] genres per row
    genres: np.ndarray  # int64 [sum(genre_lengths)] genres ids
    label: np.ndarray  # float32 [N] 1 = rating >= 4


def read_split(prepared, split: str, sparse_names: list[str], sizes: list[int]) -> Split:
    """Every row of ``split`` through the library's loader, one rank, unshuffled."""
    loader = recsys_dist.ParquetBatchLoader(
        prepared.paths(split), 4096, 0, 1, [], sparse_names, num_embeddings=sizes, prefetch=0
    )
    parts: dict[str, list] = {"userId": [], "movieId": [], "len": [], "genres": [], "label": []}
    for batch in loader:
        real = batch.weights > 0  # the last batch is padded
        kjt = batch.sparse_features
        parts["userId"].append(kjt["userId"].values()[real])
        parts["movieId"].append(kjt["movieId"].values()[real])
        g = kjt["genres"]
        lengths = g.lengths()
        keep = torch.repeat_interleave(real, lengths)
        parts["len"].append(lengths[real].long())
        parts["genres"].append(g.values()[keep])
        parts["label"].append(batch.labels[real])
    cat = {k: torch.cat(v).numpy() for k, v in parts.items()}
    return Split(cat["userId"], cat["movieId"], cat["len"], cat["genres"], cat["label"])


def item_features(train: Split, corpus: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Each corpus movie's genres bag, from its first training row (a movie's genres are the
    same on every row): (lengths [len(corpus)], values concatenated)."""
    offsets = np.concatenate([[0], np.cumsum(train.genre_lengths)])
    _, first_row = np.unique(train.item, return_index=True)  # np.unique sorts: corpus order
    assert np.array_equal(np.unique(train.item), corpus)
    values = [train.genres[offsets[r] : offsets[r + 1]] for r in first_row]
    return train.genre_lengths[first_row], np.concatenate(values)


def kjt(sparse_names: list[str], n: int, ids: dict[str, tuple[np.ndarray, np.ndarray]]) -> KeyedJaggedTensor:
    """A KJT of ``n`` rows keyed by ``sparse_names``: ``ids[key]`` = (lengths, values); a key
    not given gets empty bags (the tower that reads it is not called)."""
    lengths, values = [], []
    for key in sparse_names:
        ln, vals = ids.get(key, (np.zeros(n, dtype=np.int64), np.zeros(0, dtype=np.int64)))
        lengths.append(torch.as_tensor(ln, dtype=torch.int32))
        values.append(torch.as_tensor(vals, dtype=torch.int64))
    return KeyedJaggedTensor.from_lengths_sync(sparse_names, torch.cat(values), torch.cat(lengths))


def top_k(scores: torch.Tensor, seen: torch.Tensor, corpus: np.ndarray, k: int = K) -> np.ndarray:
    """int64 [U, k]: the ids of the k best corpus movies per user, by ``scores`` [U, C]
    (float, one column per ``corpus`` id, ascending), leaving out each user's ``seen`` columns
    (bool [U, C]); ties go to the lower id."""
    s = scores.double().masked_fill(seen, float("-inf"))
    order = torch.sort(-s, dim=1, stable=True).indices[:, :k]
    return corpus[order.numpy()]


def recall(top: np.ndarray, positives: list[np.ndarray]) -> np.ndarray:
    """float [U]: the share of user u's held-out positives (one id per positive row; a movie
    the training split never had is no corpus id, so never in a top list) in ``top[u]``."""
    return np.array([np.isin(p, t).sum() / len(p) for t, p in zip(top, positives)])


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
    train, held = (read_split(prepared, s, names, sizes) for s in ("train", a.split))
    num_items = sizes[names.index("movieId")]
    counts = np.bincount(train.item, minlength=num_items)  # training ratings per movie id
    corpus = np.unique(train.item)  # every movie of the training split, ascending ids
    if not a.no_logq:
        np.save(run_dir / "item_counts.npy", counts)
        overrides.append(f"model.args.item_counts={run_dir / 'item_counts.npy'}")

    summary, ranks_logits = recsys_dist.launch(job, a.nproc, str(CONFIG), overrides, str(run_dir), a.split)[0]

    # The unsharded model, from the checkpoint the ranks wrote.
    _, task, _ = recsys_dist.load_model(run_dir)
    model = task.model
    users = np.unique(held.user[held.label == 1])
    positives = [held.item[(held.user == u) & (held.label == 1)] for u in users]
    seen = torch.zeros(len(users), len(corpus), dtype=torch.bool)  # [U, C]: rated in training
    in_users = np.isin(train.user, users)
    seen[np.searchsorted(users, train.user[in_users]), np.searchsorted(corpus, train.item[in_users])] = True
    genre_lengths, genre_values = item_features(train, corpus)
    with torch.no_grad():
        ones_c, ones_u = np.ones(len(corpus), dtype=np.int64), np.ones(len(users), dtype=np.int64)
        items = kjt(names, len(corpus), {"movieId": (ones_c, corpus), "genres": (genre_lengths, genre_values)})
        item_vecs = model.item_vectors(items)  # [C, D]
        user_vecs = model.user_vectors(kjt(names, len(users), {"userId": (ones_u, users)}))  # [U, D]
        scores = user_vecs @ item_vecs.T  # [U, C]; the temperature does not change a ranking
        # The same pair scores two ways: the sharded model on the ranks, this unsharded copy.
        pairs = model(
            torch.zeros(len(held.user), 0),
            kjt(
                names,
                len(held.user),
                {
                    "userId": (np.ones(len(held.user), dtype=np.int64), held.user),
                    "movieId": (np.ones(len(held.item), dtype=np.int64), held.item),
                    "genres": (held.genre_lengths, held.genres),
                },
            ),
        )
    pair_diff = float((pairs - ranks_logits).abs().max())
    if not pair_diff < 1e-3:  # the checkpoint is not the model the ranks trained: no numbers from it
        raise SystemExit(f"the unsharded model from the checkpoint scores pairs {pair_diff} away from the ranks' model")

    rated = torch.as_tensor(counts[corpus], dtype=torch.float64)  # most popular: training ratings
    liked = torch.as_tensor(np.bincount(train.item[train.label == 1], minlength=num_items)[corpus], dtype=torch.float64)
    tops = {
        "two-tower": top_k(scores, seen, corpus),
        "most popular (train ratings)": top_k(rated.expand(len(users), -1), seen, corpus),
        "most popular (train ratings>=4)": top_k(liked.expand(len(users), -1), seen, corpus),
    }
    per_user = {name: recall(top, positives) for name, top in tops.items()}
    result = {
        "split": a.split,
        "k": K,
        "users": len(users),
        "items": len(corpus),
        "positives": int(sum(len(p) for p in positives)),
        "recall": {name: float(r.mean()) for name, r in per_user.items()},
        "pair_score_max_diff": pair_diff,
        "trainer_test_auc": summary["test"]["auc"],
        "seconds": round(time.perf_counter() - T0, 1),
        "nproc": a.nproc,
        "run_dir": str(run_dir),
        # per user, for checking by hand (tests/test_examples.py does)
        "per_user": [
            {
                "user": int(u),
                "positives": positives[i].tolist(),
                "recall": {name: float(r[i]) for name, r in per_user.items()},
                "top": {name: top[i].tolist() for name, top in tops.items()},
            }
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
