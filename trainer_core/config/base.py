"""What every config section shares: strict pydantic models and a canonical hash."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict
from pydantic.fields import FieldInfo


class ConfigBase(BaseModel):
    """A config section: unknown keys are errors, and assignments are validated too."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)


@dataclass(frozen=True)
class Neutral:
    """Field metadata (``Annotated[T, Neutral(value)]``): the value of a field added after runs
    were committed that reproduces the earlier behaviour. The stage fingerprint hashes the field
    only when it is set to something else (:mod:`trainer_core.fingerprint`), so the fingerprints
    of runs committed before the field existed, and their resume, are unchanged. A field added
    from now on is declared with its neutral value; removing the marker from a field changes
    earlier fingerprints.
    """

    value: Any


def neutral_of(field: FieldInfo) -> tuple[bool, Any]:
    """(whether ``field`` declares a :class:`Neutral` value, that value)."""
    for meta in field.metadata:
        if isinstance(meta, Neutral):
            return True, meta.value
    return False, None


def config_hash(obj: BaseModel | dict) -> str:
    """SHA-256 (hex, first 16 chars) of a config's canonical JSON (sorted keys, no spaces).

    Secrets (``SecretStr``) dump as ``**********``, so they never enter a hash.
    """
    data = obj.model_dump(mode="json") if isinstance(obj, BaseModel) else obj
    blob = json.dumps(data, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]
