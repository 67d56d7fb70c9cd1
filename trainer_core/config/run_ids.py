"""Run ids and the config ``name`` they are made of: one rule for both.

A run id names a directory (``<root>/runs/<run_id>/``, any fsspec URI) and an MLflow run, so it
is ASCII letters, digits and ``._-``, starts with a letter or digit, and has at most
:data:`MAX_RUN_ID_CHARS` characters (:func:`check_run_id`). A run without ``--run-id`` gets
``<name>-<YYYYmmdd-HHMMSS>-<6 hex>`` (:func:`new_run_id`); a sweep adds ``sweep-`` in front
and each of its points ``-<8 hex>`` behind, so the config's ``name`` is held to the same rule
with room for all of that (:func:`check_name`) when the config is read, not when a run starts.

The flow side (``tasks/runs.py``) uses these functions; this module imports nothing of the
pipeline, so the config can use it.
"""

from __future__ import annotations

import re
import secrets
import time

from trainer_core.errors import ConfigError

MAX_RUN_ID_CHARS = 128
"""The longest run id."""

RUN_ID_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,%d}" % (MAX_RUN_ID_CHARS - 1))
"""A run id: what URIs and MLflow run names take (matched whole: ``fullmatch``)."""

_LONGEST_DERIVED = "sweep-{name}-20250101-120000-a1b2c3-0123abcd"
"""The longest id made of a name: a sweep point's (``sweep-`` + :func:`new_run_id` + ``-<8 hex>``)."""

MAX_NAME_CHARS = MAX_RUN_ID_CHARS - len(_LONGEST_DERIVED.format(name=""))
"""The longest config ``name`` whose every derived run id fits in :data:`MAX_RUN_ID_CHARS`."""


def check_run_id(run_id: str) -> str:
    """Return ``run_id`` if it is usable in URIs and MLflow run names.

    Raises:
        ConfigError: it is empty, too long, or has characters other than ASCII letters, digits,
            ``._-`` (or starts with one of ``._-``).
    """
    if not RUN_ID_PATTERN.fullmatch(run_id):
        raise ConfigError(f"run_id {run_id!r} must match {RUN_ID_PATTERN.pattern}")
    return run_id


def check_name(name: str) -> str:
    """Return the config ``name`` if every run id made of it passes :func:`check_run_id`.

    Raises:
        ValueError: it is empty, longer than :data:`MAX_NAME_CHARS`, starts with something other
            than an ASCII letter or digit, or has characters other than those and ``._-``.
    """
    if len(name) > MAX_NAME_CHARS or not RUN_ID_PATTERN.fullmatch(name):
        raise ValueError(
            f"{name!r}: run ids are made of it (<name>-<YYYYmmdd-HHMMSS>-<6 hex>), so it takes 1 to {MAX_NAME_CHARS} "
            "ASCII letters, digits and ._- and starts with a letter or digit"
        )
    return name


def new_run_id(name: str) -> str:
    """``<name>-<YYYYmmdd-HHMMSS>-<6 hex>``, e.g. ``demo-20250101-120000-a1b2c3``."""
    return f"{name}-{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(3)}"
