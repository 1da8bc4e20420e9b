"""HSTU (Zhai et al., 2024, "Actions Speak Louder than Words: Trillion-Parameter Sequential
Transducers for Generative Recommendations", ICML, arXiv:2402.17152), ranking set-up.

The module and its equations: :class:`HSTU` and :class:`HSTULayer`. Pooled tables in one
EmbeddingBagCollection, sequence tables in one EmbeddingCollection: both sharded.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F
from torchrec.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from recsys_dist.data.spec import FeatureSpec

# called through their modules: torch.fx.wrap patches a leaf's name in its own module only
# (hstu_attention.pointwise_attention included)
from recsys_dist.models import hstu_attention, hstu_jagged, hstu_time, layers, sequence, tower
from recsys_dist.models.config import HSTUConfig
from recsys_dist.models.hstu_jagged import position_bucket
from recsys_dist.models.layers import mlp_head
from recsys_dist.models.registry import register_model
from recsys_dist.models.sequence import TargetSequenceModel
from recsys_dist.models.zoo import hstu_stages

EPS = 1e-6  # of both layer norms (the reference's epsilon)


# Leaves for torch.fx (TrainPipelineSparseDist traces the model): they read shapes.
@torch.fx.wrap
def target_layout(mask: torch.Tensor, num_buckets: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The attention layout of the token sequence ``[h_1..h_L, target]`` (N = L + 1 tokens: the
    batch's padded history, then the target at index L) given the history mask [B, L] float
    (1 for the row's n real events, then 0).

    Returns:
        weight [B, N, N] float: ``1 / c_i`` where query i may read key j (j real and at or
            before i: causal), else 0; ``c_i`` = the number of keys query i reads (eq. 2's
            normalisation, per query).
        history_bucket [N, N] int64: ``position_bucket(max(i - j, 0))`` for history queries.
        target_bucket [B, N] int64: ``position_bucket(max(n - j, 0))``, the target's distance
            to each history event (the target's position is n, right after the last real event,
            whatever the padding).
    """
    batch, length = mask.shape
    n = mask.sum(dim=1).long()  # [B]
    real = torch.cat([mask, mask.new_ones(batch, 1)], dim=1)  # [B, N]
    idx = torch.arange(length + 1, device=mask.device)
    causal = (idx[:, None] >= idx[None, :]).to(mask.dtype)  # [N, N]
    allowed = causal[None, :, :] * real[:, None, :]  # [B, N, N]
    weight = allowed / allowed.sum(dim=2, keepdim=True).clamp(min=1)
    history_bucket = position_bucket((idx[:, None] - idx[None, :]).clamp(min=0), num_buckets)
    target_bucket = position_bucket((n[:, None] - idx[None, :]).clamp(min=0), num_buckets)
    return weight, history_bucket, target_bucket


@torch.fx.wrap
def relative_bias(table: torch.Tensor, history_bucket: torch.Tensor, target_bucket: torch.Tensor) -> torch.Tensor:
    """``rab^p`` [B, 1, N, N] float: ``table[bucket]`` (one learned scalar per position bucket,
    shared by the heads), the history rows from ``history_bucket``, the target's row (the last)
    from ``target_bucket``."""
    batch, length = target_bucket.shape[0], history_bucket.shape[0] - 1
    rows = table[history_bucket[:length]].unsqueeze(0).expand(batch, length, length + 1)
    return torch.cat([rows, table[target_bucket].unsqueeze(1)], dim=1).unsqueeze(1)


