"""Megatron-LM's flags added after megatron-core 0.16.1 (and older ones that Megatron-LM main's example
scripts carry), each looked at and classified: accepted without effect (`RECENT_ACCEPTED`) or refused
with the reason (`RECENT_REFUSED`). Those that became
settings live in the schema (`--step-batch-size-schedule`, `--chat-template`) or in `config.megatron`'s
`SWITCHES`. `config.megatron` merges these tables into its own; `Accepted` and `Refused` are the
entries of both.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Accepted:
    """A Megatron-LM flag that picks an implementation detail with no effect on paratron's numbers."""

    meaning: str
    """What it does in Megatron-LM."""
    why: str
    """Why it changes nothing in paratron, and what paratron does instead."""
    nargs: int | str = 0
    """Values it takes: 0 (a switch), 1, or argparse's "*" / "+"."""
    noted: bool = False
    """Whether `adjust_like_megatron` is told it was given (to check it as Megatron-LM does)."""


@dataclass(frozen=True)
class Refused:
    """A Megatron-LM flag of a feature paratron does not have."""

    meaning: str
    reason: str


_KERNEL = "paratron has no such kernel or fusion to choose; its unfused computation gives the same numbers"
_TIMING = "Only moves work in time or onto another stream; paratron computes the same numbers"
_CKPT = (
    "Tunes Megatron-LM's distributed checkpoint writer or reader; paratron writes its own sharded checkpoints "
    "(each rank its shard, any layout loads them)"
)
_ASYNC = "Tunes Megatron-LM's asynchronous checkpoint process; paratron's --async-save writes from a background thread"
_DISPATCH = (
    "Tunes a token-dispatcher backend's kernels (DeepEP, HybridEP, NCCL EP); paratron's dispatcher routes the same "
    "tokens to the same experts"
)
_FSDP = (
    "Tunes Megatron FSDP's buffers; paratron shards with PyTorch FSDP2 (--zero-stage 3) and computes the same update"
)
_PROFILE = "Only what a profiler records; see --profile for paratron's PyTorch-profiler traces"
_FLIGHT = "A debugging aid for hung NCCL collectives; no numbers change (PyTorch's TORCH_NCCL_* variables still work)"
_STASH = (
    "Memory management of the expert activations kept for backward; paratron keeps them as ordinary autograd tensors"
)

