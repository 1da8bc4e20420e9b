"""One rank of the all-padding-rank check (run via run_ranks): every model of the zoo, the
managed-collision path and a user model (``examples/custom_model``), one after another, each
for one epoch of 88 training rows (``data.num_rows=110``, a position split) with a global
batch of 64. The epoch's second and last global batch holds 24 real rows: on 2 ranks (32 rows
each) rank 1's share is padding only (``_empty_row``: every list feature, and so every
history, empty); the 11-row validation and test splits leave rank 1 only padding as well.

``CASES``: name -> (config under ``configs/`` or the repository, overrides). Each case runs
the shipped config with dropout off, so that 1 and 2 ranks draw nothing differently."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from recsys_dist.api import Trainer
from recsys_dist.config.loader import load_config

ROOT = Path(__file__).resolve().parents[3]
GLOBAL_BATCH = 64
COMMON = [
    "data.num_rows=110",
    "train.epochs=1",
    "train.log_every_n_steps=1",
    "train.progress_bar=false",
    "train.deterministic=true",
    "train.timing_every_n_steps=null",
    "checkpoint.enabled=false",
]
POSITION = ["data.split={by: position, fractions: [0.8, 0.1, 0.1]}"]  # replaces a template's time split
# The sequence templates' early stopping, best checkpoint and mid-epoch validation, off.
TEMPLATE = [*POSITION, "checkpoint.keep_best=false", "train.early_stopping=null", "eval.every_n_steps=null"]
TEMPLATE.append("train.pipeline=sparse_dist")  # the pipeline that hung
SMALL_DLRM = ["model.name=dlrm_dcnv2", "model.dcn_num_layers=2", "model.dcn_low_rank_dim=8"]
CASES = {
    "dlrm": ("configs/criteo_quickstart.yaml", []),
    "dlrm_dcnv2": ("configs/criteo_quickstart.yaml", SMALL_DLRM),
    "dcnv2": ("configs/criteo_dcnv2.yaml", []),
    "deepfm": ("configs/criteo_deepfm.yaml", []),
    "wide_deep": ("configs/criteo_wide_deep.yaml", []),
    "xdeepfm": ("configs/criteo_xdeepfm.yaml", []),
    "user_model": ("examples/custom_model/config.yaml", []),
    "din": ("configs/movielens_din.yaml", TEMPLATE),
    "bst": ("configs/movielens_bst.yaml", [*TEMPLATE, "model.transformer_dropout=0.0"]),
    "hstu": ("configs/movielens_hstu.yaml", [*TEMPLATE, "model.layer_dropout=0.0"]),
    # the chunked attention kernel (torch.utils.checkpoint in backward) under DDP: hstu's losses
    "hstu_chunked": ("configs/movielens_hstu.yaml", [*TEMPLATE, "model.layer_dropout=0.0", "model.attention=chunked"]),
    "mmoe": ("configs/movielens_multitask.yaml", POSITION),
    "ple": ("configs/movielens_ple.yaml", POSITION),
    "two_tower": ("configs/movielens_two_tower.yaml", POSITION),
    "managed": ("configs/movielens_managed.yaml", POSITION),
}


def train_every_model(rank: int, world_size: int, cache: str, out: str, names: list[str]) -> dict:
    """Train each case of ``names`` into ``out/<name>-<world_size>``; returns name -> summary."""
    os.environ["RECSYS_DIST_CACHE"] = cache
    sys.path.insert(0, str(ROOT / "examples" / "custom_model"))  # the user model's import path
    results = {}
    for name in names:
        path, overrides = CASES[name]
        cfg = load_config(
            ROOT / path,
            [
                *COMMON,
                *overrides,
                f"distributed.nproc_per_node={world_size}",
                f"train.batch_size={GLOBAL_BATCH // world_size}",
            ],
        )
        with Trainer(cfg, Path(out) / f"{name}-{world_size}") as trainer:
            results[name] = trainer.fit()
    return results
