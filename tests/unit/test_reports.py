"""tasks/report/views.py, tasks/report/summary.py's table and headline numbers, and the stage markdown: a real
MLflow sqlite store, real matplotlib, the trainer's own metrics printer, a real child process.

Prefect's API (progress, table and markdown artifacts) is exercised in tests/e2e/test_reports_prefect.py;
here the progress artifact's two API calls are recorded instead, to check the throttle."""

from __future__ import annotations

import io
import logging
import sys
import textwrap
from types import SimpleNamespace

import pytest
from matplotlib.image import imread
from mlflow import MlflowClient
from mlflow.entities import Metric

from tasks.launch.process import launch_stage_process
from tasks.report import views as reports
from tasks.report.summary import TABLE_COLUMNS, build_summary, headline_metrics, summary_markdown, summary_rows
from tasks.report.views import (
    CURVES_ARTIFACT,
    StageProgress,
    curves_figure,
    log_curves,
    mlflow_run_url,
    mlflow_ui_url,
    parse_step,
)
from tasks.results import PipelineRun, StageResult
from tasks.stages import _metrics_markdown, artifact_key, mlflow_run_markdown
from trainer_core.checkpoint.manifest import Manifest
from trainer_core.config import load_config

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """One sqlite store for the module (creating its schema takes seconds)."""
    root = tmp_path_factory.mktemp("mlflow-reports")
    uri = f"sqlite:///{root}/mlflow.db"
    client = MlflowClient(uri)
    experiment_id = client.create_experiment("reports", artifact_location=str(root / "artifacts"))
    return uri, experiment_id


def new_run(store, metrics: dict[str, list[tuple[int, float]]]) -> str:
    """A run holding ``{key: [(step, value), ...]}`` as metric histories."""
    uri, experiment_id = store
    client = MlflowClient(uri)
    run_id = client.create_run(experiment_id).info.run_id
    batch = [Metric(k, v, 1000 + step, step) for k, points in metrics.items() for step, v in points]
    for start in range(0, len(batch), 1000):
        client.log_batch(run_id, metrics=batch[start : start + 1000])
    return run_id


def sft_history(num_steps: int = 40) -> dict[str, list[tuple[int, float]]]:
    return {
        "train/loss": [(s, 3.0 / (1 + 0.1 * s)) for s in range(1, num_steps + 1)],
        "train/lr": [(s, 1e-3) for s in range(1, num_steps + 1)],
        "eval/loss": [(s, 3.1 / (1 + 0.08 * s)) for s in range(0, num_steps + 1, 10)],
    }


# --------------------------------------------------------------------------- links


def test_mlflow_ui_url_prefers_the_configured_ui():
    sqlite = "sqlite:////tmp/mlflow.db"
    assert mlflow_ui_url(load_config(), sqlite) is None
    assert mlflow_ui_url(load_config(), "http://mlflow:5000/") == "http://mlflow:5000"
    configured = load_config(overrides={"tracking.ui_url": "https://mlflow.example.org/"})
    assert mlflow_ui_url(configured, sqlite) == "https://mlflow.example.org"
    assert mlflow_ui_url(configured, "http://mlflow:5000") == "https://mlflow.example.org"
    assert mlflow_run_url("http://ui:5000/", "3", "abc") == "http://ui:5000/#/experiments/3/runs/abc"


def test_mlflow_run_markdown_links_when_a_ui_is_known(store):
    uri, experiment_id = store
    run_id = new_run(store, {})
    assert mlflow_run_markdown(load_config(), uri, run_id) == f"`{run_id}`"
    config = load_config(overrides={"tracking.ui_url": "http://localhost:5000"})
    assert mlflow_run_markdown(config, uri, run_id) == (
        f"[`{run_id}`](http://localhost:5000/#/experiments/{experiment_id}/runs/{run_id})"
    )


