"""``model.name: sasrec_retrieval``: the SASRec baseline (Kang & McAuley, 2018) of
``hstu_retrieval``, trained and evaluated by the Trainer from YAML (docs/models.md).

Everything but the encoder is ``hstu_retrieval``'s (``recsys_dist.models.zoo.hstu_next_item``):
the data (the row's item and its user history, ``data.categorical_mapping: hash``), the one
shared sharded table, the in-batch sampled softmax with the logQ correction, the checks and the
evaluation (HR@K, NDCG@K, MRR against every item). The history is encoded by
:class:`recsys_dist.models.sasrec_retrieval.SASRecRetrieval`'s layers: ``u = y_n``, the last
real position's output (unit norm).
"""

from __future__ import annotations

from recsys_dist.data.spec import FeatureSpec
from recsys_dist.models.checks import no_history_extras
from recsys_dist.models.config import SASRecRetrievalConfig
from recsys_dist.models.registry import register_model
from recsys_dist.models.sasrec_retrieval import SASRecRetrieval
from recsys_dist.models.zoo.hstu_next_item import NEXT_ITEM_HOOKS, HSTUNextItem, next_item_parts, next_item_problems


class SASRecNextItem(HSTUNextItem, SASRecRetrieval):
    """:class:`HSTUNextItem` (its ``forward``, ``user_vectors``, ``item_vectors``: same outputs)
    with :class:`SASRecRetrieval`'s ``encode``."""


def sasrec_problems(job) -> list[str]:
    """``hstu_retrieval``'s checks (their messages name this model), and a history that fits the positions."""
    problems = next_item_problems(job)
    h = job.data.schema.history if job.data.schema is not None else None
    if h is not None and h.max_length is not None and h.max_length > job.model.max_length:
        problems.append(
            f"model.max_length: {job.model.max_length} positions, fewer than data.schema.history.max_length "
            f"{h.max_length}: raise model.max_length"
        )
    return problems


@register_model(
    "sasrec_retrieval", SASRecRetrievalConfig, checks=(sasrec_problems, no_history_extras), **NEXT_ITEM_HOOKS
)
def build_sasrec_next_item(spec: FeatureSpec, cfg: SASRecRetrievalConfig) -> SASRecNextItem:
    """:class:`SASRecNextItem` over one table: the history's, read by the history and the item."""
    return SASRecNextItem(
        *next_item_parts(spec, cfg),
        embedding_dim=cfg.embedding_dim,
        num_layers=cfg.num_layers,
        num_heads=cfg.num_heads,
        dropout=cfg.layer_dropout,
        max_length=cfg.max_length,
        device=spec.device,
    )
