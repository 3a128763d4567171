"""The memory tier's wire format and keeper (checkpoint/memory_wire.py, memory_keeper.py): shards are
raw bytes under a JSON header, every figure checked; a keeper answers only the run's token; a peer
that answers garbage is named, never trusted."""

from __future__ import annotations

import socket
import threading

import pytest
import torch

from meshforge.checkpoint.memory_frame import MemoryShardError
from meshforge.checkpoint.memory_keeper import Keeper, request, shared_secret
from meshforge.checkpoint.memory_tier import host_address
from meshforge.checkpoint.memory_wire import ALIGN, check_against, decode, encode
from meshforge.errors import ConfigError

TENSORS = {
    "model.w": torch.arange(12, dtype=torch.float32).reshape(3, 4),
    "model.b": torch.tensor([1.5, -2.0], dtype=torch.bfloat16),
    "train.step": torch.tensor(7, dtype=torch.int64),
}


def _payload(tensors: dict[str, torch.Tensor]) -> tuple[list, bytearray]:
    entries, parts, size = encode(tensors)
    payload = bytearray(b"".join(bytes(p) for p in parts))
    assert len(payload) == size
    return entries, payload


def test_a_shard_round_trips_bit_for_bit():
    entries, payload = _payload(TENSORS)
    got = decode(entries, payload, "test")
    assert all(e["offset"] % ALIGN == 0 for e in entries)
    for k, t in TENSORS.items():
        assert got[k].dtype == t.dtype and torch.equal(got[k], t)
    check_against(got, TENSORS, "test")


@pytest.mark.parametrize(
    "change, words",
    [
        ({"nbytes": 40}, "declares 40 bytes"),
        ({"shape": [3, 5]}, "is 60"),
        ({"offset": 1 << 20}, "past the shard's"),
        ({"offset": 3}, "declares"),
        ({"dtype": "object"}, "unknown dtype"),
        ({"shape": [-1, 4]}, "bad shape"),
    ],
)
def test_a_shard_whose_figures_disagree_is_refused(change, words):
    entries, payload = _payload(TENSORS)
    entries[0] = {**entries[0], **change}
    with pytest.raises(MemoryShardError, match=words):
        decode(entries, payload, "rank 1's shard")


def test_a_shard_cut_short_is_refused():
    entries, payload = _payload(TENSORS)
    with pytest.raises(MemoryShardError, match="past the shard's"):
        decode(entries, payload[:-8], "rank 1's shard")


def test_a_shard_of_another_shape_than_the_ranks_state_is_refused():
    entries, payload = _payload({**TENSORS, "model.w": torch.zeros(4, 3)})
    with pytest.raises(MemoryShardError, match=r"model.w is \(4, 3\).*this rank holds \(3, 4\)"):
        check_against(decode(entries, payload, "x"), TENSORS, "x")
    with pytest.raises(MemoryShardError, match="lacks"):
        check_against({}, TENSORS, "x")


class _Server:
    """A listening socket on loopback whose connections ``handle`` serves (one thread each)."""

    def __init__(self, handle):
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        threading.Thread(target=self._loop, args=(handle,), daemon=True).start()

    def _loop(self, handle):
        while True:
            conn, _ = self.sock.accept()
            threading.Thread(target=handle, args=(conn,), daemon=True).start()


def test_a_keeper_holds_puts_lists_gets_and_trims():
    keeper = Keeper("127.0.0.1", "t" * 64)
    port = _Server(keeper.serve).port
    entries, parts, size = encode(TENSORS)
    for step in (2, 4, 6):
        shard = {"rank": 1, "step": step, "layout": {"world_size": 2}, "info": {}, "tensors": entries}
        request(
            "127.0.0.1", port, "t" * 64, {"op": "put", "rank": 1, "step": step, "shard": shard, "size": size}, parts
        )
    held = request("127.0.0.1", port, "t" * 64, {"op": "list"})[0]["shards"]
    assert sorted(s for _, s, _ in held) == [4, 6]  # the newest two steps of each rank
    h, payload = request("127.0.0.1", port, "t" * 64, {"op": "get", "rank": 1, "step": 6}, max_payload=size)
    assert torch.equal(decode(h["shard"]["tensors"], payload, "x")["model.w"], TENSORS["model.w"])
    request("127.0.0.1", port, "t" * 64, {"op": "trim", "rank": -1, "step": 4})
    assert [s for _, s, _ in request("127.0.0.1", port, "t" * 64, {"op": "list"})[0]["shards"]] == [4]
    with pytest.raises(MemoryShardError, match="no shard of rank 0"):
        request("127.0.0.1", port, "t" * 64, {"op": "get", "rank": 0, "step": 4})


def test_a_keeper_refuses_a_request_without_the_runs_token_before_reading_its_payload():
    keeper = Keeper("127.0.0.1", "t" * 64)
    port = _Server(keeper.serve).port
    with pytest.raises(MemoryShardError, match="without this run's token"):
        request("127.0.0.1", port, "u" * 64, {"op": "put", "rank": 0, "step": 1, "shard": {}, "size": 1 << 40})
    assert keeper.shards == {}


def test_a_peer_that_answers_garbage_is_named_and_refused():
    def garbage(conn):
        with conn:
            conn.recv(1 << 16)
            conn.sendall(b"HTTP/1.1 200 OK\r\n\r\nhello")

    port = _Server(garbage).port
    with pytest.raises(MemoryShardError, match="is not a meshforge memory keeper"):
        request("127.0.0.1", port, "t" * 64, {"op": "list"})


def test_a_keeper_that_declares_a_huge_payload_is_refused_before_it_is_read():
    def huge(conn):
        with conn:
            conn.recv(1 << 16)
            head = b'{"ok": true, "size": 1099511627776}'
            conn.sendall(b"MFK1" + len(head).to_bytes(4, "big") + head)

    port = _Server(huge).port
    with pytest.raises(MemoryShardError, match="declared a payload of 1099511627776 bytes"):
        request("127.0.0.1", port, "t" * 64, {"op": "get", "rank": 0, "step": 1}, max_payload=1 << 20)


def test_the_runs_token_is_made_once_and_kept_private(tmp_path):
    token = shared_secret(tmp_path)
    assert shared_secret(tmp_path) == token and len(token) == 64
    assert (tmp_path / "secret").stat().st_mode & 0o077 == 0
    (tmp_path / "secret").write_text("not a token")
    with pytest.raises(MemoryShardError, match="not a memory keeper token"):
        shared_secret(tmp_path)


def test_a_host_address_is_checked_before_it_names_a_file(monkeypatch):
    monkeypatch.setenv("MESHFORGE_HOST", "../../etc")
    with pytest.raises(ConfigError, match="is not a host address"):
        host_address()
    monkeypatch.setenv("MESHFORGE_HOST", "10.77.0.2")
    assert host_address() == "10.77.0.2"
