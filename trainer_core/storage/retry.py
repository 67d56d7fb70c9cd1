"""The retry policy of every storage operation (``trainer_core/storage/fs.py``), and what an
operation that gave up was doing.

Transient failures (connection refused or reset, timeouts, S3 5xx answers: :func:`is_transient`)
are retried with exponential backoff: up to :data:`RETRY_ATTEMPTS` attempts over about
:data:`RETRY_MAX_DELAY_S` seconds. Missing files, permission errors and other bad input fail at
once. An operation that gives up on a transient error re-raises it unchanged with
``storage_failure`` attached (:class:`~trainer_core.errors.StorageFailure`: what it was doing,
the URI, the S3 endpoint), which :func:`~trainer_core.errors.classify` turns into a
:class:`~trainer_core.errors.StorageUnavailable` naming them: one line, where a traceback of
botocore's and aiohttp's frames said less.
"""

from __future__ import annotations

import errno
import inspect
import logging
import os
import sys
from typing import Any, Callable, TypeVar
from urllib.parse import urlsplit

import fsspec
import fsspec.config
from tenacity import (
    RetryCallState,
    before_sleep_log,
    retry,
    retry_if_exception,
    stop_after_attempt,
    stop_after_delay,
    wait_exponential,
)

from trainer_core.errors import StorageFailure

logger = logging.getLogger(__name__)

RETRY_ATTEMPTS = 6
"""Attempts (first try included) of a storage operation that keeps failing transiently."""

RETRY_MAX_DELAY_S = 30.0
"""Stop retrying once this many seconds have passed since the first attempt."""

_TRANSIENT_ERRNOS = frozenset(
    {
        errno.EIO,
        getattr(errno, "EREMOTEIO", errno.EIO),
        errno.ETIMEDOUT,
        errno.ECONNRESET,
        errno.ECONNREFUSED,
        errno.ECONNABORTED,
        errno.EAGAIN,
        errno.EPIPE,
        errno.EHOSTUNREACH,
        errno.ENETUNREACH,
        errno.ENETDOWN,
    }
)
_PERMANENT_ERRORS = (
    FileNotFoundError,
    FileExistsError,
    PermissionError,
    IsADirectoryError,
    NotADirectoryError,
)

_F = TypeVar("_F", bound=Callable[..., Any])


def _transient_types() -> tuple[type[BaseException], ...]:
    """The network error types worth a retry: the builtins, and botocore's and aiohttp's where
    they are imported. An exception of theirs can only exist once its module is imported, so
    this looks in ``sys.modules`` instead of importing them (~0.4 s a process that never uses S3)."""
    types: list[type[BaseException]] = [ConnectionError, TimeoutError]
    if (botocore := sys.modules.get("botocore.exceptions")) is not None:
        types += [botocore.ConnectionError, botocore.HTTPClientError]
    if (aiohttp := sys.modules.get("aiohttp")) is not None:
        types.append(aiohttp.ClientError)
    return tuple(types)


def is_transient(exc: BaseException) -> bool:
    """Whether ``exc`` is worth retrying: a network failure, a timeout or a server-side error.

    ``FileNotFoundError``, ``PermissionError`` and the other "bad input" ``OSError``
    subclasses are never transient.
    """
    if isinstance(exc, _PERMANENT_ERRORS):
        return False
    if isinstance(exc, _transient_types()):
        return True
    return isinstance(exc, OSError) and exc.errno in _TRANSIENT_ERRNOS


_AWS_S3 = "https://s3.amazonaws.com"
"""The endpoint named when nothing else says which one botocore used."""

_ACTIONS = {
    "write_bytes": "writing",
    "upload_file_hashed": "writing",
    "_copy_file": "copying to",
    "read_bytes": "reading",
    "sha256_uri": "reading",
    "_download_file": "downloading",
    "exists": "checking",
    "list_dirs": "listing",
    "list_files": "listing",
    "_remove": "removing",
}
"""What each retried operation does to the URI it names (for the message of an outage)."""


