"""Layer kinds and the layer pattern on one process: --hybrid-layer-pattern reads Megatron-LM's symbols and refuses
the kinds paratron does not have by name; a pattern of attention and MLP sublayers computes what the Transformer
blocks compute, bit for bit; the gated attention gates; every kind's tensor-parallel plan names its own children;
the FLOPs count asks the kinds; the inference engine keeps a cache only for the layers that attend and equals the
model's forward."""

from __future__ import annotations

import re

import pytest
import torch

from paratron.checkpoint.hf.settings import hf_config
from paratron.checkpoint.megatron.settings import megatron_args, model_settings
from paratron.config import build_config
from paratron.config.inference import InferenceConfig
from paratron.config.layer_pattern import read_layer_pattern
from paratron.config.layout import resolve_layout
from paratron.config.megatron import ignored_like_megatron
from paratron.config.schema import Config, ModelConfig
from paratron.config.validation import validate
from paratron.errors import CheckpointError, ConfigError
from paratron.inference.loading import engine_for_model
from paratron.inference.params import SamplingParams
from paratron.model.gpt import build_model
from paratron.model.layer_kind import Column, LayerKind, PartialGradient, Random, Row
from paratron.model.mlp import MLP
from paratron.model.moe import MoELayer
from paratron.model.transformer import Attention, GatedAttention, PatternLayer, TransformerBlock
from paratron.planning.memory_prediction import local_parameters
from paratron.training.flops import matmul_parameters, training_flops_per_token

TINY = dict(
    hidden_size=32,
    num_attention_heads=4,
    num_query_groups=2,
    group_query_attention=True,
    vocab_size=64,
    activation="swiglu",
    normalization="RMSNorm",
    position_embedding_type="rope",
    add_bias_linear=False,
    hidden_dropout=0.0,
    attention_dropout=0.0,
    max_position_embeddings=64,
)


def test_the_pattern_reads_megatrons_symbols_and_refuses_missing_kinds_by_name():
    pattern = read_layer_pattern("*-*E|*-")
    assert pattern.symbols == "*-*E*-" and pattern.stage_sizes == (4, 2) and pattern.num_layers == 6
    refusals = {"*M*-": "'M' (Mamba layers)", "G-": "'G' (gated DeltaNet", "+-": "'+' (multi-latent", "D": "'D'"}
    for text, named in refusals.items():
        with pytest.raises(ValueError, match=re.escape(named)):
            read_layer_pattern(text)
    with pytest.raises(ValueError, match="multi-token-prediction"):
        read_layer_pattern("*-/*-")
    with pytest.raises(ValueError, match="'x' is not a layer symbol"):
        read_layer_pattern("*x")
    with pytest.raises(ValueError, match="at least one layer"):
        read_layer_pattern("*-||*-")


def test_the_pattern_sets_the_layers_and_places_the_experts():
    config = ModelConfig(num_layers=7, hybrid_layer_pattern="*-*E", num_experts=4, **TINY)
    assert config.num_layers == 4 and config.moe_layer_pattern == (False, False, False, True)
    model = build_model(config)
    assert [type(layer) for layer in model.layers] == [PatternLayer] * 4
    assert [type(k) for layer in model.layers for k in layer.kinds().values()] == [Attention, MLP, Attention, MoELayer]
    assert "layers.3.norm.weight" in model.state_dict() and "layers.3.mlp.router.weight" in model.state_dict()


def block_weights_as_pattern(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A Transformer-block model's weights under the names of the same model as the pattern `*-` per block."""
    renamed = {}
    for name, value in state.items():
        if not name.startswith("layers."):
            renamed[name] = value
            continue
        _, index, rest = name.split(".", 2)
        second = rest.startswith("mlp")
        rest = rest.replace("attention_norm", "norm").replace("mlp_norm", "norm")
        renamed[f"layers.{2 * int(index) + second}.{rest}"] = value
    return renamed


@pytest.mark.parametrize("extra", [{}, dict(attention_output_gate=True, qk_layernorm=True)])
def test_a_pattern_of_attention_and_mlp_equals_the_transformer_blocks_bit_for_bit(extra):
    blocks = build_model(ModelConfig(num_layers=2, **TINY, **extra)).eval()
    pattern = build_model(ModelConfig(hybrid_layer_pattern="*-*-", **TINY, **extra)).eval()
    pattern.load_state_dict(block_weights_as_pattern(blocks.state_dict()))
    tokens = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(0))
    assert torch.equal(pattern(tokens), blocks(tokens))
    assert all(isinstance(layer, TransformerBlock) for layer in blocks.layers)


