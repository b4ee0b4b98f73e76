"""Megatron-LM compatibility: how each of Megatron-LM's training flags is treated.

A Megatron-LM launch script runs with `pretrain_gpt.py` swapped for `paratron train`. Each of its
flags is one of:

- implemented: a setting of the same name (`--hidden-size` is `hidden_size`), a switch that sets a
  setting (`SWITCHES`), another spelling of one (`RENAMES`) or a value translated to one (`MAPPED`);
- accepted (`ACCEPTED`): it picks an implementation detail (a fused kernel, a checkpoint writer) that
  has no effect on the numbers paratron computes; each says why and what paratron does instead;
- refused by name (`REFUSED`), with the reason, for what paratron does not have;
- any other Megatron-LM flag (`megatron_flags.txt`, its parser's full list) is refused as a
  Megatron-LM flag paratron does not implement, never taken for a typo of a paratron flag.

The flags added since megatron-core 0.16.1 are classified in `config.megatron_recent` and merged in here.

docs/megatron.md is generated from these tables (`config.arguments.markdown_megatron`), so it cannot drift.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Collection
from pathlib import Path
from typing import Any

from paratron.config.fields import all_fields
from paratron.config.megatron_recent import (
    FP8_REASON,
    LINEAR_REASON,
    RECENT_ACCEPTED,
    RECENT_REFUSED,
    Accepted,
    Refused,
    refused_by_family,
)
from paratron.config.schema import Config
from paratron.errors import ConfigError

SWITCHES: dict[str, tuple[str, Any, str]] = {
    # flag name -> (field it sets, value, help)
    "fp16": ("precision", "fp16", "Train in fp16 mixed precision with dynamic loss scaling (sets --precision fp16)."),
    "bf16": ("precision", "bf16", "Train in bf16 mixed precision (sets --precision bf16)."),
    "swiglu": ("activation", "swiglu", "Use the SwiGLU MLP (sets --activation swiglu)."),
    "squared_relu": (
        "activation",
        "squared_relu",
        "Use relu(x)^2 as the MLP activation, Nemotron-4's (sets --activation squared_relu).",
    ),
    "disable_bias_linear": ("add_bias_linear", False, "Linear layers without biases (sets --no-add-bias-linear)."),
    "recompute_activations": (
        "recompute_granularity",
        "selective",
        "Recompute the attention core in backward (sets --recompute-granularity selective).",
    ),
    "dataloader_inter_document_masking": (
        "reset_attention_mask",
        True,
        "Tokens attend only within their own document of a packed sample (sets --reset-attention-mask).",
    ),
    "no_rope_fusion": (
        "apply_rope_fusion",
        False,
        "Rotate queries and keys with eager PyTorch, not one compiled kernel (sets --no-apply-rope-fusion).",
    ),
    "use_torch_fsdp2": (
        "zero_stage",
        3,
        "Shard parameters, gradients and optimizer state with PyTorch FSDP2 (sets --zero-stage 3).",
    ),
}
"""Flags that take no value and set a field to a constant."""

RENAMES: dict[str, str] = {
    "--nproc": "nproc_per_node",
    "--model": "model_name",
    "--num-virtual-stages-per-pipeline-rank": "virtual_pipeline_model_parallel_size",
    "--use-checkpoint-opt_param-scheduler": "use_checkpoint_opt_param_scheduler",
    "--override-opt_param-scheduler": "override_opt_param_scheduler",
    "--freeze-ViT": "freeze_vision_model",  # (Megatron-LM's examples/multimodal)
    "--freeze-LM": "freeze_language_model",
    "--hybrid-override-pattern": "hybrid_layer_pattern",  # (Megatron-LM's older spelling)
    "--yarn-original-max-position-embeddings": "original_max_position_embeddings",  # (megatron-core's name)
    "--yarn-beta-fast": "beta_fast",
    "--yarn-beta-slow": "beta_slow",
}
"""Other spellings of a setting's flag (Megatron-LM's own included)."""

MAPPED: dict[str, tuple[str, dict[str, Any], str]] = {
    "data_parallel_sharding_strategy": (
        "zero_stage",
        {"no_shard": 0, "optim": 1, "optim_grads": 2, "optim_grads_params": 3},
        "Megatron FSDP's sharding of data-parallel state: no_shard, optim, optim_grads or optim_grads_params "
        "(sets --zero-stage 0, 1, 2 or 3).",
    ),
}
"""Flags whose value is translated into a setting's value."""

