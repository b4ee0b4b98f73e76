"""The vision encoder's settings (LLaVA-style models): a ViT and a projector in front of the language model.

`VisionSettings` is a part of `ModelConfig` (it inherits these fields, so they are model settings: flags, the
recipe's model section, a checkpoint's model.yaml). `--vision-model NAME` names an encoder from `VISION_MODELS`,
whose values become the defaults of the shape settings (derived as `ModelConfig`'s other derived settings are);
giving the shape settings without a name describes an encoder of one's own (Megatron-LM's --img-h, --img-w and
--patch-dim where it has names). Without either the model has no encoder.

Two encoder families, as Hugging Face's CLIP and SigLIP vision models compute them:

- `clip`: a class token before the patches, a LayerNorm before the first layer, quick GELU (x sigmoid(1.702 x)),
  no bias in the patch embedding;
- `siglip`: no class token, no norm before the layers, the tanh approximation of GELU, a biased patch embedding
  (and a pooling head, carried for conversion but never run: LLaVA reads a layer's patch features).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from paratron.config.limits import ABOVE_ZERO, DERIVED

VISION_MODELS: dict[str, dict[str, Any]] = {
    "debug-vit": dict(
        vision_type="clip",
        img_h=32,
        img_w=32,
        patch_dim=8,
        vision_num_layers=2,
        vision_hidden_size=32,
        vision_num_attention_heads=4,
        vision_ffn_hidden_size=64,
    ),
    "clip-vit-l-14-336": dict(  # LLaVA-1.5's encoder (openai/clip-vit-large-patch14-336)
        vision_type="clip",
        img_h=336,
        img_w=336,
        patch_dim=14,
        vision_num_layers=24,
        vision_hidden_size=1024,
        vision_num_attention_heads=16,
        vision_ffn_hidden_size=4096,
    ),
    "siglip-so400m-14-384": dict(  # google/siglip-so400m-patch14-384
        vision_type="siglip",
        img_h=384,
        img_w=384,
        patch_dim=14,
        vision_num_layers=27,
        vision_hidden_size=1152,
        vision_num_attention_heads=16,
        vision_ffn_hidden_size=4304,
        vision_pooling_head=True,
    ),
}
"""Named vision encoders (--vision-model): their shape settings."""

SHAPE = ("img_h", "img_w", "patch_dim", "vision_num_layers", "vision_hidden_size", "vision_num_attention_heads")
"""The settings an encoder of one's own must give (its MLP width defaults to 4 x its width)."""


