"""Unsharded models from sharded checkpoints: export, evaluate and predict in one process.

``recsys-dist export RUN_DIR --out DIR`` writes a self-contained model directory:

- ``model.safetensors``: every weight as a full tensor (safetensors never unpickles);
- ``config.yaml``: the resolved run config that rebuilds the model (table sizes as trained:
  ``recsys_dist.train.job.load_job`` reads it);
- ``preprocessing.json`` (and ``vocabulary.parquet`` under vocabulary mapping): how raw rows
  become ids and dense values, as the training conversion made them, and the versions that
  wrote the export (``recsys_dist.serve.score_inputs``). Scoring an export reads nothing else: the
  training data may change, move or be deleted.

``--format torchscript`` adds ``model.torchscript.pt`` and ``serving.json``, the model as a
TorchScript module loadable with torch alone (``recsys_dist.serve.torchscript``, docs/serving.md).

``evaluate`` and ``predict`` accept a run directory (its newest checkpoint), a checkpoint
directory written at any world size and sharding, a ``RUN/checkpoints/best`` or ``latest``
marker (``best``/``latest`` with ``--run-dir`` on the command line), or an export.
"""

from __future__ import annotations

import json
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch
import torch.distributed.checkpoint as dcp
import yaml
from safetensors.torch import load_file, save_file
from torch.distributed.checkpoint import CheckpointException

from recsys_dist.checkpoint.integrity import intact_checkpoint
from recsys_dist.checkpoint.meta import is_complete, latest_checkpoint, named_checkpoint, read_meta
from recsys_dist.checkpoint.safe_read import SafeLoadPlanner, SafeReader
from recsys_dist.data.loader import ParquetBatchLoader
from recsys_dist.data.record import RECORD_VERSION
from recsys_dist.errors import CheckpointError, DataError
from recsys_dist.files import write_atomic
from recsys_dist.models.managed import managed_metrics
from recsys_dist.models.task import CTRTask
from recsys_dist.serve.quantize import (
    QUANTIZATION_FILE,
    QUANTIZE_DTYPES,
    load_published_state,
    published_state,
    quantize_model,
    quantized_mode,
)
from recsys_dist.serve.score_inputs import (
    MANIFEST_FILE,
    PREPROCESSING_FILE,
    Preprocessing,
    check_conversion,
    converted_manifest,
    for_checkpoint,
    is_unlabelled,
    prepare_for_scoring,
    read_raw_columns,
    scoring_format,
)
from recsys_dist.serve.torchscript import save_artefact, serving_spec, to_torchscript
from recsys_dist.train.build import build_task
from recsys_dist.train.job import Job, load_job

MODEL_FILE = "model.safetensors"
FORMATS = ("safetensors", "torchscript")
# Columns every predictions file has (--keep-columns may not reuse these names).
OUTPUT_COLUMNS = ("row", "label", "logit", "probability")


@dataclass
class LoadedModel:
    """A model ready to score: its run (a :class:`~recsys_dist.train.job.Job` rebuilt from the
    saved config, its FeatureSpec sized as the model's tables), the unsharded CPU model in eval
    mode, a description of where it came from, and its preprocessing record (None when loaded
    without one, by :func:`load_model`)."""

    job: Job
    model: CTRTask
    source: str
    preprocessing: Preprocessing | None


def _unsharded(job: Job) -> CTRTask:
    """The unsharded model of ``job``, every table and parameter on the CPU (freshly initialised).
    Managed-collision tables get their remap with a history of ``train.batch_size`` x ranks rows
    per interval: the process group's ranks when one is up (a publisher inside training, whose
    gathered state holds the training ranks' history), else ``distributed.nproc_per_node``."""
    cpu = torch.device("cpu")
    up = torch.distributed.is_available() and torch.distributed.is_initialized()
    return build_task(job, job.features.on(cpu, cpu), world_size=torch.distributed.get_world_size() if up else None)


