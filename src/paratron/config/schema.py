"""The typed configuration of a paratron run.

Each section is a dataclass; the string under each field is its documentation and
becomes that flag's `--help` text. Field names are unique across sections and follow
Megatron-LM's argument names where the setting is shared, so `--hidden-size`,
`hidden_size:` in YAML and `args.hidden_size` all mean the same thing.

Configs are frozen: once built and validated nothing changes them; a derived value (the
vocabulary size a tokenizer decides) makes a new config (`config.loading.override`).

Each fact has one typed field. A setting whose default follows from others (the MLP width, the key/value heads, the
head width) holds None only until its dataclass is built: `__post_init__` fills it in, so a built config always holds
the value in effect, and remembers which settings it derived. Those are written back as None by
`config.loading.config_to_dict` (so a saved config, or `override`, derives them again) and derived anew by
`ModelConfig.with_changes`; `dataclasses.replace` keeps every value as it is, derived ones included, so change a
setting others derive from with `with_changes`. Which layers hold experts (`ModelConfig.moe_layer_pattern`) is read
from --moe-layer-freq once, when the model config is built.

Limits live in each field's metadata (`ABOVE_ZERO`, `ZERO_OR_MORE`, `FRACTION`), which `config.validation` reads.
"""

from __future__ import annotations

import ast
import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal

from paratron.config.inference import InferenceConfig
from paratron.config.layer_pattern import LayerPattern, read_layer_pattern
from paratron.config.limits import ABOVE_ZERO, DERIVED, FRACTION, ZERO_OR_MORE
from paratron.config.vision import VisionSettings

LORA_TARGETS = ("qkv", "proj", "fc1", "fc2")
"""The layers --lora-targets may name (see ModelConfig.lora_targets)."""


def moe_layer_pattern(freq: str, num_layers: int) -> tuple[bool, ...]:
    """Which of `num_layers` layers --moe-layer-freq makes MoE layers: an integer N (every N-th, from the first), a
    list such as [0,1,1,1], or Megatron-LM's list expression such as ([0]*1+[1]*3); empty for anything else
    (`config.validation` refuses it)."""
    text = freq.strip()
    if text.lstrip("-").isdigit() and int(text) >= 1:
        return tuple(i % int(text) == 0 for i in range(num_layers))
    entries = _list_expression(text, num_layers) if "[" in text else None
    if entries is None or len(entries) != num_layers or any(e not in (0, 1) for e in entries):
        return ()
    return tuple(e == 1 for e in entries)


def _list_expression(text: str, num_layers: int) -> list[int] | None:
    """The list of integers a Python expression of integer lists, `+` and `*` makes (Megatron-LM evaluates
    --moe-layer-freq with Python; this reads only that arithmetic), or None for any other text or a list longer
    than the layers."""
    try:
        tree = ast.parse(text, mode="eval").body
    except SyntaxError:
        return None

    def value(node: ast.expr) -> int | list[int] | None:
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        if isinstance(node, ast.List):
            items = [value(item) for item in node.elts]
            return items if all(isinstance(item, int) for item in items) else None  # type: ignore[return-value]
        if not (isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Mult))):
            return None
        left, right = value(node.left), value(node.right)
        if isinstance(node.op, ast.Add) and isinstance(left, list) and isinstance(right, list):
            return left + right if len(left) + len(right) <= num_layers else None
        if isinstance(node.op, ast.Mult) and isinstance(left, int) != isinstance(right, int):
            items, times = (left, right) if isinstance(left, list) else (right, left)
            if isinstance(items, list) and isinstance(times, int) and len(items) * max(times, 0) <= num_layers:
                return items * times
        return None

    result = value(tree)
    return result if isinstance(result, list) else None


def _readable_pattern(text: str | None) -> LayerPattern | None:
    """--hybrid-layer-pattern read, or None when it is unset or not one paratron builds."""
    try:
        return read_layer_pattern(text) if text else None
    except ValueError:
        return None


