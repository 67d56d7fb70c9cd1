"""Objects named by import path in a config field (a reward function, a tool environment, a tool)."""

from __future__ import annotations

import importlib
from typing import Any

from trainer_core.errors import ConfigError


def import_object(path: str, field: str, kind: str = "name") -> Any:
    """The object at import path ``package.module:attr`` (``attr`` may be dotted: a class's
    attribute), for the config field ``field``.

    Raises:
        ConfigError: naming ``field=path``: a path that is not ``package.module:<kind>``, a module
            that cannot be imported (or raises on import), a missing attribute.
    """
    where = f"{field}={path!r}"
    module_name, sep, attr = path.partition(":")
    if not sep or not module_name or not attr:
        raise ConfigError(f"{where} must be 'package.module:{kind}'")
    try:
        obj: Any = importlib.import_module(module_name)
    except Exception as exc:
        raise ConfigError(f"{where}: cannot import module {module_name!r} ({type(exc).__name__}: {exc})") from exc
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ConfigError(f"{where}: module {module_name!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    return obj
