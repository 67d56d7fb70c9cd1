"""The parity table: every comparison of ``tests/parity`` (``trl_oracle.RESULTS``) printed at the end
of the session, in the layout of bench/README.md's "Parity with TRL" (under pytest-xdist the
workers' tables are not shown: run ``pytest tests/parity`` without ``-n`` to get it)."""

from __future__ import annotations

import pytest

from tests.parity import trl_oracle


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if not trl_oracle.RESULTS:
        return
    write = terminalreporter.write_line
    terminalreporter.section("parity with TRL")
    write("| objective | quantity | steps | max rel. diff | max abs. diff | tolerance |")
    write("|---|---|---|---|---|---|")
    for r in trl_oracle.RESULTS:
        if r.tolerance:
            tolerance = r.tolerance
        elif r.departure:
            tolerance = f"departure: must exceed rel {r.rtol:g}"
        else:
            tolerance = f"rel {r.rtol:g}" + (f" + abs {r.atol:g}" if r.atol else "")
        write(f"| {r.objective} | {r.quantity} | {r.steps} | {r.max_rel:.1e} | {r.max_abs:.1e} | {tolerance} |")
