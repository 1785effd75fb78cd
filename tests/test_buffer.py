import dataclasses
import math
import time

import pytest
import torch

from buffer import GroupBatch, ReplayBuffer

K, P, R = 3, 6, 5


def make_group(gid, k=K, p=P, r=R):
    """A group whose every field is derived from one id, so a torn group is detectable."""
    prompt = torch.full((1 + gid % p,), gid)                       # [p'] unpadded
    lens = torch.tensor([1 + (gid + j) % r for j in range(k)])      # [K]
    resp = torch.full((k, int(lens.max())), gid)                   # [K, r'] (tails are not pad)
    return dict(prompt_ids=prompt, response_ids=resp, response_len=lens,
                reward=torch.full((k,), float(gid)), ref_logp=torch.full((k,), -float(gid)),
                behaviour_logp=torch.full((k,), -2.0 * gid), version=gid, prompt_index=gid)


def check_consistent(batch: GroupBatch, pad_id=0, p=P, r=R):
    """Every group in the batch must be exactly make_group(prompt_index)."""
    for b in range(batch.version.shape[0]):
        gid = int(batch.prompt_index[b])
        assert int(batch.version[b]) == gid
        assert torch.all(batch.reward[b] == gid) and torch.all(batch.ref_logp[b] == -gid)
        assert torch.all(batch.behaviour_logp[b] == -2 * gid)
        mask = batch.prompt_mask[b].bool()
        assert int(mask.sum()) == 1 + gid % p
        assert torch.equal(batch.prompt_ids[b], torch.where(mask, gid, pad_id))
        for j in range(batch.response_len.shape[1]):
            n = int(batch.response_len[b, j])
            assert n == 1 + (gid + j) % r
            assert torch.all(batch.response_ids[b, j, :n] == gid)
            assert torch.all(batch.response_ids[b, j, n:] == pad_id)


def filled(n, capacity=None, versions=None, rewards=None):
    buf = ReplayBuffer(capacity or n, K, P, R)
    for i in range(n):
        g = make_group(i + 1)
        if versions is not None:
            g["version"] = versions[i]
        if rewards is not None:
            g["reward"] = torch.full((K,), float(rewards[i]))
        buf.add(**g)
    return buf


def test_ring_eviction_order():
    buf = filled(8, capacity=5)
    assert len(buf) == 5 and buf.newest_version() == 8
    batch = buf.sample(5, recent_frac=0.0)
    kept = sorted(zip(batch.order.tolist(), batch.prompt_index.tolist()))
    assert kept == [(3, 4), (4, 5), (5, 6), (6, 7), (7, 8)]  # groups 1..3 evicted, order kept
    check_consistent(batch)


def test_empty_buffer_and_too_many():
    buf = ReplayBuffer(4, K, P, R)
    assert len(buf) == 0 and buf.newest_version() is None
    buf.add(**make_group(1))
    with pytest.raises(ValueError):
        buf.sample(2, recent_frac=0.5)


def test_sample_shapes_and_trimming():
    buf = filled(10)
    batch = buf.sample(4, recent_frac=0.3, generator=torch.Generator().manual_seed(0))
    p_max, r_max = int(batch.prompt_mask.sum(1).max()), int(batch.response_len.max())
    assert batch.prompt_ids.shape == batch.prompt_mask.shape == (4, p_max)
    assert batch.response_ids.shape == (4, K, r_max)
    assert batch.response_len.shape == batch.reward.shape == batch.ref_logp.shape == (4, K)
    assert batch.version.shape == batch.prompt_index.shape == batch.order.shape == (4,)
    assert batch.prompt_ids.dtype == batch.response_ids.dtype == torch.int64
    assert batch.reward.dtype == batch.ref_logp.dtype == torch.float32
    assert batch.to("cpu").response_ids.shape == batch.response_ids.shape


