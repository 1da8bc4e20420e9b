"""The ``recsys-dist`` command line (``main``) and its ``report`` / ``compare`` commands."""
