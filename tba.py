"""tba: Trajectory Balance with Asynchrony, on one machine.

    python tba.py --task toy --searchers 0        # synchronous baseline on the exact toy task

Every setting is a field of `Config` below and a command-line flag of the same name.
"""
import argparse
import copy
import dataclasses
import json
import os
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.multiprocessing as mp

import models
import searcher
import tasks
import trainer
from buffer import ReplayBuffer


def flag(default, help):
    return field(default=default, metadata={"help": help})


TASK_DEFAULT = "(default: the task's choice)"


@dataclass
class Config:
    # what to train
    task: str = flag("toy", "task to train on: " + ", ".join(tasks.TASKS))
    model: str = flag("", "hub id, local HF folder or .gguf file (default: the task's model, "
                          f"{models.DEFAULT_MODEL} for language tasks)")
    trust_remote_code: bool = flag(False, "allow model repositories to run their own code")
    data_dir: str = flag("", "gsm8k: folder holding train.jsonl and test.jsonl (default: "
                             "../shared/data/gsm8k when it exists, else the hub's openai/gsm8k)")
    prompt_style: str = flag("auto", "math tasks: chat (the tokenizer's chat template) or plain "
                                     "('[MATH TASK] Problem: ...'); auto: chat when the "
                                     "tokenizer has a chat template")
    max_prompt_len: int = flag(512, "math tasks: skip (and count) prompts longer than this, "
                                    "in tokens")
    eval_batch_size: int = flag(16, "math tasks: prompts per batch of greedy evaluation")
    arith_digits: int = flag(None, f"arith: digits of each number in a problem {TASK_DEFAULT}")
    arith_steps: int = flag(None, f"arith: operations per problem {TASK_DEFAULT}")
    arith_ops: str = flag(None, f"arith: operations to draw from, e.g. +- or +-* {TASK_DEFAULT}")
    # how much
    steps: int = flag(None, f"trainer steps {TASK_DEFAULT}")
    prompts_per_step: int = flag(None, f"B, prompts (groups) per trainer step {TASK_DEFAULT}")
    group_size: int = flag(None, f"K, completions sampled per prompt {TASK_DEFAULT}")
    max_new_tokens: int = flag(None, f"longest completion, in tokens {TASK_DEFAULT}")
    temperature: float = flag(None, "sampling temperature, also used to score log-probs "
                                    f"{TASK_DEFAULT}")
    # the objective
    loss: str = flag("tb", "tb (trajectory balance, valid off-policy) or rloo (on-policy baseline)")
    beta: float = flag(None, f"β at step 0: the target is p_ref·exp(r/β) {TASK_DEFAULT}")
    beta_final: float = flag(None, f"β after annealing {TASK_DEFAULT}")
    beta_steps: int = flag(None, f"steps over which β goes linearly to beta_final {TASK_DEFAULT}")
    # the optimiser
    lr: float = flag(None, f"peak learning rate (AdamW) {TASK_DEFAULT}")
    warmup_steps: int = flag(None, f"linear warm-up steps of the WSD schedule {TASK_DEFAULT}")
    decay_steps: int = flag(None, f"final steps of linear decay to 0 (WSD) {TASK_DEFAULT}")
    micro_groups: int = flag(0, "groups per forward/backward pass, gradients accumulated "
                                "(0: all of them at once)")
    max_grad_norm: float = flag(1.0, "clip the gradient norm to this (0: no clipping)")
    # asynchrony
    searchers: int = flag(None, "searcher processes; 0 runs the synchronous on-policy loop "
                                "(default: GPUs - 1, at least 1)")
    sync_every: int = flag(None, f"k: publish the trainer's weights every k steps {TASK_DEFAULT}")
    recent_frac: float = flag(None, "m: each sampled group comes from the newest weights in the "
                                    f"buffer with probability m, else from all of it {TASK_DEFAULT}")
    priority_temp: float = flag(0.0, "when > 0, draw the non-recent groups with probability "
                                     "∝ exp(mean group reward / priority_temp); 0: uniformly")
    min_buffer: int = flag(None, f"groups in the buffer before training starts {TASK_DEFAULT}")
    buffer_capacity: int = flag(None, f"groups the replay buffer holds; the oldest go first "
                                      f"{TASK_DEFAULT}")
    max_staleness: int = flag(-1, "train only on groups at most this many steps behind the "
                                  "trainer, waiting for fresher ones if needed (-1: no bound)")
    # evaluation and output
    eval_every: int = flag(None, f"evaluate every this many steps (0: only at start and end) "
                                 f"{TASK_DEFAULT}")
    eval_n: int = flag(None, f"test prompts to evaluate on (0: all) {TASK_DEFAULT}")
    out: str = flag("", "run folder (default: runs/<task>-<timestamp>)")
    seed: int = flag(0, "random seed")
    device: str = flag("auto", "torch device for the trainer: auto, cpu, cuda, cuda:1, ...")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    for f in dataclasses.fields(Config):
        name = "--" + f.name.replace("_", "-")
        help = f.metadata["help"] + (f" (default: {f.default})" if f.default not in (None, "") else "")
        if f.type is bool:
            parser.add_argument(name, action="store_true", help=f.metadata["help"])
        else:
            kind = {"int": int, "float": float, "str": str}[f.type.__name__]
            parser.add_argument(name, type=kind, default=f.default, help=help)
    return Config(**vars(parser.parse_args(argv)))


