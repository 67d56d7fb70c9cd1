"""Exactly-once MLflow metric history across a kill between checkpoint commit and metric logging."""

from __future__ import annotations

from mlflow import MlflowClient

from trainer_core.tracking import MetricLogger


def test_log_missing_fills_gaps_and_never_duplicates(tmp_path):
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    client = MlflowClient(uri)
    run_id = client.create_run(client.create_experiment("e")).info.run_id
    logger = MetricLogger(uri, run_id)
    logger.log({"train/loss": 4.0, "train/lr": 0.1}, 1)
    logger.log({"train/loss": 3.0}, 2)  # train/lr of step 2 was lost with the process
    batch = [
        ({"train/loss": 4.0, "train/lr": 0.1}, 1),
        ({"train/loss": 3.0, "train/lr": 0.2}, 2),
        ({"train/loss": 2.0, "train/lr": 0.3}, 3),
    ]
    assert logger.log_missing(batch) == 3  # lr@2, loss@3, lr@3
    assert logger.log_missing(batch) == 0
    loss = sorted((m.step, m.value) for m in client.get_metric_history(run_id, "train/loss"))
    lr = sorted((m.step, m.value) for m in client.get_metric_history(run_id, "train/lr"))
    assert loss == [(1, 4.0), (2, 3.0), (3, 2.0)]
    assert lr == [(1, 0.1), (2, 0.2), (3, 0.3)]
