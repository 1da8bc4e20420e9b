"""``recsys-dist plan``: the sharding planner's placement for any cluster, without its hardware."""

from __future__ import annotations

import argparse
import json
import logging
import sys

from recsys_dist.config.job import resolve_job
from recsys_dist.config.loader import load_config
from recsys_dist.errors import ConfigError, PlanError
from recsys_dist.logs import quiet_third_party
from recsys_dist.train.dry_run import dry_run
from recsys_dist.train.pipelines import pipeline_problems
from recsys_dist.train.preflight import check_sections


def cmd_plan(args: argparse.Namespace) -> int:
    """Print the plan (text, or JSON with ``--json``); exit code 0, 1 when no placement fits
    (the planner's message), 2 for a bad ``--world-size`` / ``--local-world-size``.

    Raises:
        ConfigError: the config is invalid, or ``--local-world-size`` does not divide ``--world-size``.
    """
    if args.world_size <= 0 or (args.local_world_size is not None and args.local_world_size <= 0):
        print("recsys-dist: --world-size and --local-world-size must be > 0", file=sys.stderr)
        return 2
    local_world_size = args.local_world_size or min(args.world_size, 8)
    overrides = list(args.overrides)
    if args.hbm_gb is not None:
        overrides.append(f"sharding.hbm_gb={args.hbm_gb}")
    if args.ddr_gb is not None:
        overrides.append(f"sharding.ddr_gb={args.ddr_gb}")
    cfg = load_config(args.config, overrides, check_files=False)  # planning reads no data
    # At the planned world size, not distributed.nproc_per_node: the rules that depend on it
    # (pipeline stages dividing the ranks) are those of a run at --world-size.
    job = resolve_job(cfg, world_size=args.world_size)
    check_sections(job)  # the cross-section rules (RunConfig checks each section alone)
    if local_world_size > args.world_size or args.world_size % local_world_size:
        raise ConfigError(f"--local-world-size {local_world_size} must divide --world-size {args.world_size}")
    quiet_third_party()
    logging.getLogger().setLevel(logging.ERROR)  # the planner logs through the root logger
    try:
        pipeline = pipeline_problems(job.train.pipeline, args.device)
        report = dry_run(job, args.world_size, local_world_size, args.device, pipeline)
    except PlanError as err:
        print(f"recsys-dist plan: {err}", file=sys.stderr)
        return 1
    if args.json:
        plan = {
            "placements": [p.__dict__ for p in report.placements],
            "hbm_gb": report.hbm_gb,
            "ddr_gb": report.ddr_gb,
            "cost_ms": report.cost_ms,
            "imbalance": report.imbalance,
            "ledger": report.ledger.to_dict() if report.ledger else None,
            "coverage": report.coverage,
            "dense": report.dense,
        }
        print(json.dumps(plan, indent=2))
    else:
        print(report.text())
    return 0
