"""The ``sharding:`` and ``distributed:`` config sections, and the names of the sharding types.

Schema only: pydantic, typing and ``section``, so loading a config loads no torch
(``tests/ranks/distributed/test_one_plan.py`` checks it). The rules these sections obey together
with a model or a world live in :mod:`recsys_dist.distributed.rules`.
"""

from __future__ import annotations

from typing import Literal, get_args

from pydantic import Field, model_validator

from recsys_dist.section import Section

# The one list of sharding type names (TorchRec's ShardingType values); every other list is derived.
ShardingType = Literal["data_parallel", "table_wise", "row_wise", "column_wise", "table_row_wise", "table_column_wise"]
SHARDING_TYPES: tuple[ShardingType, ...] = get_args(ShardingType)
# The sharding types TorchRec's EmbeddingCollectionSharder offers (on every device).
SEQUENCE_SHARDING_TYPES: tuple[ShardingType, ...] = ("data_parallel", "table_wise", "row_wise", "column_wise")
# Types that need the ranks of a fixed placement (table_wise: exactly one).
RANKED_TYPES: tuple[ShardingType, ...] = ("table_wise", "column_wise", "table_row_wise")

# The one list of dense-tower strategies (recsys_dist.distributed.dense holds one wrapper per name).
DenseStrategy = Literal["ddp", "fsdp", "pipeline"]
DENSE_STRATEGIES: tuple[DenseStrategy, ...] = get_args(DenseStrategy)
# distributed.dense.schedule: torch.distributed.pipelining's schedules (gpipe, 1f1b: one stage per
# rank; interleaved_1f1b, zero_bubble: distributed.dense.stages_per_rank stages per rank).
PipelineSchedule = Literal["gpipe", "1f1b", "interleaved_1f1b", "zero_bubble"]
# The schedules that run several (virtual) stages per rank, and their default stages per rank
# (torchtitan's: two per rank for its multi-stage schedules).
INTERLEAVED_SCHEDULES = ("interleaved_1f1b", "zero_bubble")
DEFAULT_STAGES_PER_RANK = 2
# The keys only strategy: pipeline reads.
PIPELINE_KEYS = ("stages", "schedule", "microbatches", "split", "stages_per_rank")

# 2bw: PipeDream-2BW's update rule (one version of delay) around 1F1B's order
# (recsys_dist.distributed.two_bw); its own name, so that the list above stays torch's.
PipelineSchedule = Literal[PipelineSchedule, "2bw"]

ComputeKernelName = Literal["dense", "fused", "fused_uvm", "fused_uvm_caching"]
CUDA_ONLY_KERNELS = ("fused_uvm", "fused_uvm_caching")
Precision = Literal["fp32", "fp16", "bf16"]

# ShardingConfig keys that only steer the planner: a fixed plan leaves them without effect.
PLANNER_KEYS = (
    "sharding_types",
    "compute_kernels",
    "planner_batch_size",
    "cache_load_factor",
    "per_table",
    "storage_reservation",
    "hbm_gb",
    "ddr_gb",
    "intra_node_bandwidth_gbps",
    "inter_node_bandwidth_gbps",
)
DEFAULT_PLANNER_BATCH_SIZE = 512


class TableConstraint(Section):
    sharding_types: list[ShardingType] = Field(
        default_factory=list, description="Sharding types the planner may choose for this table."
    )
    compute_kernels: list[ComputeKernelName] = Field(
        default_factory=list, description="Compute kernels the planner may choose for this table."
    )


class FixedPlacement(Section):
    sharding_type: ShardingType = Field(description="How this table is sharded.")
    ranks: list[int] | None = Field(
        None,
        description="table_wise: one rank; column_wise: the rank of each column shard (may repeat); "
        "row_wise / data_parallel: ignored (all ranks); table_row_wise: the ranks of one node.",
    )
    compute_kernel: ComputeKernelName | None = Field(
        None, description="None = dense for data_parallel, fused otherwise."
    )

    @model_validator(mode="after")
    def _check(self) -> FixedPlacement:
        if self.sharding_type == "table_column_wise":
            raise ValueError(
                "table_column_wise is not available in a fixed plan; use column_wise with ranks on one node"
            )
        if self.sharding_type in RANKED_TYPES and not self.ranks:
            raise ValueError(f"{self.sharding_type} needs ranks, e.g. ranks: [0]")
        if self.sharding_type == "table_wise" and len(self.ranks or []) != 1:
            raise ValueError(f"table_wise needs exactly one rank, got {self.ranks}")
        if any(r < 0 for r in self.ranks or []):
            raise ValueError(f"ranks must be >= 0, got {self.ranks}")
        return self


