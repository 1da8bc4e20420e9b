"""The library API: ``recsys_dist.Trainer`` in a user's function, run on 2 ranks by
``recsys_dist.launch``, gives the numbers ``recsys-dist train`` gives for the same config."""

import os

import pytest

import recsys_dist
from recsys_dist.config import ConfigError
from recsys_dist.config.loader import load_config
from recsys_dist.errors import RunDirLocked
from recsys_dist.train.pipelines import PIPELINES
from tests.conftest import QUICKSTART

TOY = ["data.num_rows=2000", "train.max_steps=12", "train.log_every_n_steps=4", "train.progress_bar=false"]
LAUNCHER_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "TORCHELASTIC_RUN_ID")


def user_job(config: str, overrides: list, run_dir: str) -> dict:
    """What a user's script runs on every rank: build, fit, evaluate, predict, save."""
    import torch.distributed as dist

    with recsys_dist.Trainer(load_config(config, overrides), run_dir) as trainer:
        summary = trainer.fit()
        out = {
            "rank": trainer.ctx.rank,
            "world_size": trainer.ctx.world_size,
            "step": trainer.step,
            "summary": summary,
            "test": trainer.evaluate("test"),
            "validation": trainer.evaluate(),
            "predict_test": {k: v.tolist() for k, v in trainer.predict("test").items()},
            "predict_train_labels": trainer.predict("train")["label"].tolist(),
            "checkpoint": str(trainer.save_checkpoint()),
            "group_open_inside": dist.is_initialized(),
        }
    out["group_open_after"] = dist.is_initialized()
    trainer.close()  # idempotent
    # A second Trainer in the same ranks makes a new group (its first collective hung when the
    # new group read the closed group's addresses from the launcher's store).
    with recsys_dist.Trainer(load_config(config, overrides), run_dir + "_again") as again:
        out["again"] = again.fit()
    # A Trainer that fails on every rank leaves its group open (a peer could be inside a
    # collective); every rank reported the failure, so the next Trainer uses and closes it.
    try:
        with recsys_dist.Trainer(load_config(config, overrides), run_dir + "_failed"):
            raise KeyError("the user's code fails on every rank")
    except KeyError:
        out["open_after_failure"] = dist.is_initialized()
    with recsys_dist.Trainer(load_config(config, overrides), run_dir + "_after_failure") as after:
        out["after_failure"] = after.fit()
    out["open_at_end"] = dist.is_initialized()
    return out


def test_trainer_refuses_to_train_one_rank_of_several(tmp_path, monkeypatch):
    import torch.distributed as dist

    for name in LAUNCHER_ENV:
        monkeypatch.delenv(name, raising=False)
    cfg = load_config(QUICKSTART)  # distributed.nproc_per_node: 2
    with pytest.raises(ConfigError) as err:
        recsys_dist.Trainer(cfg, tmp_path / "run")
    msg = str(err.value)
    assert "distributed.nproc_per_node is 2" in msg and "train only one rank of 2" in msg
    assert "recsys_dist.launch(fn, 2)" in msg and "torchrun --nproc_per_node=2" in msg
    assert "recsys-dist train" in msg and "distributed.nproc_per_node=1" in msg
    assert not dist.is_initialized() and not (tmp_path / "run").exists()


@pytest.mark.parametrize("pipeline", [n for n, p in PIPELINES.items() if p.cuda_only])
def test_trainer_refuses_a_cuda_pipeline_on_cpu_before_touching_the_run_dir(tmp_path, monkeypatch, pipeline):
    # it was refused only at fit(), after config.yaml, plan and the ledger line were written
    import torch.distributed as dist

    for name in LAUNCHER_ENV:
        monkeypatch.delenv(name, raising=False)
    cfg = load_config(
        QUICKSTART, ["distributed.nproc_per_node=1", "distributed.device=cpu", f"train.pipeline={pipeline}"]
    )
    with pytest.raises(ConfigError, match=f"train.pipeline: {pipeline} needs CUDA"):
        recsys_dist.Trainer(cfg, tmp_path / "run")
    assert not dist.is_initialized() and not (tmp_path / "run").exists()


def test_trainer_whose_group_was_destroyed_under_it(tmp_path, monkeypatch, cache_dir):
    """Two Trainers alive in one process: the second uses the first one's group. Closing the
    owner first destroys it; the other then says so (torch only said no group exists), and an
    owner's close never destroys a group made after its own was destroyed."""
    import torch.distributed as dist

    for name in LAUNCHER_ENV:
        monkeypatch.delenv(name, raising=False)
    cfg = load_config(QUICKSTART, [*TOY, "distributed.nproc_per_node=1", "checkpoint.enabled=false"])
    owner = recsys_dist.Trainer(cfg, tmp_path / "a")
    user = recsys_dist.Trainer(cfg, tmp_path / "b")
    owner.close()
    with pytest.raises(RunDirLocked, match="in use by another run of this process"):
        recsys_dist.Trainer(cfg, tmp_path / "b")  # its lock still held
    with pytest.raises(RuntimeError, match="process group this Trainer was built on has been destroyed"):
        user.evaluate()
    user.close()
    assert not dist.is_initialized()

    first = recsys_dist.Trainer(cfg, tmp_path / "c")
    dist.destroy_process_group()  # the caller's doing
    second = recsys_dist.Trainer(cfg, tmp_path / "d")  # makes and owns a new group
    first.close()
    assert dist.is_initialized()  # the new group is left to its owner
    assert second.evaluate()["num_examples"] == 200
    second.close()
    assert not dist.is_initialized()
    # closed out of order, the Trainers left no lock named in the environment (a later run in
    # one of these directories would have skipped taking its lock)
    assert "RECSYS_DIST_RUN_LOCK" not in os.environ


def test_a_second_trainer_on_an_open_run_dir_is_refused_until_the_first_is_closed(tmp_path, monkeypatch, cache_dir):
    """Two Trainers of one process on one run directory: the second is refused (it was built,
    and the two wrote one metrics.jsonl and one checkpoints/); the first's close frees it."""
    import torch.distributed as dist

    for name in LAUNCHER_ENV:
        monkeypatch.delenv(name, raising=False)
    cfg = load_config(QUICKSTART, [*TOY, "distributed.nproc_per_node=1"])
    run = tmp_path / "run"
    first = recsys_dist.Trainer(cfg, run)
    first_line = (run / "metrics.jsonl").read_text()
    with pytest.raises(RunDirLocked) as err:
        recsys_dist.Trainer(cfg, run, resume="auto")
    msg = str(err.value)
    assert f"run_dir {run.absolute()} is in use by another run of this process (pid {os.getpid()}" in msg
    assert "Close that Trainer first (trainer.close(), or leave its with-block), or give another run_dir" in msg
    (tmp_path / "alias").symlink_to(run)
    with pytest.raises(RunDirLocked, match="in use by another run of this process"):
        recsys_dist.Trainer(cfg, tmp_path / "alias")  # the same directory by another name
    # The refused Trainer touched nothing: the first one's files and group are as they were.
    assert (run / "metrics.jsonl").read_text() == first_line and not (run / "checkpoints").exists()
    assert first.evaluate()["num_examples"] == 200 and first.save_checkpoint().name == "step_00000000"
    assert "RECSYS_DIST_RUN_LOCK" not in os.environ  # a Trainer's lock is not handed to other processes
    first.close()
    with recsys_dist.Trainer(cfg, run, resume="auto") as after:  # closed: the directory is free
        assert after.resumed_at_step == 0 and after.evaluate()["num_examples"] == 200
    assert not dist.is_initialized()
