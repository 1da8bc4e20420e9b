"""The ``data:`` section: raw format, splits, categorical mapping, table sizes, pooling, loader.

Owned by ``recsys_dist.data``; composed into ``RunConfig`` by ``recsys_dist.config.run``."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import ConfigDict, Field, model_validator

from recsys_dist.data.split_config import SplitConfig, check_last_out
from recsys_dist.section import Section as _Section
from recsys_dist.section import StrictFloat as _F

Pooling = Literal["sum", "mean"]


class SequenceColumn(_Section):
    """One ``data.schema.sequence`` column: an ordered list, oldest first."""

    max_length: int = Field(gt=0, description="Keep the most recent (last) N elements of each row's list.")
    separator: str = Field("|", min_length=1, description='Separator of the elements of a text field ("a|b|c").')


class HistoryConfig(_Section):
    """``data.schema.history``: a user-history sequence derived from an interaction log."""

    name: str = Field("history", description="Name of the derived sequence feature (not a column of the file).")
    user: str = Field(description="User column: rows of the same value share a history.")
    item: str = Field(
        description="Item column: the ids that make up the history (hashed / looked up like a categorical)."
    )
    time: str = Field(
        description="Time column (numbers). A row's history holds the items of the same user's rows with a "
        "strictly smaller time, the most recent last; rows of one user must come in non-decreasing time order."
    )
    max_length: int = Field(gt=0, description="Keep the N most recent items of each history.")
    ties: Literal["exclude", "file_order"] = Field(
        "exclude",
        description="Rows of one user with equal times: exclude: they do not see each other (a row reads only "
        "strictly earlier times); file_order: a row reads every earlier row of its user in (time, file order), "
        "the order data.split.by: leave_last_out uses (which requires it).",
    )
    action: str | None = Field(None, description="Action column (the rating): derive <name>_action for hstu")
    action_values: Literal["numbers", "text"] = Field(
        "numbers",
        description="What the action column holds: numbers (a rating; any other non-empty value is an error "
        "naming the file, row and column, or a request's rows[i], HTTP 400); text: categorical strings "
        "(each value its own action; numbers still keyed by value). Only with action.",
    )
    times: bool = Field(False, description="Derive <name>_time, times before the row, for hstu's time bias")

    @model_validator(mode="after")
    def _check(self) -> HistoryConfig:
        if self.action_values != "numbers" and self.action is None:
            raise ValueError("action_values: only a history with an action column reads it (set action, or drop it)")
        return self


class TaskLabel(_Section):
    """One ``data.schema.labels`` task: its column, and how the column becomes the label."""

    column: str = Field(description="The raw column the task's label is read from.")
    kind: Literal["binary", "regression"] = Field(
        "binary",
        description="binary: the label is 0/1 (the column holds 0/1, or 1 if column >= threshold); "
        "regression: the column's value as float32 (a finite number).",
    )
    threshold: float | None = Field(
        None, description="binary only: label = 1 if the column >= this, else 0 (e.g. 4.0 for ratings)."
    )

    @model_validator(mode="after")
    def _check(self) -> TaskLabel:
        if self.kind == "regression" and self.threshold is not None:
            raise ValueError("threshold: only binary tasks take a threshold (a regression label is the value itself)")
        return self


class SchemaConfig(_Section):
    """Columns of a CSV / TSV / Parquet file for ``data.format: schema`` (see docs/data.md)."""

    label: str | None = Field(
        None, description="Label column of the one binary task: 0/1, or any number with label_threshold."
    )
    labels: dict[str, TaskLabel] = Field(
        default_factory=dict,
        description="Several tasks (name -> {column, kind: binary|regression, threshold}), in order; instead of "
        "label. The converted Parquet holds one float32 column 'label:<name>' per task (docs/data.md, 'Multi-task "
        "labels and sample weights').",
    )
    weight: str | None = Field(
        None,
        description="Sample-weight column: a finite number >= 0 per row (float32); it multiplies each row's "
        "loss and metric terms. None = every row weighs 1.",
    )
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
    separator: str = Field(
        "|",
        min_length=1,
        description="Separator of the elements of a multi_hot text field (the conversion warns when almost no "
        "value holds it but many hold another of , ; | space /).",
    )
    sequence: dict[str, SequenceColumn] = Field(
        default_factory=dict,
        description="Sequence columns (column -> {max_length, separator}): an ordered list (text split on the "
        "column's separator, or a Parquet list column), oldest first, truncated to its most recent max_length "
        "elements; each element mapped like a categorical value; one embedding per position (EmbeddingCollection).",
    )
    history: HistoryConfig | None = Field(
        None,
        description="Derive a user-history sequence feature from the log: per row, the items the same user "
        "interacted with strictly before it by the time column (docs/data.md, 'Sequence features and user histories').",
    )
    hex_categorical: list[str] = Field(
        default_factory=list,
        description="Categorical / multi_hot columns whose values are hex numbers of at most 8 digits, as "
        "Criteo's C1..C26: the key is the unsigned 32-bit value, as format: criteo_tsv reads it (so the same "
        "rows give the same ids by either route), not a hash of the text; a value that is not hex is a bad "
        "value (file, line, column).",
    )
    file_type: Literal["auto", "csv", "parquet"] = Field(
        "auto", description="auto: Parquet if the file name ends in .parquet or .pq, else delimited text."
    )
    delimiter: str = Field(",", min_length=1, max_length=1, description="Field delimiter of text files (\\t for TSV).")
    header: bool = Field(True, description="The text file's first line names the columns.")
    columns: list[str] | None = Field(
        None,
        description="Names of every field in order (needed when header is false; replaces the header's names). "
        "With columns, header must be given (false or true) for a text file, so that a headerless file's first "
        "row is never read as a header. A Parquet file's columns are named by its schema.",
    )

    @model_validator(mode="after")
    def _check(self) -> SchemaConfig:
        features = [*self.dense, *self.categorical, *self.multi_hot, *self.sequence]
        if self.history is not None:
            features.append(self.history.name)
        dup = sorted({c for c in features if features.count(c) > 1})
        if dup:
            raise ValueError(
                f"data.schema: columns {dup} are listed more than once in dense / categorical / multi_hot / "
                "sequence / history.name"
            )
        not_text = [c for c in self.hex_categorical if c in self.sequence]
        if not_text:
            raise ValueError(
                f"data.schema.hex_categorical: {not_text} are sequence columns; hex keys are for "
                "categorical and multi_hot columns"
            )
        if (self.label is None) == (not self.labels):
            raise ValueError("data.schema: set either label (one binary task) or labels (several tasks), not both")
        if self.label is not None and self.label in features:
            raise ValueError(f"data.schema.label: {self.label!r} is also a feature column")
        for name, task in self.labels.items():
            if task.column in features:
                raise ValueError(f"data.schema.labels.{name}.column: {task.column!r} is also a feature column")
            if not name or not name.replace("_", "").isalnum():
                raise ValueError(f"data.schema.labels: task name {name!r} must be letters, digits and '_'")
        if self.label_threshold is not None and self.label is None:
            raise ValueError("data.schema.label_threshold: goes with label; with labels set each task's threshold")
        if self.weight is not None and (self.weight in features or self.weight in self.label_columns()):
            raise ValueError(f"data.schema.weight: {self.weight!r} is also a feature or label column")
        not_categorical = [c for c in self.hex_categorical if c not in [*self.categorical, *self.multi_hot]]
        if not_categorical:
            raise ValueError(
                f"data.schema.hex_categorical: {not_categorical} are not categorical or multi_hot columns "
                f"(categorical: {self.categorical}, multi_hot: {self.multi_hot})"
            )
        if not self.categorical and not self.multi_hot:
            raise ValueError(
                "data.schema: needs at least one categorical or multi_hot column (one embedding table each)"
            )
        if not self.header and not self.columns:
            raise ValueError("data.schema.columns: must name every field when data.schema.header is false")
        return self

    def label_columns(self) -> list[str]:
        """The raw columns the labels are read from, in task order."""
        return [self.label] if self.label is not None else [t.column for t in self.labels.values()]

    def task_names(self) -> list[str]:
        """Task names in order: ``["label"]`` for the one-task ``label`` form."""
        return ["label"] if self.label is not None else list(self.labels)

    def task_kinds(self) -> list[str]:
        """``binary`` / ``regression`` per task, in order."""
        return ["binary"] if self.label is not None else [t.kind for t in self.labels.values()]


class StreamConfig(_Section):
    """``data.stream``: train continuously on partitions that land in a directory (docs/online.md)."""

    path: str = Field(
        description="Directory partitions land in (relative to the config file), e.g. written by a job that "
        "renames each finished file into place (day=.../hour=.../part.txt). Files are taken in name order "
        "(their path below this directory), each exactly once across restarts."
    )
    pattern: str = Field(
        "**/*",
        min_length=1,
        description="Glob (below path) of the partition files, in the format of data.format (e.g. '*.txt', "
        "'**/*.parquet'). Names starting with '.' or '_' (temporary files, _SUCCESS markers) are never taken.",
    )
    poll_seconds: _F = Field(
        5.0, gt=0, description="Seconds between two looks for a new partition when none is waiting."
    )
    stop_after_idle_seconds: _F | None = Field(
        None,
        ge=0,
        description="Stop (final checkpoint, summary) after this many seconds without a new partition; "
        "None = wait for new data forever (SIGTERM then stops the run cleanly after a checkpoint).",
    )
    progressive_validation: bool = Field(
        True,
        description="Score each partition before training on it (progressive validation) and write its "
        "metrics as a validation line naming the partition.",
    )
    min_file_age_seconds: _F = Field(
        2.0,
        ge=0,
        description="A file is taken once it has not been modified for this many seconds (its modification "
        "time against this machine's clock), so a file still being written in place is not read half-written; "
        "one whose size or modification time changed while it was read is taken again later. 0: take files at "
        "once (a producer that renames each finished file into place). Not used (an error) with data.stream.marker.",
    )
    marker: str | None = Field(
        None,
        description="Name of a file the producer writes into a partition's directory once every file there "
        "is complete (Hadoop / Spark's _SUCCESS): files are taken only from a directory that holds it. "
        "Starts with '_' or '.' (so it is never taken as data); None: no marker, min_file_age_seconds decides.",
    )

    histories: Literal["carry", "per_partition"] = Field(
        "carry",
        description="With data.schema.history: carry: each user's last max_length events (items, actions, "
        "times) are kept across partitions, so a row's history is what it would be if every partition trained "
        "so far and this one were one file in landing order (what a scoring request carries); the state is "
        "saved with each checkpoint (O(users x max_length)). A row earlier in time than its user's carried "
        "events quarantines its partition, naming the line. per_partition: each partition's histories start "
        "empty (a training / serving skew). per_partition is an error without data.schema.history.",
    )

    @model_validator(mode="after")
    def _check_marker(self) -> StreamConfig:
        m = self.marker
        if m is not None and (not m.startswith(("_", ".")) or "/" in m or m in (".", "..")):
            raise ValueError(
                f"marker: {m!r} must be a file name starting with '_' or '.' (e.g. _SUCCESS), which is never "
                "taken as a partition"
            )
        if m is not None and "min_file_age_seconds" in self.model_fields_set:
            raise ValueError("min_file_age_seconds: not used with marker (a file is taken once the marker is there)")
        return self


class ManagedConfig(_Section):
    """``data.managed``: TorchRec's MCH managed-collision module per table (docs/managed_collision.md)."""

    eviction: Literal["lfu", "lru", "distance_lfu", "ttl"] = Field(
        "lfu",
        description="Which ids keep their rows when the table is full: lfu (most counted), lru (most recently "
        "seen), distance_lfu (counts decayed by age). ttl is MPZCH's and refused: FBGEMM's CPU "
        "zero_collision_hash kernel only runs read-only (no training on CPU); for a TTL on any of the "
        "three, set ttl_steps.",
    )
    eviction_interval: int | None = Field(
        None,
        gt=0,
        description="Training steps between admission / eviction rounds (required): ids seen since the last "
        "round are counted and the best of them take rows; until then a new id reads the default row.",
    )
    admission_min_count: int = Field(
        1,
        ge=1,
        description="An id seen fewer times than this within one eviction interval is not admitted and keeps "
        "the default row (1 = every id may be admitted).",
    )
    ttl_steps: int | None = Field(
        None,
        gt=0,
        description="TTL eviction with any eviction policy: at each eviction round, an id not seen in the last "
        "ttl_steps training steps loses its row (later lookups of it read the default row; the row goes "
        "to the next admitted id). None: ids keep their rows until the policy evicts them.",
    )
    decay_exponent: _F = Field(
        1.0,
        gt=0,
        description="lru / distance_lfu: age decay exponent (TorchRec's); lfu has no decay, so another value "
        "than 1.0 is an error there.",
    )
    features: list[str] | None = Field(
        None,
        description="Managed tables for these categorical features only, the others mapped by "
        "data.categorical_mapping (hash or vocabulary; required there to use data.managed). Not used with "
        "categorical_mapping: managed, where every feature is managed.",
    )

    @model_validator(mode="after")
    def _check(self) -> ManagedConfig:
        if self.eviction == "ttl":
            raise ValueError(
                "data.managed.eviction: ttl needs TorchRec's MPZCH (HashZchManagedCollisionModule), whose "
                "FBGEMM CPU kernel (zero_collision_hash) only runs read-only, so it cannot train on CPU; use "
                "lfu, lru or distance_lfu, with data.managed.ttl_steps: N for TTL eviction (an id not seen "
                "in the last N training steps loses its row)"
            )
        if self.eviction_interval is None:
            raise ValueError("data.managed.eviction_interval: required (steps between eviction rounds), e.g. 1")
        # TorchRec's LFU_EvictionPolicy takes no decay; the key would be silently unused.
        if self.eviction == "lfu" and self.decay_exponent != 1.0:
            raise ValueError(
                f"data.managed.decay_exponent: {self.decay_exponent} is only used by eviction lru and distance_lfu "
                "(age decay); lfu ranks ids by their plain count: remove decay_exponent, or use eviction: "
                "distance_lfu"
            )
        return self


