"""HSTU next-item retrieval on MovieLens ml-latest-small by the leave-last-out protocol, against
SASRec (``recsys_dist.models.sasrec_retrieval``: softmax causal self-attention, learned
positions, as the HSTU reference trains it) in the same model and training, the library's two-tower model (user id and item id towers, in-batch
softmax with the logQ correction) and the most-popular ranking, all under the same split and
ranking.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/hstu_retrieval.py \
        [--ratings ../shared/data/movielens/ratings.csv] [--encoders hstu sasrec two_tower] \
        [--seeds 0 1 2] [--epochs 101] [--eval-every 10]

Split (``recsys_dist.models.next_item.leave_last_out``): per user, by time, the last rating is
the test target, the one before the validation target, the rest the training sequence (every
rating counts as an interaction, as in the HSTU paper's MovieLens set-up). Hyperparameters are
the reference's ``configs/ml-1m/hstu-sampled-softmax-n128-final.gin``: history 200, batch 128,
D 50, 2 blocks, 1 head, d_qk = d_v = 50, dropout 0.2, Adam lr 1e-3 (betas 0.9, 0.98), 128
uniform negatives, temperature 0.05. One sample per user per epoch: the user's training
sequence (its last 201 items), every position predicting the next. Unsharded, one process,
one intra-op thread. Every ``--eval-every`` epochs: validation metrics; the test metrics are
those of the epoch with the best validation NDCG@10. Ranking as the reference's evaluation: all
items, less the items of the history the model read (``evaluate_next_item``'s default); the
most-popular ranking (by training sequences) leaves out the same items. Prints one JSON line per
evaluation (a sequence model's with its per-user test ranks) and one per (encoder, seed);
``benchmarks/hstu_retrieval_compare.py`` makes the tables and paired bootstraps from them.
"""

from __future__ import annotations

import argparse
import csv
import json
import time

import harness
import numpy as np
import torch
from torchrec.modules.embedding_modules import EmbeddingCollection

from recsys_dist.models.hstu_retrieval import (
    HSTURetrieval,
    evaluate_next_item,
    history_kjt,
    item_table,
    next_item_batch,
    sampled_softmax_loss,
)
from recsys_dist.models.next_item import leave_last_out, popular_vectors, ranking_metrics, target_ranks
from recsys_dist.models.sasrec_retrieval import SASRecRetrieval

MAX_LEN, BATCH, DIM, NEGATIVES, TEMPERATURE = 200, 128, 50, 128, 0.05


def run_two_tower(split, seed: int, epochs: int, eval_every: int) -> dict:
    """The library's ``TwoTower`` (user id tower, item id tower, 64-32 MLPs to 32, temperature
    0.05) trained by its in-batch softmax with the logQ correction on every (user, item) pair of
    the training sequences, batches of 512, Adam lr 1e-3; the same ranking (history left out:
    the user's last 200 items, as the sequence models read)."""
    from torchrec.modules.embedding_modules import EmbeddingBagCollection
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    from recsys_dist.data.spec import make_tables
    from recsys_dist.models.losses import in_batch_softmax
    from recsys_dist.models.zoo.two_tower import TwoTower, log_q_of

    torch.manual_seed(seed)
    num_users = len(split.users)
    counts = np.bincount(np.concatenate(split.train), minlength=split.num_items + 1)
    ebc = EmbeddingBagCollection(tables=make_tables(["user", "item"], [num_users, split.num_items + 1], 32))
    model = TwoTower(ebc, ["user"], ["item"], "item", 32, [64, 32], 32, 0.05, log_q=log_q_of(torch.tensor(counts)))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    pair_users = np.concatenate([np.full(len(t), u) for u, t in enumerate(split.train)])
    pair_items = np.concatenate(split.train)
    rng = np.random.default_rng(seed)

    def kjt(users, items):
        n = len(users)
        return KeyedJaggedTensor.from_lengths_sync(
            ["user", "item"], torch.as_tensor(np.concatenate([users, items])), torch.ones(2 * n, dtype=torch.int32)
        )

    def metrics(name: str) -> dict:
        model.eval()
        with torch.no_grad():
            users = model.user_vectors(kjt(np.arange(num_users), np.ones(num_users, np.int64)))
            items = model.item_vectors(kjt(np.zeros(split.num_items, np.int64), np.arange(1, split.num_items + 1)))
        model.train()
        hist = split.histories(name, MAX_LEN)
        return target_ranks(users, items, split.targets(name), hist).numpy()

    best, start = None, time.perf_counter()
    for epoch in range(1, epochs + 1):
        order = rng.permutation(len(pair_users))
        for lo in range(0, len(order), 512):
            rows = order[lo : lo + 512]
            out = model(torch.zeros(len(rows), 0), kjt(pair_users[rows], pair_items[rows]))
            ones = torch.ones(len(rows))
            loss = in_batch_softmax(
                out["logits"], ones, ones, out["candidate_scores"], out["candidate_ids"], out["candidate_log_q"]
            )
            opt.zero_grad()
            loss.backward()
            opt.step()
        if epoch % eval_every and epoch != epochs:
            continue
        v = ranking_metrics(metrics("validation"))
        print(
            json.dumps({"encoder": "two_tower", "seed": seed, "epoch": epoch, "val_ndcg@10": v["ndcg@10"]}), flush=True
        )
        if best is None or v["ndcg@10"] > best["validation"]["ndcg@10"]:
            ranks = metrics("test")
            best = {"epoch": epoch, "validation": v, "test": ranking_metrics(ranks), "test_ranks": ranks.tolist()}
    return {"encoder": "two_tower", "seed": seed, **best, "train_s_per_epoch": (time.perf_counter() - start) / epochs}


