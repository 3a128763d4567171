"""The explorer's connection handling: no client can hold a thread.

``ThreadingHTTPServer`` gives every connection a thread that waits for the request, so idle or
half-sent connections pile up threads (one each, for ever). Here one reader thread holds every
connection until its request line and headers are in (``select`` over non-blocking sockets,
``READ_S`` to arrive whole, ``MAX_HEAD`` bytes at most), and only then hands it to a fixed pool
of ``WORKERS`` threads (searches, which run up to their budget, have ``SEARCH_WORKERS`` of
their own; a search's budget counts from when its request was in, so a queue of them drains
within about one budget). Connections waiting for their request cost no thread; beyond
``MAX_CONNECTIONS`` of them, more open sockets than the open-file limit allows
(``open_file_cap``), or ``MAX_QUEUED`` complete requests waiting for a worker, a connection
is answered 503 at once. The listen backlog (``BACKLOG``) holds a page's burst.
"""

from __future__ import annotations

import queue
import selectors
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from http.server import HTTPServer
from typing import Any
from urllib.parse import urlsplit

WORKERS = 2  # threads for quick requests: the work is CPU-bound Python, more only convoy on the GIL
SEARCH_WORKERS = 2  # threads for /api/best (up to its budget each), apart: a search never holds a quick worker
MAX_QUEUED = 256  # complete requests waiting for a worker, per pool
MAX_CONNECTIONS = 1024  # connections whose request has not arrived yet
BACKLOG = 128  # the listen queue (a page fires several requests at once; several pages more)
READ_S = 10.0  # the request line and headers must arrive within this
WRITE_S = 10.0  # the socket timeout while answering (a client that does not read is dropped)
MAX_HEAD = 16384  # bytes of request line and headers


def _status(code: int, reason: str, message: str) -> bytes:
    body = f'{{"error": "{message}"}}\n'.encode()
    head = f"HTTP/1.0 {code} {reason}\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n"
    return (head + "Connection: close\r\nRetry-After: 1\r\n\r\n").encode() + body


BUSY = _status(503, "Service Unavailable", "the explorer is busy; try again in a second")
TOO_SLOW = _status(408, "Request Timeout", f"the request did not arrive within {READ_S:.0f} s")
TOO_LARGE = _status(431, "Request Header Fields Too Large", f"the request head is over {MAX_HEAD} bytes")


def open_file_cap(spare: int = 64) -> int:
    """How many client sockets may be open at once: the open-file limit (its soft limit raised
    towards the hard one first, to hold MAX_CONNECTIONS waiting and every queue full) less
    ``spare`` for the listener and files. Past the limit ``accept`` fails (EMFILE) and the accept
    loop would spin on the waiting connection instead of answering 503."""
    want = MAX_CONNECTIONS + 2 * MAX_QUEUED + WORKERS + SEARCH_WORKERS
    try:
        import resource
    except ImportError:  # pragma: no cover - not on Windows
        return want
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < want + spare:
        new = want + spare if hard == resource.RLIM_INFINITY else min(want + spare, hard)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (new, hard))
            soft = new
        except (ValueError, OSError):
            pass
    return want if soft == resource.RLIM_INFINITY else max(8, min(want, soft - spare))


def is_search(head: bytes) -> bool:
    """Whether a request head asks for /api/best, its target read as the handler reads it
    (``urlsplit``: absolute-form ``http://host/api/best`` and a ``#fragment`` included), so
    that no search runs on the quick pool."""
    parts = head.split(b"\n", 1)[0].split()
    return len(parts) >= 2 and urlsplit(parts[1].decode("latin-1")).path == "/api/best"


class _Pending:
    __slots__ = ("addr", "buf", "deadline")

    def __init__(self, addr: Any) -> None:
        self.addr, self.buf, self.deadline = addr, b"", time.monotonic() + READ_S


