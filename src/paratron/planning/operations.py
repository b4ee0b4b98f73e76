"""One micro-batch's operations on each model stage, priced: the forward (F), backward (B) and
deferred weight-gradient (W) times, and the same time split by what it is spent on (PARTS).

Kept apart from `cost`, which runs these per-stage times through the pipeline schedule and adds
what follows it (the data-parallel tail, the optimizer step); this module is the per-layer
arithmetic of FLOPs and message bytes.

Each operation costs its compute (FLOPs at `Hardware.flops`, each layer's summed from what its kinds declare,
`LayerKind.forward_work` through `planning.layer_terms`: matmuls / TP, attention scores over the keys each query
computes / (TP x CP); the output layer and loss on the last stage; recomputation repeats forward work in B; a vision
model's encoder and projector on the first stage, forward only where the encoder is frozen) plus the communication
it cannot hide:

- tensor parallelism: an all-reduce of the micro-batch's activations per residual sublayer (two per Transformer
  block) in forward and one in backward; under sequence parallelism an all-gather and a reduce-scatter in forward,
  and in backward two all-gathers (the inputs are gathered again, as Megatron-LM does) and a reduce-scatter; not
  overlapped (Megatron does not by default), so all of it counts;
- context parallelism: each attention's ring passes key/value blocks while the previous block's attention runs,
  so only max(0, ring - attention) counts (all of it where the hardware does not overlap
  communication with compute: the CPU);
- expert parallelism: each mixture of experts' dispatch and combine all-to-alls, all of it;
- ZeRO-2: every micro-batch's gradients reduce-scattered behind its backward;
- ZeRO-3 (FSDP2): parameter all-gathers in forward and backward, prefetched behind compute;
- the pipeline's point-to-point message, charged to the operation that receives it.

Collectives follow an alpha-beta model on the level they run over: inside a node when the group's
ranks share one (the rank grid is tp fastest, then cp, ep, dp, pp), otherwise between nodes:
ring all-reduce 2(n-1)/n bytes / bandwidth + 2(n-1) latencies, all-gather or reduce-scatter half
of that, all-to-all (n-1)/n bytes.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

from paratron.config.layout import Layout
from paratron.config.schema import Config, ModelConfig
from paratron.model.fused_loss import chunk_tokens
from paratron.parallel.pipeline.schedules import stage_of
from paratron.planning.activations import WIDTHS, grad_width, padded_vocab
from paratron.planning.hardware import (
    Hardware,
    all_gather_time,
    all_reduce_time,
    all_to_all_time,
    link,
    p2p_time,
    reduce_scatter_time,
)
from paratron.planning.layer_terms import (
    LayerKinds,
    LayerWork,
    StageKinds,
    layer_works,
    stage_kinds,
    work_share,
)
from paratron.planning.memory_prediction import Parts, local_parameters
from paratron.planning.vision import images_per_micro_batch, vision_work

PARTS = ("compute", "tensor_parallel", "context_parallel", "expert_parallel", "pipeline_p2p", "data_parallel")
"""What one micro-batch's operations spend their time on (the step adds the bubble and the optimizer)."""

FLASH_BACKWARD = 2.5
"""Attention-score backward / forward work: flash attention recomputes the scores (five matmuls to
the forward's two)."""


# ---------------------------------------------------------------- work and parameters


def stage_layer_kinds(config: Config, layout: Layout) -> tuple[StageKinds, ...]:
    """Per model stage, its distinct layers (their kinds) and how many of each."""
    return stage_kinds(config.model, tuple(layout.pipeline.counts))


def stage_parameters(config: Config, layout: Layout) -> list[tuple[int, int]]:
    """Per model stage, the (dense, expert) elements one rank trains, counted on the real shards
    (`memory_prediction.local_parameters`): its layers, the embedding (and a vision encoder and projector) on the first
    stage, the head (and a tied output layer's copy) on the last."""
    p = config.parallel
    sizes = (layout.tp, p.expert_model_parallel_size, p.expert_tensor_parallel_size)
    return _stage_parameters(config.model, sizes, layout.pipeline.counts, layout.pp)


