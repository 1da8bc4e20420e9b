"""Issue 38 item 2 (in process): how a model is cut into pipeline stages, ``split: auto``, and the
layouts refused before any rank starts (issue 38 item 8), each naming the key and the fix."""

import pytest
import torch

from recsys_dist.config import ConfigError
from recsys_dist.config.job import resolve_job
from recsys_dist.config.loader import load_config
from recsys_dist.distributed.stages import cut_model, split_auto
from recsys_dist.models.build import build_model
from recsys_dist.train.preflight import section_problems
from tests.conftest import QUICKSTART
from tests.ranks.distributed.equivalence import criteo_batch
from tests.ranks.distributed.pipeline_worker import Tower

PIPE = ["distributed.dense.strategy=pipeline", "distributed.dense.stages=2"]


def _job(*overrides: str):
    return resolve_job(load_config(QUICKSTART, ["data.num_embeddings=200", *overrides]))


@pytest.mark.parametrize(
    "overrides",
    [
        ["model.name=dlrm"],
        ["model.name=dlrm_dcnv2", "model.dcn_num_layers=2", "model.dcn_low_rank_dim=8"],
        ["model.name=dcnv2"],  # parallel, full-rank cross layers
        ["model.name=dcnv2", "model.dcn_structure=stacked", "model.cross_low_rank_dim=4"],
        ["model.name=dcnv2", "model.deep_layer_sizes=[32, 16, 8]", "model.norm=layer"],
    ],
)
def test_the_tower_after_the_pooled_embeddings_is_the_model(overrides):
    """tower(pipeline_input(dense, kjt)) is forward(dense, kjt) to float rounding (a column slice
    of the carried tensor may be multiplied in another summation order), and the tower's
    modules hold every dense parameter once (the model's own, not copies)."""
    job = _job(*overrides)
    torch.manual_seed(0)
    task = build_model(job.model, job.features.on(torch.device("cpu")), job.train)
    tower, why = cut_model(task)
    assert tower is not None, why
    batch = criteo_batch(torch.Generator().manual_seed(1), 8)
    kjt = type(batch.sparse_features)(
        keys=batch.sparse_features.keys(),
        values=batch.sparse_features.values() % 200,
        lengths=batch.sparse_features.lengths(),
        stride=8,
    )
    user = task.model
    x = user.pipeline_input(batch.dense_features, kjt)
    for module in tower:
        x = module(x)
    torch.testing.assert_close(x, user(batch.dense_features, kjt), rtol=1e-6, atol=1e-7)
    tables = {id(p) for p in user.sparse_arch.parameters()}
    dense = [p for p in user.parameters() if id(p) not in tables]
    in_tower = [p for m in tower for p in m.parameters()]
    assert len(in_tower) == len({id(p) for p in in_tower}) == len(dense)
    assert {id(p) for p in in_tower} == {id(p) for p in dense}


def test_models_that_cannot_be_cut_say_why():
    job = _job("model.name=deepfm")
    task = build_model(job.model, job.features.on(torch.device("meta")), job.train)
    tower, why = cut_model(task)
    assert tower is None and "DeepFM" in why and "pipeline_tower" in why


