"""The ``checkpoint:`` section of the run config (pydantic and ``section`` only)."""

from __future__ import annotations

from pydantic import Field

from recsys_dist.section import Section


class CheckpointConfig(Section):
    """The ``checkpoint:`` section."""

    enabled: bool = Field(True, description="Save sharded checkpoints (torch.distributed.checkpoint).")
    every_n_steps: int | None = Field(
        None, gt=0, description="Also save every N training steps (None = only at the end)."
    )
    keep: int = Field(
        2,
        gt=0,
        description="Keep the newest N complete checkpoints; older ones are deleted (except the best). After a "
        "resume from an older checkpoint, the later steps of the run it left are neither counted nor deleted.",
    )
    keep_best: bool = Field(
        False,
        description="Save a checkpoint at every validation that improves on the best so far (the metric of "
        "train.early_stopping, else AUC) and keep the best one as checkpoints/best, never deleted by `keep`; "
        "`best` then names it for --resume, export, evaluate and predict. train.early_stopping with restore_best "
        "(its default) keeps it too: the best weights are read back from it when training ends.",
    )