def test_the_gated_attention_multiplies_by_a_sigmoid_of_the_input():
    """With a zero gate the output is half the ungated one: sigmoid(0) = 1/2 before the output projection."""
    gated = build_model(ModelConfig(num_layers=1, attention_output_gate=True, **TINY)).eval()
    plain = build_model(ModelConfig(num_layers=1, **TINY)).eval()
    state = {k: v for k, v in gated.state_dict().items() if ".attention.in_proj.gate." not in k}
    plain.load_state_dict(state)
    attention = gated.layers[0].attention
    assert isinstance(attention, GatedAttention) and attention.in_proj["gate"].weight.shape == (32, 32)
    x = torch.randn(2, 8, 32)
    rotary = gated.rotary_tables(torch.arange(8))
    with torch.no_grad():
        attention.in_proj["gate"].weight.zero_()
        assert torch.allclose(attention(x, rotary), 0.5 * plain.layers[0].attention(x, rotary), atol=1e-6)
        attention.in_proj["gate"].weight.normal_()
        assert not torch.allclose(attention(x, rotary), 0.5 * plain.layers[0].attention(x, rotary), atol=1e-3)


def test_every_kind_declares_a_plan_over_its_own_children():
    config = ModelConfig(num_layers=1, num_experts=4, qk_layernorm=True, **TINY)
    kinds = [Attention(config), GatedAttention(config), MLP(config), MoELayer(config)]
    for kind in kinds:
        assert isinstance(kind, LayerKind) and kind.symbol and kind.slot in ("attention", "mlp")
        for name, split in kind.tensor_parallel_plan().items():
            assert isinstance(getattr(kind, name), torch.nn.Module), f"{type(kind).__name__}.{name}"
            assert isinstance(split, (Column, Row, PartialGradient, Random))
    gated_plan = kinds[1].tensor_parallel_plan()["in_proj"]
    assert gated_plan.heads["gate"] == gated_plan.heads["q"] == (8, 4) and gated_plan.heads["k"] == (8, 2)
    assert kinds[0].selective_recompute == ("core",) and kinds[2].selective_recompute == ()


def test_flops_are_the_kinds_sums():
    """The block model's count is Megatron-LM's formula; the same layers as a pattern count the same; the gate adds
    its projection."""
    config = ModelConfig(num_layers=2, **TINY)
    h, heads, groups, d, ffn = 32, 4, 2, 8, config.ffn_hidden_size
    per_layer = h * heads * d * 2 + h * groups * d * 2 + 3 * h * ffn
    assert matmul_parameters(config) == 2 * per_layer + h * 64
    assert training_flops_per_token(config, 16) == 6.0 * (2 * per_layer + h * 64) + 12.0 * 2 * 16 * heads * d
    as_pattern = ModelConfig(hybrid_layer_pattern="*-*-", **TINY)
    assert training_flops_per_token(as_pattern, 16) == training_flops_per_token(config, 16)
    gated = ModelConfig(num_layers=2, attention_output_gate=True, **TINY)
    assert matmul_parameters(gated) == matmul_parameters(config) + 2 * h * heads * d


def checked(run_dir, **settings) -> None:
    validate(build_config(dict(TINY, mock_data=True, seq_length=16, run_dir=str(run_dir), **settings)), 1)


