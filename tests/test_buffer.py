import math
import time

import pytest
import torch

from plumbing.staleness import off_policy_metrics
import trainer
from batch import REFERENCE, GroupBatch
from buffer import ReplayBuffer

K, P, R, N = 3, 6, 5, 64       # group size, longest prompt and response, prompts of the dataset


def make_group(gid, k=K, p=P, r=R):
    """Group `gid`: prompt `gid` and k completions whose every field is derived from (gid, j),
    token 100·gid + j included, so that a torn or mixed-up completion is detectable."""
    prompt = torch.full((1 + gid % p,), gid)                                    # [p'] unpadded
    lens = torch.tensor([1 + (gid + j) % r for j in range(k)])                  # [k]
    resp = torch.stack([torch.full((r,), 100 * gid + j) for j in range(k)])     # [k, r] (tails are not pad)
    j = torch.arange(k, dtype=torch.float32)
    return dict(prompt_ids=prompt, response_ids=resp, response_len=lens,
                reward=torch.full((k,), float(gid)), ref_logp=-gid - j,
                behaviour_logp=-2.0 * gid - j, version=gid, prompt_index=gid)


def check_consistent(batch: GroupBatch, pad_id=0, p=P, r=R):
    """Every completion in the batch must be exactly completion j of make_group(its prompt)."""
    for b in range(batch.prompt_index.shape[0]):
        gid = int(batch.prompt_index[b])
        mask = batch.prompt_mask[b].bool()
        assert int(mask.sum()) == 1 + gid % p
        assert torch.equal(batch.prompt_ids[b], torch.where(mask, gid, pad_id))
        for c in range(batch.response_len.shape[1]):
            if not batch.keep[b, c]:
                assert batch.response_len[b, c] == 0 and (batch.response_ids[b, c] == pad_id).all()
                continue
            j = int(batch.response_ids[b, c, 0]) - 100 * gid
            n = int(batch.response_len[b, c])
            assert 0 <= j < K and n == 1 + (gid + j) % r
            assert torch.all(batch.response_ids[b, c, :n] == 100 * gid + j)
            assert torch.all(batch.response_ids[b, c, n:] == pad_id)
            assert batch.reward[b, c] == gid and batch.ref_logp[b, c] == -gid - j
            assert batch.behaviour_logp[b, c] == -2 * gid - j and batch.version[b, c] == gid


def filled(n, capacity=None, versions=None, rewards=None, **options):
    """A buffer holding groups 1..n (prompts 1..n), K completions each."""
    buf = ReplayBuffer(capacity or n * K, K, P, R, n_prompts=N, **options)
    for i in range(n):
        g = make_group(i + 1)
        if versions is not None:
            g["version"] = versions[i]
        if rewards is not None:
            g["reward"] = torch.full((K,), float(rewards[i]))
        buf.add(**g)
    return buf


def test_groups_are_formed_when_drawn_k_completions_of_one_prompt():
    buf = filled(6)
    assert len(buf) == 6 * K and buf.drawable_groups() == 6
    batch = buf.sample(4, recent_frac=0.0, generator=torch.Generator().manual_seed(0))
    assert batch.keep.all() and batch.response_ids.shape[:2] == (4, K)
    check_consistent(batch)                      # each row: completions of its own prompt
    # A prompt holding 2K + 2 completions makes three groups: K, K, then 2.
    buf = ReplayBuffer(20, K, P, R, n_prompts=N)
    for _ in range(2):
        buf.add(**make_group(1))
    buf.add(**{**make_group(1, k=2)})
    assert buf.drawable_groups() == 3
    batch = buf.sample(3, recent_frac=0.0)
    assert sorted(batch.keep.sum(1).tolist()) == [2, K, K]
    assert batch.prompt_index.tolist() == [1, 1, 1]
    assert len(set(batch.order[batch.keep].tolist())) == 2 * K + 2   # none twice
    check_consistent(batch)


