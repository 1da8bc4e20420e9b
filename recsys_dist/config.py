"""One typed config tree for a run, loaded strictly from YAML plus dotted overrides.

Every section is a pydantic model with ``extra="forbid"``: an unknown key, a wrong
type or an impossible value is a :class:`ConfigError` that names the dotted key, the
value given and what is allowed. All problems are reported together, and the whole
tree is validated before any process is spawned or any memory is allocated.

Relative paths written in a YAML file are resolved against the directory of that
file; relative paths given as command-line overrides are resolved against the
current working directory.

Example::

    cfg = load_config("configs/criteo_quickstart.yaml", ["train.batch_size=64"])
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, Strict, ValidationError, field_validator, model_validator

SHARDING_TYPES = (
    "data_parallel",
    "table_wise",
    "row_wise",
    "column_wise",
    "table_row_wise",
    "table_column_wise",
)
ShardingTypeName = Literal[
    "data_parallel", "table_wise", "row_wise", "column_wise", "table_row_wise", "table_column_wise"
]

# Config keys holding filesystem paths; resolved against the config file's directory.
PATH_KEYS = ("data.raw_path", "data.cache_dir", "data.split.validation_path", "data.split.test_path")


class ConfigError(ValueError):
    """A config file or override is invalid; the message lists every problem found."""


# A YAML list may fill a tuple field (strict mode wants a tuple), but its items stay strict.
_F = Annotated[float, Strict()]


def _too_big(value) -> bool:
    if isinstance(value, int) and not isinstance(value, bool):
        return not -(2**63) <= value < 2**63
    if isinstance(value, (list, tuple)):  # not into mappings: a section checks its own keys
        return any(_too_big(v) for v in value)
    return False


class _Section(BaseModel):
    # inf / nan are never a sensible size, rate or fraction: refuse them with the key's name.
    model_config = ConfigDict(extra="forbid", validate_default=True, allow_inf_nan=False, strict=True)

    @field_validator("*", mode="before")
    @classmethod
    def _fits_int64(cls, value):
        # torch takes sizes and seeds as int64: a larger int would pass here and fail deep in torch.
        if _too_big(value):
            raise ValueError("an integer here must lie within int64 (|x| < 2^63)")
        return value


class SchemaConfig(_Section):
    """Columns of a CSV / TSV / Parquet file for ``data.format: schema`` (see docs/data.md)."""

    label: str = Field(description="Label column: 0/1, or any number with label_threshold.")
    label_threshold: float | None = Field(
        None,
        description="label = 1 if the label column >= this, else 0 (e.g. 4.0 for ratings); "
        "None = the column must hold 0 or 1.",
    )
    dense: list[str] = Field(default_factory=list, description="Numeric feature columns (empty -> 0).")
    dense_transform: Literal["log1p", "none"] = Field(
        "log1p", description="Dense values as log1p(max(x, 0)) (log1p) or unchanged (none), as float32."
    )
    categorical: list[str] = Field(default_factory=list, description="One-value categorical columns (any text).")
    multi_hot: list[str] = Field(
        default_factory=list,
        description='List columns: text split on schema.separator ("a|b|c"), or a '
        "Parquet list column; each becomes a variable-length bag (list<int64>).",
    )
    separator: str = Field("|", min_length=1, description="Separator of the elements of a multi_hot text field.")
    file_type: Literal["auto", "csv", "parquet"] = Field(
        "auto", description="auto: Parquet if the file name ends in .parquet or .pq, else delimited text."
    )
    delimiter: str = Field(",", min_length=1, max_length=1, description="Field delimiter of text files (\\t for TSV).")
    header: bool = Field(True, description="The text file's first line names the columns.")
    columns: list[str] | None = Field(
        None, description="Names of every field in order (needed when header is false; replaces the header's names)."
    )

    @model_validator(mode="after")
    def _check(self) -> SchemaConfig:
        features = [*self.dense, *self.categorical, *self.multi_hot]
        dup = sorted({c for c in features if features.count(c) > 1})
        if dup:
            raise ValueError(f"data.schema: columns {dup} are listed more than once in dense / categorical / multi_hot")
        if self.label in features:
            raise ValueError(f"data.schema.label: {self.label!r} is also a feature column")
        if not self.categorical and not self.multi_hot:
            raise ValueError(
                "data.schema: needs at least one categorical or multi_hot column (one embedding table each)"
            )
        if not self.header and not self.columns:
            raise ValueError("data.schema.columns: must name every field when data.schema.header is false")
        return self


class SplitConfig(_Section):
    """How rows are split into train / validation / test (``recsys_dist.data.splits``)."""

    by: Literal["position", "random", "time", "files"] = Field(
        "position",
        description="position: fractions of rows in file order; random: each row by a seeded hash "
        "of its index; time: by split.column against split.thresholds; files: raw_path is train, "
        "split.validation_path and split.test_path the other splits.",
    )
    fractions: tuple[_F, _F, _F] = Field(
        (0.8, 0.1, 0.1), strict=False, description="position / random: train, validation, test fractions (sum 1)."
    )
    seed: int = Field(0, ge=0, description="random: seed of the row assignment.")
    column: str | None = Field(None, description="time: numeric raw column, e.g. Avazu hour (YYMMDDHH).")
    thresholds: tuple[_F, _F] | None = Field(
        None,
        strict=False,
        description="time: [validation_start, test_start]: value < first is train, < second validation, the rest test.",
    )
    validation_path: str | None = Field(None, description="files: raw validation file (relative to the config file).")
    test_path: str | None = Field(None, description="files: raw test file (relative to the config file).")

    @model_validator(mode="after")
    def _check(self) -> SplitConfig:
        f = self.fractions
        if any(x < 0 for x in f) or abs(sum(f) - 1.0) > 1e-6:
            raise ValueError(f"fractions must be three non-negative numbers summing to 1, got {list(f)}")
        if f[0] <= 0:
            raise ValueError("the train fraction (fractions[0]) must be > 0")
        if self.by == "time":
            if not self.column or self.thresholds is None:
                raise ValueError("by time needs column and thresholds [validation_start, test_start]")
            if self.thresholds[0] > self.thresholds[1]:
                raise ValueError(f"thresholds must be ascending, got {list(self.thresholds)}")
        if self.by == "files" and not (self.validation_path and self.test_path):
            raise ValueError("by files needs validation_path and test_path")
        for keys, by in ((("column", "thresholds"), "time"), (("validation_path", "test_path"), "files")):
            if self.by != by and any(getattr(self, k) is not None for k in keys):
                raise ValueError(f"{' and '.join(keys)} only apply to by: {by}, not by: {self.by}")
        return self


class DataConfig(_Section):
    format: Literal["criteo_tsv", "avazu_csv", "schema"] = Field(
        "criteo_tsv",
        description="Raw input format. criteo_tsv: label, I1..I13, C1..C26 tab-separated, "
        "empty field = missing (Criteo Kaggle / 1TB layout); avazu_csv: Avazu train.csv "
        "(23 categorical features, no dense); schema: any CSV / TSV / Parquet described by data.schema.",
    )
    schema_: SchemaConfig | None = Field(
        None,
        alias="schema",
        description="Columns of the raw file for format: schema (label, dense, categorical, "
        "multi_hot with a separator).",
    )
    raw_path: str | list[str] | None = Field(
        None,
        description="Raw labelled data file (relative to the config file); required to train. Under "
        "split.by: files it is the training data, and may be a list of files (e.g. Criteo 1TB's day_0 .. "
        "day_22): each is then converted in its own process, to its own Parquet file.",
    )
    cache_dir: str | None = Field(
        None,
        description="Where converted Parquet splits are cached. Default: $RECSYS_DIST_CACHE or ~/.cache/recsys_dist.",
    )
    num_rows: int | None = Field(
        None,
        gt=0,
        description="Read only the first N rows of raw_path (of each file under split.by: files; None = all).",
    )
    split: SplitConfig = Field(
        default_factory=SplitConfig,
        description="Train / validation / test split. Three fractions [0.8, 0.1, 0.1] are short for "
        "{by: position, fractions: [...]} (file order).",
    )
    categorical_mapping: Literal["hash", "vocabulary"] = Field(
        "hash",
        description="hash: id = 1 + key mod (num_embeddings - 1), stateless; vocabulary: the values "
        "seen >= data.min_count times in the training split get ids 2.., every other value the "
        "out-of-vocabulary id 1; the table size is then the vocabulary's (recorded in the manifest). "
        "0 is a missing value in both.",
    )
    min_count: int = Field(
        1, ge=1, description="vocabulary: keep a value seen at least this often in the training split."
    )
    num_embeddings: int | list[int] = Field(
        100_000,
        description="Rows per categorical table (one int for all, or one per feature of data.format). "
        "Row 0 is reserved for a missing value. hash: a present value maps to 1 + (key mod "
        "(num_embeddings - 1)); vocabulary: the largest table allowed (the most frequent values are kept).",
    )
    remainder: Literal["pad", "drop"] = Field(
        "pad",
        description="Training rows left over after the last full global batch: pad with "
        "zero-weight rows (never counted in loss or metrics) or drop them. "
        "Evaluation always pads, so every example is evaluated exactly once.",
    )
    on_bad_row: Literal["error", "skip"] = Field(
        "error",
        description="A malformed raw row stops the conversion naming file, line and column "
        "(error), or is left out and counted in the manifest (skip).",
    )
    row_group_size: int = Field(
        65536,
        gt=0,
        le=2**24,
        description="Rows per Parquet row group of the converted files (the unit the "
        "loader reads, and assigns to ranks under rank_reads: row_groups). Changing it converts again.",
    )
    shuffle: bool = Field(True, description="Shuffle training rows each epoch (seeded).")
    shuffle_buffer_rows: int = Field(
        1 << 20,
        gt=0,
        description="Rows read and shuffled together; bounds the loader's memory "
        "(row groups are also reordered each epoch when a split spans several windows).",
    )
    prefetch: int = Field(2, ge=0, description="Batches prepared ahead by a background thread (0 = off).")
    rank_reads: Literal["global_batch", "row_groups"] = Field(
        "global_batch",
        description="global_batch: every rank reads the whole stream and keeps its block of "
        "each global batch (global batches independent of the world size; reads grow with it). row_groups: "
        "each rank reads only its share of the row groups (balanced by rows), so reads per rank shrink, but "
        "the global batches then depend on the world size; ranks with fewer rows pad (or, under "
        "remainder: drop, all ranks stop at the smallest share).",
    )
    multi_hot_sizes: list[int] | None = Field(
        None,
        description="Typical ids per example for each categorical feature, given to the planner as pooling "
        "factors (e.g. MLPerf DLRMv2's multi-hot sizes). Planning only: multi-hot training data comes from "
        "data.schema.multi_hot columns, whose bags may have any length.",
    )

    model_config = ConfigDict(
        extra="forbid",
        validate_default=True,
        allow_inf_nan=False,
        strict=True,
        validate_by_name=True,
        validate_by_alias=True,
        serialize_by_alias=True,
    )

    @property
    def schema(self) -> SchemaConfig | None:
        """``data.schema`` (stored as ``schema_``: pydantic reserves the name)."""
        return self.schema_

    @model_validator(mode="before")
    @classmethod
    def _split_shorthand(cls, data: Any) -> Any:
        if isinstance(data, dict) and isinstance(data.get("split"), (list, tuple)):
            data = {**data, "split": {"fractions": data["split"]}}
        return data

    @model_validator(mode="after")
    def _check(self) -> DataConfig:
        from recsys_dist.data import raw_format

        if (self.format == "schema") != (self.schema_ is not None):
            raise ValueError(
                "data.schema: required with format: schema, and only used by it"
                if self.format == "schema"
                else f"data.schema: only used with format: schema, not {self.format}"
            )
        if isinstance(self.raw_path, list) and (self.split.by != "files" or not self.raw_path):
            raise ValueError(
                "data.raw_path: a list of files is the training data of split.by: files "
                f"(split.by is {self.split.by}); give one file"
                if self.raw_path
                else "data.raw_path: an empty list; give the raw data file(s)"
            )
        fmt = raw_format(self.format, self.schema_)
        n_features = len(fmt.sparse_names)
        if self.split.by == "time" and self.format != "schema" and self.split.column not in fmt.raw_columns:
            raise ValueError(
                f"data.split.column: {self.split.column!r} is not a raw column of {self.format} "
                f"({', '.join(fmt.raw_columns)})"
            )
        sizes = self.num_embeddings if isinstance(self.num_embeddings, list) else [self.num_embeddings]
        if isinstance(self.num_embeddings, list) and len(sizes) != n_features:
            raise ValueError(
                f"data.num_embeddings: expected one int or a list of {n_features} ({self.format} "
                f"features), got a list of {len(sizes)}"
            )
        if self.multi_hot_sizes is not None and (
            len(self.multi_hot_sizes) != n_features or any(h <= 0 for h in self.multi_hot_sizes)
        ):
            raise ValueError(f"data.multi_hot_sizes: expected {n_features} positive ints, got {self.multi_hot_sizes}")
        if any(n < 2 for n in sizes):
            raise ValueError(
                f"data.num_embeddings must be >= 2 (row 0 is reserved for missing values), got {self.num_embeddings}"
            )
        return self


class ModelConfig(_Section):
    name: Literal["dlrm", "dlrm_dcnv2", "dcnv2", "deepfm", "wide_deep", "xdeepfm"] = Field(
        "dlrm",
        description="dlrm: dot interaction (Naumov et al., 2019); dlrm_dcnv2: low-rank DCN-v2 cross "
        "network in place of the dot interaction (MLPerf DLRMv2); dcnv2: DCN-V2 (Wang et al., 2021); "
        "deepfm: DeepFM (Guo et al., 2017); wide_deep: Wide & Deep (Cheng et al., 2016); "
        "xdeepfm: xDeepFM with the Compressed Interaction Network (Lian et al., 2018).",
    )
    cin_layer_sizes: list[int] = Field([64, 64], description="xdeepfm: feature maps per CIN layer.")
    deep_layer_sizes: list[int] = Field(
        [256, 128], description="dcnv2 / deepfm / wide_deep / xdeepfm: hidden sizes of the deep MLP."
    )
    dcn_structure: Literal["stacked", "parallel"] = Field(
        "parallel", description="dcnv2: cross network then MLP (stacked) or side by side (parallel)."
    )
    cross_low_rank_dim: int | None = Field(
        None, gt=0, description="dcnv2: rank of each cross layer's weight (None = full rank)."
    )
    embedding_dim: int = Field(16, gt=0, description="Embedding dimension of every table.")
    dense_arch_layer_sizes: list[int] = Field(
        [64, 16], description="Bottom MLP sizes; the last must equal model.embedding_dim for dlrm."
    )
    over_arch_layer_sizes: list[int] = Field([64, 32, 1], description="Top MLP sizes; the last must be 1 (one logit).")
    dcn_num_layers: int = Field(3, gt=0, description="dlrm_dcnv2 / dcnv2: cross layers.")
    dcn_low_rank_dim: int = Field(512, gt=0, description="dlrm_dcnv2: rank of each cross layer's weight.")
    dropout: float = Field(0.0, ge=0, lt=1, description="dcnv2 / deepfm / wide_deep: dropout after each hidden layer.")
    norm: Literal["none", "batch", "layer"] = Field(
        "none", description="dcnv2 / deepfm / wide_deep: normalisation after each hidden linear layer."
    )
    activation: Literal["relu", "gelu", "silu"] = Field(
        "relu", description="dcnv2 / deepfm / wide_deep: activation of the hidden layers."
    )
    mlp_init_std: float | None = Field(
        None,
        gt=0,
        description="dcnv2 / deepfm / wide_deep / xdeepfm: the deep MLP's hidden weights (and the "
        "linear part's dense weights) start normal(0, std), as DeepCTR-Torch does with 1e-4; None = "
        "PyTorch's default (Kaiming uniform).",
    )
    embedding_init_scale: float | None = Field(
        0.05,
        gt=0,
        description="Embeddings start uniform in [-scale, scale]. None = TorchRec's default "
        "uniform(+-sqrt(1/num_embeddings)), which is tiny for large tables.",
    )

    @model_validator(mode="after")
    def _check(self) -> ModelConfig:
        for key in ("dense_arch_layer_sizes", "over_arch_layer_sizes", "deep_layer_sizes", "cin_layer_sizes"):
            sizes = getattr(self, key)
            if not sizes or any(s <= 0 for s in sizes):
                raise ValueError(f"model.{key} must be a non-empty list of positive ints, got {sizes}")
        if self.name == "dlrm" and self.dense_arch_layer_sizes[-1] != self.embedding_dim:
            raise ValueError(
                f"model.dense_arch_layer_sizes[-1] ({self.dense_arch_layer_sizes[-1]}) must equal "
                f"model.embedding_dim ({self.embedding_dim}) for dlrm's dot interaction"
            )
        if self.over_arch_layer_sizes[-1] != 1:
            raise ValueError(
                f"model.over_arch_layer_sizes[-1] must be 1 (one logit), got {self.over_arch_layer_sizes[-1]}"
            )
        return self


class TrainConfig(_Section):
    batch_size: int = Field(128, gt=0, le=2**24, description="Examples per rank per step.")
    epochs: int = Field(1, gt=0, description="Passes over the training split.")
    max_steps: int | None = Field(None, gt=0, description="Stop after this many steps (None = no cap).")
    seed: int = Field(0, ge=0, description="Seed for weights and shuffling.")
    embedding_optimizer: Literal["exact_rowwise_adagrad", "exact_adagrad", "exact_sgd", "adam"] = Field(
        "exact_rowwise_adagrad",
        description="Fused (in backward) FBGEMM optimizer of the embedding tables.",
    )
    embedding_lr: float = Field(0.05, gt=0, description="Learning rate of the embedding optimizer.")
    dense_optimizer: Literal["sgd", "adagrad", "adam", "adamw"] = Field(
        "adagrad", description="Optimizer of the dense (data-parallel) parameters."
    )
    dense_lr: float = Field(0.05, gt=0, description="Learning rate of the dense optimizer.")
    warmup_steps: int = Field(0, ge=0, description="Linear learning-rate warmup over N steps (0 = none).")
    decay_start_step: int | None = Field(
        None, ge=0, description="Start of the polynomial (squared) learning-rate decay, as in MLPerf DLRMv2."
    )
    decay_steps: int = Field(0, ge=0, description="Length of the decay in steps (0 = no decay).")
    embedding_weight_decay: float = Field(
        0.0, ge=0, description="L2 regularisation of the embedding rows, applied by the fused optimizer."
    )
    precision: Literal["fp32", "bf16-mixed"] = Field(
        "fp32",
        description="bf16-mixed: the model's forward runs under torch.autocast(bfloat16), so the dense "
        "tower's matmuls run in bfloat16; weights, their gradients, optimizer state, embedding tables, "
        "logits and the loss stay float32. The DeepFM MLP step ran 2.3x faster on a 2-core avx512_bf16 "
        "CPU (docs/benchmarks.md).",
    )
    dense_grad_clip_norm: float | None = Field(
        None, gt=0, description="Clip the dense tower's gradient to this global L2 norm (None = off)."
    )
    log_every_n_steps: int = Field(20, gt=0, description="Write a train line to metrics.jsonl every N steps.")
    deterministic: bool = Field(False, description="torch.use_deterministic_algorithms for exact reruns.")
    timing_every_n_steps: int | None = Field(
        50,
        gt=0,
        description="Profile one step in N for the data / input_dist / forward / backward / "
        "optimizer breakdown written on train lines (None = off).",
    )
    progress_bar: bool = Field(True, description="tqdm progress bar on rank 0 (false = quiet).")


class DistributedConfig(_Section):
    nproc_per_node: int = Field(1, gt=0, description="Ranks to launch on this node (ignored under torchrun).")
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="auto = cuda when available, else cpu.")
    max_restarts: int = Field(0, ge=0, description="Elastic agent restarts of the whole worker group.")
    cpu_threads_per_rank: int | None = Field(
        None,
        gt=0,
        description="CPU only: intra-op threads of each rank (torch.set_num_threads). None = this "
        "machine's cores divided among the ranks on it. 1 is safer when other jobs share the cores: an "
        "OpenMP barrier waits for a descheduled thread (docs/benchmarks.md measured 535 ms vs 3.3 ms steps).",
    )


ComputeKernelName = Literal["dense", "fused", "fused_uvm", "fused_uvm_caching"]
CUDA_ONLY_KERNELS = ("fused_uvm", "fused_uvm_caching")


class TableConstraint(_Section):
    sharding_types: list[ShardingTypeName] = Field(
        default_factory=list, description="Sharding types the planner may choose for this table."
    )
    compute_kernels: list[ComputeKernelName] = Field(
        default_factory=list, description="Compute kernels the planner may choose for this table."
    )
    pooling: Literal["sum", "mean"] | None = Field(None, description="Pooling of this table's bags.")


class FixedPlacement(_Section):
    sharding_type: ShardingTypeName = Field(description="How this table is sharded.")
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
        if self.sharding_type in ("table_wise", "column_wise", "table_row_wise") and not self.ranks:
            raise ValueError(f"{self.sharding_type} needs ranks, e.g. ranks: [0]")
        if self.sharding_type == "table_wise" and len(self.ranks or []) != 1:
            raise ValueError(f"table_wise needs exactly one rank, got {self.ranks}")
        if any(r < 0 for r in self.ranks or []):
            raise ValueError(f"ranks must be >= 0, got {self.ranks}")
        return self


class ShardingConfig(_Section):
    sharding_types: list[ShardingTypeName] = Field(
        default_factory=list,
        description="Sharding types allowed for every table (empty = all six).",
    )
    compute_kernels: list[ComputeKernelName] = Field(
        default_factory=lambda: ["fused", "dense"],
        description="Kernels allowed for every table: dense (data_parallel only), fused (FBGEMM "
        "table-batched, weights in device memory), and on CUDA fused_uvm (weights in host "
        "memory) and fused_uvm_caching (host memory with a device cache).",
    )
    pooling: Literal["sum", "mean"] = Field(
        "sum", description="How each table pools a bag of ids (multi-hot): sum or mean; mean of an empty bag is 0."
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


class CheckpointConfig(_Section):
    enabled: bool = Field(True, description="Save sharded checkpoints (torch.distributed.checkpoint).")
    every_n_steps: int | None = Field(
        None, gt=0, description="Also save every N training steps (None = only at the end)."
    )
    keep: int = Field(2, gt=0, description="Keep the newest N complete checkpoints; older ones are deleted.")


class EvalConfig(_Section):
    group_feature: str | None = Field(
        None,
        pattern=r"^C([1-9]|1[0-9]|2[0-6])$",
        description="Also report GAUC: AUC per value of this one-hot categorical feature (e.g. C1), "
        "averaged weighted by rows; exact evaluation only (not with auc_buckets).",
    )
    auc_buckets: int | None = Field(
        None,
        ge=2,
        description="None = exact AUC (gathers every prediction); N = streaming histogram "
        "AUC with N buckets, memory independent of the eval set size (error bound reported).",
    )
    batch_size: int | None = Field(
        None, gt=0, le=2**24, description="Examples per rank per eval step (None = train.batch_size)."
    )
    every_n_steps: int | None = Field(
        None, gt=0, description="Also evaluate on validation every N training steps (None = epoch ends only)."
    )


class RunConfig(_Section):
    data: DataConfig
    model: ModelConfig = Field(default_factory=ModelConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    distributed: DistributedConfig = Field(default_factory=DistributedConfig)
    sharding: ShardingConfig = Field(default_factory=ShardingConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump(mode="json")


def _set_dotted(tree: dict, key: str, value: Any) -> None:
    node = tree
    parts = key.split(".")
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"override {key}: '{part}' is a value, not a section")
        node = child
    node[parts[-1]] = value


def _get_dotted(tree: dict, key: str) -> Any:
    node: Any = tree
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


def _resolve_paths(tree: dict, base: Path, keys: tuple[str, ...] = PATH_KEYS) -> None:
    def resolve(value):
        if isinstance(value, str) and value and not os.path.isabs(os.path.expanduser(value)):
            return str((base / value).resolve())
        return value

    for key in keys:
        value = _get_dotted(tree, key)
        if isinstance(value, list):
            _set_dotted(tree, key, [resolve(v) for v in value])
        elif isinstance(value, str):
            _set_dotted(tree, key, resolve(value))


class _YamlLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` with YAML 1.2's numbers and no duplicate keys.

    YAML 1.1 (PyYAML's default) reads ``1e-3`` as a string, ``010`` as 8 (octal), ``1:04``
    as 64 (base 60) and ``0b11`` as 3; here a number is decimal: ``[-+]digits`` is an int,
    with a fraction and/or an exponent (``1.5``, ``.5``, ``1e-3``, ``.5e3``) a float, ``_``
    allowed between digits. A key given twice in one mapping is an error (YAML 1.1 keeps the
    last silently); merge keys (``<<: *defaults``) still work, and their keys may be
    overridden.
    """