def load(path: str | Path, preprocessing: bool = True) -> LoadedModel:
    """The model at ``path``: a run directory (its newest complete checkpoint), a checkpoint
    directory or an export directory (one with ``quantization.json`` gets TorchRec's quantized
    embedding modules holding its int8 / int4 rows). With ``preprocessing``, also its preprocessing record:
    an export's own; a checkpoint's pinned one, or (first use) the one found in the
    conversion cache and pinned then (``recsys_dist.serve.score_inputs.for_checkpoint``).

    Raises:
        CheckpointError: nothing loadable at ``path``, or weights that do not fit the config;
            ``CheckpointDamaged`` when a file of the checkpoint differs from its recorded
            checksum (naming the file and an intact checkpoint beside it).
        DataError: the preprocessing record cannot be found or does not match (a
            vocabulary-mapped checkpoint whose training data changed, a damaged export).
    """
    path = Path(path)
    if (path / MODEL_FILE).is_file():
        job = load_job(yaml.safe_load((path / "config.yaml").read_text()), str(path / "config.yaml"))
        model = _unsharded(job)
        mode = _export_quantization(path)
        if mode != "none":  # int8 / int4 tables as published (recsys_dist.serve.quantize)
            load_published_state(quantize_model(model, mode), load_file(str(path / MODEL_FILE)), str(path / MODEL_FILE))
        else:
            try:
                model.load_state_dict(load_file(str(path / MODEL_FILE)), strict=True)
            except RuntimeError as err:
                raise CheckpointError(f"{path / MODEL_FILE} does not fit its config.yaml: {str(err)[:800]}") from None
        prep = _export_preprocessing(path, job) if preprocessing else None
        return LoadedModel(job, model.eval(), f"export {path}", prep)
    if path.is_file() and path.name in ("best", "latest") and path.parent.name == "checkpoints":
        path = named_checkpoint(path)  # the marker file of checkpoint.keep_best / the newest one
    ckpt = path if is_complete(path) else latest_checkpoint(path)
    if ckpt is None:
        raise CheckpointError(
            f"{path}: no model.safetensors and no complete checkpoint (run, checkpoint or export dir)"
        )
    intact_checkpoint(ckpt)  # a damaged file is named, never loaded
    meta, job = _checkpoint_job(ckpt)
    model = _unsharded(job)
    state = {"model": model.state_dict()}
    try:
        with warnings.catch_warnings():  # "torch.distributed is disabled ...": one process, as intended
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(state, storage_reader=SafeReader(ckpt), planner=SafeLoadPlanner(), no_dist=True)
    except CheckpointError:
        raise
    except (Exception, CheckpointException) as err:  # noqa: BLE001 - DCP's own exception types vary by failure
        raise CheckpointError(f"checkpoint {ckpt} cannot be read: {str(err)[:800]}") from None
    model.load_state_dict(state["model"])
    return _checkpoint_model(ckpt, meta, job, model, preprocessing)


def with_state(ckpt: Path, state: dict[str, torch.Tensor], model: CTRTask | None = None) -> LoadedModel:
    """What :func:`load` gives for checkpoint ``ckpt``, its weights taken from ``state`` (the
    unsharded model state dict as the training ranks hold it:
    ``recsys_dist.checkpoint.gather.gather_full_state``) instead of its shard files: only its
    ``meta.json`` and preprocessing record are read. ``model``: an unsharded model of that
    checkpoint's run to load ``state`` into (a publisher keeps one across versions: building
    one initialises every table); None builds one.

    Raises:
        CheckpointError: as :func:`load` (a checkpoint of a user model or an own loop), or
            ``state`` lacks a tensor of the model or does not fit it.
    """
    meta, job = _checkpoint_job(ckpt)
    model = _unsharded(job) if model is None else model
    wanted = model.state_dict()
    missing = [k for k in wanted if k not in state]
    if missing:
        raise CheckpointError(f"the model state for checkpoint {ckpt} lacks {missing[:5]}; publish from the checkpoint")
    try:
        model.load_state_dict({k: state[k] for k in wanted}, strict=True)
    except RuntimeError as err:
        raise CheckpointError(
            f"the model state for checkpoint {ckpt} does not fit its config: {str(err)[:800]}"
        ) from None
    return _checkpoint_model(ckpt, meta, job, model, True)


