"""The benches in bench/ are run by hand, for hours, so a broken import shows only when someone
sits down to measure (vs_trl.py once imported a helper that compare.py no longer had). Each bench
answers --help: its imports and its argument parser are sound. And the arithmetic a bench's
verdict rests on is checked against a reference: compare.py's chance of a fall by chance,
vs_trl.py's goals against numbers worked by hand."""
import importlib
import itertools
import json
import math
import subprocess
import sys
import time
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


def _bench(name):
    """bench/<name>.py as a module. bench/ holds a buffer.py (the buffer's bench), so the repo
    goes before it on sys.path, and sys.path is restored after the import: a searcher spawned by
    a later test inherits it and would import bench/buffer.py in place of the repo's buffer."""
    saved = list(sys.path)
    sys.path[:0] = [str(REPO), str(REPO / "bench")]
    try:
        return importlib.import_module(name)
    finally:
        sys.path[:] = saved


def test_chance_of_fall_by_hand():
    # One problem, two evaluations, a fall of more than half: right, then wrong.
    chance = _bench("compare").chance_of_fall(0.7, problems=1, evaluations=2, fall=0.5)
    assert chance == pytest.approx(0.7 * 0.3)


@pytest.mark.parametrize("fall", [0.3, 0.5])
def test_chance_of_fall_equals_enumerating_every_outcome_through_largest_fall(fall):
    """The exact walk against all 4^3 outcomes of three evaluations of three problems, each
    weighed by its binomial probability and judged by the function that measures the runs."""
    compare, accuracy, n = _bench("compare"), 0.6, 3
    pmf = [math.comb(n, k) * accuracy ** k * (1 - accuracy) ** (n - k) for k in range(n + 1)]
    chance = sum(pmf[a] * pmf[b] * pmf[c] for a, b, c in itertools.product(range(n + 1), repeat=3)
                 if compare.largest_fall([{"step": step, "eval/accuracy": k / n}
                                          for step, k in enumerate((a, b, c))],
                                         "eval/accuracy", after=-1) > fall)
    assert 0 < chance < 1
    walked = compare.chance_of_fall(accuracy, problems=n, evaluations=3, fall=fall)
    assert walked == pytest.approx(chance)


def test_vs_trl_goals_by_hand():
    """Two seeds a system: the best TRL row by end accuracy is the lr-3e-6 one (0.95 ± 0.014),
    the best at step 10 the default one (0.71). tba-sync: 0.96 ± 0.007 at the end (mean and sd
    met), 0.675 at step 10 (more than 3 points behind 0.71); tba-async: 0.96 ± 0.042 (sd not
    met), 0.70 at step 10 (within 3 points)."""
    def runs(ends, at_10):
        return [dict(end=e, by_step={0: (0.0, 0.35), 10: (60.0, a), 100: (600.0, e)})
                for e, a in zip(ends, at_10)]
    lines = _bench("vs_trl").goals({
        "tba-sync": runs([0.955, 0.965], [0.67, 0.68]),
        "tba-async": runs([0.93, 0.99], [0.69, 0.71]),
        "trl-default": runs([0.90, 0.96], [0.72, 0.70]),
        "trl-default lr-3e-6": runs([0.94, 0.96], [0.60, 0.62])})
    assert lines == [
        "goal, tba-sync: end 0.960 ± 0.007 vs trl-default lr-3e-6's 0.950 ± 0.014: mean at least "
        "theirs met, sd at most theirs met; step 10 0.675 vs trl-default's 0.710 (step 10), "
        "within 0.03 not met",
        "goal, tba-async: end 0.960 ± 0.042 vs trl-default lr-3e-6's 0.950 ± 0.014: mean at "
        "least theirs met, sd at most theirs not met; step 10 0.700 vs trl-default's 0.710 "
        "(step 10), within 0.03 met"]


