"""The ``train:``, ``eval:`` and ``publish:`` sections (owned by ``recsys_dist.train.trainer``; the
Trainer publishes through ``recsys_dist.serve.publish_callback.PublishCallback``): kept apart from the
trainer so that the config schema imports no training code.

Publishing turns the checkpoints of a run into numbered model versions that a scoring service
follows: a full export first, then deltas of the embedding rows that changed
(``recsys_dist.serve.publish``, docs/serving.md#publishing)."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any, Literal

from pydantic import Field, PositiveInt, ValidationInfo, model_validator

from recsys_dist.models.config import SHIPPED_LOSSES, LossParams, find_loss
from recsys_dist.section import Section as _Section
from recsys_dist.section import imports_user_code, is_import_path

# train.pipeline's names; recsys_dist.train.pipelines.PIPELINES holds one factory per name
# (torch lives there, not in a section config; tests/unit/train/test_pipeline_registry.py checks the two agree).
PipelineName = Literal["base", "sparse_dist", "semi_sync", "fused_sparse_dist"]


class EarlyStoppingConfig(_Section):
    """``train.early_stopping``: stop when the validation metric stops improving, then score the
    best validation weights."""

    metric: Literal["auc", "logloss", "ne"] = Field(
        "auc", description="Validation metric watched: auc (higher is better), logloss or ne (lower is better)."
    )
    patience: int = Field(
        3,
        gt=0,
        description="How long to go on without an improvement, in patience_unit: stop at the validation that "
        "makes this many validations in a row without one (validations), or that comes this many epochs / "
        "training rows after the best one (epochs, rows). A validation whose metric is undefined (null AUC of "
        "a one-class or empty split) neither improves nor stops the run.",
    )
    patience_unit: Literal["validations", "epochs", "rows"] = Field(
        "validations",
        description="The unit of patience. validations: validations in a row without an improvement (with "
        "eval.every_n_steps a fixed number of steps, whatever the data size). epochs: epochs of training since "
        "the best validation (steps per epoch of the training split). rows: training rows since the best "
        "validation, counted as steps x train.batch_size x ranks.",
    )
    min_delta: float = Field(
        0.0, ge=0, description="An improvement is a change in the better direction larger than this."
    )
    restore_best: bool = Field(
        True,
        description="When training ends, put back the weights of the best validation (the test split is "
        "scored, the final checkpoint saved and predict / export read with them; summary.json's weights_step "
        "names their step). With checkpoints on, the best weights are kept as checkpoints/best (as "
        "checkpoint.keep_best) and read back from it; with checkpoints off, as a copy in memory (one more copy "
        "of each rank's table shards and dense weights). false: keep the last weights.",
    )


class TrainConfig(_Section):
    """The ``train:`` section: batches, epochs, optimizers, schedule, loss, precision, logging."""

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
        0.0,
        ge=0,
        description="Weight decay of the embedding rows, applied by the embedding optimizer to the rows a step "
        "looks up only (lazy, as FBGEMM's sparse update: a row absent from a batch is not decayed). "
        "exact_rowwise_adagrad: L2, decay * w added to the row's gradient before the Adagrad step (as "
        "torch.optim.Adagrad's weight_decay); adam: decoupled, w -= lr * decay * w (as torch.optim.AdamW). "
        "exact_adagrad and exact_sgd have no weight decay in FBGEMM, and FBGEMM's CPU fused kernel none for "
        "sharded tables: a value > 0 is refused there; on CPU only data_parallel tables decay.",
    )
    precision: Literal["fp32", "bf16-mixed"] = Field(
        "fp32",
        description="bf16-mixed: the model's forward runs under torch.autocast(bfloat16), so the dense "
        "tower's matmuls run in bfloat16; weights, their gradients, optimizer state, embedding tables, "
        "logits and the loss stay float32.",
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
        "optimizer breakdown written on train lines (None = off). train.pipeline base: no input_dist "
        "part (its forward distributes the batch); semi_sync and fused_sparse_dist: no breakdown.",
    )
    progress_bar: bool = Field(True, description="tqdm progress bar on rank 0 (false = quiet).")
    pipeline: PipelineName = Field(
        "sparse_dist",
        description="TorchRec training pipeline: sparse_dist (TrainPipelineSparseDist: input_dist of batch "
        "i+1 overlaps batch i), base (TrainPipelineBase: no overlap), semi_sync (TrainPipelineSemiSync: "
        "batch i+1's embedding lookup runs before batch i's update, so it reads tables one update "
        "stale; CUDA only), fused_sparse_dist (TrainPipelineFusedSparseDist; CUDA only). See "
        "recsys_dist/train/pipelines.py.",
    )
    loss: str | dict[str, str] = Field(
        "bce",
        description="Training loss: bce (binary cross-entropy), focal (Lin et al., 2017), mse, a name given to "
        "recsys_dist.register_loss, or an import path 'package.module:fn' with fn(logits, labels, weights) -> "
        "scalar (docs/api.md). With several tasks (data.schema.labels): one loss for every task, or "
        "{task: loss}; a task not named (or the default) gets bce if binary, mse if regression.",
    )
    loss_args: dict[str, Any] = Field(
        default_factory=dict,
        description="Keyword arguments of the loss, e.g. {gamma: 2.0} for focal; with a loss per task, "
        "{task: {argument: value}}.",
    )
    loss_weights: dict[str, float] = Field(
        default_factory=dict,
        description="Several tasks: the weight w_t of each task's loss in the total sum_t w_t * loss_t "
        "(task -> number >= 0; a task not named weighs 1).",
    )
    early_stopping: EarlyStoppingConfig | None = Field(
        None,
        description="Stop training when the validation metric (scored after every epoch and every "
        "eval.every_n_steps) has not improved for `patience` (validations, epochs or rows), then score the best "
        "validation weights (restore_best); None = train every epoch and score the last weights.",
    )

    @model_validator(mode="after")
    def _check_weight_decay(self) -> TrainConfig:
        if self.embedding_weight_decay and self.embedding_optimizer in ("exact_adagrad", "exact_sgd"):
            # FBGEMM's kernels for these have no weight decay: it would be silently ignored.
            raise ValueError(
                f"train.embedding_weight_decay: {self.embedding_weight_decay} is not applied by "
                f"train.embedding_optimizer {self.embedding_optimizer} (FBGEMM's kernel has no weight decay); "
                "use exact_rowwise_adagrad or adam, or set train.embedding_weight_decay: 0"
            )
        return self

    @model_validator(mode="after")
    def _check_loss(self, info: ValidationInfo) -> TrainConfig:
        imports = imports_user_code(info)  # False: a loss named by import path is not imported
        problems = []
        if isinstance(self.loss, dict):
            extra = [k for k in self.loss_args if k not in self.loss]
            problems += [f"train.loss_args.{k}: not a task of train.loss ({sorted(self.loss)})" for k in extra]
            for task, name in self.loss.items():
                args = self.loss_args.get(task, {})
                if not isinstance(args, dict):
                    problems.append(f"train.loss_args.{task}: must be a mapping of arguments of {name}")
                    continue
                problems += _loss_problems(name, args, f"train.loss.{task}", f"train.loss_args.{task}", imports)
        else:
            problems += _loss_problems(self.loss, self.loss_args, "train.loss", "train.loss_args", imports)
        problems += [f"train.loss_weights.{k}: {w} must be >= 0" for k, w in self.loss_weights.items() if w < 0]
        if problems:
            raise ValueError("; ".join(problems))
        return self

    def total_steps(self, steps_per_epoch: int, offset: int = 0) -> int:
        """Steps a run trains in all: ``epochs`` epochs of ``steps_per_epoch``, capped by
        ``max_steps``; ``offset``: the step the data's epochs count from (a run resumed on new
        data, ``recsys_dist.checkpoint.run_dir.resume_position``)."""
        total = offset + self.epochs * steps_per_epoch
        return min(total, self.max_steps) if self.max_steps else total

    def task_losses(self, tasks: list[str], kinds: list[str]) -> list[tuple[str, dict, float]]:
        """(loss name, loss arguments, loss weight) per task, in task order (one task: ``train.loss``)."""
        explicit = "loss" in self.model_fields_set
        out = []
        for task, kind in zip(tasks, kinds):
            if isinstance(self.loss, dict):
                name = self.loss.get(task) or ("bce" if kind == "binary" else "mse")
                args = dict(self.loss_args.get(task, {}))
            elif explicit or kind == "binary":
                name, args = self.loss, dict(self.loss_args)
            else:
                name, args = ("bce" if kind == "binary" else "mse"), {}
            out.append((name, args, float(self.loss_weights.get(task, 1.0))))
        return out


def _loss_params(fn: Callable, name: str, key: str) -> LossParams | list[str]:
    """The keyword parameters of a user's loss ``fn``, from its signature, or its problems."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):  # a builtin or C callable: nothing to check
        return LossParams(takes_kwargs=True)
    if len(params) < 3 and not any(p.kind is p.VAR_POSITIONAL for p in params):
        return [f"{key}: {name} must take (logits, labels, weights), it takes {len(params)}"]
    given = tuple(getattr(fn, "model_outputs", ()))  # the model's outputs, not loss_args
    rest = [p for p in params[3:] if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.name not in given]
    return LossParams(
        required=tuple(p.name for p in rest if p.default is p.empty),
        optional=tuple(p.name for p in rest if p.default is not p.empty),
        model_outputs=given,
        takes_kwargs=any(p.kind is p.VAR_KEYWORD for p in params),
    )


