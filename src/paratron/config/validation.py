"""Consistency checks run before any worker process starts.

Each failure is a ConfigError whose one-line message names the flag and the fix.
"""

from __future__ import annotations

from pathlib import Path

from paratron.config.schema import Config
from paratron.errors import ConfigError


def parse_split(split: str) -> tuple[float, float, float]:
    """'969,30,1' -> normalized (train, valid, test) fractions."""
    parts = [p.strip() for p in split.replace("/", ",").split(",")]
    try:
        weights = [float(p) for p in parts]
    except ValueError:
        weights = []
    if not 1 <= len(weights) <= 3 or any(w < 0 for w in weights) or sum(weights) <= 0:
        raise ConfigError(f"--split {split!r}: expected up to three non-negative numbers such as 969,30,1")
    weights += [0.0] * (3 - len(weights))
    total = sum(weights)
    return weights[0] / total, weights[1] / total, weights[2] / total


def _positive(value: float | None, flag: str, allow_zero: bool = False) -> None:
    if value is None:
        return
    if value < 0 or (value == 0 and not allow_zero):
        bound = "zero or more" if allow_zero else "at least 1"
        raise ConfigError(f"{flag} {value}: must be {bound}")


def _fraction(value: float, flag: str) -> None:
    if not 0.0 <= value < 1.0:
        raise ConfigError(f"{flag} {value}: must be in [0, 1)")


def data_parallel_size(config: Config, world_size: int) -> int:
    p = config.parallel
    return world_size // (p.tensor_model_parallel_size * p.pipeline_model_parallel_size)


