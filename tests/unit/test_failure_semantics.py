"""Failure semantics in the small: the non-finite guard, the error taxonomy, errors that name their
input, stale leases, re-plans, stage states and pre-flight checks."""

from __future__ import annotations

import errno
import io
import json
import logging
import math
import os
import socket
import subprocess
import sys
import tempfile
import uuid

import fsspec
import pytest
import torch
from fsspec.implementations.memory import MemoryFileSystem

from tasks.console import PlainConsoleHandler
from tasks.launch.failures import (
    BadStageInput,
    StageFailed,
    StageResourceError,
    raise_for_result,
    retry_condition,
    trainer_error,
)
from tasks.launch.process import LaunchResult
from tasks.preflight import preflight
from tasks.runs import config_changes, load_run_config, save_run_config, stage_status
from trainer_core import storage
from trainer_core.checkpoint.lease import LEASE_NAME, LeaseHeldError, StageLease, read_lease
from trainer_core.checkpoint.manifest import ArtifactWriter
from trainer_core.checkpoint.train_state import TrainProgress
from trainer_core.config import DataSource, ModelConfig, load_config
from trainer_core.data.sources import read_records
from trainer_core.errors import (
    EXIT_BAD_INPUT,
    EXIT_RESOURCE,
    ConfigError,
    DataError,
    NonFiniteError,
    ResourceError,
    classify,
)
from trainer_core.modeling.models import load_causal_lm
from trainer_core.storage import RunLayout, join_uri
from trainer_core.training.guard import check_finite_tensors, nonfinite_weights, step_is_finite

# --- the non-finite guard ------------------------------------------------------------------


def test_a_nonfinite_step_fails_at_once_by_default():
    progress = TrainProgress(global_step=7)
    assert step_is_finite(
        progress, stage="sft", global_step=7, max_nonfinite_steps=0, loss=1.5, grad_norm=torch.tensor(0.3)
    )
    with pytest.raises(NonFiniteError, match=r"stage sft: non-finite train/grad_norm=nan at global_step 7") as info:
        step_is_finite(
            progress, stage="sft", global_step=7, max_nonfinite_steps=0, loss=1.5, grad_norm=torch.tensor(math.nan)
        )
    assert "sft.learning_rate" in str(info.value) and "sft.max_nonfinite_steps" in str(info.value)


def test_nonfinite_steps_are_skipped_up_to_the_budget():
    progress = TrainProgress()
    bad = {"loss": math.inf, "grad_norm": math.nan}
    assert not step_is_finite(progress, stage="dpo", global_step=1, max_nonfinite_steps=2, **bad)
    assert not step_is_finite(progress, stage="dpo", global_step=2, max_nonfinite_steps=2, **bad)
    with pytest.raises(NonFiniteError, match="non-finite steps so far: 3, allowed: 2"):
        step_is_finite(progress, stage="dpo", global_step=3, max_nonfinite_steps=2, **bad)
    # a NaN loss with a finite gradient norm was not skipped (the update happened): it always fails
    with pytest.raises(NonFiniteError, match="train/loss=nan"):
        step_is_finite(TrainProgress(), stage="dpo", global_step=1, max_nonfinite_steps=2, loss=math.nan, grad_norm=1.0)


def test_rewards_and_advantages_are_checked_over_every_rank():
    sums = []

    def all_reduce_sum(t):  # two ranks: this one and a twin with one NaN reward
        sums.append(t.clone())
        return t + torch.tensor([1.0, 0.0])

    with pytest.raises(
        NonFiniteError, match=r"stage grpo: non-finite advantages \(1 non-finite values\) at global_step 4"
    ):
        check_finite_tensors(
            {"rewards": torch.ones(4), "advantages": torch.zeros(4, 3)},
            stage="grpo",
            global_step=4,
            all_reduce_sum=all_reduce_sum,
        )
    check_finite_tensors({"rewards": torch.ones(4)}, stage="grpo", global_step=4, all_reduce_sum=lambda t: t)


def test_nonfinite_weights_are_named():
    state = {"a": torch.ones(2), "b": torch.tensor([1.0, math.nan]), "step": torch.tensor([3])}
    assert nonfinite_weights(state) == ["b"]


