"""One rank of the padded-last-batch check (run via run_ranks): train the quickstart twice,
``data.remainder: pad`` then ``drop``, on 800 training rows with a global batch of 96 (the
last global batch holds 32 real rows: on 2 and 3 ranks some ranks hold only padding); then
the two-task MMoE config (``configs/movielens_multitask.yaml``) with sample weights
(``data.schema.weight``) on a small generated ratings file (``write_weighted_ratings``)."""

from __future__ import annotations

import os
from pathlib import Path

from recsys_dist.api import Trainer
from recsys_dist.config.loader import load_config
from recsys_dist.distributed.tables import gather_full_state_dict

ROOT = Path(__file__).resolve().parents[3]
GLOBAL_BATCH = 96
OVERRIDES = [
    "data.num_rows=1000",
    "data.num_embeddings=1000",
    "train.epochs=2",
    "train.log_every_n_steps=1",
    "train.progress_bar=false",
    "train.deterministic=true",
    "train.timing_every_n_steps=null",
    "checkpoint.enabled=false",
]


def train_pad_and_drop(rank: int, world_size: int, cache: str, out: str) -> dict:
    os.environ["RECSYS_DIST_CACHE"] = cache
    results = {}
    for remainder in ("pad", "drop"):
        cfg = load_config(
            ROOT / "configs" / "criteo_quickstart.yaml",
            [
                *OVERRIDES,
                f"data.remainder={remainder}",
                f"distributed.nproc_per_node={world_size}",
                f"train.batch_size={GLOBAL_BATCH // world_size}",
            ],
        )
        with Trainer(cfg, Path(out) / f"{remainder}-{world_size}") as trainer:
            summary = trainer.fit()
            weights = gather_full_state_dict(trainer.model.state_dict())
        results[remainder] = {"summary": summary, "weights": weights if rank == 0 else None}
    cfg = load_config(
        ROOT / "configs" / "movielens_multitask.yaml",
        [
            *OVERRIDES[2:],
            f"data.raw_path={Path(out) / 'weighted.csv'}",
            "data.schema.weight=w",
            f"distributed.nproc_per_node={world_size}",
            f"train.batch_size={GLOBAL_BATCH // world_size}",
        ],
    )
    with Trainer(cfg, Path(out) / f"weighted-{world_size}") as trainer:
        results["weighted"] = {"summary": trainer.fit()}
    return results


def write_weighted_ratings(path: Path, n: int = 1000) -> None:
    """``n`` ratings (userId, movieId, rating, genres, w) with uneven sample weights ``w``
    in {0, 0.25, 0.5, 1, 2, 6}: the ranks' weight sums of a batch are far from their row shares."""
    import numpy as np

    rng = np.random.default_rng(0)
    genres = ["Drama", "Comedy", "Drama|Romance", "Action|Thriller", "Animation|Children|Comedy"]
    lines = ["userId,movieId,rating,timestamp,genres,w"]
    for i in range(n):
        w = rng.choice([0.0, 0.25, 0.5, 1.0, 2.0, 6.0])
        lines.append(
            f"{rng.integers(40)},{rng.integers(120)},{rng.integers(1, 11) / 2},{i},{genres[rng.integers(5)]},{w}"
        )
    path.write_text("\n".join(lines) + "\n")