RECENT_ACCEPTED: dict[str, Accepted] = {
    "flash-attention-version": Accepted("Pin FlashAttention 2, 3 or 4.", _KERNEL + ".", 1),
    "fused-residual-rmsnorm": Accepted("Fuse the residual add with RMSNorm's backward.", _KERNEL + "."),
    "use-transformer-engine-op-fuser": Accepted("Let Transformer Engine fuse operations.", _KERNEL + "."),
    "use-grouped-gemm-for-shared-expert": Accepted("Run the shared expert as a one-group grouped GEMM.", _KERNEL + "."),
    "use-grouped-gemm-for-dense-mlp": Accepted("Run the dense MLP as a one-group grouped GEMM.", _KERNEL + "."),
    "mla-down-proj-fusion": Accepted("Fuse multi-latent attention's down-projections and input norm.", _KERNEL + "."),
    "yarn-correction-range-round-to-int": Accepted(
        "YaRN: round the correction range's ends to whole features (Megatron-LM's default).", "paratron always does."
    ),
    "moe-use-grouped-tensor": Accepted("Transformer Engine's GroupedTensor path for grouped GEMMs.", _KERNEL + "."),
    "moe-single-grouped-weight": Accepted("Store the experts' weights as one grouped parameter.", _KERNEL + "."),
    "moe-single-grouped-bias": Accepted("Store the experts' biases as one grouped parameter.", _KERNEL + "."),
    "mlp-chunks-for-training": Accepted(
        "Compute the MLP in chunks along the sequence.",
        "The MLP acts on each token alone, so chunks compute the same numbers; paratron runs it whole.",
        1,
    ),
    "use-gigatoken": Accepted(
        "A faster implementation of the tokenizer.", "The same tokens either way; paratron uses its own tokenizers."
    ),
    "tokenizer-hf-no-use-fast": Accepted(
        "Use Hugging Face's slow (Python) tokenizer.", "Slow and fast tokenizers give the same token ids."
    ),
    "overlap-dispatch-backward-with-experts-wgrad": Accepted(
        "Compute the experts' weight gradients on a side stream, overlapping the dispatch's backward.", _TIMING + "."
    ),
    "high-priority-a2a-comm-stream": Accepted("Give the all-to-all stream high CUDA priority.", _TIMING + "."),
    "no-align-grad-reduce": Accepted("Let each pipeline stage start its gradient reduction alone.", _TIMING + "."),
    "disable-align-grad-reduce": Accepted("Another spelling of --no-align-grad-reduce.", _TIMING + "."),
    "optimizer-cuda-graph": Accepted("Capture the optimizer step in a CUDA graph.", _TIMING + ".", 0),
    "cuda-graph-modules": Accepted("Which parts of a layer CUDA graphs capture.", _TIMING + ".", "+"),
    "moe-permute-fusion-into-hybridep": Accepted("Fuse the permutation into HybridEP's dispatch.", _DISPATCH + "."),
    "moe-hybridep-num-blocks-permute": Accepted("HybridEP's thread blocks for permuting.", _DISPATCH + ".", 1),
    "moe-hybridep-num-blocks-unpermute": Accepted("HybridEP's thread blocks for unpermuting.", _DISPATCH + ".", 1),
    "moe-hybridep-num-sms-preprocessing": Accepted("HybridEP's SMs for its metadata scan.", _DISPATCH + ".", 1),
    "moe-hybridep-pad-uneven-dispatch-inputs": Accepted("Pad uneven HybridEP inputs.", _DISPATCH + "."),
    "moe-flex-dispatcher-num-sms": Accepted("SMs of the flex dispatcher's communication.", _DISPATCH + ".", 1),
    "moe-ncclep-zero-copy": Accepted("NCCL EP's symmetric-memory zero-copy path.", _DISPATCH + "."),
    "moe-paged-stash": Accepted("Keep the experts' saved activations in pages.", _STASH + "."),
    "moe-paged-stash-page-size": Accepted("Tokens per page of the paged stash.", _STASH + ".", 1),
    "moe-paged-stash-buffer-size-factor-cuda": Accepted("Size of the paged stash's GPU buffer.", _STASH + ".", 1),
    "moe-paged-stash-buffer-size-factor-cpu": Accepted("Size of the paged stash's host buffer.", _STASH + ".", 1),
    "async-ckpt-cpu-priority": Accepted("CPU nice value of the asynchronous checkpoint writer.", _ASYNC + ".", 1),
    "async-ckpt-io-priority": Accepted("I/O class of the asynchronous checkpoint writer.", _ASYNC + ".", 1),
    "dist-ckpt-workers": Accepted("Worker processes of an asynchronous distributed save.", _ASYNC + ".", 1),
    "ckpt-fully-parallel-load-exchange-algo": Accepted("How ranks exchange what they read.", _CKPT + ".", 1),
    "ckpt-fully-parallel-load-per-rank-objects": Accepted("Each rank reads its own small objects.", _CKPT + "."),
    "ckpt-fully-parallel-save-process-group": Accepted("Group that shares a parallel save.", _CKPT + ".", 1),
    "ckpt-fully-parallel-load-process-group": Accepted("Group that shares a parallel load.", _CKPT + ".", 1),
    "ckpt-pg-tensors-cache-path": Accepted("Cache of which rank saves which tensor.", _CKPT + ".", 1),
    "ckpt-pg-tensors-cache-create": Accepted("Create that cache rather than read it.", _CKPT + "."),
    "no-ckpt-load-validate-sharding-integrity": Accepted("Skip checking the shards cover every tensor.", _CKPT + "."),
    "disable-ckpt-load-validate-sharding-integrity": Accepted("Another spelling of the flag above.", _CKPT + "."),
    "ckpt-drop-redundant-extra-state": Accepted("Do not save Transformer Engine's empty extra state.", _CKPT + "."),
    "no-save-tokenizer-assets": Accepted(
        "Do not copy the tokenizer's files into the checkpoint.",
        "paratron's checkpoints record the tokenizer settings in their config; the numbers are the same.",
    ),
    "disable-save-tokenizer-assets": Accepted("Another spelling of --no-save-tokenizer-assets.", "As that flag."),
    "ddp-param-name-patterns-for-fp32-local-accumulation": Accepted(
        "Accumulate the named parameters' gradients in fp32.", "paratron accumulates every gradient in fp32.", "+"
    ),
    "megatron-fsdp-version": Accepted("Which Megatron FSDP implementation.", _FSDP + ".", 1),
    "megatron-fsdp-enable-fine-grained-param-gather": Accepted("Gather parameters in finer pieces.", _FSDP + "."),
    "megatron-fsdp-max-pool-double-buffer": Accepted("Another allocator for double buffering.", _FSDP + "."),
    "fsdp-db-use-persist-buf-on-alloc-fail": Accepted("Keep modules outside the double buffer.", _FSDP + "."),
    "pytorch-profiler-collect-shapes": Accepted("Record tensor shapes in the profile.", _PROFILE + "."),
    "pytorch-profiler-collect-callstack": Accepted("Record call stacks in the profile.", _PROFILE + "."),
    "pytorch-profiler-collect-chakra": Accepted("Record a Chakra trace.", _PROFILE + "."),
    "record-shapes": Accepted("Record tensor shapes in NVTX ranges for Nsight.", _PROFILE + "."),
    "nvtx-ranges": Accepted("Mark NVTX ranges for Nsight.", _PROFILE + "."),
    "otel-enabled": Accepted("Send OpenTelemetry traces and metrics.", "Telemetry only; it changes no numbers."),
    "otel-service-name": Accepted("OpenTelemetry service name.", "Telemetry only; it changes no numbers.", 1),
    "otel-span-groups": Accepted(
        "Which OpenTelemetry spans are recorded.", "Telemetry only; it changes no numbers.", 1
    ),
    "gpu-sniff-test-interval": Accepted(
        "Every N steps, time GEMMs and collectives on every rank to find slow GPUs.",
        "A health check, not part of training; paratron names stragglers from its step timings (docs/debugging.md).",
        1,
    ),
    "exit-signal-handler-for-training": Accepted(
        "Shut training down quietly on SIGINT or SIGTERM.",
        "Only how a signal ends the run; --exit-signal-handler also finishes the step and saves a checkpoint.",
    ),
    "enable-msc": Accepted(
        "Read and write msc:// object-storage paths through the Multi-Storage Client.",
        "paratron reads and writes local or mounted paths; for those the flag changes nothing.",
    ),
    "flight-recorder-dump-path": Accepted("Where NCCL flight-recorder traces go.", _FLIGHT + ".", 1),
    "flight-recorder-trace-buffer-size": Accepted("Size of the flight recorder's buffer.", _FLIGHT + ".", 1),
    "flight-recorder-include-stack-trace": Accepted("Stack traces in flight-recorder dumps.", _FLIGHT + "."),
    "no-flight-recorder-dump-on-timeout": Accepted("No flight-recorder dump on an NCCL timeout.", _FLIGHT + "."),
    "disable-flight-recorder-dump-on-timeout": Accepted("Another spelling of the flag above.", _FLIGHT + "."),
    "no-flight-recorder-include-only-active": Accepted("Dump finished operations too.", _FLIGHT + "."),
    "disable-flight-recorder-include-only-active": Accepted("Another spelling of the flag above.", _FLIGHT + "."),
    "no-flight-recorder-extra-dump-on-exec": Accepted("No extra dump on execution.", _FLIGHT + "."),
    "disable-flight-recorder-extra-dump-on-exec": Accepted("Another spelling of the flag above.", _FLIGHT + "."),
    # older flags, met in Megatron-LM main's scripts
    "moe-permute-fusion": Accepted("Fuse the MoE dispatch's permutation kernels.", _KERNEL + "."),
    "logging-level": Accepted(
        "Python logging level of Megatron-LM's own messages.", "Only what Megatron-LM prints; it changes no numbers.", 1
    ),
}
"""Flags new since megatron-core 0.16.1 accepted because they cannot change what paratron computes."""

