"""Hugging Face interop: `config.json` + safetensors <-> paratron checkpoints.

Supported: Llama (grouped-query attention, any rotary theta, tied or untied embeddings),
Mistral (the same layers, with its sliding window when `sliding_window` is set), Qwen2 (biases
on the query, key and value projections), Qwen3 (a norm on each head's queries and keys), GPT-2
(learned positions, LayerNorm, tanh GELU, fused QKV stored as Conv1D, i.e. transposed), and the
mixtures of experts Mixtral (softmax over the top-k router logits) and Qwen2-MoE (softmax before
the top-k, a shared expert with a sigmoid gate, dense layers where `decoder_sparse_step` and
`mlp_only_layers` say) and Qwen3-MoE (Qwen2-MoE's routing with Qwen3's query/key norms, no
shared expert). A sliding window carries over both ways when every layer has it; a config whose
layers mix windowed and full attention is refused. Experts are stored one by one on the Hub and
stacked in paratron (`experts.w_in` = [gate; up] of every expert, `experts.w_out` = their down
projections).

`config.json` is read as transformers reads it: a field the file leaves out takes transformers'
default for its model type (the tables of `hf_defaults`). The weights (model.safetensors, or the
shards model.safetensors.index.json names) are checked against the model the file describes, by
name and shape, before any is loaded; a mismatch, or a weights file that is missing, empty, cut
short or not safetensors, is refused in one line naming the file, and the left-out field whose
default is to blame.

A converted checkpoint is an ordinary paratron checkpoint at iteration 0 marked "weights only"
(no optimizer state): `paratron train --load` starts from its weights at any layout, and
`paratron.load_pretrained` loads it; `paratron train --load DST --finetune` builds its model without model
flags. The converter also writes `model.yaml`, a recipe with the model's shape.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import torch
import yaml
from safetensors import SafetensorError, safe_open

from paratron.checkpoint.hf_defaults import (
    DEFAULTS,
    WEIGHT_SHAPING,
    default_text,
    first_wrong_type,
    spelled,
    with_defaults,
)
from paratron.checkpoint.io import (
    CONVERT_FIX,
    CONVERTED,
    CheckpointContent,
    read_checkpoint,
    save_checkpoint,
    weight_catalog,
)
from paratron.config.loading import build_config, config_to_dict
from paratron.config.schema import Config, ModelConfig
from paratron.data.tokenizer import Tokenizer, export_tokenizer
from paratron.errors import CheckpointError, ConfigError
from paratron.model.gpt import GPT, build_model
from paratron.model.lora import is_adapter, merge_adapters
from paratron.storage import FOLDER_SLACK, new_folder, save_tensors, tensor_bytes

ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "gpt2": "GPT2LMHeadModel",
    "mixtral": "MixtralForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
}
FAMILY_NAMES = {
    "llama": "Llama",
    "mistral": "Mistral",
    "qwen2": "Qwen2",
    "qwen3": "Qwen3",
    "gpt2": "GPT-2",
    "mixtral": "Mixtral",
    "qwen2_moe": "Qwen2-MoE",
    "qwen3_moe": "Qwen3-MoE",
}
"""How the documents and `paratron convert --help` name each model_type of ARCHITECTURES (a test holds
README.md and docs/training.md to this list)."""
LLAMA_FAMILY = ("llama", "mistral", "qwen2", "qwen3")
MOE_FAMILY = ("mixtral", "qwen2_moe", "qwen3_moe")

# paratron name -> Hugging Face name, per family (layer index as {i})
_LLAMA_NAMES = {
    "embedding.weight": "model.embed_tokens.weight",
    "final_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "layers.{i}.attention_norm.weight": "model.layers.{i}.input_layernorm.weight",
    "layers.{i}.attention.in_proj.{p}.{w}": "model.layers.{i}.self_attn.{p}_proj.{w}",
    "layers.{i}.attention.out_proj.weight": "model.layers.{i}.self_attn.o_proj.weight",
    "layers.{i}.attention.{p}_norm.weight": "model.layers.{i}.self_attn.{p}_norm.weight",
    "layers.{i}.mlp_norm.weight": "model.layers.{i}.post_attention_layernorm.weight",
    "layers.{i}.mlp.in_proj.{p}.weight": "model.layers.{i}.mlp.{p}_proj.weight",
    "layers.{i}.mlp.out_proj.weight": "model.layers.{i}.mlp.down_proj.weight",
}
_MIXTRAL_NAMES = {
    **{k: v for k, v in _LLAMA_NAMES.items() if ".mlp." not in k},
    "layers.{i}.mlp.router.weight": "model.layers.{i}.block_sparse_moe.gate.weight",
}
_MIXTRAL_EXPERT = (
    "model.layers.{i}.block_sparse_moe.experts.{e}.w1.weight",
    "model.layers.{i}.block_sparse_moe.experts.{e}.w3.weight",
    "model.layers.{i}.block_sparse_moe.experts.{e}.w2.weight",
)
_QWEN2_MOE_NAMES = {
    **_LLAMA_NAMES,
    "layers.{i}.mlp.router.weight": "model.layers.{i}.mlp.gate.weight",
    "layers.{i}.mlp.shared_expert.in_proj.{p}.weight": "model.layers.{i}.mlp.shared_expert.{p}_proj.weight",
    "layers.{i}.mlp.shared_expert.out_proj.weight": "model.layers.{i}.mlp.shared_expert.down_proj.weight",
    "layers.{i}.mlp.shared_expert_gate.weight": "model.layers.{i}.mlp.shared_expert_gate.weight",
}
_QWEN2_MOE_EXPERT = (
    "model.layers.{i}.mlp.experts.{e}.gate_proj.weight",
    "model.layers.{i}.mlp.experts.{e}.up_proj.weight",
    "model.layers.{i}.mlp.experts.{e}.down_proj.weight",
)
_EXPERTS = re.compile(r"^layers\.(\d+)\.mlp\.experts\.(w_in|w_out)$")
"""paratron's stacked expert weights; the Hub holds (gate, up, down) of each expert apart."""
_GPT2_NAMES = {
    "embedding.weight": "transformer.wte.weight",
    "position_embedding.weight": "transformer.wpe.weight",
    "final_norm.{w}": "transformer.ln_f.{w}",
    "layers.{i}.attention_norm.{w}": "transformer.h.{i}.ln_1.{w}",
    "layers.{i}.attention.out_proj.{w}": "transformer.h.{i}.attn.c_proj.{w}",
    "layers.{i}.mlp_norm.{w}": "transformer.h.{i}.ln_2.{w}",
    "layers.{i}.mlp.in_proj.up.{w}": "transformer.h.{i}.mlp.c_fc.{w}",
    "layers.{i}.mlp.out_proj.{w}": "transformer.h.{i}.mlp.c_proj.{w}",
}
_NAMES = {"gpt2": _GPT2_NAMES, "mixtral": _MIXTRAL_NAMES, "qwen2_moe": _QWEN2_MOE_NAMES, "qwen3_moe": _QWEN2_MOE_NAMES}
"""paratron name -> Hugging Face name, per model type (the Llama family's otherwise)."""
_EXPERT_NAMES = {"mixtral": _MIXTRAL_EXPERT, "qwen2_moe": _QWEN2_MOE_EXPERT, "qwen3_moe": _QWEN2_MOE_EXPERT}
"""The Hub names of one expert's (gate, up, down) weights, per mixture-of-experts type."""
_GPT2_CONV1D = re.compile(r"\.(c_attn|c_proj|c_fc)\.weight$")
"""GPT-2's linear layers are Conv1D: their weights are stored [in, out], transposed."""
_GPT2_IGNORED = re.compile(r"\.attn\.(bias|masked_bias)$")
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