def test_empty_buffer_and_too_many():
    buf = ReplayBuffer(4 * K, K, P, R, n_prompts=N)
    assert len(buf) == 0
    buf.add(**make_group(1))
    with pytest.raises(ValueError, match="cannot sample 2 groups"):
        buf.sample(2, recent_frac=0.5)


def test_sample_shapes_and_trimming():
    buf = filled(10)
    batch = buf.sample(4, recent_frac=0.3, generator=torch.Generator().manual_seed(0))
    p_max, r_max = int(batch.prompt_mask.sum(1).max()), int(batch.response_len.max())
    assert batch.prompt_ids.shape == batch.prompt_mask.shape == (4, p_max)
    assert batch.response_ids.shape == (4, K, r_max)
    for name in ("response_len", "reward", "ref_logp", "behaviour_logp", "version", "order",
                 "draws", "keep", "from_reference", "search_temperature"):
        assert getattr(batch, name).shape == (4, K), name
    assert batch.prompt_index.shape == (4,)
    assert batch.prompt_ids.dtype == batch.response_ids.dtype == torch.int64
    assert batch.reward.dtype == batch.ref_logp.dtype == torch.float32
    assert batch.to("cpu").response_ids.shape == batch.response_ids.shape


def test_padding_and_lengths():
    buf = ReplayBuffer(8, 2, max_prompt_len=5, max_response_len=4, n_prompts=2, pad_id=9)
    # response tails past the length hold junk (7) that must become pad
    buf.add([1, 2], [[3, 4, 7], [5, 7, 7]], [2, 1], [0.0, 1.0], [-1.0, -2.0], [-3.0, -4.0], 0, 0)
    buf.add([1, 2, 3], [[6, 6], [6, 6]], [2, 2], [0.0, 0.0], [0.0, 0.0], [0.0, 0.0], 0, 1)
    b = buf.sample(2, recent_frac=0.0)
    first, second = b.prompt_index.tolist().index(0), b.prompt_index.tolist().index(1)
    assert b.prompt_ids.shape == (2, 3) and b.response_ids.shape == (2, 2, 2)
    assert b.prompt_ids[first].tolist() == [9, 1, 2] and b.prompt_mask[first].tolist() == [0, 1, 1]
    assert b.prompt_ids[second].tolist() == [1, 2, 3] and b.prompt_mask[second].tolist() == [1, 1, 1]
    rows = sorted(zip(b.response_ids[first].tolist(), b.response_len[first].tolist(),
                      b.ref_logp[first].tolist(), b.behaviour_logp[first].tolist()))
    assert rows == [([3, 4], 2, -1.0, -3.0), ([5, 9], 1, -2.0, -4.0)]


def test_add_batch_stores_what_add_stores_group_by_group():
    """`add_batch` (a searcher's whole batch) is `add` of each group, in order."""
    groups = [make_group(g) for g in (3, 7)]
    one, whole = ReplayBuffer(20, K, P, R, N), ReplayBuffer(20, K, P, R, N)
    for g in groups:
        one.add(**g)
    batch = GroupBatch(
        prompt_ids=torch.zeros(2, P, dtype=torch.long), prompt_mask=torch.zeros(2, P, dtype=torch.long),
        response_ids=torch.stack([g["response_ids"] for g in groups]),
        response_len=torch.stack([g["response_len"] for g in groups]),
        reward=torch.stack([g["reward"] for g in groups]),
        ref_logp=torch.stack([g["ref_logp"] for g in groups]),
        behaviour_logp=torch.stack([g["behaviour_logp"] for g in groups]),
        version=torch.tensor([[g["version"]] * K for g in groups]),
        prompt_index=torch.tensor([g["prompt_index"] for g in groups]),
        search_temperature=torch.full((2, K), math.nan))
    assert whole.add_batch([g["prompt_ids"] for g in groups], batch) == 2 * K
    for name in ReplayBuffer.FIELDS + ("n_added",):
        torch.testing.assert_close(getattr(whole, name), getattr(one, name), rtol=0, atol=0,
                                   equal_nan=True, msg=name)


