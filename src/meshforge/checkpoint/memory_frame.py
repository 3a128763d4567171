"""The memory tier's messages, without torch (the keeper imports only this): ``MFK1``, a 4-byte
big-endian header length, a JSON header (at most 1 MiB, parsed with safeio's depth limit) and
``header["size"]`` raw bytes, every size bounded before anything is allocated; and one request to
a keeper (its refusal or silence: a MemoryShardError).
"""

from __future__ import annotations

import json
import socket
import struct
from collections.abc import Callable, Iterable
from typing import Any

from meshforge.errors import MeshforgeError
from meshforge.safeio.parse import loads_json

MAGIC = b"MFK1"
MAX_HEADER = 1 << 20


class MemoryShardError(MeshforgeError):
    """A memory checkpoint (or a keeper's answer) that cannot be used; the run falls back to disk."""


def send_msg(sock: socket.socket, header: dict[str, Any], parts: Iterable[bytes | memoryview] = ()) -> None:
    """One message: ``header`` (its ``size`` must be the total length of ``parts``) then the parts."""
    head = json.dumps(header).encode()
    sock.sendall(MAGIC + struct.pack(">I", len(head)) + head)
    for p in parts:
        sock.sendall(p)


def _exactly(sock: socket.socket, n: int, where: str) -> bytearray:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = sock.recv_into(view[got:], min(n - got, 1 << 22))
        if k == 0:
            raise MemoryShardError(f"{where} closed the connection after {got} of {n} bytes")
        got += k
    return buf


def recv_msg(
    sock: socket.socket, where: str, max_payload: int, accept: Callable[[dict[str, Any]], None] | None = None
) -> tuple[dict[str, Any], bytearray]:
    """One message from ``sock``, its header and payload sizes bounded (``max_payload`` bytes);
    ``accept`` judges the header before a byte of the payload is read (a keeper's token check)."""
    first = _exactly(sock, 8, where)
    if bytes(first[:4]) != MAGIC:
        raise MemoryShardError(
            f"{where} is not a meshforge memory keeper (it answered {bytes(first[:8])!r}); another program holds "
            "the address its registry names"
        )
    (n,) = struct.unpack(">I", first[4:])
    if n > MAX_HEADER:
        raise MemoryShardError(f"{where} sent a {n}-byte header (at most {MAX_HEADER})")
    header = loads_json(bytes(_exactly(sock, n, where)), f"{where}'s header", MemoryShardError)
    if not isinstance(header, dict):
        raise MemoryShardError(f"{where}'s header is not a JSON object")
    size = header.get("size", 0)
    if type(size) is not int or not 0 <= size <= max_payload:
        raise MemoryShardError(f"{where} declared a payload of {size!r} bytes (0 to {max_payload} allowed)")
    if accept is not None:
        accept(header)
    return header, _exactly(sock, size, where)
