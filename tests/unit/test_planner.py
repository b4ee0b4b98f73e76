"""The planner's parts without processes: the alpha-beta model, the schedule simulation with
per-stage costs, the cost model's bound, the search's rules, its commands and its errors."""

from __future__ import annotations

import dataclasses
import math
import random
import re

import pytest

from paratron.commands.train import parser as train_parser
from paratron.config.arguments import parse_config_arguments
from paratron.config.layout import resolve_layout
from paratron.config.loading import build_config
from paratron.config.schema import PlanningConfig
from paratron.errors import ConfigError
from paratron.parallel.pipeline.schedules import build_schedule, simulate, theoretical_bubble
from paratron.parallel.pipeline.timing import flatten, rank_times
from paratron.planning import cost
from paratron.planning import hardware as hw
from paratron.planning.candidates import balanced_ends, micro_batch_sizes, shapes, zero_bubble_too_long, zero_stages
from paratron.planning.cost import predict_step, step_bound
from paratron.planning.dry_run import with_vocabulary
from paratron.planning.launch_line import config_arguments
from paratron.planning.live import live_counts
from paratron.planning.operations import stage_operations
from paratron.planning.published import RUNS, evaluate
from paratron.planning.search import WITHIN, _Search, apply, plan

H100 = hw.PRESETS["h100-80g"]


def config_of(**values):
    return build_config({"precision": "bf16", **values})


# ---------------------------------------------------------------- hardware and the alpha-beta model


def test_alpha_beta_collectives():
    over = hw.Link(bandwidth=100e9, latency=5e-6)
    assert hw.all_reduce_time(1e9, 1, over) == 0.0
    # ring all-reduce: 2(n-1) steps of n-th parts; all-gather and reduce-scatter half of that
    assert hw.all_reduce_time(1e9, 8, over) == pytest.approx(2 * 7 * (1e9 / 8 / 100e9 + 5e-6))
    assert hw.all_gather_time(1e9, 8, over) == pytest.approx(hw.all_reduce_time(1e9, 8, over) / 2)
    assert hw.reduce_scatter_time(1e9, 8, over) == hw.all_gather_time(1e9, 8, over)
    assert hw.all_to_all_time(8e6, 4, over) == pytest.approx(3 * (2e6 / 100e9 + 5e-6))
    assert hw.p2p_time(1e6, over) == pytest.approx(5e-6 + 1e-5)
    # bandwidth-bound for large messages, latency-bound for small ones
    assert hw.all_reduce_time(1e11, 64, over) / hw.all_reduce_time(5e10, 64, over) == pytest.approx(2, rel=1e-3)
    assert hw.all_reduce_time(8, 64, over) == pytest.approx(2 * 63 * 5e-6, rel=1e-3)


def test_links_follow_the_rank_grid():
    intra, inter = hw.link(H100, 1, 8), hw.link(H100, 8, 2)
    assert intra.bandwidth == 450e9 and intra.latency == 3e-6
    assert inter.bandwidth == 50e9 and inter.latency == 8e-6
    assert hw.link(H100, 2, 4) == intra  # 2 x 4 = 8 ranks fit a node
    assert hw.link(H100, 4, 4) == inter


def test_presets_and_overrides():
    assert hw.PRESETS["h200-141g"].device_memory_gb == 141 and hw.PRESETS["h200-141g"].peak_tflops == 989
    assert hw.PRESETS["a100-80g"].inter_node_gbps == 25
    chosen = hw.hardware_from(PlanningConfig(hardware="a100-80g", device_memory_gb=40), nodes=4, matmul_efficiency=None)
    assert (chosen.device_memory_gb, chosen.nodes, chosen.world_size, chosen.matmul_efficiency) == (40, 4, 32, 0.55)
    with pytest.raises(
        ConfigError,
        match=r"^--hardware tpu-v5: unknown preset; choose one of h100-80g, h200-141g, gb200, a100-80g, cpu$",
    ):
        hw.hardware_from(PlanningConfig(hardware="tpu-v5"))
    with pytest.raises(ConfigError, match="--matmul-efficiency 1.5: must be at most 1"):
        hw.hardware_from(PlanningConfig(), matmul_efficiency=1.5)


