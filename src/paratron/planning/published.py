"""The planner against published training runs: their layouts, predicted, beside what was measured.

Runs (numbers checked against the papers' tables):

- Llama 3 405B on H100s (Dubey et al. 2024, "The Llama 3 Herd of Models", Table 4): 126 layers,
  hidden 16384, MLP 53248, 128 heads, 8 key/value heads, vocabulary 128256; TP8 PP16, one
  sequence per micro-batch, 16M tokens per step; 430 TFLOP/s per GPU (43% MFU) on 8,192 GPUs at
  DP64, 400 (41%) on 16,384 at DP128, 380 (38%) on 16,384 at CP16 DP8 with 131,072-token
  sequences (printings of the table give DP 4 for that row; 8 is what 16,384 GPUs and 16M tokens
  need). They ran interleaved virtual stages with the embedding and the loss each counted as a
  stage (one layer fewer on the first and last stage).
- GPT models on A100s (Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on
  GPU Clusters Using Megatron-LM"): Table 1's 145.6B (80 layers, hidden 12288, 96 heads; TP8 PP8,
  1,536 GPUs, batch 2304: 148 TFLOP/s, 47% of peak) and 1008B (128 layers, hidden 25600, 160 heads;
  TP8 PP64, 3,072 GPUs, batch 3072: 163 TFLOP/s, 52%), Table 2's 174.6B "PTD-P" run (96 layers,
  hidden 12288, 96 heads; TP8 PP12, 1,536 GPUs, batch 1536, micro-batch 1: 141 TFLOP/s); sequence
  2048, vocabulary 51200, full recomputation, the interleaved schedule.

Like with like (every published MFU is converted into paratron's model FLOPs, `training.flops`:
no recomputation, the full square of attention scores, by the exact ratio of the two counts for
that model and sequence):

- Narayanan et al. count the recomputed forward (96 B s l h^2 (1 + s/6h + V/16lh) per step: four
  passes over the layers to paratron's three): ratio about 0.75.
- Llama 3's MFU is read as counting the attention scores a causal mask computes (half the square,
  as FlashAttention reports them): ratio 1.04 at 8K tokens, 1.40 at 131K, where attention is most of
  the work. Read with the full square (PaLM's count), the 131K row would be 38% in paratron's count
  and the prediction 1.5x that: with no other change, the rows at 8K and 131K are consistent only
  with the causal reading.

How each run is put into paratron's settings: Llama 3 as TP8 with sequence parallelism and the
distributed optimizer (their FSDP shards the optimizer state; gradients are reduced once per step),
without recomputation (their MFU leaves no room for it), in the layout Llama ran: PP16 with eight
virtual stages of one layer per rank, the embedding and the loss counted as a layer each
(--account-for-embedding-in-pipeline-split --account-for-loss-in-pipeline-split), so that the first
chunk holds only the embedding and the last only the loss. Its predicted MFU is that layout's as run;
whether it fits, and the planner's comparison, use it with the least recomputation that fits
paratron's memory (its unfused SwiGLU keeps four MLP-wide tensors a layer). The A100 runs predate
sequence parallelism; their scatter/gather of pipeline messages sends what sequence parallelism sends,
so they are put with it (memory: a little less than theirs), without the distributed optimizer, full
recomputation, the interleaved schedule with two chunks per rank (the paper's tables leave the chunks
open) and one sequence per micro-batch.

Calibrated: `matmul_efficiency` of the H100 preset on the first Llama 3 row and of the A100 preset
on the 145.6B row (`planning.hardware`; bench/plan_published.py --calibrate refits them); the other
rows are predictions.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from paratron.config.layout import Layout
from paratron.config.loading import build_config
from paratron.config.schema import Config, ModelConfig
from paratron.config.validation import validate
from paratron.planning.activations import KERNELS
from paratron.planning.cost import predict_step
from paratron.planning.hardware import Hardware, preset
from paratron.planning.memory_prediction import predict_memory
from paratron.planning.search import apply, plan
from paratron.training.flops import matmul_parameters, training_flops_per_token

LLAMA3_405B = "llama3-405b"

NARAYANAN_GPT = dict(
    vocab_size=51200,
    max_position_embeddings=2048,
    position_embedding_type="learned_absolute",
    normalization="LayerNorm",
    activation="gelu",
    add_bias_linear=True,
)

FULL = {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}


@dataclass(frozen=True)
class Run:
    """One published run and how paratron expresses it."""

    name: str
    source: str
    hardware: str
    gpus: int
    model: dict[str, Any]
    seq_length: int
    global_batch: int
    settings: dict[str, Any]
    """paratron's layout settings for the run (recomputation is added when left open)."""
    published_tflops: float
    published_mfu: float
    counts_recomputation: bool = False
    """The published FLOPs include the recomputed forward (Narayanan et al.)."""
    recomputation_given: bool = False
    notes: str = ""


