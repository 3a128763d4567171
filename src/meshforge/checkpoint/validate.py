"""A checkpoint's parts checked against each other and against the model, before DCP reads a byte.

The hashes in meta.json stop damage, not tampering: whoever edits a file can hash it again. So
what the files say is checked as well, and a checkpoint that fails is skipped by ``latest`` like a
damaged one (store.verify raises CheckpointError):

- ``.metadata`` (read as data by safe_metadata.py) must hold the tensors of the model meta.json
  describes -- every parameter under its name, at its size, of a floating dtype; Adam's moments at
  their parameter's size; the train state as int64 scalars -- and nothing of another model; every
  chunk of every tensor must lie inside its tensor and be stored inside a listed file. DCP would
  otherwise fail half-way through a load, after the run directory was written (a size of
  [2^40, 2^20], shards of another model, an empty state dict, a negative offset).
- each ``rank-NNNNN.json`` must hold RNG states torch takes (garbage ones failed mid-run).
"""

from __future__ import annotations

import base64
import binascii
import itertools
import re
from pathlib import Path
from typing import Any

import torch

from meshforge.errors import ConfigError, MeshforgeError
from meshforge.models.presets import check_model_shape
from meshforge.models.shape import ModelShape
from meshforge.safeio.parse import read_json
from meshforge.safeio.schema import FILE_NAME, Int, MapOf, Obj, Str, check


class CheckpointError(MeshforgeError):
    """A checkpoint that cannot be used; the message names the file."""


_ISLAND = re.compile(r"^island\d+\.")
_ADAM = ("exp_avg", "exp_avg_sq")
_FIX = "the checkpoint is damaged or was edited; use another checkpoint"
RANK_FILE = Obj(
    {
        "rank": Int(0),
        "rng": Obj({"torch": Str(most=1 << 16), "cuda": Str(most=1 << 16)}, optional=frozenset({"cuda"})),
        "files": MapOf(Str(FILE_NAME), Obj({"bytes": Int(0), "sha256": Str(r"[0-9a-f]{64}")})),
    }
)


def checkpoint_shape(meta: dict[str, Any], path: Path) -> ModelShape:
    """The model shape a checkpoint's meta.json describes (a damaged or edited one is named)."""
    try:
        shape = ModelShape(**meta["model"])
        check_model_shape(shape)
    except (KeyError, TypeError, ValueError, ConfigError) as e:
        raise CheckpointError(
            f"{path / 'meta.json'} holds no readable model shape ({e}); the file is damaged"
        ) from None
    return shape


def readable_shape(meta: dict[str, Any], path: Path) -> ModelShape | None:
    """meta.json's model shape, or None when it has none that reads (the resume check names that)."""
    try:
        return checkpoint_shape(meta, path)
    except CheckpointError:
        return None


def check_rank_files(path: Path, names: list[str]) -> None:
    """Every listed rank file is JSON of its schema with RNG states torch would take."""
    for name in names:
        f = path / name
        data = read_json(f, CheckpointError, _FIX)
        check(data, RANK_FILE, str(f), CheckpointError, _FIX)
        try:
            state = base64.b64decode(data["rng"]["torch"], validate=True)
            torch.Generator().set_state(torch.frombuffer(bytearray(state), dtype=torch.uint8))
            base64.b64decode(data["rng"].get("cuda", ""), validate=True)
        except (binascii.Error, ValueError, RuntimeError) as e:
            raise CheckpointError(f"{f}: its RNG state is not one torch takes ({str(e)[:120]}); {_FIX}") from None


