"""Megatron-LM's distributed optimizer state: flat fp32 buffers with no parameter names in them.

megatron-core's DistributedDataParallel lays each model chunk's parameters into one flat buffer
per dtype, in reverse order of `model.parameters()`, each parameter starting at a multiple of 64,
cut into buckets of about `--ddp-bucket-size` elements (one bucket when gradients are not reduced
during the backward pass, on pipeline stages after the first and for virtual chunks after the
first), a tied embedding alone in its own bucket under pipeline parallelism, and every bucket
padded to a multiple of lcm(DP x CP, 128). The distributed optimizer saves the fp32 master
weights, `exp_avg` and `exp_avg_sq` of that buffer in two forms:

- legacy `distrib_optim.pt` beside each `model_optim_rng.pt`: per buffer one tensor per state
  holding the buckets back to back with each bucket's end padding removed;
- torch_dist `dp_reshardable`: one tensor per bucket and state,
  `optimizer.distributed.dp_group_idx_R.gbuf_idx_G.dtype_D.bucket_idx_B.{param,exp_avg,exp_avg_sq}`,
  R the rank within the tensor x pipeline group (pipeline rank x TP + tensor rank), its length
  the bucket's unpadded size.

Neither records which parameter lies where, so the layout is rebuilt from the saved args exactly
as megatron-core builds it, and checked against the saved sizes: a layout that disagrees (mixed
dtypes, expert or per-layer optimizers, settings that change the cut) leaves the state out.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

import torch

from paratron.checkpoint.megatron.legacy import chunk_keys, chunk_parameters, legacy_files, merge_legacy
from paratron.checkpoint.megatron.locate import MegatronCheckpoint, legacy_pp, rank_file
from paratron.checkpoint.megatron.tensor_layout import LAYER, MODULE_ORDER, merge_tp, to_paratron, tp_dim
from paratron.checkpoint.megatron.torch_dist import dist_chunk_bounds, dist_shapes, dist_tensors
from paratron.checkpoint.megatron.unpickle import safe_load
from paratron.config.schema import ModelConfig
from paratron.model.transformer import Attention

DISTRIB_OPTIM = "distrib_optim.pt"
_STATES = {"param": "master", "exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq"}
State = dict[str, dict[str, torch.Tensor]]
"""Paratron's state name (master, exp_avg, exp_avg_sq) -> {Megatron parameter name: tensor}."""


@dataclass(frozen=True)
class Bucketing:
    """What decides how megatron-core cuts and pads a model chunk's gradient buffer."""

    shards: int
    """The data-parallel (x context-parallel) ranks each bucket is split over."""
    bucket_size: int | None
    """Elements per bucket where buckets are cut (None: one bucket per buffer)."""
    busbw_padding: bool
    """--ddp-pad-buckets-for-high-nccl-busbw: buckets padded to a multiple of 2**16 as well."""

    @classmethod
    def of(cls, args: dict[str, Any]) -> Bucketing | None:
        """From Megatron-LM's saved args; None where the layout does not follow from them."""
        if int(args.get("num_distributed_optimizer_instances", 1) or 1) != 1 or args.get("ddp_num_buckets"):
            return None
        shards = int(args.get("data_parallel_size", 1) or 1) * int(args.get("context_parallel_size", 1) or 1)
        size = args.get("ddp_bucket_size")
        size = max(40_000_000, 1_000_000 * shards) if size is None else int(size)
        cut = bool(args.get("overlap_grad_reduce")) and not args.get("overlap_param_gather_with_optimizer_step")
        return cls(shards, size if cut else None, bool(args.get("ddp_pad_buckets_for_high_nccl_busbw")))

    def for_chunk(self, stage: int, chunk: int) -> Bucketing:
        """Buckets are cut only on the first pipeline stage's first model chunk."""
        return self if stage == 0 and chunk == 0 else Bucketing(self.shards, None, self.busbw_padding)


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def bucket_places(params: list[tuple[str, int, bool]], b: Bucketing) -> tuple[dict[str, tuple[int, int]], list[int]]:
    """Where megatron-core's buffer puts each parameter: name -> (bucket, offset from the bucket's
    start), and each bucket's size without its end padding. `params`: (name, elements, whether it
    is a tied embedding shared across pipeline stages) in `model.parameters()` order."""
    bucket_multiple = math.lcm(b.shards, 128, 2**16) if b.busbw_padding else math.lcm(b.shards, 128)
    places: dict[str, tuple[int, int]] = {}
    unpadded: list[int] = []
    start = bucket_start = 0
    members = 0

    def close(end: int) -> int:
        nonlocal bucket_start, members
        unpadded.append(end - bucket_start)
        bucket_start, members = _round_up(end, bucket_multiple), 0
        return bucket_start

    end = 0
    for name, numel, shared in reversed(params):
        start = _round_up(start, 64)
        if shared and members:
            start = close(start)
        end = start + numel
        places[name] = (len(unpadded), start - bucket_start)
        members += 1
        full = b.bucket_size is not None and end - bucket_start >= b.bucket_size
        start = close(end) if full or shared else end
    if members:
        close(end)
    return places, unpadded


