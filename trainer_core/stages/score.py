"""Score stage: sample completions from the SFT policy on held-out prompts and score them.

Prompts come from two held-out sets: GSM8K-style problems (scored by the exact-match
verifier of the final number, and by the reward model) and preference-data prompts
(scored by the reward model). The table is written as ``final/scores.parquet``.
"""

from __future__ import annotations

import io
import statistics

import pyarrow as pa
import pyarrow.parquet as pq

from trainer_core.checkpoint.manifest import Manifest
from trainer_core.data.formats import answers_match, extract_generated_answer
from trainer_core.generation.completions import (
    check_generation_engine,
    generate_completions,
    messages_of,
    prompt_ids,
    reward_scores,
)
from trainer_core.stages.commit import commit_final
from trainer_core.stages.context import StageContext


def _prompts(ctx: StageContext, num_prompts: int) -> list[dict]:
    problems = ctx.load_rows("eval_problems")[:num_prompts]
    pairs = ctx.load_rows("preference/eval")[:num_prompts]
    items = [{"source": "eval_problems", "messages": messages_of(r), "answer": r["answer"]} for r in problems]
    items += [{"source": "preference", "messages": messages_of(r), "answer": None} for r in pairs]
    return items


def _table_bytes(items: list[dict]) -> bytes:
    table = pa.table(
        {
            "source": [i["source"] for i in items],
            "prompt": [i["messages"][-1]["content"] for i in items],
            "completion": [i["completion"] for i in items],
            "answer": [i["answer"] for i in items],
            "reward": pa.array([i.get("reward") for i in items], type=pa.float64()),
            "correct": pa.array([i.get("correct") for i in items], type=pa.bool_()),
        }
    )
    buf = io.BytesIO()
    pq.write_table(table, buf)
    return buf.getvalue()


def score_metrics(items: list[dict], tokenizer) -> dict[str, float]:
    """Reward mean/std, verifier accuracy, mean completion length in tokens."""
    metrics: dict[str, float] = {"num_scored": float(len(items))}
    rewards = [i["reward"] for i in items if i.get("reward") is not None]
    if rewards:
        metrics["reward_mean"] = statistics.fmean(rewards)
        metrics["reward_std"] = statistics.pstdev(rewards)
    verified = [i["correct"] for i in items if i.get("correct") is not None]
    if verified:
        metrics["verifier_accuracy"] = sum(verified) / len(verified)
    lengths = [len(tokenizer(i["completion"], add_special_tokens=False)["input_ids"]) for i in items]
    metrics["response_length_tokens"] = statistics.fmean(lengths) if lengths else 0.0
    return metrics


def run(ctx: StageContext) -> Manifest:
    """Generate, verify and reward-score completions; commit the table.

    Raises:
        ConfigError: ``score.generation.engine`` other than ``hf`` on a sharding backend.
    """
    cfg, data, seed = ctx.config.score, ctx.config.data, ctx.config.seed
    check_generation_engine("score.generation", cfg.generation, ctx.backend)
    device = ctx.backend.device
    items = _prompts(ctx, cfg.num_prompts)
    policy = ctx.backend.prepare_frozen(ctx.models.causal_lm("model"))
    prompts = [prompt_ids(ctx.tokenizer, i["messages"], data) for i in items]
    completions = generate_completions(policy, ctx.tokenizer, prompts, cfg.generation, device, seed)
    del policy
    for item, completion in zip(items, completions):
        item["completion"] = completion
        if item["answer"] is not None:
            item["correct"] = answers_match(extract_generated_answer(completion), item["answer"])
    if "reward_model" in ctx.spec.inputs:
        rm = ctx.backend.prepare_frozen(ctx.models.reward_model())
        messages = [i["messages"] for i in items]
        rewards = reward_scores(rm, ctx.tokenizer, messages, completions, data, cfg.generation.batch_size, device)
        for item, reward in zip(items, rewards):
            item["reward"] = reward
    metrics = score_metrics(items, ctx.tokenizer)
    ctx.log_metrics(metrics, 0)
    return commit_final(ctx, metrics, files={"scores.parquet": _table_bytes(items)})
