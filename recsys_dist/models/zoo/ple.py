"""PLE: Progressive Layered Extraction (Tang, Liu, Zhao, Gong, 2020, "Progressive Layered
Extraction (PLE): A Novel Multi-Task Learning (MTL) Model for Personalized Recommendations",
RecSys, doi:10.1145/3383313.3412236).

Input ``x = [dense, e_1, ..., e_F]`` (the pooled embeddings of one EmbeddingBagCollection,
sharded like every other table), of width ``d = D_dense + F*E``. Unlike MMoE, where every
expert is shared, each level holds ``m_k`` experts of its own per task ``k`` (``E_{k,i}``)
and ``m_s`` shared experts (``E_{s,i}``), all MLPs (``deep_layer_sizes``).

Customized Gate Control (CGC, one level; eq. 2-3): task ``k`` mixes its own and the shared
experts only::

    S^k(x) = [E_{k,1}(x), ..., E_{k,m_k}(x), E_{s,1}(x), ..., E_{s,m_s}(x)]   [m_k + m_s, H]
    w^k(x) = softmax(W_g^k x)                  W_g^k: [m_k + m_s, d]
    g^k(x) = w^k(x)^T S^k(x)                                                   [H]

PLE stacks ``N = num_levels`` CGC levels (eq. 4-5). Level ``j`` has its own experts and gates;
task ``k``'s experts and gate read task ``k``'s output of level ``j - 1``, the shared experts
read the shared output, and below the last level a shared gate mixes *every* expert of the
level (all tasks' and the shared ones) into that shared output (``g^{k,0} = g^{s,0} = x``)::

    g^{k,j} = w^{k,j}(g^{k,j-1})^T S^{k,j}            S^{k,j}: E_{k,.}(g^{k,j-1}), E_{s,.}(g^{s,j-1})
    g^{s,j} = w^{s,j}(g^{s,j-1})^T S^{s,j}  (j < N)   S^{s,j}: every expert of level j
    y_k     = t^k(g^{k,N})                            t^k: MLP (tower_sizes) -> 1 logit

``num_levels: 1`` is CGC. Output: logits float32 ``[B, T]``, one column per task of
``spec.tasks`` (``data.schema.labels`` order). Sequence features, if any, are not read.
"""

from __future__ import annotations

import torch
from torch import nn
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from recsys_dist.data.spec import FeatureSpec

# layers.pooled_embeddings, called through its module: torch.fx.wrap makes it a leaf of the
# pipeline's trace by patching that name in layers' namespace, which a name imported here would miss.
from recsys_dist.models import layers
from recsys_dist.models.checks import no_sequences
from recsys_dist.models.config import PLEConfig
from recsys_dist.models.layers import mlp, mlp_head
from recsys_dist.models.registry import register_model
from recsys_dist.models.zoo.mmoe import mix


class CGCLevel(nn.Module):
    """One extraction level: per task ``num_task_experts`` experts and a gate over them and the
    ``num_shared_experts`` shared experts; with ``shared_gate``, a gate over every expert for
    the shared output (every level but the last).

    ``forward([g^1, ..., g^T, g^s])`` (each float32 ``[B, in_features]``) -> the level's
    ``[g^1, ..., g^T]`` (+ ``g^s`` with ``shared_gate``), each ``[B, H]``.
    """

    def __init__(
        self,
        in_features: int,
        num_tasks: int,
        num_task_experts: int,
        num_shared_experts: int,
        expert_sizes: list[int],
        shared_gate: bool,
        device: torch.device | None = None,
        **mlp_options,
    ) -> None:
        super().__init__()

        def expert() -> nn.Module:
            return mlp(in_features, expert_sizes, device=device, **mlp_options)

        self.task_experts = nn.ModuleList(
            nn.ModuleList(expert() for _ in range(num_task_experts)) for _ in range(num_tasks)
        )
        self.shared_experts = nn.ModuleList(expert() for _ in range(num_shared_experts))
        self.task_gates = nn.ModuleList(
            nn.Linear(in_features, num_task_experts + num_shared_experts, device=device) for _ in range(num_tasks)
        )
        every = num_tasks * num_task_experts + num_shared_experts
        self.shared_gate = nn.Linear(in_features, every, device=device) if shared_gate else None

    def forward(self, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
        shared_in = inputs[-1]
        shared = [e(shared_in) for e in self.shared_experts]
        own = [[e(x) for e in experts] for x, experts in zip(inputs, self.task_experts)]
        out = [mix(gate, x, torch.stack(o + shared, dim=1)) for gate, x, o in zip(self.task_gates, inputs, own)]
        if self.shared_gate is not None:
            out.append(mix(self.shared_gate, shared_in, torch.stack([e for o in own for e in o] + shared, dim=1)))
        return out


class PLE(nn.Module):
    """The PLE network of the module docstring over one EmbeddingBagCollection.

    ``forward(dense float32 [B, D], kjt) -> logits float32 [B, T]``.
    """

    def __init__(
        self,
        ebc: EmbeddingBagCollection,
        num_dense: int,
        features: list[str],
        embedding_dim: int,
        num_tasks: int,
        num_levels: int,
        num_task_experts: int,
        num_shared_experts: int,
        expert_sizes: list[int],
        tower_sizes: list[int],
        device: torch.device | None = None,
        **mlp_options,
    ) -> None:
        super().__init__()
        self.sparse_arch, self.features, self.num_tasks = ebc, features, num_tasks
        d, h = num_dense + len(features) * embedding_dim, expert_sizes[-1]
        self.levels = nn.ModuleList(
            CGCLevel(
                d if j == 0 else h,
                num_tasks,
                num_task_experts,
                num_shared_experts,
                expert_sizes,
                shared_gate=j < num_levels - 1,
                device=device,
                **mlp_options,
            )
            for j in range(num_levels)
        )
        self.towers = nn.ModuleList(mlp_head(h, tower_sizes, device=device, **mlp_options) for _ in range(num_tasks))

    def forward(self, dense: torch.Tensor, kjt: KeyedJaggedTensor) -> torch.Tensor:
        x = torch.cat([dense, layers.pooled_embeddings(self.sparse_arch(kjt), self.features).flatten(1)], dim=1)
        g = [x] * (self.num_tasks + 1)  # g^{k,0} = g^{s,0} = x
        for level in self.levels:
            g = level(g)
        # g indexed, not iterated: under fsdp TorchRec's pipeline tracer takes each level (an FSDP
        # block) as a leaf, whose output (the list) it cannot iterate, only index
        return torch.cat([tower(g[k]) for k, tower in enumerate(self.towers)], dim=1)  # eq. 5


@register_model("ple", PLEConfig, checks=(no_sequences,))
def build_ple(spec: FeatureSpec, cfg: PLEConfig) -> PLE:
    """``PLE`` over the spec's pooled tables, one set of experts, gate and tower per task of ``spec.tasks``."""
    return PLE(
        EmbeddingBagCollection(tables=spec.all_tables(), device=spec.embedding_device),
        spec.num_dense,
        spec.sparse_names,
        cfg.embedding_dim,
        len(spec.tasks),
        cfg.num_levels,
        cfg.num_task_experts,
        cfg.num_shared_experts,
        cfg.deep_layer_sizes,
        cfg.tower_sizes,
        device=spec.device,
        **cfg.mlp_kwargs(),
    )
