"""Models that read pooled embeddings by position, and one rank's side of the key-order checks
(run via run_ranks): the sharded KeyedTensor must come back in the unsharded module's key order."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import torch
from torch import nn
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, EmbeddingCollection, EmbeddingConfig, KeyedJaggedTensor
from torchrec.modules.embedding_configs import PoolingType
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
from torchrec.optim.optimizers import in_backward_optimizer_filter

# name, rows, dim, pooling: sizes and widths all differ, so a reordered KeyedTensor moves
# columns across table boundaries.
POOLED = [("user", 1000, 8, PoolingType.SUM), ("item", 500, 16, PoolingType.MEAN), ("tags", 50, 4, PoolingType.MEAN)]
POOLED.append(("city", 31, 12, PoolingType.SUM))
# A second table of feature "tags", sum-pooled (keys tags@t_tags, tags@t_tags_sum).
SHARED = EmbeddingBagConfig(name="t_tags_sum", embedding_dim=4, num_embeddings=50, feature_names=["tags"])
SEQUENCE = [("hist", 97, 8), ("clicks", 40, 8)]
B, NUM_DENSE, LR = 6, 3, 0.1


def pooled_tables() -> list[EmbeddingBagConfig]:
    tables = [
        EmbeddingBagConfig(name=f"t_{n}", embedding_dim=d, num_embeddings=r, feature_names=[n], pooling=p)
        for n, r, d, p in POOLED
    ]
    return tables[:3] + [dataclasses.replace(SHARED)] + tables[3:]


def sequence_tables() -> list[EmbeddingConfig]:
    return [
        EmbeddingConfig(name=f"s_{n}", embedding_dim=d, num_embeddings=r, feature_names=[n]) for n, r, d in SEQUENCE
    ]


class ReadsByPosition(nn.Module):
    """Logits [B] from ``kt.values()`` ([B, 44], read by position) and the sequence dict's
    values in iteration order (each feature's embeddings summed per example)."""

    def __init__(self, device: torch.device) -> None:
        super().__init__()
        self.ebc = EmbeddingBagCollection(tables=pooled_tables(), device=device)
        self.ec = EmbeddingCollection(tables=sequence_tables(), device=device)
        width = NUM_DENSE + sum(t.embedding_dim for t in pooled_tables()) + sum(t[2] for t in SEQUENCE)
        self.top = nn.Linear(width, 1)

    def forward(self, dense: torch.Tensor, sparse: KeyedJaggedTensor):
        kt, jts = self.ebc(sparse), self.ec(sparse)
        seq = [per_example_sums(jt.values(), jt.lengths()) for jt in jts.values()]
        return self.top(torch.cat([dense, kt.values(), *seq], dim=1)).squeeze(-1), kt, jts


def per_example_sums(values: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """[B, E]: each example's embeddings summed (zeros for an empty sequence)."""
    rows = torch.repeat_interleave(torch.arange(lengths.numel()), lengths.long())
    return torch.zeros(lengths.numel(), values.shape[1]).index_add_(0, rows, values)


def batch(seed: int) -> tuple[torch.Tensor, KeyedJaggedTensor]:
    """B examples; 0-3 ids per pooled bag and 0-4 per sequence (empty ones too)."""
    g = torch.Generator().manual_seed(seed)
    sizes = [r for _, r, *_ in POOLED] + [r for _, r, _ in SEQUENCE]
    lengths = torch.randint(0, 4, (len(sizes), B), generator=g)
    ids = [torch.randint(0, r, (int(lengths[f].sum()),), generator=g) for f, r in enumerate(sizes)]
    keys = [n for n, *_ in POOLED] + [n for n, *_ in SEQUENCE]
    kjt = KeyedJaggedTensor(keys=keys, values=torch.cat(ids), lengths=lengths.reshape(-1).int(), stride=B)
    return torch.randn(B, NUM_DENSE, generator=g), kjt


def plans(world_size: int) -> dict[str, dict | None]:
    """Sharding configs whose sharded order differs from the module's (tables on ranks in
    reverse; a mix of types) and the planner's own choice."""
    last = world_size - 1
    reverse = {
        f"t_{n}": {"sharding_type": "table_wise", "ranks": [last - i % world_size]} for i, (n, *_) in enumerate(POOLED)
    }
    reverse.update(
        {
            f"s_{n}": {"sharding_type": "table_wise", "ranks": [last - i % world_size]}
            for i, (n, *_) in enumerate(SEQUENCE)
        }
    )
    reverse["t_tags_sum"] = {"sharding_type": "table_wise", "ranks": [0]}
    mixed = {
        "t_user": {"sharding_type": "row_wise"},
        "t_tags_sum": {"sharding_type": "table_wise", "ranks": [last]},
        "t_item": {"sharding_type": "column_wise", "ranks": [last, 0]},
        "t_tags": {"sharding_type": "data_parallel"},
        "t_city": {"sharding_type": "table_wise", "ranks": [0]},
        "s_hist": {"sharding_type": "row_wise"},
        "s_clicks": {"sharding_type": "table_wise", "ranks": [last]},
    }
    # A mean-pooled row-wise table beside multi-hot tables of other types, mean and sum.
    row_wise_mean = {
        "t_user": {"sharding_type": "data_parallel"},
        "t_item": {"sharding_type": "row_wise"},
        "t_tags": {"sharding_type": "table_wise", "ranks": [last]},
        "t_tags_sum": {"sharding_type": "row_wise"},
        "t_city": {"sharding_type": "column_wise", "ranks": [0]},
        "s_hist": {"sharding_type": "table_wise", "ranks": [0]},
        "s_clicks": {"sharding_type": "row_wise"},
    }
    # One feature feeding a mean-pooled row-wise table and a sum-pooled table-wise one.
    shared = {
        **row_wise_mean,
        "t_item": {"sharding_type": "table_wise", "ranks": [0]},
        "t_tags": {"sharding_type": "row_wise"},
        "t_tags_sum": {"sharding_type": "table_wise", "ranks": [last]},
    }
    return {
        "reverse": {"fixed_plan": reverse},
        "mixed": {"fixed_plan": mixed},
        "row_wise_mean": {"fixed_plan": row_wise_mean},
        "shared_feature": {"fixed_plan": shared},
        "planner": None,
    }


def forward_and_step(rank: int, world_size: int) -> dict:
    """Per plan: the sharded module's keys, logits and one SGD step (every rank on the same
    batch, so the averaged gradients equal one rank's) against the unsharded module."""
    import recsys_dist
    from recsys_dist.distributed.tables import gather_full_state_dict, load_full_state_dict

    out = {}
    for name, sharding in plans(world_size).items():
        torch.manual_seed(0)
        ref = ReadsByPosition(torch.device("cpu"))
        full = {k: v.detach().clone() for k, v in ref.state_dict().items()}
        model = ReadsByPosition(torch.device("meta"))
        for collection in (model.ebc, model.ec):
            apply_optimizer_in_backward(torch.optim.SGD, collection.parameters(), {"lr": LR})
        dmp = recsys_dist.shard(model, sharding, init_tables=False)
        load_full_state_dict(dmp.state_dict(), full)
        # The tower and replicated (data_parallel) tables: DDP-averaged, stepped here.
        dense_params = [p for _, p in in_backward_optimizer_filter(dmp.named_parameters())]
        dense, kjt = batch(7)
        logits, kt, seq = dmp(dense, kjt)
        want, want_kt, want_seq = ref(dense, kjt)
        logits.sum().backward()
        torch.optim.SGD(dense_params, lr=LR).step()
        want.sum().backward()
        torch.optim.SGD(ref.parameters(), lr=LR).step()
        got_w, want_w = gather_full_state_dict(dmp.state_dict()), ref.state_dict()
        out[name] = {
            "types": sorted({ps.sharding_type for mp in dmp.plan.plan.values() for ps in mp.values()}),
            "keys": (kt.keys(), want_kt.keys()),
            "length_per_key": (kt.length_per_key(), want_kt.length_per_key()),
            "sequence_keys": (list(seq.keys()), list(want_seq.keys())),
            "logits": (logits - want).abs().max().item(),
            "per_key": {k: (kt[k] - want_kt[k]).abs().max().item() for k in want_kt.keys()},
            "weights": max((got_w[k] - want_w[k]).abs().max().item() for k in want_w),
        }
    return out


# --- A model through the Trainer, reading its pooled embeddings by position ---------------


class PositionalTower(nn.Module):
    """``factory(spec)``: one EmbeddingBagCollection over every sparse feature, table widths
    cycling 4, 8, 12; logits [B] = MLP([dense, kt.values()]) with ``kt.values()`` read by
    position, plus <kt["C1"], kt.to_dict()["C4"]> read by name (both in the traced forward)."""

    def __init__(self, spec, hidden: int = 16) -> None:
        super().__init__()
        tables = [dataclasses.replace(t, embedding_dim=4 * (1 + i % 3)) for i, t in enumerate(spec.tables)]
        self.ebc = EmbeddingBagCollection(tables=tables, device=spec.embedding_device)
        width = spec.num_dense + sum(t.embedding_dim for t in tables)
        self.mlp = nn.Sequential(
            nn.Linear(width, hidden, device=spec.device), nn.ReLU(), nn.Linear(hidden, 1, device=spec.device)
        )

    def forward(self, dense: torch.Tensor, sparse: KeyedJaggedTensor) -> torch.Tensor:
        kt = self.ebc(sparse)
        by_name = (kt["C1"] * kt.to_dict()["C4"]).sum(dim=1)
        return self.mlp(torch.cat([dense, kt.values()], dim=1)).squeeze(-1) + by_name


def train_and_predict(rank: int, world_size: int, cache: str, config: str, run_dir: str) -> dict:
    """Fit, then Trainer.predict("test") and Trainer.evaluate("test") (sharded), and a checkpoint."""
    from recsys_dist.api import Trainer
    from recsys_dist.config.loader import load_config

    os.environ["RECSYS_DIST_CACHE"] = cache
    with Trainer(load_config(config), Path(run_dir)) as trainer:
        trainer.fit()
        pred = trainer.predict("test")
        return {
            "logit": pred["logit"].tolist(),
            "test": trainer.evaluate("test"),
            "checkpoint": str(trainer.save_checkpoint()),
            # TrainPipelineSparseDist traced the forward and pipelined the collection.
            "pipelined": [type(m).__name__ for m in trainer._runner.pipe._pipelined_modules],
        }
