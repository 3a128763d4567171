"""Hugging Face Mixtral and Qwen3-MoE checkpoints: the config keys and tensor names of
the mixture-of-experts parts (``models/hf.py`` does the rest and calls in here).

Both families route like ``models/moe.py`` with ``router_score = "softmax"``: softmax over
the router logits in fp32, top k, weights renormalised over the chosen k (Mixtral always;
Qwen3-MoE when ``norm_topk_prob``). Neither has shared experts, a sigmoid router or a
balance bias, so a meshforge model with one of those is refused on export rather than
written as something that computes differently. Capacity is a training-time limit: HF
runs dropless, as meshforge does with ``capacity_factor = 0``.

meshforge stacks the experts ([E, ffn, hidden]); checkpoints hold one tensor per expert
(what ``save_pretrained`` writes, also in transformers 5) or, as transformers 5 holds them
in memory, fused ``experts.gate_up_proj`` [E, 2 ffn, hidden] and ``experts.down_proj``.
Both are read; the per-expert form is written.
"""

from __future__ import annotations

import re
from typing import Any

import torch

from meshforge.errors import MeshforgeError
from meshforge.models.moe import is_moe_layer

ShapeLike = Any  # a ModelShape (duck-typed, like models/moe.py)

MOE_FAMILIES = {"mixtral": "MixtralForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}
# per-expert names by family: meshforge's stacked weight -> HF's per-expert projection
_EXPERT_NAMES = {
    "mixtral": {"w1": "w1", "w2": "w2", "w3": "w3"},
    "qwen3_moe": {"w1": "gate_proj", "w2": "down_proj", "w3": "up_proj"},
}
_BLOCK = {"mixtral": "block_sparse_moe", "qwen3_moe": "mlp"}
_HF_ROUTER_RE = re.compile(r"^model\.layers\.(\d+)\.(?:block_sparse_moe|mlp)\.gate\.weight$")
_HF_EXPERT_RE = re.compile(
    r"^model\.layers\.(\d+)\.(?:block_sparse_moe|mlp)\.experts\.(\d+)\.(w1|w2|w3|gate_proj|up_proj|down_proj)\.weight$"
)
_HF_FUSED_RE = re.compile(r"^model\.layers\.(\d+)\.(?:block_sparse_moe|mlp)\.experts\.(gate_up_proj|down_proj)$")
_OURS_RE = re.compile(r"^layers\.(\d+)\.feed_forward\.(router\.weight|experts\.w[123]|expert_bias)$")
_FROM_HF_PROJ = {"w1": "w1", "w2": "w2", "w3": "w3", "gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}


class HFMoEError(MeshforgeError):
    pass


def hf_moe_family(cfg: dict) -> str | None:
    """'mixtral' / 'qwen3_moe' when ``cfg`` (a config.json) describes one of them, else None."""
    arch = cfg.get("architectures") or []
    for family, cls in MOE_FAMILIES.items():
        if cfg.get("model_type") == family or cls in arch:
            return family
    return None


def _layer_plan(cfg: dict, layers: int, source: str) -> tuple[int, int]:
    """(first_dense_layers, moe_interval) reproducing Qwen3-MoE's mlp_only_layers and
    decoder_sparse_step (MoE where i not in mlp_only_layers and (i + 1) % step == 0)."""
    step = int(cfg.get("decoder_sparse_step", 1) or 1)
    dense_only = set(cfg.get("mlp_only_layers") or [])
    want = [i not in dense_only and (i + 1) % step == 0 for i in range(layers)]
    for first in range(layers + 1):
        for interval in range(1, layers + 1):
            probe = type("P", (), {"num_experts": 1, "first_dense_layers": first, "moe_interval": interval})
            if [is_moe_layer(probe, i) for i in range(layers)] == want:
                return first, interval
    raise HFMoEError(
        f"{source}: the MoE layers given by mlp_only_layers={sorted(dense_only)} and decoder_sparse_step={step} "
        "are not 'the first n dense, then every k-th' (model.first_dense_layers / model.moe_interval); "
        "meshforge cannot represent this layout"
    )


def moe_shape_from_hf(cfg: dict, family: str, layers: int, source: str) -> dict:
    """The ModelShape MoE fields (and QK-norm) for a Mixtral / Qwen3-MoE config.json."""
    experts = cfg.get("num_local_experts") or cfg.get("num_experts")
    if not experts:
        raise HFMoEError(f"{source}: a {family} config needs num_local_experts (or num_experts)")
    window = cfg.get("sliding_window")
    if window and (family == "mixtral" or cfg.get("use_sliding_window")):
        if window < cfg.get("max_position_embeddings", 0):
            raise HFMoEError(f"{source}: sliding-window attention (sliding_window={window}) is not supported")
    out = {
        "num_experts": int(experts),
        "experts_per_token": int(cfg.get("num_experts_per_tok", 2)),
        "router_score": "softmax",
        "load_balance": "aux_loss",
        "aux_loss_coeff": float(cfg.get("router_aux_loss_coef", 0.01)),
        "capacity_factor": 0.0,
        "num_shared_experts": 0,
        "qk_norm": family == "qwen3_moe",
        "norm_topk": family == "mixtral" or bool(cfg.get("norm_topk_prob", False)),
    }
    if family == "qwen3_moe":
        out["moe_ffn_hidden"] = int(cfg["moe_intermediate_size"])
        out["first_dense_layers"], out["moe_interval"] = _layer_plan(cfg, layers, source)
    return out


def check_exportable(shape: ShapeLike, state_dict: dict[str, torch.Tensor]) -> str:
    """The family ``shape`` is written as (Qwen3-MoE with QK-norm, else Mixtral); refuses
    what neither family computes the same way."""
    family = "qwen3_moe" if shape.qk_norm else "mixtral"
    why = []
    if shape.router_score != "softmax":
        why.append(f"model.router_score = '{shape.router_score}' (HF routes by softmax)")
    if shape.num_shared_experts:
        why.append("model.num_shared_experts > 0 (no shared experts in Mixtral/Qwen3-MoE)")
    bias = [t for n, t in state_dict.items() if n.endswith("expert_bias")]
    if any(bool(t.detach().ne(0).any()) for t in bias):
        why.append("a non-zero balance bias (model.load_balance = 'bias' changes which experts are chosen)")
    if family == "mixtral":
        if not shape.norm_topk:
            why.append("model.norm_topk = false without QK-norm (Mixtral always renormalises the top k)")
        if shape.first_dense_layers or shape.moe_interval != 1:
            why.append(
                "dense blocks (model.first_dense_layers / model.moe_interval) without QK-norm (Mixtral is all-MoE)"
            )
        if shape.moe_ffn_hidden not in (0, shape.ffn_hidden):
            why.append("model.moe_ffn_hidden != model.ffn_hidden without QK-norm (Mixtral has one intermediate_size)")
    if why:
        raise HFMoEError(f"cannot write this MoE model as Hugging Face {MOE_FAMILIES[family]}: " + "; ".join(why))
    return family


def moe_hf_config(shape: ShapeLike, family: str) -> dict:
    """config.json keys of the MoE family (merged over the dense Llama/Qwen3 keys)."""
    cfg: dict = {
        "architectures": [MOE_FAMILIES[family]],
        "model_type": family,
        "num_local_experts": shape.num_experts,
        "num_experts_per_tok": shape.experts_per_token,
        "router_aux_loss_coef": shape.aux_loss_coeff,
        "output_router_logits": False,
        "sliding_window": None,
    }
    if family == "mixtral":
        cfg["router_jitter_noise"] = 0.0
        return cfg
    cfg["num_experts"] = shape.num_experts
    cfg["moe_intermediate_size"] = shape.moe_ffn_hidden or shape.ffn_hidden
    cfg["norm_topk_prob"] = bool(shape.norm_topk)
    cfg["decoder_sparse_step"] = 1
    cfg["mlp_only_layers"] = [i for i in range(shape.layers) if not is_moe_layer(shape, i)]
    cfg["use_sliding_window"] = False
    return cfg


def moe_to_hf(name: str, t: torch.Tensor, family: str) -> list[tuple[str, torch.Tensor]] | None:
    """HF tensors for one meshforge MoE tensor ([] for the balance bias); None: not an MoE name."""
    m = _OURS_RE.match(name)
    if not m:
        return None
    layer, part, block = m.group(1), m.group(2), _BLOCK[family]
    if part == "expert_bias":
        return []  # checked zero by check_exportable: selection is the same without it
    if part == "router.weight":
        return [(f"model.layers.{layer}.{block}.gate.weight", t)]
    proj = _EXPERT_NAMES[family][part.split(".")[1]]
    return [(f"model.layers.{layer}.{block}.experts.{e}.{proj}.weight", t[e]) for e in range(t.shape[0])]


def moe_from_hf(name: str, t: torch.Tensor) -> list[tuple[str, int | None, torch.Tensor]] | None:
    """Where an HF MoE tensor goes: (meshforge name, expert index or None for the whole
    tensor, tensor) for each part; None when ``name`` is not an MoE tensor."""
    m = _HF_ROUTER_RE.match(name)
    if m:
        return [(f"layers.{m.group(1)}.feed_forward.router.weight", None, t)]
    m = _HF_EXPERT_RE.match(name)
    if m:
        return [(f"layers.{m.group(1)}.feed_forward.experts.{_FROM_HF_PROJ[m.group(3)]}", int(m.group(2)), t)]
    m = _HF_FUSED_RE.match(name)
    if not m:
        return None
    base = f"layers.{m.group(1)}.feed_forward.experts"
    if m.group(2) == "down_proj":
        return [(f"{base}.w2", None, t)]
    gate, up = t.chunk(2, dim=1)
    return [(f"{base}.w1", None, gate), (f"{base}.w3", None, up)]
