"""The HSTU attention kernels (``recsys_dist.models.hstu_attention``): chunked equals dense in
outputs and in every input's gradient (uneven chunks, broadcast biases, masked keys), keeps no
``[B, H, N, N]`` tensor for backward, ``auto`` picks by length, and bad kernels are refused."""

import pytest
import torch

from recsys_dist.config import ConfigError
from recsys_dist.config.loader import load_config
from recsys_dist.models import hstu_attention
from recsys_dist.models.hstu_attention import pointwise_attention
from tests.conftest import ROOT

B, N, H, DQK, DV = 3, 10, 2, 4, 5


def inputs(bias_shape):
    g = torch.Generator().manual_seed(0)
    q, k = (torch.randn(B, N, H, DQK, generator=g, requires_grad=True) for _ in range(2))
    v = torch.randn(B, N, H, DV, generator=g, requires_grad=True)
    bias = torch.randn(*bias_shape, generator=g, requires_grad=True)
    lengths = torch.tensor([N, 4, 1])  # padded rows: their later keys weigh 0
    real = (torch.arange(N)[None, :] < lengths[:, None]).float()
    allowed = torch.tril(torch.ones(N, N))[None] * real[:, None, :]
    weight = allowed / allowed.sum(dim=2, keepdim=True).clamp(min=1)
    return q, k, v, bias, weight


def saved_shapes(fn):
    """The shapes of the tensors autograd keeps for backward while ``fn`` runs, and its output."""
    shapes = []

    def pack(t):
        shapes.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return shapes, out


@pytest.mark.parametrize("bias_shape", [(B, 1, N, N), (1, H, N, N), (B, H, N, N)])
def test_chunked_equals_dense_with_gradients(bias_shape, monkeypatch):
    monkeypatch.setattr(hstu_attention, "CHUNK_QUERIES", 3)  # 10 queries: chunks of 3, 3, 3, 1
    q, k, v, bias, weight = inputs(bias_shape)
    probe = torch.randn(B, N, H * DV)
    results = {}
    for kernel in ("dense", "chunked"):
        out = pointwise_attention(q, k, v, bias, weight, kernel)
        assert out.shape == (B, N, H * DV)
        results[kernel] = (out, *torch.autograd.grad((out * probe).sum(), (q, k, v, bias)))
    for got, want in zip(results["chunked"], results["dense"]):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    # a loop over queries and heads: the kernels compute eq. 2
    full = bias.expand(B, H, N, N)
    for b in range(B):
        for h in range(H):
            for i in range(N):
                w = torch.nn.functional.silu(q[b, i, h] @ k[b, :, h].T + full[b, h, i]) * weight[b, i]
                torch.testing.assert_close(
                    results["dense"][0][b, i, h * DV : (h + 1) * DV], w @ v[b, :, h], atol=1e-5, rtol=0
                )
    with torch.no_grad():  # evaluation: chunks without recomputation
        torch.testing.assert_close(
            pointwise_attention(q, k, v, bias, weight, "chunked"), results["dense"][0], atol=1e-5, rtol=0
        )


def test_the_chunked_kernel_keeps_no_full_score_matrix_for_backward(monkeypatch):
    monkeypatch.setattr(hstu_attention, "CHUNK_QUERIES", 3)
    q, k, v, bias, weight = inputs((B, 1, N, N))
    dense, _ = saved_shapes(lambda: pointwise_attention(q, k, v, bias, weight, "dense"))
    chunked, out = saved_shapes(lambda: pointwise_attention(q, k, v, bias, weight, "chunked"))
    full = [s for s in dense if s[-2:] == (N, N)]  # the scores plus bias, the weighted SiLU, the weights
    assert sum(torch.Size(s).numel() for s in full) >= 2 * B * H * N * N
    assert not [s for s in chunked if s[-2:] == (N, N)]
    out.sum().backward()  # and backward still runs (recomputed)
    assert q.grad is not None and bias.grad is not None


def test_auto_takes_dense_below_the_threshold_and_chunked_from_it(monkeypatch):
    q, k, v, bias, weight = inputs((B, 1, N, N))
    monkeypatch.setattr(hstu_attention, "AUTO_CHUNKED_FROM", N + 1)
    below, _ = saved_shapes(lambda: pointwise_attention(q, k, v, bias, weight, "auto"))
    monkeypatch.setattr(hstu_attention, "AUTO_CHUNKED_FROM", N)
    from_it, _ = saved_shapes(lambda: pointwise_attention(q, k, v, bias, weight, "auto"))
    assert (B, H, N, N) in below and (B, H, N, N) not in from_it


def test_bad_kernels_are_refused():
    q, k, v, bias, weight = inputs((B, 1, N, N))
    with pytest.raises(ValueError, match=r"kernel must be one of \('auto', 'dense', 'chunked'\), got 'flash'"):
        pointwise_attention(q, k, v, bias, weight, "flash")
    for config in ("movielens_hstu.yaml", "movielens_hstu_retrieval.yaml"):
        assert load_config(ROOT / "configs" / config).model.attention == "auto"
        with pytest.raises(ConfigError, match=r"model.attention"):
            load_config(ROOT / "configs" / config, ["model.attention=flash"])
