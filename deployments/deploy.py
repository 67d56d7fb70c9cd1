"""``posttrain deploy``: register the deployments declared in ``deployments/prefect.yaml``.

Against the Prefect API at ``$PREFECT_API_URL`` it

1. reads the file and fills its ``{{ $VAR }}`` placeholders from the environment, with
   ``$POSTTRAIN_PROJECT_DIR`` defaulting to this checkout (the local pool's working directory)
   and ``$POSTTRAIN_MLFLOW_UI_URL`` to ``http://127.0.0.1:5000`` (the MLflow UI the local
   deployments' artifacts link to: their store is SQLite, which has no UI of its own);
2. resolves each selected deployment's default parameters as a flow run would, so a broken
   config is never registered, and fills its ``settings`` parameter with the config's values
   (and ``overrides`` with a no-op example), so the UI's Custom run form opens on the values a
   run will use (``flows/settings.py``);
3. creates the work pools (``posttrain.work_pools``) and global concurrency limits
   (``posttrain.concurrency_limits``) that the selected deployments use, when missing; existing
   ones are left as they are (they may have been tuned in the UI);
4. creates or updates each deployment with the flow's parameter schema, less the Python-only
   ``config`` parameter: the form is ``config_uri``, the typed ``settings``, ``overrides`` and
   ``run_id``, and the API rejects a run whose parameters do not match it.

Schedules are registered as the file declares them (inactive) unless ``--enable-schedule``.
"""

from __future__ import annotations

import inspect
import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, NoReturn

import typer
import yaml

from trainer_core.errors import EXIT_BAD_INPUT, ConfigError

if TYPE_CHECKING:
    from prefect import Flow
    from prefect.client.orchestration import SyncPrefectClient
    from prefect.deployments.runner import RunnerDeployment
    from prefect.schedules import Schedule

PREFECT_FILE = Path(__file__).with_name("prefect.yaml")
PROJECT_DIR = Path(__file__).resolve().parents[1]
PROJECT_DIR_ENV = "POSTTRAIN_PROJECT_DIR"
_SCHEDULE_KEYS = ("cron", "rrule", "timezone", "day_or", "parameters", "slug")


MLFLOW_UI_URL_ENV = "POSTTRAIN_MLFLOW_UI_URL"
"""The MLflow UI that Prefect's artifacts link to for a store without one (``tasks.report.views.MLFLOW_UI_URL_ENV``)."""
DEFAULT_MLFLOW_UI_URL = "http://127.0.0.1:5000"
"""Where ``mlflow ui`` serves by default (the docs' command for the local store, ``docs/guides/mlflow-server.md``)."""


@contextmanager
def _default_env() -> Iterator[None]:
    """For the duration, unless set already: ``$POSTTRAIN_PROJECT_DIR`` this checkout,
    ``$POSTTRAIN_MLFLOW_UI_URL`` :data:`DEFAULT_MLFLOW_UI_URL`."""
    defaults = {PROJECT_DIR_ENV: str(PROJECT_DIR), MLFLOW_UI_URL_ENV: DEFAULT_MLFLOW_UI_URL}
    added = [name for name in defaults if not os.environ.get(name)]
    os.environ.update({name: defaults[name] for name in added})
    try:
        yield
    finally:
        for name in added:
            os.environ.pop(name, None)


def load_prefect_file(path: Path = PREFECT_FILE) -> dict[str, Any]:
    """The file with its ``{{ $VAR }}`` placeholders filled from the environment.

    Raises:
        ConfigError: the file is not a mapping with a ``deployments`` list, or a placeholder
            names an unset variable.
    """
    from prefect.utilities.templating import apply_values, find_placeholders

    spec = yaml.safe_load(Path(path).read_text())
    if not isinstance(spec, dict) or not isinstance(spec.get("deployments"), list):
        raise ConfigError(f"{path}: expected a mapping with a 'deployments' list")
    with _default_env():
        resolved = apply_values(spec, dict(os.environ), remove_notset=False)
    unset = sorted(p.full_match for p in find_placeholders(json.dumps(resolved)))
    if unset:
        raise ConfigError(f"{path}: no value for {', '.join(unset)} (set the environment variables)")
    return resolved