def test_vs_trl_refuses_a_missing_trl_runs_folder_before_any_run(tmp_path):
    done = subprocess.run([sys.executable, "bench/vs_trl.py", "--systems", "tba-sync", "--runs",
                           str(tmp_path / "runs"), "--trl-runs", str(tmp_path / "missing")],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert done.stderr.startswith("error: --trl-runs") and done.stderr.count("\n") == 1
    assert not (tmp_path / "runs").exists()


def _finished_run(out, ends):
    """A run folder as tba.py and the TRL runner write it: a training row a step, an evaluation
    at step 0 and at the last step (the last being what makes the run finished)."""
    out.mkdir(parents=True)
    rows = [{"step": 0, "time": 10.0, "eval/accuracy": ends[0], "eval/n": 128}]
    rows += [{"step": s, "time": 10.0 + 20 * s, "loss": 0.1, "reward_mean": 0.5} for s in (1, 2)]
    rows += [{"step": 2, "time": 55.0, "eval/accuracy": ends[1], "eval/n": 128}]
    (out / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_vs_trl_report_only_reports_the_finished_runs_and_starts_none(tmp_path):
    """tba-sync finished on seeds 0 and 1, trl-default on seed 0 only: the report has both rows
    (n=2 and n=1) and trl-default's seed-1 run is not started; nothing finished is an error."""
    runs = tmp_path / "runs"
    _finished_run(runs / "tba-sync-s0", (0.35, 0.90))
    _finished_run(runs / "tba-sync-s1", (0.35, 0.80))
    _finished_run(runs / "trl-default-s0", (0.37, 0.70))
    command = [sys.executable, "bench/vs_trl.py", "--report-only", "--systems", "tba-sync",
               "trl-default", "--seeds", "0", "1", "--steps", "2", "--runs", str(runs)]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "| tba-sync | 0.350 ± 0.000 [0.350–0.350] (n=2) | 0.850 ± 0.071" in done.stdout
    assert "| trl-default | 0.370 ± 0.000 [0.370–0.370] (n=1) | 0.700 ± 0.000" in done.stdout
    assert "goal, tba-sync: end 0.850 ± 0.071 vs trl-default's 0.700 ± 0.000" in done.stdout
    assert sorted(p.name for p in runs.iterdir()) == ["tba-sync-s0", "tba-sync-s1",
                                                       "trl-default-s0"]
    done = subprocess.run([*command[:-1], str(tmp_path / "empty")], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert done.stderr.startswith("error: no finished run") and done.stderr.count("\n") == 1


def test_the_gpu_check_runs_on_tiny_shapes(tiny_model_dir, tmp_path):
    """bench/gpu.py, the check prepared for the first GPU machine, on the CPU with tiny shapes,
    so that it cannot rot while no GPU is at hand: every section reports its figures, none fails
    or runs out of its share of the time; the trainer gets left-padded prompts of different
    lengths (arith's, one step's widest 64 tokens), and the report says which attention ran."""
    out = tmp_path / "check"
    done = subprocess.run([sys.executable, "bench/gpu.py", "--tiny", "--device", "cpu",
                           "--out", str(out), "--model-files", str(tiny_model_dir),
                           "--only", "memory", "search", "profile", "trainer", "sync", "overlap"],
                          cwd=REPO, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    report = (out / "gpu.md").read_text()
    assert "failed" not in report and "skipped" not in report, report
    figures = json.loads((out / "gpu.json").read_text())
    assert all(figures[f"section_s/{s}"] <= figures[f"share_s/{s}"]
               for s in ("memory", "search", "profile", "trainer", "sync", "overlap"))
    assert "Attention: SDPA backends enabled" in report and figures["cudnn_version"] is None
    assert set(figures["sdp_enabled"]) == {"cudnn", "flash", "mem_efficient", "math"}
    assert "Attention kernels in one arith step (widest prompt 64" in report
    assert figures["sdpa_backends"] and any("scaled_dot_product" in n for n in figures["sdpa_kernels"])
    assert len([k for k in figures if k.startswith("step_s/")]) == 4
    for cache in ("prefix", "static"):                # batch 2 × 3 and 4 × 3: "140" and "560"
        for batch in (6, 12):
            assert figures[f"tokens_per_s/tiny Llama/{cache}/{batch}"] > 0
        assert figures[f"decode_ops/{cache}"] > 0
        assert (out / f"profile-decode-{cache}.txt").is_file()
    # HF's stop check; with padded prompts the eager loop's mask check adds one (transformers'
    # `_ignore_causal_mask_sdpa` reads the padding mask each step)
    assert figures["decode_syncs/static"] == 1 and 1 <= figures["decode_syncs/prefix"] <= 2
    assert 0 < figures["trainer_syncs"] <= 3 and (out / "profile-trainer-step.txt").is_file()
    assert len([k for k in figures if k.startswith("train_step_s/")]) == 2
    for shape in ("arith", "recipe"):                 # [steps][B] prompt lengths, left padded
        steps = figures[f"train_prompt_lengths/{shape}"]
        assert len(steps) == 3 and all(min(lengths) < max(lengths) for lengths in steps)
        assert figures[f"train_finite/{shape}"] == [True] * 3
    assert 64 in [max(lengths) for lengths in figures["train_prompt_lengths/arith"]]
    assert figures["searcher_load_s"] > 0
    assert figures["finite/0"] and figures["finite/1"] and figures["steps_done/1"] == 4
    assert figures["samples_per_s/0"] > 0 and figures["samples_per_s/1"] > 0
    assert figures["staleness/1"] > 0 == figures["staleness/0"]


def test_the_gpu_check_skips_what_its_share_cannot_hold():
    """A section's clock: its first measurement starts; a later one, assumed to take as long as
    the longest so far, is skipped and named when less than that is left."""
    clock = _bench("gpu").Clock(0.3)
    assert clock.next("first")
    time.sleep(0.2)                                  # the first took 0.2 s; 0.1 s is left
    assert not clock.next("second") and clock.skipped == ["second"]
    assert clock.next("third") is False and clock.skipped == ["second", "third"]


def test_the_lag_reports_falls_last_evaluations_and_why(tmp_path, capsys):
    """bench/lag.py's report and diagnostics plot on two made-up 50-step runs at L = 16: the
    final metric, the mean of the last 3 evaluations, the largest fall after step 25 below the
    best before it, and one loss against TB, by hand."""
    lag = _bench("lag")
    curves = {"tb": [0.4, 0.6, 0.9, 0.8, 0.5, 0.7], "tb-trust": [0.4, 0.6, 0.8, 0.9, 0.9, 0.95]}
    for loss, accuracy in curves.items():
        run = lag.folder(tmp_path, loss, 16, 3)
        run.mkdir()
        rows = [{"step": s, "loss": 1.0, "kl": 0.1, "reward_mean": s / 50, "grad_norm": 10.0,
                 "ess_frac": 0.5, "log_ratio_mean": -1.0, "log_ratio_rewarded": -0.5,
                 "log_ratio_unrewarded": -2.0, "low_ratio_share": 0.2,
                 **({"grad_cos_prev": 0.1} if s > 1 else {})} for s in range(1, 51)]
        evals = [{"step": 10 * i, "eval/accuracy": a} for i, a in enumerate(accuracy)]
        (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows + evals))
    lag.main(["arith", "--report-only", "--runs", str(tmp_path), "--steps", "50", "--seeds", "3",
              "--lags", "16", "--losses", "tb", "tb-trust", "--plot-why", str(tmp_path / "why.png")])
    out = capsys.readouterr().out
    tb = next(line for line in out.splitlines() if line.startswith("| tb | 16 |"))
    # final 0.7; last three (0.8 + 0.5 + 0.7) / 3; the fall: 0.9 at step 20 to 0.5 at step 40
    assert "| 0.700 ± 0.000" in tb and "| 0.667 ± 0.000" in tb and "| 0.400 ± 0.000" in tb
    trust = next(line for line in out.splitlines() if line.startswith("| tb-trust | 16 |"))
    assert "| 0.000 ± 0.000" in trust                       # it never falls
    # against TB on its one seed: 0.95 - 0.7 ahead, and no win on one seed (the rule needs every
    # seed of several ahead by more than the larger sd)
    assert "| tb-trust | 16 | tb | 3 | +0.250 | 0.000 | no | +0.250 | +0.250 |" in out
    why = next(line for line in out.splitlines() if line.startswith("| tb | 16 | 10.000"))
    assert "0.100 ± 0.000" in why and "0.200 ± 0.000" in why
    assert (tmp_path / "why.png").stat().st_size > 10_000


def test_the_lag_report_names_the_evaluations_a_run_is_missing():
    """Evaluations every 10 steps, the one at step 20 and 70 absent (a run stopped while it
    evaluated): named; a last evaluation closer to the one before (the final step) is no gap."""
    lag = _bench("lag")
    assert lag.missing_evaluations([0, 10, 30, 40, 50, 60, 80, 90, 100]) == [20, 70]
    assert lag.missing_evaluations([0, 10, 20, 25]) == [] == lag.missing_evaluations([0, 25])
