"""A Llama 3 style decoder-only transformer, written for one device.

Nothing here knows about parallelism: tensor, pipeline and data parallelism are
applied from outside (meshforge.parallel.parallelize). Two choices keep that possible:
view shapes use -1 for the head count, so column-sharded projections just see fewer
local heads; and blocks live in a ModuleDict keyed by layer index, so a pipeline stage
can drop layers while parameter names (and so checkpoints) stay the same.

RoPE uses the "rotate half" layout (the first and second halves of each head are the
two coordinates of a rotated pair), which is the layout of Hugging Face Llama weights,
so those import without permuting q/k projections.

Seams that later features plug into without the model learning about them: the attention
core (``Attention.core``, swapped per block by context parallelism for ring attention), the
projections' application (a block's ``project_in`` / ``project_out`` and the head's ``project``,
swapped by async tensor parallelism),
positions passed in (a sequence shard passes its own), the feed-forward built by
``build_feed_forward`` (a mixture-of-experts layer per layer id), an explicit
``head_dim`` and optional QK-norm (Qwen3), and auxiliary losses reported to
``models/loss.py``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from meshforge.models.document_attention import document_attention, is_grouped, prepare_block_mask
from meshforge.models.documents import Documents
from meshforge.models.init import draw_normal
from meshforge.models.kv_cache import KVCache, LayerCache
from meshforge.models.moe import build_moe, is_moe_layer
from meshforge.models.shape import ModelShape


def rope_inv_freq(shape: ModelShape, device: torch.device | str | None = None) -> torch.Tensor:
    """Inverse frequencies per rotated pair, with the Llama 3.1 long-context scaling when asked.

    Llama 3.1 scaling leaves high frequencies (wavelength shorter than
    original_max / high_freq_factor) alone, divides low frequencies (wavelength longer
    than original_max / low_freq_factor) by ``factor``, and interpolates smoothly between.
    """
    hd = shape.head_dim
    inv = 1.0 / (shape.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.float64, device=device) / hd))
    if shape.rope_scaling == "llama3":
        old = shape.rope_original_max_seq_len
        low_wavelen = old / shape.rope_low_freq_factor
        high_wavelen = old / shape.rope_high_freq_factor
        wavelen = 2 * math.pi / inv
        smooth = (old / wavelen - shape.rope_low_freq_factor) / (
            shape.rope_high_freq_factor - shape.rope_low_freq_factor
        )
        scaled = torch.where(wavelen > low_wavelen, inv / shape.rope_factor, inv)
        mid = (wavelen <= low_wavelen) & (wavelen >= high_wavelen)
        scaled = torch.where(mid, (1 - smooth) * inv / shape.rope_factor + smooth * inv, scaled)
        inv = scaled
    return inv.float()


def rope_cos_sin(inv_freq: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and signed sin tables of shape (seq, head_dim) for ``apply_rope``, in fp32 whatever
    the autocast. The sin table's first half is negated: the sign rotate-half puts on the
    partner (-x2, x1) lives in the table, built once per forward, not in each block's pass."""
    with torch.autocast(device_type=positions.device.type, enabled=False):
        freqs = torch.outer(positions.float(), inv_freq.float())
        emb = torch.cat([freqs, freqs], dim=-1)
        half = freqs.shape[-1]
        sign = torch.cat([freqs.new_full((half,), -1.0), freqs.new_ones(half)])
        return emb.cos(), emb.sin() * sign


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate (batch, heads, seq, head_dim) by position; pairs are (i, i + head_dim/2), ``sin``
    signed as ``rope_cos_sin`` makes it. ``x * cos + swap_halves(x) * sin``: the swap is one
    copy in x's dtype and memory layout (a flip of the two halves: no neg, no cat, and its
    backward is a flip too, so q/k's gradients stay in the projections' layout with no copy),
    the products read x in its dtype and compute in the tables' fp32 (no cast pass), one cast
    back. Equal bit for bit to ``(x.float() * cos + cat(-x2, x1).float() * sin).to(x.dtype)``,
    gradients too."""
    swapped = x.unflatten(-1, (2, x.shape[-1] // 2)).flip(-2).flatten(-2)
    return (x * cos + swapped * sin).to(x.dtype)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Normalise in fp32 (as Llama does) and return the input dtype. Weight and input of one
        dtype (fp32; bf16 under FSDP2's cast-once policy) take one ``F.rms_norm`` call, which
        computes in fp32 and rounds once: a fused kernel pair on CUDA instead of five passes
        and their backward. Mixed dtypes (autocast's bf16 q/k before QK-norm) keep the explicit
        fp32 form, the same arithmetic."""
        w = self.weight
        if w.dtype == x.dtype:
            return F.rms_norm(x, (x.shape[-1],), w, self.eps)
        return (F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps) * w.float()).to(x.dtype)