def _s3_endpoint(fs: fsspec.AbstractFileSystem, exc: BaseException) -> str | None:
    """The S3 endpoint an operation on ``fs`` talked to: the one in botocore's error (its request
    URL's scheme and host), else the filesystem's or the process's setting, else AWS's global
    endpoint. None when ``fs`` is not S3."""
    if "s3" not in (fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,)):
        return None
    url = (getattr(exc, "kwargs", None) or {}).get("endpoint_url") or getattr(fs, "endpoint_url", None)
    url = url or fsspec.config.conf.get("s3", {}).get("endpoint_url")
    url = url or os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL") or _AWS_S3
    parts = urlsplit(url)
    return f"{parts.scheme}://{parts.netloc}" if parts.scheme and parts.netloc else url


def _failure(state: RetryCallState, exc: BaseException) -> StorageFailure:
    """What the operation of ``state`` was doing: its action, URI and endpoint."""
    name = getattr(state.fn, "__name__", "")
    try:
        args = inspect.signature(state.fn).bind(*state.args, **state.kwargs).arguments
    except TypeError:
        args = {}
    fs = args.get("fs")
    uri = args.get("uri") or args.get("target") or args.get("path") or "?"
    if fs is None:
        try:
            fs = fsspec.core.url_to_fs(uri)[0]
        except Exception:  # noqa: BLE001 - only for the message
            fs = None
    else:
        uri = fs.unstrip_protocol(uri)
    endpoint = _s3_endpoint(fs, exc) if fs is not None else None
    return StorageFailure(
        _ACTIONS.get(name, name.strip("_") or "using"),
        str(uri),
        endpoint,
        state.attempt_number,
        state.seconds_since_start or 0.0,
    )


def _give_up(state: RetryCallState) -> Any:
    """Re-raise the last transient error once the retries are spent, with ``storage_failure``
    attached (see the module docstring)."""
    exc = state.outcome.exception()
    try:
        exc.storage_failure = _failure(state, exc)
    except Exception:  # noqa: BLE001 - a message detail must never hide the error itself
        pass
    raise exc


def retrying(func: _F) -> _F:
    """Decorate a storage operation with the module's retry policy (tenacity)."""
    return retry(  # type: ignore[return-value]
        retry=retry_if_exception(is_transient),
        stop=stop_after_attempt(RETRY_ATTEMPTS) | stop_after_delay(RETRY_MAX_DELAY_S),
        wait=wait_exponential(multiplier=1.0, min=1.0, max=10.0),
        before_sleep=before_sleep_log(logger, logging.WARNING),
        retry_error_callback=_give_up,
        reraise=True,
    )(func)


class _AbandonedRequestFilter(logging.Filter):
    """asyncio's report of a task whose network error nobody retrieved, made one line.

    When an endpoint goes away in the middle of a request, aiohttp can leave the task writing the
    request body with a connection error no one awaits; asyncio then logs "Task exception was
    never retrieved" with its traceback. The operation that made the request fails on its own,
    and is retried and reported by this module: the task's error is one warning, no traceback.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if exc is not None and is_transient(exc):
            first = record.getMessage().split("\n", 1)[0]
            record.msg = (
                f"{first} (an abandoned storage request; its operation is retried): {type(exc).__name__}: {exc}"
            )
            record.args, record.exc_info, record.exc_text = None, None, None
            record.levelno, record.levelname = logging.WARNING, "WARNING"
        return True


def quiet_abandoned_requests() -> None:
    """Install :class:`_AbandonedRequestFilter` on the ``asyncio`` logger (once per process)."""
    asyncio_log = logging.getLogger("asyncio")
    if not any(isinstance(f, _AbandonedRequestFilter) for f in asyncio_log.filters):
        asyncio_log.addFilter(_AbandonedRequestFilter())
