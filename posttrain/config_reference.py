"""The configuration reference of the docs site, generated from the pydantic models.

:func:`config_reference_pages` writes one Markdown page per section of
:class:`~trainer_core.config.PipelineConfig` (``reference/config/<section>.md``) and an index
with the top-level fields: every field's dotted path, type, default, constraints and
description, read from the models themselves, so the reference cannot drift from the code. The
docs site's build hook (``docs/hooks.py``) adds the pages at build time; a test compares them
with :func:`field_paths`.

Paths: a nested model's fields under its field's path (``sft.lora.rank``); a list of models as
``field[]`` (``evaluate.gates[].metric``); a mapping of models as ``field.<name>``
(``backend.stages.<name>.nproc_per_node``).
"""

from __future__ import annotations

import json
import types
import typing
from typing import Any, Literal, Union

from annotated_types import Ge, Gt, Le, Lt, MaxLen, MinLen
from pydantic import BaseModel, SecretStr
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from trainer_core.config import PipelineConfig

REFERENCE_DIR = "reference/config"
"""Where the pages go in the docs site."""

_CONSTRAINTS = (
    (Ge, "ge", ">="),
    (Gt, "gt", ">"),
    (Le, "le", "<="),
    (Lt, "lt", "<"),
    (MinLen, "min_length", "min length"),
    (MaxLen, "max_length", "max length"),
)


def _models_in(annotation: Any) -> list[tuple[str, type[BaseModel]]]:
    """The pydantic models inside ``annotation`` and the path suffix each sits under: ``""`` (the
    model itself, or ``Model | None``), ``"[]"`` (a list of them), ``".<name>"`` (a mapping)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [("", annotation)]
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin in (Union, types.UnionType):
        return [found for arg in args for found in _models_in(arg)]
    if origin in (list, tuple, set) and args:
        return [("[]" + suffix, model) for suffix, model in _models_in(args[0])]
    if origin is dict and len(args) == 2:
        return [(".<name>" + suffix, model) for suffix, model in _models_in(args[1])]
    return []


def type_name(annotation: Any) -> str:
    """A readable type: ``int``, ``float | None``, ``list[str]``, ``'sigmoid' | 'ipo'``, a model's class name."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is Literal:
        return " | ".join(json.dumps(a) for a in args)
    if origin in (Union, types.UnionType):
        return " | ".join(type_name(a) for a in args)
    if origin is typing.Annotated:
        return type_name(args[0])
    if origin is not None:
        name = getattr(origin, "__name__", str(origin))
        return f"{name}[{', '.join(type_name(a) for a in args)}]" if args else name
    if annotation is type(None):
        return "None"
    return getattr(annotation, "__name__", str(annotation))


def _default(field: FieldInfo) -> str:
    """The field's default as JSON (a default factory called; a model's default abbreviated)."""
    if field.is_required():
        return "required"
    value = field.default if field.default_factory is None else field.default_factory()
    if value is PydanticUndefined:
        return "required"
    if isinstance(value, SecretStr):
        return "(secret)"
    if isinstance(value, BaseModel):
        return "(the section's defaults)"
    text = json.dumps(value, default=str)
    return text if len(text) <= 60 else text[:57] + "..."


def _constraints(field: FieldInfo) -> str:
    parts = []
    for meta in field.metadata:
        for kind, attr, symbol in _CONSTRAINTS:
            if isinstance(meta, kind):
                parts.append(f"{symbol} {getattr(meta, attr)}")
    return ", ".join(parts)


def _rows(model: type[BaseModel], prefix: str, seen: tuple[type, ...] = ()) -> list[tuple[str, FieldInfo]]:
    """(dotted path, field) of every field of ``model`` under ``prefix``, nested models' fields
    after their own row (a model met again inside itself is not descended into)."""
    rows = []
    for name, field in model.model_fields.items():
        path = f"{prefix}{name}"
        rows.append((path, field))
        for suffix, nested in _models_in(field.annotation):
            if nested not in seen:
                rows += _rows(nested, f"{path}{suffix}.", (*seen, model))
    return rows


def field_paths(model: type[BaseModel] = PipelineConfig) -> set[str]:
    """Every field's dotted path in ``model`` (as the reference pages list them)."""
    return {path for path, _ in _rows(model, "")}


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _table(rows: list[tuple[str, FieldInfo]]) -> list[str]:
    lines = ["| field | type | default | constraints | description |", "| --- | --- | --- | --- | --- |"]
    for path, field in rows:
        lines.append(
            f"| `{path}` | `{_cell(type_name(field.annotation))}` | `{_cell(_default(field))}` | "
            f"{_cell(_constraints(field))} | {_cell(field.description or '')} |"
        )
    return lines


def config_reference_pages() -> dict[str, str]:
    """``{"reference/config/index.md": ..., "reference/config/<section>.md": ...}``: the index
    (the top-level fields, and a link to each section's page) and a page per section."""
    pages: dict[str, str] = {}
    top, sections = [], []
    for name, field in PipelineConfig.model_fields.items():
        found = _models_in(field.annotation)
        if not found:
            top.append((name, field))
            continue
        sections.append(name)
        model = found[0][1]
        doc = (model.__doc__ or "").strip().split("\n\n")[0].replace("\n", " ")
        lines = [
            f"# `{name}`",
            "",
            field.description or "",
            "",
            doc,
            "",
            f"Set any field in YAML under `{name}:`, or on the command line with `--set {name}.<field>=<value>`.",
            "",
            *_table(_rows(model, f"{name}.")),
        ]
        pages[f"{REFERENCE_DIR}/{name}.md"] = "\n".join(lines) + "\n"
    index = [
        "# Configuration reference",
        "",
        "Every field of the pipeline's configuration (`trainer_core.config.PipelineConfig`), generated from "
        "the pydantic models when the site is built: its dotted path, type, default, constraints and "
        "description. A YAML config sets them by nesting; `posttrain run --set key.path=value` (the value "
        "read as YAML) overrides one; `posttrain validate CONFIG` prints a resolved config.",
        "",
        "## Top-level fields",
        "",
        *_table(top),
        "",
        "## Sections",
        "",
    ]
    index += [
        f"- [`{name}`]({name}.md): {_cell(PipelineConfig.model_fields[name].description or '')}" for name in sections
    ]
    pages[f"{REFERENCE_DIR}/index.md"] = "\n".join(index) + "\n"
    return pages
