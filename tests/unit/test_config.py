"""Config: field docs, YAML + CLI precedence, Megatron flag names, the dict form, validation messages."""

from __future__ import annotations

import re

import pytest

import paratron
from paratron.commands.train import parser as train_parser
from paratron.config import build_config, validate
from paratron.config.arguments import parse_config_arguments
from paratron.config.fields import all_fields
from paratron.config.megatron import from_megatron_dict
from paratron.errors import ConfigError
from paratron.training.preflight import check_inputs

MEGATRON_COMMAND = """
--num-layers 6 --hidden-size 96 --ffn-hidden-size 256 --num-attention-heads 6 --group-query-attention
--num-query-groups 2 --seq-length 48 --max-position-embeddings 64 --micro-batch-size 3 --global-batch-size 12
--lr 0.002 --min-lr 0.0001 --lr-warmup-iters 7 --lr-decay-iters 90 --lr-decay-style linear --train-iters 100
--weight-decay 0.05 --adam-beta1 0.8 --adam-beta2 0.99 --clip-grad 0.5 --init-method-std 0.01 --seed 7
--tensor-model-parallel-size 1 --pipeline-model-parallel-size 1 --bf16 --save /tmp/ckpt-out --load /tmp
--save-interval 50 --log-interval 5 --eval-interval 25 --eval-iters 3 --mock-data --split 90,9,1
--vocab-size 1000 --tokenizer-type HuggingFaceTokenizer --untie-embeddings-and-output-weights
--position-embedding-type rope --normalization RMSNorm --swiglu --disable-bias-linear
""".split()


def parse(argv: list[str]):
    recipe, overrides, _ = parse_config_arguments(train_parser(), argv)
    return build_config(overrides, recipe)


def test_every_field_has_a_doc_shown_by_help(capsys):
    with pytest.raises(SystemExit) as exit_info:
        train_parser().parse_args(["--help"])
    assert exit_info.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    for info in all_fields().values():
        assert info.doc, f"{info.name} has no doc string"
        assert info.flag in text
        assert " ".join(info.doc.split())[:40] in text, info.name


def test_megatron_flag_names_map_onto_the_config():
    c = parse(MEGATRON_COMMAND)
    m, t, o, s, d = c.model, c.training, c.optimizer, c.lr_schedule, c.data
    assert (m.num_layers, m.hidden_size, m.ffn_hidden_size, m.num_attention_heads, m.num_query_groups) == (
        6,
        96,
        256,
        6,
        2,
    )
    assert (d.seq_length, m.max_position_embeddings, t.micro_batch_size, t.global_batch_size) == (48, 64, 3, 12)
    assert (o.lr, s.min_lr, s.lr_warmup_iters, s.lr_decay_iters, s.lr_decay_style) == (0.002, 0.0001, 7, 90, "linear")
    assert (t.train_iters, o.weight_decay, o.adam_beta1, o.adam_beta2, o.clip_grad) == (100, 0.05, 0.8, 0.99, 0.5)
    assert (m.init_method_std, t.seed, t.precision) == (0.01, 7, "bf16")
    assert (c.checkpoint.save, c.checkpoint.load, c.checkpoint.save_interval) == ("/tmp/ckpt-out", "/tmp", 50)
    assert (c.logging.log_interval, t.eval_interval, t.eval_iters) == (5, 25, 3)
    assert (d.mock_data, d.split, m.vocab_size, d.tokenizer_type) == (True, "90,9,1", 1000, "HuggingFaceTokenizer")
    assert m.untie_embeddings_and_output_weights and not m.add_bias_linear
    assert (m.position_embedding_type, m.normalization, m.activation) == ("rope", "RMSNorm", "swiglu")
    assert parse(["--fp16"]).training.precision == "fp16"
    t = parse(
        [
            "--fp16",
            "--initial-loss-scale",
            "65536",
            "--min-loss-scale",
            "2",
            "--loss-scale-window",
            "10",
            "--hysteresis",
            "1",
            "--log-memory",
        ]
    )
    assert (
        t.training.initial_loss_scale,
        t.training.min_loss_scale,
        t.training.loss_scale_window,
        t.training.hysteresis,
        t.logging.log_memory,
    ) == (65536.0, 2.0, 10, 1, True)
    assert parse(["--fp16", "--loss-scale", "4096"]).training.loss_scale == 4096.0
    assert parse(["--recompute-activations"]).training.recompute_granularity == "selective"