def test_h200_and_gb200_plan_llama3_8b():
    h200, gb200 = hw.PRESETS["h200-141g"], hw.PRESETS["gb200"]
    assert (h200.device_memory_gb, h200.peak_tflops, h200.memory_gbps, h200.intra_node_gbps) == (141, 989, 4800, 450)
    speeds = (gb200.device_memory_gb, gb200.peak_tflops, gb200.memory_gbps, gb200.intra_node_gbps)
    assert speeds == (186, 2500, 8000, 900)
    assert gb200.gpus_per_node == 72  # (one NVLink domain)
    config = config_of(model_name="llama3-8b")
    best = {}
    for name, machine, world in (("h200", h200, 8), ("gb200", gb200, 72)):
        plans = plan(config, world, machine, global_batch=72 if world == 72 else 64, seq_length=8192, top=3)
        assert plans and all(p.peak_memory <= machine.device_memory_bytes for p in plans), name
        assert plans[0].layout.world_size == world
        best[name] = plans[0].prediction.total
    same = plan(config, 8, dataclasses.replace(gb200, gpus_per_node=8), global_batch=64, seq_length=8192, top=1)
    assert best["h200"] / same[0].prediction.total > 2  # (2.5x the peak, faster memory and NVLink)


def test_cpu_is_measured_quickly():
    machine = hw.measure_cpu(2)
    assert machine.name == "cpu" and machine.gpus_per_node == 2
    assert machine.peak_tflops > 0 and machine.intra_node_gbps > 0 and machine.device_memory_gb > 0


# ---------------------------------------------------------------- the schedule with per-stage costs


@pytest.mark.parametrize("name, pp, m, v", [("1f1b", 4, 8, 1), ("interleaved", 4, 8, 2), ("zb-h1", 4, 12, 1)])
def test_equal_stage_costs_reproduce_the_closed_forms(name, pp, m, v):
    schedule = build_schedule(name, pp, m, v)
    split = name == "zb-h1"
    per_stage = {"F": 1 / v, "B": (1 if split else 2) / v, "W": (1 / v) if split else 0.0}
    timeline = simulate(schedule, stage_costs=[per_stage] * schedule.num_stages)
    assert timeline.bubble_fraction() == pytest.approx(theoretical_bubble(name, pp, m, v))
    assert timeline.makespan == simulate(schedule).makespan
    finish, busy = rank_times(flatten(schedule), [tuple(per_stage.values())] * schedule.num_stages)
    assert max(finish) == timeline.makespan and busy == [timeline.busy(r) for r in range(pp)]


def test_unequal_stage_costs_move_the_bottleneck():
    schedule = build_schedule("1f1b", 4, 8)
    costs = [{"F": 1.0, "B": 2.0}] * 4
    slow = [*costs[:3], {"F": 2.0, "B": 4.0}]  # the last stage (the output layer) twice as long
    base, heavy = simulate(schedule, stage_costs=costs), simulate(schedule, stage_costs=slow)
    assert heavy.makespan >= base.makespan + 8 * 3.0  # its rank is busy 8 x 3 longer
    assert heavy.busy(3) == pytest.approx(8 * 6.0)
    with pytest.raises(ValueError, match="stage_costs has 3 entries for 4 model stages"):
        simulate(schedule, stage_costs=costs[:3])


# ---------------------------------------------------------------- the cost model


def test_step_bound_is_a_lower_bound_and_parts_add_up():
    cases = [
        dict(tensor_model_parallel_size=8, pipeline_model_parallel_size=8, sequence_parallel=True),
        dict(tensor_model_parallel_size=4, pipeline_model_parallel_size=4, virtual_pipeline_model_parallel_size=5),
        dict(pipeline_model_parallel_size=4, pipeline_schedule="zb-h1", zero_stage=2, overlap_grad_reduce=True),
        dict(tensor_model_parallel_size=8, context_parallel_size=2, pipeline_model_parallel_size=2, zero_stage=1),
        dict(tensor_model_parallel_size=8, zero_stage=3, recompute_granularity="selective"),
    ]
    for values in cases:
        config = config_of(
            model_name="llama3-70b", seq_length=2048, global_batch_size=256, micro_batch_size=1, **values
        )
        layout = resolve_layout(config, 512)
        step = predict_step(config, layout, H100)
        assert step_bound(config, layout, H100) <= step.total * (1 + 1e-3), values
        assert sum(step.breakdown.values()) == pytest.approx(step.total), values
        assert 0 < step.mfu < 1 and step.tokens_per_s == pytest.approx(256 * 2048 / step.total)