# ---------------------------------------------------------------- configurations


def model_settings(hf: dict[str, Any], source: str = "config.json") -> dict[str, Any]:
    """paratron model settings for a Hugging Face `config.json` (refused with one line when the
    model has something paratron's layers do not). A field the file leaves out takes transformers'
    default for the model type (`hf_defaults.DEFAULTS`), as transformers itself reads the file."""
    kind = _model_type(hf, source)
    wrong = first_wrong_type(hf, kind)
    if wrong:
        raise CheckpointError(f"{source}: {wrong[0]} is {json.dumps(hf[wrong[0]])}, not {wrong[1]}; correct it")
    hf, _ = with_defaults(hf, kind)
    if kind == "gpt2":
        return _gpt2_settings(hf, source)
    rope = hf.get("rope_scaling") or hf.get("rope_parameters") or {}  # (transformers' order)
    if not isinstance(rope, dict):
        raise CheckpointError(f"{source}: rope_parameters is not a JSON object of rotary settings; correct it")
    if rope.get("rope_type", rope.get("type", "default")) not in ("default", None):
        raise CheckpointError(
            f"{source}: rope scaling {rope.get('rope_type', rope.get('type'))!r} is not "
            "supported; only plain rotary embeddings are"
        )
    if hf["hidden_act"] != "silu":
        raise CheckpointError(f"{source}: hidden_act {hf['hidden_act']!r} is not supported (SwiGLU needs silu)")
    if hf.get("attention_bias") or hf.get("mlp_bias"):
        raise CheckpointError(f"{source}: attention_bias/mlp_bias are not supported for {kind}")
    heads = hf["num_attention_heads"]
    head_dim = hf.get("head_dim") or hf["hidden_size"] // heads
    return dict(
        **_expert_settings(hf, kind),
        **_attention_settings(hf, kind, source),
        num_layers=hf["num_hidden_layers"],
        hidden_size=hf["hidden_size"],
        num_attention_heads=heads,
        num_query_groups=hf["num_key_value_heads"] or heads,
        ffn_hidden_size=hf["intermediate_size"],
        kv_channels=None if head_dim * heads == hf["hidden_size"] else head_dim,
        max_position_embeddings=hf["max_position_embeddings"],
        vocab_size=hf["vocab_size"],
        position_embedding_type="rope",
        rotary_base=float(rope.get("rope_theta") or hf["rope_theta"]),
        normalization="RMSNorm",
        norm_epsilon=hf["rms_norm_eps"],
        activation="swiglu",
        add_bias_linear=False,
        add_qkv_bias=kind == "qwen2" or (kind == "qwen2_moe" and hf["qkv_bias"]),
        qk_layernorm=kind in ("qwen3", "qwen3_moe"),
        untie_embeddings_and_output_weights=not hf["tie_word_embeddings"],
        hidden_dropout=0.0,
        attention_dropout=hf["attention_dropout"],
    )


