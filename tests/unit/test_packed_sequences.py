"""Packed sequences: positions restarting per segment, attention within a segment, masked labels.

The references: the same conversations run one at a time (packing must not change a single
logit), and megatron-core's `_get_ltor_masks_and_position_ids` for pretraining's
--reset-position-ids / --reset-attention-mask / --eod-mask-loss.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from megatron.core.datasets.gpt_dataset import _get_ltor_masks_and_position_ids

from paratron.config import build_config
from paratron.data.loader import DocumentLayout, pretraining_batch
from paratron.model.attention import Document, TokenPlaces
from paratron.model.batch import IGNORE_INDEX, Batch
from paratron.model.gpt import build_model
from paratron.model.loss import language_model_loss, token_losses

LLAMA = dict(
    position_embedding_type="rope",
    normalization="RMSNorm",
    activation="swiglu",
    add_bias_linear=False,
    num_query_groups=2,
)


@pytest.mark.parametrize("shape", ["llama", "gpt"])
def test_packed_rows_give_each_segment_the_logits_it_has_alone(shape):
    settings = dict(vocab_size=97, hidden_size=32, num_layers=2, num_attention_heads=4, seq_length=24)
    config = build_config({**settings, **(LLAMA if shape == "llama" else {}), "mock_data": True})
    model = build_model(config.model, seed=3).eval()
    lengths = [7, 11, 6]  # three segments filling 24 positions
    ids = torch.randint(0, 97, (1, 24), generator=torch.Generator().manual_seed(0))
    segments = torch.tensor([[i for i, n in enumerate(lengths) for _ in range(n)]])
    positions = torch.tensor([[p for n in lengths for p in range(n)]])
    packed = model(ids, position_ids=positions, segment_ids=segments)
    start = 0
    for n in lengths:
        alone = model(ids[:, start : start + n])
        torch.testing.assert_close(packed[:, start : start + n], alone, rtol=1e-5, atol=1e-5)
        start += n
    # and without the layout the segments do see each other
    assert not torch.allclose(model(ids)[:, 7:18], packed[:, 7:18], atol=1e-3)


def segment_attention_mask(segment_ids: torch.Tensor) -> torch.Tensor:
    """[B, 1, T, T] True where query i may attend to key j: document attention's mask of these segments."""
    length = segment_ids.size(1)
    return TokenPlaces.row(length, segment_ids.device, segments=segment_ids).mask(Document(), length)


def test_segment_mask_is_causal_within_segments():
    mask = segment_attention_mask(torch.tensor([[0, 0, 1, 1, 1]]))[0, 0]
    expected = torch.tensor(
        [
            [1, 0, 0, 0, 0],
            [1, 1, 0, 0, 0],
            [0, 0, 1, 0, 0],
            [0, 0, 1, 1, 0],
            [0, 0, 1, 1, 1],
        ],
        dtype=torch.bool,
    )
    assert torch.equal(mask, expected)


@pytest.mark.parametrize(
    "flags",
    [(True, True, True), (True, False, False), (False, True, False), (False, False, True)],
    ids=["all", "positions", "attention", "eod-loss"],
)
def test_document_layout_matches_megatron_core(flags):
    reset_positions, reset_attention, eod_loss = flags
    eod = 5
    rng = np.random.default_rng(1)
    tokens = rng.integers(0, 5, size=(3, 21))
    tokens[0, [3, 9, 10]] = eod  # two documents end back to back
    tokens[1, [0, 19]] = eod  # a document ending at the first position
    documents = DocumentLayout(eod, reset_positions, reset_attention, eod_loss)
    batch = pretraining_batch(tokens, documents)
    for row in range(3):
        inputs = torch.from_numpy(tokens[row, :-1])
        mask, loss_mask, positions = _get_ltor_masks_and_position_ids(
            inputs.clone(), eod, reset_positions, reset_attention, eod_loss, create_attention_mask=True
        )
        ours_positions = batch.position_ids[row] if batch.position_ids is not None else torch.arange(20)
        assert torch.equal(ours_positions, positions), f"row {row}: positions"
        trained = batch.labels[row] != IGNORE_INDEX
        assert torch.equal(trained, loss_mask.bool()), f"row {row}: loss mask"
        allowed = ~mask[0]  # megatron-core's mask is True where attending is not allowed
        ours = (
            segment_attention_mask(batch.segment_ids[row : row + 1])[0, 0]
            if batch.segment_ids is not None
            else torch.ones(20, 20, dtype=torch.bool).tril()
        )
        assert torch.equal(ours, allowed), f"row {row}: attention"


def test_plain_documents_leave_the_batch_untouched():
    tokens = np.arange(2 * 9).reshape(2, 9)
    batch = pretraining_batch(tokens, DocumentLayout(eod_id=4))
    assert batch.position_ids is None and batch.segment_ids is None
    assert torch.equal(batch.labels, torch.from_numpy(tokens[:, 1:]))


def test_ignored_labels_add_nothing_to_the_loss():
    logits = torch.randn(2, 5, 11, generator=torch.Generator().manual_seed(0))
    labels = torch.tensor([[1, 2, IGNORE_INDEX, 4, 5], [IGNORE_INDEX] * 4 + [3]])
    losses = token_losses(logits, labels)
    trained = labels != IGNORE_INDEX
    assert torch.all(losses[~trained] == 0)
    reference = torch.nn.functional.cross_entropy(logits[trained], labels[trained])
    torch.testing.assert_close(language_model_loss(logits, labels), reference)
    assert Batch(labels, labels).trained_tokens().item() == 5


def test_document_attention_marks_documents_as_reset_attention_mask_does():
    from paratron.config.schema import DataConfig, ModelConfig

    plain = DocumentLayout.of(DataConfig(), ModelConfig(), eod_id=0)
    documents = DocumentLayout.of(DataConfig(), ModelConfig(attention_type="document"), eod_id=0)
    assert plain.plain and plain == DocumentLayout(0)
    assert documents == DocumentLayout.of(DataConfig(reset_attention_mask=True), ModelConfig(), eod_id=0)
    tokens = np.array([[5, 6, 0, 7, 8]])
    assert pretraining_batch(tokens, documents).segment_ids.tolist() == [[0, 0, 0, 1]]
