"""Multi-latent attention (--multi-latent-attention, `model/mla.py`) and YaRN's rotary tables against transformers'
DeepSeek-V3 (its weights copied by the kind's checkpoint names), its settings' checks, its planner terms and a tiny
model that trains from the command line's settings."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import DeepseekV3Config
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention, DeepseekV3RotaryEmbedding

from paratron.config import build_config, validate
from paratron.config.schema import ModelConfig
from paratron.errors import ConfigError
from paratron.inference.loading import _engine
from paratron.model.gpt import GPT, build_model
from paratron.model.mla import MultiLatentAttention
from paratron.model.rotary import rotary_tables
from paratron.planning import hardware as hw
from paratron.planning.activations import CUDA
from paratron.planning.cost import predict_step
from paratron.planning.memory_prediction import predict_memory

from tiny import QUIET, no_loss_plot, training_records

HEADS, HIDDEN, SEQ = 4, 32, 24
YARN = dict(rope_type="yarn", rotary_scaling_factor=4.0, original_max_position_embeddings=8, mscale=0.9)
YARN_HF = dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=8, beta_fast=32, beta_slow=1, mscale=0.9)


def configs(q_lora_rank: int | None, yarn: bool) -> tuple[ModelConfig, DeepseekV3Config]:
    """The same tiny attention for paratron and transformers (the latent norms on and the rotary pairs interleaved,
    as DeepSeek's)."""
    ours = ModelConfig(
        multi_latent_attention=True,
        hidden_size=HIDDEN,
        num_attention_heads=HEADS,
        q_lora_rank=q_lora_rank,
        kv_lora_rank=12,
        qk_head_dim=8,
        qk_pos_emb_head_dim=8,
        v_head_dim=6,
        qk_layernorm=True,
        normalization="RMSNorm",
        norm_epsilon=1e-6,
        position_embedding_type="rope",
        add_bias_linear=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        max_position_embeddings=64,
        **(dict(YARN, mscale_all_dim=0.7) if yarn else dict(rope_type="rope")),
    )
    rope = dict(YARN_HF, mscale_all_dim=0.7) if yarn else dict(rope_type="default")
    theirs = DeepseekV3Config(
        hidden_size=HIDDEN,
        num_attention_heads=HEADS,
        num_key_value_heads=HEADS,
        q_lora_rank=q_lora_rank,
        kv_lora_rank=12,
        qk_nope_head_dim=8,
        qk_rope_head_dim=8,
        v_head_dim=6,
        max_position_embeddings=64,
        rope_interleave=True,
        rope_parameters=dict(rope, rope_theta=10000.0),
        attention_bias=False,
    )
    theirs._attn_implementation = "eager"
    return ours, theirs


def copy_weights(ours: MultiLatentAttention, theirs: torch.nn.Module) -> None:
    """Theirs take our weights by the names the kind declares for Hugging Face checkpoints."""
    declared = ours.checkpoint_names.hf_weights.items()
    names = {k.replace("{w}", "weight"): v.replace("{w}", "weight") for k, v in declared}
    hub = theirs.state_dict()
    with torch.no_grad():
        for name, tensor in ours.state_dict().items():
            hub[names[name]].copy_(tensor)
    assert set(names[name] for name in ours.state_dict()) == set(hub)


@pytest.mark.parametrize(
    "q_lora_rank, yarn",
    [(16, False), (None, False), (16, True), (None, True)],
    ids=["q-latent", "q-full", "q-latent-yarn", "q-full-yarn"],
)
def test_the_layer_equals_transformers_deepseek_v3_attention(q_lora_rank, yarn):
    torch.manual_seed(0)
    ours_config, theirs_config = configs(q_lora_rank, yarn)
    ours = MultiLatentAttention(ours_config).eval()
    for name, param in ours.named_parameters():
        torch.nn.init.normal_(param, 1.0 if "norm" in name else 0.0, 0.3 if "norm" in name else 0.2)
    theirs = DeepseekV3Attention(theirs_config, layer_idx=0).eval()
    copy_weights(ours, theirs)
    x = torch.randn(2, SEQ, HIDDEN)
    positions = torch.arange(SEQ)
    causal = torch.full((SEQ, SEQ), float("-inf")).triu(1)[None, None]
    tables = DeepseekV3RotaryEmbedding(theirs_config)(x, positions[None])
    expected, _ = theirs(x, tables, causal)
    got = ours(x, rotary_tables(ours_config, positions))
    assert got.shape == (2, SEQ, HIDDEN)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    if yarn:  # (the scale reaches the scores: leaving it out parts the outputs)
        ours.query_scale = 1.0
        assert not torch.allclose(ours(x, rotary_tables(ours_config, positions)), expected, atol=1e-3)


@pytest.mark.parametrize("yarn", [False, True])
def test_the_rotary_tables_equal_transformers(yarn):
    ours_config, theirs_config = configs(16, yarn)
    positions = torch.arange(40)  # (beyond YaRN's original context of 8)
    cos, sin = DeepseekV3RotaryEmbedding(theirs_config)(torch.zeros(1), positions[None])
    ours_cos, ours_sin = rotary_tables(ours_config, positions)
    for pair in (0, 1):  # (ours laid out by interleaved pairs, theirs by halves: the same angle per pair)
        torch.testing.assert_close(ours_cos[:, pair::2], cos[0, :, :4], rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(ours_sin[:, pair::2], sin[0, :, :4], rtol=1e-6, atol=1e-6)
    if yarn:  # (YaRN's tables are not the plain ones: some frequencies divided, all scaled)
        plain, _ = rotary_tables(ours_config.with_changes(rope_type="rope", **_YARN_DEFAULTS), positions)
        assert not torch.allclose(plain, ours_cos, atol=1e-3)


_YARN_DEFAULTS = dict(rotary_scaling_factor=1.0, original_max_position_embeddings=4096, mscale=1.0, mscale_all_dim=0.0)


def test_the_plain_rotary_tables_of_other_models_are_unchanged():
    config = ModelConfig(position_embedding_type="rope", hidden_size=32, num_attention_heads=4, rotary_percent=0.5)
    positions = torch.arange(16)
    cos, sin = rotary_tables(config, positions)
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, 4, 2, dtype=torch.float32) / 4))
    angles = positions.float()[:, None] * inv_freq
    angles = torch.cat((angles, angles), -1)
    assert torch.equal(cos, angles.cos()) and torch.equal(sin, angles.sin())