def _gpt2_settings(hf: dict[str, Any], source: str) -> dict[str, Any]:
    """paratron model settings for a GPT-2 `config.json` (`hf` with its defaults)."""
    gelu = hf["activation_function"]
    if gelu not in ("gelu_new", "gelu_pytorch_tanh", "gelu"):
        raise CheckpointError(
            f"{source}: activation_function {gelu!r} is not supported (paratron's GELU is the exact one, "
            "gelu, or the tanh approximation, gelu_new)"
        )
    return dict(
        num_layers=hf["n_layer"],
        hidden_size=hf["n_embd"],
        num_attention_heads=hf["n_head"],
        ffn_hidden_size=hf["n_inner"] or 4 * hf["n_embd"],
        max_position_embeddings=hf["n_positions"],
        vocab_size=hf["vocab_size"],
        position_embedding_type="learned_absolute",
        normalization="LayerNorm",
        norm_epsilon=hf["layer_norm_epsilon"],
        activation="gelu",
        openai_gelu=gelu != "gelu",
        add_bias_linear=True,
        untie_embeddings_and_output_weights=not hf["tie_word_embeddings"],
        hidden_dropout=hf["resid_pdrop"],
        attention_dropout=hf["attn_pdrop"],
    )


def _model_type(hf: dict[str, Any], source: str) -> str:
    """The supported model type a config.json declares (its `architectures` only hint at a missing one)."""
    if "model_type" not in hf:
        by_class = {architecture: kind for kind, architecture in ARCHITECTURES.items()}
        named = [by_class[a] for a in hf.get("architectures") or [] if isinstance(a, str) and a in by_class]
        hint = f'"model_type": "{named[0]}" (its architectures say {ARCHITECTURES[named[0]]})' if named else "it"
        raise CheckpointError(f"{source}: has no model_type (one of {', '.join(ARCHITECTURES)}); add {hint}")
    kind = hf["model_type"]
    if kind not in ARCHITECTURES:
        raise CheckpointError(
            f"{source}: model_type {kind!r} is not supported; convert one of {', '.join(ARCHITECTURES)}"
        )
    return kind


QWEN_FAMILY = ("qwen2", "qwen2_moe", "qwen3", "qwen3_moe")


def _attention_settings(hf: dict[str, Any], kind: str, source: str) -> dict[str, Any]:
    """Full causal attention, or one sliding window on every layer, read as transformers reads each
    family (`hf` with its defaults): Mistral and Mixtral window every layer by `sliding_window`, Qwen3-MoE
    too when `use_sliding_window`; Qwen2 and Qwen3 window the layers from `max_window_layers` on, Qwen2-MoE
    the even-numbered ones below it, when `use_sliding_window`, unless `layer_types` lists each layer's.
    Windows on some layers only are refused: paratron's layers share one pattern. A window longer than
    `max_position_embeddings` never hides a token of a sequence the model takes: plain causal attention."""
    layers, use = hf["num_hidden_layers"], hf.get("use_sliding_window")
    if kind in ("qwen2", "qwen3"):
        window = hf["sliding_window"] if use else None
        first = hf["max_window_layers"]
        pattern = [
            "sliding_attention" if window is not None and i >= first else "full_attention" for i in range(layers)
        ]
    elif kind == "qwen2_moe":
        window = hf["sliding_window"] if use else 0
        below = hf["max_window_layers"]
        pattern = ["sliding_attention" if use and i % 2 == 0 and i < below else "full_attention" for i in range(layers)]
    else:  # (transformers gives Mistral, Mixtral and Qwen3-MoE layers no types of their own)
        window = hf.get("sliding_window") if kind != "qwen3_moe" or use else None
        pattern = ["full_attention" if window is None else "sliding_attention"] * layers
    declared = hf.get("layer_types")
    types = declared if declared is not None else pattern
    unknown = sorted(set(types) - {"full_attention", "sliding_attention"})
    if unknown:
        raise CheckpointError(f"{source}: layer_types {unknown[0]!r} is not supported (full or sliding attention)")
    if len(set(types)) > 1:
        raise CheckpointError(
            f"{source}: some layers use sliding-window attention and others full attention "
            "(layer_types / max_window_layers); paratron gives every layer the same attention"
        )
    if kind in ("qwen2", "qwen3", "qwen2_moe") and types and types[0] == "full_attention":
        window = None
    if window is None or window > hf["max_position_embeddings"]:
        return {"attention_type": "causal"}
    if not window:
        raise CheckpointError(f"{source}: sliding-window layers with sliding_window {window!r}; give the window size")
    return {"attention_type": "sliding-window", "window_size": int(window)}


