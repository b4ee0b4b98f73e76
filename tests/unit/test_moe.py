"""The MoE layer (model/moe.py) against its references: megatron-core's routing functions for the
router, transformers' Mixtral and Qwen2-MoE blocks for the whole layer, and its own variants
(loop or batched experts, capacity, padding) for each other."""

from __future__ import annotations

import copy

import pytest
import torch
from megatron.core import parallel_state
from megatron.core.transformer.moe import moe_utils as megatron
from torch.utils.checkpoint import checkpoint
from transformers import DeepseekV3Config, MixtralConfig, Qwen2MoeConfig
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE, DeepseekV3TopkRouter
from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock

from paratron.checkpoint.hf.settings import model_type_of
from paratron.cli import main
from paratron.commands.train import train_config
from paratron.config.schema import Config, ModelConfig
from paratron.config.validation import validate
from paratron.errors import CheckpointError, ConfigError
from paratron.model.gpt import build_model
from paratron.model.moe import (
    MoELayer,
    Router,
    attach_aux_loss,
    expert_capacity,
    group_limited_top,
    grouped_gemm_available,
)

H = 32


def moe_config(**overrides) -> ModelConfig:
    values = dict(
        hidden_size=H,
        num_experts=4,
        moe_router_topk=2,
        moe_ffn_hidden_size=48,
        activation="swiglu",
        num_layers=2,
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )
    return ModelConfig(**{**values, **overrides})


def router_inputs(config: ModelConfig, tokens: int = 24, seed: int = 0) -> tuple[Router, torch.Tensor]:
    """A router with weights large enough that the top-k has no near-ties, and its input."""
    torch.manual_seed(seed)
    router = Router(config)
    with torch.no_grad():
        router.weight.normal_(0.0, 0.5)
    return router, torch.randn(tokens, config.hidden_size)


def logits_of(router: Router, x: torch.Tensor) -> torch.Tensor:
    return x.float() @ router.weight.float().t()


# ---------------------------------------------------------------- router against megatron-core

ROUTINGS = {
    "softmax-top1": dict(moe_router_topk=1),
    "softmax-top2": dict(moe_router_topk=2),
    "softmax-top3": dict(moe_router_topk=3),
    "presoftmax-top1": dict(moe_router_topk=1, moe_router_pre_softmax=True),
    "presoftmax-top2": dict(moe_router_topk=2, moe_router_pre_softmax=True),
    "presoftmax-top3": dict(moe_router_topk=3, moe_router_pre_softmax=True),
    "sigmoid-top1": dict(moe_router_topk=1, moe_router_score_function="sigmoid"),
    "sigmoid-top2": dict(moe_router_topk=2, moe_router_score_function="sigmoid"),
    "sigmoid-top3": dict(moe_router_topk=3, moe_router_score_function="sigmoid"),
    "softmax-scaled": dict(moe_router_topk=2, moe_router_topk_scaling_factor=2.5),
    "presoftmax-scaled": dict(moe_router_topk=3, moe_router_pre_softmax=True, moe_router_topk_scaling_factor=2.5),
    "sigmoid-scaled": dict(moe_router_topk=3, moe_router_score_function="sigmoid", moe_router_topk_scaling_factor=2.5),
}


@pytest.mark.parametrize("name", list(ROUTINGS))
def test_router_choice_and_losses_match_megatron(name):
    options = ROUTINGS[name]
    config = moe_config(num_experts=6, moe_aux_loss_coeff=0.01, moe_z_loss_coeff=1e-3, **options)
    router, x = router_inputs(config)
    routing = router(x)
    logits = logits_of(router, x)
    k, score = config.moe_router_topk, config.moe_router_score_function
    probs, routing_map = megatron.topk_routing_with_score_function(
        logits,
        k,
        use_pre_softmax=config.moe_router_pre_softmax,
        scaling_factor=config.moe_router_topk_scaling_factor,
        score_function=score,
    )
    assert torch.equal(routing.routing_map, routing_map)
    assert routing.probs.dtype == torch.float32
    torch.testing.assert_close(routing.probs, probs, atol=1e-6, rtol=0)
    assert torch.equal(routing.tokens_per_expert, routing_map.sum(0))

    aux_map, scores = megatron.compute_routing_scores_for_aux_loss(logits, k, score)
    aux = megatron.switch_load_balancing_loss_func(scores, aux_map.sum(0), x.size(0), k, 6, 0.01)
    torch.testing.assert_close(routing.aux_loss, aux, atol=1e-6, rtol=0)
    torch.testing.assert_close(routing.z_loss, megatron.z_loss_func(logits, 1e-3), atol=1e-6, rtol=0)
    assert routing.aux_loss > 0 and routing.z_loss > 0

    # the losses' gradients reach the router weight as megatron's do
    (routing.aux_loss + routing.z_loss).backward()
    weight = router.weight.detach().clone().requires_grad_()
    logits = x @ weight.t()
    aux_map, scores = megatron.compute_routing_scores_for_aux_loss(logits, k, score)
    reference = megatron.switch_load_balancing_loss_func(scores, aux_map.sum(0), x.size(0), k, 6, 0.01)
    (reference + megatron.z_loss_func(logits, 1e-3)).backward()
    torch.testing.assert_close(router.weight.grad, weight.grad, atol=1e-6, rtol=0)


