"""The GPT family (GPT-2/3, Llama, Mistral, Qwen2 shapes) as plain single-device PyTorch.

Read top to bottom: the whole model (its blocks, attention and positions in `model/transformer.py`, its MLP in
`model/mlp.py`, the image side of a vision-language model in `model/vision.py`) and `build_model` (the weights'
initialization lives in `model/init.py`). Nothing here knows about parallelism.
"""

from __future__ import annotations

import torch
from torch import nn

from paratron.config.schema import ModelConfig
from paratron.model.attention import TokenPlaces
from paratron.model.init import init_weights
from paratron.model.lora import add_adapters
from paratron.model.norms import make_norm
from paratron.model.rotary import rotary_tables
from paratron.model.transformer import TransformerLayers, build_layers
from paratron.model.vision import VisionModel


class GPT(nn.Module):
    """Token (+ learned position) embedding, a stack of layers (Transformer blocks, or the residual sublayers of a
    --hybrid-layer-pattern: `model.transformer.build_layers`), a final norm and the output layer.

    `forward(input_ids)` returns logits [B, T, vocab]; `position_ids` and `segment_ids` ([B, T])
    lay out several sequences packed in one row (see `model.batch`). When `input_ids` holds only
    some tokens of each row (a row split over ranks), `token_index` [T] gives their places in the
    row, and `segment_ids` and `position_ids` cover the whole row. `config.vocab_size` must be
    set. `before_output=True` returns the final norm's output [B, T, hidden] instead, for a loss that applies the
    output layer itself (`model.fused_loss`). With `config.lora_rank` the chosen linear layers carry LoRA adapters
    and only those train.

    With a vision encoder (`config.has_vision`) `images` [N, 3, H, W] are the micro-batch's images, whose
    features take the places of the image placeholders (`model.vision`); --freeze-vision-model and
    --freeze-language-model leave those parts' weights untrained.
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        if config.vocab_size is None:
            raise ValueError("ModelConfig.vocab_size must be set before building the model")
        self.config = config
        self.embedding = nn.Embedding(config.vocab_size, config.hidden_size)
        self.vision = VisionModel(config) if config.has_vision else None
        learned = config.position_embedding_type == "learned_absolute"
        self.position_embedding = nn.Embedding(config.max_position_embeddings, config.hidden_size) if learned else None
        self.embedding_dropout = nn.Dropout(config.hidden_dropout)
        self.layers = TransformerLayers(build_layers(config))
        self.final_norm = make_norm(config)
        self.output = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.tie_weights()
        if config.lora_rank is not None:
            add_adapters(self, config.lora_rank, config.lora_alpha, config.lora_targets)
        self.freeze()

    def freeze(self) -> None:
        """Leave untrained what the config freezes, and the encoder's weights that never run. With LoRA the
        projector trains whole beside the adapters (LLaVA's LoRA recipe); the encoder stays frozen."""
        vision, config = self.vision, self.config
        if vision is None:
            return
        if config.lora_rank is not None:
            vision.projector.requires_grad_(True)
        frozen = vision.encoder.carried() if config.encoder_trains else list(vision.encoder.parameters())
        if config.freeze_language_model:
            image_side = set(vision.parameters())
            frozen += [p for name, p in self.named_parameters() if p not in image_side and "lora_" not in name]
        for param in frozen:
            param.requires_grad_(False)

    @property
    def tied(self) -> bool:
        return not self.config.untie_embeddings_and_output_weights

    def tie_weights(self) -> None:
        """Share the input embedding with the output layer (again after materializing from meta)."""
        if self.tied:
            self.output.weight = self.embedding.weight

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        segment_ids: torch.Tensor | None = None,
        token_index: torch.Tensor | None = None,
        images: torch.Tensor | None = None,
        before_output: bool = False,
    ) -> torch.Tensor:
        positions, places = self.token_layout(input_ids, position_ids, segment_ids, token_index)
        x = self.embed(input_ids, positions, images)
        x = self.layers(x, range(len(self.layers)), self.rotary_tables(positions), places=places)
        return self.final_norm(x) if before_output else self.head(x)

    # The pieces of forward, in order; a pipeline stage runs some of them on its own layers.

    @staticmethod
    def token_layout(
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        segment_ids: torch.Tensor | None = None,
        token_index: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, TokenPlaces]:
        """The positions (for embeddings) and the places in their rows (for attention masks) of the
        tokens of `input_ids`; the arguments are `forward`'s."""
        if token_index is not None:
            places = TokenPlaces(token_index, segment_ids)
        else:
            places = TokenPlaces.row(input_ids.size(1), input_ids.device, segments=segment_ids)
        if position_ids is None:
            return places.index, places
        return (position_ids if token_index is None else position_ids[:, token_index]), places

    def embed(
        self, input_ids: torch.Tensor, positions: torch.Tensor, images: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Token embeddings, the images' features in their placeholders' places (with a vision encoder), + learned
        position embeddings at `positions` ([T] or [B, T])."""
        x = self.embedding(input_ids)
        if self.vision is not None:
            x = self.vision(x, input_ids, images)
        if self.position_embedding is not None:
            x = x + self.position_embedding(positions)
        return self.embedding_dropout(x)

    def rotary_tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Rotary cos/sin tables for `positions` ([T] or [B, T]; None without rotary embeddings)."""
        return rotary_tables(self.config, positions)

    def head(self, x: torch.Tensor) -> torch.Tensor:
        """Final norm and output layer: logits."""
        return self.output(self.final_norm(x))


# ---------------------------------------------------------------- building


def build_model(config: ModelConfig, device: torch.device | str = "cpu", seed: int = 0) -> GPT:
    """Build on the meta device (no memory, no time), then materialize on `device` and initialize
    (`model.init`: the same weights from `seed` at every layout)."""
    with torch.device("meta"):
        model = GPT(config)
    model.to_empty(device=device)
    model.tie_weights()
    init_weights(model, config, seed)
    return model
