"""``posttrain validate`` / ``posttrain run`` argument and config errors (CliRunner, in process)."""

from __future__ import annotations

import subprocess
import sys

import yaml
from typer.testing import CliRunner

from posttrain.cli import app

runner = CliRunner()


def write_config(tmp_path, text="name: t\nstages: [prepare_data, sft]\n"):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    return str(path)


def test_validate_prints_resolved_yaml_with_overrides_and_masked_secrets(tmp_path):
    config = write_config(tmp_path)
    result = runner.invoke(
        app, ["validate", config, "--set", "sft.max_steps=7", "-s", "storage.secret_access_key=topsecret"]
    )
    assert result.exit_code == 0, result.output
    resolved = yaml.safe_load(result.stdout)
    assert resolved["sft"]["max_steps"] == 7
    assert resolved["stages"] == ["prepare_data", "sft"]
    assert resolved["storage"]["root"].startswith("/")  # made absolute
    assert "topsecret" not in result.stdout


def test_validate_bad_override_exits_2_naming_the_field(tmp_path):
    result = runner.invoke(app, ["validate", write_config(tmp_path), "--set", "dpo.beta=-0.5"])
    assert result.exit_code == 2
    assert "dpo.beta" in result.stderr and "greater than 0" in result.stderr
    assert result.stdout == ""


def test_validate_unknown_field_and_malformed_override_exit_2(tmp_path):
    config = write_config(tmp_path)
    unknown = runner.invoke(app, ["validate", config, "--set", "sft.learning_rat=0.1"])
    assert unknown.exit_code == 2 and "sft.learning_rat" in unknown.stderr
    malformed = runner.invoke(app, ["validate", config, "--set", "sft.max_steps"])
    assert malformed.exit_code == 2 and "key.path=value" in malformed.stderr


def test_unknown_stage_exits_2_naming_it(tmp_path):
    result = runner.invoke(app, ["validate", write_config(tmp_path, "stages: [prepare_data, bogus]\n")])
    assert result.exit_code == 2
    assert "'bogus'" in result.stderr and "stages" in result.stderr


def test_run_with_bad_config_exits_2_before_anything_runs(tmp_path):
    out = tmp_path / "out"
    config = write_config(tmp_path, f"stages: [sft, rlhf]\nstorage: {{root: {out}}}\n")
    result = runner.invoke(app, ["run", config])
    assert result.exit_code == 2 and "'rlhf'" in result.stderr
    assert not out.exists()
    bad_id = runner.invoke(app, ["run", write_config(tmp_path), "--run-id", "../escape"])
    assert bad_id.exit_code == 2 and "run_id" in bad_id.stderr


def test_missing_config_file_exits_2(tmp_path):
    result = runner.invoke(app, ["validate", str(tmp_path / "nope.yaml")])
    assert result.exit_code == 2 and "not found" in result.stderr


def test_console_script_is_installed_and_validates(tmp_path):
    """The ``posttrain`` entry point from pyproject.toml, as a real process."""
    exe = f"{sys.prefix}/bin/posttrain"
    bad = subprocess.run([exe, "validate", write_config(tmp_path), "--set", "seed=abc"], capture_output=True, text=True)
    assert bad.returncode == 2 and "seed" in bad.stderr


def test_deploy_names_the_api_url_when_no_server_answers():
    """``posttrain deploy`` against a dead Prefect API: exit 2 and one line naming the URL and
    ``PREFECT_API_URL`` (was: a 266-line traceback ending in ``ConnectError``)."""
    import socket

    from prefect.settings import PREFECT_API_URL, temporary_settings

    with socket.socket() as s:  # a loopback port nothing listens on
        s.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{s.getsockname()[1]}/api"
    with temporary_settings(updates={PREFECT_API_URL: url}):
        result = runner.invoke(app, ["deploy"])
    assert result.exit_code == 2
    assert f"no Prefect API answers at {url} (PREFECT_API_URL)" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and "Traceback" not in result.output
