"""The ``model:`` section: keys every model takes, and the per-model classes behind ``model.name``.

``model.name`` picks the config class: a registered name (``dlrm``, ``deepfm``, ... or one
added with :func:`recsys_dist.register_model`) validates against that model's own class, so
an option the chosen model does not take (``model.dropout`` on ``dlrm``) is an error. The
classes behind names live with their models (``recsys_dist.models.zoo``); import paths are
checked by ``recsys_dist.models.registry.FactoryModelConfig``.
"""

from __future__ import annotations

from pydantic import Field

from recsys_dist.config.base import Section


class ModelConfig(Section):
    """Keys every model takes: its name, and the embedding tables the library builds for it."""

    name: str = Field(
        "dlrm",
        description="A registered model (dlrm, dlrm_dcnv2, dcnv2, deepfm, wide_deep, xdeepfm, din, mmoe, two_tower; see docs/models.md) "
        "or the import path of a model factory, 'package.module:factory' (see docs/api.md).",
    )
    embedding_dim: int = Field(16, gt=0, description="Embedding dimension of every table t_<feature>.")
    embedding_init_scale: float | None = Field(
        0.05,
        gt=0,
        description="Embeddings start uniform in [-scale, scale]. None = TorchRec's default "
        "uniform(+-sqrt(1/num_embeddings)), which is tiny for large tables.",
    )
