"""Options shared by the models with a deep MLP (DCN-V2, DeepFM, Wide & Deep, xDeepFM)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from recsys_dist.models.config import ModelConfig


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
        if not self.deep_layer_sizes or any(s <= 0 for s in self.deep_layer_sizes):
            raise ValueError(
                f"model.deep_layer_sizes must be a non-empty list of positive ints, got {self.deep_layer_sizes}"
            )
        return self

    def mlp_kwargs(self) -> dict:
        """The keyword arguments every deep-MLP module of ``recsys_dist.models.ctr`` takes."""
        return dict(dropout=self.dropout, norm=self.norm, activation=self.activation, init_std=self.mlp_init_std)
