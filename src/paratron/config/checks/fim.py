"""Consistency checks of the fill-in-the-middle settings (part of `config.validation`).

What the settings alone can tell, before any worker starts: rates are probabilities, the fragment settings come
together, and FIM rewrites text, so it needs pretraining documents (not --mock-data's token progressions, not
--sft's conversations). Whether the tokenizer has the sentinel tokens is checked when it is loaded (`data.fim`).
"""

from __future__ import annotations

from paratron.config.fields import flag
from paratron.config.schema import DataConfig
from paratron.errors import ConfigError


def check_fim(d: DataConfig) -> None:
    """Raise ConfigError for the first fill-in-the-middle setting that cannot work."""
    if not d.fim_data:  # (the other --fim-* settings are then unused, as in Megatron-LM)
        return
    for name in ("fim_rate", "fim_spm_rate", "fim_fragment_rate"):
        value = getattr(d, name)
        if value is not None and not 0.0 <= value <= 1.0:
            raise ConfigError(f"{getattr(flag, name)} {value}: a probability, so in [0, 1]; give one there")
    if d.fim_split_sample and d.fim_fragment_rate is None:
        raise ConfigError(
            f"{flag.fim_split_sample} cuts documents into fragments, each rewritten with probability "
            f"{flag.fim_fragment_rate}; give {flag.fim_fragment_rate} too"
        )
    if d.fim_fragment_rate is not None and not d.fim_split_sample:
        raise ConfigError(f"{flag.fim_fragment_rate} applies to fragments; add {flag.fim_split_sample} TOKEN")
    if d.mock_data or d.sft:
        what = flag.mock_data if d.mock_data else flag.sft
        raise ConfigError(
            f"{flag.fim_data} rewrites the text of pretraining documents, which {what} does not have; give "
            f"{flag.data_path} (or {flag.corpus} stdlib) instead"
        )
