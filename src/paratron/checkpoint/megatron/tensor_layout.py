"""Megatron-LM's tensor layouts <-> paratron's single-device names.

Megatron's layouts, as single-device tensors (TP slices merged): `linear_qkv` holds q, k and v
interleaved per query group ([q of the group's heads; k; v] for each group in turn), `linear_fc1`
of a SwiGLU MLP holds [gate; up], the embedding and output layer carry a padded vocabulary, and the
norms are either separate modules (`input_layernorm`, `pre_mlp_layernorm`: the local spec) or
fused into the linear layers (`linear_qkv.layer_norm_weight`, `linear_fc1.layer_norm_weight`:
Transformer Engine's spec). Under TP, column-parallel weights (qkv, fc1, embedding, output) are
split along dim 0 (qkv by whole query groups, fc1 gate and up each), row-parallel ones (proj,
fc2) along dim 1; under PP each stage numbers its layers from 0.

The names of a layer's modules come from its kinds' declarations (`LayerKind.checkpoint_names`: attention and MLP,
the layers of megatron-core's GPT); this module keeps the arithmetic of the fused ones.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from paratron.config.schema import ModelConfig
from paratron.errors import CheckpointError
from paratron.model.layer_kind import LayerKind
from paratron.model.mlp import MLP
from paratron.model.transformer import Attention, TransformerBlock


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


# ---------------------------------------------------------------- a layer's names, from its kinds' declarations

_KINDS: dict[str, type[LayerKind]] = {kind.slot: kind for kind in (Attention, MLP)}
_BLOCK: tuple[tuple[str, type[LayerKind]], ...] = tuple(
    (norm, _KINDS[slot]) for norm, slot in TransformerBlock.residual_slots
)
"""The layers of megatron-core's GPT: a Transformer block's norms, each with the kind after it."""
_LINEARS = ("in_proj", "out_proj")
"""The children Megatron-LM keeps as linear layers (the others of a kind: its query and key norms)."""


def _megatron_name(kind: type[LayerKind], child: str) -> str:
    """The megatron-core module of a kind's child in a layer (`self_attention.linear_qkv`)."""
    names = kind.checkpoint_names
    return f"{names.megatron_module}.{names.megatron_children[child]}"


def _norm_spellings(kind: type[LayerKind]) -> tuple[str, ...]:
    """The megatron-core names of the norm in front of a kind: its own module, and fused by Transformer Engine."""
    names = kind.checkpoint_names
    fused = (f"{names.megatron_module}.{names.megatron_fused_norm}",) if names.megatron_fused_norm else ()
    return (names.megatron_norm, *fused)


_QKV, _FC1 = _megatron_name(Attention, "in_proj"), _megatron_name(MLP, "in_proj")
"""The fused input projections: q, k and v interleaved per query group; an MLP's [gate; up]."""
MODULE_ORDER = tuple(
    module
    for _, kind in _BLOCK
    for module in (
        kind.checkpoint_names.megatron_norm,
        *(_megatron_name(kind, child) for child in kind.checkpoint_names.megatron_children),
    )
)
"""A layer's modules in megatron-core's registration order (norms as their own modules: the local spec)."""
LINEAR_MODULES = tuple(
    _megatron_name(kind, child)
    for _, kind in _BLOCK
    for child in kind.checkpoint_names.megatron_children
    if child in _LINEARS
)
"""A layer's linear layers, in megatron-core's registration order."""
_NORMS = {spelling: norm for norm, kind in _BLOCK for spelling in _norm_spellings(kind)}
"""Either spelling of a norm -> paratron's name of it."""
_ALONE = {
    _megatron_name(kind, child): f"{kind.slot}.{child}"
    for _, kind in _BLOCK
    for child in kind.checkpoint_names.megatron_children
    if child != "in_proj"
}
"""The modules that map one to one (the output projections, the query and key norms) -> paratron's names."""
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
        module, _, part = rest.rpartition(".")
        if norm and norm.group(1) in _NORMS:
            out[prefix + f"{_NORMS[norm.group(1)]}.{norm.group(2)}"] = tensor
        elif module == _QKV:
            for p, piece in split_qkv(tensor, s).items():
                out[prefix + f"{Attention.slot}.in_proj.{p}.{part}"] = piece
        elif module == _FC1:
            if s.gated:
                gate, up = tensor.chunk(2)
                out[prefix + f"{MLP.slot}.in_proj.gate.{part}"] = gate.contiguous()
                out[prefix + f"{MLP.slot}.in_proj.up.{part}"] = up.contiguous()
            else:
                out[prefix + f"{MLP.slot}.in_proj.up.{part}"] = tensor
        elif module in _ALONE:
            out[prefix + f"{_ALONE[module]}.{part}"] = tensor
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
        out.update(_layer_to_megatron(state, f"layers.{i}.", f"decoder.layers.{i}.", s))
    for part in ("weight", "bias"):
        if f"final_norm.{part}" in state:
            out[f"decoder.final_layernorm.{part}"] = state[f"final_norm.{part}"]
    if m.untie_embeddings_and_output_weights:
        out["output_layer.weight"] = pad(state["output.weight"])
    return out