def select_deployments(spec: dict[str, Any], names: list[str] | None) -> list[dict[str, Any]]:
    """The deployments called ``names`` (all when empty), in file order.

    Raises:
        ConfigError: a name the file does not declare.
    """
    entries = {d["name"]: d for d in spec["deployments"]}
    unknown = [n for n in names or [] if n not in entries]
    if unknown:
        raise ConfigError(f"unknown deployment(s) {unknown}; declared: {list(entries)}")
    return [e for n, e in entries.items() if not names or n in names]


def used_resources(spec: dict[str, Any], entries: list[dict[str, Any]]) -> tuple[dict[str, dict], dict[str, int]]:
    """Work pools (name -> declaration) and concurrency limits (name -> slots) that ``entries`` use.

    Raises:
        ConfigError: a deployment without a work pool, or naming a pool or limit that
            ``posttrain:`` does not declare.
    """
    from tasks.stages import GPU_CONCURRENCY_ENV

    declared = spec.get("posttrain") or {}
    pool_decls, limit_decls = declared.get("work_pools") or {}, declared.get("concurrency_limits") or {}
    pools: dict[str, dict] = {}
    limits: dict[str, int] = {}
    for entry in entries:
        pool = entry.get("work_pool") or {}
        where = f"deployment {entry['name']!r}"
        if pool.get("name") not in pool_decls:
            raise ConfigError(f"{where}: work pool {pool.get('name')!r} is not in posttrain.work_pools")
        pools[pool["name"]] = pool_decls[pool["name"]]
        limit = ((pool.get("job_variables") or {}).get("env") or {}).get(GPU_CONCURRENCY_ENV)
        if limit:
            if limit not in limit_decls:
                raise ConfigError(f"{where}: concurrency limit {limit!r} is not in posttrain.concurrency_limits")
            limits[limit] = int(limit_decls[limit])
    return pools, limits


OVERRIDES_EXAMPLE_KEY = "evaluate.generation.max_new_tokens"
"""The key of the example that ``overrides`` opens with in a deployment's form (the config's own
value, so the example changes nothing)."""

UI_HIDDEN_PARAMETERS = ("config", "sweep")
"""Flow parameters for Python callers only: left out of a deployment's form and schema."""


def deployment_parameters(flow: Flow, entry: dict[str, Any]) -> dict[str, Any]:
    """The deployment's default parameters: the file's, resolved as a flow run would resolve them
    (a relative ``config_uri`` is read from the pool's ``working_dir``, else this checkout, laid
    out as the image), plus ``settings`` holding the config's values, so that the Custom run form
    opens on the values a run will use; ``overrides`` keeps the file's overrides of keys the
    form does not show (or, when none, a no-op example).

    Raises:
        ConfigError: a parameter the flow does not take, or a config that does not validate.
    """
    from flows.settings import (
        flat_overrides,
        override_items,
        overrides_mapping,
        resolve_config,
        settings_of,
        settings_overrides,
    )

    params = dict(entry.get("parameters") or {})
    unknown = sorted(set(params) - set(inspect.signature(flow.fn).parameters))
    if unknown:
        raise ConfigError(f"deployment {entry['name']!r}: the flow takes no parameter(s) {unknown}")
    hidden = sorted(set(params) & set(UI_HIDDEN_PARAMETERS))
    if hidden:
        raise ConfigError(
            f"deployment {entry['name']!r}: parameter(s) {hidden} are for Python callers; "
            "use config_uri, settings and overrides"
        )
    uri = params.get("config_uri")
    if uri and "://" not in uri and not os.path.isabs(uri):
        job_variables = (entry.get("work_pool") or {}).get("job_variables") or {}
        uri = os.path.join(job_variables.get("working_dir") or PROJECT_DIR, uri)
    try:
        config = resolve_config(None, uri, params.get("overrides"), params.get("settings"))
    except ConfigError as e:
        raise ConfigError(f"deployment {entry['name']!r}: {e}") from None
    settings = settings_of(config)
    params["settings"] = settings.model_dump(mode="json")
    # What the form shows is the form's: an override of a form field would beat a value typed
    # there (and the flow refuses such a clash), so those keys live in settings only.
    shown = set(settings_overrides(settings))
    kept = {k: v for k, v in flat_overrides(overrides_mapping(params.get("overrides"))).items() if k not in shown}
    params["overrides"] = override_items(kept or {OVERRIDES_EXAMPLE_KEY: config.evaluate.generation.max_new_tokens})
    return params


