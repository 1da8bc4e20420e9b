"""train.pipeline has one source of names: PIPELINES, whose factories declare what the core
asks of them (CUDA only, restart at a checkpoint); the Literal of the config agrees with it."""

from typing import get_args

import pytest
import torch

from recsys_dist.train.config import PipelineName, TrainConfig
from recsys_dist.train.pipelines import PIPELINES, TrainPipeline, make_pipeline, pipeline_problems

CUDA_ONLY = [name for name, p in PIPELINES.items() if p.cuda_only]


def test_the_config_literal_names_exactly_the_registered_pipelines():
    assert list(get_args(PipelineName)) == list(PIPELINES)
    assert TrainConfig.model_fields["pipeline"].annotation == PipelineName
    assert TrainConfig().pipeline in PIPELINES


def test_factories_declare_cuda_only_and_restart_at_checkpoint():
    assert CUDA_ONLY == ["semi_sync", "fused_sparse_dist"]
    assert [name for name, p in PIPELINES.items() if p.restart_at_checkpoint] == ["semi_sync"]
    for name, p in PIPELINES.items():
        problems = pipeline_problems(name, "cpu")
        assert problems == ([f"train.pipeline: {name} needs CUDA: {p.why_cuda}"] if p.cuda_only else [])
        assert pipeline_problems(name, "cuda") == []


@pytest.mark.parametrize("name", CUDA_ONLY)
def test_make_pipeline_refuses_a_cuda_pipeline_on_cpu(name):
    with pytest.raises(ValueError, match=f"train.pipeline: {name} needs CUDA"):
        make_pipeline(name, torch.nn.Linear(1, 1), None, torch.device("cpu"))
    with pytest.raises(ValueError, match="unknown pipeline 'nope'; one of base, sparse_dist"):
        make_pipeline("nope", torch.nn.Linear(1, 1), None, torch.device("cpu"))


def test_the_trainer_types_its_pipeline_against_the_protocol():
    from recsys_dist.train.steps import StepRunner

    assert set(TrainPipeline.__annotations__) == {"steps_done"}
    assert {"progress", "detach", "pop_times"} <= set(vars(TrainPipeline))
    assert StepRunner.start.__annotations__["return"] in ("TrainPipeline", TrainPipeline)
    assert StepRunner._new.__annotations__["return"] in ("TrainPipeline", TrainPipeline)
