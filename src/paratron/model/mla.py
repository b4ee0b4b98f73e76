"""Multi-latent attention (DeepSeek-V2/V3's MLA, Megatron-LM's --multi-latent-attention) as a layer kind.

A token's keys and values are not projected from the hidden state head by head: the hidden state goes down to one
latent of --kv-lora-rank features (normalized under --qk-layernorm), which goes up to every head's key and value;
beside the latent the same down-projection gives one rotary key of --qk-pos-emb-head-dim features that every head
shares. Queries come down to a latent of --q-lora-rank features and up again (or from one full projection without
it). Each query and key head is --qk-head-dim features without positions and --qk-pos-emb-head-dim rotary ones; each
value head --v-head-dim. The rotary features turn in pairs (2k, 2k + 1), the layout of DeepSeek's weights, as
megatron-core's MLA and transformers' `rope_interleave` turn them. Under --rope-type yarn the rotary tables are
YaRN's (`model/rotary.py`) and the softmax scale 1/sqrt(qk-head-dim + qk-pos-emb-head-dim) is multiplied by
m(--mscale-all-dim)^2, as transformers' DeepseekV3Attention and megatron-core's MLASelfAttention compute it. This
is the non-absorbed form: keys and values are expanded per head and attention runs in the model's attention core
(`model/attention.py`: its patterns, packed documents and kernels).

Under tensor parallelism (megatron-core's layout) the up-projections split by heads, the output projection by its
input columns; the down-projections and their norms stay whole on every rank, and the shared rotary key enters the
heads' region as a column-parallel layer's input does.
"""

from __future__ import annotations

import torch
from torch import nn

from paratron.config.schema import ModelConfig
from paratron.model.attention import AttentionCore, LayerCache, TokenPlaces, make_pattern
from paratron.model.layer_kind import (
    CheckpointNames,
    Column,
    ColumnInput,
    ContextParallel,
    DecodeState,
    KindWork,
    LayerKind,
    MicroBatchShare,
    PartialGradient,
    Random,
    Row,
    Split,
)
from paratron.model.norms import make_norm
from paratron.model.rotary import fused_rotation, yarn_softmax_factor