class PoolServer(HTTPServer):
    """An HTTPServer whose requests are read by one thread and answered by a fixed pool."""

    request_queue_size = BACKLOG
    search_budget_s = 1.5  # set by make_server

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.pools = {
            False: (ThreadPoolExecutor(WORKERS, "explore"), threading.BoundedSemaphore(MAX_QUEUED + WORKERS)),
            True: (ThreadPoolExecutor(SEARCH_WORKERS, "explore-search"), threading.BoundedSemaphore(MAX_QUEUED)),
        }
        self.heads: dict[int, bytes] = {}
        self.arrived: dict[int, float] = {}
        self.max_open = open_file_cap()
        self.open: set[int] = set()  # ids of the client sockets accepted and not yet closed
        self._new: queue.SimpleQueue = queue.SimpleQueue()
        self._wake_r, self._wake_w = socket.socketpair()
        self._closing = False
        self._reader = threading.Thread(target=self._read_loop, name="explore-reader", daemon=True)
        self._reader.start()

    def process_request(self, request: socket.socket, client_address: Any) -> None:
        """From the accept loop: hand the new connection to the reader thread (or refuse it, the
        newest, when one more open socket would pass the open-file limit)."""
        if len(self.open) >= self.max_open:
            self._refuse(request, BUSY)
            return
        self.open.add(id(request))
        self._new.put((request, client_address))
        try:
            self._wake_w.send(b"\0")
        except OSError:
            pass

    def take_head(self, sock: socket.socket) -> bytes | None:
        """The request bytes the reader received for ``sock`` (the handler parses them)."""
        return self.heads.pop(sock.fileno(), None)

    def arrival(self, sock: socket.socket) -> float:
        """When ``sock``'s request was in whole (monotonic; now if unknown)."""
        return self.arrived.pop(sock.fileno(), time.monotonic())

    def _read_loop(self) -> None:
        sel = selectors.DefaultSelector()
        sel.register(self._wake_r, selectors.EVENT_READ, None)
        while not self._closing:
            for key, _ in sel.select(timeout=0.25):
                if key.data is None:
                    self._accept_new(sel)
                else:
                    self._read(sel, key.fileobj, key.data)
            self._expire(sel)
        sel.close()

    def _accept_new(self, sel: selectors.BaseSelector) -> None:
        try:
            self._wake_r.recv(4096)
        except OSError:
            pass
        while not self._new.empty():
            sock, addr = self._new.get()
            if len(sel.get_map()) > MAX_CONNECTIONS:
                self._refuse(sock, BUSY)
                continue
            sock.setblocking(False)
            sel.register(sock, selectors.EVENT_READ, _Pending(addr))

    def _read(self, sel: selectors.BaseSelector, sock: Any, st: _Pending) -> None:
        try:
            chunk = sock.recv(MAX_HEAD + 1)
        except BlockingIOError:
            return
        except OSError:
            chunk = b""
        if not chunk:  # the client left before its request was in
            sel.unregister(sock)
            self.shutdown_request(sock)
            return
        st.buf += chunk
        if b"\r\n\r\n" in st.buf or b"\n\n" in st.buf:
            sel.unregister(sock)
            self._dispatch(sock, st)
        elif len(st.buf) > MAX_HEAD:
            sel.unregister(sock)
            self._refuse(sock, TOO_LARGE)

    def _expire(self, sel: selectors.BaseSelector) -> None:
        now = time.monotonic()
        late = [k for k in list(sel.get_map().values()) if k.data is not None and k.data.deadline < now]
        for key in late:
            sel.unregister(key.fileobj)
            self._refuse(key.fileobj, TOO_SLOW)

    def _dispatch(self, sock: socket.socket, st: _Pending) -> None:
        sock.setblocking(True)
        pool, queued = self.pools[is_search(st.buf)]
        if not queued.acquire(blocking=False):
            self._refuse(sock, BUSY)
            return
        self.heads[sock.fileno()] = st.buf
        self.arrived[sock.fileno()] = time.monotonic()  # a search's budget counts from here, queueing included
        pool.submit(self._work, sock, st.addr, queued)

    def _refuse(self, sock: socket.socket, reply: bytes) -> None:
        try:
            sock.setblocking(True)
            sock.settimeout(1.0)
            sock.sendall(reply)
        except OSError:
            pass
        self.shutdown_request(sock)

    def _work(self, sock: socket.socket, addr: Any, queued: threading.BoundedSemaphore) -> None:
        try:
            self.finish_request(sock, addr)
        except Exception:  # noqa: BLE001 - socketserver's own policy: report, close, go on
            self.handle_error(sock, addr)
        finally:
            self.heads.pop(sock.fileno(), None)
            self.arrived.pop(sock.fileno(), None)
            self.shutdown_request(sock)
            queued.release()

    def shutdown_request(self, request: Any) -> None:
        self.open.discard(id(request))
        super().shutdown_request(request)

    def handle_error(self, request: Any, client_address: Any) -> None:
        if not getattr(self.RequestHandlerClass, "quiet", False):
            super().handle_error(request, client_address)

    def server_close(self) -> None:
        self._closing = True
        super().server_close()
        if not hasattr(self, "pools"):  # the bind failed: socketserver closes before __init__ went on
            return
        for pool, _ in self.pools.values():
            pool.shutdown(wait=False, cancel_futures=True)
        for s in (self._wake_r, self._wake_w):
            s.close()