def test_add_rejects_bad_shapes():
    buf = ReplayBuffer(4 * K, K, P, R, n_prompts=N)
    g = make_group(1)
    for key, bad in [("prompt_ids", torch.ones(P + 1)), ("prompt_ids", torch.ones(1, 2)),
                     ("response_ids", torch.ones(K, R + 1)), ("response_len", torch.tensor([1, 2])),
                     ("reward", torch.zeros(K + 1)), ("response_len", torch.full((K,), R + 1)),
                     ("behaviour_logp", torch.zeros(K - 1)), ("prompt_index", N),
                     ("version", torch.zeros(K + 1))]:
        with pytest.raises(ValueError):
            buf.add(**{**g, key: bad})
    assert len(buf) == 0


def test_no_completion_twice_in_a_batch():
    buf = filled(12, versions=[0] * 6 + [1] * 6, rewards=list(range(12)))
    gen = torch.Generator().manual_seed(1)
    for i in range(300):
        b = buf.sample(8, recent_frac=0.7, priority_temp=[None, 0.5, 0.01][i % 3], generator=gen)
        assert len(set(b.order[b.keep].tolist())) == int(b.keep.sum()) == 8 * K
    assert sorted(buf.sample(12, recent_frac=1.0).order.flatten().tolist()) == list(range(12 * K))


def test_recent_draws_take_only_the_newest_version_while_it_lasts():
    """recent_frac 1: every group comes from the newest policy version's completions while a
    prompt has 2 of them; then from everything. recent_count says how many did."""
    buf = filled(6, versions=[0, 0, 0, 0, 1, 1])
    gen = torch.Generator().manual_seed(2)
    for _ in range(50):
        b = buf.sample(2, recent_frac=1.0, generator=gen)
        assert (b.version == 1).all() and b.recent_count == 2
        b = buf.sample(4, recent_frac=1.0, generator=gen)
        assert (b.version == 1).sum() == 2 * K and b.recent_count == 2
        b = buf.sample(3, recent_frac=0.0, generator=gen)
        assert b.recent_count == 0


def expected_newest(n_buf, n_newest, n, m):
    """Exact mean/variance of #newest-version groups in a batch of whole-prompt groups, and
    the mean recent_count."""
    dist = {0: 1.0}  # newest-version groups taken so far -> probability
    recent_count = 0.0
    for i in range(n):
        nxt = {}
        for r, pr in dist.items():
            left = n_newest - r
            recent_count += pr * m * (left > 0)
            take = m * (left > 0) + (1 - m) * left / (n_buf - i)
            nxt[r + 1] = nxt.get(r + 1, 0.0) + pr * take
            nxt[r] = nxt.get(r, 0.0) + pr * (1 - take)
        dist = nxt
    mean = sum(r * p for r, p in dist.items())
    return mean, sum(r * r * p for r, p in dist.items()) - mean ** 2, recent_count


def test_recent_frac_statistics():
    m, n_buf, n_newest, draws = 0.5, 12, 3, 3000
    assert expected_newest(n_buf, n_newest, 1, m)[0] == pytest.approx(m + (1 - m) * 3 / 12)
    buf = filled(n_buf, versions=[0] * 5 + [1] * 4 + [2] * n_newest)
    gen = torch.Generator().manual_seed(2)
    for n in (1, 4):  # with n=4 the recent pool is often exhausted
        mean, var, mean_recent = expected_newest(n_buf, n_newest, n, m)
        newest = recent = 0
        for _ in range(draws):
            b = buf.sample(n, recent_frac=m, generator=gen)
            newest += int((b.version[:, 0] == 2).sum())
            recent += b.recent_count
        se = math.sqrt(var / draws)
        assert abs(newest / draws - mean) < 4 * se, (n, newest / draws, mean)
        assert abs(recent / draws - mean_recent) < 0.1 * n


