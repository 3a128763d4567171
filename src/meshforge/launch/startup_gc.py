"""The cyclic garbage collector paused while a ``meshforge train`` process starts.

Starting a process imports ~2,500 modules (torch, DTensor, the compiler's front end) and
builds the model; the collector runs hundreds of times meanwhile and finds nothing to free,
costing ~1.3 s of CPU per process (measured: ``import torch, torch.distributed.tensor,
torch._dynamo`` 5.2 -> 3.6-4.3 CPU-s with it off). A 2-rank launch is three such processes.
``pause`` is called by ``cli.entry`` for ``train`` (a process of its own: an in-process
``main()`` is left alone); ``resume`` before the work that runs for long: the launcher's wait
on its ranks, a rank's step loop. ``resume`` freezes what startup
made (never scanned again: later collections are cheaper) and turns the collector back on,
only if ``pause`` turned it off (a caller's own ``gc.disable()`` is left alone).
"""

from __future__ import annotations

import gc

_paused = [False]


def pause() -> None:
    if gc.isenabled():
        gc.disable()
        _paused[0] = True


def resume() -> None:
    if _paused[0]:
        _paused[0] = False
        gc.freeze()
        gc.enable()
