"""Dry-run planning: the sharding plan for any cluster, on a laptop, with no process group.

``recsys-dist plan --config X.yaml --world-size 64 --local-world-size 8 --device cuda --hbm-gb 80``
builds the model on ``meta`` (no table memory), runs TorchRec's ``EmbeddingShardingPlanner``
for the given topology and prints the plan, per-rank memory and the planner's cost estimate.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field

import torch
from torchrec.distributed.planner.types import PlannerError
from torchrec.distributed.types import ShardingPlan

from recsys_dist.data.convert.manifest import MANIFEST_FILE, table_coverage
from recsys_dist.data.coverage import WARN_ABOVE, coverage_lines
from recsys_dist.data.resolve import cached_conversion
from recsys_dist.distributed import ledger as ledgers
from recsys_dist.distributed.dense import planned_dense_bytes
from recsys_dist.distributed.optim import fuse_embedding_optimizer
from recsys_dist.distributed.pipeline_traffic import add_pipeline_flows, pipeline_layout
from recsys_dist.distributed.plan import ChosenOptions, World, make_topology
from recsys_dist.distributed.plan_io import plan_summary
from recsys_dist.distributed.rules import comms_problems
from recsys_dist.distributed.sharders import check_covered, model_tables
from recsys_dist.errors import PlanError
from recsys_dist.models.build import build_model
from recsys_dist.section import ConfigError
from recsys_dist.train.build import managed_remap, plan_job
from recsys_dist.train.job import Job

GB = 1024**3  # sizes are reported in GiB, as TorchRec's planner counts them
# Optimizer state per row, in units of embedding_dim floats (rowwise keeps one float per row).
_STATE_FLOATS = {"exact_rowwise_adagrad": None, "exact_adagrad": 1, "exact_sgd": 0, "adam": 2}


@dataclass
class TablePlacement:
    table: str
    sharding_type: str
    compute_kernel: str
    ranks: list[int]


@dataclass
class PlanReport:
    world_size: int
    local_world_size: int
    device: str
    placements: list[TablePlacement]
    hbm_gb: list[float] = field(default_factory=list)
    ddr_gb: list[float] = field(default_factory=list)
    cost_ms: list[float] = field(default_factory=list)
    ledger: ledgers.Ledger | None = None
    plan: ShardingPlan | None = None  # the plan described (what the Trainer's path gives on such a world)
    # How many training values each table gives a row of its own (plan_coverage), when converted.
    coverage: dict | None = None
    # distributed.dense: {"strategy", "optimizer", "per_rank": [{parameters, gradients, optimizer} bytes]},
    # and under pipeline "pipeline" (PipelineLayout.to_dict(), or {"why": ...} when not known)
    dense: dict | None = None
    replica_groups: int = 1  # sharding.replica_groups: world_size is one sharding group's

    def header(self) -> str:
        """What the plan is for: the world, or under replica groups one sharding group of it."""
        where = f"({self.local_world_size} per node), device {self.device}"
        if self.replica_groups == 1:
            return f"plan for {self.world_size} ranks {where}"
        n, g = self.replica_groups, self.world_size
        return (
            f"plan for one sharding group of {g} ranks {where}, the same in each of {n} replica groups "
            f"(sharding.replica_groups: {n}, world {g * n}; group k holds ranks k, k+{n}, ...; the ranks below "
            "are a group's)"
        )

    @property
    def imbalance(self) -> float:
        """max / mean of the per-rank estimated cost (1.0 = perfectly balanced)."""
        mean = sum(self.cost_ms) / len(self.cost_ms) if self.cost_ms else 0.0
        return max(self.cost_ms) / mean if mean > 0 else 1.0

    def text(self) -> str:
        lines = [self.header(), ""]
        lines.append(f"{'table':<8} {'sharding type':<18} {'kernel':<18} ranks")
        for p in self.placements:
            lines.append(f"{p.table:<8} {p.sharding_type:<18} {p.compute_kernel:<18} {_ranges(p.ranks)}")
        lines += ["", f"{'rank':<6} {'HBM GiB':>9} {'DDR GiB':>9} {'est. cost ms':>13}"]
        for r in range(self.world_size):
            lines.append(f"{r:<6} {self.hbm_gb[r]:>9.3f} {self.ddr_gb[r]:>9.3f} {self.cost_ms[r]:>13.3f}")
        lines.append("")
        lines.append(
            f"total HBM {sum(self.hbm_gb):.2f} GiB, DDR {sum(self.ddr_gb):.2f} GiB; "
            f"max/mean cost imbalance {self.imbalance:.3f}"
        )
        if self.dense is not None:
            lines += ["", *_dense_text(self.dense, self.replica_groups)]
        if self.ledger is not None:
            pool = sorted({v for v in self.ledger.pooling.values()})
            lines += [
                "",
                self.ledger.text(),
                f"(ids per example assumed: {', '.join(f'{p:g}' for p in pool)}; see recsys_dist/distributed/ledger.py)",
            ]
        if self.coverage is not None:
            lines += ["", *_coverage_text(self.coverage)]
        return "\n".join(lines)


def _dense_text(dense: dict, replica_groups: int = 1) -> list[str]:
    how = {
        "ddp": "replicated on every rank (DDP)",
        "fsdp": "sharded over the ranks (FSDP2, dim 0 of each weight)",
        "pipeline": "cut into pipeline stages (layout below); each rank holds only its own stages' parameters, "
        "gradients and optimizer state, and under 2bw its stages' previous version too (docs/design/pipeline.md)",
    }
    lines = [
        f"dense tower: distributed.dense.strategy {dense['strategy']}, {how.get(dense['strategy'], '')}; "
        f"optimizer state of train.dense_optimizer {dense['optimizer']}",
        f"{'rank':<6} {'parameters':>12} {'gradients':>12} {'optimizer':>12}",
    ]
    if replica_groups > 1:  # the tables' rows above are one group's; the tower spans the job
        lines.insert(
            1,
            f"(over all {len(dense['per_rank'])} ranks of the job, across the {replica_groups} replica groups: "
            "the ranks below are the job's)",
        )
    h = ledgers.human
    for r, b in enumerate(dense["per_rank"]):
        lines.append(f"{r:<6} {h(b['parameters']):>12} {h(b['gradients']):>12} {h(b['optimizer']):>12}")
    if "pipeline" in dense:
        lines += _pipeline_text(dense["pipeline"])
    return lines


def _pipeline_text(p: dict) -> list[str]:
    """The pipeline's grid and each stage's modules, parameters, output width and ranks."""
    if "why" in p:
        return [f"pipeline layout not known: {p['why']}"]
    dp, pp, v = p["grid"]["dp"], p["grid"]["pp"], p["stages_per_rank"]
    pipes = "; ".join(f"pipeline {d}: ranks {_ranges(ranks)}" for d, ranks in enumerate(p["pipelines"]))
    lines = [
        f"pipeline layout: {dp} x {pp} ranks (data x pipeline; {pipes}), {len(p['stages'])} stages, "
        f"{v} per rank ({'pipeline rank i holds stages i, i + ' + str(pp) + ', ...' if v > 1 else 'pipeline rank i holds stage i'}), "
        f"schedule {p['schedule']}, {p['microbatches']} microbatches; input [B, {p['input_width']}]",
        f"{'stage':<6} {'modules':>9} {'parameters':>12} {'output':>10}  ranks",
    ]
    for st in p["stages"]:
        a, b = st["modules"]
        mods = f"{a}" if b == a + 1 else f"{a}-{b - 1}"
        lines.append(
            f"{st['stage']:<6} {mods:>9} {st['parameters']:>12,} {'[b, ' + str(st['output_width']) + ']':>10}  "
            f"{','.join(map(str, st['ranks']))}"
        )
    return lines


def plan_coverage(job: Job) -> dict:
    """The plan's ``coverage``: ``conversion`` (the cache entry of the config's training data, or
    None), ``kind`` (``data.categorical_mapping``), ``tables`` (per table, as the conversion
    counted it: ``recsys_dist.data.coverage``; None when not known) and ``why`` (not known)."""
    d = job.data
    out = {"conversion": None, "kind": d.categorical_mapping, "tables": None, "why": ""}
    if d.categorical_mapping == "managed":
        out["why"] = "data.categorical_mapping: managed (the managed-collision module gives ids rows while training)"
        return out
    entry, out["why"] = cached_conversion(d)
    if entry is not None:
        out["conversion"] = str(entry)
        try:
            manifest = json.loads((entry / MANIFEST_FILE).read_text())
        except (OSError, ValueError) as err:
            out["why"] = f"{entry / MANIFEST_FILE} is unreadable ({err})"
            return out
        out["tables"] = table_coverage(manifest) if isinstance(manifest, dict) else None
        if out["tables"] is None:
            out["why"] = f"the conversion in {entry} was written before coverage was counted (delete it to count)"
    return out


def _coverage_text(c: dict) -> list[str]:
    head = "training values with a table row of their own"
    if c["tables"] is None:
        return [f"{head}: not known: {c['why']}"]
    notes = [
        f"{head} (from {c['conversion']}; ! = more than {WARN_ABOVE[c['kind']]:.0%} without one):",
        *coverage_lines(c["kind"], c["tables"]),
    ]
    if c["kind"] == "hash":
        notes.append("(hash: ~ = expected under uniform hashing, docs/data.md)")
    return notes


def _ranges(ranks: list[int]) -> str:
    out, start = [], None
    for i, r in enumerate(ranks):
        if start is None:
            start = r
        if i + 1 == len(ranks) or ranks[i + 1] != r + 1:
            out.append(f"{start}" if start == r else f"{start}-{r}")
            start = None
    return ",".join(out)


def table_bytes(job: Job) -> dict[str, int]:
    """fp32 weights plus optimizer state of each table, in bytes."""
    state = _STATE_FLOATS[job.train.embedding_optimizer]
    out = {}
    for t in job.features.planned_tables():
        per_row = t.embedding_dim * 4 + (4 if state is None else state * t.embedding_dim * 4)
        out[t.name] = t.num_embeddings * per_row
    return out


def dry_run(
    job: Job, world_size: int, local_world_size: int, device: str, problems: list[str] | None = None
) -> PlanReport:
    """Plan ``job``'s model for a topology without any process group: the same
    :func:`recsys_dist.train.build.plan_job` as the Trainer's, on a simulated world (so a
    ``sharding.fixed_plan`` is honoured as in training; no planner runs then, so the memory per
    rank is its fp32 weights, without optimizer state, and the cost 0). ``problems``: the caller's own
    refusals of this config on ``device`` (the CLI passes ``train.pipeline``'s), reported with
    ``sharding.comms``'s.

    Raises:
        PlanError: the planner found no placement that fits (names the largest tables, the
            memory they need against what the topology has, and what to change), or the
            placement has column shards FBGEMM cannot run.
        ConfigError: ``problems``, or ``sharding.comms`` cannot run on ``device``; the model
            holds an embedding module no sharder covers; the rules of
            ``recsys_dist.distributed.rules.plan_problems`` (``per_table`` naming an unknown
            table, a fixed plan not placing exactly the tables, ...).
    """
    # Before building anything: refused as recsys-dist train refuses it.
    problems = list(problems or []) + comms_problems(job.sharding.comms, device, world_size)
    if problems:
        raise ConfigError("invalid config:\n" + "\n".join(f"  {p}" for p in problems))
    model = build_model(
        job.model,
        job.features.on(torch.device("meta")),
        job.train,
        remap=managed_remap(job, job.features.on(torch.device("meta"))),
    )
    dense_bytes = ledgers.dense_bytes_of(model, job.distributed.dense.strategy, world_size)
    pipeline = _pipeline(job, model, world_size)  # before the tables' optimizer is fused in
    fuse_embedding_optimizer(
        model, job.train.embedding_optimizer, job.train.embedding_lr, job.train.embedding_weight_decay
    )
    try:
        check_covered(model)
    except ValueError as err:  # the model's, as recsys-dist train reports it (preflight.coverage_problems)
        raise ConfigError(f"invalid config:\n  model.name: {job.model.name}: {err}") from None
    chosen = ChosenOptions()
    try:
        plan = plan_job(job, model, World(world_size, local_world_size, device), stats=[chosen])
    except PlannerError as err:
        raise PlanError(_explain(job, world_size, local_world_size, device, err)) from None
    except ConfigError:
        raise
    except ValueError as err:  # a placement FBGEMM cannot run (column shard widths, ...)
        raise PlanError(str(err)) from None
    tables = model_tables(model)
    summary = plan_summary(plan, tables)
    group = World(world_size, local_world_size, device).sharding_group(job.sharding.replica_groups)  # the plan's
    placements = [
        TablePlacement(r["table"], r["sharding_type"], r["compute_kernel"], r["ranks"] or list(range(group.size)))
        for r in summary
    ]
    zeros = [0.0] * group.size
    ledger = _ledger(job, model, plan, tables, group, dense_bytes, world_size)
    report = PlanReport(
        group.size, group.local_size, device, placements, list(zeros), list(zeros), list(zeros), ledger, plan
    )
    report.replica_groups = job.sharding.replica_groups
    report.coverage = plan_coverage(job)
    strategy, optimizer = job.distributed.dense.strategy, job.train.dense_optimizer
    report.dense = {
        "strategy": strategy,
        "optimizer": optimizer,
        "per_rank": planned_dense_bytes(model, strategy, world_size, optimizer),
    }
    if pipeline is not None:
        _add_pipeline(report, *pipeline)
    _add_rank_memory(report, summary if job.sharding.fixed_plan is not None else None, chosen)
    return report


def _add_rank_memory(report: PlanReport, fixed: list[dict] | None, chosen: ChosenOptions) -> None:
    """Each rank's memory (GB) and cost (ms) in ``report``: the planner's chosen shards, or
    with a fixed plan (``fixed``: its summary rows; no planner ran) the weights each rank holds."""
    memory = report.hbm_gb if report.device == "cuda" else report.ddr_gb
    for row in fixed or []:
        for rank, size in row["rank_bytes"].items():
            memory[int(rank)] += size / GB
    for option in chosen.options:
        for shard in option.shards:
            if shard.rank is None:
                continue
            report.hbm_gb[shard.rank] += shard.storage.hbm / GB
            report.ddr_gb[shard.rank] += shard.storage.ddr / GB
            report.cost_ms[shard.rank] += shard.perf.total


def _pipeline(job: Job, model, world_size: int):
    """Under ``distributed.dense.strategy: pipeline``, (its layout or None, why not), else None."""
    if job.distributed.dense.strategy != "pipeline":
        return None
    d, f = job.distributed.dense, job.features
    return pipeline_layout(model, d, world_size, f.num_dense, list(f.keys), job.sharding.replica_groups)


def _add_pipeline(report: PlanReport, layout, why: str) -> None:
    """The pipeline's layout into ``report.dense`` and its bytes into ``report.ledger``; each
    rank's dense gradients are its own stages' (``_stage_bytes``)."""
    report.dense["pipeline"] = layout.to_dict() if layout is not None else {"why": why}
    if layout is not None:
        _stage_bytes(report.dense["per_rank"], layout)
    if layout is not None and report.world_size > 1 and report.ledger is not None:
        add_pipeline_flows(report.ledger, layout)


def _stage_bytes(per_rank: list[dict], layout) -> None:
    """Under pipeline, in place: a rank holds its own stages' tower parameters, their gradients
    and their optimizer state (the other stages' are freed: ``stages.free_other_stages``), and
    under 2bw also its stages' previous weights W(t-1). The tower is fp32 (4 bytes a parameter:
    mixed precision is refused under pipeline); the optimizer's state per element is the
    planned rows' (``train.dense_optimizer``'s)."""
    tower = sum(layout.parameters) * 4
    for rank, row in enumerate(per_rank):
        own = sum(n for k, n in enumerate(layout.parameters) if layout.owner(k) == layout.pipeline_rank(rank)) * 4
        state_per_byte = row["optimizer"] / row["parameters"] if row["parameters"] else 0
        for key in ("parameters", "gradients"):
            row[key] -= tower - own
        row["optimizer"] = round(row["parameters"] * state_per_byte)
        if layout.schedule == "2bw":
            row["parameters"] += own


def _ledger(job: Job, model, plan, tables, group: World, dense_bytes: tuple, world_size: int):
    """The bytes ledger of the plan (``recsys_dist.distributed.ledger.predict``, and
    ``replica_sync_flows`` under ``sharding.replica_groups``) on ``group``, the world the plan
    is for (one sharding group's); ``dense_bytes``: ``ledger.dense_bytes_of``'s (DDP's all-reduce
    bytes, FSDP's chunks per block), whose collectives run over the job's ``world_size`` ranks."""
    comms = job.sharding.comms
    ledger = ledgers.predict(
        plan,
        tables,
        group.size,
        job.sharding.planner_batch_size or job.train.batch_size,
        dense_bytes[0],
        ledgers.pooling_from_config(job.data, tables),
        comms.forward,
        comms.backward,
        group.local_size,
        ledgers.managed_features(model),
        dense_bytes[1],
        world_size,
    )
    ledger.unsized_multi_hot = ledgers.unsized_multi_hot(job.data)
    s = job.sharding
    if s.replicated:  # the replicas' sync, besides one group's all-to-alls
        ledgers.replica_sync_flows(
            ledger, plan, tables, s.replica_groups, s.replica_sync_every, job.train.embedding_optimizer
        )
    return ledger


def _explain(job: Job, world_size: int, local_world_size: int, device: str, err: PlannerError) -> str:
    topo = make_topology(job.sharding, world_size, local_world_size, device)
    cap_key = "hbm" if device == "cuda" else "ddr"
    per_rank = getattr(topo.devices[0].storage, cap_key)
    usable = per_rank * (1 - job.sharding.storage_reservation)
    sizes = table_bytes(job)
    total = sum(sizes.values())
    big = sorted(sizes.items(), key=lambda kv: -kv[1])
    too_big = [(n, b) for n, b in big if b > usable]
    listed = too_big or big[:5]
    names = ", ".join(f"{n} ({b / GB:.1f} GiB)" for n, b in listed)
    need_ranks = math.ceil(total / usable) if usable > 0 else 0
    mem = (
        f"{cap_key.upper()} {per_rank / GB:.0f} GiB per rank, {usable / GB:.1f} GiB usable after the "
        f"{job.sharding.storage_reservation:.0%} reservation"
    )
    fixes = [f"use at least {need_ranks} ranks (--world-size)"]
    if device == "cuda":
        fixes.append("allow sharding.compute_kernels: [fused, dense, fused_uvm_caching] to keep rows in host memory")
    fixes.append("or shrink data.num_embeddings of the largest tables")
    header = "tables that do not fit on one rank" if too_big else "largest tables"
    return (
        f"no sharding plan fits {world_size} rank(s) with {mem}: the tables need "
        f"{total / GB:.1f} GiB (fp32 weights + {job.train.embedding_optimizer} state) against "
        f"{world_size * usable / GB:.1f} GiB in all.\n"
        f"  {header}: {names}\n"
        f"  fix: " + "; ".join(fixes) + f"\n  (planner: {str(err).splitlines()[0][:300]})"
    )