_INT_TAG, _FLOAT_TAG = "tag:yaml.org,2002:int", "tag:yaml.org,2002:float"
_YamlLoader.yaml_implicit_resolvers = {
    first: [(tag, rx) for tag, rx in resolvers if tag not in (_INT_TAG, _FLOAT_TAG)]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_YamlLoader.add_implicit_resolver(_INT_TAG, re.compile(r"^[-+]?[0-9][0-9_]*$"), list("-+0123456789"))
_YamlLoader.add_implicit_resolver(
    _FLOAT_TAG,
    re.compile(
        r"^(?:[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)?"
        r"|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$"
    ),
    list("-+0123456789."),
)


def _decimal_int(loader: _YamlLoader, node: yaml.ScalarNode) -> int:
    return int(loader.construct_scalar(node).replace("_", ""), 10)


_YamlLoader.add_constructor(_INT_TAG, _decimal_int)


def _mapping_without_duplicates(loader: _YamlLoader, node: yaml.MappingNode, deep: bool = False) -> dict:
    seen: dict = {}
    for key_node, _ in node.value:
        if key_node.tag == "tag:yaml.org,2002:merge":
            continue  # "<<": its keys are defaults the mapping's own keys may override
        if not isinstance(key_node, yaml.ScalarNode):
            raise yaml.constructor.ConstructorError(
                None,
                None,
                f"line {key_node.start_mark.line + 1}: a key must be a plain name, not a list or mapping",
                key_node.start_mark,
            )
        key = loader.construct_object(key_node, deep=deep)
        if key in seen:
            raise yaml.constructor.ConstructorError(
                None,
                None,
                f"key {key!r} on line {key_node.start_mark.line + 1} is given twice (also on line "
                f"{seen[key] + 1}); keep one",
                key_node.start_mark,
            )
        seen[key] = key_node.start_mark.line
    return loader.construct_mapping(node, deep=deep)


_YamlLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _mapping_without_duplicates)


