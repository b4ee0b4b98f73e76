"""Hugging Face tensors <-> paratron's single-device tensors, by each family's weight facts: names
(`Family.weight_names`), experts stored one by one on the Hub and stacked in paratron
(`experts.w_in` = [gate; up] of every expert, `experts.w_out` = their down projections), and GPT-2's
fused, transposed q/k/v and Conv1D weights.
"""

from __future__ import annotations

import re

import torch

from paratron.checkpoint.hf.families import FAMILIES
from paratron.checkpoint.hf.family import Family
from paratron.config.schema import ModelConfig
from paratron.errors import CheckpointError

_EXPERTS = re.compile(r"^layers\.(\d+)\.mlp\.experts\.(w_in|w_out)$")
"""paratron's stacked expert weights; the Hub holds (gate, up, down) of each expert apart."""
_QKV = re.compile(r"layers\.(\d+)\.attention\.in_proj\.(\w)\.(weight|bias)")
IGNORED = re.compile(r"\.attn\.(bias|masked_bias)$")
"""Causal-mask buffers some GPT-2 files carry; not weights."""


def _hf_name(name: str, table: dict[str, str]) -> str | None:
    """The Hugging Face name of paratron tensor `name` under `table` (None: not in the table)."""
    for pattern, target in table.items():
        regex = (
            "^"
            + re.escape(pattern)
            .replace(r"\{i\}", r"(?P<i>\d+)")
            .replace(r"\{p\}", r"(?P<p>\w+)")
            .replace(r"\{w\}", r"(?P<w>weight|bias)")
            + "$"
        )
        match = re.match(regex, name)
        if match:
            return target.format(**match.groupdict())
    return None


def _stored(family: Family, hf_name: str, tensor: torch.Tensor) -> torch.Tensor:
    """A weight as the family stores it (or back: transposing is its own inverse)."""
    return tensor.t().contiguous() if family.transposed and family.transposed.search(hf_name) else tensor


def weights_from_hf(
    tensors: dict[str, torch.Tensor], kind: str, m: ModelConfig, names: list[str], source: str
) -> dict[str, torch.Tensor]:
    """paratron tensors `names` (a model's parameter names) from Hugging Face `tensors`."""
    family = FAMILIES[kind]
    out: dict[str, torch.Tensor] = {}
    used: set[str] = set()
    for name in names:
        stacked = _EXPERTS.match(name)
        if stacked:  # one tensor of every expert's weights
            layer, which = stacked.groups()
            per_expert = []
            for e in range(m.num_experts or 0):
                gate, up, down = (pattern.format(i=layer, e=e) for pattern in family.expert_names or ())
                parts = [gate, up] if which == "w_in" else [down]
                per_expert.append(torch.cat([_take(tensors, part, source) for part in parts]))
                used.update(parts)
            out[name] = torch.stack(per_expert)
            continue
        if family.fused_qkv and ".attention.in_proj." in name:  # one fused, transposed QKV
            i, which, part = _QKV.match(name).groups()
            fused_name = family.fused_qkv.format(i=i, w=part)
            fused = _take(tensors, fused_name, source)
            used.add(fused_name)
            piece = fused.chunk(3, dim=-1)["qkv".index(which)]
            out[name] = piece.t().contiguous() if part == "weight" else piece.clone()
            continue
        hf_name = _hf_name(name, family.weight_names)
        if hf_name is None:
            raise CheckpointError(f"{source}: no Hugging Face name for {name}")
        used.add(hf_name)
        out[name] = _stored(family, hf_name, _take(tensors, hf_name, source))
    tied_head = tied_head_name(family) if not m.untie_embeddings_and_output_weights else None
    extra = [n for n in tensors if n not in used and n != tied_head and not IGNORED.search(n)]
    if extra:
        raise CheckpointError(f"{source}: has tensors the converted model would lack ({extra[0]}, ...)")
    return out


def weights_to_hf(state: dict[str, torch.Tensor], kind: str) -> dict[str, torch.Tensor]:
    """Hugging Face tensors from a paratron model's whole `state` (single-device names)."""
    family = FAMILIES[kind]
    out: dict[str, torch.Tensor] = {}
    fused: dict[tuple[str, str], dict[str, torch.Tensor]] = {}
    for name, tensor in state.items():
        stacked = _EXPERTS.match(name)
        if stacked:
            layer, which = stacked.groups()
            for e, weights in enumerate(tensor):
                gate, up, down = (pattern.format(i=layer, e=e) for pattern in family.expert_names or ())
                if which == "w_in":
                    out[gate], out[up] = (half.contiguous() for half in weights.chunk(2))
                else:
                    out[down] = weights.contiguous()
            continue
        if family.fused_qkv and ".attention.in_proj." in name:
            i, which, part = _QKV.match(name).groups()
            fused.setdefault((i, part), {})[which] = tensor
            continue
        hf_name = _hf_name(name, family.weight_names)
        if hf_name is None:
            raise CheckpointError(f"no Hugging Face name for {name}")
        out[hf_name] = _stored(family, hf_name, tensor)
    for (i, part), pieces in fused.items():
        qkv = [pieces[p].t() if part == "weight" else pieces[p] for p in "qkv"]
        out[family.fused_qkv.format(i=i, w=part)] = torch.cat(qkv, dim=-1).contiguous()
    return out


def tied_head_name(family: Family) -> str:
    """The Hub name of the output layer, which files of a model with tied embeddings may hold or leave out."""
    return _hf_name("output.weight", family.weight_names) or "lm_head.weight"


def written_layout(names: list[str], kind: str, source: str) -> dict[str, str]:
    """Each Hub weight name of a file -> its name in the layout paratron writes for family `kind` (the same but
    where the family's `hub_layouts` rename an earlier layout); a weight named twice is refused."""
    layouts = [(re.compile(pattern), target) for pattern, target in FAMILIES[kind].hub_layouts]
    renamed: dict[str, str] = {}
    first: dict[str, str] = {}
    for name in names:
        new = next((regex.sub(target, name, count=1) for regex, target in layouts if regex.match(name)), name)
        if new in first:
            raise CheckpointError(f"{source}: holds {new} twice (as {first[new]} and {name}); keep one")
        renamed[name], first[new] = new, name
    return renamed


def _take(tensors: dict[str, torch.Tensor], name: str, source: str) -> torch.Tensor:
    if name not in tensors:
        raise CheckpointError(f"{source}: has no tensor {name}; it is not a complete {name.split('.')[0]} model")
    return tensors[name]
