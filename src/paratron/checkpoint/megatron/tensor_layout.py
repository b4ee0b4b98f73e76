"""Megatron-LM's tensor layouts <-> paratron's single-device names.

Megatron's layouts, as single-device tensors (TP slices merged): `linear_qkv` holds q, k and v
interleaved per query group ([q of the group's heads; k; v] for each group in turn), `linear_fc1`
of a SwiGLU MLP holds [gate; up], the embedding and output layer carry a padded vocabulary, and the
norms are either separate modules (`input_layernorm`, `pre_mlp_layernorm`: the local spec) or
fused into the linear layers (`linear_qkv.layer_norm_weight`, `linear_fc1.layer_norm_weight`:
Transformer Engine's spec). Under TP, column-parallel weights (qkv, fc1, embedding, output) are
split along dim 0 (qkv by whole query groups, fc1 gate and up each), row-parallel ones (proj,
fc2) along dim 1; under PP each stage numbers its layers from 0.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from paratron.config.schema import ModelConfig
from paratron.errors import CheckpointError


@dataclass(frozen=True)
class Shapes:
    """The widths that Megatron's fused layouts interleave by."""

    heads: int
    groups: int
    head_dim: int
    gated: bool

    @classmethod
    def of(cls, m: ModelConfig) -> Shapes:
        heads = m.num_attention_heads
        groups = m.num_query_groups
        return cls(heads, groups, m.kv_channels, m.activation == "swiglu")


def split_qkv(fused: torch.Tensor, s: Shapes) -> dict[str, torch.Tensor]:
    """Megatron's per-group [q..; k; v] rows -> paratron's q, k, v (weight [rows, in] or bias [rows])."""
    per_group = s.heads // s.groups
    grouped = fused.reshape(s.groups, (per_group + 2) * s.head_dim, *fused.shape[1:])
    q, k, v = grouped.split([per_group * s.head_dim, s.head_dim, s.head_dim], dim=1)
    return {p: t.reshape(-1, *fused.shape[1:]).contiguous() for p, t in zip("qkv", (q, k, v))}


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, s: Shapes) -> torch.Tensor:
    """paratron's q, k, v -> Megatron's rows, interleaved per query group."""
    tail = q.shape[1:]
    parts = [t.reshape(s.groups, -1, *tail) for t in (q, k, v)]
    return torch.cat(parts, dim=1).reshape(-1, *tail).contiguous()


_NORMS = {
    "input_layernorm": "attention_norm",
    "self_attention.linear_qkv.layer_norm": "attention_norm",
    "pre_mlp_layernorm": "mlp_norm",
    "mlp.linear_fc1.layer_norm": "mlp_norm",
}
LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")


def to_paratron(global_state: dict[str, torch.Tensor], m: ModelConfig, source: str) -> dict[str, torch.Tensor]:
    """Megatron single-device tensors (global layer numbers, TP merged, padded vocabulary) ->
    paratron's single-device state."""
    s = Shapes.of(m)
    out: dict[str, torch.Tensor] = {}
    for name, tensor in global_state.items():
        layer = LAYER.match(name)
        if layer is None:
            _top_level(name, tensor, m, out, source)
            continue
        i, rest = layer.groups()
        prefix = f"layers.{i}."
        norm = re.match(r"^(.+?)[._](weight|bias)$", rest)
        if norm and norm.group(1) in _NORMS:
            out[prefix + f"{_NORMS[norm.group(1)]}.{norm.group(2)}"] = tensor
        elif rest.startswith("self_attention.linear_qkv."):
            part = rest.rsplit(".", 1)[1]
            for p, piece in split_qkv(tensor, s).items():
                out[prefix + f"attention.in_proj.{p}.{part}"] = piece
        elif rest.startswith("self_attention.linear_proj."):
            out[prefix + "attention.out_proj." + rest.rsplit(".", 1)[1]] = tensor
        elif re.fullmatch(r"self_attention\.[qk]_layernorm\.(weight|bias)", rest):
            which, part = rest.split(".")[1][0], rest.rsplit(".", 1)[1]
            out[prefix + f"attention.{which}_norm.{part}"] = tensor
        elif rest.startswith("mlp.linear_fc1."):
            part = rest.rsplit(".", 1)[1]
            if s.gated:
                gate, up = tensor.chunk(2)
                out[prefix + f"mlp.in_proj.gate.{part}"] = gate.contiguous()
                out[prefix + f"mlp.in_proj.up.{part}"] = up.contiguous()
            else:
                out[prefix + f"mlp.in_proj.up.{part}"] = tensor
        elif rest.startswith("mlp.linear_fc2."):
            out[prefix + "mlp.out_proj." + rest.rsplit(".", 1)[1]] = tensor
        else:
            raise CheckpointError(f"{source}: holds {name}, which paratron's GPT layers have no place for")
    return out