@dataclass(frozen=True)
class ModelConfig(VisionSettings):
    """Transformer architecture (and, with a vision model, the image encoder and projector in front of it)."""

    model_name: str | None = None
    """Named size from the model registry (debug, gpt2-small, llama3-8b, ...); its values are defaults that the other
    model settings override."""

    num_layers: int = field(default=2, metadata=ABOVE_ZERO)
    """Number of Transformer layers (under --hybrid-layer-pattern: the pattern's layers; a different value given is
    ignored, with a warning, as Megatron-LM ignores it)."""

    hybrid_layer_pattern: str | None = None
    """The layers as a pattern, one symbol per residual sublayer (each with its own norm), as Megatron-LM's hybrid
    models give them: `*` attention, `-` MLP, `E` mixture of experts, `|` between pipeline stages; for example
    `*-*E|*-*E`. The pattern sets the layer count. Unset: --num-layers Transformer blocks, each attention then MLP
    (or mixture of experts). Megatron-LM's `M` (Mamba), `G` (gated DeltaNet), `+` (multi-latent attention), `D`
    (DeepSeek sparse attention) and `/` (multi-token prediction) are refused by name."""

    hidden_size: int = field(default=64, metadata=ABOVE_ZERO)
    """Width of the residual stream."""

    ffn_hidden_size: int = field(default=None, metadata={**ABOVE_ZERO, DERIVED: True})  # type: ignore[assignment]
    """Width of the MLP's inner layer (default: 4 x hidden size; with SwiGLU int(4 x hidden x 2/3 / 64) x 64, as
    Megatron-LM sizes it)."""

    num_attention_heads: int = field(default=4, metadata=ABOVE_ZERO)
    """Number of attention (query) heads."""

    group_query_attention: bool = False
    """Grouped-query attention with --num-query-groups key/value heads (default 1), as Megatron-LM's switch. On the
    command line --num-query-groups counts only with it (Megatron-LM ignores it otherwise, and so does paratron, with a
    warning); recipes, presets and Hugging Face imports may set num_query_groups alone."""

    num_query_groups: int = field(default=None, metadata={**ABOVE_ZERO, DERIVED: True})  # type: ignore[assignment]
    """Number of key/value heads for grouped-query attention (default: one per query head; 1 with
    --group-query-attention)."""

    kv_channels: int = field(default=None, metadata={**ABOVE_ZERO, DERIVED: True})  # type: ignore[assignment]
    """Width of each attention head (default: hidden size / attention heads)."""

    max_position_embeddings: int = field(default=1024, metadata=ABOVE_ZERO)
    """Longest sequence the model accepts (size of the learned position table)."""

    vocab_size: int | None = field(default=None, metadata=ABOVE_ZERO)
    """Vocabulary size; also the size a trained BPE tokenizer aims for (default: the tokenizer's size; a trained BPE
    aims for 8192; mock data uses 4096)."""

    position_embedding_type: Literal["learned_absolute", "rope", "none"] = "learned_absolute"
    """How positions are encoded: a learned table, rotary embeddings, or none (NoPE: causal attention alone tells
    tokens apart; Megatron-LM's 'none', and what --no-position-embedding means for a model without rotary
    embeddings)."""

    rotary_base: float = field(default=10000.0, metadata=ABOVE_ZERO)
    """Base (theta) of the rotary embedding frequencies."""

    rotary_percent: float = 1.0
    """Fraction of each head's width that gets rotary embeddings (Megatron-LM's --rotary-percent, default 1.0): the
    first int(head width x fraction) features of every query and key head rotate, with frequencies
    base^(-2i / that width); the rest pass through unchanged (GPT-NeoX / Pythia's partial rotary)."""

    rotary_interleaved: bool = False
    """Rotate interleaved pairs of features (0, 1), (2, 3), ... (RoFormer / GPT-J style) instead of the pairs
    (i, i + width/2) of the two halves (Llama / GPT-NeoX style, the default), as Megatron-LM's --rotary-interleaved."""

    normalization: Literal["LayerNorm", "RMSNorm"] = "LayerNorm"
    """Normalization layer used before attention, before the MLP and at the end."""

    norm_epsilon: float = field(default=1e-5, metadata=ABOVE_ZERO)
    """Epsilon of the normalization layers."""

    apply_layernorm_1p: bool = False
    """Zero-centred gamma (Megatron-LM's --apply-layernorm-1p, layernorm_zero_centered_gamma): every norm (LayerNorm
    or RMSNorm, the q/k norms included) stores its scale as w, starting at 0, and multiplies by 1 + w; the same
    function as a plain norm with scale 1 + w, but weight decay pulls the scale towards 1 rather than 0."""

    activation: Literal["gelu", "swiglu", "squared_relu"] = "gelu"
    """MLP activation: GELU, SwiGLU (gated, as in Llama; --swiglu) or squared ReLU, relu(x)^2 (not gated, as in
    Nemotron-4; --squared-relu)."""

    openai_gelu: bool = False
    """GELU in its tanh approximation (GPT-2's, Megatron-LM's --openai-gelu) instead of the exact erf form
    (Megatron-LM's default); the GPT-2 presets and Hugging Face GPT-2 imports set it."""

    add_bias_linear: bool = True
    """Give linear layers a bias (--disable-bias-linear turns it off)."""

    add_qkv_bias: bool = False
    """Give the query, key and value projections a bias even when other linear layers have none (Qwen2)."""

    qk_layernorm: bool = False
    """Normalize each head's queries and keys (the model's norm over the head dimension, before rotary embeddings), as
    Qwen3 does."""

    attention_output_gate: bool = False
    """Gate the attention output feature by feature with a sigmoid of the layer's input, before the output projection
    (the full-attention layers of Qwen3-Next): a fourth input projection beside the queries, keys and values."""

    multi_latent_attention: bool = False
    """Multi-latent attention (DeepSeek-V2/V3's MLA) in every attention layer: the keys and values of a token come
    from one latent of --kv-lora-rank features (up-projected per head), the queries from a latent of --q-lora-rank
    features or one full projection; each query and key head has --qk-head-dim features plus --qk-pos-emb-head-dim
    rotary ones (the rotary key one vector that every head shares), each value head --v-head-dim (--kv-channels is
    not used). With --qk-layernorm the latents are normalized, as DeepSeek's are. See docs/attention.md."""

    q_lora_rank: int | None = field(default=None, metadata=ABOVE_ZERO)
    """Multi-latent attention: width of the queries' latent (a projection down from the hidden size, a norm under
    --qk-layernorm, a projection up to the heads). Unset: the queries come from one full projection, as in
    DeepSeek-V2-Lite."""

    kv_lora_rank: int = field(default=32, metadata=ABOVE_ZERO)
    """Multi-latent attention: width of the latent the keys and values are projected up from (Megatron-LM's default
    32; DeepSeek-V3's is 512)."""

    qk_head_dim: int = field(default=128, metadata=ABOVE_ZERO)
    """Multi-latent attention: features of each query and key head without their rotary part (Hugging Face's
    qk_nope_head_dim)."""

    qk_pos_emb_head_dim: int = field(default=64, metadata=ABOVE_ZERO)
    """Multi-latent attention: the rotary features of each query and key head (Hugging Face's qk_rope_head_dim); the
    rotary key is one vector per token that every head shares."""

    v_head_dim: int = field(default=128, metadata=ABOVE_ZERO)
    """Multi-latent attention: features of each value head."""

    rope_type: Literal["rope", "yarn"] = field(default=None, metadata={DERIVED: True})  # type: ignore[assignment]
    """Rotary embeddings of multi-latent attention: plain (rope) or with YaRN's frequency interpolation (yarn:
    --rotary-scaling-factor, --original-max-position-embeddings, --beta-fast, --beta-slow, --mscale,
    --mscale-all-dim). Default: yarn with --multi-latent-attention, as in Megatron-LM (at --rotary-scaling-factor 1
    the same tables as rope), rope otherwise (other attention has rope only)."""

    rotary_scaling_factor: float = field(default=1.0, metadata=ABOVE_ZERO)
    """YaRN: how many times --original-max-position-embeddings the context is stretched to (DeepSeek-V3: 40); the
    slowest rotary frequencies are divided by it."""

    original_max_position_embeddings: int = field(default=4096, metadata=ABOVE_ZERO)
    """YaRN: the context length the rotary frequencies were first trained on; with --beta-fast and --beta-slow it
    decides which frequencies are kept and which are divided by the scaling factor. On Megatron-LM's command line
    --yarn-original-max-position-embeddings."""

    beta_fast: float = field(default=32.0, metadata=ABOVE_ZERO)
    """YaRN: frequencies that turn more than this many times over the original context are kept as they are; on
    Megatron-LM's command line --yarn-beta-fast."""

    beta_slow: float = field(default=1.0, metadata=ABOVE_ZERO)
    """YaRN: frequencies that turn fewer than this many times over the original context are divided by the scaling
    factor (between the two bounds a linear ramp mixes both); on Megatron-LM's command line --yarn-beta-slow."""

    mscale: float = 1.0
    """YaRN: the rotary tables are multiplied by m(--mscale) / m(--mscale-all-dim), where m(a) = 0.1 a ln(factor) + 1
    (a factor of 1 multiplies by 1)."""

    mscale_all_dim: float = 0.0
    """YaRN: the softmax scale of multi-latent attention is multiplied by m(this)^2 (see --mscale; 0 leaves it
    1/sqrt(query head width))."""

    untie_embeddings_and_output_weights: bool = False
    """Give the output layer its own weights instead of sharing the input embedding."""

    attention_type: Literal["causal", "sliding-window", "document", "block-sparse"] = "causal"
    """Which keys each token attends to: causal (every earlier token), sliding-window (the --window-size most recent
    ones), document (earlier tokens of its own packed document; the data marks documents as --reset-attention-mask
    does) or block-sparse (Child et al.'s strided pattern over --sparse-block-size blocks). See docs/attention.md."""

    window_size: int | None = field(default=None, metadata=ABOVE_ZERO)
    """Sliding-window attention: each token attends to itself and the W - 1 tokens before it (Mistral's
    sliding_window)."""

    sparse_block_size: int = field(default=64, metadata=ABOVE_ZERO)
    """Block-sparse attention: tokens per block."""

    sparse_stride: int = field(default=4, metadata=ABOVE_ZERO)
    """Block-sparse attention: a token attends to the S most recent blocks (its own included) and to every S-th block
    before them."""

    hidden_dropout: float = field(default=0.1, metadata=FRACTION)
    """Dropout probability on the embedding and the outputs of attention and MLP (Megatron-LM's default 0.1; the
    recipes and model presets set 0)."""

    attention_dropout: float = field(default=0.1, metadata=FRACTION)
    """Dropout probability on the attention weights (Megatron-LM's default 0.1; the recipes and model presets set
    0)."""

    apply_query_key_layer_scaling: bool = False
    """Megatron-LM's --apply-query-key-layer-scaling (for fp16): layer L computes its attention scores as
    q.k / (sqrt(head width) x L) in the compute precision, then multiplies them by L in fp32 before the fp32 softmax,
    so fp16 scores cannot overflow in deep layers (attention then runs unfused, as Megatron-LM's local attention, in
    fp16/bf16: more memory and time than the fused kernels). Implies --attention-softmax-in-fp32; in fp32 the numbers
    are those of plain attention."""

    attention_softmax_in_fp32: bool = False
    """Megatron-LM's --attention-softmax-in-fp32 (mask and softmax in fp32). paratron's fused attention
    (scaled_dot_product_attention) already keeps its softmax in fp32 in fp16/bf16, as Megatron-LM's default
    Transformer Engine attention does, so this is accepted and changes nothing; --apply-query-key-layer-scaling
    selects Megatron-LM's unfused attention with its fp32 softmax."""

    init_method_std: float = field(default=0.02, metadata=ABOVE_ZERO)
    """Standard deviation of the normal initial weights (output projections are scaled by 1/sqrt(2 x layers))."""

    make_vocab_size_divisible_by: int = field(default=128, metadata=ABOVE_ZERO)
    """The embedding and output layer hold the vocabulary padded to a multiple of this x TP, at every TP size
    (one process included), so the output matmul has a shape the hardware runs fast; padding rows are never
    predicted nor saved, so the loss and checkpoints are the unpadded model's. 1: no padding on one process."""

    num_experts: int | None = None
    """Mixture of experts: replace the dense MLP of the MoE layers (see --moe-layer-freq) by this many experts and a
    router (default: dense MLPs)."""

    moe_layer_freq: str = "1"
    """Which layers are MoE layers: an integer N (every N-th layer, counting from the first) or a list such as
    [0,1,1,1] (1 = MoE) with one entry per layer, also written as Megatron-LM's list expression ([0]*1+[1]*3)."""

    moe_ffn_hidden_size: int | None = None
    """Width of each expert's inner layer (default: --ffn-hidden-size)."""

    moe_router_topk: int = 2
    """Experts each token is routed to."""

    moe_router_score_function: Literal["softmax", "sigmoid"] = "softmax"
    """Router scores: softmax over experts (Mixtral, Qwen-MoE) or a sigmoid per expert (DeepSeek-V3)."""

    moe_router_pre_softmax: bool = False
    """With softmax scores: the softmax over all experts comes before the top-k (the chosen probabilities are not
    renormalised; Qwen2-MoE); otherwise over the top-k logits only (Mixtral)."""

    moe_router_topk_scaling_factor: float | None = None
    """Multiply the chosen experts' weights by this factor (DeepSeek-V3's routed scaling)."""

    moe_router_num_groups: int | None = None
    """Group-limited routing (DeepSeek-V2's device-limited and DeepSeek-V3's node-limited routing): the experts form
    this many equal groups of consecutive experts, and each token chooses its experts among the --moe-router-group-topk
    best groups only; set both (default: off, every expert is open to every token)."""

    moe_router_group_topk: int | None = None
    """Group-limited routing: the groups each token chooses, ranked by the sum of each group's best
    (--moe-router-topk / this) expert scores (expert bias included), before its top-k experts among their experts;
    set with --moe-router-num-groups."""

    moe_router_load_balancing_type: Literal["aux_loss", "seq_aux_loss", "none"] = "aux_loss"
    """Load-balancing loss: aux_loss (Switch Transformer's, over the micro-batch), seq_aux_loss (per sequence,
    DeepSeek-V2/V3) or none; weighted by --moe-aux-loss-coeff."""

    moe_aux_loss_coeff: float = 0.0
    """Weight of the load-balancing loss (0: none)."""

    moe_z_loss_coeff: float | None = None
    """Weight of the router z-loss, the mean squared log-sum-exp of the router logits (ST-MoE)."""

    moe_router_enable_expert_bias: bool = False
    """Aux-loss-free balancing (DeepSeek-V3): a per-expert bias added to the scores for choosing experts only, raised
    for under-loaded experts and lowered for over-loaded ones after every step."""

    moe_router_bias_update_rate: float = 1e-3
    """Step of the expert-bias update."""

    moe_expert_capacity_factor: float | None = None
    """Drop tokens beyond capacity = factor x tokens x top-k / experts per expert (default: dropless)."""

    moe_token_drop_policy: Literal["probs", "position"] = "probs"
    """With a capacity: drop an over-full expert's tokens of lowest probability (probs) or the last ones (position)."""

    moe_pad_expert_input_to_capacity: bool = False
    """With a capacity: pad every expert's input to the capacity (fixed shapes; the same numbers)."""

    moe_shared_expert_intermediate_size: int | None = None
    """Width of a shared expert that every token goes through beside the routed ones (Qwen-MoE, DeepSeek)."""

    moe_shared_expert_gate: bool = False
    """Scale the shared expert's output by a learned sigmoid gate of the token (Qwen-MoE)."""

    moe_grouped_gemm: bool = False
    """Run the experts' matmuls as one batched call over experts instead of a loop over them (the same results to
    rounding)."""

    lora_rank: int | None = None
    """Rank of LoRA adapters: freeze the base weights and train low-rank adapters W + (alpha / rank) B A on the layers
    named by --lora-targets (default: no adapters, every weight trains)."""

    lora_alpha: float = 16.0
    """LoRA scaling numerator: the adapter's output is multiplied by alpha / rank."""

    lora_targets: tuple[str, ...] = LORA_TARGETS
    """Layers that get LoRA adapters (on the command line separated by commas or spaces: qkv,proj): qkv (query, key
    and value projections), proj (attention output projection), fc1 (MLP up and gate projections), fc2 (MLP down
    projection)."""

    persist_layer_norm: bool | None = None
    """Run each RMSNorm (forward, and backward) as one compiled kernel instead of PyTorch's several elementwise ones
    (model/fused_ops.py; LayerNorm is one kernel already): the same numbers up to rounding. Unset: on where the model
    runs on an accelerator, off on the CPU, where compiling the kernel (C++, tens of seconds) costs a small run more
    than it saves. Under --compile the compiled blocks fuse it anyway. Megatron-LM's --no-persist-layer-norm turns it
    off."""

    apply_rope_fusion: bool | None = None
    """Rotate queries and keys (rotary embeddings) with one compiled kernel instead of PyTorch's several (slices, a
    concatenation, products; model/fused_ops.py): the same numbers up to rounding. Unset: on where the model runs on
    an accelerator, off on the CPU (see --persist-layer-norm). Megatron-LM's --no-rope-fusion turns it off."""

    bias_swiglu_fusion: bool | None = None
    """Compute SwiGLU's silu(gate) x up (forward and backward) as one compiled kernel (model/fused_ops.py): the same
    numbers up to rounding. Unset: on where the model runs on an accelerator, off on the CPU (see
    --persist-layer-norm). Megatron-LM's --no-bias-swiglu-fusion turns it off."""

    def __post_init__(self) -> None:
        """Fill in the settings left to their derived defaults (Megatron-LM's), and read --moe-layer-freq once."""
        derived = {name: value for name, value in self._derived_defaults().items() if getattr(self, name) is None}
        for name, value in derived.items():
            object.__setattr__(self, name, value)
        object.__setattr__(self, "_derived", frozenset(derived))
        pattern = _readable_pattern(self.hybrid_layer_pattern)
        if pattern is not None:  # (the pattern sets the layers; an unreadable one is refused by validation)
            object.__setattr__(self, "num_layers", pattern.num_layers)
            experts = tuple(symbol == "E" for symbol in pattern.symbols)
        else:
            experts = moe_layer_pattern(self.moe_layer_freq, self.num_layers)
        object.__setattr__(self, "_moe_layer_pattern", experts)
        object.__setattr__(self, "_layer_pattern", pattern)

    def _derived_defaults(self) -> dict[str, Any]:
        """The MLP width (4h; int(4h x 2/3 / 64) x 64 with SwiGLU, which keeps the parameter count of a 4h GELU MLP),
        the key/value heads (1 with --group-query-attention alone, else one per query head) and the head width."""
        swiglu = self.activation == "swiglu"
        return {
            "ffn_hidden_size": int(4 * self.hidden_size * 2 / 3 / 64) * 64 if swiglu else 4 * self.hidden_size,
            "num_query_groups": 1 if self.group_query_attention else self.num_attention_heads,
            "kv_channels": self.hidden_size // max(self.num_attention_heads, 1),
            "rope_type": "yarn" if self.multi_latent_attention else "rope",
            **self._vision_defaults(),
        }

    @property
    def derived(self) -> frozenset[str]:
        """The settings this config worked out itself (they were None when it was built)."""
        return self._derived  # type: ignore[attr-defined,no-any-return]

    @property
    def layer_pattern(self) -> LayerPattern | None:
        """--hybrid-layer-pattern read (None: unset, or one that validation refuses)."""
        return self._layer_pattern  # type: ignore[attr-defined,no-any-return]

    @property
    def moe_layer_pattern(self) -> tuple[bool, ...]:
        """Which layers are MoE layers (all False without experts; empty for a --moe-layer-freq that validation
        refuses)."""
        if not self.num_experts:
            return (False,) * self.num_layers
        return self._moe_layer_pattern  # type: ignore[attr-defined,no-any-return]

    def with_changes(self, **changes: Any) -> ModelConfig:
        """A copy with `changes`, the settings this config derived worked out again from the new values (unless
        `changes` sets them)."""
        return dataclasses.replace(self, **{**dict.fromkeys(self.derived), **changes})

    def architecture(self) -> dict[str, Any]:
        """Each MODEL_ARCHITECTURE setting's value in effect: a derived default worked out (the MLP width, the
        key/value heads, the head width) and a setting this model does not use (rotary settings without rotary
        embeddings, expert settings without experts, multi-latent attention's without it, vision settings without an
        encoder, the position table's size without one) None, so that two spellings of the same model compare
        equal."""
        rope, experts, mla = self.position_embedding_type == "rope", bool(self.num_experts), self.multi_latent_attention
        in_effect: dict[str, Any] = {
            "group_query_attention": self.num_query_groups,
            "max_position_embeddings": (
                self.max_position_embeddings if self.position_embedding_type == "learned_absolute" else None
            ),
            "moe_ffn_hidden_size": self.moe_ffn_hidden_size or self.ffn_hidden_size,
        }
        values = {name: in_effect.get(name, getattr(self, name)) for name in MODEL_ARCHITECTURE}
        for name in values:
            unused_vision = not self.has_vision and name in VisionSettings.__dataclass_fields__
            unused_rope, unused_mla = name.startswith("rotary_") and not rope, name in MLA_SETTINGS[1:] and not mla
            if unused_rope or (name.startswith("moe_") and not experts) or unused_vision or unused_mla:
                values[name] = None
        return values


