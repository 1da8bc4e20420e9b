"""One rank's side of the ledger test: predicted bytes vs bytes counted at the collectives.

A 4-table model (60 rows each; widths 8, 8, 8, 4; pooling factors 3, 2, 1, 2) is sharded
by fixed plans, trained one step under :class:`recsys_dist.distributed.comm_counter.CommCounter`, and the
counts per phase are returned with :func:`recsys_dist.distributed.ledger.predict`'s. Row-wise ids are
drawn so that each row block receives ids in proportion to its rows (the ledger's assumption).
One more case puts managed-collision tables (``recsys_dist.models.managed``) in front of the
table-wise plan, so their per-step id all_gathers are counted too.
"""

from __future__ import annotations

import torch
from torch import nn
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

from recsys_dist.distributed import ledger
from recsys_dist.distributed.comm_counter import CommCounter

# name, rows, dim, ids per example
TABLES = [("a", 60, 8, 3), ("b", 60, 8, 2), ("c", 60, 8, 1), ("d", 60, 4, 2)]
B, NUM_DENSE = 6, 3


class Tiny(nn.Module):
    def __init__(self, ebc: EmbeddingBagCollection) -> None:
        super().__init__()
        self.sparse_arch = ebc
        self.bottom = nn.Linear(NUM_DENSE, 4)
        self.over = nn.Linear(4 + sum(t[2] for t in TABLES), 1)

    def forward(self, dense, kjt):
        kt = self.sparse_arch(kjt).to_dict()
        return self.over(torch.cat([self.bottom(dense)] + [kt[f"f_{t[0]}"] for t in TABLES], dim=1))


def plans(world: int) -> dict[str, dict]:
    """Fixed plans by name: each sharding type for every table, and one of each type."""
    last = world - 1
    return {
        "table_wise": {n: {"sharding_type": "table_wise", "ranks": [i % world]} for i, (n, *_) in enumerate(TABLES)},
        "row_wise": {n: {"sharding_type": "row_wise"} for n, *_ in TABLES},
        "column_wise": {
            "a": {"sharding_type": "column_wise", "ranks": [0, last]},
            "b": {"sharding_type": "column_wise", "ranks": [last, 1]},
            "c": {"sharding_type": "column_wise", "ranks": [1, 1]},  # two shards on one rank
            "d": {"sharding_type": "column_wise", "ranks": [0]},
        },
        "data_parallel": {n: {"sharding_type": "data_parallel"} for n, *_ in TABLES},
        "table_row_wise": {n: {"sharding_type": "table_row_wise", "ranks": list(range(world))} for n, *_ in TABLES},
        "mixed": {
            "a": {"sharding_type": "table_wise", "ranks": [last]},
            "b": {"sharding_type": "row_wise"},
            "c": {"sharding_type": "column_wise", "ranks": [0, last]},
            "d": {"sharding_type": "data_parallel"},
        },
    }


def batch(rank: int, world: int, step: int):
    g = torch.Generator().manual_seed(100 * step + rank)
    lengths, values = [], []
    for _, rows, _, p in TABLES:
        lengths.append(torch.full((B,), p, dtype=torch.int32))
        # id j goes to row block j % world: every block of a row_wise table gets its share
        block = rows // world
        j = torch.arange(B * p)
        values.append((j % world) * block + torch.randint(0, block, (B * p,), generator=g))
    kjt = KeyedJaggedTensor(keys=[f"f_{t[0]}" for t in TABLES], values=torch.cat(values), lengths=torch.cat(lengths))
    return torch.randn(B, NUM_DENSE, generator=g), kjt


def count(rank: int, world: int, precisions=(("fp32", "fp32"),)) -> dict:
    """{(plan name, fwd, bwd): {"predicted": per-phase, "counted": per-phase}} for this rank;
    plus ("table_wise+managed", "fp32", "fp32"): the table_wise plan behind managed-collision tables
    (not row_wise: remapped ids no longer spread over row blocks as drawn, the row_wise assumption)."""
    out = {}
    for name, fixed in plans(world).items():
        for fwd, bwd in precisions:
            out[(name, fwd, bwd)] = _count_one(rank, world, fixed, fwd, bwd)
    out[("table_wise+managed", "fp32", "fp32")] = _count_one(
        rank, world, plans(world)["table_wise"], "fp32", "fp32", True
    )
    return out


