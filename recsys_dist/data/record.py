"""The preprocessing record (``preprocessing.json``): how a model's inputs are made from raw rows
(features, transforms, table sizes, the id mapping and its vocabulary), written beside every
checkpoint and export so that scoring never reads the training data again."""

from __future__ import annotations

import hashlib
import json
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa

from recsys_dist.data import mapping as mp
from recsys_dist.data.config import DataConfig
from recsys_dist.data.convert.manifest import table_coverage
from recsys_dist.data.formats.base import TRANSFORM_VERSION, RawFormat
from recsys_dist.errors import DataError
from recsys_dist.files import write_atomic
from recsys_dist.versions import __version__, installed_versions

PREPROCESSING_FILE = "preprocessing.json"
VOCABULARY_FILE = "vocabulary.parquet"  # the name the conversion gives it too (convert.manifest.VOCABULARY_FILE)
MANIFEST_FILE = "manifest.json"
RECORD_VERSION = 1


def written_by() -> dict:
    """Versions of what wrote an export: recsys_dist, torch, fbgemm-gpu, torchrec, pyarrow, numpy, Python."""
    return {
        "recsys_dist": __version__,
        **installed_versions(),
        "pyarrow": pa.__version__,
        "numpy": np.__version__,
        "python": ".".join(map(str, sys.version_info[:3])),
    }


def vocabulary_digest(path: Path, names: list[str]) -> str:
    """SHA-256 of the vocabularies of ``names`` in a ``vocabulary.parquet``: per feature its
    name, then its (key, id) pairs sorted by key; independent of how the file was written."""
    h = hashlib.sha256()
    for name, v in zip(names, mp.load_vocabularies(Path(path), names)):
        h.update(name.encode() + b"\0" + np.int64(len(v.keys)).tobytes())
        h.update(np.ascontiguousarray(v.keys, dtype=np.uint64).tobytes())
        h.update(np.ascontiguousarray(v.ids, dtype=np.int64).tobytes())
    return h.hexdigest()


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


@dataclass
class Preprocessing:
    """The record of how a model's inputs are made (``preprocessing.json``) and the directory
    holding its vocabulary file (under vocabulary mapping)."""

    record: dict
    directory: Path | None = None

    @property
    def vocabulary(self) -> Path | None:
        """The vocabulary file (vocabulary mapping), else None."""
        if self.record["categorical_mapping"]["kind"] != "vocabulary":
            return None
        return Path(self.directory) / self.record["categorical_mapping"]["file"]

    @property
    def num_embeddings(self) -> list[int]:
        return list(self.record["num_embeddings"])

    @classmethod
    def describe(
        cls,
        d: DataConfig,
        fmt: RawFormat,
        num_embeddings: list[int],
        conversion: Path | None = None,
        manifest: dict | None = None,
    ) -> Preprocessing:
        """The record of a model trained on data section ``d`` (format object ``fmt``) with tables
        of ``num_embeddings`` rows; under vocabulary mapping from its training conversion
        (``conversion``, a cache entry with its ``manifest``), whose vocabulary file it then refers to."""
        dense, sparse = list(fmt.dense_names), list(fmt.sparse_names)
        transforms = dict(manifest["transforms"]) if manifest else dict(fmt.transforms)
        kind = d.categorical_mapping
        mapping: dict = {"kind": kind, "missing_id": mp.MISSING_ID}
        if kind == "hash":
            mapping["rule"] = "id = 1 + key mod (num_embeddings - 1); a missing value -> 0"
        elif kind == "managed":
            mapping["rule"] = (
                "raw id = 1 + key mod (2^63 - 2); a missing value -> 0; the model's managed-collision state "
                "(in its weights) maps raw ids to rows, an id without a row -> row num_embeddings - 1"
            )
        else:
            if conversion is None:
                raise ValueError("a vocabulary-mapped model's record needs its training conversion")
            mapping.update(
                oov_id=mp.OOV_ID,
                min_count=d.min_count,
                rule=f"id = the key's id in {VOCABULARY_FILE} (feature, key, id); other keys -> {mp.OOV_ID} (OOV); "
                f"a missing value -> {mp.MISSING_ID}",
                file=VOCABULARY_FILE,
                digest=vocabulary_digest(Path(conversion) / VOCABULARY_FILE, sparse),
            )
        if manifest is not None and kind != "managed":
            # How many training values each table gives a row of its own, as the conversion
            # counted it (recsys_dist.data.coverage): None where not counted (e.g. a stream).
            mapping["coverage"] = table_coverage(manifest)
        record = {
            "record_version": RECORD_VERSION,
            "format": fmt.name,  # the manifest's format (data.format may be an import path)
            "schema": d.schema.model_dump(mode="json", by_alias=True) if d.schema is not None else None,
            "dense": dense,
            "sparse": sparse,
            "num_embeddings": [int(n) for n in num_embeddings],
            "categorical_mapping": mapping,
            "transforms": transforms,
            "transform_version": TRANSFORM_VERSION,
            # the training file's columns and its id columns of integers only (data.formats.ids):
            # None when not known (no conversion given, or one from before they were recorded)
            "raw_columns": manifest.get("raw_columns") if manifest else None,
            "integer_columns": manifest.get("integer_columns") if manifest else None,
            "training_conversion": None
            if manifest is None
            else {
                "directory": str(conversion),
                "source": manifest.get("source"),
                "rows": manifest.get("rows"),
                "manifest_sha256": file_sha256(Path(conversion) / MANIFEST_FILE),
            },
            "written_by": written_by(),
        }
        return cls(record, Path(conversion) if conversion is not None else None)

    def save(self, out: Path) -> list[Path]:
        """Write ``out/preprocessing.json`` (and ``out/vocabulary.parquet``), each under a
        temporary name renamed into place (``recsys_dist.files.write_atomic``), the JSON last.
        Returns the paths written."""
        out = Path(out)
        written = []
        vocab = self.vocabulary
        if vocab is not None:
            target = out / VOCABULARY_FILE
            if target.is_symlink() or vocab.resolve() != target.resolve():
                write_atomic(target, vocab.read_bytes())
            written.append(target)
        write_atomic(out / PREPROCESSING_FILE, json.dumps(self.record, indent=2) + "\n")
        return [out / PREPROCESSING_FILE, *written]

    @classmethod
    def load(cls, directory: Path) -> Preprocessing | None:
        """The record in ``directory`` (None if it holds none), its vocabulary checked against
        the recorded digest.

        Raises:
            DataError: the record is unreadable, or the vocabulary file is missing or differs.
        """
        directory = Path(directory)
        path = directory / PREPROCESSING_FILE
        if not path.is_file():
            return None
        try:
            record = json.loads(path.read_text())
            record["num_embeddings"], record["categorical_mapping"]["kind"]  # noqa: B018 - required keys
        except (ValueError, KeyError, TypeError) as err:
            raise DataError(f"{path}: not a valid preprocessing record ({err}); export the model again") from None
        p = cls(record, directory)
        vocab = p.vocabulary
        if vocab is not None:
            if not vocab.is_file():
                raise DataError(f"{vocab}: missing; {path} maps categories through it (export the model again)")
            if vocabulary_digest(vocab, record["sparse"]) != record["categorical_mapping"]["digest"]:
                raise DataError(
                    f"{vocab}: differs from the vocabulary {path} records (digest mismatch): the file was "
                    "changed or replaced; export the model again"
                )
        return p


# ---------------------------------------------------------------- checkpoints