def test_artifact_key_is_reexported_by_stages():
    assert artifact_key("reward_model", "progress") == "reward-model-progress"
    assert artifact_key is reports.artifact_key


# --------------------------------------------------------------------------- curves


def test_sft_curves_are_logged_as_a_png(store):
    uri, _ = store
    run_id = new_run(store, sft_history())
    png = log_curves(uri, run_id, "sft")
    assert png is not None and png.startswith(PNG_SIGNATURE)
    client = MlflowClient(uri)
    assert [a.path for a in client.list_artifacts(run_id, "plots")] == [CURVES_ARTIFACT]
    with open(client.download_artifacts(run_id, CURVES_ARTIFACT), "rb") as f:
        assert f.read() == png
    height, width, _ = imread(io.BytesIO(png), format="png").shape
    assert (width, height) == (540, 315)  # 6 x 3.5 in at 90 dpi
    assert len(png) < 100_000


def test_pair_stages_get_an_accuracy_panel(store):
    uri, _ = store
    history = sft_history(20)
    history["eval/rewards/accuracies"] = [(0, 0.5), (10, 0.6), (20, 0.7)]
    history["train/rewards/accuracies"] = [(s, 0.5 + s / 100) for s in range(1, 21)]
    fig = curves_figure(uri, new_run(store, history), "dpo")
    titles = [ax.get_title() for ax in fig.axes]
    assert titles == ["loss", "implicit reward accuracy"]
    assert [line.get_label() for line in fig.axes[1].get_lines()] == [
        "train/rewards/accuracies",
        "eval/rewards/accuracies",
    ]
    # A missing metric group is left out, not drawn empty.
    assert [ax.get_title() for ax in curves_figure(uri, new_run(store, sft_history(5)), "reward_model").axes] == [
        "loss"
    ]


def test_rl_curves_plot_reward_and_kl(store):
    uri, _ = store
    run_id = new_run(
        store,
        {
            "reward_mean": [(s, 0.1 * s) for s in range(1, 6)],
            "verifier_accuracy": [(s, 0.05 * s) for s in range(1, 6)],
            "objective/kl": [(s, 0.01 * s) for s in range(1, 6)],
        },
    )
    fig = curves_figure(uri, run_id, "grpo")
    assert [ax.get_title() for ax in fig.axes] == ["reward", "KL to reference"]
    steps, values = fig.axes[1].get_lines()[0].get_data()
    assert list(steps) == [1, 2, 3, 4, 5] and values[-1] == pytest.approx(0.05)


def test_no_curves_for_a_run_without_histories(store):
    uri, _ = store
    final_only = new_run(store, {"final/vocab_size": [(0, 256.0)]})
    assert curves_figure(uri, final_only, "sft") is None
    assert curves_figure(uri, new_run(store, sft_history(3)), "prepare_data") is None
    assert log_curves(uri, final_only, "sft") is None
    assert MlflowClient(uri).list_artifacts(final_only, "plots") == []


def test_long_histories_are_thinned_last_step_kept(store):
    uri, _ = store
    run_id = new_run(store, {"train/loss": [(s, 1.0 / s) for s in range(1, 5002)]})
    steps, _ = curves_figure(uri, run_id, "sft").axes[0].get_lines()[0].get_data()
    assert len(steps) <= 2001 and steps[0] == 1 and steps[-1] == 5001


def test_stage_markdown_embeds_the_curves(store):
    uri, _ = store
    png = log_curves(uri, new_run(store, sft_history(5)), "sft")
    manifest = Manifest(kind="final", stage="sft", run_id="r1", global_step=5, files=[], metrics={"train/loss": 1.5})
    text = _metrics_markdown("sft", "r1", manifest, "/out/sft/final", "`abc`", png)
    assert "![sft curves](data:image/png;base64,iVBORw0KGgo" in text
    assert "| `train/loss` | 1.5 |" in text
    assert "data:image" not in _metrics_markdown("score", "r1", manifest, "/out", "`abc`")