class SDPAttention(nn.Module):
    """The attention core: causal softmax attention of q (batch, heads, seq, head_dim) over
    k, v (batch, kv_heads, seq, head_dim), after RoPE; returns q's shape.

    Parameter-free and given everything as arguments, so context parallelism can swap a
    block's ``attention.core`` for ring attention without touching the projections. With
    ``documents`` (packed sequences), attention stays inside each document
    (models/document_attention.py)."""

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, documents: Documents | None = None
    ) -> torch.Tensor:
        if documents is not None and not documents.single:
            return document_attention(q, k, v, documents)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=is_grouped(q, k))


class Projections(nn.Module):
    """The linears that read one input, each applied to it (a block's ``project_in``).
    Parameter-free, so async tensor parallelism can swap it for one that gathers the input's
    sequence shards once for all of them while multiplying (parallel/tensor/async_tp.py)."""

    def forward(self, x: torch.Tensor, linears: tuple[nn.Module, ...]) -> tuple[torch.Tensor, ...]:
        return tuple(lin(x) for lin in linears)


class Projection(nn.Module):
    """A block's output linear applied (``project_out``); async tensor parallelism swaps it for
    a multiply-and-reduce-scatter."""

    def forward(self, x: torch.Tensor, linear: nn.Module) -> torch.Tensor:
        return linear(x)


