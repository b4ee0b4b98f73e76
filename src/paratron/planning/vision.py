"""The work of a vision-language model's image side for the cost model: a micro-batch's images through the
vision encoder and the projector, which run on the first pipeline stage before its language-model layers.

Forward FLOPs only, as `layers.layer_work` counts a layer's; `operations` prices their backward and
communication and `candidates` weighs them when it balances the pipeline's stages. The training FLOPs of one
image (for MFU) are `training.flops.vision_flops_per_image`.
"""

from __future__ import annotations

from dataclasses import dataclass

from paratron.config.schema import Config


@dataclass(frozen=True)
class VisionWork:
    """Forward FLOPs of a micro-batch's images through the vision encoder and projector on one rank."""

    linear: float
    """One encoder layer's matmuls with weights (attention projections and MLP), / TP."""
    scores: float
    """One encoder layer's attention scores and their product with the values (every token of an image), / TP."""
    patches: float
    """The patch embedding (whole on every TP rank; its input, the pixels, takes no gradient)."""
    projector_in: float
    """The projector's first matmul (whole; it takes an input gradient only when the encoder trains)."""
    projector_out: float
    """The mlp projector's second matmul (whole)."""
    activation: float
    """Elements of a layer's activations (images x tokens x width), which its TP all-reduces move."""

    def forward(self, layers: int) -> float:
        """The whole forward with `layers` encoder layers."""
        return layers * (self.linear + self.scores) + self.patches + self.projector_in + self.projector_out


def images_per_micro_batch(config: Config, micro_batch: int) -> int:
    """Images `micro_batch` samples run through the encoder (--plan-images-per-sample per sample)."""
    return micro_batch * config.planning.plan_images_per_sample


def vision_work(config: Config, tp: int, images: int) -> VisionWork:
    """The encoder's and projector's forward work for `images` images on one of `tp` tensor-parallel ranks."""
    m = config.model
    width, lm = m.vision_hidden_size, m.hidden_size
    per_image = m.num_patches + int(m.class_token)
    tokens = images * per_image
    features = images * m.image_tokens
    return VisionWork(
        linear=2 * tokens * (4 * width * width + 2 * width * m.vision_ffn_hidden_size) / tp,
        scores=4 * tokens * per_image * width / tp,
        patches=2 * images * m.num_patches * 3 * m.patch_dim**2 * width,
        projector_in=2 * features * width * lm,
        projector_out=2 * features * lm * lm if m.vision_projection == "mlp" else 0.0,
        activation=tokens * width,
    )
