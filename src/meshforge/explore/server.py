"""``meshforge explore``: a standard-library HTTP server for the page and its JSON API.

Routes (GET only): ``/`` (or ``/index.html``) the page, built once from static/ (page.py);
``/api/presets``; ``/api/estimate``, ``/api/best`` and ``/api/config`` take the parameters of
``params.SPECS`` as a query string. A parameter the
API refuses is answered 400 with ``{"error": message}``; anything unexpected 500 with a
fixed message: no traceback ever reaches the client. Nothing is read from or written to
disk on a request. Requests whose Host header names another host are refused (a page on
another site cannot reach the server through a rebound DNS name).

Nobody can hold it hostage: connections are read by one thread and answered by a fixed pool
(pool.py: no thread per connection; idle and half-sent requests are timed out), and the layout
search stops at ``SEARCH_BUDGET_S`` (its answer marked partial) or as soon as the client
hangs up.
"""

from __future__ import annotations

import io
import json
import select
import socket
import sys
import time
import traceback
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler
from typing import Any
from urllib.parse import parse_qs, urlsplit

from meshforge.errors import MeshforgeError

from . import answers
from .page import page
from .params import BadRequest, parse
from .pool import WRITE_S, PoolServer

MAX_QUERY = 4096
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


Gone = Callable[[], bool] | None


def _best(v: dict[str, Any], gone: Gone, budget_s: float) -> Any:
    return answers.best(v, deadline=time.monotonic() + budget_s, cancelled=gone)


API: dict[str, Callable[[dict[str, Any], Gone, float], Any]] = {
    "/api/estimate": lambda v, gone, budget_s: answers.evaluate(v),
    "/api/best": _best,
}


def route(target: str, gone: Gone = None, budget_s: float = SEARCH_BUDGET_S) -> Reply:
    """The reply to ``GET target`` (raises BadRequest / MeshforgeError for refused parameters);
    ``gone`` says whether the client has hung up, ``budget_s`` bounds a search (long work stops then)."""
    url = urlsplit(target)
    if len(url.query) > MAX_QUERY:
        raise BadRequest(f"the query string is longer than {MAX_QUERY} characters")
    if url.path in ("/", "/index.html"):
        return Reply(200, "text/html; charset=utf-8", page())
    if url.path == "/api/presets":
        return json_reply(200, answers.presets())
    query = parse_qs(url.query, keep_blank_values=True, strict_parsing=False, max_num_fields=64)
    if url.path in API:
        return json_reply(200, API[url.path](parse(query), gone, budget_s))
    if url.path == "/api/config":
        text = answers.config_file(parse(query))
        disposition = 'attachment; filename="meshforge-train.toml"'
        return Reply(200, "application/toml; charset=utf-8", text.encode(), {"Content-Disposition": disposition})
    return json_reply(404, {"error": f"no such page: {url.path}; the API is /api/estimate, /api/best, /api/config"})


class Handler(BaseHTTPRequestHandler):
    server_version = "meshforge-explore"
    sys_version = ""
    quiet = False
    timeout = WRITE_S

    def setup(self) -> None:
        super().setup()
        pool = isinstance(self.server, PoolServer)
        self.arrived = self.server.arrival(self.connection) if pool else time.monotonic()
        head = self.server.take_head(self.connection) if pool else None
        if head is not None:  # the reader thread has the request line and headers already
            self.rfile = io.BytesIO(head)

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        self._send(self._reply())

    def do_HEAD(self) -> None:  # noqa: N802
        self._send(self._reply())  # the GET's headers (its Content-Length too), no body (see _send)

    def _refuse_method(self) -> None:
        self._send(json_reply(405, {"error": f"{self.command} is not served; the explorer answers GET only"}))

    do_POST = do_PUT = do_DELETE = do_PATCH = do_OPTIONS = _refuse_method

    def _reply(self) -> Reply:
        try:
            if not self._host_ok():
                return json_reply(403, {"error": "this server answers requests to the local host only"})
            budget = getattr(self.server, "search_budget_s", SEARCH_BUDGET_S) - (time.monotonic() - self.arrived)
            return route(self.path, self._client_gone, max(0.0, budget))  # the wait for a worker counts
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

    def handle(self) -> None:
        """A client that goes away mid-answer (closed tab, curl | head) is not an error."""
        try:
            super().handle()
        except ConnectionError:
            pass

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (http.server's signature)
        if not self.quiet:
            super().log_message(format, *args)


def make_server(
    host: str = "127.0.0.1", port: int = 8800, quiet: bool = False, search_budget_s: float = SEARCH_BUDGET_S
) -> PoolServer:
    """A bound, not yet serving, server (port 0: any free port; read ``server.server_address``);
    ``search_budget_s``: how long /api/best may search (tests that need the full ranking raise it)."""
    handler = type("ExploreHandler", (Handler,), {"quiet": quiet})
    cls = type("Server6", (PoolServer,), {"address_family": socket.AF_INET6}) if ":" in host else PoolServer
    server = cls((host, port), handler)
    server.search_budget_s = search_budget_s
    page()  # read the page's files now: a broken install fails here, not on the first visit
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