MODEL = dict(
    multi_latent_attention=True,
    q_lora_rank=16,
    kv_lora_rank=12,
    qk_head_dim=8,
    qk_pos_emb_head_dim=4,
    v_head_dim=8,
    qk_layernorm=True,
    position_embedding_type="rope",
    normalization="RMSNorm",
    activation="swiglu",
    add_bias_linear=False,
    hidden_size=32,
    num_attention_heads=4,
    ffn_hidden_size=64,
    num_layers=2,
    vocab_size=128,
    max_position_embeddings=64,
    hidden_dropout=0.0,
    attention_dropout=0.0,
    **YARN,
)


def test_a_tiny_model_with_it_trains_from_the_command_lines_settings(tmp_path):
    settings = dict(MODEL, **QUIET, mock_data=True, seq_length=32, micro_batch_size=2, global_batch_size=2)
    settings |= dict(train_iters=8, lr=3e-3, run_dir=str(tmp_path))
    config = build_config(settings)
    assert config.model.rope_type == "yarn" and "rope_type" not in config.model.derived
    model = build_model(config.model)
    assert all(isinstance(layer.attention, MultiLatentAttention) for layer in model.layers)
    with no_loss_plot():
        records = training_records(settings)
    assert len(records) == 8 and records[-1]["loss"] < records[0]["loss"]