def test_padding_and_lengths():
    buf = ReplayBuffer(4, 2, max_prompt_len=5, max_response_len=4, pad_id=9)
    # response tails past the length hold junk (7) that must become pad
    buf.add([1, 2], [[3, 4, 7], [5, 7, 7]], [2, 1], [0.0, 1.0], [-1.0, -2.0], [-3.0, -4.0], 0, 0)
    buf.add([1, 2, 3], [[6, 6], [6, 6]], [2, 2], [0.0, 0.0], [0.0, 0.0], [0.0, 0.0], 0, 1)
    b = buf.sample(2, recent_frac=0.0)
    first, second = b.prompt_index.tolist().index(0), b.prompt_index.tolist().index(1)
    assert b.prompt_ids.shape == (2, 3) and b.response_ids.shape == (2, 2, 2)
    assert b.prompt_ids[first].tolist() == [9, 1, 2] and b.prompt_mask[first].tolist() == [0, 1, 1]
    assert b.prompt_ids[second].tolist() == [1, 2, 3] and b.prompt_mask[second].tolist() == [1, 1, 1]
    assert b.response_ids[first].tolist() == [[3, 4], [5, 9]]
    assert b.response_len[first].tolist() == [2, 1]
    assert b.ref_logp[first].tolist() == [-1.0, -2.0]
    assert b.behaviour_logp[first].tolist() == [-3.0, -4.0]


def test_add_rejects_bad_shapes():
    buf = ReplayBuffer(4, K, P, R)
    g = make_group(1)
    for key, bad in [("prompt_ids", torch.ones(P + 1)), ("prompt_ids", torch.ones(1, 2)),
                     ("response_ids", torch.ones(K, R + 1)), ("response_ids", torch.ones(K + 1, 2)),
                     ("response_len", torch.tensor([1, 2])), ("reward", torch.zeros(K + 1)),
                     ("response_len", torch.full((K,), R + 1)),
                     ("behaviour_logp", torch.zeros(K - 1))]:
        with pytest.raises(ValueError):
            buf.add(**{**g, key: bad})
    assert len(buf) == 0


def test_no_duplicates_in_batch():
    buf = filled(12, versions=[0] * 6 + [1] * 6, rewards=list(range(12)))
    gen = torch.Generator().manual_seed(1)
    for i in range(300):
        b = buf.sample(8, recent_frac=0.7, priority_temp=[None, 0.5, 0.01][i % 3], generator=gen)
        assert len(set(b.order.tolist())) == 8
    assert sorted(buf.sample(12, recent_frac=1.0).order.tolist()) == list(range(12))


def expected_newest(n_buf, n_newest, n, m):
    """Exact mean/variance of #newest-version groups in a batch, and mean recent_count."""
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
            newest += int((b.version == 2).sum())
            recent += b.recent_count
        se = math.sqrt(var / draws)
        assert abs(newest / draws - mean) < 4 * se, (n, newest / draws, mean)
        assert abs(recent / draws - mean_recent) < 0.1 * n


def test_reward_prioritised_sampling():
    rewards, temp, draws = [0.0, 0.2, 0.4, 0.6, 0.8, 1.0], 0.3, 6000
    buf = filled(6, rewards=rewards)
    probs = torch.softmax(torch.tensor(rewards, dtype=torch.float64) / temp, 0)
    gen = torch.Generator().manual_seed(3)
    counts = torch.zeros(6, dtype=torch.float64)
    for _ in range(draws):
        counts[buf.sample(1, recent_frac=0.0, priority_temp=temp, generator=gen).order] += 1
    freq = counts / draws
    assert torch.all((freq - probs).abs() < 4 * (probs * (1 - probs) / draws).sqrt()), (freq, probs)
    assert int(freq.argmax()) == 5


def test_priority_numerically_stable():
    buf = filled(5, rewards=[1000.0, 2000.0, 3000.0, 4000.0, 5000.0])
    b = buf.sample(3, recent_frac=0.0, priority_temp=1e-3)  # naive exp would overflow
    assert b.reward[:, 0].tolist() == [5000.0, 4000.0, 3000.0]


def test_generator_reproducible():
    buf = filled(10, rewards=list(range(10)))
    a = buf.sample(5, 0.5, 1.0, generator=torch.Generator().manual_seed(7))
    b = buf.sample(5, 0.5, 1.0, generator=torch.Generator().manual_seed(7))
    assert torch.equal(a.order, b.order) and a.recent_count == b.recent_count


def test_state_dict_round_trip():
    buf = filled(7, capacity=5)
    buf.sample(2, 0.0)                                  # draw counts travel with the groups
    state = buf.state_dict()
    other = ReplayBuffer(5, K, P, R)
    other.load_state_dict(state, max_version=7)
    assert len(other) == 5 and other.newest_version() == 7
    for name in ReplayBuffer._FIELDS:                   # unrecorded temperatures are NaN
        torch.testing.assert_close(getattr(other, name), getattr(buf, name), equal_nan=True,
                                   rtol=0, atol=0)
    other.add(**make_group(8))  # continues the ring where it stopped: evicts group 3
    assert sorted(other.sample(5, 0.0).prompt_index.tolist()) == [4, 5, 6, 7, 8]
    with pytest.raises(ValueError, match="response_ids"):
        ReplayBuffer(5, K, P, R + 1).load_state_dict(state, max_version=7)
    with pytest.raises(ValueError, match="capacity=6"):
        ReplayBuffer(6, K, P, R).load_state_dict(state, max_version=7)


