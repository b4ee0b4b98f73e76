"""How each Hugging Face family's config.json says what its layers are, both ways: the functions the
rows of `families.FAMILIES` name. Each reads a config.json whose left-out fields already hold
transformers' defaults, and refuses in one line what paratron's layers do not have.
"""

from __future__ import annotations

from typing import Any

from paratron.checkpoint.hf.family import Family, HFConfig, Settings
from paratron.config.schema import ModelConfig
from paratron.errors import CheckpointError

# ---------------------------------------------------------------- rotary families (Llama's layers)


def rotary_settings(hf: HFConfig, family: Family, source: str) -> Settings:
    """paratron model settings of a Llama-style config.json: rotary embeddings, RMSNorm, SwiGLU."""
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
        raise CheckpointError(f"{source}: attention_bias/mlp_bias are not supported for {family.model_type}")
    heads = hf["num_attention_heads"]
    head_dim = hf.get("head_dim") or hf["hidden_size"] // heads
    qkv_bias = hf[family.qkv_bias] if isinstance(family.qkv_bias, str) else family.qkv_bias
    return dict(
        **(family.read_experts(hf, family) if family.read_experts else {}),
        **attention_settings(hf, family, source),
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
        add_qkv_bias=qkv_bias,
        qk_layernorm=family.qk_norm,
        untie_embeddings_and_output_weights=not hf["tie_word_embeddings"],
        hidden_dropout=0.0,
        attention_dropout=hf["attention_dropout"],
    )


def rotary_config(m: ModelConfig, family: Family) -> HFConfig:
    """The entries of a Llama-style config.json for paratron model `m`."""
    config = {
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
        **family.fixed_config,
    }
    if family.write_experts:
        config.update(family.write_experts(m, family))
    return config


# ---------------------------------------------------------------- GPT-2


def gpt2_settings(hf: HFConfig, family: Family, source: str) -> Settings:
    """paratron model settings of a GPT-2 config.json: learned positions, LayerNorm, GELU, biases."""
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


