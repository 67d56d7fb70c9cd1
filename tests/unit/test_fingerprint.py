"""Stage fingerprints chain through input manifests."""

from __future__ import annotations

import uuid

from trainer_core.checkpoint.manifest import ArtifactWriter
from trainer_core.config import load_config
from trainer_core.fingerprint import stage_fingerprint
from trainer_core.storage import join_uri


def _commit(uri: str, config_hash: str) -> None:
    writer = ArtifactWriter(uri, overwrite=True)
    writer.write_bytes("x.bin", b"x")
    writer.commit(kind="final", stage="s", run_id="r", config_hash=config_hash)


def test_editing_a_stage_changes_it_and_its_consumers_only():
    root = f"memory://fp-{uuid.uuid4().hex}"
    base = load_config("configs/demo.yaml")
    edited = load_config("configs/demo.yaml", overrides={"dpo.beta": 0.5})
    sft_uri, dpo_uri, data_uri = (join_uri(root, n) for n in ("sft", "dpo", "data"))
    _commit(data_uri, "d0")
    _commit(sft_uri, "s0")
    sft_inputs = {"data": data_uri, "model": "init"}
    dpo_inputs = {"data": data_uri, "model": sft_uri, "reference": sft_uri}
    assert stage_fingerprint(base, "sft", sft_inputs) == stage_fingerprint(edited, "sft", sft_inputs)
    before, after = stage_fingerprint(base, "dpo", dpo_inputs), stage_fingerprint(edited, "dpo", dpo_inputs)
    assert before != after
    _commit(dpo_uri, before)
    eval_inputs = {"data": data_uri, "sft_model": sft_uri, "dpo_model": dpo_uri}
    first = stage_fingerprint(base, "evaluate", eval_inputs)
    _commit(dpo_uri, after)  # DPO re-ran under the edited config
    assert stage_fingerprint(base, "evaluate", eval_inputs) != first


def test_upstream_change_reaches_downstream_through_manifests():
    root = f"memory://fp-{uuid.uuid4().hex}"
    config = load_config("configs/demo.yaml")
    data_uri = join_uri(root, "data")
    _commit(data_uri, "tokenised-v1")
    inputs = {"data": data_uri, "model": "init"}
    first = stage_fingerprint(config, "sft", inputs)
    _commit(data_uri, "tokenised-v2")
    assert stage_fingerprint(config, "sft", inputs) != first


def test_backend_is_not_part_of_the_fingerprint():
    a = load_config("configs/demo.yaml")
    b = load_config("configs/demo.yaml", overrides={"backend.device": "cpu"})
    inputs = {"model": "init"}
    assert stage_fingerprint(a, "sft", inputs) == stage_fingerprint(b, "sft", inputs)


def test_fingerprints_of_the_demo_config_are_those_runs_were_committed_with():
    """Hashes computed by the code before the stage registry and the non-finite guard (3fd5023):
    a run committed then is still matched, skipped and resumed. A new config field must keep them,
    in sub-sections too. The demo config of that time is kept in tests/unit/fixtures (the shipped
    one has changed since: its RL stages learn), less the ``log_every`` its RL sections set.

    One epoch since (CHANGELOG.md): the RL sections lost the supervised loop's fields, which
    their loop never read, so PPO's and GRPO's hashes are those of that change; the others'
    are 3fd5023's."""
    from trainer_core.config import load_config

    demo = "tests/unit/fixtures/demo_3fd5023.yaml"
    config = load_config(demo)
    inputs = {"data": "/x/prepare_data/final", "model": "/x/sft/final", "reference": "/x/sft/final"}
    got = {s: stage_fingerprint(config, s, inputs if s != "prepare_data" else {}) for s in config.stages}
    assert got == {
        "prepare_data": "5681b97af2fa254d",
        "sft": "a5f13cabb416981d",
        "reward_model": "21a64cf870bc4bf0",
        "score": "af56d1a5ea5c4a77",
        "dpo": "8570077f3620050b",
        "ppo": "5eb2181a878af66c",
        "grpo": "7273564b2651116f",
        "evaluate": "76b1eb6ce37612ca",
    }
    changed = {
        "sft": [
            {"sft.max_nonfinite_steps": 2},
            {"sft.max_tokens_per_micro_batch": 512},
            {"model.attn_implementation": "eager"},
        ],
        "grpo": [
            {"grpo.advantage_estimator": "rloo"},
            {"grpo.loss_aggregation": "constant"},
            {"grpo.clip_eps_high": 0.28},
            {"grpo.dynamic_sampling": True},
            {"grpo.overlong_buffer_tokens": 8},
            {"grpo.forward_micro_batch_size": 4},
            {"grpo.importance_sampling_cap": 2.0},
            {"grpo.generation.engine": "static"},
            {"grpo.generation.fuse_projections": False},
            {"grpo.reward.kind": "math_verify"},
            {"grpo.reward.kind": "function", "grpo.reward.function": "m:f"},
        ],
        "score": [{"score.generation.engine": "static"}],
        "evaluate": [{"evaluate.generation.engine": "static"}, {"evaluate.generation.compile": True}],
    }
    for stage, overrides in changed.items():
        for override in overrides:
            assert stage_fingerprint(load_config(demo, overrides=override), stage, inputs) != got[stage], override


def test_data_num_proc_is_never_hashed():
    """prepare_data's output is byte-identical for any data.num_proc (tests/unit/test_data_streaming.py):
    running it with more processes must not invalidate the data or anything downstream."""
    from trainer_core.config import load_config
    from trainer_core.fingerprint import stage_fingerprint

    one = stage_fingerprint(load_config(), "prepare_data", {})
    assert stage_fingerprint(load_config(overrides={"data.num_proc": 2}), "prepare_data", {}) == one
    assert stage_fingerprint(load_config(overrides={"data.max_eval_rows": 7}), "prepare_data", {}) != one


def test_a_neutral_value_is_declared_on_its_field_not_matched_by_name():
    """A field is left out of the hash at the neutral value its own declaration gives
    (``Annotated[T, Neutral(v)]``), never because a field of that name elsewhere has one: a new
    ``loss`` field of another section is hashed at distill's neutral value (``token_reverse_kl``)."""
    from typing import Annotated

    from trainer_core.config.base import ConfigBase, Neutral
    from trainer_core.fingerprint import _not_hashed

    class Declared(ConfigBase):
        loss: Annotated[str, Neutral("token_reverse_kl")] = "token_reverse_kl"

    class Plain(ConfigBase):
        loss: str = "token_reverse_kl"

    assert _not_hashed(Declared()) == {"loss": True}
    assert _not_hashed(Declared(loss="generalized_jsd")) == {}
    assert _not_hashed(Plain()) == {}
