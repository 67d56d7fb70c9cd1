"""What a stage shows where people look: MLflow UI links, curve images, Prefect progress.

- :func:`mlflow_ui_url` / :func:`mlflow_run_url`: the MLflow UI page of a run, when a UI URL is
  known (``tracking.ui_url``, else an http(s) tracking URI; a sqlite store has none).
- :func:`curves_figure` / :func:`log_curves`: a stage run's headline curves (the metric
  histories the trainer logged, named in :data:`CURVES`), drawn with matplotlib's object API
  (no pyplot: stage tasks run in parallel threads) and logged into the run as
  ``plots/curves.png``. Only ``MlflowClient`` is used, no fluent API.
- :class:`StageProgress`: a Prefect progress artifact fed the trainer's output lines (the
  ``[<stage>] step <global_step>: ...`` line rank 0 prints per logged step,
  ``trainer_core.stages.context.StageContext.print_metrics``), updated at most every
  ``min_interval_s`` and only when it moved by ``min_delta`` of the stage's ``max_steps``.

The Prefect UIs (V2, the default, and V1) both render ``data:image/png;base64`` images in
markdown artifacts: V2's markdown view lets ``data:image/`` through its URL transform and
sanitizer for ``img`` sources, V1 renders marked's image tokens as plain ``<img src>``.
"""

from __future__ import annotations

import base64
import io
import logging
import os
import re
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from matplotlib.figure import Figure
from mlflow import MlflowClient
from prefect.artifacts import create_progress_artifact, update_progress_artifact

from trainer_core.config import PipelineConfig

logger = logging.getLogger(__name__)

CURVES_ARTIFACT = "plots/curves.png"
"""Where :func:`log_curves` puts a stage run's curves image."""

_FIGSIZE_IN = (6.0, 3.5)
_DPI = 90
_MAX_POINTS = 2000
"""Points drawn per curve; longer histories are thinned to every k-th point (last kept)."""


def artifact_key(stage: str, suffix: str) -> str:
    """A Prefect artifact key (lowercase letters, digits, dashes): ``reward_model`` -> ``reward-model-<suffix>``."""
    raw = f"{stage}-{suffix}".lower()
    return "".join(c if c.isalnum() and c.isascii() else "-" for c in raw)


# --------------------------------------------------------------------------- MLflow UI links


MLFLOW_UI_URL_ENV = "POSTTRAIN_MLFLOW_UI_URL"
"""The MLflow UI of a store that has none of its own (SQLite, files), for links: set by a
deployment's job variables (``deployments/prefect.yaml``; ``posttrain deploy`` defaults it to
``http://127.0.0.1:5000``, where ``mlflow ui`` serves), or exported by hand."""


def mlflow_ui_url(config: PipelineConfig, tracking_uri: str) -> str | None:
    """Base URL of the MLflow UI showing ``tracking_uri``'s store, without a trailing slash.

    Returns:
        ``config.tracking.ui_url``; else ``tracking_uri`` when it is http(s) (a tracking server
        is its own UI); else ``$POSTTRAIN_MLFLOW_UI_URL`` (:data:`MLFLOW_UI_URL_ENV`); else None
        (no links).
    """
    url = config.tracking.ui_url or (tracking_uri if tracking_uri.startswith(("http://", "https://")) else None)
    url = url or os.environ.get(MLFLOW_UI_URL_ENV) or None
    return url.rstrip("/") if url else None


def mlflow_run_url(ui_url: str, experiment_id: str, run_id: str) -> str:
    """The MLflow UI page of a run: ``{ui_url}/#/experiments/{experiment_id}/runs/{run_id}``."""
    return f"{ui_url.rstrip('/')}/#/experiments/{experiment_id}/runs/{run_id}"


def run_link_markdown(ui_url: str | None, experiment_id: str | None, run_id: str) -> str:
    """The run id in backticks, as a markdown link to its MLflow UI page when both URL parts are known."""
    if ui_url is None or experiment_id is None:
        return f"`{run_id}`"
    return f"[`{run_id}`]({mlflow_run_url(ui_url, experiment_id, run_id)})"


# --------------------------------------------------------------------------- curves


@dataclass(frozen=True)
class Panel:
    """One plot of a stage's curves image.

    Attributes:
        title: the panel title.
        metrics: MLflow metric keys drawn in it (one line each; absent ones are skipped).
    """

    title: str
    metrics: tuple[str, ...]


_LOSS = Panel("loss", ("train/loss", "eval/loss"))