@functools.lru_cache(maxsize=4096)
def _stage_parameters(
    model: ModelConfig, sizes: tuple[int, int, int | None], counts: tuple[int, ...], pp: int
) -> list[tuple[int, int]]:
    local = local_parameters(model, *sizes)
    out = []
    for stage, held in enumerate(stage_kinds(model, counts)):
        parts = Parts()
        for layer, count in held:
            parts = parts + local.layers[layer] * count
        parts = parts + (local.embedding + local.vision if stage == 0 else Parts())
        parts = parts + (
            local.head + (local.output_copy if pp > 1 else Parts()) if stage == len(counts) - 1 else Parts()
        )
        out.append((parts.dense, parts.experts))
    return out


def rank_stages(layout: Layout, rank: int) -> list[int]:
    """The model stages pipeline rank `rank` runs, one per chunk."""
    v_shape = layout.pipeline.schedule == "zb-v"
    return [stage_of(rank, chunk, layout.pp, v_shape) for chunk in range(layout.pipeline.chunks)]


# ---------------------------------------------------------------- the operations


def stage_operations(
    config: Config, layout: Layout, hardware: Hardware
) -> tuple[list[dict[str, float]], list[dict[str, float]]]:
    """Per model stage: one micro-batch's F, B and W durations, and the same time split by PARTS."""
    comm = _Comm.of(config, layout, hardware)
    share = work_share(config, layout.tp, layout.cp, layout.micro_batch_size)
    works = layer_works(config.model, share)
    layer = {(kinds, again): comm.layer(work, again) for kinds, work in works.items() for again in (0, 1)}
    t = config.training
    block = t.recompute_num_layers or 1 if t.recompute_method == "block" else None
    params = stage_parameters(config, layout)
    stages, message = len(layout.pipeline.counts), comm.message(layout)
    ends = (
        {0: comm.embedding(), stages - 1: comm.output()} if stages > 1 else {0: _sum(comm.embedding(), comm.output())}
    )
    if config.model.has_vision:
        ends[0] = _sum(ends[0], comm.vision(layout, block))
    ops, parts, seen = [], [], {}
    owner = [_rank_of(layout, s) for s in range(stages)]
    for s, held in enumerate(stage_layer_kinds(config, layout)):
        before = s > 0 and owner[s - 1] != owner[s]
        after = s < stages - 1 and owner[s + 1] != owner[s]
        signature = (held, ends.get(s) and s, before, after)
        if signature not in seen:  # (most stages of a pipeline look alike: price each kind once)
            counts = _recomputed(t.recompute_granularity == "full", block, held)
            counts = {key: n for key, n in counts.items() if n}
            op = {k: sum(n * layer[key][0][k] for key, n in counts.items()) for k in "FBW"}
            part = {name: sum(n * layer[key][1][name] for key, n in counts.items()) for name in PARTS}
            if s in ends:
                _add(op, part, *ends[s])
            _add(op, part, {"F": message * before, "B": message * after}, {"pipeline_p2p": message * (before + after)})
            if config.parallel.zero_stage >= 2:
                extra = comm.sharded(sum(params[s]), sum(n for _, n in held), op)
                _add(op, part, extra, {"data_parallel": sum(extra.values())})
            if not comm.split:  # without zero-bubble W, weight gradients are part of the backward
                op["B"], op["W"] = op["B"] + op["W"], 0.0
            seen[signature] = (op, part)
        ops.append(seen[signature][0])
        parts.append(seen[signature][1])
    return ops, parts


