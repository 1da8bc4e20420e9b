"""Issue 30 item 1 without processes: a DIN, BST or HSTU batch whose histories are all empty still
reaches the sequence embeddings in backward (the 2-rank run is tests/ranks/train/test_all_padding_rank.py).
"""

import pytest
import torch
from torchrec import KeyedJaggedTensor

from tests.unit.models import test_bst, test_din, test_hstu


@pytest.mark.parametrize("module", [test_din, test_bst, test_hstu], ids=["din", "bst", "hstu"])
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
