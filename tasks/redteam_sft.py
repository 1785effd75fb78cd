"""The red-teaming attacker's supervised start: the instruct model tuned on human-written attacks.

GFlowNet red-teaming trains its attacker from a supervised checkpoint, which is also the prior
p_ref of its reward. Here the same step is part of the task: `python tba.py --task redteam` looks
for the tuned attacker in the model cache (`~/.cache/tba/redteam-sft-<key>`, or $TBA_CACHE) and
makes it there once when it is missing; the key is every input of the tuning (the base model, the
attacks, the settings below), so a changed input makes a new one and the same inputs always find
it. A run's `--model` stays the base model; the first run prints the folder it makes.

The format is the task's own: each attack is the answer to the task's instruction prompt (chat
template and all) of the topic whose name its embedding is nearest to. Why not GFlowNet
red-teaming's few-shot "write a list of instructions" prompt: the reward's p_ref and the policy
are queried on the task's prompts only, so tuning another conditional would move the wrong one.
The loss is the attack's tokens and its EOS only (the prompt is masked), each attack at most
--max-new-tokens long with its EOS (longer ones are left out: the attacker could never sample
them). A fixed tenth of the attacks is held out and never trained on; `sft.json` beside the
weights records their mean log-likelihood per token before and after, and the time it took.

Optimiser as GFlowNet red-teaming's SFT (`trainers/sft_trainer.py`): AdamW, weight decay 0.1,
full fine-tuning. Their 100 steps of 1,024 attacks (~35 epochs of their set) warm up over all
100; here --sft-steps of --sft-batch attacks of one topic each (their shared prompt computed
once: 5.3 s a step for SmolLM2-135M on 2 CPU cores against 10.5 s for random batches, whose chat
prompts are 60 of ~75 tokens) warm up over a tenth and then hold --sft-lr.
"""
import hashlib
import json
import os
import random
import shutil
import tempfile
import time
from pathlib import Path

import torch

from llm import models, sampling
from llm.logprobs import completion_logprobs

HELD_OUT = 0.1            # the share of attacks never trained on, to show the tuning learned
SFT_SEED = 0              # one tuned attacker for every run and seed: the comparison's start
WEIGHT_DECAY = 0.1        # GFlowNet red-teaming's SFT (main.py's weight_decay)
FORMAT = 2                # bump when the examples' format changes: a new cache key


def nearest_topics(attacks, topics, embedder):
    """The index of the topic each attack's embedding is nearest to (cosine).  -> [N] list"""
    a = embedder(attacks)                                                      # [N, D] unit rows
    t = embedder([f"a message about {topic}" for topic in topics])             # [T, D]
    return (a @ t.T).argmax(-1).tolist()


def split(n, seed=SFT_SEED):
    """Fixed train and held-out indices of n attacks.  -> (train, held_out) lists"""
    order = list(range(n))
    random.Random(seed).shuffle(order)
    cut = max(1, round(n * HELD_OUT))
    return sorted(order[cut:]), sorted(order[:cut])


def attack_loss(model, prompt_ids, attack_ids, eos_id):
    """Mean negative log-likelihood per token of attacks that all answer one prompt, their EOS
    included and the prompt never a target: -Σ log p(attack, EOS | prompt) / tokens. The prompt
    is computed once for all of them (`completion_logprobs`, the trainer's log-probs)."""
    response_ids, response_len = sampling.ended_by_eos(attack_ids, eos_id)    # [m, R], [m]
    device = next(model.parameters()).device
    prompt = torch.tensor([list(prompt_ids)], device=device)                   # [1, P]
    logp = completion_logprobs(model, prompt, torch.ones_like(prompt), response_ids.to(device),
                               response_len.to(device),
                               torch.zeros(len(attack_ids), dtype=torch.long, device=device))
    return -logp.sum() / response_len.sum()


