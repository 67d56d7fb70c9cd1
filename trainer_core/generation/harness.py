"""EleutherAI's lm-evaluation-harness over the project's models and generation engines.

:class:`HarnessLM` is an ``lm_eval.api.model.LM``: the harness builds its requests from its task
definitions (by name, or YAML files in an include folder) and computes its metrics and standard
errors itself; this class answers the requests with a model the pipeline trained:

- ``generate_until``: the project's :func:`~trainer_core.generation.completions.generate_completions`
  (so the ``hf`` or the ``static`` engine of ``evaluate.lm_eval.generation``), each request's
  context tokenised as text without special tokens (the chat template, when the harness applies
  one, already wrote them), cut at the first of the request's ``until`` strings. Requests are
  answered in batches of equal generation settings.
- ``loglikelihood`` / ``loglikelihood_rolling``: the sum of the continuation's token
  log-probabilities under one forward pass (rolling: the harness's disjoint windows of the
  model's context length, ``lm_eval.utils.get_rolling_token_windows``), and whether greedy
  decoding would have produced the continuation.
- ``apply_chat_template``: the tokenizer's chat template, with the generation prefix.

:func:`run_harness` evaluates one model on a task list and returns the harness's results dict
(``results[task][metric,filter]``, ``..._stderr,filter``) and :func:`harness_metrics` turns it into
flat metric names. The harness is imported here alone (the ``eval`` extra); evaluate imports this
module only when ``evaluate.lm_eval`` is set.
"""

from __future__ import annotations

import json
import logging
import math
import re
from typing import Any

import torch
import torch.nn.functional as F
from lm_eval.api.model import LM
from torch import nn
from transformers import PreTrainedTokenizerBase

from trainer_core.config.generation import GenerationConfig
from trainer_core.generation.completions import generate_completions
from trainer_core.storage import materialize


