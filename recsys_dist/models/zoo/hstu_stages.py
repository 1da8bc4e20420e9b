"""HSTU (``model.name: hstu``) cut into pipeline stages (``distributed.dense.strategy: pipeline``;
the contract: :mod:`recsys_dist.models.tower`): ``HSTU.pipeline_input`` packs what the layers and
the head read into one float32 row, :func:`tower` gives the modules that read it.

The row (``[B, K]`` float32; every rank's is as wide, so stage 0 can gather them and the
schedule cut microbatches along dim 0):

- ``[dense (D) | e_1..e_F (F x E)]``: the head's inputs besides the sequences' outputs;
- per sequence ``s`` (:class:`SequenceSlots`), its history padded to the FIXED length ``L_s``
  (``FeatureSpec.sequence_lengths``: ``data.schema.history.max_length`` or the column's
  ``max_length``), not to the batch's longest as ``HSTU.forward`` pads:

  - the tokens ``[h_1..h_L, target]``, ``(L + 1) x E`` (padding 0; the target token last; the
    first module adds the learned target action with ``action_tokens``);
  - the row's count of events ``n`` (1 column; an integer <= ``L``, exact in float32);
  - with ``time_buckets``, each event's time before the row ``d_j`` (int64, the time
    column's units) as two columns ``hi, lo`` with ``d = hi x 2^24 + lo``, ``0 <= lo < 2^24``:
    both integers below 2^24 in magnitude, which float32 holds exactly, so ``|d| < 2^48``
    (``pipeline_input`` raises beyond). Padding: 0, as ``hstu_time.padded_deltas`` pads.

Each layer's module rebuilds the row's real tokens from ``n`` (and its times from ``d``) and
runs the layer on them packed, as ``HSTU.encode`` does (``hstu_jagged``), so a stage computes
what ``HSTU.forward`` computes whatever the padding, and spends nothing on the padding.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from recsys_dist.models import hstu_jagged

EXACT = 2**24  # float32 holds every integer of magnitude <= 2^24 exactly


@dataclass(frozen=True)
class SequenceSlots:
    """Where sequence ``name``'s parts lie in the row: its tokens ``[start, count)`` (``(length +
    1) x dim`` columns), its count of events at column ``count``, with ``timed`` its events'
    times ``[count + 1, end)`` (``length`` hi columns, then ``length`` lo columns)."""

    name: str
    length: int
    dim: int
    start: int
    timed: bool

    @property
    def tokens(self) -> int:
        """Tokens of the sequence, ``N = length + 1`` (the target's last)."""
        return self.length + 1

    @property
    def count(self) -> int:
        return self.start + self.tokens * self.dim

    @property
    def end(self) -> int:
        return self.count + 1 + (2 * self.length if self.timed else 0)


def row_layout(head: int, names: list[str], lengths: list[int], dim: int, timed: bool) -> list[SequenceSlots]:
    """The slots of each sequence after the ``head`` columns (``D + F x E``)."""
    slots, start = [], head
    for name, length in zip(names, lengths, strict=True):
        slots.append(SequenceSlots(name, length, dim, start, timed))
        start = slots[-1].end
    return slots


def split_deltas(deltas: torch.Tensor, name: str) -> list[torch.Tensor]:
    """``[hi, lo]`` float32 ``[B, L]`` each of ``deltas`` int64 ``[B, L]`` (``d = hi x 2^24 + lo``).

    Raises:
        ValueError: a ``|d| >= 2^48`` (float32 could not hold ``hi``), naming the feature.
    """
    hi = torch.div(deltas, EXACT, rounding_mode="floor")
    if not deltas.is_meta and deltas.numel() and int(hi.abs().max()) >= EXACT:
        raise ValueError(
            f"{name}: an event's time before its row, {int(deltas.abs().max())}, is 2^48 or more units of the time "
            "column; HSTU's pipeline stages carry it in two float32 columns (< 2^24 each): use a coarser time unit"
        )
    return [hi.float(), (deltas - hi * EXACT).float()]


def join_deltas(x: torch.Tensor, slots: SequenceSlots) -> torch.Tensor:
    """int64 ``[B, L]``: the events' times packed by :func:`split_deltas`."""
    hi = x[:, slots.count + 1 : slots.count + 1 + slots.length].long()
    lo = x[:, slots.count + 1 + slots.length : slots.end].long()
    return hi * EXACT + lo


def fixed_sequence(out: dict, key: str, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``sequence.padded_sequence`` padded to ``length`` (not the batch's longest): (values
    ``[B, length, E]``, mask ``[B, length]`` float 1/0) of the EmbeddingCollection output's ``key``.

    Raises:
        ValueError: a row holds more than ``length`` events (its tail would be cut off).
    """
    jt = out[key]
    lengths = jt.lengths()
    if not lengths.is_meta and lengths.numel() and int(lengths.max()) > length:
        raise ValueError(
            f"{key}: a row holds {int(lengths.max())} events, more than its max_length {length} "
            "(FeatureSpec.sequence_lengths), which HSTU's pipeline stages pad every row to"
        )
    values = jt.to_padded_dense(desired_length=length)
    mask = (torch.arange(length, device=lengths.device)[None, :] < lengths[:, None]).to(values.dtype)
    return values, mask


def _tokens(x: torch.Tensor, slots: SequenceSlots) -> torch.Tensor:
    return x[:, slots.start : slots.count].unflatten(1, (slots.tokens, slots.dim))


def _mask(x: torch.Tensor, slots: SequenceSlots) -> torch.Tensor:
    """[B, L] float 1/0, as ``sequence.padded_sequence``'s (of length L)."""
    n = x[:, slots.count]
    return (torch.arange(slots.length, device=x.device)[None, :] < n[:, None]).to(x.dtype)


class TargetAction(nn.Module):
    """Adds the learned target action ``target_action[i]`` (``[S, E]``, the model's parameter) to
    each sequence i's target token (``HSTU.forward``'s ``token = target + target_action[i]``)."""

    def __init__(self, target_action: nn.Parameter, slots: list[SequenceSlots]) -> None:
        super().__init__()
        self.target_action, self.slots = target_action, slots

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        parts, at = [], 0
        for i, s in enumerate(self.slots):
            last = s.count - s.dim  # the target token's first column
            parts += [x[:, at:last], x[:, last : s.count] + self.target_action[i]]
            at = s.count
        return torch.cat([*parts, x[:, at:]], dim=1)


class LayerStage(nn.Module):
    """One ``HSTULayer`` (``layer``) over sequence ``slots``' tokens of the row; the rest of the
    row passes through. The layer runs on the row's real tokens ``[h_1..h_n, target]``, packed
    (``hstu_jagged``), as ``HSTU.encode`` runs it, so a stage computes what ``HSTU.forward``
    computes (and no padding); ``timed``: the time bias, from the packed times. Padded positions
    leave as 0 (no layer reads them)."""

    def __init__(self, layer: nn.Module, slots: SequenceSlots, timed: bool) -> None:
        super().__init__()
        self.layer, self.slots, self.timed = layer, slots, timed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = self.slots
        mask = _mask(x, s)
        real = torch.cat([mask, mask.new_ones(mask.shape[0], 1)], dim=1) > 0  # the target is real
        packed = hstu_jagged.pack(_tokens(x, s), real)
        deltas = join_deltas(x, s) if self.timed else None
        y = self.layer(packed, layout=hstu_jagged.layout(real.sum(dim=1)), deltas=deltas)
        y = hstu_jagged.unpack(y, real)
        return torch.cat([x[:, : s.start], y.flatten(1), x[:, s.count :]], dim=1)


class Head(nn.Module):
    """``deep([dense, e_1..e_F, y_A of each sequence])`` from the head columns and each
    sequence's target token: ``deep`` the head's first layer (then the tower's next modules
    are its others), or ``HSTU``'s whole ``TaskHeads`` (the logits ``[B, T]``)."""

    def __init__(self, deep: nn.Module, head: int, slots: list[SequenceSlots]) -> None:
        super().__init__()
        self.deep, self.head, self.slots = deep, head, slots

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        targets = [x[:, s.count - s.dim : s.count] for s in self.slots]
        return self.deep(torch.cat([x[:, : self.head], *targets], dim=1))
