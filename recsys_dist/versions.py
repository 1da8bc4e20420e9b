"""torch, fbgemm-gpu and torchrec load only in lock-step; check before importing them.

A mismatched set otherwise fails deep inside an import with ``undefined symbol`` or a
missing fbgemm operator, the most common TorchRec installation complaint.
"""

from __future__ import annotations

import os
from importlib import metadata

__version__ = "0.1.0"  # of recsys_dist (the package root re-exports it)

SUPPORTED = {"torch": "2.13.0", "fbgemm-gpu": "1.8.0", "torchrec": "1.8.0"}
_FBGEMM_DISTS = ("fbgemm-gpu", "fbgemm-gpu-cpu")


def _installed(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def installed_versions() -> dict[str, str | None]:
    fbgemm = next((v for d in _FBGEMM_DISTS if (v := _installed(d))), None)
    return {"torch": _installed("torch"), "fbgemm-gpu": fbgemm, "torchrec": _installed("torchrec")}


def check_versions() -> None:
    """Raise ImportError listing installed and supported versions if they differ.

    Local build tags are ignored (``2.13.0+cpu`` matches ``2.13.0``). Set
    ``RECSYS_DIST_SKIP_VERSION_CHECK=1`` to skip the check at your own risk.
    """
    if os.environ.get("RECSYS_DIST_SKIP_VERSION_CHECK") == "1":
        return
    found = installed_versions()
    bad = {k: v for k, v in found.items() if (v or "").split("+")[0] != SUPPORTED[k]}
    if bad:
        rows = "\n".join(f"  {k:<11} installed {found[k] or 'missing':<14} supported {SUPPORTED[k]}" for k in SUPPORTED)
        raise ImportError(
            "recsys_dist needs torch, fbgemm-gpu (or fbgemm-gpu-cpu) and torchrec in lock-step:\n"
            f"{rows}\n"
            "Install the supported set (`make install` does it), e.g. pip install torch==2.13.0 "
            "fbgemm-gpu-cpu==1.8.0 && pip install --no-deps torchrec==1.8.0"
        )
