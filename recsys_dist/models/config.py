"""The ``model:`` section: keys every model takes, and the per-model classes behind ``model.name``.

``model.name`` picks the config class: a registered name (``dlrm``, ``deepfm``, ... or one
added with :func:`recsys_dist.register_model`) validates against that model's own class, so
an option the chosen model does not take (``model.dropout`` on ``dlrm``) is an error. The
shipped models' classes live here, apart from their builders in ``recsys_dist.models.zoo``
(torch, TorchRec), so that loading a config imports neither: :data:`SHIPPED_MODEL_CONFIGS`
maps each shipped name to its class. Import paths are checked by
``recsys_dist.models.registry.FactoryModelConfig``.

The losses ``train.loss`` may name, without torch either (the config check of ``train.loss`` /
``train.loss_args`` in ``recsys_dist.train.config`` reads them): the shipped losses' keyword
parameters as constants (tests/unit/train/test_loss_names.py checks them against the functions'
signatures), and the table ``recsys_dist.models.losses.register_loss`` fills.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, get_args

from pydantic import Field, PositiveInt, model_validator

from recsys_dist.section import Section, import_object, is_import_path


class ModelConfig(Section):
    """Keys every model takes: its name, and the embedding tables the library builds for it."""

    name: str = Field(
        "dlrm",
        description="A registered model (dlrm, dlrm_dcnv2, dcnv2, deepfm, wide_deep, xdeepfm, din, bst, hstu, mmoe, ple, two_tower, hstu_retrieval, sasrec_retrieval; see docs/models.md) "
        "or the import path of a model factory, 'package.module:factory' (see docs/api.md).",
    )
    embedding_dim: int = Field(16, gt=0, description="Embedding dimension of every table t_<feature>.")
    embedding_init_scale: float | None = Field(
        0.05,
        gt=0,
        description="Embeddings start uniform in [-scale, scale]. None = TorchRec's default "
        "uniform(+-sqrt(1/num_embeddings)), which is tiny for large tables.",
    )


# Options shared by the models with a deep MLP (DCN-V2, DeepFM, Wide & Deep, xDeepFM, DIN, BST, MMoE,
# PLE), by the multi-task models' towers (MMoE, PLE) and by the target-attention models (DIN, BST).


def check_sizes(key: str, sizes: list[int], non_empty: bool = True) -> None:
    """Raises ValueError naming ``model.<key>`` unless every hidden size is positive (and, with
    ``non_empty``, there is one at least)."""
    if (non_empty and not sizes) or any(s <= 0 for s in sizes):
        what = "a non-empty list of positive ints" if non_empty else "positive ints"
        raise ValueError(f"model.{key} must be {what}, got {sizes}")


class DeepModelConfig(ModelConfig):
    """Keys of a model with a deep MLP over ``[dense, e_1 .. e_F]``."""

    deep_layer_sizes: list[int] = Field([256, 128], description="Hidden sizes of the deep MLP.")
    dropout: float = Field(0.0, ge=0, lt=1, description="Dropout after each hidden layer.")
    norm: Literal["none", "batch", "layer"] = Field("none", description="Normalisation after each hidden linear layer.")
    activation: Literal["relu", "gelu", "silu"] = Field("relu", description="Activation of the hidden layers.")
    mlp_init_std: float | None = Field(
        None,
        gt=0,
        description="The deep MLP's hidden weights (and the linear part's dense weights) start normal(0, std), "
        "as DeepCTR-Torch does with 1e-4; None = PyTorch's default (Kaiming uniform).",
    )

    @model_validator(mode="after")
    def _check_sizes(self):
        check_sizes("deep_layer_sizes", self.deep_layer_sizes)
        return self

    def mlp_kwargs(self) -> dict:
        """The keyword arguments every deep-MLP module of ``recsys_dist.models.zoo`` takes (``recsys_dist.models.layers.mlp``)."""
        return dict(dropout=self.dropout, norm=self.norm, activation=self.activation, init_std=self.mlp_init_std)


class TowersConfig(DeepModelConfig):
    """Keys of a multi-task model with one tower per task (MMoE, PLE)."""

    tower_sizes: list[int] = Field(
        [32], description="Hidden sizes of each task's tower (MMoE's h^k, PLE's t^k; [] = a linear head)."
    )

    @model_validator(mode="after")
    def _check_towers(self):
        check_sizes("tower_sizes", self.tower_sizes, non_empty=False)
        return self


class TargetSequenceConfig(DeepModelConfig):
    """Keys of a model that attends from the scored item to the user's history (DIN, BST, HSTU)."""

    target_feature: str = Field(description="The categorical feature of the item being scored (e.g. movieId).")


