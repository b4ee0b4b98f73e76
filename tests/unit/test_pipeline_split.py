"""The embedding and the loss counted as layers when cutting the pipeline
(--account-for-embedding-in-pipeline-split, --account-for-loss-in-pipeline-split): every stage's
layers against megatron-core's own `get_num_layers_to_build` and `get_transformer_layer_offset`, and
the combinations both refuse."""

from __future__ import annotations

import dataclasses
import re
import shlex
import warnings

import pytest
import torch

from paratron.commands.train import train_config
from paratron.config import build_config, validate
from paratron.config.layout import Layout, layer_counts
from paratron.errors import ConfigError
from paratron.planning.hardware import preset
from paratron.planning.published import RUNS, run_config
from paratron.planning.search import plan

with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # (megatron-core warns that Transformer Engine and Apex are missing)
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_config import TransformerConfig
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

# (layers, pipeline ranks, virtual stages per rank or None, embedding counted, loss counted)
ACCEPTED = [
    (8, 2, None, True, True),  # 10 over 2: 4 + 4, the same as the even cut
    (7, 2, None, True, False),  # 3 + 4
    (7, 2, None, False, True),  # 4 + 3
    (13, 2, None, True, False),
    (2, 4, None, True, True),  # the end ranks hold only the embedding / the loss
    (14, 4, None, True, True),
    (15, 4, None, False, True),
    (6, 2, 2, True, True),  # chunks of 1, 2 | 2, 1
    (8, 2, 5, True, True),  # chunks of one layer, the first and last of none
    (6, 4, 2, True, True),
    (11, 4, 3, True, False),
    (10, 4, 3, True, True),
    (126, 16, 8, True, True),  # Llama 3 405B as it ran
    (5, 1, None, True, True),  # one stage: it holds everything whatever is counted
]
REFUSED = [
    (8, 4, None, True, False),  # 9 over 4
    (8, 2, None, True, False),
    (9, 2, None, True, True),
    (7, 2, 3, True, False),  # 8 over 2 ranks, 4 per rank, not over 3 chunks
    (8, 4, 2, True, True),  # 10 over 4
]


def megatron_stages(layers: int, pp: int, virtual: int | None, embedding: bool, loss: bool) -> dict[int, range]:
    """Layer numbers of every model stage (chunk x pp + rank) as megatron-core builds them."""
    config = TransformerConfig(
        num_layers=layers,
        hidden_size=16,
        num_attention_heads=2,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=virtual,
        account_for_embedding_in_pipeline_split=embedding,
        account_for_loss_in_pipeline_split=loss,
        pipeline_dtype=torch.float32,
    )
    stages = {}
    for chunk in range(virtual or 1):
        vp_stage = chunk if virtual else None
        for rank in range(pp):
            offset = get_transformer_layer_offset(config, vp_stage, rank) if pp > 1 else 0
            stages[chunk * pp + rank] = range(offset, offset + get_num_layers_to_build(config, vp_stage, rank))
    return stages


def paratron_layout(layers: int, pp: int, virtual: int | None, embedding: bool, loss: bool, **more) -> Layout:
    config = build_config(
        dict(
            num_layers=layers,
            hidden_size=16,
            num_attention_heads=2,
            vocab_size=64,
            seq_length=16,
            max_position_embeddings=16,
            mock_data=True,
            pipeline_model_parallel_size=pp,
            virtual_pipeline_model_parallel_size=virtual,
            account_for_embedding_in_pipeline_split=embedding,
            account_for_loss_in_pipeline_split=loss,
            micro_batch_size=1,
            global_batch_size=2 * pp,
            **more,
        )
    )
    return validate(config, pp, check_data=False)


@pytest.mark.parametrize("layers, pp, virtual, embedding, loss", ACCEPTED)
def test_stage_layers_are_megatron_cores(layers, pp, virtual, embedding, loss):
    expected = megatron_stages(layers, pp, virtual, embedding, loss)
    plan = paratron_layout(layers, pp, virtual, embedding, loss).pipeline
    assert plan.chunks == (virtual or 1)
    assert dict(enumerate(plan.ranges)) == expected
    assert sum(plan.counts) == layers


