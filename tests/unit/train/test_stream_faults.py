"""data.stream and publish under faults found by adversarial testing: each case a run killed
or fed bad input at one point, then resumed; what must hold afterwards (docs/online.md)."""

from __future__ import annotations

import json

import pytest

from recsys_dist.checkpoint.meta import CHECKPOINT_FORMAT
from recsys_dist.config.job import resolve_job
from recsys_dist.config.loader import load_config
from recsys_dist.errors import CheckpointError
from recsys_dist.train.preflight import check_resumable
from tests.conftest import QUICKSTART
from tests.unit.train.test_stream import CONFIG


def test_a_stream_checkpoint_is_not_resumed_by_a_batch_run_nor_the_reverse(tmp_path):
    """Refused before any rank (a batch run resumed a stream's checkpoint at step 10, trained
    nothing, exit 0, and saved a checkpoint of step 10 without the stream's position over it:
    the stream run could no longer resume)."""
    stream_job = resolve_job(load_config(CONFIG, [f"data.stream.path={tmp_path}"]))
    batch_job = resolve_job(load_config(QUICKSTART))
    for name, stream in (("s", {"consumed": ["a"], "current": None}), ("b", None)):
        (tmp_path / name).mkdir()
        meta = {"step": 10, "checkpoint_format": CHECKPOINT_FORMAT, **({"stream": stream} if stream else {})}
        (tmp_path / name / "meta.json").write_text(json.dumps(meta))
        (tmp_path / name / ".metadata").write_bytes(b"")
    with pytest.raises(CheckpointError, match="written by a run over data.stream, not data.raw_path; a run over"):
        check_resumable(batch_job, tmp_path / "s")
    with pytest.raises(CheckpointError, match="written by a run over data.raw_path, not data.stream; a stream run"):
        check_resumable(stream_job, tmp_path / "b")