# --------------------------------------------------------------------------- progress


def printed_lines(capsys, stage: str, steps: list[tuple[int, dict[str, float]]]) -> list[str]:
    """What rank 0 of ``stage`` prints for these logged steps (``StageContext.print_metrics``)."""
    from trainer_core.stages.context import StageContext

    ctx = StageContext(spec=SimpleNamespace(stage=stage), backend=SimpleNamespace(rank=0), tokenizer=None, metrics=None)
    capsys.readouterr()
    for step, metrics in steps:
        ctx.print_metrics(metrics, step)
    return capsys.readouterr().out.splitlines()


TRAIN_METRICS = {
    "train/loss": 2.31,
    "train/grad_norm": 0.9,
    "train/lr": 1e-3,
    "time/forward_s": 0.01,
    "memory/peak_bytes": 1e9,
    "train/consumed_samples": 64.0,
}


def test_parse_step_reads_the_printers_lines(capsys):
    lines = printed_lines(capsys, "reward_model", [(0, {"eval/loss": 0.69}), (12, TRAIN_METRICS)])
    assert lines[1].startswith("[reward_model] step 12: train/")
    assert [parse_step(line, "reward_model") for line in lines] == [0, 12]
    assert parse_step(f"[default0]:{lines[1]}", "reward_model") == 12  # torchrun --tee prefix
    assert parse_step(lines[1], "sft") is None
    assert parse_step("INFO stage sft committed /out/step-00000012", "sft") is None


class Recorder:
    """Stands in for Prefect's two progress-artifact calls; ``fail`` makes them raise."""

    def __init__(self, monkeypatch, fail: bool = False):
        self.calls: list[tuple[str, float, str]] = []
        self.fail = fail
        monkeypatch.setattr(reports, "create_progress_artifact", self.create)
        monkeypatch.setattr(reports, "update_progress_artifact", self.update)

    def create(self, progress, key, description):
        return self._record("create", progress, description)

    def update(self, artifact_id, progress, description):
        return self._record("update", progress, description)

    def _record(self, what, progress, description):
        if self.fail:
            raise ConnectionError("prefect API unreachable")
        self.calls.append((what, progress, description))
        return "artifact-id"


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def test_progress_is_throttled_by_time_and_delta(monkeypatch, capsys):
    recorder, clock = Recorder(monkeypatch), Clock()
    lines = printed_lines(capsys, "sft", [(s, TRAIN_METRICS) for s in range(0, 301)])
    progress = StageProgress("sft", 300, clock=clock)
    assert progress.key == "sft-progress"
    progress.start()
    for line in lines[:100]:  # steps 0..99 within the first 2 s: nothing sent
        progress.on_line(line)
        clock.now += 0.01
    assert recorder.calls == [("create", 0.0, "sft: global_step 0/300")]
    clock.now += 2.0
    progress.on_line(lines[100])
    assert recorder.calls[-1][:2] == ("update", 33.3)  # one decimal: the UI prints the float as it is
    clock.now += 10.0
    progress.on_line(lines[101])  # long enough, but less than 1% more: not sent
    assert len(recorder.calls) == 2
    progress.on_line(lines[104])
    assert recorder.calls[-1][1] == 34.7
    progress.complete()
    assert recorder.calls[-1] == ("update", 100.0, "sft: global_step 104/300 (completed)")


def test_resumed_progress_starts_at_the_resumed_step(monkeypatch, capsys):
    recorder, clock = Recorder(monkeypatch), Clock()
    progress = StageProgress("grpo", 40, clock=clock)
    progress.start()
    clock.now += 5.0
    for line in printed_lines(capsys, "grpo", [(31, {"reward_mean": 0.4, "objective/kl": 0.01})]):
        progress.on_line(line)
    assert recorder.calls[-1] == ("update", pytest.approx(77.5), "grpo: global_step 31/40")


