"""`paratron plan --calibration doctor.json`: the doctor's report read, checked and fitted into the
hardware the cost model prices with, and what that does to the predictions and the ranking."""

from __future__ import annotations

import json

import pytest

from paratron.commands.plan import run as run_plan
from paratron.config.layout import resolve_layout
from paratron.config.loading import build_config
from paratron.errors import ConfigError
from paratron.planning import hardware as hw
from paratron.planning.calibration import calibrate, fit_link, read_calibration
from paratron.planning.cost import predict_step
from paratron.planning.dry_run import run_dry_run, with_vocabulary
from paratron.planning.hardware import ring_terms
from paratron.planning.search import plan

H100 = hw.PRESETS["h100-80g"]


def timings(op: str, ranks: int, spans: bool, latency_us: float, gbps: float) -> list[dict]:
    """What an alpha-beta link of `gbps` and `latency_us` per step takes for messages of 1 KiB to 1 GiB."""
    out = []
    for size in (2**k for k in range(10, 31, 4)):
        steps, chunk = ring_terms(op, size, ranks)
        time_us = steps * (latency_us + chunk / (gbps * 1e9) * 1e6)
        out.append({"op": op, "group_size": ranks, "spans_nodes": spans, "bytes": size, "time_us": time_us})
    return out


def report(intra_gbps: float = 225.0, inter_gbps: float = 25.0, tflops: float | None = 600.0, **changes) -> dict:
    """A doctor.json of 2 nodes of 8 H100s."""
    collectives = timings("all_reduce", 8, False, 3.0, intra_gbps) + timings("all_gather", 8, False, 3.0, intra_gbps)
    collectives += timings("reduce_scatter", 16, True, 9.0, inter_gbps) + timings("send_recv", 2, True, 9.0, inter_gbps)
    return {
        "format": "paratron-doctor/1",
        "world_size": 16,
        "nodes": 2,
        "ranks_per_node": 8,
        "backend": "nccl",
        "device_type": "cuda",
        "versions": {},
        "devices": [{"name": "NVIDIA H100 80GB HBM3", "memory_gb": 79.2}] * 16,
        "environment": {},
        "compute": {"matmul_tflops": tflops, "dtype": "bfloat16"},
        "collectives": collectives,
        "warnings": [],
        **changes,
    }


def written(tmp_path, document, name="doctor.json") -> str:
    path = tmp_path / name
    path.write_text(json.dumps(document) if not isinstance(document, str) else document)
    return str(path)


def test_the_fit_recovers_each_levels_latency_and_bandwidth(tmp_path):
    measured = read_calibration(written(tmp_path, report()))
    assert measured.intra_node.bandwidth_gbps == pytest.approx(225.0, rel=1e-9)
    assert measured.intra_node.latency_us == pytest.approx(3.0, rel=1e-6)
    assert measured.intra_node.operations == ("all_reduce", "all_gather") and measured.intra_node.group_sizes == (8,)
    assert measured.inter_node.bandwidth_gbps == pytest.approx(25.0, rel=1e-9)
    assert measured.inter_node.latency_us == pytest.approx(9.0, rel=1e-6)
    assert measured.device_memory_gb == 79.2 and measured.matmul_tflops == 600.0
    # one size only: no latency to tell apart, the bandwidth from that size
    single = fit_link([{"op": "all_reduce", "group_size": 4, "bytes": 1e6, "time_us": 15.0, "spans_nodes": False}])
    assert single.latency_us == 0 and single.bandwidth_gbps == pytest.approx(2 * 3 / 4 * 1e6 / 15e-6 / 1e9)