def validate(config: Config, world_size: int, check_data: bool = True) -> None:
    """Raise ConfigError for the first inconsistent setting of a run on `world_size` processes.

    `check_data=False` skips the data-source checks (for library use that brings its own data)."""
    m, p, o, s, d, t, c, lg = (config.model, config.parallel, config.optimizer, config.lr_schedule,
                               config.data, config.training, config.checkpoint, config.logging)

    for value, flag in [
        (m.num_layers, "--num-layers"), (m.hidden_size, "--hidden-size"), (m.ffn_hidden_size, "--ffn-hidden-size"),
        (m.num_attention_heads, "--num-attention-heads"), (m.num_query_groups, "--num-query-groups"),
        (m.kv_channels, "--kv-channels"), (m.max_position_embeddings, "--max-position-embeddings"),
        (m.vocab_size, "--vocab-size"), (m.rotary_base, "--rotary-base"), (m.norm_epsilon, "--norm-epsilon"),
        (m.init_method_std, "--init-method-std"), (m.make_vocab_size_divisible_by, "--make-vocab-size-divisible-by"),
        (p.nproc_per_node, "--nproc"), (p.tensor_model_parallel_size, "--tensor-model-parallel-size"),
        (p.pipeline_model_parallel_size, "--pipeline-model-parallel-size"),
        (p.num_layers_per_virtual_pipeline_stage, "--num-layers-per-virtual-pipeline-stage"),
        (p.virtual_pipeline_model_parallel_size, "--virtual-pipeline-model-parallel-size"),
        (p.decoder_first_pipeline_num_layers, "--decoder-first-pipeline-num-layers"),
        (p.decoder_last_pipeline_num_layers, "--decoder-last-pipeline-num-layers"),
        (t.recompute_num_layers, "--recompute-num-layers"),
        (d.seq_length, "--seq-length"), (t.micro_batch_size, "--micro-batch-size"),
        (t.global_batch_size, "--global-batch-size"), (t.train_iters, "--train-iters"),
        (t.eval_interval, "--eval-interval"), (lg.log_interval, "--log-interval"),
        (c.save_interval, "--save-interval"), (lg.sample_tokens, "--sample-tokens"),
        (s.lr_decay_iters, "--lr-decay-iters"), (lg.peak_tflops, "--peak-tflops"),
        (p.distributed_timeout_minutes, "--distributed-timeout-minutes"), (p.ddp_bucket_size, "--ddp-bucket-size"),
        (t.loss_scale, "--loss-scale"), (t.initial_loss_scale, "--initial-loss-scale"),
        (t.min_loss_scale, "--min-loss-scale"), (t.loss_scale_window, "--loss-scale-window"),
        (t.hysteresis, "--hysteresis"), (t.exit_duration_in_mins, "--exit-duration-in-mins"),
        (t.exit_interval, "--exit-interval"), (c.keep_last, "--keep-last"),
    ]:
        _positive(value, flag)
    for value, flag in [
        (t.eval_iters, "--eval-iters"), (s.lr_warmup_iters, "--lr-warmup-iters"), (o.lr, "--lr"),
        (s.min_lr, "--min-lr"), (lg.sample_temperature, "--sample-temperature"), (o.weight_decay, "--weight-decay"), (o.clip_grad, "--clip-grad"),
        (o.adam_eps, "--adam-eps"), (o.sgd_momentum, "--sgd-momentum"),
    ]:
        _positive(value, flag, allow_zero=True)
    for value, flag in [(m.hidden_dropout, "--hidden-dropout"), (m.attention_dropout, "--attention-dropout"),
                        (o.adam_beta1, "--adam-beta1"), (o.adam_beta2, "--adam-beta2")]:
        _fraction(value, flag)

    if t.loss_scale is not None and t.precision != "fp16":
        raise ConfigError(f"--loss-scale applies to fp16 training only (this run is {t.precision}); add --fp16 or drop it")
    if t.min_loss_scale > t.initial_loss_scale:
        raise ConfigError(f"--min-loss-scale {t.min_loss_scale:g} exceeds --initial-loss-scale {t.initial_loss_scale:g}; "
                          "lower the first or raise the second")

    # Model shape.
    heads, groups = m.num_attention_heads, m.num_query_groups or m.num_attention_heads
    if m.kv_channels is None and m.hidden_size % heads:
        raise ConfigError(f"--hidden-size {m.hidden_size} is not divisible by --num-attention-heads {heads}; "
                          "change one of them or set --kv-channels")
    if groups > heads or heads % groups:
        raise ConfigError(f"--num-attention-heads {heads} is not a multiple of --num-query-groups {groups}; "
                          "use a divisor of the head count")
    head_dim = m.kv_channels or m.hidden_size // heads
    if m.position_embedding_type == "rope" and head_dim % 2:
        raise ConfigError(f"rotary embeddings need an even head width, got {head_dim}; change --kv-channels or --hidden-size")
    if d.seq_length > m.max_position_embeddings:
        raise ConfigError(f"--seq-length {d.seq_length} exceeds --max-position-embeddings {m.max_position_embeddings}; "
                          "lower the first or raise the second")

    # Layout.
    tp, pp = p.tensor_model_parallel_size, p.pipeline_model_parallel_size
    if world_size % (tp * pp):
        raise ConfigError(f"world size {world_size} is not divisible by --tensor-model-parallel-size {tp} x "
                          f"--pipeline-model-parallel-size {pp}; use a multiple of {tp * pp} processes")
    if heads % tp:
        raise ConfigError(f"--num-attention-heads {heads} is not divisible by --tensor-model-parallel-size {tp}; "
                          "choose a tensor-parallel size that divides the head count")
    if groups % tp and tp % groups:
        raise ConfigError(f"--num-query-groups {groups} and --tensor-model-parallel-size {tp}: one must divide the "
                          "other (key/value heads are split over the ranks, or replicated when fewer)")
    ffn = m.ffn_hidden_size or 4 * m.hidden_size
    if ffn % tp:
        raise ConfigError(f"--ffn-hidden-size {ffn} is not divisible by --tensor-model-parallel-size {tp}; "
                          "choose a tensor-parallel size that divides it")
    if p.sequence_parallel and tp == 1:
        raise ConfigError("--sequence-parallel needs --tensor-model-parallel-size above 1")
    if p.sequence_parallel and d.seq_length % tp:
        raise ConfigError(f"--seq-length {d.seq_length} is not divisible by --tensor-model-parallel-size {tp}, "
                          "which --sequence-parallel needs; choose a multiple")
    dp = data_parallel_size(config, world_size)
    if t.global_batch_size is not None and t.global_batch_size % (t.micro_batch_size * dp):
        raise ConfigError(f"--global-batch-size {t.global_batch_size} is not divisible by --micro-batch-size "
                          f"{t.micro_batch_size} x data-parallel size {dp}; use a multiple of {t.micro_batch_size * dp}")
    if t.recompute_granularity == "full" and t.recompute_method is None:
        raise ConfigError("--recompute-granularity full needs --recompute-method uniform or block")
    if t.recompute_granularity != "full" and (t.recompute_method is not None or t.recompute_num_layers is not None):
        raise ConfigError("--recompute-method and --recompute-num-layers apply to --recompute-granularity full; "
                          "add it or drop them")
    if t.recompute_method == "block" and t.recompute_num_layers is None:
        raise ConfigError("--recompute-method block needs --recompute-num-layers (layers per pipeline chunk)")
    from paratron.parallel.pipeline.stage import plan_pipeline  # (here: parallel/ imports config/)

    plan = plan_pipeline(config, dp)
    stage = p.sharding_stage
    if p.overlap_param_gather and stage not in (1, 2):
        raise ConfigError("--overlap-param-gather needs the distributed optimizer: add --use-distributed-optimizer "
                          "(or --zero-stage 1 or 2)")
    if stage == 3 and plan.schedule is not None and plan.schedule.split_backward:
        raise ConfigError(f"--zero-stage 3 does not combine with --pipeline-schedule {plan.schedule.name}, whose "
                          "deferred weight gradients would miss FSDP's reduction; use 1f1b, interleaved or gpipe, "
                          "or --zero-stage 1 or 2")

    # Schedule.
    decay_iters = s.lr_decay_iters or t.train_iters
    if s.lr_warmup_iters > decay_iters:
        raise ConfigError(f"--lr-warmup-iters {s.lr_warmup_iters} exceeds the decay length {decay_iters}; "
                          "lower it or raise --lr-decay-iters")
    if s.min_lr > o.lr:
        raise ConfigError(f"--min-lr {s.min_lr} exceeds --lr {o.lr}; lower --min-lr")

    # Data.
    if check_data:
        _validate_data(config)

    # Checkpoints.
    if c.load is not None and not Path(c.load).expanduser().is_dir():
        raise ConfigError(f"--load {c.load}: no such checkpoint directory; check the path")


