"""Training backends behind one Protocol (:class:`~trainer_core.backends.base.Backend`)."""

from __future__ import annotations

from trainer_core.backends.base import Backend
from trainer_core.config import BackendConfig


def build_backend(config: BackendConfig) -> Backend:
    """Construct the backend named by ``config.name`` (joins the process group if distributed).

    Raises:
        ConfigError: for a backend name this build does not provide, or a distributed
            backend started without a launcher.
    """
    from trainer_core.errors import ConfigError

    if config.name == "single":
        from trainer_core.backends.single import SingleDeviceBackend

        return SingleDeviceBackend(config)
    if config.name == "ddp":
        from trainer_core.backends.ddp import DDPBackend

        return DDPBackend(config)
    if config.name == "fsdp2":
        from trainer_core.backends.fsdp2 import FSDP2Backend

        return FSDP2Backend(config)
    if config.name == "deepspeed":
        from trainer_core.backends.deepspeed_zero import DeepSpeedBackend

        return DeepSpeedBackend(config)
    raise ConfigError(f"backend.name: unknown backend {config.name!r}")


__all__ = ["Backend", "build_backend"]
