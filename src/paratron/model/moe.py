"""Mixture of experts on one device, with Megatron-LM's semantics: a drop-in for a block's MLP.

Read top to bottom: the router (scores, top-k choice, capacity, the
load-balancing losses), the experts (stacked weights, a loop or one batched matmul), the shared
expert, the layer that ties them together, and how the losses reach the backward pass.

    x [B, T, H] -> tokens [N, H] -> router: probs and routing map [N, E] (fp32)
      -> each expert's tokens, in token order -> expert e -> weighted by the token's prob of e
      -> summed back per token (+ the shared expert) -> [B, T, H]

Parameter names are a contract with checkpoints and the Hugging Face conversion:
`router.weight` [E, H], `router.expert_bias` [E] (buffer), `experts.w_in` [E, G*F, H] (G = 2 for
SwiGLU: gate rows, then up rows), `experts.w_out` [E, H, F], `shared_expert.in_proj.{gate,up}.weight`,
`shared_expert.out_proj.weight`, `shared_expert_gate.weight`. Nothing here knows about
parallelism: expert parallelism swaps `experts` for this rank's share and moves the tokens.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from paratron.config.schema import ModelConfig
from paratron.model.layer_kind import CheckpointNames, ContextParallel, KindWork, LayerKind, MicroBatchShare
from paratron.model.mlp import MLP, activation_kind, ungated_activation

_SHARED_EXPERT = MLP.checkpoint_names
"""The shared expert is an MLP: its checkpoint names are an MLP's, below `shared_expert` (Hub), `shared_experts`
(megatron-core)."""

# ---------------------------------------------------------------- router


@dataclass
class Routing:
    """What the router decided for N tokens and E experts."""

    probs: torch.Tensor
    """[N, E] fp32: the weight of each chosen expert's output (0 for the others and dropped tokens)."""
    routing_map: torch.Tensor
    """[N, E] bool: token n goes to expert e (after dropping)."""
    tokens_per_expert: torch.Tensor
    """[E] int64: tokens each expert processes (after dropping, padding not counted)."""
    aux_loss: torch.Tensor
    """Load-balancing loss times its coefficient (a zero scalar when off)."""
    z_loss: torch.Tensor
    """Router z-loss times its coefficient (a zero scalar when off)."""
    capacity: int | None = None
    """Tokens each expert takes at most (None: dropless)."""


def expert_capacity(num_tokens: int, topk: int, num_experts: int, capacity_factor: float) -> int:
    """Megatron's `get_capacity(tokens x topk, experts, factor)`: the even share of the routed
    slots times the factor, rounded up (the same float operations, so the same integer)."""
    return math.ceil((num_tokens * topk / num_experts) * capacity_factor)


def _top_indices(ranked: torch.Tensor, k: int) -> torch.Tensor:
    """[N, k] indices of the k largest entries of each row (torch.topk, as Megatron, so ties
    break the same way)."""
    return torch.topk(ranked, k=k, dim=1).indices


def _first_ranked(ranked: torch.Tensor, k: int) -> torch.Tensor:
    """[..., k] indices of the k largest entries of each row, ties to the lowest index (a stable sort: the same
    choice on every device and at every layout)."""
    return torch.sort(ranked, dim=-1, descending=True, stable=True).indices[..., :k]