def _attention_config(m: ModelConfig, kind: str) -> dict[str, Any]:
    """The sliding-window entries of a `config.json` for model `m` as architecture `kind`."""
    if m.attention_type == "block-sparse" or (kind == "gpt2" and m.attention_type == "sliding-window"):
        raise CheckpointError(
            f"--attention-type {m.attention_type} has no equivalent in Hugging Face's {ARCHITECTURES[kind]}; "
            "export a model trained with causal or sliding-window attention"
        )
    window = m.window_size if m.attention_type == "sliding-window" else None
    if kind in QWEN_FAMILY:
        kinds = ["sliding_attention" if window else "full_attention"] * m.num_layers
        return dict(
            use_sliding_window=window is not None, sliding_window=window, max_window_layers=0, layer_types=kinds
        )
    return {} if kind == "gpt2" else {"sliding_window": window}


def _expert_settings(hf: dict[str, Any], kind: str) -> dict[str, Any]:
    """The mixture-of-experts settings of a Mixtral, Qwen2-MoE or Qwen3-MoE config.json (`hf` with its
    defaults; none for dense models)."""
    if kind == "mixtral":
        return dict(
            num_experts=hf["num_local_experts"],
            moe_router_topk=hf["num_experts_per_tok"],
            moe_ffn_hidden_size=hf["intermediate_size"],
            moe_aux_loss_coeff=hf["router_aux_loss_coef"],
        )
    if kind not in ("qwen2_moe", "qwen3_moe"):
        return {}
    step, dense = hf["decoder_sparse_step"] or 1, set(hf["mlp_only_layers"] or [])
    pattern = [int(i not in dense and (i + 1) % step == 0) for i in range(hf["num_hidden_layers"])]
    shared = (hf["shared_expert_intermediate_size"] or None) if kind == "qwen2_moe" else None
    return dict(
        num_experts=hf["num_experts" if kind == "qwen2_moe" else "num_local_experts"],
        moe_router_topk=hf["num_experts_per_tok"],
        moe_router_pre_softmax=not hf["norm_topk_prob"],
        moe_ffn_hidden_size=hf["moe_intermediate_size"],
        moe_layer_freq="[" + ",".join(map(str, pattern)) + "]",
        moe_shared_expert_intermediate_size=shared,
        moe_shared_expert_gate=shared is not None,
        moe_aux_loss_coeff=hf["router_aux_loss_coef"],
    )


def _refuse_megatron_only_features(m: ModelConfig) -> None:
    """Megatron-LM model settings that none of the supported Hugging Face architectures can express."""
    unsupported = {
        "--apply-layernorm-1p (norm scales stored as w, applied as 1 + w)": m.apply_layernorm_1p,
        "--rotary-percent below 1 (partial rotary embeddings)": m.rotary_percent < 1.0,
        "--rotary-interleaved (rotation of interleaved feature pairs)": m.rotary_interleaved,
        "--position-embedding-type none (no position embeddings)": m.position_embedding_type == "none",
    }
    for setting, used in unsupported.items():
        if used:
            raise CheckpointError(
                f"this model uses {setting}, which the Hugging Face Llama/Qwen/Mistral/GPT-2 formats cannot express; "
                "keep it as a paratron checkpoint"
            )


def model_type_of(m: ModelConfig, preferred: str | None = None) -> str:
    """The Hugging Face architecture that has exactly paratron model `m`'s layers."""
    _refuse_megatron_only_features(m)
    if (
        m.position_embedding_type == "rope"
        and m.normalization == "RMSNorm"
        and m.activation == "swiglu"
        and not m.add_bias_linear
    ):
        if m.num_experts:
            return _moe_type_of(m)
        if m.qk_layernorm and not m.add_qkv_bias:
            return "qwen3"
        if m.add_qkv_bias and not m.qk_layernorm:
            return "qwen2"
        if m.qk_layernorm:
            raise CheckpointError("no Hugging Face model has both query/key/value biases and query/key norms")
        if m.attention_type == "sliding-window":
            return "mistral"  # (Llama has no window)
        return preferred if preferred in ("llama", "mistral") else "llama"
    if (
        m.position_embedding_type == "learned_absolute"
        and m.normalization == "LayerNorm"
        and m.activation == "gelu"
        and m.add_bias_linear
        and not m.untie_embeddings_and_output_weights
    ):
        return "gpt2"
    raise CheckpointError(
        "this model has no Hugging Face equivalent (Llama, Mistral and Qwen2 need rotary "
        "embeddings, RMSNorm, SwiGLU and no linear biases; GPT-2 needs learned positions, "
        "LayerNorm, GELU, biases and tied embeddings)"
    )


def _moe_type_of(m: ModelConfig) -> str:
    softmax = m.moe_router_score_function == "softmax"
    shared = m.moe_shared_expert_intermediate_size
    mixtral = not (m.add_qkv_bias or m.qk_layernorm or shared or m.moe_router_pre_softmax)
    if mixtral and all(m.moe_layer_pattern) and softmax:
        return "mixtral"
    shared_ok = bool(shared) == m.moe_shared_expert_gate
    if m.add_qkv_bias and not m.qk_layernorm and shared_ok and softmax:
        return "qwen2_moe"
    if m.qk_layernorm and not m.add_qkv_bias and not shared and softmax:
        return "qwen3_moe"
    raise CheckpointError(
        "this mixture of experts has no Hugging Face equivalent (Mixtral: softmax over the top-k, every layer MoE, "
        "no shared expert; Qwen2-MoE: query/key/value biases, a shared expert with its gate or none; Qwen3-MoE: "
        "query/key norms, no shared expert)"
    )