def test_losses_are_zero_tensors_when_off():
    routing = router_inputs(moe_config())[0](torch.randn(5, H))
    assert routing.aux_loss.shape == () and routing.aux_loss == 0
    assert routing.z_loss.shape == () and routing.z_loss == 0
    config = moe_config(moe_aux_loss_coeff=0.1, moe_router_load_balancing_type="none")
    assert router_inputs(config)[0](torch.randn(5, H)).aux_loss == 0


@pytest.mark.parametrize("score", ["softmax", "sigmoid"])
def test_sequence_aux_loss_matches_megatron(score):
    B, T, E, k, coeff = 3, 8, 5, 2, 0.02
    config = moe_config(
        num_experts=E,
        moe_router_topk=k,
        moe_router_score_function=score,
        moe_router_load_balancing_type="seq_aux_loss",
        moe_aux_loss_coeff=coeff,
    )
    router, x = router_inputs(config, tokens=B * T)
    ours = router(x, sequences=B).aux_loss
    # megatron's TopKRouter._apply_seq_aux_loss on its [T, B] token order: [T, B*E] columns
    logits = logits_of(router, x).view(B, T, E).transpose(0, 1).reshape(T * B, E)
    aux_map, scores = megatron.compute_routing_scores_for_aux_loss(logits, k, score)
    scores, aux_map = scores.reshape(T, B * E), aux_map.reshape(T, B * E)
    reference = megatron.switch_load_balancing_loss_func(scores, aux_map.sum(0), T, k, E, coeff) / B
    torch.testing.assert_close(ours, reference, atol=1e-6, rtol=0)
    assert not torch.allclose(ours, router(x, sequences=1).aux_loss)  # (not the micro-batch loss)


def test_sigmoid_expert_bias_changes_the_choice_as_megatron():
    config = moe_config(
        num_experts=6, moe_router_topk=2, moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True
    )
    router, x = router_inputs(config, tokens=32)
    unbiased = router(x).routing_map
    with torch.no_grad():
        router.expert_bias.copy_(torch.tensor([0.3, -0.2, 0.0, 0.1, -0.4, 0.25]))
    routing = router(x)
    probs, routing_map = megatron.topk_routing_with_score_function(
        logits_of(router, x), 2, score_function="sigmoid", expert_bias=router.expert_bias
    )
    assert not torch.equal(routing.routing_map, unbiased)
    assert torch.equal(routing.routing_map, routing_map)
    torch.testing.assert_close(routing.probs, probs, atol=1e-6, rtol=0)


@pytest.mark.parametrize("pre_softmax", [False, True])
def test_softmax_expert_bias_changes_only_the_choice(pre_softmax):
    config = moe_config(moe_router_topk=2, moe_router_pre_softmax=pre_softmax, moe_router_enable_expert_bias=True)
    router, x = router_inputs(config, tokens=16)
    with torch.no_grad():
        router.expert_bias.copy_(torch.tensor([0.0, 0.0, 1e3, 1e3]))  # experts 2 and 3 always win
    routing = router(x)
    assert routing.routing_map[:, 2:].all() and not routing.routing_map[:, :2].any()
    logits = logits_of(router, x)
    if pre_softmax:
        expected = torch.softmax(logits, -1)[:, 2:]
    else:
        expected = torch.softmax(logits[:, 2:], -1)
    torch.testing.assert_close(routing.probs[:, 2:], expected, atol=1e-6, rtol=0)


def test_expert_bias_update_matches_megatron(monkeypatch):
    config = moe_config(num_experts=5, moe_router_enable_expert_bias=True, moe_router_bias_update_rate=0.01)
    router = Router(config)
    start = torch.tensor([0.0, 0.05, -0.02, 0.0, 0.01])
    router.expert_bias.copy_(start)
    tokens = torch.tensor([10.0, 2.0, 6.0, 7.0, 0.0])  # mean 5: 10, 6, 7 over, 2 and 0 under
    monkeypatch.setattr(torch.distributed, "all_reduce", lambda *args, **kwargs: None)  # one rank
    monkeypatch.setattr(parallel_state, "get_tensor_and_data_parallel_group", lambda **kwargs: None)
    expected = megatron.get_updated_expert_bias(tokens.clone(), start.clone(), 0.01)
    router.update_expert_bias(tokens)
    torch.testing.assert_close(router.expert_bias, expected, atol=0, rtol=0)
    torch.testing.assert_close(router.expert_bias, start + 0.01 * torch.tensor([-1.0, 1, -1, -1, 1]))


# ---------------------------------------------------------------- group-limited routing