def _layer_to_megatron(state: dict[str, torch.Tensor], p: str, q: str, s: Shapes) -> dict[str, torch.Tensor]:
    """One layer's tensors (paratron's names under `p`, Megatron's under `q`), in the order written before: for the
    weights, then the biases, the norms and each kind's linear layers; then the query and key norms."""
    out: dict[str, torch.Tensor] = {}
    for part in ("weight", "bias"):
        if p + f"{_BLOCK[0][0]}.{part}" in state:
            for norm, kind in _BLOCK:
                out[q + f"{kind.checkpoint_names.megatron_norm}.{part}"] = state[p + f"{norm}.{part}"]
        for _, kind in _BLOCK:
            fused = _fused_in_proj(kind, state, p + f"{kind.slot}.in_proj.", part, s)
            if fused is not None:
                out[q + f"{_megatron_name(kind, 'in_proj')}.{part}"] = fused
            if p + f"{kind.slot}.out_proj.{part}" in state:
                out[q + f"{_megatron_name(kind, 'out_proj')}.{part}"] = state[p + f"{kind.slot}.out_proj.{part}"]
    for _, kind in _BLOCK:
        for child in kind.checkpoint_names.megatron_children:
            if child in _LINEARS:
                continue
            for part in ("weight", "bias"):
                if p + f"{kind.slot}.{child}.{part}" in state:
                    out[q + f"{_megatron_name(kind, child)}.{part}"] = state[p + f"{kind.slot}.{child}.{part}"]
    return out


def _fused_in_proj(
    kind: type[LayerKind], state: dict[str, torch.Tensor], prefix: str, part: str, s: Shapes
) -> torch.Tensor | None:
    """Megatron's one input projection of a kind from paratron's `in_proj` pieces under `prefix` (None: it has none):
    an attention's q, k, v interleaved per query group, an MLP's [gate; up]."""
    if kind is Attention:
        if prefix + f"q.{part}" not in state:
            return None
        return fuse_qkv(*(state[prefix + f"{x}.{part}"] for x in "qkv"), s)
    if prefix + f"up.{part}" not in state:
        return None
    up = state[prefix + f"up.{part}"]
    return torch.cat([state[prefix + f"gate.{part}"], up] if s.gated else [up]).contiguous()


# ---------------------------------------------------------------- tensor-parallel slices


def _linear(child: str, leaves: str) -> re.Pattern[str]:
    """Tensors `leaves` of the linear layers that the block's kinds' `child` is in megatron-core."""
    modules = "|".join(re.escape(kind.checkpoint_names.megatron_children[child]) for _, kind in _BLOCK)
    return re.compile(rf"\.({modules})\.({leaves})$")


_COLUMN_PARALLEL = _linear("in_proj", "weight|bias")
"""Split along their rows (q, k and v by whole query groups; an MLP's gate and up each)."""
_ROW_PARALLEL = _linear("out_proj", "weight")
"""Split along their columns (their biases whole)."""
_GATE_AND_UP = re.compile(rf"\.{re.escape(MLP.checkpoint_names.megatron_children['in_proj'])}\.(weight|bias)$")
"""A SwiGLU MLP's [gate; up], split into halves and each half over the ranks."""


def tp_dim(name: str) -> int | None:
    """The dimension Megatron splits tensor `name` along under TP (None: whole on every rank)."""
    if name in ("embedding.word_embeddings.weight", "output_layer.weight"):
        return 0
    if _COLUMN_PARALLEL.search(name):
        return 0
    if _ROW_PARALLEL.search(name):
        return 1
    return None


def merge_tp(name: str, slices: list[torch.Tensor], gated: bool) -> torch.Tensor:
    """One tensor from its TP ranks' slices (a SwiGLU fc1's gate halves and up halves each joined)."""
    dim = tp_dim(name)
    if dim is None or len(slices) == 1:
        return slices[0]
    if gated and _GATE_AND_UP.search(name):
        halves = [t.chunk(2) for t in slices]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves])
    return torch.cat(slices, dim=dim)


def split_tp(name: str, tensor: torch.Tensor, tp: int, gated: bool) -> list[torch.Tensor]:
    """`merge_tp`'s inverse: rank r's slice of `tensor`."""
    dim = tp_dim(name)
    if dim is None or tp == 1:
        return [tensor] * tp
    if gated and _GATE_AND_UP.search(name):
        gate, up = (h.chunk(tp) for h in tensor.chunk(2))
        return [torch.cat([g, u]).contiguous() for g, u in zip(gate, up)]
    return [t.contiguous() for t in tensor.chunk(tp, dim=dim)]


# ---------------------------------------------------------------- reading
