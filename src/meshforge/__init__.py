"""meshforge: train transformer language models across a device mesh."""

import os
import tempfile

__version__ = "0.1.0"


def _inductor_cache_per_capability() -> None:
    """torch's on-disk inductor cache is not keyed by ``ATEN_CPU_CAPABILITY``: code compiled
    under one capability and loaded under another gave a compiled loss of ``nan``, a ``double
    free`` and a loss 13% off. Where the capability is forced and no cache is named, each
    capability gets its own directory (inherited by the ranks this process starts)."""
    cap = os.environ.get("ATEN_CPU_CAPABILITY", "").strip().lower()
    if cap and not os.environ.get("TORCHINDUCTOR_CACHE_DIR"):
        who = getattr(os, "getuid", lambda: "user")()
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(tempfile.gettempdir(), f"torchinductor_{who}_{cap}")


_inductor_cache_per_capability()