def _yaml(text: str):
    return yaml.load(text, Loader=_YamlLoader)  # noqa: S506 - a SafeLoader subclass


def parse_overrides(overrides: list[str]) -> dict:
    """Turn ``["a.b=1", "c=[1,2]"]`` into a nested dict; values are parsed as YAML."""
    tree: dict = {}
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key or any(not p for p in key.split(".")):
            raise ConfigError(f"override '{item}': expected dotted.key=value, e.g. train.batch_size=256")
        try:
            value = _yaml(raw)
        except yaml.constructor.ConstructorError as err:  # parsed, but a key twice or a list as a key
            raise ConfigError(f"override '{item}': {err.problem}") from None
        except yaml.YAMLError as err:
            raise ConfigError(
                f"override '{item}': the value is not valid YAML ({getattr(err, 'problem', err)}); "
                f"if it is text, quote it, e.g. {key}='\"{raw}\"'"
            ) from None
        _set_dotted(tree, key.strip(), value)
    return tree


def _merge(base: dict, extra: dict) -> dict:
    out = dict(base)
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


def _format_errors(err: ValidationError, tree: dict, source: str, overridden: frozenset = frozenset()) -> str:
    lines = [f"invalid config {source}:"]
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"])
        msg = e["msg"].removeprefix("Value error, ")
        if e["type"] == "extra_forbidden":
            parent = loc.rpartition(".")[0]
            lines.append(f"  {loc}: unknown key (remove it, or check the spelling under '{parent or 'top level'}')")
        elif e["type"] == "missing":
            lines.append(f"  {loc}: required key is missing")
        elif e["type"] in ("value_error", "assertion_error"):
            lines.append(f"  {loc or 'config'}: {msg}")
        else:
            lines.append(f"  {loc}: {msg} (got {e.get('input')!r})")
        if any(loc == k or loc.startswith(k + ".") for k in overridden):
            lines[-1] += "; set on the command line, not in the file"
    return "\n".join(lines)


