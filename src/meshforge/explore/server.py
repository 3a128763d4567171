"""``meshforge explore``: a standard-library HTTP server for the page and its JSON API.

Routes (GET only): ``/`` the page; ``/api/presets``; ``/api/estimate``, ``/api/best`` and
``/api/config`` take the parameters of ``params.SPECS`` as a query string. A parameter the
API refuses is answered 400 with ``{"error": message}``; anything unexpected 500 with a
fixed message: no traceback ever reaches the client. Nothing is read from or written to
disk on a request. Requests whose Host header names another host are refused (a page on
another site cannot reach the server through a rebound DNS name).

Nobody can hold it hostage: a fixed pool of ``WORKERS`` threads answers (not a thread per
connection), with at most ``MAX_PENDING`` connections waiting for one (more are answered 503
at once); a request must arrive whole within ``READ_S``; the layout search stops at
``SEARCH_BUDGET_S`` (its answer marked partial) or as soon as the client hangs up; and the
listen backlog holds a page's burst of requests.
"""

from __future__ import annotations

import json
import select
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, HTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

from meshforge.errors import MeshforgeError

from . import answers
from .page import PAGE
from .params import BadRequest, parse

MAX_QUERY = 4096
WORKERS = 8  # threads answering requests (the work is CPU-bound Python: more would only queue in the GIL)
MAX_PENDING = 256  # accepted connections waiting for a worker; beyond that, 503 at once
BACKLOG = 128  # the listen queue: a page fires several requests at once, many pages more
READ_S = 10.0  # the whole request line and headers must arrive within this
WRITE_S = 10.0  # a client that does not read its answer is dropped after this
SEARCH_BUDGET_S = 1.5  # /api/best stops searching here and answers with the best so far (partial)
SECURITY_HEADERS = {
    "Content-Security-Policy": "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; "
    "connect-src 'self'; img-src data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",
}
LOCAL_NAMES = ("127.0.0.1", "localhost", "::1", "[::1]")


class Reply:
    """A response: status, content type, body, extra headers."""

    def __init__(self, status: int, ctype: str, body: bytes, headers: dict[str, str] | None = None) -> None:
        self.status, self.ctype, self.body, self.headers = status, ctype, body, headers or {}


def json_reply(status: int, data: Any) -> Reply:
    return Reply(status, "application/json; charset=utf-8", json.dumps(data).encode())


def _best(v: dict[str, Any], gone: Callable[[], bool] | None) -> Any:
    return answers.best(v, deadline=time.monotonic() + SEARCH_BUDGET_S, cancelled=gone)


API: dict[str, Callable[[dict[str, Any], Callable[[], bool] | None], Any]] = {
    "/api/estimate": lambda v, gone: answers.evaluate(v),
    "/api/best": _best,
}


def route(target: str, gone: Callable[[], bool] | None = None) -> Reply:
    """The reply to ``GET target`` (raises BadRequest / MeshforgeError for refused parameters);
    ``gone`` says whether the client has hung up (long work stops then)."""
    url = urlsplit(target)
    if len(url.query) > MAX_QUERY:
        raise BadRequest(f"the query string is longer than {MAX_QUERY} characters")
    if url.path in ("/", "/index.html"):
        return Reply(200, "text/html; charset=utf-8", PAGE.encode())
    if url.path == "/api/presets":
        return json_reply(200, answers.presets())
    query = parse_qs(url.query, keep_blank_values=True, strict_parsing=False, max_num_fields=64)
    if url.path in API:
        return json_reply(200, API[url.path](parse(query), gone))
    if url.path == "/api/config":
        text = answers.train_config(parse(query))
        disposition = 'attachment; filename="meshforge-train.toml"'
        return Reply(200, "application/toml; charset=utf-8", text.encode(), {"Content-Disposition": disposition})
    return json_reply(404, {"error": f"no such page: {url.path}; the API is /api/estimate, /api/best, /api/config"})