def gpt2_config(m: ModelConfig, family: Family) -> HFConfig:
    """The entries of a GPT-2 config.json for paratron model `m`."""
    return {
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


# ---------------------------------------------------------------- sliding windows


def attention_settings(hf: HFConfig, family: Family, source: str) -> Settings:
    """Full causal attention, or one sliding window on every layer, read as transformers reads the
    family (`Family.read_windows`), unless `layer_types` lists each layer's. Windows on some layers only
    are refused: paratron's layers share one pattern. A window longer than `max_position_embeddings`
    never hides a token of a sequence the model takes: plain causal attention."""
    assert family.read_windows is not None
    window, pattern, full_means_none = family.read_windows(hf)
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
    if full_means_none and types and types[0] == "full_attention":
        window = None
    if window is None or window > hf["max_position_embeddings"]:
        return {"attention_type": "causal"}
    if not window:
        raise CheckpointError(f"{source}: sliding-window layers with sliding_window {window!r}; give the window size")
    return {"attention_type": "sliding-window", "window_size": int(window)}


def every_layer_windows(hf: HFConfig) -> tuple[Any, list[str], bool]:
    """Mistral and Mixtral (and Llama, where it is set): `sliding_window` on every layer."""
    window = hf.get("sliding_window")
    return window, ["full_attention" if window is None else "sliding_attention"] * hf["num_hidden_layers"], False


def every_layer_windows_when_used(hf: HFConfig) -> tuple[Any, list[str], bool]:
    """Qwen3-MoE: `sliding_window` on every layer when `use_sliding_window`."""
    window = hf.get("sliding_window") if hf.get("use_sliding_window") else None
    return window, ["full_attention" if window is None else "sliding_attention"] * hf["num_hidden_layers"], False


def upper_layer_windows(hf: HFConfig) -> tuple[Any, list[str], bool]:
    """Qwen2 and Qwen3: when `use_sliding_window`, the layers from `max_window_layers` on."""
    window = hf["sliding_window"] if hf.get("use_sliding_window") else None
    first, layers = hf["max_window_layers"], hf["num_hidden_layers"]
    types = ["sliding_attention" if window is not None and i >= first else "full_attention" for i in range(layers)]
    return window, types, True


def even_lower_layer_windows(hf: HFConfig) -> tuple[Any, list[str], bool]:
    """Qwen2-MoE: when `use_sliding_window`, the even-numbered layers below `max_window_layers`."""
    use = hf.get("use_sliding_window")
    window = hf["sliding_window"] if use else 0
    below = hf["max_window_layers"]
    layers = range(hf["num_hidden_layers"])
    return window, ["sliding_attention" if use and i % 2 == 0 and i < below else "full_attention" for i in layers], True


def qwen_window_config(window: int | None, layers: int) -> HFConfig:
    """The Qwen families' window entries: each layer's type spelled out."""
    kinds = ["sliding_attention" if window else "full_attention"] * layers
    return dict(use_sliding_window=window is not None, sliding_window=window, max_window_layers=0, layer_types=kinds)


def window_config(window: int | None, layers: int) -> HFConfig:
    """Mistral's (and Llama's, Mixtral's) one window entry."""
    return {"sliding_window": window}


# ---------------------------------------------------------------- mixtures of experts


def mixtral_experts(hf: HFConfig, family: Family) -> Settings:
    """Mixtral: softmax over the top-k router logits, every layer a mixture."""
    return dict(
        num_experts=hf["num_local_experts"],
        moe_router_topk=hf["num_experts_per_tok"],
        moe_ffn_hidden_size=hf["intermediate_size"],
        moe_aux_loss_coeff=hf["router_aux_loss_coef"],
    )


def mixtral_expert_config(m: ModelConfig, family: Family) -> HFConfig:
    return dict(
        num_local_experts=m.num_experts,
        num_experts_per_tok=m.moe_router_topk,
        router_aux_loss_coef=m.moe_aux_loss_coeff,
    )


def qwen_experts(hf: HFConfig, family: Family) -> Settings:
    """Qwen2-MoE and Qwen3-MoE: softmax before the top-k, dense layers where `decoder_sparse_step` and
    `mlp_only_layers` say, and (Qwen2-MoE) a shared expert with a sigmoid gate."""
    step, dense = hf["decoder_sparse_step"] or 1, set(hf["mlp_only_layers"] or [])
    pattern = [int(i not in dense and (i + 1) % step == 0) for i in range(hf["num_hidden_layers"])]
    shared = (hf["shared_expert_intermediate_size"] or None) if family.shared_expert else None
    return dict(
        num_experts=hf[family.experts_field],
        moe_router_topk=hf["num_experts_per_tok"],
        moe_router_pre_softmax=not hf["norm_topk_prob"],
        moe_ffn_hidden_size=hf["moe_intermediate_size"],
        moe_layer_freq="[" + ",".join(map(str, pattern)) + "]",
        moe_shared_expert_intermediate_size=shared,
        moe_shared_expert_gate=shared is not None,
        moe_aux_loss_coeff=hf["router_aux_loss_coef"],
    )


def qwen_expert_config(m: ModelConfig, family: Family) -> HFConfig:
    layers = m.moe_layer_pattern
    config = dict(
        **{family.experts_field: m.num_experts},
        num_experts_per_tok=m.moe_router_topk,
        norm_topk_prob=not m.moe_router_pre_softmax,
        moe_intermediate_size=m.moe_ffn_hidden_size or m.ffn_hidden_size,
        decoder_sparse_step=1,
        mlp_only_layers=[i for i, moe in enumerate(layers) if not moe],
        router_aux_loss_coef=m.moe_aux_loss_coeff,
    )
    if family.shared_expert:
        config["shared_expert_intermediate_size"] = m.moe_shared_expert_intermediate_size or 0
    if isinstance(family.qkv_bias, str):
        config[family.qkv_bias] = True
    return config
