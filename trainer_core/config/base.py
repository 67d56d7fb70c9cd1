"""What every config section shares: strict pydantic models and a canonical hash."""

from __future__ import annotations

import hashlib
import json

from pydantic import BaseModel, ConfigDict


class ConfigBase(BaseModel):
    """A config section: unknown keys are errors, and assignments are validated too."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)


def config_hash(obj: BaseModel | dict) -> str:
    """SHA-256 (hex, first 16 chars) of a config's canonical JSON (sorted keys, no spaces).

    Secrets (``SecretStr``) dump as ``**********``, so they never enter a hash.
    """
    data = obj.model_dump(mode="json") if isinstance(obj, BaseModel) else obj
    blob = json.dumps(data, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]
