"""The soak (marker ``soak``, deselected by default; ``pytest -m soak``): minutes of random
duplicates and random faults on one cluster keep every invariant of the short run, round
after round, with every kind of fault injected, and write the summary with the gateways'
memory over time to ``tests/faults/SOAK.md``. ``GATEWAY_SOAK_MINUTES`` sets the length
(default 3, at most 30).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.faults.checker import Report
from tests.faults.faults import KINDS
from tests.faults.soak import SOAK_FILE, render, soak

pytestmark = [pytest.mark.soak, pytest.mark.multiprocess]


async def test_soak_keeps_every_invariant(tmp_path: Path, fault_reports: list[Report]) -> None:
    minutes = float(os.environ.get("GATEWAY_SOAK_MINUTES", "3"))
    result = await soak(minutes, workdir=tmp_path)
    SOAK_FILE.write_text(render(result), encoding="utf-8")
    report = result.report
    fault_reports.append(report)

    assert report.ok, report.table()
    assert len(result.rounds) > 1
    if minutes >= 2:
        assert set(report.faults) == set(KINDS), report.faults
    assert result.rss, "no gateway memory was sampled"
