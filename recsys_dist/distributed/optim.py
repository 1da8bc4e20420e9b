"""Optimizers: the embedding optimizer fused into backward (FBGEMM), the dense one separate."""

from __future__ import annotations

from collections.abc import Callable

import torch
from fbgemm_gpu.tbe.config import WeightDecayMode
from torch import nn
from torch.distributed.tensor import DTensor
from torchrec.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection
from torchrec.optim import optimizers as trec_optim
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
from torchrec.optim.clipping import GradientClipping, GradientClippingOptimizer
from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper, OptimizerWrapper
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
# How each embedding optimizer decays (train.embedding_weight_decay), always on the rows a
# step looks up only (lazy, as FBGEMM's sparse update). FBGEMM's CUDA kernels: EXACT_ROWWISE_ADAGRAD
# applies weight_decay only with a weight_decay_mode (default NONE = ignored); L2 adds decay * w
# to the row's gradient before Adagrad, as torch.optim.Adagrad's weight_decay. ADAM always
# subtracts lr * decay * w (decoupled, as torch.optim.AdamW). EXACT_ADAGRAD and EXACT_SGD have
# no weight decay: refused. FBGEMM's CPU kernels ignore weight decay in every mode (measured,
# fbgemm-gpu-cpu 1.8): refused for sharded tables on CPU (check_fused_weight_decay).
# Data-parallel tables get the same lazy decay here (_lazy_weight_decay).
EMBEDDING_WEIGHT_DECAY = {"exact_rowwise_adagrad": "l2", "adam": "decoupled"}
DENSE_OPTIMIZERS = {
    "sgd": torch.optim.SGD,
    "adagrad": torch.optim.Adagrad,
    "adam": torch.optim.Adam,
    "adamw": torch.optim.AdamW,
}


def fuse_embedding_optimizer(model: nn.Module, optimizer: str, lr: float, weight_decay: float = 0.0) -> None:
    """Mark the parameters of every EmbeddingBagCollection and EmbeddingCollection in ``model`` for
    ``optimizer`` (``train.embedding_optimizer``) at learning rate ``lr`` (``train.embedding_lr``)
    with ``weight_decay`` (``train.embedding_weight_decay``), applied in backward.

    Must run before sharding: the sharder reads the mark to build FBGEMM's fused kernel,
    and the planner uses it to count optimizer state in its memory estimate.
    """
    cls, kwargs = EMBEDDING_OPTIMIZERS[optimizer]
    collections = (EmbeddingBagCollection, EmbeddingCollection)
    params = [p for m in model.modules() if isinstance(m, collections) for p in m.parameters()]
    kwargs = {**kwargs, **fused_weight_decay(optimizer, weight_decay)}
    apply_optimizer_in_backward(cls, params, {"lr": lr, **kwargs})


def check_embedding_weight_decay(embedding_optimizer: str, weight_decay: float) -> None:
    """Raise ValueError (naming ``train.embedding_weight_decay``) when ``embedding_optimizer``
    cannot decay and ``weight_decay`` is not 0: FBGEMM would silently ignore it."""
    if weight_decay and embedding_optimizer not in EMBEDDING_WEIGHT_DECAY:
        raise ValueError(
            f"train.embedding_weight_decay: {weight_decay} is not applied by train.embedding_optimizer "
            f"{embedding_optimizer} (FBGEMM's {embedding_optimizer} kernel has no weight decay); use "
            f"{' or '.join(EMBEDDING_WEIGHT_DECAY)}, or set train.embedding_weight_decay: 0"
        )