@pytest.mark.parametrize("layers, pp, virtual, embedding, loss", REFUSED)
def test_splits_megatron_core_refuses_are_refused(layers, pp, virtual, embedding, loss):
    with pytest.raises(ValueError, match="divisible"):
        megatron_stages(layers, pp, virtual, embedding, loss)
    with pytest.raises(ConfigError, match=r"do not split evenly .*; choose sizes that divide the layer count, or drop"):
        paratron_layout(layers, pp, virtual, embedding, loss)


def test_counted_ends_cannot_be_combined_with_given_end_layers():
    with pytest.raises(ValueError, match="cannot be"):
        TransformerConfig(
            num_layers=8,
            hidden_size=16,
            num_attention_heads=2,
            pipeline_model_parallel_size=2,
            num_layers_in_first_pipeline_stage=3,
            account_for_embedding_in_pipeline_split=True,
            pipeline_dtype=torch.float32,
        )
    message = (
        "--account-for-embedding-in-pipeline-split / --account-for-loss-in-pipeline-split cannot be combined with "
        "--decoder-first-pipeline-num-layers / --decoder-last-pipeline-num-layers (Megatron-LM refuses it too); "
        "drop one"
    )
    with pytest.raises(ConfigError, match=re.escape(message)):
        paratron_layout(7, 2, None, True, False, decoder_first_pipeline_num_layers=3)
    with pytest.raises(ValueError, match="end stages' layer counts cannot be given"):
        layer_counts(7, 2, 3, embedding=True)


def test_layers_per_virtual_stage_count_the_ends_as_megatron_lm_does():
    """Megatron-LM's arguments: chunks = (layers + counted ends) / pp / layers per virtual stage."""
    layout = paratron_layout(6, 2, None, True, True, num_layers_per_virtual_pipeline_stage=2)
    assert layout.pipeline.chunks == 2
    assert layout.pipeline.counts == (1, 2, 2, 1)
    with pytest.raises(ConfigError, match=r"stage 3 does not divide --num-layers 6 \(\+ 2 counted .*divisor of 4"):
        paratron_layout(6, 2, None, True, True, num_layers_per_virtual_pipeline_stage=3)


def test_zb_v_counts_both_ends_on_the_first_rank():
    """ZB-V places the first and the last model stage on rank 0, which then runs two layers fewer."""
    plan = paratron_layout(6, 2, None, True, True, pipeline_schedule="zb-v").pipeline
    assert (plan.chunks, plan.schedule, plan.counts) == (2, "zb-v", (1, 2, 2, 1))


def test_megatron_lms_flags_are_taken():
    argv = ["--num-layers", "126", "--pipeline-model-parallel-size", "16", "--num-virtual-stages-per-pipeline-rank"]
    argv += ["8", "--account-for-embedding-in-pipeline-split", "--account-for-loss-in-pipeline-split"]
    config = train_config(argv)
    assert config.parallel.account_for_embedding_in_pipeline_split
    assert config.parallel.account_for_loss_in_pipeline_split


def test_the_plans_for_llama3_405b_carry_the_flags_and_their_commands_validate():
    """Llama 3 405B's published request (16,384 H100s, 2,048 sequences of 8,192 tokens): 126 layers divide
    into no pipeline size above 2, but 126 + 2 do, so the layouts Llama ran, virtual stages with the embedding
    and the loss counted as layers, are among the plans; each one's command says so and rebuilds its stages."""
    run = next(r for r in RUNS if r.gpus == 16384 and r.seq_length == 8192)
    hardware = dataclasses.replace(preset(run.hardware), nodes=run.gpus // 8)
    plans = plan(run_config(run), run.gpus, hardware)
    counted = [p for p in plans if p.settings["account_for_embedding_in_pipeline_split"]]
    assert counted, [p.describe() for p in plans]
    for found in counted:
        command = found.command()
        assert " --account-for-embedding-in-pipeline-split --account-for-loss-in-pipeline-split " in command
        assert "(embedding/loss counted)" in found.describe()
        layout = validate(train_config(shlex.split(command.split(" train ", 1)[1])), run.gpus, check_data=False)
        counts = layout.pipeline.counts
        assert counts == found.layout.pipeline.counts
        share = (126 + 2) // len(counts)
        assert counts == (share - 1, *[share] * (len(counts) - 2), share - 1)