def test_packed_documents_stay_apart():
    """Tokens of a second packed document attend as if it were alone in its row (positions restarting)."""
    torch.manual_seed(1)
    model = build_model(ModelConfig(**MODEL)).eval()
    first, second = torch.randint(0, 128, (1, 10)), torch.randint(0, 128, (1, 6))
    packed = torch.cat((first, second), 1)
    segments = torch.tensor([[0] * 10 + [1] * 6])
    positions = torch.cat((torch.arange(10), torch.arange(6)))[None]
    with torch.no_grad():
        together = model(packed, position_ids=positions, segment_ids=segments)
        alone = model(second)
    torch.testing.assert_close(together[:, 10:], alone, rtol=1e-5, atol=1e-5)


def test_the_planner_counts_its_weights_and_prices_it():
    config = ModelConfig(**MODEL)
    with torch.device("meta"):
        model = GPT(config)
    attention = model.layers[0].attention
    matmuls = sum(p.numel() for name, p in attention.named_parameters() if "norm" not in name)
    down, up = 32 * 16 + 32 * (12 + 4), 16 * 4 * (8 + 4) + 12 * 4 * (8 + 8)
    assert MultiLatentAttention.matmul_weights(config) == matmuls == down + up + 4 * 8 * 32
    assert MultiLatentAttention.attention_width(config) == 4 * (8 + 4 + 8) // 2
    for tp, sp in ((1, False), (2, True)):  # (the plan, --dry-run and MFU price it: more latent, more memory)
        small, large = (
            build_config(dict(MODEL, kv_lora_rank=rank, tensor_model_parallel_size=tp, sequence_parallel=sp))
            for rank in (12, 64)
        )
        layouts = [validate(c, 2, check_data=False) for c in (small, large)]
        memory = [predict_memory(c, 2, CUDA, layout)[0].activations for c, layout in zip((small, large), layouts)]
        assert 0 < memory[0] < memory[1]
        assert predict_step(small, layouts[0], hw.PRESETS["h100-80g"]).total > 0


def test_its_settings_are_checked_in_one_line():
    def refused(**values) -> str:
        with pytest.raises(ConfigError) as error:
            validate(build_config(dict(MODEL, mock_data=True, seq_length=32, **values)), 2, check_data=False)
        return str(error.value)

    assert refused(rotary_scaling_factor=1.0) == (
        "--rope-type yarn needs --rotary-scaling-factor above 1 (at 1 it stretches nothing; DeepSeek-V3's is 40); "
        "set it or use --rope-type rope"
    )
    assert refused(group_query_attention=True, num_query_groups=2).startswith(
        "--multi-latent-attention needs no --group-query-attention / --num-query-groups"
    )
    assert refused(position_embedding_type="learned_absolute") == (
        "--multi-latent-attention needs --position-embedding-type rope (its rotary parts need it)"
    )
    assert refused(context_parallel_size=2) == (
        "--context-parallel-size 2 does not serve --multi-latent-attention yet; use tensor or pipeline parallelism "
        "for now"
    )
    assert refused(tensor_model_parallel_size=2, num_attention_heads=3).startswith(
        "--num-attention-heads 3 is not divisible by --tensor-model-parallel-size 2"
    )
    plain = dict(multi_latent_attention=False, rope_type="rope", **_YARN_DEFAULTS)
    assert refused(**plain, q_lora_rank=8) == "--q-lora-rank applies to --multi-latent-attention; add that or drop this"
    assert refused(rope_type="rope") == "--rotary-scaling-factor applies to --rope-type yarn; set that or drop this"
    assert refused(rotary_interleaved=True) == (
        "--multi-latent-attention needs no --rotary-interleaved (its rotary features always turn in interleaved pairs, "
        "DeepSeek's layout)"
    )


def test_the_inference_engine_refuses_it_by_name():
    config = ModelConfig(**MODEL)
    with pytest.raises(ConfigError, match="^--multi-latent-attention: the inference engine's key/value cache does not"):
        _engine(build_model(config), config, None, None, None, torch.float32, "mla")  # type: ignore[arg-type]


def test_yarn_scale_matches_the_formula():
    config = ModelConfig(**dict(MODEL, mscale_all_dim=0.5))
    layer = MultiLatentAttention(config)
    assert layer.query_scale == pytest.approx((0.1 * 0.5 * math.log(4.0) + 1.0) ** 2)


