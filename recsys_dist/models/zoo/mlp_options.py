"""Options shared by the models with a deep MLP (DCN-V2, DeepFM, Wide & Deep, xDeepFM, DIN, BST,
MMoE, PLE), by the multi-task models' towers (MMoE, PLE) and by the target-attention models (DIN,
BST)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from recsys_dist.models.config import ModelConfig


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
    """Keys of a model that attends from the scored item to the user's history (DIN, BST)."""

    target_feature: str = Field(description="The categorical feature of the item being scored (e.g. movieId).")
