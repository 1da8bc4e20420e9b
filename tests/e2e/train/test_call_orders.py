"""The Trainer's methods called in unusual orders, one rank in this process: the numbers equal
those of the plain order (pinned when the Trainer was split into roles: data source, steps,
recorder, checkpointer, lease; the pre-split code gave the same)."""

from __future__ import annotations

import pytest
import torch

import recsys_dist
from tests.conftest import QUICKSTART

OVERRIDES = ["distributed.nproc_per_node=1", "train.batch_size=64", "data.num_rows=2000", "train.progress_bar=false"]


class RaiseAt(recsys_dist.Callback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, trainer, step, loss):
        if step == self.step:
            raise ValueError(f"user callback at step {step}")


def test_methods_in_unusual_orders_give_the_plain_numbers(tmp_path, cache_dir):
    cfg = recsys_dist.load_config(QUICKSTART, OVERRIDES)
    with recsys_dist.Trainer(cfg, tmp_path / "plain") as trainer:
        initial = trainer.evaluate()
        plain = trainer.fit()
    # evaluate / predict / save_checkpoint before fit, fit twice, close twice
    odd = recsys_dist.Trainer(cfg, tmp_path / "odd")
    assert odd.evaluate() == initial and odd.step == 0
    scores = odd.predict("validation")
    assert scores["probability"].shape == (initial["num_examples"],)
    assert odd.save_checkpoint().name == "step_00000000"
    first = odd.fit()
    again = odd.fit()  # nothing left: no step trained, the test split scored again
    assert odd.step == first["steps"] == again["steps"] == plain["steps"] == 25
    assert first["validation"] == plain["validation"] and first["test"] == again["test"] == plain["test"]
    odd.close()
    odd.close()
    with pytest.raises(RuntimeError, match="this Trainer is closed"):
        odd.predict()
    # A callback that raises: the Trainer is still usable for evaluate / save_checkpoint, and a
    # resume from that checkpoint ends with the uninterrupted run's numbers.
    broken = recsys_dist.Trainer(cfg, tmp_path / "raised", callbacks=[RaiseAt(5)])
    with pytest.raises(ValueError, match="user callback at step 5"):
        broken.fit()
    # fitting it again is refused (it used to train on and crash in validation, "Sizes of tensors must match")
    with pytest.raises(RuntimeError, match="fit\\(\\) failed at step 5; build a new Trainer with resume='auto'"):
        broken.fit()
    assert broken.step == 5 and broken.evaluate()["num_examples"] == initial["num_examples"]
    assert broken.save_checkpoint().name == "step_00000005"
    broken.close()
    with recsys_dist.Trainer(cfg, tmp_path / "raised", resume="auto") as resumed:
        assert resumed.resumed_at_step == 5
        summary = resumed.fit()
    assert summary["validation"] == plain["validation"] and summary["test"] == plain["test"]
    # resume="auto" into a finished run trains nothing and reports the run's numbers
    with recsys_dist.Trainer(cfg, tmp_path / "plain", resume="auto") as finished:
        done = finished.fit()
        assert finished.evaluate("test")["auc"] == pytest.approx(plain["test"]["auc"], abs=1e-12)
    assert done["already_complete"] and done["steps"] == 25 and done["test"] == plain["test"]
    assert torch.isfinite(scores["logit"]).all()


def test_the_trainer_sizes_the_jobs_tables_once(tmp_path, cache_dir, monkeypatch):
    """``recsys_dist.Trainer(cfg)`` builds the FeatureSpec twice: resolved from the config, then
    once with the sizes the conversion decided (vocabulary mapping), not again per consumer."""
    import recsys_dist.train.job as job_module

    calls = []
    real = job_module.feature_spec
    monkeypatch.setattr(job_module, "feature_spec", lambda *a, **k: calls.append(1) or real(*a, **k))
    cfg = recsys_dist.load_config(
        QUICKSTART,
        [*OVERRIDES, "train.max_steps=1", "data.categorical_mapping=vocabulary"],
    )
    with recsys_dist.Trainer(cfg, tmp_path / "run") as trainer:
        assert trainer.job.table_sizes == list(trainer.job.prepared.num_embeddings)
    assert len(calls) == 2, calls