@dataclass(frozen=True)
class VisionSettings:
    """Vision-language models: the image encoder and the projector into the language model."""

    vision_model: str | None = None
    """Named vision encoder (debug-vit, clip-vit-l-14-336, siglip-so400m-14-384) put with a projector in front of the
    language model; its shape is the default of the vision settings below. Without it, giving --vision-num-layers,
    --vision-hidden-size, --vision-num-attention-heads, --img-h, --img-w and --patch-dim describes an encoder of
    one's own."""

    vision_type: Literal["clip", "siglip"] = field(default=None, metadata={DERIVED: True})  # type: ignore[assignment]
    """Encoder family: clip (class token, norm before the layers, quick GELU) or siglip (no class token, tanh GELU)."""

    img_h: int = field(default=None, metadata={**ABOVE_ZERO, DERIVED: True})  # type: ignore[assignment]
    """Image height in pixels the encoder takes."""

    img_w: int = field(default=None, metadata={**ABOVE_ZERO, DERIVED: True})  # type: ignore[assignment]
    """Image width in pixels the encoder takes."""

    patch_dim: int = field(default=None, metadata={**ABOVE_ZERO, DERIVED: True})  # type: ignore[assignment]
    """Side of the square patches the encoder cuts an image into (each patch one token)."""

    vision_num_layers: int = field(default=None, metadata={**ABOVE_ZERO, DERIVED: True})  # type: ignore[assignment]
    """Transformer layers of the vision encoder."""

    vision_hidden_size: int = field(default=None, metadata={**ABOVE_ZERO, DERIVED: True})  # type: ignore[assignment]
    """Width of the vision encoder."""

    vision_num_attention_heads: int = field(  # type: ignore[assignment]
        default=None, metadata={**ABOVE_ZERO, DERIVED: True}
    )
    """Attention heads of the vision encoder."""

    vision_ffn_hidden_size: int = field(  # type: ignore[assignment]
        default=None, metadata={**ABOVE_ZERO, DERIVED: True}
    )
    """Inner width of the vision encoder's MLPs (default 4 x its width)."""

    vision_norm_epsilon: float = field(default=None, metadata={**ABOVE_ZERO, DERIVED: True})  # type: ignore[assignment]
    """Epsilon of the vision encoder's LayerNorms (default: CLIP's 1e-5, SigLIP's 1e-6)."""

    vision_pooling_head: bool = field(default=None, metadata={DERIVED: True})  # type: ignore[assignment]
    """The encoder carries SigLIP's attention-pooling head (kept for conversion; never run)."""

    vision_feature_layer: int = -2
    """Which layer's output feeds the projector: -1 the last, -2 the one before (LLaVA's), 0 the embeddings. Layers
    after it are kept (for conversion) but neither run nor trained."""

    vision_feature_select: Literal["default", "full"] = field(default=None, metadata={DERIVED: True})  # type: ignore[assignment]
    """default: drop the first feature (CLIP's class token), full: keep every feature (default: full for SigLIP)."""

    vision_projection: Literal["mlp", "affine"] = "mlp"
    """Projector from the encoder's width to the language model's: mlp (Linear-GELU-Linear, LLaVA-1.5's) or affine
    (one Linear)."""

    vision_projection_bias: bool = True
    """The projector's linear layers have biases."""

    image_token_id: int | None = None
    """Token id of the image placeholder: each image's features take the places of as many placeholders as the
    encoder yields tokens (default: the tokenizer's image token, else the last id of the vocabulary)."""

    add_image_token: bool = False
    """Give the tokenizer an image token `<image>` (a new special token) where it has none, and grow the embedding
    and output rows of the checkpoint loaded with --finetune to the new vocabulary, each new row the mean of the old
    ones (LLaVA's recipe): a text model's start of a vision-language fine-tune. Nothing is added where the tokenizer
    has `<image>` already or --image-token-id (or the checkpoint) names the image token."""

    freeze_vision_model: bool = False
    """Train neither the vision encoder's weights nor keep optimizer state for them (Megatron-LM's --freeze-ViT)."""

    freeze_language_model: bool = False
    """Train neither the language model's weights nor keep optimizer state for them (Megatron-LM's --freeze-LM);
    with --freeze-vision-model only the projector trains."""

    # ------------------------------------------------------------ what the settings mean

    @property
    def has_vision(self) -> bool:
        """The model has an image encoder (named, or described by its shape settings)."""
        return self.vision_model is not None or self.vision_num_layers is not None

    def _vision_defaults(self) -> dict[str, Any]:
        """The encoder's derived settings: from its registry entry, then the families' defaults."""
        if not self.has_vision:
            return {}
        named = VISION_MODELS.get(self.vision_model or "", {})
        kind = self.vision_type or named.get("vision_type", "clip")
        hidden = self.vision_hidden_size or named.get("vision_hidden_size")
        same_width = named and hidden == named["vision_hidden_size"]
        return {
            **named,
            "vision_type": kind,
            "vision_ffn_hidden_size": named["vision_ffn_hidden_size"] if same_width else 4 * (hidden or 0) or None,
            "vision_norm_epsilon": 1e-5 if kind == "clip" else 1e-6,
            "vision_pooling_head": named.get("vision_pooling_head", False),
            "vision_feature_select": "default" if kind == "clip" else "full",
        }

    @property
    def placeholder_id(self) -> int:
        """The image placeholder's token id (--image-token-id, else the last id of the vocabulary)."""
        if self.image_token_id is not None:
            return self.image_token_id
        vocab = getattr(self, "vocab_size", None)  # (the language model's setting)
        assert vocab is not None, "the vocabulary size is known before a vision model is built"
        return int(vocab) - 1

    @property
    def encoder_trains(self) -> bool:
        """The encoder's weights take gradients: neither --freeze-vision-model nor LoRA (which freezes the encoder and
        trains the projector whole) leaves it frozen."""
        return self.has_vision and not self.freeze_vision_model and getattr(self, "lora_rank", None) is None

    @property
    def class_token(self) -> bool:
        """The encoder puts a class token before the patches (CLIP)."""
        return self.vision_type == "clip"

    @property
    def num_patches(self) -> int:
        return (self.img_h // self.patch_dim) * (self.img_w // self.patch_dim)

    @property
    def vision_run_layers(self) -> int:
        """Encoder layers that run: those up to --vision-feature-layer (hidden state k is layer k's output)."""
        layer = self.vision_feature_layer
        return layer if layer >= 0 else self.vision_num_layers + 1 + layer

    @property
    def image_tokens(self) -> int:
        """Placeholder tokens per image: the features the projector hands the language model."""
        features = self.num_patches + int(self.class_token)
        return features - 1 if self.vision_feature_select == "default" else features
