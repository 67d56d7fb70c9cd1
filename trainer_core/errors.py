"""The error taxonomy: what went wrong, what it means for a retry, and the exit code that says so.

Three kinds of failure, one exit code each (a trainer process exits with it; the stage task
decides on a retry from it; the CLI maps the pipeline's outcome to it):

| kind | exit | retried | examples |
| --- | --- | --- | --- |
| bad input (:class:`PosttrainError` and subclasses but :class:`ResourceError`) | 2 | never | a config value, a malformed data file, a missing model, missing credentials, a permission, a diverged run, an engine serving stale weights |
| resource (:class:`ResourceError`) | 3 | never blindly | disk full (with the path), out of memory (with the stage and batch size) |
| transient (:class:`StorageUnavailable`, :class:`EngineUnavailable`, anything else) | 1 | yes | storage unreachable after its retries (naming the endpoint and URI), a generation server gone, a network error, throttling, a killed process, a crash |
| quality gate (``tasks.report.gates.QualityGateFailed``) | 4 | no (the run completed) | the final policy scored below a gate: not made champion |

Every message names its input: the file and line, the URI, or the config field. Code that knows
the input raises one of these itself; :func:`classify` maps the library exceptions that escape
without one (``ENOSPC``, out of memory, a permission, missing S3 credentials, a storage outage)
in one place.
"""

from __future__ import annotations

import errno
import tempfile
from dataclasses import dataclass
from urllib.parse import urlsplit

EXIT_FAILED = 1
"""Process exit code of a crash or a transient failure (a retry may fix it)."""

EXIT_BAD_INPUT = 2
"""Process exit code for bad config, data, model source, credentials or permissions (never retried)."""

EXIT_RESOURCE = 3
"""Process exit code for an exhausted resource: disk full, out of memory (not retried blindly)."""

EXIT_GATE_FAILED = 4
"""``posttrain run`` exit code when every stage completed but a quality gate failed."""


class PosttrainError(Exception):
    """Base class of the project's own errors: bad input unless a subclass says otherwise."""

    exit_code = EXIT_BAD_INPUT


class ConfigError(PosttrainError, ValueError):
    """A configuration value is invalid; the message names the field path."""


class DataError(PosttrainError, ValueError):
    """An input record or file is malformed; the message names the file and line."""


class NonFiniteError(PosttrainError, ArithmeticError):
    """Training produced NaN or infinity (loss, gradient norm, rewards, advantages, weights).

    The message names the stage, the global step and the metric; nothing of that step is
    committed. A retry would diverge again from the same checkpoint: it is bad input (usually a
    learning rate, a warmup, or data), not retried.
    """


class ResourceError(PosttrainError):
    """A resource ran out: disk space (the message names the path) or memory (the stage and
    batch size, and what to lower). Retrying the same thing would fail the same way."""

    exit_code = EXIT_RESOURCE


class StorageUnavailable(PosttrainError):
    """Storage did not answer (connection refused, reset or timed out, a 5xx) through all of the
    storage layer's retries; the message names the endpoint and the URI being read or written.
    Transient: a retry (or ``posttrain resume``) once the service is back goes on from the last
    committed checkpoint."""

    exit_code = EXIT_FAILED


class EngineUnavailable(PosttrainError):
    """A generation engine's server stopped answering mid-stage (connection refused, reset or
    timed out; its process gone); the message names the engine, its URL and what was being done.
    Transient: a retry (or ``posttrain resume``) starts or reaches the server again and goes on
    from the last committed checkpoint."""

    exit_code = EXIT_FAILED


class EngineStateError(PosttrainError):
    """A generation engine serves weights other than the policy's: after a weight sync its
    log-probs of the sampled tokens differ from the trainer's beyond the configured bound. The
    message names the engine, the global step and both numbers; nothing of that step is
    committed. Not retried: training on them would be off-policy in silence, and a retry meets
    the same engine (its weight sync, its version, its dtype) again."""


@dataclass(frozen=True)
class StorageFailure:
    """What a storage operation was doing when it gave up on a transient error: attached to that
    exception as ``exc.storage_failure`` by ``trainer_core/storage/fs.py`` (the exception itself
    is re-raised unchanged), read by :func:`classify`.

    Attributes:
        action: what it was doing (``"writing"``, ``"reading"``, ``"listing"``, ...).
        uri: the URI it was reading or writing.
        endpoint: the service's endpoint URL (an S3 endpoint), or None for a filesystem.
        attempts: attempts made, the first included.
        elapsed_s: seconds from the first attempt to giving up.
    """

    action: str
    uri: str
    endpoint: str | None
    attempts: int
    elapsed_s: float