class DataConfig(_Section):
    format: str = Field(
        "criteo_tsv",
        description="Raw input format. criteo_tsv: label, I1..I13, C1..C26 tab-separated, "
        "empty field = missing (Criteo Kaggle / 1TB layout); avazu_csv: Avazu train.csv "
        "(23 categorical features, no dense); schema: any CSV / TSV / Parquet described by data.schema; "
        "or a format of your own: a name registered with recsys_dist.register_format, or its factory "
        "'package.module:factory' (docs/data.md).",
    )
    format_args: dict[str, Any] = Field(
        default_factory=dict,
        description="Keyword arguments of a format of your own (its factory's); the shipped formats take none.",
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
    stream: StreamConfig | None = Field(
        None,
        description="Train on partitions as they land in a directory instead of data.raw_path "
        "(online training, docs/online.md); None = train on data.raw_path.",
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
    categorical_mapping: Literal["hash", "vocabulary", "managed"] = Field(
        "hash",
        description="hash: id = 1 + key mod (num_embeddings - 1), stateless; vocabulary: the values "
        "seen >= data.min_count times in the training split get ids 2.., every other value the "
        "out-of-vocabulary id 1; the table size is then the vocabulary's (recorded in the manifest). "
        "0 is a missing value in both. managed: the loader feeds the 63-bit key itself (1 + key mod "
        "(2^63 - 2), missing = 0) and a managed-collision module (TorchRec MCH, data.managed) maps it to "
        "one of num_embeddings rows while training (docs/managed_collision.md).",
    )
    managed: ManagedConfig | None = Field(
        None,
        description="categorical_mapping: managed: eviction policy, interval and admission threshold of "
        "the managed-collision tables (required with managed, and only used by it).",
    )
    min_count: int = Field(
        1,
        ge=1,
        description="vocabulary: keep a value seen at least this often in the training split (another value "
        "than 1 is an error under hash or managed mapping, which keep no vocabulary).",
    )
    num_embeddings: int | list[int] = Field(
        100_000,
        description="Rows per categorical table (one int for all, or one per feature of data.format). "
        "Row 0 is reserved for a missing value. hash: a present value maps to 1 + (key mod "
        "(num_embeddings - 1)); vocabulary: the largest table allowed (the most frequent values are kept). "
        "The conversion counts the share of training values each table gives a row of their own, warns "
        "about a table that leaves out more than 1% (vocabulary) or shares rows for more than 50% (hash), "
        "and suggests the size for 95% / 99% (docs/data.md, Coverage of the tables; recsys-dist plan).",
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
    short_lines: Literal["error", "pad"] = Field(
        "error",
        description="criteo_tsv: a line with fewer than 40 fields (an export that leaves out trailing empty "
        "fields, e.g. 37-39) is a bad line (error: see on_bad_row), or is read with its absent trailing "
        "fields as missing values (pad).",
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
    prefetch: int | None = Field(
        None,
        ge=0,
        description="Batches prepared ahead by background threads, handed over in blocks of up to 64 "
        "(0 = off: read and gather in the training thread). null (default): 2 on CUDA or when the node "
        "has more cores than its ranks' intra-op threads, else 0 (ranks that take every core lose more "
        "CPU to the loader's threads than they gain).",
    )
    rank_reads: Literal["global_batch", "row_groups"] = Field(
        "global_batch",
        description="global_batch: every rank reads the whole stream and keeps its block of "
        "each global batch (global batches independent of the world size; reads grow with it). row_groups: "
        "each rank reads only its share of the row groups (balanced by rows), so reads per rank shrink, but "
        "the global batches then depend on the world size; ranks with fewer rows pad (or, under "
        "remainder: drop, all ranks stop at the smallest share).",
    )
    pooling: Pooling = Field(
        "sum", description="How every table pools a bag of ids (multi-hot): sum or mean; mean of an empty bag is 0."
    )
    feature_pooling: dict[str, Pooling] = Field(
        default_factory=dict,
        description="Pooling of single features, overriding data.pooling (e.g. {genres: mean}); the feature's "
        "first-order table, if the model has one, pools the same way.",
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
        # Checks that need the format object (feature names) are the data layer's:
        # recsys_dist.data.resolve.check_data, run by RunConfig on its data section.
        self._check_layout()
        check_last_out(self.split, self.schema_.history if self.schema_ is not None else None)
        return self

    def _check_layout(self) -> None:
        if self.short_lines == "pad" and self.format != "criteo_tsv":
            raise ValueError(f"data.short_lines: pad only applies to format: criteo_tsv, not {self.format}")
        if (self.format == "schema") != (self.schema_ is not None):
            raise ValueError(
                "data.schema: required with format: schema, and only used by it"
                if self.format == "schema"
                else f"data.schema: only used with format: schema, not {self.format}"
            )
        s = self.schema_
        if s is not None and s.columns and "header" not in s.model_fields_set:
            files = [*raw_paths(self), *(p for p in (self.split.validation_path, self.split.test_path) if p)]
            parquet = s.file_type == "parquet" or (
                s.file_type == "auto" and bool(files) and all(str(p).endswith((".parquet", ".pq")) for p in files)
            )
            if not parquet:
                # Under the default header: true a headerless file's first row would be lost as its header.
                raise ValueError(
                    "data.schema.header: must be given with data.schema.columns: false (the file has no "
                    "header line: every line is a row, its fields named by columns) or true (the first line "
                    "is a header line, skipped, its names replaced by columns)"
                )
        if self.stream is not None:
            self._check_stream()
        if isinstance(self.raw_path, list) and (self.split.by != "files" or not self.raw_path):
            raise ValueError(
                "data.raw_path: a list of files is the training data of split.by: files "
                f"(split.by is {self.split.by}); give one file"
                if self.raw_path
                else "data.raw_path: an empty list; give the raw data file(s)"
            )

    def _check_stream(self) -> None:
        if self.raw_path is not None:
            raise ValueError(
                "data.raw_path: not used with data.stream (the stream's partitions are the training data); "
                "remove one of them"
            )
        if self.split != SplitConfig():  # a saved config lists every key at its default
            raise ValueError(
                "data.split: not used with data.stream (every partition is trained on; with "
                "data.stream.progressive_validation each is scored first); remove it"
            )
        if self.num_rows is not None:
            raise ValueError("data.num_rows: not used with data.stream (every row of every partition is trained on)")
        if self.cache_dir is not None:
            raise ValueError(
                "data.cache_dir: not used with data.stream (partitions are converted into RUN_DIR/partitions and "
                "removed once trained); remove it"
            )
        if self.categorical_mapping == "vocabulary":
            raise ValueError(
                "data.categorical_mapping: vocabulary needs the whole training data up front; a stream uses hash "
                "or managed (new ids get rows as they come: docs/managed_collision.md)"
            )
        if self.remainder == "drop":
            raise ValueError(
                "data.remainder: drop would leave out each partition's last rows; a stream trains every row "
                "exactly once (pad)"
            )
        if self.stream.histories != "carry" and getattr(self.schema, "history", None) is None:
            raise ValueError(
                f"data.stream.histories: {self.stream.histories} is not used without data.schema.history (no "
                "user histories to derive); remove it"
            )


def raw_paths(d: DataConfig) -> list[str]:
    """``data.raw_path`` as a list (empty when not set)."""
    r = d.raw_path
    return [] if r is None else list(r) if isinstance(r, list) else [r]


def missing_data_files(d: DataConfig) -> list[str]:
    """``key: what is wrong`` for each data file the config names that is not a file
    (``data.raw_path``, ``data.split.validation_path`` / ``test_path``); empty when all are."""
    problems = []
    for raw in raw_paths(d):
        if Path(raw).is_dir():
            problems.append(f"data.raw_path: {raw} is a directory; give the raw data file")
        elif not Path(raw).is_file():
            problems.append(f"data.raw_path: file {raw} does not exist (fix the path in the config)")
    for key in ("validation_path", "test_path"):
        p = getattr(d.split, key)
        if p is not None and not Path(p).is_file():
            problems.append(f"data.split.{key}: file {p} does not exist (fix the path in the config)")
    return problems


def describe_raw_path(raw: str | list[str] | None) -> str:
    """``data.raw_path`` for a message: the file, or "N training files (first .. last)"."""
    if isinstance(raw, list) and len(raw) > 1:
        return f"{len(raw)} training files ({Path(raw[0]).name} .. {Path(raw[-1]).name})"
    return str(raw[0] if isinstance(raw, list) else raw)
