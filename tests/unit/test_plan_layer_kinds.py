"""The planner prices each layer from its kinds' declarations: a --hybrid-layer-pattern that spells the same layers
as a block model is predicted the same memory and time, gated attention costs its gate's terms, and a pattern model
is planned (its '|' stages as given)."""

from __future__ import annotations

import json
import math
import subprocess

import pytest

from paratron.cli import main
from paratron.config import build_config, validate
from paratron.config.layout import resolve_layout
from paratron.planning import hardware as hw
from paratron.planning.activations import CUDA
from paratron.planning.cost import predict_step
from paratron.planning.dry_run import with_vocabulary
from paratron.planning.memory_prediction import predict_memory
from paratron.planning.operations import stage_operations
from paratron.planning.search import plan
from paratron.training.flops import training_flops_per_token

H100 = hw.PRESETS["h100-80g"]
LLAMA = dict(model_name="llama3-8b", precision="bf16", seq_length=4096, global_batch_size=16, micro_batch_size=1)
MOE = dict(num_experts=8, moe_router_topk=2)


def config_of(**values):
    return with_vocabulary(build_config(dict(LLAMA, **values)))


def predicted(config, world: int) -> tuple[list[dict], float]:
    layout = validate(config, world, check_data=False)
    memory = [vars(role) for role in predict_memory(config, world, CUDA, layout)]
    return memory, predict_step(config, layout, H100).total


LAYOUTS = {
    "one rank": (1, {}, {}),
    "tp2 sp selective": (2, dict(tensor_model_parallel_size=2, sequence_parallel=True), {}),
    "cp2 zero1": (2, dict(context_parallel_size=2, use_distributed_optimizer=True), {}),
    "pp2 zb-h1": (2, dict(pipeline_model_parallel_size=2, pipeline_schedule="zb-h1"), {}),
    "experts ep2": (2, dict(MOE, expert_model_parallel_size=2), dict(moe_layer_freq="[1,0]")),
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_a_pattern_spelling_blocks_is_predicted_as_the_blocks(name):
    world, settings, block_only = LAYOUTS[name]
    pattern = "*E*-" if "num_experts" in settings else "*-*-"
    if settings.get("pipeline_model_parallel_size"):
        pattern = pattern[:2] + "|" + pattern[2:]  # (the blocks' even split: a block per stage)
    if name == "tp2 sp selective":
        settings = dict(settings, recompute_granularity="selective")
    blocks = predicted(config_of(num_layers=2, **settings, **block_only), world)
    layers = predicted(config_of(hybrid_layer_pattern=pattern, **settings), world)
    for block_role, pattern_role in zip(*(memory for memory, _ in (blocks, layers)), strict=True):
        for category, value in block_role.items():
            assert pattern_role[category] == pytest.approx(value, rel=1e-9, abs=1), f"{name}: {category}"
    assert layers[1] == pytest.approx(blocks[1], rel=1e-9)


def test_gated_attention_costs_its_gate():
    plain, gated = config_of(num_layers=4), config_of(num_layers=4, attention_output_gate=True)
    layout = resolve_layout(plain, 1)
    (plain_memory,), (gated_memory,) = (predict_memory(c, 1, CUDA, layout) for c in (plain, gated))
    m, tokens = plain.model, 4096
    gate_rows = m.num_attention_heads * m.kv_channels
    assert gated_memory.activations - plain_memory.activations == 4 * 2 * 2 * gate_rows * tokens  # sigmoid, product
    assert gated_memory.parameters - plain_memory.parameters == 4 * 2 * m.hidden_size * gate_rows  # bf16 weights
    (plain_ops,), (gated_ops,) = (stage_operations(c, layout, H100)[0] for c in (plain, gated))
    gate_flops = 4 * 2 * tokens * m.hidden_size * gate_rows
    assert gated_ops["F"] - plain_ops["F"] == pytest.approx(gate_flops / H100.flops, rel=1e-6)
    assert predict_step(gated, layout, H100).total > predict_step(plain, layout, H100).total


def test_pattern_models_are_planned():
    experts = plan(build_config(dict(LLAMA, hybrid_layer_pattern="*E*-", **MOE)), 8, H100, within=math.inf)
    assert experts and {p.settings["expert_model_parallel_size"] for p in experts} > {1}
    staged = plan(build_config(dict(LLAMA, hybrid_layer_pattern="*-*-|*-*-")), 8, H100, within=math.inf)
    assert {(p.layout.pp, p.layout.pipeline.chunks) for p in staged} <= {(2, 1), (1, 2)} and staged
    assert all(p.layout.pipeline.counts == (4, 4) for p in staged)


def _run(capsys, *args: str) -> subprocess.CompletedProcess:
    code = main(list(args))
    return subprocess.CompletedProcess(args, code, *capsys.readouterr())


def test_the_plan_command_plans_a_pattern_model(capsys, tmp_path):
    output = tmp_path / "plans.json"
    run = _run(
        capsys, "plan", "--model", "llama3-8b", "--hybrid-layer-pattern", "*-*-|*-*-", "--seq-length", "4096",
        "--global-batch-size", "16", "--nodes", "1", "--hardware", "h100-80g", "--output", str(output),
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    plans = json.loads(output.read_text())["plans"]
    assert plans and all("PP2" in p["layout"] for p in plans)


def test_group_limited_routing_is_planned_and_counted_as_plain_routing():
    """Group-limited routing changes which experts a token meets, not a matmul: the same memory, time and FLOPs."""
    grouped = dict(MOE, moe_router_num_groups=4, moe_router_group_topk=2)
    layout = dict(expert_model_parallel_size=2, moe_layer_freq="[1,0]")
    plain_config = config_of(num_layers=2, **MOE, **layout)
    grouped_config = config_of(num_layers=2, **grouped, **layout)
    assert predicted(grouped_config, 2) == predicted(plain_config, 2)
    flops = (training_flops_per_token(c.model, 4096) for c in (plain_config, grouped_config))
    assert len(set(flops)) == 1
    plans = plan(build_config(dict(LLAMA, hybrid_layer_pattern="*E*-", **grouped)), 2, H100, within=math.inf)
    assert plans and {p.settings["expert_model_parallel_size"] for p in plans} > {1}
