"""The equivalence check on CUDA with nccl (FBGEMM's GPU kernels, Adam included)."""

import pytest
import torch

from recsys_dist.testing import run_ranks
from tests.ranks.distributed import equivalence
from tests.ranks.distributed.test_sharding_equivalence import TYPES

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


@pytest.mark.slow
def test_embedding_weight_decay_on_cuda():
    """FBGEMM's CUDA kernels decay the looked-up rows (row-wise Adagrad: L2 with
    weight_decay_mode L2; Adam: decoupled) like the plain reference, on sharded tables too."""
    world_size = min(torch.cuda.device_count(), 2)
    cases = [(t, o) for t in ("row_wise", "table_wise", "data_parallel") for o in ("exact_rowwise_adagrad", "adam")]
    results = run_ranks(equivalence.weight_decay_checks, world_size, cases, "cuda", timeout_s=600, backend="nccl")
    for rank, out in enumerate(results):
        for case in cases:
            assert max(out[case]["diffs"].values()) <= 1e-5, (rank, case, out[case])
            assert out[case]["effect"] > 1e-3, (rank, case, out[case])