FOLDED: dict[str, tuple[str, str]] = {
    "use_distributed_optimizer": (
        "zero_stage",
        "Shard master weights and optimizer state over the data-parallel ranks (ZeRO stage 1; sets --zero-stage 1 "
        "unless given).",
    ),
}
"""Megatron-LM switches that fold into a setting of their own (name -> (that setting, help)); recipes and saved
configs may hold them too (`config.loading.LEGACY_SETTINGS` reads them)."""


_FUSION = "paratron has no fused kernel to turn on or off here; the unfused computation gives the same numbers"
_DIST_CKPT = (
    "paratron writes its own sharded checkpoints: each rank writes only its shard, in parallel, and any layout "
    "loads them (always fully reshardable, always strict about missing and unexpected tensors)"
)

ACCEPTED: dict[str, Accepted] = {
    "use-mcore-models": Accepted(
        "Build megatron-core's models rather than the legacy ones.",
        "paratron has one model implementation, close to megatron-core's GPTModel (tests compare them).",
    ),
    "transformer-impl": Accepted(
        "Which layer library builds the model: transformer_engine or local.",
        "paratron builds its own layers; the choice only picks kernels in Megatron-LM.",
        1,
    ),
    "attention-backend": Accepted(
        "Which attention kernel runs: flash, fused, unfused, local or auto.",
        "paratron calls torch's scaled_dot_product_attention, which picks the best kernel for the device; every "
        "backend computes the same attention.",
        1,
    ),
    "use-flash-attn": Accepted(
        "Use FlashAttention (deprecated for --attention-backend).",
        "torch's scaled_dot_product_attention uses a flash kernel where the device has one.",
    ),
    "no-gradient-accumulation-fusion": Accepted(
        "Turn off the fused CUDA kernel that accumulates weight gradients into fp32 main_grad.",
        "paratron accumulates weight gradients in fp32 without a fused kernel; " + _FUSION + ".",
    ),
    "no-masked-softmax-fusion": Accepted("Turn off the fused scale-mask-softmax kernel.", _FUSION + "."),
    "no-bias-gelu-fusion": Accepted("Turn off the fused bias + GELU kernel.", _FUSION + "."),
    "no-bias-dropout-fusion": Accepted("Turn off the fused bias + dropout + add kernel.", _FUSION + "."),
    "cross-entropy-fusion-impl": Accepted(
        "Which fused cross-entropy kernel: native or te.",
        "--cross-entropy-loss-fusion has one implementation, chunked PyTorch (model/fused_loss.py); same numbers.",
        1,
    ),
    "no-async-tensor-model-parallel-allreduce": Accepted(
        "Do not overlap the tensor-parallel all-reduce of input gradients with the weight-gradient matmul.",
        "paratron does not overlap tensor-parallel communication; the numbers are the same either way.",
    ),
    "tp-comm-overlap": Accepted(
        "Overlap tensor-parallel communication with GEMMs through Transformer Engine's userbuffers.",
        "A scheduling choice of Transformer Engine; paratron runs the same collectives without the overlap.",
    ),
    "tp-comm-overlap-cfg": Accepted(
        "YAML file tuning --tp-comm-overlap.", "Only tunes --tp-comm-overlap, which paratron accepts as is.", 1
    ),
    "defer-embedding-wgrad-compute": Accepted(
        "Defer the output layer's weight-gradient GEMMs to the pipeline's cool-down.",
        "Only moves work in time; paratron computes the same gradients (its zb-h1 and zb-v schedules defer weight "
        "gradients, see --pipeline-schedule).",
    ),
    "wgrad-deferral-limit": Accepted(
        "How many micro-batches' weight gradients --defer-embedding-wgrad-compute may hold back.",
        "Only tunes the deferral above.",
        1,
    ),
    "overlap-p2p-communication-warmup-flush": Accepted(
        "Overlap pipeline sends and receives in the warm-up and flush of the interleaved schedule.",
        "Timing only: the same tensors are exchanged.",
    ),
    "microbatch-group-size-per-virtual-pipeline-stage": Accepted(
        "Micro-batches a virtual stage runs back to back in the interleaved schedule.",
        "Changes the order of operations, not their results: every micro-batch's gradients are summed either way.",
        1,
    ),
    "ddp-average-in-collective": Accepted(
        "Average gradients inside the data-parallel collective instead of scaling them before.",
        "The same mean; paratron scales before the reduction (equal up to rounding in the last bit).",
    ),
    "num-distributed-optimizer-instances": Accepted(
        "Split the distributed optimizer into several instances, each over part of the data-parallel ranks.",
        "Changes where optimizer state lives, not the update; paratron's --zero-stage shards over all "
        "data-parallel ranks.",
        1,
    ),
    "overlap-param-gather-with-optimizer-step": Accepted(
        "Start gathering updated parameters while the optimizer step still runs.",
        "Timing only; see --overlap-param-gather.",
    ),
    "use-megatron-fsdp": Accepted(
        "Use Megatron's own FSDP implementation.",
        "paratron shards with PyTorch FSDP2; --data-parallel-sharding-strategy (or --zero-stage) says how much.",
    ),
    "megatron-fsdp-main-params-dtype": Accepted(
        "Precision of Megatron FSDP's main parameters.", "paratron's master weights are always fp32.", 1
    ),
    "megatron-fsdp-main-grads-dtype": Accepted(
        "Precision of Megatron FSDP's main gradients.", "paratron's reduced gradients are always fp32.", 1
    ),
    "megatron-fsdp-grad-comm-dtype": Accepted(
        "Precision of Megatron FSDP's gradient communication.", "paratron reduces gradients in fp32.", 1
    ),
    "disable-gloo-process-groups": Accepted(
        "Do not create the gloo groups Megatron-LM keeps beside NCCL (for checkpointing).",
        "paratron creates no extra gloo groups next to NCCL ones; on CPUs gloo is the only backend.",
    ),
    "use-tp-pp-dp-mapping": Accepted(
        "Number ranks tensor, then pipeline, then data parallel (instead of data before pipeline).",
        "Changes which GPUs talk, not the results: every layout trains the same numbers in paratron (see "
        "docs/launch.md for how paratron places the axes).",
    ),
    "ckpt-fully-parallel-save": Accepted("Every rank writes a part of the checkpoint.", _DIST_CKPT + "."),
    "no-ckpt-fully-parallel-save": Accepted("Let fewer ranks write the checkpoint.", _DIST_CKPT + "."),
    "ckpt-fully-parallel-load": Accepted("Every rank reads a part of the checkpoint.", _DIST_CKPT + "."),
    "ckpt-assume-constant-structure": Accepted("Reuse the checkpoint plan of the previous save.", _DIST_CKPT + "."),
    "dist-ckpt-strictness": Accepted(
        "How loading a torch_dist checkpoint treats missing and unexpected keys.", _DIST_CKPT + ".", 1
    ),
    "dist-ckpt-optim-fully-reshardable": Accepted(
        "Save the distributed optimizer's state so that any layout can load it.", _DIST_CKPT + "."
    ),
    "use-persistent-ckpt-worker": Accepted(
        "Keep one background process for asynchronous saves.",
        "paratron's --async-save writes from a background thread of each rank.",
    ),
    "async-strategy": Accepted(
        "Which asynchronous checkpoint writer: nvrx or mcore.", "See --async-save; paratron has one writer.", 1
    ),
    "async-ckpt-use-cpu-shm": Accepted(
        "Stage asynchronous checkpoints through CPU shared memory.", "See --async-save; paratron has one writer."
    ),
    "verify-integrity": Accepted(
        "Verify checkpoint files when loading.",
        "paratron always checks every file's SHA-256 when it loads a checkpoint (and passes over damaged ones).",
    ),
    "rerun-mode": Accepted(
        "Megatron's rerun state machine: re-run a step to tell faulty hardware from a true NaN (validate_results), "
        "report variability, or neither (disabled).",
        "paratron re-runs a step whose gradients are not finite, watching every module, to name where the NaN "
        "began (--on-nan); the training numbers are the same.",
        1,
    ),
    "check-weight-hash-across-dp-replicas-interval": Accepted(
        "Every N steps, check that data-parallel replicas hold identical weights.",
        "A consistency check, not part of training; paratron's data-parallel parity tests prove the replicas agree.",
        1,
    ),
    "test-mode": Accepted(
        "Megatron-LM's own real-time tests alongside the run.", "A self-test of Megatron-LM; nothing to run here."
    ),
    "use-checkpoint-args": Accepted(
        "Take the model's settings (and tokenizer) from the --load checkpoint's saved args over the command line's.",
        "paratron always builds the model the --load checkpoint holds, and uses its tokenizer when the run names "
        "none; with this flag a model setting that contradicts the checkpoint gives way to it with a note, as in "
        "Megatron-LM, instead of being refused (docs/finetuning.md).",
        noted=True,
    ),
    "no-position-embedding": Accepted(
        "Deprecated: no learned position table; with --position-embedding-type rope it changes nothing, and "
        "otherwise Megatron-LM refuses it.",
        "The same: nothing with rope, refused otherwise (--position-embedding-type none trains without positions).",
        noted=True,
    ),
    **RECENT_ACCEPTED,
}
"""Megatron-LM flags accepted because they cannot change what paratron computes."""