class CommsConfig(Section):
    """``sharding.comms``: element type of output_dist's pooled embeddings on the wire
    (TorchRec's QCommsConfig, encoded and decoded by FBGEMM's quantized-comm codecs around
    the all-to-all and the reduce-scatter; the lookup itself stays fp32)."""

    forward: Precision = Field("fp32", description="Pooled embeddings in output_dist's forward: fp32, fp16 or bf16.")
    backward: Precision = Field("fp32", description="Their gradients in output_dist's backward: fp32, fp16 or bf16.")


class ShardingConfig(Section):
    sharding_types: list[ShardingType] = Field(
        default_factory=list,
        description="Sharding types allowed for every table (empty = all six).",
    )
    compute_kernels: list[ComputeKernelName] = Field(
        default_factory=lambda: ["fused", "dense"],
        description="Kernels allowed for every table: dense (data_parallel only), fused (FBGEMM "
        "table-batched, weights in device memory), and on CUDA fused_uvm (weights in host "
        "memory) and fused_uvm_caching (host memory with a device cache).",
    )
    planner_batch_size: int | None = Field(
        None, gt=0, description="Per-rank batch size the planner's cost model assumes (None = train.batch_size)."
    )
    cache_load_factor: float | None = Field(
        None, gt=0, le=1, description="fused_uvm_caching: fraction of each table's rows cached on device."
    )
    per_table: dict[str, TableConstraint] = Field(
        default_factory=dict, description="Overrides by table name (t_<feature>, w_<feature> for first-order tables)."
    )
    storage_reservation: float = Field(
        0.15, ge=0, lt=1, description="Fraction of each rank's memory the planner keeps free."
    )
    fixed_plan: dict[str, FixedPlacement] | None = Field(
        None,
        description="Place every table by hand instead of planning (table -> sharding_type, ranks). "
        "`recsys-dist train --plan RUN_DIR/plan.json` fills it from an earlier run.",
    )
    hbm_gb: float | None = Field(None, gt=0, description="Device memory per rank in GB (None = TorchRec's 32 GB).")
    ddr_gb: float | None = Field(None, gt=0, description="Host memory per rank in GB (None = TorchRec's 128 GB).")
    intra_node_bandwidth_gbps: float | None = Field(
        None, gt=0, description="Bandwidth between ranks of one node in GB/s (None = TorchRec's 600)."
    )
    inter_node_bandwidth_gbps: float | None = Field(
        None, gt=0, description="Bandwidth between nodes per rank in GB/s (None = TorchRec's 12.5)."
    )
    comms: CommsConfig = Field(
        default_factory=CommsConfig,
        description="Quantized output_dist: fp16 / bf16 halve the bytes of the pooled embeddings "
        "(forward) and their gradients (backward); bf16 needs CUDA (NCCL), gloo carries fp16 only.",
    )
    replica_groups: int = Field(
        1,
        ge=1,
        description="2-D sparse parallelism (TorchRec's DMPCollection): the tables are planned for, and sharded "
        "within, groups of world / replica_groups ranks, and replicated across the replica_groups groups; the "
        "all-to-alls stay inside a group, and every replica_sync_every steps each shard is averaged with its "
        "replicas (all-reduce). 1 = one group of all ranks. Must divide the world size; the dense tower "
        "(ddp, fsdp, or pipeline with each pipeline inside a group: its stages must divide world / replica_groups) "
        "spans all ranks of the job; exact against 1 group with exact_sgd synced every step, close (not equal) "
        "with the Adagrads (docs/design/replica_groups.md).",
    )
    replica_sync_every: int = Field(
        1,
        ge=1,
        description="replica_groups > 1 only: average the replicas' table shards and their optimizer state "
        "every N training steps (and always before an evaluation, a checkpoint or the end of training). "
        "N > 1 is local SGD: the replicas drift apart between syncs.",
    )

    @model_validator(mode="after")
    def _replica_keys(self) -> ShardingConfig:
        if self.replica_groups == 1 and self.replica_sync_every != 1:
            raise ValueError(
                "replica_sync_every: only read with replica_groups > 1 (there are no replicas to sync); "
                "remove it or set replica_groups"
            )
        return self

    @property
    def replicated(self) -> bool:
        """Whether the tables are replicated across groups (``replica_groups`` > 1)."""
        return self.replica_groups > 1

    def allowed_types(self, table: str) -> list[ShardingType]:
        """The sharding types the planner may choose for ``table``: its ``per_table`` override,
        else ``sharding_types``, else all six."""
        override = self.per_table.get(table)
        return list((override and override.sharding_types) or self.sharding_types or SHARDING_TYPES)

    def types_key(self, table: str) -> str:
        """The dotted key that sets :meth:`allowed_types` of ``table`` (for messages)."""
        override = self.per_table.get(table)
        return (
            f"sharding.per_table.{table}.sharding_types"
            if override and override.sharding_types
            else "sharding.sharding_types"
        )


