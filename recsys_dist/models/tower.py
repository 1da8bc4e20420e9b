"""How a model's dense tower is cut into pipeline stages (``distributed.dense.strategy: pipeline``).

A model that can be cut has two methods (the zoo's ``dcnv2``, ``dlrm``, ``dlrm_dcnv2`` and ``hstu`` do;
hstu's in ``recsys_dist.models.zoo.hstu_stages``):

- ``pipeline_input(dense [B, D] float32, kjt) -> [B, d] float32``: everything up to the
  pooled embeddings (the table lookups, then a concatenation): run on every rank, since the
  sharded tables' forward and backward are collective. It uses no parameter of the tower
  (one it uses is refused at the first step: its gradient would not be averaged).
- ``pipeline_tower() -> list[nn.Module]``: the rest as an ordered list of modules, each taking
  one tensor ``[b, ·]`` and returning one; the last returns the logits ``[b, 1]``. Composed,
  ``tower(pipeline_input(dense, kjt))`` is ``forward(dense, kjt)`` op for op (the same numbers
  up to float rounding: a matmul over a column slice of the carried tensor may sum in another order).
  Each module holds its own parameters (the model's, shared, not copies); a parameter in two
  modules could not be owned by one stage.

The modules here carry what a later layer still needs (DCN's ``x0``, the cross output of a
parallel DCN) in extra columns of the one tensor, so that any cut between modules is valid.
"""

from __future__ import annotations

import torch
from torch import nn


class Carry(nn.Module):
    """``[x[:, keep], f(x[:, take])]`` (``keep`` None: ``f(x[:, take])``): run ``f`` on some
    columns and carry others along for a later module. ``take``/``keep``: (start, stop) columns."""

    def __init__(self, f: nn.Module, take: tuple[int, int | None], keep: tuple[int, int] | None = None) -> None:
        super().__init__()
        self.f, self.take, self.keep = f, take, keep

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.f(x[:, self.take[0] : self.take[1]])
        return y if self.keep is None else torch.cat([x[:, self.keep[0] : self.keep[1]], y], dim=1)


class CrossLayer(nn.Module):
    """Layer ``index`` of TorchRec's ``CrossNet`` / ``LowRankCrossNet`` ``net`` over the carried
    ``[x0, x_l]`` (``[b, 2N]``; the first layer takes ``x0`` alone, ``[b, N]``) -> ``[x0, x_{l+1}]``,
    with the net's own parameters and its op order (the same numbers as ``net(x0)``)."""

    def __init__(self, net: nn.Module, index: int, width: int) -> None:
        super().__init__()
        self.width, self.first = width, index == 0
        self.low_rank = hasattr(net, "W_kernels")
        if self.low_rank:
            self.w, self.v = net.W_kernels[index], net.V_kernels[index]
        else:
            self.w = net.kernels[index]
        self.b = net.bias[index]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x0, xl = (x, x) if self.first else (x[:, : self.width], x[:, self.width :])
        if self.low_rank:
            out = x0 * (nn.functional.linear(nn.functional.linear(xl, self.v), self.w) + self.b) + xl
        else:  # CrossNet works on [b, N, 1]
            x0_, xl_ = x0.unsqueeze(2), xl.unsqueeze(2)
            out = torch.squeeze(x0_ * (torch.matmul(self.w, xl_) + self.b) + xl_, dim=2)
        return torch.cat([x0, out], dim=1)


def mlp_layers(mlp: nn.Sequential) -> list[nn.Sequential]:
    """``recsys_dist.models.layers.mlp``'s Sequential as one Sequential per hidden layer (its
    Linear and the norm / activation / dropout after it)."""
    groups: list[list[nn.Module]] = []
    for m in mlp:
        if isinstance(m, nn.Linear):
            groups.append([])
        groups[-1].append(m)
    return [nn.Sequential(*g) for g in groups]


def cross_then_deep(
    net: nn.Module, layers: int, width: int, deep: list[nn.Module], head: nn.Module, parallel: bool
) -> list[nn.Module]:
    """DCN-V2's tower after ``x0`` (``[b, width]``): ``layers`` cross layers of ``net``, then the
    ``deep`` layers (at least one: DCNv2 needs one) and the ``head``; ``parallel``: the deep layers read ``x0`` and the head
    ``[cross, deep]``, else (stacked) the deep layers read the cross output."""
    tower: list[nn.Module] = [CrossLayer(net, i, width) for i in range(layers)]
    if parallel:  # [x0, xc] -> [xc, deep(x0)] -> ... -> head([xc, h])
        tower.append(Carry(deep[0], (0, width), keep=(width, 2 * width)))
        tower += [Carry(d, (width, None), keep=(0, width)) for d in deep[1:]]
        return [*tower, head]
    return [*tower, Carry(deep[0], (width, None)), *deep[1:], head]


class DLRMInteraction(nn.Module):
    """TorchRec DLRM's dense arch and interaction over ``[dense, pooled]`` (``[b, D + F*E]``, the
    pooled embeddings flattened in the sparse arch's feature order) -> the interaction output."""

    def __init__(self, dense_arch: nn.Module, inter_arch: nn.Module, num_dense: int, features: int) -> None:
        super().__init__()
        self.dense_arch, self.inter_arch = dense_arch, inter_arch
        self.num_dense, self.features = num_dense, features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dense = x[:, : self.num_dense]
        sparse = x[:, self.num_dense :].reshape(x.shape[0], self.features, -1)
        return self.inter_arch(dense_features=self.dense_arch(dense), sparse_features=sparse)
