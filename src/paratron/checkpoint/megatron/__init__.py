"""Megatron-LM checkpoints of GPT and Llama-style models (megatron-core `GPTModel`) <-> paratron.

Read: Megatron-LM's legacy `torch` format (`latest_checkpointed_iteration.txt`,
`iter_NNNNNNN/mp_rank_TT[_PPP]/model_optim_rng.pt`, or `release/`) at any tensor- and
pipeline-parallel size, its `torch_dist` format (torch.distributed.checkpoint files of global
tensors under Megatron's sharded names, `metadata.json` saying `torch_dist`) and Megatron FSDP's
`fsdp_dtensor` format (plain DCP files under `model.module.NAME`; weights and counters). Written: the
legacy format at a chosen TP/PP, with the local layer spec's names.

Optimizer state: Adam's moments and fp32 masters from torch_dist's reshardable formats
(`optimizer.state.{exp_avg,exp_avg_sq,fp32_param}.KEY`) and from the legacy format's
non-distributed optimizer (its parameter indices matched to names through Megatron's standard
weight-decay groups) become paratron's optimizer files (`optimizer_state.py`), as do the
distributed optimizer's flat buffers (legacy `distrib_optim.pt`, torch_dist `dp_reshardable`),
mapped to parameters through megatron-core's gradient-buffer layout rebuilt from the saved args.

One module per concern: `unpickle` (restricted unpickling), `locate` (format, folders, args),
`settings` (args <-> model settings), `tensor_layout` (fused tensors and TP slices <-> paratron's names),
`legacy`, `torch_dist` and `fsdp_dtensor` (the file formats), `distrib_optim` (the distributed optimizer's
buffers), `reader` (the reader `checkpoint.formats` uses;
the writer is `legacy.write_megatron`).
"""

from paratron.checkpoint.megatron.legacy import MEGATRON_CHECKPOINT, write_megatron
from paratron.checkpoint.megatron.locate import (
    MEGATRON_FILE,
    RELEASE,
    MegatronCheckpoint,
    cache_name,
    check_load,
    detect_format,
    open_megatron,
)
from paratron.checkpoint.megatron.reader import megatron_optimizer, megatron_weights, read_megatron
from paratron.checkpoint.megatron.settings import (
    config_of,
    megatron_args,
    model_settings,
    padded_vocab,
    vocab_size_of,
)
from paratron.checkpoint.megatron.tensor_layout import (
    Shapes,
    from_paratron,
    fuse_qkv,
    merge_tp,
    split_qkv,
    split_tp,
    to_paratron,
    tp_dim,
)
from paratron.checkpoint.megatron.torch_dist import unstack
from paratron.checkpoint.megatron.unpickle import ALLOWED_GLOBALS, MegatronStandIn, safe_load

__all__ = [
    "ALLOWED_GLOBALS",
    "MEGATRON_CHECKPOINT",
    "MEGATRON_FILE",
    "RELEASE",
    "MegatronCheckpoint",
    "MegatronStandIn",
    "Shapes",
    "cache_name",
    "check_load",
    "config_of",
    "detect_format",
    "from_paratron",
    "fuse_qkv",
    "megatron_args",
    "megatron_optimizer",
    "megatron_weights",
    "merge_tp",
    "model_settings",
    "open_megatron",
    "padded_vocab",
    "read_megatron",
    "safe_load",
    "split_qkv",
    "split_tp",
    "to_paratron",
    "tp_dim",
    "unstack",
    "vocab_size_of",
    "write_megatron",
]
