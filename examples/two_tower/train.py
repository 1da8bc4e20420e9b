"""Train the two-tower retrieval model on the MovieLens sample with 2 CPU ranks, then rank the
whole movie corpus for every test user and print recall@10 next to a most-popular baseline.

    python examples/two_tower/train.py [--nproc 2] [--run-dir DIR] [dotted.key=value ...]

Only recsys_dist's public API: ``load_config``, ``prepare``, ``feature_spec`` and
``ParquetBatchLoader`` (read the converted splits), ``launch`` (the ranks), ``Trainer`` (fit,
checkpoint, predict on the sharded model), ``load_model`` (the unsharded model back from the
checkpoint, for the retrieval evaluation).

Evaluation protocol (the same for the model and the baselines):
- positives: a test user's held-out ratings >= 4 (test rows with label 1); a user counts when
  they have at least one. A positive movie absent from the training split (its id is the
  out-of-vocabulary id 0) can be found by no method and stays in the denominator as a miss.
- candidates: every movie of the training split's vocabulary, minus the movies the user rated
  in the training split (those are known, and never test positives: each (user, movie) pair
  is one row of the file, in one split).
- recall@10 of a user: positives among their top 10 / their positives; averaged over users.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
CONFIG = HERE / "config.yaml"
# two_tower.py by import path (model.name: two_tower:TwoTower), here and in the ranks: a
# spawned rank starts with its parent's sys.path.
sys.path.insert(0, str(HERE))

import recsys_dist  # noqa: E402
import torch  # noqa: E402
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor  # noqa: E402

K = 10


@dataclass
class Split:
    """One converted split, every row, in file order: ids as the model sees them."""

    user: np.ndarray  # int64 [N] userId ids
    item: np.ndarray  # int64 [N] movieId ids (0: not in the training vocabulary)
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


def item_features(train: Split, num_items: int) -> tuple[np.ndarray, np.ndarray]:
    """Each movie's genres bag (a movie's genres are the same on every row), for ids
    0..num_items-1: (lengths [num_items], values). Id 0 gets an empty bag."""
    offsets = np.concatenate([[0], np.cumsum(train.genre_lengths)])
    first_row = np.full(num_items, -1)
    first_row[train.item[::-1]] = np.arange(len(train.item))[::-1]  # first row of each movie
    lengths, values = np.zeros(num_items, dtype=np.int64), []
    for i in range(1, num_items):
        r = first_row[i]
        if r >= 0:
            lengths[i] = train.genre_lengths[r]
            values.append(train.genres[offsets[r] : offsets[r + 1]])
    return lengths, np.concatenate(values) if values else np.zeros(0, dtype=np.int64)


def kjt(sparse_names: list[str], n: int, ids: dict[str, tuple[np.ndarray, np.ndarray]]) -> KeyedJaggedTensor:
    """A KJT of ``n`` rows keyed by ``sparse_names``: ``ids[key]`` = (lengths, values); a key
    not given gets empty bags (the tower that reads it is not called)."""
    lengths, values = [], []
    for key in sparse_names:
        ln, vals = ids.get(key, (np.zeros(n, dtype=np.int64), np.zeros(0, dtype=np.int64)))
        lengths.append(torch.as_tensor(ln, dtype=torch.int32))
        values.append(torch.as_tensor(vals, dtype=torch.int64))
    return KeyedJaggedTensor.from_lengths_sync(sparse_names, torch.cat(values), torch.cat(lengths))


def top_k(scores: torch.Tensor, seen: torch.Tensor, k: int = K) -> torch.Tensor:
    """int64 [U, k]: the k best candidates per row of ``scores`` [U, I] (float), ignoring
    column 0 (the out-of-vocabulary id) and each row's ``seen`` columns (bool [U, I]); ties go
    to the lower id."""
    s = scores.double().masked_fill(seen, float("-inf"))
    s[:, 0] = float("-inf")
    order = torch.sort(-s, dim=1, stable=True).indices
    return order[:, :k]


def recall(top: torch.Tensor, positives: list[np.ndarray]) -> np.ndarray:
    """float [U]: |top[u] & positives[u]| / |positives[u]| (positives: one id per held-out
    positive row, 0 for a movie the training split never had, which no top list holds)."""
    return np.array([np.isin(p, t.numpy()).sum() / len(p) for t, p in zip(top, positives)])


def job(config: str, overrides: list[str], run_dir: str):
    """Every rank: train, checkpoint, and score the test rows with the sharded model."""
    cfg = recsys_dist.load_config(config, overrides)
    with recsys_dist.Trainer(cfg, run_dir) as trainer:
        summary = trainer.fit()  # writes the final checkpoint
        logits = trainer.predict("test")["logit"]  # pair scores <u, v> / temperature, row order
    return summary, logits


def main(argv: list[str] | None = None) -> dict:
    """Train and evaluate; prints the table and returns everything it measured."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--run-dir", default=None)
    p.add_argument("--no-logq", action="store_true", help="train without the logQ correction")
    p.add_argument("overrides", nargs="*", help="config overrides, e.g. train.epochs=3")
    a = p.parse_args(argv)
    t0 = time.perf_counter()
    run_dir = Path(a.run_dir or f"runs/two_tower-{time.strftime('%Y%m%d-%H%M%S')}").resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    overrides = [f"distributed.nproc_per_node={a.nproc}", *a.overrides]

    # The converted splits (rank 0 of the job finds them in the cache) and the table sizes.
    cfg = recsys_dist.load_config(CONFIG, overrides)
    prepared = recsys_dist.prepare(cfg)
    spec = recsys_dist.feature_spec(cfg, prepared.num_embeddings)
    names, sizes = spec.sparse_names, spec.num_embeddings
    train, test = (read_split(prepared, s, names, sizes) for s in ("train", "test"))
    num_items = sizes[names.index("movieId")]
    counts = np.bincount(train.item, minlength=num_items)  # training ratings per movie
    if not a.no_logq:
        np.save(run_dir / "item_counts.npy", counts)
        overrides.append(f"model.args.item_counts={run_dir / 'item_counts.npy'}")

    summary, ranks_logits = recsys_dist.launch(job, a.nproc, str(CONFIG), overrides, str(run_dir))[0]

    # The unsharded model, from the checkpoint the ranks wrote.
    _, task, _ = recsys_dist.load_model(run_dir)
    model = task.model
    users = np.unique(test.user[test.label == 1])
    positives = [test.item[(test.user == u) & (test.label == 1)] for u in users]
    seen = torch.zeros(len(users), num_items, dtype=torch.bool)
    row_of = {u: i for i, u in enumerate(users)}
    for u, i in zip(train.user, train.item):
        if u in row_of:
            seen[row_of[u], i] = True
    genre_lengths, genre_values = item_features(train, num_items)
    with torch.no_grad():
        corpus = np.arange(num_items)
        ones_i, ones_u = np.ones(num_items, dtype=np.int64), np.ones(len(users), dtype=np.int64)
        items = kjt(names, num_items, {"movieId": (ones_i, corpus), "genres": (genre_lengths, genre_values)})
        item_vecs = model.item_vectors(items)  # [I, D]
        user_vecs = model.user_vectors(kjt(names, len(users), {"userId": (ones_u, users)}))  # [U, D]
        scores = user_vecs @ item_vecs.T  # [U, I]; the temperature does not change a ranking
        # The same pair scores two ways: the sharded model on the ranks, this unsharded copy.
        test_offsets = np.concatenate([[0], np.cumsum(test.genre_lengths)])
        pairs = model(
            torch.zeros(len(test.user), 0),
            kjt(
                names,
                len(test.user),
                {
                    "userId": (np.ones(len(test.user), dtype=np.int64), test.user),
                    "movieId": (np.ones(len(test.item), dtype=np.int64), test.item),
                    "genres": (test.genre_lengths, test.genres[: test_offsets[-1]]),
                },
            ),
        )
    pair_diff = float((pairs - ranks_logits).abs().max())

    model_top = top_k(scores, seen)
    popular = torch.as_tensor(counts, dtype=torch.float64).expand(len(users), -1)
    liked = torch.as_tensor(np.bincount(train.item[train.label == 1], minlength=num_items), dtype=torch.float64)
    pop_top, liked_top = top_k(popular, seen), top_k(liked.expand(len(users), -1), seen)
    result = {
        "run_dir": str(run_dir),
        "users": len(users),
        "items": num_items - 1,
        "positives": int(sum(len(p) for p in positives)),
        "recall_model": float(recall(model_top, positives).mean()),
        "recall_popular": float(recall(pop_top, positives).mean()),
        "recall_popular_liked": float(recall(liked_top, positives).mean()),
        "pair_score_max_diff": pair_diff,
        "test_auc": summary["test"]["auc"],
        "seconds": round(time.perf_counter() - t0, 1),
        # for checks (tests/test_examples.py)
        "user_ids": users,
        "positives_per_user": positives,
        "seen": seen,
        "user_vectors": user_vecs,
        "item_vectors": item_vecs,
        "model_top": model_top,
    }
    print(
        f"two-tower retrieval on MovieLens ({result['users']} test users, {result['items']} movies ranked, "
        f"{result['positives']} held-out positives; {a.nproc} ranks, {result['seconds']} s)\n"
        f"  recall@{K}  two-tower                      {result['recall_model']:.4f}\n"
        f"  recall@{K}  most popular (train ratings)    {result['recall_popular']:.4f}\n"
        f"  recall@{K}  most popular (train ratings>=4) {result['recall_popular_liked']:.4f}\n"
        f"  test pair AUC (liked vs not) {result['test_auc']:.4f}; sharded vs unsharded pair scores: "
        f"max |diff| {pair_diff:.2e}\n"
        f"  run directory: {run_dir}"
    )
    return result


if __name__ == "__main__":
    main()
