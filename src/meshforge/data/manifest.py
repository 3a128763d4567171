"""Versioned JSON manifests (token-shard indexes, checkpoint and weights metadata): read and
checked in one place. A manifest is a regular file of at most MAX_MANIFEST_BYTES, parsed with a
depth limit (safeio/parse.py), of a format and version this code reads, and -- given its schema
(safeio/schema.py) -- of the fields and types its readers trust."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from meshforge.errors import MeshforgeError
from meshforge.safeio.parse import read_json
from meshforge.safeio.schema import Obj, check


def read_manifest(
    path: Path, fmt: str, version: int, error: type[MeshforgeError], fix: str, schema: Obj | None = None
) -> dict[str, Any]:
    """The JSON object at ``path`` if it declares ``format == fmt``, a whole-number version this
    code reads and (given ``schema``) the fields its readers need, of their types.

    ``fix`` completes every error message with what the user should do.
    """
    data = read_json(path, error, fix)
    if not isinstance(data, dict) or data.get("format") != fmt:
        found = data.get("format") if isinstance(data, dict) else type(data).__name__
        raise error(f"{path} is not a {fmt} file (format {str(found)[:80]!r}); {fix}")
    found = data.get("version", 0)
    if type(found) is not int or found < 0:
        raise error(f"{path}: version must be a whole number >= 0, not {str(found)[:80]!r}; {fix}")
    if found > version:
        raise error(
            f"{path} was written by a newer meshforge (format version {found} > {version}); upgrade meshforge or {fix}"
        )
    if schema is not None:
        check(data, schema, str(path), error, fix)
    return data
