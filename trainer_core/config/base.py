"""What every config section shares: strict pydantic models and a canonical hash."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Annotated, Any, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, create_model, model_serializer
from pydantic.fields import FieldInfo

ModelT = TypeVar("ModelT", bound=BaseModel)


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


class OverrideBase(ConfigBase):
    """A stage's partial override of a pipeline-wide section (:func:`override_of`): every field
    optional, unset meaning "inherit". Only the fields set count, as the keys of a mapping would:
    they are what :meth:`merged_over` sets and what a dump holds (an explicit null sets None where
    None is a value of the field), so a dump loads back to the same override."""

    @model_serializer(mode="wrap")
    def _set_fields_only(self, handler: Any) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if k in self.model_fields_set}

    def merged_over(self, base: ModelT, field: str) -> ModelT:
        """``base`` with the fields set here replaced, validated again as a whole; ``base`` itself
        when nothing is set.

        Raises:
            ValueError: the merged section is invalid (the message starts with ``field``).
        """
        if not self.model_fields_set:
            return base
        try:
            return type(base).model_validate({**base.model_dump(), **self.model_dump()})
        except ValidationError as e:
            raise ValueError(f"{field}: {e}") from None


def override_of(section: type[ConfigBase]) -> type[OverrideBase]:
    """The partial-override model of ``section``: its fields, each with its constraints and
    description but optional with default None (unset: inherit), unknown keys refused. The
    section's own validators judge the merged result (:meth:`OverrideBase.merged_over`), not the
    override alone."""
    fields: dict[str, Any] = {}
    for name, info in section.model_fields.items():
        optional = info.annotation | None
        annotation = Annotated[(optional, *info.metadata)] if info.metadata else optional
        fields[name] = (annotation, Field(None, description=info.description))
    return create_model(f"{section.__name__}Fields", __base__=OverrideBase, __module__=section.__module__, **fields)


def config_hash(obj: BaseModel | dict) -> str:
    """SHA-256 (hex, first 16 chars) of a config's canonical JSON (sorted keys, no spaces).

    Secrets (``SecretStr``) dump as ``**********``, so they never enter a hash.
    """
    data = obj.model_dump(mode="json") if isinstance(obj, BaseModel) else obj
    blob = json.dumps(data, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]