class DLRMConfig(ModelConfig):
    """``model.name: dlrm``."""

    name: Literal["dlrm"] = "dlrm"
    dense_arch_layer_sizes: list[int] = Field(
        [64, 16], description="Bottom MLP sizes; the last must equal model.embedding_dim (dot interaction)."
    )
    over_arch_layer_sizes: list[int] = Field([64, 32, 1], description="Top MLP sizes; the last must be 1 (one logit).")

    @model_validator(mode="after")
    def _check(self):
        for key in ("dense_arch_layer_sizes", "over_arch_layer_sizes"):
            sizes = getattr(self, key)
            if not sizes or any(s <= 0 for s in sizes):
                raise ValueError(f"model.{key} must be a non-empty list of positive ints, got {sizes}")
        if self.over_arch_layer_sizes[-1] != 1:
            raise ValueError(
                f"model.over_arch_layer_sizes[-1] must be 1 (one logit), got {self.over_arch_layer_sizes[-1]}"
            )
        # model.name left out: dlrm is only the default, and a config for Trainer(model=...) names
        # none (its model.embedding_dim need not fit dlrm). The run's preflight checks it then,
        # once it knows which model trains (recsys_dist.models.checks.dot_interaction).
        problem = self.dot_interaction_problem()
        if problem and "name" in self.model_fields_set:
            raise ValueError(problem)
        return self

    def dot_interaction_problem(self) -> str | None:
        """dlrm's dot interaction needs the bottom MLP's output as wide as an embedding: the
        message naming both keys when it is not, else None."""
        if self.name == "dlrm" and self.dense_arch_layer_sizes[-1] != self.embedding_dim:
            return (
                f"model.dense_arch_layer_sizes[-1] ({self.dense_arch_layer_sizes[-1]}) must equal "
                f"model.embedding_dim ({self.embedding_dim}) for dlrm's dot interaction"
            )
        return None


class DLRMDCNConfig(DLRMConfig):
    """``model.name: dlrm_dcnv2``."""

    name: Literal["dlrm_dcnv2"] = "dlrm_dcnv2"
    dcn_num_layers: int = Field(3, gt=0, description="Cross layers.")
    dcn_low_rank_dim: int = Field(512, gt=0, description="Rank of each cross layer's weight.")


class DCNv2Config(DeepModelConfig):
    """``model.name: dcnv2``."""

    name: Literal["dcnv2"] = "dcnv2"
    dcn_num_layers: int = Field(3, gt=0, description="Cross layers.")
    dcn_structure: Literal["stacked", "parallel"] = Field(
        "parallel", description="Cross network then MLP (stacked) or side by side (parallel)."
    )
    cross_low_rank_dim: int | None = Field(None, gt=0, description="Rank of each cross layer's weight (None = full).")


class DeepFMConfig(DeepModelConfig):
    """``model.name: deepfm`` (Guo et al., 2017)."""

    name: Literal["deepfm"] = "deepfm"


class WideDeepConfig(DeepModelConfig):
    """``model.name: wide_deep`` (Cheng et al., 2016)."""

    name: Literal["wide_deep"] = "wide_deep"


class XDeepFMConfig(DeepModelConfig):
    """``model.name: xdeepfm`` (Lian et al., 2018)."""

    name: Literal["xdeepfm"] = "xdeepfm"
    cin_layer_sizes: list[int] = Field([64, 64], description="Feature maps per CIN layer.")

    @model_validator(mode="after")
    def _check_cin(self):
        if not self.cin_layer_sizes or any(s <= 0 for s in self.cin_layer_sizes):
            raise ValueError(
                f"model.cin_layer_sizes must be a non-empty list of positive ints, got {self.cin_layer_sizes}"
            )
        return self