def _referenced(node: Any) -> set[str]:
    """The names of the ``#/definitions/<name>`` references inside a JSON-schema node."""
    if isinstance(node, dict):
        refs = {node["$ref"].rsplit("/", 1)[-1]} if isinstance(node.get("$ref"), str) else set()
        return refs.union(*(_referenced(v) for v in node.values()))
    if isinstance(node, list):
        return set().union(*(_referenced(v) for v in node))
    return set()


def hide_parameters(schema: Any, names: tuple[str, ...] = UI_HIDDEN_PARAMETERS) -> None:
    """Drop ``names`` from a deployment's parameter schema (``ParameterSchema``) and the
    definitions only they used, in place."""
    for name in names:
        schema.properties.pop(name, None)
    schema.required = [r for r in schema.required if r not in names]
    keep, todo = set(), _referenced(schema.properties)
    while todo:
        name = todo.pop()
        if name not in keep and name in schema.definitions:
            keep.add(name)
            todo |= _referenced(schema.definitions[name])
    schema.definitions = {k: v for k, v in schema.definitions.items() if k in keep}


def editable_overrides(schema: Any) -> None:
    """Make ``overrides`` a list of ``key.path=value`` strings in a deployment's schema, in place.

    The flow also takes a mapping (Python callers); the schema's ``anyOf`` of a list, a free-form
    object and null rendered in Prefect's default (V2) form as a type toggle whose object branch
    cannot be edited. A list of strings is edited item by item in both UIs, and the API
    validates a run's parameters against it.
    """
    field = schema.properties.get("overrides")
    if field is None:
        return
    schema.properties["overrides"] = {
        key: field[key] for key in ("title", "description", "position") if key in field
    } | {"type": "array", "items": {"type": "string"}}


def schedule_of(item: dict[str, Any], enable: bool) -> Schedule:
    """A schedule of the file (``cron``, ``rrule`` or ``interval`` seconds); active if ``enable``."""
    from prefect.schedules import Schedule

    fields = {k: item[k] for k in _SCHEDULE_KEYS if k in item}
    if "interval" in item:
        fields["interval"] = timedelta(seconds=float(item["interval"]))
    return Schedule(**fields, active=enable or bool(item.get("active", True)))


def build_deployment(
    flow: Flow, entry: dict[str, Any], enable_schedule: bool, parameters: dict[str, Any] | None = None
) -> RunnerDeployment:
    """The ``RunnerDeployment`` of one file entry (module-path entrypoint, no pull steps), with
    ``parameters`` (default: the entry's) and a schema without :data:`UI_HIDDEN_PARAMETERS`.

    Raises:
        ConfigError: the entry's ``entrypoint`` is not the module path of ``flow``.
    """
    from prefect.deployments.runner import RunnerDeployment
    from prefect.types.entrypoint import EntrypointType

    pool = entry.get("work_pool") or {}
    deployment = RunnerDeployment.from_flow(
        flow,
        name=entry["name"],
        description=entry.get("description"),
        tags=list(entry.get("tags") or []),
        parameters=dict(parameters if parameters is not None else entry.get("parameters") or {}),
        schedules=[schedule_of(s, enable_schedule) for s in entry.get("schedules") or []],
        concurrency_limit=entry.get("concurrency_limit"),
        enforce_parameter_schema=entry.get("enforce_parameter_schema", True),
        work_pool_name=pool["name"],
        work_queue_name=pool.get("work_queue_name"),
        job_variables=dict(pool.get("job_variables") or {}),
        entrypoint_type=EntrypointType.MODULE_PATH,
    )
    # No public API narrows a deployment's schema: the form would otherwise show the whole
    # PipelineConfig, opened on the class defaults (see flows/settings.py).
    hide_parameters(deployment._parameter_openapi_schema)
    editable_overrides(deployment._parameter_openapi_schema)
    if deployment.entrypoint != entry["entrypoint"]:
        raise ConfigError(f"deployment {entry['name']!r}: entrypoint must be {deployment.entrypoint!r}")
    return deployment


def base_job_template(declared: dict[str, Any]) -> dict[str, Any]:
    """A pool's base job template: the declared JSON file, or Prefect's default for a process pool.

    Raises:
        ConfigError: a pool type other than process without a ``base_job_template`` file.
    """
    if declared.get("base_job_template"):
        return json.loads((PROJECT_DIR / declared["base_job_template"]).read_text())
    if declared.get("type") == "process":
        from prefect.workers.process import ProcessWorker

        return ProcessWorker.get_default_base_job_template()
    raise ConfigError(f"work pool type {declared.get('type')!r} needs a base_job_template file")