_FP8, _LINEAR = FP8_REASON, LINEAR_REASON

REFUSED: dict[str, Refused] = {
    "fp8-amax-history-len": Refused("fp8 amax history length.", _FP8),
    "fp8-amax-compute-algo": Refused("fp8 amax reduction.", _FP8),
    "fp8-margin": Refused("fp8 scaling margin.", _FP8),
    "first-last-layers-bf16": Refused("Keep the first and last layers in bf16 under fp8.", _FP8),
    "fp4": Refused("Train in fp4.", "paratron has no fp4 training; train in --bf16"),
    "experimental-attention-variant": Refused("An experimental attention (gated delta net, DSA).", _LINEAR),
    "linear-attention-freq": Refused("Which layers use linear attention.", _LINEAR),
    "linear-conv-kernel-dim": Refused("Linear attention: convolution width.", _LINEAR),
    "linear-key-head-dim": Refused("Linear attention: key head width.", _LINEAR),
    "linear-value-head-dim": Refused("Linear attention: value head width.", _LINEAR),
    "linear-num-key-heads": Refused("Linear attention: key heads.", _LINEAR),
    "linear-num-value-heads": Refused("Linear attention: value heads.", _LINEAR),
    "apply-wd-to-qk-layernorm": Refused(
        "Apply weight decay to the query/key norms.",
        "paratron never decays norms (their weights are not matrices); drop it, or ask for it as a feature",
    ),
    "use-mup": Refused("Maximal-update parametrisation.", "muP is not implemented"),
    "mup-base-hidden-size": Refused("muP's base width.", "muP is not implemented"),
    "pipeline-model-parallel-split-rank": Refused(
        "Encoder/decoder split of the pipeline (T5).", "paratron trains decoder-only models"
    ),
    "hierarchical-context-parallel-sizes": Refused(
        "Context parallelism in nested groups (a2a+p2p).",
        "context parallelism is p2p or all_gather (--cp-comm-type); hierarchical groups are not implemented",
    ),
    "eval-global-batch-size": Refused(
        "A global batch size for evaluation other than training's.",
        "evaluation uses the training global batch size; --eval-iters sets how many",
    ),
    "moe-router-dtype": Refused(
        "Precision of the router's scores and expert weighting.",
        "the router's precision is not selectable; paratron's router computes in the model's dtype",
    ),
    "error-injection-rate": Refused(
        "Inject errors for the rerun state machine.", "use --fault-inject RANK:STEP:nan|crash|hang|slow"
    ),
    "error-injection-type": Refused(
        "Kind of error --error-injection-rate injects.", "use --fault-inject RANK:STEP:nan|crash|hang|slow"
    ),
    "accumulate-allreduce-grads-in-fp32": Refused(
        "Accumulate and all-reduce gradients in fp32 (legacy models).",
        "paratron accumulates and reduces gradients in fp32 unless --grad-reduce-in-bf16 is given; drop the flag",
    ),
    "distribute-saved-activations": Refused(
        "Shard recomputation checkpoints over tensor-parallel ranks.",
        "not implemented; --sequence-parallel shards the same activations",
    ),
    "use-legacy-models": Refused("Build Megatron-LM's legacy (pre-mcore) models.", "paratron has one model family"),
    "spec": Refused("A custom layer spec module.", "paratron builds its layers from the settings; no specs"),
    "use-cpu-initialization": Refused(
        "Initialise weights on the CPU, then copy them to the GPU.",
        "paratron initialises each shard where it lives, identically at every layout; drop the flag",
    ),
    "data-parallel-random-init": Refused(
        "Give each data-parallel replica different initial weights.", "replicas start identical in paratron"
    ),
    **RECENT_REFUSED,
}
"""Megatron-LM flags of features paratron does not have, with the reason."""