GROUPED = {  # (experts, groups, group top-k, top-k, more settings)
    "sigmoid-bias-scaled": (8, 4, 2, 4, dict(moe_router_score_function="sigmoid", moe_router_topk_scaling_factor=2.5)),
    "sigmoid-top1-per-group": (8, 4, 2, 3, dict(moe_router_score_function="sigmoid")),  # (groups ranked by 3 // 2 = 1)
    "softmax": (8, 2, 1, 2, dict(moe_router_topk_scaling_factor=1.5)),
    "presoftmax": (6, 3, 2, 3, dict(moe_router_pre_softmax=True)),
}


def grouped_router(name: str, tokens: int = 32) -> tuple[Router, torch.Tensor]:
    experts, groups, group_k, k, options = GROUPED[name]
    bias = options.get("moe_router_score_function") == "sigmoid"
    config = moe_config(
        num_experts=experts,
        moe_router_topk=k,
        moe_router_num_groups=groups,
        moe_router_group_topk=group_k,
        moe_router_enable_expert_bias=bias,
        **options,
    )
    router, x = router_inputs(config, tokens=tokens, seed=1)
    if bias:
        with torch.no_grad():
            router.expert_bias.copy_(torch.linspace(-0.2, 0.2, experts)[torch.randperm(experts)])
    return router, x


def ranked_values(router: Router, x: torch.Tensor) -> torch.Tensor:
    """What the router ranks experts by: the scores (or the logits, softmax after the top-k) plus the expert bias."""
    logits = logits_of(router, x)
    if router.score_function == "sigmoid":
        values = torch.sigmoid(logits)
    else:
        values = torch.softmax(logits, -1) if router.pre_softmax else logits
    return values if router.expert_bias is None else values + router.expert_bias


