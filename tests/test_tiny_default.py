"""The README's promise about the embedded default: every member's greedy accuracy rises by at least 20 points
over step 0. (Its wall time is measured by benchmarks/tiny_default.py, not asserted here.)"""

from __future__ import annotations

import json

import pytest

from ftis_engine.cli import main

from .helpers import TINY


@pytest.mark.slow
def test_tiny_default_every_member_gains_20_points(tmp_path):
    with pytest.raises(SystemExit) as done:
        main(["train", "--config", str(TINY), "--output-dir", str(tmp_path)])
    assert done.value.code == 0
    evals = [json.loads(line) for line in (tmp_path / "tiny" / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in evals if r["kind"] == "eval"]
    last = max(r["step"] for r in evals)
    for member in {r["member"] for r in evals}:
        start_acc = next(r["accuracy"] for r in evals if r["member"] == member and r["step"] == 0)
        end_acc = next(r["accuracy"] for r in evals if r["member"] == member and r["step"] == last)
        assert end_acc - start_acc >= 0.20, (member, start_acc, end_acc)
