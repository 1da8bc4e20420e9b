"""The one call that trains a config: a :class:`~recsys_dist.train.trainer.Trainer` over
``data.raw_path``, or a :class:`~recsys_dist.train.stream.StreamTrainer` over ``data.stream``."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from recsys_dist.train.job import Job
from recsys_dist.train.stream import StreamTrainer
from recsys_dist.train.trainer import Callback, Trainer


def train(
    job: Job,
    run_dir: Path,
    profile_dir: Path | None = None,
    resume: Path | str | None = None,
    resume_on_new_data: bool = False,
    callbacks: Sequence[Callback] = (),
) -> dict:
    """Train and evaluate the resolved run ``job``; returns the summary (also in summary.json).

    ``fit()`` of a Trainer (a StreamTrainer when the config has ``data.stream``) in a ``with``
    block: the process group is destroyed at the end if this call created it. ``profile_dir``,
    ``resume``, ``resume_on_new_data`` and ``callbacks`` as for :class:`~recsys_dist.train.trainer.Trainer`
    (``recsys-dist train`` gives the publishing one of ``publish:``, ``recsys_dist.serve.publish``).
    """
    trainer_class = StreamTrainer if job.data.stream is not None else Trainer
    with trainer_class(
        job,
        run_dir,
        resume=resume,
        profile_dir=profile_dir,
        resume_on_new_data=resume_on_new_data,
        callbacks=callbacks,
    ) as trainer:
        return trainer.fit()