def _slices(flat: dict[str, list[torch.Tensor]], places: dict[str, tuple[int, int]], shapes: dict[str, tuple]) -> State:
    """Each parameter's tensors out of the buckets' flat states (paratron's state names)."""
    out: State = {}
    for megatron_state, ours in _STATES.items():
        buckets = flat[megatron_state]
        part = out.setdefault(ours, {})
        for name, (bucket, offset) in places.items():
            numel = math.prod(shapes[name])
            part[name] = buckets[bucket][offset : offset + numel].reshape(shapes[name]).clone()
    return out


def _shared(name: str, args: dict[str, Any], stage: int, chunk: int) -> bool:
    """megatron-core gives a tied embedding its own bucket where pipeline stages hold copies of it."""
    tied = not args.get("untie_embeddings_and_output_weights")
    pipelined = int(args.get("pipeline_model_parallel_size", 1) or 1) > 1
    if not (tied and pipelined):
        return False
    return name == "output_layer.weight" or (name == "embedding.word_embeddings.weight" and (stage, chunk) == (0, 0))


# ---------------------------------------------------------------- legacy distrib_optim.pt


def has_distrib_optim(ckpt: MegatronCheckpoint) -> bool:
    """Whether a legacy checkpoint was saved with the distributed optimizer (its first rank's file)."""
    return (rank_file(ckpt.folder, 0, 0, legacy_pp(ckpt.folder) > 1).parent / DISTRIB_OPTIM).is_file()


def legacy_distributed_optimizer(ckpt: MegatronCheckpoint, m: ModelConfig) -> dict[str, State] | None:
    """Adam's state of a legacy checkpoint's `distrib_optim.pt` files under paratron's names; None
    where their layout cannot be mapped to the parameters."""
    bucketing = Bucketing.of(ckpt.args)
    if bucketing is None:
        return None
    files = legacy_files(ckpt)
    pipelined = legacy_pp(ckpt.folder) > 1
    per_rank: dict[tuple[int, int], list[State]] = {}
    for (rank, stage), loaded in files.items():
        saved = safe_load(rank_file(ckpt.folder, rank, stage, pipelined).parent / DISTRIB_OPTIM)
        chunks = [chunk_parameters(loaded[k]) for k in chunk_keys(loaded)]
        states = _legacy_rank(saved, chunks, ckpt.args, stage, bucketing)
        if states is None:
            return None
        per_rank[(rank, stage)] = states
    gated = m.activation == "swiglu"
    out = {}
    for ours in _STATES.values():
        merged = merge_legacy(files, lambda key, v, s=ours: per_rank[key][v][s], gated)
        out[ours] = to_paratron(merged, m, str(ckpt.folder))
    step = _legacy_step(files[(0, 0)].get("optimizer"))
    out["step"] = {"0": torch.tensor([float(step)])} if step is not None else {}
    return out


def _legacy_rank(
    saved: Any, chunks: list[dict[str, torch.Tensor]], args: dict[str, Any], stage: int, bucketing: Bucketing
) -> list[State] | None:
    """One rank file's model chunks' state out of its `distrib_optim.pt` (one buffer per chunk)."""
    if isinstance(saved, list):
        saved = saved[0] if len(saved) == 1 else None  # (several optimizers: expert parameters)
    if not isinstance(saved, dict) or not saved.get("buckets_coalesced"):
        return None  # (older layouts keep each bucket padded)
    buffers = [saved[g] for g in sorted(k for k in saved if isinstance(k, int))]
    if len(buffers) != len(chunks) or any(not isinstance(b, dict) or len(b) != 1 for b in buffers):
        return None  # (several dtypes per chunk)
    out = []
    for v, (chunk, buffer) in enumerate(zip(chunks, buffers)):
        world = next(iter(buffer.values()))
        params = [(n, t.numel(), _shared(n, args, stage, v)) for n, t in chunk.items()]
        places, unpadded = bucket_places(params, bucketing.for_chunk(stage, v))
        if not isinstance(world, dict) or any(world.get(s) is None or world[s].numel() != sum(unpadded)
                                              for s in _STATES):  # fmt: skip
            return None
        starts = [sum(unpadded[:i]) for i in range(len(unpadded))]
        flat = {s: [world[s][a : a + n] for a, n in zip(starts, unpadded)] for s in _STATES}
        out.append(_slices(flat, places, {n: tuple(t.shape) for n, t in chunk.items()}))
    return out


