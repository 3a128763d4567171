"""A rank whose peer is gone says so in one line, not a transport traceback.

When one rank of a group ends (its error reported, a hang report written, a crash), the others
are left in a collective whose connections close under them; gloo and NCCL raise a
DistBackendError (or a RuntimeError) with a C++ traceback some 60 lines long. That is not the
cause, so such a rank prints one line pointing at the rank that reports it. If this rank's hang
watchdog has fired, it is about to exit with the hang's code (3): let it finish its report.
"""

from __future__ import annotations

import os
import re
import signal
import sys
import time

from meshforge.launch import env as launch_env

PATTERN = re.compile(
    r"Connection closed by peer|Connection reset by peer|Broken pipe|Socket Timeout|Connection refused|"
    r"NCCL communicator was aborted|ProcessGroup.*(abort|terminat)|Timed out waiting|peer .* closed",
    re.IGNORECASE,
)
PEER_LOST_EXIT = 1
GRACE_S = 5.0  # how long a quiet rank waits for its node's local rank 0 to say an every-rank error


def is_peer_lost(exc: BaseException) -> bool:
    """Whether ``exc`` is a collective failing because another rank went away."""
    if launch_env.world_size() < 2:
        return False
    try:
        from torch.distributed import DistBackendError, DistNetworkError
    except ImportError:  # pragma: no cover - torch always has them (>= 2.1)
        DistBackendError = DistNetworkError = RuntimeError  # noqa: N806
    if not isinstance(exc, (DistBackendError, DistNetworkError, RuntimeError)):
        return False
    return bool(PATTERN.search(str(exc)))


READER_GONE_KEY = "meshforge/stdout_reader_gone"


def mark_reader_gone() -> None:
    """Rank 0's stdout reader went away (``meshforge train --nproc N | head``): it stops quietly, and
    says so in the rendezvous store first, so the ranks its leaving strands stop quietly too."""
    from meshforge.health import watchdog

    try:
        watchdog.rendezvous_store().set(READER_GONE_KEY, "1")
    except Exception:  # noqa: BLE001 - no process group (one rank), or the store is gone: nothing to tell
        pass


_READER_GONE: list[bool] = []  # asked once, while the process group (and its store) still exists


def ask_reader_gone() -> bool:
    """Whether rank 0 left because its stdout reader did; ask while the process group is up (the
    failure handler does, before the group is destroyed), then ``say_peer_lost`` reads the answer."""
    from meshforge.health import watchdog

    if not _READER_GONE:
        try:
            _READER_GONE.append(bool(watchdog.rendezvous_store().check([READER_GONE_KEY])))
        except Exception:  # noqa: BLE001 - no store to ask: not a quiet stop
            return False
    return _READER_GONE[0]


def say_peer_lost(exc: BaseException) -> int:
    """Print the one line and return the exit code (the hang's, when this rank's watchdog fired);
    nothing and 0 when rank 0 left because the console's reader did (``| head``)."""
    from meshforge.health import watchdog

    if _READER_GONE and _READER_GONE[0]:
        return 0

    what = f"{type(exc).__name__} in a collective"  # the transport's own text is the noise this line replaces
    rank = launch_env.rank()
    print(
        f"meshforge: rank {rank} stopped: another rank of the run went away ({what}); its own message above says why",
        file=sys.stderr,
        flush=True,
    )
    if watchdog.FIRED.is_set():  # its thread writes the hang report, then exits with HANG_EXIT
        time.sleep(60)
        return watchdog.HANG_EXIT
    return PEER_LOST_EXIT


def leave_it_to_local_rank0(exc: BaseException) -> int:
    """An error every rank raised together (``MeshforgeError.every_rank``: a health stop, a gathered
    checkpoint failure), on a rank other than its node's local rank 0: stay quiet and let that rank
    say it. This rank lives until it has (the launcher then stops this one with SIGTERM: exit 2 at
    once), so the launcher cannot stop rank 0 mid-message because a quiet rank left first. Should
    rank 0 not finish within GRACE_S, this rank says the error itself."""

    def leave(signum: int, frame: object) -> None:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(2)

    signal.signal(signal.SIGTERM, leave)
    time.sleep(GRACE_S)
    print(f"meshforge: error: {exc}", file=sys.stderr, flush=True)
    return 2