def test_recomputation_and_the_end_stages_cost_what_they_should():
    base = dict(model_name="llama3-8b", seq_length=4096, global_batch_size=64, micro_batch_size=1)
    base |= dict(pipeline_model_parallel_size=4)
    plain = config_of(**base)
    full = config_of(**base, recompute_granularity="full", recompute_method="uniform")
    layout = resolve_layout(plain, 32)
    (ops, parts), (again, _) = stage_operations(plain, layout, H100), stage_operations(full, layout, H100)
    message = parts[1]["pipeline_p2p"] / 2  # (a middle stage receives activations and gradients)
    assert again[1]["F"] == pytest.approx(ops[1]["F"])
    assert again[1]["B"] - ops[1]["B"] == pytest.approx(ops[1]["F"] - message)  # the forward again, not its message
    assert ops[3]["F"] > ops[1]["F"] > ops[0]["F"] * 0.95  # the output layer sits on the last stage


# ---------------------------------------------------------------- the search


def test_balanced_end_stages():
    assert balanced_ends(32, 4, 0.0) == (None, None)
    assert balanced_ends(126, 16, 0.7) in ((7, 7), (8, 7), (7, 6))  # one fewer layer where the ends do more
    first, last = balanced_ends(80, 8, 3.0)
    assert last < 10 and (80 - first - last) % 6 == 0


def test_plans_keep_tensor_and_expert_parallelism_in_a_node_and_fit():
    config = config_of(model_name="mixtral-8x7b", seq_length=2048, global_batch_size=64)
    found = list(shapes(config, 32, 4))
    assert {(s.tp, s.ep) for s in found} == {(t, e) for t in (1, 2, 4) for e in (1, 2, 4, 8) if t * e <= 4}
    assert {s.cp for s in found} == {1, 2, 4, 8}  # (dropless experts: context parallelism serves them)
    folded = config_of(model_name="mixtral-8x7b", seq_length=2048, global_batch_size=64, expert_tensor_parallel_size=1)
    pairs = {(s.tp, s.ep) for s in shapes(folded, 32, 4)}  # (EP over the TP ranks: EP x expert TP 1 in a node)
    assert pairs == {(t, e) for t in (1, 2, 4) for e in (1, 2, 4)}
    machine = dataclasses.replace(H100, gpus_per_node=4)
    plans = plan(config, 32, machine)
    assert plans and all(p.layout.tp * p.settings["expert_model_parallel_size"] <= 4 for p in plans)
    assert all(p.peak_memory <= machine.device_memory_bytes for p in plans)
    times = [p.prediction.total for p in plans]
    assert all(a <= b * (1 + 1e-9) for a, b in zip(times, times[1:])) and times[-1] <= 1.1 * times[0]


def test_memory_rejects_what_does_not_fit():
    config = config_of(model_name="llama3-8b")
    machine = dataclasses.replace(H100, gpus_per_node=4)
    roomy = plan(config, 4, machine, global_batch=8, seq_length=4096, within=math.inf)
    tight = plan(
        config, 4, dataclasses.replace(machine, device_memory_gb=40), global_batch=8, seq_length=4096, within=math.inf
    )
    assert all(p.peak_memory <= 40e9 for p in tight)
    assert len(tight) < len(roomy) and any(p.peak_memory > 40e9 for p in roomy)


def test_four_thousand_gpus_plan():
    plans = plan(config_of(model_name="gpt3-175b"), 4096, H100, global_batch=1536, seq_length=2048, top=5)
    assert len(plans) == 5 and plans[0].layout.world_size == 4096
    assert all(p.layout.tp <= 8 for p in plans)