def _storage_unavailable(exc: BaseException, prefix: str) -> StorageUnavailable | None:
    """The outage a storage operation gave up on (in ``exc`` or what it was raised from), or a
    botocore connection error that reached here by another way (naming the request's URL)."""
    cause: BaseException | None = exc
    while cause is not None and not isinstance(getattr(cause, "storage_failure", None), StorageFailure):
        cause = cause.__cause__
    advice = "a transient outage: resume the run once it answers (committed checkpoints are kept)"
    if cause is not None:
        failure = cause.storage_failure
        service = f"the S3 endpoint {failure.endpoint}" if failure.endpoint else "storage"
        return StorageUnavailable(
            f"{prefix}{service} did not answer: {failure.action} {failure.uri} failed after {failure.attempts} "
            f"attempt(s) over {failure.elapsed_s:.0f} s ({type(cause).__name__}: {str(cause)[:300]}); {advice}"
        )
    url = (getattr(exc, "kwargs", None) or {}).get("endpoint_url") if _is_botocore_connection_error(exc) else None
    if not isinstance(url, str):
        return None
    parts = urlsplit(url)
    return StorageUnavailable(
        f"{prefix}the S3 endpoint {parts.scheme}://{parts.netloc} did not answer: {url} "
        f"({type(exc).__name__}); {advice}"
    )


def _is_botocore_connection_error(exc: BaseException) -> bool:
    """botocore's "could not connect", "connect timeout", "read timeout" and "connection closed"
    errors (without importing botocore: an exception of its can only exist once it is imported)."""
    names = {"botocore.exceptions.ConnectionError", "botocore.exceptions.HTTPClientError"}
    return any(f"{t.__module__}.{t.__name__}" in names for t in type(exc).__mro__)


def _is_oom(exc: BaseException) -> bool:
    if isinstance(exc, MemoryError):
        return True
    name, text = type(exc).__name__, str(exc).lower()
    return name == "OutOfMemoryError" or (
        isinstance(exc, RuntimeError) and ("out of memory" in text or "can't allocate memory" in text)
    )


def _is_no_credentials(exc: BaseException) -> bool:
    return type(exc).__name__ in ("NoCredentialsError", "PartialCredentialsError", "NoAuthTokenError")


def classify(exc: BaseException, *, where: str = "") -> PosttrainError | None:
    """The taxonomy error for a library exception that escaped without one, or None (transient).

    Args:
        exc: the exception.
        where: what was being done, for the message (e.g. ``"stage sft"``).

    Returns:
        A :class:`ResourceError` for ``ENOSPC`` / ``EDQUOT`` (naming the file when the OS did)
        and for out-of-memory errors; a :class:`ConfigError` for a permission error and for
        missing S3 credentials; a :class:`StorageUnavailable` (transient, naming the endpoint and
        URI) for a storage operation that gave up on a transient error; None for anything else
        (a retry may help).
    """
    prefix = f"{where}: " if where else ""
    if isinstance(exc, PosttrainError):
        return exc
    if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
        # a write() on an open file names none: say where this process writes files
        path = exc.filename or (
            f"a file (under storage.root, or the temporary directory {tempfile.gettempdir()} that TMPDIR names)"
        )
        return ResourceError(
            f"{prefix}disk full (or quota exceeded) writing {path}: free space there, or point "
            "storage.root (and TMPDIR) at a larger volume"
        )
    if _is_oom(exc):
        return ResourceError(
            f"{prefix}out of memory ({type(exc).__name__}: {str(exc)[:300]}); lower the stage's "
            "micro_batch_size (keep the global batch with grad_accum_steps or global_batch_size), "
            "max_length_tokens, or the generation batch size"
        )
    if isinstance(exc, PermissionError):
        return ConfigError(f"{prefix}permission denied: {exc.filename or exc}")
    if _is_no_credentials(exc):
        return ConfigError(
            f"{prefix}no S3 credentials ({type(exc).__name__}): set storage.access_key_id and "
            "storage.secret_access_key, or AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY"
        )
    return _storage_unavailable(exc, prefix)