def clear_margins(router: Router, x: torch.Tensor, margin: float = 1e-4) -> torch.Tensor:
    """[N] bool: the tokens whose choices no near-tie decides: the chosen groups' scores and the chosen experts' values
    (within the chosen groups) each at least `margin` above the next one, so that every implementation must pick
    the same."""
    values, k, groups, group_k = ranked_values(router, x), router.topk, router.num_groups, router.group_topk
    by_group = values.view(x.size(0), groups, -1)
    group_scores = by_group.topk(k // group_k, dim=-1).values.sum(-1)
    ranked_groups = group_scores.sort(-1, descending=True).values
    clear = ranked_groups[:, group_k - 1] - ranked_groups[:, group_k] >= margin
    closed = group_scores < ranked_groups[:, group_k - 1 : group_k]
    ranked = by_group.masked_fill(closed.unsqueeze(-1), -1e9).flatten(1).sort(-1, descending=True).values
    return clear & (ranked[:, k - 1] - ranked[:, k] >= margin)


def clear_tokens(router: Router, x: torch.Tensor) -> torch.Tensor:
    """The tokens of x with clear margins (most of them)."""
    clear = clear_margins(router, x)
    assert clear.sum() >= 0.75 * x.size(0)
    return x[clear]


@pytest.mark.parametrize("name", list(GROUPED))
def test_group_limited_routing_matches_megatron(name):
    router, x = grouped_router(name)
    x = clear_tokens(router, x)
    routing = router(x)
    probs, routing_map = megatron.topk_routing_with_score_function(
        logits_of(router, x),
        router.topk,
        use_pre_softmax=router.pre_softmax,
        num_groups=router.num_groups,
        group_topk=router.group_topk,
        scaling_factor=router.scaling_factor,
        score_function=router.score_function,
        expert_bias=router.expert_bias,
    )
    assert torch.equal(routing.routing_map, routing_map)  # the same experts first, then their weights
    torch.testing.assert_close(routing.probs, probs, atol=1e-6, rtol=0)
    # every token's experts lie in at most group-top-k groups, and the groups changed some token's choice
    experts_per_group = router.num_experts // router.num_groups
    groups_used = routing.routing_map.view(x.size(0), router.num_groups, experts_per_group).any(-1).sum(-1)
    assert (groups_used <= router.group_topk).all()
    ungrouped = copy.copy(router)
    ungrouped.group_topk = None
    assert not torch.equal(ungrouped(x).routing_map, routing.routing_map)


def deepseek_v3_config(**overrides) -> DeepseekV3Config:
    values = dict(
        hidden_size=H,
        moe_intermediate_size=24,
        n_routed_experts=8,
        n_shared_experts=1,
        num_experts_per_tok=4,
        n_group=4,
        topk_group=2,
        norm_topk_prob=True,
        routed_scaling_factor=2.5,
        hidden_act="silu",
        experts_implementation="eager",
    )
    return DeepseekV3Config(**{**values, **overrides})


def test_group_limited_routing_matches_transformers_deepseek_v3():
    router, x = grouped_router("sigmoid-bias-scaled")  # 8 experts, 4 groups, 2 chosen, top-4: DeepSeek-V3's ratios
    x = clear_tokens(router, x)
    gate = DeepseekV3TopkRouter(deepseek_v3_config())
    with torch.no_grad():
        gate.weight.copy_(router.weight)
        gate.e_score_correction_bias.copy_(router.expert_bias)
    _, weights, indices = gate(x)
    routing = router(x)
    chosen = torch.zeros_like(routing.routing_map).scatter(1, indices, True)
    assert torch.equal(routing.routing_map, chosen)
    torch.testing.assert_close(routing.probs.gather(1, indices), weights, atol=1e-6, rtol=0)


def test_grouped_moe_layer_matches_transformers_deepseek_v3_block():
    torch.manual_seed(0)
    block = DeepseekV3MoE(deepseek_v3_config()).eval()
    with torch.no_grad():
        for param in block.parameters():
            param.normal_(0.0, 0.3)
        block.gate.e_score_correction_bias.copy_(torch.linspace(-0.2, 0.2, 8))
    config = moe_config(
        num_experts=8,
        moe_router_topk=4,
        moe_router_num_groups=4,
        moe_router_group_topk=2,
        moe_router_score_function="sigmoid",
        moe_router_enable_expert_bias=True,
        moe_router_topk_scaling_factor=2.5,
        moe_ffn_hidden_size=24,
        moe_shared_expert_intermediate_size=24,
    )
    layer = MoELayer(config)
    names = {
        "router.weight": "gate.weight",
        "router.expert_bias": "gate.e_score_correction_bias",
        "experts.w_in": "experts.gate_up_proj",
        "experts.w_out": "experts.down_proj",
        "shared_expert.in_proj.gate.weight": "shared_experts.gate_proj.weight",
        "shared_expert.in_proj.up.weight": "shared_experts.up_proj.weight",
        "shared_expert.out_proj.weight": "shared_experts.down_proj.weight",
    }
    assert sorted(names) == sorted(layer.state_dict())
    theirs = block.state_dict()
    layer.load_state_dict({ours: theirs[name] for ours, name in names.items()})
    x = torch.randn(2, 8, H)
    router = layer.router
    assert clear_margins(router, x.view(-1, H)).all()
    _, _, indices = block.gate(x)
    theirs = torch.zeros(16, 8, dtype=torch.bool).scatter(1, indices, True)
    assert torch.equal(router(x.view(-1, H)).routing_map, theirs)
    compare_with(block, layer, x)


def test_ties_go_to_the_lowest_index():
    ranked = torch.tensor([[1.0, 1.0, 1.0, 1.0, 0.5, 0.5, 1.0, 1.0]])  # four groups of two; groups 0, 1, 3 tie
    assert sorted(group_limited_top(ranked, 2, 4, 2).tolist()[0]) == [0, 1]  # groups 0 and 1 (not 3), experts 0, 1
    assert sorted(group_limited_top(ranked, 3, 4, 3).tolist()[0]) == [0, 1, 2]


GROUP_ERRORS = {
    "groups alone": (dict(moe_router_num_groups=2), "--moe-router-num-groups needs --moe-router-group-topk too"),
    "group top-k alone": (dict(moe_router_group_topk=1), "--moe-router-group-topk needs --moe-router-num-groups too"),
    "uneven groups": (
        dict(moe_router_num_groups=3, moe_router_group_topk=1),
        "--moe-router-num-groups 3 does not divide --num-experts 8 into equal groups; use a divisor",
    ),
    "more groups chosen than exist": (
        dict(moe_router_num_groups=2, moe_router_group_topk=3),
        "--moe-router-group-topk 3: must be between 1 and --moe-router-num-groups 2",
    ),
    "no group chosen": (
        dict(moe_router_num_groups=2, moe_router_group_topk=0),
        "--moe-router-group-topk 0: must be between 1",
    ),
    "too few experts open": (
        dict(moe_router_num_groups=4, moe_router_group_topk=1, moe_router_topk=3),
        "--moe-router-group-topk 1 opens 2 experts, fewer than --moe-router-topk 3; choose more groups",
    ),
    "more groups than experts per token": (
        dict(moe_router_num_groups=4, moe_router_group_topk=3, moe_router_topk=2),
        "--moe-router-group-topk 3 exceeds --moe-router-topk 2",
    ),
    "without experts": (
        dict(num_experts=None, moe_ffn_hidden_size=None, moe_router_num_groups=2, moe_router_group_topk=1),
        "--moe-router-num-groups: a mixture-of-experts setting needs --num-experts",
    ),
}


@pytest.mark.parametrize("name", list(GROUP_ERRORS))
def test_group_limited_routing_refuses_what_cannot_route(name):
    settings, message = GROUP_ERRORS[name]
    with pytest.raises(ConfigError) as error:
        validate(Config(model=moe_config(**{"num_experts": 8, **settings})), 1, check_data=False)
    assert message in str(error.value) and "\n" not in str(error.value)


def test_a_refused_group_setting_exits_with_code_2(capsys):
    flags = ["--num-experts", "4", "--moe-router-num-groups", "3", "--moe-router-group-topk", "1"]
    assert main(["train", "--config", "debug", "--dry-run", *flags]) == 2
    assert "--moe-router-num-groups 3 does not divide --num-experts 4" in capsys.readouterr().err


def test_hugging_face_export_refuses_group_routing_routed_scaling_and_expert_bias():
    mixtral = dict(position_embedding_type="rope", normalization="RMSNorm", add_bias_linear=False)
    assert model_type_of(moe_config(**mixtral)) == "mixtral"
    with pytest.raises(CheckpointError, match=r"--moe-router-num-groups \(group-limited expert routing\)"):
        model_type_of(moe_config(**mixtral, moe_router_num_groups=2, moe_router_group_topk=1))
    with pytest.raises(CheckpointError, match=r"--moe-router-topk-scaling-factor \(routed scaling\)"):
        model_type_of(moe_config(**mixtral, moe_router_topk_scaling_factor=2.5))
    with pytest.raises(CheckpointError, match=r"--moe-router-enable-expert-bias \(aux-loss-free expert bias\)"):
        model_type_of(moe_config(**mixtral, moe_router_enable_expert_bias=True, moe_router_score_function="sigmoid"))


DEEPSEEK_FLAGS = (
    "--config debug --swiglu --num-layers 4 --moe-layer-freq ([0]*1+[1]*3) --num-experts 8 --moe-ffn-hidden-size 32 "
    "--moe-shared-expert-intermediate-size 32 --moe-router-topk 4 --moe-router-score-function sigmoid "
    "--moe-router-enable-expert-bias --moe-router-topk-scaling-factor 2.5 --moe-router-num-groups 4 "
    "--moe-router-group-topk 2 --moe-router-load-balancing-type seq_aux_loss --moe-aux-loss-coeff 1e-3"
)


def test_a_deepseek_style_model_from_the_command_line_trains():
    config = train_config(DEEPSEEK_FLAGS.split())
    validate(config, 1)
    m = config.model
    assert m.moe_layer_pattern == (False, True, True, True)
    assert (m.moe_router_num_groups, m.moe_router_group_topk, m.moe_router_topk) == (4, 2, 4)
    model = build_model(m, seed=0)
    layers = [layer for layer in model.modules() if isinstance(layer, MoELayer)]
    assert len(layers) == 3 and all(layer.shared_expert is not None for layer in layers)
    ids = torch.randint(0, m.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    maps = []
    layers[0].router.register_forward_hook(lambda router, args, routing: maps.append(routing.routing_map))
    logits = model(ids)
    torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), ids.flatten()).backward()
    for layer in layers:
        used = layer.last_stats["tokens_per_expert"]
        assert used.sum() == 2 * 16 * 4
        assert layer.router.weight.grad is not None and layer.router.weight.grad.abs().sum() > 0
    assert (maps[0].view(-1, 4, 2).any(-1).sum(-1) <= 2).all()  # (each token's 4 experts within 2 groups of 2)


