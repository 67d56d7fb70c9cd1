"""The real data beside the checkout (``../shared/data``, or ``$POSTTRAIN_SHARED_DATA``; its README
describes the files) and the mark that skips a test without it."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.tiny import REPO

SHARED_DATA = Path(os.environ.get("POSTTRAIN_SHARED_DATA") or REPO.parent / "shared" / "data").resolve()
"""The shared data folder."""
GSM8K = SHARED_DATA / "gsm8k" / "train.jsonl"
"""GSM8K's training problems (``question``/``answer`` JSON lines)."""
HH = SHARED_DATA / "hh-rlhf-harmless" / "pairs.jsonl"
"""HH-RLHF harmless preference pairs (``chosen``/``rejected`` JSON lines)."""

needs_shared_data = pytest.mark.skipif(
    not (GSM8K.is_file() and HH.is_file()),
    reason=f"real data not found under {SHARED_DATA} (set POSTTRAIN_SHARED_DATA)",
)
"""Skips a test (or, as ``pytestmark``, a module) when GSM8K or the HH-RLHF pairs are missing."""
