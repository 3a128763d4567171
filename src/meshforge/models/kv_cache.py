"""A key/value cache for decoding: each block's keys and values of the positions seen so far, so
that a new token costs one position's projections and attention over the cached ones instead of
the whole sequence again. The model stays one-device and unchanged in training: ``Transformer``
takes a cache in its forward and hands each block its layer's slot (``LayerCache``), which its
attention calls in place of the attention core."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from meshforge.models.document_attention import is_grouped
from meshforge.models.shape import ModelShape


class KVCache:
    """Room for ``max_len`` positions of ``batch`` sequences in every block; ``length`` positions
    are filled. The model's forward writes the next positions and advances ``length``."""

    def __init__(
        self,
        shape: ModelShape,
        batch: int,
        max_len: int,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
    ):
        self.max_len, self.length = max_len, 0
        size = (batch, shape.kv_heads, max_len, shape.head_dim)
        self.layers = [LayerCache(self, size, device, dtype) for _ in range(shape.layers)]

    def layer(self, layer_id: int) -> LayerCache:
        return self.layers[layer_id]

    def advance(self, n: int) -> None:
        """``n`` more positions are filled (after every block wrote them)."""
        self.length += n


class LayerCache:
    """One block's keys and values; ``attend`` takes the place of the attention core."""

    def __init__(self, owner: KVCache, size: tuple[int, ...], device: torch.device | str, dtype: torch.dtype):
        self.owner = owner
        self.k = torch.zeros(size, device=device, dtype=dtype)
        self.v = torch.zeros(size, device=device, dtype=dtype)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Store the new positions' k, v (batch, kv_heads, new, head_dim) after the cached ones and
        attend q (batch, heads, new, head_dim) causally over all of them: the new position p sees
        every position up to p, as in the whole-sequence forward."""
        start = self.owner.length
        end = start + k.shape[2]
        if end > self.owner.max_len:
            raise ValueError(f"the cache holds {self.owner.max_len} positions; {start} + {k.shape[2]} do not fit")
        self.k[:, :, start:end] = k
        self.v[:, :, start:end] = v
        keys, values = self.k[:, :, :end], self.v[:, :, :end]
        gqa = is_grouped(q, k)
        if start == 0:  # nothing cached yet: the plain causal forward over the prompt
            return F.scaled_dot_product_attention(q, keys, values, is_causal=True, enable_gqa=gqa)
        seen = torch.arange(end, device=q.device) <= torch.arange(start, end, device=q.device)[:, None]
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=seen, enable_gqa=gqa)