def read_ratings(path: str):
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    return (np.array([int(r[k]) for r in rows]) for k in ("userId", "movieId", "timestamp"))


def build(encoder: str, num_items: int, seed: int) -> HSTURetrieval:
    torch.manual_seed(seed)
    ec = EmbeddingCollection(tables=[item_table(num_items, DIM)], device=torch.device("cpu"))
    if encoder == "hstu":
        return HSTURetrieval(ec, DIM, num_layers=2, num_heads=1, attention_dim=50, linear_dim=50, dropout=0.2)
    # the training sequences are MAX_LEN + 1 items (every position but the last predicts the next)
    return SASRecRetrieval(ec, DIM, num_layers=2, num_heads=1, dropout=0.2, max_length=MAX_LEN + 1)


@torch.no_grad()
def test_ranks(model: HSTURetrieval, histories: list[np.ndarray], targets: np.ndarray, num_items: int) -> np.ndarray:
    """int64 [U]: each target's rank, as ``evaluate_next_item`` ranks it (all items less the
    history's), kept per user for the paired bootstrap of ``retrieval_bootstrap.py``."""
    model.eval()
    items = model.item_vectors(torch.arange(1, num_items + 1))
    users = torch.cat([model.user_vectors(history_kjt(histories[i : i + 256])) for i in range(0, len(histories), 256)])
    model.train()
    return target_ranks(users, items, targets, histories).numpy()


def run(encoder: str, split, seed: int, epochs: int, eval_every: int) -> dict:
    model = build(encoder, split.num_items, seed)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, betas=(0.9, 0.98))
    rng = np.random.default_rng(seed)
    seqs = [s[-(MAX_LEN + 1) :] for s in split.train]
    val = (split.histories("validation", MAX_LEN), split.targets("validation"))
    test = (split.histories("test", MAX_LEN), split.targets("test"))
    best, history, train_s = None, [], 0.0
    for epoch in range(1, epochs + 1):
        start = time.perf_counter()
        model.train()
        order = rng.permutation(len(seqs))
        losses = []
        for lo in range(0, len(order), BATCH):
            batch = next_item_batch([seqs[i] for i in order[lo : lo + BATCH]], split.num_items, NEGATIVES, rng)
            loss = sampled_softmax_loss(model(batch), TEMPERATURE)
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(float(loss.detach()))
        train_s += time.perf_counter() - start
        if epoch % eval_every and epoch != epochs:
            continue
        v = evaluate_next_item(model, *val, split.num_items)
        history.append({"epoch": epoch, "loss": float(np.mean(losses)), "val_ndcg@10": v["ndcg@10"]})
        # every evaluation's test ranks: hstu_retrieval_compare.py picks the best validation epoch
        # within any common epoch budget, also of a run stopped early
        ranks = test_ranks(model, *test, split.num_items)
        print(json.dumps({"encoder": encoder, "seed": seed, **history[-1], "test_ranks": ranks.tolist()}), flush=True)
        if best is None or v["ndcg@10"] > best["validation"]["ndcg@10"]:
            best = {"epoch": epoch, "validation": v, "test": ranking_metrics(ranks), "test_ranks": ranks.tolist()}
    return {"encoder": encoder, "seed": seed, **best, "train_s_per_epoch": train_s / epochs, "curve": history}


def main(argv: list[str] | None = None) -> None:
    p = harness.parser(__doc__, "hstu_retrieval", "2 epochs, seed 0, hstu only, evaluated every epoch")
    p.add_argument("--ratings", default="../shared/data/movielens/ratings.csv")
    p.add_argument("--encoders", nargs="+", default=["hstu", "sasrec"])
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    p.add_argument("--epochs", type=int, default=101)
    p.add_argument("--eval-every", type=int, default=10)
    a = p.parse_args(argv)
    if a.smoke:
        a.encoders, a.seeds, a.epochs, a.eval_every = ["hstu"], [0], 2, 1
    with harness.Results(a, argv):
        _run(a)


def _run(a: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    split = leave_last_out(*read_ratings(a.ratings))
    print(
        json.dumps(
            {
                "users": len(split.users),
                "dropped_users": split.dropped_users,
                "items": split.num_items,
                "train_interactions": int(sum(len(s) for s in split.train)),
            }
        ),
        flush=True,
    )
    for name in ("validation", "test"):
        users, items = popular_vectors(split.train, split.num_items)
        ranks = target_ranks(users, items, split.targets(name), split.histories(name, MAX_LEN))
        print(json.dumps({"encoder": "most_popular", name: ranking_metrics(ranks.numpy())}), flush=True)
    for seed in a.seeds:
        for encoder in a.encoders:
            if encoder == "two_tower":
                print(json.dumps(run_two_tower(split, seed, a.epochs, a.eval_every)), flush=True)
            else:
                print(json.dumps(run(encoder, split, seed, a.epochs, a.eval_every)), flush=True)


if __name__ == "__main__":
    main()