def test_the_command_rebuilds_the_layout():
    config = config_of(model_name="llama3-8b", mock_data=True, train_iters=5)
    for found in plan(config, 16, H100, global_batch=64, seq_length=4096, top=3):
        command = found.command()
        assert command.startswith(
            "torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint HOST:PORT --rdzv-id JOB "
            "-m paratron train --model-name llama3-8b"
        )
        recipe, overrides, _ = parse_config_arguments(train_parser(), command.split(" train ", 1)[1].split())
        rebuilt = build_config(overrides, recipe)
        assert resolve_layout(rebuilt, 16) == found.layout
        assert rebuilt == apply(found.config, {})
        assert "--mock-data" in config_arguments(rebuilt)


def test_nothing_fits_names_the_memory_and_the_world():
    config = config_of(model_name="llama3-8b")
    small = dataclasses.replace(H100, device_memory_gb=8, gpus_per_node=2)
    with pytest.raises(ConfigError) as caught:
        plan(config, 2, small, global_batch=8, seq_length=2048)
    message = str(caught.value)
    assert "\n" not in message
    assert message.startswith("no layout of llama3-8b fits 8 GB per device on 2 ranks: the most frugal (TP")
    assert re.search(r" full\) needs (\d+\.\d) GB; use devices of at least \1 GB, or at least \d+ ranks$", message)


def test_no_divisor_names_world_sizes_that_would_work():
    config = config_of(model_name="debug", seq_length=64)
    machine = dataclasses.replace(H100, gpus_per_node=6)
    with pytest.raises(ConfigError, match=r"^no layout of debug on 6 ranks divides --global-batch-size 7 and "):
        plan(config, 6, machine, global_batch=7)
    with pytest.raises(ConfigError, match="world sizes that would: 1, 2, 7$"):
        plan(config, 6, dataclasses.replace(machine, gpus_per_node=1), global_batch=7)


# ---------------------------------------------------------------- published runs


@pytest.mark.parametrize("run", RUNS, ids=[r.name for r in RUNS])
def test_published_runs_are_predicted_within_fifteen_percent(run):
    row = evaluate(run, search=False)
    assert row["fits"], row
    assert abs(row["relative_error"]) <= 0.15, row


# ---------------------------------------------------------------- the fast paths give the exhaustive answers


def _walked_peak(schedule, rank: int, sizes: list[float]) -> float:
    """The activation peak by walking every operation of the rank (what the live counts stand for)."""
    live = peak = 0.0
    for action in schedule.ranks[rank]:
        if action.kind == "F":
            live += sizes[action.chunk]
            peak = max(peak, live)
        elif action.kind == "B":
            live -= sizes[action.chunk]
    return peak


@pytest.mark.parametrize(
    "name, pp, m, chunks", [("1f1b", 4, 9, 1), ("interleaved", 4, 8, 3), ("zb-h1", 4, 10, 1), ("zb-v", 3, 7, 2)]
)
def test_live_counts_give_the_walked_activation_peak(name, pp, m, chunks):
    schedule = build_schedule(name, pp, m, chunks)
    for rank in range(pp):
        counts = live_counts(name, pp, m, chunks, rank)
        assert 1 <= len(counts) <= m * schedule.chunks
        for sizes in (
            [1.0] * schedule.chunks,
            [7.0 + 5 * c for c in range(schedule.chunks)],
            [3e9, 1.0, 2e9][: schedule.chunks],
        ):
            fast = max(sum(n * s for n, s in zip(live, sizes)) for live in counts)
            assert fast == _walked_peak(schedule, rank, sizes)


def _fullest(counts: set) -> set:
    return {c for c in counts if not any(o != c and all(a >= b for a, b in zip(o, c)) for o in counts)}


