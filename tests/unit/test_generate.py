"""Decoding with the key/value cache computes what the whole-sequence forward computes (greedy, fp32:
the same token ids, logits within round-off), sampling draws what it says it draws, and
``meshforge generate``'s flags and sources are checked before a model is loaded."""

from __future__ import annotations

import copy

import pytest
import torch

from meshforge.cli.main import main
from meshforge.models import kv_cache
from meshforge.models.generate import Sampling, generate, next_token
from meshforge.models.llama import build_model
from meshforge.models.presets import get_preset

PROMPT = [5, 77, 300, 12, 9, 140, 33, 2, 250, 61, 17]


@pytest.fixture(autouse=True)
def _one_thread():
    """One position's matmuls are too small to share: on a busy machine two threads wait on each other."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def tiny(**fields):
    shape = copy.copy(get_preset("debug"))  # GQA: 4 heads over 2 key/value heads
    for k, v in fields.items():
        setattr(shape, k, v)
    return build_model(shape, seed=3).eval()


def decode(model, s: Sampling, use_cache: bool) -> tuple[list[int], list[torch.Tensor]]:
    """The new ids, and the logits each was chosen from."""
    seen: list[torch.Tensor] = []
    forward = model.forward

    def keep(*args, **kw):
        out = forward(*args, **kw)
        seen.append(out[0, -1].clone())
        return out

    model.forward = keep
    try:
        ids = list(generate(model, PROMPT, s, use_cache))
    finally:
        del model.forward
    return ids, seen


@pytest.mark.parametrize("fields", [{}, {"qk_norm": True}, {"num_experts": 4, "experts_per_token": 2}])
def test_the_cache_decodes_what_the_whole_sequence_decodes(fields):
    model = tiny(**fields)
    s = Sampling(max_new_tokens=40, temperature=0)
    cached, with_cache = decode(model, s, True)
    whole, without = decode(model, s, False)
    assert cached == whole and len(cached) == 40
    assert len(set(cached)) > 3  # (not one token over and over: the comparison means something)
    for a, b in zip(with_cache, without, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_sampling_with_the_cache_repeats_the_seeds_text():
    model = tiny()
    s = Sampling(max_new_tokens=30, temperature=1.0, top_k=40, seed=7)
    assert list(generate(model, PROMPT, s)) == list(generate(model, PROMPT, s, use_cache=False))
    assert list(generate(model, PROMPT, s)) != list(generate(model, PROMPT, Sampling(30, 1.0, 40, seed=8)))


def test_the_cache_test_fails_when_the_cache_forgets_the_past(monkeypatch):
    model = tiny()
    s = Sampling(max_new_tokens=40, temperature=0)
    whole = list(generate(model, PROMPT, s, use_cache=False))
    attend = kv_cache.LayerCache.attend

    def forgetful(self, q, k, v):
        self.owner.length, length = 0, self.owner.length  # sees only the new position
        try:
            return attend(self, q, k, v)
        finally:
            self.owner.length = length

    monkeypatch.setattr(kv_cache.LayerCache, "attend", forgetful)
    assert list(generate(model, PROMPT, s)) != whole


def test_next_token_draws_only_what_it_may():
    gen = torch.Generator().manual_seed(0)
    logits = torch.tensor([0.0, 5.0, 1.0, 9.0, 9.5])
    assert next_token(logits, Sampling(temperature=0), gen) == 4
    assert next_token(logits, Sampling(temperature=0, vocab=4), gen) == 3  # 4 is a padding row
    draws = {next_token(logits, Sampling(temperature=5.0, top_k=2, vocab=4), gen) for _ in range(200)}
    assert draws == {1, 3}  # the two likeliest of the tokenizer's four
    assert {next_token(logits, Sampling(temperature=1.0, top_k=1), gen) for _ in range(20)} == {4}


def test_the_cache_refuses_positions_beyond_its_room():
    model = tiny()
    cache = kv_cache.KVCache(model.shape, 1, 4)
    with torch.no_grad():
        model(torch.tensor([[1, 2, 3]]), cache=cache)
        with pytest.raises(ValueError, match="the cache holds 4 positions; 3 \\+ 2 do not fit"):
            model(torch.tensor([[4, 5]]), cache=cache)


@pytest.mark.parametrize(
    "argv, said",
    [
        (["--max-new-tokens", "0"], "--max-new-tokens 0 must be between 1 and"),
        (["--temperature", "nan"], "--temperature nan must be a number in [0, 100]"),
        (["--temperature", "-1"], "--temperature -1.0 must be a number in [0, 100]"),
        (["--top-k", "-5"], "--top-k -5 must be 0 (every token) or more"),
        (["--seed", "-1"], "--seed -1 must be in [0, 2^63)"),
        (["--prompt", ""], "--prompt is empty"),
    ],
)
def test_bad_flag_values_are_refused_before_anything_loads(capsys, tmp_path, argv, said):
    assert main(["generate", str(tmp_path), "--prompt", "x", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("meshforge: error:") and said in err and err.count("\n") == 1


@pytest.mark.parametrize(
    "make, said",
    [
        ("missing", "does not exist; give a run directory"),
        ("f", "is not a directory"),
        ("", "is neither a run directory (config.toml) nor weights"),
        ("config.toml", "holds no weights: no final/ and no complete checkpoint"),
    ],
)
def test_a_source_without_weights_is_refused(capsys, tmp_path, make, said):
    if make in ("f", "config.toml"):
        (tmp_path / make).write_text("")
    source = tmp_path / make if make in ("missing", "f") else tmp_path
    assert main(["generate", str(source), "--prompt", "x"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("meshforge: error:") and said in err
