"""fp8 training through torchao, run on the CPU with its emulated fp8 matmuls (PARATRON_FP8_EMULATE=1: the
same casts and scales as on Hopper, no fp8 kernel): Megatron's format names set each cast's type, the chosen
layers become torchao's Float8Linear (the tensor-parallel ones their fp8 twins), training follows bf16 within
fp8's error, ZeRO-3 (with and without --fp8-param-gather, weights gathered in fp8) trains as the same layout at
ZeRO-1, and TP 2 (with and without sequence parallelism) as one process."""

from __future__ import annotations

import pytest
import torch
from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

from paratron.commands.train import train_config
from paratron.config import build_config
from paratron.config.validation import validate
from paratron.distributed.init import initialize
from paratron.distributed.local_ranks import run_ranks
from paratron.errors import ConfigError
from paratron.model.gpt import GPT
from paratron.parallel import fp8
from paratron.parallel.fp8 import EMULATE_VARIABLE, convert_to_float8, float8_config
from paratron.parallel.tensor.apply import apply_tensor_parallel
from paratron.parallel.tensor.layers import TPContext

from tiny import LLAMA_STYLE, QUIET, training_records

SETTINGS = dict(
    QUIET,
    **LLAMA_STYLE,
    num_layers=2,
    hidden_size=64,
    num_attention_heads=4,
    ffn_hidden_size=128,
    vocab_size=256,
    seq_length=32,
    max_position_embeddings=32,
    micro_batch_size=2,
    global_batch_size=4,
    train_iters=8,
    lr=1e-3,
    mock_data=True,
    precision="bf16",
)
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
GRADIENT_CASTS = ("cast_config_grad_output", "cast_config_grad_output_for_grad_weight")


