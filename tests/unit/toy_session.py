"""The checkpoint session of the toy training loops of ``test_loop.py`` and ``test_step_sync.py``."""

from __future__ import annotations

from trainer_core.backends.single import SingleDeviceBackend
from trainer_core.checkpoint.session import CheckpointSession, MetricsBuffer
from trainer_core.storage import join_uri


def toy_session(
    root: str, backend: SingleDeviceBackend, metrics: MetricsBuffer, *, keep_last: int, asynchronous: bool
) -> CheckpointSession:
    """A session under ``<root>/checkpoints`` for stage ``toy`` of run ``r`` (fingerprint ``h``),
    its metrics into ``metrics``, keeping the last ``keep_last`` checkpoints, saving in the background
    with ``asynchronous``."""
    return CheckpointSession(
        join_uri(root, "checkpoints"),
        backend,
        fingerprint="h",
        metrics=metrics,
        stage="toy",
        run_id="r",
        keep_last=keep_last,
        asynchronous=asynchronous,
    )