def test_split_auto_minimises_the_largest_stage():
    assert split_auto([10, 1, 1, 10], 2) == [2]
    assert split_auto([1, 1, 1, 1], 2) == [2]
    assert split_auto([5, 1, 1, 1, 1, 1], 2) == [1]
    assert split_auto([3, 3, 3], 3) == [1, 2]
    assert split_auto([100, 1, 1, 1], 3) == [1, 2]
    with pytest.raises(ValueError, match="4 modules cannot make 5 stages"):
        split_auto([1, 1, 1, 1], 5)


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (["distributed.dense.stages=3"], "distributed.dense.stages: 3 stages do not divide 2 rank(s)"),
        (["distributed.nproc_per_node=3"], "distributed.dense.stages: 2 stages do not divide 3 rank(s)"),
        (["distributed.dense.microbatches=5"], "distributed.dense.microbatches: 5 does not divide a pipeline's batch"),
        (["distributed.dense.microbatches=1"], "distributed.dense.microbatches: 1f1b needs at least one microbatch"),
        (
            ["distributed.dense.schedule=2bw", "distributed.dense.microbatches=1"],
            "distributed.dense.microbatches: 2bw runs 1f1b's order, which needs at least one microbatch per stage (2)",
        ),
        (["model.name=deepfm"], "distributed.dense.strategy: pipeline: the model (DeepFM) does not say how"),
        (["distributed.dense.split=[4]"], "distributed.dense.split: [4] must be 1 increasing module indices"),
        (["train.pipeline=base"], "train.pipeline: not applied under distributed.dense.strategy: pipeline"),
        (["train.pipeline=sparse_dist"], "train.pipeline: not applied under distributed.dense.strategy: pipeline"),
        (["train.dense_grad_clip_norm=1.0"], "train.dense_grad_clip_norm: not applied"),
        (["train.precision=bf16-mixed"], "train.precision: not applied"),
        (["train.timing_every_n_steps=5"], "train.timing_every_n_steps: not applied"),
    ],
)
def test_bad_pipeline_layouts_are_refused_before_any_rank_starts(overrides, expected):
    problems = section_problems(_job(*PIPE, *overrides))
    assert any(p.startswith(expected) for p in problems), problems


def test_more_stages_than_tower_modules_are_refused():
    # the quickstart's dlrm: interaction, two over-arch perceptrons, the last linear: 4 modules
    job = _job("distributed.dense.strategy=pipeline", "distributed.dense.stages=5", "distributed.nproc_per_node=5")
    problems = section_problems(job)
    assert any(
        p.startswith("distributed.dense.stages: 5 stages, but the model's tower has 4 modules") for p in problems
    )
    ok = _job("distributed.dense.strategy=pipeline", "distributed.dense.stages=4", "distributed.nproc_per_node=4")
    assert section_problems(ok) == []


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        # torch's rounds: max(1, 5 // 2) = 2 rounds do not cut 5 microbatches (its own error, raised
        # on every rank as the schedule is built); 5 also does not divide 32 rows
        (
            ["distributed.dense.schedule=interleaved_1f1b", "distributed.dense.microbatches=5"],
            "distributed.dense.microbatches: interleaved_1f1b runs 5 microbatches in max(1, 5 // 2 stages) = 2 rounds",
        ),
        (
            ["distributed.dense.schedule=zero_bubble", "train.batch_size=18", "distributed.dense.microbatches=9"],
            "distributed.dense.microbatches: zero_bubble runs 9 microbatches in max(1, 9 // 2 stages) = 4 rounds",
        ),
        # the quickstart's dlrm: 4 modules, 2 ranks x 3 stages each = 6 stages
        (
            ["distributed.dense.schedule=zero_bubble", "distributed.dense.stages_per_rank=3"],
            "distributed.dense.stages_per_rank: 2 stages x 3 stages per rank = 6 stages, but the model's tower has "
            "4 modules to cut (one at least per stage); use stages_per_rank: 2",
        ),
        # an explicit cut must make the 2 x 2 = 4 stages (the default stages_per_rank)
        (
            ["distributed.dense.schedule=interleaved_1f1b", "distributed.dense.split=[2]"],
            "distributed.dense.split: [2] must be 3 increasing module indices between 1 and 3 (the first module of "
            "each stage after the first (2 stages x 2 per rank)), or auto",
        ),
    ],
)
def test_bad_interleaved_layouts_are_refused_before_any_rank_starts(overrides, expected):
    problems = section_problems(_job(*PIPE, *overrides))
    assert any(p.startswith(expected) for p in problems), problems