MLA_SETTINGS: tuple[str, ...] = (
    "multi_latent_attention",
    "q_lora_rank",
    "kv_lora_rank",
    "qk_head_dim",
    "qk_pos_emb_head_dim",
    "v_head_dim",
    "rope_type",
    "rotary_scaling_factor",
    "original_max_position_embeddings",
    "beta_fast",
    "beta_slow",
    "mscale",
    "mscale_all_dim",
)
"""Multi-latent attention's settings (the switch first): the others are used by it alone."""

MODEL_ARCHITECTURE: tuple[str, ...] = (
    "num_layers",
    "hidden_size",
    "ffn_hidden_size",
    "num_attention_heads",
    "num_query_groups",
    "group_query_attention",
    "kv_channels",
    "max_position_embeddings",
    "vocab_size",
    "position_embedding_type",
    "rotary_base",
    "rotary_percent",
    "rotary_interleaved",
    "normalization",
    "norm_epsilon",
    "apply_layernorm_1p",
    "activation",
    "openai_gelu",
    "add_bias_linear",
    "add_qkv_bias",
    "qk_layernorm",
    "attention_output_gate",
    *MLA_SETTINGS,
    "hybrid_layer_pattern",
    "untie_embeddings_and_output_weights",
    "num_experts",
    "moe_layer_freq",
    "moe_ffn_hidden_size",
    "moe_router_topk",
    "moe_router_score_function",
    "moe_router_pre_softmax",
    "moe_router_topk_scaling_factor",
    "moe_router_num_groups",
    "moe_router_group_topk",
    "moe_router_enable_expert_bias",
    "moe_shared_expert_intermediate_size",
    "moe_shared_expert_gate",
    "vision_type",
    "img_h",
    "img_w",
    "patch_dim",
    "vision_num_layers",
    "vision_hidden_size",
    "vision_num_attention_heads",
    "vision_ffn_hidden_size",
    "vision_norm_epsilon",
    "vision_pooling_head",
    "vision_feature_layer",
    "vision_feature_select",
    "vision_projection",
    "vision_projection_bias",
    "image_token_id",
)
"""Model settings that define the architecture: the shapes of the weights and the function they compute. A run that
loads a checkpoint takes them from it, and refuses a different value from a flag, the recipe or --model
(`config.loading`); compared as `ModelConfig.architecture` works them out."""

MODEL_ADJUSTABLE: tuple[str, ...] = (
    "model_name",
    "persist_layer_norm",
    "apply_rope_fusion",
    "bias_swiglu_fusion",
    "attention_type",
    "window_size",
    "sparse_block_size",
    "sparse_stride",
    "hidden_dropout",
    "attention_dropout",
    "apply_query_key_layer_scaling",
    "attention_softmax_in_fp32",
    "init_method_std",
    "make_vocab_size_divisible_by",
    "moe_router_load_balancing_type",
    "moe_aux_loss_coeff",
    "moe_z_loss_coeff",
    "moe_router_bias_update_rate",
    "moe_expert_capacity_factor",
    "moe_token_drop_policy",
    "moe_pad_expert_input_to_capacity",
    "moe_grouped_gemm",
    "lora_rank",
    "lora_alpha",
    "lora_targets",
    "vision_model",
    "add_image_token",
    "freeze_vision_model",
    "freeze_language_model",
)
"""Model settings a run may change from its checkpoint's: the registry name (only a source of defaults), which keys
each token attends to (a mask over the same weights, e.g. document masking for packed fine-tuning data), dropout,
numerics that compute the same function (fp32 softmax, query-key layer scaling), initialisation (the weights are
loaded), vocabulary padding under tensor parallelism, the experts' balancing losses and capacity, kernels and LoRA
adapters. Without a flag they too keep the checkpoint's values."""

