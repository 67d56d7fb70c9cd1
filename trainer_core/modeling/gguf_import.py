"""The import of a GGUF file (see :mod:`trainer_core.modeling.gguf`): the architecture check, the
dequantization by transformers and the commit under the storage root. Apart from the torch-free
half so that the flow process, which checks sources and finds earlier imports, never loads torch
or transformers; the flow runs this module as a child process:

``python -m trainer_core.modeling.gguf_import SOURCE ROOT RUN_ID`` imports SOURCE under ROOT and
prints ``imported: <URI of the directory>``; a file it refuses exits 2 with ``error: ...``.
"""

from __future__ import annotations

import logging
import os
import sys
import tempfile

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig
from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

from trainer_core import storage
from trainer_core.checkpoint.lease import StageLease
from trainer_core.checkpoint.manifest import ArtifactWriter, sha256_file
from trainer_core.errors import ConfigError
from trainer_core.modeling.gguf import (
    IMPORT_STAGE,
    IMPORTED_LINE,
    GGUFInfo,
    check_tensor_types,
    imported_uri,
    is_imported,
    local_gguf,
    read_info,
)

log = logging.getLogger(__name__)

# transformers 5.24 ``load_gguf_checkpoint``: GGUF architecture names it renames before looking
# them up in GGUF_SUPPORTED_ARCHITECTURES (llama.cpp spells them without the underscore).
_TRANSFORMERS_NAMES = {
    "qwen2moe": "qwen2_moe",
    "qwen3moe": "qwen3_moe",
    "gpt-oss": "gpt_oss",
    "minimax-m2": "minimax_m2",
    "t5encoder": "t5",
}
_NOT_ARCHITECTURES = {"general", "tokenizer"}  # sections of transformers' mapping, not models


def check_readable(info: GGUFInfo, source: str) -> None:
    """Refuse a GGUF file transformers cannot turn into a dense model: an architecture outside
    transformers' GGUF loader, or tensor types :func:`~trainer_core.modeling.gguf.check_tensor_types`
    refuses.

    Raises:
        ConfigError: naming ``source`` and the architecture, or the tensor types, it cannot read.
    """
    supported = set(GGUF_SUPPORTED_ARCHITECTURES) - _NOT_ARCHITECTURES
    arch = _TRANSFORMERS_NAMES.get(info.architecture, info.architecture)
    if arch not in supported:
        raise ConfigError(
            f"model source {source!r}: GGUF architecture {info.architecture or '(none)'!r} is not one "
            f"transformers can load (it reads {', '.join(sorted(supported))})"
        )
    check_tensor_types(info, source)


def dequantize_to(path: str, out_dir: str) -> None:
    """Load the GGUF file ``path`` as a dense fp32 ``AutoModelForCausalLM`` and its tokenizer, and
    save both in Hugging Face format (safetensors, tokenizer files, chat template) in ``out_dir``."""
    folder, name = os.path.split(os.path.abspath(path))
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(
        folder, gguf_file=name, dtype=torch.float32, quantization_config=GgufConfig(dequantize=True)
    )
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)


def import_gguf(source: str, root: str, run_id: str, *, lease_ttl_s: float = 60.0) -> str:
    """Import the GGUF file ``source`` under the storage ``root`` (once: a committed import of the
    same content is reused) and return the imported directory's URI.

    Two importers of one file serialise on a lease beside the directory (``<dir>.lease``); the
    second finds the first's commit and returns it.

    Raises:
        ConfigError: the file is missing or unreadable (:func:`check_readable`).
    """
    path = local_gguf(source)
    info = read_info(path, source)
    check_readable(info, source)
    sha256 = sha256_file(path)
    dest = imported_uri(root, sha256)
    if is_imported(dest):
        return dest
    with StageLease(dest + ".lease", ttl_s=lease_ttl_s, what="another run is importing this GGUF file"):
        if is_imported(dest):
            return dest
        log.info(
            "importing %s (%s, %s) into %s",
            source,
            info.architecture,
            ", ".join(f"{k} x{v}" for k, v in info.tensor_types.items()),
            dest,
        )
        with tempfile.TemporaryDirectory(prefix="posttrain-gguf-") as tmp:
            dequantize_to(path, tmp)
            writer = ArtifactWriter(dest)
            writer.write_dir(tmp)
            writer.commit(
                kind="final",
                stage=IMPORT_STAGE,
                run_id=run_id,
                extra={
                    "source": source,
                    "sha256": sha256,
                    "architecture": info.architecture,
                    "gguf_name": info.name,
                    "tensor_types": info.tensor_types,
                    "dtype": "float32",
                },
            )
    storage.remove(dest + ".lease")  # the released lease's (empty) directory
    return dest


def main(argv: list[str] | None = None) -> int:
    """``python -m trainer_core.modeling.gguf_import SOURCE ROOT RUN_ID``: import, print the URI."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 3:
        print("usage: python -m trainer_core.modeling.gguf_import SOURCE ROOT RUN_ID", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        print(f"{IMPORTED_LINE}{import_gguf(*args)}", flush=True)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