def _recomputed(full: bool, block: int | None, held: StageKinds) -> dict[tuple[LayerKinds, int], float]:
    """A stage's layers by (kinds, recomputed): full recomputation takes every layer, or with the block
    method the first `block` of the chunk (its layers in the stage's proportion)."""
    count = sum(n for _, n in held)
    again = 0 if not full else (count if block is None else min(block, count))
    share = again / count if count else 0.0
    out: dict[tuple[LayerKinds, int], float] = {}
    for kinds, n in held:
        out[(kinds, 0)] = n * (1 - share)
        out[(kinds, 1)] = n * share
    return out


def _sum(
    a: tuple[dict[str, float], dict[str, float]], b: tuple[dict[str, float], dict[str, float]]
) -> tuple[dict[str, float], dict[str, float]]:
    return (
        {k: a[0].get(k, 0.0) + b[0].get(k, 0.0) for k in "FBW"},
        {n: a[1].get(n, 0.0) + b[1].get(n, 0.0) for n in {*a[1], *b[1]}},
    )


def _add(op: dict[str, float], part: dict[str, float], times: dict[str, float], spent: dict[str, float]) -> None:
    """Add times per operation, and the same time by part."""
    for k, t in times.items():
        op[k] += t
    for n, t in spent.items():
        part[n] += t