def test_measured_figures_replace_the_presets_and_flags_win(tmp_path):
    measured = read_calibration(written(tmp_path, report()))
    machine, lines = calibrate(H100, measured, precision="bf16")
    assert machine.intra_node_gbps == pytest.approx(225) and machine.inter_node_latency_us == pytest.approx(9)
    assert machine.flops == pytest.approx(600e12) and machine.peak_tflops == H100.peak_tflops
    assert machine.device_memory_gb == 79.2
    assert lines[1].startswith("  intra-node: measured 225 GB/s, 3 us per step (12 timings of all-reduce, all-gather")
    kept, lines = calibrate(H100, measured, keep={"intra_node_gbps", "intra_node_latency_us", "matmul_efficiency"})
    assert (kept.intra_node_gbps, kept.flops) == (H100.intra_node_gbps, H100.flops)
    assert kept.inter_node_gbps == pytest.approx(25)
    assert "intra-node: as given on the command line" in lines[1] and "compute: as given" in lines[3]
    # one node: the preset's network between nodes stays, and the plan says so
    alone = report(collectives=timings("all_reduce", 8, False, 3.0, 225.0), nodes=1, world_size=8)
    machine, lines = calibrate(H100, read_calibration(written(tmp_path, alone, "one.json")))
    assert machine.inter_node_gbps == H100.inter_node_gbps
    assert "  inter-node: the preset's 50 GB/s (no group spanned nodes)" in lines


def test_half_the_bandwidth_slows_communication_heavy_layouts_and_changes_the_ranking(tmp_path):
    preset_speed = report(intra_gbps=H100.intra_node_gbps, inter_gbps=H100.inter_node_gbps, tflops=None)
    half_speed = report(intra_gbps=H100.intra_node_gbps / 2, inter_gbps=H100.inter_node_gbps / 2, tflops=None)
    as_preset, _ = calibrate(H100, read_calibration(written(tmp_path, preset_speed, "full.json")))
    slow, _ = calibrate(H100, read_calibration(written(tmp_path, half_speed, "half.json")))
    config = build_config({"model_name": "llama3-8b", "precision": "bf16"})
    request = dict(global_batch=32, seq_length=2048)
    before, after = plan(config, 16, as_preset, **request, top=1)[0], plan(config, 16, slow, **request, top=1)[0]
    assert before.describe() != after.describe()
    for chosen in (before, after):
        fast_run = predict_step(chosen.config, chosen.layout, as_preset)
        slow_run = predict_step(chosen.config, chosen.layout, slow)
        assert slow_run.compute == pytest.approx(fast_run.compute)
        assert slow_run.total > fast_run.total
    # the more a layout communicates, the more it loses: tensor parallelism inside nodes against data parallelism
    # across them
    losses = []
    for tp in (8, 1):
        settings = {
            "tensor_model_parallel_size": tp,
            "sequence_parallel": tp > 1,
            "global_batch_size": 32,
            "micro_batch_size": 1,
        }
        config = with_vocabulary(build_config({"model_name": "llama3-8b", "precision": "bf16", **settings}))
        layout = resolve_layout(config, 16)
        times = [predict_step(config, layout, machine) for machine in (as_preset, slow)]
        talk = [t.tensor_parallel + t.data_parallel + t.pipeline_p2p for t in times]
        assert times[1].compute == times[0].compute and talk[1] > talk[0]
        losses.append((talk[0], times[1].total - times[0].total))
    (less, less_lost), (more, more_lost) = sorted(losses)
    assert more > 2 * less and more_lost > 2 * less_lost > 0


def test_the_matmul_figure_sets_the_compute_time(tmp_path):
    config = build_config({"model_name": "llama3-8b", "precision": "bf16"})
    found = plan(config, 8, H100, global_batch=16, seq_length=2048, top=1)[0]
    times = {}
    for tflops in (200.0, 400.0):
        machine, lines = calibrate(H100, read_calibration(written(tmp_path, report(tflops=tflops), f"{tflops}.json")))
        assert machine.flops == pytest.approx(tflops * 1e12)
        assert f"compute: measured {tflops:.4g} TFLOP/s dense matmul" in lines[3]
        times[tflops] = predict_step(found.config, found.layout, machine).compute
    assert times[200.0] == pytest.approx(2 * times[400.0], rel=0.01)  # (less the memory-bound lookups and loss)
    faster, _ = calibrate(H100, read_calibration(written(tmp_path, report(tflops=1500.0), "fast.json")))
    assert faster.peak_tflops == 1500.0 and faster.matmul_efficiency == 1.0


