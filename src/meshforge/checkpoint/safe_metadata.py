"""DCP's ``.metadata`` read as data, never as code.

torch's ``FileSystemReader`` reads a checkpoint's ``.metadata`` with ``pickle.load``, and
loads any non-tensor entry with ``torch.load(weights_only=False)``: a checkpoint from
elsewhere could run code the moment it is opened. meshforge never lets DCP do either. The
metadata goes through an unpickler that admits only the classes DCP's metadata is made of
(and torch's sizes, dtypes and layouts); the result is then checked to describe tensors
only (meshforge saves nothing else), stored in files inside the checkpoint directory, with
no storage transforms. Tensor data itself is read by DCP with ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import functools
import io
import pickle
import re
from pathlib import Path, PurePath
from typing import TYPE_CHECKING, Any

import torch

from meshforge.errors import MeshforgeError
from meshforge.safeio.files import read_regular

if TYPE_CHECKING:
    from torch.distributed.checkpoint import metadata as dcp_metadata

# (module, name) pairs a DCP .metadata may name; anything else is refused before it is built
_DCP_CLASSES = {
    "Metadata",
    "TensorStorageMetadata",
    "BytesStorageMetadata",  # admitted to be named, refused below (meshforge saves tensors only)
    "ChunkStorageMetadata",
    "MetadataIndex",
    "TensorProperties",
    "StorageMeta",
    "_MEM_FORMAT_ENCODING",
}
_ALLOWED = {
    **{("torch.distributed.checkpoint.metadata", n): None for n in _DCP_CLASSES},
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"): None,
    ("torch.serialization", "_get_layout"): None,
    ("torch", "Size"): None,
    ("collections", "OrderedDict"): None,
    ("pathlib", "PosixPath"): None,
    ("pathlib", "PurePosixPath"): None,
    ("pathlib", "WindowsPath"): None,
    ("pathlib", "PureWindowsPath"): None,
}
_FILE_NAME = re.compile(r"^[A-Za-z0-9_.\-]+$")
MAX_METADATA_BYTES = 4 << 30  # a .metadata lists every chunk of every tensor: ~100 bytes a chunk


class UnsafeCheckpointError(MeshforgeError):
    """A checkpoint whose metadata is not plain DCP metadata; it is never loaded."""


class _RestrictedUnpickler(pickle.Unpickler):
    def __init__(self, data: bytes, path: Path) -> None:
        super().__init__(io.BytesIO(data))
        self._path = path

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise UnsafeCheckpointError(
            f"{self._path} names {module}.{name}, which is not part of a DCP checkpoint's metadata: the file was "
            "crafted or written by another tool, and loading it could run code; it was not loaded. Use a checkpoint "
            "written by meshforge, or convert the weights to safetensors (meshforge convert) where they come from"
        )


def read_metadata(path: Path) -> dcp_metadata.Metadata:
    """The ``.metadata`` file at ``path``, built only from DCP's metadata classes and checked."""
    data = read_regular(path, MAX_METADATA_BYTES, UnsafeCheckpointError, "the checkpoint is damaged")  # (no FIFO)
    try:
        md = _RestrictedUnpickler(data, path).load()
    except UnsafeCheckpointError:
        raise
    except Exception as e:  # a truncated or garbled pickle: any unpickling error
        raise UnsafeCheckpointError(f"{path} is not a readable DCP metadata file ({type(e).__name__}: {e})") from None
    _check(md, path)
    return md


