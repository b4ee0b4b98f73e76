"""The image side of a vision-language model (LLaVA's design): a ViT encoder, a projector into the language model's
width, and the merge of the image features into the token embeddings.

Read top to bottom: the encoder's layer settings (its layers are the language model's `TransformerBlock`, so
tensor parallelism and recomputation treat them as they treat the language model's), the patch embedding, the
encoder, the projector, and `VisionModel`, which the GPT model holds as `vision` and calls from `embed`.

Each image becomes `config.image_tokens` features that take, in order, the places of the image placeholder tokens
(`config.image_token_id`) of the micro-batch: one placeholder per feature, the images in the order their
placeholders appear, row after row (Hugging Face's expanded form). Nothing here knows about parallelism.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from paratron.config.schema import ModelConfig
from paratron.model.transformer import TransformerBlock, TransformerLayers


def encoder_layer_config(config: ModelConfig) -> ModelConfig:
    """The settings of the encoder's layers as a block config: LayerNorm, biases, no positions in the layers
    (the patch embedding adds them), attention that sees the whole image, no dropout."""
    clip = config.vision_type == "clip"
    return ModelConfig(
        num_layers=config.vision_num_layers,
        hidden_size=config.vision_hidden_size,
        ffn_hidden_size=config.vision_ffn_hidden_size,
        num_attention_heads=config.vision_num_attention_heads,
        normalization="LayerNorm",
        norm_epsilon=config.vision_norm_epsilon,
        activation="quick_gelu" if clip else "gelu",
        openai_gelu=not clip,  # (SigLIP's tanh approximation)
        add_bias_linear=True,
        position_embedding_type="none",
        attention_type="bidirectional",
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=config.init_method_std,
    )


class PoolingHead(nn.Module):
    """SigLIP's attention-pooling head: its weights are carried so that a converted encoder converts back whole;
    LLaVA reads patch features, so it never runs (and never trains)."""

    def __init__(self, hidden: int, heads: int, ffn: int, eps: float) -> None:
        super().__init__()
        self.probe = nn.Parameter(torch.empty(1, 1, hidden))
        self.attention = nn.MultiheadAttention(hidden, heads, batch_first=True)
        self.norm = nn.LayerNorm(hidden, eps=eps)
        self.fc1 = nn.Linear(hidden, ffn)
        self.fc2 = nn.Linear(ffn, hidden)


class VisionEncoder(nn.Module):
    """A ViT: patches (+ CLIP's class token) and learned positions, (CLIP's) norm, the layers up to the feature
    layer. The layers after it, the final norm and SigLIP's pooling head are kept for conversion only."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        hidden, patch = config.vision_hidden_size, config.patch_dim
        self.class_token = config.class_token
        self.drop_first = config.vision_feature_select == "default"
        self.run_layers = config.vision_run_layers
        self.patch_embedding = nn.Conv2d(3, hidden, patch, stride=patch, bias=not self.class_token)
        self.class_embedding = nn.Parameter(torch.empty(hidden)) if self.class_token else None
        self.position_embedding = nn.Embedding(config.num_patches + int(self.class_token), hidden)
        eps = config.vision_norm_epsilon
        self.pre_norm = nn.LayerNorm(hidden, eps=eps) if self.class_token else None
        block = encoder_layer_config(config)
        self.layers = TransformerLayers(TransformerBlock(block) for _ in range(config.vision_num_layers))
        self.post_norm = nn.LayerNorm(hidden, eps=eps)
        heads, ffn = config.vision_num_attention_heads, config.vision_ffn_hidden_size
        self.head = PoolingHead(hidden, heads, ffn, eps) if config.vision_pooling_head else None

    def carried(self) -> list[nn.Parameter]:
        """The weights that never run: layers past the feature layer, the final norm, the pooling head."""
        unused = [*self.layers[self.run_layers :], self.post_norm, *([self.head] if self.head is not None else [])]
        return [p for module in unused if module is not None for p in module.parameters()]

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        """Images [N, 3, H, W] -> their features [N, image tokens, encoder width] at the feature layer."""
        weight = self.patch_embedding.weight
        x = self.patch_embedding(pixels.to(weight.dtype)).flatten(2).transpose(1, 2)  # [N, patches, width]
        if self.class_embedding is not None:
            x = torch.cat((self.class_embedding.expand(x.size(0), 1, -1), x), dim=1)
        x = x + self.position_embedding.weight
        if self.pre_norm is not None:
            x = self.pre_norm(x)
        x = self.layers(x, range(self.run_layers))
        return x[:, 1:] if self.drop_first else x


class Projector(nn.Module):
    """From the encoder's width to the language model's: Linear-GELU-Linear (mlp, LLaVA-1.5's) or one Linear."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        bias, width = config.vision_projection_bias, config.hidden_size
        self.linear_1 = nn.Linear(config.vision_hidden_size, width, bias=bias)
        self.linear_2 = nn.Linear(width, width, bias=bias) if config.vision_projection == "mlp" else None

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        x = self.linear_1(features)
        return x if self.linear_2 is None else self.linear_2(F.gelu(x))


class VisionModel(nn.Module):
    """The encoder and projector; `forward` puts the images' features in the places of their placeholders."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.encoder = VisionEncoder(config)
        self.projector = Projector(config)
        self.image_shape = (3, config.img_h, config.img_w)
        self.image_token_id = config.placeholder_id

    def features(self, images: torch.Tensor) -> torch.Tensor:
        """Images [N, 3, H, W] -> [N, image tokens, language model width]."""
        return self.projector(self.encoder(images))

    def forward(self, embeddings: torch.Tensor, input_ids: torch.Tensor, images: torch.Tensor | None) -> torch.Tensor:
        """`embeddings` [B, T, width] of `input_ids` [B, T] with each placeholder's embedding replaced by its image
        feature. A micro-batch without images runs one blank image whose features count zero times: the encoder
        and projector then have gradients (zero) on every rank, so no reduction waits for them."""
        if images is None or images.size(0) == 0:
            if not torch.is_grad_enabled():  # (evaluation, generation: no gradient to wait for)
                return embeddings
            blank = embeddings.new_zeros((1, *self.image_shape))
            return embeddings + 0.0 * self.features(blank).sum()
        features = self.features(images)
        places = input_ids == self.image_token_id
        if int(places.sum()) != features.size(0) * features.size(1):  # (the data checks this; a model call may not)
            raise ValueError(
                f"{int(places.sum())} image placeholders for {features.size(0)} images of {features.size(1)} tokens"
            )
        return embeddings.masked_scatter(places.unsqueeze(-1), features.to(embeddings.dtype))