def test_a_skipped_step_leaves_weights_and_optimizer_untouched():
    from trainer_core.backends.single import torch_optimizer_step

    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    model(torch.tensor([[math.nan, 1.0]])).sum().backward()
    norm = torch_optimizer_step(model, optimizer, 1.0, skip_nonfinite=True)
    assert math.isnan(float(norm)) and optimizer.state_dict()["state"] == {}
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert all(p.grad is None for p in model.parameters())


def test_deepspeed_refuses_skipped_steps_in_the_config():
    with pytest.raises(ConfigError, match="sft.max_nonfinite_steps=2: skipping non-finite steps"):
        load_config(overrides={"backend": {"name": "deepspeed", "nproc_per_node": 2}, "sft.max_nonfinite_steps": 2})


# --- the taxonomy ----------------------------------------------------------------------------


def test_disk_full_from_the_os_is_a_resource_error():
    """``/dev/full`` answers every write with a real ENOSPC, naming no file (as a full disk does)."""
    with pytest.raises(OSError) as info:
        with open("/dev/full", "wb") as f:
            f.write(b"x" * 16)
    error = classify(info.value, where="stage sft")
    assert isinstance(error, ResourceError) and error.exit_code == EXIT_RESOURCE
    assert str(error).startswith("stage sft: disk full")
    assert f"the temporary directory {tempfile.gettempdir()} that TMPDIR names" in str(error)  # issue 35, item 13


def test_taxonomy_of_library_errors():
    from botocore.exceptions import NoCredentialsError

    assert isinstance(classify(MemoryError()), ResourceError)
    oom = classify(
        RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 9 bytes"),
        where="stage dpo at dpo.micro_batch_size=64",
    )
    assert isinstance(oom, ResourceError) and "dpo.micro_batch_size=64" in str(oom) and "lower" in str(oom)
    assert isinstance(classify(PermissionError(errno.EACCES, "denied", "/data/x")), ConfigError)
    creds = classify(NoCredentialsError())
    assert isinstance(creds, ConfigError) and creds.exit_code == EXIT_BAD_INPUT
    assert "storage.access_key_id" in str(creds)
    assert classify(ConnectionResetError()) is None  # transient: retried


class FullFileSystem(MemoryFileSystem):
    """An object store whose disk is full: every upload fails with ENOSPC. A full volume cannot be
    made on this machine without privileges, so this stands in for one."""

    protocol = "fullfs"

    def pipe_file(self, path, value, mode="overwrite", **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")


def test_storage_names_the_uri_when_the_disk_is_full():
    fsspec.register_implementation("fullfs", FullFileSystem, clobber=True)
    with pytest.raises(ResourceError, match="disk full .* writing fullfs://bucket/run/x.json"):
        storage.write_bytes("fullfs://bucket/run/x.json", b"{}")


def test_a_corrupt_gzip_file_is_named_with_its_line(tmp_path):
    path = tmp_path / "sft.jsonl.gz"
    path.write_bytes(b"not gzip at all")
    with pytest.raises(DataError, match=rf"{path}:1: corrupt or truncated compressed file"):
        read_records(DataSource(uri=str(path)))


def test_model_sources_are_named(tmp_path):
    with pytest.raises(ConfigError, match=r"model source '.*missing': no such directory"):
        load_causal_lm(str(tmp_path / "missing"), ModelConfig(name_or_path="x"), None, 0)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="is not a Hugging Face model directory"):
        load_causal_lm(str(tmp_path / "empty"), ModelConfig(name_or_path="x"), None, 0)
    remote = tmp_path / "remote"
    remote.mkdir()
    (remote / "config.json").write_text(
        json.dumps(
            {
                "model_type": "remote_only",
                "auto_map": {"AutoConfig": "configuration_x.XConfig", "AutoModelForCausalLM": "modeling_x.XModel"},
            }
        )
    )
    with pytest.raises(ConfigError, match="model.trust_remote_code: true"):
        load_causal_lm(str(remote), ModelConfig(name_or_path=str(remote)), None, 0)


# --- what the task makes of a trainer's exit ----------------------------------------------------


def _result(code: int, tail: list[str]) -> LaunchResult:
    return LaunchResult(returncode=code, tail=tail, wall_s=1.0, timed_out=False, rank_tails={}, launcher_lines=[])