def test_reward_prioritised_sampling():
    """Prompts are drawn ∝ exp(mean reward of their completions / τ)."""
    rewards, temp, draws = [0.0, 0.2, 0.4, 0.6, 0.8, 1.0], 0.3, 6000
    buf = filled(6, rewards=rewards)
    probs = torch.softmax(torch.tensor(rewards, dtype=torch.float64) / temp, 0)
    gen = torch.Generator().manual_seed(3)
    counts = torch.zeros(6, dtype=torch.float64)
    for _ in range(draws):
        counts[buf.sample(1, recent_frac=0.0, priority_temp=temp, generator=gen).prompt_index - 1] += 1
    freq = counts / draws
    assert torch.all((freq - probs).abs() < 4 * (probs * (1 - probs) / draws).sqrt()), (freq, probs)
    assert int(freq.argmax()) == 5


def test_completions_are_drawn_by_reward_within_a_prompt():
    """Within a prompt, up to K completions one after another ∝ exp(reward / τ) (Plackett-Luce):
    the first of a group is drawn with the softmax of the rewards."""
    rewards, temp, draws = torch.tensor([0.0, 0.5, 1.0, 1.5]), 0.5, 6000
    buf = ReplayBuffer(8, 2, P, R, n_prompts=1)
    buf.add([1], torch.arange(4)[:, None] + 10, [1] * 4, rewards, [0.0] * 4, [0.0] * 4, 0, 0)
    probs = torch.softmax(rewards.double() / temp, 0)
    gen, counts = torch.Generator().manual_seed(5), torch.zeros(4, dtype=torch.float64)
    for _ in range(draws):
        counts[int(buf.sample(1, 0.0, temp, gen).response_ids[0, 0, 0]) - 10] += 1
    freq = counts / draws
    assert torch.all((freq - probs).abs() < 4 * (probs * (1 - probs) / draws).sqrt()), (freq, probs)


def test_priority_numerically_stable():
    buf = filled(5, rewards=[1000.0, 2000.0, 3000.0, 4000.0, 5000.0])
    b = buf.sample(3, recent_frac=0.0, priority_temp=1e-3)  # naive exp would overflow
    assert b.reward[:, 0].tolist() == [5000.0, 4000.0, 3000.0]


def test_generator_reproducible():
    buf = filled(10, rewards=list(range(10)))
    a = buf.sample(5, 0.5, 1.0, generator=torch.Generator().manual_seed(7))
    b = buf.sample(5, 0.5, 1.0, generator=torch.Generator().manual_seed(7))
    assert torch.equal(a.order, b.order) and a.recent_count == b.recent_count


def test_oldest_eviction_evicts_the_oldest_completion_of_all():
    buf = filled(8, capacity=5 * K)
    assert len(buf) == 5 * K and buf.version.max() == 8
    batch = buf.sample(5, recent_frac=0.0)
    assert sorted(batch.prompt_index.tolist()) == [4, 5, 6, 7, 8]   # prompts 1..3 evicted
    check_consistent(batch)


def test_lowest_eviction_removes_the_lowest_reward():
    """A prompt at its cap evicts its lowest reward (the oldest of equals), and a newcomer
    worse than everything its prompt holds is not stored; a full buffer takes the lowest of
    the prompt holding the most."""
    buf = ReplayBuffer(6, 2, P, R, n_prompts=2, per_prompt=4, evict="lowest")

    def add(prompt, rewards, first_token):
        n = len(rewards)
        return buf.add([1], torch.arange(first_token, first_token + n)[:, None], [1] * n,
                       rewards, [0.0] * n, [0.0] * n, 0, prompt)

    add(0, [0.5, 0.1, 0.9, 0.3], 10)
    assert add(0, [0.4], 20) == 1                           # 0.1 goes
    assert sorted(buf.reward[buf.prompt_index == 0].tolist()) == pytest.approx([0.3, 0.4, 0.5, 0.9])
    assert add(0, [0.2], 30) == 0                           # worse than all: not stored
    add(1, [0.0, 0.0], 40)                                  # fills the buffer (6)
    assert add(1, [0.7], 50) == 1                           # full: prompt 0 (4 held) loses 0.3
    assert sorted(buf.reward[buf.prompt_index == 0].tolist()) == pytest.approx([0.4, 0.5, 0.9])
    assert add(1, [0.6], 60) == 1                           # 3 and 3 held: prompt 0 loses 0.4
    assert sorted(buf.reward.tolist()) == pytest.approx([0.0, 0.0, 0.5, 0.6, 0.7, 0.9])


