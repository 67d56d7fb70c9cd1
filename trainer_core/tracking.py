"""Metric logging from inside a trainer process.

The orchestrating task creates the stage's MLflow run and passes ``tracking_uri`` and
``mlflow_run_id`` in the :class:`~trainer_core.spec.StageSpec`; the trainer logs into that run
through :class:`MetricLogger`. Only ``mlflow.MlflowClient`` is used (no fluent API, no active
run state), and every MLflow error becomes a warning: tracking never crashes training.
With no tracking URI and no run id the logger is a no-op, so plain scripts work unchanged.
"""

from __future__ import annotations

import logging
import math
import re
import time
from typing import Any

logger = logging.getLogger(__name__)

_INVALID_METRIC_CHARS = re.compile(r"[^A-Za-z0-9_\-. /]")
_MAX_METRICS_PER_BATCH = 1000
"""MLflow's limit on metrics in one ``log_batch`` call."""


def sanitize_metric_name(name: str) -> str:
    """Make ``name`` a valid MLflow metric key.

    MLflow accepts alphanumerics, underscores, dashes, periods, spaces and slashes; every
    other character becomes ``_``. ``"eval/loss@8"`` -> ``"eval/loss_8"``.

    Args:
        name: A metric name.

    Returns:
        The sanitised name (``"_"`` for an empty one).
    """
    return _INVALID_METRIC_CHARS.sub("_", str(name)) or "_"


class MetricLogger:
    """Logs step metrics and small JSON artifacts into one existing MLflow run.

    Args:
        tracking_uri: MLflow tracking URI; None together with ``run_id=None`` gives a no-op logger.
        run_id: The MLflow run to log into (created by the orchestrator).

    Raises:
        ValueError: when exactly one of ``tracking_uri`` and ``run_id`` is given.
    """

    def __init__(self, tracking_uri: str | None, run_id: str | None) -> None:
        if (tracking_uri is None) != (run_id is None):
            raise ValueError("MetricLogger needs both tracking_uri and run_id, or neither")
        self.tracking_uri = tracking_uri
        self.run_id = run_id
        self._client: Any = None
        self._warned_nonfinite = False
        if tracking_uri is not None:
            try:
                from mlflow import MlflowClient

                self._client = MlflowClient(tracking_uri=tracking_uri)
            except Exception as e:  # noqa: BLE001 - tracking must never stop training
                logger.warning("MLflow client unavailable (%s); metrics will not be tracked", e)

    @property
    def enabled(self) -> bool:
        """True when metrics go to an MLflow run."""
        return self._client is not None

    def _clean(self, metrics: dict[str, float]) -> dict[str, float]:
        out: dict[str, float] = {}
        skipped: list[str] = []
        for name, value in metrics.items():
            try:
                number = float(value)
            except (TypeError, ValueError):
                skipped.append(name)
                continue
            if not math.isfinite(number):
                skipped.append(name)
                continue
            out[sanitize_metric_name(name)] = number
        if skipped and not self._warned_nonfinite:
            logger.warning("skipping non-finite or non-numeric metrics %s (warned once)", skipped)
            self._warned_nonfinite = True
        return out

    def log(self, metrics: dict[str, float], step: int) -> dict[str, float]:
        """Log ``metrics`` at ``step`` in one batch.

        Names are sanitised; NaN, infinite and non-numeric values are skipped (one warning for
        the logger's lifetime).

        Args:
            metrics: Metric name -> value (floats, ints, or 0-dim tensors).
            step: The step the values belong to (optimizer steps, ``global_step``).

        Returns:
            The metrics as logged (sanitised names, float values); also for a no-op logger.
        """
        clean = self._clean(metrics)
        if not self.enabled or not clean:
            return clean
        from mlflow.entities import Metric

        timestamp_ms = int(time.time() * 1000)
        items = [Metric(key=k, value=v, timestamp=timestamp_ms, step=int(step)) for k, v in clean.items()]
        try:
            for start in range(0, len(items), _MAX_METRICS_PER_BATCH):
                self._client.log_batch(self.run_id, metrics=items[start : start + _MAX_METRICS_PER_BATCH])
        except Exception as e:  # noqa: BLE001
            logger.warning("MLflow log_batch failed at step %d: %s", step, e)
        return clean

    def log_missing(self, batch: list[tuple[dict[str, float], int]]) -> int:
        """Log the (name, step) values of ``batch`` that the run does not hold yet.

        Used on resume with the metrics a checkpoint covers: the process that wrote the
        checkpoint may have died after committing it and before logging them, or after
        logging them; either way the run ends with each step exactly once.

        Returns:
            The number of values logged.
        """
        if not self.enabled or not batch:
            return 0
        names = {k for metrics, _ in batch for k in self._clean(metrics)}
        try:
            logged = {(n, m.step) for n in names for m in self._client.get_metric_history(self.run_id, n)}
        except Exception as e:  # noqa: BLE001
            logger.warning("MLflow get_metric_history failed (%s); not re-logging", e)
            return 0
        count = 0
        for metrics, step in batch:
            missing = {k: v for k, v in self._clean(metrics).items() if (k, int(step)) not in logged}
            count += len(self.log(missing, step)) if missing else 0
        return count

    def log_dict_artifact(self, obj: dict[str, Any], artifact_file: str) -> None:
        """Log a JSON/YAML-serialisable dict as the run artifact ``artifact_file``.

        Args:
            obj: The object to write.
            artifact_file: Run-relative path, e.g. ``"eval/samples.json"``.
        """
        if not self.enabled:
            return
        try:
            self._client.log_dict(self.run_id, obj, artifact_file)
        except Exception as e:  # noqa: BLE001
            logger.warning("MLflow log_dict(%s) failed: %s", artifact_file, e)

    def log_table(self, rows: list[dict[str, Any]], artifact_file: str) -> None:
        """Log ``rows`` (one dict per row, the same keys) as the MLflow table ``artifact_file``
        (shown in the run's Artifacts and the experiment's evaluation view).

        Args:
            rows: The table's rows; an empty list logs nothing.
            artifact_file: Run-relative JSON path, e.g. ``"eval/samples.json"``.
        """
        if not self.enabled or not rows:
            return
        try:
            columns = list(dict.fromkeys(k for row in rows for k in row))
            self._client.log_table(
                self.run_id, data={c: [row.get(c) for row in rows] for c in columns}, artifact_file=artifact_file
            )
        except Exception as e:  # noqa: BLE001
            logger.warning("MLflow log_table(%s) failed: %s", artifact_file, e)

    def close(self) -> None:
        """Drop the client. The run itself is terminated by the orchestrator, not here."""
        self._client = None