# ---------------------------------------------------------------- capacity


@pytest.mark.parametrize(("tokens", "topk", "experts", "factor"), [(24, 2, 4, 1.0), (10, 1, 3, 1.1), (7, 3, 8, 0.3)])
def test_capacity_matches_megatron(tokens, topk, experts, factor):
    assert expert_capacity(tokens, topk, experts, factor) == megatron.get_capacity(tokens * topk, experts, factor)


def hand_built_routing() -> tuple[torch.Tensor, torch.Tensor]:
    """8 tokens, 2 experts, top-1: expert 0 gets tokens 0 2 3 5 7 (two over a capacity of 3),
    expert 1 gets 1 4 6 (exactly full)."""
    probs = torch.zeros(8, 2)
    probs[[0, 2, 3, 5, 7], 0] = torch.tensor([0.6, 0.9, 0.7, 0.8, 0.95])
    probs[[1, 4, 6], 1] = torch.tensor([0.55, 0.65, 0.75])
    return probs, probs > 0


@pytest.mark.parametrize(("policy", "kept"), [("probs", [2, 5, 7]), ("position", [0, 2, 3])])
def test_token_dropping_keeps_the_known_tokens(policy, kept):
    config = moe_config(num_experts=2, moe_router_topk=1, moe_expert_capacity_factor=0.75, moe_token_drop_policy=policy)
    probs, routing_map = hand_built_routing()
    capacity = expert_capacity(8, 1, 2, 0.75)
    assert capacity == 3
    dropped_probs, dropped_map = Router(config).drop(probs, routing_map, capacity)
    assert dropped_map[:, 0].nonzero().flatten().tolist() == kept
    assert torch.equal(dropped_map[:, 1], routing_map[:, 1])
    assert torch.equal(dropped_probs, probs * dropped_map)
    reference_probs, reference_map = megatron.apply_router_token_dropping(
        probs, routing_map, router_topk=1, capacity_factor=0.75, drop_policy=policy
    )
    if policy == "probs":
        assert torch.equal(dropped_map, reference_map)
        torch.testing.assert_close(dropped_probs, reference_probs, atol=1e-6, rtol=0)
    else:  # megatron picks "the first ones" with torch.topk over a 0/1 map, whose ties fall anywhere on CPU
        assert torch.equal(dropped_map.sum(0), reference_map.sum(0))