def _checkpoint_job(ckpt: Path) -> tuple[dict, Job]:
    """(meta.json, the run that rebuilds the model, table sizes as trained) of ``ckpt``: its
    ``data.num_embeddings`` are the trained sizes, so that an export's ``config.yaml`` rebuilds
    the same tables.

    Raises:
        CheckpointError: a checkpoint of an own loop or of a user model (no config to rebuild it).
    """
    meta = read_meta(ckpt)
    if meta.get("own_loop"):
        raise CheckpointError(
            f"checkpoint {ckpt} was written by recsys_dist.save_checkpoint in a loop of your own: it holds no "
            "config to rebuild the model from; load it into your module with recsys_dist.load_checkpoint"
        )
    if meta.get("user_model"):
        raise CheckpointError(
            f"checkpoint {ckpt} holds a model given to Trainer(model=...): its config names no model to rebuild "
            "it from (model.name would build another one); score it with Trainer.predict, in a Trainer given the "
            "same model= and resume= this run"
        )
    tree = meta["config"]
    if "num_embeddings" in meta:  # the sizes the data preparation decided (vocabulary mapping)
        tree = {**tree, "data": {**tree["data"], "num_embeddings": meta["num_embeddings"]}}
    return meta, load_job(tree, f"{ckpt}/meta.json")


def _checkpoint_model(ckpt: Path, meta: dict, job: Job, model: CTRTask, preprocessing: bool) -> LoadedModel:
    try:
        prep = for_checkpoint(ckpt, meta) if preprocessing else None
    except DataError as err:  # about the checkpoint, not the rows to score
        raise CheckpointError(str(err)) from None
    source = f"checkpoint {ckpt} (step {meta['step']}, saved on {meta['world_size']} rank(s))"
    return LoadedModel(job, model.eval(), source, prep)


def _export_quantization(path: Path) -> str:
    """``"none"``, or the mode of the quantized tables of the export at ``path`` (its
    ``quantization.json``, written by ``recsys_dist.serve.publish`` for a quantized publish).

    Raises:
        CheckpointError: the file is unreadable or names another mode.
    """
    file = path / QUANTIZATION_FILE
    if not file.is_file():
        return "none"
    try:
        mode = json.loads(file.read_text())["quantize"]
    except (ValueError, KeyError, TypeError):
        mode = None
    if mode not in QUANTIZE_DTYPES:
        raise CheckpointError(
            f'{file}: not a quantization record (want {{"quantize": "int8" or "int4"}}); export the model again'
        )
    return mode


def _export_preprocessing(path: Path, job: Job) -> Preprocessing:
    """The preprocessing record of the export at ``path``, checked against its config.

    Raises:
        DataError: the export has none (written by recsys_dist 0.1.0, before exports carried
            one), or its table sizes differ from ``config.yaml``'s.
    """
    prep = Preprocessing.load(path)
    if prep is None:
        raise DataError(
            f"export {path} holds no {PREPROCESSING_FILE}: it was written by an older recsys_dist (export without "
            f"a preprocessing record; this one reads exports of record version {RECORD_VERSION}). Export its run "
            "or checkpoint again with `recsys-dist export`"
        )
    if prep.num_embeddings != job.table_sizes:
        raise DataError(
            f"export {path}: preprocessing.json's table sizes {prep.num_embeddings} differ from config.yaml's "
            f"{job.table_sizes}; export the model again"
        )
    return prep


def load_model(path: str | Path) -> tuple[Job, CTRTask, str]:
    """(the run, unsharded CPU model in eval mode, description of the source) from a run
    directory, a checkpoint directory or an export directory (weights only: see :func:`load`
    for the preprocessing record that scoring raw rows needs). The run is a
    :class:`~recsys_dist.train.job.Job`: its sections (``job.model``, ``job.data``, ...) and
    FeatureSpec (``job.features``), sized as the model's tables.

    Raises:
        CheckpointError: nothing loadable at ``path``, or weights that do not fit the config.
    """
    m = load(path, preprocessing=False)
    return m.job, m.model, m.source


def export(path: str | Path, out: str | Path, format: str = "safetensors") -> list[Path]:
    """Write a self-contained export of a run, checkpoint or export into ``out``:
    ``model.safetensors``, ``config.yaml``, ``preprocessing.json`` (and ``vocabulary.parquet``);
    the model's ``export_extras`` hook's files (``two_tower``: ``item_ids.npy`` and
    ``item_embeddings.npy``, ``recsys_dist.models.retrieval.export_item_embeddings``); with ``format="torchscript"`` also ``model.torchscript.pt`` and ``serving.json``.
    Returns the paths written.

    Raises:
        CheckpointError: nothing loadable at ``path``; ``serving.ExportError``: the model
            cannot be written as TorchScript (nothing is written then).
        DataError: a vocabulary-mapped checkpoint whose vocabulary cannot be found as it was.
    """
    if format not in FORMATS:
        raise ValueError(f"format must be one of {FORMATS}, got {format!r}")
    return write_export(load(path), out, format, path)


