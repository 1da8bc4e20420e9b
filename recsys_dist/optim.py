"""Optimizers: the embedding optimizer fused into backward (FBGEMM), the dense one separate."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torchrec.optim import optimizers as trec_optim
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
from torchrec.optim.clipping import GradientClipping, GradientClippingOptimizer
from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
from torchrec.optim.optimizers import in_backward_optimizer_filter
from torchrec.optim.rowwise_adagrad import RowWiseAdagrad

# torchrec optimizer classes map to FBGEMM's EmbOptimType when the tables are sharded:
# RowWiseAdagrad -> EXACT_ROWWISE_ADAGRAD, Adagrad -> EXACT_ADAGRAD, SGD -> EXACT_SGD, Adam -> ADAM.
EMBEDDING_OPTIMIZERS = {
    "exact_rowwise_adagrad": (RowWiseAdagrad, {"eps": 1e-8}),
    "exact_adagrad": (trec_optim.Adagrad, {"eps": 1e-8}),
    "exact_sgd": (trec_optim.SGD, {}),
    "adam": (trec_optim.Adam, {"eps": 1e-8}),
}
# Plain-torch twins for data-parallel tables (torchrec's SGD/Adagrad/Adam classes above are
# markers for FBGEMM, not runnable optimizers).
REPLICATED_TABLE_OPTIMIZERS = {
    "exact_rowwise_adagrad": (RowWiseAdagrad, {"eps": 1e-8}),
    "exact_adagrad": (torch.optim.Adagrad, {"eps": 1e-8}),
    "exact_sgd": (torch.optim.SGD, {}),
    "adam": (torch.optim.Adam, {"eps": 1e-8}),
}
DENSE_OPTIMIZERS = {
    "sgd": torch.optim.SGD,
    "adagrad": torch.optim.Adagrad,
    "adam": torch.optim.Adam,
    "adamw": torch.optim.AdamW,
}


def fuse_embedding_optimizer(model: nn.Module, cfg) -> None:
    """Mark the parameters of every EmbeddingBagCollection and EmbeddingCollection in ``model`` for
    ``train.embedding_optimizer``, applied in backward.

    Must run before sharding: the sharder reads the mark to build FBGEMM's fused kernel,
    and the planner uses it to count optimizer state in its memory estimate.
    """
    from torchrec.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection

    cls, kwargs = EMBEDDING_OPTIMIZERS[cfg.train.embedding_optimizer]
    collections = (EmbeddingBagCollection, EmbeddingCollection)
    params = [p for m in model.modules() if isinstance(m, collections) for p in m.parameters()]
    if cfg.train.embedding_weight_decay:
        kwargs = {**kwargs, "weight_decay": cfg.train.embedding_weight_decay}
    apply_optimizer_in_backward(cls, params, {"lr": cfg.train.embedding_lr, **kwargs})


def build_optimizer(
    dmp: nn.Module,
    embedding_optimizer: str,
    embedding_lr: float,
    dense_optimizer: str,
    dense_lr: float,
    dense_grad_clip_norm: float | None = None,
    embedding_weight_decay: float = 0.0,
    dense_factory: Callable[[list[nn.Parameter]], torch.optim.Optimizer] | None = None,
) -> CombinedOptimizer:
    """All optimizers of a DistributedModelParallel as one KeyedOptimizer.

    - model-parallel tables: FBGEMM's fused optimizer, applied in backward (``dmp.fused_optimizer``);
    - data-parallel tables: their parameters are replicated and DDP-averaged, and TorchRec
      does not fuse an optimizer into them; they get the same algorithm as the fused tables
      (torchrec's RowWiseAdagrad / Adagrad / SGD / Adam), stepped after backward;
    - everything else (the dense tower): ``dense_optimizer`` at ``dense_lr``, or
      ``dense_factory(params)`` when given (``Trainer(dense_optimizer=...)``; then
      ``dense_optimizer`` and ``dense_lr`` are not used).

    Note: FBGEMM's Adam updates only rows present in the batch; the data-parallel Adam
    updates every row whose moments are non-zero.
    """
    params = dict(in_backward_optimizer_filter(dmp.named_parameters()))
    # Replicated EmbeddingBagCollection / EmbeddingCollection tables.
    dp_tables = {n: p for n, p in params.items() if ".embedding_bags." in n or ".embeddings." in n}
    dense = {n: p for n, p in params.items() if n not in dp_tables}
    dense_cls = DENSE_OPTIMIZERS[dense_optimizer]
    # On CPU torch's fused kernel updates each tensor in one pass instead of its single-tensor
    # path's several ops per tensor (docs/design/0010-trainer-epoch-start-and-fused-dense-optimizer.md).
    on_cpu = all(p.device.type == "cpu" for p in dense.values())
    fused = {"fused": True} if on_cpu and dense and dense_optimizer in ("adagrad", "adam", "adamw") else {}
    make = dense_factory or (lambda ps: dense_cls(ps, lr=dense_lr, **fused))
    dense_opt = KeyedOptimizerWrapper(dense, lambda ps: _checked(make(list(ps))))
    if dense_grad_clip_norm:
        dense_opt = GradientClippingOptimizer(
            dense_opt, max_gradient=dense_grad_clip_norm, clipping=GradientClipping.NORM
        )
    optimizers = [dmp.fused_optimizer, dense_opt]
    if dp_tables:
        emb_cls, kwargs = REPLICATED_TABLE_OPTIMIZERS[embedding_optimizer]
        if embedding_weight_decay:
            kwargs = {**kwargs, "weight_decay": embedding_weight_decay}
        optimizers.append(KeyedOptimizerWrapper(dp_tables, lambda ps: emb_cls(ps, lr=embedding_lr, **kwargs)))
    return CombinedOptimizer(optimizers)


def _checked(opt: object) -> torch.optim.Optimizer:
    if not isinstance(opt, torch.optim.Optimizer):
        raise TypeError(f"the dense optimizer factory returned {type(opt).__name__}, not a torch.optim.Optimizer")
    return opt


def dense_torch_optimizer(optimizer: CombinedOptimizer) -> torch.optim.Optimizer:
    """The torch optimizer of the dense parameters inside :func:`build_optimizer`'s result (the
    one an LR scheduler drives)."""
    inner = optimizer.optimizers[1][1]
    while not isinstance(inner, KeyedOptimizerWrapper):  # GradientClippingOptimizer wraps it
        inner = inner._optimizer
    return inner._optimizer


def init_lazy_state(optimizer: CombinedOptimizer, fused: object = None) -> None:
    """Create the state torch optimizers make only at their first step (Adam's moments), so a
    checkpoint can be loaded into ``optimizer.state_dict()`` in place; without it a resumed
    Adam run silently restarts its moments from zero.

    Uses TorchRec's ``KeyedOptimizer.init_state`` (one step with zero gradients) on each
    sub-optimizer whose parameters lack state, ``fused`` (``dmp.fused_optimizer``, whose
    state FBGEMM creates up front) left out. That step leaves the weights as they are except
    under weight decay, and a restore loads the weights after it anyway.
    """
    for _, opt in optimizer.optimizers:
        if opt is fused:
            continue
        params = [p for p in opt.params.values() if isinstance(p, torch.Tensor) and p.requires_grad]
        if params and any(not opt.state.get(p) for p in params):
            opt.init_state()
            for p in params:
                p.grad = None
