"""The ``publish:`` section of the run config (pydantic and ``config.base`` only).

Publishing turns the checkpoints of a run into numbered model versions that a scoring service
follows: a full export first, then deltas of the embedding rows that changed
(``recsys_dist.serve.publish``, docs/serving.md#publishing).
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from recsys_dist.config.base import Section


class PublishConfig(Section):
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