@pytest.mark.parametrize("policy", ["probs", "position"])
@pytest.mark.parametrize("pad", [False, True])
def test_router_capacity_matches_megatron(policy, pad):
    config = moe_config(
        num_experts=4,
        moe_router_topk=2,
        moe_expert_capacity_factor=0.6,
        moe_token_drop_policy=policy,
        moe_pad_expert_input_to_capacity=pad,
    )
    router, x = router_inputs(config, tokens=40, seed=3)
    routing = router(x)
    probs, routing_map = megatron.topk_routing_with_score_function(logits_of(router, x), 2)
    capacity = megatron.get_capacity(40 * 2, 4, 0.6)
    assert routing.capacity == capacity
    assert (routing.tokens_per_expert <= capacity).all() and (routing_map.sum(0) > capacity).any()
    if policy == "probs":
        reference_probs, reference_map = megatron.apply_router_token_dropping(
            probs, routing_map, 2, 0.6, drop_policy=policy, pad_to_capacity=pad
        )
        if pad:  # megatron's map then marks padding slots too (with probability 0); ours only the routed tokens
            reference_map = reference_map & routing_map
        assert torch.equal(routing.routing_map, reference_map)
        torch.testing.assert_close(routing.probs, reference_probs, atol=1e-6, rtol=0)
    else:
        first = routing_map & (routing_map.long().cumsum(0) <= capacity)
        assert torch.equal(routing.routing_map, first)
        torch.testing.assert_close(routing.probs, probs * first, atol=1e-6, rtol=0)


# ---------------------------------------------------------------- the layer


def reference_output(layer: MoELayer, x: torch.Tensor) -> torch.Tensor:
    """sum over chosen e of probs[n, e] expert_e(x[n]), one token and one expert at a time."""
    tokens = x.reshape(-1, x.size(-1))
    routing = layer.router(tokens, sequences=x.size(0))
    w_in, w_out = layer.experts.w_in, layer.experts.w_out
    rows = []
    for n, token in enumerate(tokens):
        row = torch.zeros_like(token)
        for e in routing.routing_map[n].nonzero().flatten().tolist():
            h = w_in[e] @ token
            if layer.experts.gated:
                gate, up = h.chunk(2)
                h = torch.nn.functional.silu(gate) * up
            elif layer.experts.kind == "squared_relu":
                h = torch.where(h > 0, h * h, 0.0)  # (Nemotron-4's relu(h)^2)
            else:
                h = torch.nn.functional.gelu(h, approximate=layer.experts.kind)  # (tanh with --openai-gelu)
            row = row + routing.probs[n, e] * (w_out[e] @ h)
        rows.append(row)
    return torch.stack(rows).view_as(x)


def built(config: ModelConfig, seed: int = 0) -> MoELayer:
    torch.manual_seed(seed)
    layer = MoELayer(config)
    with torch.no_grad():
        layer.router.weight.normal_(0.0, 0.5)
        layer.experts.w_in.normal_(0.0, 0.2)
        layer.experts.w_out.normal_(0.0, 0.2)
    return layer


@pytest.mark.parametrize("activation", ["swiglu", "gelu", "squared_relu"])
@pytest.mark.parametrize("grouped", [False, True])
def test_layer_is_the_weighted_sum_of_its_chosen_experts(activation, grouped):
    layer = built(moe_config(activation=activation, moe_grouped_gemm=grouped, moe_router_topk=3))
    assert layer.experts.w_in.shape == (4, (2 if activation == "swiglu" else 1) * 48, H)
    assert layer.experts.w_out.shape == (4, H, 48)
    x = torch.randn(2, 5, H)
    torch.testing.assert_close(layer(x), reference_output(layer, x), atol=1e-5, rtol=0)


