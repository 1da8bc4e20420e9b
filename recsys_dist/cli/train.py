"""``recsys-dist train``: load the config, then run (``recsys_dist.cli.train_run``). The config is
loaded before torch and TorchRec are imported, so that a config error answers in about a second."""

from __future__ import annotations

import argparse
import json

from recsys_dist.config.loader import load_config
from recsys_dist.distributed.plan_io import load_plan_file
from recsys_dist.errors import ConfigError


def cmd_train(args: argparse.Namespace) -> int:
    """``recsys-dist train``: the launcher, or one of torchrun's ranks (each runs this command).

    Raises:
        ConfigError: the config, an override or ``--plan`` is invalid, or the flags disagree.
    """
    cfg = load_config(args.config, _train_overrides(args))
    if args.resume_on_new_data and not args.resume:
        raise ConfigError("--resume-on-new-data goes with --resume (it allows resuming a checkpoint on other data)")
    from recsys_dist.cli import train_run  # torch and TorchRec: imported once the config is valid

    return train_run.run_train(args, cfg)


def _train_overrides(args: argparse.Namespace) -> list[str]:
    """The dotted overrides, plus ``--plan FILE`` as ``sharding.fixed_plan``.

    Raises:
        ConfigError: the plan file cannot be read.
    """
    overrides = list(args.overrides)
    if args.plan:
        try:
            fixed = load_plan_file(args.plan)
        except ValueError as err:
            raise ConfigError(str(err)) from None
        overrides.append(f"sharding.fixed_plan={json.dumps(fixed)}")
    return overrides
