"""MMoE (Ma et al., KDD 2018): eq. 5-7 against a plain loop; one logit per task; sharded."""

from pathlib import Path

import torch

from recsys_dist.config.job import resolve_job
from recsys_dist.config.loader import load_config
from recsys_dist.models.build import build_model

CONFIG = Path(__file__).resolve().parents[3] / "configs" / "movielens_multitask.yaml"


def _batch(B=8):
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    from recsys_dist.data.loader import CTRBatch

    g = torch.Generator().manual_seed(3)
    lengths = torch.cat([torch.ones(2 * B, dtype=torch.int32), torch.randint(0, 4, (B,), generator=g).int()])
    kjt = KeyedJaggedTensor(
        keys=["userId", "movieId", "genres"],
        values=torch.randint(0, 50, (int(lengths.sum()),), generator=g),
        lengths=lengths,
    )
    labels = torch.stack([torch.randint(0, 2, (B,), generator=g).float(), torch.rand(B, generator=g) * 5], 1)
    return CTRBatch(dense_features=torch.zeros(B, 0), sparse_features=kjt, labels=labels, weights=torch.ones(B))


def test_mmoe_follows_the_equations_and_gives_a_logit_per_task():
    cfg = load_config(CONFIG, ["data.num_embeddings=50", "data.categorical_mapping=hash"])
    torch.manual_seed(0)
    job = resolve_job(cfg)
    task = build_model(job.model, job.features.on(torch.device("cpu")), job.train)
    task.eval()
    batch = _batch()
    loss, (_, logits, labels, _) = task(batch)
    assert logits.shape == (8, 2) and labels.shape == (8, 2)
    m = task.model
    pooled = m.sparse_arch(batch.sparse_features)
    x = torch.cat([pooled[f] for f in m.features], dim=1)
    want = []
    for k in range(2):
        g = torch.softmax(m.gates[k](x), dim=1)  # eq. 6
        f = sum(g[:, i : i + 1] * m.experts[i](x) for i in range(len(m.experts)))  # eq. 5
        want.append(m.towers[k](f))  # eq. 7
    torch.testing.assert_close(logits, torch.cat(want, 1))
    # the configured loss: bce(like) + 0.1 * mse(rating)
    bce = torch.nn.functional.binary_cross_entropy_with_logits(logits[:, 0], labels[:, 0])
    mse = ((logits[:, 1] - labels[:, 1]) ** 2).mean()
    torch.testing.assert_close(loss, bce + 0.1 * mse)