class MultiLatentAttention(LayerKind):
    """Self-attention through low-rank latents (see the module docstring). Its children: `q_proj` (one full query
    projection) or `q_down`, `q_norm` (under --qk-layernorm) and `q_up`; `kv_down` (to the latent and the shared
    rotary key), `kv_norm` (under --qk-layernorm) and `kv_up` (to every head's key without positions and value);
    `core` (the attention of the configured pattern) and `out_proj`."""

    symbol, kind_name, slot = "*", "multi-latent attention", "attention"
    sees_positions = True
    context_parallel = ContextParallel.ATTENTION_CORE
    context_parallel_refusal = "multi-latent attention does not run with the sequence split over ranks yet"
    decode_state = DecodeState.KEY_VALUE
    selective_recompute = ("core",)

    # (its names in checkpoints: Hugging Face's deepseek_v3 and megatron-core's MLASelfAttention, local spec; under
    # Transformer Engine's spec megatron-core fuses the latent norms into the up-projections)
    checkpoint_names = CheckpointNames(
        hf_module="self_attn",
        hf_norm="input_layernorm",
        hf_weights={
            "q_proj.weight": "q_proj.weight",
            "q_down.weight": "q_a_proj.weight",
            "q_norm.weight": "q_a_layernorm.weight",
            "q_up.weight": "q_b_proj.weight",
            "kv_down.weight": "kv_a_proj_with_mqa.weight",
            "kv_norm.weight": "kv_a_layernorm.weight",
            "kv_up.weight": "kv_b_proj.weight",
            "out_proj.{w}": "o_proj.{w}",
        },
        megatron_module="self_attention",
        megatron_norm="input_layernorm",
        megatron_fused_norm=None,
        megatron_children={
            "out_proj": "linear_proj",
            "q_proj": "linear_q_proj",
            "q_down": "linear_q_down_proj",
            "q_up": "linear_q_up_proj",
            "kv_down": "linear_kv_down_proj",
            "kv_up": "linear_kv_up_proj",
            "q_norm": "q_layernorm",
            "kv_norm": "kv_layernorm",
        },
    )

    def __init__(self, config: ModelConfig, layer_number: int = 1) -> None:
        super().__init__()
        heads, hidden = config.num_attention_heads, config.hidden_size
        self.nope_dim, self.rope_dim, self.v_dim = config.qk_head_dim, config.qk_pos_emb_head_dim, config.v_head_dim
        self.kv_rank = config.kv_lora_rank
        query_width = heads * (self.nope_dim + self.rope_dim)
        rank = config.q_lora_rank
        self.q_proj = nn.Linear(hidden, query_width, bias=False) if rank is None else None
        self.q_down = nn.Linear(hidden, rank, bias=False) if rank is not None else None
        self.q_norm = make_norm(config, rank) if rank is not None and config.qk_layernorm else None
        self.q_up = nn.Linear(rank, query_width, bias=False) if rank is not None else None
        self.kv_down = nn.Linear(hidden, self.kv_rank + self.rope_dim, bias=False)
        self.kv_norm = make_norm(config, self.kv_rank) if config.qk_layernorm else None
        self.kv_up = nn.Linear(self.kv_rank, heads * (self.nope_dim + self.v_dim), bias=False)
        self.rope_key_entry = nn.Identity()  # (under tensor parallelism: where the shared key enters the heads)
        self.core = AttentionCore(
            make_pattern(config),
            config.attention_dropout,
            layer_scaling=layer_number if config.apply_query_key_layer_scaling else None,
        )
        self.out_proj = nn.Linear(heads * self.v_dim, hidden, bias=config.add_bias_linear)
        self.output_dropout = nn.Dropout(config.hidden_dropout)
        self.rope_fusion = config.apply_rope_fusion
        self.query_scale = yarn_softmax_factor(config)
        """What the queries are multiplied by, so that the core's 1/sqrt(width) becomes YaRN's softmax scale."""

    def tensor_parallel_plan(self) -> dict[str, Split]:
        """The up-projections by heads (their rows are whole heads), the output row-parallel, the core on this
        rank's heads under the tensor-parallel random stream; the down-projections and latent norms whole (their
        gradients partial under sequence parallelism, where each rank sees its tokens); the shared rotary key
        entering the heads' region."""
        up = "q_proj" if self.q_proj is not None else "q_up"
        plan: dict[str, Split] = {up: Column(), "kv_up": Column(), "out_proj": Row(), "core": Random()}
        replicated = [name for name in ("q_down", "q_norm", "kv_down", "kv_norm") if getattr(self, name) is not None]
        plan |= {name: PartialGradient(sequence_parallel_only=True) for name in replicated}
        return plan | {"rope_key_entry": ColumnInput(), "output_dropout": Random(sequence_parallel_only=True)}

    def query_projection(self) -> nn.Module:
        return self.q_proj if self.q_proj is not None else self.q_up

    def forward(
        self,
        x: torch.Tensor,
        rotary: tuple[torch.Tensor, torch.Tensor] | None = None,
        cache: LayerCache | None = None,
        places: TokenPlaces | None = None,
    ) -> torch.Tensor:
        q = self.queries(x)
        latent, rope_key = self.kv_down(x).split([self.kv_rank, self.rope_dim], dim=-1)
        kv = self.kv_up(self.kv_norm(latent) if self.kv_norm is not None else latent)
        rope_key = self.rope_key_entry(rope_key)
        B, T = q.shape[:2]  # (not x's: with sequence parallelism x holds only part of the sequence)
        q_nope, q_rope = q.view(B, T, -1, self.nope_dim + self.rope_dim).split([self.nope_dim, self.rope_dim], -1)
        k_nope, v = kv.view(B, T, -1, self.nope_dim + self.v_dim).split([self.nope_dim, self.v_dim], -1)
        rope_key = rope_key.unsqueeze(1)  # [B, 1, T, rope]: one key for every head
        q_rope = q_rope.transpose(1, 2)  # [B, heads, T, rope]
        if rotary is not None:
            q_rope, rope_key = fused_rotation(self.rope_fusion, q_rope, rope_key, *rotary, True)
        # (queries, keys and values laid out [B, T, heads, width] under their [B, heads, T, width] views, as the
        # other attention's are: the core's output then reaches the output projection without a copy)
        q = torch.cat((q_nope, q_rope.transpose(1, 2)), dim=-1)
        k = torch.cat((k_nope, rope_key.transpose(1, 2).expand(-1, -1, q.size(2), -1)), dim=-1)
        if self.query_scale != 1.0:
            q = q * self.query_scale
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.contiguous().transpose(1, 2)
        if cache is not None:
            k, v = cache.update(k, v)
        y = self.core(q, k, v, places).transpose(1, 2).reshape(B, T, -1)
        return self.output_dropout(self.out_proj(y))

    def queries(self, x: torch.Tensor) -> torch.Tensor:
        """Every head's queries [B, T, heads x (nope + rope)]: one projection, or down, normed, up."""
        if self.q_proj is not None:
            return self.q_proj(x)
        assert self.q_down is not None and self.q_up is not None
        latent = self.q_down(x)
        return self.q_up(self.q_norm(latent) if self.q_norm is not None else latent)

    # ------------------------------------------------------------ FLOPs and the planner's terms

    @classmethod
    def _weights(cls, config: ModelConfig) -> tuple[int, int]:
        """(the down-projections' weights, whole on every rank; the up and output projections', split by TP)."""
        h, heads, rank = config.hidden_size, config.num_attention_heads, config.q_lora_rank
        query_width = heads * (config.qk_head_dim + config.qk_pos_emb_head_dim)
        down = h * (config.kv_lora_rank + config.qk_pos_emb_head_dim) + (h * rank if rank is not None else 0)
        up = (rank if rank is not None else h) * query_width
        up += config.kv_lora_rank * heads * (config.qk_head_dim + config.v_head_dim)
        return down, up + heads * config.v_head_dim * h

    @classmethod
    def matmul_weights(cls, config: ModelConfig) -> int:
        return sum(cls._weights(config))

    @classmethod
    def attention_width(cls, config: ModelConfig) -> int:
        """Half of heads x (query/key width + value width): the scores run over the query width, their product with
        the values over the value width, where other attention counts one head width for both."""
        width = config.qk_head_dim + config.qk_pos_emb_head_dim + config.v_head_dim
        return config.num_attention_heads * width // 2

    @classmethod
    def activation_bytes(cls, config: ModelConfig, share: MicroBatchShare, selective: bool) -> float:
        """Per token (a: this rank's heads, w: bytes of the compute type, n, r, v: the query/key width without
        positions, the rotary width, the value width): the queries and keys 2·w·a·(n + r) and values w·a·v the core
        keeps, its output w·a·v, the log-sum-exp 4a (not under selective recomputation), with attention dropout on
        the reference kernel its fp32 probabilities and mask; on the replicated (under sequence parallelism,
        sharded) tokens each latent (`_latent_bytes`); the output dropout's mask. As a fused kernel runs it: on the
        CPU, values of another width than the queries fall back to SDPA's math kernel, which keeps more (s x s
        probabilities) than counted here."""
        w, a = share.width, config.num_attention_heads // share.tp
        n, r, v = config.qk_head_dim, config.qk_pos_emb_head_dim, config.v_head_dim
        per_token = 2 * w * a * (n + r) + 2 * w * a * v
        if not selective:
            per_token += 4 * a
        if config.attention_dropout > 0 and not share.flash_with_dropout and not selective:
            per_token += 12 * a * share.keys
        normed = config.qk_layernorm
        latents = _latent_bytes(share, config.kv_lora_rank, r, normed)
        if config.q_lora_rank is not None:
            latents += _latent_bytes(share, config.q_lora_rank, 0, normed)
        return per_token * share.tokens + latents * share.sharded_tokens + share.output_dropout(config)

    @classmethod
    def forward_work(cls, config: ModelConfig, share: MicroBatchShare) -> KindWork:
        """The down-projections on the replicated (sharded under sequence parallelism) tokens, the up and output
        projections / TP, and the scores and their product with the values over the keys each query computes."""
        down, split = cls._weights(config)
        linear = 2 * (share.sharded_tokens * down + share.tokens * split / share.tp)
        width = config.qk_head_dim + config.qk_pos_emb_head_dim + config.v_head_dim
        scores = 2 * share.tokens * share.computed_keys * config.num_attention_heads * width / share.tp
        return KindWork(linear, scores)


def _latent_bytes(share: MicroBatchShare, width: int, beside: int, normed: bool) -> float:
    """Bytes per token a latent of `width` features keeps, `beside` more features of the same down-projection's
    output beside it (the rotary key): the up-projection's input (a view, which keeps the whole output); under
    --qk-layernorm also the norm's output and statistics, or on the CPU its fp32 copies (the input's own where it is
    fp32 already)."""
    w = share.width
    if not normed:
        return w * (width + beside)
    if share.composite_rms_norm:
        return 8 * width + 4 + w * width + (4 * beside if w == 4 else 0)
    return w * (width + beside) + w * width + 4
