"""paratron's model against megatron-core 0.16.1's GPTModel (built on CPU by tests/megatron_oracle.py).

Logits parity: megatron's weights copied into paratron's model give the same logits (fp32, 1e-5) for a
tiny GPT, a tiny Llama and each Megatron-LM model flag paratron implements (--apply-layernorm-1p,
--rotary-percent, --rotary-interleaved, --qk-layernorm, --apply-query-key-layer-scaling,
--attention-softmax-in-fp32, --position-embedding-type none). Parameter shapes: Megatron-LM's
functional-test model configurations, shrunk, parsed by paratron's CLI, against GPTModel.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from paratron.config.schema import ModelConfig
from paratron.model.attention import AttentionCore, Causal
from paratron.model.gpt import GPT

pytest.importorskip("megatron.core")

from megatron_oracle import cpu_megatron, destroy_oracle, oracle_gpt, oracle_logits  # noqa: E402

VOCAB, SEQ, HIDDEN, HEADS = 64, 16, 32, 4


@pytest.fixture(scope="module")
def megatron() -> Iterator[None]:
    with cpu_megatron():
        yield
    destroy_oracle(destroy_process_group=True)  # (later tests build their own worlds)


# ---------------------------------------------------------------- megatron names and layouts -> paratron's


def megatron_to_paratron(params: dict[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
    """megatron-core GPTModel parameters (TP 1) under paratron's names: linear_qkv holds, per query
    group, that group's query heads then its key head then its value head; linear_fc1 of a gated MLP
    stacks [gate; up]."""
    heads, groups = config.num_attention_heads, config.num_query_groups
    head_dim = config.kv_channels
    per_group = heads // groups
    renames = {
        "embedding.word_embeddings.": "embedding.",
        "embedding.position_embeddings.": "position_embedding.",
        "decoder.final_layernorm.": "final_norm.",
        "output_layer.": "output.",
        "input_layernorm.": "attention_norm.",
        "pre_mlp_layernorm.": "mlp_norm.",
        "self_attention.linear_proj.": "attention.out_proj.",
        "self_attention.q_layernorm.": "attention.q_norm.",
        "self_attention.k_layernorm.": "attention.k_norm.",
        "mlp.linear_fc2.": "mlp.out_proj.",
    }
    out: dict[str, torch.Tensor] = {}
    for name, tensor in params.items():
        name = name.replace("decoder.layers.", "layers.")
        leaf = name.rsplit(".", 1)[1]
        if "self_attention.linear_qkv." in name:
            prefix = name.split("self_attention.")[0] + "attention.in_proj."
            grouped = tensor.reshape(groups, per_group + 2, head_dim, -1)
            pieces = {"q": grouped[:, :per_group], "k": grouped[:, per_group], "v": grouped[:, per_group + 1]}
            for part, piece in pieces.items():
                out[f"{prefix}{part}.{leaf}"] = piece.reshape(-1, *tensor.shape[1:])
            continue
        if "mlp.linear_fc1." in name:
            prefix = name.split("mlp.")[0] + "mlp.in_proj."
            if config.activation == "swiglu":
                gate, up = tensor.chunk(2, dim=0)
                out[f"{prefix}gate.{leaf}"], out[f"{prefix}up.{leaf}"] = gate, up
            else:
                out[f"{prefix}up.{leaf}"] = tensor
            continue
        for old, new in renames.items():
            name = name.replace(old, new)
        out[name] = tensor
    return out


# ---------------------------------------------------------------- the same model in both


def megatron_kwargs(config: ModelConfig) -> dict[str, Any]:
    """oracle_gpt keywords for a paratron ModelConfig (GELU: the exact one, or the tanh form with
    --openai-gelu, as in Megatron-LM)."""
    from megatron.core.activations import squared_relu  # start-up speed: megatron is heavy
    from megatron.core.transformer.utils import openai_gelu

    swiglu = config.activation == "swiglu"
    ungated = squared_relu if config.activation == "squared_relu" else openai_gelu if config.openai_gelu else F.gelu
    return dict(
        num_layers=config.num_layers,
        hidden_size=config.hidden_size,
        num_attention_heads=config.num_attention_heads,
        num_query_groups=config.num_query_groups,
        kv_channels=config.kv_channels,
        ffn_hidden_size=config.ffn_hidden_size,
        vocab_size=config.vocab_size,
        max_sequence_length=config.max_position_embeddings,
        position_embedding_type=config.position_embedding_type,
        rotary_percent=config.rotary_percent,
        rotary_base=int(config.rotary_base),
        rotary_interleaved=config.rotary_interleaved,
        normalization=config.normalization,
        layernorm_epsilon=config.norm_epsilon,
        layernorm_zero_centered_gamma=config.apply_layernorm_1p,
        qk_layernorm=config.qk_layernorm,
        add_bias_linear=config.add_bias_linear,
        add_qkv_bias=config.add_qkv_bias,
        gated_linear_unit=swiglu,
        activation_func=F.silu if swiglu else ungated,
        apply_query_key_layer_scaling=config.apply_query_key_layer_scaling,
        attention_softmax_in_fp32=config.attention_softmax_in_fp32,
        share_embeddings_and_output_weights=not config.untie_embeddings_and_output_weights,
    )


GPT_TINY = ModelConfig(
    num_layers=2,
    hidden_size=HIDDEN,
    num_attention_heads=HEADS,
    vocab_size=VOCAB,
    max_position_embeddings=SEQ,
    hidden_dropout=0.0,
    attention_dropout=0.0,
)
LLAMA_TINY = dataclasses.replace(
    GPT_TINY,
    position_embedding_type="rope",
    normalization="RMSNorm",
    activation="swiglu",
    add_bias_linear=False,
    untie_embeddings_and_output_weights=True,
    group_query_attention=True,
    num_query_groups=2,
    ffn_hidden_size=48,
)
ROPE_GPT = dataclasses.replace(GPT_TINY, position_embedding_type="rope")
FEATURES: dict[str, ModelConfig] = {
    "gpt": GPT_TINY,
    "llama": LLAMA_TINY,
    "layernorm_1p": dataclasses.replace(GPT_TINY, apply_layernorm_1p=True),
    "rotary_percent": dataclasses.replace(ROPE_GPT, rotary_percent=0.5),
    "rotary_interleaved": dataclasses.replace(LLAMA_TINY, rotary_interleaved=True),
    "rotary_percent_interleaved": dataclasses.replace(ROPE_GPT, rotary_percent=0.5, rotary_interleaved=True),
    "qk_layernorm": dataclasses.replace(LLAMA_TINY, qk_layernorm=True),
    "qk_layernorm_1p": dataclasses.replace(ROPE_GPT, qk_layernorm=True, apply_layernorm_1p=True),
    "query_key_layer_scaling": dataclasses.replace(LLAMA_TINY, apply_query_key_layer_scaling=True),
    "softmax_in_fp32": dataclasses.replace(GPT_TINY, attention_softmax_in_fp32=True),
    "no_position_embedding": dataclasses.replace(GPT_TINY, position_embedding_type="none"),
    "squared_relu": dataclasses.replace(  # Nemotron-4's layers
        ROPE_GPT, activation="squared_relu", apply_layernorm_1p=True, rotary_percent=0.5, add_bias_linear=False
    ),
}
MEASURED: dict[str, float] = {}


def paratron_from_megatron(config: ModelConfig) -> tuple[torch.nn.Module, GPT]:
    """megatron's GPTModel for `config` (every weight nudged off its initial value, so that unit norms and
    zero biases cannot hide a mapping error) and paratron's model holding the same weights."""
    oracle, _ = oracle_gpt(**megatron_kwargs(config))
    generator = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for param in oracle.parameters():
            param.add_(0.1 * torch.randn(param.shape, generator=generator))
    ours = GPT(config).eval()
    state = megatron_to_paratron(dict(oracle.named_parameters()), config)
    missing, unexpected = ours.load_state_dict(state, strict=False)
    assert not unexpected
    assert set(missing) <= ({"output.weight"} if ours.tied else set())
    return oracle, ours