def test_live_counts_without_the_schedule_are_the_schedules():
    for name, pp, m, chunks in [
        *(("1f1b", p, b, 1) for p in (1, 2, 4, 5) for b in (1, 2, 3, 8)),
        *(("interleaved", p, b, v) for p in (2, 3, 4) for v in (2, 3, 5) for b in (p, 2 * p, 5 * p)),
    ]:
        schedule = build_schedule(name, pp, m, chunks)
        for rank in range(pp):
            live, walked = [0] * chunks, set()
            for action in schedule.ranks[rank]:
                live[action.chunk] += {"F": 1, "B": -1}[action.kind]
                walked |= {tuple(live)} if action.kind == "F" else set()
            assert set(live_counts(name, pp, m, chunks, rank)) == _fullest(walked), (name, pp, m, chunks, rank)


def _exhaustive(config, world, hardware):
    """Every variant the search may price (no bound, no pruning), priced; the plans within WITHIN of the fastest."""
    run = _Search(with_vocabulary(config), world, hardware, math.inf, config)
    found = []
    for shape in shapes(run.base, world, hardware.gpus_per_node):
        for mbs in micro_batch_sizes(run.base, world, shape):
            if zero_bubble_too_long(run.base, world, shape, mbs):
                continue
            for zero in zero_stages(run.base, world, shape):
                options = run._options(shape, mbs, zero)
                variants = list(options)
                if run._layout(options[0]) and not run._fits(options[0]) and run._fits(options[-1]):
                    variants.append(run._fewest_recomputed(shape, mbs, zero))
                found += [p for p in map(run._evaluate, filter(None, variants)) if p is not None]
    best = min(p.prediction.total for p in found)
    kept = [p for p in found if p.prediction.total <= best * WITHIN]
    return sorted(kept, key=lambda p: (-p.prediction.tokens_per_s, p.peak_memory))


@pytest.mark.parametrize(
    "model, world, batch, seq, memory", [("llama3-1b", 8, 32, 4096, 12), ("debug-moe", 8, 32, 256, 80)]
)
def test_the_pruned_search_finds_the_exhaustive_plans(model, world, batch, seq, memory):
    config = config_of(model_name=model, global_batch_size=batch, seq_length=seq)
    hardware = dataclasses.replace(H100, device_memory_gb=memory)
    fast = plan(config, world, hardware)
    slow = _exhaustive(config, world, hardware)
    assert [(p.describe(), p.prediction, p.memory) for p in fast] == [
        (p.describe(), p.prediction, p.memory) for p in slow
    ]
    assert any(p.settings["recompute_granularity"] for p in fast) or memory == 80


@pytest.mark.parametrize(
    ("name", "pp", "chunks"),
    [("gpipe", 2, 1), ("1f1b", 4, 1), ("interleaved", 2, 2), ("zb-h1", 2, 1), ("zb-v", 2, 2)],
)
def test_long_schedules_are_priced_along_their_steady_state_as_whole_simulations_price_them(name, pp, chunks):
    """Past its warm-up a schedule adds the same time per group of pp micro-batches; the planner's
    three short simulations, extended along that line, equal the whole simulation."""
    rng = random.Random(5)
    stages = pp * chunks
    for microbatches in (3 * (cost.STEADY_GROUPS * pp + 2 * pp), 97 * pp, 97 * pp + 1):
        if name == "interleaved" and microbatches % pp:
            continue
        costs = tuple(
            (rng.uniform(1, 2), rng.uniform(2, 4), rng.uniform(0, 1) if name.startswith("zb") else 0.0)
            for _ in range(stages)
        )
        whole = cost._whole(name, pp, microbatches, chunks, costs)
        cost._simulated.cache_clear()
        priced = cost._simulated(name, pp, microbatches, chunks, costs)
        for got, want in zip((*priced[0], *priced[1]), (*whole[0], *whole[1])):
            assert got == pytest.approx(want, rel=1e-9), f"{name} pp {pp} m {microbatches}"
    built = []
    original = cost._whole
    try:
        cost._whole = lambda *args: built.append(args[2]) or original(*args)
        cost._simulated.cache_clear()
        cost._simulated(name, pp, 97 * pp, chunks, ((1.0, 2.0, 0.5),) * stages)
    finally:
        cost._whole = original
    assert 97 * pp not in built and len(built) == 3, built  # (three short simulations, not the whole one)