def _moe_config(m: ModelConfig, kind: str) -> dict[str, Any]:
    if kind == "mixtral":
        return dict(
            num_local_experts=m.num_experts,
            num_experts_per_tok=m.moe_router_topk,
            router_aux_loss_coef=m.moe_aux_loss_coeff,
        )
    layers = m.moe_layer_pattern
    config = dict(
        **{"num_experts" if kind == "qwen2_moe" else "num_local_experts": m.num_experts},
        num_experts_per_tok=m.moe_router_topk,
        norm_topk_prob=not m.moe_router_pre_softmax,
        moe_intermediate_size=m.moe_ffn_hidden_size or m.ffn_hidden_size,
        decoder_sparse_step=1,
        mlp_only_layers=[i for i, moe in enumerate(layers) if not moe],
        router_aux_loss_coef=m.moe_aux_loss_coeff,
    )
    if kind == "qwen2_moe":
        config.update(shared_expert_intermediate_size=m.moe_shared_expert_intermediate_size or 0, qkv_bias=True)
    return config


def hf_config(m: ModelConfig, kind: str) -> dict[str, Any]:
    """A Hugging Face `config.json` for paratron model `m` as architecture `kind`."""
    common = {
        "architectures": [ARCHITECTURES[kind]],
        "model_type": kind,
        "vocab_size": m.vocab_size,
        "torch_dtype": "float32",
        **_attention_config(m, kind),  # (and refused when the architecture has no such attention)
    }
    if kind == "gpt2":
        return {
            **common,
            "n_layer": m.num_layers,
            "n_embd": m.hidden_size,
            "n_head": m.num_attention_heads,
            "n_inner": m.ffn_hidden_size,
            "n_positions": m.max_position_embeddings,
            "layer_norm_epsilon": m.norm_epsilon,
            "activation_function": "gelu_new" if m.openai_gelu else "gelu",
            "resid_pdrop": m.hidden_dropout,
            "embd_pdrop": m.hidden_dropout,
            "attn_pdrop": m.attention_dropout,
            "tie_word_embeddings": True,
        }
    config = {
        **common,
        "num_hidden_layers": m.num_layers,
        "hidden_size": m.hidden_size,
        "num_attention_heads": m.num_attention_heads,
        "num_key_value_heads": m.num_query_groups,
        "head_dim": m.kv_channels,
        "intermediate_size": m.ffn_hidden_size,
        "max_position_embeddings": m.max_position_embeddings,
        "rms_norm_eps": m.norm_epsilon,
        "rope_theta": m.rotary_base,
        "hidden_act": "silu",
        "attention_dropout": m.attention_dropout,
        "tie_word_embeddings": not m.untie_embeddings_and_output_weights,
    }
    if kind in ("llama", "qwen3", "qwen3_moe"):
        config.update(attention_bias=False)
    if kind == "llama":
        config.update(mlp_bias=False)
    if kind in MOE_FAMILY:
        config.update(_moe_config(m, kind))
    return config


# ---------------------------------------------------------------- weights


def weights_from_hf(
    tensors: dict[str, torch.Tensor], kind: str, m: ModelConfig, names: list[str], source: str
) -> dict[str, torch.Tensor]:
    """paratron tensors `names` (a model's parameter names) from Hugging Face `tensors`."""
    out: dict[str, torch.Tensor] = {}
    used: set[str] = set()
    table = _NAMES.get(kind, _LLAMA_NAMES)
    for name in names:
        stacked = _EXPERTS.match(name)
        if stacked:  # one tensor of every expert's weights
            layer, which = stacked.groups()
            per_expert = []
            for e in range(m.num_experts or 0):
                gate, up, down = (pattern.format(i=layer, e=e) for pattern in _EXPERT_NAMES[kind])
                parts = [gate, up] if which == "w_in" else [down]
                per_expert.append(torch.cat([_take(tensors, part, source) for part in parts]))
                used.update(parts)
            out[name] = torch.stack(per_expert)
            continue
        if kind == "gpt2" and ".attention.in_proj." in name:  # one fused, transposed QKV
            i, which, part = re.match(r"layers\.(\d+)\.attention\.in_proj\.(\w)\.(weight|bias)", name).groups()
            fused_name = f"transformer.h.{i}.attn.c_attn.{part}"
            fused = _take(tensors, fused_name, source)
            used.add(fused_name)
            piece = fused.chunk(3, dim=-1)["qkv".index(which)]
            out[name] = piece.t().contiguous() if part == "weight" else piece.clone()
            continue
        hf_name = _hf_name(name, table)
        if hf_name is None:
            raise CheckpointError(f"{source}: no Hugging Face name for {name}")
        tensor = _take(tensors, hf_name, source)
        used.add(hf_name)
        out[name] = tensor.t().contiguous() if kind == "gpt2" and _GPT2_CONV1D.search(hf_name) else tensor
    tied_head = "lm_head.weight" if not m.untie_embeddings_and_output_weights else None
    extra = [n for n in tensors if n not in used and n != tied_head and not _GPT2_IGNORED.search(n)]
    if extra:
        raise CheckpointError(f"{source}: has tensors the converted model would lack ({extra[0]}, ...)")
    return out


