"""The structure the code promises: import layering (import-linter), the stage registry as the one
list of stages, light orchestration imports, and module and function sizes in lines of code."""

from __future__ import annotations

import importlib
import subprocess
import sys
from pathlib import Path

import pytest

from trainer_core.config import PipelineConfig, load_config
from trainer_core.registry import DEFAULT_STAGES, STAGE_ORDER, STAGES, StageOutputs, get_stage, stage_inputs
from trainer_core.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]
MAX_MODULE_CODE_LINES = 400
MAX_FUNCTION_CODE_LINES = 50
"""The caps count lines of code (:func:`code_lines`), not docstrings or comments: a documented
function is not penalised for its documentation."""
PACKAGES = ("trainer_core", "tasks", "flows", "posttrain", "deployments")


def lint_imports(config: Path, *contracts: str) -> subprocess.CompletedProcess:
    """import-linter on ``config`` in a child process (it reconfigures logging for its process)."""
    code = (
        "import sys; from importlinter.cli import lint_imports; "
        f"sys.exit(lint_imports(config_filename={str(config)!r}, no_cache=True, limit_to_contracts={contracts!r}))"
    )
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)


def test_import_contracts_are_kept():
    """``.importlinter``: packages in one direction, trainer_core's floors, no package cycles, no
    Prefect in the trainer library, the RL algorithms below the RL loop, no torch in the flow process."""
    result = lint_imports(ROOT / ".importlinter")
    assert result.returncode == 0, result.stdout[-4000:]
    assert "Contracts: 6 kept, 0 broken." in result.stdout


def ruff_format_check(*paths: Path | str) -> subprocess.CompletedProcess:
    """``ruff format --check`` (the dev extra's ruff, the settings of pyproject.toml's ``[tool.ruff]``)."""
    ruff = Path(sys.executable).parent / "ruff"
    return subprocess.run([str(ruff), "format", "--check", *map(str, paths)], cwd=ROOT, capture_output=True, text=True)


def test_the_tree_is_formatted(tmp_path):
    """Every Python file of the checkout is as ``ruff format`` writes it (``make format`` does it),
    and the check fails on a file that is not."""
    result = ruff_format_check(".")
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    loose = tmp_path / "loose.py"
    loose.write_text("x = {  'a':1 }\n")
    assert ruff_format_check(loose).returncode == 1


def test_a_broken_layer_is_reported(tmp_path):
    """The contracts can fail: with ``trainer_core.registry`` declared above ``trainer_core.config``
    (which imports it), the floors contract is broken."""
    text = (ROOT / ".importlinter").read_text()
    swapped = text.replace(
        "    trainer_core.config\n    trainer_core.registry\n", "    trainer_core.registry\n    trainer_core.config\n"
    )
    assert swapped != text
    config = tmp_path / "importlinter.ini"
    config.write_text(swapped)
    result = lint_imports(config, "floors")
    assert result.returncode == 1 and "BROKEN" in result.stdout, result.stdout[-2000:]


