"""Bad input refused when the config is read (or the run planned), before any stage runs, naming
the field or the file: the seed's range, an empty config file, a reward that reads a reward model
nothing provides, a ``name`` no run id can be made of, an empty ``--grid`` axis, and a run copied
to another root resumed where it was found (``trainer_core/config``, ``tasks/plan.py``,
``tasks/runs.py``, ``tasks/sweep.py``, ``posttrain/cli.py``)."""

from __future__ import annotations

import json
import shutil
import sys
import types

import pytest
from typer.testing import CliRunner

import posttrain.cli as cli
from tasks.plan import plan_run
from tasks.runs import check_run_id, new_run_id, resume_config, save_run_config
from tasks.sweep import point_run_id, sweep_grid
from trainer_core.checkpoint.manifest import ArtifactWriter
from trainer_core.config import RewardConfig, load_config
from trainer_core.config.pipeline import MAX_SEED
from trainer_core.config.run_ids import MAX_NAME_CHARS
from trainer_core.errors import ConfigError
from trainer_core.storage import RunLayout

runner = CliRunner()


def _config_file(tmp_path, text: str) -> str:
    path = tmp_path / "c.yaml"
    path.write_text(text)
    return str(path)


# 1. seed


@pytest.mark.parametrize("seed", [2**64 + 1, 2**32, -1])
def test_a_seed_outside_numpys_range_is_refused_naming_the_field(seed):
    """2**64 + 1 passed validation, then SFT's ``torch.manual_seed`` crashed (exit 1, retried)."""
    with pytest.raises(ConfigError, match=r"\n  seed: "):
        load_config(overrides={"seed": seed})


def test_the_largest_seed_is_numpys_largest():
    """numpy's seed range is the tightest of the seed's consumers (lm-evaluation-harness seeds numpy
    with it; torch takes up to 2**64 - 1, ``random`` any int): the bound is exactly numpy's."""
    import numpy as np

    assert load_config(overrides={"seed": MAX_SEED}).seed == MAX_SEED == 2**32 - 1
    np.random.RandomState(MAX_SEED)
    with pytest.raises(ValueError):
        np.random.RandomState(MAX_SEED + 1)


# 2. an empty config file


@pytest.mark.parametrize("text", ["", "   \n\n", "# only a comment\n  # another\n"])
def test_an_empty_config_file_is_refused_naming_it_and_the_explicit_way_to_take_the_defaults(tmp_path, text):
    """It ran the whole default pipeline without a word."""
    path = _config_file(tmp_path, text)
    with pytest.raises(ConfigError, match=rf"config file {path} is empty.*write \{{\}}"):
        load_config(path)
    result = runner.invoke(cli.app, ["validate", path])
    assert result.exit_code == 2 and path in result.stderr and result.stdout == ""
    assert load_config(_config_file(tmp_path, "{}  # every default\n")).stages  # the explicit way


# 3. a reward that reads a reward model nothing provides


def _plan(tmp_path, **overrides):
    config = load_config(overrides={"storage.root": str(tmp_path), **overrides})
    return plan_run(config, RunLayout(str(tmp_path), "r1"))


@pytest.mark.parametrize(
    ("stage", "reward"),
    [
        ("grpo", {"grpo.reward.kind": "weighted"}),
        ("grpo", {"grpo.reward.kind": "weighted", "grpo.reward.weights": {"reward_model": 1.0, "verifier": 0.5}}),
        ("ppo", {}),  # PPO's default reward is the reward model
    ],
)
def test_a_reward_reading_a_reward_model_without_one_is_refused_when_the_run_is_planned(tmp_path, stage, reward):
    """It was refused only when the stage started, after SFT ran, as "needs input 'reward_model';
    spec inputs: [...]"."""
    with pytest.raises(
        ConfigError,
        match=rf"{stage}\.reward \(kind .*reads a trained reward model.*add the "
        rf"reward_model stage to stages, set {stage}\.reward\.reward_model_from",
    ):
        _plan(tmp_path, stages=f"prepare_data,sft,{stage}", **reward)


