"""safeio/ (issue 50): regular files read bounded, JSON and TOML parsed with a depth limit, schemas
that name the first field that is wrong, and writes that never go through a link; a zstd stream
cut off inside a frame is an error. The commands that use them are tested end to end in
tests/integration/test_files_as_data.py."""

from __future__ import annotations

import io
import os
import subprocess
import sys

import pytest

from meshforge.errors import MeshforgeError
from meshforge.safeio.files import read_regular, regular_size, sha256_declared
from meshforge.safeio.links import LinkRefused, make_dir, open_append, refuse_links, remove, write_new
from meshforge.safeio.parse import MAX_DEPTH, loads_json, loads_toml, nesting_depth, read_json
from meshforge.safeio.schema import FILE_NAME, Int, ListOf, MapOf, Null, Obj, OneOf, Str, check

# --- reading -------------------------------------------------------------------------------------------


def test_a_fifo_a_device_and_a_directory_are_refused_by_name_without_waiting(tmp_path):
    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "zero").symlink_to("/dev/zero")
    for name, kind in [("fifo", "a FIFO"), ("zero", "a character device")]:
        with pytest.raises(MeshforgeError, match=f"is not a regular file: it is {kind}"):
            read_regular(tmp_path / name)
        with pytest.raises(MeshforgeError, match=kind):
            regular_size(tmp_path / name)
    with pytest.raises(MeshforgeError, match="a directory"):
        read_regular(tmp_path)


def test_a_file_is_read_no_further_than_its_cap_or_its_declared_size(tmp_path):
    f = tmp_path / "f"
    f.write_bytes(b"x" * 100)
    assert read_regular(f, cap=100) == b"x" * 100
    with pytest.raises(MeshforgeError, match="100 bytes, more than the 99"):
        read_regular(f, cap=99)
    import hashlib

    assert sha256_declared(f, 100, MeshforgeError, "fix") == hashlib.sha256(b"x" * 100).hexdigest()
    with pytest.raises(MeshforgeError, match="has 100 bytes, 99 were written"):
        sha256_declared(f, 99, MeshforgeError, "fix")


def test_a_link_that_leads_back_to_itself_is_named_as_a_loop(tmp_path):
    (tmp_path / "loop").symlink_to(tmp_path / "loop")
    with pytest.raises(MeshforgeError, match="leads back to itself"):
        read_regular(tmp_path / "loop")


# --- parsing ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("depth", [MAX_DEPTH, MAX_DEPTH + 1, 50_000])
def test_json_deeper_than_the_limit_is_refused_in_one_sentence(depth):
    text = "[" * depth + "]" * depth
    if depth <= MAX_DEPTH:
        assert loads_json(text, "x") is not None
        return
    with pytest.raises(MeshforgeError, match=f"more than {MAX_DEPTH} levels deep"):
        loads_json(text, "x")


def test_brackets_inside_strings_and_comments_do_not_count():
    s = '"' + "[" * 1000 + '"'
    assert nesting_depth('{"a": ' + s + "}") == 1
    assert nesting_depth("a = " + s + "\n# " + "{" * 1000 + "\n", toml=True) == 0
    assert loads_toml("a = " + s + "\n", "x")["a"] == "[" * 1000


def test_toml_nested_50000_deep_is_refused_not_a_recursion_error():
    with pytest.raises(MeshforgeError, match="levels deep"):
        loads_toml("a = " + "[" * 50_000 + "]" * 50_000, "config file c.toml")
    with pytest.raises(MeshforgeError, match="levels deep"):
        loads_toml("a = " + "{b = " * 50_000 + "1" + "}" * 50_000, "config file c.toml")


def test_a_file_that_is_not_json_or_not_utf8_says_cannot_read_it(tmp_path):
    (tmp_path / "a.json").write_text("{not json")
    (tmp_path / "b.json").write_bytes(b'{"x": "\xff"}')
    (tmp_path / "c.json").write_text("1" * 5000)  # more digits than Python's int() takes
    with pytest.raises(MeshforgeError, match=r"cannot read .*a.json: it is not valid JSON"):
        read_json(tmp_path / "a.json")
    with pytest.raises(MeshforgeError, match=r"cannot read .*b.json: it is not UTF-8"):
        read_json(tmp_path / "b.json")
    with pytest.raises(MeshforgeError, match="is not valid JSON"):
        read_json(tmp_path / "c.json")


# --- schemas ------------------------------------------------------------------------------------------

SHARD = Obj({"file": Str(FILE_NAME), "tokens": Int(0)})
INDEX = Obj(
    {
        "dtype": Str(choices=("uint16", "uint32")),
        "splits": MapOf(Str(), ListOf(SHARD)),
        "eos": OneOf((Int(0), Null()), "an id or null"),
    }
)