CURVES: dict[str, tuple[Panel, ...]] = {
    "pretrain": (_LOSS, Panel("perplexity", ("eval/perplexity",))),
    "sft": (_LOSS,),
    "reward_model": (_LOSS, Panel("pairwise accuracy", ("train/accuracy", "eval/accuracy"))),
    "dpo": (_LOSS, Panel("implicit reward accuracy", ("train/rewards/accuracies", "eval/rewards/accuracies"))),
    "kto": (
        _LOSS,
        Panel("implied reward", ("train/rewards/chosen", "train/rewards/rejected")),
        Panel("KL estimate", ("train/kl",)),
    ),
    "ppo": (Panel("reward", ("reward_mean", "objective/rlhf_reward")), Panel("KL to reference", ("objective/kl",))),
    "grpo": (Panel("reward", ("reward_mean", "verifier_accuracy")), Panel("KL to reference", ("objective/kl",))),
    "distill": (
        Panel("divergence from the teacher", ("distill/reverse_kl_avg", "distill/jsd_avg")),
        Panel("reward (logged)", ("reward_mean",)),
    ),
}
"""Stage -> the panels of its curves image (the metric names the trainer logs: ``training/loop.py``
for pretrain, SFT, reward model, DPO and KTO, ``training/rl/trainer.py`` for PPO, GRPO and distill). Other stages have none."""