def test_run_refuses_it_before_prefect_starts(tmp_path, monkeypatch):
    """``posttrain run`` says it in seconds, exit 2, nothing of the run written (stand-ins for the
    pipeline flow and the temporary Prefect API mark a start: neither may be reached)."""
    started = []
    fake = types.ModuleType("flows.pipeline")
    fake.post_training_pipeline = lambda **kwargs: started.append(kwargs)
    monkeypatch.setitem(sys.modules, "flows.pipeline", fake)
    server = types.ModuleType("posttrain.api_server")
    server.needs_temporary_server, server.start_temporary_api_server = (lambda: False), started.append
    monkeypatch.setitem(sys.modules, "posttrain.api_server", server)
    root = tmp_path / "out"
    config = _config_file(
        tmp_path,
        f"stages: [prepare_data, sft, grpo]\ngrpo: {{reward: {{kind: weighted}}}}\nstorage: {{root: {root}}}\n",
    )
    result = runner.invoke(cli.app, ["run", config, "--run-id", "r1"])
    assert result.exit_code == 2 and not started, result.output
    assert "grpo.reward (kind 'weighted', weights {'reward_model': 1.0, 'verifier': 1.0}) reads" in result.stderr
    assert not (root / "runs").exists()


def test_a_reward_model_from_the_run_or_elsewhere_or_a_reward_without_one_plans(tmp_path):
    weighted = {"grpo.reward.kind": "weighted"}
    assert "reward_model" in _plan(tmp_path, stages="prepare_data,sft,reward_model,grpo", **weighted)["grpo"].inputs
    assert (
        _plan(tmp_path, stages="prepare_data,sft,grpo", **weighted, **{"grpo.reward.reward_model_from": "/rm"})[
            "grpo"
        ].inputs["reward_model"]
        == "/rm"
    )
    no_rm = {"grpo.reward.weights": {"verifier": 1.0, "math_verify": 0.5}}
    assert "grpo" in _plan(tmp_path, stages="prepare_data,sft,grpo", **weighted, **no_rm)
    layout = RunLayout(str(tmp_path), "r1")  # committed by an earlier start of the same run id
    ArtifactWriter(layout.final("reward_model")).commit(kind="final", stage="reward_model", run_id="r1")
    assert _plan(tmp_path, stages="prepare_data,sft,grpo", **weighted)["grpo"].inputs["reward_model"] == layout.final(
        "reward_model"
    )


def test_distill_whose_reward_reads_a_reward_model_is_refused_it_takes_none(tmp_path):
    with pytest.raises(ConfigError, match=r"distill\.reward \(kind 'reward_model'\).*the distill stage takes none"):
        _plan(
            tmp_path,
            stages="prepare_data,sft,reward_model,distill",
            **{"distill.teacher_from": "/teacher", "distill.reward.kind": "reward_model"},
        )


@pytest.mark.parametrize(
    ("cfg", "reads"),
    [  # the table of test_rewards.py's needs_reward_model (the stage's rule)
        ({"kind": "reward_model"}, True),
        ({"kind": "verifier"}, False),
        ({"kind": "math_verify"}, False),
        ({"kind": "function", "function": "m:f"}, False),
        ({"kind": "weighted"}, True),
        ({"kind": "weighted", "weights": {"function": 1.0}, "function": "m:f"}, False),
        ({"kind": "weighted", "weights": {"reward_model": 1.0, "function": 1.0}, "function": "m:f"}, True),
        ({"kind": "weighted", "weights": {"math_verify": 1.0}}, False),
        ({"kind": "weighted", "weights": {"reward_model": 0.5, "verifier": 1.0}}, True),
    ],
)
def test_the_plans_reward_rule_is_the_one_the_reward_is_built_by(cfg, reads):
    """``RewardConfig.reads_reward_model`` (the plan's) gives what ``needs_reward_model`` (the
    stage's, ``trainer_core/training/rl/rewards.py``) gives, without importing torch."""
    assert RewardConfig(**cfg).reads_reward_model is reads


# 4. the run name


@pytest.mark.parametrize("name", ["démo✓", "my run", "-demo", "", "demo\n", "a/b", "x" * (MAX_NAME_CHARS + 1)])
def test_a_name_no_run_id_can_be_made_of_is_refused_when_the_config_is_read(tmp_path, name):
    """``démo✓`` passed ``validate`` and was refused as a run id when ``run`` started."""
    with pytest.raises(ConfigError, match=r"\n  name: .*run ids are made of it"):
        load_config(overrides={"name": name})
    result = runner.invoke(cli.app, ["validate", _config_file(tmp_path, json.dumps({"name": name}))])
    assert result.exit_code == 2 and "name" in result.stderr


def test_every_run_id_made_of_the_longest_name_is_a_run_id():
    config = load_config(overrides={"name": "n" * MAX_NAME_CHARS})
    run_id = check_run_id(new_run_id(config))
    check_run_id(point_run_id(check_run_id(f"sweep-{run_id}"), {"dpo.beta": 0.1}))  # the CLI's sweep ids


# 5. an empty --grid axis