MODEL_PER_RUN: tuple[str, ...] = ("add_image_token", "freeze_vision_model", "freeze_language_model")
"""Model settings that say what one run trains, not what the model is: a run that loads a checkpoint does not take
them from it (a stage-2 run after a projector-only stage 1 trains what its own flags say)."""


@dataclass(frozen=True)
class ParallelConfig:
    """How the run is spread over processes."""

    nproc_per_node: int = field(default=1, metadata=ABOVE_ZERO)
    """Processes to start on this machine; paratron train launches itself under torchrun when this is above 1
    (--nproc)."""

    nnodes: int = field(default=1, metadata=ABOVE_ZERO)
    """Machines in the job; run paratron train on each with its --node-rank (under Slurm, read from SLURM_*)."""

    node_rank: int = field(default=0, metadata=ZERO_OR_MORE)
    """This machine's place among --nnodes (0 hosts the rendezvous with --master-addr)."""

    master_addr: str | None = None
    """Address of node 0, where the nodes meet (static rendezvous, as torchrun's --master-addr)."""

    master_port: int = field(default=29500, metadata=ABOVE_ZERO)
    """Port on --master-addr where the nodes meet."""

    rdzv_endpoint: str | None = None
    """HOST:PORT of torchrun's c10d rendezvous instead of --master-addr: nodes join in any order, and restart together
    after a failure (--max-restarts)."""

    rdzv_id: str | None = None
    """Name of the job at the rendezvous, the same on every node (default: SLURM_JOB_ID, else fixed)."""

    rdzv_timeout_seconds: float = field(default=900.0, metadata=ABOVE_ZERO)
    """How long a node waits at the rendezvous for the others before giving up (then exit 2)."""

    max_restarts: int = field(default=0, metadata=ZERO_OR_MORE)
    """Restart the job this many times when a process dies; each restart resumes from the newest intact checkpoint
    in --save (--save-interval bounds the lost work)."""

    tensor_model_parallel_size: int = field(default=1, metadata=ABOVE_ZERO)
    """Tensor-parallel degree: ranks that split each layer's matrices."""

    pipeline_model_parallel_size: int = field(default=1, metadata=ABOVE_ZERO)
    """Pipeline-parallel degree: ranks the layers are cut across."""

    pipeline_schedule: Literal["1f1b", "gpipe", "interleaved", "zb-h1", "zb-v"] | None = None
    """Pipeline schedule: 1f1b (the default), gpipe (all forwards, then all backwards), interleaved (1F1B over virtual
    stages; the default when they are set), zb-h1 (zero bubble: weight gradients deferred into the bubble) or zb-v
    (zero bubble over two chunks per rank placed as a V)."""

    num_layers_per_virtual_pipeline_stage: int | None = field(default=None, metadata=ABOVE_ZERO)
    """Layers per virtual stage: each pipeline rank runs several non-adjacent chunks of this many layers (interleaved
    schedule)."""

    virtual_pipeline_model_parallel_size: int | None = field(default=None, metadata=ABOVE_ZERO)
    """Model chunks (virtual stages) per pipeline rank; an alternative to --num-layers-per-virtual-pipeline-stage."""

    decoder_first_pipeline_num_layers: int | None = field(default=None, metadata=ABOVE_ZERO)
    """Layers on the first pipeline stage (it also holds the embeddings); the others share the rest evenly."""

    decoder_last_pipeline_num_layers: int | None = field(default=None, metadata=ABOVE_ZERO)
    """Layers on the last pipeline stage (it also holds the output layer and loss); the others share the rest evenly."""

    account_for_embedding_in_pipeline_split: bool = False
    """Count the input embedding as one layer of the first pipeline stage when cutting the layers into stages: the
    (layers + 1) are cut evenly, so the first stage (the first chunk of rank 0 with virtual stages) runs one decoder
    layer fewer, perhaps none."""

    account_for_loss_in_pipeline_split: bool = False
    """Count the output layer and loss as one layer of the last pipeline stage when cutting the layers into stages:
    the last stage (the last chunk of the last rank with virtual stages) runs one decoder layer fewer, perhaps none."""

    variable_seq_lengths: bool = False
    """Send each pipeline message's shape ahead of it, for micro-batches whose sequence length varies."""

    sequence_parallel: bool = False
    """Split activations along the sequence between tensor-parallel layers (norms and dropout run on shards; needs TP >
    1)."""

    context_parallel_size: int = field(default=1, metadata=ABOVE_ZERO)
    """Context-parallel degree: ranks that split every sequence (each holds chunks i and 2CP - 1 - i of 2CP, which
    balances causal attention) and pass keys and values between them."""

    cp_comm_type: Literal["p2p", "all_gather"] = "p2p"
    """How context-parallel ranks attend across chunks: p2p (a ring passes key/value blocks, each transfer overlapped
    with the previous block's attention) or all_gather (every rank gathers all keys and values first)."""

    expert_model_parallel_size: int = 1
    """Expert-parallel degree: each rank holds num-experts / EP of every MoE layer's experts. The experts' grid
    (expert TP x EP x expert DP) is folded over each pipeline stage's TP x CP x DP ranks as Megatron-Core folds it, so
    EP x expert TP must divide them; EP may span tensor- and context-parallel ranks and exceed DP."""

    expert_tensor_parallel_size: int | None = None
    """Tensor-parallel degree of the experts (each split like a dense MLP over that many ranks): default the
    tensor-parallel size; 1 for whole experts. Any size whose product with EP divides a stage's TP x CP x DP ranks.
    A dense model accepts it and ignores it, as Megatron-LM does."""

    moe_token_dispatcher_type: Literal["alltoall", "allgather"] = "allgather"
    """How tokens reach the ranks of their experts under expert parallelism: alltoall (each routed copy sent to its
    expert's rank, uneven splits) or allgather (every rank gathers all tokens, outputs reduce-scattered back;
    Megatron-LM's default)."""

    ddp_bucket_size: int | None = field(default=None, metadata=ABOVE_ZERO)
    """Gradient elements per data-parallel reduction bucket (default: max(40M, 1M x data-parallel size), as in
    Megatron-LM)."""

    overlap_grad_reduce: bool = False
    """Start each gradient bucket's reduction as soon as backward has filled it, behind the rest of backward."""

    ddp_sync_every_micro_batch: bool = False
    """Reduce gradients after every micro-batch instead of only after the last one of a step (more traffic; ZeRO-2
    always does)."""

    grad_reduce_in_bf16: bool = False
    """Keep gradients in bf16 and reduce them over the data-parallel ranks in bf16 (bf16 training only): half the
    gradient buffer's memory and half the bytes each reduction moves, at the cost of bf16 rounding in the micro-batch
    accumulation and the cross-rank sum. Master weights, optimizer state and the gradient norm stay fp32. Off (the
    default), gradients are accumulated and reduced in fp32, Megatron-LM's --accumulate-allreduce-grads-in-fp32."""

    zero_stage: Literal[0, 1, 2, 3] = 0
    """ZeRO stage: 0 replicates everything; 1 shards optimizer state and master weights; 2 also gradients; 3 also
    parameters (PyTorch FSDP2). Megatron-LM's --use-distributed-optimizer (a flag, or use_distributed_optimizer: true
    in a recipe or a saved config) means stage 1 when no other stage is given."""

    overlap_param_gather: bool = False
    """With the distributed optimizer, gather each bucket's updated parameters behind the next forward (waited for by
    the first layer that uses them). At --zero-stage 3 FSDP2 always gathers the next block's parameters ahead."""

    def gradient_bucket_size(self, data_parallel_size: int) -> int:
        """Gradient elements per reduction bucket: --ddp-bucket-size, or Megatron-LM's max(40M, 1M x DP)."""
        return self.ddp_bucket_size or max(40_000_000, 1_000_000 * data_parallel_size)

    distributed_backend: Literal["auto", "nccl", "xccl", "gloo"] = "auto"
    """Collective backend; auto picks the one torch pairs with the machine's accelerator (NCCL for CUDA and ROCm,
    XCCL for Intel XPU, gloo for Apple MPS) and gloo on the CPU."""

    distributed_timeout_minutes: float = field(default=10.0, metadata=ABOVE_ZERO)
    """How long a collective may wait for the other ranks (raise it when rank 0 tokenizes a large corpus first); a
    training step or save that makes no progress for this long is reported by every rank (which operation, which group,
    which ranks did not arrive) and the job ends."""


LAUNCH_FIELDS = (
    "nproc_per_node",
    "nnodes",
    "node_rank",
    "master_addr",
    "master_port",
    "rdzv_endpoint",
    "rdzv_id",
    "rdzv_timeout_seconds",
    "max_restarts",
)
"""Settings of the launcher (where processes start and meet), not of the run they train."""