def weights_to_hf(state: dict[str, torch.Tensor], kind: str) -> dict[str, torch.Tensor]:
    """Hugging Face tensors from a paratron model's whole `state` (single-device names)."""
    out: dict[str, torch.Tensor] = {}
    fused: dict[tuple[str, str], dict[str, torch.Tensor]] = {}
    table = _NAMES.get(kind, _LLAMA_NAMES)
    for name, tensor in state.items():
        stacked = _EXPERTS.match(name)
        if stacked:
            layer, which = stacked.groups()
            for e, weights in enumerate(tensor):
                gate, up, down = (pattern.format(i=layer, e=e) for pattern in _EXPERT_NAMES[kind])
                if which == "w_in":
                    out[gate], out[up] = (half.contiguous() for half in weights.chunk(2))
                else:
                    out[down] = weights.contiguous()
            continue
        if kind == "gpt2" and ".attention.in_proj." in name:
            i, which, part = re.match(r"layers\.(\d+)\.attention\.in_proj\.(\w)\.(weight|bias)", name).groups()
            fused.setdefault((i, part), {})[which] = tensor
            continue
        hf_name = _hf_name(name, table)
        if hf_name is None:
            raise CheckpointError(f"no Hugging Face name for {name}")
        out[hf_name] = tensor.t().contiguous() if kind == "gpt2" and _GPT2_CONV1D.search(hf_name) else tensor
    for (i, part), pieces in fused.items():
        qkv = [pieces[p].t() if part == "weight" else pieces[p] for p in "qkv"]
        out[f"transformer.h.{i}.attn.c_attn.{part}"] = torch.cat(qkv, dim=-1).contiguous()
    return out


def _take(tensors: dict[str, torch.Tensor], name: str, source: str) -> torch.Tensor:
    if name not in tensors:
        raise CheckpointError(f"{source}: has no tensor {name}; it is not a complete {name.split('.')[0]} model")
    return tensors[name]


# ---------------------------------------------------------------- directories


def read_hf_config(path: Path) -> dict[str, Any]:
    """A Hugging Face model directory's config.json, refused with one line unless supported."""
    config_file = path / "config.json"
    if not config_file.is_file():
        raise CheckpointError(f"{path}: no config.json; give a Hugging Face model directory")
    try:
        hf = json.loads(config_file.read_text(encoding="utf-8"))
    except ValueError:
        raise CheckpointError(f"{config_file}: not valid JSON") from None
    if not isinstance(hf, dict):
        raise CheckpointError(f"{config_file}: not a JSON object of model settings; give the model's config.json")
    model_settings(hf, str(config_file))
    return hf


INDEX = "model.safetensors.index.json"
"""Hugging Face's map of a sharded model's tensors to the files that hold them."""


