"""Evaluation stage: held-out numbers for every model the pipeline trained.

Metrics (each present when its models were trained in this run):
- ``sft/eval_loss``, ``sft/eval_perplexity``: SFT model on the held-out SFT split.
- ``reward_model/eval_accuracy``, ``reward_model/eval_margin``: pairwise accuracy on
  held-out preference pairs.
- ``dpo/eval_reward_accuracy``, ``dpo/eval_reward_margin``: DPO implicit-reward accuracy on
  held-out pairs, against the SFT model (the DPO reference).
- ``<policy>/exact_match``, ``<policy>/exact_match_se``: greedy generation exact-match of the
  final number on held-out GSM8K-style problems, and its standard error (the sample standard
  deviation of the 0 / 1 verdicts over sqrt(n)), for ``base`` (when the base model is
  pretrained), ``sft``, ``dpo``, ``ppo`` and ``grpo``.
- ``sft_vs_base/exact_match_gain`` and its ``_se`` (when the base model is scored): SFT's
  exact match minus the base model's on the same problems, paired as below.
- ``<policy>_vs_sft/exact_match_gain``, ``<policy>_vs_sft/exact_match_gain_se`` (every trained
  policy but SFT, when SFT was trained): the policy's exact match minus SFT's on the same problems, and
  the standard error of that paired difference
  (:func:`~trainer_core.objectives.paired.paired_gain`): a gain within about twice
  its standard error is not a difference these problems can show.
- ``<policy>/reward_auc`` (when a reward model was trained): the ROC AUC of the reward model's
  scores of the policy's greedy answers against the verifier's verdicts on them
  (:func:`~trainer_core.objectives.paired.verdict_auc`; 0.5 is chance): whether the reward
  tracks correctness on the policy's own answers, where RL samples; absent when every answer
  is right or every one wrong.
- ``<policy>/pass_at_<k>``, ``<policy>/avg_at_<n>`` and their ``_se`` (with ``evaluate.pass_at_k``):
  n sampled answers per held-out problem, Chen et al.'s unbiased pass@k and the mean accuracy;
  and ``<policy>_vs_sft/pass_at_<k>_gain``, ``..._avg_at_<n>_gain`` with their ``_se``: paired
  over SFT's per-problem estimates on the same sampled problems, as exact match's gain.
- ``<policy>/lm_eval/<task>/<metric>`` (with ``evaluate.lm_eval``): the lm-evaluation-harness's
  metrics and standard errors on its tasks, and ``<policy>_vs_sft/lm_eval/<task>/<metric>_gain``
  with its ``_se``, paired over SFT's scores of the same examples.
- ``<policy>/tool_calls`` (with ``evaluate.environment``): tool calls per problem in the
  policy's exact-match answers, which are then generated with the tool (e.g. the calculator).
- ``<policy>_vs_sft/win_rate`` (``dpo``, ``ppo``, ``grpo``): fraction of held-out preference
  prompts where the reward model scores the policy's completion above the SFT policy's (ties
  count one half).

Sample generations: ``final/samples.jsonl`` (and the MLflow table ``eval/samples.json``), one
row per held-out problem: the question, the reference answer, and per policy its greedy
completion, the verifier's verdict on it, the reward model's score when one was trained, and
on the sampled problems its per-problem ``pass_at_<k>`` / ``avg_at_<n>`` (what a gate with
``min_gain_se`` against the champion pairs with). With ``evaluate.lm_eval``,
``final/lm_eval_samples.jsonl`` holds each task example's score per policy, and
``final/lm_eval_<policy>.json`` the harness's results.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field

from torch import nn

from trainer_core.checkpoint.manifest import Manifest
from trainer_core.config import GenerationConfig
from trainer_core.data.formats import answers_match, extract_generated_answer
from trainer_core.errors import ConfigError
from trainer_core.generation.completions import (
    check_generation_engine,
    generate_completions,
    messages_of,
    prompt_ids,
    reward_scores,
)
from trainer_core.modeling.forwards.pairs import reference_logprobs
from trainer_core.objectives.paired import (
    HARNESS_SAMPLES_FILE,
    SAMPLES_FILE,
    mean_and_se,
    paired_gain,
    pass_at_k,
    verdict_auc,
)
from trainer_core.registry import INIT_SOURCE, policy_role, policy_stages
from trainer_core.stages.commit import commit_final
from trainer_core.stages.context import StageContext
from trainer_core.training.rl.environments import ToolSession, load_environment
from trainer_core.training.rl.rewards import PromptItem
from trainer_core.training.supervised import (
    DPOObjective,
    RewardObjective,
    SFTObjective,
    causal_source,
    collate_with_reference,
    evaluate_pairs,
    pair_source,
)

log = logging.getLogger(__name__)


def _policy(ctx: StageContext, role: str) -> nn.Module:
    model = ctx.models.causal_lm(role)
    return ctx.backend.prepare_frozen(model)


def exact_match(
    ctx: StageContext,
    policy: nn.Module,
    problems: list[dict],
    tool_calls: list[float] | None = None,
    gen: GenerationConfig | None = None,
) -> tuple[list[bool], list[str]]:
    """Greedy completions of GSM8K-style problems and the verifier's verdict on each; with
    ``evaluate.environment``, generated with that tool (its observations in the completions).

    Args:
        tool_calls: with a tool, each problem's number of calls is appended to it.
        gen: generation settings other than ``evaluate.generation`` (pass@k's sampling).

    Returns:
        (verdicts, completions), one of each per problem in order; the exact-match accuracy is
        the verdicts' mean.
    """
    cfg = ctx.config.evaluate
    prompts = [prompt_ids(ctx.tokenizer, messages_of(p), ctx.config.data) for p in problems]
    sessions: list[ToolSession] = []
    session_for = None
    if cfg.environment is not None:
        env = load_environment(cfg.environment.name, cfg.environment.kwargs, where="evaluate.environment.name")
        items = [PromptItem(messages_of(p), ids, p["answer"]) for p, ids in zip(problems, prompts, strict=True)]

        def session_for(start: int, stop: int) -> ToolSession:
            sessions.append(ToolSession.configured(env, cfg.environment, ctx.tokenizer, items[start:stop]))
            return sessions[-1]

    completions = generate_completions(
        policy,
        ctx.tokenizer,
        prompts,
        gen or cfg.generation,
        ctx.backend.device,
        ctx.config.seed,
        session_for=session_for,
    )
    for session in sessions:
        session.close()
        if tool_calls is not None:
            tool_calls.extend(session.stats()["tool_calls"])
    return [answers_match(extract_generated_answer(c), p["answer"]) for c, p in zip(completions, problems)], completions


def _question(problem: dict) -> str:
    """A held-out problem's question: its last user message ("" without one)."""
    user = [m["content"] for m in messages_of(problem) if m.get("role") == "user"]
    return user[-1] if user else ""


def _harness_metrics(
    ctx: StageContext, name: str, policy: nn.Module, problems: list[dict], files: dict[str, bytes]
) -> tuple[dict[str, float], dict[str, dict[str, float]]]:
    """With ``evaluate.lm_eval``: the harness's metrics of ``policy`` on its tasks
    (:mod:`trainer_core.generation.harness`; ``posttrain_heldout`` is built over ``problems``),
    as ``<name>/lm_eval/<task>/<metric>``, and each example's score
    (:func:`~trainer_core.generation.harness.example_scores`). Its results JSON (without the
    examples) goes into ``files`` as ``lm_eval_<name>.json`` (the final directory) and to the
    MLflow run as ``lm_eval/<name>.json``."""
    cfg = ctx.config.evaluate.lm_eval
    if cfg is None:
        return {}, {}
    import importlib.util
    import tempfile

    if importlib.util.find_spec("lm_eval") is None:
        raise ConfigError(
            "evaluate.lm_eval needs EleutherAI's lm-evaluation-harness: pip install 'posttrain[eval]' "
            "(or remove evaluate.lm_eval)"
        )
    from trainer_core.generation.harness import (
        HELDOUT_TASK,
        HarnessLM,
        example_scores,
        harness_metrics,
        run_harness,
        write_heldout_task,
    )

    with tempfile.TemporaryDirectory() as folder:
        include = [cfg.include_path] if cfg.include_path else []
        if HELDOUT_TASK in cfg.tasks:
            rows = [{"question": _question(p), "answer": p["answer"]} for p in problems]
            write_heldout_task(folder, rows, cfg.generation.max_new_tokens)
            include.insert(0, folder)
        lm = HarnessLM(policy, ctx.tokenizer, cfg.generation, ctx.backend.device, ctx.config.seed)
        results = run_harness(
            lm,
            cfg.tasks,
            include or None,
            cfg.limit,
            cfg.num_fewshot,
            cfg.apply_chat_template,
            ctx.config.seed,
            log_samples=True,
        )
    scores = example_scores(results)
    results.pop("samples", None)  # kept as scores in the harness's sample table, not in the JSON
    files[f"lm_eval_{name}.json"] = json.dumps(results, indent=1).encode()
    if ctx.is_main:
        ctx.metrics.log_dict_artifact(results, f"lm_eval/{name}.json")
    return harness_metrics(results, name), scores


Estimates = dict[str, "list[float] | dict[str, float]"]
"""One policy's per-problem values of its paired metrics: a sampled ``pass_at_<k>`` /
``avg_at_<n>`` -> a list, one per sampled problem in order; a harness metric
``lm_eval/<task>/<metric>`` -> ``{example key: score}`` (:data:`HARNESS_SAMPLES_FILE`'s ``prompt``)."""


def _policy_metrics(
    ctx: StageContext,
    name: str,
    policy: nn.Module,
    problems: list[dict],
    tool_calls: list[float],
    files: dict[str, bytes],
) -> tuple[dict[str, float], Estimates]:
    """``<name>/tool_calls`` (with a tool: calls per problem of its greedy answers), the harness's
    metrics (:func:`_harness_metrics`) and, with ``evaluate.pass_at_k``, ``<name>/pass_at_<k>``
    and ``<name>/avg_at_<n>`` with their standard errors over problems (``..._se``): n sampled
    answers to each of the first ``num_problems`` problems,
    :func:`~trainer_core.objectives.paired.pass_at_k` of each. Also returns the per-problem
    values of the sampled and the harness's metrics (:data:`Estimates`), which the sample tables
    keep and the paired gains read."""
    out = {f"{name}/tool_calls": sum(tool_calls) / len(tool_calls)} if tool_calls else {}
    harness, estimates = _harness_metrics(ctx, name, policy, problems, files)
    out |= harness
    cfg = ctx.config.evaluate.pass_at_k
    if cfg is None:
        return out, estimates
    sampled = [p for p in problems[: cfg.num_problems] for _ in range(cfg.n)]  # each problem's n samples together
    verdicts, _ = exact_match(ctx, policy, sampled, gen=cfg.generation)
    correct = [sum(verdicts[i : i + cfg.n]) for i in range(0, len(verdicts), cfg.n)]
    passes = {f"pass_at_{k}": [pass_at_k(cfg.n, c, k) for c in correct] for k in cfg.k}
    passes[f"avg_at_{cfg.n}"] = [c / cfg.n for c in correct]
    for metric, values in passes.items():
        out[f"{name}/{metric}"], out[f"{name}/{metric}_se"] = mean_and_se(values)
    return out, {**passes, **estimates}


def _paired(baseline: list[float] | dict[str, float], other: list[float] | dict[str, float]) -> tuple[list, list]:
    """Two policies' per-problem values on the same problems: lists as they are (the same problems
    in order), harness scores on the example keys both hold (sorted)."""
    if isinstance(baseline, dict) and isinstance(other, dict):
        keys = sorted(baseline.keys() & other.keys())
        return [baseline[k] for k in keys], [other[k] for k in keys]
    return list(baseline), list(other)


def _exact_match_metrics(verdicts: dict[str, list[bool]]) -> dict[str, float]:
    """``<policy>/exact_match`` of each policy's verdicts (0.0 for none), and its ``_se``."""
    out = {f"{name}/exact_match": sum(hits) / max(len(hits), 1) for name, hits in verdicts.items()}
    return out | {
        f"{name}/exact_match_se": mean_and_se([float(h) for h in hits])[1] for name, hits in verdicts.items() if hits
    }


def _paired_gains(verdicts: dict[str, list[bool]], estimates: dict[str, Estimates]) -> dict[str, float]:
    """``<policy>_vs_sft/<metric>_gain`` and ``..._gain_se`` of every policy but SFT (and the base
    model): :func:`~trainer_core.objectives.paired.paired_gain` over SFT on the same problems, for
    greedy exact match (every problem), each sampled metric (the sampled problems) and each
    harness metric (the examples both were scored on); and ``sft_vs_base/exact_match_gain`` (SFT
    over the base model) when the base model was scored."""
    out: dict[str, float] = {}
    if "base" in verdicts:  # what SFT added to the pretrained model
        out["sft_vs_base/exact_match_gain"], out["sft_vs_base/exact_match_gain_se"] = paired_gain(
            verdicts["base"], verdicts["sft"]
        )
    for name in (n for n in verdicts if n not in ("sft", "base")):
        per_problem: dict[str, tuple[list, list]] = {"exact_match": (verdicts["sft"], verdicts[name])}
        for metric, values in estimates.get(name, {}).items():
            if metric in estimates.get("sft", {}):
                per_problem[metric] = _paired(estimates["sft"][metric], values)
        for metric, (baseline, other) in per_problem.items():
            if baseline:
                gain, se = paired_gain(baseline, other)
                out[f"{name}_vs_sft/{metric}_gain"], out[f"{name}_vs_sft/{metric}_gain_se"] = gain, se
    return out


def _sft_metrics(ctx: StageContext, sft: nn.Module) -> dict[str, float]:
    cfg = ctx.config.evaluate
    rows = ctx.load_rows("sft/eval")
    source = causal_source(
        rows, ctx.tokenizer.pad_token_id, cfg.micro_batch_size, ctx.config.seed, ctx.backend.device, shuffle=False
    )
    m = SFTObjective(source, cfg.eval_max_batches).evaluate(sft)
    return {"sft/eval_loss": m["loss"], "sft/eval_perplexity": m["perplexity"]}


def _pair_source(ctx: StageContext, rows: list[dict], collate=None):
    cfg = ctx.config.evaluate
    return pair_source(
        rows,
        ctx.tokenizer.pad_token_id,
        cfg.micro_batch_size,
        ctx.config.seed,
        ctx.backend.device,
        shuffle=False,
        collate=collate,
    )


def _rm_metrics(ctx: StageContext, rm: nn.Module, pairs: list[dict]) -> dict[str, float]:
    cfg = ctx.config.evaluate
    m = evaluate_pairs(RewardObjective(None, 0), rm, _pair_source(ctx, pairs), cfg.eval_max_batches)
    return {"reward_model/eval_accuracy": m["accuracy"], "reward_model/eval_margin": m["margin"]}


def _dpo_reference_rows(ctx: StageContext, reference: nn.Module, pairs: list[dict]) -> list[dict]:
    """The held-out pairs DPO is evaluated on, with their log-probs under ``reference`` (SFT's model)."""
    cfg = ctx.config.evaluate
    pairs = pairs[: cfg.eval_max_batches * cfg.micro_batch_size]
    ref = reference_logprobs(reference, pairs, ctx.tokenizer.pad_token_id, cfg.micro_batch_size, ctx.backend.device)
    return [{**p, "ref_chosen_logprobs": c, "ref_rejected_logprobs": r} for p, (c, r) in zip(pairs, ref)]


def _dpo_metrics(ctx: StageContext, dpo: nn.Module, rows: list[dict]) -> dict[str, float]:
    """DPO's implicit-reward accuracy and margin on :func:`_dpo_reference_rows`' rows."""
    from functools import partial

    cfg = ctx.config.evaluate
    source = _pair_source(ctx, rows, collate=partial(collate_with_reference, pad_id=ctx.tokenizer.pad_token_id))
    m = evaluate_pairs(DPOObjective(ctx.config.dpo.beta, None, 0), dpo, source, cfg.eval_max_batches)
    return {"dpo/eval_reward_accuracy": m["rewards/accuracies"], "dpo/eval_reward_margin": m["rewards/margins"]}


def _win_rate_prompts(ctx: StageContext, pairs: list[dict]) -> tuple[list, list[list[int]]]:
    """The first ``evaluate.num_winrate_prompts`` held-out preference prompts: (messages, token ids)."""
    messages = [messages_of(p) for p in pairs[: ctx.config.evaluate.num_winrate_prompts]]
    return messages, [prompt_ids(ctx.tokenizer, m, ctx.config.data) for m in messages]


def _win_rate_scores(
    ctx: StageContext, rm: nn.Module, policy: nn.Module, messages: list, prompts: list[list[int]]
) -> list[float]:
    """The reward model's scores of ``policy``'s completions of :func:`_win_rate_prompts`' prompts."""
    cfg, data, device = ctx.config.evaluate, ctx.config.data, ctx.backend.device
    completions = generate_completions(policy, ctx.tokenizer, prompts, cfg.generation, device, ctx.config.seed)
    return reward_scores(rm, ctx.tokenizer, messages, completions, data, cfg.micro_batch_size, device)


def _win_rates(scores: dict[str, list[float]]) -> dict[str, float]:
    """``<policy>_vs_sft/win_rate`` of every scored policy but SFT, from :func:`_win_rate_scores`'
    scores: the fraction of prompts where the policy's score is above SFT's (ties count one half)."""
    out = {}
    for name in (n for n in scores if n != "sft"):
        wins = [1.0 if d > s else 0.5 if d == s else 0.0 for d, s in zip(scores[name], scores["sft"])]
        out[f"{name}_vs_sft/win_rate"] = sum(wins) / max(len(wins), 1)
    return out


def sample_rows(
    problems: list[dict],
    completions: dict[str, list[str]],
    verdicts: dict[str, list[bool]],
    rewards: dict[str, list[float]],
    estimates: dict[str, Estimates] | None = None,
) -> list[dict]:
    """The sample-generation table: per problem its question (the last user message), reference
    answer, and per policy ``<policy>`` (completion), ``<policy>_correct`` (verifier verdict),
    where scored ``<policy>_reward`` (reward-model score) and, on the problems evaluate sampled,
    ``<policy>_<metric>`` (``estimates[policy][metric][i]``: ``pass_at_<k>``, ``avg_at_<n>``)."""
    rows = []
    for i, problem in enumerate(problems):
        row: dict = {"prompt": _question(problem), "answer": problem["answer"]}
        for name, texts in completions.items():
            row[name] = texts[i]
            row[f"{name}_correct"] = verdicts[name][i]
            if name in rewards:
                row[f"{name}_reward"] = rewards[name][i]
            for metric, values in (estimates or {}).get(name, {}).items():
                if isinstance(values, list) and i < len(values):
                    row[f"{name}_{metric}"] = values[i]
        rows.append(row)
    return rows


def harness_rows(estimates: dict[str, Estimates]) -> list[dict]:
    """The harness's sample table (:data:`HARNESS_SAMPLES_FILE`): one row per task example scored,
    its key as ``prompt`` and per policy ``<policy>_lm_eval/<task>/<metric>`` its score (from
    :data:`Estimates`' harness entries); empty without ``evaluate.lm_eval``."""
    rows: dict[str, dict] = {}
    for name, metrics in estimates.items():
        for metric, scores in metrics.items():
            if isinstance(scores, dict):
                for key, score in scores.items():
                    rows.setdefault(key, {"prompt": key})[f"{name}_{metric}"] = score
    return [rows[key] for key in sorted(rows)]


def _jsonl(rows: list[dict]) -> bytes:
    return "".join(json.dumps(row) + "\n" for row in rows).encode()


def _reward_aucs(rewards: dict[str, list[float]], verdicts: dict[str, list[bool]]) -> dict[str, float]:
    """``<policy>/reward_auc``: how well the reward model ranks each policy's own right answers
    above its wrong ones (:func:`verdict_auc`; left out where one kind is missing)."""
    aucs = {name: verdict_auc(scores, verdicts[name]) for name, scores in rewards.items()}
    return {f"{name}/reward_auc": auc for name, auc in aucs.items() if auc is not None}


@dataclass
class _Collected:
    """What :func:`run` gathers policy by policy (each dict keyed by the stage name, ``base`` for
    the model trained from): completions, exact-match verdicts, reward-model scores, win-rate
    scores, the estimates of the sampled metrics, the metrics, and the harness's result files."""

    completions: dict[str, list[str]] = field(default_factory=dict)
    verdicts: dict[str, list[bool]] = field(default_factory=dict)
    rewards: dict[str, list[float]] = field(default_factory=dict)
    win_rate_scores: dict[str, list[float]] = field(default_factory=dict)
    estimates: dict[str, Estimates] = field(default_factory=dict)
    metrics: dict[str, float] = field(default_factory=dict)
    files: dict[str, bytes] = field(default_factory=dict)


def _collect(
    ctx: StageContext,
    roles: list[tuple[str, str]],
    problems: list[dict],
    pairs: list[dict],
    rm: nn.Module | None,
    win_rate_prompts: tuple[list, list] | None,
) -> _Collected:
    """Every policy of ``roles`` (``(stage, input role)``) evaluated in turn, one in memory at a
    time (SFT's before DPO's: pipeline order); ``win_rate_prompts``: None without win rates."""
    trained = [name for name, _ in roles if name != "base"]
    out, dpo_rows = _Collected(), []
    messages = [messages_of(p) for p in problems]
    for name, role in roles:
        policy = _policy(ctx, role)
        out.verdicts[name], out.completions[name] = exact_match(ctx, policy, problems, calls := [])
        sampled_metrics, out.estimates[name] = _policy_metrics(ctx, name, policy, problems, calls, out.files)
        out.metrics |= sampled_metrics
        if rm is not None:
            out.rewards[name] = reward_scores(
                rm,
                ctx.tokenizer,
                messages,
                out.completions[name],
                ctx.config.data,
                ctx.config.evaluate.micro_batch_size,
                ctx.backend.device,
            )
        if name == "sft":
            out.metrics |= _sft_metrics(ctx, policy)
            if "dpo" in trained:
                dpo_rows = _dpo_reference_rows(ctx, policy, pairs)
        if name == "dpo" and "sft" in trained:
            out.metrics |= _dpo_metrics(ctx, policy, dpo_rows)
        if win_rate_prompts is not None and name != "base":
            out.win_rate_scores[name] = _win_rate_scores(ctx, rm, policy, *win_rate_prompts)
        del policy
    return out


def run(ctx: StageContext) -> Manifest:
    """Compute every available held-out metric and the sample-generation table, and commit them.

    The policies compared are the inputs ``<stage>_model`` of every policy stage this run trained
    (``trainer_core.registry.policy_stages``), loaded one at a time in pipeline order next to the
    reward model: the peak memory is one policy and the reward model.

    Raises:
        ConfigError: ``evaluate.generation.engine`` other than ``hf`` on a sharding backend.
    """
    check_generation_engine("evaluate.generation", ctx.config.evaluate.generation, ctx.backend)
    inputs = ctx.spec.inputs
    problems = ctx.load_rows("eval_problems")[: ctx.config.evaluate.num_problems]
    pairs = ctx.load_rows("preference/eval")
    roles = [("base", "base_model")] if inputs.get("base_model", INIT_SOURCE) != INIT_SOURCE else []
    roles += [(name, policy_role(name)) for name in policy_stages() if policy_role(name) in inputs]
    trained = [name for name, _ in roles if name != "base"]
    rm = ctx.backend.prepare_frozen(ctx.models.reward_model()) if "reward_model" in inputs else None
    rm_metrics = _rm_metrics(ctx, rm, pairs) if rm is not None else {}
    with_win_rates = rm is not None and "sft" in trained and len(trained) > 1
    got = _collect(ctx, roles, problems, pairs, rm, _win_rate_prompts(ctx, pairs) if with_win_rates else None)
    metrics = _exact_match_metrics(got.verdicts) | rm_metrics | got.metrics
    metrics |= _win_rates(got.win_rate_scores) if with_win_rates else {}
    if "sft" in got.verdicts and problems:
        metrics |= _paired_gains(got.verdicts, got.estimates)
    metrics |= _reward_aucs(got.rewards, got.verdicts)
    samples = sample_rows(problems, got.completions, got.verdicts, got.rewards, got.estimates)
    ctx.log_metrics(metrics, 0)
    if ctx.is_main:
        ctx.metrics.log_table(samples, "eval/samples.json")
    harness = harness_rows(got.estimates)
    return commit_final(
        ctx,
        metrics,
        files={
            **got.files,
            SAMPLES_FILE: _jsonl(samples),
            **({HARNESS_SAMPLES_FILE: _jsonl(harness)} if harness else {}),
        },
    )