@functools.cache
def megatron_flags() -> frozenset[str]:
    """Every flag of Megatron-LM's training argument parser (names without the leading dashes)."""
    path = Path(__file__).with_name("megatron_flags.txt")
    lines = path.read_text(encoding="utf-8").splitlines()
    return frozenset(line[2:] for line in lines if line.startswith("--"))


REFUSED.update(refused_by_family(megatron_flags()))


def unknown_megatron_flag_message(flag: str) -> str:
    """The one line for a Megatron-LM flag paratron neither implements nor lists."""
    refused = REFUSED.get(flag[2:])
    if refused is not None:
        return f"{flag}: Megatron-LM's flag is not supported: {refused.reason}; remove it from the command line"
    return (
        f"{flag} is a Megatron-LM flag that paratron does not implement; remove it from the command line "
        "(docs/megatron.md lists how each Megatron-LM flag is treated)"
    )


def ignored_like_megatron(config: Config, given: Collection[str]) -> dict[str, str]:
    """The settings of a command line that Megatron-LM ignores in `config` (resolved from it), each with the warning
    to print. `given` names the settings set on the command line. The run is resolved as if they were not given
    (`config.loading.resolve_settings` with `given`), so that what a checkpoint is compared with, and what a second
    command line is compared with, is the model as it is built."""
    ignored: dict[str, str] = {}
    if "num_query_groups" in given and not config.model.group_query_attention:
        ignored["num_query_groups"] = (
            f"--num-query-groups {config.model.num_query_groups} is ignored without --group-query-attention, as "
            "Megatron-LM ignores it; add --group-query-attention for grouped-query attention"
        )
    if "num_layers" in given and config.model.hybrid_layer_pattern:
        ignored["num_layers"] = (
            f"--num-layers is ignored under --hybrid-layer-pattern, whose {config.model.num_layers} symbols are the "
            "layers, as Megatron-LM ignores it; drop --num-layers"
        )
    return ignored