def config_from_dict(tree: dict, source: str = "<dict>", overridden: frozenset = frozenset()) -> RunConfig:
    """Validate a nested dict into a :class:`RunConfig`; raises :class:`ConfigError`.
    ``overridden``: dotted keys set by command-line overrides, named as such in errors."""
    try:
        return RunConfig.model_validate(tree)
    except ValidationError as err:
        raise ConfigError(_format_errors(err, tree, source, overridden)) from None


def load_config(path: str | os.PathLike, overrides: list[str] | None = None) -> RunConfig:
    """Load a YAML run config, apply dotted ``key=value`` overrides and validate it.

    Args:
        path: YAML file. Loaded with a ``yaml.SafeLoader`` (no object construction) that reads
            ``1e-3`` as a number and refuses a key given twice.
        overrides: e.g. ``["train.batch_size=64", "sharding.sharding_types=[row_wise]"]``.

    Raises:
        ConfigError: the file is missing or not a mapping, or any key is unknown,
            mistyped or out of range; every problem is listed in one message.
    """
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {path} {'is a directory' if path.is_dir() else 'does not exist'}")
    try:
        tree = _yaml(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as err:
        raise ConfigError(f"config file {path} is not valid YAML: {err}") from None
    except UnicodeDecodeError as err:
        raise ConfigError(f"config file {path} is not UTF-8 text (byte {err.start}); is it the right file?") from None
    if tree is None:  # an empty file: every required key is reported missing below
        tree = {}
    if not isinstance(tree, dict):
        raise ConfigError(
            f"config file {path} must hold a mapping of sections (data:, model:, ...), "
            f"got {type(tree).__name__} {tree!r:.40}"
        )
    _resolve_paths(tree, path.resolve().parent)
    extra = parse_overrides(overrides or [])
    _resolve_paths(extra, Path.cwd())
    keys = frozenset(o.partition("=")[0].strip() for o in overrides or [])
    return config_from_dict(_merge(tree, extra), str(path), keys)


def save_config(cfg: RunConfig, path: str | os.PathLike) -> None:
    """Write the resolved config (absolute paths, every default filled in) as YAML."""
    Path(path).write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))


