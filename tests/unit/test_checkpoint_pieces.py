"""Checkpoint tensors as boxes of single-device tensors (checkpoint/pieces.py): flat ranges as
boxes, keys, partial reads that refuse what is missing; and optimizer state written before the
boxes (flat pieces) still resumes exactly."""

from __future__ import annotations

import hashlib
import json
import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from paratron.checkpoint.optimizer_state import INDEX
from paratron.checkpoint.pieces import Catalog, SavedBox, box_key, flat_boxes, parse_key
from paratron.errors import CheckpointError
from paratron.training.run import run_training

from tiny import tiny_config


@pytest.mark.parametrize("shape", [(4, 6), (3, 4, 5), (7,), ()])
def test_every_flat_range_is_contiguous_boxes(shape):
    values = torch.arange(torch.Size(shape).numel()).reshape(shape)
    n = values.numel()
    for start in range(n + 1):
        for end in range(start, n + 1):
            parts = []
            for box, first in flat_boxes(shape, start, end):
                part = values[box].reshape(-1)
                assert int(part[0]) == first  # each box starts where its flat position says
                parts.append(part)
            joined = torch.cat(parts) if parts else values.reshape(-1)[:0]
            assert torch.equal(joined, values.reshape(-1)[start:end]), (shape, start, end)
    assert len(flat_boxes((4, 6), 3, 23)) == 3  # a partial row, two whole rows, a partial row


def test_keys_name_the_box_unless_whole():
    whole, part = (slice(0, 4), slice(0, 6)), (slice(0, 4), slice(2, 6))
    assert box_key("w", whole, (4, 6)) == "w"
    assert box_key("w", part, (4, 6)) == "w[0:4,2:6]"
    assert parse_key("w[0:4,2:6]") == ("w", part)
    assert parse_key("layers.0.norm.weight") == ("layers.0.norm.weight", None)


def test_a_reader_takes_only_the_intersections_and_refuses_what_is_missing(tmp_path):
    full = torch.arange(48.0).reshape(6, 8)
    save_file({"w[0:6,0:4]": full[:, :4].clone()}, str(tmp_path / "a.safetensors"))
    save_file({"w[0:6,4:8]": full[:, 4:].clone()}, str(tmp_path / "b.safetensors"))
    keys = {"w[0:6,0:4]": "a.safetensors", "w[0:6,4:8]": "b.safetensors"}
    with Catalog(tmp_path, keys, {"w": [6, 8]}) as catalog:
        target = torch.zeros(2, 6)  # rows 1-2, columns 1-6 of the whole: parts of both files
        catalog.fill("w", target, [((slice(1, 3), slice(1, 7)), (slice(0, 2), slice(0, 6)))])
        assert torch.equal(target, full[1:3, 1:7])
        assert torch.equal(catalog.whole("w"), full)
    with Catalog(tmp_path, {"w[0:6,0:4]": "a.safetensors"}, {"w": [6, 8]}) as catalog:
        with pytest.raises(CheckpointError, match=r"holds only 8 of the 16 values of w this rank needs"):
            catalog.fill("w", torch.zeros(2, 8), [((slice(1, 3), slice(0, 8)), (slice(0, 2), slice(0, 8)))])


def to_flat_pieces(folder) -> None:
    """Rewrite a single-process checkpoint's optimizer state as it was written before the boxes:
    one flat piece per parameter, listed in the file's metadata, and no optimizer.index.json."""
    index = json.loads((folder / INDEX).read_text())
    (name,) = set(index["weight_map"].values())
    by_param: dict[str, dict[str, torch.Tensor]] = {}
    with safe_open(str(folder / name), framework="pt") as f:
        for key in f.keys():
            state, _, param = key.partition("/")
            by_param.setdefault(param, {})[state] = f.get_tensor(key).reshape(-1)
    tensors, records = {}, []
    for i, (param, states) in enumerate(sorted(by_param.items())):
        shape = index["shapes"][param]
        size = torch.Size(shape).numel()
        records.append(
            dict(name=param, start=0, end=size, keys=list(states), slice_shape=shape, boxes=None, shape=shape)
        )
        tensors.update({f"{i}/{state}": values for state, values in states.items()})
    save_file(tensors, str(folder / name), metadata={"pieces": json.dumps(records), "step": json.dumps(index["step"])})
    (folder / INDEX).unlink()
    meta = json.loads((folder / "meta.json").read_text())
    del meta["files"][INDEX]
    meta["files"][name] = hashlib.sha256((folder / name).read_bytes()).hexdigest()
    (folder / "meta.json").write_text(json.dumps(meta))


def test_optimizer_state_in_flat_pieces_still_resumes_exactly(tmp_path):
    """fp16 weights, fp32 masters and Adam's moments saved as the older flat pieces."""
    common = dict(precision="fp16", train_iters=6, lr_decay_iters=6)
    straight = run_training(tiny_config(tmp_path / "straight", **common)).losses
    save = tmp_path / "ckpt"
    run_training(tiny_config(tmp_path / "a", **dict(common, train_iters=3), save=str(save), save_interval=3))
    to_flat_pieces(save / "iter_0000003")
    shutil.rmtree(tmp_path / "a")
    resumed = run_training(tiny_config(tmp_path / "a", **common, load=str(save))).losses
    assert resumed == straight[3:]


def test_overlaps_do_not_hide_a_gap_and_damage_is_one_line(tmp_path):
    full = torch.arange(48.0).reshape(6, 8)
    # columns 0-4 twice over (an older checkpoint's replicas), 5 missing, 6-7 present: 42 of 48 values
    save_file({"w[0:6,0:5]": full[:, :5].clone(), "w[0:6,6:8]": full[:, 6:].clone()}, str(tmp_path / "a.safetensors"))
    save_file({"w[0:6,0:5]": full[:, :5].clone()}, str(tmp_path / "b.safetensors"))
    keys = {"w[0:6,0:5]": "a.safetensors", "w[0:6,6:8]": "a.safetensors"}
    everything = [((slice(0, 6), slice(0, 8)), (slice(0, 6), slice(0, 8)))]
    with Catalog(tmp_path, keys, {"w": [6, 8]}) as catalog:
        catalog.boxes["w"].append(SavedBox("b.safetensors", "w[0:6,0:5]", (slice(0, 6), slice(0, 5))))
        with pytest.raises(CheckpointError, match=r"holds only 42 of the 48 values of w"):
            catalog.fill("w", torch.zeros(6, 8), everything)
    with Catalog(tmp_path, {"w[0:6,2:8]": "b.safetensors"}, {"w": [6, 8]}) as catalog:  # listed, not stored
        with pytest.raises(
            CheckpointError, match=r"b.safetensors: has no tensor w\[0:6,2:8\]; the checkpoint is damaged"
        ):
            catalog.fill("w", torch.zeros(6, 8), everything)
    (tmp_path / "c.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}")  # a truncated header
    with pytest.raises(CheckpointError, match=r"c.safetensors: unreadable .*the checkpoint is damaged"):
        Catalog(tmp_path, {"x": "c.safetensors"})
