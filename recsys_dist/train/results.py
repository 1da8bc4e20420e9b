"""The types of what the Trainer returns, for type checkers and readers: ``Trainer.fit()``'s
summary (``summary.json``) and ``StreamTrainer.fit()``'s. (``Trainer.evaluate()`` returns
``dict[str, float]``: its metric names depend on the data and the model.)

The summaries are plain dicts at run time (``json.dumps`` writes them as they are); these
``TypedDict``\\s name every key they can hold and its type, so that mypy checks
``summary["test"]["auc"]`` and refuses a key that does not exist. tests/unit/test_noise.py checks that
the summaries the code builds hold no key these types do not name.
"""

from typing import TypedDict


class BestSummary(TypedDict):
    """``summary["best"]``: early stopping's or ``checkpoint.keep_best``'s tracker at the end."""

    metric: str  # the validation metric ranked by, e.g. "auc"
    value: float | None  # its best value (None: never defined)
    step: int | None  # the step of that value
    early_stopped: bool  # training stopped early
    checkpoint: str | None  # the best checkpoint kept (keep_best), else None


class FitSummary(TypedDict, total=False):
    """``Trainer.fit()``'s return value and ``summary.json``: the same on every rank (but the
    timings, each rank's own). Metrics are ``None`` where undefined.

    A run that trained has every key down to ``wall_split``, ``checkpoint`` with
    ``checkpoint.enabled`` and ``best`` with early stopping or ``checkpoint.keep_best``. A resume
    with nothing left to train returns the run's earlier ``summary.json`` (whatever it holds)
    with ``run_dir``, ``steps``, ``resumed_from`` and ``already_complete: True``.
    """

    run_dir: str
    world_size: int
    steps: int  # optimizer steps taken in all (a resumed run counts the earlier ones)
    rows_trained: int  # training rows (not padding) over every rank
    train_seconds: float  # seconds in training steps
    samples_per_s: float | None  # rows_trained / train_seconds
    resumed_at_step: int | None  # the checkpoint's step this run resumed from
    validation: dict[str, float | None]  # the last validation's auc, logloss, ne (...)
    test: dict[str, float | None]  # the test split's, after training (empty for a stream)
    wall_seconds: float  # this rank's wall time
    wall_split: dict[str, float]  # seconds per phase, adding up to wall_seconds
    checkpoint: str  # the final checkpoint (checkpoint.enabled)
    best: BestSummary  # with train.early_stopping or checkpoint.keep_best
    weights_step: int  # the step whose weights were scored (the best validation's when restored)
    resumed_from: str  # a resume with nothing left to train: the checkpoint ...
    already_complete: bool  # ... and True (nothing was trained or written)


class StreamSummary(FitSummary, total=False):
    """``StreamTrainer.fit()``'s return value: :class:`FitSummary` (``test`` empty) and the stream's end."""

    partitions: list[str]  # the partitions trained, in order
    quarantined: dict[str, str]  # partition -> why it was quarantined
    stopped: str | None  # "idle", "max_steps" or "SIGTERM"
    rows_skipped: int  # bad rows skipped (data.on_bad_row: skip) over every partition
    skipped: dict[str, int]  # partition -> its bad rows skipped