MODEL_NAME = "model"
"""The LoggedModel name of a stage's final model (``runs:/<stage run>/model``)."""


def stage_model_name(stage: str) -> str:
    """The LoggedModel name of ``stage``'s final model: ``<stage>-reward`` for the reward model,
    ``<stage>-policy`` for any other (a causal LM), so that the experiment's Models tab tells a
    run's models apart (every one was called :data:`MODEL_NAME`, still looked up for runs logged
    so: :func:`stage_logged_model_uri`).

    Raises:
        ConfigError: unknown stage.
    """
    from trainer_core.registry import get_stage

    return f"{stage}-{'reward' if get_stage(stage).output == 'reward_model' else 'policy'}"


def stage_logged_model_uri(client: Any, stage: str, run_id: str) -> str | None:
    """``models:/<model_id>`` of ``stage``'s final model in its run: the newest READY LoggedModel
    named :func:`stage_model_name`, else one named :data:`MODEL_NAME` (logged before the names
    changed); None when there is neither."""
    return logged_model_uri(client, run_id, stage_model_name(stage)) or logged_model_uri(client, run_id)


def logged_model_uri(client: Any, run_id: str, name: str = MODEL_NAME) -> str | None:
    """``models:/<model_id>`` of the newest READY LoggedModel called ``name`` of run ``run_id``.

    Args:
        client: An ``mlflow.MlflowClient``.
        run_id: The MLflow run (a stage run).
        name: The LoggedModel's name.

    Returns:
        The URI, or None when the run logged no such model (or only failed attempts).

    Raises:
        MlflowException: the run does not exist or the store fails.
    """
    from mlflow.entities import LoggedModelStatus

    experiment_id = client.get_run(run_id).info.experiment_id
    found = client.search_logged_models(
        [experiment_id],
        filter_string=f"source_run_id = '{run_id}' AND name = '{name}'",
        order_by=[{"field_name": "creation_timestamp", "ascending": False}],
        max_results=20,
    )
    ready = [m for m in found if m.status == LoggedModelStatus.READY]
    return f"models:/{ready[0].model_id}" if ready else None
