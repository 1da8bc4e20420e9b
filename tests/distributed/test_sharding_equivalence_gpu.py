"""The equivalence check on CUDA with nccl (FBGEMM's GPU kernels, Adam included)."""

import pytest
import torch

from recsys_dist.testing import run_ranks
from tests.distributed import equivalence
from tests.distributed.test_sharding_equivalence import TYPES

pytestmark = pytest.mark.gpu


@pytest.mark.slow
def test_every_sharding_type_matches_unsharded_on_cuda():
    world_size = min(torch.cuda.device_count(), 2)
    cases = [(t, o) for t in TYPES for o in ("exact_sgd", "exact_rowwise_adagrad", "exact_adagrad", "adam")]
    results = run_ranks(equivalence.check_all, world_size, cases, "cuda", timeout_s=600, backend="nccl")
    failures = [
        f"rank {rank} {case}: {diffs}"
        for rank, per_case in enumerate(results)
        for case, diffs in per_case.items()
        if max(diffs.values()) > 1e-5
    ]
    assert not failures, "\n".join(failures)
