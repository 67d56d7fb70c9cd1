"""The console side of Prefect's logging, made fit for the messages posttrain prints.

Prefect's console handler renders log messages with rich, whose emoji codes turn a
``file.jsonl:100:`` location into ``file.jsonl💯``, and it prints the full traceback of every
failed task and flow before the message that explains it. :class:`PlainConsoleHandler` is the
same handler with emoji codes off and, for the failures posttrain already explains (a stage's
:class:`~tasks.launch.failures.StageFailed` with the trainer's own error, a
:class:`~trainer_core.errors.PosttrainError` naming its input), one line instead of the
traceback and the exception's repr; a raw storage error that gave up on an outage is shown as the
:class:`~trainer_core.errors.StorageUnavailable` it classifies as (the endpoint and the URI), in
one line too. Prefect's API log handler is untouched: the Prefect UI keeps
every traceback (the debug record).
"""

from __future__ import annotations

import logging

from prefect.logging.configuration import PROCESS_LOGGING_CONFIG
from prefect.logging.handlers import PrefectConsoleHandler, PrefectConsoleHighlighter
from prefect.settings import PREFECT_LOGGING_COLORS, PREFECT_LOGGING_MARKUP
from rich.console import Console
from rich.highlighter import NullHighlighter
from rich.theme import Theme

from tasks.launch.failures import LaunchAborted, StageFailed
from trainer_core.errors import PosttrainError, StorageUnavailable, classify

EXPLAINED = (StageFailed, LaunchAborted, PosttrainError)
"""Failures whose message already says what went wrong: shown without their traceback."""

_MAX_CHARS = 300


class PlainConsoleHandler(PrefectConsoleHandler):
    """``PrefectConsoleHandler`` without emoji codes, and without tracebacks for :data:`EXPLAINED` failures."""

    def __init__(self, stream=None, highlighter=PrefectConsoleHighlighter, styles=None, level=logging.NOTSET):
        super().__init__(stream=stream, highlighter=highlighter, styles=styles, level=level)
        colors = PREFECT_LOGGING_COLORS.value()
        self.console = Console(
            highlighter=highlighter() if colors else NullHighlighter(),
            theme=Theme(styles or {}, inherit=False) if colors else Theme(inherit=False),
            file=self.stream,
            markup=PREFECT_LOGGING_MARKUP.value(),
            emoji=False,
        )

    def emit(self, record: logging.LogRecord) -> None:
        error = record.exc_info[1] if record.exc_info else None
        text = record.getMessage()
        outage = classify(error) if isinstance(error, Exception) and not isinstance(error, EXPLAINED) else None
        if isinstance(outage, StorageUnavailable):  # a raw storage error: the service and URI, not the frames
            record = logging.makeLogRecord(record.__dict__)
            record.msg, record.args = f"{text.split(':', 1)[0]}: {outage}", None
            record.exc_info = record.exc_text = None
        elif isinstance(error, EXPLAINED) or any(
            name.__name__ in text for name in (StageFailed, *StageFailed.__subclasses__())
        ):
            record = logging.makeLogRecord(record.__dict__)
            first = text.split("\n", 1)[0]
            record.msg, record.args = (
                (first[:_MAX_CHARS] + (" [...]" if len(first) > _MAX_CHARS or "\n" in text else "")),
                None,
            )
            record.exc_info = record.exc_text = None
        super().emit(record)


def use_plain_console() -> int:
    """Swap every ``PrefectConsoleHandler`` of the logging tree for a :class:`PlainConsoleHandler`
    on the same stream, level and formatter; returns how many were swapped (idempotent)."""
    loggers = [logging.getLogger()] + [
        logger for logger in logging.Logger.manager.loggerDict.values() if isinstance(logger, logging.Logger)
    ]
    swapped = 0
    for logger in loggers:
        for i, handler in enumerate(logger.handlers):
            if type(handler) is PrefectConsoleHandler:
                styles = PROCESS_LOGGING_CONFIG.get("handlers", {}).get("console", {}).get("styles")
                plain = PlainConsoleHandler(stream=handler.stream, styles=styles, level=handler.level)
                plain.setFormatter(handler.formatter)
                plain.filters = list(handler.filters)
                logger.handlers[i] = plain
                swapped += 1
    return swapped
