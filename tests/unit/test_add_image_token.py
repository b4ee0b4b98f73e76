"""--add-image-token: a text checkpoint loaded into a vision-language model whose tokenizer gained `<image>`. The
checkpoint's vocabulary rows load unchanged, the new row (embedding and, untied, output) is the mean of the saved
ones, the vocabulary is padded again to --make-vocab-size-divisible-by x TP (at TP 1 and on each rank of TP 2), and
on text the old tokens' logits are the text model's while the new token's logit is the mean of theirs (the loss
itself changes: the softmax gains a term). The encoder and projector, absent from a text checkpoint, keep their
initialization; without the flag the larger vocabulary is refused naming it."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from tokenizers import AddedToken

from paratron.checkpoint.load import load_model_weights
from paratron.checkpoint.save import CheckpointContent, save_checkpoint
from paratron.checkpoint.verify import read_checkpoint
from paratron.config import build_config
from paratron.config.layout import resolve_layout
from paratron.config.validation import validate
from paratron.data.tokenizer import NullTokenizer, train_byte_level_bpe
from paratron.data.vision.settings import with_image_token
from paratron.distributed.fake import fake_world
from paratron.distributed.topology import ParallelDims, Topology
from paratron.errors import CheckpointError, ConfigError, DataError
from paratron.model.gpt import GPT
from paratron.optim.build import build_optimizer
from paratron.parallel import parallelize
from paratron.parallel.tensor.layers import padded_vocab_size

from tiny import WORDS

VOCAB, HIDDEN = 250, 32
TEXT = dict(
    num_layers=2,
    hidden_size=HIDDEN,
    num_attention_heads=4,
    vocab_size=VOCAB,
    seq_length=16,
    max_position_embeddings=16,
    hidden_dropout=0.0,
    attention_dropout=0.0,
    mock_data=True,
    seed=3,
    make_vocab_size_divisible_by=96,  # (a multiple of 96 at TP 1, of 192 at TP 2: the two differ)
)
VISION = dict(vision_model="debug-vit", add_image_token=True, mock_data=False, vocab_size=VOCAB + 1)


def _model(settings: dict, topology: Topology | None = None):
    config = build_config(settings)
    with torch.device("meta"):
        meta = GPT(config.model)
    topology = topology or Topology(ParallelDims(1))
    return config, parallelize(
        meta, config, topology, torch.device("cpu"), resolve_layout(config, topology.dims.world_size)
    )


def _text_checkpoint(folder: Path, untied: bool) -> tuple[dict[str, torch.Tensor], Path]:
    """A text model with random weights, saved; its single-device weights (the vocabulary's real rows)."""
    settings = dict(TEXT, untie_embeddings_and_output_weights=untied)
    config, model = _model(settings)
    with torch.no_grad():  # (rows far from their mean, so that a wrong row would show)
        for param in model.module.parameters():
            param.add_(torch.randn_like(param) * 0.5)
    save_checkpoint(folder, CheckpointContent(1, 1, config, model.module, build_optimizer(model, config.optimizer)))
    weights = {name: p.detach().clone() for name, p in model.module.named_parameters()}
    return {
        name: w[:VOCAB] if name in ("embedding.weight", "output.weight") else w for name, w in weights.items()
    }, folder


def _vision_settings(untied: bool, **more) -> dict:
    return dict(TEXT, **VISION, untie_embeddings_and_output_weights=untied, **more)


@pytest.mark.parametrize("untied", [False, True], ids=["tied", "untied"])
def test_the_new_row_is_the_mean_and_old_logits_are_kept(tmp_path, untied):
    saved, folder = _text_checkpoint(tmp_path / "text", untied)
    config, model = _model(_vision_settings(untied))
    initial_projector = {n: p.detach().clone() for n, p in model.module.named_parameters() if n.startswith("vision.")}
    load_model_weights(read_checkpoint(folder), model.module, grow=True)
    grown = model.module
    padded = padded_vocab_size(VOCAB + 1, 1, config.model.make_vocab_size_divisible_by)
    assert padded == 288 and grown.embedding.weight.shape == (padded, HIDDEN)
    names = ["embedding.weight"] + (["output.weight"] if untied else [])
    for name in names:
        weight, old = dict(grown.named_parameters())[name].detach(), saved[name]
        assert torch.equal(weight[:VOCAB], old)  # the saved rows, unchanged
        torch.testing.assert_close(weight[VOCAB], old.double().mean(0).float(), rtol=0, atol=1e-7)
        assert torch.count_nonzero(weight[VOCAB + 1 :]) == 0  # padding
    assert grown.tied is not untied
    for name, value in initial_projector.items():  # new parts: as initialized
        assert torch.equal(dict(grown.named_parameters())[name], value), name

    text = torch.tensor([[3, 17, 99, 249, 5, 0, 120, 77]])
    _, plain = _model(dict(TEXT, untie_embeddings_and_output_weights=untied))
    load_model_weights(read_checkpoint(folder), plain.module)
    with torch.no_grad():
        before = plain.module(text)[..., :VOCAB]
        after = grown.eval()(text)[..., : VOCAB + 1]
    torch.testing.assert_close(after[..., :VOCAB], before, rtol=0, atol=1e-5)
    torch.testing.assert_close(after[..., VOCAB], before.double().mean(-1).float(), rtol=0, atol=1e-5)
    # the loss on text: log-softmax gains exp(mean logit); exactly that, not equality, is what holds
    labels = torch.tensor([17, 99, 249, 5, 0, 120, 77, 3])
    loss_before = torch.nn.functional.cross_entropy(before[0].double(), labels)
    loss_after = torch.nn.functional.cross_entropy(after[0].double(), labels)
    gained = torch.log1p(torch.exp(after[0, :, VOCAB].double() - torch.logsumexp(before[0].double(), -1))).mean()
    assert float(loss_after) == pytest.approx(float(loss_before + gained), abs=1e-5)
    assert float(loss_after) > float(loss_before)


def test_each_rank_of_tp2_holds_its_rows_of_the_grown_vocabulary(tmp_path):
    saved, folder = _text_checkpoint(tmp_path / "text", untied=True)
    settings = _vision_settings(True, tensor_model_parallel_size=2)
    padded = padded_vocab_size(VOCAB + 1, 2, 96)
    assert padded == 384  # (a multiple of 96 x 2)
    mean = {name: saved[name].double().mean(0).float() for name in ("embedding.weight", "output.weight")}
    for rank in (0, 1):
        with fake_world(2, rank):
            topology = Topology(ParallelDims(2, tp=2), rank)
            topology.create_groups()
            _, model = _model(settings, topology)
            load_model_weights(read_checkpoint(folder), model.module, grow=True)
            for name in mean:
                local = dict(model.module.named_parameters())[name].detach()
                rows = padded // 2
                assert local.shape == (rows, HIDDEN)
                first = rank * rows
                real = min(first + rows, VOCAB) - first
                assert torch.equal(local[:real], saved[name][first : first + real])
                if rank == 1:
                    new = VOCAB - first
                    torch.testing.assert_close(local[new], mean[name], rtol=0, atol=1e-7)
                    assert torch.count_nonzero(local[new + 1 :]) == 0
            del model


def test_without_the_flag_the_larger_vocabulary_is_refused_naming_it(tmp_path):
    _, folder = _text_checkpoint(tmp_path / "text", untied=False)
    _, model = _model(_vision_settings(False))
    with pytest.raises(CheckpointError) as caught:
        load_model_weights(read_checkpoint(folder), model.module)
    message = str(caught.value)
    assert "embedding.weight has shape [250, 32] there but [251, 32]" in message
    assert "the tokenizer has 1 token(s) more than the checkpoint's vocabulary; add --add-image-token" in message
    _, smaller = _model(dict(TEXT, vocab_size=VOCAB - 1))
    with pytest.raises(CheckpointError, match=r"\[249, 32\] in this model; use the same model settings"):
        load_model_weights(read_checkpoint(folder), smaller.module)


def test_the_tokenizer_gains_image_as_its_next_id_in_a_copy():
    tokenizer = train_byte_level_bpe(iter([" ".join(WORDS)] * 5), 300)
    tokenizer.hf.add_special_tokens([AddedToken("<|im_end|>", special=True)])
    size = tokenizer.vocab_size
    added = with_image_token(tokenizer)
    assert added.vocab_size == size + 1 and added.hf.token_to_id("<image>") == size
    assert tokenizer.vocab_size == size and tokenizer.hf.token_to_id("<image>") is None  # the original as it was
    assert added.encode("alpha <image> beta").count(size) == 1  # one token, never split
    assert added.eod_id == tokenizer.eod_id
    assert with_image_token(added) is added  # has one: nothing to add
    with pytest.raises(DataError, match="adds <image> to a tokenizer.json tokenizer.*; name an existing token's id "):
        with_image_token(NullTokenizer(100))


@pytest.mark.parametrize(
    "settings, message",
    [
        (dict(add_image_token=True), "--add-image-token adds the image token of a vision-language model; add "
         "--vision-model NAME or leave it out"),
        (dict(add_image_token=True, vision_model="debug-vit"), "--add-image-token adds a token to a tokenizer, and "
         "--mock-data has none"),
    ],
    ids=["text-model", "mock-data"],
)  # fmt: skip
def test_the_flag_is_refused_where_it_cannot_add_a_token(settings, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        validate(build_config(dict(TEXT, **settings, seq_length=32, max_position_embeddings=32)), 1)
