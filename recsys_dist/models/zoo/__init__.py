"""The shipped models, one family per file; each registers itself with ``register_model``.

Every module in this package is imported the first time the registry is read, so a new
model is one new file here (its builder and the ``register_model`` call) and its config class
in ``recsys_dist.models.config`` (torch-free, listed in ``SHIPPED_MODEL_CONFIGS``).
"""