def _loss_problems(name: str, args: dict, key: str, args_key: str, imports: bool = True) -> list[str]:
    # A shipped loss from the torch-free table; only a user's loss (registered, or an import
    # path, whose module is imported here unless not ``imports``) is read from its function.
    found = SHIPPED_LOSSES.get(name)
    if found is None and is_import_path(name) and not imports:
        return []
    if found is None:
        try:
            found = _loss_params(find_loss(name), name, key)
        except ValueError as err:
            return [str(err).replace("train.loss", key, 1)]
        if isinstance(found, list):
            return found
    given = set(found.model_outputs)
    rest = {*found.required, *found.optional}
    problems = [
        f"{args_key}.{k}: {name} reads {k!r} from the model's output, not from config" for k in args if k in given
    ]
    unknown = [k for k in args if k not in rest and not found.takes_kwargs]
    missing = [n for n in found.required if n not in args]
    problems += [
        f"{args_key}.{k}: {name} takes no argument {k!r} (it takes {sorted(rest)})" for k in unknown if k not in given
    ]
    problems += [f"{args_key}.{k}: required by {name}, missing" for k in missing]
    return problems


class EvalConfig(_Section):
    """The ``eval:`` section: how validation and test metrics are computed."""

    group_feature: str | None = Field(
        None,
        min_length=1,
        description="Also report GAUC: AUC per value of this one-hot categorical feature (e.g. C1 for Criteo, "
        "userId for MovieLens), averaged weighted by rows; exact evaluation only (not with auc_buckets).",
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
    retrieval_k: list[PositiveInt] | None = Field(
        None,
        min_length=1,
        description="Retrieval models: the K of recall@K and NDCG@K over the item corpus (two_tower, "
        "recsys_dist.models.retrieval) or of HR@K and NDCG@K of the next item (hstu_retrieval); None = [10, 50]. "
        "Not for other models.",
    )


class PublishConfig(_Section):
    """The ``publish:`` section; disabled by default, and then it takes no other key."""

    enabled: bool = Field(
        False,
        description="Publish model versions while training: after a checkpoint is saved, rank 0 writes a full "
        "export first, then deltas (docs/serving.md#publishing).",
    )
    dir: str | None = Field(
        None,
        description="Directory of the published versions and their manifest.json; None = RUN_DIR/publish; a "
        "relative path is relative to the run directory.",
    )
    every_n_steps: int | None = Field(
        None,
        gt=0,
        description="Publish at the checkpoint of every N training steps (checkpoint.every_n_steps must save "
        "there). Exactly one of every_n_steps / every_partition when enabled.",
    )
    every_partition: bool = Field(
        False,
        description="Publish after each partition of a streaming run (data.stream) is trained and checkpointed. "
        "Exactly one of every_n_steps / every_partition when enabled.",
    )
    full_every: int | None = Field(
        None,
        gt=0,
        description="Compaction: once N deltas follow the last full version, publish a full version instead of "
        "the next delta, so loading a version folds at most N deltas (docs/serving.md#publishing); None = never "
        "(one full version, then deltas only).",
    )
    overwrite: bool = Field(
        False,
        description="Let a run publish into a publish.dir that already holds another run's versions (a run from "
        "scratch finding any versions there; a resumed run finding versions its manifest says another run "
        "directory published): its first version, a full one, is numbered after them and replaces them (they "
        "move to dropped/). False: such a run is refused before it trains, naming the directory.",
    )
    format: Literal["safetensors", "torchscript"] = Field(
        "safetensors",
        description="What the full version and `recsys-dist export --from-publish` write (the formats of "
        "`recsys-dist export`); deltas are always safetensors.",
    )
    quantize: Literal["none", "int8", "int4"] = Field(
        "none",
        description="Embedding rows as published: fp32, or row-wise int8 / int4 with an fp16 scale and bias per "
        "row (FBGEMM, TorchRec's quantized EmbeddingBagCollection); dense layers stay fp32. Not with format "
        "torchscript.",
    )

    @model_validator(mode="after")
    def _check(self) -> PublishConfig:
        if not self.enabled:
            # a resolved config (config.yaml, meta.json) lists every key at its default: only other values count
            fields = type(self).model_fields
            given = sorted(k for k in self.model_fields_set - {"enabled"} if getattr(self, k) != fields[k].default)
            if given:
                # strict config: a key that would not be used is a mistake, not a no-op
                raise ValueError(
                    f"publish.{given[0]} is set but publish.enabled is false (keys {given} would be ignored); set "
                    "publish.enabled: true or remove them"
                )
            return self
        if (self.every_n_steps is None) == (not self.every_partition):
            raise ValueError(
                "publish: give exactly one of publish.every_n_steps: N or publish.every_partition: true (got "
                f"every_n_steps={self.every_n_steps}, every_partition={self.every_partition})"
            )
        if self.format == "torchscript" and self.quantize != "none":
            raise ValueError(
                f"publish.quantize: {self.quantize} cannot be written as TorchScript (the quantized embedding "
                "modules are not scriptable here); use publish.format: safetensors, or publish.quantize: none"
            )
        return self
