"""Where a pipeline run keeps its files: one object per run, one per stage, URI strings only.

Layout under ``<storage.root>/runs/<run_id>/`` (every path a URI: a ``pathlib.Path`` would
mangle ``s3://``)::

    config.json                                   the config the run was last started with
    summary.json                                  written by the flow at the end
    specs/<stage>.json                            what each trainer process was given
    stages/<stage>/lease.json                     the writer lease (checkpoint/lease.py)
    stages/<stage>/checkpoints/step-00000010/     step checkpoints, manifest.json last
    stages/<stage>/final/                         the stage's committed result, manifest.json last

Nothing here touches storage: these are names, computed the same way by the flow, the
tasks, the trainer processes and ``posttrain status``.
"""

from __future__ import annotations

from dataclasses import dataclass

CONFIG_NAME = "config.json"
"""The pipeline config a run was last started with (secrets excluded)."""

SUMMARY_NAME = "summary.json"
"""The run summary the flow writes at the end."""


def join_uri(base: str, *parts: str) -> str:
    """Join URI path parts with '/' (a ``pathlib.Path`` would mangle ``s3://``).

    Empty parts are skipped; slashes at the ends of each part are dropped.
    ``join_uri("s3://b/x/", "/runs", "r1")`` -> ``"s3://b/x/runs/r1"``.
    """
    out = base.rstrip("/")
    for p in parts:
        p = str(p).strip("/")
        if p:
            out = f"{out}/{p}"
    return out


@dataclass(frozen=True)
class StageLayout:
    """The files of one stage of one run.

    Attributes:
        output: the stage's output directory (``<run>/stages/<stage>``): a ``StageSpec``'s
            ``output_uri``.
    """

    output: str

    @property
    def final(self) -> str:
        """The committed result directory: ``<output>/final``."""
        return join_uri(self.output, "final")

    @property
    def checkpoints(self) -> str:
        """The directory holding ``step-XXXXXXXX`` checkpoints: ``<output>/checkpoints``."""
        return join_uri(self.output, "checkpoints")

    def artifact(self, name: str) -> str:
        """Another committed directory of the stage, e.g. DPO's ``<output>/reference``."""
        return join_uri(self.output, name)


@dataclass(frozen=True)
class RunLayout:
    """The files of one pipeline run.

    Attributes:
        root: ``storage.root`` (any fsspec URI; a local one should already be absolute, see
            ``trainer_core.config.resolve_local_root``).
        run_id: the pipeline run id.
    """

    root: str
    run_id: str

    @property
    def uri(self) -> str:
        """``<root>/runs/<run_id>``."""
        return join_uri(self.root, "runs", self.run_id)

    @property
    def config(self) -> str:
        """``<run>/config.json``."""
        return join_uri(self.uri, CONFIG_NAME)

    @property
    def summary(self) -> str:
        """``<run>/summary.json``."""
        return join_uri(self.uri, SUMMARY_NAME)

    def spec(self, stage: str) -> str:
        """``<run>/specs/<stage>.json``."""
        return join_uri(self.uri, "specs", f"{stage}.json")

    def stage(self, stage: str) -> StageLayout:
        """The layout of ``stage``: its output directory ``<run>/stages/<stage>``."""
        return StageLayout(join_uri(self.uri, "stages", stage))

    def final(self, stage: str) -> str:
        """``<run>/stages/<stage>/final``: where ``stage`` commits its result."""
        return self.stage(stage).final