def check_state(md: Any, shape: ModelShape, path: Path, optimizer: bool = True) -> None:
    """Refuse ``.metadata`` entries that do not fit the model ``shape`` (meta.json's): a parameter
    missing or of another size, a name of another model, moments of another size, a train state that
    is not int64 scalars. ``optimizer``: Adam's state must be there too (a resume loads it)."""
    from meshforge.models.llama import build_model  # (here: DTensor and the model cost ~1.5 s to import)

    model = build_model(shape, device="meta")
    sizes = {n: tuple(t.shape) for n, t in model.state_dict().items()}
    where = path / ".metadata"
    found: set[str] = set()
    for key, entry in md.state_dict_metadata.items():
        name = _ISLAND.sub("", key)
        size, dtype = tuple(entry.size), entry.properties.dtype
        kind, _, rest = name.partition(".")
        if kind == "model":
            _expect(rest in sizes and size == sizes[rest], where, key, size, sizes.get(rest), "a tensor of this model")
            _floating(dtype, where, key)
            found.add(name)
        elif kind == "optim":
            param, _, field = rest.rpartition(".")
            want = () if field == "step" else sizes.get(param)
            ok = param in sizes and field in (*_ADAM, "step") and (size == want or (field == "step" and size == (1,)))
            _expect(ok, where, key, size, want, "Adam's state for a parameter of this model")
            found.add(name)
        elif kind == "train":
            _expect(rest in ("step", "tokens_seen", "consumed") and size in ((), (1,)), where, key, size, (), "")
            if dtype != torch.int64:
                raise CheckpointError(f"{where}: {key} is {dtype}, not int64; {_FIX}")
    for name, _ in model.named_parameters():
        needed = [f"model.{name}"] + ([f"optim.{name}.{f}" for f in (*_ADAM, "step")] if optimizer else [])
        missing = [n for n in needed if n not in found]
        if missing:
            raise CheckpointError(
                f"{where} holds no {missing[0]}, which the model meta.json describes has; the shards belong to "
                f"another model or were emptied; {_FIX}"
            )


def _expect(ok: bool, where: Path, key: str, size: tuple, want: Any, what: str) -> None:
    if not ok:
        shown = "nothing of that name" if want is None else f"{want}"
        raise CheckpointError(
            f"{where}: {key} is {size}, but the model meta.json describes has {shown} there ({what or 'a scalar'}); "
            f"the shards belong to another model or were edited; {_FIX}"
        )


def _floating(dtype: Any, where: Path, key: str) -> None:
    if not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise CheckpointError(f"{where}: {key} is {dtype}, not a floating-point tensor; {_FIX}")


def check_storage(md: Any, sizes: dict[str, int], path: Path) -> None:
    """Every chunk of every tensor lies inside its tensor and has a stored copy inside one of the
    checkpoint's listed files (``sizes``: their bytes), holding at least the chunk's bytes."""
    from torch.distributed.checkpoint.metadata import MetadataIndex

    where = path / ".metadata"
    storage = md.storage_data if isinstance(md.storage_data, dict) else {}
    _no_overlap(storage, where)
    for key, entry in md.state_dict_metadata.items():
        item = entry.properties.dtype.itemsize if isinstance(entry.properties.dtype, torch.dtype) else 1
        for chunk in entry.chunks:
            info = storage.get(MetadataIndex(key, chunk.offsets))
            if info is None:
                raise CheckpointError(f"{where}: {key} has a chunk at {tuple(chunk.offsets)} stored nowhere; {_FIX}")
            have = sizes.get(info.relative_path)
            numel = 1
            for n in chunk.sizes:
                numel *= n
            if have is None or info.offset + info.length > have or info.length < numel * item:
                raise CheckpointError(
                    f"{where}: {key} is said to be stored at bytes {info.offset}..{info.offset + info.length} of "
                    f"{info.relative_path!r} ({have if have is not None else 'not a listed file'} bytes), too little "
                    f"for its {numel:,} elements; {_FIX}"
                )


def _no_overlap(storage: dict[Any, Any], where: Path) -> None:
    """DCP writes a file's items one after another: two that share bytes were moved by an edit."""
    spans: dict[str, list[tuple[int, int, str]]] = {}
    for index, info in storage.items():
        spans.setdefault(info.relative_path, []).append((info.offset, info.offset + info.length, index.fqn))
    for name, items in spans.items():
        items.sort()
        for (_, end, a), (start, _, b) in itertools.pairwise(items):
            if start < end:
                raise CheckpointError(
                    f"{where}: {b} is said to be stored inside {a}'s bytes of {name!r}; the shards were moved "
                    f"or edited; {_FIX}"
                )