COMPILED = {"squared_relu"}
"""Features whose Megatron-LM oracle runs a `torch.compile`d activation: inductor starts the compiler (a process)."""


@pytest.mark.parametrize(
    "feature", [pytest.param(f, marks=pytest.mark.spawns) if f in COMPILED else f for f in FEATURES]
)
def test_logits_equal_megatron(megatron: None, feature: str) -> None:
    config = FEATURES[feature]
    oracle, ours = paratron_from_megatron(config)
    tokens = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(3))
    expected = oracle_logits(oracle, tokens)
    with torch.no_grad():
        got = ours(tokens)
    difference = (got - expected).abs().max().item()
    MEASURED[feature] = difference
    print(f"{feature}: max |logit difference| {difference:.2e}")
    assert expected.abs().max() > 0.1  # (the logits are not trivially small)
    assert difference < 1e-5


def test_layernorm_1p_starts_as_plain_norm() -> None:
    """Zero-centred gamma starts at 0 and applies 1 + w: the initial model equals the plain one."""
    from paratron.model.gpt import build_model

    tokens = torch.randint(0, VOCAB, (1, SEQ), generator=torch.Generator().manual_seed(1))
    plain = build_model(GPT_TINY, seed=3).eval()
    one_p = build_model(dataclasses.replace(GPT_TINY, apply_layernorm_1p=True), seed=3).eval()
    assert all(p.abs().max() == 0 for n, p in one_p.named_parameters() if n.endswith("norm.weight"))
    with torch.no_grad():
        torch.testing.assert_close(one_p(tokens), plain(tokens), rtol=0, atol=0)


