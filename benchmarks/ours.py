"""Our trainer as a contender of benchmarks/run.py and benchmarks/step_overhead.py: the config of
a benchmark run (:func:`overrides`, :func:`load`) and one more epoch of the Trainer, timed
(:func:`trainer_epoch`)."""

from __future__ import annotations

import json
import logging
import warnings
from pathlib import Path

from harness import CONFIGS

CONFIG_FILES = {"dlrm": "criteo_quickstart.yaml", "deepfm": "criteo_deepfm.yaml", "mlperf": "mlperf_dlrmv2.yaml"}


def overrides(spec: dict, model: str) -> list[str]:
    """Config overrides shared by every trainer run of a benchmark: ``spec`` holds ``raw``,
    ``cache``, ``batch``, ``reps`` (epochs), ``world``, ``device`` and optionally
    ``precision``, ``rows_per_table``, ``max_rows`` (mlperf: each table's row cap)."""
    common = [
        f"data.raw_path={spec['raw']}",
        f"data.cache_dir={spec['cache']}",
        "data.split=[0.98,0.01,0.01]",
        f"train.batch_size={spec['batch']}",
        f"train.epochs={spec['reps']}",
        "train.progress_bar=false",
        "checkpoint.enabled=false",
        f"distributed.nproc_per_node={spec['world']}",
        f"distributed.device={spec['device']}",
        "eval.batch_size=1024",
        f"train.precision={spec.get('precision', 'fp32')}",
    ]
    if model == "mlperf":
        from recsys_dist.config.loader import load_config

        sizes = load_config(CONFIGS / CONFIG_FILES["mlperf"]).data.num_embeddings
        capped = [min(n, spec["max_rows"]) for n in sizes]
        return common + [f"data.num_embeddings={json.dumps(capped)}", "data.multi_hot_sizes=null"]
    rows = [f"data.num_embeddings={spec['rows_per_table']}"] if spec.get("rows_per_table") else []
    return common + rows + ["sharding.sharding_types=[table_wise]"]


def load(spec: dict, name: str):
    """The run config of model ``name`` (dlrm, deepfm, mlperf) with :func:`overrides`."""
    from recsys_dist.config.loader import load_config

    return load_config(CONFIGS / CONFIG_FILES[name], overrides(spec, name))


def trainer_epoch(cfg, run_dir: Path, with_trainer: bool = False):
    """(``epoch()`` -> global samples/s of one more epoch of our trainer, steps per epoch[, the
    Trainer]). Call on the ranks of ``run_ranks`` (the Trainer uses the group it finds)."""
    from recsys_dist.api import Trainer

    trainer = Trainer(cfg, run_dir)  # on the group run_ranks made, which it leaves open

    def epoch() -> float:
        rows, secs = trainer.rows_trained, trainer.train_seconds
        trainer.train_epoch()
        return (trainer.rows_trained - rows) / (trainer.train_seconds - secs)

    return (epoch, len(trainer.loaders.train)) + ((trainer,) if with_trainer else ())


def quiet() -> None:
    """Silence warnings and logging below ERROR (in a rank: the table is what matters)."""
    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
