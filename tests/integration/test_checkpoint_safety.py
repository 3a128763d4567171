"""A checkpoint is data, never code: a crafted DCP ``.metadata`` (with meta.json's hashes
updated to match, as a tamperer would) is refused by name and runs nothing, through
``train --checkpoint.load``, ``convert --from-checkpoint`` and the loaders themselves."""

import json
import os
import pickle
import shutil

import pytest
from torch.distributed.checkpoint import metadata as dcp_md

from conftest import cli_args, run_cli, tiny_config, tiny_overrides, train
from meshforge.checkpoint import sharded, store
from meshforge.checkpoint.safe_metadata import UnsafeCheckpointError, read_metadata
from meshforge.checkpoint.store import CheckpointError
from meshforge.models.llama import ModelShape, build_model

COMMON = {"train.steps": 2, "optim.warmup_steps": 1, "checkpoint.interval": 2}


@pytest.fixture(scope="module")
def saved(tmp_path_factory, corpus):
    d = tmp_path_factory.mktemp("safe") / "run"
    train(tiny_config(d, corpus, **COMMON))
    return d


class _Payload:
    """Unpickling this runs a shell command: the attack."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _tamper(ckpt, data):
    """Write ``data`` as .metadata and re-hash it in meta.json, as an attacker can."""
    (ckpt / ".metadata").write_bytes(data)
    meta = json.loads((ckpt / "meta.json").read_text())
    meta["files"][".metadata"] = {"bytes": len(data), "sha256": store.sha256_file(ckpt / ".metadata")}
    (ckpt / "meta.json").write_text(json.dumps(meta))


def _crafted_copy(saved, tmp_path, data):
    run = tmp_path / "downloaded"
    shutil.copytree(saved, run)
    ckpt = store.list_complete(run / "checkpoints")[-1].path
    _tamper(ckpt, data)
    return ckpt


def test_a_valid_checkpoint_reads_through_the_restricted_unpickler(saved):
    ckpt = store.list_complete(saved / "checkpoints")[-1].path
    md = read_metadata(ckpt / ".metadata")
    assert md.state_dict_metadata and all(
        isinstance(e, dcp_md.TensorStorageMetadata) for e in md.state_dict_metadata.values()
    )
    # the same bytes through plain pickle give the same entries: nothing was dropped
    plain = pickle.loads((ckpt / ".metadata").read_bytes())
    assert set(plain.state_dict_metadata) == set(md.state_dict_metadata)


def test_code_in_metadata_is_refused_by_train_and_runs_nothing(saved, tmp_path, corpus):
    marker = tmp_path / "PWNED"
    ckpt = _crafted_copy(saved, tmp_path, pickle.dumps(_Payload(marker)))
    o = tiny_overrides(tmp_path / "victim", corpus, **{**COMMON, "checkpoint.load": str(ckpt), "train.steps": 4})
    r = run_cli("train", *cli_args(o))
    assert r.returncode == 2, r.stderr[-2000:]
    assert "meshforge: error:" in r.stderr and "Traceback" not in r.stderr
    assert str(ckpt / ".metadata") in r.stderr and "posix.system" in r.stderr.replace("os.system", "posix.system")
    assert not marker.exists(), "the payload ran"


def test_code_in_metadata_is_refused_by_convert_and_runs_nothing(saved, tmp_path):
    marker = tmp_path / "PWNED"
    ckpt = _crafted_copy(saved, tmp_path, pickle.dumps(_Payload(marker)))
    r = run_cli("convert", "--from-checkpoint", str(ckpt), "--out", str(tmp_path / "hf"))
    assert r.returncode == 2, r.stderr[-2000:]
    assert "not part of a DCP checkpoint" in r.stderr and "Traceback" not in r.stderr
    assert not marker.exists() and not (tmp_path / "hf").exists()


def test_the_loader_itself_refuses_without_verification(saved, tmp_path):
    """A caller that skips store.verify still never reaches pickle.load."""
    marker = tmp_path / "PWNED"
    ckpt = _crafted_copy(saved, tmp_path, pickle.dumps(_Payload(marker)))
    meta = json.loads((ckpt / "meta.json").read_text())
    model = build_model(ModelShape(**meta["model"]), device="cpu", seed=0)
    with pytest.raises(UnsafeCheckpointError, match="not part of a DCP checkpoint"):
        sharded.load_model_only(model, ckpt)
    assert not marker.exists()


def _rewritten(saved, mutate):
    """The saved checkpoint's metadata, changed by ``mutate`` (a well-formed but hostile file)."""
    ckpt = store.list_complete(saved / "checkpoints")[-1].path
    md = pickle.loads((ckpt / ".metadata").read_bytes())
    mutate(md)
    return pickle.dumps(md)


