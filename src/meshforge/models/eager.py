"""``eager_only``: ``torch.compiler.disable`` without importing ``torch._dynamo`` up front.

``torch.compiler.disable`` used as a decorator imports ``torch._dynamo`` (and with it sympy and
the compiler stack) when the module is imported: ~1 s of CPU in every process that imports the
model, a rank of an eager run included, which never compiles anything. Only a run that
compiles needs the mark, and such a run has loaded ``torch._dynamo`` before it traces a frame.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import Any

import torch


def eager_only(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` that always runs outside compiled graphs (as under ``torch.compiler.disable``).

    The wrapper carries dynamo's own mark (``_torchdynamo_disable``), so a trace that meets it
    breaks the graph there instead of inlining it; called while ``torch._dynamo`` is loaded
    it runs ``fn`` through ``torch.compiler.disable`` (made once), so nothing below it is traced
    either. Before that nothing can be compiling, and ``fn`` runs as it is."""
    disabled: list[Callable[..., Any]] = []

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        if "torch._dynamo" not in sys.modules:
            return fn(*args, **kwargs)
        if not disabled:
            disabled.append(torch.compiler.disable(fn))
        return disabled[0](*args, **kwargs)

    call._torchdynamo_disable = True  # type: ignore[attr-defined]
    return call
