"""The Hugging Face families paratron converts, one `Family` row each, and their weight names.

Llama (grouped-query attention, any rotary theta, tied or untied embeddings), Mistral (the same
layers, with its sliding window), Qwen2 (biases on the query, key and value projections), Qwen3 (a
norm on each head's queries and keys), GPT-2 (learned positions, LayerNorm, tanh GELU, fused QKV
stored as Conv1D, i.e. transposed), the mixtures of experts Mixtral, Qwen2-MoE and Qwen3-MoE, and the
vision-language LLaVA (a CLIP or SigLIP vision tower and a projector before a Llama, Mistral or Qwen2; `llava`).

The names of a Transformer block's layers come from its layer kinds (`LayerKind.checkpoint_names`: attention, MLP,
mixture of experts); the tables here add only where a family's Hub names differ from theirs (GPT-2's, Mixtral's
experts, LLaVA's `language_model.` prefix and its vision tower's CLIP names).
"""

from __future__ import annotations

import re

from paratron.checkpoint.hf import layer_settings, llava
from paratron.checkpoint.hf.family import Family
from paratron.model.layer_kind import LayerKind
from paratron.model.mlp import MLP
from paratron.model.moe import MoELayer
from paratron.model.transformer import Attention, TransformerBlock

# paratron name -> Hugging Face name, per family (layer index as {i}). A Transformer block's layers take their names
# from its kinds' declarations (`LayerKind.checkpoint_names`, Llama's convention); a family whose Hub names differ
# says how here.
_BLOCK_NORMS = {slot: norm for norm, slot in TransformerBlock.residual_slots}
"""Each kind's slot in a Transformer block -> the attribute of the norm in front of it."""
_TOP_LEVEL = {
    "embedding.weight": "model.embed_tokens.weight",
    "final_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def _layer_names(
    kind: type[LayerKind], module: str | None = None, weights: dict[str, str] | None = None
) -> dict[str, str]:
    """paratron name -> Hub name of a block's sublayer of `kind` and the norm in front of it, as the kind declares
    them; `module` and `weights` stand for the kind's Hub module and tensors where a family names them otherwise."""
    names = kind.checkpoint_names
    ours, hub = f"layers.{{i}}.{kind.slot}.", f"model.layers.{{i}}.{module or names.hf_module}."
    table = {f"layers.{{i}}.{_BLOCK_NORMS[kind.slot]}.weight": f"model.layers.{{i}}.{names.hf_norm}.weight"}
    return table | {ours + weight: hub + theirs for weight, theirs in (weights or names.hf_weights).items()}


def _expert_names(module: str, experts: tuple[str, ...]) -> tuple[str, str, str]:
    """The Hub names of one expert's (gate, up, down) weights (layer {i}, expert {e}) below `module`."""
    gate, up, down = (f"model.layers.{{i}}.{module}.{weight}" for weight in experts)
    return gate, up, down


_MOE = MoELayer.checkpoint_names
_LLAMA_NAMES = {**_TOP_LEVEL, **_layer_names(Attention), **_layer_names(MLP)}
_MIXTRAL_NAMES = {  # (its experts under `block_sparse_moe`, its router the `gate`, no shared expert)
    **_TOP_LEVEL,
    **_layer_names(Attention),
    **_layer_names(MoELayer, module="block_sparse_moe", weights={"router.weight": "gate.weight"}),
}
_MIXTRAL_EXPERT = _expert_names(
    "block_sparse_moe", ("experts.{e}.w1.weight", "experts.{e}.w3.weight", "experts.{e}.w2.weight")
)
_QWEN_MOE_NAMES = {**_LLAMA_NAMES, **_layer_names(MoELayer)}  # (its dense layers' MLPs, and the experts)
_QWEN_MOE_EXPERT = _expert_names(_MOE.hf_module, _MOE.hf_experts)
_GPT2_NAMES = {  # (GPT-2 names every layer its own way; its q, k and v are one fused tensor: `Family.fused_qkv`)
    "embedding.weight": "transformer.wte.weight",
    "position_embedding.weight": "transformer.wpe.weight",
    "final_norm.{w}": "transformer.ln_f.{w}",
    "layers.{i}.attention_norm.{w}": "transformer.h.{i}.ln_1.{w}",
    "layers.{i}.attention.out_proj.{w}": "transformer.h.{i}.attn.c_proj.{w}",
    "layers.{i}.mlp_norm.{w}": "transformer.h.{i}.ln_2.{w}",
    "layers.{i}.mlp.in_proj.up.{w}": "transformer.h.{i}.mlp.c_fc.{w}",
    "layers.{i}.mlp.out_proj.{w}": "transformer.h.{i}.mlp.c_proj.{w}",
}