def ensure_work_pool(client: SyncPrefectClient, name: str, declared: dict[str, Any]) -> bool:
    """Create work pool ``name`` as declared unless it exists; True when created."""
    from prefect.client.schemas.actions import WorkPoolCreate
    from prefect.exceptions import ObjectNotFound

    try:
        client.read_work_pool(name)
        return False
    except ObjectNotFound:
        pass
    template = base_job_template(declared)
    client.create_work_pool(WorkPoolCreate(name=name, type=declared["type"], base_job_template=template))
    return True


def ensure_concurrency_limit(client: SyncPrefectClient, name: str, slots: int) -> bool:
    """Create global concurrency limit ``name`` with ``slots`` unless it exists; True when created."""
    from prefect.client.schemas.actions import GlobalConcurrencyLimitCreate
    from prefect.exceptions import ObjectNotFound

    try:
        client.read_global_concurrency_limit_by_name(name)
        return False
    except ObjectNotFound:
        client.create_global_concurrency_limit(GlobalConcurrencyLimitCreate(name=name, limit=slots))
        return True


def _fail(message: str) -> NoReturn:
    typer.secho(message, fg="red", err=True)
    raise typer.Exit(EXIT_BAD_INPUT)


def _check_api() -> None:
    """Exit (:func:`_fail`) unless $PREFECT_API_URL is set and a Prefect API answers there."""
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL

    url = PREFECT_API_URL.value()
    if not url:
        _fail("PREFECT_API_URL is not set: point it at a Prefect server, e.g. http://127.0.0.1:4200/api")
    with get_client(sync_client=True) as client:
        unreachable = client.api_healthcheck()
    if unreachable is not None:
        _fail(
            f"no Prefect API answers at {url} (PREFECT_API_URL): {type(unreachable).__name__}: {unreachable}. "
            "Start a server (prefect server start) or point PREFECT_API_URL at one"
        )


def deploy(
    names: Annotated[
        list[str] | None, typer.Option("--name", "-n", help="Register only this deployment (repeatable). Default: all.")
    ] = None,
    enable_schedule: Annotated[
        bool, typer.Option("--enable-schedule", help="Register the schedules active (the file has them inactive).")
    ] = False,
    prefect_file: Annotated[Path, typer.Option("--file", help="The deployments file.")] = PREFECT_FILE,
) -> None:
    """Register deployments/prefect.yaml's deployments with the Prefect API at $PREFECT_API_URL.

    Creates the work pools and concurrency limits they use when missing.
    """
    from prefect.client.orchestration import get_client
    from prefect.flows import load_flow_from_entrypoint

    _check_api()
    try:
        spec = load_prefect_file(prefect_file)
        entries = select_deployments(spec, names)
        pools, limits = used_resources(spec, entries)
        flows = {e["entrypoint"]: load_flow_from_entrypoint(e["entrypoint"]) for e in entries}
        deployments = [
            build_deployment(
                flows[e["entrypoint"]], e, enable_schedule, deployment_parameters(flows[e["entrypoint"]], e)
            )
            for e in entries
        ]
    except ConfigError as e:
        _fail(str(e))
    with get_client(sync_client=True) as client:
        for name, declared in pools.items():
            created = ensure_work_pool(client, name, declared)
            typer.echo(f"work pool {name} ({declared['type']}): {'created' if created else 'exists'}")
        for name, slots in limits.items():
            created = ensure_concurrency_limit(client, name, slots)
            typer.echo(f"concurrency limit {name}: {f'created, {slots} slot(s)' if created else 'exists'}")
    for deployment in deployments:
        deployment_id = deployment.apply()
        active = [s.active for s in deployment.schedules or []]
        schedules = f", schedules {'active' if all(active) else 'inactive'}" if active else ""
        typer.echo(
            f"deployment {deployment.flow_name}/{deployment.name}: {deployment_id} "
            f"(pool {deployment.work_pool_name}{schedules})"
        )
    for name in (n for n, declared in pools.items() if declared["type"] == "process"):
        typer.echo(f"run them with a worker: prefect worker start --pool {name}")