# ---------------------------------------------------------------- fp16/bf16 attention numerics


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_unfused_attention_equals_megatron_in_half_precision(megatron: None, dtype: torch.dtype) -> None:
    """--apply-query-key-layer-scaling (layer 3) with the fp32 softmax: paratron's attention core gives
    megatron's DotProductAttention's numbers in fp16/bf16 (grouped-query heads included)."""
    from megatron.core.transformer import TransformerConfig  # start-up speed: megatron is heavy
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    layer, heads, groups, head_dim, batch = 3, 4, 2, 8, 2
    config = TransformerConfig(
        num_layers=4,
        hidden_size=heads * head_dim,
        num_attention_heads=heads,
        num_query_groups=groups,
        apply_query_key_layer_scaling=True,
        attention_dropout=0.0,
        masked_softmax_fusion=False,
        fp16=dtype == torch.float16,
        bf16=dtype == torch.bfloat16,
        params_dtype=dtype,
        use_cpu_initialization=True,
    )
    theirs = DotProductAttention(config, layer_number=layer, attn_mask_type=AttnMaskType.causal, attention_type="self")
    generator = torch.Generator().manual_seed(11)
    q, k, v = (
        torch.randn(batch, n, SEQ, head_dim, generator=generator).mul(4).to(dtype) for n in (heads, groups, groups)
    )
    mask = torch.triu(torch.ones(1, 1, SEQ, SEQ, dtype=torch.bool), diagonal=1)
    as_sbhd = lambda t: t.permute(2, 0, 1, 3).contiguous()  # noqa: E731
    expected = theirs(as_sbhd(q), as_sbhd(k), as_sbhd(v), mask).view(SEQ, batch, heads, head_dim).permute(1, 2, 0, 3)
    ours = AttentionCore(Causal(), 0.0, layer_scaling=layer)
    got = ours(q, k, v)
    assert got.dtype == dtype
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    plain = AttentionCore(Causal(), 0.0)(q.float(), k.float(), v.float())
    assert (got.float() - plain).abs().max() < 0.05 * plain.abs().max()  # (the same attention, rounded)


# ---------------------------------------------------------------- parameter shapes of Megatron-LM's test models