@dataclass(frozen=True)
class OptimizerConfig:
    """Optimizer and gradient clipping."""

    optimizer: Literal["adam", "sgd"] = "adam"
    """Optimizer: adam (AdamW, decoupled weight decay) or sgd (with momentum)."""

    lr: float = field(default=3e-4, metadata=ZERO_OR_MORE)
    """Peak learning rate."""

    weight_decay: float = field(default=0.01, metadata=ZERO_OR_MORE)
    """Decoupled weight decay, applied to matrices and embeddings, not to biases or norms."""

    adam_beta1: float = field(default=0.9, metadata=FRACTION)
    """Adam's first-moment decay."""

    adam_beta2: float = field(default=0.999, metadata=FRACTION)
    """Adam's second-moment decay (Megatron-LM's default; the recipes set 0.95)."""

    adam_eps: float = field(default=1e-8, metadata=ZERO_OR_MORE)
    """Adam's epsilon."""

    sgd_momentum: float = field(default=0.9, metadata=ZERO_OR_MORE)
    """SGD momentum."""

    clip_grad: float = field(default=1.0, metadata=ZERO_OR_MORE)
    """Clip gradients to this global L2 norm (0 turns clipping off)."""

    decoupled_lr: float | None = None
    """A separate peak learning rate for the input embedding and the output layer (their own parameter groups,
    following the same schedule shape, warmup from --lr-warmup-init); unset: they use --lr."""

    decoupled_min_lr: float | None = None
    """With --decoupled-lr: the minimum learning rate of the embedding and output layer (default: --min-lr); no
    effect without --decoupled-lr, as in Megatron-LM."""


@dataclass(frozen=True)
class LRScheduleConfig:
    """Learning-rate schedule (Megatron-LM's OptimizerParamScheduler): linear warmup from --lr-warmup-init to --lr,
    then decay to --min-lr. It is counted in samples: a step's rate is that of the samples the steps before it
    trained (iteration flags count --global-batch-size samples per step), so the first step runs at
    --lr-warmup-init when there is a warmup."""

    lr_warmup_iters: int = field(default=0, metadata=ZERO_OR_MORE)
    """Iterations of linear warmup from --lr-warmup-init to the peak --lr (iteration-based runs; default 0)."""

    lr_decay_iters: int | None = field(default=None, metadata=ABOVE_ZERO)
    """Iterations over which the rate decays to --min-lr, warmup included (iteration-based runs; default:
    --train-iters)."""

    lr_decay_style: Literal["constant", "linear", "cosine", "inverse-square-root", "WSD"] = "linear"
    """Shape of the decay after warmup (Megatron-LM's default linear): constant (stay at --lr), linear or cosine (to
    --min-lr at the end of decay), inverse-square-root (--lr x sqrt(warmup / samples), not below --min-lr) or WSD
    (warmup-stable-decay: --lr until the last --lr-wsd-decay-iters/samples of decay, then --lr-wsd-decay-style)."""

    min_lr: float = field(default=0.0, metadata=ZERO_OR_MORE)
    """Learning rate at the end of decay (and after it)."""

    lr_warmup_fraction: float | None = None
    """Warmup length as a fraction of the decay length (of --lr-decay-iters or --lr-decay-samples); replaces
    --lr-warmup-iters / --lr-warmup-samples, which must then be 0 (default: unset)."""

    lr_warmup_samples: int = 0
    """Samples of linear warmup (sample-based runs, with --train-samples; default 0)."""

    lr_decay_samples: int | None = None
    """Samples over which the rate decays to --min-lr, warmup included (sample-based runs; default:
    --train-samples)."""

    lr_warmup_init: float = 0.0
    """Learning rate the warmup starts from (default 0.0)."""

    lr_wsd_decay_style: Literal["exponential", "linear", "cosine", "minus_sqrt"] = "exponential"
    """With --lr-decay-style WSD: the shape of the final annealing to --min-lr (default exponential:
    min + (max - min) x (2 x 0.5^progress - 1))."""

    lr_wsd_decay_samples: int | None = None
    """With --lr-decay-style WSD in sample-based runs: samples of the final annealing (required there)."""

    lr_wsd_decay_iters: int | None = None
    """With --lr-decay-style WSD in iteration-based runs: iterations of the final annealing (required there)."""

    use_checkpoint_opt_param_scheduler: bool = False
    """On resume, take the schedule (--lr, --min-lr, warmup and decay lengths, decay style) from the checkpoint's
    settings instead of the flags. Without it and without --override-opt-param-scheduler a resume whose flags change
    them goes on with the flags' and says which differ (Megatron-LM refuses it); either way the schedule goes on from
    the samples the checkpoint's steps trained."""

    override_opt_param_scheduler: bool = False
    """On resume, take the schedule from the flags even where they differ from the checkpoint's (Megatron-LM's
    --override-opt-param-scheduler); the schedule still goes on from the samples the checkpoint's steps trained."""


