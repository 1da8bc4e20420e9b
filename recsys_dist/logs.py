"""Logging helpers every layer uses: a handler that writes to the current ``sys.stderr``, and
the filters that hide third-party warnings a user cannot act on."""

from __future__ import annotations

import logging
import sys
import warnings

from tqdm import tqdm


class StderrHandler(logging.StreamHandler):
    """Writes to whatever ``sys.stderr`` is now. A handler bound to the stream of its creation
    breaks when a caller (a test harness, a notebook) later replaces and closes that stream."""

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value) -> None:
        pass

    def emit(self, record: logging.LogRecord) -> None:
        # A progress bar holds the last line of stderr: a message written under it would be
        # glued to the bar. tqdm.write clears any bar, writes, and redraws it (a plain write
        # when there is none).
        try:
            tqdm.write(self.format(record), file=sys.stderr)
            self.flush()
        except Exception:  # noqa: BLE001 - logging must never raise; report as logging does
            self.handleError(record)


def quiet_third_party() -> None:
    """TorchRec and torch.fx warn on every run about internals a user cannot act on."""
    warnings.filterwarnings("ignore", category=UserWarning)
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    for name in ("torch.fx._symbolic_trace", "torchrec", "torch.distributed", "fbgemm_gpu"):
        logging.getLogger(name).setLevel(logging.ERROR)
