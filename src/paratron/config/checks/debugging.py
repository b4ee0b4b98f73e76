"""The debugging and watching settings: --debug-capture's folder, the loss-spike detector."""

from __future__ import annotations

import os

from paratron.config.fields import flag
from paratron.config.schema import Config
from paratron.errors import ConfigError


def check_debug_capture(config: Config) -> None:
    """--debug-capture maps every rank's piece to the single-device tensor at every layout (tensor,
    sequence, pipeline, context, expert and data parallelism, ZeRO stages 0-3); its folder must be one."""
    folder = config.logging.debug_capture
    if folder and os.path.exists(folder) and not os.path.isdir(folder):
        raise ConfigError(f"{flag.debug_capture} {folder} is a file; give a folder (new or one of earlier captures)")


def check_loss_spikes(config: Config) -> None:
    """--loss-spike-zscore's window must give a standard deviation, --on-spike rollback a checkpoint to go back to."""
    t = config.training
    if t.loss_spike_zscore is None:
        return
    if t.loss_spike_window < 2:
        raise ConfigError(
            f"{flag.loss_spike_window} {t.loss_spike_window}: a loss spike is judged against the spread of at least "
            f"2 recent losses; give {flag.loss_spike_window} 2 or more (50 by default)"
        )
    if t.on_spike == "rollback" and not config.checkpoint.save:
        raise ConfigError(
            f"{flag.on_spike} rollback reloads the newest checkpoint of {flag.save}: give {flag.save} DIR "
            f"(and {flag.save_interval} N), or choose {flag.on_spike} warn or skip"
        )