@dataclass(frozen=True)
class DataConfig:
    """What the model trains on."""

    data_path: list[str] = field(default_factory=list)
    """Megatron-LM's form: PREFIX... or WEIGHT PREFIX... (a blend); PREFIX.bin/.idx come from `paratron preprocess`.
    Text or jsonl files and directories in its place are preprocessed into the cache first. Cut into
    train/valid/test by --split."""

    train_data_path: list[str] = field(default_factory=list)
    """Training data, as --data-path but used whole (instead of --data-path and --split)."""

    valid_data_path: list[str] = field(default_factory=list)
    """Validation data, as --data-path but used whole."""

    test_data_path: list[str] = field(default_factory=list)
    """Test data, as --data-path but used whole."""

    corpus: Literal["stdlib"] | None = None
    """Built-in corpus to train on instead of --data-path: stdlib is the Python standard library's own source, present
    wherever Python is."""

    mock_data: bool = False
    """Train on deterministic synthetic tokens instead of a corpus."""

    split: str = "969,30,1"
    """Relative sizes of the train, validation and test splits."""

    seq_length: int = field(default=64, metadata=ABOVE_ZERO)
    """Tokens per training sample."""

    tokenizer_type: (
        Literal[
            "ByteLevelBPE",
            "HuggingFaceTokenizer",
            "GPT2BPETokenizer",
            "GPTSentencePieceTokenizer",
            "Llama2Tokenizer",
            "TikTokenizer",
            "NullTokenizer",
        ]
        | None
    ) = None
    """ByteLevelBPE trains a byte-level BPE on the text (cached); HuggingFaceTokenizer loads --tokenizer-model (a
    tokenizer.json or its folder); GPT2BPETokenizer loads --vocab-file and --merge-file; GPTSentencePieceTokenizer and
    Llama2Tokenizer load a SentencePiece --tokenizer-model; TikTokenizer loads Megatron's tiktoken JSON vocabulary
    (--tokenizer-model); NullTokenizer reads token ids (--vocab-size). Unset: GPT2BPETokenizer when --vocab-file or
    --merge-file is given (as Megatron-LM's pretrain_gpt.py), else ByteLevelBPE."""

    tokenizer_model: str | None = None
    """The tokenizer file: a Hugging Face tokenizer.json or a folder holding one (HuggingFaceTokenizer), a
    SentencePiece .model (GPTSentencePieceTokenizer, Llama2Tokenizer), or Megatron's tiktoken vocabulary .json
    (TikTokenizer)."""

    vocab_file: str | None = None
    """GPT-2 vocab.json (for GPT2BPETokenizer; given without --tokenizer-type, it implies GPT2BPETokenizer)."""

    merge_file: str | None = None
    """GPT-2 merges.txt (for GPT2BPETokenizer; given without --tokenizer-type, it implies GPT2BPETokenizer)."""

    tiktoken_pattern: Literal["v1", "v2"] | None = None
    """TikTokenizer's pre-tokenization regex, Megatron-LM's v1 or v2 (unset: v2, as Megatron-LM's tokenizer library;
    --legacy-tokenizer needs it given)."""

    tiktoken_num_special_tokens: int = 1000
    """TikTokenizer: ids 0..N-1 are special tokens (the named ones, then <SPECIAL_i> fillers); the vocabulary file's
    ranks follow, shifted by N (Megatron-LM's default 1000)."""

    tiktoken_special_tokens: list[str] | None = None
    """TikTokenizer's named special tokens, ids in this order (Megatron-LM's older spelling of
    --tokenizer-special-tokens; default <unk> <s> </s> <mask> <pad> <cls> <sep>, with --legacy-tokenizer <unk> <s>
    </s>)."""

    tokenizer_special_tokens: list[str] | None = None
    """TikTokenizer's named special tokens (as --tiktoken-special-tokens, which it overrides); other tokenizer types
    refuse it."""

    legacy_tokenizer: bool = False
    """Megatron-LM's older tokenizer classes (megatron/training/tokenizer) instead of its tokenizer library:
    Llama2Tokenizer then starts every document with <s>, and TikTokenizer reads special-token text in documents as
    plain text and names only <unk> <s> </s> by default."""

    vocab_extra_ids: int = 0
    """Megatron-LM's T5/BERT sentinel tokens (<extra_id_i>); GPT training has none, so only 0 is accepted."""

    data_cache_path: str | None = None
    """Where trained tokenizers, preprocessed corpora and sample indices are cached (default: $PARATRON_CACHE or
    ~/.cache/paratron)."""

    sft: bool = False
    """Supervised fine-tuning: --data-path names .jsonl conversations (or `paratron preprocess --sft` output), rendered
    with --chat-template; only assistant turns are trained; per-token loss by default."""

    chat_template: str = "tokenizer"
    """With --sft: tokenizer (the Hugging Face tokenizer's own chat_template, from tokenizer_config.json or
    chat_template.jinja beside its tokenizer.json), chatml, llama3, or a path to a jinja file."""

    sft_pack: bool = True
    """With --sft: pack several conversations into each sequence, each attending only to itself with positions from 0
    (else one conversation per sequence, padded)."""

    sft_truncation: Literal["truncate", "error"] = "truncate"
    """With --sft: cut a conversation longer than --seq-length, or refuse it (error)."""

    truncate: bool = True
    """With --sft: cut conversations longer than --seq-length (counted in the run's summary), else refuse them."""

    def truncation(self) -> Literal["truncate", "error"]:
        """What becomes of a conversation longer than --seq-length: "error" under --no-truncate or --sft-truncation
        error."""
        return "error" if not self.truncate else self.sft_truncation

    image_folder: str | None = None
    """With a vision model: the folder the image paths of the --data-path files are relative to (default: each file's
    own folder)."""

    image_processor: str | None = None
    """With a vision model: a Hugging Face processor_config.json or preprocessor_config.json (or their folder) saying
    how images become pixel values (default: the one beside the tokenizer, which checkpoints keep, else the encoder
    family's: CLIP's or SigLIP's)."""

    use_tiling: bool = False
    """With a vision model: cut each image into tiles of the encoder's size on the grid closest to its aspect ratio
    (Megatron-LM's dynamic resolution); each tile is one image's worth of tokens."""

    max_num_tiles: int = field(default=1, metadata=ABOVE_ZERO)
    """With --use-tiling: at most this many tiles per image."""

    use_thumbnail: bool = False
    """With --use-tiling: also the whole image, resized, after its tiles (when there is more than one tile)."""

    reset_position_ids: bool = False
    """Pretraining: restart positions at 0 after each end-of-document token (Megatron-LM's flag)."""

    reset_attention_mask: bool = False
    """Pretraining: tokens attend only within their own document (Megatron-LM's flag)."""

    eod_mask_loss: bool = False
    """Pretraining: do not train the prediction made at an end-of-document token (Megatron-LM's flag)."""

    num_workers: int = 0
    """Worker processes that read and collate the training micro-batches ahead of the step (a torch DataLoader, as
    Megatron-LM's --num-workers; its default is 2, paratron's 0 reads them in the training process). The batches are
    the same either way."""

    dataloader_type: Literal["single", "cyclic", "external"] = "single"
    """Order of the samples: single reads them once in order from the consumed count (Megatron-LM's
    MegatronPretrainingSampler); cyclic reshuffles the built samples every epoch as Megatron-LM's
    MegatronPretrainingRandomSampler (seeded by the epoch, per data-parallel bucket with --data-sharding); external
    (a user-built loader) is refused."""

    data_sharding: bool = True
    """With --dataloader-type cyclic: each data-parallel rank shuffles its own contiguous share of the samples
    (Megatron-LM's default); --no-data-sharding shuffles them all and deals them out to the ranks in turn."""

    fim_data: bool = False
    """Fill-in-the-middle pretraining samples for code models (Megatron-LM's --fim-data, after Bavarian et al.
    2022): with probability --fim-rate a sample's text between end-of-document tokens is cut at two random
    characters into prefix, middle and suffix and rewritten as <prefix> prefix <suffix> suffix <middle> middle (PSM)
    or, with probability --fim-spm-rate, <prefix> <suffix> suffix <middle> prefix middle (SPM), then cut or padded
    back to the sample's length. Each sample draws from its own random stream, seeded by (--seed, its index), so the
    samples are the same at every layout and after a resume. The tokenizer must have the sentinel tokens
    (--fim-prefix-token ...)."""

    fim_rate: float = 0.5
    """With --fim-data: the probability that a document (a fragment's file, with --fim-split-sample) is rewritten."""

    fim_spm_rate: float = 0.5
    """With --fim-data: the probability that a rewritten document takes the SPM order rather than PSM."""

    fim_split_sample: str | None = None
    """With --fim-data: a token (a repository's file separator, say) that cuts each document into fragments; with
    probability --fim-rate the document's fragments are each rewritten with probability --fim-fragment-rate."""

    fim_fragment_rate: float | None = None
    """With --fim-split-sample: the probability that each fragment is rewritten."""

    fim_no_prefix: str | None = None
    """With --fim-data: documents (fragments) whose text starts with this string are left as they are."""

    fim_prefix_token: str = "<fim_prefix>"
    """With --fim-data: the tokenizer's token that opens the prefix."""

    fim_middle_token: str = "<fim_middle>"
    """With --fim-data: the tokenizer's token that opens the middle."""

    fim_suffix_token: str = "<fim_suffix>"
    """With --fim-data: the tokenizer's token that opens the suffix."""

    fim_pad_token: str = "<fim_pad>"
    """With --fim-data: the tokenizer's token that pads a sample the rewriting made shorter."""

    fim_eod_token: str | None = None
    """With --fim-data: the token that separates documents in a sample (unset: the tokenizer's end-of-document
    token; Megatron-LM's default names <|endoftext|>)."""

    mmap_bin_files: bool = True
    """Memory-map the .bin token files; --no-mmap-bin-files reads each sequence with a file read instead (Megatron-LM's
    flag; the same tokens either way)."""

    create_attention_mask_in_dataloader: bool = True
    """Accepted for Megatron-LM scripts: paratron's loader never builds a [seq, seq] attention mask (causal and
    document masking come from positions and segment ids inside attention), so --no-create-attention-mask-in-dataloader
    changes nothing."""

    @property
    def resolved_tokenizer_type(self) -> str:
        """--tokenizer-type, or what its absence means: GPT2BPETokenizer with --vocab-file/--merge-file (Megatron-LM's
        pretrain_gpt.py default), else ByteLevelBPE."""
        if self.tokenizer_type is not None:
            return self.tokenizer_type
        return "GPT2BPETokenizer" if self.vocab_file or self.merge_file else "ByteLevelBPE"

    def blend_flags(self) -> list[tuple[list[str], str]]:
        """The data-path settings that are set, with their flag names."""
        return [
            (values, flag)
            for values, flag in (
                (self.data_path, "--data-path"),
                (self.train_data_path, "--train-data-path"),
                (self.valid_data_path, "--valid-data-path"),
                (self.test_data_path, "--test-data-path"),
            )
            if values
        ]


MEGATRON_EVAL_ITERS = 100
"""Megatron-LM's --eval-iters, pretraining's default."""


