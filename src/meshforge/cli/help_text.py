"""Help text that fits the terminal. argparse wraps the other commands' --help itself;
``meshforge train --help`` is written by hand (its flags are --section.key=value overrides, not
argparse options), so its usage text is reflowed here, to the same width argparse uses.
Standard library only: ``meshforge --help`` loads no torch."""

from __future__ import annotations

import re
import shutil
import textwrap

MIN_WIDTH, MAX_WIDTH = 40, 1000
_OPTION = re.compile(r"^(\s+-\S.*?\s{2,})(\S.*)$")  # "  --flag ARG    what it does"
_USAGE = re.compile(r"^usage:\s+[^\[\-]*")  # "usage: meshforge train " (the options start after)
_KEEP = "\x00"  # a space that must not break a line (inside a usage group such as [--nproc N])


def terminal_width() -> int:
    """The columns to fill: the terminal's (``COLUMNS`` first, as argparse reads it) less 2, as
    argparse's formatter does. COLUMNS is the environment's: a value below 40 or above 1000
    (or none, or not a number: 80) is bounded, so help never comes out a word per line."""
    return min(max(shutil.get_terminal_size().columns - 2, MIN_WIDTH), MAX_WIDTH)


def _wrap(text: str, width: int, first: str, rest: str) -> list[str]:
    lines = textwrap.wrap(
        text, width, initial_indent=first, subsequent_indent=rest, break_long_words=False, break_on_hyphens=False
    )
    return [line.replace(_KEEP, " ") for line in lines] or [first.rstrip()]


def _items(block: list[str]) -> list[list[str]]:
    """Lines of one paragraph block grouped into what wraps as one: a usage with its continuation
    lines, an option with its description's continuation lines, or a paragraph."""
    items: list[list[str]] = []
    for line in block:
        indent = len(line) - len(line.lstrip())
        if items:
            head = items[-1][0]
            option = _OPTION.match(head)
            if head.startswith("usage:"):
                joins = indent > 0 and not _OPTION.match(line)
            elif option:
                joins = indent >= len(option.group(1))
            else:
                joins = indent == len(head) - len(head.lstrip()) and not _OPTION.match(line)
            if joins:
                items[-1].append(line)
                continue
        items.append([line])
    return items


def _render(item: list[str], width: int) -> list[str]:
    head = item[0]
    words = " ".join(" ".join(item).split())
    if head.startswith("usage:"):
        lead = " ".join(_USAGE.match(head).group(0).split())  # type: ignore[union-attr]  # it starts "usage:"
        groups = re.sub(r"\[[^\]]*\]", lambda m: m.group(0).replace(" ", _KEEP), words[len(lead) :])
        return _wrap(lead + groups, width, "", " " * (len(lead) + 1))
    option = _OPTION.match(head)
    if option:
        label = option.group(1)
        text = " ".join(" ".join([option.group(2), *item[1:]]).split())
        if len(label) > width // 2:  # a long flag: its description goes under it
            indent = " " * (len(label) - len(label.lstrip()) + 4)
            return [label.rstrip(), *_wrap(text, width, indent, indent)]
        return _wrap(text, width, label, " " * len(label))
    indent = " " * (len(head) - len(head.lstrip()))
    return _wrap(words, width, indent, indent)


def fit(text: str, width: int) -> str:
    """Reflow hand-written help text (a usage line, paragraphs, an option list) to ``width``
    columns, each part under its own indent: a usage's options under the first option, an
    option's description under its description column."""
    out: list[str] = []
    block: list[str] = []
    for line in [*text.splitlines(), ""]:
        if line.strip():
            block.append(line.rstrip())
            continue
        for item in _items(block):
            out += _render(item, width)
        block = []
        out.append("")
    return "\n".join(out[:-1])