@pytest.mark.parametrize(
    "content, message",
    [
        (None, r"^--calibration {path}: no such file; write it with paratron doctor --output FILE\.json$"),
        ("{not json", r"^--calibration {path}: not JSON \(line 1: .+\); write it with paratron doctor"),
        ([1, 2], r"^--calibration {path}: not a doctor report \(a JSON object\); write it with"),
        ({"format": "nccl-tests/2"}, r"^--calibration {path}: format 'nccl-tests/2', expected 'paratron-doctor/1';"),
        (
            {"format": "paratron-doctor/1", "world_size": 2, "nodes": 1},
            r"^--calibration {path}: no ranks_per_node, device_type, devices, compute, collectives; write it with",
        ),
        (
            report(collectives=[{"op": "broadcast", "group_size": 2, "spans_nodes": False, "bytes": 8, "time_us": 1}]),
            r"^--calibration {path}: a malformed entry \(ValueError: unknown collective 'broadcast'\); write it again",
        ),
        (
            report(collectives=[{"op": "all_reduce", "group_size": 2, "bytes": 8, "time_us": 1}]),
            r"^--calibration {path}: a malformed entry \(KeyError: 'spans_nodes'\)",
        ),
    ],
)
def test_a_bad_file_is_one_line_naming_it_and_the_fix(tmp_path, content, message):
    path = str(tmp_path / "doctor.json") if content is None else written(tmp_path, content)
    with pytest.raises(ConfigError, match=message.format(path=path)) as caught:
        read_calibration(path)
    assert "\n" not in str(caught.value)


def test_a_report_of_other_devices_is_refused_or_warned(tmp_path):
    cpu = read_calibration(written(tmp_path, report(device_type="cpu", devices=[{"name": "Xeon", "memory_gb": 64}])))
    with pytest.raises(
        ConfigError, match=r"measured cpu devices, but the plan is for --hardware h100-80g; run paratron"
    ):
        calibrate(H100, cpu)
    a100 = report(devices=[{"name": "NVIDIA A100-SXM4-80GB", "memory_gb": 80}], ranks_per_node=4)
    _, lines = calibrate(H100, read_calibration(written(tmp_path, a100, "a100.json")), precision="fp32")
    assert "  warning: measured NVIDIA A100-SXM4-80GB, the preset is h100-80g: its figures are replaced" in lines
    assert "  warning: measured 4 ranks per node, the plan has 8" in lines
    assert "  warning: the matmul was timed in bf16, the plan trains in fp32" in lines


def test_paratron_plan_prints_what_was_measured(tmp_path, capsys):
    path = written(tmp_path, report())
    argv = ["--model", "llama3-1b", "--nodes", "2", "--global-batch-size", "32", "--seq-length", "1024"]
    assert run_plan([*argv, "--calibration", path, "--top", "1", "--output", str(tmp_path / "p.json")]) == 0
    out = capsys.readouterr().out
    assert f"calibration {path}: measured on 16 ranks, 2 node(s) of 8, cuda (NVIDIA H100 80GB HBM3)" in out
    assert "  inter-node: measured 25 GB/s, 9 us per step (12 timings of reduce-scatter, send-recv over 2/16" in out
    saved = json.loads((tmp_path / "p.json").read_text())
    assert saved["hardware"]["intra_node_gbps"] == pytest.approx(225) and saved["hardware"]["device_memory_gb"] == 79.2
    assert saved["request"]["calibration"][0].startswith("calibration ")
    with pytest.raises(ConfigError, match="no such file"):
        run_plan([*argv, "--calibration", str(tmp_path / "missing.json")])


def test_the_dry_run_checks_against_the_measured_memory(tmp_path, capsys):
    gpu = written(tmp_path, report())
    cpu = written(tmp_path, report(device_type="cpu", devices=[{"name": "Xeon", "memory_gb": 64.0}]), "cpu.json")
    for path, limit in ((gpu, "79.2 GB"), (cpu, "32 GB")):  # (the CPU's memory shared by its 2 processes)
        config = build_config({"model_name": "debug", "mock_data": True, "world_size": 2, "calibration": path})
        assert run_dry_run(config) == 0
        assert capsys.readouterr().out.rstrip().endswith(f"uses 0% of {limit}")
