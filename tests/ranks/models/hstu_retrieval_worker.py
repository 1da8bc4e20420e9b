"""Worker of tests/ranks/models/test_hstu_retrieval.py (run per rank by recsys_dist.testing.run_ranks)."""

from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist
from torchrec.modules.embedding_modules import EmbeddingCollection
from torchrec.optim.optimizers import in_backward_optimizer_filter

from recsys_dist.models.hstu_retrieval import (
    HSTURetrieval,
    evaluate_next_item,
    item_table,
    next_item_batch,
    sampled_softmax_loss,
)

NUM_ITEMS, DIM, LR, STEPS, GLOBAL_BATCH = 40, 8, 0.5, 3, 4


def build(device: torch.device) -> HSTURetrieval:
    torch.manual_seed(0)
    ec = EmbeddingCollection(tables=[item_table(NUM_ITEMS, DIM, init_scale=0.5)], device=device)
    return HSTURetrieval(ec, DIM, num_layers=2, num_heads=2, attention_dim=4, linear_dim=4, dropout=0.0)


def eval_data() -> tuple[list[np.ndarray], np.ndarray]:
    """23 users (batches of 5: the last one short, uneven over 2 ranks), histories of 1-9 items."""
    rng = np.random.default_rng(5)
    hist = [rng.integers(1, NUM_ITEMS + 1, size=int(rng.integers(1, 10))) for _ in range(23)]
    return hist, rng.integers(1, NUM_ITEMS + 1, size=23)


def step_batch(step: int, rank: int, world: int):
    """This rank's share of the step's global batch (sequences of equal length, so every rank's
    mean over positions weighs the same) and the step's negatives (the same on every rank)."""
    rng = np.random.default_rng(100 + step)
    seqs = [rng.integers(1, NUM_ITEMS + 1, size=6) for _ in range(GLOBAL_BATCH)]
    per = GLOBAL_BATCH // world
    mine = seqs[rank * per : (rank + 1) * per]
    state = rng.bit_generator.state  # the same negatives in both batches
    first = next_item_batch(mine, NUM_ITEMS, 7, rng)
    rng.bit_generator.state = state
    return first, next_item_batch(seqs, NUM_ITEMS, 7, rng)


def sharded_vs_unsharded(rank: int, world: int, sharding_type: str) -> dict:
    """Metrics and training losses of the sharded model against the unsharded one with the same
    weights, before and after ``STEPS`` SGD steps (table: fused SGD; layers: DDP + SGD)."""
    from torch.distributed.optim import _apply_optimizer_in_backward as apply_optimizer_in_backward

    from recsys_dist.distributed.sharding import shard
    from recsys_dist.distributed.tables import load_full_state_dict

    ref = build(torch.device("cpu"))
    model = build(torch.device("meta"))
    apply_optimizer_in_backward(torch.optim.SGD, model.seq_arch.parameters(), {"lr": LR})
    dmp = shard(model, {"sharding_types": [sharding_type]}, device=torch.device("cpu"), batch_size=8)
    load_full_state_dict(dmp.state_dict(), ref.state_dict())
    types = sorted({ps.sharding_type for mp in dmp.plan.plan.values() for ps in mp.values()})
    hist, targets = eval_data()
    out = {
        "types": types,
        "before": (
            evaluate_next_item(dmp, hist, targets, NUM_ITEMS, batch_size=5),
            evaluate_next_item(ref, hist, targets, NUM_ITEMS, batch_size=5),
        ),
    }
    dense_opt = torch.optim.SGD(dict(in_backward_optimizer_filter(dmp.named_parameters())).values(), lr=LR)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=LR)
    losses = []
    for step in range(STEPS):
        mine, whole = step_batch(step, rank, world)
        loss = sampled_softmax_loss(dmp(mine), temperature=0.2)
        dense_opt.zero_grad()
        loss.backward()
        dense_opt.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        ref_loss = sampled_softmax_loss(ref(whole), temperature=0.2)
        ref_opt.zero_grad()
        ref_loss.backward()
        ref_opt.step()
        losses.append((float(mean) / world, float(ref_loss.detach())))
    out["losses"] = losses
    out["after"] = (
        evaluate_next_item(dmp, hist, targets, NUM_ITEMS, batch_size=5),
        evaluate_next_item(ref, hist, targets, NUM_ITEMS, batch_size=5),
    )
    return out
