"""Training backends behind one Protocol (:class:`~trainer_core.backends.base.Backend`)."""

from __future__ import annotations

from trainer_core.backends.base import Backend
from trainer_core.config import BackendConfig


def build_backend(config: BackendConfig) -> Backend:
    """Construct the backend named by ``config.name``.

    Raises:
        ConfigError: for a backend name this build does not provide.
    """
    from trainer_core.errors import ConfigError

    if config.name == "single":
        from trainer_core.backends.single import SingleDeviceBackend

        return SingleDeviceBackend(config.device)
    raise ConfigError(f"backend.name: unknown backend {config.name!r}")


__all__ = ["Backend", "build_backend"]