class Handler(BaseHTTPRequestHandler):
    server_version = "meshforge-explore"
    sys_version = ""
    quiet = False
    timeout = READ_S  # per read; _DeadlineReader bounds the whole request too

    def setup(self) -> None:
        super().setup()
        self.rfile = _DeadlineReader(self.rfile, self.connection, time.monotonic() + READ_S)

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        self._send(self._reply())

    def do_HEAD(self) -> None:  # noqa: N802
        r = self._reply()
        r.body = b""
        self._send(r)

    def _refuse_method(self) -> None:
        self._send(json_reply(405, {"error": f"{self.command} is not served; the explorer answers GET only"}))

    do_POST = do_PUT = do_DELETE = do_PATCH = do_OPTIONS = _refuse_method

    def _reply(self) -> Reply:
        try:
            if not self._host_ok():
                return json_reply(403, {"error": "this server answers requests to the local host only"})
            self.connection.settimeout(WRITE_S)  # the request is in: now the answer's time
            return route(self.path, self._client_gone)
        except (BadRequest, MeshforgeError, ValueError) as e:
            return json_reply(400, {"error": str(e)})
        except Exception:  # never a traceback to the client; the server's console keeps it
            if not self.quiet:
                traceback.print_exc(file=sys.stderr)
            return json_reply(500, {"error": "internal error while answering this request; see the server's console"})

    def _client_gone(self) -> bool:
        """Whether the client hung up (its end readable with nothing to read), checked at most
        every 50 ms: a search asks for every layout it considers."""
        now = time.monotonic()
        if now - getattr(self, "_checked", 0.0) < 0.05:
            return False
        self._checked = now
        try:
            readable, _, _ = select.select([self.connection], [], [], 0)
            return bool(readable) and self.connection.recv(1, socket.MSG_PEEK) == b""
        except (OSError, ValueError):
            return True

    def _host_ok(self) -> bool:
        host = (self.headers.get("Host") or "").strip().lower()
        name = host.rsplit(":", 1)[0] if not host.endswith("]") else host
        bound = str(self.server.server_address[0]).lower()
        if bound not in ("127.0.0.1", "::1"):
            return True  # served beyond this machine on purpose (--host)
        return name in LOCAL_NAMES or name == bound

    def _send(self, r: Reply) -> None:
        self.send_response(r.status)
        self.send_header("Content-Type", r.ctype)
        self.send_header("Content-Length", str(len(r.body)))
        for k, val in {**SECURITY_HEADERS, **r.headers}.items():
            self.send_header(k, val)
        self.end_headers()
        if r.body and self.command != "HEAD":
            self.wfile.write(r.body)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (http.server's signature)
        if not self.quiet:
            super().log_message(format, *args)


class _DeadlineReader:
    """The request's input stream with one deadline for the whole request line and headers
    (a per-read timeout alone lets a client send a byte every few seconds forever)."""

    def __init__(self, raw: Any, sock: socket.socket, deadline: float) -> None:
        self.raw, self.sock, self.deadline = raw, sock, deadline

    def _arm(self) -> None:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"the request did not arrive within {READ_S:.0f} s")
        self.sock.settimeout(min(left, READ_S))

    def readline(self, limit: int = -1) -> bytes:
        self._arm()
        return self.raw.readline(limit)

    def read(self, n: int = -1) -> bytes:
        self._arm()
        return self.raw.read(n)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.raw, name)


class PoolServer(HTTPServer):
    """An HTTP server whose requests run on a fixed pool of threads, with a bounded wait."""

    request_queue_size = BACKLOG
    daemon_threads = True  # kept for callers that read it; the pool's threads never block exit

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.pool = ThreadPoolExecutor(WORKERS, thread_name_prefix="explore")
        self.slots = threading.BoundedSemaphore(WORKERS + MAX_PENDING)

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self.slots.acquire(blocking=False):  # overloaded: say so now rather than queue forever
            try:
                request.sendall(BUSY)
            except OSError:
                pass
            self.shutdown_request(request)
            return
        self.pool.submit(self._work, request, client_address)

    def _work(self, request: Any, client_address: Any) -> None:
        try:
            self.finish_request(request, client_address)
        except Exception:  # noqa: BLE001 - socketserver's own policy: report, close, go on
            self.handle_error(request, client_address)
        finally:
            self.shutdown_request(request)
            self.slots.release()

    def handle_error(self, request: Any, client_address: Any) -> None:
        if not getattr(self.RequestHandlerClass, "quiet", False):
            super().handle_error(request, client_address)

    def server_close(self) -> None:
        super().server_close()
        self.pool.shutdown(wait=False, cancel_futures=True)


BUSY = (
    b"HTTP/1.0 503 Service Unavailable\r\nContent-Type: application/json\r\nRetry-After: 1\r\n"
    b'Content-Length: 57\r\nConnection: close\r\n\r\n{"error": "the explorer is busy; try again in a second"}\n'
)


def make_server(host: str = "127.0.0.1", port: int = 8800, quiet: bool = False) -> PoolServer:
    """A bound, not yet serving, server (port 0: any free port; read ``server.server_address``)."""
    handler = type("ExploreHandler", (Handler,), {"quiet": quiet})
    cls = type("Server6", (PoolServer,), {"address_family": socket.AF_INET6}) if ":" in host else PoolServer
    server = cls((host, port), handler)
    route("/api/best?gpus=8&pp=2&top=1")  # warm: the first pipeline rule imports torch's pipelining (seconds)
    return server


def serve(host: str = "127.0.0.1", port: int = 8800) -> int:
    """Serve until Ctrl-C."""
    server = make_server(host, port)
    shown = f"[{host}]" if ":" in host else host
    print(f"meshforge explore: http://{shown}:{server.server_address[1]}/  (Ctrl-C stops it)", flush=True)
    if host not in ("127.0.0.1", "localhost", "::1"):
        print(f"warning: listening on {host}: anyone who can reach this address can use the explorer", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        print("meshforge explore: stopped")
    finally:
        server.server_close()
    return 0
