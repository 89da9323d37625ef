"""Collects the fault runs' reports and prints their summary at the end of the session (the
default run, ``pytest -m faults`` or ``-m soak``): one line per run (and what its faults
measured), then one table adding them all up. A failing run's own table is in its assertion
message."""

from __future__ import annotations

import pytest

from tests.faults.checker import Report

FAULT_REPORTS = pytest.StashKey[list[Report]]()


@pytest.fixture(scope="session")
def fault_reports(request: pytest.FixtureRequest) -> list[Report]:
    """Append a run's report here to have it in the terminal summary."""
    return request.config.stash.setdefault(FAULT_REPORTS, [])


def pytest_terminal_summary(
    terminalreporter: pytest.TerminalReporter, config: pytest.Config
) -> None:
    reports = config.stash.get(FAULT_REPORTS, [])
    if not reports:
        return
    terminalreporter.section("fault run summary")
    for report in reports:
        verdict = "ok" if report.ok else f"{len(report.violations)} violations"
        terminalreporter.write_line(f"{report.title}: {verdict} ({report.seconds:.1f} s)")
        for line in report.extra:  # what the faults measured (a failover's recovery time)
            terminalreporter.write_line(line)
    terminalreporter.write_line(Report.merged("all fault runs together", reports).table())