def test_progress_api_errors_are_logged_once_never_raised(monkeypatch, caplog):
    Recorder(monkeypatch, fail=True)
    progress = StageProgress("dpo", 10, min_interval_s=0.0, log=logging.getLogger("test-progress"))
    with caplog.at_level(logging.WARNING, "test-progress"):
        progress.start()
        progress.on_line("[dpo] step 5: train/loss=0.6")
        progress.complete()
    assert [r.getMessage() for r in caplog.records] == [
        "stage dpo: progress artifact dpo-progress not updated: ConnectionError: prefect API unreachable"
    ]


class ListLog:
    def __init__(self):
        self.lines: list[str] = []
        self.warnings: list[str] = []

    def info(self, msg, *args):
        self.lines.append(msg % args if args else msg)

    def warning(self, msg, *args):
        self.warnings.append(msg % args if args else msg)


def test_launch_feeds_every_line_to_on_line(monkeypatch):
    """A child printing the trainer's step lines drives the progress through ``on_line``."""
    recorder = Recorder(monkeypatch)
    code = textwrap.dedent("""
        import sys
        for step in range(1, 11):
            sys.stdout.write(f"[sft] step {step}: train/loss={1 / step:.4g}\\n")
        print("done")
    """)
    seen: list[str] = []
    progress = StageProgress("sft", 10, min_interval_s=0.0, min_delta=0.5)
    progress.start()

    def on_line(line):
        seen.append(line)
        progress.on_line(line)

    log = ListLog()
    result = launch_stage_process([sys.executable, "-c", code], env=None, log=log, timeout_s=30, on_line=on_line)
    assert result.returncode == 0 and seen == log.lines and seen[-1] == "done"
    assert [c[1] for c in recorder.calls] == [0.0, 50.0, 100.0]


def test_a_failing_on_line_is_logged_once_and_the_launch_goes_on():
    def on_line(line):
        raise RuntimeError(f"cannot take {line}")

    log = ListLog()
    code = "print('a'); print('b')"
    result = launch_stage_process([sys.executable, "-c", code], env=None, log=log, timeout_s=30, on_line=on_line)
    assert result.returncode == 0 and log.lines == ["a", "b"]
    assert log.warnings == ["on_line callback failed (later failures not logged): RuntimeError: cannot take a"]


# --------------------------------------------------------------------------- summary table


def realistic_results() -> dict[str, StageResult]:
    """Final metrics as the stages' manifests carry them (``summarize`` of the loops' histories)."""
    done = dict(status="completed", wall_s=12.34, mlflow_run_id="0123456789abcdef0123456789abcdef")
    return {
        "prepare_data": StageResult(
            stage="prepare_data", metrics={"vocab_size": 256.0, "num_sft_train": 540.0}, **done
        ),
        "sft": StageResult(
            stage="sft",
            metrics={
                "train/loss": 1.23456,
                "eval/loss": 1.5,
                "eval/perplexity": 4.48,
                "first/train/loss": 5.5,
                "train/lr": 1e-4,
                "global_step": 300.0,
                "resumed": 0.0,
            },
            **done,
        ),
        "reward_model": StageResult(
            stage="reward_model",
            metrics={"train/loss": 0.61, "eval/loss": 0.66, "eval/accuracy": 0.62, "train/accuracy": 0.7},
            **done,
        ),
        "dpo": StageResult(
            stage="dpo",
            reused=True,
            metrics={
                "train/loss": 0.55,
                "eval/loss": 0.6,
                "eval/rewards/accuracies": 0.71,
                "eval/rewards/margins": 0.2,
            },
            **done,
        ),
        "grpo": StageResult.failed("grpo", RuntimeError("out of memory")),
        "evaluate": StageResult(
            stage="evaluate",
            metrics={
                "base/exact_match": 0.0,
                "sft/exact_match": 0.25,
                "dpo/exact_match": 0.3125,
                "sft/eval_loss": 1.4,
                "sft/eval_perplexity": 4.06,
                "reward_model/eval_accuracy": 0.64,
                "reward_model/eval_margin": 0.3,
                "dpo/eval_reward_accuracy": 0.7,
                "dpo/eval_reward_margin": 0.2,
                "dpo_vs_sft/win_rate": 0.5625,
            },
            **done,
        ),
    }