_LLAMA = dict(
    tensor_model_parallel_size=8,
    sequence_parallel=True,
    pipeline_model_parallel_size=16,
    virtual_pipeline_model_parallel_size=8,
    pipeline_schedule="interleaved",
    account_for_embedding_in_pipeline_split=True,
    account_for_loss_in_pipeline_split=True,
    micro_batch_size=1,
    zero_stage=1,
    overlap_grad_reduce=True,
    overlap_param_gather=True,
)
_MEGATRON_2021 = dict(
    tensor_model_parallel_size=8,
    sequence_parallel=True,
    micro_batch_size=1,
    virtual_pipeline_model_parallel_size=2,
    pipeline_schedule="interleaved",
    recompute_granularity="full",
    recompute_method="uniform",
    recompute_num_layers=1,
    overlap_grad_reduce=True,
)

RUNS: tuple[Run, ...] = (
    Run("Llama 3 405B, 8,192 H100", "Dubey et al. 2024, Table 4", "h100-80g", 8192, {"model_name": LLAMA3_405B},
        8192, 2048, _LLAMA, 430, 0.43, notes="DP64, 32 sequences per DP rank"),
    Run("Llama 3 405B, 16,384 H100", "Dubey et al. 2024, Table 4", "h100-80g", 16384, {"model_name": LLAMA3_405B},
        8192, 2048, _LLAMA, 400, 0.41, notes="DP128, 16 sequences per DP rank"),
    Run("Llama 3 405B, 16,384 H100, 128K", "Dubey et al. 2024, Table 4", "h100-80g", 16384,
        {"model_name": LLAMA3_405B, "max_position_embeddings": 131072}, 131072, 128,
        {**_LLAMA, "context_parallel_size": 16}, 380, 0.38, notes="CP16 DP8, 16 sequences per DP rank"),
    Run("GPT 145.6B, 1,536 A100", "Narayanan et al. 2021, Table 1", "a100-80g", 1536,
        dict(NARAYANAN_GPT, num_layers=80, hidden_size=12288, num_attention_heads=96), 2048, 2304,
        dict(_MEGATRON_2021, pipeline_model_parallel_size=8), 148, 0.47, counts_recomputation=True,
        recomputation_given=True),
    Run("GPT 174.6B, 1,536 A100", "Narayanan et al. 2021, Table 2 (PTD-P)", "a100-80g", 1536,
        dict(NARAYANAN_GPT, num_layers=96, hidden_size=12288, num_attention_heads=96), 2048, 1536,
        dict(_MEGATRON_2021, pipeline_model_parallel_size=12), 141, 141 / 312, counts_recomputation=True,
        recomputation_given=True),
    Run("GPT 1008B, 3,072 A100", "Narayanan et al. 2021, Table 1", "a100-80g", 3072,
        dict(NARAYANAN_GPT, num_layers=128, hidden_size=25600, num_attention_heads=160), 2048, 3072,
        dict(_MEGATRON_2021, pipeline_model_parallel_size=64), 163, 0.52, counts_recomputation=True,
        recomputation_given=True),
)  # fmt: skip


def narayanan_flops_per_token(model: ModelConfig, seq_length: int) -> float:
    """Narayanan et al.'s count, recomputation included: 96 l h^2 (1 + s/6h + V/16lh) per token."""
    layers, h, vocab = model.num_layers, model.hidden_size, model.vocab_size or 0
    return 96 * layers * h * h * (1 + seq_length / (6 * h) + vocab / (16 * layers * h))


def run_config(run: Run, extra: dict[str, Any] | None = None) -> Config:
    """The run's config: its model, sequence, batch, layout settings and bf16."""
    base = build_config(
        {**run.model, "seq_length": run.seq_length, "global_batch_size": run.global_batch, "precision": "bf16"}
    )
    return apply(base, {**run.settings, **(extra or {})})


def causal_flops_per_token(model: ModelConfig, seq_length: int) -> float:
    """Model FLOPs counting the attention scores a causal mask computes (half the square)."""
    heads = model.num_attention_heads
    d_attn = heads * model.kv_channels
    return 6.0 * matmul_parameters(model) + 6.0 * model.num_layers * seq_length * d_attn