COMMON = "--num-layers 2 --max-position-embeddings 32 --vocab-size 1000"
MEGATRON_TEST_MODELS: dict[str, str] = {
    # Megatron-LM's functional-test MODEL_ARGS (tests/functional_tests/test_cases/gpt/*), sizes shrunk.
    "gpt3_mcore_te_tp2_pp1": "--hidden-size 64 --num-attention-heads 8 --tensor-model-parallel-size 2",
    "gpt3_mcore_te_tp1_pp4_disable_bias_linear": "--hidden-size 64 --num-attention-heads 8 --disable-bias-linear",
    "gpt3_mcore_te_tp1_pp4_swiglu": "--hidden-size 80 --num-attention-heads 8 --swiglu --attention-softmax-in-fp32",
    "gpt3_mcore_te_tp1_pp4_untie_embeddings_and_outputs": "--hidden-size 64 --num-attention-heads 8 "
    "--untie-embeddings-and-output-weights",
    "gpt3_mcore_te_tp1_pp2_rope_embeddings_interleaved_no_fusion": "--hidden-size 64 --num-attention-heads 8 "
    "--position-embedding-type rope --rotary-interleaved",
    "gpt3_mcore_te_tp4_pp1_qk_layernorm_test_mode": "--hidden-size 64 --num-attention-heads 8 --qk-layernorm "
    "--tensor-model-parallel-size 4",
    "gpt3_mcore_tp2_pp2_uninstall_te": "--hidden-size 64 --num-attention-heads 8 --apply-query-key-layer-scaling "
    "--tensor-model-parallel-size 2 --make-vocab-size-divisible-by 64",
    "gpt3_weekly_dgx_h100_mcore_tp2_pp2_fp8_tp_pp": "--hidden-size 64 --num-attention-heads 8 --normalization RMSNorm "
    "--tensor-model-parallel-size 2",
    "gpt3_mcore_reruns_disable": "--hidden-size 64 --num-attention-heads 8 --kv-channels 16 --ffn-hidden-size 96 "
    "--group-query-attention --num-query-groups 2 --normalization RMSNorm --position-embedding-type rope "
    "--rotary-percent 1.0 --swiglu --disable-bias-linear --untie-embeddings-and-output-weights",
    "gpt3_mcore_te_tp2_pp1_modelopt_distill_resume": "--hidden-size 96 --num-attention-heads 8 --normalization RMSNorm "
    "--position-embedding-type rope --rotary-percent 0.5 --swiglu --disable-bias-linear "
    "--untie-embeddings-and-output-weights --tensor-model-parallel-size 2",
    "gpt3_15b_8t_release": "--hidden-size 96 --num-attention-heads 12 --group-query-attention --num-query-groups 4 "
    "--squared-relu --apply-layernorm-1p --position-embedding-type rope --rotary-percent 0.5 --disable-bias-linear "
    "--untie-embeddings-and-output-weights --tensor-model-parallel-size 8 --make-vocab-size-divisible-by 16",
    "gpt3_7b_tp4_pp1_memory_speed": "--hidden-size 64 --num-attention-heads 8 --group-query-attention "
    "--untie-embeddings-and-output-weights --tensor-model-parallel-size 4",
    # (--use-rotary-position-embeddings left out: Megatron-LM's deprecated spelling of the rope type.)
    "gpt_grpo_tp4_pp1_dp2_8b_throughput": "--hidden-size 64 --num-attention-heads 8 --kv-channels 16 "
    "--ffn-hidden-size 192 --group-query-attention --num-query-groups 2 --normalization RMSNorm --norm-epsilon 1e-6 "
    "--position-embedding-type rope --qk-layernorm --rotary-base 1000000 --swiglu --disable-bias-linear "
    "--untie-embeddings-and-output-weights --tensor-model-parallel-size 4 --make-vocab-size-divisible-by 128",
}


def flag_values(argv: list[str]) -> dict[str, Any]:
    """{'hidden-size': '64', 'swiglu': True, ...} from a flag list."""
    values: dict[str, Any] = {}
    for i, token in enumerate(argv):
        if token.startswith("--"):
            following = argv[i + 1] if i + 1 < len(argv) else "--"
            values[token[2:]] = True if following.startswith("--") else following
    return values


