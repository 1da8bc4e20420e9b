"""``recsys-dist export``, ``evaluate`` and ``predict``: a trained model (a run, a checkpoint, or
an export) written out, scored against labels, or applied to a data file."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from recsys_dist.checkpoint.meta import named_checkpoint
from recsys_dist.errors import CheckpointError, ConfigError, DataError
from recsys_dist.logs import quiet_third_party
from recsys_dist.serve.export import OUTPUT_COLUMNS, export, load, score, write_predictions
from recsys_dist.serve.publish import export_from_publish, latest_version, newest_intact, read_manifest
from recsys_dist.train.metrics import binary_metrics, task_metrics


def model_path(args: argparse.Namespace) -> Path:
    """The MODEL argument of export / evaluate / predict: ``best`` or ``latest`` of
    ``--run-dir``, or a path as given.

    Raises:
        ConfigError: ``best`` / ``latest`` without ``--run-dir``, or ``--run-dir`` with a path;
            a ``--run-dir`` that does not exist or holds no ``checkpoints/``; a MODEL path that
            does not exist.
        CheckpointError: the run has no such checkpoint.
    """
    if args.model in ("best", "latest"):
        if not args.run_dir:
            raise ConfigError(f"MODEL {args.model} names a checkpoint of a run: give the run with --run-dir")
        run_dir = Path(args.run_dir)
        if not run_dir.is_dir():
            raise ConfigError(
                f"--run-dir {run_dir}: {'is a file' if run_dir.exists() else 'does not exist'}; give the directory "
                "of a training run (runs/<config>-<time>, or the --run-dir it was trained with)"
            )
        if not (run_dir / "checkpoints").is_dir():
            raise ConfigError(
                f"--run-dir {run_dir}: has no checkpoints/ folder, so no {args.model} checkpoint (not a run "
                "directory, or a run trained with checkpoint.enabled: false, or one that has not yet saved one)"
            )
        return named_checkpoint(args.model, run_dir)
    if args.run_dir:
        raise ConfigError(f"--run-dir goes with MODEL best or latest; {args.model} is a path already")
    if not Path(args.model).exists():
        raise ConfigError(
            f"MODEL {args.model}: does not exist; give a run, checkpoint or export directory, or best / latest "
            "with --run-dir RUN"
        )
    return Path(args.model)


def cmd_export(args: argparse.Namespace) -> int:
    """Write MODEL (or the folded versions of ``--from-publish DIR``) as a self-contained
    unsharded export in ``--out``; exit code 0.

    Raises:
        ConfigError: ``--out`` is a file, MODEL and --from-publish both or neither given,
            ``--version`` without --from-publish, or MODEL is wrong (:func:`model_path`).
        CheckpointError: the checkpoint or publish cannot be read or exported.
    """
    quiet_third_party()
    if Path(args.out).exists() and not Path(args.out).is_dir():
        raise ConfigError(f"--out {args.out} is a file; give a directory (it is created if missing)")
    if (args.model is None) == (args.from_publish is None):
        raise ConfigError("export: give MODEL (a run, checkpoint or export) or --from-publish DIR, not both")
    if args.version is not None and args.from_publish is None:
        raise ConfigError(f"--version {args.version} picks a version of --from-publish DIR; MODEL has none")
    if args.from_publish is not None:
        version, written = _export_published(args)
    else:
        written = export(model_path(args), args.out, args.format or "safetensors")
    source = args.model
    if args.from_publish is not None:
        step = next(v["step"] for v in read_manifest(args.from_publish)["versions"] if v["version"] == version)
        source = f"version {version} (step {step}) of the publish {args.from_publish}"
    print(f"recsys-dist: exported {source} to {args.out}: {', '.join(p.name for p in written)}")
    return 0


def _export_published(args: argparse.Namespace) -> tuple[int, list[Path]]:
    """(the version exported, the paths written) for ``--from-publish DIR [--version N]``: N,
    or the latest; a latest that cannot be loaded (a damaged or missing file, a gap) gives way
    to the newest intact version, with a warning naming why. A version asked for is never
    replaced by another.

    Raises:
        CheckpointError: version N cannot be loaded; no version at all can.
    """
    if args.version is not None:
        return args.version, export_from_publish(args.from_publish, args.out, args.format, args.version)
    version = latest_version(args.from_publish)  # read once: a version may land meanwhile
    try:
        return version, export_from_publish(args.from_publish, args.out, args.format, version)
    except CheckpointError as err:
        intact, _ = newest_intact(args.from_publish, below=version)
        if version is None or intact is None:
            raise
        print(
            f"recsys-dist: warning: version {version}, the latest of {args.from_publish}, cannot be loaded ({err}); "
            f"exporting version {intact}, the newest intact one (--version N picks one)",
            file=sys.stderr,
        )
        return intact, export_from_publish(args.from_publish, args.out, args.format, intact)


def cmd_evaluate(args: argparse.Namespace) -> int:
    """Print MODEL's metrics on ``--data`` as one JSON line; exit code 0.

    Raises:
        DataError: the data has no label column, or is malformed.
        ConfigError / CheckpointError: MODEL is wrong (:func:`model_path`).
    """
    quiet_third_party()
    m = load(model_path(args))
    scores = score(m.job, m.model, args.data, preprocessing=m.preprocessing)
    if not scores["labelled"]:
        raise DataError(
            f"{args.data}: no label column (Criteo's 39-field test layout, or no data.schema.label column), so "
            "there is nothing to evaluate against; `recsys-dist predict` scores it"
        )
    logit, label = torch.from_numpy(scores["logit"]), torch.from_numpy(scores["label"])
    if logit.dim() == 2:  # several tasks: <task>/<metric>, unweighted (every row of the file counts 1)
        metrics = {"num_examples": len(logit)}
        for t, (name, kind) in enumerate(zip(scores["tasks"], scores["kinds"])):
            got = task_metrics(logit[:, t], label[:, t], torch.ones(len(logit)), kind)
            metrics.update({f"{name}/{k}": v for k, v in got.items() if k not in ("num_examples", "weight_sum")})
    else:
        metrics = binary_metrics(logit, label)
    print(json.dumps({"model": m.source, "data": str(args.data), **metrics, **scores.get("managed", {})}))
    return 0


def keep_columns(text: str | None) -> list[str]:
    """``--keep-columns A,B`` -> ``["A", "B"]`` ([] when not given).

    Raises:
        ConfigError: an empty or repeated name, or one of the output's own columns.
    """
    if not text:
        return []
    names = [c.strip() for c in text.split(",")]
    bad = [c for c in names if not c] or [c for c in names if names.count(c) > 1]
    if bad:
        raise ConfigError(f"--keep-columns {text!r}: an empty or repeated column name; give names like id,user")
    taken = [c for c in names if c in OUTPUT_COLUMNS]
    if taken:
        raise ConfigError(
            f"--keep-columns: {', '.join(taken)} is an output column already ({', '.join(OUTPUT_COLUMNS)}); "
            "the label is written as 'label'"
        )
    return names


def cmd_predict(args: argparse.Namespace) -> int:
    """Write MODEL's per-row predictions on ``--data`` to ``--out`` (Parquet, or CSV); exit code 0.

    Raises:
        ConfigError: ``--out`` is a directory or in a missing folder, bad ``--keep-columns``,
            or MODEL is wrong (:func:`model_path`).
        DataError: the data is malformed.
    """
    quiet_third_party()
    out = Path(args.out)
    if out.is_dir() or not out.parent.is_dir():
        raise ConfigError(
            f"--out {out}: {'is a directory' if out.is_dir() else f'folder {out.parent} does not exist'}; "
            "give a file path such as preds.parquet in an existing folder"
        )
    keep = keep_columns(args.keep_columns)
    m = load(model_path(args))
    scores = score(m.job, m.model, args.data, preprocessing=m.preprocessing, keep_columns=keep)
    write_predictions(scores, args.out)
    print(f"recsys-dist: {len(scores['logit'])} predictions from {m.source} -> {args.out}")
    for f, st in scores.get("managed", {}).get("managed", {}).items():  # ids without a row are counted, never silent
        print(f"  managed {f}: {st['default_share'] or 0:.2%} of lookups read the default row (id not in the table)")
    return 0