@pytest.mark.parametrize(
    ("item", "why"),
    [
        ("dpo.beta=[]", "give at least one value"),
        ("dpo.beta=0.1,0.1", "a value is repeated"),
        ("storage.root=[a, b]", "the sweep, its name, storage and tracking are one"),
    ],
)
def test_a_grid_axis_the_config_would_refuse_is_refused_by_the_cli_naming_it(tmp_path, monkeypatch, item, why):
    """``--grid 'dpo.beta=[]'`` "completed" a sweep of 0 points with exit 0 (``sweep.grid`` refused it)."""
    ran = []
    monkeypatch.setattr(cli, "_run_sweep", lambda *args: ran.append(args))
    result = runner.invoke(cli.app, ["sweep", _config_file(tmp_path, "name: t\n"), "--grid", item])
    assert result.exit_code == 2 and not ran, result.output
    assert f"--grid {item.split('=')[0]}: {why}" in result.stderr
    with pytest.raises(ConfigError, match=r"sweep\.grid: .*sweep\.grid\.dpo\.beta: give at least one value"):
        load_config(overrides={"sweep.grid": {"dpo.beta": []}})  # the config's path: the same rule


def test_the_sweep_grid_adds_the_cli_axes_to_the_configs():
    config = load_config(overrides={"sweep.grid": {"dpo.beta": [0.1, 0.5], "sft.max_steps": [2]}})
    assert sweep_grid(config, {"sft.max_steps": [3, 4]}) == {"dpo.beta": [0.1, 0.5], "sft.max_steps": [3, 4]}
    with pytest.raises(ConfigError, match="no grid"):
        sweep_grid(load_config(), {})


# 6. resume of a run copied to another root


def _copied_run(tmp_path, **overrides):
    original, copy = tmp_path / "outputs", tmp_path / "copy"
    config = load_config(overrides={"storage.root": str(original), "stages": "prepare_data,sft", **overrides})
    save_run_config(config, RunLayout(str(original), "r1"))
    shutil.copytree(original, copy)
    return original, copy


def test_a_run_copied_elsewhere_resumes_under_the_root_it_was_found_under(tmp_path):
    """``resume RUN --root COPY`` wrote into the original root (the copy's saved storage.root)."""
    original, copy = _copied_run(
        tmp_path,
        **{
            "tracking.tracking_uri": f"sqlite:///{tmp_path}/outputs/mlflow.db",
            "sft.init_from": f"{tmp_path}/outputs/m",
            "dpo.init_from": f"{tmp_path}/outputs-other/m",
        },
    )
    config, moved = resume_config(str(copy), "r1", ["sft.max_steps=3"])
    assert config.storage.root == str(copy) and config.sft.max_steps == 3
    assert config.tracking.tracking_uri == f"sqlite:///{copy}/mlflow.db" and config.sft.init_from == f"{copy}/m"
    assert config.dpo.init_from == f"{tmp_path}/outputs-other/m"  # not under the old root: as it was
    assert set(moved) == {"storage.root", "tracking.tracking_uri", "sft.init_from"}
    with pytest.raises(ConfigError, match=r"storage\.root=.*resume writes the run where it was found"):
        resume_config(str(copy), "r1", [f"storage.root={original}"])


def test_a_run_copied_between_uris_resumes_under_the_uri_it_was_found_under(tmp_path):
    config = load_config(
        overrides={
            "storage.root": "memory://bad-input/a",
            "stages": "prepare_data,sft",
            "sft.init_from": "memory://bad-input/a/models/m",
        }
    )
    save_run_config(config, RunLayout("memory://bad-input/b", "r1"))  # a copy: its config.json names /a
    resumed, moved = resume_config("memory://bad-input/b", "r1")
    assert resumed.storage.root == "memory://bad-input/b" and resumed.sft.init_from == "memory://bad-input/b/models/m"
    assert moved["storage.root"] == ["memory://bad-input/a", "memory://bad-input/b"]


def test_the_cli_resumes_the_copy_and_says_what_moved(tmp_path, monkeypatch):
    original, copy = _copied_run(tmp_path)
    before = (original / "runs" / "r1" / "config.json").read_bytes()
    resumed = []
    monkeypatch.setattr(cli, "_run_pipeline", lambda cfg, run_id: resumed.append((cfg, run_id)))
    result = runner.invoke(cli.app, ["resume", "r1", "--root", str(copy)])
    assert result.exit_code == 0, result.output
    assert resumed[0][0].storage.root == str(copy) and resumed[0][1] == "r1"
    assert f"storage.root: {original} -> {copy}" in result.stderr
    assert (original / "runs" / "r1" / "config.json").read_bytes() == before
