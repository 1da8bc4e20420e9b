"""The shipped models, one family per file; each registers itself with ``register_model``.

Every module in this package is imported the first time the registry is read, so a new
model is one new file here: its config class, its builder and the ``register_model`` call.
"""
