"""--hybrid-layer-pattern: the model's layers as one symbol per residual sublayer, as Megatron-LM's hybrid models
give them (`*` attention, `-` MLP, `E` mixture of experts; `|` between pipeline stages). The kinds behind the
symbols live in `model/` (`model.layer_kind`); this module reads the text."""

from __future__ import annotations

from dataclasses import dataclass

PATTERN_SYMBOLS: dict[str, str] = {"*": "attention", "-": "MLP", "E": "mixture of experts"}
"""The symbols of --hybrid-layer-pattern that paratron builds."""

NOT_YET: dict[str, str] = {
    "M": "Mamba layers",
    "G": "gated DeltaNet layers",
    "+": "multi-latent attention layers beside others; --multi-latent-attention makes every '*' one",
    "D": "DeepSeek sparse attention layers",
}
"""Megatron-LM's symbols of kinds paratron does not have yet."""

STAGE_BREAK, MTP_BREAK = "|", "/"


@dataclass(frozen=True)
class LayerPattern:
    """A --hybrid-layer-pattern read: the symbols of its layers in order, and how many layers each pipeline stage
    holds (one stage when the pattern has no `|`)."""

    symbols: str
    stage_sizes: tuple[int, ...]

    @property
    def num_layers(self) -> int:
        return len(self.symbols)


def read_layer_pattern(text: str) -> LayerPattern:
    """Read a --hybrid-layer-pattern; ValueError (its message names the symbol and the fix) for one paratron does
    not build."""
    if MTP_BREAK in text:
        raise ValueError(f"'{MTP_BREAK}' starts multi-token-prediction layers, which are not implemented; drop it")
    stages = text.split(STAGE_BREAK)
    for symbol in text.replace(STAGE_BREAK, ""):
        if symbol in NOT_YET:
            raise ValueError(f"'{symbol}' ({NOT_YET[symbol]}) is not implemented; use {_known()}")
        if symbol not in PATTERN_SYMBOLS:
            raise ValueError(f"'{symbol}' is not a layer symbol; use {_known()}, and '{STAGE_BREAK}' between stages")
    if any(not stage for stage in stages):
        raise ValueError(f"every pipeline stage ('{STAGE_BREAK}' between them) needs at least one layer")
    return LayerPattern("".join(stages), tuple(len(stage) for stage in stages))


def _known() -> str:
    return ", ".join(f"'{s}' ({name})" for s, name in PATTERN_SYMBOLS.items())
