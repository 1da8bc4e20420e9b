"""Start the worker group with torch.distributed's elastic launcher (torchrun's code)."""

from __future__ import annotations

import os
import sys
from pathlib import Path


def launch_workers(run_dir: Path, nproc_per_node: int, max_restarts: int, extra_args: list[str] = ()) -> None:
    """Run ``recsys-dist train`` on ``nproc_per_node`` local ranks via ``torch.distributed.run``.

    The workers read the resolved ``run_dir/config.yaml``. Raises
    ``torch.distributed.elastic.multiprocessing.errors.ChildFailedError`` when a rank fails
    (after ``max_restarts`` restarts of the whole group); its message carries the first
    failing rank's traceback.
    """
    from torch.distributed.run import get_args_parser, run

    # torchrun would force OMP_NUM_THREADS=1 with a warning; give each rank its share.
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc_per_node)))
    args = get_args_parser().parse_args(
        [
            "--standalone",
            f"--nproc_per_node={nproc_per_node}",
            f"--max_restarts={max_restarts}",
            "--module",
            "recsys_dist.cli",
            "train",
            "--config",
            str(run_dir / "config.yaml"),
            "--run-dir",
            str(run_dir),
            "--worker",
            *extra_args,
        ]
    )
    # The launcher's own INFO lines would drown the summary.
    import logging

    logging.getLogger("torch.distributed.elastic").setLevel(logging.WARNING)
    sys.stdout.flush()
    run(args)