def test_orchestration_imports_no_torch():
    """The flow process (flow, tasks, registry, config, spec) starts without torch or transformers."""
    code = (
        "import sys, flows.pipeline, tasks.stages, tasks.plan, trainer_core.registry, trainer_core.spec; "
        "print(sorted(m for m in ('torch', 'transformers', 'deepspeed') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def code_lines(source: str) -> set[int]:
    """The line numbers of ``source`` that hold code: not blank, not a comment alone, not part
    of a docstring (a module's, class's or function's, or an attribute's string statement)."""
    import ast
    import io
    import tokenize

    docs: set[int] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            docs.update(range(node.lineno, node.end_lineno + 1))
    skipped = {tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT, tokenize.ENDMARKER}
    lines: set[int] = set()
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type not in skipped:
            lines.update(n for n in range(token.start[0], token.end[0] + 1) if n not in docs)
    return lines


def test_code_lines_count_code_only():
    source = '''"""Module docstring,
two lines."""
X = 1
"""X's docstring."""


def f(a):
    """f's docstring."""
    # a comment
    return (a +
            1)
'''
    assert code_lines(source) == {3, 7, 10, 11}


def product_modules():
    """(path relative to the repository, source) of every module of the product's packages."""
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            yield str(path.relative_to(ROOT)), path.read_text()


def test_no_module_over_400_lines_of_code():
    """Modules of the product's packages hold at most 400 lines of code (:func:`code_lines`:
    docstrings, comments and blank lines are not counted)."""
    sizes = {rel: len(code_lines(source)) for rel, source in product_modules()}
    assert {rel: n for rel, n in sizes.items() if n > MAX_MODULE_CODE_LINES} == {}


def test_no_function_over_50_lines_of_code():
    """Functions of the product's packages hold at most 50 lines of code (docstrings, comments
    and blank lines not counted)."""
    import ast

    long = {}
    for rel, source in product_modules():
        lines = code_lines(source)
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                size = sum(node.lineno <= n <= node.end_lineno for n in lines)
                if size > MAX_FUNCTION_CODE_LINES:
                    long[f"{rel}::{node.name}"] = size
    assert long == {}


LOOPS = ("trainer_core/training/loop.py", "trainer_core/training/rl/trainer.py")
"""The supervised and the RL loop: they read what an objective, an algorithm or a config section
declares, never probe it."""


def test_the_loops_probe_no_objective_algorithm_or_config_with_getattr():
    """No ``getattr(x, ...)`` in the loops where ``x`` is an objective, an algorithm or a config
    (a name or attribute ``objective``, ``algo``, ``cfg``, ``config`` or ``*_cfg``): optional
    behaviour is a declared hook or attribute with a default (``Objective``, ``Algorithm``)."""
    import ast

    def probed(node: ast.expr) -> str | None:
        name = node.attr if isinstance(node, ast.Attribute) else node.id if isinstance(node, ast.Name) else None
        return name if name in {"objective", "algo", "cfg", "config"} or (name or "").endswith("_cfg") else None

    found = []
    for rel in LOOPS:
        for node in ast.walk(ast.parse((ROOT / rel).read_text())):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id in {"getattr", "hasattr"}
            ):
                if node.args and probed(node.args[0]):
                    found.append(f"{rel}:{node.lineno}")
    assert found == []


@pytest.mark.parametrize("stage", STAGE_ORDER)
def test_every_registered_stage_has_a_module_and_a_config_section(stage):
    definition = get_stage(stage)
    assert callable(importlib.import_module(definition.module).run)
    assert definition.section in PipelineConfig.model_fields


def test_stage_order_is_a_topological_order_of_the_inputs():
    """Given every stage's output, each stage reads only outputs of stages before it."""
    config = load_config(
        overrides={"ppo.reward.kind": "weighted", "grpo.reward.kind": "weighted", "distill.teacher_from": "/teacher"}
    )
    outputs = {s: f"<{s}>" for s in STAGE_ORDER}
    for i, stage in enumerate(STAGE_ORDER):
        read = {uri for uri in stage_inputs(config, stage, outputs).values() if uri.startswith("<")}
        assert read <= {f"<{s}>" for s in STAGE_ORDER[:i]}, stage


def test_lists_of_stages_derive_from_the_registry():
    """The default stage list, which stages run on the configured backend (the training ones),
    and the names the config accepts all come from the registry."""
    config = load_config()
    assert config.stages == list(DEFAULT_STAGES) == [s.name for s in STAGES if s.default]
    # opt-in: data or a teacher of their own
    assert set(STAGE_ORDER) - set(DEFAULT_STAGES) == {"pretrain", "kto", "teacher", "distill"}
    assert [s.name for s in STAGES if s.trains] == [s for s in STAGE_ORDER if config.backend_for(s) is config.backend]
    with pytest.raises(ConfigError, match="unknown stage 'simpo'"):
        get_stage("simpo")
    with pytest.raises(ValueError, match="unknown stage"):
        load_config(overrides={"stages": "prepare_data,simpo"})


def test_a_missing_upstream_output_names_what_to_run():
    with pytest.raises(ConfigError, match="stage 'dpo' needs the output of 'prepare_data'"):
        stage_inputs(load_config(), "dpo", {"sft": "S"})
    assert StageOutputs({"sft": "S"}, "dpo").require("sft") == "S"
