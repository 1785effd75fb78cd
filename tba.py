"""tba: Trajectory Balance with Asynchrony, on one machine.

    python tba.py --task toy --searchers 0        # synchronous baseline on the exact toy task

Every setting is a field of `Config` below and a command-line flag of the same name.
"""
import argparse
import copy
import dataclasses
import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

import models
import searcher
import tasks
import trainer


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
    searchers: int = flag(0, "searcher processes; 0 runs the synchronous on-policy loop")
    # evaluation and output
    eval_every: int = flag(None, f"evaluate every this many steps (0: only at start and end) "
                                 f"{TASK_DEFAULT}")
    eval_n: int = flag(None, f"test prompts to evaluate on (0: all) {TASK_DEFAULT}")
    out: str = flag("", "run folder (default: runs/<task>-<timestamp>)")
    seed: int = flag(0, "random seed")
    device: str = flag("auto", "torch device for the trainer: auto, cpu, cuda, cuda:1, ...")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    for f in dataclasses.fields(Config):
        name = "--" + f.name.replace("_", "-")
        if f.type is bool:
            parser.add_argument(name, action="store_true", help=f.metadata["help"])
        else:
            kind = {"int": int, "float": float, "str": str}[f.type.__name__]
            parser.add_argument(name, type=kind, default=f.default, help=f.metadata["help"])
    return Config(**vars(parser.parse_args(argv)))


def resolve(cfg):
    """Fill the fields left unset with the task's defaults, and check the combination."""
    task_defaults = tasks.task_class(cfg.task).defaults
    cfg = dataclasses.replace(cfg, **{k: v for k, v in task_defaults.items()
                                      if getattr(cfg, k) is None})
    if cfg.device == "auto":
        cfg.device = "cuda" if torch.cuda.is_available() else "cpu"
    if not cfg.out:
        cfg.out = f"runs/{cfg.task}-{time.strftime('%Y%m%d-%H%M%S')}"
    if cfg.group_size < 2:
        raise ValueError(f"--group-size must be at least 2 (got {cfg.group_size}): "
                         "log Z is estimated from the spread within each group")
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


def evaluate(task, model, tokenizer, ref_model, step, start, log):
    metrics = task.evaluate(model, tokenizer, ref_model)
    log.write({"step": step, "time": round(time.time() - start, 3), **metrics})
    return metrics


def train(cfg):
    """The synchronous loop: sample with the current policy, score, take a step, repeat."""
    torch.manual_seed(cfg.seed)
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(dataclasses.asdict(cfg), indent=2))
    log = MetricsLog(out / "metrics.jsonl")
    device = torch.device(cfg.device)

    task = tasks.make_task(cfg)
    policy, tokenizer = task.load_model(device)
    ref_model = copy.deepcopy(policy).requires_grad_(False)
    optimizer, scheduler = trainer.make_optimizer(policy, cfg.lr, cfg.steps, cfg.warmup_steps,
                                                  cfg.decay_steps)
    batches = searcher.prompt_batches(task.prompts("train", tokenizer), cfg.prompts_per_step,
                                      cfg.seed)
    start = time.time()
    metrics = evaluate(task, policy, tokenizer, ref_model, 0, start, log)
    print(f"step 0: " + " ".join(f"{k}={v:.4g}" for k, v in metrics.items()))
    samples = 0
    for step in range(1, cfg.steps + 1):
        beta = trainer.beta_at(step - 1, cfg.beta, cfg.beta_final, cfg.beta_steps)
        t0 = time.time()
        batch, _ = searcher.sample_groups(policy, ref_model, tokenizer, task, next(batches),
                                          cfg.group_size, cfg.max_new_tokens, cfg.temperature)
        t1 = time.time()
        lr = scheduler.get_last_lr()[0]
        stats = trainer.train_step(policy, optimizer, scheduler, batch, beta, cfg.loss,
                                   cfg.temperature, cfg.micro_groups, cfg.max_grad_norm)
        samples += batch.reward.numel()
        log.write({"step": step, "time": round(time.time() - start, 3), "samples": samples,
                   **stats, "beta": beta, "lr": lr, "gen_s": round(t1 - t0, 4),
                   "train_s": round(time.time() - t1, 4)})
        if (cfg.eval_every and step % cfg.eval_every == 0) or step == cfg.steps:
            metrics = evaluate(task, policy, tokenizer, ref_model, step, start, log)
            print(f"step {step}: reward={stats['reward_mean']:.3f} loss={stats['loss']:.4g} "
                  + " ".join(f"{k}={v:.4g}" for k, v in metrics.items()))
    summary = " ".join(f"{k}={v:.4g}" for k, v in metrics.items())
    print(f"final ({cfg.steps} steps, {time.time() - start:.0f} s, {samples} samples): {summary}")
    return metrics


def main(argv=None):
    try:
        cfg = resolve(parse_args(argv))
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    train(cfg)
    return 0


if __name__ == "__main__":
    sys.exit(main())