class DINConfig(TargetSequenceConfig):
    """``model.name: din``."""

    name: Literal["din"] = "din"
    attention_sizes: list[int] = Field([64, 16], description="Hidden sizes of the attention unit's MLP.")

    @model_validator(mode="after")
    def _check_attention(self):
        check_sizes("attention_sizes", self.attention_sizes)
        return self


class BSTConfig(TargetSequenceConfig):
    """``model.name: bst``."""

    name: Literal["bst"] = "bst"
    num_heads: int = Field(2, gt=0, description="Attention heads of each transformer layer; must divide embedding_dim.")
    ffn_size: int = Field(64, gt=0, description="Hidden size of each transformer layer's feed-forward network.")
    num_blocks: int = Field(1, gt=0, description="Transformer encoder layers, stacked (the paper's best is 1).")
    transformer_dropout: float = Field(
        0.1, ge=0, lt=1, description="Dropout on the attention weights and on each sublayer's output."
    )
    max_positions: int = Field(
        64,
        ge=2,
        description="Rows of the learned positional embedding: the target is position 0, the history's events "
        "1 (most recent) onwards; older events than max_positions - 1 share the last row.",
    )

    @model_validator(mode="after")
    def _check_heads(self):
        if self.embedding_dim % self.num_heads:
            raise ValueError(
                f"model.num_heads: {self.num_heads} does not divide model.embedding_dim {self.embedding_dim}"
            )
        return self


ATTENTION_KERNEL = (
    "How each HSTU layer evaluates its attention (the same numbers to float rounding). The layers run on each "
    "row's real tokens only (recsys_dist/models/hstu_jagged.py): rows sorted by length, blocks of 32 query "
    "positions, each over the rows that reach into it and the keys up to its end. dense: every block's scores "
    "kept for backward; chunked: each block recomputed in backward (torch.utils.checkpoint), keeping only its "
    "inputs; auto: chunked from 2^24 scores a layer (e.g. 64 full rows of 800 events), dense below (measured on "
    "CPU: keeping is 1.1-1.6x faster from 200 tokens, recomputing takes about 0.3x the memory at 64 full rows "
    "of 800; "
    "benchmarks/results/hstu_jagged_cpu2core_20261205.md). The padded layer (HSTULayer.forward, e.g. a "
    "pipeline stage) reads the same key: dense the whole [B, H, N, N] matrix at once, chunked 64 query rows at "
    "a time, auto chunked from 128 tokens (benchmarks/results/hstu_attention_cpu2core_20261205.md)."
)


class HSTUStackConfig(ModelConfig):
    """The HSTU layers' keys, shared by ``hstu`` and ``hstu_retrieval`` (Zhai et al., 2024)."""

    num_layers: int = Field(2, gt=0, description="HSTU layers, stacked (the paper's MovieLens models: 2 or 8).")
    num_heads: int = Field(1, gt=0, description="Attention heads of each HSTU layer.")
    attention_dim: int = Field(16, gt=0, description="Width of each head's query and key (d_qk).")
    linear_dim: int = Field(16, gt=0, description="Width of each head's value and gate U (d_v).")
    max_positions: int = Field(
        64,
        ge=2,
        description="Buckets of the relative position bias: one per distance (in events) below max_positions / 2, "
        "then four per doubling of the distance; larger distances share the last bucket.",
    )
    attention: Literal["auto", "dense", "chunked"] = Field(
        "auto",
        description=ATTENTION_KERNEL,
    )


class HSTUConfig(TargetSequenceConfig, HSTUStackConfig):
    """``model.name: hstu`` (Zhai et al., 2024; ``deep_layer_sizes`` are each task head's hidden sizes)."""

    name: Literal["hstu"] = "hstu"
    layer_dropout: float = Field(
        0.2, ge=0, lt=1, description="Dropout on each layer's Norm(A V) * U before its output projection f_2."
    )
    time_buckets: int = Field(
        0,
        ge=0,
        description="Buckets of the relative time bias rab^t (0: none, the position bias alone): a learned scalar "
        "per layer and bucket floor(ln(max(|dt|, 1)) / 0.301) of the time between the query's next token and "
        "the key, as the reference; larger ones share the last bucket. Needs data.schema.history.times.",
    )
    action_tokens: bool = Field(
        False,
        description="Add each history event's action embedding (data.schema.history.action, e.g. the rating: "
        "the <history>_action sequence's table) to its item's; the target token gets a learned action vector.",
    )