def adjust_like_megatron(config: Config, given: set[str]) -> tuple[Config, list[str]]:
    """Where Megatron-LM carries on with a warning, so does paratron: the settings after its
    adjustments and the warnings to print. `given` names the settings set on the command line."""
    notes: list[str] = []
    model, parallel = config.model, config.parallel
    if "no_position_embedding" in given and model.position_embedding_type != "rope":
        raise ConfigError(
            "--no-position-embedding is deprecated (Megatron-LM refuses it too without rope): use "
            "--position-embedding-type none for no positions, or rope"
        )
    if model.position_embedding_type != "rope":
        for name, on in (
            ("--rotary-percent", model.rotary_percent < 1.0),
            ("--rotary-interleaved", model.rotary_interleaved),
        ):
            if on:
                notes.append(
                    f"{name} shapes rotary embeddings; with --position-embedding-type "
                    f"{model.position_embedding_type} it is ignored, as Megatron-LM ignores it"
                )
    if parallel.sequence_parallel and parallel.tensor_model_parallel_size == 1:
        notes.append(
            "--sequence-parallel needs --tensor-model-parallel-size above 1; turned off (Megatron-LM does the same)"
        )
        parallel = dataclasses.replace(parallel, sequence_parallel=False)
    return dataclasses.replace(config, model=model, parallel=parallel), notes


