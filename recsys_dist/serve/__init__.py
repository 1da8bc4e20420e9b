"""Serving: self-contained exports (``export``), the TorchScript artefact (``torchscript``) and
raw rows -> model inputs for predict and export (``scoring``). Nothing is re-exported here."""
