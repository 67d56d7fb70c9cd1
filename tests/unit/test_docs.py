"""The docs site (``mkdocs.yml``, ``docs/``) and the README: the site builds with ``--strict`` (no
broken link, reference or docstring), the configuration reference lists every field of the
config, the README stays short, and every ``posttrain`` command the README and the docs show is
one the CLI accepts as written (its subcommand, options and arguments), every ``make`` target
one the Makefile has, every config file one that exists."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import BaseModel
from typer.main import get_command

from posttrain.cli import app
from posttrain.config_reference import config_reference_pages, field_paths
from trainer_core.config import PipelineConfig

REPO = Path(__file__).resolve().parents[2]
DOCS = REPO / "docs"
PAGES = [REPO / "README.md", *sorted(DOCS.rglob("*.md"))]
FENCE = re.compile(r"```(?:bash|sh|console)\n(.*?)```", re.S)


def test_the_configuration_reference_lists_every_field_of_the_config():
    pages = config_reference_pages()
    sections = [
        name
        for name, f in PipelineConfig.model_fields.items()
        if isinstance(f.annotation, type) and issubclass(f.annotation, BaseModel)
    ]
    assert set(pages) == {f"reference/config/{s}.md" for s in sections} | {"reference/config/index.md"}
    text = "\n".join(pages.values())
    missing = sorted(p for p in field_paths() if p not in sections and f"| `{p}` |" not in text)
    assert not missing, missing
    assert all(f"[`{s}`]({s}.md)" in pages["reference/config/index.md"] for s in sections)
    assert len(field_paths()) > 400
    dpo = pages["reference/config/dpo.md"]
    assert "| `dpo.beta` | `float` | `0.1` | > 0 |" in dpo
    assert "| `evaluate.gates[].metric` | `str` | `required` |" in pages["reference/config/evaluate.md"]
    assert "| `sweep.grid` | `dict[str, list[Any]]` | `{}` |" in pages["reference/config/sweep.md"]


def test_the_site_builds_strict(tmp_path):
    site = tmp_path / "site"
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
        env={"NO_MKDOCS_2_WARNING": "1", "PATH": "/usr/bin:/bin"},
    )
    assert result.returncode == 0, result.stderr[-5000:]
    assert (site / "reference" / "config" / "dpo" / "index.html").is_file()
    api = (site / "reference" / "api" / "index.html").read_text()
    assert "group_advantages" in api and "Raises" in api  # docstrings rendered by mkdocstrings
    assert (site / "guides" / "sweeps" / "index.html").is_file()


def test_the_readme_is_short():
    lines = (REPO / "README.md").read_text().splitlines()
    assert len(lines) < 150, len(lines)


def _commands(page: Path) -> list[list[str]]:
    """The shell commands of a page's bash blocks (continuations joined, comments dropped)."""
    out = []
    for block in FENCE.findall(page.read_text()):
        for line in block.replace("\\\n", " ").splitlines():
            try:
                words = shlex.split(line, comments=True)
            except ValueError:
                continue
            while words and re.fullmatch(r"[A-Z_]+=\S*", words[0]):  # VAR=value before the command
                words = words[1:]
            if words:
                out.append(words)
    return out


def _check_posttrain(words: list[str]) -> None:
    group = get_command(app)
    name, args = words[1], words[2:]
    with group.make_context("posttrain", [name]) as ctx:
        command = group.get_command(ctx, name)
        assert command is not None, f"no posttrain command {name!r}"
        command.make_context(name, list(args), parent=ctx)  # raises on an unknown option or a missing argument


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_the_commands_shown_are_ones_that_run(page):
    targets = set(re.findall(r"^([a-z][a-z-]*):", (REPO / "Makefile").read_text(), re.M))
    for words in _commands(page):
        program = Path(words[0]).name
        if program == "posttrain":
            _check_posttrain(words)
        elif program == "make":
            named = [w for w in words[1:] if not w.startswith("-") and "=" not in w]
            assert set(named) <= targets, (page.name, words)
        for word in words:
            if re.fullmatch(r"configs/[\w.-]+\.yaml", word):
                assert (REPO / word).is_file(), (page.name, word)