def _top_level(name: str, tensor: torch.Tensor, m: ModelConfig, out: dict[str, torch.Tensor], source: str) -> None:
    vocab = m.vocab_size or tensor.shape[0]
    if name == "embedding.word_embeddings.weight":
        out["embedding.weight"] = tensor[:vocab].contiguous()
    elif name == "embedding.position_embeddings.weight":
        out["position_embedding.weight"] = tensor
    elif name.startswith("decoder.final_layernorm."):
        out["final_norm." + name.rsplit(".", 1)[1]] = tensor
    elif name == "output_layer.weight":
        if m.untie_embeddings_and_output_weights:  # (tied: the last stage's copy of the embedding)
            out["output.weight"] = tensor[:vocab].contiguous()
    else:
        raise CheckpointError(f"{source}: holds {name}, which paratron's GPT layers have no place for")


def from_paratron(state: dict[str, torch.Tensor], m: ModelConfig, padded: int) -> dict[str, torch.Tensor]:
    """paratron's single-device state -> Megatron single-device tensors (local spec names, global
    layer numbers, vocabulary padded with zero rows to `padded`)."""
    s = Shapes.of(m)

    def pad(t: torch.Tensor) -> torch.Tensor:
        return torch.cat([t, t.new_zeros(padded - t.shape[0], *t.shape[1:])]) if padded > t.shape[0] else t

    out: dict[str, torch.Tensor] = {"embedding.word_embeddings.weight": pad(state["embedding.weight"])}
    if "position_embedding.weight" in state:
        out["embedding.position_embeddings.weight"] = state["position_embedding.weight"]
    for i in range(m.num_layers):
        p, q = f"layers.{i}.", f"decoder.layers.{i}."
        for part in ("weight", "bias"):
            if p + f"attention_norm.{part}" in state:
                out[q + f"input_layernorm.{part}"] = state[p + f"attention_norm.{part}"]
                out[q + f"pre_mlp_layernorm.{part}"] = state[p + f"mlp_norm.{part}"]
            if p + f"attention.in_proj.q.{part}" in state:
                qkv = (state[p + f"attention.in_proj.{x}.{part}"] for x in "qkv")
                out[q + f"self_attention.linear_qkv.{part}"] = fuse_qkv(*qkv, s)
            if p + f"attention.out_proj.{part}" in state:
                out[q + f"self_attention.linear_proj.{part}"] = state[p + f"attention.out_proj.{part}"]
            if p + f"mlp.in_proj.up.{part}" in state:
                up = state[p + f"mlp.in_proj.up.{part}"]
                gated = [state[p + f"mlp.in_proj.gate.{part}"], up] if s.gated else [up]
                out[q + f"mlp.linear_fc1.{part}"] = torch.cat(gated).contiguous()
            if p + f"mlp.out_proj.{part}" in state:
                out[q + f"mlp.linear_fc2.{part}"] = state[p + f"mlp.out_proj.{part}"]
        for x in "qk":
            for part in ("weight", "bias"):
                if p + f"attention.{x}_norm.{part}" in state:
                    out[q + f"self_attention.{x}_layernorm.{part}"] = state[p + f"attention.{x}_norm.{part}"]
    for part in ("weight", "bias"):
        if f"final_norm.{part}" in state:
            out[f"decoder.final_layernorm.{part}"] = state[f"final_norm.{part}"]
    if m.untie_embeddings_and_output_weights:
        out["output_layer.weight"] = pad(state["output.weight"])
    return out


# ---------------------------------------------------------------- tensor-parallel slices


def tp_dim(name: str) -> int | None:
    """The dimension Megatron splits tensor `name` along under TP (None: whole on every rank)."""
    if name in ("embedding.word_embeddings.weight", "output_layer.weight"):
        return 0
    if re.search(r"\.linear_(qkv|fc1)\.(weight|bias)$", name):
        return 0
    if re.search(r"\.linear_(proj|fc2)\.weight$", name):
        return 1
    return None


def merge_tp(name: str, slices: list[torch.Tensor], gated: bool) -> torch.Tensor:
    """One tensor from its TP ranks' slices (a SwiGLU fc1's gate halves and up halves each joined)."""
    dim = tp_dim(name)
    if dim is None or len(slices) == 1:
        return slices[0]
    if gated and re.search(r"\.linear_fc1\.(weight|bias)$", name):
        halves = [t.chunk(2) for t in slices]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves])
    return torch.cat(slices, dim=dim)


def split_tp(name: str, tensor: torch.Tensor, tp: int, gated: bool) -> list[torch.Tensor]:
    """`merge_tp`'s inverse: rank r's slice of `tensor`."""
    dim = tp_dim(name)
    if dim is None or tp == 1:
        return [tensor] * tp
    if gated and re.search(r"\.linear_fc1\.(weight|bias)$", name):
        gate, up = (h.chunk(tp) for h in tensor.chunk(2))
        return [torch.cat([g, u]).contiguous() for g, u in zip(gate, up)]
    return [t.contiguous() for t in tensor.chunk(tp, dim=dim)]


# ---------------------------------------------------------------- reading
