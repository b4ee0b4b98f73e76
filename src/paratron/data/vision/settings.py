"""A run's image settings from its configuration: the pixel preprocessing, the tiling and the image token.

The image token is what the files declare: --image-token-id, else the tokenizer's `<image>` token; a tokenizer
without one is refused by name for image-text files, naming --add-image-token, which gives it one (mock data,
which has no tokenizer, uses the last id of the vocabulary, as the model does).
"""

from __future__ import annotations

from pathlib import Path

from tokenizers import AddedToken
from tokenizers import Tokenizer as HFTokenizer

from paratron.config.fields import flag
from paratron.config.schema import Config
from paratron.data.tokenizer import AnyTokenizer, Tokenizer
from paratron.data.vision.images import ImageSettings
from paratron.data.vision.llava import PLACEHOLDER
from paratron.data.vision.processor import ImageProcessor, settings_file
from paratron.data.vision.tiling import ImageTiling
from paratron.errors import ConfigError, DataError


def image_token_id(config: Config, tokenizer: Tokenizer) -> int:
    """The image placeholder's id: --image-token-id, else the tokenizer's `<image>`."""
    if config.model.image_token_id is not None:
        return config.model.image_token_id
    found = tokenizer.hf.token_to_id(PLACEHOLDER)
    if found is None:
        raise DataError(
            f"the tokenizer ({tokenizer.source or 'the run'}'s) has no {PLACEHOLDER} token for images; add "
            f"{flag.add_image_token} (it adds one and grows the vocabulary by it), or name an existing token's id "
            f"with {flag.image_token_id}"
        )
    return int(found)


def with_image_token(tokenizer: AnyTokenizer) -> Tokenizer:
    """--add-image-token: `tokenizer` with `<image>` as a new special token (the next id), or as it is where it
    has one; a copy, so that the tokenizer a checkpoint was read with stays as it was."""
    if not isinstance(tokenizer, Tokenizer):
        raise DataError(
            f"{flag.add_image_token} adds {PLACEHOLDER} to a tokenizer.json tokenizer, and this run's is "
            f"{type(tokenizer).__name__}; name an existing token's id with {flag.image_token_id} instead"
        )
    if tokenizer.hf.token_to_id(PLACEHOLDER) is not None:
        return tokenizer
    hf = HFTokenizer.from_str(tokenizer.hf.to_str())
    hf.add_special_tokens([AddedToken(PLACEHOLDER, special=True, normalized=False)])
    return Tokenizer(hf, tokenizer.source, tokenizer.special)


def image_processor(config: Config, tokenizer: Tokenizer) -> ImageProcessor:
    """--image-processor's file, else the processor settings beside the tokenizer's file (a Hugging Face
    folder's processor_config.json or preprocessor_config.json, kept in the checkpoints made from it), else the
    encoder family's defaults at its image size."""
    d, m = config.data, config.model
    given = d.image_processor
    beside = settings_file(Path(tokenizer.source).parent) if tokenizer.source else None
    if given is None and beside is not None:
        given = str(beside)
    if given is not None:
        processor = ImageProcessor.from_file(Path(given))
        if processor.output_size != (m.img_h, m.img_w):
            raise ConfigError(
                f"{flag.image_processor} {given}: makes {processor.output_size[0]}x{processor.output_size[1]} images, "
                f"but the encoder takes {m.img_h}x{m.img_w}; give the encoder's own with {flag.image_processor}"
            )
        return processor
    if m.img_h != m.img_w:
        raise ConfigError(
            f"{flag.img_h} {m.img_h} and {flag.img_w} {m.img_w} differ: give the encoder's preprocessing with "
            f"{flag.image_processor}"
        )
    return ImageProcessor.clip(m.img_h) if m.vision_type == "clip" else ImageProcessor.siglip(m.img_h)


def image_settings(config: Config, tokenizer: Tokenizer) -> ImageSettings:
    """How the run's images become placeholders and pixels."""
    d = config.data
    tiling = ImageTiling(d.max_num_tiles, d.use_thumbnail) if d.use_tiling else None
    token = image_token_id(config, tokenizer)
    return ImageSettings(image_processor(config, tokenizer), token, config.model.image_tokens, tiling)
