"""Issue 17 item 3, without processes: every batch carries the factor that makes the step's
loss the mean over the real rows of the whole global batch, and CTRTask applies it."""

import pytest
import torch
from torchrec import KeyedJaggedTensor

from recsys_dist.data.loader import CTRBatch
from recsys_dist.models.losses import bce
from recsys_dist.models.task import CTRTask
from tests.unit.data.test_loader import loaders, make_parquet, write_files


def add_weights(paths, seed=0):
    """A float32 'w' column of uneven weights (some 0, some below 1) in each file."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = np.random.default_rng(seed)
    for p in paths:
        t = pq.read_table(p)
        w = rng.choice([0.0, 0.25, 0.5, 1.0, 3.0, 7.5], size=t.num_rows).astype(np.float32)
        meta = pq.ParquetFile(p).metadata
        rg = meta.row_group(0).num_rows if meta.num_row_groups else None
        pq.write_table(t.append_column("w", pa.array(w, pa.float32())), p, row_group_size=rg)


def check_scales(ls, weighted=False):
    """Every rank's scale is its weight x W / the global batch's weight, with the global
    weight read from every rank's batches (an independent count). Without sample weights
    (weight 1 per real row, 0 per padding row) also the loaders' real-row counts, and a
    batch without padding keeps exactly 1."""
    W = len(ls)
    per_rank = [list(l.iter_from(0)) for l in ls]
    for step in range(len(ls[0])):
        here = [float(per_rank[r][step].weights.sum()) for r in range(W)]
        total = sum(here)
        for r in range(W):
            scale = float(per_rank[r][step].loss_scale)
            want = here[r] * W / total if total > 0 else 0.0
            assert scale == pytest.approx(want, rel=1e-6, abs=1e-7), (step, r)
            if not weighted:
                assert ls[r].real_rows(step) == here[r]
                assert ls[r].real_rows(step, -1) == total
                if total == W * ls[r].batch_size:
                    assert scale == 1.0  # exactly: a batch without padding is left as it was


@pytest.mark.parametrize(
    "n,ws,bs,remainder", [(10, 3, 2, "pad"), (11, 2, 4, "pad"), (7, 1, 3, "pad"), (23, 3, 3, "drop")]
)
def test_loss_scale_from_the_global_real_rows(tmp_path, n, ws, bs, remainder):
    check_scales(loaders(make_parquet(tmp_path, n), ws, bs, remainder=remainder))


@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("ws,bs", [(2, 3), (3, 2)])
def test_loss_scale_when_each_rank_reads_its_row_groups(tmp_path, ws, bs, weighted):
    from recsys_dist.data.loader import ParquetBatchLoader

    paths = write_files(tmp_path, [9, 5, 3])
    kw = dict(rank_reads="row_groups", prefetch=0)
    if weighted:
        add_weights(paths, seed=1)
        kw.update(weight_column="w", shuffle=True)
    check_scales([ParquetBatchLoader(paths, bs, r, ws, ["I1"], ["C1"], **kw) for r in range(ws)], weighted)


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


def ranks_and_one(dense, labels, weights, world_size):
    """CTRTask's loss and weight gradient on each of ``world_size`` equal slices of a global
    batch, every slice scaled by its share of the global weight (as the loader scales it),
    and on the whole batch in one rank. Returns (losses, grads, task, reference loss); the
    task's gradient is the whole batch's."""
    torch.manual_seed(0)
    task = CTRTask(Linear())
    total, n = float(weights.sum()), len(labels) // world_size
    losses, grads = [], []
    for r in range(world_size):
        s = slice(n * r, n * r + n)
        task.zero_grad()
        loss, _ = task(batch(dense[s], labels[s], weights[s], float(weights[s].sum()) * world_size / total))
        loss.backward()
        losses.append(loss.detach())
        grads.append(task.model.w.weight.grad.clone())
    task.zero_grad()
    ref, _ = task(batch(dense, labels, weights))  # one rank, the whole global batch
    ref.backward()
    return losses, grads, task, ref


def test_rank_means_scaled_then_averaged_are_the_global_mean():
    # A global batch of 8 rows on 2 ranks, 4 each, with 3 real rows on rank 0 and 1 on rank 1:
    # the average of the two ranks' scaled losses (and gradients, as DDP averages them) must be
    # the mean over the 4 real rows, as one rank holding the whole batch computes it.
    torch.manual_seed(0)
    dense, labels = torch.randn(8, 2), (torch.rand(8) > 0.5).float()
    weights = torch.tensor([1.0, 1, 1, 0, 1, 0, 0, 0])
    losses, grads, task, ref = ranks_and_one(dense, labels, weights, 2)
    assert ref.item() == pytest.approx(bce(task.model.w(dense).squeeze(-1), labels, weights).item())
    assert (losses[0] + losses[1]).item() / 2 == pytest.approx(ref.item(), abs=1e-7)  # DDP averages
    torch.testing.assert_close((grads[0] + grads[1]) / 2, task.model.w.weight.grad)


# ---- sample weights (data.schema.weight): the scale is the rank's share of the global weight


@pytest.mark.parametrize(
    ("ws", "bs", "remainder", "shuffle"), [(2, 3, "pad", True), (3, 2, "pad", False), (3, 2, "drop", True)]
)
def test_weighted_loss_scale_is_the_global_weight_share(tmp_path, ws, bs, remainder, shuffle):
    from recsys_dist.data.loader import ParquetBatchLoader

    paths = write_files(tmp_path, [9, 5, 3])
    add_weights(paths)
    kw = dict(weight_column="w", remainder=remainder, shuffle=shuffle, shuffle_buffer_rows=5, prefetch=0)
    ls = [ParquetBatchLoader(paths, bs, r, ws, ["I1"], ["C1"], **kw) for r in range(ws)]
    for l in ls:
        l.set_epoch(1)
    check_scales(ls, weighted=True)
    # the global weights do not depend on the world size: one rank with the global batch
    one = ParquetBatchLoader(paths, bs * ws, 0, 1, ["I1"], ["C1"], **kw)
    one.set_epoch(1)
    want = [float(b.weights.sum()) for b in one]
    assert list(ls[0].global_weights()) == pytest.approx(want, rel=1e-7)
    assert list(ls[1].global_weights(2)) == pytest.approx(want[2:], rel=1e-7)


def test_an_evaluation_loader_carries_no_loss_scale_and_reads_no_other_ranks_weights(tmp_path, monkeypatch):
    from recsys_dist.data.loader import ParquetBatchLoader

    paths = write_files(tmp_path, [9, 5, 3])
    add_weights(paths)
    train = ParquetBatchLoader(paths, 2, 1, 3, ["I1"], ["C1"], weight_column="w", prefetch=2)
    ev = train.reopen(scale_losses=False)
    assert not ev.scale_losses and train.reopen().scale_losses

    def no_read(*a, **k):
        raise AssertionError("an evaluation loader read the other ranks' weights")

    monkeypatch.setattr(ev, "global_weights", no_read)
    got, want = list(ev), list(train)
    assert all(b.loss_scale is None for b in got)
    assert any(float(b.loss_scale) != 1.0 for b in want)
    for g, w in zip(got, want, strict=True):  # the same batches otherwise
        assert torch.equal(g.dense_features, w.dense_features) and torch.equal(g.weights, w.weights)
        assert torch.equal(g.sparse_features.values(), w.sparse_features.values())


def test_weighted_rank_means_scaled_then_averaged_are_the_global_weighted_mean():
    # Sample weights below 1 and uneven across ranks: 3 ranks' scaled losses (and gradients,
    # averaged as DDP does) are sum w_i l_i / sum w_i over the 12 rows, as one rank computes it.
    torch.manual_seed(0)
    dense, labels = torch.randn(12, 2), (torch.rand(12) > 0.5).float()
    weights = torch.tensor([0.1, 0.2, 0.3, 0.0, 3.0, 0.5, 0.0, 0.0, 0.0, 0.0, 0.05, 0.0])
    losses, grads, task, ref = ranks_and_one(dense, labels, weights, 3)
    per_row = torch.nn.functional.binary_cross_entropy_with_logits(
        task.model.w(dense).squeeze(-1), labels, reduction="none"
    )
    assert ref.item() == pytest.approx(((per_row * weights).sum() / weights.sum()).item(), rel=1e-6)
    assert sum(losses).item() / 3 == pytest.approx(ref.item(), rel=1e-6)
    torch.testing.assert_close(sum(grads) / 3, task.model.w.weight.grad)


@pytest.mark.parametrize("prefetch", [0, 2])
@pytest.mark.parametrize(("ws", "remainder", "shuffle"), [(1, "pad", True), (2, "pad", True), (3, "drop", False)])
def test_global_batch_weights_come_from_the_ranks_own_reads(tmp_path, monkeypatch, ws, remainder, shuffle, prefetch):
    # Under rank_reads global_batch a rank reads every row of each window anyway: the global
    # weight sums come from that pass (no window read twice), bit-identical to global_weights
    # (its own read of the stream as one rank with batch B x W), and so are the loss scales;
    # several windows (global batches split between two), from step 0 and from a resumed step.
    from collections import deque

    from recsys_dist.data.loader import ParquetBatchLoader

    paths = write_files(tmp_path, [9, 5, 3, 7])
    add_weights(paths, seed=2)
    kw = dict(weight_column="w", remainder=remainder, shuffle=shuffle, shuffle_buffer_rows=5, prefetch=prefetch)
    ls = [ParquetBatchLoader(paths, 2, r, ws, ["I1"], ["C1"], **kw) for r in range(ws)]
    reads = []
    real_read = ParquetBatchLoader._read
    monkeypatch.setattr(ParquetBatchLoader, "_read", lambda self, *a: reads.append(a[0]) or real_read(self, *a))
    for start in (0, 2):
        for l in ls:
            l.set_epoch(1)
            ev = l.reopen(scale_losses=False)  # reads its own rows only
            ev.set_epoch(1)
            reads.clear()
            list(ev.iter_from(start))
            own = list(reads)
            reads.clear()
            got = list(l.iter_from(start))
            assert reads == own  # the rank's own pass only: no second read for the weights
            totals = list(l.global_weights(start))
            sums = deque()
            for _ in l._own_windows(start, sums):
                pass
            assert list(sums) == totals  # exactly, float64
            assert len(got) == len(totals) == len(l) - start
            for b, total in zip(got, totals):
                share = float(b.weights.sum()) * ws / total if total > 0 else 0.0
                want = torch.tensor(share if ws > 1 else (1.0 if total > 0 else 0.0), dtype=torch.float32)
                assert torch.equal(b.loss_scale, want)