def _check(md: Any, path: Path) -> None:
    """Tensors only, in plain files beside the metadata, with no storage transforms."""
    from torch.distributed.checkpoint import metadata as dcp_metadata  # (here: DCP costs ~1.5 s to import)

    if not isinstance(md, dcp_metadata.Metadata):
        raise UnsafeCheckpointError(f"{path} holds a {type(md).__name__}, not DCP metadata")
    entries = getattr(md, "state_dict_metadata", None)  # (an edited pickle can leave a field out)
    if not isinstance(entries, dict):
        raise UnsafeCheckpointError(f"{path}: its state_dict_metadata is not a mapping")
    if not isinstance(getattr(md, "storage_meta", None), (dcp_metadata.StorageMeta, type(None))) or not isinstance(
        getattr(md, "planner_data", None), (dict, type(None))
    ):
        raise UnsafeCheckpointError(f"{path}: its storage_meta or planner_data is not what DCP writes")
    for key, entry in entries.items():
        if not isinstance(entry, dcp_metadata.TensorStorageMetadata):
            raise UnsafeCheckpointError(
                f"{path}: entry {key!r} is a {type(entry).__name__}, not a tensor; meshforge checkpoints hold "
                "tensors only, and a non-tensor entry would be unpickled by torch.load; it was not loaded"
            )
        _check_tensor(key, entry, path, dcp_metadata)
    storage = getattr(md, "storage_data", None)
    storage = storage if isinstance(storage, dict) else None
    if storage is None:
        raise UnsafeCheckpointError(f"{path}: its storage_data is not a mapping")
    for index, info in storage.items():
        name = getattr(info, "relative_path", "")
        name = str(name) if isinstance(name, PurePath) else name
        fqn = getattr(index, "fqn", index)
        if not isinstance(name, str) or not _FILE_NAME.match(name) or name in (".", ".."):
            raise UnsafeCheckpointError(f"{path}: entry {fqn!r} points at {name!r}, outside the checkpoint directory")
        if getattr(info, "transform_descriptors", None):
            raise UnsafeCheckpointError(
                f"{path}: entry {fqn!r} asks for storage transforms "
                f"{info.transform_descriptors!r}, which meshforge never writes"
            )
        if not (_whole(getattr(info, "offset", None)) and _whole(getattr(info, "length", None))):
            raise UnsafeCheckpointError(f"{path}: entry {fqn!r} is stored at a negative or non-integer offset")
        if not (isinstance(fqn, str) and _sizes(getattr(index, "offset", None))):
            raise UnsafeCheckpointError(f"{path}: a storage entry has no readable name and offset ({index!r:.80})")


def _whole(v: Any) -> bool:
    return type(v) is int and 0 <= v < 2**62


def _sizes(v: Any, ndim: int | None = None) -> bool:
    """A tensor's size or a chunk's offsets: whole numbers >= 0 (``ndim`` of them, when given)."""
    return isinstance(v, (tuple, torch.Size)) and len(v) <= 16 and all(_whole(x) for x in v) and ndim in (None, len(v))


def _check_tensor(key: str, entry: Any, path: Path, dcp_metadata: Any) -> None:
    """One tensor's description: a size, a dtype, and chunks inside the size (DCP trusts them all)."""
    size = getattr(entry, "size", None)
    dtype = getattr(getattr(entry, "properties", None), "dtype", None)
    chunks = getattr(entry, "chunks", None)
    if not isinstance(key, str) or not _sizes(size) or not isinstance(dtype, torch.dtype):
        raise UnsafeCheckpointError(f"{path}: entry {key!r:.80} has no readable size and dtype")
    if not isinstance(chunks, list) or not chunks:
        raise UnsafeCheckpointError(f"{path}: entry {key!r} has no list of stored chunks")
    for c in chunks:
        ok = isinstance(c, dcp_metadata.ChunkStorageMetadata)
        ok = ok and _sizes(getattr(c, "offsets", None), len(size)) and _sizes(getattr(c, "sizes", None), len(size))
        if not ok or any(o + n > s for o, n, s in zip(c.offsets, c.sizes, size, strict=True)):
            raise UnsafeCheckpointError(f"{path}: entry {key!r} has a chunk outside its size {tuple(size)}")


def safe_reader(path: str) -> Any:
    """DCP's file reader over ``path`` with its metadata read by ``read_metadata`` (never
    ``pickle.load``). Built on first use, so that importing this module (every launcher's
    pre-flight does, through store.py) does not import DCP."""
    return _reader_class()(path)


@functools.cache
def _reader_class() -> type:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import metadata as dcp_metadata

    class SafeFileSystemReader(dcp.FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> dcp_metadata.Metadata:
            rank = kwargs.get("rank")
            name = ".metadata" if rank is None else f"__{rank}.metadata"
            md = read_metadata(Path(self.path) / name)
            if getattr(md, "storage_meta", None) is None:
                md.storage_meta = dcp_metadata.StorageMeta()
            md.storage_meta.load_id = self.load_id
            return md

    return SafeFileSystemReader
