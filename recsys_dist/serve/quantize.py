"""Row-wise int8 / int4 embedding tables through TorchRec's quantized modules (FBGEMM kernels).

``quantize_model`` swaps every float ``EmbeddingBagCollection`` / ``EmbeddingCollection`` of an
unsharded model for its ``torchrec.quant.embedding_modules`` counterpart (``from_float`` with
weights ``torch.quint8`` / ``torch.quint4x2``): each row becomes its quantized values plus an
fp16 scale and bias, padded to FBGEMM's row alignment, and lookups run FBGEMM's
``IntNBitTableBatchedEmbeddingBagsCodegen``. Dense layers stay fp32.

A model's *published state* is its state dict with every table as stored for scoring: fp32
``[rows, dim]`` weights, or (quantized) the raw bytes of the FBGEMM rows, uint8
``[rows, row_bytes]`` (int8, dim 16: 32 bytes = 16 values + 4 bytes of scale and bias + padding;
int4, dim 16: 16 bytes). Keys are the float model's state-dict keys in both cases, so a
publish's deltas and an export's ``model.safetensors`` address tables the same way.
"""

from __future__ import annotations

import torch
import torch.ao.quantization as tq
from torch import nn
from torchrec.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection
from torchrec.quant.embedding_modules import EmbeddingBagCollection as QuantEmbeddingBagCollection
from torchrec.quant.embedding_modules import EmbeddingCollection as QuantEmbeddingCollection
from torchrec.quant.embedding_modules import QuantConfig

from recsys_dist.errors import CheckpointError

QUANTIZE_DTYPES = {"int8": torch.quint8, "int4": torch.quint4x2}
# Beside an export's model.safetensors when its tables are quantized: {"quantize": "int8"|"int4"}.
QUANTIZATION_FILE = "quantization.json"
_FLOAT = {EmbeddingBagCollection: QuantEmbeddingBagCollection, EmbeddingCollection: QuantEmbeddingCollection}
_QUANT = (QuantEmbeddingBagCollection, QuantEmbeddingCollection)


def _tables_attr(module: nn.Module) -> str:
    return (
        "embedding_bags" if isinstance(module, (EmbeddingBagCollection, QuantEmbeddingBagCollection)) else "embeddings"
    )


def _embedding_modules(model: nn.Module, kinds: tuple) -> list[tuple[str, nn.Module]]:
    # exact types: a FeatureProcessedEmbeddingBagCollection subclass is not handled
    return [(name, m) for name, m in model.named_modules() if type(m) in kinds]


def table_keys(model: nn.Module) -> list[str]:
    """The state-dict keys of ``model``'s embedding tables (float or quantized collections),
    ``<module>.embedding_bags.<table>.weight`` / ``<module>.embeddings.<table>.weight``."""
    keys = []
    for name, m in _embedding_modules(model, (*_FLOAT, *_QUANT)):
        prefix = f"{name}." if name else ""
        keys += [f"{prefix}{_tables_attr(m)}.{t}.weight" for t in getattr(m, _tables_attr(m))]
    return keys


def quantized_mode(model: nn.Module) -> str:
    """``"int8"`` / ``"int4"`` when ``model``'s tables are TorchRec quantized modules, else ``"none"``."""
    for _, m in _embedding_modules(model, _QUANT):
        for tables in m._key_to_tables.values():
            return "int4" if "INT4" in str(tables[0].data_type) else "int8"
    return "none"


def quantize_model(model: nn.Module, mode: str) -> nn.Module:
    """Swap ``model``'s float embedding collections for TorchRec's quantized ones, in place
    (rows quantized from the float weights); returns ``model``. ``mode``: ``int8`` or ``int4``.

    Raises:
        CheckpointError: ``model`` has no EmbeddingBagCollection / EmbeddingCollection to quantize.
    """
    found = _embedding_modules(model, tuple(_FLOAT))
    if not found:
        raise CheckpointError(
            f"quantize {mode}: the model has no TorchRec EmbeddingBagCollection / EmbeddingCollection to quantize; "
            "publish it with publish.quantize: none"
        )
    qconfig = QuantConfig(
        activation=tq.PlaceholderObserver.with_args(dtype=torch.float),
        weight=tq.PlaceholderObserver.with_args(dtype=QUANTIZE_DTYPES[mode]),
    )
    for name, m in found:
        m.qconfig = qconfig
        quant = _FLOAT[type(m)].from_float(m)
        parent_name, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, attr, quant)
    return model


def _row_views(model: nn.Module) -> dict[str, torch.Tensor]:
    """table key -> the uint8 [rows, row_bytes] storage of its FBGEMM rows (a view: writing it
    changes what the model looks up). TorchRec keeps each group's kernel in ``_emb_modules``,
    in the order of ``_key_to_tables`` (as its own constructor pairs them)."""
    views = {}
    for name, m in _embedding_modules(model, _QUANT):
        prefix = f"{name}." if name else ""
        for tables, kernel in zip(m._key_to_tables.values(), m._emb_modules):
            for table, (weight, _, _) in zip(tables, kernel.split_embedding_weights_with_scale_bias(0)):
                views[f"{prefix}{_tables_attr(m)}.{table.name}.weight"] = weight
    return views


def published_state(model: nn.Module, clone: bool = True) -> dict[str, torch.Tensor]:
    """``model``'s published state (module docstring): its state dict, quantized tables as
    uint8 [rows, row_bytes] copies of their FBGEMM rows. Tensors are contiguous copies; with
    ``clone=False`` they are the model's own storage (writing a table's rows in place changes
    what the model looks up: how a delta is folded into a model no request is using)."""
    views = _row_views(model)
    if not clone:
        return {**{k: v.detach() for k, v in model.state_dict().items() if k not in views}, **views}
    state = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items() if k not in views}
    state.update({k: v.clone().contiguous() for k, v in views.items()})
    return state


def load_published_state(model: nn.Module, state: dict[str, torch.Tensor], where: str) -> None:
    """Load a published state into ``model`` (float, or quantized by :func:`quantize_model` in
    the same mode), every key and shape checked.

    Raises:
        CheckpointError: a key missing or extra, or a shape / dtype that does not fit; the
            message names ``where`` (the file the state came from).
    """
    views = _row_views(model)
    dense = {k: v for k, v in state.items() if k not in views}
    try:
        missing, unexpected = model.load_state_dict(dense, strict=False)
    except RuntimeError as err:
        raise CheckpointError(f"{where} does not fit its config.yaml: {str(err)[:800]}") from None
    missing = [k for k in missing if k not in views]
    lost = [k for k in views if k not in state]
    if missing or unexpected or lost:
        raise CheckpointError(
            f"{where} does not fit its config.yaml: missing keys {(missing + lost)[:5]}, unexpected keys "
            f"{list(unexpected)[:5]}; write it again from its run"
        )
    for k, view in views.items():
        rows = state[k]
        if rows.shape != view.shape or rows.dtype != view.dtype:
            raise CheckpointError(
                f"{where}: table {k} holds {rows.dtype} {tuple(rows.shape)}, the quantized model needs "
                f"{view.dtype} {tuple(view.shape)} (another quantization or table size); write it again from its run"
            )
        view.copy_(rows)