def read_hf(path: Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """config.json and every tensor of a Hugging Face model directory (model.safetensors, or the shards
    its index names), read once every file opens and the tensors' names and shapes fit the config."""
    hf = read_hf_config(path)
    files, placed = _weight_files(path)
    shapes: dict[str, list[int]] = {}
    holder: dict[str, str] = {}
    for file in files:
        for name, shape in _tensor_shapes(file).items():
            shapes[name], holder[name] = shape, file.name
    for name, file_name in placed.items():
        if holder.get(name) != file_name:
            raise CheckpointError(
                f"{path / file_name}: has no tensor {name}, which {INDEX} places there; fetch it again"
            )
    source = str(path / "config.json")
    _check_weights_fit(hf, config_for_hf(hf, source).model, shapes, source)
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        try:
            with safe_open(str(file), framework="pt", device="cpu") as f:
                tensors.update({key: f.get_tensor(key) for key in f.keys()})
        except (SafetensorError, OSError) as exc:
            raise CheckpointError(_unreadable(file, exc)) from None
    return hf, tensors


def _weight_files(path: Path) -> tuple[list[Path], dict[str, str]]:
    """The safetensors files of a model directory (those its index names, else every *.safetensors
    file) and the index's tensor -> file map (empty without an index)."""
    index = path / INDEX
    if index.is_file():
        try:
            placed = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
            files = sorted({path / name for name in placed.values()})
        except (ValueError, KeyError, TypeError, AttributeError):
            raise CheckpointError(
                f"{index}: not a safetensors index (JSON with a weight_map); fetch it again"
            ) from None
        for file in files:
            if not file.is_file():
                raise CheckpointError(
                    f"{index}: names {file.name}, which is not in {path}; fetch that file (or remove the index "
                    "when one model.safetensors holds every tensor)"
                )
        return files, placed
    files = sorted(path.glob("*.safetensors"))
    if files:
        return files, {}
    if any(path.glob("pytorch_model*.bin")):
        raise CheckpointError(
            f"{path}: has PyTorch .bin weights only; paratron reads safetensors: save the model with "
            "save_pretrained(DIR, safe_serialization=True)"
        )
    raise CheckpointError(f"{path}: no weights (model.safetensors, or {INDEX} and its shards); add the model's weights")


def _tensor_shapes(file: Path) -> dict[str, list[int]]:
    """The names and shapes of a safetensors file's tensors, from its header alone."""
    try:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            return {key: list(f.get_slice(key).get_shape()) for key in f.keys()}
    except (SafetensorError, OSError) as exc:
        raise CheckpointError(_unreadable(file, exc)) from None


def _unreadable(file: Path, error: Exception) -> str:
    """One line on why a weights file cannot be read, and what to do."""
    if isinstance(error, OSError):
        return f"{file}: cannot be read ({error.strerror or error}); check the file and its permissions"
    size = file.stat().st_size
    if size == 0:
        return f"{file}: is empty (0 bytes); copy or download the weights again"
    with open(file, "rb") as f:
        start = f.read(64)
    if start.startswith(b"version https://git-lfs"):
        return f"{file}: is a Git LFS pointer, not the weights; fetch them with git lfs pull (or download the file)"
    reason = str(error).splitlines()[0].removeprefix("Error while deserializing header: ")
    if "incomplete metadata" in reason:
        return f"{file}: is cut short ({size} bytes, fewer than its header lists); copy or download it again"
    return (
        f"{file}: is not a safetensors file ({reason}); download it again, or save the model with "
        "save_pretrained(DIR, safe_serialization=True)"
    )


def _check_weights_fit(hf: dict[str, Any], m: ModelConfig, shapes: dict[str, list[int]], source: str) -> None:
    """Refuse weights whose tensor names or shapes are not those of model `m` (read from `hf`): naming the
    fields config.json leaves out whose transformers defaults shape the weights, if any."""
    kind = hf["model_type"]
    with torch.device("meta"):
        expected = {
            name: list(tensor.shape) for name, tensor in weights_to_hf(dict(GPT(m).named_parameters()), kind).items()
        }
    problem = None
    for name, shape in expected.items():
        if name not in shapes:
            problem = f"the weights have no {name}"
        elif shapes[name] != shape:
            problem = f"{name} is {shapes[name]} in the weights, {shape} by config.json"
        if problem:
            break
    tied_head = "lm_head.weight" if not m.untie_embeddings_and_output_weights else None
    extra = [n for n in shapes if n not in expected and n != tied_head and not _GPT2_IGNORED.search(n)]
    if problem is None and extra:
        problem = f"the weights hold {extra[0]}, which the model of config.json lacks"
    if problem:
        raise CheckpointError(_blame(hf, source, f"the weights do not fit it ({problem})"))


def _blame(hf: dict[str, Any], source: str, problem: str) -> str:
    """One line for a config.json that does not describe its model, naming the fields it leaves out whose
    transformers defaults shape the weights (the likely cause), or else config.json as a whole."""
    kind = hf["model_type"]
    suspects = [name for name in with_defaults(hf, kind)[1] if name in WEIGHT_SHAPING]
    fixed = [name for name in suspects if DEFAULTS[kind][name] is not None]
    suspects = fixed or suspects  # (a derived default, head_dim's say, is to blame only when nothing else is)
    if not suspects:
        return f"{source}: {problem}; correct config.json or give the weights it was saved with"
    many = len(suspects) > 1
    missing = ", ".join(spelled(kind, name) for name in suspects)
    defaults = ", ".join(default_text(kind, name) for name in suspects)
    return (
        f"{source}: has no {missing}, and with transformers' default{'s' * many} for a {kind} model ({defaults}) "
        f"{problem}; add {'them' if many else 'it'}"
    )


def config_for_hf(hf: dict[str, Any], source: str) -> Config:
    """The paratron configuration of a Hugging Face config.json; a model paratron cannot build is
    refused in one line that names the file (and the left-out field to blame, if any)."""
    try:
        return build_config(dict(model_settings(hf, source), mock_data=True))
    except ConfigError as exc:
        raise CheckpointError(_blame(hf, source, f"it describes a model paratron cannot build ({exc})")) from None


def model_from_hf(path: Path, device: torch.device | str = "cpu") -> GPT:
    """A single-device paratron model with a Hugging Face directory's weights, in eval mode."""
    hf, tensors = read_hf(path)
    config = config_for_hf(hf, str(path / "config.json"))
    model = build_model(config.model, device)
    names = [n for n, _ in model.named_parameters()]  # (a tied output weight is the embedding's)
    state = weights_from_hf(tensors, hf["model_type"], config.model, names, str(path))
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(state[name])
    return model.eval()


def hf_to_paratron(source: Path, destination: Path) -> Path:
    """Write a weights-only paratron checkpoint (iteration 0) of a Hugging Face model directory."""
    _refuse_existing(destination)
    hf = read_hf_config(source)
    model = model_from_hf(source)
    config = config_for_hf(hf, str(source / "config.json"))
    # (read first: a bad declaration of its special tokens is refused before anything is written)
    tokenizer = Tokenizer.from_file(source / "tokenizer.json") if (source / "tokenizer.json").is_file() else None
    needed = tensor_bytes(list(model.parameters())) + _file_bytes(source / "tokenizer.json") + FOLDER_SLACK
    with new_folder(CONVERTED, destination, needed, CONVERT_FIX) as tmp:
        folder = save_checkpoint(
            tmp,
            CheckpointContent(
                0,
                0,
                config,
                model,
                tokenizer=tokenizer,
                extra_meta={"weights_only": True, "hf_model_type": hf["model_type"]},
            ),
            what=CONVERTED,
            fix=CONVERT_FIX,
        )
        recipe = {"model": {k: v for k, v in config_to_dict(config)["model"].items() if v is not None}}
        (tmp / "model.yaml").write_text(yaml.safe_dump(recipe, sort_keys=False), encoding="utf-8")
    return destination / folder.name


def paratron_to_hf(source: Path, destination: Path, merge_lora: bool = False) -> Path:
    """Write a Hugging Face directory (config.json, model.safetensors, tokenizer.json if any) of a
    paratron checkpoint's weights; a LoRA checkpoint's adapters are merged into the base weights
    when `merge_lora` is set (without it such a checkpoint is refused)."""
    _refuse_existing(destination)
    info = read_checkpoint(source)
    m = info.config.model
    if m.lora_rank is not None and not merge_lora:
        raise CheckpointError(
            f"{info.path}: holds LoRA adapters; add --merge-lora to write merged weights, or convert with "
            "--to peft DIR to write the adapters alone"
        )
    kind = model_type_of(m, info.hf_model_type)
    needed = _export_bytes(m) + _file_bytes(info.path / "tokenizer.json") + FOLDER_SLACK
    with new_folder(HF_MODEL, destination, needed, CONVERT_FIX) as tmp:
        with weight_catalog(info) as catalog, _ShardWriter(tmp) as writer:
            for names in _layer_groups(m):  # one layer at a time: never the whole model in memory
                state = {name: catalog.whole(name).float() for name in names}  # (config.json says float32)
                if m.lora_rank is not None:
                    state = merge_adapters(state, m.lora_alpha, m.lora_rank)
                for hf_name, tensor in weights_to_hf(state, kind).items():
                    writer.add(hf_name, tensor)
        token_ids = export_tokenizer(info.path, tmp) if (info.path / "tokenizer.json").is_file() else {}
        config = {**hf_config(info.config.model, kind), **token_ids}  # (else transformers assumes its own ids)
        (tmp / "config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")
    return destination


HF_MODEL = "the Hugging Face model"
"""What a full disk's line says the conversion to Hugging Face was writing."""


def _export_bytes(m: ModelConfig) -> int:
    """The bytes of model `m`'s weights in float32, as `paratron_to_hf` writes them (adapters merged)."""
    with torch.device("meta"):
        sizes = [p.numel() for name, p in GPT(m).named_parameters() if not is_adapter(name)]
    return 4 * sum(sizes)


def _file_bytes(path: Path) -> int:
    return path.stat().st_size if path.is_file() else 0


MAX_SHARD_BYTES = 5 * 10**9
"""Hugging Face's usual largest weights file (`save_pretrained`'s max_shard_size="5GB")."""


def _layer_groups(config: ModelConfig) -> list[list[str]]:
    """The single-device parameter names of a model, one list per transformer layer (what one
    exported tensor may combine: fused q/k/v, LoRA adapters), and one per other tensor."""
    with torch.device("meta"):
        names = [name for name, _ in GPT(config).named_parameters()]  # (a tied output weight is the embedding's)
    groups: dict[str, list[str]] = {}
    for name in names:
        layer = re.match(r"layers\.\d+\.", name)
        groups.setdefault(layer.group(0) if layer else name, []).append(name)
    return list(groups.values())


class _ShardWriter:
    """Hugging Face's sharded weights layout, written as tensors arrive: a file each time
    `MAX_SHARD_BYTES` fill up, named model-0000K-of-0000N.safetensors with
    model.safetensors.index.json once N is known (model.safetensors when one file holds all)."""

    def __init__(self, folder: Path) -> None:
        self.folder, self.max_bytes = folder, MAX_SHARD_BYTES
        self.pending: dict[str, torch.Tensor] = {}
        self.size = 0
        self.files: list[list[str]] = []
        self.total = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        nbytes = tensor.numel() * tensor.element_size()
        if self.pending and self.size + nbytes > self.max_bytes:
            self._flush()
        self.pending[name] = tensor.contiguous()
        self.size += nbytes
        self.total += nbytes

    def _flush(self) -> None:
        save_tensors(self.pending, self.folder / f"part-{len(self.files):05d}.safetensors", {"format": "pt"})
        self.files.append(list(self.pending))
        self.pending, self.size = {}, 0

    def __enter__(self) -> _ShardWriter:
        return self

    def __exit__(self, error: object, *_: object) -> None:
        if error is not None:
            return
        if self.pending or not self.files:
            self._flush()
        count = len(self.files)
        if count == 1:
            (self.folder / "part-00000.safetensors").replace(self.folder / "model.safetensors")
            return
        weight_map = {}
        for i, names in enumerate(self.files):
            final = f"model-{i + 1:05d}-of-{count:05d}.safetensors"
            (self.folder / f"part-{i:05d}.safetensors").replace(self.folder / final)
            weight_map.update({name: final for name in names})
        index = {"metadata": {"total_size": self.total}, "weight_map": weight_map}
        (self.folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2), encoding="utf-8")


def _refuse_existing(destination: Path) -> None:
    if destination.exists() and any(destination.iterdir()):
        raise CheckpointError(f"{destination}: already exists and is not empty; choose a new directory")
