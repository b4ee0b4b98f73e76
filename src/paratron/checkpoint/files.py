"""The files of a training checkpoint: their names, and the checksum meta.json lists for each.

Layout (Megatron-LM's tracker file and iteration folders):

    SAVE/latest_checkpointed_iteration.txt      newest complete checkpoint
    SAVE/iter_0000200/model_tp000_pp000_dp000.safetensors
                                                weights: what one rank holds, as boxes of the
                                                single-device tensors (`pieces.py`)
    SAVE/iter_0000200/model.safetensors.index.json
                                                every stored box's file, the single-device shapes
    SAVE/iter_0000200/optimizer_tp000_pp000_dp000.safetensors, optimizer.index.json
                                                optimizer state, the same way (`optimizer_state.py`)
    SAVE/iter_0000200/training_state_tp000_pp000.pt
                                                per tensor- and pipeline-parallel rank: RNG and
                                                loss-scaler state (tensors and numbers only)
    SAVE/iter_0000200/tokenizer.json            the run's tokenizer, if it has one
    SAVE/iter_0000200/chat_template.jinja       the chat template a fine-tuning run trained with
    SAVE/iter_0000200/meta.json                 iteration, consumed samples, config, checksums

A single process writes one model.safetensors of whole tensors under single-device names.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from paratron.distributed.topology import Axis, Topology

TRACKER = "latest_checkpointed_iteration.txt"
WEIGHTS, WEIGHTS_INDEX = "model.safetensors", "model.safetensors.index.json"


def file_sha256(path: Path) -> str:
    """The checksum meta.json lists for every file of a checkpoint (read in 1 MiB chunks)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def weights_file(topology: Topology) -> str:
    """This rank's weights file: model.safetensors for a single process."""
    if topology.dims.world_size == 1:
        return WEIGHTS
    return (
        f"model_tp{topology.tp_rank:03d}_pp{topology.pp_rank:03d}_dp{topology.local_rank(Axis.DP_CP):03d}.safetensors"
    )


def rank_state_file(tp_rank: int, pp_rank: int = 0, pp_size: int = 1) -> str:
    """training_state_tp000[_pp000].pt: random-generator states and loss scaler of one rank."""
    return f"training_state_tp{tp_rank:03d}" + (f"_pp{pp_rank:03d}" if pp_size > 1 else "") + ".pt"