def published_model_mfu(run: Run, model: ModelConfig) -> float:
    """The published MFU in paratron's model FLOPs (`training.flops`: no recomputation, the full
    square of attention scores), converted by the ratio of the two counts."""
    theirs = narayanan_flops_per_token if run.counts_recomputation else causal_flops_per_token
    return run.published_mfu * training_flops_per_token(model, run.seq_length) / theirs(model, run.seq_length)


def fitting(run: Run, hardware: Hardware) -> tuple[Config, Layout, list[Any]]:
    """The run in paratron's settings with the least recomputation that fits (none, selective, the
    fewest layers per chunk by the block method, all), or the given one; its layout and memory."""
    kernels = KERNELS["cuda"]
    if run.recomputation_given:
        options: list[dict[str, Any]] = [{}]
    else:
        most = max(validate(run_config(run), run.gpus, check_data=False).pipeline.counts)
        block = [{**FULL, "recompute_method": "block", "recompute_num_layers": k} for k in range(1, most)]
        options = [{}, {"recompute_granularity": "selective"}, *block, FULL]
    for extra in options:
        config = run_config(run, extra)
        layout = validate(config, run.gpus, check_data=False)
        memory = predict_memory(config, run.gpus, kernels, layout)
        if max(m.total for m in memory) <= hardware.device_memory_bytes:
            break
    return config, layout, memory


def evaluate(run: Run, hardware: Hardware | None = None, search: bool = True) -> dict[str, Any]:
    """Predicted beside published for one run (see the module docstring): the memory of its layout in
    paratron's settings, its predicted MFU as run, and the planner's top plan."""
    hardware = hardware or dataclasses.replace(preset(run.hardware), nodes=run.gpus // 8)
    config, layout, memory = fitting(run, hardware)
    settings = predict_step(config, layout, hardware, memory)
    ran = run_config(run)  # (as run: the recomputation given, or none)
    prediction = predict_step(ran, validate(ran, run.gpus, check_data=False), hardware)
    published = published_model_mfu(run, config.model)
    peak = max(m.total for m in memory)
    row: dict[str, Any] = {
        "run": run.name,
        "source": run.source,
        "gpus": run.gpus,
        "layout": _describe(ran, layout),
        "fits": peak <= hardware.device_memory_bytes,
        "peak_memory_gb": round(peak / 1e9, 1),
        "recomputation_to_fit": _recompute(config),
        "published_tflops": run.published_tflops,
        "published_mfu": run.published_mfu,
        "published_model_mfu": round(published, 4),
        "predicted_mfu": round(prediction.mfu, 4),
        "relative_error": round(prediction.mfu / published - 1, 4),
        "predicted_model_tflops": round(prediction.model_tflops_per_device, 1),
        "predicted_step_s": round(prediction.total, 3),
        "breakdown_s": {k: round(v, 4) for k, v in prediction.breakdown.items()},
        "settings_layout": _describe(config, layout),
        "settings_mfu": round(settings.mfu, 4),
    }
    if search:
        best = plan(run_config(run), run.gpus, hardware, top=1)[0]
        row |= {
            "top_plan": best.describe(),
            "top_plan_mfu": round(best.prediction.mfu, 4),
            "top_plan_not_slower": best.prediction.total <= settings.total * (1 + 1e-9),
            "top_plan_vs_as_run": round(prediction.total / best.prediction.total, 4),
            "top_plan_command": best.command(),
        }
    return row


def _recompute(config: Config) -> str:
    t = config.training
    if t.recompute_method == "block":
        return f"{t.recompute_num_layers} layers per stage"
    return t.recompute_granularity or "none"


def _describe(config: Config, layout: Layout) -> str:
    p = config.parallel
    pipe = f"PP{layout.pp}" + (f" v{layout.pipeline.chunks}" if layout.pipeline.chunks > 1 else "")
    if layout.pipeline.chunks == 1 and p.decoder_first_pipeline_num_layers:
        pipe += f" ({p.decoder_first_pipeline_num_layers}/{p.decoder_last_pipeline_num_layers} on the ends)"
    if p.account_for_embedding_in_pipeline_split and p.account_for_loss_in_pipeline_split:
        pipe += " (embedding and loss counted as layers)"
    return f"TP{layout.tp} CP{layout.cp} {pipe} DP{layout.dp} mbs{layout.micro_batch_size} ZeRO-{p.zero_stage}"