def test_validation_names_what_the_pattern_contradicts(tmp_path):
    checked(tmp_path, hybrid_layer_pattern="*-*E", num_experts=4)
    cases = {
        "'M' (Mamba layers) is not implemented": dict(hybrid_layer_pattern="*M"),
        "has 'E' layers (mixture of experts): give --num-experts": dict(hybrid_layer_pattern="*E"),
        "the pattern places the experts": dict(hybrid_layer_pattern="*-", num_experts=4),
        "has 2 pipeline stages": dict(hybrid_layer_pattern="*-|*-"),
    }
    for message, settings in cases.items():
        with pytest.raises(ConfigError, match=re.escape(message)):
            checked(tmp_path, **settings)
    zero_bubble_v = dict(TINY, mock_data=True, seq_length=16, run_dir=str(tmp_path), global_batch_size=8)
    zero_bubble_v |= dict(hybrid_layer_pattern="*-|*-", pipeline_model_parallel_size=2, pipeline_schedule="zb-v")
    with pytest.raises(ConfigError, match=re.escape("has 2 pipeline stages ('|' between them) but the run has 4")):
        validate(build_config(zero_bubble_v), 2)  # (zb-v runs two chunks per rank)


def test_the_engine_keeps_keys_only_where_a_layer_attends_and_equals_the_forward():
    config = ModelConfig(hybrid_layer_pattern="*-*E-", num_experts=4, attention_output_gate=True, **TINY)
    model = build_model(config).eval()
    engine = engine_for_model(model, None, InferenceConfig(kv_cache_tokens=256, kv_block_size=4))
    held = [i for i, layer in enumerate(engine.runner.cache.layers) if layer is not None]
    assert held == [0, 2]
    prompts = [[3, 9, 27, 17, 51, 25], [8, 1, 5]]
    outputs = engine.generate(prompts, SamplingParams(max_tokens=5, prompt_logprobs=1))
    for prompt, output in zip(prompts, outputs):
        tokens = prompt + output.completions[0].token_ids
        with torch.no_grad():
            logits = model(torch.tensor([tokens]))[0]
        assert output.completions[0].token_ids == logits[len(prompt) - 1 : -1].argmax(-1).tolist()
        reference = torch.log_softmax(logits.float(), dim=-1)
        for i, entry in enumerate(output.prompt_logprobs[1:]):
            assert entry.logprob == pytest.approx(reference[i, prompt[i + 1]].item(), abs=1e-4)


def test_the_pattern_places_the_pipeline_stages_and_num_layers_is_ignored_with_a_warning(tmp_path):
    config = build_config(
        dict(TINY, mock_data=True, seq_length=16, run_dir=str(tmp_path), num_layers=3, global_batch_size=4)
        | dict(hybrid_layer_pattern="*-*E*|-*E", num_experts=4, pipeline_model_parallel_size=2)
    )
    assert resolve_layout(config, 2).pipeline.counts == (5, 3)
    warning = ignored_like_megatron(config, {"num_layers"})["num_layers"]
    assert warning.startswith("--num-layers is ignored under --hybrid-layer-pattern, whose 8 symbols are the layers")
    assert ignored_like_megatron(config, {"hidden_size"}) == {}


@pytest.mark.parametrize("setting", [dict(hybrid_layer_pattern="*-*-"), dict(attention_output_gate=True)])
def test_hugging_face_export_refuses_layers_its_families_lack(setting):
    with pytest.raises(CheckpointError, match="cannot express; keep it as a paratron checkpoint"):
        hf_config(ModelConfig(num_layers=2, **TINY, **setting), "llama")


def test_the_planner_counts_a_patterns_sublayers_as_the_blocks_they_spell():
    pattern = local_parameters(ModelConfig(hybrid_layer_pattern="*-*E", num_experts=4, **TINY), 1, 1, None).layers
    blocks = local_parameters(ModelConfig(num_layers=2, **TINY), 1, 1, None).layers
    assert set(pattern) == {(Attention,), (MLP,), (MoELayer,)}
    assert pattern[(Attention,)] + pattern[(MLP,)] == blocks[(Attention, MLP)]
    assert pattern[(MoELayer,)].experts > 0 == pattern[(MLP,)].experts


def test_megatron_checkpoints_refuse_layer_patterns_both_ways():
    with pytest.raises(CheckpointError, match="Megatron-LM checkpoints are written for Transformer blocks"):
        megatron_args(Config(model=ModelConfig(hybrid_layer_pattern="*-", **TINY)), 1, 1, 64, 1, 0)
    for args in (dict(hybrid_override_pattern="M*-"), dict(attention_output_gate=True)):
        with pytest.raises(CheckpointError, match="is not supported by paratron's GPT layers"):
            model_settings(dict(num_layers=2, hidden_size=32, num_attention_heads=4, **args))
