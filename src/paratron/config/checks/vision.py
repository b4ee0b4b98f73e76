"""Consistency checks of a vision-language model's settings and its layout (part of `config.validation`).

Each failure is one line naming the setting and the fix. What is refused, and why:
- context parallelism: a row's image features would have to be cut with the row, and no encoder layout
  for it exists here;
- encoder heads that tensor parallelism cannot split evenly (named with the divisors that work).
"""

from __future__ import annotations

from paratron.config.fields import flag
from paratron.config.layout import Layout
from paratron.config.schema import Config, ModelConfig
from paratron.config.vision import SHAPE, VISION_MODELS
from paratron.errors import ConfigError


def check_vision_model(m: ModelConfig, seq_length: int) -> None:
    """The encoder is named or fully described, its image is whole patches, its feature layer exists, and one
    image's tokens fit a sequence."""
    if not m.has_vision:
        return
    if m.vision_model is not None and m.vision_model not in VISION_MODELS:
        raise ConfigError(f"{flag.vision_model} {m.vision_model!r}: unknown; choose one of {', '.join(VISION_MODELS)}")
    missing = [getattr(flag, name) for name in SHAPE if getattr(m, name) is None]
    if missing:
        raise ConfigError(
            f"an encoder of one's own needs {', '.join(missing)} too (or name one with {flag.vision_model})"
        )
    if m.img_h % m.patch_dim or m.img_w % m.patch_dim:
        raise ConfigError(
            f"{flag.img_h} {m.img_h} x {flag.img_w} {m.img_w} is not whole patches of {flag.patch_dim} {m.patch_dim}; "
            "use sides that are multiples of the patch side"
        )
    if m.vision_hidden_size % m.vision_num_attention_heads:
        raise ConfigError(
            f"{flag.vision_hidden_size} {m.vision_hidden_size} is not divisible by {flag.vision_num_attention_heads} "
            f"{m.vision_num_attention_heads}; change one of them"
        )
    if not -m.vision_num_layers - 1 <= m.vision_feature_layer <= m.vision_num_layers:
        raise ConfigError(
            f"{flag.vision_feature_layer} {m.vision_feature_layer}: the encoder has {m.vision_num_layers} layers; use "
            f"a layer from {-m.vision_num_layers - 1} to {m.vision_num_layers} (-2: the one before the last)"
        )
    if m.image_tokens >= seq_length:
        raise ConfigError(
            f"one image is {m.image_tokens} tokens, which leaves no room in {flag.seq_length} {seq_length}; "
            "raise the sequence length or use a smaller image or larger patches"
        )
    if m.image_token_id is not None and m.vocab_size is not None and not 0 <= m.image_token_id < m.vocab_size:
        raise ConfigError(
            f"{flag.image_token_id} {m.image_token_id} is outside the vocabulary of {m.vocab_size} tokens; "
            "use the tokenizer's image token"
        )


def check_added_image_token(config: Config) -> None:
    """--add-image-token gives a tokenizer the image token of a vision model: it needs both, and a token of its own."""
    m = config.model
    if not m.add_image_token:
        return
    if not m.has_vision:
        raise ConfigError(
            f"{flag.add_image_token} adds the image token of a vision-language model; add {flag.vision_model} NAME "
            "or leave it out"
        )
    if config.data.mock_data:
        raise ConfigError(
            f"{flag.add_image_token} adds a token to a tokenizer, and {flag.mock_data} has none (its image token is "
            "the last id of the vocabulary); leave it out"
        )


def check_vision_layout(config: Config, layout: Layout) -> None:
    """What the parallel layout asks of the encoder."""
    m = config.model
    if not m.has_vision:
        return
    if layout.cp > 1:
        raise ConfigError(
            f"{flag.context_parallel_size} {layout.cp} with a vision model is not supported (an image's features "
            "would be cut with the rows); use tensor or pipeline parallelism for long sequences"
        )
    heads = m.vision_num_attention_heads
    if heads % layout.tp:
        splits = [t for t in range(1, heads + 1) if heads % t == 0]
        raise ConfigError(
            f"{flag.tensor_model_parallel_size} {layout.tp} does not divide the encoder's "
            f"{flag.vision_num_attention_heads} {heads}; use a tensor-parallel size of {', '.join(map(str, splits))}"
        )
    if m.vision_ffn_hidden_size % layout.tp:
        raise ConfigError(
            f"{flag.tensor_model_parallel_size} {layout.tp} does not divide {flag.vision_ffn_hidden_size} "
            f"{m.vision_ffn_hidden_size}; use a tensor-parallel size that divides it"
        )
