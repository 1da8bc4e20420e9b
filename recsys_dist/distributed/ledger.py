"""The bytes ledger: what one training step puts on the wire, per rank, per table, per phase.

Predicted from a sharding plan alone (no process group), so ``recsys-dist plan`` prints it
for any cluster, and the trainer logs it once into ``metrics.jsonl``. The same quantities are
counted at the collectives of a real run by :class:`recsys_dist.distributed.comm_counter.CommCounter`;
``tests/ranks/distributed/test_ledger.py`` checks the two agree exactly.

What a step moves, as TorchRec 1.8 does it for a sharded EmbeddingBagCollection (one
input_dist and one output_dist per collection and sharding type):

- ``input_dist`` (the KJT all-to-all): first the splits, 3 int64 per peer (counts of
  lengths and values, and the batch size); then the lengths (int32, ``B`` per feature and
  destination) and the ids (int64). table_wise / column_wise / table_column_wise send a
  feature's ``B`` lengths and ``B x P`` ids to every rank holding a shard of its table (column
  shards each get a copy); row_wise / table_row_wise send ``B`` lengths per feature to every
  shard's rank and each id to the rank whose rows hold it.
- ``output_dist_forward``: pooled embeddings [B, width] per feature. table_wise / column_wise
  shards send theirs to every rank (an all-to-all); row_wise shards reduce-scatter
  partial sums of all ranks' examples.
- ``output_dist_backward``: their gradients, the same sizes the other way (an all-to-all,
  or the all-gather that is a reduce-scatter's backward).
- ``allreduce``: DDP's gradient all-reduce of the dense parameters (under
  ``distributed.dense.strategy: fsdp`` only those in no FSDP block), and of each
  data_parallel table (whole table, every step), as fp32 payload.
- ``fsdp_all_gather`` / ``fsdp_reduce_scatter`` (``distributed.dense.strategy: fsdp``): per
  dense block (:func:`recsys_dist.distributed.dense.dense_blocks`), FSDP2's all-gather of its
  weights (once per step, in forward: ``dense.ALL_GATHERS_PER_STEP``) and reduce-scatter of its
  gradients (in backward); a chunk is one rank's share of every parameter padded on dim 0 to a
  multiple of the world size (table ``dense``).
- ``pipeline_io`` / ``pipeline_p2p`` (``distributed.dense.strategy: pipeline``): the stages'
  collectives around the schedule and their send / recv, booked by
  :func:`recsys_dist.distributed.pipeline_traffic.add_pipeline_flows` (table ``pipeline``),
  which also books the stages' data-parallel all-reduce under ``allreduce``. ``recsys-dist plan``
  and the run's ledger line (``recsys_dist.train.summary.ledger_line``) count them; ``run_ledger``
  alone does not. Under ``sharding.replica_groups`` each pipeline lies inside a sharding group,
  so a group's row ``r`` is pipeline rank ``r % S`` in every group.
- ``replica_sync`` (``sharding.replica_groups`` N > 1, :mod:`recsys_dist.distributed.replicas`):
  the plan is one sharding group's (world / N ranks; every phase above is counted inside a
  group, the rows of the ledger are a group's ranks, the same in every group, except the dense
  tower's DDP / FSDP collectives and the data_parallel tables' all-reduce, which run over all
  the job's ranks: ``predict``'s ``dense_world_size``), and every
  ``replica_sync_every`` = k steps each rank all-reduces (AVG, over its N replicas) its table
  shards (fp32) and their optimizer state (``exact_adagrad``: one float per weight,
  ``exact_rowwise_adagrad``: one per row, ``exact_sgd``: none): counted as that payload / k
  per step (``Ledger.sync_bytes``: per sync).
- ``managed_all_gather``: under managed-collision tables (``recsys_dist.models.managed``),
  the replicated MCH state's two all_gathers every training step: the id count per managed
  feature (int64 each), then the step's ids of every managed feature (int64, ``B x P`` per
  feature), so every rank records the global batch's ids (table ``managed``).

Counting rules (the same on both sides): in an all-to-all, a rank sends the chunks it
addresses to other ranks and receives the chunks others address to it (its own chunk is a
local copy, not counted); a reduce-scatter of ``W`` chunks sends ``W - 1`` chunks and
receives ``W - 1`` partial chunks; an all-gather sends its chunk to ``W - 1`` ranks and
receives ``W - 1`` chunks; an all-reduce is counted as its payload (a ring all-reduce
moves ``2 (W - 1) / W`` of it each way). A world of one rank moves nothing.

Assumptions of the prediction: every rank has the same batch size ``B``; every example has
``P`` ids of a feature (its pooling factor: 1 for one-hot features, ``data.multi_hot_sizes``
for MLPerf-style fixed bags, else as given; a ``data.schema.multi_hot`` feature without
``data.multi_hot_sizes`` is counted as 1 and listed in ``unsized_multi_hot``); under row_wise, ids spread over the row blocks
in proportion to their rows (the counted bytes equal the prediction when they do, e.g. for
uniformly drawn ids in expectation). Unweighted KJTs (no per-id weights). Only
EmbeddingBagCollection tables' all-to-alls are modelled: EmbeddingCollection (sequence) tables
are listed as not counted there (the replicas' sync counts them). table_row_wise
across several nodes (its intra-node reduce-scatter and cross-node all-to-all) is modelled
from TorchRec's TwRwPooledEmbeddingDist and not checked by the counting test, which runs on
one node (where table_row_wise is checked); table_column_wise is modelled as column_wise.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from torch import nn
from torch.distributed.fsdp import FSDPModule
from torchrec.distributed.embedding import ShardedEmbeddingCollection
from torchrec.distributed.embeddingbag import ShardedEmbeddingBagCollection
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection

from recsys_dist.data.config import DataConfig
from recsys_dist.distributed.config import SHARDING_TYPES, CommsConfig
from recsys_dist.distributed.dense import ALL_GATHERS_PER_STEP, fsdp_traffic
from recsys_dist.models.managed import find_remap

PHASES = (
    "input_dist",
    "output_dist_forward",
    "output_dist_backward",
    "allreduce",
    "managed_all_gather",
    "fsdp_all_gather",
    "fsdp_reduce_scatter",
    "pipeline_io",
    "pipeline_p2p",
    "replica_sync",
)
# shown only when they move bytes
_OPTIONAL = (
    "managed_all_gather",
    "fsdp_all_gather",
    "fsdp_reduce_scatter",
    "pipeline_io",
    "pipeline_p2p",
    "replica_sync",
)
PRECISION_BYTES = {"fp32": 4, "fp16": 2, "bf16": 2}
ID_BYTES = 8  # KJT values: the loader hands int64 ids to the model
LENGTH_BYTES = 4  # KJT lengths: int32
SPLITS_PER_PEER = 3  # the splits all-to-all: counts of lengths, of values, and the batch size
SPLIT_BYTES = 8  # int64
_ROW_LIKE = ("row_wise", "table_row_wise")
_SHARDED_TYPES = tuple(t for t in SHARDING_TYPES if t != "data_parallel")


@dataclass
class Flow:
    """Bytes one rank sends and receives in one phase for one table (or ``dense``/``splits``)."""

    rank: int
    phase: str
    table: str
    sent: float
    received: float


@dataclass
class Ledger:
    """Per-step bytes of a plan. ``flows`` holds one :class:`Flow` per (rank, phase, table);
    bytes are per training step, exact integers except row_wise ids, which are expectations
    when ``B x P x rows_shard / rows`` is not whole."""

    world_size: int
    batch_size: int
    pooling: dict[str, float]
    forward_precision: str = "fp32"
    backward_precision: str = "fp32"
    flows: list[Flow] = field(default_factory=list)
    unmodelled: list[str] = field(default_factory=list)  # tables left out (EmbeddingCollection)
    # multi-hot features whose bags vary and whose size nobody gave: P = 1 is a guess
    unsized_multi_hot: list[str] = field(default_factory=list)
    replica_groups: int = 1  # sharding.replica_groups: world_size is one group's
    replica_sync_every: int = 1
    sync_bytes: list[int] = field(default_factory=list)  # per rank of a group: the payload of one sync

    def add(self, rank: int, phase: str, table: str, sent: float = 0, received: float = 0) -> None:
        if sent or received:
            self.flows.append(Flow(rank, phase, table, sent, received))

    def per_rank(self) -> list[dict[str, dict[str, float]]]:
        """For each rank: phase -> {"sent", "received"} in bytes per step."""
        out = [{p: {"sent": 0, "received": 0} for p in PHASES} for _ in range(self.world_size)]
        for f in self.flows:
            out[f.rank][f.phase]["sent"] += f.sent
            out[f.rank][f.phase]["received"] += f.received
        return out

    def per_table(self) -> dict[str, dict[str, float]]:
        """For each table (and ``dense``, ``splits``, ``managed``): phase -> bytes sent per step, summed over ranks."""
        out: dict[str, dict[str, float]] = {}
        for f in self.flows:
            row = out.setdefault(f.table, {p: 0 for p in PHASES})
            row[f.phase] += f.sent
        return out

    def totals(self) -> dict[str, float]:
        """Phase -> bytes sent per step, summed over ranks (each all-to-all byte counted once)."""
        out = {p: 0 for p in PHASES}
        for f in self.flows:
            out[f.phase] += f.sent
        return out

    def to_dict(self) -> dict:
        return {
            "world_size": self.world_size,
            "batch_size": self.batch_size,
            "forward_precision": self.forward_precision,
            "backward_precision": self.backward_precision,
            "pooling": self.pooling,
            "per_rank": [
                {"rank": r, **{p: {k: _num(v) for k, v in d.items()} for p, d in row.items()}}
                for r, row in enumerate(self.per_rank())
            ],
            "per_table": {t: {p: _num(v) for p, v in row.items()} for t, row in self.per_table().items()},
            "totals": {p: _num(v) for p, v in self.totals().items()},
            "unmodelled_tables": self.unmodelled,
            "unsized_multi_hot": self.unsized_multi_hot,
            "replica_groups": self.replica_groups,
            "replica_sync_every": self.replica_sync_every,
            "sync_bytes_per_rank": self.sync_bytes,
        }

    def text(self, max_tables: int = 40) -> str:
        t = self.totals()
        # managed-collision and FSDP columns only where they move bytes
        extra = [p for p in _OPTIONAL if t[p]]
        phases = [p for p in PHASES if p not in _OPTIONAL or p in extra]
        heads = {
            "managed_all_gather": "mc gather",
            "fsdp_all_gather": "fsdp gather",
            "fsdp_reduce_scatter": "fsdp rs",
            "pipeline_io": "pp io",
            "pipeline_p2p": "pp p2p",
            "replica_sync": "replica sync",
        }
        notes = {
            "replica_sync": f"replica sync = the all-reduce of each rank's table shards and optimizer state over "
            f"its {self.replica_groups} replicas, every {self.replica_sync_every} step(s), per step (payload per "
            f"sync: {', '.join(human(b) for b in self.sync_bytes)} by rank)",
            "managed_all_gather": "mc gather = managed-collision ids all_gather, sent",
            "fsdp_all_gather": "fsdp gather / fsdp rs = FSDP2's all-gather of the dense weights / "
            "reduce-scatter of their gradients, sent",
            "pipeline_io": "pp io / pp p2p = the pipeline stages' gather, scatter, label all_gather and loss "
            "broadcast / activations and their gradients between stages, sent (recsys_dist/distributed/pipeline_traffic.py)",
        }
        group = (
            [
                f"one sharding group of {self.world_size} rank(s), the same in each of {self.replica_groups} replica groups"
            ]
            if self.replica_groups > 1
            else []
        )
        lines = group + [
            f"bytes per step on the wire (per-rank batch {self.batch_size}, output_dist forward "
            f"{self.forward_precision} / backward {self.backward_precision}; allreduce = fp32 payload"
            + "".join(f"; {notes[p]}" for p in extra if p in notes)
            + ")",
            "",
            f"{'rank':<6}"
            + "".join(f"{h:>13}" for h in ("in sent", "in recv", "out-fwd sent", "out-fwd recv", "out-bwd sent"))
            + f"{'out-bwd recv':>13}{'allreduce':>13}"
            + "".join(f"{heads[p]:>13}" for p in extra),
        ]
        for r, row in enumerate(self.per_rank()):
            cells = [
                row["input_dist"]["sent"],
                row["input_dist"]["received"],
                row["output_dist_forward"]["sent"],
                row["output_dist_forward"]["received"],
                row["output_dist_backward"]["sent"],
                row["output_dist_backward"]["received"],
                row["allreduce"]["sent"],
            ] + [row[p]["sent"] for p in extra]
            lines.append(f"{r:<6}" + "".join(f"{human(c):>13}" for c in cells))
        lines += [
            "",
            f"{'table':<16}{'input_dist':>13}{'out-fwd':>13}{'out-bwd':>13}{'allreduce':>13}"
            + "".join(f"{heads[p]:>13}" for p in extra)
            + "  (all ranks)",
        ]
        tables = sorted(self.per_table().items(), key=lambda kv: -sum(kv[1].values()))
        for name, row in tables[:max_tables]:
            lines.append(f"{name:<16}" + "".join(f"{human(row[p]):>13}" for p in phases))
        if len(tables) > max_tables:
            lines.append(f"... {len(tables) - max_tables} more tables")
        lines.append(f"{'total':<16}" + "".join(f"{human(t[p]):>13}" for p in phases))
        if self.unmodelled:
            lines.append(f"not counted (EmbeddingCollection sequence tables): {', '.join(self.unmodelled)}")
        if self.unsized_multi_hot:
            lines.append(
                f"multi-hot features counted as 1 id per example (their bags vary and data.multi_hot_sizes "
                f"is not set; set it to their typical bag length for their real bytes): "
                f"{', '.join(self.unsized_multi_hot)}"
            )
        return "\n".join(lines)


def _num(v: float) -> float | int:
    return int(v) if float(v).is_integer() else round(v, 3)


def human(n: float) -> str:
    for unit, size in (("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f} B"


def dense_parameter_bytes(model: nn.Module) -> int:
    """fp32 bytes of the gradients DDP all-reduces for the dense part of ``model`` (every
    parameter that needs a gradient outside its EmbeddingBagCollections and
    EmbeddingCollections, sharded or not), on a plain, meta or DMP-wrapped model."""
    # The tables are not DDP's: model-parallel ones are updated by their fused optimizer, and
    # an EmbeddingCollection's tables are left out of the ledger altogether (``unmodelled``).
    skip = (EmbeddingBagCollection, ShardedEmbeddingBagCollection, EmbeddingCollection, ShardedEmbeddingCollection)

    def walk(m: nn.Module) -> int:
        if isinstance(m, skip):
            return 0
        own = sum(p.numel() * 4 for p in m.parameters(recurse=False) if p.requires_grad)
        return own + sum(walk(c) for c in m.children())

    seen = getattr(model, "module", model)  # DMP: its module is the unwrapped model
    return walk(seen)


def dense_bytes_of(model: nn.Module, strategy: str, world_size: int) -> tuple[int, list[tuple[int, int]]]:
    """``predict``'s ``dense_bytes`` and ``fsdp_blocks`` for ``model`` (plain, meta or
    DMP-wrapped) under ``distributed.dense.strategy`` ``strategy`` at ``world_size`` ranks.
    ``pipeline``: no DDP over the tower (its stages' own collectives:
    :func:`recsys_dist.distributed.pipeline_traffic.add_pipeline_flows`)."""
    if strategy == "pipeline":
        return 0, []
    if strategy == "fsdp":
        return fsdp_traffic(model, world_size)
    return dense_parameter_bytes(model), []


def predict(
    plan,
    tables: Iterable,
    world_size: int,
    batch_size: int,
    dense_bytes: int,
    pooling: dict[str, float] | None = None,
    forward_precision: str = "fp32",
    backward_precision: str = "fp32",
    local_world_size: int | None = None,
    managed_features: Iterable[str] = (),
    fsdp_blocks: Iterable[tuple[int, int]] = (),
    dense_world_size: int | None = None,
) -> Ledger:
    """The per-step ledger of a sharding plan (see the module doc for what is counted).

    Args:
        plan: a TorchRec ``ShardingPlan`` (e.g. ``dmp.plan``, or the planner's).
        tables: the ``EmbeddingBagConfig`` of every planned table.
        world_size: ranks of the job.
        batch_size: examples per rank per step (``B``).
        dense_bytes: fp32 bytes of the dense gradients DDP all-reduces (:func:`dense_bytes_of`).
        pooling: feature name -> ids per example ``P`` (default 1 for every feature).
        forward_precision, backward_precision: element type of output_dist's pooled
            embeddings and of their gradients: fp32, fp16 or bf16 (``sharding.comms``).
        local_world_size: ranks per node (default: all in one node).
        managed_features: the features of managed-collision tables (:func:`managed_features`),
            whose ids every rank all-gathers each step (``managed_all_gather``).
        fsdp_blocks: under ``distributed.dense.strategy: fsdp``, per dense block the bytes of one
            rank's chunk of its all-gather and of its reduce-scatter (:func:`dense_bytes_of`).
        dense_world_size: the ranks the dense tower's DDP / FSDP and the data_parallel tables'
            all-reduce run over (default ``world_size``). Under ``sharding.replica_groups`` N,
            ``world_size`` is one sharding group's (the plan's) and this is the job's, N times it.

    Raises:
        ValueError: a sharding type the ledger does not know, or an unknown precision.
    """
    for p in (forward_precision, backward_precision):
        if p not in PRECISION_BYTES:
            raise ValueError(f"precision {p!r}: one of {sorted(PRECISION_BYTES)}")
    pooling = dict(pooling or {})
    # EmbeddingCollection tables (EmbeddingConfig) are not modelled; predict lists them.
    by_name = {t.name: t for t in tables if isinstance(t, EmbeddingBagConfig)}
    for t in by_name.values():
        for f in t.feature_names:
            pooling.setdefault(f, 1.0)
    W, B = world_size, batch_size
    DW = world_size if dense_world_size is None else dense_world_size
    led = Ledger(W, B, pooling, forward_precision, backward_precision)
    if DW == 1:
        return led
    ef, eb = PRECISION_BYTES[forward_precision], PRECISION_BYTES[backward_precision]
    groups: set[tuple[str, str]] = set()
    for path, module_plan in plan.plan.items():
        for name, ps in module_plan.items():  # type: ignore[union-attr]
            t = by_name.get(name)
            if t is None:  # an EmbeddingCollection (sequence) table: not modelled
                led.unmodelled.append(name)
                continue
            st = ps.sharding_type
            if st == "data_parallel":  # DDP's, over the job's ranks
                for r in range(W):
                    b = t.num_embeddings * t.embedding_dim * 4
                    led.add(r, "allreduce", name, b, b)
                continue
            if st not in _SHARDED_TYPES:
                raise ValueError(f"table {name}: sharding type {st} is not in the ledger")
            groups.add((path, st))
            shards = [(s.placement.rank(), s.shard_sizes[0], s.shard_sizes[1]) for s in ps.sharding_spec.shards]
            _sharded_table(led, t, st, shards, pooling, ef, eb, local_world_size)
    for _ in sorted(groups):
        for r in range(W):
            b = SPLITS_PER_PEER * SPLIT_BYTES * (W - 1)
            led.add(r, "input_dist", "splits", b, b)
    _dense_flows(led, dense_bytes, fsdp_blocks, DW)
    _managed_flows(led, list(managed_features))
    return led


def _managed_flows(led: Ledger, managed: list[str]) -> None:
    """recsys_dist.models.managed: all_gather of the id count per feature, then of the ids
    (every rank's buffer is as long as the longest, which is B x sum(P) when batches are equal)."""
    W, B = led.world_size, led.batch_size
    chunk = ID_BYTES * (len(managed) + sum(B * led.pooling.get(f, 1.0) for f in managed)) if managed else 0
    for r in range(W):
        led.add(r, "managed_all_gather", "managed", (W - 1) * chunk, (W - 1) * chunk)


def _dense_flows(led: Ledger, allreduce: int, fsdp_blocks: Iterable[tuple[int, int]], world: int) -> None:
    """The dense tower's collectives over ``world`` ranks (the job's): DDP's all-reduce of
    ``allreduce`` bytes; per FSDP block (one rank's all-gather chunk, reduce-scatter chunk)
    world - 1 chunks each way of each. Booked on each of the ledger's ranks (under replica
    groups a sharding group's: every rank of the job moves the same)."""
    for r in range(led.world_size):
        led.add(r, "allreduce", "dense", allreduce, allreduce)
    for gather, reduce in fsdp_blocks:
        for r in range(led.world_size):
            g = ALL_GATHERS_PER_STEP * gather * (world - 1)
            led.add(r, "fsdp_all_gather", "dense", g, g)
            led.add(r, "fsdp_reduce_scatter", "dense", reduce * (world - 1), reduce * (world - 1))


def _sharded_table(
    led: Ledger, t, st: str, shards: list[tuple[int, int, int]], pooling: dict, ef: int, eb: int, local: int | None
) -> None:
    """input_dist and output_dist of one sharded table ``t`` of type ``st``; ``shards``:
    (rank, rows, width) of each shard."""
    W, B, name = led.world_size, led.batch_size, t.name
    for f in t.feature_names:
        ids = B * pooling[f]
        for d, rows, width in shards:
            if st in _ROW_LIKE:
                per_src = B * LENGTH_BYTES + ids * rows / t.num_embeddings * ID_BYTES
            else:
                per_src = B * LENGTH_BYTES + ids * ID_BYTES
            for r in range(W):
                if r != d:
                    led.add(r, "input_dist", name, per_src, 0)
                    led.add(d, "input_dist", name, 0, per_src)
            if st in _ROW_LIKE:
                continue
            fwd, bwd = B * width * ef, B * width * eb
            for r in range(W):
                if r != d:
                    led.add(d, "output_dist_forward", name, fwd, 0)
                    led.add(r, "output_dist_forward", name, 0, fwd)
                    led.add(r, "output_dist_backward", name, bwd, 0)
                    led.add(d, "output_dist_backward", name, 0, bwd)
        if st in _ROW_LIKE:
            ranks = sorted({d for d, *_ in shards})
            _row_output_dist(led, name, ranks, W, B * t.embedding_dim, ef, eb, st, local)


def managed_features(model: nn.Module) -> list[str]:
    """The features of ``model``'s managed-collision tables (its ``ManagedRemap``), in the
    order it gathers them; empty without managed tables. A plain, meta or DMP-wrapped model."""
    remap = find_remap(model)
    return list(remap.mch.keys()) if remap is not None else []


def _row_output_dist(
    led: Ledger, name: str, ranks: list[int], W: int, chunk: int, ef: int, eb: int, st: str, local: int | None
) -> None:
    """output_dist of one row-sharded feature whose pooled output is [B, D] per rank (``chunk`` = B x D).

    row_wise: a reduce-scatter over all ranks forward, an all-gather backward. table_row_wise
    (TorchRec's TwRwPooledEmbeddingDist): a reduce-scatter over the node's L ranks of the
    partial sums for the N nodes' local-rank peers (N x B x D each), then an all-to-all across
    nodes (each node rank sends B x D to its peer on every other node); backward the reverse.
    On one node both are the same reduce-scatter."""
    if st == "row_wise" or not local or local >= W:
        n = len(ranks)
        for r in ranks:
            led.add(r, "output_dist_forward", name, (n - 1) * chunk * ef, (n - 1) * chunk * ef)
            led.add(r, "output_dist_backward", name, (n - 1) * chunk * eb, (n - 1) * chunk * eb)
        return
    nodes, L = W // local, len(ranks)
    node = ranks[0] // local
    for r in ranks:
        rs_f, rs_b = (L - 1) * nodes * chunk * ef, (L - 1) * nodes * chunk * eb
        led.add(r, "output_dist_forward", name, rs_f + (nodes - 1) * chunk * ef, rs_f)
        led.add(r, "output_dist_backward", name, rs_b, rs_b + (nodes - 1) * chunk * eb)
    for r in range(W):
        if r // local != node:
            led.add(r, "output_dist_forward", name, 0, chunk * ef)
            led.add(r, "output_dist_backward", name, chunk * eb, 0)


def pooling_from_config(data: DataConfig, tables: Iterable) -> dict[str, float]:
    """Feature -> ids per example the ledger assumes for a ``data`` section: ``data.multi_hot_sizes``
    for the features of the ``t_`` tables when given, else 1 (one-hot)."""
    tables = list(tables)
    hot = data.multi_hot_sizes
    feats = [t.feature_names[0] for t in tables if t.name.startswith("t_")]
    out = {f: 1.0 for t in tables for f in t.feature_names}
    if hot:
        out.update({f: float(h) for f, h in zip(feats, hot)})
    return out


def unsized_multi_hot(data: DataConfig) -> list[str]:
    """The ``data.schema.multi_hot`` features whose ids per example :func:`pooling_from_config`
    takes to be 1 because ``data.multi_hot_sizes`` is not set (their bags may hold any number)."""
    schema = data.schema
    if data.multi_hot_sizes or schema is None:
        return []
    return list(schema.multi_hot)


def run_ledger(
    dmp, data: DataConfig, comms: CommsConfig, batch_size: int, world_size: int, local_world_size: int | None = None
) -> Ledger:
    """The ledger of a sharded run: ``dmp``'s plan and tables, ``batch_size`` (``train.batch_size``),
    ``comms`` (``sharding.comms``), the pooling factors of :func:`pooling_from_config` and the
    managed-collision features of :func:`managed_features`, and the dense tower's collectives
    under the layout ``dmp`` has (FSDP's blocks, or DDP over it all)."""
    tables = [
        t for m in dmp.modules() if isinstance(m, ShardedEmbeddingBagCollection) for t in m._embedding_bag_configs
    ]
    # the layout the run has, not the one asked for: FSDPDense wraps its blocks in FSDPModule
    strategy = "fsdp" if any(isinstance(m, FSDPModule) for m in dmp.modules()) else "ddp"
    if getattr(dmp, "dense_stages", None) is not None:  # PipelineDense
        strategy = "pipeline"
    dense, blocks = dense_bytes_of(dmp, strategy, world_size) if world_size > 1 else (0, [])
    groups = getattr(dmp, "replica_groups", 1)  # a ReplicaDMP: its group's plan, on the group's ranks
    led = predict(
        getattr(dmp, "group_plan", dmp.plan),
        tables,
        world_size // groups,
        batch_size,
        dense,
        pooling_from_config(data, tables),
        comms.forward,
        comms.backward,
        local_world_size,
        managed_features(dmp),
        blocks,
        world_size,
    )
    led.unsized_multi_hot = unsized_multi_hot(data)
    if groups > 1:  # the sync averages the sequence tables' shards too
        seq = [t for m in dmp.modules() if isinstance(m, ShardedEmbeddingCollection) for t in m._embedding_configs]
        replica_sync_flows(led, dmp.group_plan, tables + seq, groups, dmp.sync_every, dmp.embedding_optimizer)
    return led


# Optimizer state sync() averages per table weight: exact_adagrad's sum is per weight, exact_rowwise_adagrad's per row.
_SYNC_STATE = {"exact_sgd": (0, 0), "exact_adagrad": (1, 0), "exact_rowwise_adagrad": (0, 1)}


def replica_sync_flows(led: Ledger, plan, tables: Iterable, groups: int, every: int, optimizer: str) -> None:
    """``sharding.replica_groups`` ``groups`` > 1: each rank's sync payload (``led.sync_bytes``,
    per sync) and the ``replica_sync`` flows (that / ``every`` per step, sent and received). The
    payload is what ``DMPCollection.sync`` all-reduces: every fused table shard the rank holds
    (fp32 weights) and its ``optimizer``'s state (``train.embedding_optimizer``). An
    EmbeddingCollection table counts too (its shards are synced alike).

    Raises:
        ValueError: an optimizer whose state the sync does not average (see rules.REPLICA_OPTIMIZERS).
    """
    if optimizer not in _SYNC_STATE:
        raise ValueError(f"train.embedding_optimizer {optimizer}: not synced across replica groups")
    per_weight, per_row = _SYNC_STATE[optimizer]
    by_name = {t.name: t for t in tables}
    payload = [0] * led.world_size
    for module_plan in plan.plan.values():
        for name, ps in module_plan.items():  # type: ignore[union-attr]
            if name not in by_name or ps.sharding_spec is None:
                continue
            for sh in ps.sharding_spec.shards:
                rows, cols = sh.shard_sizes
                payload[sh.placement.rank()] += 4 * (rows * cols * (1 + per_weight) + rows * per_row)
    led.replica_groups, led.replica_sync_every, led.sync_bytes = groups, every, payload
    for r, b in enumerate(payload):
        led.add(r, "replica_sync", "replicas", b / every, b / every)
