"""The TorchScript artefact: plain tensors in, the model's logits out, loadable with torch alone."""

import re

import pytest
import torch
from torch import nn

from tests.conftest import ROOT

CONFIGS = {
    "dlrm": ("configs/criteo_quickstart.yaml", []),
    "dlrm_dcnv2": (
        "configs/mlperf_dlrmv2.yaml",
        ["model.dcn_low_rank_dim=8", "model.embedding_dim=16", "model.dense_arch_layer_sizes=[32,16]"]
        + ["model.over_arch_layer_sizes=[32,1]"],
    ),
    "dcnv2": ("configs/criteo_dcnv2.yaml", []),
    "deepfm": ("configs/movielens_deepfm.yaml", []),
    "wide_deep": ("configs/avazu_wide_deep.yaml", []),
    "xdeepfm": ("configs/avazu_xdeepfm.yaml", []),
}
FOREIGN = ("recsys_dist", "torchrec", "fbgemm_gpu")


def build(name, *extra):
    """(the Job of a shipped config with 50-row tables, its unsharded CPU model in eval mode)."""
    from recsys_dist.config.job import resolve_job
    from recsys_dist.config.loader import load_config
    from recsys_dist.train.build import build_task

    path, overrides = CONFIGS[name]
    job = resolve_job(load_config(ROOT / path, ["data.num_embeddings=50", *overrides, *extra]))
    torch.manual_seed(0)
    cpu = torch.device("cpu")
    return job, build_task(job, job.features.on(cpu, cpu)).eval()


def test_artefact_checks_its_inputs():
    from recsys_dist.serve.torchscript import example_inputs, to_torchscript

    job, task = build("dlrm")
    artefact = to_torchscript(job, task)
    dense, values, lengths = example_inputs(13, job.table_sizes, 4, 0, False)
    with pytest.raises(Exception, match=r"lengths has 103 entries; expected 26 sparse features x B = 4"):
        artefact(dense, values, lengths[:-1])
    bad = values.clone()
    bad[5] = 50
    with pytest.raises(Exception, match=r"sparse feature C2: ids must lie in \[0, 50\), got .* 50"):
        artefact(dense, bad, lengths)
    with pytest.raises(Exception, match=r"dense must be float32 \[B, 13\]"):
        artefact(dense[:, :3], values, lengths)


class _ReadsLengths(nn.Module):
    """Uses the number of ids per row as a feature: reads the KJT outside its collection."""

    def __init__(self, spec):
        super().__init__()
        from torchrec.modules.embedding_modules import EmbeddingBagCollection

        self.ebc = EmbeddingBagCollection(tables=spec.tables, device=spec.embedding_device)
        self.out = nn.Linear(spec.embedding_dim * len(spec.sparse_names) + 1, 1)

    def forward(self, dense, sparse):
        n = sparse.lengths().float().view(len(self.ebc.embedding_bag_configs()), -1).sum(0, keepdim=True).t()
        return self.out(torch.cat([self.ebc(sparse).values(), n], dim=1))


class _Branches(nn.Module):
    """Python control flow on a tensor value: a trace keeps one branch."""

    def __init__(self, spec):
        super().__init__()
        from torchrec.modules.embedding_modules import EmbeddingBagCollection

        self.ebc = EmbeddingBagCollection(tables=spec.tables, device=spec.embedding_device)

    def forward(self, dense, sparse):
        x = self.ebc(sparse).values().sum(1, keepdim=True)
        return x if float(dense[:, 0].sum()) > 0 else -x


@pytest.mark.parametrize(
    "module, reason",
    [
        (_ReadsLengths, r"uses its sparse input \(KeyedJaggedTensor.lengths\) outside an EmbeddingBagCollection"),
        (_Branches, r"the traced artefact differs from the model by .*Python control flow"),
    ],
)
def test_a_model_that_cannot_be_traced_is_refused_with_the_reason(module, reason):
    from recsys_dist.models.task import CTRTask
    from recsys_dist.serve.torchscript import ExportError, to_torchscript

    job, _ = build("dlrm")
    spec = job.features.on(torch.device("cpu"), torch.device("cpu"))
    with pytest.raises(ExportError, match=reason):
        to_torchscript(job, CTRTask(module(spec)).eval())


def _docs_example(tmp_path):
    text = (ROOT / "docs" / "serving.md").read_text()
    code = [b for b in re.findall(r"```python\n(.*?)```", text, re.S) if "torch.jit.load" in b]
    assert len(code) == 1
    check = f"\nbad = sorted(m for m in sys.modules if m.split('.')[0] in {FOREIGN!r})\nassert not bad, bad\n"
    path = tmp_path / "serve.py"
    path.write_text(code[0] + check)
    assert len(code[0].strip().splitlines()) <= 30
    return path
