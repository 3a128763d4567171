"""``meshforge generate`` (issue 53): a model trained to memorise a text says it back; a short
trained run, its final weights, its checkpoint and its Hugging Face export all generate; what
cannot be generated from is refused with one paragraph and exit 2. And the tokenizer a user
brings: ``data prepare`` with a BPE tokenizer of 1,000 tokens prints a train command that runs."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from conftest import STDLIB, run_cli, tiny_config, train
from meshforge.data.tokenizer import ByteTokenizer
from meshforge.models.generate import Sampling, generate
from meshforge.models.llama import build_model
from meshforge.models.shape import ModelShape

TEXT = "meshforge generate: the quick brown fox jumps over the lazy dog; 0123456789."


def test_a_tiny_model_trained_on_one_text_says_it_back():
    torch.manual_seed(0)
    ids = ByteTokenizer().encode(TEXT).tolist()
    shape = ModelShape(hidden=64, layers=2, heads=4, kv_heads=2, ffn_hidden=128, vocab_size=320, max_seq_len=128)
    model = build_model(shape, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    x = torch.tensor([ids])
    for _ in range(300):
        loss = F.cross_entropy(model(x[:, :-1])[0], x[0, 1:])
        opt.zero_grad()
        loss.backward()
        opt.step()
        if loss.item() < 0.02:
            break
    model.eval()
    got = list(generate(model, ids[:8], Sampling(len(ids) - 8, temperature=0)))
    assert ByteTokenizer().decode(ids[:8] + got) == TEXT


@pytest.fixture(scope="module")
def run(tmp_path_factory, corpus):
    """A 20-step run of the tiny model with a checkpoint and final weights."""
    d = tmp_path_factory.mktemp("gen") / "run"
    train(tiny_config(d, corpus, **{"train.steps": 20, "optim.lr": 1e-2, "checkpoint.interval": 20}))
    return d


def new_tokens(r: subprocess.CompletedProcess) -> int:
    assert r.returncode == 0, r.stderr[-3000:]
    return int(re.search(r"meshforge: (\d+) new tokens in", r.stderr).group(1))


def test_generate_from_a_short_trained_run_streams_its_text(run):
    prompt = "def __init__(self"
    r = run_cli("generate", str(run), "--prompt", prompt, "--max-new-tokens", "48", "--seed", "1")
    assert new_tokens(r) >= 40 and r.stdout.startswith(prompt) and len(r.stdout) > len(prompt) + 20
    again = run_cli("generate", str(run / "final"), "--prompt", prompt, "--max-new-tokens", "48", "--seed", "1")
    assert again.stdout == r.stdout  # the run's final/ is what the run directory names; a seed repeats its text


def test_generate_from_a_checkpoint_and_from_hugging_face_weights(run, tmp_path):
    prompt, flags = "import ", ["--max-new-tokens", "40", "--temperature", "0"]
    final = run_cli("generate", str(run / "final"), "--prompt", prompt, *flags)
    ckpt = run_cli("generate", str(run / "checkpoints"), "--prompt", prompt, *flags)
    assert new_tokens(ckpt) == new_tokens(final) and ckpt.stdout == final.stdout  # step 20's weights are final's
    r = run_cli("convert", "--to-hf", str(run / "final"), "--out", str(tmp_path / "hf"))
    assert r.returncode == 0, r.stderr[-2000:]
    hf = run_cli("generate", str(tmp_path / "hf"), "--prompt", prompt, *flags, "--tokenizer", "byte")
    assert hf.stdout == final.stdout


def _bpe(path, vocab: int = 1000) -> None:
    """A byte-level BPE tokenizer.json of ``vocab`` tokens, trained here (no network)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator([(STDLIB / n).read_text() for n in ("argparse.py", "difflib.py")], trainer)
    assert tok.get_vocab_size() == vocab
    tok.save(str(path))


def refused(argv: list[str], said: str) -> None:
    r = run_cli(*argv)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-3000:]
    assert r.stderr.startswith("meshforge: error:") and said in r.stderr and r.stdout == ""


def test_generate_refuses_what_it_cannot_generate_from(run, tmp_path, corpus):
    _bpe(tmp_path / "bpe.json")
    refused(
        ["generate", str(run), "--prompt", "x", "--tokenizer", str(tmp_path / "bpe.json")],
        "the tokenizer's vocabulary (1,000) is larger than the model's (512 rows)",
    )
    refused(["generate", str(run), "--prompt", "x" * 1100], "the prompt is 1,100 tokens; the model's context is 1,024")
    refused(["generate", str(run / "final"), "--prompt", "x", "--tokenizer", str(tmp_path)], "tokenizer.json")
    bare = tmp_path / "bare"
    train(tiny_config(bare, corpus, **{"train.steps": 1, "checkpoint.save_final": False, "checkpoint.final": False}))
    refused(["generate", str(bare), "--prompt", "x"], "holds no weights: no final/ and no complete checkpoint")


def test_a_prepared_bpe_corpus_trains_with_the_command_prepare_prints(tmp_path, corpus):
    _bpe(tmp_path / "tokenizer.json")
    r = run_cli("data", "prepare", "--input", str(corpus), "--out", str(tmp_path / "data"), "--tokenizer",
                str(tmp_path / "tokenizer.json"))  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    (line,) = [x for x in r.stdout.splitlines() if x.startswith("train on it with: ")]
    command = shlex.split(line.removeprefix("train on it with: "))
    assert command[:2] == ["meshforge", "train"]
    # as printed, but 2 steps (its own 200 prove nothing more); run where a user would, in a folder of theirs
    cmd = [sys.executable, "-m", "meshforge", *command[1:], "--train.steps=2"]
    done = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=600, env=dict(os.environ))
    assert done.returncode == 0, done.stderr[-3000:]
    assert "note: model.vocab_size = 'auto' runs as 1024: the vocabulary of data.tokenizer (1,000 tokens)" in (
        done.stdout
    )
    (run_dir,) = (tmp_path / "runs").iterdir()
    assert "vocab_size = 1024" in (run_dir / "config.toml").read_text()