@pytest.fixture(scope="module")
def one_process_hybrid(tmp_path_factory) -> list[dict]:
    """The metrics of one process training `SETTINGS` with the hybrid format, run once for the tests that
    compare with it."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(EMULATE_VARIABLE, "1")
        return training_records(dict(SETTINGS, run_dir=str(tmp_path_factory.mktemp("hybrid")), fp8_format="hybrid"))


@pytest.mark.parametrize("recipe, granularity", [("tensorwise", "TENSORWISE"), ("rowwise", "AXISWISE")])
def test_the_format_sets_every_cast_and_the_recipe_the_scales(recipe, granularity):
    for fp8_format, gradient in (("e4m3", E4M3), ("hybrid", E5M2)):
        config = float8_config(fp8_format, recipe)
        casts = {name: getattr(config, name) for name in fp8.cast_targets(fp8_format)}
        assert {name: c.target_dtype for name, c in casts.items() if name not in GRADIENT_CASTS} == dict.fromkeys(
            set(casts) - set(GRADIENT_CASTS), E4M3
        )
        assert [casts[name].target_dtype for name in GRADIENT_CASTS] == [gradient, gradient], (fp8_format, recipe)
        assert config.cast_config_input.scaling_granularity.name == granularity
        assert not config.enable_fsdp_float8_all_gather
    assert float8_config("hybrid", "tensorwise", param_gather=True).enable_fsdp_float8_all_gather


def test_the_transformer_linears_become_float8_and_train_as_bf16_within_fp8_error(
    tmp_path, monkeypatch, one_process_hybrid
):
    from torchao.float8.float8_linear import Float8Linear

    monkeypatch.setenv(EMULATE_VARIABLE, "1")
    config = build_config(dict(SETTINGS, fp8_format="hybrid"))
    model = convert_to_float8(GPT(config.model), config.training)
    converted = sorted(name for name, module in model.named_modules() if isinstance(module, Float8Linear))
    assert len(converted) == 2 * 7 and "layers.0.mlp.in_proj.gate" in converted  # (q, k, v, out, gate, up, down)
    assert type(model.output) is torch.nn.Linear

    bf16 = training_records(dict(SETTINGS, run_dir=str(tmp_path / "bf16")))
    for fp8_format in ("e4m3", "hybrid"):
        if fp8_format == "hybrid":
            run = one_process_hybrid
        else:
            run = training_records(dict(SETTINGS, run_dir=str(tmp_path / fp8_format), fp8_format=fp8_format))
        gaps = [abs(a["loss"] - b["loss"]) / b["loss"] for a, b in zip(run, bf16)]
        assert len(run) == 8 and 0 < max(gaps) < 5e-4, (fp8_format, gaps)  # (fp8 rounds: 9.8e-5 e4m3, 9.0e-5 hybrid)


def test_param_gather_is_refused_where_it_cannot_serve():
    def refusal(*flags: str) -> str:
        with pytest.raises(ConfigError) as error:
            validate(train_config(["--bf16", "--mock-data", *flags]), 2)
        assert "\n" not in str(error.value)
        return str(error.value)

    assert "add --zero-stage 3" in refusal("--fp8-format", "e4m3", "--fp8-param-gather")
    assert "--fp8-recipe tensorwise" in refusal(
        "--fp8-format", "e4m3", "--fp8-recipe", "rowwise", "--fp8-param-gather", "--zero-stage", "3"
    )
    assert "add --fp8-format" in refusal("--fp8-param-gather", "--zero-stage", "3")


TWO_RANK_LAYOUTS = {
    "zero1": dict(zero_stage=1),
    "zero3": dict(zero_stage=3),
    "zero3-fp8-gather": dict(zero_stage=3, fp8_param_gather=True),
    "tp2": dict(tensor_model_parallel_size=2),
    "tp2-sp": dict(tensor_model_parallel_size=2, sequence_parallel=True),
}


def two_rank_losses(run_dir: str) -> tuple[dict[str, list[float]], list[bool]]:
    """Each layout's losses, one run after another on one process group; and, for each fp8 all-gather of a
    weight, whether its scale was computed before (one all-reduce for all weights) rather than inside it."""
    initialize("gloo")
    gather = WeightWithDynamicFloat8CastTensor.fsdp_pre_all_gather
    precomputed = []

    def watched(weight: WeightWithDynamicFloat8CastTensor, *args):
        precomputed.append(weight._precomputed_scale is not None)
        return gather(weight, *args)

    WeightWithDynamicFloat8CastTensor.fsdp_pre_all_gather = watched  # (in this rank's process only)
    losses = {}
    for name, layout in TWO_RANK_LAYOUTS.items():
        records = training_records(dict(SETTINGS, run_dir=f"{run_dir}/{name}", fp8_format="hybrid", **layout))
        losses[name] = [r["loss"] for r in records]
    return losses, precomputed


def test_zero3_and_tensor_parallel_fp8_train_as_one_process(tmp_path, monkeypatch, one_process_hybrid):
    monkeypatch.setenv(EMULATE_VARIABLE, "1")
    losses, precomputed = run_ranks(two_rank_losses, 2, str(tmp_path))[0]
    assert len(losses["zero1"]) == 8
    assert len(precomputed) >= 8 * 2 and all(precomputed)  # (every step's gathers: each weight's scale precomputed)
    assert losses["zero3"] == pytest.approx(losses["zero1"], rel=5e-4)  # (bf16 sums in another order: 7e-5)
    # fp8 all-gather casts the fp32 shards, not their bf16 copies: another rounding, the same training
    assert losses["zero3-fp8-gather"] == pytest.approx(losses["zero1"], rel=5e-4)
    assert losses["zero3-fp8-gather"] != losses["zero3"]
    # each rank scales its own shard of a weight: fp8's rounding apart from one process, never more
    one = [r["loss"] for r in one_process_hybrid]
    for layout in ("tp2", "tp2-sp"):
        assert losses[layout] == pytest.approx(one, rel=5e-4), layout


def test_tensor_parallel_layers_become_their_fp8_twins(monkeypatch):
    monkeypatch.setenv(EMULATE_VARIABLE, "1")
    config = build_config(dict(SETTINGS, fp8_format="e4m3", tensor_model_parallel_size=2))
    with torch.device("meta"):
        model = GPT(config.model)
    apply_tensor_parallel(model, TPContext(size=2, rank=0), None, 1)
    convert_to_float8(model, config.training)
    twins = {name: type(module).__name__ for name, module in model.named_modules() if "Float8" in type(module).__name__}
    block = {
        "attention.in_proj": "Float8ColumnParallelProjections",
        **{f"attention.in_proj.{p}": "Float8ColumnParallelLinear" for p in "qkv"},
        "attention.out_proj": "Float8RowParallelLinear",
        "mlp.in_proj": "Float8ColumnParallelProjections",
        **{f"mlp.in_proj.{p}": "Float8ColumnParallelLinear" for p in ("gate", "up")},
        "mlp.out_proj": "Float8RowParallelLinear",
    }
    assert twins == {f"layers.{i}.{name}": kind for i in (0, 1) for name, kind in block.items()}
    assert type(model.output).__name__ == "VocabParallelOutput"