@dataclass(frozen=True)
class TrainingConfig:
    """The training loop."""

    micro_batch_size: int = field(default=4, metadata=ABOVE_ZERO)
    """Samples per micro-batch on each data-parallel rank."""

    global_batch_size: int | None = field(default=None, metadata=ABOVE_ZERO)
    """Samples per optimizer step over all ranks; micro-batches accumulate up to it (default: micro batch x
    data-parallel size)."""

    train_iters: int = field(default=100, metadata=ABOVE_ZERO)
    """Optimizer steps to train for (with --train-samples: derived from it, this value is replaced)."""

    train_samples: int | None = None
    """Train on this many samples instead of --train-iters steps (Megatron-LM's sample-based training): the steps are
    --train-samples // --global-batch-size (a partial last batch is dropped), or those of the batch ramp with
    --rampup-batch-size. Sample-based runs take --lr-warmup-samples / --lr-decay-samples / --lr-wsd-decay-samples
    instead of the iteration flags. Needs --global-batch-size."""

    rampup_batch_size: list[str] = field(default_factory=list)
    """START INCREMENT SAMPLES: the global batch starts at START samples and grows by INCREMENT every
    SAMPLES / ((--global-batch-size - START) / INCREMENT) consumed samples until it reaches --global-batch-size
    after SAMPLES samples (Megatron-LM's batch-size ramp; sample-based runs only). Each batch is a multiple of
    --micro-batch-size x data-parallel size (more micro-batches per step); the data order is unchanged."""

    step_batch_size_schedule: list[str] = field(default_factory=list)
    """"THRESHOLD:BATCH ...", e.g. "0:768 250B:1536": train global batches of BATCH samples once THRESHOLD tokens
    have been consumed (THRESHOLD // --seq-length samples; suffixes K, M, B, T), starting at threshold 0 (Megatron-LM's
    step schedule, in place of --rampup-batch-size; one quoted word or several). --global-batch-size is the last BATCH
    (give it only equal to that); every BATCH must be a multiple of --micro-batch-size x data-parallel size.
    Iteration- or sample-based; a --train-samples run's partial last batch is still a step."""

    def step_schedule_text(self) -> str | None:
        """--step-batch-size-schedule as one string, None when not given."""
        return " ".join(self.step_batch_size_schedule) or None

    def rampup(self) -> tuple[int, int, int] | None:
        """--rampup-batch-size as (start, increment, samples), None when not given (ValueError when malformed)."""
        if not self.rampup_batch_size:
            return None
        values = tuple(int(v) for v in self.rampup_batch_size)
        if len(values) != 3:
            raise ValueError("expected three integers")
        return values[0], values[1], values[2]

    precision: Literal["fp32", "bf16", "fp16"] = "fp32"
    """Compute precision. --bf16 and --fp16 keep the model's weights in 16 bits with fp32 master weights, fp32
    gradients (bf16 with --grad-reduce-in-bf16) and fp32 optimizer state; fp16 adds loss scaling."""

    fp8_format: Literal["e4m3", "hybrid"] | None = None
    """Run the transformer layers' linear matmuls in fp8 (with --bf16), through torchao's float8 training: e4m3 for
    every tensor, or hybrid (e4m3 forward, e5m2 for the gradients). Needs fp8 matmuls (CUDA compute capability 8.9 or
    newer: Ada, Hopper, Blackwell) and torchao installed; refused elsewhere."""

    fp8_recipe: Literal["tensorwise", "rowwise"] = "tensorwise"
    """With --fp8-format: how fp8 scales are chosen, one per tensor (tensorwise) or one per row (rowwise, more
    accurate, slower)."""

    fp8_param_gather: bool = False
    """With --fp8-format under --zero-stage 3: all-gather the fp8 layers' weights in fp8 (cast on each rank's
    shard, half the bytes of bf16), not in bf16 (torchao's float8 all-gather; tensorwise recipe)."""

    loss_scale: float | None = field(default=None, metadata=ABOVE_ZERO)
    """With --fp16: a static loss scale (a power of two); unset, the scale is dynamic (see --initial-loss-scale)."""

    initial_loss_scale: float = field(default=2.0**32, metadata=ABOVE_ZERO)
    """With --fp16: the dynamic loss scale to start from; it halves on overflows and doubles after --loss-scale-window
    clean steps."""

    min_loss_scale: float = field(default=1.0, metadata=ABOVE_ZERO)
    """With --fp16: the dynamic loss scale never goes below this."""

    loss_scale_window: int = field(default=1000, metadata=ABOVE_ZERO)
    """With --fp16: steps without overflow after which the dynamic loss scale doubles."""

    hysteresis: int = field(default=2, metadata=ABOVE_ZERO)
    """With --fp16: overflows tolerated (steps skipped without lowering the scale) before the dynamic loss scale
    halves; refilled when the scale grows."""

    seed: int = 1234
    """Seed of weights, data order and dropout; the same seed gives the same run at every layout."""

    eval_interval: int = field(default=100, metadata=ABOVE_ZERO)
    """Evaluate on the validation split every this many steps (and at the end)."""

    eval_iters: int | None = field(default=None, metadata=ZERO_OR_MORE)
    """Global batches per evaluation; 0: none. Unset: with --sft the whole validation split, each sample scored once
    per evaluation; otherwise Megatron-LM's 100."""

    def eval_batches(self, sft: bool) -> int | None:
        """Global batches per evaluation: --eval-iters; unset, None with `sft` (the whole validation split once)
        and Megatron-LM's 100 otherwise."""
        if self.eval_iters is not None:
            return self.eval_iters
        return None if sft else MEGATRON_EVAL_ITERS

    calculate_per_token_loss: bool | None = None
    """A step's loss is the sum of the token losses of the whole global batch divided by its trained tokens (default
    with --sft); otherwise the mean over micro-batches of each one's mean token loss (Megatron-LM's default)."""

    cross_entropy_loss_fusion: bool = False
    """Compute the output layer and the cross-entropy together over chunks of tokens (model/fused_loss.py), so that
    training and evaluation never hold the whole fp32 logits and their gradient: the same losses and gradients, much
    less memory at a large vocabulary. Under tensor parallelism each rank runs its vocabulary slice (as the
    vocabulary-parallel loss does); under pipeline parallelism the last stage runs it, under ZeRO-3 on the gathered
    output weight. Generation still computes logits."""

    exit_signal_handler: bool = False
    """On SIGTERM or SIGINT, finish the current step, save a checkpoint (with --save) and exit with code 0."""

    exit_duration_in_mins: float | None = field(default=None, metadata=ABOVE_ZERO)
    """Stop after the first step that ends this many minutes after training started, saving a checkpoint (with
    --save)."""

    exit_interval: int | None = field(default=None, metadata=ABOVE_ZERO)
    """Stop after a step whose number is a multiple of this, saving a checkpoint (with --save)."""

    on_nan: Literal["stop", "skip", "rollback"] = "stop"
    """When a step's gradients are not finite (a NaN or infinite loss or gradient; fp16 overflow is the loss scaler's):
    the step is not applied, the first module whose output or gradient went non-finite is named, and then stop (exit
    2), skip (go on with the next batch) or rollback (reload the newest checkpoint of --save and go on without the
    offending batch)."""

    loss_spike_zscore: float | None = field(default=None, metadata=ABOVE_ZERO)
    """Treat a step whose loss lies more than this many standard deviations above the mean of the last
    --loss-spike-window steps' losses as a loss spike and act on it as --on-spike says (off by default; 4 to 6 is
    usual). Judged only once the window is full."""

    loss_spike_window: int = field(default=50, metadata=ABOVE_ZERO)
    """With --loss-spike-zscore: the number of recent steps whose losses give the mean and standard deviation a
    step's loss is measured against (spikes themselves are left out of it)."""

    on_spike: Literal["warn", "skip", "rollback"] = "warn"
    """With --loss-spike-zscore, after a loss spike: warn (name the step, its loss and z-score, and apply it), skip
    (do not apply the step; go on with the next batch) or rollback (reload the newest checkpoint of --save and go on
    without the offending batch), as --on-nan does."""

    check_for_nan_in_loss_and_grad: bool = True
    """Check every step's gradient norm for NaN or infinity and act on it as --on-nan says (the default, as in
    Megatron-LM). --no-check-for-nan-in-loss-and-grad turns the check off as Megatron-LM does: a non-finite step is
    applied like any other (the weights may turn NaN) and only the logged loss shows it."""

    deterministic_mode: bool = False
    """Choose deterministic algorithms (torch.use_deterministic_algorithms; on CUDA also CUBLAS_WORKSPACE_CONFIG
    :4096:8 unless set, and NCCL_ALGO Ring unless set): slower, for debugging. CPU runs are deterministic already;
    Megatron-LM's --deterministic-mode."""

    manual_gc: bool = False
    """Turn Python's automatic garbage collector off for the run and collect only every --manual-gc-interval steps
    (and around each evaluation), on every rank at the same step, so collections do not stall ranks at different
    times (Megatron-LM's --manual-gc)."""

    manual_gc_interval: int = 0
    """With --manual-gc: collect garbage after every this many steps (0: only around evaluations)."""

    manual_gc_eval: bool = True
    """With --manual-gc: also collect at the start and end of each evaluation (--no-manual-gc-eval: not)."""

    empty_unused_memory_level: Literal[0, 1, 2] = 0
    """Return the device allocator's unused cached memory to the device: 1 after each forward-backward pass and
    after each evaluation, 2 also after each optimizer step (fights fragmentation, costs speed; Megatron-LM's
    torch.cuda.empty_cache levels). No effect on the CPU, which has no such cache."""

    fault_inject: list[str] = field(default_factory=list)
    """Faults for drills and tests, RANK:STEP:KIND each, KIND one of crash (the process dies by SIGKILL), hang (it
    stops answering), nan (its forward output turns NaN), slow (it sleeps 2 s) or spike (its logits are scaled by 30
    for that step, so the loss jumps; a rank of the last pipeline stage); the first fires in the first run, the next
    after the first restart, and so on."""

    recompute_granularity: Literal["full", "selective"] | None = None
    """Recompute activations in backward instead of keeping them: full (whole layers, see --recompute-method) or
    selective (the attention core only)."""

    recompute_method: Literal["uniform", "block"] | None = None
    """With full recomputation: uniform (layers in groups of --recompute-num-layers, only each group's input kept) or
    block (only the first --recompute-num-layers layers of each pipeline chunk recomputed)."""

    recompute_num_layers: int | None = field(default=None, metadata=ABOVE_ZERO)
    """Layers per recomputed group (uniform) or recomputed layers per pipeline chunk (block); default 1 for uniform."""

    compile: bool = False
    """Compile each transformer block with torch.compile (regional compilation: blocks of one shape share one graph,
    compiled during the first step; the log says how long it took and how many graphs and graph breaks it made)."""

    compile_backend: str = "inductor"
    """torch.compile's backend for --compile: inductor (generated kernels), or aot_eager / eager to check tracing
    without code generation."""


@dataclass(frozen=True)
class CheckpointConfig:
    """Saving and resuming."""

    save: str | None = None
    """Directory to save checkpoints into."""

    load: str | None = None
    """Checkpoint directory to resume from (its newest checkpoint)."""

    save_interval: int | None = field(default=None, metadata=ABOVE_ZERO)
    """Save every this many steps (a final checkpoint is always written when --save is set)."""

    finetune: bool = False
    """Load only the weights from --load and start at step 0 with a fresh optimizer and data order."""

    async_save: bool = False
    """Write checkpoints in a background thread: training goes on after the weights and optimizer state are copied; the
    checkpoint is published (tracker moved) before the next save and at the end."""

    keep_last: int | None = field(default=None, metadata=ABOVE_ZERO)
    """Keep only the newest this many checkpoints under --save, deleting older ones after each save (default: keep
    all)."""

    save_retain_interval: int | None = field(default=None, metadata=ABOVE_ZERO)
    """Keep only the newest checkpoint and those of steps that are multiples of this, deleting the others after each
    save (Megatron-LM's flag; with --keep-last, both rules delete)."""

    no_load_optim: bool = False
    """Resume from --load at its step, but with a fresh optimizer state (e.g. at another tensor-parallel size)."""

    no_load_rng: bool = False
    """Resume from --load without its random-generator states: dropout and other draws start again from --seed (as
    after a change of layout)."""

    ckpt_format: Literal["torch", "torch_dist", "fsdp_dtensor", "paratron"] | None = None
    """Format of --load: detected when unset; Megatron-LM's torch (legacy), torch_dist and fsdp_dtensor (Megatron
    FSDP's; weights and counters, not its optimizer state) are read (converted once into the data cache, see
    docs/megatron-checkpoints.md); paratron always saves its own format."""

    auto_detect_ckpt_format: bool = False
    """Accepted for Megatron-LM compatibility: the format of --load is always detected."""


