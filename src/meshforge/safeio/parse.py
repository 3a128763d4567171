"""JSON and TOML parsed with limits: how deep they nest and how large they are.

Python's parsers recurse once per level of nesting, so a file nested 50,000 deep (``[[[[...``)
ends in a RecursionError, a traceback instead of a message. meshforge's own files nest a few
levels (a checkpoint's meta.json 3, index.json 4, a Hugging Face config.json 3); anything from a
user is held to MAX_DEPTH before it is parsed, by a scan that skips strings and comments, and a
parse error of any kind is one sentence naming the file.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any

from meshforge.errors import MeshforgeError
from meshforge.safeio.files import MAX_MANIFEST_BYTES, read_regular

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

MAX_DEPTH = 64  # arrays and objects (tables) inside each other
_JSON_TOKENS = re.compile(r'"(?:[^"\\]|\\.)*"|[\[\]{}]', re.S)
_TOML_TOKENS = re.compile(r'"""[\s\S]*?"""|\'\'\'[\s\S]*?\'\'\'|"(?:[^"\\\n]|\\.)*"|\'[^\'\n]*\'|#[^\n]*|[\[\]{}]')


def nesting_depth(text: str, toml: bool = False) -> int:
    """How deep the brackets of ``text`` nest, strings (and TOML's comments) skipped."""
    if text.count("[") + text.count("{") <= MAX_DEPTH:  # cannot nest deeper than its brackets
        return min(text.count("[") + text.count("{"), MAX_DEPTH)
    depth = deepest = 0
    for m in (_TOML_TOKENS if toml else _JSON_TOKENS).finditer(text):
        c = m.group()
        if c in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif c in "]}":
            depth = max(0, depth - 1)
    return deepest


def _check_depth(text: str, where: str, error: type[MeshforgeError], fix: str, toml: bool) -> None:
    if nesting_depth(text, toml) > MAX_DEPTH:
        raise error(
            f"{where} nests arrays or objects more than {MAX_DEPTH} levels deep, more than any file meshforge reads "
            f"(it was crafted or damaged); {fix}"
        )


def loads_json(
    text: str | bytes, where: str, error: type[MeshforgeError] = MeshforgeError, fix: str = "", file: bool = False
) -> Any:
    """``text`` parsed as JSON: its depth held to MAX_DEPTH first; any failure (bad syntax, not
    UTF-8, a number too long for Python) is ``error`` naming ``where`` (``file``: "cannot read FILE: it ...")."""
    fix = fix or "fix or replace the file"
    where = f"cannot read {where}: it" if file else where
    if isinstance(text, bytes):
        try:
            text = text.decode("utf-8")
        except UnicodeDecodeError as e:
            raise error(f"{where} is not UTF-8 text (byte {e.start} is not UTF-8: a binary file?); {fix}") from None
    _check_depth(text, where, error, fix, toml=False)
    try:
        return json.loads(text)
    except (ValueError, RecursionError) as e:  # JSONDecodeError is a ValueError, and so is a 5,000-digit number
        raise error(f"{where} is not valid JSON ({str(e)[:200]}); {fix}") from None


def read_json(
    path: Path | str, error: type[MeshforgeError] = MeshforgeError, fix: str = "", cap: int = MAX_MANIFEST_BYTES
) -> Any:
    """The JSON document in the regular file ``path`` (at most ``cap`` bytes, MAX_DEPTH deep)."""
    return loads_json(read_regular(path, cap, error, fix), str(path), error, fix, file=True)


def loads_toml(text: str, where: str, error: type[MeshforgeError] = MeshforgeError, fix: str = "") -> dict[str, Any]:
    """``text`` parsed as TOML, its depth held to MAX_DEPTH first (tomllib recurses per level)."""
    fix = fix or "fix or replace the file"
    _check_depth(text, where, error, fix, toml=True)
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise error(f"{where} is not valid TOML: {e}. Fix the syntax at that line.") from None
    except (RecursionError, ValueError) as e:
        raise error(f"{where} is not valid TOML ({str(e)[:200]}); {fix}") from None