@torch.fx.wrap
def with_actions(out: dict, key: str, values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[B, L, E]: the history's item embeddings ``values`` plus each event's action embedding
    (``key``'s, from the EmbeddingCollection's output ``out``); padding stays 0.

    Raises:
        ValueError: a row's count of actions is not its count of events.
    """
    jt = out[key]
    if not torch.equal(jt.lengths().long(), mask.sum(dim=1).long()):
        raise ValueError(f"{key}: rows' counts of actions {jt.lengths().tolist()} are not their counts of events")
    return values + jt.to_padded_dense(desired_length=values.shape[1])


class HSTULayer(nn.Module):
    """One HSTU layer (eq. 1-3 of the paper) over padded tokens ``x`` [B, N, D] float32
    (:meth:`forward`), or packed ones [T, D] (:meth:`forward_jagged`, what :class:`HSTU` and
    ``HSTURetrieval`` run: no compute on padding; the padded one is its reference):

    ``U, V, Q, K = Split(SiLU(f_1(LayerNorm(x))))`` (eq. 1; ``f_1`` linear without bias,
    U, V: ``num_heads x linear_dim``, Q, K: ``num_heads x attention_dim``);
    ``A V = (SiLU(Q K^T + rab^{p,t}) * M / c) V`` per head (eq. 2: pointwise aggregated attention,
    no softmax; ``M`` the causal mask over real keys, ``c`` each query's number of keys),
    evaluated by ``recsys_dist.models.hstu_attention.pointwise_attention`` (padded) or
    ``recsys_dist.models.hstu_jagged.jagged_attention`` (packed) with the kernel ``attention``
    (``auto``, ``dense`` or ``chunked``);
    ``y = x + f_2(Dropout(LayerNorm(A V) * U))`` (eq. 3 with the residual). Both layer norms
    have no learned scale or shift, as in the reference implementation
    (facebookresearch/generative-recommenders, ``SequentialTransductionUnitJagged``).
    """

    def __init__(
        self,
        dim: int,
        num_heads: int,
        attention_dim: int,
        linear_dim: int,
        num_buckets: int,
        dropout: float,
        device: torch.device | None = None,
        attention: str = "auto",
        time_buckets: int = 0,
    ) -> None:
        super().__init__()
        self.dim, self.heads, self.dqk, self.dv = dim, num_heads, attention_dim, linear_dim
        self.attention = attention
        self.f1 = nn.Linear(dim, num_heads * (2 * linear_dim + 2 * attention_dim), bias=False, device=device)
        nn.init.normal_(self.f1.weight, 0.0, 0.02)
        self.f2 = nn.Linear(num_heads * linear_dim, dim, device=device)
        nn.init.xavier_uniform_(self.f2.weight)
        self.position_bias = nn.Parameter(torch.empty(num_buckets, device=device).normal_(0.0, 0.02))
        self.dropout = nn.Dropout(dropout)
        # rab^t (recsys_dist.models.hstu_time): made only when used, so a model without it draws
        # the same initial weights as before it existed
        if time_buckets:
            self.time_bias = nn.Parameter(torch.empty(time_buckets, device=device).normal_(0.0, 0.02))

    def forward(
        self,
        x: torch.Tensor,
        weight: torch.Tensor | None = None,
        history_bucket: torch.Tensor | None = None,
        target_bucket: torch.Tensor | None = None,
        time_bucket: torch.Tensor | None = None,
        *,
        layout: hstu_jagged.JaggedLayout | None = None,
        deltas: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Padded: ``x`` [B, N, D] -> [B, N, D] under ``weight``, ``history_bucket`` and
        ``target_bucket`` (:func:`target_layout`); ``time_bucket`` int64 [B, N, N]
        (``hstu_time.time_buckets``) adds ``rab^t`` to the scores, None: position bias only.
        Packed: ``x`` [T, D] -> [T, D] under ``layout`` (and ``deltas``): :meth:`forward_jagged`,
        called through here so the module's hooks (e.g. FSDP's unsharding) run.

        Raises:
            ValueError: both layouts, or neither, given.
        """
        if (layout is None) == (weight is None):
            raise ValueError("HSTULayer: pass either the padded layout (weight, buckets) or layout=, not both")
        if layout is not None:
            return self.forward_jagged(x, layout, deltas)
        h, dv, dqk = self.heads, self.dv, self.dqk
        uvqk = F.silu(self.f1(F.layer_norm(x, (self.dim,), eps=EPS)))
        u, v, q, k = uvqk.split([h * dv, h * dv, h * dqk, h * dqk], dim=-1)
        bias = relative_bias(self.position_bias, history_bucket, target_bucket)  # [B, 1, N, N]
        if time_bucket is not None:  # rab^{p,t} = rab^p + rab^t
            bias = bias + self.time_bias[time_bucket].unsqueeze(1)
        q, k, v = q.unflatten(-1, (h, dqk)), k.unflatten(-1, (h, dqk)), v.unflatten(-1, (h, dv))
        av = hstu_attention.pointwise_attention(q, k, v, bias, weight, self.attention)  # [B, N, H*dv]
        return x + self.f2(self.dropout(F.layer_norm(av, (h * dv,), eps=EPS) * u))

    def forward_jagged(
        self, x: torch.Tensor, lay: hstu_jagged.JaggedLayout, deltas: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The same layer over packed tokens ``x`` [T, D] -> [T, D] (``recsys_dist.models.hstu_jagged``:
        no compute on padding): a token at position i of its row reads positions ``j <= i`` below
        its row's ``lay`` keys, with ``rab^p`` of ``i - j``; ``deltas`` int64 [B, L] (each
        history event's ``d``, ``hstu_time.padded_deltas``) adds ``rab^t``, None: position bias
        only. Equals the padded :meth:`forward` at the real tokens, to float rounding. Call it
        as ``layer(x, layout=lay, deltas=deltas)``, through the module's hooks."""
        h, dv, dqk = self.heads, self.dv, self.dqk
        uvqk = F.silu(self.f1(F.layer_norm(x, (self.dim,), eps=EPS)))
        u, v, q, k = uvqk.split([h * dv, h * dv, h * dqk, h * dqk], dim=-1)
        q, k, v = q.unflatten(-1, (h, dqk)), k.unflatten(-1, (h, dqk)), v.unflatten(-1, (h, dv))
        time_bias = self.time_bias if deltas is not None else None
        av = hstu_jagged.jagged_attention(q, k, v, lay, self.position_bias, deltas, time_bias, self.attention)
        return x + self.f2(self.dropout(F.layer_norm(av, (h * dv,), eps=EPS) * u))


class TaskHeads(nn.Module):
    """One MLP head per task: ``[B, d] -> [B, T]`` logits (column t = task t's head)."""

    def __init__(self, d: int, sizes: list[int], num_tasks: int, device=None, **mlp_options) -> None:
        super().__init__()
        self.heads = nn.ModuleList(mlp_head(d, sizes, device=device, **mlp_options) for _ in range(num_tasks))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([head(x) for head in self.heads], dim=1)


class HSTU(TargetSequenceModel):
    """HSTU ranking model (Zhai et al., 2024, Section 2-3), target-aware.

    For each sequence feature with events ``h_1..h_n`` [B, L, E] (oldest first, padded to the
    batch's longest L) and the target item's embedding ``v_A`` [B, E] (the pooled embedding of
    ``target_feature``, the item being ranked), the tokens ``[h_1..h_n, v_A]`` go through
    ``num_layers`` :class:`HSTULayer` s under a causal mask: each event reads the events before
    it, the target reads the whole history and itself, and nothing reads a later token or a
    padded one. The relative attention bias ``rab^p`` is a learned scalar per layer and per
    bucket of the distance ``i - j`` in events (:func:`position_bucket`: exact below
    ``max_positions // 2``, logarithmic beyond); the target's position is ``n``, right after
    the last event. With ``time_buckets`` > 0 the paper's time bias ``rab^t`` joins it
    (``rab^{p,t} = rab^p + rab^t``, a learned scalar per layer and bucket of the time between
    the query's next token and the key: ``recsys_dist.models.hstu_time``), read from the
    raw-valued ``<sequence>_time`` feature (``data.schema.history.times``). With
    ``action_tokens`` each event's token is its item embedding plus its action's (the
    ``<sequence>_action`` sequence, ``data.schema.history.action``: e.g. the rating), and the
    target's is the target item plus a learned action vector (its action is unknown). Both off,
    the model is the one from before them (same parameters, same seeded weights).

    The target's output ``y_A`` [B, E] after the last layer (the "target-aware" set-up of the
    paper's ranking model: the candidate is the last token) goes into one MLP head per task:
    ``logit_t = MLP_t([dense, e_1..e_F, y_A per sequence])`` with ``e_1..e_F`` the pooled
    embeddings of every sparse feature (the paper puts such context features in the sequence
    as tokens; here they join at the head, as for DIN and BST).

    No compute on padding: the EmbeddingCollection's JaggedTensor is padded to the batch's
    longest history (``recsys_dist.models.sequence.padded_sequence``), then each row's real
    tokens are packed (``[sum(n + 1), E]``) and the layers run on them
    (:meth:`HSTULayer.forward_jagged`, ``recsys_dist.models.hstu_jagged``): the pointwise parts
    on the real tokens only, the attention over length-sorted row blocks that skip the padded
    rows and the causal upper half (``attention``: each block's scores kept for backward, or
    recomputed for long histories). A row's logits do not depend on the other rows or on the
    padding (to float rounding). The reference's fused jagged kernels are GPU-only; these are
    plain torch ops.

    ``forward(dense [B, num_dense] float32, kjt)`` returns logits float32 [B, T], T =
    ``len(spec.tasks)`` (``[B, 1]`` for one task).

    Raises:
        ValueError: no sequence feature, ``target_feature`` not a categorical feature, or the
            actions / times and the options disagree (:func:`token_sequences`).
    """

    def __init__(
        self,
        ebc: EmbeddingBagCollection,
        ec: EmbeddingCollection,
        num_dense: int,
        features: list[str],
        sequences: list[str],
        target_feature: str,
        embedding_dim: int,
        deep_layer_sizes: list[int],
        num_tasks: int = 1,
        num_layers: int = 2,
        num_heads: int = 1,
        attention_dim: int = 16,
        linear_dim: int = 16,
        layer_dropout: float = 0.2,
        max_positions: int = 64,
        attention: str = "auto",
        device: torch.device | None = None,
        time_buckets: int = 0,
        action_tokens: bool = False,
        values: list[str] = (),
        sequence_lengths: dict[str, int] | None = None,
        **mlp_options,
    ) -> None:
        super().__init__(ebc, ec, features, sequences, target_feature)
        self.max_positions, self.time_buckets, self.action_tokens = max_positions, time_buckets, action_tokens
        self.histories = token_sequences(sequences, values, time_buckets, action_tokens)
        # the pipeline stages' fixed row layout (hstu_stages): head columns, each history's length
        self.head_width, self.sequence_lengths = num_dense + len(features) * embedding_dim, dict(sequence_lengths or {})
        self.stacks = nn.ModuleList(
            nn.ModuleList(
                HSTULayer(
                    embedding_dim,
                    num_heads,
                    attention_dim,
                    linear_dim,
                    max_positions,
                    layer_dropout,
                    device=device,
                    attention=attention,
                    time_buckets=time_buckets,
                )
                for _ in range(num_layers)
            )
            for _ in self.histories
        )
        d = num_dense + (len(features) + len(self.histories)) * embedding_dim
        self.deep = TaskHeads(d, deep_layer_sizes, num_tasks, device=device, **mlp_options)
        if action_tokens:  # the target's action is unknown: a learned one (the reference's target action)
            self.target_action = nn.Parameter(torch.empty(len(self.histories), embedding_dim, device=device))
            nn.init.normal_(self.target_action, 0.0, 0.1)

    def encode(
        self,
        stack: nn.ModuleList,
        values: torch.Tensor,
        mask: torch.Tensor,
        target: torch.Tensor,
        deltas: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """[B, E]: the target token's output after the stack, for one sequence (``values`` [B, L, E],
        ``mask`` [B, L], ``target`` [B, E], ``deltas`` int64 [B, L] or None: no time bias). The
        layers run on the real tokens ``[h_1..h_n, target]`` of each row, packed
        (``HSTULayer.forward_jagged``)."""
        x = torch.cat([values, target.unsqueeze(1)], dim=1)  # [B, L + 1, E]
        real = torch.cat([mask, mask.new_ones(mask.shape[0], 1)], dim=1) > 0  # the target is real
        tokens = real.sum(dim=1)
        lay = hstu_jagged.layout(tokens)
        x = hstu_jagged.pack(x, real)  # [T, E]
        for layer in stack:
            x = layer(x, layout=lay, deltas=deltas)
        return x[torch.cumsum(tokens, 0) - 1]  # each row's last token: its target

    def summarise(self, i: int, values: torch.Tensor, mask: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """The target's output of sequence ``i``'s stack without actions or time bias."""
        return self.encode(self.stacks[i], values, mask, target)

    def forward(self, dense: torch.Tensor, kjt: KeyedJaggedTensor) -> torch.Tensor:
        v = layers.pooled_embeddings(self.sparse_arch(kjt), self.features)  # [B, F, E]
        target = v[:, self._target_index, :]
        out = self.seq_arch(kjt)
        parts = [dense, v.flatten(1)]
        for i, name in enumerate(self.histories):
            values, mask = sequence.padded_sequence(out, name)
            token = target
            if self.action_tokens:  # item + action embedding per event (padding stays 0)
                values = with_actions(out, f"{name}_action", values, mask)
                token = target + self.target_action[i]
            deltas = hstu_time.padded_deltas(kjt, f"{name}_time", mask) if self.time_buckets else None
            parts.append(self.encode(self.stacks[i], values, mask, token, deltas))
        return self.deep(torch.cat(parts, dim=1))

    def pipeline_slots(self) -> list[hstu_stages.SequenceSlots]:
        """Where each history lies in :meth:`pipeline_input`'s row (``hstu_stages``).

        Raises:
            ValueError: a history whose max length the data does not give.
        """
        missing = [h for h in self.histories if h not in self.sequence_lengths]
        if missing:
            raise ValueError(
                f"HSTU's pipeline stages pad each history to its max length, unknown for {missing} (the "
                "FeatureSpec's sequence_lengths: data.schema.history.max_length or data.schema.sequence's max_length)"
            )
        lengths = [self.sequence_lengths[h] for h in self.histories]
        dim = self.stacks[0][0].dim
        return hstu_stages.row_layout(self.head_width, self.histories, lengths, dim, bool(self.time_buckets))

    def pipeline_input(self, dense: torch.Tensor, kjt: KeyedJaggedTensor) -> torch.Tensor:
        """``[B, K]`` float32, the row of ``hstu_stages`` (dense, pooled embeddings, then each
        history's tokens padded to its max length, its count of events and, with the time bias,
        its times): the lookups, no dense parameter (recsys_dist.models.tower).

        Raises:
            ValueError: a history longer than its max length, times of 2^48 units or more, or
                the actions / times not matching the events (as ``forward``).
        """
        v = layers.pooled_embeddings(self.sparse_arch(kjt), self.features)  # [B, F, E]
        target = v[:, self._target_index, :]
        out = self.seq_arch(kjt)
        parts, meta = [dense, v.flatten(1)], dense.is_meta  # meta: the plan reads the width, no values to check
        for s in self.pipeline_slots():
            values, mask = hstu_stages.fixed_sequence(out, s.name, s.length)
            if self.action_tokens:
                key = f"{s.name}_action"
                if meta:  # with_actions checks the counts, which meta tensors do not hold
                    values = values + out[key].to_padded_dense(desired_length=s.length)
                else:
                    values = with_actions(out, key, values, mask)
            parts += [values.flatten(1), target, mask.sum(dim=1, keepdim=True)]
            if self.time_buckets:
                key = f"{s.name}_time"
                deltas = mask.long() if meta else hstu_time.padded_deltas(kjt, key, mask)
                parts += hstu_stages.split_deltas(deltas, key)
        return torch.cat(parts, dim=1)

    def pipeline_tower(self) -> list[nn.Module]:
        """The target action (with ``action_tokens``), each history's layers, then the head's
        layers (its hidden layers and its output layer; several tasks' heads: one module), one
        module each over :meth:`pipeline_input`'s row: composed, ``forward`` (``hstu_stages``)."""
        slots = self.pipeline_slots()
        modules: list[nn.Module] = [hstu_stages.TargetAction(self.target_action, slots)] if self.action_tokens else []
        for s, stack in zip(slots, self.stacks, strict=True):
            modules += [hstu_stages.LayerStage(layer, s, self.time_buckets > 0) for layer in stack]
        heads = self.deep.heads
        head = [*tower.mlp_layers(heads[0][0]), heads[0][1]] if len(heads) == 1 else [self.deep]
        return [*modules, hstu_stages.Head(head[0], self.head_width, slots), *head[1:]]


def hstu_inputs(job) -> list[str]:
    """Preflight: the data's actions and event times match ``model.action_tokens`` /
    ``model.time_buckets`` (:func:`token_sequences`)."""
    f, m = job.features, job.model
    try:
        token_sequences(f.sequence_names, f.value_names, m.time_buckets, m.action_tokens)
    except ValueError as err:
        return [str(err)]
    return []


def token_sequences(sequences: list[str], values, time_buckets: int, action_tokens: bool) -> list[str]:
    """The sequences HSTU reads as tokens: ``sequences`` but the ``<s>_action`` ones (which join
    ``<s>``'s tokens). An input the options leave unused, or one they need and miss, is an error.

    Raises:
        ValueError: ``<s>_action`` without ``model.action_tokens`` or the reverse; ``<s>_time``
            without ``model.time_buckets`` or the reverse.
    """
    actions = [s for s in sequences if s.endswith("_action") and s[: -len("_action")] in sequences]
    histories = [s for s in sequences if s not in actions]
    if actions and not action_tokens:
        raise ValueError(
            f"the data derives {actions} (data.schema.history.action) but model.action_tokens is false: set "
            "model.action_tokens: true to use them, or drop data.schema.history.action"
        )
    if action_tokens and (missing := [s for s in histories if f"{s}_action" not in actions]):
        raise ValueError(
            f"model.action_tokens: true needs each sequence's actions; {missing} have none (set "
            "data.schema.history.action to the action column, e.g. the rating)"
        )
    if list(values) and not time_buckets:
        raise ValueError(
            f"the data derives {list(values)} (data.schema.history.times) but model.time_buckets is 0: set "
            "model.time_buckets (e.g. 128) to use them, or drop data.schema.history.times"
        )
    if time_buckets and (missing := [s for s in histories if f"{s}_time" not in values]):
        raise ValueError(
            f"model.time_buckets: {time_buckets} needs each sequence's event times; {missing} have none (set "
            "data.schema.history.times: true)"
        )
    return histories


@register_model("hstu", HSTUConfig, checks=(hstu_inputs,))
def build_hstu(spec: FeatureSpec, cfg: HSTUConfig) -> HSTU:
    """``HSTU`` over the spec's pooled tables and its sequence tables, one head per task of
    ``spec.tasks`` (so no one-task check: several ``data.schema.labels`` are welcome).

    Raises:
        ValueError: no sequence feature, or ``target_feature`` is not a categorical feature.
    """
    return HSTU.from_spec(
        spec,
        cfg,
        num_tasks=len(spec.tasks),
        num_layers=cfg.num_layers,
        num_heads=cfg.num_heads,
        attention_dim=cfg.attention_dim,
        linear_dim=cfg.linear_dim,
        layer_dropout=cfg.layer_dropout,
        max_positions=cfg.max_positions,
        attention=cfg.attention,
        time_buckets=cfg.time_buckets,
        action_tokens=cfg.action_tokens,
        values=spec.value_names,
        sequence_lengths=spec.sequence_lengths,
    )
