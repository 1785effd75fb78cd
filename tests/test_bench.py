"""The benches in bench/ are run by hand, for hours, so a broken import shows only when someone
sits down to measure (vs_trl.py once imported a helper that compare.py no longer had). Each bench
answers --help: its imports and its argument parser are sound. And the arithmetic a bench's
verdict rests on is checked against a reference: compare.py's chance of a fall by chance."""
import itertools
import math
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


def _compare():
    """bench/compare.py as a module. sys.path is restored after the import: bench/ holds a
    buffer.py, and a searcher spawned by a later test inherits sys.path and would import it in
    place of the repo's buffer module."""
    saved = list(sys.path)
    sys.path.insert(0, str(REPO / "bench"))
    try:
        import compare
    finally:
        sys.path[:] = saved
    return compare


def test_chance_of_fall_by_hand():
    # One problem, two evaluations, a fall of more than half: right, then wrong.
    chance = _compare().chance_of_fall(0.7, problems=1, evaluations=2, fall=0.5)
    assert chance == pytest.approx(0.7 * 0.3)


@pytest.mark.parametrize("fall", [0.3, 0.5])
def test_chance_of_fall_equals_enumerating_every_outcome_through_largest_fall(fall):
    """The exact walk against all 4^3 outcomes of three evaluations of three problems, each
    weighed by its binomial probability and judged by the function that measures the runs."""
    compare, accuracy, n = _compare(), 0.6, 3
    pmf = [math.comb(n, k) * accuracy ** k * (1 - accuracy) ** (n - k) for k in range(n + 1)]
    chance = sum(pmf[a] * pmf[b] * pmf[c] for a, b, c in itertools.product(range(n + 1), repeat=3)
                 if compare.largest_fall([{"step": step, "eval/accuracy": k / n}
                                          for step, k in enumerate((a, b, c))],
                                         "eval/accuracy", after=-1) > fall)
    assert 0 < chance < 1
    walked = compare.chance_of_fall(accuracy, problems=n, evaluations=3, fall=fall)
    assert walked == pytest.approx(chance)
