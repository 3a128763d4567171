"""``meshforge train --help`` gives every key one line of meaning, taken from the tables of
docs/configuration.md into ``meshforge/config_help.py``; this test fails when the two differ
or a key has no meaning. Regenerate after editing the docs: ``python tests/test_config_help.py``."""

from __future__ import annotations

import re
import sys
import textwrap
from pathlib import Path

from meshforge.config import describe_keys, load_config, to_dict
from meshforge.config_help import HELP

ROOT = Path(__file__).resolve().parents[1]


def meanings_from_docs() -> dict[str, str]:
    """section.key -> the meaning column of docs/configuration.md, without Markdown backticks."""
    out, section = {}, None
    for line in (ROOT / "docs" / "configuration.md").read_text().splitlines():
        if m := re.match(r"## \[(\w+)\]", line):
            section = m.group(1)
        elif section and (m := re.match(r"\| `(\w+)` \| (.*)$", line)):
            cells = m.group(2).rstrip().rstrip("|").split(" | ")
            out[f"{section}.{m.group(1)}"] = " | ".join(cells[1:]).strip().replace("`", "").replace("\\|", "|")
    return out


def render(meanings: dict[str, str]) -> str:
    lines = [_module_doc(), "", "HELP: dict[str, str] = {"]
    for k, v in meanings.items():
        parts = textwrap.wrap(v, 90, drop_whitespace=False, break_on_hyphens=False) or [""]
        if len(parts) == 1:
            lines.append(f"    {k!r}: {v!r},")
        else:
            lines += [f"    {k!r}: (", *(f"        {x!r}" for x in parts), "    ),"]
    return "\n".join(lines + ["}"]) + "\n"


def _module_doc() -> str:
    return (
        '"""One line of meaning per config key, for ``meshforge train --help``. Generated from the\n'
        "tables in docs/configuration.md (tests/test_config_help.py fails when they differ; regenerate\n"
        'with ``python tests/test_config_help.py``)."""'
    )


def test_help_lines_match_the_configuration_docs():
    assert HELP == meanings_from_docs(), "docs/configuration.md changed: run python tests/test_config_help.py"


def test_every_key_has_a_meaning_in_train_help():
    text = describe_keys()
    for section, body in to_dict(load_config()).items():
        for key in body:
            name = f"{section}.{key}"
            assert HELP.get(name), f"{name} has no meaning in docs/configuration.md"
            line = next(x for x in text.splitlines() if x.strip().startswith(f"--{name} "))
            assert HELP[name][:40] in line


if __name__ == "__main__":
    path = ROOT / "src" / "meshforge" / "config_help.py"
    path.write_text(render(meanings_from_docs()))
    import subprocess  # the project's formatter, so the generated file stays `ruff format` clean

    subprocess.run([sys.executable, "-m", "ruff", "format", "-q", str(path)], check=False)
    print(f"wrote {path}")
