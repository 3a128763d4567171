"""The key reference, generated from the fields that declare the keys: ``meshforge train
--help`` (``describe_keys``) and docs/configuration.md (``markdown``; regenerate it with
``python -m meshforge.config.reference > docs/configuration.md``, a test fails when stale).
"""

from __future__ import annotations

import textwrap

from meshforge.config.keys import PRESET_DEFAULT, SECTIONS, keys, plain_text
from meshforge.config.values import toml_value

INTRO = """# Configuration reference

Every key below can be set in a TOML file passed with `--config` and overridden on the command line
as `--section.key=value` or `--section.key value`. Unknown keys, wrong types, non-finite numbers and
impossible values are refused before training with a message naming the key (and the nearest valid
one); every number has a range (shown with its meaning), and a value outside it is refused naming the
key and the range. `meshforge plan`'s flags and the explorer's parameters that set a key take its range
and words from the same field, so all three accept the same values. A run resolves its config once,
for its world size and machine, into a run plan; the run directory's `config.toml` is that plan
written out: every preset field and every automatic value (`auto`, an inferred `-1` degree, the
pipeline's micro-batches) replaced by what ran, with the decisions taken from them and any value
the resolution changed (and why) as comments. Rerunning it reproduces the run.
Model shape fields default to the preset's value (shown as `—`), but for `vocab_size`, whose `auto`
takes the tokenizer's vocabulary (the key's meaning says how).

This page is generated from the fields' docstrings and ranges (`src/meshforge/config/sections.py`,
`src/meshforge/config/layout.py`, `src/meshforge/models/shape.py`):
`python -m meshforge.config.reference > docs/configuration.md`.
"""

SECTION_NOTES = {
    "parallel": "The layout: degrees over the device mesh and how each axis runs; see "
    "[parallelism.md](parallelism.md).",
    "health": "What happens when a run goes wrong while it keeps running; see [health.md](health.md).",
    "diloco": "DiLoCo across islands of ranks; see [diloco.md](diloco.md). The `[parallel]` degrees are one island's.",
    "fault_tolerance": "Replica groups that keep training through a failure (torchft); see "
    "[checkpointing.md](checkpointing.md#live-recovery-fault_tolerance). The `[parallel]` degrees are one group's.",
}


def _default_text(default: object) -> str:
    return PRESET_DEFAULT + " value" if default == PRESET_DEFAULT else toml_value(default)


def describe_keys(width: int = 100) -> str:
    """Every config key with its type, default and meaning, for ``--help``, wrapped to ``width``
    columns (a terminal's): the key, its type and default on one line, the meaning under it. One
    line per key made lines of 500 characters, which a terminal folds mid-word."""
    lines, section = [], None
    for k in keys().values():
        if k.section != section:
            section = k.section
            lines.append(f"[{section}]")
        head = f"{k.type_text}, default {_default_text(k.default)}"
        bounds = f" ({k.range_text()})" if k.range_text() else ""
        lines += _wrap(head, width, f"  --{k.dotted}  ", " " * 8)
        lines += _wrap(plain_text(k.help) + bounds, width, " " * 6, " " * 6)
    return "\n".join(lines)


def _wrap(text: str, width: int, first: str, rest: str) -> list[str]:
    """``text`` in lines of at most ``width`` columns where its words allow (a word is never split)."""
    return textwrap.wrap(
        " ".join(text.split()),
        width,
        initial_indent=first,
        subsequent_indent=rest,
        break_long_words=False,
        break_on_hyphens=False,
    )


def markdown() -> str:
    """docs/configuration.md."""
    out = [INTRO]
    for section in SECTIONS:
        out.append(f"## [{section}]\n")
        if section in SECTION_NOTES:
            out.append(SECTION_NOTES[section] + "\n")
        out += ["| key | default | meaning |", "|---|---|---|"]
        for k in keys().values():
            if k.section == section:
                default = "—" if k.default == PRESET_DEFAULT else f"`{toml_value(k.default)}`"
                bounds = f" ({k.range_text()})" if k.range_text() else ""
                meaning = (k.help + bounds).replace("|", "\\|")
                out.append(f"| `{k.name}` | {default} | {meaning} |")
        out.append("")
    return "\n".join(out)


if __name__ == "__main__":
    print(markdown(), end="")
