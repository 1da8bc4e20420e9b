"""Reading DCP checkpoints without unpickling anything but checkpoint metadata.

DCP stores a checkpoint's index (``.metadata``) as a pickle and its non-tensor entries with
``torch.save``; :class:`SafeReader` and :class:`SafeLoadPlanner` read both so that a tampered
file can construct nothing but DCP's metadata types and tensors.
"""

from __future__ import annotations

import io
import pickle
from pathlib import Path

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import StorageMeta

from recsys_dist.errors import CheckpointError

# Everything DCP's own ``.metadata`` pickle may name (torch 2.13): its metadata dataclasses,
# torch.Size, dtypes, layouts and the path of the checkpoint. Nothing else is constructed.
_METADATA_CLASSES = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata",
        "MetadataIndex",
        "StorageMeta",
        "TensorProperties",
        "TensorStorageMetadata",
        "ChunkStorageMetadata",
        "BytesStorageMetadata",
        "_MEM_FORMAT_ENCODING",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size"},
    "pathlib": {"PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"},
    "collections": {"OrderedDict"},
}


class _MetadataUnpickler(pickle.Unpickler):
    def __init__(self, file, path: Path) -> None:
        super().__init__(file)
        self._path = path

    def find_class(self, module: str, name: str):
        allowed = name in _METADATA_CLASSES.get(module, ()) or (
            module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        )
        if not allowed:
            raise CheckpointError(
                f"{self._path}: refusing to load {module}.{name}; a DCP .metadata file holds only checkpoint "
                "metadata, so this file was not written by recsys_dist / torch.distributed.checkpoint. "
                "Load checkpoints only from sources you trust."
            )
        return super().find_class(module, name)


class SafeReader(FileSystemReader):
    """DCP's file reader whose ``.metadata`` pickle may construct only DCP's metadata types.

    DCP stores its checkpoint index as a pickle; a plain ``pickle.load`` of a tampered file
    could run arbitrary code. Tensor data is read by DCP with ``torch.load(weights_only=True)``.

    Raises:
        CheckpointError: the metadata names any other class or function, or is not a pickle.
    """

    def read_metadata(self, *args, **kwargs):
        path = Path(self._get_metadata_path(kwargs.get("rank")))
        try:
            metadata = _MetadataUnpickler(io.BytesIO(path.read_bytes()), path).load()
        except CheckpointError:
            raise
        except Exception as err:  # noqa: BLE001 - truncated or garbage files fail in many ways
            raise CheckpointError(
                f"{path}: not a readable DCP metadata file ({type(err).__name__}: {err}); "
                "the checkpoint is damaged, resume from an older one"
            ) from None
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's load planner, reading non-tensor entries with ``torch.load(weights_only=True)``
    (DCP's default unpickles them fully)."""

    def load_bytes(self, read_item, value) -> None:
        obj = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


def checkpoint_keys(path: Path) -> set[str]:
    """The flattened names of every entry saved in the checkpoint at ``path``
    (``"model.<fqn>"``, ``"optimizer.<...>"``, ``"rng.rank_<r>"``)."""
    return set(SafeReader(path).read_metadata().state_dict_metadata)