def _history(client: MlflowClient, run_id: str, key: str) -> tuple[list[int], list[float]]:
    """``(steps, values)`` of one metric, one value per step (the latest logged), thinned to
    about :data:`_MAX_POINTS`."""
    by_step: dict[int, tuple[int, float]] = {}
    for m in client.get_metric_history(run_id, key):
        if m.step not in by_step or m.timestamp >= by_step[m.step][0]:
            by_step[m.step] = (m.timestamp, m.value)
    steps = sorted(by_step)
    stride = max(1, -(-len(steps) // _MAX_POINTS))
    kept = steps[::stride] + ([steps[-1]] if steps and (len(steps) - 1) % stride else [])
    return kept, [by_step[s][1] for s in kept]


def curves_figure(tracking_uri: str, mlflow_run_id: str, stage: str) -> Figure | None:
    """The stage run's headline curves (:data:`CURVES`) against ``global_step``.

    Args:
        tracking_uri: The MLflow tracking URI.
        mlflow_run_id: The stage's MLflow run.
        stage: The stage name (selects the panels).

    Returns:
        A ``matplotlib.figure.Figure`` (6 x 3.5 in, one panel per metric group with data), or
        None when the stage has no curves or the run logged none of their metrics.
    """
    panels = CURVES.get(stage, ())
    if not panels:
        return None
    client = MlflowClient(tracking_uri)
    logged = set(client.get_run(mlflow_run_id).data.metrics)
    drawn = [(p, [k for k in p.metrics if k in logged]) for p in panels]
    drawn = [(p, keys) for p, keys in drawn if keys]
    if not drawn:
        return None
    fig = Figure(figsize=_FIGSIZE_IN, dpi=_DPI, layout="constrained")
    axes = fig.subplots(1, len(drawn), squeeze=False)[0]
    for ax, (panel, keys) in zip(axes, drawn):
        for key in keys:
            steps, values = _history(client, mlflow_run_id, key)
            style = {"marker": "o", "markersize": 3} if key.startswith("eval/") or len(steps) < 30 else {}
            ax.plot(steps, values, label=key, linewidth=1.2, **style)
        ax.set_title(panel.title, fontsize=9)
        ax.set_xlabel("global_step", fontsize=8)
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(stage, fontsize=10)
    return fig


def figure_png(fig: Figure) -> bytes:
    """``fig`` rendered as PNG bytes (Agg, no pyplot)."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=_DPI)
    return buf.getvalue()


def log_curves(tracking_uri: str, mlflow_run_id: str, stage: str) -> bytes | None:
    """Draw :func:`curves_figure` and log it into the run as :data:`CURVES_ARTIFACT`.

    Returns:
        The PNG bytes logged, or None when there was nothing to draw.

    Raises:
        MlflowException: the store rejected a read or the artifact upload.
    """
    fig = curves_figure(tracking_uri, mlflow_run_id, stage)
    if fig is None:
        return None
    png = figure_png(fig)
    directory, name = os.path.split(CURVES_ARTIFACT)
    with tempfile.TemporaryDirectory(prefix="posttrain-curves-") as tmp:
        path = os.path.join(tmp, name)
        with open(path, "wb") as f:
            f.write(png)
        MlflowClient(tracking_uri).log_artifact(mlflow_run_id, path, directory)
    return png


def png_markdown(png: bytes, alt: str) -> str:
    """A markdown image embedding ``png`` as a ``data:image/png;base64`` URL."""
    return f"![{alt}](data:image/png;base64,{base64.b64encode(png).decode('ascii')})"


# --------------------------------------------------------------------------- progress

_STEP_LINE = re.compile(r"\[(?P<stage>[A-Za-z0-9_]+)\] step (?P<step>\d+):")
"""The per-step line of ``StageContext.print_metrics`` (``[sft] step 12: train/loss=...``), also
behind torchrun's ``[default0]:`` prefix."""


def parse_step(line: str, stage: str) -> int | None:
    """The global step of ``stage``'s per-step metrics line, or None for any other line."""
    m = _STEP_LINE.search(line)
    return int(m.group("step")) if m is not None and m.group("stage") == stage else None


class StageProgress:
    """A Prefect progress artifact (key ``<stage>-progress``) following a stage's global step.

    Feed it every output line (:meth:`on_line`, the ``on_line`` of
    ``tasks.launch.process.launch_stage_process``); it never raises: the first Prefect API error is
    logged as a warning, later ones are dropped silently. A resumed stage's first line names its
    resumed step, so the bar starts there.

    Args:
        stage: The stage name (as in its metrics lines).
        total_steps: The stage's ``max_steps`` (100%).
        log: Receives the warning (a Prefect run logger or ``logging.Logger``); default: this
            module's logger.
        min_interval_s: Fewest seconds between two updates.
        min_delta: Smallest progress change (fraction of ``total_steps``) worth an update.
        clock: Seconds, monotonic (a test seam).
    """

    def __init__(
        self,
        stage: str,
        total_steps: int,
        *,
        log: Any = None,
        min_interval_s: float = 2.0,
        min_delta: float = 0.01,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if total_steps < 1:
            raise ValueError(f"total_steps must be at least 1, got {total_steps}")
        self.stage = stage
        self.total_steps = total_steps
        self.log = log if log is not None else logger
        self.min_interval_s = min_interval_s
        self.min_delta = min_delta
        self.clock = clock
        self.artifact_id: Any = None
        self.step = 0
        self.shown = 0.0
        self.done = False
        self._shown_at = float("-inf")
        self._warned = False

    @property
    def key(self) -> str:
        """The artifact key: ``artifact_key(stage, "progress")``."""
        return artifact_key(self.stage, "progress")

    @property
    def fraction(self) -> float:
        """The latest step as a fraction of ``total_steps``, in [0, 1]."""
        return min(max(self.step / self.total_steps, 0.0), 1.0)

    def start(self) -> None:
        """Create the artifact at 0% (in the current task run)."""
        self.artifact_id = self._call(lambda: create_progress_artifact(0.0, key=self.key, description=self._describe()))
        self._shown_at = self.clock()

    def on_line(self, line: str) -> None:
        """Take one output line; update the artifact when the step moved enough, long enough ago."""
        step = parse_step(line, self.stage)
        if step is None:
            return
        self.step = step
        now = self.clock()
        if now - self._shown_at >= self.min_interval_s and self.fraction - self.shown >= self.min_delta:
            self._update(self.fraction, now)

    def complete(self) -> None:
        """Set 100%: the stage committed its result (early stopping may have ended it before ``max_steps``)."""
        self.done = True
        self._update(1.0, self.clock())

    def _describe(self) -> str:
        done = " (completed)" if self.done else ""
        return f"{self.stage}: global_step {self.step}/{self.total_steps}{done}"

    def _update(self, fraction: float, now: float) -> None:
        if self.artifact_id is None:
            return
        self._shown_at = now  # a failed call waits as long as a successful one before the next try
        percent = round(100.0 * fraction, 1)  # the UI prints the float as it is (46.666666666666664%)
        if self._call(lambda: update_progress_artifact(self.artifact_id, percent, self._describe())) is not None:
            self.shown = fraction

    def _call(self, fn: Callable[[], Any]) -> Any:
        """``fn()``, or None after logging (once) what it raised."""
        try:
            return fn()
        except Exception as e:  # noqa: BLE001 - progress is decoration: never fail the stage for it
            if not self._warned:
                self._warned = True
                self.log.warning(
                    "stage %s: progress artifact %s not updated: %s: %s", self.stage, self.key, type(e).__name__, e
                )
            return None