def test_per_prompt_cap_with_oldest_eviction():
    buf = ReplayBuffer(100, K, P, R, n_prompts=N, per_prompt=2 * K)
    for _ in range(3):
        buf.add(**make_group(1))
    buf.add(**make_group(2))
    assert (buf.prompt_index == 1).sum() == 2 * K and (buf.prompt_index == 2).sum() == K
    assert buf.order[buf.prompt_index == 1].min() == K      # the first copy went


def test_dedup_never_stores_a_completion_twice():
    buf = ReplayBuffer(50, K, P, R, n_prompts=N, dedup=True)
    g = make_group(1)
    g["response_ids"][2] = g["response_ids"][0]             # a duplicate within the group
    g["response_len"][2] = g["response_len"][0]
    buf.add(**g)
    assert len(buf) == K - 1
    buf.add(**{**make_group(1), "version": 7})              # newer copies replace in place
    assert len(buf) == K and buf.version[buf.prompt_index == 1].tolist() == [7] * K
    for _ in range(5):
        buf.add(**make_group(1))
    stored = buf.response_ids[buf.prompt_index == 1]
    assert len(buf) == K and len({tuple(r.tolist()) for r in stored}) == K


def test_a_merged_cluster_keeps_its_best_across_eviction():
    """The best completion of a cluster of near-duplicates blocks its worse rediscoveries; each
    rediscovery renews its age, so "oldest" eviction never takes it while the searchers keep
    finding it (before, a stored best aged out while it kept its rediscoveries out)."""
    buf = ReplayBuffer(4, 2, P, R, n_prompts=1, per_prompt=4, merge_cosine=0.9,
                       embedding_dim=2)
    best = [1.0, 0.0]

    def add(tokens, rewards, embeddings):
        n = len(tokens)
        return buf.add([1], torch.tensor(tokens)[:, None], [1] * n, rewards, [0.0] * n,
                       [0.0] * n, 0, 0, embedding=torch.tensor(embeddings))

    add([10], [1.0], [best])
    for step in range(20):                  # a worse near copy of the best, and a new one
        other = [math.cos(0.05 * step + 1), math.sin(0.05 * step + 1)]
        add([11, 20 + step], [0.5, 0.0], [best, other])
        assert buf.response_ids[:, 0].tolist().count(10) == 1, step   # the best survives
        assert 11 not in buf.response_ids[:, 0].tolist()             # its copies stay out
    # A better near copy replaces it.
    assert add([12], [2.0], [best]) == 1
    assert 10 not in buf.response_ids[:, 0].tolist() and 12 in buf.response_ids[:, 0].tolist()


def test_reuse_and_staleness_bounds_are_per_completion():
    """max_reuse counts each completion's draws (this one included); min_version bounds each
    completion's version; reference samples are of no version and pass any staleness bound."""
    buf = filled(2, capacity=10 * K, versions=[0, 5])
    first = buf.sample(2, 0.0, max_reuse=2)
    assert first.draws[first.keep].tolist() == [1] * 2 * K
    second = buf.sample(2, 0.0, max_reuse=2)
    assert second.draws[second.keep].tolist() == [2] * 2 * K
    assert buf.drawable_groups(max_reuse=2) == 0 and buf.drawable_groups() == 2     # used up, but still there
    with pytest.raises(ValueError, match="drawn fewer than 2 times"):
        buf.sample(1, 0.0, max_reuse=2)
    buf.add(**make_group(3))                                    # new completions start at 0
    assert buf.drawable_groups(max_reuse=2) == 1
    assert buf.drawable_groups(min_version=4) == 1                        # prompt 2 (version 5)
    assert buf.sample(1, 0.0, min_version=4).prompt_index.tolist() == [2]
    buf.add(**{**make_group(4), "version": REFERENCE})
    assert buf.drawable_groups(min_version=4) == 2                        # never stale


