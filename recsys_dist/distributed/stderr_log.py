"""A logging handler that writes to the current ``sys.stderr``."""

from __future__ import annotations

import logging
import sys


class StderrHandler(logging.StreamHandler):
    """Writes to whatever ``sys.stderr`` is now. A handler bound to the stream of its creation
    breaks when a caller (a test harness, a notebook) later replaces and closes that stream."""

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value) -> None:
        pass