def _legacy_step(wrapper: Any) -> int | None:
    """The step count the distributed optimizer keeps in its param groups (model_optim_rng.pt)."""
    groups = wrapper.get("optimizer", {}).get("param_groups", []) if isinstance(wrapper, dict) else []
    steps = [g["step"] for g in groups if isinstance(g, dict) and g.get("step") is not None]
    return int(steps[0]) if steps else None


# ---------------------------------------------------------------- torch_dist dp_reshardable

_BUCKET_KEY = re.compile(
    r"^optimizer\.distributed\.dp_group_idx_(\d+)\.gbuf_idx_(\d+)\.dtype_.+\.bucket_idx_(\d+)\.(param|exp_avg|exp_avg_sq)$"
)
_TOP_ORDER = ("embedding.word_embeddings.", "embedding.position_embeddings.", "decoder.layers.",
              "decoder.final_layernorm.", "output_layer.")  # fmt: skip
_LAYER_ORDER = tuple(f"{module}." for module in MODULE_ORDER)
_ATTENTION = Attention.checkpoint_names
_FUSED_ATTENTION_NORM = f"{_ATTENTION.megatron_module}.{_ATTENTION.megatron_fused_norm}_"
"""Transformer Engine's spelling of the attention's norm (`self_attention.linear_qkv.layer_norm_`)."""
_PARAM_ORDER = ("layer_norm_weight", "layer_norm_bias", "weight", "bias")


def _order(name: str, local_spec: bool) -> tuple[int, ...] | None:
    """megatron-core GPTModel's registration order of a parameter (None: a module it does not place).
    torch_dist names a layer's norms as Transformer Engine does (`linear_qkv.layer_norm_weight`)
    whatever the spec; under the local spec the attention norm is its own module, before `linear_proj`."""
    top = next((i for i, p in enumerate(_TOP_ORDER) if name.startswith(p)), None)
    layer = LAYER.match(name)
    if top is None or (layer is None) != (top != 2):
        return None
    rest = layer.group(2) if layer else name
    if local_spec and rest.startswith(_FUSED_ATTENTION_NORM):
        rest = f"{_ATTENTION.megatron_norm}." + rest.rsplit(".", 1)[1]
    module = next((i for i, p in enumerate(_LAYER_ORDER) if rest.startswith(p)), None) if layer else 0
    leaf = rest.rsplit(".", 1)[-1]
    if module is None or leaf not in _PARAM_ORDER:
        return None
    return (top, int(layer.group(1)) if layer else 0, module, _PARAM_ORDER.index(leaf))


_UNEVEN = ("decoder_first_pipeline_num_layers", "decoder_last_pipeline_num_layers", "pipeline_model_parallel_layout",
           "num_layers_per_virtual_pipeline_stage", "virtual_pipeline_model_parallel_size",
           "account_for_embedding_in_pipeline_split", "account_for_loss_in_pipeline_split")  # fmt: skip


def _stage_params(
    shapes: dict[str, tuple], args: dict[str, Any], stage: int, tp: int
) -> list[tuple[str, tuple]] | None:
    """One pipeline stage's parameters in megatron-core's order with their TP-local shapes."""
    pp, layers = int(args.get("pipeline_model_parallel_size", 1) or 1), int(args["num_layers"])
    per_stage = layers // pp
    if layers % pp or any(args.get(k) for k in _UNEVEN):
        return None  # (uneven or virtual stages)
    own = []
    for name in shapes:
        layer = LAYER.match(name)
        if layer:
            keep = stage * per_stage <= int(layer.group(1)) < (stage + 1) * per_stage
        else:
            keep = stage == 0 if name.startswith("embedding.") else stage == pp - 1
        if keep:
            own.append(name)
    tied_copy = "embedding.word_embeddings.weight"
    if stage == pp - 1 and pp > 1 and not args.get("untie_embeddings_and_output_weights") and tied_copy in shapes:
        own.append("output_layer.weight")  # (the last stage's copy of the tied embedding)
        shapes = {**shapes, "output_layer.weight": shapes[tied_copy]}
    local_spec = args.get("transformer_impl", "transformer_engine") == "local"  # (Megatron-LM's default: TE)
    orders = {n: _order(n, local_spec) for n in own}
    if any(o is None for o in orders.values()):
        return None
    out = []
    for name in sorted(own, key=lambda n: orders[n]):
        shape = list(shapes[name])
        dim = tp_dim(name)
        if dim is not None:
            shape[dim] //= tp
        out.append((name, tuple(shape)))
    return out