def test_reference_samples_are_not_recent_and_count_in_no_staleness():
    """A quarter of the completions sampled by the reference: they carry REFERENCE, stay out of
    the newest-version pool and out of the staleness metrics, and their share is reported."""
    buf = filled(3, capacity=10 * K, versions=[4, 4, 4])
    buf.add(**{**make_group(4), "version": REFERENCE})
    for _ in range(20):
        b = buf.sample(3, recent_frac=1.0)
        assert not b.from_reference.any() and (b.version == 4).all()
    b = buf.sample(4, recent_frac=0.0)
    assert b.from_reference.sum() == K and (b.version[b.from_reference] == REFERENCE).all()
    metrics = b.sampling_metrics(version=6)
    assert metrics["staleness_mean"] == metrics["staleness_max"] == 2.0
    assert metrics["from_reference_frac"] == 0.25 and metrics["trained_completions"] == 4 * K


def test_tb_on_a_group_drawn_across_versions_by_hand():
    """A group mixing completions of three versions: TB's loss is the formula on its kept
    completions, and staleness, log π/μ and ESS are exact per completion."""
    buf = ReplayBuffer(20, 4, P, R, n_prompts=1)
    for version, reward, log_mu in ((1, 0.0, -3.0), (2, 1.0, -2.0), (3, 0.5, -1.0)):
        buf.add([1], [[10 + version], [20 + version]], [1, 1], [reward, reward + 0.25],
                [-1.0, -1.5], [log_mu, log_mu - 0.5], version, 0)
    batch = buf.sample(1, recent_frac=0.0, generator=torch.Generator().manual_seed(0))
    assert batch.keep.all() and set(batch.version[0].tolist()) <= {1, 2, 3}
    assert len(set(batch.version[0].tolist())) >= 2           # 4 of 6: at least two versions
    logp = torch.tensor([[-2.0, -1.0, -0.5, -3.0]], requires_grad=True)        # [1, 4]
    beta = 0.5
    loss, log_z = trainer.tb_loss(logp, batch.ref_logp, batch.reward, beta)
    delta = [float(logp[0, i].detach() - batch.ref_logp[0, i] - batch.reward[0, i] / beta) for i in range(4)]
    want_z = -sum(delta) / 4
    assert log_z.item() == pytest.approx(want_z)
    assert loss.item() == pytest.approx(sum((want_z + d) ** 2 for d in delta) / 4)
    staleness = [5 - v for v in batch.version[0].tolist()]
    metrics = batch.sampling_metrics(version=5)
    assert metrics["staleness_mean"] == pytest.approx(sum(staleness) / 4)
    assert metrics["staleness_max"] == max(staleness)
    ratio = (logp.detach() - batch.behaviour_logp)[0]                           # [4]
    w = ratio.exp()
    off = off_policy_metrics(logp, batch.behaviour_logp)
    assert off["log_ratio_mean"] == pytest.approx(ratio.mean().item())
    assert off["ess_frac"] == pytest.approx((w.sum() ** 2 / (4 * (w ** 2).sum())).item())


def test_state_dict_round_trip():
    buf = filled(7, capacity=5 * K)
    buf.sample(2, 0.0)                                  # draw counts travel with the completions
    state = buf.state_dict()
    other = ReplayBuffer(5 * K, K, P, R, n_prompts=N)
    other.load_state_dict(state, max_version=7)
    assert len(other) == 5 * K and other.version.max() == 7
    for name in ReplayBuffer.FIELDS:                   # unrecorded temperatures are NaN
        torch.testing.assert_close(getattr(other, name), getattr(buf, name), equal_nan=True,
                                   rtol=0, atol=0)
    gen_a, gen_b = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    for b in (buf, other):                              # both go on the same way
        b.add(**make_group(8))
    assert torch.equal(buf.sample(5, 0.5, 1.0, gen_a).order, other.sample(5, 0.5, 1.0, gen_b).order)
    assert sorted(other.sample(5, 0.0).prompt_index.tolist()) == [4, 5, 6, 7, 8]
    with pytest.raises(ValueError, match="response_ids"):
        ReplayBuffer(5 * K, K, P, R + 1, n_prompts=N).load_state_dict(state, max_version=7)
    with pytest.raises(ValueError, match="capacity=16"):
        ReplayBuffer(16, K, P, R, n_prompts=N).load_state_dict(state, max_version=7)