class MMoEConfig(TowersConfig):
    """``model.name: mmoe`` (``deep_layer_sizes`` are each expert's hidden sizes)."""

    name: Literal["mmoe"] = "mmoe"
    num_experts: int = Field(4, gt=0, description="Experts shared by every task (n in eq. 5).")


class PLEConfig(TowersConfig):
    """``model.name: ple`` (``deep_layer_sizes`` are each expert's hidden sizes)."""

    name: Literal["ple"] = "ple"
    num_levels: int = Field(2, gt=0, description="Extraction levels N (1 = CGC alone).")
    num_task_experts: int = Field(2, gt=0, description="Experts of each task's own, per level (m_k).")
    num_shared_experts: int = Field(2, gt=0, description="Experts shared by every task, per level (m_s).")


class TwoTowerConfig(ModelConfig):
    """``model.name: two_tower``."""

    name: Literal["two_tower"] = "two_tower"
    user_features: list[str] = Field(
        min_length=1, description="Categorical features of the user tower (the first one names the user)."
    )
    item_features: list[str] | None = Field(
        None, description="Categorical features of the item tower (None = every categorical feature not a user one)."
    )
    item_id: str = Field(
        description="The one-hot feature that names the item (one of item_features): the corpus, logQ, accidental hits."
    )
    tower_sizes: list[PositiveInt] = Field(
        [64], description="Hidden sizes of each tower's MLP ([] = one linear layer)."
    )
    output_dim: int = Field(32, gt=0, description="Width of the towers' L2-normalised outputs.")
    temperature: float = Field(0.1, gt=0, description="Divides the cosine similarity of the two towers (tau).")
    logq_correction: bool = Field(
        True,
        description="Subtract log q_j (the item's share of the training rows) from in-batch scores (Yi et al. eq. 3).",
    )

    @model_validator(mode="after")
    def _check_features(self):
        both = sorted(set(self.user_features) & set(self.item_features or []))
        if both:
            raise ValueError(f"model.item_features: {both} are user features too; a feature belongs to one tower")
        if self.item_features is not None and self.item_id not in self.item_features:
            raise ValueError(f"model.item_id: {self.item_id!r} must be one of model.item_features {self.item_features}")
        if self.item_id in self.user_features:
            raise ValueError(f"model.item_id: {self.item_id!r} is a user feature; name an item feature")
        return self

    def item_feature_names(self, sparse_names: list[str]) -> list[str]:
        """``item_features``, or every feature of ``sparse_names`` that is not a user feature."""
        if self.item_features is not None:
            return list(self.item_features)
        return [f for f in sparse_names if f not in self.user_features]


class NextItemConfig(ModelConfig):
    """The next-item retrieval models' keys (``hstu_retrieval`` and ``sasrec_retrieval``: one item
    table read by the item and its history, the in-batch sampled softmax)."""

    item_id: str = Field(
        description="The one-hot categorical feature of each row's item (the history's data.schema.history.item): "
        "the next item each row's history predicts, and the catalogue ranked at evaluation."
    )
    temperature: float = Field(0.05, gt=0, description="Divides the cosine of the user and item vectors (tau).")
    logq_correction: bool = Field(
        True,
        description="Subtract log q_j (the item's share of the training rows) from in-batch scores (Yi et al. eq. 3).",
    )


class HSTURetrievalConfig(HSTUStackConfig, NextItemConfig):
    """``model.name: hstu_retrieval`` (Zhai et al., 2024, next-item retrieval; docs/models.md): the
    item feature and its user history (``data.schema.history``) read one shared, sharded table."""

    name: Literal["hstu_retrieval"] = "hstu_retrieval"
    layer_dropout: float = Field(
        0.2, ge=0, lt=1, description="Dropout on the scaled history embeddings and in each HSTU layer."
    )