@pytest.mark.parametrize(
    "doc, said",
    [
        ({"dtype": "float64", "splits": {}, "eos": 1}, "dtype must be one of 'uint16', 'uint32', not 'float64'"),
        ({"dtype": "uint16", "eos": 1}, "splits is missing"),
        ({"dtype": "uint16", "splits": {"train": {}}, "eos": 1}, "splits['train'] must be a list"),
        (
            {"dtype": "uint16", "splits": {"t": [{"file": "a", "tokens": "9"}]}, "eos": 1},
            "['t'][0].tokens must be a whole",
        ),
        ({"dtype": "uint16", "splits": {"t": [{"file": "../x", "tokens": 9}]}, "eos": 1}, "a plain file name"),
        ({"dtype": "uint16", "splits": {"t": [{"file": "a", "tokens": True}]}, "eos": 1}, "not True"),
        ({"dtype": "uint16", "splits": {}, "eos": -1}, "eos must be an id or null"),
        ([1], "the document must be an object"),
    ],
)
def test_a_schema_names_the_first_field_that_is_not_what_it_must_be(doc, said):
    with pytest.raises(MeshforgeError, match="index.json: .*; re-run"):
        check(doc, INDEX, "index.json", MeshforgeError, "re-run")
    with pytest.raises(MeshforgeError) as e:
        check(doc, INDEX, "index.json", MeshforgeError, "re-run")
    assert said in str(e.value)
    check(
        {"dtype": "uint16", "splits": {"t": [{"file": ".metadata", "tokens": 0}]}, "eos": None},
        INDEX,
        "i",
        MeshforgeError,
        "",
    )


# --- writing ------------------------------------------------------------------------------------------


def test_writes_never_go_through_a_link(tmp_path):
    mine = tmp_path / "mine.txt"
    mine.write_text("mine\n")
    run = tmp_path / "run"
    run.mkdir()
    for name in ("config.toml", "events.jsonl"):
        (run / name).symlink_to(mine)
    with pytest.raises(LinkRefused, match="is a symbolic link"):
        write_new(run / "config.toml", "x")
    with pytest.raises(LinkRefused, match="is a symbolic link"):
        open_append(run / "events.jsonl")
    (run / "checkpoints").symlink_to(tmp_path)
    with pytest.raises(LinkRefused, match="is a symbolic link"):
        make_dir(run / "checkpoints")
    with pytest.raises(LinkRefused, match="is a symbolic link"):
        remove(run / "checkpoints")
    assert mine.read_text() == "mine\n" and (tmp_path / "run").is_dir()
    write_new(run / "summary.json", "{}")  # a regular file (or none): written
    write_new(run / "summary.json", "{}\n")
    assert (run / "summary.json").read_text() == "{}\n"


def test_refuse_links_looks_below_the_folders_a_run_writes_and_not_elsewhere(tmp_path):
    run = tmp_path / "run"
    (run / "checkpoints" / "step-00000002").mkdir(parents=True)
    (run / "notes").mkdir()
    (run / "notes" / "link").symlink_to(tmp_path)  # a folder of the user's: not meshforge's to judge
    refuse_links(run, ["checkpoints", "config.toml"], "fix")
    (run / "checkpoints" / ".tmp-step-00000004").symlink_to(tmp_path)
    with pytest.raises(LinkRefused, match=r"\.tmp-step-00000004 is a symbolic link"):
        refuse_links(run, ["checkpoints"], "fix")
    os.mkfifo(run / "config.toml")
    with pytest.raises(LinkRefused, match="FIFO"):
        refuse_links(run, ["config.toml"], "fix")


# --- compressed streams ----------------------------------------------------------------------------------


def test_a_zstd_stream_cut_off_inside_a_frame_is_an_error_and_frames_are_read_across():
    zstandard = pytest.importorskip("zstandard")
    from meshforge.data.zstd_frames import ZstdFrames

    a, b = os.urandom(50_000).hex().encode(), b"second frame\n" * 1000
    packed = zstandard.ZstdCompressor().compress(a) + zstandard.ZstdCompressor().compress(b)
    whole = io.BufferedReader(ZstdFrames(io.BytesIO(packed), zstandard.ZstdDecompressor())).read()
    assert whole == a + b
    with pytest.raises(EOFError, match="truncated"):
        io.BufferedReader(ZstdFrames(io.BytesIO(packed[:-10]), zstandard.ZstdDecompressor())).read()


def test_a_small_zstd_bomb_is_handed_out_a_slice_at_a_time():
    zstandard = pytest.importorskip("zstandard")
    from meshforge.data.zstd_frames import FEED, ZstdFrames

    packed = zstandard.ZstdCompressor().compress(b"\0" * (256 << 20))
    assert len(packed) < 64 << 10
    frames = ZstdFrames(io.BytesIO(packed), zstandard.ZstdDecompressor())
    buf = bytearray(1 << 16)
    assert frames.readinto(buf) == len(buf)
    assert len(frames.pending) <= 32768 * FEED  # one feed's output, not the whole 256 MiB


@pytest.mark.skipif(sys.platform != "linux", reason="RLIMIT_AS as Linux applies it")
def test_a_small_file_reads_under_a_memory_limit_below_its_cap(tmp_path):
    """The cap bounds what is read, not what is allocated: ``f.read(cap + 1)`` asked for 4 GiB at
    once, and a run under `ulimit -v` lost its report.html to a MemoryError."""
    small = tmp_path / "small.json"
    small.write_bytes(b"{}" * 50)
    code = (
        "import resource, sys\n"
        "resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30))\n"
        "from meshforge.safeio.files import read_regular\n"
        "print(len(read_regular(sys.argv[1], cap=4 << 30)))\n"
    )
    r = subprocess.run([sys.executable, "-c", code, str(small)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "100", r.stderr[-2000:]
