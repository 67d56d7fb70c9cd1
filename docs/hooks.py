"""MkDocs hook of the docs site (``mkdocs.yml``: ``hooks``): adds the configuration reference,
generated from the pydantic models at build time (``posttrain/config_reference.py``), so it
cannot drift from the code."""

from __future__ import annotations

from mkdocs.structure.files import File, Files

from posttrain.config_reference import REFERENCE_DIR, config_reference_pages

_INDEX = f"{REFERENCE_DIR}/index.md"


def on_config(config):
    """Replace the nav entry of the configuration reference's index by the index and one entry
    per section (so a new config section gets its page in the nav without editing mkdocs.yml)."""
    sections = [{path.rsplit("/", 1)[1][:-3]: path} for path in config_reference_pages() if path != _INDEX]

    def expand(items):
        out = []
        for item in items:
            if isinstance(item, dict):
                ((title, value),) = item.items()
                if value == _INDEX:
                    item = {title: [{"Overview": _INDEX}, *sections]}
                elif isinstance(value, list):
                    item = {title: expand(value)}
            out.append(item)
        return out

    config["nav"] = expand(config["nav"] or [])
    return config


def on_files(files: Files, config) -> Files:
    """Add ``reference/config/*.md`` to the site's files."""
    for path, content in config_reference_pages().items():
        files.append(File.generated(config, path, content=content))
    return files