class HarnessLM(LM):
    """A trained causal LM as the harness's model (see the module docstring).

    Args:
        model: the causal LM, in eval mode, on ``device`` (unsharded for the ``static`` engine).
        tokenizer: its tokenizer (its chat template renders chat prompts).
        generation: the settings of ``generate_until`` (engine, batch size, default
            ``max_new_tokens``); a request's ``max_gen_toks`` and ``temperature`` / ``do_sample``
            replace them (greedy unless the request samples).
        device: where ``model`` is.
        seed: seeds sampling requests.
    """

    def __init__(
        self,
        model: nn.Module,
        tokenizer: PreTrainedTokenizerBase,
        generation: GenerationConfig,
        device: torch.device,
        seed: int,
    ) -> None:
        super().__init__()
        self.model, self.tokenizer, self.generation, self.seed = model, tokenizer, generation, seed
        self._device = device

    @property
    def tokenizer_name(self) -> str:
        """The tokenizer's name (the harness keys its chat-templated request cache by it)."""
        return str(getattr(self.tokenizer, "name_or_path", "") or "posttrain")

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        """The chat template's rendering of ``chat_history`` (text, special tokens written out)."""
        return self.tokenizer.apply_chat_template(
            chat_history, tokenize=False, add_generation_prompt=add_generation_prompt
        )

    def _encode(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def generate_until(self, requests: list[Any]) -> list[str]:
        """One completion per request ``(context, gen_kwargs)``, in request order (see the module
        docstring)."""
        groups: dict[str, list[int]] = {}
        for i, request in enumerate(requests):
            groups.setdefault(json.dumps(request.args[1], sort_keys=True, default=str), []).append(i)
        out = [""] * len(requests)
        for key, indices in groups.items():
            kwargs = json.loads(key)
            until = kwargs.get("until") or []
            until = [until] if isinstance(until, str) else list(until)
            sample = bool(kwargs.get("do_sample")) and float(kwargs.get("temperature", 1.0)) > 0
            gen = self.generation.model_copy(
                update={
                    "max_new_tokens": int(kwargs.get("max_gen_toks", self.generation.max_new_tokens)),
                    "temperature": float(kwargs.get("temperature", 1.0)) if sample else 0.0,
                }
            )
            prompts = [self._encode(requests[i].args[0]) for i in indices]
            texts = generate_completions(self.model, self.tokenizer, prompts, gen, self._device, self.seed)
            for i, text in zip(indices, texts):
                cut = min((text.find(s) for s in until if s and s in text), default=len(text))
                out[i] = text[:cut]
        return out

    @torch.no_grad()
    def _score(self, context: list[int], continuation: list[int]) -> tuple[float, bool]:
        """Sum of ``continuation``'s token log-probs after ``context``, and whether each of its
        tokens is the greedy choice."""
        ids = torch.tensor([context + continuation], device=self._device)
        logits = self.model(input_ids=ids).logits[0, len(context) - 1 : -1].float()
        logprobs = F.log_softmax(logits, dim=-1)
        target = torch.tensor(continuation, device=self._device)
        total = logprobs.gather(-1, target[:, None]).sum().item()
        return float(total), bool((logprobs.argmax(-1) == target).all().item())

    def _context_ids(self, context: str) -> list[int]:
        ids = self._encode(context)
        if not ids:  # an empty context: score from the BOS (else EOS) token, as the harness's HF model does
            start = (
                self.tokenizer.bos_token_id if self.tokenizer.bos_token_id is not None else self.tokenizer.eos_token_id
            )
            ids = [start]
        return ids

    def loglikelihood(self, requests: list[Any]) -> list[tuple[float, bool]]:
        """``(log P(continuation | context), is_greedy)`` for each request ``(context, continuation)``.
        The continuation is tokenised apart from the context (trailing spaces of the context moved
        onto the continuation, as the harness's HF model does)."""
        out = []
        for request in requests:
            context, continuation = request.args
            spaces = len(context) - len(context.rstrip())
            if spaces:
                context, continuation = context[:-spaces], context[-spaces:] + continuation
            out.append(self._score(self._context_ids(context), self._encode(continuation)))
        return out

    def loglikelihood_rolling(self, requests: list[Any]) -> list[float]:
        """The log-likelihood of each request's whole string, over disjoint windows of the model's
        context length (``max_position_embeddings``), the first conditioned on the BOS token."""
        from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

        max_length = int(getattr(self.model.config, "max_position_embeddings", 2048))
        start = self._context_ids("")[0]
        out = []
        for request in requests:
            windows = get_rolling_token_windows(
                self._encode(request.args[0]), prefix_token=start, max_seq_len=max_length, context_len=1
            )
            out.append(sum(self._score(*make_disjoint_window(w))[0] for w in windows))
        return out


def run_harness(
    lm: HarnessLM,
    tasks: list[str],
    include_path: str | list[str] | None,
    limit: int | None,
    num_fewshot: int | None,
    apply_chat_template: bool,
    seed: int,
    log_samples: bool = False,
) -> dict[str, Any]:
    """Evaluate ``lm`` on ``tasks`` with ``lm_eval.simple_evaluate``; the harness's results dict
    (as plain JSON).

    Args:
        tasks: task names (the harness's own, or those of ``include_path``'s YAML files).
        include_path: folder(s) of task YAMLs, each a local path or any fsspec URI (``s3://...``,
            copied to a local folder first: :func:`~trainer_core.storage.materialize`), or None.
            When every task is there, the harness's own thousands of task files are not indexed
            (seconds saved). A task's ``dataset_kwargs.data_files`` are read by 🤗 datasets: a
            local path, or a URI through fsspec with the same S3 settings.
        limit: at most this many examples per task (None: all).
        num_fewshot: few-shot examples (None: each task's default).
        apply_chat_template: render prompts with the model's chat template.
        seed: the harness's random, numpy, torch and few-shot seeds.
        log_samples: keep each example's prompt, response and score (``results["samples"]``).

    Raises:
        ConfigError: a task the harness does not know (naming it).
    """
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    from trainer_core.errors import ConfigError

    logging.getLogger("lm_eval").setLevel(logging.WARNING)  # its per-task INFO lines would fill the stage's log
    if include_path:
        include_path = [materialize(p) for p in ([include_path] if isinstance(include_path, str) else include_path)]
    manager = TaskManager(include_path=include_path, include_defaults=False) if include_path else None
    if manager is None or any(t not in manager.all_tasks for t in tasks):
        manager = TaskManager(include_path=include_path, include_defaults=True)
    unknown = [t for t in tasks if t not in manager.all_tasks]
    if unknown:
        raise ConfigError(
            f"evaluate.lm_eval.tasks: unknown task(s) {unknown}"
            + (f" (include_path {include_path})" if include_path else "")
        )
    results = simple_evaluate(
        model=lm,
        tasks=list(tasks),
        task_manager=manager,
        limit=limit,
        num_fewshot=num_fewshot,
        apply_chat_template=apply_chat_template,
        log_samples=log_samples,
        bootstrap_iters=1000,
        random_seed=seed,
        numpy_random_seed=seed,
        torch_random_seed=seed,
        fewshot_random_seed=seed,
    )
    return json.loads(json.dumps(results, default=str))  # plain JSON (the harness keeps numpy and dtypes)


def harness_metrics(results: dict[str, Any], prefix: str) -> dict[str, float]:
    """``<prefix>/lm_eval/<task>/<metric>`` for each numeric result of ``results["results"]``:
    the harness's ``metric,filter`` keys with the filter appended after an underscore
    (``exact_match,strict-match`` -> ``exact_match_strict_match``), standard errors as
    ``..._stderr_<filter>``; non-finite values (a standard error of one example) and the example
    count (``sample_len``) left out."""
    out: dict[str, float] = {}
    for task, values in results.get("results", {}).items():
        for key, value in values.items():
            if key in ("alias", "sample_len") or not isinstance(value, (int, float)) or isinstance(value, bool):
                continue
            if not math.isfinite(float(value)):
                continue
            out[f"{prefix}/lm_eval/{task}/{_metric_name(key)}"] = float(value)
    return out


def _metric_name(key: str) -> str:
    """A harness result key as a metric name: ``exact_match,strict-match`` -> ``exact_match_strict_match``."""
    return re.sub(r"[^A-Za-z0-9_]+", "_", key.replace(",", "_")).strip("_")


def example_scores(results: dict[str, Any]) -> dict[str, dict[str, float]]:
    """Each example's score from a results dict made with ``log_samples`` (``results["samples"]``):
    ``{"lm_eval/<task>/<metric>_<filter>": {"lm_eval/<task>/<doc_id>/<doc_hash>": score}}``, the
    names :func:`harness_metrics` gives the task's means (without the policy). The key holds the
    example's content hash, so two runs' scores pair only on the same example. Non-numeric
    per-example values (a metric the harness aggregates from tuples, e.g. BLEU) are left out.

    Returns:
        ``{}`` when ``results`` has no samples.
    """
    out: dict[str, dict[str, float]] = {}
    for task, examples in results.get("samples", {}).items():
        for example in examples:
            key = f"lm_eval/{task}/{example['doc_id']}/{example.get('doc_hash', '')}"
            for metric in example.get("metrics", []):
                value = example.get(metric)
                if isinstance(value, (int, float)) and math.isfinite(float(value)):
                    name = f"lm_eval/{task}/{_metric_name(metric + ',' + example['filter'])}"
                    out.setdefault(name, {})[key] = float(value)
    return out


HELDOUT_TASK = "posttrain_heldout"
"""The harness task evaluate builds over its own held-out problems (:func:`write_heldout_task`)."""

_HELDOUT_YAML = """\
task: {task}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "{{{{question}}}}"
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until: []
  do_sample: false
  max_gen_toks: {max_new_tokens}
filter_list:
  - name: strict-match
    filter:
      - function: regex
        regex_pattern: "#### (\\\\-?[0-9\\\\.\\\\,]+)"
      - function: take_first
  - name: flexible-extract
    filter:
      - function: regex
        group_select: -1
        regex_pattern: "(-?[$0-9.,]{{2,}})|(-?[0-9]+)"
      - function: take_first
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
    ignore_case: true
    ignore_punctuation: false
    regexes_to_ignore: [",", "\\\\$", "\\\\.$"]
metadata:
  version: 1.0
"""
"""lm-eval's own ``gsm8k`` task (its ``strict-match`` and ``flexible-extract`` filters and
exact-match settings) over local rows, zero-shot."""


def write_heldout_task(folder: str, problems: list[dict[str, str]], max_new_tokens: int) -> str:
    """Write the harness task :data:`HELDOUT_TASK` over ``problems`` into ``folder`` (a task YAML
    and its JSON-lines rows): each row's ``question`` (the problem's last user message) and
    ``answer`` (the reference final number), scored as lm-eval's ``gsm8k`` scores. Returns the
    task's name.

    Args:
        folder: a local directory (created), then the harness's ``include_path``.
        problems: ``{"question": ..., "answer": ...}`` rows.
        max_new_tokens: the generation length.
    """
    from pathlib import Path

    root = Path(folder)
    root.mkdir(parents=True, exist_ok=True)
    data = root / f"{HELDOUT_TASK}.jsonl"
    data.write_text("".join(json.dumps({"question": p["question"], "answer": p["answer"]}) + "\n" for p in problems))
    (root / f"{HELDOUT_TASK}.yaml").write_text(
        _HELDOUT_YAML.format(task=HELDOUT_TASK, data=json.dumps(str(data)), max_new_tokens=max_new_tokens)
    )
    return HELDOUT_TASK