def test_the_trainers_own_error_leads_the_message():
    tail = ["INFO loading", "error: stage sft: non-finite train/loss=nan at global_step 3; nothing committed"]
    with pytest.raises(BadStageInput) as info:
        raise_for_result(_result(2, tail), "sft")
    assert str(info.value).startswith("stage sft: non-finite train/loss=nan at global_step 3")
    assert trainer_error(["[default0]:error: first line", "[default0]:  second"]) == "first line\n  second"
    with pytest.raises(StageResourceError, match=r"^stage 'dpo': disk full"):
        raise_for_result(_result(3, ["error: disk full writing /x"]), "dpo")


def test_bad_input_and_exhausted_resources_are_not_retried():
    from prefect.states import Failed

    assert retry_condition(None, None, Failed(data=StageResourceError("disk full", 3))) is False
    assert retry_condition(None, None, Failed(data=StageFailed("killed", -9))) is True


def _console_logger() -> tuple[logging.Logger, io.StringIO]:
    """A logger of its own whose only handler is the plain console's, writing to the stream returned."""
    stream = io.StringIO()
    handler = PlainConsoleHandler(stream=stream)
    handler.setFormatter(logging.Formatter("%(message)s"))
    logger = logging.getLogger(f"console-test-{uuid.uuid4().hex}")
    logger.addHandler(handler)
    logger.propagate = False
    return logger, stream


def test_the_console_keeps_file_and_line_and_drops_explained_tracebacks():
    logger, stream = _console_logger()
    logger.error("bad record at sft.jsonl:100: invalid JSON")
    try:
        raise BadStageInput("stage 'sft': sft.jsonl:100: invalid JSON\n\nlong details", 2)
    except BadStageInput:
        logger.exception("Task run failed with exception: BadStageInput(...)")
    text = stream.getvalue()
    assert "sft.jsonl:100: invalid JSON" in text and "\U0001f4af" not in text
    assert "Traceback" not in text and "long details" not in text


def _outage(uri: str = "s3://bucket/runs/r/summary.json", endpoint: str = "http://127.0.0.1:9") -> BaseException:
    """botocore's error for a refused endpoint, as the storage layer re-raises it once it gave up."""
    from botocore.exceptions import EndpointConnectionError

    from trainer_core.errors import StorageFailure

    exc = EndpointConnectionError(endpoint_url=f"{endpoint}/{uri.removeprefix('s3://')}")
    exc.storage_failure = StorageFailure("writing", uri, endpoint, attempts=6, elapsed_s=31.0)
    return exc


def test_a_storage_outage_is_transient_and_named_and_the_console_shows_it_in_one_line():
    error = classify(_outage(), where="stage sft")
    assert error is not None and error.exit_code == 1  # transient: retried
    assert str(error).startswith(
        "stage sft: the S3 endpoint http://127.0.0.1:9 did not answer: writing "
        "s3://bucket/runs/r/summary.json failed after 6 attempt(s) over 31 s"
    )
    logger, stream = _console_logger()
    try:
        raise _outage()
    except Exception:
        logger.exception("Encountered exception during execution: EndpointConnectionError(...)")
    text = stream.getvalue()
    assert "Traceback" not in text and "the S3 endpoint http://127.0.0.1:9 did not answer" in text, text


def test_a_summary_storage_cannot_take_is_one_warning_and_the_stage_failure_stays_the_error(monkeypatch):
    from flows import pipeline
    from trainer_core.errors import StorageUnavailable

    def unreachable(run, summary):
        raise _outage()

    monkeypatch.setattr(pipeline, "write_summary", unreachable)
    run = type("Run", (), {"run_id": "r", "layout": RunLayout("s3://bucket", "r")})()
    warnings: list[str] = []
    log = type("Log", (), {"warning": lambda self, msg, *args: warnings.append(msg % args)})()
    assert pipeline._write_summary(run, {}, log, failed=True) is None
    assert len(warnings) == 1 and "summary s3://bucket/runs/r/summary.json not written: the S3 endpoint" in warnings[0]
    with pytest.raises(StorageUnavailable, match="the S3 endpoint http://127.0.0.1:9 did not answer"):
        pipeline._write_summary(run, {}, log, failed=False)