def _validate_data(config: Config) -> None:
    from paratron.data.blending import parse_blend
    from paratron.data.indexed import dataset_exists

    d, t = config.data, config.training
    per_split = bool(d.train_data_path or d.valid_data_path or d.test_data_path)
    sources = [name for name, on in (("--mock-data", d.mock_data), ("--corpus", d.corpus),
                                     ("--data-path", bool(d.data_path)), ("--train-data-path", per_split)) if on]
    if len(sources) != 1:
        what = "none" if not sources else " and ".join(sources)
        raise ConfigError("give exactly one of --data-path, --train-data-path (with --valid-data-path), "
                          f"--corpus stdlib or --mock-data (got {what})")
    if per_split and not d.train_data_path:
        raise ConfigError("--valid-data-path and --test-data-path need --train-data-path too")
    if per_split and t.eval_iters > 0 and not d.valid_data_path:
        raise ConfigError(f"--eval-iters {t.eval_iters} needs --valid-data-path; give it or set --eval-iters 0")
    raw, preprocessed = bool(d.corpus), False
    for values, flag in d.blend_flags():
        for path in parse_blend(values, flag).paths:
            if dataset_exists(path):
                preprocessed = True
            elif Path(path).exists():
                raw = True
            else:
                raise ConfigError(f"{flag} {path}: neither a dataset prefix ({path}.bin/.idx) nor a file or "
                                  "directory; check the path")
    kind = d.tokenizer_type
    if kind == "HuggingFaceTokenizer":
        if not d.tokenizer_model:
            raise ConfigError("--tokenizer-type HuggingFaceTokenizer needs --tokenizer-model PATH (a tokenizer.json)")
        model = Path(d.tokenizer_model).expanduser()
        if not (model.is_file() or (model / "tokenizer.json").is_file()):
            raise ConfigError(f"--tokenizer-model {d.tokenizer_model}: no tokenizer.json there; check the path")
    elif kind == "GPT2BPETokenizer":
        for value, flag in ((d.vocab_file, "--vocab-file"), (d.merge_file, "--merge-file")):
            if not value or not Path(value).expanduser().is_file():
                raise ConfigError(f"--tokenizer-type GPT2BPETokenizer needs {flag} (GPT-2's "
                                  f"{'vocab.json' if flag == '--vocab-file' else 'merges.txt'}); got {value}")
    elif kind == "NullTokenizer":
        if not config.model.vocab_size:
            raise ConfigError("--tokenizer-type NullTokenizer needs --vocab-size")
    elif preprocessed or (not raw and not d.mock_data):
        raise ConfigError("--tokenizer-type ByteLevelBPE trains on text, but (some of) the data is preprocessed "
                          "already; name its tokenizer: HuggingFaceTokenizer --tokenizer-model, GPT2BPETokenizer "
                          "--vocab-file/--merge-file, or NullTokenizer --vocab-size")
    _, valid_share, _ = parse_split(d.split)
    if t.eval_iters > 0 and valid_share == 0 and (d.data_path or d.corpus):
        raise ConfigError(f"--split {d.split} leaves no validation data for --eval-iters {t.eval_iters}; "
                          "give the split a validation share or set --eval-iters 0")