def test_a_non_tensor_entry_is_refused(saved, tmp_path):
    """DCP unpickles non-tensor entries with torch.load(weights_only=False): never let it."""

    def add_bytes(md):
        md.state_dict_metadata["extra"] = dcp_md.BytesStorageMetadata()

    ckpt = _crafted_copy(saved, tmp_path, _rewritten(saved, add_bytes))
    with pytest.raises(CheckpointError, match="'extra' is a BytesStorageMetadata, not a tensor"):
        store.verify(ckpt)


def test_a_shard_path_outside_the_checkpoint_is_refused(saved, tmp_path):
    def escape(md):
        info = next(iter(md.storage_data.values()))
        info.relative_path = "../../../etc/passwd"

    ckpt = _crafted_copy(saved, tmp_path, _rewritten(saved, escape))
    with pytest.raises(CheckpointError, match="outside the checkpoint directory"):
        store.verify(ckpt)


def test_garbage_metadata_is_named(saved, tmp_path):
    ckpt = _crafted_copy(saved, tmp_path, b"\x80\x04not a pickle at all")
    with pytest.raises(CheckpointError, match=r"\.metadata is not a readable DCP metadata file"):
        store.verify(ckpt)


def test_latest_skips_a_crafted_checkpoint_with_a_warning(saved, tmp_path, corpus):
    """Inside a run, a tampered newest checkpoint is skipped for the one before (never run)."""
    marker = tmp_path / "PWNED"
    run = tmp_path / "run"
    train(tiny_config(run, corpus, **{**COMMON, "train.steps": 4, "checkpoint.keep": 2}))
    newest = store.list_complete(run / "checkpoints")[-1].path
    _tamper(newest, pickle.dumps(_Payload(marker)))
    train(tiny_config(run, corpus, **{**COMMON, "train.steps": 6, "checkpoint.keep": 2}))
    ev = [json.loads(x) for x in (run / "events.jsonl").read_text().splitlines()]
    skipped = [e for e in ev if e["event"] == "checkpoint_skipped"]
    assert skipped and "not part of a DCP checkpoint" in skipped[-1]["reason"]
    resumed = [e for e in ev if e["event"] == "resumed"]
    assert resumed and resumed[-1]["step"] == 2
    assert not marker.exists()
    steps = [json.loads(x)["step"] for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps[-1] == 6 and 3 in steps  # steps 3..6 were trained again from step 2


@pytest.mark.parametrize(
    "edit, named",
    [
        (lambda m: m.update(step=1), "step 1 (the shards say 2)"),
        (lambda m: m["sampler"].update(consumed=0), "consumed 0 (the shards say"),
        (lambda m: m.update(tokens_seen=7), "tokens_seen 7 (the shards say"),
    ],
    ids=["step", "sampler", "tokens"],
)
def test_an_edited_meta_json_is_refused(saved, tmp_path, corpus, edit, named):
    """meta.json is plain JSON anyone can edit; the shards carry the train state too."""
    run = tmp_path / "run"
    shutil.copytree(saved, run)
    ckpt = store.list_complete(run / "checkpoints")[-1].path
    meta = json.loads((ckpt / "meta.json").read_text())
    edit(meta)
    (ckpt / "meta.json").write_text(json.dumps(meta))
    r = run_cli("train", *cli_args(tiny_overrides(run, corpus, **{**COMMON, "train.steps": 4})))
    assert r.returncode == 2, r.stderr[-2000:]
    assert "disagrees with the checkpoint's shards" in r.stderr and named in r.stderr
    assert "Traceback" not in r.stderr