def carry_on_like_megatron(
    config: Config, given: set[str], holds_checkpoint: Callable[[Path], bool]
) -> tuple[Config, list[str]]:
    """Carry on where Megatron-LM carries on with a warning: its setting adjustments (`adjust_like_megatron`),
    and a --load that names the --save directory before its first checkpoint starts from scratch. A --load
    elsewhere that holds nothing stays an error (`training.preflight`). The settings and the warnings to
    print. `holds_checkpoint` says whether a directory holds one (`checkpoint.verify.holds_checkpoint`, passed in:
    config imports no later layer)."""
    config, notes = adjust_like_megatron(config, given)
    c = config.checkpoint
    if c.load and c.save and Path(c.load).expanduser().resolve() == Path(c.save).expanduser().resolve():
        if not holds_checkpoint(Path(c.load).expanduser()):
            notes.append(
                f"--load {c.load} holds no checkpoint yet; it is also --save, so training starts from scratch "
                "(as Megatron-LM does)"
            )
            config = dataclasses.replace(config, checkpoint=dataclasses.replace(c, load=None))
    return config, notes


def from_megatron_dict(args: dict[str, Any]) -> dict[str, Any]:
    """Turn the dict form of Megatron tutorials ({'tensor_model_parallel_size': 2, 'use_fp16': True, ...})
    into field overrides."""
    fields = all_fields()
    renames = {flag[2:].replace("-", "_"): name for flag, name in RENAMES.items()}
    out: dict[str, Any] = {}
    for key, value in args.items():
        name = key.replace("-", "_")
        dashed = name.replace("_", "-")
        if name in ("use_fp16", "use_bf16", "fp16", "bf16"):
            if value:
                out["precision"] = "fp16" if "fp16" in name else "bf16"
        elif name in SWITCHES:
            field_name, constant, _ = SWITCHES[name]
            if value:
                out[field_name] = constant
        elif name in MAPPED:
            field_name, values, _ = MAPPED[name]
            if value not in values:
                raise ConfigError(f"{key}: {value!r} is not one of {', '.join(values)}")
            out[field_name] = values[value]
        elif name in renames:
            out[renames[name]] = value
        elif name in FOLDED:
            out[name] = value
        elif name in fields:
            out[name] = value
        elif dashed in ACCEPTED:
            continue
        elif dashed in REFUSED or dashed in megatron_flags():
            raise ConfigError(unknown_megatron_flag_message("--" + dashed).replace("command line", "settings"))
        else:
            raise ConfigError(f"{key}: unknown setting; `paratron train --help` lists them all")
    return out