def test_the_microbatch_rule_is_torchs():
    """The preflight refuses exactly the microbatch counts torch 2.13's interleaved schedules
    raise for as they are built (on every rank, after launch): their constructors run here over
    stand-in stages (no process group: the schedule's plan needs only the stages' indices)."""
    from torch.distributed.pipelining.stage import _PipelineStageBase

    from recsys_dist.distributed.config import DenseConfig
    from recsys_dist.distributed.rules import interleaved_microbatch_problems
    from recsys_dist.distributed.stages import MULTI_SCHEDULES

    class Stub(_PipelineStageBase):
        _create_grad_recv_info = _prepare_backward_infra = _prepare_forward_infra = lambda *a, **k: None

        def __init__(self, index: int, stages: int, ranks: int) -> None:  # no nn.Module, no group
            self.stage_index, self.num_stages, self.group_size, self.group_rank = index, stages, ranks, 0
            self.submod = None

    for name, schedule in MULTI_SCHEDULES.items():
        for ranks, per_rank in ((2, 2), (3, 2), (4, 3)):
            refused = []
            for m in range(1, 26):
                cfg = DenseConfig(
                    strategy="pipeline", stages=ranks, schedule=name, microbatches=m, stages_per_rank=per_rank
                )
                try:
                    schedule([Stub(k * ranks, ranks * per_rank, ranks) for k in range(per_rank)], m)
                    raised = False
                except ValueError:
                    raised = True
                assert bool(interleaved_microbatch_problems(cfg)) == raised, (name, ranks, m)
                refused += [m] if raised else []
            assert refused, (name, ranks)  # some counts are refused (5 at 2 ranks)


def test_a_good_layout_passes():
    assert section_problems(_job(*PIPE)) == []
    assert section_problems(_job(*PIPE, "distributed.nproc_per_node=4")) == []  # 2 pipelines of 2 stages
    assert section_problems(_job(*PIPE, "distributed.dense.schedule=gpipe", "distributed.dense.split=[1]")) == []
    # 2 ranks x 2 stages each (the default) of the quickstart's 4 modules; an explicit cut into 4
    assert section_problems(_job(*PIPE, "distributed.dense.schedule=interleaved_1f1b")) == []
    assert (
        section_problems(_job(*PIPE, "distributed.dense.schedule=zero_bubble", "distributed.dense.split=[1, 2, 3]"))
        == []
    )
    assert section_problems(_job(*PIPE, "distributed.dense.schedule=2bw", "distributed.dense.microbatches=2")) == []


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (["distributed.dense.schedule=zb"], "distributed.dense.schedule: Input should be 'gpipe', '1f1b'"),
        (
            ["distributed.dense.stages_per_rank=2"],
            "distributed.dense: stages_per_rank: only schedule interleaved_1f1b or zero_bubble runs several stages",
        ),
        (
            ["distributed.dense.schedule=gpipe", "distributed.dense.stages_per_rank=1"],
            "stages_per_rank: only schedule interleaved_1f1b or zero_bubble",
        ),
        (
            ["distributed.dense.schedule=zero_bubble", "distributed.dense.stages_per_rank=0"],
            "distributed.dense.stages_per_rank: Input should be greater than or equal to 1",
        ),
        (
            ["distributed.dense.strategy=ddp", "distributed.dense.stages_per_rank=2"],
            "stages, stages_per_rank: only strategy: pipeline reads them",
        ),
        (["distributed.dense.strategy=ddp"], "distributed.dense: stages: only strategy: pipeline reads it"),
        (["distributed.dense.strategy=fsdp", "distributed.dense.microbatches=2"], "stages, microbatches: only"),
        (["distributed.dense.stages=1"], "distributed.dense.stages: Input should be greater than or equal to 2"),
    ],
)
def test_bad_pipeline_keys_are_config_errors(overrides, expected):
    with pytest.raises(ConfigError) as e:
        load_config(QUICKSTART, [*PIPE, *overrides])
    assert expected in str(e.value), str(e.value)


