"""`paratron debug compare` in one process: the kept elements, the assembly of ranks' pieces (experts
split over expert-parallel ranks among them), which rank's gradient counts, the router's record, the
report's order and tolerance, the flags of the two runs and the one-line refusals."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from tests.tiny import tiny_config

from paratron.cli import main
from paratron.config.validation import validate
from paratron.debugging.capture import _perturbing, block_of, step_file, write_capture
from paratron.debugging.capture_sample import (
    Captured,
    assemble,
    owns_gradient,
    param_tables,
    position_table,
    range_table,
    sample_indices,
    take_piece,
)
from paratron.debugging.compare import last_error_line, parse_compare, resolve_run, same_model, single_process_flags
from paratron.debugging.compare_report import compare_captures, format_report
from paratron.errors import ConfigError, DataError
from paratron.model.moe import Router, Routing
from paratron.parallel.sharding import ParamInfo, Shard, set_info, take_slice
from paratron.training.run import run_training

LIMIT = 64


def test_kept_elements_are_fixed_sorted_and_bounded() -> None:
    assert sample_indices((3, 5), LIMIT).tolist() == list(range(15))
    big = sample_indices((100, 300), LIMIT)
    assert big.numel() <= LIMIT and big.numel() > LIMIT // 2
    assert torch.equal(big, sample_indices((100, 300), LIMIT))  # the same choice in every run
    assert torch.all(big[1:] > big[:-1]) and int(big.max()) < 30_000


def _pieces_of_column_split(full: torch.Tensor, blocks: int, padding: int) -> list:
    """Two tensor-parallel ranks' pieces of `full` [1, T, N], its last dimension split in `blocks`
    blocks (gate rows, then up rows), each rank's local tensor padded with `padding` junk columns."""
    n = full.size(-1)
    per_block, pieces = n // blocks, []
    for rank in range(2):
        half = per_block // 2
        cols = [b * per_block + rank * half + i for b in range(blocks) for i in range(half)]
        local = torch.cat([full[..., cols], torch.full((1, full.size(1), padding), 99.0)], dim=-1)
        pairs = [
            (slice(b * per_block + rank * half, b * per_block + (rank + 1) * half), slice(b * half, (b + 1) * half))
            for b in range(blocks)
        ]
        tables = [None, None, range_table(n, pairs)]
        pieces.append(take_piece("forward", "x", (1, 0), local, tables, full.shape, LIMIT))
    return pieces


@pytest.mark.parametrize("blocks,padding", [(1, 0), (2, 0), (1, 3)])
def test_column_split_pieces_assemble_the_single_device_tensor(blocks: int, padding: int) -> None:
    full = torch.randn(1, 3, 8, generator=torch.Generator().manual_seed(0))
    (captured,) = assemble(_pieces_of_column_split(full, blocks, padding), LIMIT)
    kept = full.reshape(-1)[sample_indices(full.shape, LIMIT)]
    assert torch.equal(captured.values, kept)
    assert captured.rms == pytest.approx(float(full.double().square().mean().sqrt()), rel=1e-12)
    assert captured.max_abs == float(full.abs().max()) and not captured.notes


def test_sequence_split_and_sharded_gradient_pieces() -> None:
    """A context-parallel sequence split (chunks 0 and 3 on rank 0, 1 and 2 on rank 1) of an output, and a
    distributed optimizer's flat shards of a gradient, both put back whole."""
    full = torch.randn(1, 8, 4, generator=torch.Generator().manual_seed(1))
    pieces = []
    for positions in (torch.tensor([0, 1, 6, 7]), torch.tensor([2, 3, 4, 5])):
        tables = [None, position_table(8, positions), None]
        pieces.append(take_piece("forward", "h", (0, 0), full[:, positions], tables, full.shape, LIMIT))
    grad = torch.randn(6, 5, generator=torch.Generator().manual_seed(2))
    flat = grad.reshape(-1)
    for start, end in ((0, 13), (13, 30)):
        pieces.append(
            take_piece(
                "gradient", "w", (1, 0), flat[start:end], [None, None], grad.shape, LIMIT, (start, end), grad.shape
            )
        )
    h, w = assemble(pieces, LIMIT)
    assert torch.equal(h.values, full.reshape(-1)[sample_indices(full.shape, LIMIT)])
    assert torch.equal(w.values, flat[sample_indices(grad.shape, LIMIT)])
    assert w.rms == pytest.approx(float(grad.double().square().mean().sqrt()), rel=1e-12)


