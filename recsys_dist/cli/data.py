"""``recsys-dist preprocess``: convert a config's raw data to Parquet splits (cached)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from recsys_dist.config.loader import load_config
from recsys_dist.data.config import describe_raw_path, raw_paths
from recsys_dist.data.resolve import data_format, prepare_from_config
from recsys_dist.errors import ConfigError
from recsys_dist.train.section_checks import Sections, config_problems


def cmd_preprocess(args: argparse.Namespace) -> int:
    """Convert (or find in the cache) the config's data and print where it went; exit code 0.

    Raises:
        ConfigError: the config is invalid (each section, or across sections as far as the data, tasks,
            evaluation and publishing go: ``recsys_dist.train.section_checks``; the model's own checks are
            ``train``'s), or ``data.raw_path`` is not given or not a file.
        DataError: the raw data is malformed.
    """
    # A model or loss named by import path is not imported (nor checked) here: it is train's,
    # and its module imports torch.
    cfg = load_config(args.config, args.overrides, import_user_code=False)
    # Data prepared for a config that train would refuse helps no one. The checks that need the
    # model (its registered checks, sharding) are train's: converting data imports no torch.
    problems = config_problems(
        Sections(cfg.data, cfg.train, cfg.eval, cfg.checkpoint, cfg.publish, data_format(cfg.data))
    )
    if problems:
        raise ConfigError("invalid config:\n" + "\n".join(f"  {p}" for p in problems))
    if cfg.data.stream is not None:
        raise ConfigError(
            "data.stream: a stream's partitions are converted as they land, by `recsys-dist train` "
            "(docs/online.md); `recsys-dist preprocess` converts a config's data.raw_path"
        )
    missing = [r for r in raw_paths(cfg.data) if not Path(r).is_file()]
    if cfg.data.raw_path is None or missing:
        raise ConfigError(f"data.raw_path: {missing[0] if missing else None} is not a file")
    prepared = prepare_from_config(cfg.data, progress=not args.quiet)
    manifest = json.loads((prepared.directory / "manifest.json").read_text())
    rows = ", ".join(f"{k} {v:,}" for k, v in prepared.rows.items())
    print(
        f"recsys-dist: {describe_raw_path(manifest['source'])} -> {prepared.directory}\n  rows: {rows}; "
        f"skipped {manifest['rows_skipped']:,}\n  manifest: {prepared.directory / 'manifest.json'}"
    )
    return 0