def test_pipeline_needs_its_stages():
    """The message names the full key and the override that fixes it."""
    with pytest.raises(ConfigError) as e:
        load_config(QUICKSTART, ["distributed.dense.strategy=pipeline"])
    assert "stages: strategy: pipeline needs the number of stages" in str(e.value), str(e.value)
    assert "distributed.dense.stages=2 on 2 ranks" in str(e.value), str(e.value)
    # under replica groups the stages divide a group's ranks, not the world (it said the world only)
    assert "under sharding.replica_groups N, of a sharding group's world / N ranks" in str(e.value), str(e.value)


def test_a_given_model_is_checked_as_it_is_sharded():
    """A model given to Trainer(model=...) skips the config checks; the wrapper refuses a cut it
    cannot make, naming the key, before any stage is built."""
    from recsys_dist.distributed.config import DenseConfig
    from recsys_dist.distributed.stages import PipelineDense

    job = _job()
    task = build_model(job.model, job.features.on(torch.device("cpu")), job.train)

    class Env:
        world_size, rank, process_group = 5, 0, None

    class DMP:
        _dmp_wrapped_module = task

    with pytest.raises(ValueError, match="distributed.dense.stages: 5 stages, but the model's tower has 4 modules"):
        PipelineDense(DenseConfig(strategy="pipeline", stages=5)).wrap(DMP(), Env(), torch.device("cpu"))
    fm = _job("model.name=deepfm")
    DMP._dmp_wrapped_module = build_model(fm.model, fm.features.on(torch.device("meta")), fm.train)
    with pytest.raises(ValueError, match="distributed.dense.strategy: pipeline: the model .DeepFM. does not say"):
        PipelineDense(DenseConfig(strategy="pipeline", stages=2)).wrap(DMP(), Env(), torch.device("meta"))


def test_plan_checks_the_layout_at_the_planned_world_size(capsys):
    """``recsys-dist plan --world-size N`` judges the stages against N ranks, not the config's
    ``distributed.nproc_per_node`` (2 here): 4 stages on 4 ranks were refused ("do not divide 2
    rank(s)") and 2 stages on 3 ranks planned, exit 0, where ``train`` at 3 ranks refuses them."""
    import argparse

    from recsys_dist.cli.plan import cmd_plan

    def plan(world: int, *overrides: str) -> int:
        args = argparse.Namespace(
            config=str(QUICKSTART),
            world_size=world,
            local_world_size=None,
            device="cpu",
            hbm_gb=None,
            ddr_gb=None,
            json=True,
            overrides=["data.num_embeddings=200", "model.name=dcnv2", *PIPE[:1], *overrides],
        )
        return cmd_plan(args)

    assert plan(4, "distributed.dense.stages=4") == 0
    assert len(__import__("json").loads(capsys.readouterr().out)["hbm_gb"]) == 4
    with pytest.raises(ConfigError, match=r"distributed.dense.stages: 2 stages do not divide 3 rank\(s\)"):
        plan(3, "distributed.dense.stages=2")


class Tied(Tower):
    """A user's cuttable model whose tower applies one hidden layer twice (tied weights):
    ``[l1, l2, l2, head]``. Cut at 2, stage 0 and stage 1 each updated their own copy of l2 with
    their part of its gradient: validation AUC 0.463 where ddp's was 0.491, exit 0."""

    def pipeline_tower(self):
        return [self.l1, self.l2, self.l2, self.head]


def test_a_tower_sharing_a_parameter_between_modules_is_refused_before_launch():
    problems = section_problems(_job(*PIPE, f"model.name={__name__}:Tied", "distributed.dense.split=[2]"))
    assert any(
        p.startswith("distributed.dense.strategy: pipeline: the tower of Tied holds a parameter in more than one")
        and "modules 1 and 2" in p
        for p in problems
    ), problems