def _count_one(rank: int, world: int, fixed: dict, fwd: str, bwd: str, managed: bool = False) -> dict:
    import recsys_dist
    from recsys_dist.models.managed import ManagedRemap, ReplicatedMCH

    cfgs = [
        EmbeddingBagConfig(name=n, embedding_dim=d, num_embeddings=r, feature_names=[f"f_{n}"]) for n, r, d, _ in TABLES
    ]
    torch.manual_seed(0)
    model = Tiny(EmbeddingBagCollection(tables=cfgs, device=torch.device("meta")))
    apply_optimizer_in_backward(torch.optim.SGD, model.sparse_arch.parameters(), {"lr": 0.1})
    sharding = {"fixed_plan": fixed}
    if (fwd, bwd) != ("fp32", "fp32"):
        sharding["comms"] = {"forward": fwd, "backward": bwd}
    dmp = recsys_dist.shard(model, sharding)
    # Managed-collision tables as the trainer has them: the replicated MCH state remaps the raw
    # ids (all_gathering every rank's ids each step) before the sharded model sees them.
    remap = (
        ManagedRemap({f"f_{n}": ReplicatedMCH(r, "lfu", 1, history_capacity=4096) for n, r, _, _ in TABLES})
        if managed
        else None
    )
    predicted = ledger.predict(
        dmp.plan,
        cfgs,
        world,
        B,
        ledger.dense_parameter_bytes(dmp),
        {f"f_{n}": p for n, _, _, p in TABLES},
        fwd,
        bwd,
        managed_features=ledger.managed_features(remap) if remap is not None else (),
    )
    dense_opt = torch.optim.SGD([p for n, p in dmp.named_parameters() if "sparse_arch" not in n], lr=0.1)
    with CommCounter(dmp) as counter:
        for step in range(2):
            counter.reset()
            dense, kjt = batch(rank, world, step)
            if remap is not None:
                kjt = remap(kjt)
            dmp(dense, kjt).sum().backward()
            dense_opt.step()
            dense_opt.zero_grad()
    return {
        "predicted": predicted.per_rank()[rank],
        "counted": {k: v for k, v in counter.counts.items()},
        "calls": counter.calls,  # for a failing case's message
    }


def delayed_all_to_all(rank: int, world: int, delay_ms: float) -> dict:
    """Async all-to-alls under CommCounter(delay_ms): whether the work is a dist.Work, the
    output, the seconds rank 0 spent from issue to the end of ``wait()`` when rank 1 came
    ``late_s`` late, in the work's ``get_future().wait()``, and in both ``wait()`` calls
    (``waited``) beside what the counter booked as exposed."""
    import time

    import torch.distributed as dist

    late_s = 0.3
    out, inp = torch.empty(2 * world), torch.arange(2.0 * world) + 10 * rank
    futured = torch.empty(2 * world)
    with CommCounter(delay_ms=delay_ms) as counter:
        work = dist.all_to_all_single(out, inp, async_op=True)
        t0 = time.perf_counter()
        work.wait()
        waited = time.perf_counter() - t0
        dist.barrier()
        if rank == 1:
            time.sleep(late_s)
        t0 = time.perf_counter()
        late_work = dist.all_to_all_single(torch.empty(2 * world), inp, async_op=True)
        t1 = time.perf_counter()
        late_work.wait()
        late, waited = time.perf_counter() - t0, waited + time.perf_counter() - t1
        exposed = counter.exposed["other"]
        dist.barrier()
        t0 = time.perf_counter()
        dist.all_to_all_single(futured, inp, async_op=True).get_future().wait()
        future = time.perf_counter() - t0
    return {
        "is_work": isinstance(work, dist.Work),
        "out": out.tolist(),
        "futured": futured.tolist(),
        "late_s": late_s,
        "waited_late": late,
        "waited_future": future,
        "waited": waited,
        "exposed": exposed,
    }
