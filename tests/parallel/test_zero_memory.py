"""Per-rank training-state accounting (`parallel/data_parallel/state_memory.py`) against the ZeRO formulas, exactly.

Two gloo ranks build the debug model at stages 0-3 with an odd MLP width (129), so that some
gradient buckets need padding to split in two and FSDP2 gives the two ranks shards of different
sizes; every count is then checked element for element against what the layout implies.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from paratron.distributed.local_ranks import run_ranks
from paratron.parallel.data_parallel.state_memory import paper_bytes, training_state_elements, zero_formula

from tiny import tiny_config

SIZE = 2
OVERRIDES = dict(ffn_hidden_size=129, ddp_bucket_size=5000)


def _counts(report: dict) -> dict:
    return {
        c: (report[c]["elements"], report[c]["bytes"]) for c in ("parameters", "gradients", "master", "optimizer_state")
    }


def measure_stages(run_dir: str) -> list[dict]:
    """On each rank: build every stage, take one step, count; stage 2 also with a planted leak."""
    import torch.distributed as dist

    from paratron.config.layout import resolve_layout
    from paratron.distributed.topology import ParallelDims, Topology
    from paratron.model.batch import Batch
    from paratron.model.gpt import GPT
    from paratron.optim.build import build_optimizer
    from paratron.optim.mixed_precision import Precision
    from paratron.parallel.parallelize import parallelize
    from paratron.training.step import train_step

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    topology = Topology(ParallelDims(SIZE), rank)
    topology.create_groups()
    tokens = torch.randint(0, 512, (2, 33), generator=torch.Generator().manual_seed(rank))
    out = []
    for stage in range(4):
        config = tiny_config(run_dir, zero_stage=stage, **OVERRIDES)
        with torch.device("meta"):
            meta = GPT(config.model)
        shapes = [tuple(p.shape) for p in meta.parameters()]
        model = parallelize(
            meta, config, topology, torch.device("cpu"), resolve_layout(config, topology.dims.world_size)
        )
        optimizer = build_optimizer(model, config.optimizer)
        train_step(model, optimizer, [Batch(tokens[:, :-1], tokens[:, 1:])], Precision("fp32"), 1.0)
        entry = {"stage": stage, "shapes": shapes, "report": training_state_elements(model, optimizer)}
        reducer = model.gradients.reducer
        if reducer is not None:
            entry["total"] = reducer.total
            entry["bucket_sums"] = [sum(p.numel() for p in b.params) for b in reducer.buckets]
            entry["pieces"] = sum(z - a for _, a, z, _ in reducer.local_pieces())
        if stage == 2:
            bucket = reducer.buckets[0]
            bucket.buffer = reducer.grad_shard[:10]  # a view of counted storage: no change
            entry["aliased_bucket"] = training_state_elements(model, optimizer)
            bucket.buffer = torch.zeros(bucket.end - bucket.start)  # a buffer left alive
            entry["leaked_bucket"] = (bucket.end - bucket.start, training_state_elements(model, optimizer))
            bucket.buffer = None
        out.append(entry)
    dist.destroy_process_group()
    return out


def _numel(shape: tuple[int, ...]) -> int:
    return int(torch.Size(shape).numel())


def _fsdp_rows(shape: tuple[int, ...], rank: int) -> int:
    """Elements of rank `rank`'s FSDP2 shard: dim 0 chunked as `torch.chunk` does."""
    chunk = -(-shape[0] // SIZE)
    return max(0, min(chunk, shape[0] - rank * chunk)) * _numel(shape[1:])


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return run_ranks(measure_stages, SIZE, str(tmp_path_factory.mktemp("zero_memory")))


def test_plain_data_parallel_and_stage_1(ranks):
    for entries in ranks:
        zero, one = entries[0], entries[1]
        psi = sum(_numel(s) for s in zero["shapes"])
        padding = sum(-n % SIZE for n in zero["bucket_sums"])
        assert padding > 0, "the odd MLP width should make some bucket need padding"
        total = psi + padding
        assert zero["total"] == one["total"] == total
        # stage 0: whole parameters, the padded gradient buffer (each .grad a view, counted once),
        # master weights that are the parameters, two Adam moments per parameter element
        assert _counts(zero["report"]) == {
            "parameters": (psi, 4 * psi),
            "gradients": (total, 4 * total),
            "master": (psi, 0),
            "optimizer_state": (2 * psi, 8 * psi),
        }
        assert zero["report"]["total_bytes"] == 16 * psi + 4 * padding
        assert paper_bytes(zero["report"])["total"] == zero_formula(0, psi, SIZE) + 2 * padding
        # stage 1: flat parameters and full gradients stay; masters (views) and state are this rank's pieces
        mine = one["pieces"]
        assert total // SIZE - padding <= mine <= total // SIZE
        assert _counts(one["report"]) == {
            "parameters": (total, 4 * total),
            "gradients": (total, 4 * total),
            "master": (mine, 0),
            "optimizer_state": (2 * mine, 8 * mine),
        }
    assert sum(entries[1]["pieces"] for entries in ranks) == psi  # the pieces partition the model


def test_stage_2_keeps_only_the_gradient_shard(ranks):
    for entries in ranks:
        two = entries[2]
        psi, total, mine = sum(_numel(s) for s in two["shapes"]), two["total"], two["pieces"]
        shard = total // SIZE
        assert _counts(two["report"]) == {
            "parameters": (total, 4 * total),
            "gradients": (shard, 4 * shard),
            "master": (mine, 0),
            "optimizer_state": (2 * mine, 8 * mine),
        }
        assert two["report"]["total_bytes"] == 4 * total + 4 * shard + 8 * mine
        assert _counts(two["aliased_bucket"]) == _counts(two["report"])
        size, leaked = two["leaked_bucket"]
        assert leaked["gradients"] == {"elements": shard + size, "bytes": 4 * (shard + size)}
    # over both ranks, the fp32 formula (4 psi + 12 psi/N per rank) plus the padding's share:
    # N full padded parameter buffers and one padded gradient buffer in shards
    psi = sum(_numel(s) for s in ranks[0][2]["shapes"])
    padding = ranks[0][2]["total"] - psi
    assert sum(entries[2]["report"]["total_bytes"] for entries in ranks) == SIZE * zero_formula(
        2, psi, SIZE, "fp32"
    ) + 4 * padding * (SIZE + 1)


def test_stage_3_shards_everything(ranks):
    for rank, entries in enumerate(ranks):
        three = entries[3]
        mine = sum(_fsdp_rows(s, rank) for s in three["shapes"])
        padded = sum(_fsdp_rows(s, 0) for s in three["shapes"])  # FSDP2 pads every shard to rank 0's
        counts = _counts(three["report"])
        assert counts["parameters"] == (mine, 4 * padded)
        assert counts["gradients"] == (mine, 4 * padded)  # reduce-scattered into padded shards too
        assert counts["master"] == (mine, 0)
        assert counts["optimizer_state"] == (2 * mine, 8 * mine)
    psi = sum(_numel(s) for s in ranks[0][3]["shapes"])
    assert sum(_counts(entries[3]["report"])["parameters"][0] for entries in ranks) == psi
    assert _counts(ranks[0][3]["report"]) != _counts(ranks[1][3]["report"]), "odd widths: unequal shards"


def test_a_plain_module_and_optimizer():
    model = nn.Sequential(nn.Linear(7, 5), nn.Linear(5, 3, bias=False))
    optimizer = torch.optim.AdamW(model.parameters())
    before = training_state_elements(model, optimizer)
    assert _counts(before) == {
        "parameters": (55, 220),
        "gradients": (0, 0),
        "master": (55, 0),
        "optimizer_state": (0, 0),
    }
    model(torch.randn(4, 7)).sum().backward()
    optimizer.step()
    report = training_state_elements(model, optimizer)
    assert _counts(report) == {
        "parameters": (55, 220),
        "gradients": (55, 220),
        "master": (55, 0),
        "optimizer_state": (110, 440),
    }  # the step counters are not state
    assert report["total_bytes"] == 16 * 55 == zero_formula(0, 55, 1, "fp32")
    assert paper_bytes(report) == {
        "parameters": 110,
        "gradients": 110,
        "master": 220,
        "optimizer_state": 440,
        "total": 880,
    }
    # a state tensor that is a view of a parameter's storage costs elements, not bytes
    optimizer.state[model[1].weight]["alias"] = model[1].weight.detach()[0]
    aliased = training_state_elements(model, optimizer)
    assert _counts(aliased)["optimizer_state"] == (115, 440)