def grads_of(layer: MoELayer, x: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """(output, gradients of the input and of every parameter) for a fixed random cotangent."""
    x = x.clone().requires_grad_()
    layer.zero_grad()
    out = layer(x)
    out.backward(torch.linspace(-1, 1, out.numel()).view_as(out))
    grads = {name: p.grad.clone() for name, p in layer.named_parameters()}
    return out.detach(), {"input": x.grad, **grads}


@pytest.mark.parametrize("activation", ["swiglu", "gelu"])
@pytest.mark.parametrize("capacity", [None, 0.7])
def test_grouped_gemm_matches_the_loop(activation, capacity):
    options = dict(activation=activation, moe_expert_capacity_factor=capacity, moe_aux_loss_coeff=0.01)
    loop = built(moe_config(**options))
    grouped = built(moe_config(**options, moe_grouped_gemm=True))
    grouped.load_state_dict(loop.state_dict())
    x = torch.randn(3, 7, H)
    out, grads = grads_of(loop, x)
    out_grouped, grads_grouped = grads_of(grouped, x)
    torch.testing.assert_close(out_grouped, out, atol=1e-6, rtol=1e-6)
    for name, grad in grads.items():
        torch.testing.assert_close(grads_grouped[name], grad, atol=1e-6, rtol=1e-6, msg=name)


@pytest.mark.parametrize("grouped", [False, True])
def test_experts_given_no_rows_stay_in_the_graph(grouped):
    """An expert-parallel rank whose experts no token chose (group-limited routing makes it common) still gives
    backward a path through its experts: the exchanges around them must run there as on the other ranks."""
    experts = built(moe_config(moe_grouped_gemm=grouped)).experts
    tokens, probs = torch.zeros(0, H, requires_grad=True), torch.zeros(0, requires_grad=True)
    out = experts(tokens, [0, 0, 0, 0], probs)
    assert out.shape == (0, H) and out.requires_grad
    out.sum().backward()
    assert tokens.grad.shape == (0, H) and experts.w_in.grad is not None and not experts.w_in.grad.any()


def test_this_device_has_a_grouped_matmul_for_every_precision():
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        assert grouped_gemm_available(torch.device("cpu"), dtype), dtype


@pytest.mark.parametrize("grouped", [False, True])
def test_capacity_that_drops_nothing_and_padding_change_nothing(grouped):
    x = torch.randn(2, 9, H)
    dropless = built(moe_config(moe_grouped_gemm=grouped))
    roomy = built(moe_config(moe_grouped_gemm=grouped, moe_expert_capacity_factor=4.0))  # capacity >= tokens
    out, grads = grads_of(dropless, x)
    out_roomy, grads_roomy = grads_of(roomy, x)
    assert torch.equal(out_roomy, out)
    for name, grad in grads.items():
        assert torch.equal(grads_roomy[name], grad), name

    dropping = built(moe_config(moe_grouped_gemm=grouped, moe_expert_capacity_factor=0.5))
    padded = built(
        moe_config(moe_grouped_gemm=grouped, moe_expert_capacity_factor=0.5, moe_pad_expert_input_to_capacity=True)
    )
    out, grads = grads_of(dropping, x)
    out_padded, grads_padded = grads_of(padded, x)
    assert not torch.allclose(out, out_roomy)  # (tokens were dropped)
    torch.testing.assert_close(out_padded, out, atol=1e-6, rtol=0)
    for name, grad in grads.items():
        torch.testing.assert_close(grads_padded[name], grad, atol=1e-6, rtol=0, msg=name)
    torch.testing.assert_close(out, reference_output(dropping, x), atol=1e-5, rtol=0)


def test_matches_transformers_mixtral_block():
    hf = MixtralConfig(
        hidden_size=H, intermediate_size=48, num_local_experts=4, num_experts_per_tok=2, experts_implementation="eager"
    )
    torch.manual_seed(0)
    block = MixtralSparseMoeBlock(hf).eval()
    with torch.no_grad():
        block.gate.weight.normal_(0.0, 0.5)
        block.experts.gate_up_proj.normal_(0.0, 0.2)
        block.experts.down_proj.normal_(0.0, 0.2)
    layer = MoELayer(moe_config(num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=48))
    with torch.no_grad():
        layer.router.weight.copy_(block.gate.weight)
        layer.experts.w_in.copy_(block.experts.gate_up_proj)
        layer.experts.w_out.copy_(block.experts.down_proj)
    compare_with(block, layer, torch.randn(2, 6, H))


def test_matches_transformers_qwen2_moe_block():
    hf = Qwen2MoeConfig(
        hidden_size=H,
        num_experts=3,
        num_experts_per_tok=2,
        moe_intermediate_size=48,
        shared_expert_intermediate_size=40,
        norm_topk_prob=False,
        experts_implementation="eager",  # the plain loop over experts
    )
    torch.manual_seed(0)
    block = Qwen2MoeSparseMoeBlock(hf).eval()
    with torch.no_grad():
        for param in block.parameters():
            param.normal_(0.0, 0.3)
    config = moe_config(
        num_experts=3,
        moe_router_topk=2,
        moe_router_pre_softmax=True,
        moe_ffn_hidden_size=48,
        moe_shared_expert_intermediate_size=40,
        moe_shared_expert_gate=True,
    )
    layer = MoELayer(config)
    names = {
        "router.weight": "gate.weight",
        "experts.w_in": "experts.gate_up_proj",
        "experts.w_out": "experts.down_proj",
        "shared_expert.in_proj.gate.weight": "shared_expert.gate_proj.weight",
        "shared_expert.in_proj.up.weight": "shared_expert.up_proj.weight",
        "shared_expert.out_proj.weight": "shared_expert.down_proj.weight",
        "shared_expert_gate.weight": "shared_expert_gate.weight",
    }
    assert sorted(names) == sorted(name for name, _ in layer.named_parameters())
    theirs = block.state_dict()
    layer.load_state_dict({ours: theirs[name] for ours, name in names.items()})
    compare_with(block, layer, torch.randn(2, 6, H))


def compare_with(block: torch.nn.Module, layer: MoELayer, x: torch.Tensor) -> None:
    """Same output (1e-5) and input gradient for the same cotangent."""
    x_theirs, x_ours = x.clone().requires_grad_(), x.clone().requires_grad_()
    theirs, ours = block(x_theirs), layer(x_ours)
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=0)
    cotangent = torch.randn_like(theirs)
    theirs.backward(cotangent)
    ours.backward(cotangent)
    torch.testing.assert_close(x_ours.grad, x_theirs.grad, atol=1e-5, rtol=0)