def test_data_parallel_flags():
    p = parse(
        ["--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather", "--ddp-bucket-size", "1000"]
    ).parallel
    assert (p.zero_stage, p.overlap_grad_reduce, p.overlap_param_gather, p.ddp_bucket_size) == (1, True, True, 1000)
    assert parse(["--zero-stage", "3"]).parallel.zero_stage == 3
    assert parse(["--use-distributed-optimizer", "--zero-stage", "2"]).parallel.zero_stage == 2
    assert parse([]).parallel.zero_stage == 0
    with pytest.raises(ConfigError, match=r"--zero-stage: 4 is not one of: 0, 1, 2, 3"):
        parse(["--zero-stage", "4"])


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["--fp8-margin", "0"], "--fp8-margin: Megatron-LM's flag is not supported: paratron's fp8 training is"),
        (["--linear-attention-freq", "4"], "--linear-attention-freq: Megatron-LM's flag is not supported: linear-"),
        (["--use-mup"], "--use-mup: Megatron-LM's flag is not supported: muP is not implemented"),
        (["--use-dist-ckpt"], "--use-dist-ckpt is a Megatron-LM flag that paratron does not implement; remove it"),
        (["--biencoder-projection-dim", "8"], "--biencoder-projection-dim is a Megatron-LM flag that paratron does"),
    ],
)
def test_unsupported_megatron_flags_are_refused_by_name(argv, expected):
    with pytest.raises(ConfigError, match="^" + re.escape(expected)):
        parse(argv)


def test_unknown_flag_suggests_the_close_one():
    with pytest.raises(ConfigError, match=r"unknown flag --hiden-size; did you mean --hidden-size\?"):
        parse(["--hiden-size", "64"])
    with pytest.raises(ConfigError, match="unknown flag --hidden"):  # no silent prefix matching
        parse(["--hidden", "64"])


def test_bad_values_name_the_flag():
    with pytest.raises(ConfigError, match=r"--hidden-size: expected an integer, got 'wide'"):
        parse(["--hidden-size", "wide"])
    with pytest.raises(ConfigError, match=r"--normalization: 'BatchNorm' is not one of: LayerNorm, RMSNorm"):
        parse(["--normalization", "BatchNorm"])