def test_state_without_behaviour_logprobs_loads_them_as_unknown():
    """A checkpoint written before behaviour log-probs were recorded still resumes: its groups
    come back with NaN ones (TB does not need them; importance weights are refused up front)."""
    state = filled(7, capacity=5).state_dict()
    del state["behaviour_logp"]
    buf = ReplayBuffer(5, K, P, R)
    buf.load_state_dict(state, max_version=7)
    batch = buf.sample(5, 0.0)
    assert batch.behaviour_logp.isnan().all()
    check_consistent(dataclasses.replace(batch, behaviour_logp=torch.full((5, K), 0.0)
                                         - 2 * batch.prompt_index[:, None]))


def spoiled(name, index, value):
    state = filled(7, capacity=5).state_dict()
    state[name][index] = value
    return state


@pytest.mark.parametrize("state, message", [
    (spoiled("response_len", (0, 1), R + 1), f"response lengths outside \\[1, {R}\\]: \\[{R + 1}\\]"),
    (spoiled("response_len", (2, 0), 0), "response lengths outside"),
    (spoiled("prompt_len", 4, P + 3), f"prompt lengths outside \\[1, {P}\\]"),
    (spoiled("version", 1, 8), "versions outside \\[0, 7\\]: \\[8\\]"),      # from the future
    (spoiled("version", 1, -1), "versions outside"),
    (spoiled("reward", (3, 2), math.nan), "non-finite rewards"),
    (spoiled("ref_logp", (0, 0), -math.inf), "non-finite reference log-probs"),
    (spoiled("behaviour_logp", (1, 1), -math.inf), "infinite behaviour log-probs"),
    (spoiled("order", 0, 99), "insertion orders"),
    (spoiled("draws", 0, -2), "negative draw counts"),
    (dict(spoiled("draws", 0, 0), n_added=-3), "'n_added' must be a count"),
    (dict(spoiled("draws", 0, 0), reward=torch.zeros(5, K, dtype=torch.float64)), "float64"),
])
def test_impossible_buffer_state_is_refused(state, message):
    """Right shapes, impossible values: each is refused with what is wrong, nothing loaded."""
    buf = ReplayBuffer(5, K, P, R)
    with pytest.raises(ValueError, match=message):
        buf.load_state_dict(state, max_version=7)
    assert len(buf) == 0


def test_reuse_is_bounded():
    """With max_reuse=2 each group is drawn at most twice; `draws` counts this draw too, and a
    group written into a slot starts again at 0."""
    buf = filled(4)
    first = buf.sample(4, 0.0, max_reuse=2)
    assert first.draws.tolist() == [1, 1, 1, 1]
    second = buf.sample(4, 0.0, max_reuse=2)
    assert second.draws.tolist() == [2, 2, 2, 2]
    assert buf.count(max_reuse=2) == 0 and buf.count() == 4     # used up, but still there
    with pytest.raises(ValueError, match="drawn fewer than 2 times"):
        buf.sample(1, 0.0, max_reuse=2)
    assert buf.sample(1, 0.0).draws.tolist() == [3]             # 0: no bound
    buf.add(**make_group(5))                                     # replaces the oldest slot
    assert buf.count(max_reuse=2) == 1
    assert buf.sample(1, 1.0, max_reuse=2).prompt_index.tolist() == [5]


def _writer(buf, writer_id, started, stop):
    """Process target: write self-consistent groups (odd ids / even ids) until told to stop."""
    i = 0
    while not stop.is_set() and i < 200_000:
        buf.add(**make_group(2 * i + writer_id + 1))
        i += 1
        if i == 10:
            started.set()


def test_concurrent_writers_no_torn_groups():
    ctx = torch.multiprocessing.get_context("spawn")
    buf = ReplayBuffer(32, K, P, R)
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
    assert int(buf.n_added[0]) > 64  # the ring wrapped while being read
    check_consistent(buf.sample(32, recent_frac=0.0))