def realistic_summary() -> dict:
    config = load_config(overrides={"stages": ["prepare_data", "sft", "reward_model", "dpo", "grpo", "evaluate"]})
    run = PipelineRun(run_id="r1", config=config, tracking_uri="sqlite:///x.db", parent_mlflow_run_id="p")
    return build_summary(run, realistic_results())


def test_summary_table_has_one_column_per_headline_metric():
    rows = summary_rows(realistic_summary(), "http://mlflow:5000", "7")
    assert all(tuple(row) == TABLE_COLUMNS for row in rows)
    by_stage = {row["stage"]: row for row in rows}
    assert [row["stage"] for row in rows] == ["base", "prepare_data", "sft", "reward_model", "dpo", "grpo", "evaluate"]
    sft, rm, dpo = by_stage["sft"], by_stage["reward_model"], by_stage["dpo"]
    assert (sft["train_loss"], sft["eval_loss"], sft["exact_match"], sft["wall_s"]) == (1.235, 1.4, 0.25, 12.3)
    assert (rm["train_loss"], rm["accuracy"], rm["exact_match"]) == (0.61, 0.64, None)
    assert (dpo["status"], dpo["accuracy"], dpo["exact_match"], dpo["win_rate_vs_sft"]) == (
        "completed (reused)",
        0.7,
        0.3125,
        0.5625,
    )
    assert by_stage["base"]["exact_match"] == 0.0 and by_stage["base"]["status"] == "evaluated only"
    assert by_stage["grpo"]["status"] == "failed" and by_stage["grpo"]["mlflow_run"] is None
    assert sft["mlflow_run"] == (
        "[0123456789abcdef0123456789abcdef](http://mlflow:5000/#/experiments/7/runs/0123456789abcdef0123456789abcdef)"
    )
    assert summary_rows(realistic_summary())[2]["mlflow_run"] == "0123456789abcdef0123456789abcdef"
    summary = {
        **realistic_summary(),
        "release": {
            "gates": [],
            "failure": None,
            "judged": True,
            "registered_model": {
                "name": "m",
                "version": "2",
                "alias": "champion",
                "stage": "dpo",
                "previous_champion": "1",
            },
        },
    }
    lines = summary_markdown(summary, rows).splitlines()
    assert lines[:3] == [
        "**Run `r1`: failed**",
        "",
        "**Champion**: `m` version 2 (dpo of run `r1`) is now `@champion` (was version 1).",
    ]
    assert f"| {sft['mlflow_run']} |" in lines[8]  # the sft row, its link as Markdown


def test_headline_metrics_name_each_stage():
    summary = realistic_summary()
    headline = headline_metrics(summary)
    assert summary["headline"] == headline
    evaluate = realistic_results()["evaluate"].metrics
    assert headline == {  # one name per quantity: evaluate's held-out number, not also the stage's last eval
        "sft/train/loss": 1.23456,  # sft/eval/loss: evaluate's sft/eval_loss
        "reward_model/train/loss": 0.61,
        "reward_model/eval/loss": 0.66,  # eval/accuracy: reward_model/eval_accuracy
        "dpo/train/loss": 0.55,
        "dpo/eval/loss": 0.6,  # eval/rewards/accuracies: dpo/eval_reward_accuracy
        **evaluate,  # every evaluate metric under its own name
    }
    stages_only = {**summary, "stages": {k: v for k, v in summary["stages"].items() if k != "evaluate"}}
    assert headline_metrics(stages_only)["sft/eval/loss"] == 1.5  # without evaluate, the stage's own