class DenseConfig(Section):
    """``distributed.dense``: how the dense tower (every module that is not an embedding table)
    is spread over the ranks while TorchRec shards the tables."""

    strategy: DenseStrategy = Field(
        "ddp",
        description="ddp: every rank holds the whole dense tower, its gradients and optimizer state "
        "(DistributedDataParallel all-reduces the gradients). fsdp: each dense block is sharded over the "
        "ranks with FSDP2 (torch.distributed.fsdp.fully_shard): every rank holds about 1/world of the dense "
        "parameters, gradients and optimizer state, and gathers a block's weights for its forward and "
        "backward. pipeline: the part after the pooled embeddings is cut into `stages` run by "
        "torch.distributed.pipelining, one stage per rank (stages_per_rank under the interleaved schedules; "
        "world / stages pipelines, data x pipeline; "
        "docs/design/pipeline.md); a rank holds only its own stages' parameters, gradients and optimizer state. "
        "The same losses every way (docs/sharding.md); checkpoints move between them.",
    )
    stages: int | None = Field(
        None,
        ge=2,
        description="pipeline only (required there): the ranks of one pipeline (torch's pp group size, "
        "torchtitan's pipeline_parallel_degree); each runs one stage, or stages_per_rank stages under the "
        "interleaved schedules. Must divide the world size (world / stages pipelines side by side, each on its "
        "share of the batch, their stages' gradients averaged: data x pipeline), under sharding.replica_groups "
        "a sharding group's ranks (each pipeline inside a group); stages x stages_per_rank must "
        "be at most the number of modules the model's tower is cut into.",
    )
    schedule: PipelineSchedule | None = Field(
        None,
        description="pipeline only: torch.distributed.pipelining schedule, gpipe (ScheduleGPipe: every "
        "microbatch's forward, then every backward), 1f1b (Schedule1F1B: fewer activations held), "
        "interleaved_1f1b (ScheduleInterleaved1F1B) or zero_bubble (ScheduleInterleavedZeroBubble, ZB1P: the "
        "weights' backward fills the bubble); the last two run stages_per_rank stages per rank, which "
        "shortens the bubble. None = 1f1b. "
        "2bw: PipeDream-2BW's weight update (W(t+1) = W(t) - lr * grad f(W(t-1)): each step's microbatches run "
        "1f1b's order on the stage weights of the step before, their gradient updates the current ones; two "
        "versions of each stage's weights held; the tables are not delayed), with a flush per step "
        "(docs/design/pipeline.md).",
    )
    microbatches: int | None = Field(
        None,
        gt=0,
        description="pipeline only: microbatches a pipeline's batch (train.batch_size x stages rows) is "
        "cut into per step; must divide it, be >= stages under 1f1b and 2bw, and under interleaved_1f1b / "
        "zero_bubble be a multiple of max(1, microbatches // stages) (torch's rounds: at most stages, or a "
        "multiple of microbatches // stages). None = stages.",
    )
    split: Literal["auto"] | list[int] | None = Field(
        None,
        description="pipeline only: where the tower is cut. auto (None): contiguous stages with the largest "
        "stage's parameter count as small as it can be; or the index of the first module of each stage after "
        "the first (stages x stages_per_rank - 1 increasing ints, `recsys-dist plan` lists the modules).",
    )
    stages_per_rank: int | None = Field(
        None,
        ge=1,
        description="pipeline with schedule interleaved_1f1b or zero_bubble only: stages each rank runs (torch's "
        "local stages, Megatron's virtual pipeline size). The tower is cut into stages x stages_per_rank stages; "
        "rank r of a pipeline holds stages r, r + stages, r + 2 x stages, ... (torch's loop placement). "
        "None = 2 under those schedules (torchtitan's default); an error under gpipe / 1f1b (one stage per rank).",
    )

    @model_validator(mode="after")
    def _pipeline_keys(self) -> DenseConfig:
        given = [k for k in PIPELINE_KEYS if getattr(self, k) is not None]
        if self.strategy != "pipeline" and given:
            raise ValueError(
                f"{', '.join(given)}: only strategy: pipeline reads {'it' if len(given) == 1 else 'them'}, "
                f"strategy is {self.strategy}; remove {'it' if len(given) == 1 else 'them'} or set strategy: pipeline"
            )
        if self.strategy == "pipeline" and self.stages is None:
            raise ValueError(
                "stages: strategy: pipeline needs the number of stages, the ranks of one pipeline (a divisor of "
                "the world size; under sharding.replica_groups N, of a sharding group's world / N ranks); set it, "
                "e.g. distributed.dense.stages=2 on 2 ranks"
            )
        if self.stages_per_rank is not None and self.pipeline_schedule not in INTERLEAVED_SCHEDULES:
            raise ValueError(
                f"stages_per_rank: only schedule {' or '.join(INTERLEAVED_SCHEDULES)} runs several stages per "
                f"rank, schedule is {self.pipeline_schedule}; remove stages_per_rank or set schedule: interleaved_1f1b"
            )
        return self

    @property
    def pipeline_stages_per_rank(self) -> int:
        """The stages each rank runs (``stages_per_rank``, or 2 under the interleaved schedules, else 1)."""
        if self.pipeline_schedule not in INTERLEAVED_SCHEDULES:
            return 1
        return self.stages_per_rank or DEFAULT_STAGES_PER_RANK

    @property
    def pipeline_virtual_stages(self) -> int:
        """The stages the tower is cut into: ``stages x`` :attr:`pipeline_stages_per_rank`."""
        return (self.stages or 1) * self.pipeline_stages_per_rank

    @property
    def pipeline_schedule(self) -> str:
        """The schedule name in effect (``schedule`` or its default, 1f1b)."""
        return self.schedule or "1f1b"

    @property
    def pipeline_microbatches(self) -> int:
        """The microbatches in effect (``microbatches`` or its default, ``stages``)."""
        return self.microbatches or self.stages or 1


