"""The strategy explorer's JSON API, served in-process on a free port: its answers, its
refusals (400 with a message, never a traceback), and the textbook's three cases."""

from __future__ import annotations

import http.client
import json
import socket
import threading
import urllib.parse

import pytest

from meshforge.cli.main import build_parser
from meshforge.config import load_config
from meshforge.explore import make_server, server
from meshforge.explore.params import SPECS
from meshforge.resolve import resolve

SEVEN_B = {  # the textbook's 7B: the Llama-2-7B shape (6.7B parameters)
    "model": "custom",
    "layers": 32,
    "hidden": 4096,
    "heads": 32,
    "kv_heads": 32,
    "ffn_hidden": 11008,
    "vocab": 32000,
    "gpus": 8,
    "global_batch": 8,
    "seq_len": 4096,
}
HBM = 80  # GiB, the h100-sxm preset


@pytest.fixture(scope="module")
def port():
    srv = make_server("127.0.0.1", 0, quiet=True, search_budget_s=600)  # full rankings even on a loaded machine
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    yield srv.server_address[1]
    srv.shutdown()
    srv.server_close()


def request(port: int, path: str, method: str = "GET", host: str | None = None) -> tuple[int, dict, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    conn.putrequest(method, path, skip_host=host is not None)
    if host is not None:
        conn.putheader("Host", host)
    conn.endheaders()
    r = conn.getresponse()
    body = r.read()
    conn.close()
    return r.status, dict(r.getheaders()), body


def api(port: int, what: str, **params) -> tuple[int, dict]:
    status, _, body = request(port, f"/api/{what}?" + urllib.parse.urlencode(params))
    return status, json.loads(body)


def estimate(port: int, **params) -> dict:
    status, a = api(port, "estimate", **params)
    assert status == 200, a
    return a


def test_page_is_self_contained(port):
    status, headers, body = request(port, "/")
    assert status == 200 and headers["Content-Type"].startswith("text/html")
    page = body.decode()
    assert "<script>" in page and "/api/estimate" in page
    assert "http://" not in page and "https://" not in page  # no CDN, nothing fetched from elsewhere
    assert "default-src 'none'" in headers["Content-Security-Policy"]


def test_presets_list_models_gpus_and_ranges(port):
    status, p = api(port, "presets")
    assert status == 200
    assert "llama3.1-405b" in p["models"] and p["models"]["llama3.1-405b"]["num_params"] > 4e11
    assert p["gpus"]["h100-sxm"]["hbm_gib"] == HBM
    assert p["params"]["gpus"]["max"] >= 16384 and "zero_bubble" in p["params"]["schedule"]["choices"]
    assert p["models"]["mixtral-8x7b"]["num_experts"] == 8 and p["models"]["llama3.1-8b"]["num_experts"] == 0
    assert p["gpus"]["h100-sxm"]["can_offload"] and not p["gpus"]["cpu"]["can_offload"]


def test_estimate_answers_with_the_planners_breakdown(port):
    a = estimate(port, model="llama3.1-8b", gpus=8, tp=2, zero=1)
    e = a["estimate"]
    mem = e["memory_gib"]
    parts = ("params", "grads", "optimizer", "activations", "working", "weight_copies", "buffers", "reserve")
    assert mem["total"] == pytest.approx(sum(mem[k] for k in (*parts, "grads_not_at_peak")), rel=1e-3)
    assert a["layout"]["dp_shard"] == 4 and a["layout"]["tp"] == 2
    assert e["step_time_s"] == pytest.approx(sum(e["step_s"].values()), rel=1e-6)
    assert set(e["comm_s"]) == {"tp", "cp", "pp", "dp"} and e["comm_s"]["tp"] > 0 and e["comm_s"]["dp"] > 0
    assert 0 < e["mfu"] <= e["hfu"] < 1
    # ZeRO-1 under tp is a rule of parallel/rules.py: shown in its words, as unsupported
    assert [p["kind"] for p in a["problems"]] == ["unsupported"] and "ZeRO-1" in a["problems"][0]["message"]
    assert a["exists"] and not a["runnable"]


def test_changing_tp_and_zero_changes_memory_and_mfu(port):
    base = estimate(port, model="llama3.1-8b", gpus=8)["estimate"]
    tp2 = estimate(port, model="llama3.1-8b", gpus=8, tp=2)["estimate"]
    z3 = estimate(port, model="llama3.1-8b", gpus=8, zero=3)["estimate"]
    assert tp2["memory_gib"]["total"] < base["memory_gib"]["total"] and tp2["mfu"] != base["mfu"]
    states = ("params", "grads", "optimizer")  # ZeRO-3 shards all of DDP's 16 bytes per parameter over 8
    z3_states, base_states = (sum(e["memory_gib"][k] for k in states) for e in (z3, base))
    assert z3_states == pytest.approx(base_states / 8, rel=1e-6)


def test_layout_rules_in_words(port):
    a = estimate(port, model="debug", gpus=8, tp=8)  # 4 heads over 8 tp ranks
    assert not a["exists"] and any(p["key"] == "model.heads" for p in a["problems"])
    a = estimate(port, model="llama3.1-8b", gpus=8, tp=3)  # 3 does not divide 8 GPUs
    assert a["estimate"] is None and "not divisible" in a["problems"][0]["message"]


def test_textbook_7b_on_8_gpus_needs_fsdp(port):
    dp = estimate(port, **SEVEN_B, zero=0)
    fsdp = estimate(port, **SEVEN_B, zero=3)
    assert dp["layout"]["dp_shard"] == 8 and dp["runnable"] and fsdp["runnable"]
    assert dp["estimate"]["memory_gib"]["total"] * 2**30 / 1e9 > 80  # > 80 GB per GPU
    assert not dp["estimate"]["fits"]
    assert fsdp["estimate"]["fits"] and fsdp["estimate"]["memory_gib"]["total"] < HBM


def test_offload_moves_the_model_states_to_the_host(port):
    kept = estimate(port, **SEVEN_B, zero=3)
    off = estimate(port, **SEVEN_B, zero=3, offload="cpu")
    assert off["runnable"] and off["layout"]["offload"] == "cpu"
    states = ("params", "grads", "optimizer")
    moved = sum(kept["estimate"]["memory_gib"][k] for k in states)
    assert sum(off["estimate"]["memory_gib"][k] for k in states) == 0
    assert off["estimate"]["host_memory_gib"]["total"] == pytest.approx(moved, rel=1e-6)
    assert off["estimate"]["step_time_s"] == pytest.approx(sum(off["estimate"]["step_s"].values()), rel=1e-6)
    refused = estimate(port, **SEVEN_B, zero=1, offload="cpu")  # the layout rule, in its words
    assert not refused["exists"] and refused["problems"][0]["key"] == "parallel.offload"


def test_ep_on_an_moe_preset_adds_the_all_to_all(port):
    moe = {"model": "mixtral-8x7b", "gpus": 8, "zero": 3}
    one, eight = estimate(port, **moe)["estimate"], estimate(port, **moe, ep=8)
    assert "ep" not in one["comm_s"] and eight["layout"]["ep"] == 8 and eight["runnable"], eight["problems"]
    e = eight["estimate"]
    assert e["comm_s"]["ep"] == e["ep_a2a_s"] > 0 and e["comm_exposed_s"]["ep"] == e["ep_a2a_s"]
    assert e["step_time_s"] == pytest.approx(sum(e["step_s"].values()), rel=1e-6)  # the all-to-all is in the bars
    assert e["memory_gib"]["total"] != one["memory_gib"]["total"]
    status, _, toml = request(port, "/api/config?model=debug-moe&gpus=4&ep=2&zero=3&global_batch=4&seq_len=64")
    assert status == 200 and b"ep = 2" in toml and b"dp_shard = 4" in toml


def test_best_searches_ep_or_keeps_a_given_one(port):
    moe = {"model": "mixtral-8x7b", "gpus": 16, "top": 20}
    status, free = api(port, "best", **moe)
    assert status == 200 and any(L["ep"] > 1 for L in free["layouts"])
    status, fixed = api(port, "best", **moe, ep=4)
    assert status == 200 and fixed["layouts"] and {L["ep"] for L in fixed["layouts"]} == {4}
    for bad, words in ((dict(ep=3), "model.num_experts = 8"), (dict(model="llama3.1-8b", ep=2), "dense")):
        status, err = api(port, "best", **{**moe, **bad})
        assert status == 400 and words in err["error"] and "parallel.ep" in err["error"]


@pytest.mark.slow  # the first layout with pp > 1 imports torch.distributed.pipelining
def test_textbook_405b_on_128_gpus_needs_tp8_pp_and_fsdp(port):
    big = {"model": "llama3.1-405b", "gpus": 128, "global_batch": 128, "recompute": "full"}
    full = estimate(port, **big, tp=8, pp=4, zero=3)
    assert full["runnable"] and full["estimate"]["fits"], full["estimate"]["overflow"]
    for drop in ({"tp": 8, "pp": 4, "zero": 0}, {"tp": 1, "pp": 1, "zero": 3}, {"tp": 8, "pp": 1, "zero": 0}):
        e = estimate(port, **big, **drop)["estimate"]
        assert not e["fits"], drop
    status, b = api(port, "best", model="llama3.1-405b", gpus=128, global_batch=128, top=5)
    assert status == 200 and b["layouts"]
    assert all(L["fits"] and L["tp"] * L["pp"] >= 4 for L in b["layouts"])  # nothing fits without model parallelism


def test_textbook_405b_on_8_gpus_fits_nothing(port):
    tiny = {"model": "llama3.1-405b", "gpus": 8, "global_batch": 8, "recompute": "full"}
    for lay in ({"tp": 8}, {"tp": 8, "zero": 3}, {"pp": 8}, {"zero": 3}):
        assert not estimate(port, **tiny, **lay)["estimate"]["fits"], lay
    status, b = api(port, "best", **tiny)
    assert status == 200 and b["layouts"] == [] and "fits no layout" in b["message"]


def test_config_download_is_a_runnable_train_config(port, tmp_path):
    status, headers, body = request(port, "/api/config?model=llama3.1-8b&gpus=8&tp=2&zero=3&recompute=selective")
    assert status == 200 and "attachment" in headers["Content-Disposition"]
    path = tmp_path / "c.toml"
    path.write_bytes(body)
    cfg = resolve(load_config(path), 8)
    assert (cfg.layout.tp, cfg.layout.dp_shard, cfg.layout.zero_stage) == (2, 4, 3)
    assert cfg.layout.activation_checkpoint == "selective"
    status, err = api(port, "config", model="llama3.1-405b", gpus=8)
    assert status == 400 and "does not fit" in err["error"]
    status, err = api(port, "config", model="llama3.1-8b", gpus=8, tp=2, zero=1)
    assert status == 400 and "ZeRO-1" in err["error"]


@pytest.mark.parametrize(
    "query, names",
    [
        ("tp=abc", "tp"),
        ("gpus=-1", "gpus"),
        ("gpus=100000", "gpus"),
        ("seq_len=1e9", "seq_len"),
        ("hbm_gib=nan", "hbm_gib"),
        ("modle=debug", "model"),
        ("model=llama9", "llama"),
        ("gpu=tpu", "gpu"),
        ("tp=1&tp=2", "tp"),
        ("layers=4", "model=custom"),
        ("model=custom&layers=2", "hidden"),
        ("model=custom&layers=2&hidden=100&heads=3&ffn_hidden=8&vocab=8", "heads"),
        ("tp=16&gpus=8", "tp"),
        ("micro_batch=9&global_batch=8", "micro_batch"),
        ("sp=maybe", "sp"),
        ("gpu=cpu&precision=fp8", "fp8"),
        ("offload=disk", "offload"),
        ("gpu=cpu&precision=fp32&offload=cpu", "offload"),
        ("ep=0", "ep"),
        ("model=llama3.1-8b&ep=2", "dense (model.num_experts = 0); set parallel.ep = 1"),
        ("model=mixtral-8x7b&gpus=16&ep=16", "must divide model.num_experts = 8"),
        ("model=mixtral-8x7b&gpus=12&ep=8", "must divide parallel.dp_shard x parallel.cp = 12"),
        ("model=mixtral-8x7b&gpus=4&ep=8", "ep = 8 is more than gpus = 4"),
        ("q=" + "x" * 5000, "query"),
    ],
)
def test_bad_parameters_are_refused_with_a_message(port, query, names):
    status, headers, body = request(port, "/api/estimate?" + query)
    assert status == 400 and headers["Content-Type"].startswith("application/json")
    msg = json.loads(body)["error"]
    assert names in msg and "Traceback" not in msg


def test_unexpected_errors_answer_500_without_a_traceback(port, monkeypatch):
    def boom(values):
        raise RuntimeError("secret internals")

    monkeypatch.setitem(server.API, "/api/estimate", boom)
    status, headers, body = request(port, "/api/estimate")
    assert status == 500 and b"secret" not in body and b"Traceback" not in body
    assert "error" in json.loads(body)


def test_only_get_from_the_local_host(port):
    assert request(port, "/api/estimate", method="POST")[0] == 405
    assert request(port, "/", host="evil.example:80")[0] == 403  # a rebound DNS name
    assert request(port, "/", host=f"localhost:{port}")[0] == 200
    assert request(port, "/nowhere")[0] == 404


def test_explore_binds_to_localhost_by_default():
    args = build_parser().parse_args(["explore"])
    assert (args.host, args.port) == ("127.0.0.1", 8800)


def test_one_verdict_fit_and_rules_together(port):
    """The default view does not fit: the verdict says so even though no rule refuses the layout."""
    default = estimate(port)["verdict"]
    assert not default["ok"] and default["kind"] == "does_not_fit"
    assert default["text"].startswith("runs under meshforge train's rules but does not fit: needs ")
    fits = estimate(port, zero=3)
    assert fits["verdict"] == {
        "ok": True,
        "kind": "ok",
        "text": f"fits ({fits['estimate']['memory_gib']['total']:.1f} of 80 GiB) and meshforge train runs it",
    }
    rule = estimate(port, tp=2, zero=1)["verdict"]  # a rule wins over a fit
    assert not rule["ok"] and rule["kind"] == "rules" and "ZeRO-1" in rule["text"] and "it would fit" in rule["text"]


# -- limits: no input gives a 500, no client holds a thread, a search stops at its budget ---------------------------

HOSTILE = ["9" * 400, "-" + "9" * 400, "-1", "0", "nan", "NaN", "inf", "-inf", "1e400", "1e-400", "", "abc", "0x10"]
HOSTILE += ["1_000", "\u0663", "1.5", " 7", "+-3", "1e", ".", "1" * 5000]


@pytest.mark.parametrize("name", [k for k, s in SPECS.items() if s.kind in ("int", "float")])
def test_numeric_parameters_fuzzed_give_400_naming_the_parameter(port, name):
    for raw in HOSTILE:
        status, _, body = request(port, "/api/estimate?" + urllib.parse.urlencode({name: raw}))
        if status == 200:  # an in-range value written oddly but validly (" 7", "1.5" for a float)
            continue
        a = json.loads(body)
        assert status == 400, (name, raw[:30], status, a)
        assert name in a["error"] or "query string" in a["error"], (name, raw[:30], a)
    status, _, body = request(port, "/api/estimate?" + urllib.parse.urlencode({name: "9" * 400}))
    assert status == 400 and "out of range" in json.loads(body)["error"]


def test_a_search_stops_at_its_budget_and_says_partial():
    largest = {"model": "custom", "layers": 1024, "hidden": 131072, "heads": 1024, "ffn_hidden": 1048576}
    largest.update(vocab=1048576, gpus=16384, gpus_per_node=64, seq_len=1048576, global_batch=16384)
    r = server.route("/api/best?" + urllib.parse.urlencode(largest), budget_s=0.05)
    assert r.status == 200 and json.loads(r.body)["partial"] is True
    gone = server.route("/api/best?model=llama3.1-8b&gpus=64", gone=lambda: True)  # the client hung up
    b = json.loads(gone.body)
    assert b["partial"] is True and b["considered"] == 0 and b["layouts"] == []
    whole = json.loads(server.route("/api/best?model=llama3.1-8b&gpus=8", budget_s=600).body)
    assert whole["partial"] is False and whole["layouts"]


def test_idle_and_half_sent_connections_hold_no_worker(port, monkeypatch):
    from meshforge.explore import pool

    monkeypatch.setattr(pool, "READ_S", 0.5)  # connections accepted from now on
    idle = [socket.create_connection(("127.0.0.1", port)) for _ in range(3 * pool.WORKERS + 4)]
    half = socket.create_connection(("127.0.0.1", port))
    half.sendall(b"GET /api/estimate?gpus=8 HTTP/1.1\r\nHost: 127.0.0.1\r\n")  # never finished
    try:
        assert api(port, "estimate", gpus=8)[0] == 200  # answered while all of those are open
        half.settimeout(30)
        assert half.recv(100).startswith(b"HTTP/1.0 408")
    finally:
        for s in [*idle, half]:
            s.close()


def test_client_gone_is_seen_on_a_closed_socket():
    a, b = socket.socketpair()
    h = server.Handler.__new__(server.Handler)
    h.connection = a
    assert not h._client_gone()
    b.close()
    h._checked = 0.0
    assert h._client_gone()
    a.close()


def test_a_search_budget_counts_from_arrival_and_searches_never_take_the_quick_pool(port, monkeypatch):
    """A search that waited for a worker has that much less budget (a queue of searches drains in
    about one budget), and /api/best in absolute form or with a fragment is still a search."""
    import time

    from meshforge.explore import pool

    monkeypatch.setattr(pool.PoolServer, "arrival", lambda self, sock: time.monotonic() - 1e4)  # queued long ago
    status, b = api(port, "best", model="llama3.1-8b", gpus=8)  # 600 s of budget would rank them all
    assert status == 200 and b["partial"] is True
    head = b"GET http://127.0.0.1:1/api/best?gpus=8 HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"
    assert pool.is_search(head) and pool.is_search(b"GET /api/best#x HTTP/1.1\r\n\r\n")
    assert not pool.is_search(b"GET /api/estimate?x=/api/best HTTP/1.1\r\n\r\n") and not pool.is_search(b"\r\n\r\n")


SMALL_FD_SERVER = """
import resource, sys, threading, time
resource.setrlimit(resource.RLIMIT_NOFILE, (200, 200))
from meshforge.explore import make_server, pool
pool.READ_S = 120.0
srv = make_server("127.0.0.1", 0, quiet=True)
threading.Thread(target=srv.serve_forever, daemon=True).start()
print(srv.server_address[1], getattr(srv, "max_open", 150), flush=True)
time.sleep(600)
"""


def test_more_connections_than_open_files_are_refused_503_not_left_in_the_backlog():
    """Under a low open-file limit the server refuses what it cannot hold (503 at once) instead of
    failing accept (EMFILE) and spinning on it, and serves again once the connections go."""
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-c", SMALL_FD_SERVER], stdout=subprocess.PIPE, text=True)
    try:
        port, cap = (int(x) for x in proc.stdout.readline().split())
        assert 8 <= cap < 200
        held = [socket.create_connection(("127.0.0.1", port)) for _ in range(cap + 20)]
        over = held[-1]
        over.settimeout(60)
        assert over.recv(100).startswith(b"HTTP/1.0 503")
        for s in held:
            s.close()
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        for _ in range(100):  # the server sees the closes as it reads; until then it may still say busy
            conn.request("GET", "/api/estimate?gpus=8")
            r = conn.getresponse()
            r.read()
            conn.close()
            if r.status == 200:
                break
        assert r.status == 200
    finally:
        proc.kill()
        proc.wait()


def test_a_config_value_means_here_what_it_means_in_a_config(port):
    """micro_batch 0 is the whole per-rank batch, a -1 degree is inferred (with dp inferred too,
    the layout rules refuse the view, as resolving such a config does), precision auto the device's."""
    a = estimate(port, micro_batch=0, gpus=8, global_batch=32)
    assert (a["layout"]["micro_batch_size"], a["layout"]["num_microbatches"]) == (4, 1)
    status, b = api(port, "estimate", tp=-1)
    assert status == 200 and b["layout"] is None and "only one parallel degree may be -1" in b["verdict"]["text"]
    assert estimate(port, precision="auto", gpu="cpu")["training"]["precision"] == "fp32"
    assert estimate(port, precision="auto")["training"]["precision"] == "bf16"