def write_export(m: LoadedModel, out: str | Path, format: str, source: str | Path) -> list[Path]:
    """:func:`export` of a loaded model (``source``: where it came from, for messages). A model
    whose tables are quantized (``recsys_dist.serve.quantize``) is written with its quantized
    rows, uint8, and ``quantization.json``. Returns the paths written.

    Raises:
        CheckpointError: torchscript asked of a quantized model; ``serving.ExportError``: the
            model cannot be written as TorchScript (nothing is written then).
    """
    mode = quantized_mode(m.model)
    artefact = None
    if format == "torchscript":  # first: a model that cannot be traced leaves nothing behind
        if mode != "none":
            raise CheckpointError(
                f"{source}: its tables are quantized ({mode}), which TorchScript export does not write; "
                "export with format safetensors"
            )
        artefact = to_torchscript(m.job, m.model)
        spec = serving_spec(m.job, m.preprocessing.record["written_by"])
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    state = published_state(m.model)
    write_atomic(out / MODEL_FILE, lambda p: save_file(state, str(p)))  # mode as a plain open's, not 0600
    m.job.save_config(out / "config.yaml")
    written = [out / MODEL_FILE, out / "config.yaml", *m.preprocessing.save(out)]
    if mode != "none":
        write_atomic(out / QUANTIZATION_FILE, json.dumps({"quantize": mode}) + "\n")
        written.append(out / QUANTIZATION_FILE)
    extras = m.job.model_spec.export_extras  # two_tower: the item embeddings, for an ANN index
    if extras is not None:
        written += extras(m.job, m.model, m.preprocessing.record, source, out)
    if artefact is not None:
        written += save_artefact(artefact, spec, out)
    return written


@torch.no_grad()
def score(
    job: Job,
    model: CTRTask,
    data: str | Path,
    batch_size: int = 4096,
    preprocessing: Preprocessing | None = None,
    keep_columns: list[str] | tuple = (),
    reader=None,
) -> dict[str, np.ndarray]:
    """Logits and labels for every row of ``data``: a raw file in the model's data format
    (gzip ok), converted with the model's preprocessing record, or a converted split (a
    Parquet file that a ``manifest.json`` beside it lists) made with the same settings.
    ``preprocessing``: the record :func:`load` returns with the model (``LoadedModel``); it
    may be left out for a hash-mapped model (made from ``job``), never for a vocabulary-mapped
    one, whose training vocabulary is never rebuilt. ``reader``: the format object that reads a
    raw ``data`` (default ``scoring.scoring_format``: unlabelled when the label column is absent).

    Returns arrays ``logit`` (float32 [N]) and ``label`` (float32 [N], NaN for a file
    without labels: Criteo's 39-field test layout, a schema file without its label column),
    in file order, ``labelled`` (bool), ``columns`` (``keep_columns`` of the raw file),
    ``managed`` (managed-collision models: per feature the share of lookups that read the
    default row, see ``recsys_dist.models.managed.managed_metrics``; else ``{}``), and
    ``tasks`` / ``kinds``: the task names and kinds; with several tasks ``logit`` and
    ``label`` are [N, T], a column per task.

    Raises:
        DataError: a missing or malformed file, a converted split made with other settings
            (table sizes, vocabulary, transforms), a Parquet file of a format that has no raw
            Parquet, ``keep_columns`` absent or asked of a converted split.
    """
    prep = preprocessing
    if prep is None:
        if job.data.categorical_mapping == "vocabulary":
            raise ValueError(
                "score: a vocabulary-mapped model needs its preprocessing record (the training vocabulary): "
                "load it with recsys_dist.serve.export.load and pass preprocessing=loaded.preprocessing"
            )
        prep = Preprocessing.describe(job.data, job.fmt, job.table_sizes)
    data = Path(data)
    parquet, manifest, columns = _scoring_input(job, data, prep, keep_columns, reader)
    labelled = not is_unlabelled(manifest["format"])
    f = job.features
    loader = ParquetBatchLoader(
        str(parquet),
        batch_size,
        0,
        1,
        f.dense_names,
        f.keys,
        num_embeddings=f.id_bounds,
        label_columns=f.label_columns,  # no sample weights: every row is scored
    )
    logits, labels = [], []
    for batch in loader:
        _, (_, lg, lb, w) = model(batch)
        keep = w > 0
        logits.append(lg[keep]), labels.append(lb[keep])
    label = torch.cat(labels).numpy()
    for name, col in columns.items():
        if len(col) != len(label):
            raise DataError(
                f"--keep-columns: {data} gave {len(col)} values of column {name} for {len(label)} scored rows"
            )
    return {
        "logit": torch.cat(logits).numpy(),
        "label": label if labelled else np.full_like(label, np.nan),
        "labelled": labelled,
        "columns": columns,
        "managed": managed_metrics(model, "score"),
        "tasks": list(f.tasks),
        "kinds": list(f.task_kinds),
    }