def test_a_group_ring_state_is_refused_with_one_line():
    """A checkpoint of the buffer of whole groups (before completions) cannot be resumed here."""
    state = filled(2).state_dict()
    state["response_ids"] = torch.zeros(2, K, R, dtype=torch.int32)
    state["keep"] = torch.ones(2, K, dtype=torch.bool)
    with pytest.raises(ValueError, match="holds whole groups"):
        filled(2).load_state_dict(state, max_version=7)


def spoiled(name, index, value):
    state = filled(7, capacity=7 * K).state_dict()
    state[name][index] = value
    return state


@pytest.mark.parametrize("state, message", [
    (spoiled("response_len", 1, R + 1), f"response lengths outside \\[1, {R}\\]: \\[{R + 1}\\]"),
    (spoiled("response_len", 2, 0), "response lengths outside"),
    (spoiled("prompt_len", 4, P + 3), f"prompt lengths outside \\[1, {P}\\]"),
    (spoiled("version", 1, 8), "versions outside \\[-1, 7\\]: \\[8\\]"),      # from the future
    (spoiled("version", 1, -2), "versions outside"),
    (spoiled("prompt_index", 1, N), "prompt indices outside"),
    (spoiled("reward", 3, math.nan), "non-finite rewards"),
    (spoiled("ref_logp", 0, -math.inf), "non-finite reference log-probs"),
    (spoiled("behaviour_logp", 1, -math.inf), "infinite behaviour log-probs"),
    (spoiled("order", 0, 99), "insertion orders"),
    (spoiled("draws", 0, -2), "negative draw counts"),
    (dict(spoiled("draws", 0, 0), n_added=-3), "'n_added' must be a count"),
    (dict(spoiled("draws", 0, 0), reward=torch.zeros(7 * K, dtype=torch.float64)), "float64"),
])
def test_impossible_buffer_state_is_refused(state, message):
    """Right shapes, impossible values: each is refused with what is wrong, nothing loaded."""
    buf = ReplayBuffer(7 * K, K, P, R, n_prompts=N)
    with pytest.raises(ValueError, match=message):
        buf.load_state_dict(state, max_version=7)
    assert len(buf) == 0


def _writer(buf, writer_id, started, stop):
    """Process target: write self-consistent groups (odd ids / even ids) until told to stop."""
    i = 0
    while not stop.is_set() and i < 200_000:
        buf.add(**make_group(1 + (2 * i + writer_id) % (N - 1)))
        i += 1
        if i == 10:
            started.set()


def test_concurrent_writers_no_torn_completions():
    ctx = torch.multiprocessing.get_context("spawn")
    buf = ReplayBuffer(32 * K, K, P, R, n_prompts=N)
    stop = ctx.Event()
    started = [ctx.Event(), ctx.Event()]
    procs = [ctx.Process(target=_writer, args=(buf, w, started[w], stop)) for w in range(2)]
    for p in procs:
        p.start()
    try:
        assert all(e.wait(timeout=60) for e in started), "writers did not start"
        seen_parity, n_batches, t_end = set(), 0, time.time() + 1.5
        while time.time() < t_end:
            batch = buf.sample(8, recent_frac=0.5)
            check_consistent(batch)
            seen_parity.update(int(i) % 2 for i in batch.prompt_index)
            n_batches += 1
        assert seen_parity == {0, 1}  # both processes' writes are visible here
        assert n_batches > 20
    finally:
        stop.set()
        for p in procs:
            p.join(timeout=30)
    assert all(p.exitcode == 0 for p in procs)
    assert int(buf.n_added[0]) > 64 * K  # the buffer evicted while being read
    check_consistent(buf.sample(buf.drawable_groups(), recent_frac=0.0))
