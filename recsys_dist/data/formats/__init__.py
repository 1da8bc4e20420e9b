"""Raw input formats: the interface and registry (``base``), and one module per format."""