def test_tensor_parallel_ranks_disagreeing_on_a_replicated_output_is_found() -> None:
    full = torch.randn(1, 4, 6, generator=torch.Generator().manual_seed(3))
    tables = [None, None, None]
    same = [take_piece("forward", "o", (1, 0), full, tables, full.shape, LIMIT, owner=r == 0) for r in range(2)]
    assert assemble(same, LIMIT)[0].disagreement == 0.0
    off = take_piece("forward", "o", (1, 0), full * 1.01, tables, full.shape, LIMIT, owner=False)
    (captured,) = assemble([same[0], off], LIMIT)
    assert captured.disagreement == pytest.approx(0.01, rel=1e-3)
    assert torch.equal(captured.values, full.reshape(-1))  # (the first rank's copy is the record)


def test_order_blocks() -> None:
    names = ("embedding", "vision.encoder.layers.3", "layers.0.mlp", "layers.11", "final_norm", "output")
    assert [block_of(n) for n in names] == [0, 0, 1, 12, 10**6, 10**6]


def _write(folder: Path, step: int, tensors: dict[str, torch.Tensor], disagree: str = "") -> None:
    captured = []
    for order, (key, value) in enumerate(tensors.items()):
        kind, name = key.split("/", 1)
        flat = value.reshape(-1)[sample_indices(value.shape, LIMIT)]
        rms, top = float(value.square().mean().sqrt()), float(value.abs().max())
        captured.append(Captured(kind, name, (block_of(name), order), tuple(value.shape), flat, rms, top))
        if name == disagree:
            captured[-1].disagreement = 0.02
    write_capture(folder, step, captured, LIMIT, {"world_size": 1})


def _model_tensors(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "forward/embedding": torch.randn(1, 4, 8, generator=g),
        "forward/layers.0": torch.randn(1, 4, 8, generator=g),
        "forward/output": torch.randn(1, 4, 16, generator=g),
        "gradient/embedding.weight": torch.randn(16, 8, generator=g),
        "gradient/layers.0.mlp.weight": torch.randn(8, 8, generator=g),
        "gradient/layers.0.mlp.bias": torch.randn(8, generator=g) * 1e-9,  # rounding noise only
        "gradient/output.weight": torch.randn(16, 8, generator=g),
    }


def test_report_names_the_first_forward_output_then_the_last_gradient(tmp_path: Path) -> None:
    for step in (1, 2):
        _write(tmp_path / "b", step, _model_tensors(step))
        a = _model_tensors(step)
        a["gradient/layers.0.mlp.bias"] = a["gradient/layers.0.mlp.bias"] * 3  # noise against a tiny scale
        if step == 2:
            a["forward/output"][0, 2, 5] += 0.5
            a["gradient/embedding.weight"] *= 1.1
            a["gradient/output.weight"] *= 1.1
        _write(tmp_path / "a", step, a)
    report = compare_captures(tmp_path / "a", tmp_path / "b", 1e-4)
    first = report.first
    assert first is not None and (first.step, first.phase, first.name) == (2, "forward", "output")
    assert first.element == [0, 2, 5] and first.max_abs_diff == pytest.approx(0.5)
    assert report.steps == [1, 2] and report.compared == 14
    rows = {(r["step"], r["layer"]): r for r in report.layers}
    assert rows[(1, "layers.0")]["gradient"] < 1e-4  # (the bias' noise against the step's gradient scale)
    assert rows[(2, "embedding")]["gradient"] == pytest.approx(0.1, rel=1e-4)
    assert rows[(2, "head")]["forward"] > 1e-4 and rows[(1, "head")]["forward"] == 0.0
    text = format_report(report)
    assert text.startswith("the runs part at step 2, forward, output: rel. diff") and "at element [0, 2, 5]" in text
    json.dumps(report.to_json())

    _write(tmp_path / "c", 1, {k: v for k, v in _model_tensors(1).items() if "forward" not in k})
    gradients_only = _model_tensors(1)
    gradients_only["gradient/layers.0.mlp.weight"] *= 2
    gradients_only["gradient/output.weight"] *= 2
    _write(tmp_path / "d", 1, {k: v for k, v in gradients_only.items() if "forward" not in k})
    first = compare_captures(tmp_path / "d", tmp_path / "c", 1e-4).first
    assert first is not None and first.name == "output.weight"  # backward runs from the last parameter


