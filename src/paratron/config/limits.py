"""Field metadata the settings' dataclasses share: their limits (which `config.validation` reads) and the mark of a
derived setting."""

ABOVE_ZERO = {"above": 0}
"""Field metadata: the setting must be above zero when set."""

ZERO_OR_MORE = {"min": 0}
"""Field metadata: the setting may be zero but not negative."""

FRACTION = {"min": 0, "below": 1}
"""Field metadata: the setting lies in [0, 1)."""

DERIVED = "derived"
"""Field metadata key: None means "work it out from the other settings" (done when the dataclass is built)."""