# --- leases, re-plans, states ---------------------------------------------------------------


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_a_lease_whose_process_is_gone_is_stale_at_once(tmp_path):
    prefix = str(tmp_path / "run")
    record = {
        "owner": "killed-cli",
        "expires_at": 4e9,
        "pid": _dead_pid(),
        "host": socket.gethostname(),
        "pidns": os.readlink("/proc/self/ns/pid"),
    }
    storage.write_json(join_uri(prefix, LEASE_NAME), record)
    assert read_lease(prefix)["live"] is False
    lease = StageLease(prefix, owner="next", ttl_s=30)
    lease.acquire(wait_s=0)  # no wait for the dead holder's expiry
    lease.release()
    other_container = {**record, "pidns": "pid:[1]"}  # same host name, other pids: trust the expiry
    storage.write_json(join_uri(prefix, LEASE_NAME), other_container)
    assert read_lease(prefix)["live"] is True


def test_a_live_lease_is_refused_at_once_naming_its_holder(tmp_path):
    prefix = str(tmp_path / "run")
    what = "another posttrain run of this run id is live"
    holder = StageLease(prefix, owner="first-cli", ttl_s=30, what=what)
    holder.acquire(wait_s=0)
    try:
        assert read_lease(prefix)["live"] is True
        with pytest.raises(LeaseHeldError, match=rf"held by first-cli \(pid {os.getpid()} on .*another posttrain run"):
            StageLease(prefix, owner="second-cli", ttl_s=30, what=what).acquire(wait_s=0)
    finally:
        holder.release()


def test_a_resume_with_another_config_is_a_logged_replan_keeping_the_old_config(tmp_path):
    layout = RunLayout(str(tmp_path), "r1")
    first = load_config(overrides={"storage.root": str(tmp_path)})
    assert save_run_config(first, layout) == {}
    assert save_run_config(first, layout) == {}
    changed = load_config(overrides={"storage.root": str(tmp_path), "dpo.beta": 0.3})
    assert save_run_config(changed, layout) == {"dpo.beta": [0.1, 0.3]}
    assert load_run_config(str(tmp_path), "r1")["dpo"]["beta"] == 0.3
    history = tmp_path / "runs" / "r1" / "config-history" / "0001.json"
    assert json.loads(history.read_text())["dpo"]["beta"] == 0.1
    assert config_changes({"a": {"b": 1}}, {"a": {"b": 1, "c": 2}}) == {"a.c": [None, 2]}


def test_a_run_saved_before_the_rl_sections_lost_the_supervised_fields_still_resumes(tmp_path):
    """A ``config.json`` of that time holds the supervised loop's fields in its RL sections (a
    dump holds every field); they are dropped when it is read (the RL loop never read them), and
    the other sections keep theirs."""
    from tasks.runs import resume_config

    layout = RunLayout(str(tmp_path), "r1")
    save_run_config(load_config(overrides={"storage.root": str(tmp_path)}), layout)
    old = json.loads(open(layout.config).read())
    for section in ("ppo", "grpo", "distill"):
        old[section].update({"micro_batch_size": 8, "eval_every": 25, "log_every": 1, "moe": {"aux_loss_coef": 0.0}})
    with open(layout.config, "w") as f:
        json.dump(old, f)
    saved = load_run_config(str(tmp_path), "r1")
    assert "micro_batch_size" not in saved["ppo"] and "log_every" not in saved["distill"]
    assert saved["sft"]["micro_batch_size"] == old["sft"]["micro_batch_size"]
    config, _ = resume_config(str(tmp_path), "r1")
    assert config.grpo.prompts_per_rollout == old["grpo"]["prompts_per_rollout"]


def test_a_damaged_run_config_is_reported_by_path(tmp_path):
    layout = RunLayout(str(tmp_path), "r1")
    os.makedirs(layout.uri)
    with open(layout.config, "w") as f:
        f.write("{not json")
    with pytest.raises(ConfigError, match=rf"{layout.config} is damaged"):
        load_run_config(str(tmp_path), "r1")


def test_stage_states(tmp_path):
    root, run_id = str(tmp_path), "r1"
    paths = RunLayout(root, run_id).stage("sft")
    assert stage_status(root, run_id, "sft")["state"] == "not started"
    lease = StageLease(paths.output, owner="trainer", ttl_s=30)
    lease.acquire(wait_s=0)
    running = stage_status(root, run_id, "sft")
    assert (running["state"], running["holder"]) == ("running", "trainer")
    lease.release()
    storage.write_json(
        join_uri(paths.output, LEASE_NAME),
        {
            "owner": "killed",
            "expires_at": 4e9,
            "pid": _dead_pid(),
            "host": socket.gethostname(),
            "pidns": os.readlink("/proc/self/ns/pid"),
        },
    )
    assert stage_status(root, run_id, "sft")["state"] == "interrupted"
    ArtifactWriter(paths.final).commit(kind="final", stage="sft", run_id=run_id, global_step=4)
    assert stage_status(root, run_id, "sft")["state"] == "completed"