# ---------------------------------------------------------------- losses in backward, precision, counters


def test_attach_aux_loss_is_identity_with_a_scaled_gradient():
    output, aux = torch.randn(3, requires_grad=True), torch.tensor(0.7, requires_grad=True)
    out = attach_aux_loss(output, aux, 2.5)
    assert torch.equal(out, output)
    out.sum().backward()
    assert torch.equal(output.grad, torch.ones(3)) and aux.grad == 2.5


@pytest.mark.parametrize("balancing", ["aux_loss", "seq_aux_loss"])
def test_aux_loss_gradient_reaches_the_router(balancing):
    config = moe_config(moe_aux_loss_coeff=0.05, moe_z_loss_coeff=0.01, moe_router_load_balancing_type=balancing)
    layer, x, scale = built(config), torch.randn(2, 8, H), 3.0
    cotangent = torch.randn(2, 8, H)
    layer.aux_loss_scale = scale
    (layer(x) * cotangent).sum().backward()
    attached = layer.router.weight.grad.clone()

    direct = copy.deepcopy(layer)
    direct.zero_grad()
    direct.aux_loss_scale = 0.0  # the attached losses then add nothing
    main = (direct(x) * cotangent).sum()
    routing = direct.router(x.reshape(-1, H), sequences=2)
    (main + scale * (routing.aux_loss + routing.z_loss)).backward()
    size = float(attached.abs().max())  # (about 20: compared to 1e-6 of that, the sums run in another order)
    torch.testing.assert_close(attached, direct.router.weight.grad, atol=1e-6 * size, rtol=0)

    direct.zero_grad()
    (direct(x) * cotangent).sum().backward()
    assert not torch.allclose(attached, direct.router.weight.grad, atol=1e-4)  # (the losses did contribute)


def test_bf16_input_keeps_fp32_routing_and_buffers():
    layer = built(moe_config(moe_router_enable_expert_bias=True, moe_aux_loss_coeff=0.01)).to(torch.bfloat16)
    assert layer.experts.w_in.dtype == torch.bfloat16
    assert layer.router.expert_bias.dtype == torch.float32 and layer.load.dtype == torch.float32
    x = torch.randn(2, 4, H, dtype=torch.bfloat16, requires_grad=True)
    routing = layer.router(x.view(-1, H))
    assert routing.probs.dtype == torch.float32 and routing.aux_loss.dtype == torch.float32
    out = layer(x)
    assert out.dtype == torch.bfloat16
    out.float().sum().backward()
    assert x.grad.dtype == torch.bfloat16 and layer.router.weight.grad.dtype == torch.bfloat16


def test_load_counts_trained_forwards_once():
    layer = built(moe_config(moe_aux_loss_coeff=0.01))
    x = torch.randn(2, 5, H, requires_grad=True)
    layer(x)
    first = layer.last_stats["tokens_per_expert"].float()
    assert first.sum() == 2 * 5 * 2
    checkpoint(layer, x * 2, use_reentrant=False).sum().backward()  # recomputed in backward: counted once
    second = layer.last_stats["tokens_per_expert"].float()
    with torch.no_grad():
        layer(x)  # no gradient: not counted
    layer.eval()
    layer(x)  # evaluation: not counted
    torch.testing.assert_close(layer.load, first + second, atol=0, rtol=0)
    tokens, losses, forwards = layer.take_stats()
    torch.testing.assert_close(tokens, first + second, atol=0, rtol=0)
    assert forwards == 2 and losses[0] > 0 and losses[1] == 0
    assert layer.load.sum() == 0 and layer.forwards == 0
    assert "load" not in layer.state_dict()


def test_moe_layers_follow_the_layer_frequency():
    assert list(moe_config(num_layers=5, moe_layer_freq="2").moe_layer_pattern) == [True, False, True, False, True]
    assert list(moe_config(num_layers=3, moe_layer_freq="1").moe_layer_pattern) == [True] * 3
    assert list(moe_config(num_layers=4, moe_layer_freq="[0,1,1,1]").moe_layer_pattern) == [False, True, True, True]
    assert moe_config(num_layers=4, moe_layer_freq="([0]*1+[1]*3)").moe_layer_pattern == (False, True, True, True)
    assert moe_config(num_layers=6, moe_layer_freq="([1]*2+[0])*2").moe_layer_pattern == (True, True, False) * 2
    assert moe_config(num_layers=6, moe_layer_freq="2*[0]+[1]*4").moe_layer_pattern == (False,) * 2 + (True,) * 4
    for bad in ("[0,1]", "0", "x", "[0,2,1,1]", "[0]*4+__import__('os').sep", "[0,1]*1000000000000", "[0,1,1,1"):
        with pytest.raises(ConfigError, match="moe-layer-freq") as error:
            validate(Config(model=moe_config(num_layers=4, moe_layer_freq=bad)), 1, check_data=False)
        assert "\n" not in str(error.value)
