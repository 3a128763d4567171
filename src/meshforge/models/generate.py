"""Sampling text from a model on one device: the prompt's forward fills a key/value cache, then
each new token is one position's forward (models/kv_cache.py). Greedy at temperature 0, else
softmax sampling at that temperature over the ``top_k`` likeliest tokens (0: all of them), from a
seeded generator, so a seed repeats its text. Ids the tokenizer does not have (the vocabulary's
padding rows) are never drawn."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch

from meshforge.models.kv_cache import KVCache
from meshforge.models.llama import Transformer
from meshforge.models.loss import drain_aux


@dataclass(frozen=True)
class Sampling:
    """How the next token is chosen."""

    max_new_tokens: int = 100
    temperature: float = 0.8  # 0: greedy
    top_k: int = 50  # 0: every token
    seed: int = 0
    vocab: int = 0  # ids at or above this (padding rows) are never drawn; 0: every row of the head
    stop_id: int | None = None  # the tokenizer's end-of-text: generation stops after it


def next_token(logits: torch.Tensor, s: Sampling, gen: torch.Generator) -> int:
    """The id chosen from one position's logits (vocab,)."""
    logits = logits.float()
    if 0 < s.vocab < logits.shape[-1]:
        logits = logits[: s.vocab]
    if s.temperature == 0:
        return int(logits.argmax())
    if 0 < s.top_k < logits.shape[-1]:
        kth = torch.topk(logits, s.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits / s.temperature, dim=-1)
    return int(torch.multinomial(probs.cpu(), 1, generator=gen))


@torch.no_grad()
def generate(model: Transformer, prompt: list[int], s: Sampling, use_cache: bool = True) -> Iterator[int]:
    """Yield the new token ids one by one (stopping after ``s.stop_id``). ``use_cache = False``
    runs the whole sequence again for every token: the reference the cache is tested against."""
    device = model.rope_inv_freq.device
    gen = torch.Generator().manual_seed(s.seed)
    dtype = next(model.parameters()).dtype
    cache = KVCache(model.shape, 1, len(prompt) + s.max_new_tokens, device, dtype) if use_cache else None
    tokens = torch.tensor([prompt], device=device)
    logits = model(tokens, cache=cache)[0, -1]
    for i in range(s.max_new_tokens):
        drain_aux(model)  # (an MoE layer's balance terms: no loss takes them here)
        token = next_token(logits, s, gen)
        yield token
        if token == s.stop_id or i == s.max_new_tokens - 1:
            return
        step = torch.tensor([[token]], device=device)
        if cache is None:
            tokens = torch.cat([tokens, step], dim=1)
            logits = model(tokens)[0, -1]
        else:
            logits = model(step, cache=cache)[0, -1]
