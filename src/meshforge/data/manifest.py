"""Versioned JSON manifests (token-shard indexes, weights metadata): read and checked in one place."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from meshforge.errors import MeshforgeError


def read_manifest(path: Path, fmt: str, version: int, error: type[MeshforgeError], fix: str) -> dict[str, Any]:
    """The JSON object at ``path`` if it declares ``format == fmt`` and a version this code reads.

    ``fix`` completes every error message with what the user should do.
    """
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise error(f"cannot read {path}: {e}; {fix}") from None
    if not isinstance(data, dict) or data.get("format") != fmt:
        found = data.get("format") if isinstance(data, dict) else type(data).__name__
        raise error(f"{path} is not a {fmt} file (format {found!r}); {fix}")
    if data.get("version", 0) > version:
        raise error(
            f"{path} was written by a newer meshforge (format version {data['version']} > {version}); "
            f"upgrade meshforge or {fix}"
        )
    return data