# --- pre-flight --------------------------------------------------------------------------------


def test_preflight_names_the_field(tmp_path):
    (tmp_path / "a-file").write_text("")
    with pytest.raises(ConfigError, match="storage.root .* is a file, not a directory"):
        preflight(load_config(overrides={"storage.root": str(tmp_path / "a-file" / "out")}))
    root = str(tmp_path / "out")
    with pytest.raises(ConfigError, match=r"data.preference.uri '.*nope.jsonl' does not exist"):
        preflight(load_config(overrides={"storage.root": root, "data.preference.uri": str(tmp_path / "nope.jsonl")}))
    with pytest.raises(ConfigError, match=r"model.name_or_path '.*no-model' is not a model directory"):
        preflight(load_config(overrides={"storage.root": root, "model": {"name_or_path": str(tmp_path / "no-model")}}))
    with pytest.raises(ConfigError, match=r"dpo.reference_from"):
        preflight(load_config(overrides={"storage.root": root, "dpo.reference_from": str(tmp_path / "x")}))
    preflight(load_config(overrides={"storage.root": root, "model": {"name_or_path": "Qwen/Qwen2.5-0.5B"}}))
    assert os.listdir(root) == []  # the probe is gone


def test_preflight_names_missing_s3_credentials(s3_server, monkeypatch, tmp_path):
    from tests.conftest import make_bucket

    bucket = make_bucket(s3_server)
    storage.write_bytes(f"s3://{bucket}/data/sft.jsonl", b"{}\n")
    for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    config = load_config(
        overrides={
            "storage.root": str(tmp_path / "out"),
            "storage.endpoint_url": s3_server,
            "data.sft.uri": f"s3://{bucket}/data/sft.jsonl",
        }
    )
    storage.configure(config.storage)
    with pytest.raises(
        ConfigError,
        match=rf"data.sft.uri 's3://{bucket}/data/sft.jsonl' cannot be read: .*no S3 "
        "credentials",
    ):
        preflight(config)


def test_an_unreachable_storage_root_is_refused_after_one_probe(monkeypatch, caplog, tmp_path):
    """A refused S3 endpoint: one probe write (botocore's own attempts cut to one here), none of
    the storage layer's retries, and the root named."""
    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "x")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "y")
    config = load_config(
        overrides={"storage.root": "s3://bucket/root", "storage.endpoint_url": f"http://127.0.0.1:{port}"}
    )
    storage.configure(config.storage)
    try:
        with (
            caplog.at_level(logging.WARNING, logger="trainer_core.storage"),
            pytest.raises(ConfigError, match=r"storage.root 's3://bucket/root' is not writable: .*Could not connect"),
        ):
            preflight(config)
    finally:
        storage.configure(load_config(overrides={"storage.root": str(tmp_path)}).storage)
    assert not [r for r in caplog.records if "Retrying" in r.getMessage()], caplog.text


def test_a_final_model_with_nonfinite_weights_is_never_committed(tmp_path):
    from trainer_core.backends.single import SingleDeviceBackend
    from trainer_core.spec import build_spec
    from trainer_core.stages.commit import commit_final
    from trainer_core.stages.context import StageContext
    from trainer_core.tracking import MetricLogger

    config = load_config(overrides={"storage.root": str(tmp_path)})
    spec = build_spec(config, "sft", "r1", {}, output_uri=str(tmp_path / "sft"))
    ctx = StageContext(spec=spec, backend=SingleDeviceBackend("cpu"), tokenizer=None, metrics=MetricLogger(None, None))
    model = torch.nn.Linear(2, 2)
    with torch.no_grad():
        model.bias[1] = math.inf
    with pytest.raises(NonFiniteError, match="stage sft: the final model has non-finite weights .*bias"):
        commit_final(ctx, {"global_step": 3.0}, model=model)
    assert not (tmp_path / "sft" / "final").exists()