class Attention(nn.Module):
    """Projections (wq, wk, wv, wo: the names checkpoints, HF export and the TP plan key
    on), optional QK-norm, RoPE, and the replaceable core between them; the projections are
    applied through the ``project_in`` / ``project_out`` seams."""

    def __init__(self, shape: ModelShape):
        super().__init__()
        hd = shape.head_dim
        self.head_dim = hd
        self.wq = nn.Linear(shape.hidden, shape.heads * hd, bias=False)
        self.wk = nn.Linear(shape.hidden, shape.kv_heads * hd, bias=False)
        self.wv = nn.Linear(shape.hidden, shape.kv_heads * hd, bias=False)
        self.wo = nn.Linear(shape.heads * hd, shape.hidden, bias=False)
        # Qwen3: one RMSNorm weight of size head_dim shared by all heads of q (and of k)
        self.q_norm = RMSNorm(hd, shape.norm_eps) if shape.qk_norm else None
        self.k_norm = RMSNorm(hd, shape.norm_eps) if shape.qk_norm else None
        self.core: nn.Module = SDPAttention()
        self.project_in: nn.Module = Projections()
        self.project_out: nn.Module = Projection()

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        documents: Documents | None = None,
        cache: LayerCache | None = None,
    ) -> torch.Tensor:
        """``cache`` (decoding): this block's cached keys and values, which the new positions'
        join and are attended over in place of the core (models/kv_cache.py)."""
        q, k, v = self.project_in(x, (self.wq, self.wk, self.wv))
        b, s = q.shape[:2]  # (the projections' sequence: the whole one under tp's gathering seam)
        q = q.view(b, s, -1, self.head_dim).transpose(1, 2)
        k = k.view(b, s, -1, self.head_dim).transpose(1, 2)
        v = v.view(b, s, -1, self.head_dim).transpose(1, 2)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if cache is not None:
            out = cache.attend(q, k, v)
        else:
            out = self.core(q, k, v) if documents is None else self.core(q, k, v, documents)
        return self.project_out(out.transpose(1, 2).reshape(b, s, -1), self.wo)


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x), through the ``project_in`` / ``project_out`` seams."""

    def __init__(self, shape: ModelShape):
        super().__init__()
        self.w1 = nn.Linear(shape.hidden, shape.ffn_hidden, bias=False)
        self.w3 = nn.Linear(shape.hidden, shape.ffn_hidden, bias=False)
        self.w2 = nn.Linear(shape.ffn_hidden, shape.hidden, bias=False)
        self.project_in: nn.Module = Projections()
        self.project_out: nn.Module = Projection()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.project_in(x, (self.w1, self.w3))
        return self.project_out(F.silu(gate) * up, self.w2)


def build_feed_forward(shape: ModelShape, layer_id: int) -> nn.Module:
    """The feed-forward layer of block ``layer_id``: the one place that chooses it, so a
    mixture-of-experts layer can replace the dense SwiGLU on chosen layers."""
    if is_moe_layer(shape, layer_id):
        return build_moe(shape)
    return FeedForward(shape)


class Block(nn.Module):
    def __init__(self, shape: ModelShape, layer_id: int):
        super().__init__()
        self.layer_id = layer_id
        self.attention_norm = RMSNorm(shape.hidden, shape.norm_eps)
        self.attention = Attention(shape)
        self.ffn_norm = RMSNorm(shape.hidden, shape.norm_eps)
        self.feed_forward = build_feed_forward(shape, layer_id)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        documents: Documents | None = None,
        cache: LayerCache | None = None,
    ) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), cos, sin, documents=documents, cache=cache)
        return x + self.feed_forward(self.ffn_norm(x))


class HeadProjection(nn.Module):
    """The head's linear applied (its ``project`` seam). Parameter-free, so async tensor
    parallelism can swap it for one that gathers the sequence shards while multiplying."""

    def forward(self, x: torch.Tensor, head: nn.Linear) -> torch.Tensor:
        return F.linear(x, head.weight, head.bias)


class Head(nn.Linear):
    """The output projection. Called with ``loss_fn`` it returns ``loss_fn(x, weight)``
    instead of the logits: the chunked loss applies the head itself (models/chunked_loss.py)
    through the module's call, so whatever hooks wrap the head (sharding, gathering) still run."""

    takes_loss_fn = True  # what the loss checks (a head swapped for another class, e.g. fp8, is not)

    def __init__(self, in_features: int, out_features: int, bias: bool = True, **kw: Any) -> None:
        super().__init__(in_features, out_features, bias=bias, **kw)
        self.project: nn.Module = HeadProjection()

    def forward(self, x: torch.Tensor, loss_fn: Callable[..., torch.Tensor] | None = None) -> torch.Tensor:
        return self.project(x, self) if loss_fn is None else loss_fn(x, self.weight)