def resolve(cfg):
    """Fill the fields left unset with the task's defaults, and check the combination."""
    task_defaults = tasks.task_class(cfg.task).defaults
    cfg = dataclasses.replace(cfg, **{k: v for k, v in task_defaults.items()
                                      if getattr(cfg, k) is None})
    if cfg.device == "auto":
        cfg.device = "cuda" if torch.cuda.is_available() else "cpu"
    if cfg.searchers is None:
        cfg.searchers = max(1, torch.cuda.device_count() - 1) if cfg.device.startswith("cuda") else 1
    if not cfg.out:
        cfg.out = f"runs/{cfg.task}-{time.strftime('%Y%m%d-%H%M%S')}"
    if cfg.group_size < 2:
        raise ValueError(f"--group-size must be at least 2 (got {cfg.group_size}): "
                         "log Z is estimated from the spread within each group")
    if not 0.0 <= cfg.recent_frac <= 1.0:
        raise ValueError(f"--recent-frac must be in [0, 1] (got {cfg.recent_frac})")
    if cfg.sync_every < 1:
        raise ValueError(f"--sync-every must be at least 1 (got {cfg.sync_every})")
    if 0 <= cfg.max_staleness < cfg.sync_every - 1:
        raise ValueError(f"--max-staleness {cfg.max_staleness} is below --sync-every - 1 = "
                         f"{cfg.sync_every - 1}: searchers could never produce data fresh enough")
    if cfg.loss not in trainer.LOSSES:
        raise ValueError(f"--loss must be one of {', '.join(trainer.LOSSES)} (got {cfg.loss!r})")
    return cfg


class MetricsLog:
    """Appends one JSON object per line to runs/<name>/metrics.jsonl, flushed every row."""

    def __init__(self, path):
        self.file = open(path, "a")

    def write(self, row):
        self.file.write(json.dumps(row) + "\n")
        self.file.flush()