class _MegatronCore(torch.nn.Module):
    """Softmax attention in megatron-core's layout ([s, b, heads, width] in, [s, b, heads x width] out) at the scale
    its MLA hands its core: megatron-core's own local core takes no separate key and value widths (only Transformer
    Engine's does, which is not installed here)."""

    def __init__(self, config, layer_number, attn_mask_type, attention_type, softmax_scale=None, **_) -> None:
        super().__init__()
        self.scale = softmax_scale

    def forward(self, q, k, v, mask, **_):
        q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale)
        return out.permute(2, 0, 1, 3).reshape(out.size(2), out.size(0), -1)


@pytest.mark.parametrize("q_lora_rank, rope_type", [(16, "yarn"), (None, "rope")])
def test_the_layer_equals_megatron_cores_mla_self_attention(q_lora_rank, rope_type):
    """Weights copied by the kind's megatron-core names (its local spec, whose module names and order they are)."""
    from megatron_oracle import cpu_megatron, destroy_oracle, init_oracle_parallel

    shape = dict(hidden_size=32, num_attention_heads=4, q_lora_rank=q_lora_rank, kv_lora_rank=12, qk_head_dim=8)
    shape |= dict(
        qk_pos_emb_head_dim=8, v_head_dim=6, qk_layernorm=True, normalization="RMSNorm", add_bias_linear=False
    )
    yarn = dict(YARN, mscale_all_dim=0.7) if rope_type == "yarn" else dict(rope_type="rope")
    ours_config = ModelConfig(
        multi_latent_attention=True, norm_epsilon=1e-6, position_embedding_type="rope", **shape, **yarn
    )
    ours = MultiLatentAttention(ours_config).eval()
    torch.manual_seed(0)
    with torch.no_grad():
        for name, param in ours.named_parameters():
            param.normal_(1.0 if "norm" in name else 0.0, 0.3 if "norm" in name else 0.2)
    x = torch.randn(2, SEQ, 32)
    with cpu_megatron():
        init_oracle_parallel()
        try:
            theirs = _megatron_mla(dict(shape, **yarn, layernorm_epsilon=1e-6))
            names = ours.checkpoint_names.megatron_children
            state = theirs.state_dict()
            weights = [name for name in state if not name.endswith("_extra_state")]
            assert weights == [f"{names[child]}.weight" for child in names if f"{child}.weight" in ours.state_dict()]
            for name, param in ours.named_parameters():
                child, part = name.split(".")
                state[f"{names[child]}.{part}"].copy_(param.detach())
            theirs.load_state_dict(state)
            with torch.no_grad():
                expected, _ = theirs(x.transpose(0, 1).contiguous(), None)
                got = ours(x, rotary_tables(ours_config, torch.arange(SEQ)))
        finally:
            destroy_oracle(destroy_process_group=True)  # (later tests build their own worlds)
    torch.testing.assert_close(got, expected.transpose(0, 1), rtol=1e-5, atol=1e-5)


def _megatron_mla(settings: dict) -> torch.nn.Module:
    """megatron-core's MLASelfAttention of its local spec on the CPU, our stand-in core inside; its check for
    Transformer Engine's layers (not installed here) sees a class no layer is."""
    import megatron.core.transformer.multi_latent_attention as megatron_mla
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    from megatron_oracle import _FUSIONS_OFF

    config = MLATransformerConfig(num_layers=1, use_cpu_initialization=True, **settings, **_FUSIONS_OFF)
    spec = get_gpt_layer_local_spec(multi_latent_attention=True, qk_layernorm=True, normalization="RMSNorm")
    parts = spec.submodules.self_attention.submodules
    parts.core_attention = _MegatronCore
    no_te = megatron_mla.TELinear, megatron_mla.TEColumnParallelLinear
    megatron_mla.TELinear = megatron_mla.TEColumnParallelLinear = type("NoTransformerEngine", (), {})
    try:
        return megatron_mla.MLASelfAttention(config, parts, 1, attn_mask_type=AttnMaskType.causal).eval()
    finally:
        megatron_mla.TELinear, megatron_mla.TEColumnParallelLinear = no_te
