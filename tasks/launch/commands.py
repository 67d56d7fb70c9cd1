"""Command lines that run a stage's trainer (or any Python entry point) on a backend's ranks.

:func:`trainer_command` runs one plain process for the ``single`` backend and every other
backend under ``torchrun`` (one process per rank, c10d rendezvous: :func:`torchrun_args`) or
the ``deepspeed`` launcher (:func:`deepspeed_args`); :func:`launcher_command` builds the same
for any Python entry point. ``tasks/launch/process.py`` runs these commands.
"""

from __future__ import annotations

import socket
import sys

from trainer_core.config import BackendConfig


def torchrun_args(backend: BackendConfig, rdzv_id: str) -> list[str]:
    """The ``torchrun`` options (between ``torch.distributed.run`` and the entry point).

    c10d rendezvous at ``backend.rdzv_endpoint``; on one node without one, ``127.0.0.1:0``:
    the rendezvous store binds a free loopback port itself (what ``--standalone`` does), so
    no port is picked here and then raced for. ``torchrun`` ignores ``--node-rank`` for c10d
    (ranks are assigned at the rendezvous), so ``node_rank`` decides which node hosts the
    rendezvous store instead: node 0 (``--rdzv-conf is_host=true``), as the endpoint says.
    ``--max-restarts 0`` leaves retries to the Prefect task; ``--tee 3`` copies both streams
    of every rank to the console prefixed ``[default<local_rank>]:``.

    Args:
        backend: The stage's backend (``nnodes``, ``nproc_per_node``, ``node_rank``,
            ``rdzv_endpoint``).
        rdzv_id: Rendezvous id, the same on every node of the job.

    Returns:
        The options, as strings.
    """
    endpoint = backend.rdzv_endpoint or "127.0.0.1:0"
    is_host = "true" if backend.node_rank == 0 else "false"
    return [
        "--nnodes", str(backend.nnodes),
        "--nproc-per-node", str(backend.nproc_per_node),
        "--rdzv-backend", "c10d",
        "--rdzv-endpoint", endpoint,
        "--rdzv-id", rdzv_id,
        "--rdzv-conf", f"is_host={is_host}",
        "--max-restarts", "0",
        "--tee", "3",
    ]  # fmt: skip


def free_loopback_port() -> int:
    """A TCP port free on 127.0.0.1 right now (another process may take it before use)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def deepspeed_args(backend: BackendConfig) -> list[str]:
    """The ``deepspeed`` launcher's options for one node (DeepSpeed 0.19 ``launcher/runner.py``).

    ``--hostfile /dev/null`` keeps a stray ``/job/hostfile`` from turning the launch into a
    pdsh/ssh multi-node one; ``--no_local_rank`` keeps ``--local_rank=N`` out of the entry
    point's arguments (ranks read ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE`` from the environment).

    Args:
        backend: The stage's backend; ``rdzv_endpoint`` (if set) is the master address.

    Returns:
        The options, as strings.

    Raises:
        ValueError: ``backend.nnodes > 1``: the deepspeed launcher reaches other nodes over
            ssh with a hostfile; use ``launcher=torchrun`` (one worker per node) instead.
    """
    if backend.nnodes > 1:
        raise ValueError(
            f"backend.launcher=deepspeed runs on one node (got nnodes={backend.nnodes}); "
            "use backend.launcher=torchrun for multi-node stages"
        )
    if backend.rdzv_endpoint:
        host, _, port = backend.rdzv_endpoint.rpartition(":")
    else:
        host, port = "127.0.0.1", str(free_loopback_port())
    return [
        "--hostfile", "/dev/null",
        "--num_nodes", "1",
        "--num_gpus", str(backend.nproc_per_node),
        "--master_addr", host,
        "--master_port", port,
        "--no_local_rank",
    ]  # fmt: skip


def launcher_command(backend: BackendConfig, rdzv_id: str, entry: list[str]) -> list[str]:
    """The command that runs the Python entry point ``entry`` on ``backend``'s ranks.

    Args:
        backend: The stage's backend: ``single`` runs one plain process; any other runs under
            ``backend.launcher`` (even at world size 1, so the ranks see the same environment).
        rdzv_id: Rendezvous id (torchrun only).
        entry: ``["-m", module, *args]`` or ``[script.py, *args]``.

    Returns:
        The command line.

    Raises:
        ValueError: an empty ``entry``, or a launcher that cannot run ``backend`` (see
            :func:`deepspeed_args`).
    """
    if not entry:
        raise ValueError("empty entry point")
    if backend.name == "single":
        return [sys.executable, *entry]
    if backend.launcher == "deepspeed":
        target = ["--module", *entry[1:]] if entry[0] == "-m" else entry
        return [sys.executable, "-m", "deepspeed.launcher.runner", *deepspeed_args(backend), *target]
    return [sys.executable, "-m", "torch.distributed.run", *torchrun_args(backend, rdzv_id), *entry]


def trainer_command(spec_uri: str, backend: BackendConfig, rdzv_id: str) -> list[str]:
    """The command line that runs one stage described by the spec at ``spec_uri``.

    Args:
        spec_uri: URI of the stage's ``StageSpec`` JSON.
        backend: The stage's effective backend (``PipelineConfig.backend_for(stage)``).
        rdzv_id: Default rendezvous id (e.g. run id and stage); ``backend.rdzv_id`` wins when set.

    Returns:
        ``[python, "-m", "trainer_core.run", spec_uri]`` for the single backend; that entry
        point under ``torch.distributed.run`` or ``deepspeed.launcher.runner`` otherwise.

    Raises:
        ValueError: a launcher that cannot run ``backend`` (deepspeed launcher on several nodes).
    """
    return launcher_command(backend, backend.rdzv_id or rdzv_id, ["-m", "trainer_core.run", spec_uri])
