"""The explorer under load: latency of /api/estimate at 20 and 100 concurrent clients, and the
worst request time for the largest inputs the API allows.

Starts ``meshforge explore --port 0`` as a subprocess on the loopback interface (nothing else
is contacted), runs each phase with a fixed number of requests and a time cap, prints the
figures and stops the server. Clients are threads in this process, each with its own
connection per request (the explorer answers HTTP/1.0: one request per connection), so a
client sees connect, queueing and answer time; one client alone gives the service time the
others queue behind (on a loaded machine, compare the phases side by side). Also measured: the same load while 100 idle
connections are held open (they must cost no worker), and the largest /api/best,
/api/estimate and /api/config (the search stops at its budget and says so: ``partial``).

    python bench/bench_explore_load.py [--requests 1000 --cap-s 60]
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import socket
import statistics
import subprocess
import sys
import threading
import time
from urllib.parse import urlencode

LARGEST = {
    "model": "custom",
    "layers": 1024,
    "hidden": 131072,
    "heads": 1024,
    "ffn_hidden": 1048576,
    "vocab": 1048576,
    "gpus": 16384,
    "gpus_per_node": 64,
    "seq_len": 1048576,
    "global_batch": 1048576,
}


def get(port: int, path: str, timeout: float = 30.0) -> tuple[int, float, bytes]:
    t0 = time.perf_counter()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("GET", path)
        r = conn.getresponse()
        body = r.read()
        return r.status, time.perf_counter() - t0, body
    except OSError:
        return 0, time.perf_counter() - t0, b""
    finally:
        conn.close()


def load(port: int, clients: int, total: int, cap_s: float) -> dict:
    """``clients`` threads share ``total`` /api/estimate requests (varied layouts), capped at ``cap_s``."""
    times: list[float] = []
    status: dict[int, int] = {}
    lock = threading.Lock()
    left = [total]
    stop_at = time.monotonic() + cap_s

    def client(i: int) -> None:
        k = 0
        while time.monotonic() < stop_at:
            with lock:
                if left[0] <= 0:
                    return
                left[0] -= 1
            q = {"gpus": 8 << (k % 4), "tp": 1 << (i % 4), "zero": k % 4, "seq_len": 2048 << (i % 3)}
            code, dt, _ = get(port, "/api/estimate?" + urlencode(q))
            k += 1
            with lock:
                times.append(dt)
                status[code] = status.get(code, 0) + 1

    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    times.sort()
    q = statistics.quantiles(times, n=100, method="inclusive") if len(times) > 1 else times * 99
    return {"n": len(times), "p50": q[49], "p99": q[98], "max": times[-1], "status": status, "rps": len(times) / wall}


def start_server() -> tuple[subprocess.Popen, int]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "meshforge", "explore", "--port", "0"]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
    line = p.stdout.readline()  # "meshforge explore: http://127.0.0.1:PORT/ ..."
    port = int(line.split("http://127.0.0.1:")[1].split("/")[0])
    return p, port


def show(name: str, r: dict) -> None:
    print(
        f"{name:<44} n={r['n']:5d}  p50 {1000 * r['p50']:7.1f} ms  p99 {1000 * r['p99']:7.1f} ms  "
        f"max {1000 * r['max']:7.1f} ms  {r['rps']:6.0f} req/s  status {r['status']}"
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=1000, help="requests per load phase")
    ap.add_argument("--cap-s", type=float, default=60.0, help="time cap per load phase")
    a = ap.parse_args()
    server, port = start_server()
    try:
        print(f"meshforge explore on 127.0.0.1:{port}; {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}")
        get(port, "/api/estimate?")  # warm
        show("/api/estimate, 1 client (the service time)", load(port, 1, a.requests // 5, a.cap_s))
        for clients in (20, 100):
            show(f"/api/estimate, {clients} concurrent clients", load(port, clients, a.requests, a.cap_s))
        idle = [socket.create_connection(("127.0.0.1", port)) for _ in range(100)]
        try:
            show("/api/estimate, 20 clients + 100 idle connections", load(port, 20, a.requests, a.cap_s))
        finally:
            for s in idle:
                s.close()
        for path in ("best", "estimate", "config"):
            code, dt, body = get(port, f"/api/{path}?" + urlencode(LARGEST), timeout=60)
            partial = json.loads(body).get("partial") if path == "best" and code == 200 else None
            extra = f", partial={partial}" if partial is not None else ""
            print(f"largest allowed input, /api/{path}: {dt:.2f} s wall, HTTP {code}{extra}")
    finally:
        server.terminate()
        server.wait(timeout=10)


if __name__ == "__main__":
    main()
