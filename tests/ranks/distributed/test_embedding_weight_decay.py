"""``train.embedding_weight_decay`` changes training, and as specified: the tables after 3
steps equal a plain reference that decays the rows of each batch (L2 added to the gradient
for row-wise Adagrad, decoupled for Adam), at world sizes 1 and 2 (one spawn each).

On CPU only data-parallel tables can decay (FBGEMM's CPU fused kernel ignores weight decay in
every weight_decay_mode), so sharded tables with a decay are refused there; the CUDA kernels
are checked in test_sharding_equivalence_gpu.py.
"""

import pytest

from recsys_dist.testing import run_ranks
from tests.ranks.distributed import equivalence

CASES = [("data_parallel", "exact_rowwise_adagrad"), ("data_parallel", "adam")]


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [1, 2])
def test_weight_decay_matches_reference(world_size):
    results = run_ranks(equivalence.weight_decay_checks, world_size, CASES, timeout_s=600)
    for rank, out in enumerate(results):
        for case in CASES:
            diffs, effect = out[case]["diffs"], out[case]["effect"]
            assert max(diffs.values()) <= 1e-6, (rank, case, diffs)
            assert effect > 1e-3, (rank, case, effect)  # the decay did something
        refusal = out["row_wise_on_cpu"]
        assert refusal and "train.embedding_weight_decay" in refusal and "CPU fused kernel" in refusal, refusal
        # What the CUDA kernel reads: without weight_decay_mode L2 (1) it ignores weight_decay.
        assert out["fbgemm_args"] and set(out["fbgemm_args"]) == {(equivalence.WEIGHT_DECAY, 1)}, out