class DistributedConfig(Section):
    """The ``distributed:`` section: ranks, device, restarts, CPU threads, the dense strategy."""

    nproc_per_node: int = Field(1, gt=0, description="Ranks to launch on this node (ignored under torchrun).")
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="auto = cuda when available, else cpu.")
    max_restarts: int = Field(0, ge=0, description="Elastic agent restarts of the whole worker group.")
    start_method: Literal["auto", "forkserver", "fork", "spawn"] = Field(
        "auto",
        description="How `recsys-dist train` starts its ranks on this node. forkserver: forked from one clean "
        "process that imported torch and torchrec once (about 3 CPU-seconds a launch); spawn: fresh interpreters "
        "(those imports in every rank); fork: forked from the launcher itself, the fastest start, but the launcher "
        "runs threads (the rendezvous store's, the data library's) and a fork that lands while one of them holds a "
        "lock can leave a rank stuck at its start (seen here: a rank waiting in the rendezvous store's connect "
        "until the 600 s timeout, once in about 270 launches under load, and once in a CI run). auto = forkserver on CPU, spawn on CUDA. fork with CUDA is an "
        "error (CUDA does not survive a fork).",
    )
    cpu_threads_per_rank: int | None = Field(
        None,
        gt=0,
        description="CPU only: intra-op threads of each rank (torch.set_num_threads). None = this "
        "machine's cores divided among the ranks on it. 1 is safer when other jobs share the cores (an "
        "OpenMP barrier waits for a descheduled thread).",
    )
    dense: DenseConfig = Field(
        default_factory=DenseConfig, description="How the dense tower is spread over the ranks (ddp, fsdp or pipeline)."
    )
