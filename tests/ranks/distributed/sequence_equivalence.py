"""EmbeddingCollection (unpooled, per-position) tables sharded vs unsharded: one rank's side.

The model reads one pooled table (EmbeddingBagCollection) and two sequence tables
(EmbeddingCollection) from the same KeyedJaggedTensor; each sequence is padded to
``MAX_LEN`` positions and weighted per position, so a wrong order or a lost position
changes the output. The reference is one unsharded model trained on the mean of the
per-rank losses (see ``equivalence``: TorchRec divides the embedding gradients by the world
size in the output all-to-all's backward, for sequence embeddings as for pooled ones).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, EmbeddingCollection, EmbeddingConfig, KeyedJaggedTensor
from torchrec.distributed import DistributedModelParallel
from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward

from recsys_dist.data.loader import CTRBatch
from recsys_dist.distributed.optim import EMBEDDING_OPTIMIZERS, build_optimizer
from recsys_dist.distributed.sharders import fix_replicated_sequence_tables, sharders
from recsys_dist.distributed.tables import gather_full_state_dict, load_full_state_dict
from recsys_dist.models.task import CTRTask
from tests.ranks.distributed.equivalence import DENSE_LR, EMB_LR, STEPS, reference_embedding_step

# name, feature, rows, dim, max ids per example (0 allows empty sequences). 997 rows split
# unevenly over 2 and 3 ranks.
POOLED = [("t_user", "user", 53, 8, 1)]
SEQUENCE = [("s_hist", "hist", 997, 8, 5), ("s_tag", "tag", 40, 8, 3)]
B, NUM_DENSE, MAX_LEN = 4, 3, 5


def bag_configs():
    return [
        EmbeddingBagConfig(name=n, embedding_dim=d, num_embeddings=r, feature_names=[f]) for n, f, r, d, _ in POOLED
    ]


def seq_configs():
    return [EmbeddingConfig(name=n, embedding_dim=d, num_embeddings=r, feature_names=[f]) for n, f, r, d, _ in SEQUENCE]


class SeqTiny(nn.Module):
    def __init__(self, device: torch.device) -> None:
        super().__init__()
        self.pooled = EmbeddingBagCollection(tables=bag_configs(), device=device)
        self.seq = EmbeddingCollection(tables=seq_configs(), device=device)
        self.position = nn.Parameter(torch.linspace(0.5, 1.5, MAX_LEN))
        width = NUM_DENSE + sum(t[3] for t in POOLED) + sum(t[3] for t in SEQUENCE)
        self.over = nn.Linear(width, 1)

    def forward(self, dense, kjt):
        pooled = self.pooled(kjt).to_dict()
        seq = self.seq(kjt)
        parts = [dense] + [pooled[f] for _, f, *_ in POOLED]
        for _, f, *_ in SEQUENCE:
            padded = seq[f].to_padded_dense(desired_length=MAX_LEN)  # [B, MAX_LEN, E]
            parts.append((padded * self.position[None, :, None]).sum(dim=1))
        return self.over(torch.cat(parts, dim=1))


def global_batch(step: int, world_size: int) -> list[CTRBatch]:
    g = torch.Generator().manual_seed(2000 + step)
    tables = POOLED + SEQUENCE
    out = []
    for _ in range(world_size):
        lengths = torch.cat([torch.randint(0 if h > 1 else 1, h + 1, (B,), generator=g) for *_, h in tables])
        rows = [t[2] for t in tables for _ in range(B)]
        values = torch.cat([torch.randint(0, r, (int(n),), generator=g) for n, r in zip(lengths.tolist(), rows)])
        kjt = KeyedJaggedTensor(keys=[t[1] for t in tables], values=values, lengths=lengths.int(), stride=B)
        out.append(
            CTRBatch(
                dense_features=torch.randn(B, NUM_DENSE, generator=g),
                sparse_features=kjt,
                labels=torch.randint(0, 2, (B,), generator=g).float(),
                weights=torch.ones(B),
            )
        )
    return out


def check_all(rank: int, world_size: int, cases: list[tuple[str, str]]) -> dict:
    """One spawn serves every (sharding_type, optimizer) case."""
    return {case: check(rank, world_size, *case) for case in cases}


def check(rank: int, world_size: int, sharding_type: str, optimizer: str) -> dict:
    """Train ``STEPS`` steps sharded and unsharded; the largest absolute differences of the
    logits, the loss, and every weight after the last step (embedding rows included)."""
    torch.manual_seed(0)
    ref = CTRTask(SeqTiny(torch.device("cpu")))
    with torch.no_grad():
        for p in [*ref.model.pooled.parameters(), *ref.model.seq.parameters()]:
            p.uniform_(-0.1, 0.1)
    full = {k: v.clone() for k, v in ref.state_dict().items()}

    model = CTRTask(SeqTiny(torch.device("meta")))
    model.model.position = nn.Parameter(torch.empty(MAX_LEN))
    model.model.over = nn.Linear(ref.model.over.in_features, 1)
    cls, kwargs = EMBEDDING_OPTIMIZERS[optimizer]
    tables = [*model.model.pooled.parameters(), *model.model.seq.parameters()]
    apply_optimizer_in_backward(cls, tables, {"lr": EMB_LR, **kwargs})
    kernel = "dense" if sharding_type == "data_parallel" else "fused"
    cons = {
        n: ParameterConstraints(sharding_types=[sharding_type], compute_kernels=[kernel]) for n, *_ in POOLED + SEQUENCE
    }
    planner = EmbeddingShardingPlanner(
        topology=Topology(world_size=world_size, compute_device="cpu", local_world_size=world_size),
        constraints=cons,
    )
    plan = planner.collective_plan(model, sharders(), dist.group.WORLD)
    dmp = DistributedModelParallel(model, device=torch.device("cpu"), plan=plan, sharders=sharders())
    fix_replicated_sequence_tables(dmp)
    planned = {(path, ps.sharding_type) for path, mp in plan.plan.items() for ps in mp.values()}
    assert {t for _, t in planned} == {sharding_type}, f"asked for {sharding_type}, planner chose {planned}"
    assert any(path.endswith("seq") for path, _ in planned), f"the EmbeddingCollection was not sharded: {planned}"
    load_full_state_dict(dmp.state_dict(), full)
    opt = build_optimizer(dmp, optimizer, EMB_LR, "adagrad", DENSE_LR)

    ref_emb = {n: p for n, p in ref.named_parameters() if ".pooled." in n or ".seq." in n}
    ref_dense = [p for n, p in ref.named_parameters() if n not in ref_emb]
    ref_opt = torch.optim.Adagrad(ref_dense, lr=DENSE_LR)
    ref_state = {n: {} for n in ref_emb}
    diffs = {"logits": 0.0, "loss": 0.0}
    for step in range(STEPS):
        batches = global_batch(step, world_size)
        loss, (_, logits, _, _) = dmp(batches[rank])
        loss.backward()
        opt.step()
        opt.zero_grad()

        ref_opt.zero_grad()
        for p in ref_emb.values():
            p.grad = None
        losses, ref_logits = [], []
        for b in batches:
            l, (_, lg, _, _) = ref(b)
            losses.append(l)
            ref_logits.append(lg)
        torch.stack(losses).mean().backward()
        ref_opt.step()
        with torch.no_grad():
            for n, p in ref_emb.items():
                grad = p.grad if p.grad is not None else torch.zeros_like(p)
                reference_embedding_step(p, grad, ref_state[n], optimizer, lazy=sharding_type != "data_parallel")
        diffs["logits"] = max(diffs["logits"], (logits - ref_logits[rank].detach()).abs().max().item())
        diffs["loss"] = max(diffs["loss"], abs(loss.item() - losses[rank].item()))

    got = gather_full_state_dict(dmp.state_dict())
    for name, t in ref.state_dict().items():
        assert got[name].shape == t.shape, (name, got[name].shape, t.shape)
        diffs[name] = (got[name] - t).abs().max().item()
    return diffs