FP8_REASON = (
    "paratron's fp8 training is torchao's float8 layers (--fp8-format, --fp8-recipe), which have no such setting"
)
_DSA = "DeepSeek sparse attention (DSA) is not implemented; see docs/attention.md for the attentions paratron has"
LINEAR_REASON = "linear-attention layers are not implemented; see docs/attention.md for the attentions paratron has"
_MTP = "multi-token prediction is not implemented; paratron trains the next-token loss only"
_MUP = "muP is not implemented"
_MHC = "hyper-connections (several residual streams) are not implemented; paratron has one residual stream"
_GTP = "weight sharding beyond --tensor-model-parallel-size (GTP) is not implemented; weights shard over TP ranks only"
_OFFLOAD = "activation offloading to the CPU is not implemented; --recompute-granularity saves activation memory"
_OPTIM = "--optimizer is adam or sgd; Muon and Lion are not implemented"
_HYBRID = "Mamba and hybrid layer stacks are not implemented; paratron trains Transformer layers"
_INFERENCE = (
    "a setting of Megatron-LM's inference engine, which training does not start; `paratron generate` and "
    "`paratron serve` have their own settings (docs/inference.md)"
)
_RL = "reinforcement learning is not implemented"
_DISTILL = "logit distillation (saving and training on a teacher's logits) is not implemented"
_FAULTS = "use --fault-inject RANK:STEP:nan|crash|hang|slow to inject faults"
_TRACE = "router decision traces are not written; metrics.jsonl records each step's MoE load balance"
_YARN = "paratron's YaRN rounds the correction range's ends to whole features (Megatron-LM's and transformers' default)"
_GLU = "paratron keeps the gate and up projections of a GLU apart; a block-interleaved layout is not implemented"