_ROTARY = dict(read_settings=layer_settings.rotary_settings, write_config=layer_settings.rotary_config)
_QWEN = dict(write_windows=layer_settings.qwen_window_config)
_QWEN_MOE = dict(
    read_experts=layer_settings.qwen_experts,
    write_experts=layer_settings.qwen_expert_config,
    weight_names=_QWEN_MOE_NAMES,
    expert_names=_QWEN_MOE_EXPERT,
)

FAMILIES: dict[str, Family] = {
    family.model_type: family
    for family in (
        Family(
            "llama",
            "LlamaForCausalLM",
            "Llama",
            _LLAMA_NAMES,
            **_ROTARY,
            read_windows=layer_settings.every_layer_windows,
            write_windows=layer_settings.window_config,
            fixed_config={"attention_bias": False, "mlp_bias": False},
            peft=True,
        ),
        Family(
            "mistral",
            "MistralForCausalLM",
            "Mistral",
            _LLAMA_NAMES,
            **_ROTARY,
            read_windows=layer_settings.every_layer_windows,
            write_windows=layer_settings.window_config,
            peft=True,
        ),
        Family(
            "qwen2",
            "Qwen2ForCausalLM",
            "Qwen2",
            _LLAMA_NAMES,
            **_ROTARY,
            **_QWEN,
            read_windows=layer_settings.upper_layer_windows,
            qkv_bias=True,
            peft=True,
        ),
        Family(
            "gpt2",
            "GPT2LMHeadModel",
            "GPT-2",
            _GPT2_NAMES,
            read_settings=layer_settings.gpt2_settings,
            write_config=layer_settings.gpt2_config,
            fused_qkv="transformer.h.{i}.attn.c_attn.{w}",
            transposed=re.compile(r"\.(c_attn|c_proj|c_fc)\.weight$"),
        ),
        Family(
            "mixtral",
            "MixtralForCausalLM",
            "Mixtral",
            _MIXTRAL_NAMES,
            **_ROTARY,
            read_windows=layer_settings.every_layer_windows,
            write_windows=layer_settings.window_config,
            read_experts=layer_settings.mixtral_experts,
            write_experts=layer_settings.mixtral_expert_config,
            expert_names=_MIXTRAL_EXPERT,
        ),
        Family(
            "qwen2_moe",
            "Qwen2MoeForCausalLM",
            "Qwen2-MoE",
            **_ROTARY,
            **_QWEN,
            **_QWEN_MOE,
            read_windows=layer_settings.even_lower_layer_windows,
            experts_field="num_experts",
            shared_expert=True,
            qkv_bias="qkv_bias",
        ),
        Family(
            "qwen3",
            "Qwen3ForCausalLM",
            "Qwen3",
            _LLAMA_NAMES,
            **_ROTARY,
            **_QWEN,
            read_windows=layer_settings.upper_layer_windows,
            qk_norm=True,
            fixed_config={"attention_bias": False},
            peft=True,
        ),
        Family(
            "qwen3_moe",
            "Qwen3MoeForCausalLM",
            "Qwen3-MoE",
            **_ROTARY,
            **_QWEN,
            **_QWEN_MOE,
            read_windows=layer_settings.every_layer_windows_when_used,
            qk_norm=True,
            fixed_config={"attention_bias": False},
        ),
        Family(
            "llava",
            "LlavaForConditionalGeneration",
            "LLaVA",
            llava.llava_names(_LLAMA_NAMES),
            read_settings=llava.llava_settings,
            write_config=llava.llava_config,
            text_families=("llama", "mistral", "qwen2"),  # (their weights share Llama's names)
            hub_layouts=llava.LLAVA_LAYOUTS,
        ),
    )
}
"""Every family paratron converts, by config.json's model_type (the order error messages list them in)."""

ARCHITECTURES = {kind: family.architecture for kind, family in FAMILIES.items()}


def _listed(family: Family) -> tuple[bool, bool, bool]:
    return bool(family.text_families), family.read_experts is not None, family.transposed is not None


FAMILY_NAMES = {family.model_type: family.name for family in sorted(FAMILIES.values(), key=_listed)}
"""How the documents and `paratron convert --help` name each model_type of ARCHITECTURES (a test holds
README.md and docs/training.md to this list): dense rotary families first, then GPT-2, then the mixtures, then the
vision-language families."""
PEFT_FAMILIES = tuple(kind for kind, family in FAMILIES.items() if family.peft)
"""The families whose LoRA adapters are written as PEFT adapters."""