def test_precedence_registry_then_recipe_then_flags(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("model:\n  model_name: gpt2-small\n  num_layers: 3\ntraining:\n  train_iters: 9\n")
    c = parse(["--config", str(recipe), "--train-iters", "11"])
    assert c.model.hidden_size == 768  # registry
    assert c.model.num_layers == 3  # recipe over registry
    assert c.training.train_iters == 11  # flag over recipe
    assert parse(["--config", str(recipe), "--model", "debug"]).model.hidden_size == 64


def test_yaml_mistakes_are_one_line_errors(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("model:\n  hiden_size: 3\n")
    with pytest.raises(ConfigError, match=r"bad.yaml: unknown setting model.hiden_size \(did you mean hidden_size\?\)"):
        parse(["--config", str(bad)])
    bad.write_text("modle:\n  hidden_size: 3\n")
    with pytest.raises(ConfigError, match=r"unknown section 'modle' \(did you mean model\?\)"):
        parse(["--config", str(bad)])
    bad.write_text("model: [1, 2\n")
    with pytest.raises(ConfigError, match="not valid YAML at line"):
        parse(["--config", str(bad)])
    with pytest.raises(ConfigError, match=r"--config nosuch: no such file or recipe; recipes: .*demo"):
        parse(["--config", "nosuch"])
    with pytest.raises(ConfigError, match=r"--model gpt5: unknown model; choose one of debug, gpt2-small"):
        parse(["--model", "gpt5"])


def base(**overrides):
    values = dict(mock_data=True)
    values.update(overrides)
    return build_config(values)


@pytest.mark.parametrize(
    "overrides, world, message",
    [
        (
            dict(tensor_model_parallel_size=2),
            3,
            "world size 3 is not divisible by --tensor-model-parallel-size 2 x --pipeline-model-parallel-size 1",
        ),
        (
            dict(num_attention_heads=6, hidden_size=48, tensor_model_parallel_size=4),
            4,
            "--num-attention-heads 6 is not divisible by --tensor-model-parallel-size 4",
        ),
        (
            dict(hidden_size=48, num_attention_heads=6, num_query_groups=3, tensor_model_parallel_size=2),
            2,
            "--num-query-groups 3 and --tensor-model-parallel-size 2: one must divide the other",
        ),
        (
            dict(ffn_hidden_size=30, tensor_model_parallel_size=4),
            4,
            "--ffn-hidden-size 30 is not divisible by --tensor-model-parallel-size 4",
        ),
        (dict(sequence_parallel=True), 1, "--sequence-parallel needs --tensor-model-parallel-size above 1"),
        (
            dict(loss_scale=1024.0),
            1,
            "--loss-scale applies to fp16 training only (this run is fp32); add --fp16 or drop it",
        ),
        (
            dict(precision="fp16", min_loss_scale=8.0, initial_loss_scale=4.0),
            1,
            "--min-loss-scale 8 exceeds --initial-loss-scale 4",
        ),
        (dict(precision="fp16", loss_scale_window=0), 1, "--loss-scale-window 0: must be at least 1"),
        (dict(precision="fp16", hysteresis=0), 1, "--hysteresis 0: must be at least 1"),
        (dict(keep_last=0), 1, "--keep-last 0: must be at least 1"),
        (dict(exit_interval=0), 1, "--exit-interval 0: must be at least 1"),
        (
            dict(sequence_parallel=True, tensor_model_parallel_size=4, seq_length=30),
            4,
            "--seq-length 30 is not divisible by --tensor-model-parallel-size 4, which --sequence-parallel needs",
        ),
        (
            dict(num_layers=3, pipeline_model_parallel_size=2),
            2,
            "--num-layers 3 with --pipeline-model-parallel-size 2: 3 layers do not split evenly into 2 stages",
        ),
        (
            dict(num_layers=8, pipeline_model_parallel_size=4, decoder_first_pipeline_num_layers=3),
            4,
            "the 5 layers left by the end stages do not split evenly into 3 stages",
        ),
        (
            dict(
                num_layers=4,
                pipeline_model_parallel_size=2,
                decoder_first_pipeline_num_layers=3,
                decoder_last_pipeline_num_layers=3,
            ),
            2,
            "the first and last stage take 6 layers, not 4",
        ),
        (
            dict(num_layers=8, pipeline_model_parallel_size=2, num_layers_per_virtual_pipeline_stage=3),
            2,
            "--num-layers-per-virtual-pipeline-stage 3 does not divide --num-layers 8",
        ),
        (
            dict(
                num_layers=8,
                pipeline_model_parallel_size=2,
                num_layers_per_virtual_pipeline_stage=2,
                virtual_pipeline_model_parallel_size=3,
            ),
            2,
            "disagrees with",
        ),
        (
            dict(
                num_layers=8,
                pipeline_model_parallel_size=2,
                num_layers_per_virtual_pipeline_stage=2,
                pipeline_schedule="zb-h1",
            ),
            2,
            "--pipeline-schedule zb-h1 runs one chunk per rank",
        ),
        (
            dict(num_layers=8, pipeline_model_parallel_size=2, pipeline_schedule="interleaved"),
            2,
            "--pipeline-schedule interleaved needs virtual stages",
        ),
        (
            dict(num_layers=8, virtual_pipeline_model_parallel_size=2),
            1,
            "virtual pipeline stages need --pipeline-model-parallel-size above 1",
        ),
        (
            dict(
                num_layers=8,
                pipeline_model_parallel_size=4,
                virtual_pipeline_model_parallel_size=2,
                global_batch_size=6,
                micro_batch_size=1,
            ),
            4,
            "--global-batch-size 6: the interleaved schedule needs a number of micro-batches (6) divisible by the "
            "pipeline size (4)",
        ),
        (
            dict(
                num_layers=8,
                pipeline_model_parallel_size=2,
                virtual_pipeline_model_parallel_size=2,
                decoder_first_pipeline_num_layers=2,
            ),
            2,
            "cannot be combined with virtual pipeline stages",
        ),
        (
            dict(
                num_layers=8,
                pipeline_model_parallel_size=2,
                pipeline_schedule="zb-v",
                num_layers_per_virtual_pipeline_stage=1,
            ),
            2,
            "--pipeline-schedule zb-v places two chunks per rank itself",
        ),
        (
            dict(num_layers=6, pipeline_model_parallel_size=2, pipeline_schedule="zb-v"),
            2,
            "--num-layers 6 with --pipeline-model-parallel-size 2 x 2 virtual stages: 6 layers do not split evenly "
            "into 4 stages",
        ),
        (
            dict(recompute_granularity="full"),
            1,
            "--recompute-granularity full needs --recompute-method uniform or block",
        ),
        (
            dict(recompute_method="uniform"),
            1,
            "--recompute-method and --recompute-num-layers apply to --recompute-granularity full",
        ),
        (
            dict(recompute_granularity="full", recompute_method="block"),
            1,
            "--recompute-method block needs --recompute-num-layers",
        ),
        (
            dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=0),
            1,
            "--recompute-num-layers 0: must be at least 1",
        ),
        (
            dict(global_batch_size=12, micro_batch_size=4),
            2,
            "--global-batch-size 12 is not divisible by --micro-batch-size 4 x data-parallel size 2; use a "
            "multiple of 8",
        ),
        (
            dict(seq_length=2048, max_position_embeddings=1024),
            1,
            "--seq-length 2048 exceeds --max-position-embeddings 1024",
        ),
        (dict(hidden_size=0), 1, "--hidden-size 0: must be at least 1"),
        (dict(micro_batch_size=-2), 1, "--micro-batch-size -2: must be at least 1"),
        (dict(lr=-1.0), 1, "--lr -1.0: must be zero or more"),
        (dict(hidden_dropout=1.5), 1, "--hidden-dropout 1.5: must be in [0, 1)"),
        (
            dict(num_attention_heads=4, num_query_groups=3),
            1,
            "--num-attention-heads 4 is not a multiple of --num-query-groups 3",
        ),
        (
            dict(hidden_size=50, num_attention_heads=4),
            1,
            "--hidden-size 50 is not divisible by --num-attention-heads 4",
        ),
        (
            dict(mock_data=False),
            1,
            "give exactly one of --data-path, --train-data-path (with --valid-data-path), --corpus stdlib or "
            "--mock-data (got none)",
        ),
        (dict(mock_data=True, corpus="stdlib"), 1, "(got --mock-data and --corpus)"),
        (
            dict(mock_data=False, data_path=["/no/such/corpus"]),
            1,
            "--data-path /no/such/corpus: neither a dataset prefix",
        ),
        (dict(load="/no/such/ckpt"), 1, "--load /no/such/ckpt: no such checkpoint directory"),
        (dict(lr_warmup_iters=200, train_iters=100), 1, "--lr-warmup-iters 200 exceeds the decay length 100"),
        (dict(min_lr=0.1, lr=0.01), 1, "--min-lr 0.1 exceeds --lr 0.01"),
        (
            dict(overlap_param_gather=True),
            2,
            "--overlap-param-gather needs the distributed optimizer: add --use-distributed-optimizer",
        ),
        (dict(ddp_bucket_size=0), 2, "--ddp-bucket-size 0: must be at least 1"),
        (
            dict(num_layers=8, pipeline_model_parallel_size=2, pipeline_schedule="zb-h1", zero_stage=3),
            4,
            "--zero-stage 3 does not combine with --pipeline-schedule zb-h1",
        ),
        (dict(split="a,b"), 1, "--split 'a,b': expected up to three non-negative numbers"),
    ],
)
def test_validation_messages(overrides, world, message):
    config = base(**overrides)
    with pytest.raises(ConfigError) as error:
        validate(config, world)  # the settings
        check_inputs(config)  # and the files they name
    assert message in str(error.value)
    assert "\n" not in str(error.value)


def test_a_consistent_config_passes():
    validate(base(global_batch_size=16, micro_batch_size=4), 4)


def test_megatron_dict_form_and_get_args():
    overrides = from_megatron_dict(
        {
            "tensor_model_parallel_size": 1,
            "pipeline_model_parallel_size": 1,
            "micro_batch_size": 2,
            "global_batch_size": 8,
            "use_fp16": True,
            "optimizer": "sgd",
            "lr": 0.05,
            "train_iters": 33,
        }
    )
    assert overrides["precision"] == "fp16"
    args = paratron.initialize_megatron(
        {
            "micro_batch_size": 2,
            "global_batch_size": 8,
            "use_fp16": True,
            "optimizer": "sgd",
            "lr": 0.05,
            "train_iters": 33,
        },
        args_defaults={"lr": 0.1, "num_layers": 3},
    )
    assert paratron.get_args() is args
    assert (args.micro_batch_size, args.global_batch_size, args.optimizer, args.lr, args.train_iters) == (
        2,
        8,
        "sgd",
        0.05,
        33,
    )
    assert args.num_layers == 3 and args.fp16 and not args.bf16
    assert args.data_parallel_size == 1 and args.tensor_model_parallel_size == 1
    assert args.config.training.precision == "fp16"
    assert args.use_distributed_optimizer is False and args.zero_stage == 0
    with pytest.raises(ConfigError, match="--fp8-amax-history-len: Megatron-LM's flag is not supported: paratron's"):
        from_megatron_dict({"fp8_amax_history_len": 1024})
    assert from_megatron_dict({"fp8_format": "hybrid", "fp8_recipe": "rowwise"}) == {
        "fp8_format": "hybrid",
        "fp8_recipe": "rowwise",
    }
    assert from_megatron_dict({"transformer_impl": "local", "data_parallel_sharding_strategy": "optim"}) == {
        "zero_stage": 1
    }
    assert from_megatron_dict({"use_distributed_optimizer": True, "overlap_grad_reduce": True}) == {
        "use_distributed_optimizer": True,
        "overlap_grad_reduce": True,
    }
    with pytest.raises(ConfigError, match="hidden_sise: unknown setting"):
        from_megatron_dict({"hidden_sise": 3})


def test_flags_reference_is_up_to_date():
    from pathlib import Path

    from paratron.config.arguments import markdown_reference

    path = Path(__file__).resolve().parents[2] / "docs" / "flags.md"
    assert path.read_text(encoding="utf-8") == markdown_reference(), "docs/flags.md is stale: run `make docs`"


def test_worker_errors_are_left_for_the_launcher_except_on_rank_0(tmp_path, monkeypatch, capsys):
    from paratron.distributed.launch import ERROR_DIR_ENV, report_worker_error

    monkeypatch.setenv(ERROR_DIR_ENV, str(tmp_path))
    monkeypatch.setenv("RANK", "3")
    report_worker_error("bad file")
    assert (tmp_path / "rank000003.txt").read_text() == "bad file" and capsys.readouterr().err == ""
    monkeypatch.setenv("RANK", "0")
    report_worker_error("bad file")
    assert capsys.readouterr().err == "error: bad file\n"


def test_each_megatron_flag_has_one_treatment():
    from paratron.config.fields import all_fields
    from paratron.config.megatron import ACCEPTED, MAPPED, REFUSED, SWITCHES

    settings = {name.replace("_", "-") for name in all_fields()}
    switches = {name.replace("_", "-") for name in (*SWITCHES, *MAPPED)}
    groups = [settings, switches, set(ACCEPTED), set(REFUSED)]
    for i, one in enumerate(groups):
        for other in groups[i + 1 :]:
            assert not one & other, sorted(one & other)


@pytest.mark.parametrize(
    "settings, expected",
    [
        (dict(num_experts=4, moe_router_topk=5), "--moe-router-topk 5: must be between 1 and --num-experts 4"),
        (dict(num_experts=4, moe_expert_capacity_factor=0.0), "--moe-expert-capacity-factor 0: must be positive"),
        (dict(moe_router_topk=1), "--moe-router-topk: a mixture-of-experts setting needs --num-experts"),
        (dict(num_experts=4, moe_layer_freq="[1,0,1]"), "--moe-layer-freq [1,0,1]: give a positive integer or a list"),
        (
            dict(num_experts=6, expert_model_parallel_size=4, nproc_per_node=4),
            "--num-experts 6 is not divisible by --expert-model-parallel-size 4",
        ),
        (
            dict(num_experts=4, expert_model_parallel_size=4, tensor_model_parallel_size=2, nproc_per_node=4),
            "--expert-model-parallel-size 4 x expert tensor-parallel size 2 = 8 does not divide the 4 ranks of a "
            "pipeline stage (TP 2 x CP 1 x DP 2)",
        ),
        (dict(expert_model_parallel_size=2, nproc_per_node=2), "needs a mixture-of-experts model: add --num-experts"),
        (
            dict(num_experts=4, expert_tensor_parallel_size=3, tensor_model_parallel_size=2, nproc_per_node=2),
            "--expert-tensor-parallel-size 3 does not divide the 2 ranks of a pipeline stage (TP 2 x CP 1 x DP 1)",
        ),
        (
            dict(num_experts=4, moe_grouped_gemm=True, moe_ffn_hidden_size=50),
            "--moe-grouped-gemm: torch's grouped matmul needs rows of a multiple of 16 bytes, and the experts' "
            "width per tensor-parallel rank 50 is not a multiple of 4 in fp32",
        ),
        (dict(num_experts=4, moe_pad_expert_input_to_capacity=True), "needs --moe-expert-capacity-factor"),
    ],
)
def test_bad_expert_settings_are_named(settings, expected):
    config = build_config(dict(mock_data=True, **settings), recipe="debug")
    with pytest.raises(ConfigError, match=re.escape(expected)):
        validate(config, config.parallel.nproc_per_node)


@pytest.mark.parametrize(
    "settings",
    [
        dict(num_experts=4, expert_model_parallel_size=4, expert_tensor_parallel_size=1, tensor_model_parallel_size=2),
        dict(num_experts=4, expert_model_parallel_size=2, expert_tensor_parallel_size=4, tensor_model_parallel_size=2),
        dict(
            num_experts=4, expert_model_parallel_size=4, expert_tensor_parallel_size=1, pipeline_model_parallel_size=2
        ),
        dict(expert_tensor_parallel_size=2, tensor_model_parallel_size=4),  # (a dense model: as Megatron-LM, no effect)
    ],
)
def test_folded_expert_layouts_validate(settings):
    config = build_config(dict(mock_data=True, nproc_per_node=8, **settings), recipe="debug")
    layout = validate(config, 8)
    assert layout.tp * layout.cp * layout.dp * layout.pp == 8


@pytest.mark.parametrize(
    "settings, expected",
    [
        (
            dict(context_parallel_size=2, seq_length=90, nproc_per_node=2),
            "--seq-length 90 is not divisible by 2 x --context-parallel-size 2 = 4 (each rank holds two of 4 chunks)",
        ),
        (
            dict(context_parallel_size=4, nproc_per_node=6),
            "world size 6 is not divisible by --tensor-model-parallel-size 1 x --context-parallel-size 4 x "
            "--pipeline-model-parallel-size 1; use a multiple of 4 processes",
        ),
        (dict(context_parallel_size=0), "--context-parallel-size 0: must be at least 1"),
        (
            dict(attention_type="sliding-window", window_size=512),
            "--window-size 512 exceeds --max-position-embeddings 256: no sequence is longer than the window",
        ),
        (dict(attention_type="sliding-window"), "--attention-type sliding-window needs --window-size W"),
        (dict(window_size=16), "--window-size applies to --attention-type sliding-window (this run's is causal)"),
        (
            dict(context_parallel_size=2, attention_dropout=0.1, nproc_per_node=2),
            "--context-parallel-size 2 does not serve --attention-dropout 0.1 yet; set it to 0",
        ),
        (
            dict(context_parallel_size=2, zero_stage=3, nproc_per_node=2),
            "--context-parallel-size 2 does not serve --zero-stage 3 yet; use --zero-stage 1 or 2",
        ),
        (
            dict(context_parallel_size=2, num_experts=4, moe_expert_capacity_factor=1.0, nproc_per_node=2),
            "--context-parallel-size 2 does not serve --moe-expert-capacity-factor 1.0 yet; leave it unset for "
            "dropless experts",
        ),
        (dict(attention_type="strided"), "--attention-type: 'strided' is not one of"),
        (
            dict(attention_type="document"),
            "--attention-type document reads the documents of each sample, and --mock-data has none",
        ),
    ],
)
def test_bad_attention_and_context_parallel_settings_are_named(settings, expected):
    with pytest.raises(ConfigError, match=re.escape(expected)):
        config = build_config(dict(mock_data=True, **settings), recipe="debug")
        validate(config, config.parallel.nproc_per_node)


def test_overlap_param_gather_is_accepted_at_zero_stage_3():
    """(FSDP2 gathers the next block's parameters ahead at stage 3: the flag changes nothing there)"""
    settings = dict(mock_data=True, overlap_param_gather=True, zero_stage=3, nproc_per_node=2)
    config = build_config(settings, recipe="debug")
    assert validate(config, 2).dp == 2