def megatron_model_from_flags(argv: list[str]) -> tuple[dict[str, Any], int]:
    """oracle_gpt keywords for Megatron-LM flags, as Megatron-LM's training scripts derive them
    (megatron/training/arguments.py: --swiglu's default width, --group-query-attention's groups;
    tokenizer.py: the vocabulary padded to a multiple of --make-vocab-size-divisible-by x TP);
    and the tensor-parallel size."""
    from megatron.core.activations import squared_relu  # start-up speed: megatron is heavy

    flags = flag_values(argv)
    hidden = int(flags["hidden-size"])
    tp = int(flags.get("tensor-model-parallel-size", 1))
    multiple = int(flags.get("make-vocab-size-divisible-by", 128)) * tp
    swiglu = "swiglu" in flags
    ffn = flags.get("ffn-hidden-size")
    kwargs: dict[str, Any] = dict(
        num_layers=int(flags["num-layers"]),
        hidden_size=hidden,
        num_attention_heads=int(flags["num-attention-heads"]),
        num_query_groups=int(flags.get("num-query-groups", 1)) if "group-query-attention" in flags else None,
        kv_channels=int(flags["kv-channels"]) if "kv-channels" in flags else None,
        ffn_hidden_size=int(ffn) if ffn else (int(4 * hidden * 2 / 3 / 64) * 64 if swiglu else 4 * hidden),
        vocab_size=-(-int(flags["vocab-size"]) // multiple) * multiple,
        max_sequence_length=int(flags["max-position-embeddings"]),
        position_embedding_type=flags.get("position-embedding-type", "learned_absolute"),
        rotary_percent=float(flags.get("rotary-percent", 1.0)),
        rotary_interleaved="rotary-interleaved" in flags,
        rotary_base=int(float(flags.get("rotary-base", 10000))),
        normalization=flags.get("normalization", "LayerNorm"),
        layernorm_epsilon=float(flags.get("norm-epsilon", 1e-5)),
        layernorm_zero_centered_gamma="apply-layernorm-1p" in flags,
        qk_layernorm="qk-layernorm" in flags,
        add_bias_linear="disable-bias-linear" not in flags,
        gated_linear_unit=swiglu,
        activation_func=F.silu if swiglu else squared_relu if "squared-relu" in flags else F.gelu,
        apply_query_key_layer_scaling="apply-query-key-layer-scaling" in flags,
        attention_softmax_in_fp32="attention-softmax-in-fp32" in flags,
        share_embeddings_and_output_weights="untie-embeddings-and-output-weights" not in flags,
    )
    return kwargs, tp


def paratron_config_from_flags(argv: list[str]) -> Any:
    """paratron's whole Config from the same flags, through its CLI parser."""
    from paratron.commands.train import parser as train_parser
    from paratron.config.arguments import parse_config_arguments
    from paratron.config.loading import build_config

    recipe, overrides, _ = parse_config_arguments(train_parser(), argv)
    return build_config(overrides, recipe)


@pytest.mark.parametrize("name", list(MEGATRON_TEST_MODELS))
def test_parameter_shapes_equal_megatron(megatron: None, name: str) -> None:
    from paratron.parallel.tensor.layers import padded_vocab_size

    argv = f"{COMMON} {MEGATRON_TEST_MODELS[name]}".split()
    config = paratron_config_from_flags(argv)
    model_config = config.model
    kwargs, tp = megatron_model_from_flags(argv)
    oracle, _ = oracle_gpt(**kwargs)
    theirs = {n: tuple(t.shape) for n, t in megatron_to_paratron(dict(oracle.named_parameters()), model_config).items()}
    with torch.device("meta"):
        model = GPT(model_config)
    ours = {n: tuple(p.shape) for n, p in model.named_parameters()}
    # paratron pads the vocabulary inside its vocabulary-parallel layers, Megatron-LM in the tokenizer, both to a
    # multiple of --make-vocab-size-divisible-by x TP at every TP size (one rank included):
    padded = padded_vocab_size(model_config.vocab_size, tp, model_config.make_vocab_size_divisible_by)
    for vocab_matrix in ("embedding.weight", "output.weight"):
        if vocab_matrix in ours:
            ours[vocab_matrix] = (padded, *ours[vocab_matrix][1:])
    assert ours == theirs


def test_query_key_layer_scaling_uses_megatrons_layer_numbers() -> None:
    """Layer i (from 1, as Megatron-LM counts) divides its scores by i; without the flag, fused attention."""
    scaled = GPT(dataclasses.replace(GPT_TINY, num_layers=3, apply_query_key_layer_scaling=True))
    assert [block.attention.core.layer_scaling for block in scaled.layers] == [1, 2, 3]
    assert all(block.attention.core.layer_scaling is None for block in GPT(GPT_TINY).layers)


def test_fused_attention_softmax_is_as_accurate_as_an_fp32_softmax() -> None:
    """Why --attention-softmax-in-fp32 changes nothing: in bf16 paratron's fused attention is at least as close
    to fp32 attention as Megatron-LM's unfused attention with its fp32 softmax."""
    from paratron.model.attention import attend_unfused

    generator = torch.Generator().manual_seed(2)
    q, k, v = (3 * torch.randn(2, 4, 64, 16, generator=generator) for _ in range(3))
    exact = AttentionCore(Causal(), 0.0)(q, k, v)
    half = [t.to(torch.bfloat16) for t in (q, k, v)]
    fused_error = (AttentionCore(Causal(), 0.0)(*half).float() - exact).abs().max()
    unfused_error = (attend_unfused(Causal(), *half, None).float() - exact).abs().max()
    assert 0 < fused_error <= unfused_error


@pytest.mark.parametrize("feature", FEATURES)
def test_production_megatron_mapping_agrees(megatron: None, feature: str) -> None:
    """paratron.checkpoint.megatron.to_paratron maps megatron-core's real GPTModel as this test's mapping does."""
    converter = pytest.importorskip("paratron.checkpoint.megatron")
    config = FEATURES[feature]
    oracle, _ = oracle_gpt(**megatron_kwargs(config))
    params = {n: p.detach() for n, p in oracle.named_parameters()}
    expected = megatron_to_paratron(params, config)
    got = converter.to_paratron(params, config, "test")
    assert sorted(got) == sorted(expected)
    for name, tensor in expected.items():
        assert torch.equal(got[name], tensor), name


@pytest.mark.parametrize("feature", ["layernorm_1p", "rotary_percent", "rotary_interleaved", "no_position_embedding"])
def test_hugging_face_export_refuses_what_it_cannot_express(feature: str) -> None:
    from paratron.checkpoint.hf import model_type_of
    from paratron.errors import CheckpointError

    with pytest.raises(CheckpointError, match="cannot express"):
        model_type_of(FEATURES[feature])
