"""Errors caused by the user's input rather than by paratron.

The CLI prints them as one line and exits with code 2; anything else is a bug and
keeps its traceback (exit code 1).
"""


class UserError(Exception):
    """A mistake in settings or input that the user can fix; the message says how."""


class ConfigError(UserError):
    """An inconsistent or invalid setting."""


class DataError(UserError):
    """A data file that is missing, malformed or unusable."""


class CheckpointError(UserError):
    """A checkpoint that is missing, incomplete or does not fit the model."""


class PeerFailure(UserError):
    """Another rank hit a user error and reported it; this rank stops quietly with the same exit code."""


class NonFiniteStop(UserError):
    """Training met a non-finite loss or gradient and --on-nan says stop (or cannot roll back);
    the message names the first module whose output or gradient went non-finite."""