def dp_reshardable_optimizer(ckpt: MegatronCheckpoint, m: ModelConfig) -> dict[str, State] | None:
    """Adam's state of a torch_dist checkpoint saved in the distributed optimizer's `dp_reshardable`
    format under paratron's names; None when it has none or its layout cannot be mapped."""
    bucketing = Bucketing.of(ckpt.args)
    found = {k: v for k, v in dist_shapes(ckpt, "optimizer.distributed.").items() if _BUCKET_KEY.match(k)}
    if bucketing is None or not found:
        return None
    a = ckpt.args
    tp, pp = int(a.get("tensor_model_parallel_size", 1) or 1), int(a.get("pipeline_model_parallel_size", 1) or 1)
    weights = dist_shapes(ckpt)
    tensors = dist_tensors(ckpt, "optimizer.distributed.")
    bounds = _saved_bounds(ckpt)
    per_domain: dict[tuple[int, int], State] = {}
    for stage in range(pp):
        params = _stage_params(weights, a, stage, tp)
        if params is None:
            return None
        listed = [(n, math.prod(s), _shared(n, a, stage, 0)) for n, s in params]
        places, unpadded = bucket_places(listed, bucketing.for_chunk(stage, 0))
        for rank in range(tp):
            prefix = f"optimizer.distributed.dp_group_idx_{stage * tp + rank}.gbuf_idx_"
            flat = _bucket_tensors({k: t for k, t in tensors.items() if k.startswith(prefix)}, len(unpadded))
            if flat is None or any(t.numel() != n for ts in flat.values() for t, n in zip(ts, unpadded)):
                return None
            edges = {b: bounds.get((stage * tp + rank, b), set()) for b in range(len(unpadded))}
            if any({o, o + math.prod(dict(params)[n])} - edges[b] for n, (b, o) in places.items()):
                return None  # (the saved pieces do not begin and end where the parameters do)
            per_domain[(rank, stage)] = _slices(flat, places, dict(params))
    return _merge_domains(per_domain, tp, pp, m, str(ckpt.folder))


def _saved_bounds(ckpt: MegatronCheckpoint) -> dict[tuple[int, int], set[int]]:
    """(dp_group_idx, bucket) -> where the saved pieces of its master weights begin and end: each
    parameter (and each gap between parameters) is saved as pieces of its own."""
    out = {}
    for key, edges in dist_chunk_bounds(ckpt, "optimizer.distributed.").items():
        matched = _BUCKET_KEY.match(key)
        if matched and matched.group(4) == "param":
            out[(int(matched.group(1)), int(matched.group(3)))] = edges
    return out


def _bucket_tensors(tensors: dict[str, torch.Tensor], buckets: int) -> dict[str, list[torch.Tensor]] | None:
    """One domain's saved buckets per state, in bucket order (None: not one buffer of `buckets` buckets)."""
    out: dict[str, dict[int, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        matched = _BUCKET_KEY.match(key)
        if matched is None or matched.group(2) != "0":
            return None  # (a second buffer: several dtypes or model chunks)
        out.setdefault(matched.group(4), {})[int(matched.group(3))] = tensor
    if set(out) != set(_STATES) or any(sorted(b) != list(range(buckets)) for b in out.values()):
        return None
    return {s: [out[s][i] for i in range(buckets)] for s in _STATES}


def _merge_domains(per_domain: dict[tuple[int, int], State], tp: int, pp: int, m: ModelConfig, source: str) -> dict:
    """Every stage's TP slices joined into single-device tensors (the first stage's copy of a tied embedding)."""
    gated = m.activation == "swiglu"
    out: dict[str, State] = {}
    for ours in _STATES.values():
        merged: dict[str, torch.Tensor] = {}
        for stage in range(pp):
            for name in per_domain[(0, stage)][ours]:
                if name == "output_layer.weight" and pp > 1 and not m.untie_embeddings_and_output_weights:
                    continue
                merged[name] = merge_tp(name, [per_domain[(r, stage)][ours][name] for r in range(tp)], gated)
        out[ours] = to_paratron(merged, m, source)
    out["step"] = {}
    return out
