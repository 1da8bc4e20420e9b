"""Unsharded models from sharded checkpoints: export, evaluate and predict in one process.

``recsys-dist export RUN_DIR --out DIR`` writes ``DIR/model.safetensors`` (every weight as a
full tensor; safetensors never unpickles) and ``DIR/config.yaml`` (the resolved run config
that rebuilds the model). ``evaluate`` and ``predict`` accept a run directory (its newest
checkpoint), a checkpoint directory written at any world size and sharding, or an export.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch
import torch.distributed.checkpoint as dcp
import yaml
from safetensors.torch import load_file, save_file
from torch.distributed.checkpoint import CheckpointException

from recsys_dist.checkpoint import (
    CheckpointError,
    SafeLoadPlanner,
    SafeReader,
    in_saved_layout,
    is_complete,
    latest_checkpoint,
    read_meta,
)
from recsys_dist.config import RunConfig, config_from_dict, save_config
from recsys_dist.data import feature_names, prepare_for_scoring
from recsys_dist.data.loader import ParquetBatchLoader
from recsys_dist.models import CTRTask, build_model
from recsys_dist.models.build import table_sizes

MODEL_FILE = "model.safetensors"


def _unsharded(cfg: RunConfig) -> CTRTask:
    return build_model(cfg, torch.device("cpu"), tables_device=torch.device("cpu"))


def load_model(path: str | Path) -> tuple[RunConfig, CTRTask, str]:
    """(config, unsharded CPU model in eval mode, description of the source) from a run
    directory, a checkpoint directory or an export directory.

    Raises:
        CheckpointError: nothing loadable at ``path``, or weights that do not fit the config.
    """
    path = Path(path)
    if (path / MODEL_FILE).is_file():
        cfg = config_from_dict(yaml.safe_load((path / "config.yaml").read_text()), str(path / "config.yaml"))
        model = _unsharded(cfg)
        try:
            model.load_state_dict(load_file(str(path / MODEL_FILE)), strict=True)
        except RuntimeError as err:
            raise CheckpointError(f"{path / MODEL_FILE} does not fit its config.yaml: {str(err)[:800]}") from None
        return cfg, model.eval(), f"export {path}"
    ckpt = path if is_complete(path) else latest_checkpoint(path)
    if ckpt is None:
        raise CheckpointError(
            f"{path}: no model.safetensors and no complete checkpoint (run, checkpoint or export dir)"
        )
    meta = read_meta(ckpt)
    tree = meta["config"]
    if "num_embeddings" in meta:  # the sizes the data preparation decided (vocabulary mapping)
        tree = {**tree, "data": {**tree["data"], "num_embeddings": meta["num_embeddings"]}}
    cfg = config_from_dict(tree, f"{ckpt}/meta.json")
    model = _unsharded(cfg)
    state = {"model": model.state_dict()}
    try:
        dcp.load(in_saved_layout(state, ckpt), storage_reader=SafeReader(ckpt), planner=SafeLoadPlanner(), no_dist=True)
    except CheckpointError:
        raise
    except (Exception, CheckpointException) as err:  # noqa: BLE001 - DCP's own exception types vary by failure
        raise CheckpointError(f"checkpoint {ckpt} cannot be read: {str(err)[:800]}") from None
    model.load_state_dict(state["model"])
    return cfg, model.eval(), f"checkpoint {ckpt} (step {meta['step']}, saved on {meta['world_size']} rank(s))"


def export(path: str | Path, out: str | Path) -> Path:
    """Write ``out/model.safetensors`` and ``out/config.yaml`` from a run or checkpoint."""
    cfg, model, _ = load_model(path)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(out / MODEL_FILE))
    save_config(cfg, out / "config.yaml")
    return out


@torch.no_grad()
def score(cfg: RunConfig, model: CTRTask, data: str | Path, batch_size: int = 4096) -> dict[str, np.ndarray]:
    """Logits and labels for every row of ``data``: a raw file in the model's data format
    (gzip ok) converted with its own table sizes, or a Parquet file in the converted layout.

    Returns arrays ``logit`` (float32 [N]) and ``label`` (float32 [N], NaN for a file
    without labels: Kaggle's 39-field test layout), in file order, and ``labelled`` (bool).
    """
    data = Path(data)
    labelled = True
    if data.suffix == ".parquet":
        parquet = data
    else:
        prepared = prepare_for_scoring(cfg, data)
        parquet = prepared.files["train"]
        manifest = json.loads((prepared.directory / "manifest.json").read_text())
        labelled = manifest["format"] != "criteo_tsv_unlabelled"
    dense_names, sparse_names = feature_names(cfg)
    loader = ParquetBatchLoader(
        str(parquet), batch_size, 0, 1, dense_names, sparse_names, num_embeddings=table_sizes(cfg)
    )
    logits, labels = [], []
    for batch in loader:
        _, (_, lg, lb, w) = model(batch)
        keep = w > 0
        logits.append(lg[keep]), labels.append(lb[keep])
    label = torch.cat(labels).numpy()
    return {
        "logit": torch.cat(logits).numpy(),
        "label": label if labelled else np.full_like(label, np.nan),
        "labelled": labelled,
    }


def write_predictions(scores: dict[str, np.ndarray], out: str | Path) -> None:
    """Columns ``row`` (int64, 0-based file order), ``label`` (null when the input had none),
    ``logit``, ``probability``: CSV when ``out`` ends in ``.csv``, else Parquet."""
    logit = scores["logit"]
    table = pa.table(
        {
            "row": np.arange(len(logit), dtype=np.int64),
            "label": pa.array(scores["label"], mask=np.isnan(scores["label"])),
            "logit": logit,
            "probability": (1.0 / (1.0 + np.exp(-logit.astype(np.float64)))).astype(np.float32),
        }
    )
    if str(out).lower().endswith(".csv"):
        import pyarrow.csv as pacsv

        pacsv.write_csv(table, str(out))
    else:
        pq.write_table(table, str(out))