@dataclass(frozen=True)
class LoggingConfig:
    """What the run reports and where."""

    run_dir: str = "runs/latest"
    """Directory for metrics.jsonl, TensorBoard events and the loss plot."""

    log_interval: int = field(default=100, metadata=ABOVE_ZERO)
    """Log metrics every this many steps (Megatron-LM's default)."""

    progress_bar: bool | None = None
    """Show a live progress bar on rank 0 (log lines are printed either way). Unset: only when rank 0's output and
    error streams are both terminals, so that a log file (Slurm, nohup, a redirect) gets no bar redrawn into it;
    --progress-bar shows it wherever the output goes."""

    tensorboard: bool = True
    """Write TensorBoard event files into the run directory."""

    peak_tflops: float | None = field(default=None, metadata=ABOVE_ZERO)
    """Peak TFLOP/s of one device for MFU (default: a table for known GPUs, a quick matmul probe on CPU)."""

    log_memory: bool = False
    """Measure each rank's memory on the first step (parameters, gradients, master weights, optimizer state,
    activations saved for backward) and write memory.json in the run directory."""

    log_expert_load: bool = False
    """With experts: keep every logged step's tokens per expert of each MoE layer and draw them as a heatmap
    (expert_load.png, with expert_load.json) in the run directory."""

    profile_pipeline: bool = False
    """Time every pipeline operation of the last step: per-rank Chrome traces (Perfetto) and a PNG timeline in the run
    directory."""

    sample_prompt: str | None = None
    """After training, print a continuation of this prompt."""

    sample_tokens: int = field(default=48, metadata=ABOVE_ZERO)
    """Tokens generated for --sample-prompt."""

    sample_temperature: float = field(default=0.7, metadata=ZERO_OR_MORE)
    """Sampling temperature for --sample-prompt (0: greedy); sampling draws from the top 40 tokens with the run's
    seed."""

    tensorboard_dir: str | None = None
    """Write TensorBoard events (and --profile traces) to this directory (default: RUN_DIR/tensorboard)."""

    tensorboard_log_interval: int = 1
    """Write a logged step's scalars to TensorBoard (and wandb) only when the step is a multiple of this. paratron
    logs every --log-interval steps, so the effective interval is the least common multiple of both (Megatron-LM
    writes every such step)."""

    tensorboard_queue_size: int = 1000
    """Events the TensorBoard writer queues before it flushes them to disk (SummaryWriter's max_queue)."""

    log_params_norm: bool = False
    """Log the L2 norm of all trained parameters (the fp32 master weights where there are some) after the step, as
    params_norm: the norm of the whole single-device model, every shard counted once, whatever the layout."""

    log_num_zeros_in_grad: bool = False
    """Log the number of zero entries in the step's gradients over the whole model (every shard counted once), as
    num_zeros_in_grad."""

    log_throughput: bool = False
    """Add Megatron-LM's 'throughput per GPU (TFLOP/s/GPU)' to the log line, and throughput (TFLOP/s per device)
    to metrics.jsonl, TensorBoard and wandb."""

    log_validation_ppl_to_tensorboard: bool = False
    """Also write the validation perplexity exp(loss) to TensorBoard and wandb, as valid/ppl (eval.jsonl always has
    val_ppl)."""

    log_timers_to_tensorboard: bool = False
    """Write iteration-time and the --timing-log-level timers (seconds per step) to TensorBoard and wandb."""

    timing_log_level: Literal[0, 1, 2] = 0
    """Timers measured in each step (perf_counter around the parts, the device synchronized at each boundary): 0
    iteration time only; 1 also forward-backward (gradient reduction included), all-grads-sync, the optimizer
    (optimizer-unscale-and-check-inf, optimizer-clip-main-grad, optimizer-count-zeros, optimizer-inner-step,
    optimizer-copy-main-to-model-params); 2 also batch-generator. Logged as NAME-time (seconds per step averaged
    over the log interval) in metrics.jsonl and a log line."""

    timing_log_option: Literal["minmax", "max", "all"] = "minmax"
    """How timers are reported across ranks: minmax (NAME-time-min and NAME-time, the max), max, or all (one value
    per rank)."""

    log_memory_to_tensorboard: bool = False
    """Log the device's memory at each logged step: mem_allocated_bytes, mem_max_allocated_bytes and
    mem_reserved_bytes from the accelerator's allocator; on the CPU the process's resident set (now and peak)."""

    log_loss_scale_to_tensorboard: bool = True
    """With --fp16: write the loss scale to TensorBoard (--no-log-loss-scale-to-tensorboard: not)."""

    log_world_size_to_tensorboard: bool = False
    """Log the number of ranks as world_size."""

    log_learning_rate_to_tensorboard: bool = True
    """Write the learning rate to TensorBoard and wandb (metrics.jsonl always has lr)."""

    log_batch_size_to_tensorboard: bool = True
    """Log the global batch size as batch_size."""

    log_progress: bool = False
    """Append to progress.txt in --save: a line when the job starts and one per saved checkpoint with the job's and
    the cumulative throughput (TFLOP/s per device), the floating-point operations and tokens so far (Megatron-LM's
    format)."""

    log_layer_stats: int = field(default=0, metadata=ZERO_OR_MORE)
    """Every this many steps, record per layer the activation RMS and largest magnitude, the gradient norm, the
    update-to-weight ratio (and, for MoE layers, the router's entropy) in metrics.jsonl and TensorBoard, under
    single-device layer names at any layout (0: off)."""

    straggler_threshold: float | None = field(default=None, metadata=ABOVE_ZERO)
    """Time every rank's step and, per process group, the time it waits in collectives; every log interval name the
    ranks whose compute time is more than this fraction above the median (0.2: 20% slower) and the groups they delay
    (off by default: timing the collectives costs a device synchronization around each on GPUs)."""

    dump_batches: int = field(default=0, metadata=ZERO_OR_MORE)
    """Write the first this many global training batches, decoded as text with their loss masks and document
    boundaries, to batches.txt (and batches.jsonl) in the run directory before training starts (0: none)."""

    debug_capture: str | None = None
    """Write every module's forward output and every parameter's gradient of each step, under single-device names, to
    this folder (what `paratron debug compare` reads; its runs set it)."""

    debug_capture_elements: int = field(default=4096, metadata=ABOVE_ZERO)
    """With --debug-capture: the most elements kept of each captured tensor (a fixed, layout-independent sample of
    its single-device elements when it holds more)."""

    profile: bool = False
    """Record a PyTorch profiler trace (CPU activity, and CUDA activity on GPUs) of steps [--profile-step-start,
    --profile-step-end) on the --profile-ranks, written as a Chrome trace (Perfetto, chrome://tracing, TensorBoard's
    profiler) profile_rank{R}_steps{S}-{E}.pt.trace.json in the TensorBoard directory. (Megatron-LM's --profile
    without --use-pytorch-profiler drives nsys instead.)"""

    profile_step_start: int = 10
    """With --profile: the first step profiled."""

    profile_step_end: int = 12
    """With --profile: the step profiling stops before (not profiled)."""

    profile_ranks: tuple[int, ...] = (0,)
    """With --profile: the global ranks that record a trace."""

    use_pytorch_profiler: bool = False
    """Accepted for Megatron-LM compatibility: paratron's --profile always uses the PyTorch profiler."""

    wandb_project: str | None = None
    """Also log every scalar to Weights & Biases in this project (needs `pip install wandb`). Offline unless
    WANDB_MODE is set (WANDB_MODE=online to sync live)."""

    wandb_exp_name: str | None = None
    """The wandb run's name (default: the run directory's name)."""

    wandb_save_dir: str | None = None
    """Where wandb keeps its files (default: RUN_DIR/wandb)."""

    wandb_entity: str | None = None
    """The wandb entity (team or user) the project belongs to."""


@dataclass(frozen=True)
class PlanningConfig:
    """Checking and choosing the parallel layout before (or instead of) training."""

    dry_run: bool = False
    """Validate the run for --world-size ranks without starting them: build every distinct rank's part of the model on
    the meta device through the real parallelization and print its memory (weights, gradients, master weights,
    optimizer state, activations, communication buffers) against the device memory."""

    world_size: int | None = field(default=None, metadata=ABOVE_ZERO)
    """Ranks the --dry-run (or --auto) plans for (default: --nproc, or torchrun's world)."""

    hardware: str | None = None
    """Hardware preset for --dry-run, --auto and paratron plan: h100-80g, a100-80g, h200-141g, gb200 (B200 in a GB200
    NVL72 rack), or cpu (measured on the spot); sets the device memory, peak throughput and network speeds."""

    device_memory_gb: float | None = field(default=None, metadata=ABOVE_ZERO)
    """Memory of one device in GB (10^9 bytes) that --dry-run and paratron plan check each rank against (default: the
    --hardware preset's)."""

    plan_images_per_sample: int = field(default=1, metadata=ABOVE_ZERO)
    """With a vision model: images per sample that --dry-run, --auto and paratron plan price, the vision encoder's
    activations and compute on the first pipeline stage growing with them (a micro-batch of b samples runs b x this
    many images through the encoder)."""

    auto: bool = False
    """Choose the parallel layout (tensor, context, pipeline and data parallelism, virtual stages, micro-batch size,
    recomputation, ZeRO stage, schedule) with the planner for this machine and world size, then train with it; the
    layout flags given are replaced."""

    calibration: str | None = None
    """A `paratron doctor --output FILE.json` report of the cluster: paratron plan and --auto price layouts with its
    measured network bandwidths and latencies (inside a node and between nodes), matmul TFLOP/s and device memory in
    place of the --hardware preset's (figures it did not measure stay the preset's; flags given win over it), and
    --dry-run checks against its device memory."""


@dataclass(frozen=True)
class Config:
    """A whole run: one dataclass per section."""

    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    lr_schedule: LRScheduleConfig = field(default_factory=LRScheduleConfig)
    data: DataConfig = field(default_factory=DataConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    planning: PlanningConfig = field(default_factory=PlanningConfig)
    inference: InferenceConfig = field(default_factory=InferenceConfig)


SECTIONS: tuple[str, ...] = (
    "model",
    "parallel",
    "optimizer",
    "lr_schedule",
    "data",
    "training",
    "checkpoint",
    "logging",
    "planning",
    "inference",
)