def group_limited_top(ranked: torch.Tensor, k: int, groups: int, group_k: int) -> torch.Tensor:
    """[N, k] indices of each row's k largest entries among its `group_k` best groups (Megatron's
    `group_limited_topk`): the E entries form `groups` groups of consecutive experts, a group's score is the sum of
    its k // group_k largest entries, and the other groups' experts are out of reach. Ties go to the lowest index,
    of groups and of experts."""
    N, E = ranked.shape
    by_group = ranked.view(N, groups, E // groups)
    group_scores = by_group.topk(k // group_k, dim=-1).values.sum(dim=-1)  # [N, groups]
    chosen_groups = _first_ranked(group_scores, group_k)
    open_groups = torch.zeros_like(group_scores, dtype=torch.bool).scatter(1, chosen_groups, True)
    open_experts = open_groups.unsqueeze(-1).expand_as(by_group).reshape(N, E)
    return _first_ranked(ranked.masked_fill(~open_experts, float("-inf")), k)


def _keep_fp32(module: nn.Module, before: dict[str, torch.Tensor | None]) -> None:
    """After `module._apply` (e.g. `model.to(torch.bfloat16)`): give back the fp32 values of the
    named buffers on their new device. A bf16 expert bias could not move by 1e-3 steps, and bf16
    counters stop counting at 256."""
    for name, old in before.items():
        new = getattr(module, name)
        if old is not None and new is not None and new.dtype != torch.float32:
            setattr(module, name, old.to(device=new.device, dtype=torch.float32))


class Router(nn.Module):
    """Scores each token against every expert and picks its top-k experts, in fp32 whatever the
    input's precision (Megatron's `topk_routing_with_score_function`, then the capacity and the
    load-balancing losses of its TopKRouter).

    Expert bias (aux-loss-free balancing) changes which experts are chosen, never their weights:
    it is added to whatever the top-k ranks (the logits when the softmax comes after the top-k,
    the scores otherwise). Megatron allows it with sigmoid scores only; with softmax this follows
    the same rule. Group-limited routing (--moe-router-num-groups) ranks the groups by the same
    values; the load-balancing losses count the plain top-k of the scores, as Megatron's do."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        assert config.num_experts, "a Router needs config.num_experts"
        self.num_experts = config.num_experts
        self.topk = config.moe_router_topk
        self.score_function = config.moe_router_score_function
        self.pre_softmax = config.moe_router_pre_softmax
        self.scaling_factor = config.moe_router_topk_scaling_factor
        self.balancing = config.moe_router_load_balancing_type
        self.aux_loss_coeff = config.moe_aux_loss_coeff
        self.z_loss_coeff = config.moe_z_loss_coeff
        self.capacity_factor = config.moe_expert_capacity_factor
        self.drop_policy = config.moe_token_drop_policy
        self.bias_update_rate = config.moe_router_bias_update_rate
        self.num_groups = config.moe_router_num_groups
        self.group_topk = config.moe_router_group_topk
        self.weight = nn.Parameter(torch.empty(config.num_experts, config.hidden_size))
        bias = torch.zeros(config.num_experts) if config.moe_router_enable_expert_bias else None
        self.expert_bias: torch.Tensor | None
        self.register_buffer("expert_bias", bias)
        nn.init.normal_(self.weight, 0.0, config.init_method_std)

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> Router:
        before = {"expert_bias": self.expert_bias}
        super()._apply(fn, recurse)
        _keep_fp32(self, before)
        return self

    def forward(self, x: torch.Tensor, sequences: int = 1) -> Routing:
        """Route tokens x [N, H]; `sequences` is how many sequences of equal length x holds, one
        after the other (the per-sequence load-balancing loss needs them)."""
        logits = x.float() @ self.weight.float().t()  # [N, E]
        probs, routing_map = self.choose(logits)
        capacity = None
        if self.capacity_factor is not None:
            capacity = expert_capacity(logits.size(0), self.topk, self.num_experts, self.capacity_factor)
            probs, routing_map = self.drop(probs, routing_map, capacity)
        return Routing(
            probs=probs,
            routing_map=routing_map,
            tokens_per_expert=routing_map.sum(dim=0),
            aux_loss=self.load_balancing_loss(logits, sequences),
            z_loss=self.z_loss(logits),
            capacity=capacity,
        )

    def choose(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(probs [N, E], routing map [N, E]) of the top-k experts of each token, from fp32 logits."""
        bias = self.expert_bias
        if self.score_function == "sigmoid":
            scores = torch.sigmoid(logits)
            top = self.top(scores if bias is None else scores + bias)
            chosen = scores.gather(1, top)
            if self.topk > 1:
                chosen = chosen / (chosen.sum(dim=-1, keepdim=True) + 1e-20)
        elif self.pre_softmax:  # softmax over all experts; the chosen ones keep their probability
            scores = torch.softmax(logits, dim=-1)
            top = self.top(scores if bias is None else scores + bias)
            chosen = scores.gather(1, top)
        else:  # softmax over the k chosen logits only
            top = self.top(logits if bias is None else logits + bias)
            chosen = torch.softmax(logits.gather(1, top), dim=-1)
        if self.scaling_factor:
            chosen = chosen * self.scaling_factor
        probs = torch.zeros_like(logits).scatter(1, top, chosen)
        routing_map = torch.zeros_like(logits, dtype=torch.bool).scatter(1, top, True)
        return probs, routing_map

    def top(self, ranked: torch.Tensor) -> torch.Tensor:
        """[N, k] the experts each token goes to, ranked by `ranked` [N, E]: its top-k, or with group-limited routing
        its top-k among its best groups."""
        if self.group_topk is None or self.num_groups is None:
            return _top_indices(ranked, self.topk)
        return group_limited_top(ranked, self.topk, self.num_groups, self.group_topk)

    def drop(self, probs: torch.Tensor, routing_map: torch.Tensor, capacity: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Each expert keeps at most `capacity` of its tokens: those of highest probability
        ("probs") or the first ones ("position"); the others lose that expert (as Megatron's
        `apply_router_token_dropping`; padding to capacity happens at dispatch)."""
        if capacity >= probs.size(0):
            return probs, routing_map
        if self.drop_policy == "probs":
            kept = torch.topk(probs, k=capacity, dim=0, sorted=False).indices
            keep = torch.zeros_like(routing_map).scatter(0, kept, True)
        else:  # the first `capacity` tokens routed to each expert, counted in token order
            keep = routing_map.long().cumsum(dim=0) <= capacity
        routing_map = routing_map & keep
        return probs * routing_map, routing_map

    sequence_parts = 1
    """How many ranks' tokens make up each sequence this router sees (context parallelism splits them)."""

    def whole_sequences(self, counts: torch.Tensor) -> torch.Tensor:
        """Token counts of the part of each sequence this router sees, summed over the parts
        other ranks route (the context-parallel twin's all-reduce); here, the counts themselves."""
        return counts

    def load_balancing_loss(self, logits: torch.Tensor, sequences: int) -> torch.Tensor:
        """Switch Transformer's loss, E x sum_e f_e P_e x coeff, over the whole micro-batch
        ("aux_loss") or per sequence and averaged ("seq_aux_loss"). As Megatron, P uses the
        scores over all experts (softmax, or sigmoid normalised per token) and f counts the top-k
        of those scores: no expert bias, no dropping. When other ranks route the rest of each
        sequence, f counts every part and this is the share of the loss of this part's P."""
        if self.balancing == "none" or self.aux_loss_coeff <= 0:
            return logits.new_zeros(())
        if self.score_function == "softmax":
            scores = torch.softmax(logits, dim=-1)
        else:
            scores = torch.sigmoid(logits)
            scores = scores / (scores.sum(dim=-1, keepdim=True) + 1e-20)
        chosen = torch.zeros_like(scores).scatter(1, _top_indices(scores, self.topk), 1.0)
        E, k, coeff = self.num_experts, self.topk, self.aux_loss_coeff
        if self.balancing == "aux_loss":
            N = logits.size(0) * self.sequence_parts
            return torch.sum(scores.sum(dim=0) * self.whole_sequences(chosen.sum(dim=0))) * (E * coeff / (k * N * N))
        T = logits.size(0) // sequences  # per sequence: its own f and P, then the mean over sequences
        counts = self.whole_sequences(chosen.view(sequences, T, E).sum(dim=1))
        per_sequence = scores.view(sequences, T, E).sum(dim=1) * counts
        T *= self.sequence_parts
        return torch.sum(per_sequence) * (E * coeff / (k * T * T)) / sequences

    def z_loss(self, logits: torch.Tensor) -> torch.Tensor:
        """ST-MoE's z-loss: mean over tokens of logsumexp(logits)^2, times its coefficient."""
        if not self.z_loss_coeff:
            return logits.new_zeros(())
        return torch.logsumexp(logits, dim=-1).square().mean() / self.sequence_parts * self.z_loss_coeff

    @torch.no_grad()
    def update_expert_bias(self, tokens_per_expert: torch.Tensor) -> None:
        """Aux-loss-free balancing step (Megatron's `get_updated_expert_bias`, the all-reduce left
        to the caller): raise the bias of experts below the mean load, lower it above."""
        assert self.expert_bias is not None, "update_expert_bias needs --moe-router-enable-expert-bias"
        tokens = tokens_per_expert.to(self.expert_bias.device, torch.float32)
        offset = tokens.sum(dim=-1, keepdim=True) / tokens.size(-1) - tokens
        self.expert_bias += torch.sign(offset) * self.bias_update_rate


# ---------------------------------------------------------------- experts


def _activation(h: torch.Tensor, gated: bool, kind: str = "none") -> torch.Tensor:
    """The dense MLP's activation: silu(gate) * up on [gate | up] (SwiGLU), or the non-gated one `kind` names
    (`mlp.activation_kind`: squared ReLU, or GELU's approximation, "tanh" with --openai-gelu)."""
    if gated:
        gate, up = h.chunk(2, dim=-1)
        return F.silu(gate) * up
    return ungated_activation(h, kind)


def _weighted(h: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
    """Scale each token's activation by its fp32 routing weight, back in the activation's dtype
    (as Megatron's experts do before their output projection; no bias, so the same as scaling the
    output)."""
    return (h * probs.unsqueeze(-1)).to(h.dtype)


def expert_mlp(
    x: torch.Tensor, probs: torch.Tensor, w_in: torch.Tensor, w_out: torch.Tensor, gated: bool, kind: str
) -> torch.Tensor:
    """One expert on its rows x [n, H] (n may be 0), each row's activation scaled by its prob [n]."""
    torch._check(probs.size(0) == x.size(0))  # (one count of rows: what a compiled call may assume)
    return F.linear(_weighted(_activation(F.linear(x, w_in), gated, kind), probs), w_out)


def grouped_expert_mlp(
    x: torch.Tensor,
    probs: torch.Tensor,
    w_in: torch.Tensor,
    w_out: torch.Tensor,
    ends: torch.Tensor,
    gated: bool,
    kind: str,
) -> torch.Tensor:
    """Every expert on its rows at once: rows [ends[e-1], ends[e]) of x [M, H] through expert e (weights
    stacked [E, ...]), one grouped matmul per projection."""
    torch._check(probs.size(0) == x.size(0))
    h = _grouped_mm(x, w_in.transpose(1, 2), ends)
    return _grouped_mm(_weighted(_activation(h, gated, kind), probs), w_out.transpose(1, 2), ends)


@dataclass(frozen=True)
class ExpertKernels:
    """The functions that run the experts' matmuls on their rows, whose count the routing decides:
    these eager ones, or their compiled twins (--compile, `parallel/compile.py`)."""

    one: Callable[..., torch.Tensor] = expert_mlp
    grouped: Callable[..., torch.Tensor] = grouped_expert_mlp


class Experts(nn.Module):
    """E MLPs with stacked weights, run on tokens already grouped by expert.

    `forward(tokens [M, H], counts, probs [M])`: the first counts[0] rows go to expert 0, the next
    counts[1] to expert 1, ...; returns each row's output already multiplied by its prob. The
    matmuls run in the tokens' dtype: a loop over experts, or with `grouped` one call of torch's
    grouped matmul per projection (`torch._grouped_mm`: a grouped GEMM kernel on GPUs that have
    one), over exactly the experts' rows."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        assert config.num_experts, "Experts need config.num_experts"
        E, H = config.num_experts, config.hidden_size
        F_ = config.moe_ffn_hidden_size or config.ffn_hidden_size
        self.gated = config.activation == "swiglu"
        self.kind = activation_kind(config)
        self.grouped = config.moe_grouped_gemm
        self.kernels = ExpertKernels()
        self.w_in = nn.Parameter(torch.empty(E, (2 if self.gated else 1) * F_, H))
        self.w_out = nn.Parameter(torch.empty(E, H, F_))
        nn.init.normal_(self.w_in, 0.0, config.init_method_std)
        nn.init.normal_(self.w_out, 0.0, config.init_method_std / math.sqrt(2.0 * config.num_layers))

    def forward(
        self, tokens: torch.Tensor, counts: list[int], probs: torch.Tensor, pad_to: int | None = None
    ) -> torch.Tensor:
        """`pad_to`: run each expert on at least this many rows (zeros beyond its tokens, then
        discarded): fixed shapes, the same numbers."""
        if pad_to is None and not any(counts):  # no rows (an expert-parallel rank whose experts no token chose):
            # still an output of the graph, so that backward runs the exchanges around it here as on the other ranks
            return self.kernels.one(tokens, probs, self.w_in[0], self.w_out[0], self.gated, self.kind)
        if self.grouped:
            return self._grouped(tokens, counts, probs, pad_to)
        return self._looped(tokens, counts, probs, pad_to)

    def _looped(self, tokens: torch.Tensor, counts: list[int], probs: torch.Tensor, pad_to: int | None) -> torch.Tensor:
        outputs = []
        for e, (x, p) in enumerate(zip(tokens.split(counts), probs.split(counts), strict=True)):
            n = x.size(0)
            if n == 0 and pad_to is None:
                continue
            if pad_to is not None and pad_to > n:
                x, p = F.pad(x, (0, 0, 0, pad_to - n)), F.pad(p, (0, pad_to - n))
            outputs.append(self.kernels.one(x, p, self.w_in[e], self.w_out[e], self.gated, self.kind)[:n])
        return torch.cat(outputs) if outputs else tokens.new_zeros(0, self.w_out.size(1))

    def _grouped(
        self, tokens: torch.Tensor, counts: list[int], probs: torch.Tensor, pad_to: int | None
    ) -> torch.Tensor:
        if pad_to is not None:  # each expert's rows padded with zeros to at least `pad_to`
            rows = [max(n, pad_to) for n in counts]
            sizes = torch.tensor(counts, device=tokens.device)
            expert = torch.repeat_interleave(torch.arange(len(counts), device=tokens.device), sizes)
            first = torch.tensor(rows, device=tokens.device).cumsum(0) - torch.tensor(rows, device=tokens.device)
            rank_in_expert = torch.arange(tokens.size(0), device=tokens.device) - (sizes.cumsum(0) - sizes)[expert]
            position = first[expert] + rank_in_expert
            tokens = tokens.new_zeros(sum(rows), tokens.size(1)).index_put((position,), tokens)
            probs = probs.new_zeros(sum(rows)).index_put((position,), probs)
            return self._grouped(tokens, rows, probs, None)[position]
        ends = torch.tensor(counts, device=tokens.device).cumsum(0).to(torch.int32)
        return self.kernels.grouped(tokens, probs, self.w_in, self.w_out, ends, self.gated, self.kind)


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward makes the gradient contiguous (torch's grouped matmul needs aligned
    strides, which a broadcast gradient lacks)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad.contiguous()


def _grouped_mm(x: torch.Tensor, weights: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """Rows [ends[e-1], ends[e]) of x [M, K] times weights[e] [K, N], for every expert e, in one call
    of torch's grouped matmul (a grouped GEMM kernel where the device has one). Rows of K and N
    values must be multiples of 16 bytes (`config.validation` checks the model's sizes)."""
    return _ContiguousGrad.apply(torch._grouped_mm(x.contiguous(), weights, offs=ends))


def grouped_gemm_available(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether torch's grouped matmul runs on `device` in `dtype` (a tiny probe: some GPUs have no
    grouped GEMM kernel for some types)."""
    try:
        x = torch.zeros(2, 8, device=device, dtype=dtype)
        torch._grouped_mm(
            x,
            torch.zeros(1, 8, 8, device=device, dtype=dtype),
            offs=torch.tensor([2], device=device, dtype=torch.int32),
        )
    except (RuntimeError, NotImplementedError):
        return False
    return True


def sort_by_expert(
    tokens: torch.Tensor, probs: torch.Tensor, routing_map: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The routed copies of `tokens` [N, H] grouped by expert, token order within each: (copies
    [M, H], their probs [M], tokens per expert [E], the token each copy comes from [M])."""
    expert, token = routing_map.t().nonzero(as_tuple=True)
    return tokens[token], probs[token, expert], routing_map.sum(dim=0), token


def sum_by_token(outputs: torch.Tensor, token: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """Each token's routed outputs summed (in fp32, cast to `like`'s dtype once; Megatron sums in
    the tokens' dtype): the inverse of `sort_by_expert`."""
    out = torch.zeros(like.shape, dtype=torch.float32, device=like.device)
    return out.index_add(0, token, outputs.float()).to(like.dtype)


def run_experts(
    tokens: torch.Tensor, probs: torch.Tensor, routing_map: torch.Tensor, experts: Experts, pad_to: int | None = None
) -> torch.Tensor:
    """sum over chosen e of probs[n, e] x expert_e(tokens[n]), all experts on this device."""
    copies, copy_probs, counts, token = sort_by_expert(tokens, probs, routing_map)
    return sum_by_token(experts(copies, counts.tolist(), copy_probs, pad_to), token, tokens)


# ---------------------------------------------------------------- the layer


class MoELayer(LayerKind):
    """Router, experts and optional shared expert in place of a block's MLP: [B, T, H] -> [B, T, H].

    Dropless unless --moe-expert-capacity-factor is set. The load-balancing and z losses do not
    change the output: they are attached to it (`attach_aux_loss`) so that backward adds
    `aux_loss_scale` x their gradients, and the training step sets that scale (the loss scale
    over the micro-batches). `last_stats` holds the last forward's losses and tokens per expert;
    `load` sums the tokens per expert over the forwards that record gradients (not the
    recomputation in backward), for logging and the expert-bias update.

    Expert parallelism (`parallel.expert`) splits it, experts over ranks, so it declares no tensor-parallel plan of
    its own; under context parallelism its router counts the experts chosen over the whole sequence."""

    symbol, kind_name, slot = "E", "mixture of experts", "mlp"
    context_parallel = ContextParallel.SEQUENCE_ROUTER

    # (its names in checkpoints; the routed experts, stacked here, are stored one by one: on the Hub as `hf_experts`,
    # in megatron-core as each expert's linear layers, not declared: paratron's Megatron-LM converters refuse experts)
    checkpoint_names = CheckpointNames(
        hf_module="mlp",
        hf_norm="post_attention_layernorm",
        hf_weights={
            "router.weight": "gate.weight",
            **{f"shared_expert.{ours}": f"shared_expert.{hub}" for ours, hub in _SHARED_EXPERT.hf_weights.items()},
            "shared_expert_gate.weight": "shared_expert_gate.weight",
        },
        hf_experts=("experts.{e}.gate_proj.weight", "experts.{e}.up_proj.weight", "experts.{e}.down_proj.weight"),
        megatron_module="mlp",
        megatron_norm="pre_mlp_layernorm",
        megatron_fused_norm=None,
        megatron_children={
            "router": "router",
            **{f"shared_expert.{ours}": f"shared_experts.{m}" for ours, m in _SHARED_EXPERT.megatron_children.items()},
            "shared_expert_gate.weight": "shared_experts.gate_weight",
        },
    )

    @classmethod
    def matmul_weights(cls, config: ModelConfig) -> int:
        """The router, the top-k routed experts and the shared expert (active weights only)."""
        h, projections = config.hidden_size, 3 if config.activation == "swiglu" else 2
        expert = projections * h * (config.moe_ffn_hidden_size or config.ffn_hidden_size)
        shared = projections * h * (config.moe_shared_expert_intermediate_size or 0)
        experts = config.num_experts or 0
        return experts * h + config.moe_router_topk * expert + shared + h * config.moe_shared_expert_gate

    # ------------------------------------------------------------ the planner's terms

    @classmethod
    def activation_bytes(cls, config: ModelConfig, share: MicroBatchShare, selective: bool) -> float:
        """Per token: the router's scores over E experts, and for each of the k routed copies its dispatched input,
        output and bookkeeping, and the expert's gate and up (one tensor), activation, weighted activation (5 w f);
        the shared expert's SwiGLU (4 w f); plus the output dropout's mask. Fitted to the meter on the CPU (dropless
        routing: exact; under expert parallelism each rank's experts see n k copies on average, so a rank's figure
        moves with the routing's balance)."""
        w, h, etp = share.width, config.hidden_size, share.expert_tp
        f = (config.moe_ffn_hidden_size or config.ffn_hidden_size) // etp
        experts = config.num_experts or 0
        router = (4 if w == 4 else 6) * experts + (0 if w == 4 else w * h)
        per_copy = w * h + 4 * h + 32 + 5 * w * f
        shared = 4 * w * (config.moe_shared_expert_intermediate_size or 0) // share.tp * share.tokens
        routed = share.tokens * etp / share.tp  # (with whole experts each TP rank routes its share of the tokens)
        return (router + config.moe_router_topk * per_copy) * routed + shared + share.output_dropout(config)

    @classmethod
    def forward_work(cls, config: ModelConfig, share: MicroBatchShare) -> KindWork:
        """The router, each token's top-k experts (/ expert TP) and the shared expert (/ TP); its tokens travel to
        their experts and back through all-to-alls."""
        h, tokens, projections = config.hidden_size, share.tokens, 3 if config.activation == "swiglu" else 2
        ffn = config.moe_ffn_hidden_size or config.ffn_hidden_size
        routed = 2 * tokens * projections * h * ffn * config.moe_router_topk / share.expert_tp
        shared = 2 * tokens * projections * h * (config.moe_shared_expert_intermediate_size or 0) / share.tp
        return KindWork(routed + shared + 2 * tokens * h * (config.num_experts or 0), all_to_all=True)

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        assert config.num_experts, "an MoE layer needs config.num_experts"
        self.router = Router(config)
        self.experts = Experts(config)
        shared = config.moe_shared_expert_intermediate_size
        # (a dense MLP without biases every token goes through beside the routed experts: Qwen-MoE, DeepSeek)
        self.shared_expert = MLP(config, shared, bias=False, dropout=0.0) if shared else None
        gated = shared and config.moe_shared_expert_gate
        self.shared_expert_gate = nn.Linear(config.hidden_size, 1, bias=False) if gated else None
        self.pad_to_capacity = config.moe_pad_expert_input_to_capacity
        self.dropout = nn.Dropout(config.hidden_dropout)
        self.aux_loss_scale = 1.0
        self.last_stats: dict[str, torch.Tensor] = {}
        self.forwards = 0
        self.load: torch.Tensor
        self.loss_sums: torch.Tensor
        self.register_buffer("load", torch.zeros(config.num_experts), persistent=False)
        self.register_buffer("loss_sums", torch.zeros(2), persistent=False)  # aux, z summed over `forwards`

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> MoELayer:
        before = {"load": self.load, "loss_sums": self.loss_sums}
        super()._apply(fn, recurse)
        _keep_fp32(self, before)
        return self

    aux_loss_copies = 1
    """Ranks that compute these same losses and add their gradient (the tensor-parallel ranks, in the
    parallel twin): each adds its share."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        routed_input = self.gather_tokens(x)
        B, T, H = routed_input.shape
        tokens = routed_input.reshape(B * T, H)
        routing = self.router(tokens, sequences=B)
        y = self.scatter_output(self.routed(tokens, routing).view(B, T, H))
        if self.shared_expert is not None:
            shared = self.shared_expert(x)
            if self.shared_expert_gate is not None:
                shared = shared * torch.sigmoid(self.shared_expert_gate(x))
            y = y + shared
        out = self.dropout(y)
        self._record(routing)
        losses = routing.aux_loss + routing.z_loss
        if torch.is_grad_enabled() and losses.requires_grad:
            out = attach_aux_loss(out, losses, self.aux_loss_scale / self.aux_loss_copies)
        return out

    def gather_tokens(self, x: torch.Tensor) -> torch.Tensor:
        """The tokens the router sees: all of x here (the tensor-parallel twin gathers the sequence)."""
        return x

    def scatter_output(self, y: torch.Tensor) -> torch.Tensor:
        """The routed experts' output for x, from theirs for `gather_tokens(x)`: the same here."""
        return y

    def routed(self, tokens: torch.Tensor, routing: Routing) -> torch.Tensor:
        """sum over chosen e of probs[n, e] x expert_e(tokens[n]) for tokens [N, H] (the parallel
        twin sends the tokens to the ranks that hold their experts instead)."""
        pad_to = routing.capacity if self.pad_to_capacity else None
        return run_experts(tokens, routing.probs, routing.routing_map, self.experts, pad_to)

    def _record(self, routing: Routing) -> None:
        """Keep the stats of this forward; add them to the counters once per trained forward
        (not in evaluation, not when recomputation runs the forward again inside backward)."""
        stats = {
            "aux_loss": routing.aux_loss.detach(),
            "z_loss": routing.z_loss.detach(),
            "tokens_per_expert": routing.tokens_per_expert.detach(),
        }
        self.last_stats = stats
        recomputing = torch._C._current_graph_task_id() != -1  # a forward run by the autograd engine
        if self.training and torch.is_grad_enabled() and not recomputing:
            with torch.no_grad():
                self.load += stats["tokens_per_expert"]
                self.loss_sums += torch.stack((stats["aux_loss"], stats["z_loss"])).float()
            self.forwards += 1

    def reset_load(self) -> None:
        """Zero the counters (after the trainer has read them)."""
        self.load.zero_()
        self.loss_sums.zero_()
        self.forwards = 0

    def take_stats(self) -> tuple[torch.Tensor, torch.Tensor, int]:
        """(tokens per expert [E], [aux, z] loss sums [2], forwards counted) since the last call,
        then reset."""
        stats = (self.load.clone(), self.loss_sums.clone(), self.forwards)
        self.reset_load()
        return stats


# ---------------------------------------------------------------- auxiliary losses in backward


class _AttachAuxLoss(torch.autograd.Function):
    """Identity on `output`; in backward also gives `aux_loss` the gradient `scale` (Megatron's
    MoEAuxLossAutoScaler), so that the losses train the router without entering the output."""

    @staticmethod
    def forward(ctx: Any, output: torch.Tensor, aux_loss: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.save_for_backward(aux_loss)
        ctx.scale = scale
        return output

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        (aux_loss,) = ctx.saved_tensors
        return grad_output, torch.ones_like(aux_loss) * ctx.scale, None


def attach_aux_loss(output: torch.Tensor, aux_loss: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """`output`, unchanged; its backward also runs `aux_loss`'s with gradient `scale`."""
    return _AttachAuxLoss.apply(output, aux_loss, scale)