class SASRecRetrievalConfig(NextItemConfig):
    """``model.name: sasrec_retrieval`` (Kang & McAuley, 2018: SASRec, the baseline of
    ``hstu_retrieval``; docs/models.md): ``hstu_retrieval``'s data, table, loss and evaluation with
    SASRec's layers (``recsys_dist.models.sasrec_retrieval``) encoding the history."""

    name: Literal["sasrec_retrieval"] = "sasrec_retrieval"
    num_layers: int = Field(2, gt=0, description="SASRec blocks, stacked.")
    num_heads: int = Field(1, gt=0, description="Attention heads of each block; must divide embedding_dim.")
    max_length: int = Field(
        200,
        gt=0,
        description="Rows of the learned position embedding (positions counted from a history's first item); "
        "at least data.schema.history.max_length.",
    )
    layer_dropout: float = Field(
        0.2, ge=0, lt=1, description="Dropout on the input, the attention weights and in each feed-forward network."
    )

    @model_validator(mode="after")
    def _heads_divide(self) -> SASRecRetrievalConfig:
        if self.embedding_dim % self.num_heads:
            raise ValueError(f"model.num_heads={self.num_heads} must divide model.embedding_dim={self.embedding_dim}")
        return self


def _shipped(*classes: type[ModelConfig]) -> dict[str, type[ModelConfig]]:
    """``{model.name: class}``, the name read from each class's ``name: Literal[...]`` (written once)."""
    out = {}
    for cls in classes:
        (name,) = get_args(cls.model_fields["name"].annotation)
        out[name] = cls
    return out


SHIPPED_MODEL_CONFIGS: dict[str, type[ModelConfig]] = _shipped(
    DLRMConfig,
    DLRMDCNConfig,
    DCNv2Config,
    DeepFMConfig,
    WideDeepConfig,
    XDeepFMConfig,
    DINConfig,
    BSTConfig,
    HSTUConfig,
    MMoEConfig,
    PLEConfig,
    TwoTowerConfig,
    HSTURetrievalConfig,
    SASRecRetrievalConfig,
)
"""The shipped models' config classes by ``model.name``: ``recsys_dist.models.registry.model_config_class``
reads them without importing the zoo (tests/unit/api/test_registry.py checks they equal the registry's)."""


# The losses train.loss may name (recsys_dist.models.losses holds the functions).


@dataclass(frozen=True)
class LossParams:
    """The keyword parameters of a loss ``fn(logits, labels, weights, ...)`` after the first three.

    Attributes:
        required: parameters without a default: ``train.loss_args`` must give them.
        optional: parameters with a default.
        model_outputs: parameters the model's output gives (``register_loss(model_outputs=...)``),
            never ``train.loss_args``.
        takes_kwargs: the loss takes ``**kwargs`` (any ``train.loss_args`` key).
    """

    required: tuple[str, ...] = ()
    optional: tuple[str, ...] = ()
    model_outputs: tuple[str, ...] = ()
    takes_kwargs: bool = False


SHIPPED_LOSSES: dict[str, LossParams] = {
    "bce": LossParams(),
    "focal": LossParams(optional=("gamma", "alpha")),
    "mse": LossParams(),
    "in_batch_softmax": LossParams(
        optional=("positives_only",), model_outputs=("candidate_scores", "candidate_ids", "candidate_log_q")
    ),
}
"""The losses of ``recsys_dist.models.losses`` by name."""

REGISTERED_LOSSES: dict[str, Callable] = {}
"""``{name: fn}`` of every ``register_loss`` call: the shipped losses once
``recsys_dist.models.losses`` is imported, and the user's."""


def registered_loss_names() -> list[str]:
    """Every loss name ``train.loss`` may give (shipped or registered), sorted."""
    return sorted({*SHIPPED_LOSSES, *REGISTERED_LOSSES})


def find_loss(name: str) -> Callable:
    """The loss registered as ``name``, or the function at import path ``"package.module:fn"``
    (importing the user's module).

    Raises:
        ValueError: unknown name (a shipped loss is unknown here until
            ``recsys_dist.models.losses`` is imported), or an import path that does not resolve
            to a callable.
    """
    if is_import_path(name):
        fn = import_object(name, "train.loss")
        if not callable(fn):
            raise ValueError(f"train.loss: {name} is not callable")
        return fn
    if name not in REGISTERED_LOSSES:
        raise ValueError(
            f"train.loss: unknown loss {name!r}; registered: {', '.join(registered_loss_names())}, "
            "or 'package.module:fn'"
        )
    return REGISTERED_LOSSES[name]
