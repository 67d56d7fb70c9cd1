"""What a pipeline run reports, and its release: MLflow runs and models, Prefect artifacts, gates.

- :mod:`~tasks.report.tracking`: one MLflow parent run per pipeline run, one nested run per stage.
- :mod:`~tasks.report.mlflow_models`: the stages' logged models and the registry.
- :mod:`~tasks.report.views`: what a stage shows where people look (links, curves, progress).
- :mod:`~tasks.report.summary`: ``summary.json``, the headline metrics and the summary artifact.
- :mod:`~tasks.report.gates`: the quality gates a run's final policy is judged by.
- :mod:`~tasks.report.release`: the judgement and the registered version, shown in both UIs.
"""