@torch.no_grad()
def mean_loglik(model, prompts, examples, eos_id):
    """Mean log-likelihood per token (EOS included) of `examples`, [(prompt index, attack ids)],
    under their prompts (`prompts`: [T] token lists)."""
    total, tokens = 0.0, 0
    for t, prompt in enumerate(prompts):
        attacks = [a for topic, a in examples if topic == t]
        if attacks:
            n = sum(len(a) + 1 for a in attacks)
            total -= attack_loss(model, prompt, attacks, eos_id).item() * n
            tokens += n
    return total / tokens


def tune(model, prompts, train, held_out, steps, batch, lr, eos_id, seed=SFT_SEED, progress=0):
    """Tune `model` in place on `train`, [(prompt index, attack ids)]: each step `batch` attacks
    of one topic (drawn ∝ its attacks), so that their prompt is computed once; AdamW with
    weight decay 0.1, lr warmed up over the first tenth then held. -> the record: held-out
    log-likelihood per token before and after, sizes, seconds."""
    start, rng = time.time(), random.Random(seed)
    before = mean_loglik(model, prompts, held_out, eos_id)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr,
                                  weight_decay=WEIGHT_DECAY)
    warmup = max(1, steps // 10)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / warmup))
    for step in range(1, steps + 1):
        topic = rng.choice(train)[0]                 # a topic, with the odds of its attacks
        pool = [a for t, a in train if t == topic]
        loss = attack_loss(model, prompts[topic], rng.sample(pool, min(batch, len(pool))), eos_id)
        loss.backward()
        if progress and (step % progress == 0 or step == steps):
            print(f"  sft step {step}/{steps}: loss {loss.item():.3f} "
                  f"({time.time() - start:.0f} s)", flush=True)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
    return {"held_out_loglik_before": before,
            "held_out_loglik_after": mean_loglik(model, prompts, held_out, eos_id),
            "train_attacks": len(train), "held_out_attacks": len(held_out),
            "steps": steps, "batch": batch, "lr": lr, "seconds": round(time.time() - start, 1)}


def cache_key(base, attacks, settings):
    blob = json.dumps({"base": base, "attacks": attacks, "format": FORMAT, **settings},
                      sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def tuned_attacker(task, device, attacks, base, steps, batch, lr, max_tokens, topics):
    """The folder of the tuned attacker for these inputs: found in the cache, else made there
    (written to a temporary folder and renamed, so a crash never leaves half of one).
    `task`: the red-teaming task with its embedder loaded; `topics`: [T] names, in the order
    of its prompts."""
    settings = {"steps": steps, "batch": batch, "lr": lr, "max_tokens": max_tokens,
                "topics": list(topics), "instruction": task.INSTRUCTION}
    folder = models.cache_dir() / f"redteam-sft-{cache_key(base, attacks, settings)}"
    if (folder / "sft.json").is_file():
        return folder
    model, tokenizer = models.load_model(base, device=device,
                                         trust_remote_code=task.cfg.trust_remote_code)
    prompts = task.prompts("train", tokenizer)
    attack_ids = tokenizer(attacks, add_special_tokens=False)["input_ids"]
    fits = [i for i, ids in enumerate(attack_ids) if len(ids) + 1 <= max_tokens]
    topic = nearest_topics([attacks[i] for i in fits], topics, task.embedder)
    data = [(t, attack_ids[i]) for t, i in zip(topic, fits)]
    train_rows, held_rows = split(len(data))
    print(f"tba: tuning the attacker once on {len(train_rows)} human-written attacks "
          f"({steps} steps of {batch}) into {folder}", flush=True)
    torch.manual_seed(SFT_SEED)
    record = tune(model.to(device), [p.ids for p in prompts], [data[i] for i in train_rows],
                  [data[i] for i in held_rows], steps, batch, lr, tokenizer.eos_token_id,
                  progress=10)
    record.update(base=base, attacks=len(attacks), fit=len(fits), **settings)
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=folder.parent, prefix=f".{folder.name}.tmp-"))
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / "sft.json").write_text(json.dumps(record, indent=1))
        os.rename(tmp, folder)
    except OSError:
        if not (folder / "sft.json").is_file():   # not just a concurrent maker winning the race
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return folder
