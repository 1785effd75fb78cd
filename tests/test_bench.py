"""The benches in bench/ are run by hand, for hours, so a broken import shows only when someone
sits down to measure (vs_trl.py once imported a helper that compare.py no longer had). Each bench
answers --help: its imports and its argument parser are sound."""
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
BENCHES = sorted(p.name for p in (REPO / "bench").glob("*.py"))


def test_every_bench_is_listed():
    assert "vs_trl.py" in BENCHES and len(BENCHES) >= 10


@pytest.mark.parametrize("bench", BENCHES)
def test_a_bench_imports_and_answers_help(bench):
    done = subprocess.run([sys.executable, f"bench/{bench}", "--help"], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.startswith("usage:"), done.stdout[:500]