RECENT_REFUSED: dict[str, Refused] = {
    "fp8-output-proj": Refused("Run the output layer in MXFP8.", FP8_REASON),
    "moe-dispatch-fwd-dtype": Refused(
        "Precision of the tokens the MoE dispatch sends (bf16 or mxfp8).",
        "the dispatch's wire precision is not selectable; paratron sends tokens in the model's dtype",
    ),
    "moe-combine-bwd-dtype": Refused(
        "Precision of the gradients the MoE combine sends back (bf16 or mxfp8).",
        "the combine's wire precision is not selectable; paratron sends gradients in the model's dtype",
    ),
    "output-logit-dtype": Refused(
        "Precision of the output layer's GEMM (bf16 or fp32).",
        "the output layer's precision is not selectable; it computes in the training precision",
    ),
    "dsa-indexer-topk-freq": Refused("DSA: layers between top-k computations of the indexer.", _DSA),
    "dsa-indexer-skip-topk-offset": Refused("DSA: layer offset of shared top-k.", _DSA),
    "dsa-kernel-backend": Refused("DSA: fused kernel backend.", _DSA),
    "dsa-indexer-rope-interleaved": Refused("DSA: interleaved rotary embedding of the indexer.", _DSA),
    "no-dsa-indexer-rotate-activation": Refused("DSA: no Hadamard rotation in the indexer.", _DSA),
    "disable-dsa-indexer-rotate-activation": Refused("DSA: no Hadamard rotation in the indexer.", _DSA),
    "no-dsa-indexer-scoring-relu": Refused("DSA: no ReLU on the indexer's scores.", _DSA),
    "disable-dsa-indexer-scoring-relu": Refused("DSA: no ReLU on the indexer's scores.", _DSA),
    "dsa-indexer-k-norm-epsilon": Refused("DSA: epsilon of the indexer's key norm.", _DSA),
    "dsa-indexer-k-norm-fp32": Refused("DSA: the indexer's key norm in fp32.", _DSA),
    "gdp-num-householder": Refused("Gated Delta Product: Householder reflections.", LINEAR_REASON),
    "gdp-cutedsl-kernel": Refused("Gated Delta Product: CuTeDSL kernel.", LINEAR_REASON),
    "gdp-num-chunk-states-to-recompute": Refused("Gated Delta Product: recomputed chunk states.", LINEAR_REASON),
    "mamba-training-ssm-states-dtype": Refused("Precision of Mamba's inter-chunk states.", _HYBRID),
    "mamba-inference-conv-states-dtype": Refused("Precision of Mamba's inference convolution states.", _HYBRID),
    "mamba-inference-ssm-states-dtype": Refused("Precision of Mamba's inference SSM states.", _HYBRID),
    "mtp-use-repeated-layer": Refused("Multi-token prediction: one layer used repeatedly.", _MTP),
    "mtp-detach-heads": Refused("Multi-token prediction: detach the heads' inputs.", _MTP),
    "mtp-hsm": Refused("Multi-token prediction: hidden-state mixing.", _MTP),
    "mtp-hybrid-override-pattern": Refused("Multi-token prediction: layer pattern (deprecated).", _MTP),
    "mup-width-mult": Refused("muP's width multiplier.", _MUP),
    "mup-embedding-mult": Refused("muP's embedding multiplier.", _MUP),
    "mup-output-mult": Refused("muP's output-logit multiplier.", _MUP),
    "mup-base-head-dim": Refused("muP's base head width.", _MUP),
    "mup-attn-scale-power": Refused("muP's attention scaling power.", _MUP),
    "enable-mhc-connections": Refused("Manifold-constrained hyper-connections.", _MHC),
    "mhc-num-residual-streams": Refused("Hyper-connections: residual streams.", _MHC),
    "mhc-sinkhorn-iterations": Refused("Hyper-connections: Sinkhorn iterations.", _MHC),
    "mhc-init-gating-factor": Refused("Hyper-connections: initial gating factor.", _MHC),
    "mhc-recompute-layer-num": Refused("Hyper-connections: layers per recompute block.", _MHC),
    "tensor-parallel-num-weight-shards": Refused("Shards of each weight over TP and GTP ranks.", _GTP),
    "expert-tensor-parallel-num-weight-shards": Refused("Shards of each expert weight over ETP and GTP.", _GTP),
    "gtp-remat-opt-in-modules": Refused("More modules whose weights GTP shards.", _GTP),
    "gtp-remat-nccl-ub": Refused("GTP's reduce-scatter buffers in NCCL symmetric memory.", _GTP),
    "gtp-expert-remat-nccl-ub": Refused("The same for expert GTP groups.", _GTP),
    "gtp-remat-reduce-scatter-with-fp32-accumulation": Refused("GTP's reduce-scatter in low precision.", _GTP),
    "cpu-offloading-retain-pinned-cpu-buffers": Refused("Keep pinned CPU buffers of offloading.", _OFFLOAD),
    "delay-offload-until-cuda-graph": Refused("Offload after the CUDA graph runs.", _OFFLOAD),
    "delta-offload-bytes-across-pp-ranks": Refused("Balance offloaded bytes across stages.", _OFFLOAD),
    "activation-offload-fraction": Refused("Share of activations offloaded.", _OFFLOAD),
    "fine-grained-offloading-max-inflight-offloads": Refused("Offloads in flight at once.", _OFFLOAD),
    "muon-nesterov": Refused("Muon: Nesterov momentum.", _OPTIM),
    "muon-coefficient-type": Refused("Muon: Newton-Schulz coefficients.", _OPTIM),
    "muon-use-syrk": Refused("Muon: SYRK kernel for the Gram matrix.", _OPTIM),
    "muon-scalar-optimizer": Refused("Muon: the optimizer of scalar parameters.", _OPTIM),
    "no-use-layer-wise-param-layout": Refused("Muon: the older layer-wise parameter layout.", _OPTIM),
    "lion-beta1": Refused("Lion's first beta.", _OPTIM),
    "lion-beta2": Refused("Lion's second beta.", _OPTIM),
    "moe-router-quantile-balancing-ema": Refused(
        "EMA of quantile load balancing's expert bias.",
        "quantile load balancing is not implemented; --moe-router-load-balancing-type is aux_loss, seq_aux_loss "
        "or none",
    ),
    "moe-router-force-biased": Refused(
        "Add a random bias to the router's logits (for benchmarking).", "a forced router bias is not implemented"
    ),
    "moe-expert-rank-capacity-factor": Refused(
        "A token budget per expert rank; tokens beyond it are dropped.",
        "per-rank token budgets are not implemented; --moe-expert-capacity-factor drops tokens per expert",
    ),
    "moe-mlp-glu-interleave-size": Refused("Block-interleaved GLU weights of the experts.", _GLU),
    "moe-shared-expert-glu-interleave-size": Refused("Block-interleaved GLU weights of the shared expert.", _GLU),
    "moe-routing-trace-path": Refused("Write the router's decisions to JSONL traces.", _TRACE),
    "moe-routing-trace-max-training-iters": Refused("Steps the router traces cover.", _TRACE),
    "moe-routing-trace-capture-logits": Refused("Router traces: the logits too.", _TRACE),
    "moe-routing-trace-capture-hidden-states": Refused("Router traces: the hidden states too.", _TRACE),
    "moe-routing-trace-dump-weights": Refused("Router traces: the router's weights too.", _TRACE),
    "batch-invariant-backend": Refused(
        "The GEMM of --batch-invariant-mode.", "batch-invariant kernels (--batch-invariant-mode) are not implemented"
    ),
    "no-pad-vocab-size": Refused(
        "Do not pad the vocabulary.",
        "paratron always pads the vocabulary to --make-vocab-size-divisible-by; set that to 1 for no padding",
    ),
    "disable-pad-vocab-size": Refused(
        "Do not pad the vocabulary.",
        "paratron always pads the vocabulary to --make-vocab-size-divisible-by; set that to 1 for no padding",
    ),
    "no-tokenizer-sentencepiece-ignore-extra-whitespaces": Refused(
        "Keep extra whitespace when SentencePiece encodes.", "the SentencePiece tokenizer's whitespace is not settable"
    ),
    "disable-tokenizer-sentencepiece-ignore-extra-whitespaces": Refused(
        "Keep extra whitespace when SentencePiece encodes.", "the SentencePiece tokenizer's whitespace is not settable"
    ),
    "tokenizer-hf-no-include-special-tokens": Refused(
        "Encode without the Hugging Face tokenizer's special tokens.",
        "the Hugging Face tokenizer's special tokens are not settable",
    ),
    "null-tokenizer-eod-id": Refused("The NullTokenizer's end-of-document id.", "the NullTokenizer's ids are fixed"),
    "null-tokenizer-pad-id": Refused("The NullTokenizer's padding id.", "the NullTokenizer's ids are fixed"),
    "freeze-all-layers": Refused(
        "Freeze every layer.",
        "use --freeze-language-model or --freeze-vision-model, or train LoRA adapters (--lora-rank)",
    ),
    "save-params-interval": Refused(
        "Every N steps, save every parameter by name.", "named dumps of parameters are not implemented; use --save"
    ),
    "save-activations-interval": Refused(
        "Every N steps, save every activation by name.",
        "named dumps of activations are not implemented; `paratron debug` records layer statistics",
    ),
    "save-tokens-per-expert-interval": Refused(
        "Every N steps, save the tokens each expert received.",
        "not written; metrics.jsonl records each step's MoE load balance",
    ),
    "override-ckpt-iteration": Refused(
        "Take the loaded checkpoint for another iteration.",
        "not implemented; load the iteration wanted (--load DIR/iter_NNNNNNN)",
    ),
    "start-eval-at-iter": Refused(
        "Evaluate only after this step.", "not implemented; --eval-interval sets when evaluation runs"
    ),
    "eval-micro-batch-size": Refused(
        "A micro-batch size for evaluation other than training's.", "evaluation uses the training micro-batch size"
    ),
    "validation-set-names": Refused(
        "Names of several validation sets.", "several validation sets (--multiple-validation-sets) are not implemented"
    ),
    "no-yarn-correction-range-round-to-int": Refused("YaRN: do not round the correction range.", _YARN),
    "num-speculative-tokens": Refused("Speculative tokens per decoding step.", _INFERENCE),
    "use-same-sampling-seed-across-dp-ranks": Refused("One sampling seed on every data-parallel rank.", _INFERENCE),
    "inference-shards": Refused("Split the world into several inference models.", _INFERENCE),
    "fault-injector-ranks": Refused("Ranks to inject faults on.", _FAULTS),
    "fault-injector-num-ranks": Refused("How many random ranks get faults.", _FAULTS),
    "fault-injector-fault-types": Refused("Kinds of fault to inject.", _FAULTS),
    "fault-injector-fault-probabilities": Refused("Probability of each kind.", _FAULTS),
    "fault-injector-fault-delay": Refused("Seconds until the fault.", _FAULTS),
    "fault-injector-delay-start-iteration": Refused("Step the fault delay starts at.", _FAULTS),
    "fault-injector-mtti-seconds": Refused("Mean time to inject.", _FAULTS),
    "fault-injector-offset-seconds": Refused("Seconds added to the fault delay.", _FAULTS),
    "fault-injector-seed": Refused("Seed of the fault injector.", _FAULTS),
    # older flags, met in Megatron-LM main's scripts
    "outer-dp-sharding-strategy": Refused(
        "Hybrid FSDP: how an outer data-parallel group shards (no_shard or optim).",
        "hybrid sharding over nested data-parallel groups is not implemented; --zero-stage shards over all "
        "data-parallel ranks",
    ),
}
"""Flags new since megatron-core 0.16.1 of features paratron does not have, with the reason."""

_FAMILIES: tuple[tuple[str, str, str], ...] = (
    # prefix -> (what the family is, reason), for the many flags of one feature
    ("inference-", "A setting of Megatron-LM's dynamic inference engine.", _INFERENCE),
    ("rl-", "Reinforcement-learning rollouts and their bookkeeping.", _RL),
    ("no-rl-", "Reinforcement-learning rollouts and their bookkeeping.", _RL),
    ("logits-", "Saving or training on a teacher's logits.", _DISTILL),
    ("no-inference-", "A setting of Megatron-LM's dynamic inference engine.", _INFERENCE),
)


def refused_by_family(flags: frozenset[str]) -> dict[str, Refused]:
    """Entries for the flags of whole refused families (inference engine, RL, distillation) among `flags`."""
    out: dict[str, Refused] = {}
    for flag in sorted(flags):
        for prefix, meaning, reason in _FAMILIES:
            if flag.startswith(prefix) and flag not in RECENT_ACCEPTED and flag not in RECENT_REFUSED:
                out[flag] = Refused(meaning, reason)
    return out