@dataclass(frozen=True)
class _Comm:
    """The per-micro-batch message times of one layout, and what a layer costs with them."""

    config: Config
    hardware: Hardware
    tp: int
    cp: int
    dp: int
    split: bool
    tokens: float
    """Tokens of a micro-batch on one CP rank."""
    activation: float
    """Bytes of one micro-batch's activations on a CP rank (b x s / CP x h)."""
    act_bytes: int

    @property
    def expert_tp(self) -> int:
        """The stride of an expert-parallel group's ranks (the experts' grid varies expert TP fastest)."""
        return self.config.parallel.expert_tensor_parallel_size or self.tp

    @classmethod
    def of(cls, config: Config, layout: Layout, hardware: Hardware) -> _Comm:
        tokens = layout.micro_batch_size * config.data.seq_length / layout.cp
        act = WIDTHS[config.training.precision]
        split = layout.pipeline.schedule in ("zb-h1", "zb-v")
        activation = tokens * config.model.hidden_size * act
        return cls(config, hardware, layout.tp, layout.cp, layout.dp, split, tokens, activation, act)

    def layer(self, work: LayerWork, recomputed: bool) -> tuple[dict[str, float], dict[str, float]]:
        """One layer's (F/B/W times, times by part) for one micro-batch; `recomputed`: under full
        recomputation (its forward, communication included, runs again in backward)."""
        rate, m, p = self.hardware.flops, self.config.model, self.config.parallel
        tp_link = link(self.hardware, 1, self.tp)
        if p.sequence_parallel:  # per sublayer, forward: gather, reduce-scatter; backward: 2 gathers (input again), 1
            gather = all_gather_time(self.activation, self.tp, tp_link)
            tp_fwd, tp_bwd = 2 * work.sublayers * gather, 3 * work.sublayers * gather
        else:  # an all-reduce each way per sublayer
            tp_fwd = tp_bwd = work.sublayers * all_reduce_time(self.activation, self.tp, tp_link)
        kv = 2 * self.tokens * max(m.num_query_groups / self.tp, 1) * m.kv_channels
        hop = link(self.hardware, self.tp, self.cp)
        ring = work.attentions * ((self.cp - 1) * p2p_time(kv * self.act_bytes, hop)) if self.cp > 1 else 0
        ep = p.expert_model_parallel_size
        routed = self.tokens / (self.tp if p.sequence_parallel else 1) * m.moe_router_topk * m.hidden_size
        ep_link = link(self.hardware, self.expert_tp, ep)
        a2a = work.all_to_alls * all_to_all_time(routed * self.act_bytes, ep, ep_link) if work.all_to_alls else 0
        scores_f, scores_b = work.scores / rate, FLASH_BACKWARD * work.scores / rate
        hides = self.hardware.overlaps_communication
        fwd = {"compute": work.linear / rate + scores_f, "tensor_parallel": tp_fwd}
        fwd |= {"context_parallel": max(0.0, ring - scores_f) if hides else ring, "expert_parallel": 2 * a2a}
        bwd = {"compute": work.linear / rate + scores_b, "tensor_parallel": tp_bwd}
        bwd |= {"context_parallel": max(0.0, 2 * ring - scores_b) if hides else 2 * ring, "expert_parallel": 2 * a2a}
        if recomputed:
            bwd = {k: v + fwd[k] for k, v in bwd.items()}
        elif self.config.training.recompute_granularity == "selective":
            bwd["compute"] += scores_f
        weight = work.linear / rate
        parts = {n: fwd.get(n, 0.0) + bwd.get(n, 0.0) for n in PARTS}
        parts["compute"] += weight
        return {"F": sum(fwd.values()), "B": sum(bwd.values()), "W": weight}, parts

    def embedding(self) -> tuple[dict[str, float], dict[str, float]]:
        """The first stage's embedding: a memory-bound lookup and its vocabulary-parallel reduction."""
        lookup = 2 * self.activation / (self.hardware.memory_gbps * 1e9)
        reduce = all_reduce_time(self.activation, self.tp, link(self.hardware, 1, self.tp))
        sp = self.config.parallel.sequence_parallel
        ops = {"F": lookup + reduce / (2 if sp else 1), "B": lookup + (reduce / 2 if sp else 0.0), "W": 0.0}
        return ops, {"compute": 2 * lookup, "tensor_parallel": ops["F"] + ops["B"] - 2 * lookup}

    def vision(self, layout: Layout, block: int | None) -> tuple[dict[str, float], dict[str, float]]:
        """The first stage's vision encoder and projector for a micro-batch's images: the encoder's layers as the
        language model's (split by TP, never by sequence; recomputed alike), their forward only when the encoder
        is frozen (no gradient passes through it); the patch embedding and the projector whole on each TP rank."""
        m, rate = self.config.model, self.hardware.flops
        work = vision_work(self.config, self.tp, images_per_micro_batch(self.config, layout.micro_batch_size))
        layer = LayerWork(work.linear, work.scores, sublayers=2, attentions=1, all_to_alls=0)  # (a Transformer block)
        trains = m.encoder_trains
        whole_rows = dataclasses.replace(self.config.parallel, sequence_parallel=False)
        encoder = dataclasses.replace(
            self,
            config=dataclasses.replace(self.config, parallel=whole_rows),
            cp=1,
            tokens=work.activation / m.vision_hidden_size,
            activation=work.activation * self.act_bytes,
        )
        ops, parts = {"F": 0.0, "B": 0.0, "W": 0.0}, dict.fromkeys(PARTS, 0.0)
        full = self.config.training.recompute_granularity == "full"
        for (_, again), count in _recomputed(full, block, (((), m.vision_run_layers),)).items():  # (blocks alike)
            times, spent = encoder.layer(layer, bool(again))
            if not trains:
                times = {"F": times["F"], "B": 0.0, "W": 0.0}
                tp_link = link(self.hardware, 1, self.tp)
                spent = {"compute": layer.linear / rate + layer.scores / rate}
                spent["tensor_parallel"] = 2 * all_reduce_time(encoder.activation, self.tp, tp_link)
            _add(ops, parts, {k: count * t for k, t in times.items()}, {n: count * t for n, t in spent.items()})
        ends = {
            "F": (work.patches + work.projector_in + work.projector_out) / rate,
            "B": (work.projector_out + work.projector_in * trains) / rate,
            "W": (work.patches * trains + work.projector_in + work.projector_out) / rate,
        }
        _add(ops, parts, ends, {"compute": sum(ends.values())})
        return ops, parts

    def output(self) -> tuple[dict[str, float], dict[str, float]]:
        """The last stage's output layer (a vocabulary-parallel matmul) and the cross-entropy over it."""
        m, rate = self.config.model, self.hardware.flops
        vocab = padded_vocab(self.config, self.tp) / self.tp
        matmul = 2 * self.tokens * m.hidden_size * vocab / rate
        loss = 3 * self.tokens * vocab * 4 / (self.hardware.memory_gbps * 1e9)  # fp32 logits, a few passes
        tp_link = link(self.hardware, 1, self.tp)
        small = 3 * all_reduce_time(self.tokens * 4, self.tp, tp_link)  # max, sum of exponentials, target logit
        gather = all_gather_time(self.activation, self.tp, tp_link) if self.config.parallel.sequence_parallel else 0
        if self.config.training.cross_entropy_loss_fusion:
            return self._fused_output(matmul, loss, small, gather, vocab)
        ops = {"F": matmul + loss + small + gather, "B": matmul + loss + gather, "W": matmul}
        return ops, {"compute": 3 * matmul + 2 * loss, "tensor_parallel": small + 2 * gather}

    def _fused_output(
        self, matmul: float, loss: float, small: float, gather: float, vocab: float
    ) -> tuple[dict[str, float], dict[str, float]]:
        """--cross-entropy-loss-fusion: forward runs all three matmuls and one pass over each chunk's logits, with
        the three small all-reduces per chunk; backward only scales the kept fp32 gradients (of the hidden states
        and the output weight) and sends the hidden states' back (reduce-scattered under SP); nothing is left for W."""
        chunks = -(-self.tokens // chunk_tokens(round(vocab)))
        kept = 4 * (self.tokens + vocab) * self.config.model.hidden_size
        scale = 2 * kept / (self.hardware.memory_gbps * 1e9)  # (read and written once)
        ops = {"F": 3 * matmul + loss + chunks * small + gather, "B": scale + gather, "W": 0.0}
        return ops, {"compute": 3 * matmul + loss + scale, "tensor_parallel": chunks * small + 2 * gather}

    def message(self, layout: Layout) -> float:
        """One pipeline message: a micro-batch's activations (or their gradients), / TP under
        sequence parallelism, between pipeline neighbours (TP x CP x DP ranks apart)."""
        nbytes = self.activation / (self.tp if self.config.parallel.sequence_parallel else 1)
        return p2p_time(nbytes, link(self.hardware, self.tp * self.cp * layout.dp, 2))

    def sharded(self, params: float, layers: int, op: dict[str, float]) -> dict[str, float]:
        """ZeRO-2: every micro-batch's gradients reduce-scattered behind its backward (all but the
        last bucket). ZeRO-3: each layer's 16-bit weights all-gathered before its forward and its
        backward, prefetched behind the previous layer's compute (the first gather waits)."""
        stage, over = self.config.parallel.zero_stage, link(self.hardware, self.tp * self.cp, self.dp * self.cp)
        hides = self.hardware.overlaps_communication
        if stage == 2 and params:
            bucket = self.config.parallel.gradient_bucket_size(self.dp)
            g = grad_width(self.config)
            whole = reduce_scatter_time(g * params, self.dp * self.cp, over)
            last = reduce_scatter_time(g * min(bucket, params), self.dp * self.cp, over)
            return {"B": max(last, whole - op["B"] - op["W"]) if hides else whole}
        if stage != 3 or not params:
            return {}
        units = max(layers, 1)  # (one gather per layer: each pays its latency)
        first = all_gather_time(params * self.act_bytes / units, self.dp, over)
        whole = units * first
        return {k: max(first, whole - op[k]) if hides else whole for k in ("F", "B")}


def _rank_of(layout: Layout, stage: int) -> int:
    if layout.pipeline.schedule == "zb-v":
        return stage if stage < layout.pp else 2 * layout.pp - 1 - stage
    return stage % layout.pp
