"""The Prefect UI's run form (``flows/settings.py``): it opens on the deployment's config, every
value it shows is the value a run uses, any single-field edit yields a valid config, and its
descriptions are plain text."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from prefect.flows import load_flow_from_entrypoint

from deployments import deploy
from flows.settings import RunSettings, resolve_config, settings_of, settings_overrides
from trainer_core.config import load_config
from trainer_core.errors import ConfigError

PROJECT = Path(__file__).resolve().parents[2]
DEMO = str(PROJECT / "configs" / "demo.yaml")


@pytest.fixture(scope="module")
def demo_entry() -> tuple:
    flow = load_flow_from_entrypoint("flows.pipeline.post_training_pipeline")
    [entry] = deploy.select_deployments(deploy.load_prefect_file(), ["demo"])
    return flow, entry


def test_form_opens_on_the_deployments_config(demo_entry):
    flow, entry = demo_entry
    params = deploy.deployment_parameters(flow, entry)
    settings = RunSettings.model_validate(params["settings"])
    demo = load_config(DEMO)
    assert settings.sft.max_steps == demo.sft.max_steps == 900
    assert settings.dpo.learning_rate == demo.dpo.learning_rate and settings.stages == demo.stages
    assert settings.model.name_or_path is None  # the demo builds its model from model.init
    # The form as it opens resolves to exactly the deployment's config: nothing shown is not used.
    resolved = resolve_config(None, DEMO, params["overrides"], params["settings"])
    assert resolved == resolve_config(None, DEMO, None)
    assert params["overrides"] == [f"{deploy.OVERRIDES_EXAMPLE_KEY}={demo.evaluate.generation.max_new_tokens}"]


def _leaves(node: dict, prefix: str = "") -> list[str]:
    out = []
    for key, value in node.items():
        path = f"{prefix}{key}"
        out += _leaves(value, path + ".") if isinstance(value, dict) else [path]
    return out


def _edited(value):
    if isinstance(value, bool):
        return not value
    if isinstance(value, int):
        return value + 1
    if isinstance(value, float):
        return value * 2
    if isinstance(value, list):
        return value[:2]
    return {"single": "ddp", "auto": "cpu"}.get(value, value)


def test_every_single_field_edit_resolves_to_that_value(demo_entry):
    flow, entry = demo_entry
    params = deploy.deployment_parameters(flow, entry)
    for path in _leaves(params["settings"]):
        settings = json.loads(json.dumps(params["settings"]))
        node = settings
        *parents, leaf = path.split(".")
        for key in parents:
            node = node[key]
        if node[leaf] is None:
            continue
        node[leaf] = _edited(node[leaf])
        config = resolve_config(None, DEMO, params["overrides"], settings)
        key = "stages" if path == "stages" else path
        assert config.model_dump(mode="json").get(key, None) is not None or "." in key
        value = config.model_dump(mode="json")
        for part in key.split("."):
            value = value[part]
        assert value == node[leaf], path


def test_settings_round_trip_and_model_swap():
    demo = load_config(DEMO)
    assert load_config(DEMO, overrides=settings_overrides(settings_of(demo))) == demo
    settings = settings_of(demo).model_copy(deep=True)
    settings.model.name_or_path = "/models/qwen"
    config = load_config(DEMO, overrides=settings_overrides(settings))
    assert config.model.name_or_path == "/models/qwen" and config.model.init is None


def test_bad_settings_name_the_field():
    settings = settings_of(load_config(DEMO)).model_dump(mode="json")
    settings["sft"]["learning_rate"] = -1
    with pytest.raises(ConfigError, match="learning_rate"):
        resolve_config(None, DEMO, None, settings)


def test_form_text_is_plain():
    schema = json.dumps(RunSettings.model_json_schema())
    flow = load_flow_from_entrypoint("flows.pipeline.post_training_pipeline")
    from prefect.utilities.callables import parameter_schema

    described = json.dumps(parameter_schema(flow).properties)
    for text in (schema, described):
        for markup in ("``", ":func:", ":class:", "<root>", "<run_id>"):
            assert markup not in text
    assert "Reward model" in schema and "Max steps" in schema


def test_an_override_of_a_form_field_is_refused_naming_both(demo_entry):
    """An override used to beat a value typed in the form silently (6 typed, 4 run)."""
    flow, entry = demo_entry
    settings = json.loads(json.dumps(deploy.deployment_parameters(flow, entry)["settings"]))
    settings["sft"]["max_steps"] = 6
    with pytest.raises(
        ConfigError,
        match=r"overrides sets sft.max_steps=4 but settings set it to 6 \(the config "
        r"file has 900\)",
    ):
        resolve_config(None, DEMO, ["sft.max_steps=4"], settings)
    with pytest.raises(ConfigError, match=r"sft.max_steps=4 but settings set it to 6"):
        resolve_config(None, DEMO, {"sft": {"max_steps": 4}}, settings)
    assert resolve_config(None, DEMO, ["sft.max_steps=6", "sft.save_every=3"], settings).sft.max_steps == 6
    # A field the form leaves at the file's value: the override is the only edit, and applies.
    settings["sft"]["max_steps"] = 900
    assert resolve_config(None, DEMO, ["sft.max_steps=4"], settings).sft.max_steps == 4
    with pytest.raises(ConfigError, match=r"overrides\[1\]: override 'launch.retries' is not of the form"):
        resolve_config(None, DEMO, ["sft.max_steps=4", "launch.retries"], settings)
    # A deployment whose file overrides a form field: the value moves into the form, out of overrides.
    params = deploy.deployment_parameters(
        flow,
        {
            **entry,
            "parameters": {**entry.get("parameters", {}), "overrides": {"sft": {"max_steps": 4, "save_every": 2}}},
        },
    )
    assert params["settings"]["sft"]["max_steps"] == 4 and params["overrides"] == ["sft.save_every=2"]
    config = resolve_config(None, DEMO, params["overrides"], params["settings"])
    assert (config.sft.max_steps, config.sft.save_every) == (4, 2)