def _scoring_input(
    job: Job, data: Path, prep: Preprocessing, keep_columns: list[str] | tuple, reader=None
) -> tuple[Path, dict, dict[str, np.ndarray]]:
    """(the converted Parquet file to score, its conversion's manifest, the kept raw columns)
    for ``data``: a converted split as it is, a raw file converted with ``prep``.

    Raises:
        DataError: as :func:`score`.
    """
    data = Path(data)
    if not data.is_file():
        raise DataError(f"{data}: {'is a directory, not a file' if data.is_dir() else 'file does not exist'}")
    manifest = converted_manifest(data)
    columns = {}
    if manifest is not None:
        check_conversion(manifest, data.parent, prep, f"{data} (a converted split: {data.parent / MANIFEST_FILE})")
        if keep_columns:
            raise DataError(
                f"--keep-columns: {data} is a converted split (listed in {data.parent / MANIFEST_FILE}); it holds "
                "ids, not the raw columns. Give the raw file to keep its columns"
            )
        parquet = data
    else:
        if job.fmt.spec is None and _is_parquet_file(data):  # a format without data.schema reads text
            raise DataError(
                f"{data} is a Parquet file but not a converted split (no {MANIFEST_FILE} beside it lists it), and "
                f"{job.data.format} raw data is text. Give the raw file, or a converted split where "
                "`recsys-dist preprocess` wrote it (beside its manifest.json)"
            )
        fmt = reader or scoring_format(job.data, data)
        prepared = prepare_for_scoring(job.data, data, prep.vocabulary, fmt)
        parquet = prepared.files["train"]
        manifest = json.loads((prepared.directory / MANIFEST_FILE).read_text())
        check_conversion(manifest, prepared.directory, prep, f"{data} (converted to {prepared.directory})")
        if keep_columns:
            columns = read_raw_columns(fmt, data, list(keep_columns))
    return parquet, manifest, columns


def _is_parquet_file(path: Path) -> bool:
    with open(path, "rb") as f:
        return f.read(4) == b"PAR1"


def write_predictions(scores: dict[str, np.ndarray], out: str | Path) -> None:
    """Columns ``row`` (int64, 0-based file order), the kept raw columns (``scores["columns"]``,
    if any), ``label`` (null when the input had none), ``logit``, ``probability``: CSV when
    ``out`` ends in ``.csv``, else Parquet."""
    logit = scores["logit"]
    if logit.ndim == 2:  # several tasks: label:<task>, logit:<task>, and probability:<task> (binary)
        cols: dict = {"row": np.arange(len(logit), dtype=np.int64), **scores.get("columns", {})}
        for t, (name, kind) in enumerate(zip(scores["tasks"], scores["kinds"])):
            y = scores["label"][:, t]
            cols[f"label:{name}"] = pa.array(y, mask=np.isnan(y))
            cols[f"logit:{name}"] = logit[:, t]
            if kind == "binary":
                cols[f"probability:{name}"] = (1.0 / (1.0 + np.exp(-logit[:, t].astype(np.float64)))).astype(np.float32)
        table = pa.table(cols)
    else:
        table = pa.table(
            {
                "row": np.arange(len(logit), dtype=np.int64),
                **scores.get("columns", {}),
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