def test_a_replicated_output_the_ranks_disagree_on_parts_the_runs(tmp_path: Path) -> None:
    _write(tmp_path / "b", 1, _model_tensors(1))
    _write(tmp_path / "a", 1, _model_tensors(1), disagree="layers.0")
    report = compare_captures(tmp_path / "a", tmp_path / "b", 1e-4)
    assert report.first is not None and report.first.name == "layers.0" and report.first.rel_diff == 0.0
    assert "tensor-parallel ranks of run A disagree" in format_report(report)
    assert compare_captures(tmp_path / "b", tmp_path / "b", 1e-4).first is None


def test_missing_or_disjoint_captures_are_refused(tmp_path: Path) -> None:
    _write(tmp_path / "b", 1, _model_tensors(1))
    _write(tmp_path / "a", 2, _model_tensors(1))
    with pytest.raises(DataError, match="share no captured step"):
        compare_captures(tmp_path / "a", tmp_path / "b", 1e-4)
    with pytest.raises(DataError, match="holds no --debug-capture output"):
        compare_captures(tmp_path / "none", tmp_path / "b", 1e-4)


def test_single_process_run_drops_every_layout_flag() -> None:
    flags = (
        "--config debug --nproc 2 --tensor-model-parallel-size 2 --sequence-parallel --pipeline-model-parallel-size=2 "
        "--use-distributed-optimizer --overlap-grad-reduce --num-layers-per-virtual-pipeline-stage 1 "
        "--pipeline-schedule zb-h1 --context-parallel-size 2 --hidden-size 64 --seed 3"
    ).split()
    assert single_process_flags(flags) == ["--config", "debug", "--hidden-size", "64", "--seed", "3"]


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--steps", "2"], 'give the train flags after "--"'),
        (["--steps", "0", "--", "--config debug"], "--steps 0: compare at least 1 step"),
        (["--steps", "1", "--tol", "0", "--", "--config debug"], "--tol 0.0: the tolerance must be above 0"),
        (["--steps", "1", "--", "a", "--", "b", "--", "c"], "give one or two groups"),
        (["--steps", "1", "--", "--config debug --save /tmp/x"], "flags A: drop --save"),
        (["--steps", "1", "--", "--config debug", "--", "--config debug --train-iters 3"], "flags B: drop --train"),
        (["--steps", "1", "--reference", "r", "--", "--config debug", "--", "--config debug"], "--reference is run B"),
        (["--", "--config debug"], "the following arguments are required: --steps"),
    ],
)
def test_bad_options_are_refused_in_one_line(argv: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        parse_compare(argv)


def test_runs_are_checked_before_they_start() -> None:
    a = resolve_run(["--config", "debug", "--train-iters", "2"], "A")
    with pytest.raises(ConfigError, match="^flags B: unknown flag --hidden-sise; did you mean --hidden-size"):
        resolve_run(["--config", "debug", "--hidden-sise", "64"], "B")
    with pytest.raises(ConfigError, match="^flags B: .*tensor"):
        resolve_run(["--config", "debug", "--nproc", "2", "--tensor-model-parallel-size", "3"], "B")
    wider = resolve_run(["--config", "debug", "--train-iters", "2", "--hidden-size", "128"], "B")
    with pytest.raises(ConfigError, match="different models: A has --hidden-size 64, B has --hidden-size 128"):
        same_model(a, wider)
    bigger = resolve_run(["--config", "debug", "--train-iters", "2", "--global-batch-size", "16"], "B")
    with pytest.raises(ConfigError, match="--global-batch-size: A has 8, B has 16"):
        same_model(a, bigger)
    same_model(a, resolve_run(["--config", "debug", "--nproc", "2", "--tensor-model-parallel-size", "2"], "B"))


def test_command_line_exit_codes(capsys: pytest.CaptureFixture) -> None:
    assert main(["debug", "compare", "--steps", "0", "--", "--config debug"]) == 2
    assert "--steps 0" in capsys.readouterr().err
    assert main(["debug", "unknown"]) == 2
    assert main(["debug", "--help"]) == 0
    assert last_error_line("a\nerror: --foo 3 is wrong\nTraceback\n  x\n") == "error: --foo 3 is wrong"


def test_captures_of_two_runs_in_process(tmp_path: Path) -> None:
    """Real captures: recomputation changes nothing; a different seed parts at the first module."""
    runs = {
        "plain": {},
        "recompute": dict(recompute_granularity="full", recompute_method="uniform"),
        "seed": dict(seed=7),
    }
    for label, extra in runs.items():
        config = tiny_config(
            tmp_path / label,
            train_iters=2,
            debug_capture=str(tmp_path / label / "c"),
            debug_capture_elements=LIMIT,
            hidden_size=32,
            num_attention_heads=4,
            ffn_hidden_size=64,
            vocab_size=97,
            seq_length=16,
            micro_batch_size=2,
            **extra,
        )
        run_training(config)
    index = json.loads((tmp_path / "plain" / "c" / "index.json").read_text())
    assert index["steps"] == [1, 2] and index["shapes"]["forward/output"] == [1, 16, 97]
    names = index["names"]
    assert names.index("forward/embedding") < names.index("forward/layers.0.attention.in_proj.q")
    assert (
        names.index("forward/layers.0.attention.core") < names.index("forward/layers.1") < names.index("forward/output")
    )
    same = compare_captures(tmp_path / "recompute" / "c", tmp_path / "plain" / "c", 1e-5)
    assert same.first is None and same.compared == 2 * len(names)
    other = compare_captures(tmp_path / "seed" / "c", tmp_path / "plain" / "c", 1e-4).first
    assert other is not None and (other.step, other.phase, other.name) == (1, "forward", "embedding")
    assert math.isfinite(other.rel_diff) and other.rel_diff > 0.1


def test_a_shape_that_differs_parts_and_reports_as_plain_json(tmp_path: Path) -> None:
    _write(tmp_path / "b", 1, _model_tensors(1))
    wider = _model_tensors(1)
    wider["forward/output"] = torch.zeros(1, 4, 17)
    _write(tmp_path / "a", 1, wider)
    report = compare_captures(tmp_path / "a", tmp_path / "b", 1e-4)
    assert report.first is not None and report.first.name == "output"
    assert report.first.note == "shapes differ: (1, 4, 17) vs (1, 4, 16)"
    plain = json.loads(json.dumps(report.to_json(), allow_nan=False))
    assert plain["first"]["rel_diff"] is None and plain["first"]["element"] is None


def _expert_rank_pieces(full: torch.Tensor, etp: int, ep: int, edp: int, zero_stage: int) -> list:
    """Every rank's gradient piece of stacked experts' w_in [E, 2F, H] (gate rows, then up rows) on the
    experts' grid: `ep` ranks hold E / ep experts each, split over `etp` expert-tensor-parallel ranks,
    and `edp` replicas hold each slice (whatever tensor- or context-parallel ranks they are; ZeRO 1:
    each replica one part of the flat local tensor)."""
    E, rows, _ = full.shape
    pieces = []
    for e in range(ep):
        for d in range(edp):
            for t in range(etp):
                layout = tuple(Shard(1, t2 * rows // 2 // etp, rows // 2 // etp, rows, blocks=2) for t2 in range(etp))
                info = ParamInfo(
                    shard=layout[t] if etp > 1 else None,
                    layout=layout if etp > 1 else None,
                    expert_shard=Shard(0, e * E // ep, E // ep, E),
                )
                param = torch.empty(E // ep, rows // etp, full.size(2))
                set_info(param, info)
                coords = {"etp": t, "ep": e, "edp": d}
                if not owns_gradient(info, False, zero_stage, coords):
                    continue
                local = take_slice(full, param)
                start, end = 0, local.numel()
                if zero_stage:
                    start, end = local.numel() * d // edp, local.numel() * (d + 1) // edp
                flat = local.reshape(-1)[start:end]
                tables = param_tables(param, full.shape)
                pieces.append(
                    take_piece("gradient", "w_in", (1, 0), flat, tables, full.shape, 512, (start, end), param.shape)
                )
    return pieces


@pytest.mark.parametrize(
    "etp,ep,edp,zero_stage",
    [(1, 2, 1, 0), (2, 2, 2, 0), (1, 4, 2, 1), (2, 2, 2, 1), (1, 2, 4, 0), (1, 1, 2, 0)],
    ids=["ep2", "etp2-ep2-edp2", "ep4-edp2-zero1", "etp2-ep2-edp2-zero1", "ep2-edp4", "ep1-edp2"],
)
def test_experts_split_over_ranks_assemble_once(etp: int, ep: int, edp: int, zero_stage: int) -> None:
    """Each element of an expert's gradient is counted exactly once, from the right rank's experts."""
    full = torch.randn(4, 2 * 4, 3, generator=torch.Generator().manual_seed(5))
    pieces = _expert_rank_pieces(full, etp, ep, edp, zero_stage)
    (captured,) = assemble(pieces, 512)
    assert torch.equal(captured.values, full.reshape(-1))
    assert captured.rms == pytest.approx(float(full.double().square().mean().sqrt()), rel=1e-12)
    assert not captured.notes and sum(p.count for p in pieces) == full.numel()


def test_which_rank_counts_a_gradient() -> None:
    dense = ParamInfo()
    owners = {
        (zero, sharded): [
            (dp, cp)
            for dp in range(4)
            for cp in (0, 1)
            if owns_gradient(dense, sharded, zero, {"tp": 0, "dp": dp, "cp": cp})
        ]
        for zero, sharded in ((0, False), (1, False), (3, True))
    }
    assert owners[0, False] == [(0, 0)]
    assert len(owners[1, False]) == 8
    assert owners[3, True] == [(0, 0), (1, 0), (2, 0), (3, 0)]  # (FSDP2 rows: not over CP)
    # an expert's replicas are its expert-data-parallel ranks (EP 2 x EDP 2 here)
    expert = ParamInfo(expert_shard=Shard(0, 2, 2, 4))
    ranks = [(ep, edp) for edp in (0, 1) for ep in (0, 1)]
    assert [r for r in ranks if owns_gradient(expert, False, 0, {"etp": 0, "ep": r[0], "edp": r[1]})] == [
        (0, 0),
        (1, 0),
    ]
    assert [r for r in ranks if owns_gradient(expert, False, 1, {"etp": 0, "ep": r[0], "edp": r[1]})] == ranks
    split = ParamInfo(shard=Shard(0, 2, 2, 4), layout=(Shard(0, 0, 2, 4), Shard(0, 2, 2, 4)))
    assert [t for t in range(2) if owns_gradient(split, False, 0, {"tp": t})] == [1]


def test_a_planted_router_defect_scales_its_expert_weights() -> None:
    probs = torch.tensor([[0.25, 0.75]])
    routing = Routing(probs, probs > 0, torch.tensor([1, 1]), torch.zeros(()), torch.zeros(()))
    hook = _perturbing("layers.0.mlp.router", "layers.0.mlp.router", Router.__new__(Router))
    out = hook(None, (), routing)
    assert torch.allclose(out.probs, probs * 1.01) and out.routing_map is routing.routing_map


def test_router_logits_and_expert_weights_are_recorded(tmp_path: Path) -> None:
    """A mixture-of-experts run records each router's logits and its top-2 weights [1, T, E] (the
    weights are the softmax of the two largest logits), never the routed experts' rows."""
    config = tiny_config(
        tmp_path,
        train_iters=1,
        debug_capture=str(tmp_path / "c"),
        debug_capture_elements=LIMIT,
        model_name="debug-moe",
        hidden_size=32,
        num_attention_heads=4,
        num_query_groups=2,
        ffn_hidden_size=64,
        moe_ffn_hidden_size=32,
        moe_shared_expert_intermediate_size=32,
        vocab_size=97,
        seq_length=16,
        micro_batch_size=2,
    )
    run_training(config)
    index = json.loads((tmp_path / "c" / "index.json").read_text())
    names = index["names"]
    assert (
        index["shapes"]["forward/layers.1.mlp.router"]
        == [1, 16, 4]
        == index["shapes"]["forward/layers.1.mlp.router.logits"]
    )
    assert names.index("forward/layers.1.mlp.router.logits") < names.index("forward/layers.1.mlp.router")
    assert names.index("forward/layers.1.mlp.shared_expert.in_proj.up") < names.index("forward/layers.1.mlp")
    assert not [n for n in names if n.startswith("forward/") and ".experts" in n]
    assert "gradient/layers.1.mlp.experts.w_in" in names
    tensors = load_file(str(step_file(tmp_path / "c", 1)))
    logits = tensors["forward/layers.1.mlp.router.logits"].view(16, 4)
    top = logits.topk(2, dim=-1)
    expected = torch.zeros(16, 4).scatter(1, top.indices, torch.softmax(top.values, dim=-1))
    torch.testing.assert_close(tensors["forward/layers.1.mlp.router"].view(16, 4), expected, rtol=1e-5, atol=1e-6)


def test_a_capture_folder_that_is_a_file_is_refused(tmp_path: Path) -> None:
    (tmp_path / "taken").write_text("x")
    experts = dict(model_name="debug-moe", expert_model_parallel_size=2, debug_capture=str(tmp_path / "c"))
    validate(tiny_config(tmp_path, **experts), world_size=2)  # (experts split over ranks are captured)
    validate(tiny_config(tmp_path, zero_stage=3, debug_capture=str(tmp_path / "c")), world_size=2)
    with pytest.raises(ConfigError, match=r"^--debug-capture .*taken is a file; give a folder"):
        validate(tiny_config(tmp_path, debug_capture=str(tmp_path / "taken")), world_size=1)
