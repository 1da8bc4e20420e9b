"""Issue 17 item 3, without processes: every batch carries the factor that makes the step's
loss the mean over the real rows of the whole global batch, and CTRTask applies it."""

import pytest
import torch
from torchrec import KeyedJaggedTensor

from recsys_dist.data.loader import CTRBatch
from recsys_dist.models.losses import bce
from recsys_dist.models.task import CTRTask
from tests.data.test_loader import loaders, make_parquet, write_files


def check_scales(ls):
    W = len(ls)
    per_rank = [list(l.iter_from(0)) for l in ls]
    for step in range(len(ls[0])):
        real = [float(per_rank[r][step].weights.sum()) for r in range(W)]
        total = sum(real)
        for r in range(W):
            assert ls[r].real_rows(step) == real[r]
            assert ls[r].real_rows(step, -1) == total
            scale = float(per_rank[r][step].loss_scale)
            assert scale == pytest.approx(real[r] * W / total)
            if total == W * ls[r].batch_size:
                assert scale == 1.0  # exactly: a batch without padding is left as it was


@pytest.mark.parametrize(
    "n,ws,bs,remainder", [(10, 3, 2, "pad"), (11, 2, 4, "pad"), (7, 1, 3, "pad"), (23, 3, 3, "drop")]
)
def test_loss_scale_from_the_global_real_rows(tmp_path, n, ws, bs, remainder):
    check_scales(loaders(make_parquet(tmp_path, n), ws, bs, remainder=remainder))


@pytest.mark.parametrize("ws,bs", [(2, 3), (3, 2)])
def test_loss_scale_when_each_rank_reads_its_row_groups(tmp_path, ws, bs):
    from recsys_dist.data.loader import ParquetBatchLoader

    paths = write_files(tmp_path, [9, 5, 3])
    ls = [ParquetBatchLoader(paths, bs, r, ws, ["I1"], ["C1"], rank_reads="row_groups", prefetch=0) for r in range(ws)]
    check_scales(ls)


class Linear(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Linear(2, 1)

    def forward(self, dense, kjt):
        return self.w(dense)


def batch(dense, labels, weights, scale=None):
    b = len(labels)
    kjt = KeyedJaggedTensor(
        keys=["f"], values=torch.zeros(b, dtype=torch.long), lengths=torch.ones(b, dtype=torch.int32)
    )
    return CTRBatch(dense, kjt, labels, weights, None if scale is None else torch.tensor(scale))


def test_rank_means_scaled_then_averaged_are_the_global_mean():
    # A global batch of 8 rows on 2 ranks, 4 each, with 3 real rows on rank 0 and 1 on rank 1:
    # the average of the two ranks' scaled losses (and gradients, as DDP averages them) must be
    # the mean over the 4 real rows, as one rank holding the whole batch computes it.
    torch.manual_seed(0)
    task = CTRTask(Linear())
    dense, labels = torch.randn(8, 2), (torch.rand(8) > 0.5).float()
    weights = torch.tensor([1.0, 1, 1, 0, 1, 0, 0, 0])
    total = 4
    losses, grads = [], []
    for r in range(2):
        s = slice(4 * r, 4 * r + 4)
        task.zero_grad()
        loss, _ = task(batch(dense[s], labels[s], weights[s], float(weights[s].sum()) * 2 / total))
        loss.backward()
        losses.append(loss.detach())
        grads.append(task.model.w.weight.grad.clone())
    task.zero_grad()
    ref, _ = task(batch(dense, labels, weights))  # one rank, the whole global batch
    ref.backward()
    assert ref.item() == pytest.approx(bce(task.model.w(dense).squeeze(-1), labels, weights).item())
    assert (losses[0] + losses[1]).item() / 2 == pytest.approx(ref.item(), abs=1e-7)  # DDP averages
    torch.testing.assert_close((grads[0] + grads[1]) / 2, task.model.w.weight.grad)