def placement(cfg):
    """Where each process runs. -> (trainer device, searcher devices, CPU threads per process)

    With G >= 2 GPUs the trainer takes cuda:0 and the searchers share cuda:1..G-1; with one GPU
    everything shares it. On CPU the cores are split evenly, because processes that each use
    every core slow each other down more than they gain.
    """
    trainer_device = torch.device(cfg.device)
    gpus = torch.cuda.device_count() if trainer_device.type == "cuda" else 0
    if gpus >= 2:
        searcher_devices = [f"cuda:{1 + i % (gpus - 1)}" for i in range(cfg.searchers)]
    else:
        searcher_devices = [str(trainer_device)] * cfg.searchers
    cores = os.cpu_count() or 1
    if trainer_device.type == "cpu" and cfg.searchers > cores:
        raise ValueError(f"--searchers {cfg.searchers} needs at least one CPU core each but this "
                         f"machine has {cores}: use --searchers {cores} or fewer")
    return trainer_device, searcher_devices, max(1, cores // (cfg.searchers + 1))


def evaluate(task, model, tokenizer, ref_model, step, start, log):
    metrics = task.evaluate(model, tokenizer, ref_model, step=step)
    log.write({"step": step, "time": round(time.time() - start, 3), **metrics})
    return metrics


def wait_for_groups(buffer, pool, n_groups, min_version):
    """Block until the buffer holds n_groups recent enough to train on. -> seconds waited"""
    start = time.time()
    while buffer.count(min_version) < n_groups:
        check_stop()
        pool.poll()
        time.sleep(0.01)
    return time.time() - start


def train(cfg):
    """Sample, score, take a trainer step, repeat: in-process (--searchers 0) or from the buffer
    that searcher processes fill while the trainer learns."""
    torch.manual_seed(cfg.seed)
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(dataclasses.asdict(cfg), indent=2))
    log = MetricsLog(out / "metrics.jsonl")
    device, searcher_devices, threads = placement(cfg)
    if device.type == "cpu":
        torch.set_num_threads(threads)

    task = tasks.make_task(cfg)
    policy, tokenizer = task.load_model(device)
    ref_model = copy.deepcopy(policy).requires_grad_(False)
    optimizer, scheduler = trainer.make_optimizer(policy, cfg.lr, cfg.steps, cfg.warmup_steps,
                                                  cfg.decay_steps)
    prompts = task.prompts("train", tokenizer)
    start = time.time()
    metrics = evaluate(task, policy, tokenizer, ref_model, 0, start, log)
    print("step 0: " + " ".join(f"{k}={v:.4g}" for k, v in metrics.items()))

    pool = None
    if cfg.searchers:
        buffer = ReplayBuffer(cfg.buffer_capacity, cfg.group_size, max(len(p.ids) for p in prompts),
                              cfg.max_new_tokens, tokenizer.pad_token_id)
        weights = trainer.WeightChannel(policy, cfg.searchers, mp.get_context("spawn"))
        weights.publish(policy, version=0)
        pool = searcher.SearcherPool(cfg, searcher_devices, threads, buffer, weights)
        sampler = torch.Generator().manual_seed(cfg.seed)
    else:
        batches = searcher.prompt_batches(prompts, cfg.prompts_per_step, cfg.seed)
    try:
        if pool:
            wait_for_groups(buffer, pool, max(cfg.min_buffer, cfg.prompts_per_step), -1)
        samples, tokens, last = 0, 0, time.time()
        for step in range(1, cfg.steps + 1):
            check_stop()
            version = step - 1                   # updates the policy has had before this step
            beta = trainer.beta_at(version, cfg.beta, cfg.beta_final, cfg.beta_steps)
            wait_s = sync_s = 0.0
            if pool:
                min_version = version - cfg.max_staleness if cfg.max_staleness >= 0 else -1
                wait_s = wait_for_groups(buffer, pool, cfg.prompts_per_step, min_version)
                batch = buffer.sample(cfg.prompts_per_step, cfg.recent_frac,
                                      cfg.priority_temp or None, sampler, min_version)
            else:
                batch, _ = searcher.sample_groups(policy, ref_model, tokenizer, task, next(batches),
                                                  cfg.group_size, cfg.max_new_tokens,
                                                  cfg.temperature, version)
                tokens += int(batch.response_len.sum())
            lr = scheduler.get_last_lr()[0]
            stats = trainer.train_step(policy, optimizer, scheduler, batch, beta, cfg.loss,
                                       cfg.temperature, cfg.micro_groups, cfg.max_grad_norm)
            if pool and step % cfg.sync_every == 0:
                t0 = time.time()
                weights.publish(policy, version=step)
                sync_s = time.time() - t0
            if pool:
                pool.poll()
                tokens = pool.tokens
            samples += batch.reward.numel()
            now = time.time()
            staleness = (version - batch.version).float()
            log.write({"step": step, "time": round(now - start, 3), "samples": samples, **stats,
                       "beta": beta, "lr": lr, "version": version,
                       "staleness_mean": staleness.mean().item(),
                       "staleness_max": staleness.max().item(),
                       "buffer_groups": len(buffer) if pool else 0,
                       "recent_frac_actual": batch.recent_count / len(batch.version) if pool else 1.0,
                       "trainer_wait_s": round(wait_s, 4), "sync_s": round(sync_s, 4),
                       "gen_tokens_per_s": round(tokens / (now - start), 2),
                       "samples_per_s": round(batch.reward.numel() / (now - last), 2)})
            last = now
            if (cfg.eval_every and step % cfg.eval_every == 0) or step == cfg.steps:
                metrics = evaluate(task, policy, tokenizer, ref_model, step, start, log)
                print(f"step {step}: reward={stats['reward_mean']:.3f} loss={stats['loss']:.4g} "
                      f"staleness={staleness.mean().item():.2f} "
                      + " ".join(f"{k}={v:.4g}" for k, v in metrics.items()))
    finally:
        if pool:
            pool.close()
            weights.close()
    summary = " ".join(f"{k}={v:.4g}" for k, v in metrics.items())
    print(f"final ({cfg.steps} steps, {time.time() - start:.0f} s, {samples} samples): {summary}")
    return metrics


stop_signals = 0


def request_stop(signum, frame):
    """Ctrl-C or `kill`: stop at the end of the current step, where no lock or queue is in use;
    a second one stops at once."""
    global stop_signals
    stop_signals += 1
    if stop_signals > 1:
        raise KeyboardInterrupt


def check_stop():
    if stop_signals:
        raise KeyboardInterrupt


def main(argv=None):
    global stop_signals
    try:
        cfg = resolve(parse_args(argv))
        placement(cfg)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    stop_signals = 0
    previous = {sig: signal.signal(sig, request_stop) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        train(cfg)
    except searcher.SearcherError as e:
        print(f"error: {e}\nthe run stopped; metrics so far are in {cfg.out}/metrics.jsonl",
              file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"interrupted; metrics so far are in {cfg.out}/metrics.jsonl", file=sys.stderr)
        return 130
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 0


if __name__ == "__main__":
    sys.exit(main())