def check_fused_weight_decay(dmp: nn.Module, weight_decay: float) -> None:
    """Raise ValueError (naming ``train.embedding_weight_decay``) when ``weight_decay`` is not 0
    and the DistributedModelParallel ``dmp`` has a table on FBGEMM's CPU fused kernel, whose
    update ignores weight decay (only data-parallel tables decay on CPU)."""
    plan = getattr(getattr(dmp, "plan", None), "plan", {})
    sharded = sorted(
        {t for per_module in plan.values() for t, ps in per_module.items() if ps.sharding_type != "data_parallel"}
    )
    if weight_decay and sharded and getattr(dmp, "device", torch.device("cpu")).type == "cpu":
        raise ValueError(
            f"train.embedding_weight_decay: {weight_decay} would be ignored: FBGEMM's CPU fused kernel has no "
            f"weight decay, and tables {sharded[:5]}{' ...' if len(sharded) > 5 else ''} are sharded; set "
            "train.embedding_weight_decay: 0, or sharding.sharding_types: [data_parallel], or train on CUDA"
        )


def fused_weight_decay(embedding_optimizer: str, weight_decay: float) -> dict:
    """The FBGEMM (TBE) keyword arguments that make its fused ``embedding_optimizer`` decay the
    looked-up rows by ``weight_decay`` ({} for 0). Raises ValueError as
    :func:`check_embedding_weight_decay`."""
    check_embedding_weight_decay(embedding_optimizer, weight_decay)
    if not weight_decay:
        return {}
    if embedding_optimizer == "exact_rowwise_adagrad":
        # Without a mode FBGEMM's rowwise Adagrad reads weight_decay and applies nothing.
        return {"weight_decay": weight_decay, "weight_decay_mode": WeightDecayMode.L2}
    return {"weight_decay": weight_decay}  # ADAM: decoupled, whatever the mode


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

    ``embedding_weight_decay`` decays the rows a step looks up, as FBGEMM does (see
    :data:`EMBEDDING_WEIGHT_DECAY`); on data-parallel tables "looked up" is "non-zero
    gradient row". Raises ValueError for an ``embedding_optimizer`` that cannot decay, and
    for sharded tables on CPU (:func:`check_fused_weight_decay`).

    Note: FBGEMM's Adam updates only rows present in the batch; the data-parallel Adam
    updates every row whose moments are non-zero.
    """
    check_embedding_weight_decay(embedding_optimizer, embedding_weight_decay)
    check_fused_weight_decay(dmp, embedding_weight_decay)
    params = dict(in_backward_optimizer_filter(dmp.named_parameters()))
    # Replicated EmbeddingBagCollection / EmbeddingCollection tables.
    dp_tables = {n: p for n, p in params.items() if ".embedding_bags." in n or ".embeddings." in n}
    dense = {n: p for n, p in params.items() if n not in dp_tables}
    dense_cls = DENSE_OPTIMIZERS[dense_optimizer]
    # On CPU torch's fused kernel updates each tensor in one pass instead of its single-tensor
    # path's several ops per tensor (docs/design/0010-trainer-epoch-start-and-fused-dense-optimizer.md).
    on_cpu = all(p.device.type == "cpu" for p in dense.values())
    # DTensor (distributed.dense.strategy: fsdp) has fused Adam/AdamW kernels, no fused Adagrad (torch 2.13).
    fusable = ("adam", "adamw") if any(isinstance(p, DTensor) for p in dense.values()) else ("adagrad", "adam", "adamw")
    fused = {"fused": True} if on_cpu and dense and dense_optimizer in fusable else {}
    make = dense_factory or (lambda ps: dense_cls(ps, lr=dense_lr, **fused))
    dense_opt = KeyedOptimizerWrapper(dense, lambda ps: _checked(make(list(ps))))
    if dense_grad_clip_norm and any(isinstance(p, DTensor) for p in dense.values()):
        dense_opt = GlobalNormClipping(dense_opt, dense_grad_clip_norm)  # FSDP: sharded gradients
    elif dense_grad_clip_norm:
        dense_opt = GradientClippingOptimizer(
            dense_opt, max_gradient=dense_grad_clip_norm, clipping=GradientClipping.NORM
        )
    optimizers = [dmp.fused_optimizer, dense_opt]
    if dp_tables:
        emb_cls, kwargs = REPLICATED_TABLE_OPTIMIZERS[embedding_optimizer]
        if embedding_weight_decay:
            decoupled = EMBEDDING_WEIGHT_DECAY[embedding_optimizer] == "decoupled"
            emb_cls = _lazy_weight_decay(emb_cls, embedding_weight_decay, decoupled)
        optimizers.append(KeyedOptimizerWrapper(dp_tables, lambda ps: emb_cls(ps, lr=embedding_lr, **kwargs)))
    return CombinedOptimizer(optimizers)


class GlobalNormClipping(OptimizerWrapper):
    """Clip the gradients of ``optimizer``'s parameters to a total L2 norm of at most
    ``max_norm`` (torch's ``clip_grad_norm_`` formula: scale by ``max_norm / (norm + 1e-6)``
    when below 1), the norm taken over the whole gradient when parameters are ``DTensor`` s.

    TorchRec's GradientClippingOptimizer (the ``ddp`` path) takes each DTensor's local shard as
    if it were the whole gradient: under FSDP every rank would clip by the norm of its own
    slice, a different factor per rank. Here the DTensors' norm is reduced over their mesh
    (collective: every rank steps) and joined with that of the plain (replicated) tensors.
    """

    def __init__(self, optimizer, max_norm: float) -> None:
        super().__init__(optimizer)
        self._max_norm = max_norm
        self._params = [p for group in self.param_groups for p in group["params"]]

    def step(self, closure=None) -> None:
        sharded = [p for p in self._params if isinstance(p, DTensor)]
        plain = [p for p in self._params if not isinstance(p, DTensor)]
        squares = torch.zeros((), dtype=torch.float32)
        for params in (sharded, plain):
            grads = [p.grad for p in params if p.grad is not None]
            if grads:
                norm = torch.nn.utils.get_total_norm(grads)
                norm = norm.full_tensor() if isinstance(norm, DTensor) else norm
                squares = squares + norm.float().cpu() ** 2
        total = squares.sqrt()
        for params in (sharded, plain):
            if params:
                torch.nn.utils.clip_grads_with_norm_(params, self._max_norm, total.to(params[0].device))
        super().step(closure)


def _lazy_weight_decay(cls: type, weight_decay: float, decoupled: bool) -> type:
    """``cls`` (a torch optimizer of 2-D tables) that first decays the rows with a non-zero
    gradient: L2 (``grad += weight_decay * w``) or decoupled (``w *= 1 - lr * weight_decay``).

    torch's own weight_decay would decay every row every step; FBGEMM decays only the rows a
    step looks up, and data-parallel tables must train like sharded ones.
    """

    class LazyWeightDecay(cls):
        @torch.no_grad()
        def step(self, closure=None):
            for group in self.param_groups:
                for p in group["params"]:
                    if p.grad is None:
                        continue
                    if p.grad.is_sparse or p.dim() != 2:
                        raise ValueError("train.embedding_weight_decay needs dense 2-D gradients of the tables")
                    rows = p.grad.ne(0).any(dim=1, keepdim=True).to(p.dtype)
                    if decoupled:
                        p.mul_(1 - group["lr"] * weight_decay * rows)
                    else:
                        p.grad.add_(p * rows, alpha=weight_decay)
            return super().step(closure)

    LazyWeightDecay.__name__ = LazyWeightDecay.__qualname__ = f"LazyWeightDecay{cls.__name__}"
    return LazyWeightDecay


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
    state FBGEMM creates up front) left out. That step leaves the weights as they are (its
    gradients are zero, so no row is decayed), and a restore loads the weights after it anyway.
    """
    for _, opt in optimizer.optimizers:
        if opt is fused:
            continue
        params = [p for p in opt.params.values() if isinstance(p, torch.Tensor) and p.requires_grad]
        if params and any(not opt.state.get(p) for p in params):
            opt.init_state()
            for p in params:
                p.grad = None
