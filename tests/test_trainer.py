"""The trainer's math, checked against hand computations and against HF `generate`."""
import copy
from pathlib import Path

import pytest
import torch
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

from llm import sampling
from llm import models, precision
from batch import GroupBatch
from tasks.toy import build_model, build_tokenizer
from llm.logprobs import (check_logprobs, completion_logprobs, enable_activation_checkpointing,
                      group_logprobs)
from options import losses
from options.rloo import rloo_loss
from plumbing.schedules import beta_at, make_optimizer, WSD
from trainer import sequence_logprobs, tb_loss, train_step


@pytest.fixture(scope="module")
def toy():
    tokenizer = build_tokenizer()
    return build_model(len(tokenizer)), tokenizer


def tiny_llama():
    """RoPE, grouped-query attention and no position table: what SmolLM2 is, in miniature."""
    config = LlamaConfig(vocab_size=24, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    return LlamaForCausalLM(config).eval()


# The trusted reference: `trainer.sequence_logprobs`, every completion as a full sequence of its
# own, prompt and response without any padding, through the model's own forward and all its
# [T, V] logits. The fast path (`logprobs.group_logprobs`) is held to it.
plain_logprobs = sequence_logprobs


def random_batch(vocab, prompt_lengths=(5, 2, 4), k=4, r=6, seed=0):
    """Left-padded prompts of different lengths, K right-padded responses each of random length
    (some of them ending in the pad id, as SmolLM2's EOS is its pad)."""
    g = torch.Generator().manual_seed(seed)
    n, p = len(prompt_lengths), max(prompt_lengths)
    prompt_mask = (torch.arange(p) >= p - torch.tensor(prompt_lengths)[:, None]).long()   # [n, P]
    prompt_ids = torch.randint(1, vocab, (n, p), generator=g) * prompt_mask
    response_len = torch.randint(1, r + 1, (n, k), generator=g)                           # [n, K]
    response_ids = torch.randint(0, vocab, (n, k, r), generator=g)
    response_ids[torch.arange(r) >= response_len[..., None]] = 0                          # padding
    reward = torch.randn(n, k, generator=g)
    return GroupBatch(prompt_ids=prompt_ids, prompt_mask=prompt_mask, response_ids=response_ids,
                      response_len=response_len, reward=reward, ref_logp=torch.zeros(n, k),
                      version=torch.zeros(n, dtype=torch.long), prompt_index=torch.arange(n))


def test_tb_loss_by_hand():
    logp = torch.tensor([[-1.0, -2.0, -3.0]])
    ref_logp = torch.tensor([[-1.5, -1.0, -2.0]])
    reward = torch.tensor([[1.0, 0.0, 0.5]])
    beta = 0.5
    # delta = logp - ref - r/beta = [0.5 - 2, -1 - 0, -1 - 1] = [-1.5, -1, -2]; log Z = 1.5
    # residuals log Z + delta = [0, 0.5, -0.5]; loss = (0 + 0.25 + 0.25) / 3
    loss, log_z = tb_loss(logp, ref_logp, reward, beta)
    assert log_z.shape == (1,)
    assert log_z.item() == pytest.approx(1.5)
    assert loss.item() == pytest.approx(0.5 / 3)


def test_tb_loss_log_z_per_prompt():
    logp = torch.zeros(2, 4)
    ref_logp = torch.zeros(2, 4)
    reward = torch.tensor([[1.0, 1.0, 1.0, 1.0], [0.0, 0.0, 0.0, 0.0]])
    loss, log_z = tb_loss(logp, ref_logp, reward, beta=0.1)
    # Each prompt's log Z is its own: exp(r/β) summed in its group, here 10 and 0.
    assert torch.allclose(log_z, torch.tensor([10.0, 0.0]))
    assert loss.item() == pytest.approx(0.0)  # within a group every delta is equal: balanced
    assert not log_z.requires_grad


def test_rloo_loss_by_hand():
    logp = torch.tensor([[-1.0, -2.0, -3.0]], requires_grad=True)
    ref_logp = torch.tensor([[-1.0, -2.0, -3.0]])
    reward = torch.tensor([[3.0, 0.0, 0.0]])
    loss = rloo_loss(logp, ref_logp, reward, beta=0.1)
    loss.backward()
    # KL term is 0; leave-one-out baselines [0, 1.5, 1.5]; advantages [3, -1.5, -1.5]
    assert torch.allclose(logp.grad, -torch.tensor([[3.0, -1.5, -1.5]]) / 3)


def test_schedules():
    assert beta_at(0, 0.014, 0.004, 500) == pytest.approx(0.014)
    assert beta_at(250, 0.014, 0.004, 500) == pytest.approx(0.009)
    assert beta_at(900, 0.014, 0.004, 500) == pytest.approx(0.004)
    schedule = WSD(total_steps=10, warmup_steps=2, decay_steps=4)
    factors = [schedule(s) for s in range(10)]
    assert factors == pytest.approx([0.5, 1, 1, 1, 1, 1, 1, 0.75, 0.5, 0.25])


CUDA = pytest.param("cuda:0", marks=pytest.mark.gpu)       # skipped without a GPU


@pytest.mark.parametrize("device", ["cpu", CUDA])
@pytest.mark.parametrize("checkpointing", [False, True])
@pytest.mark.parametrize("build", ["gpt2", "llama"])
def test_shared_prompt_logprobs_and_gradients_equal_the_full_sequences(build, checkpointing,
                                                                         device, toy):
    """Each prompt computed once for its K completions: left-padded prompts of lengths 5, 2 and 4,
    responses of 1 to 6 tokens, a slice of completions that starts and ends mid-group, with and
    without activation checkpointing. The same
    log-probs and the same gradient of the TB loss as every completion run alone, unpadded.
    Tolerance: float32 sums of at most 6 log-probs near -3 each, and gradients of order 1: a
    few ulps of accumulation order, far below any bug (a shifted position or a masked-out prompt
    token changes them at the first significant digit). On CUDA TF32 stays off (torch's
    default; `placement.set_up_process` is not called), so the tolerance is the same."""
    model = (copy.deepcopy(toy[0]) if build == "gpt2" else tiny_llama()).to(device)
    vocab = model.get_output_embeddings().out_features
    batch = random_batch(vocab).to(device)
    if checkpointing:
        enable_activation_checkpointing(model)
    params = list(model.parameters())
    flat = lambda grads: torch.cat([g.flatten() for g in grads])

    shared = group_logprobs(model, batch, temperature=0.8).view(3, 4)                # [n, K]
    reference = plain_logprobs(model, batch, temperature=0.8).view(3, 4)
    torch.testing.assert_close(shared, reference, rtol=1e-5, atol=1e-5)
    tb = lambda logp: tb_loss(logp, batch.ref_logp, batch.reward, beta=0.5)[0]
    torch.testing.assert_close(flat(torch.autograd.grad(tb(shared), params)),
                               flat(torch.autograd.grad(tb(reference), params)),
                               rtol=1e-4, atol=1e-6)
    part = group_logprobs(model, batch, temperature=0.8, completions=slice(3, 9))   # groups 0-2
    torch.testing.assert_close(part, reference.flatten()[3:9], rtol=1e-5, atol=1e-5)
    one = group_logprobs(model, batch, temperature=0.8, groups=slice(1, 2))          # group 1
    torch.testing.assert_close(one, reference[1], rtol=1e-5, atol=1e-5)


def test_logprobs_match_generate_scores(toy):
    """Left padding, pad id == EOS id, temperature 0.7: the trainer scores what generate sampled."""
    model, tokenizer = toy
    temperature = 0.7
    prompts = [[1], [4, 1, 2, 3], [2, 4]]
    ids, mask = sampling.left_pad(prompts, tokenizer.pad_token_id)
    torch.manual_seed(0)
    config = GenerationConfig(max_new_tokens=6, do_sample=True, temperature=temperature, top_k=0,
                              top_p=1.0, num_return_sequences=4, pad_token_id=0, eos_token_id=0)
    out = model.generate(input_ids=ids, attention_mask=mask, generation_config=config,
                         output_scores=True, return_dict_in_generate=True)
    response = out.sequences[:, ids.shape[1]:]                                  # [12, R]
    scores = torch.stack(out.scores, 1).log_softmax(-1)                         # [12, R, V]
    chosen = scores.gather(-1, response[..., None]).squeeze(-1)                 # [12, R]
    is_eos = response == tokenizer.eos_token_id
    length = torch.where(is_eos.any(-1), is_eos.float().argmax(-1) + 1, response.shape[1])
    assert (length < response.shape[1]).any(), "want some sequences padded after their EOS"
    in_response = torch.arange(response.shape[1]) < length[:, None]
    expected = (chosen * in_response).sum(-1)

    logp = completion_logprobs(model, ids, mask, response, length,
                               owner=torch.arange(3).repeat_interleave(4), temperature=temperature)
    assert torch.allclose(logp, expected, atol=1e-4)


def sampled_batch(model, tokenizer, ref_model, temperature=1.0, k=6):
    """On-policy groups for two prompts, with rewards that differ between completions."""
    torch.manual_seed(1)
    prompt_ids, prompt_mask, response_ids, response_len = sampling.generate(
        model, tokenizer, [[1], [4, 2]], num_samples=k, max_new_tokens=5, temperature=temperature)
    reward = (response_len.float() / 5) + (response_ids[..., 0] == 1).float()   # [2, K]
    batch = GroupBatch(prompt_ids, prompt_mask, response_ids, response_len, reward,
                       torch.zeros_like(reward), torch.zeros(2, dtype=torch.long),
                       torch.arange(2))
    with torch.no_grad():
        batch.ref_logp = group_logprobs(ref_model, batch, temperature).view(2, k)
    return batch


def test_tb_gradient_equals_reinforce_on_policy(toy):
    """App. A of the paper: on-policy, ∇ TB = (2/β) ∇ of REINFORCE with a per-prompt mean
    baseline on the KL-regularised reward r − β(log p − log p_ref)."""
    model, tokenizer = toy
    policy = copy.deepcopy(model)
    with torch.no_grad():                       # move the policy away from the reference
        for p in policy.parameters():
            p.add_(0.05 * torch.randn_like(p))
    beta = 0.3
    batch = sampled_batch(policy, tokenizer, model)
    params = list(policy.parameters())

    logp = group_logprobs(policy, batch).view(2, -1)
    loss, _ = tb_loss(logp, batch.ref_logp, batch.reward, beta)
    tb_grad = torch.autograd.grad(loss, params)

    logp = group_logprobs(policy, batch).view(2, -1)
    kl_reward = (batch.reward - beta * (logp - batch.ref_logp)).detach()
    advantage = kl_reward - kl_reward.mean(1, keepdim=True)
    surrogate = -(advantage * logp).mean()
    reinforce_grad = torch.autograd.grad(surrogate, params)

    flat = lambda grads: torch.cat([g.flatten() for g in grads])
    assert flat(tb_grad).norm() > 1e-3
    torch.testing.assert_close(flat(tb_grad), (2 / beta) * flat(reinforce_grad),
                               rtol=1e-4, atol=1e-6)


def test_micro_batches_give_the_same_step(toy):
    model, tokenizer = toy
    batch = sampled_batch(model, tokenizer, model)
    results = []
    for micro_groups in (0, 1):
        policy = copy.deepcopy(model)
        # plain SGD, so parameters move by exactly lr · gradient (Adam's first step is ~sign(g))
        optimizer = torch.optim.SGD(policy.parameters(), lr=0.1)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
        stats = train_step(policy, optimizer, scheduler, batch, beta=0.5, loss=losses.make("tb"),
                           micro_groups=micro_groups, max_grad_norm=1.0)
        results.append((stats, torch.cat([p.flatten() for p in policy.parameters()])))
    (full, full_params), (micro, micro_params) = results
    assert full["loss"] == pytest.approx(micro["loss"], rel=1e-5)
    assert full["grad_norm"] == pytest.approx(micro["grad_norm"], rel=1e-4)
    assert torch.allclose(full_params, micro_params, atol=1e-6)
    assert not torch.allclose(full_params, torch.cat([p.flatten() for p in model.parameters()]))


def test_tb_and_rloo_take_the_same_clipped_step(toy):
    """On any batch, ∇TB = (2/β)·(K−1)/K·∇RLOO (RLOO's KL-regularised reward at the same β):
    the same direction. Once clipped to one norm (and with Adam, which ignores the scale),
    synchronous TB and RLOO at equal β take the same steps: the redteam runs of both ended with
    weights equal to 3e-6."""
    model, tokenizer = toy
    batch = sampled_batch(model, tokenizer, model)
    beta, k = 0.3, batch.reward.shape[1]
    grads, params = {}, {}
    for loss in ("tb", "rloo"):
        policy = copy.deepcopy(model)
        optimizer, scheduler = make_optimizer(policy, 1e-2, 10, 0, 0)
        stats = train_step(policy, optimizer, scheduler, batch, beta=beta, loss=losses.make(loss),
                           max_grad_norm=1.0)
        grads[loss] = stats["grad_norm"]
        params[loss] = torch.cat([p.flatten() for p in policy.parameters()])
    assert grads["tb"] == pytest.approx((2 / beta) * (k - 1) / k * grads["rloo"], rel=1e-4)
    assert grads["rloo"] > 1.0                           # both were clipped to norm 1
    # Adam's first step moves each weight by about lr = 1e-2; the two steps agree to 1% of that
    # (where a clipped gradient is ~1e-8, Adam's eps turns rounding into a visible difference).
    start = torch.cat([p.flatten() for p in model.parameters()])
    assert (params["tb"] - start).abs().max() > 0.5e-2
    assert (params["tb"] - params["rloo"]).abs().max() < 0.01 * 1e-2


def test_chunked_logprobs_match_the_full_logits_and_their_gradient(toy):
    """The output layer in checkpointed chunks of 3 positions gives the same values and the same
    gradient as the [T, V] logits it never builds."""
    model, tokenizer = toy
    batch = sampled_batch(model, tokenizer, model, temperature=0.8)
    params = list(model.parameters())
    n, k, _ = batch.response_ids.shape
    ours = completion_logprobs(model, batch.prompt_ids, batch.prompt_mask,
                               batch.response_ids.flatten(0, 1), batch.response_len.flatten(),
                               owner=torch.arange(n).repeat_interleave(k), temperature=0.8,
                               chunk_size=3)
    reference = plain_logprobs(model, batch, temperature=0.8)
    torch.testing.assert_close(ours, reference, rtol=1e-5, atol=1e-5)
    weights = torch.randn_like(ours)                  # any linear function of the log-probs
    flat = lambda grads: torch.cat([g.flatten() for g in grads])
    torch.testing.assert_close(flat(torch.autograd.grad((weights * ours).sum(), params)),
                               flat(torch.autograd.grad((weights * reference).sum(), params)),
                               rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("loss", ["tb", "rloo"])
def test_split_groups_and_checkpointing_give_the_whole_group_step(toy, loss):
    """K = 6 completions per group, trained whole, split into passes of 1, 4 (uneven) and 5
    completions, and with activation checkpointing: one and the same SGD step."""
    model, tokenizer = toy
    policy = copy.deepcopy(model)
    with torch.no_grad():                       # away from the reference: KL terms are non-zero
        for p in policy.parameters():
            p.add_(0.05 * torch.randn_like(p))
    batch = sampled_batch(policy, tokenizer, model)
    start = torch.cat([p.flatten() for p in policy.parameters()])
    steps = {}
    for name, micro_completions, checkpointing in [("whole", 0, False), ("1", 1, False),
                                                    ("4", 4, False), ("5+ckpt", 5, True)]:
        trained = copy.deepcopy(policy)
        if checkpointing:
            enable_activation_checkpointing(trained)
        optimizer = torch.optim.SGD(trained.parameters(), lr=0.1)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
        stats = train_step(trained, optimizer, scheduler, batch, beta=0.5, loss=losses.make(loss), micro_groups=1,
                           micro_completions=micro_completions)
        assert getattr(trained, "checkpointed_layers", 0) == (2 if checkpointing else 0)
        assert not trained.training                     # back in eval mode for sampling
        steps[name] = (stats, torch.cat([p.flatten() for p in trained.parameters()]) - start)
    whole_stats, whole_step = steps.pop("whole")
    assert whole_step.abs().max() > 1e-4
    for name, (stats, step) in steps.items():
        assert stats["loss"] == pytest.approx(whole_stats["loss"], rel=1e-5), name
        torch.testing.assert_close(step, whole_step, rtol=1e-4, atol=1e-7, msg=name)


def test_a_model_that_post_processes_its_logits_is_refused():
    from transformers import Gemma2Config, Gemma2ForCausalLM
    config = Gemma2Config(vocab_size=32, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
                          num_attention_heads=2, num_key_value_heads=1, head_dim=4,
                          final_logit_softcapping=0.5)
    with pytest.raises(ValueError, match="post-processes its output layer"):
        check_logprobs(Gemma2ForCausalLM(config).eval())
    check_logprobs(tiny_llama())                  # a plain model passes


def test_bfloat16_sampling_and_scoring_agree(tiny_model_dir):
    """Searchers sample under the same autocast as the trainer scores: the log-probs of what was
    sampled agree with the trainer's to rounding. Tolerance: bfloat16 keeps 8 significant bits,
    so each logit carries an error of up to 2^-9 of its size; a token's log-prob (its logit minus
    the log-sum-exp) up to twice that, summed over the tokens. Float32 against bfloat16 is held
    to the same bound: that is the price of --dtype bfloat16, measured on SmolLM2-135M at
    ~0.03 nats per token (0.25 over 12 tokens)."""
    model, tokenizer = models.load_model(tiny_model_dir)
    with torch.no_grad():                       # logits of a realistic size (~±10), not ~±0.1
        model.lm_head.weight.mul_(100)
    prompts = [tokenizer("What is 2+3?")["input_ids"], tokenizer("Name a colour.")["input_ids"]]
    ids, mask = sampling.left_pad(prompts, tokenizer.pad_token_id)
    config = GenerationConfig(max_new_tokens=10, do_sample=True, temperature=1.0, top_k=0,
                              top_p=1.0, num_return_sequences=3, min_new_tokens=10,
                              pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(0)
    with precision.autocast("cpu", torch.bfloat16):
        out = model.generate(input_ids=ids, attention_mask=mask, generation_config=config,
                             output_scores=True, return_dict_in_generate=True)
    response = out.sequences[:, ids.shape[1]:]                                  # [6, 10]
    scores = torch.stack(out.scores, 1).float()                                 # [6, 10, V]
    sampled = scores.log_softmax(-1).gather(-1, response[..., None]).squeeze(-1).sum(-1)
    inputs = dict(prompt_ids=ids, prompt_mask=mask, response_ids=response,
                  response_len=torch.full((6,), response.shape[1]),
                  owner=torch.arange(2).repeat_interleave(3))
    with torch.no_grad():
        with precision.autocast("cpu", torch.bfloat16):
            scored = completion_logprobs(model, **inputs)
        float32 = completion_logprobs(model, **inputs)
    bound = response.shape[1] * 2 * scores.abs().max() * 2 ** -9
    assert scores.abs().max() > 5
    assert (sampled - scored).abs().max() <= bound
    assert (float32 - scored).abs().max() <= bound
    assert (float32 - scored).abs().max() > 0        # bfloat16 was really used


def test_a_group_drawn_short_costs_nothing_for_its_padding(monkeypatch):
    """The buffer pads a group drawn with fewer than K completions (`keep` False): those slots
    get log-prob 0 and never reach the model, the kept ones keep their exact log-probs, and a
    step split so that some passes hold padding only is the whole step."""
    from llm import logprobs
    model = tiny_llama()
    batch = random_batch(24)
    batch.keep = torch.tensor([[True, True, False, False], [True] * 4, [True, True, True, False]])
    computed = []
    real = logprobs.completion_logprobs
    monkeypatch.setattr(logprobs, "completion_logprobs",
                        lambda *args, **kwargs: computed.append(len(args[4])) or real(*args, **kwargs))
    with torch.no_grad():
        logp = group_logprobs(model, batch)                                    # [B·K]
    assert sum(computed) == 9                                  # the kept completions only
    kept = batch.keep.flatten()
    torch.testing.assert_close(logp[kept], plain_logprobs(model, batch)[kept], rtol=1e-4, atol=1e-4)
    assert (logp[~kept] == 0).all()
    steps = []
    for micro_completions in (0, 1):
        trained = copy.deepcopy(model)
        optimizer = torch.optim.SGD(trained.parameters(), lr=0.1)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
        train_step(trained, optimizer, scheduler, batch, beta=0.5, micro_groups=1,
                   micro_completions=micro_completions)
        steps.append(torch.cat([p.flatten() - q.flatten()
                                for p, q in zip(trained.parameters(), model.parameters())]))
    assert steps[0].abs().max() > 1e-5
    torch.testing.assert_close(steps[1], steps[0], rtol=1e-4, atol=1e-7)


def test_step_metrics_by_hand():
    """The metrics of what was trained on count the kept completions only: mean log π (the
    trusted per-sequence log-probs before the step), mean response length, and the share of
    groups whose kept rewards are all equal (group 0 equal but for its padding, group 2 equal)."""
    model = tiny_llama()
    batch = random_batch(24)
    batch.keep = torch.tensor([[True, True, False, False], [True] * 4, [True, True, True, False]])
    batch.reward = torch.tensor([[1.0, 1.0, 5.0, 0.0], [0.0, 1.0, 0.0, 0.0], [2.0, 2.0, 2.0, 9.0]])
    kept = batch.keep.flatten()
    with torch.no_grad():
        expected_logp = plain_logprobs(model, batch)[kept].mean().item()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    stats = train_step(model, optimizer, scheduler, batch, beta=0.5)
    assert stats["logp_mean"] == pytest.approx(expected_logp, rel=1e-4)
    assert stats["response_len_mean"] == pytest.approx(
        batch.response_len.flatten()[kept].float().mean().item())
    assert stats["equal_reward_frac"] == pytest.approx(2 / 3)


def _overhead():
    """bench/overhead.py, the counter of ops and host syncs, as a module (the repo first on the
    path: bench/ holds a buffer.py of its own)."""
    import importlib
    import sys
    saved = list(sys.path)
    repo = Path(__file__).resolve().parents[1]
    sys.path[:0] = [str(repo), str(repo / "bench")]
    try:
        return importlib.import_module("overhead")
    finally:
        sys.path[:] = saved


def test_a_trainer_step_and_a_decode_step_read_the_device_as_few_times_as_counted():
    """Host syncs stall a GPU's host; `bench/overhead.py` counts them on the CPU. A trainer step
    reads the device twice (the batch's lengths, when the batch is on the device already, and
    its statistics with the loss and the gradient norm, together) plus transformers' own check
    of the attention mask, once a pass; a decode step once (HF's test of unfinished sequences),
    on either cache. Held here so that a change cannot quietly add one back."""
    import batch as batch_module
    from llm import sampling
    from plumbing import schedules
    import trainer
    overhead = _overhead()
    model = overhead.tiny_llama(layers=2)
    modules = (trainer, schedules, batch_module)
    assert overhead.trainer_step(modules, model)["syncs"] == 3                 # all groups a pass
    assert overhead.trainer_step(modules, model, micro_groups=1)["syncs"] == 6  # 4 passes
    for cache in (sampling.PREFIX, sampling.STATIC):
        assert overhead.decode_step(sampling, model, prompts=2, samples=3, steps=3,
                                    cache=cache)["syncs"] == 1


def test_the_memory_model_puts_as_many_groups_in_a_pass_as_fit():
    """`groups_that_fit` by hand: a 2-layer model with hidden size 16, no checkpointing, float32:
    76 · 16 bytes a layer and token; groups of 4 completions of 5 + 6 tokens."""
    from devices.memory import groups_that_fit
    model = tiny_llama()
    batch = random_batch(24)                                     # 3 groups × 4, P = 5, R = 6
    optimizer = torch.optim.AdamW(model.parameters())
    config = model.config
    params = sum(p.numel() for p in model.parameters())
    per_group = (4 * (5 + 6) * config.num_hidden_layers * 76 * config.hidden_size
                 + 4 * 64 * config.vocab_size * 12)
    state = 12 * params                                          # gradients and AdamW moments
    for groups in (1, 2, 3):
        free = state + per_group * groups / 0.8 + 1
        assert groups_that_fit(model, optimizer, batch, torch.float32, free) == groups
    assert groups_that_fit(model, optimizer, batch, torch.float32, 10 ** 12) == 3
    assert groups_that_fit(model, optimizer, batch, torch.float32, 0) == 1