def uvm_kernels(cfg: RunConfig) -> list[tuple[str, str]]:
    """(config key, kernel) for every CUDA-only compute kernel the config allows."""
    found = [("sharding.compute_kernels", k) for k in cfg.sharding.compute_kernels if k in CUDA_ONLY_KERNELS]
    for name, t in cfg.sharding.per_table.items():
        found += [
            (f"sharding.per_table.{name}.compute_kernels", k) for k in t.compute_kernels if k in CUDA_ONLY_KERNELS
        ]
    return found


def raw_paths(cfg: RunConfig) -> list[str]:
    """``data.raw_path`` as a list (empty when not set)."""
    r = cfg.data.raw_path
    return [] if r is None else list(r) if isinstance(r, list) else [r]


def describe_raw_path(raw: str | list[str] | None) -> str:
    """``data.raw_path`` for a message: the file, or "N training files (first .. last)"."""
    if isinstance(raw, list) and len(raw) > 1:
        return f"{len(raw)} training files ({Path(raw[0]).name} .. {Path(raw[-1]).name})"
    return str(raw[0] if isinstance(raw, list) else raw)


def check_before_launch(cfg: RunConfig, world_size: int | None = None) -> None:
    """Checks that need the filesystem or the machine, run before any rank is spawned.

    ``world_size`` is the job's size when known (under torchrun), else nproc_per_node.

    Raises:
        ConfigError: the data file is missing, or the device asked for is absent.
    """
    problems = []
    if cfg.data.raw_path is None:
        problems.append("  data.raw_path: not set; training needs a raw data file")
    for raw in raw_paths(cfg):
        if Path(raw).is_dir():
            problems.append(f"  data.raw_path: {raw} is a directory; give the raw data file")
        elif not Path(raw).is_file():
            problems.append(f"  data.raw_path: file {raw} does not exist (fix the path in the config)")
    for key in ("validation_path", "test_path"):
        p = getattr(cfg.data.split, key)
        if p is not None and not Path(p).is_file():
            problems.append(f"  data.split.{key}: file {p} does not exist (fix the path in the config)")
    from recsys_dist.data import feature_names
    from recsys_dist.models.build import table_names

    tables = table_names(cfg)
    if not feature_names(cfg)[0] and cfg.model.name in ("dlrm", "dlrm_dcnv2"):
        problems.append(
            f"  model.name: {cfg.model.name} needs dense features and {cfg.data.format} has none; "
            "use dcnv2, deepfm or wide_deep"
        )
    unknown = sorted(set(cfg.sharding.per_table) - set(tables))
    if unknown:
        problems.append(f"  sharding.per_table: unknown tables {unknown}; the tables are {tables[0]} .. {tables[-1]}")
    if cfg.eval.group_feature and cfg.eval.auc_buckets:
        problems.append(
            "  eval.group_feature: GAUC needs every prediction; it cannot be combined with eval.auc_buckets"
        )
    fixed = cfg.sharding.fixed_plan
    world = world_size if world_size is not None else cfg.distributed.nproc_per_node
    if fixed is not None:
        missing = [t for t in tables if t not in fixed]
        extra = sorted(set(fixed) - set(tables))
        if missing or extra:
            problems.append(
                f"  sharding.fixed_plan: must place exactly the model's tables {tables[0]} .. {tables[-1]} "
                f"(missing {missing}, unknown {extra})"
            )
        for name, fp in fixed.items():
            if any(r >= world for r in fp.ranks or []):
                problems.append(f"  sharding.fixed_plan.{name}.ranks: {fp.ranks} but the job has {world} rank(s)")
    if cfg.sharding.sharding_types == ["table_wise"] and world > len(tables) and fixed is None:
        problems.append(
            f"  distributed.nproc_per_node: {world} ranks but only {len(tables)} tables and "
            "sharding_types [table_wise]; allow row_wise or column_wise, or use fewer ranks"
        )
    only_dp = cfg.sharding.sharding_types == ["data_parallel"] and not cfg.sharding.per_table and fixed is None
    if cfg.model.embedding_dim % 4 and not only_dp:
        low = cfg.model.embedding_dim - cfg.model.embedding_dim % 4
        problems.append(
            f"  model.embedding_dim: {cfg.model.embedding_dim} is not a multiple of 4, which FBGEMM's fused "
            f"kernel needs for every local shard; use {low or 4} or {low + 4} (or sharding_types: [data_parallel])"
        )
    for key, types, kernels in [("sharding", cfg.sharding.sharding_types, cfg.sharding.compute_kernels)] + [
        (
            f"sharding.per_table.{n}",
            t.sharding_types or cfg.sharding.sharding_types,
            t.compute_kernels or cfg.sharding.compute_kernels,
        )
        for n, t in cfg.sharding.per_table.items()
    ]:
        if types == ["data_parallel"] and kernels and "dense" not in kernels:
            problems.append(f"  {key}.compute_kernels: data_parallel tables need the dense kernel; add dense")
        if types and "data_parallel" not in types and kernels == ["dense"]:
            problems.append(f"  {key}.compute_kernels: only data_parallel uses the dense kernel; add fused")
    import torch

    cuda = torch.cuda.is_available()
    if cfg.distributed.device == "cuda" and not cuda:
        problems.append("  distributed.device: 'cuda' asked for but no CUDA device is visible (use auto or cpu)")
    if cfg.distributed.device == "cpu" or not cuda:
        if cfg.train.embedding_optimizer == "adam" and cfg.sharding.sharding_types != ["data_parallel"]:
            problems.append(
                "  train.embedding_optimizer: FBGEMM's CPU kernels have no Adam for sharded tables; use "
                "exact_rowwise_adagrad, exact_adagrad or exact_sgd on CPU (or sharding.sharding_types: [data_parallel])"
            )
        problems += [f"  {key}: {k} needs a CUDA device; use fused on CPU" for key, k in uvm_kernels(cfg)]
    if problems:
        raise ConfigError("invalid config:\n" + "\n".join(problems))