class Transformer(nn.Module):
    def __init__(self, shape: ModelShape):
        super().__init__()
        self.shape = shape
        self.tok_embeddings = nn.Embedding(shape.vocab_size, shape.hidden)
        self.layers = nn.ModuleDict({str(i): Block(shape, i) for i in range(shape.layers)})
        self.norm = RMSNorm(shape.hidden, shape.norm_eps)
        self.output = Head(shape.hidden, shape.vocab_size, bias=False)
        self.hidden_out = False  # True: forward stops at the final norm; the loss applies the head
        self.register_buffer("rope_inv_freq", rope_inv_freq(shape), persistent=False)
        self.tie_weights()

    def tie_weights(self) -> None:
        if self.shape.tie_embeddings and self.tok_embeddings is not None and self.output is not None:
            self.output.weight = self.tok_embeddings.weight

    def forward(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor | None = None,
        documents: Documents | None = None,
        cache: KVCache | None = None,
    ) -> torch.Tensor:
        """Token ids (batch, seq) -> logits (batch, seq, vocab).

        ``positions`` (seq,) are the input's token positions: a sequence shard passes its
        own (e.g. p..p+s); None means ``arange(seq)``, for a model used whole. A slice of
        the model (a pipeline stage: some of the layers, ``tok_embeddings`` or
        ``norm``/``output`` set to None) maps hidden states to hidden states the same way;
        such a slice must be given ``positions`` when its input may be a sequence shard.
        With ``hidden_out`` set the head is left to the loss (LanguageModelLoss with a chunk size).
        ``documents`` (packed sequences, models/documents.py) keeps attention inside each
        document; ``positions`` may then be per sequence (batch, seq), restarting at each one.
        ``cache`` (decoding, a whole model): ``tokens`` are the positions after the cached ones,
        which every block attends over; the cache then holds these too (models/kv_cache.py)."""
        if positions is None:
            start = cache.length if cache is not None else 0
            positions = torch.arange(start, start + tokens.shape[1], device=tokens.device)
        cos, sin = rope_cos_sin(self.rope_inv_freq, positions.reshape(-1))
        if positions.dim() == 2:  # per sequence: (batch, 1, seq, head_dim), broadcast over heads
            cos, sin = (t.view(*positions.shape, -1).unsqueeze(1) for t in (cos, sin))
        if documents is not None:
            documents.check_rows(tokens.shape[0])
            prepare_block_mask(documents, self.rope_inv_freq.device)
        h = tokens if self.tok_embeddings is None else self.tok_embeddings(tokens)
        for layer in self.layers.values():
            if cache is not None:
                h = layer(h, cos, sin, cache=cache.layer(layer.layer_id))
            else:
                h = layer(h, cos, sin) if documents is None else layer(h, cos, sin, documents=documents)
        if cache is not None:
            cache.advance(tokens.shape[1])
        if self.norm is not None:
            h = self.norm(h)
        return h if self.output is None or self.hidden_out else self.output(h)


Region = Callable[[torch.Tensor], tuple[tuple[int, ...], tuple[int, ...]] | None]


@torch.no_grad()
def init_weights(
    model: Transformer,
    seed: int,
    fill: Callable[[torch.Tensor, torch.Tensor], None] | None = None,
    region: Region | None = None,
) -> None:
    """Initialise every parameter from (seed, parameter name) alone, on every device alike.

    Each parameter's values are drawn on the CPU from generators seeded by its fully qualified
    name (models/init.py), so the full weights depend neither on construction order, on which
    parameters a rank holds, on how they are sharded, nor on the device they live on (CPU,
    CUDA, host memory under offload). Output projections of the residual branches (wo, w2)
    get std / sqrt(2 * layers), as in GPT-2, to keep the residual stream's variance flat with
    depth. ``region(param)`` names the box of the full tensor a sharded parameter holds
    ((offset, local shape), None: all of it) and ``fill(param, values)`` stores that box's values.
    """
    fill = fill or (lambda p, values: p.copy_(values))
    shape = model.shape
    model.rope_inv_freq = rope_inv_freq(shape, device=model.rope_inv_freq.device)
    residual_std = shape.init_std / math.sqrt(2 * shape.layers)
    for name, p in model.named_parameters():
        box = region(p) if region is not None else None
        offset, local = box if box is not None else (None, tuple(p.shape))
        if name.endswith("norm.weight"):
            fill(p, torch.ones(local, dtype=torch.float32))
            continue
        std = residual_std if name.endswith(("wo.weight", "w2.weight", "experts.w2")) else shape.init_std
        fill(p, draw_normal(seed, name, tuple(p.shape), std, offset, local))
    _init_buffers(model)


def _init_buffers(model: nn.Module) -> None:
    """Training-state buffers (the MoE balance bias and load counters) start at zero."""
    for m in model.modules():
        if hasattr(m, "init_buffers"):
            m.init_buffers()


def build_model(shape: ModelShape, device: torch.device | str = "cpu", seed: int | None = 0) -> Transformer:
    """Build on the meta device, then materialise on ``device`` and initialise from ``seed``.

    ``device="meta"`` gives a model with shapes but no memory (for counting the large
    presets); ``seed=None`` leaves the memory uninitialised (weights are loaded next).
    """
    with torch.device("meta"):
        model = Transformer(shape)
    if str(device) == "meta":
        return model
    model.to_empty(device=device)
    model.tie_weights()
    if seed is not None:
        init_weights(model, seed)
    else:
        model.rope_inv_freq = rope_inv_freq(shape, device=device)
        _init_buffers(model)
    return model
