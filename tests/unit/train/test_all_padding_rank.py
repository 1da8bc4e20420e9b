"""Issue 30 item 1: every rank runs the same collectives whatever its data, also when its share
of a global batch is padding only (every list feature, so every history, empty).

Before the fix DIN and BST replaced the sequence embeddings of such a batch by zeros made apart
from the graph, so that rank skipped the sharded EmbeddingCollection's backward all-to-all and
the ranks waited in different collectives until the process group's timeout (600 s in a
``recsys-dist train`` run): ``configs/movielens_din.yaml`` with a position split and
``data.num_rows=10000`` (8,000 training rows, 62.5 global batches of 128) hung at the end of its
first epoch.

One spawn of 2 ranks trains every zoo model, the managed-collision path and a user model
(``tests/ranks/train/all_padding_worker.py``: 88 training rows, global batch 64, so rank 1's
share of the second step and of every evaluation batch is padding only) with a process-group
timeout of 120 s: a rank left waiting fails the test in about two minutes, naming the
collective. DIN and BST are also trained on 1 rank: every step's loss and the test metrics
(which follow from the padded step's gradients) must be the 1-rank run's.
"""

import pytest
import torch
from torchrec import KeyedJaggedTensor

from tests.unit.models import test_bst, test_din


@pytest.mark.parametrize("module", [test_din, test_bst], ids=["din", "bst"])
def test_a_batch_of_empty_histories_reaches_the_sequence_embeddings_in_backward(module):
    """Without processes: the loss of a batch whose histories are all empty still depends on
    the EmbeddingCollection's output values (an empty [0, E] tensor), so backward reaches them:
    sharded, that is the output_dist's backward all-to-all, which every rank must run."""
    model = module.build().train()
    seen = {}

    def keep(_module, _inputs, out):
        seen["values"] = out["history"].values()
        seen["values"].retain_grad()

    model.seq_arch.register_forward_hook(keep)
    kjt = KeyedJaggedTensor(
        keys=["user", "movie", "history"], values=torch.tensor([1, 2, 9, 8]), lengths=torch.tensor([1, 1, 1, 1, 0, 0])
    )
    dense = torch.zeros(2, len(module.spec().dense_names))
    model(dense, kjt).sum().backward()
    assert seen["values"].shape == (0, 8)
    assert seen["values"].grad is not None and seen["values"].grad.shape == (0, 8)
