"""Errors that mean "bad input": a retry cannot fix them.

The trainer process exits with :data:`EXIT_BAD_INPUT` when one of these escapes, so the
orchestrating task fails at once instead of retrying (see ``tasks/launch.py``).
"""

from __future__ import annotations

EXIT_BAD_INPUT = 2
"""Process exit code for bad config or bad data (never retried)."""


class PosttrainError(Exception):
    """Base class of the project's own errors."""


class ConfigError(PosttrainError, ValueError):
    """A configuration value is invalid; the message names the field path."""


class DataError(PosttrainError, ValueError):
    """An input record or file is malformed; the message names the file and line."""
