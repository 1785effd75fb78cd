"""Tasks: where prompts come from, how completions are rewarded and how a policy is evaluated.

A task is one file with one `Task` subclass. The rest of the project only uses this interface:

    task = make_task(cfg)
    task.check_data()                                   # data files read before any model
    model, tokenizer = task.load_model(device)
    prompts = task.prompts("train", tokenizer)          # list[Prompt], already tokenised
    rewards = task.reward(prompts, completions)         # list[float], one per completion
    rewards, info = task.score(prompts, completions)    # the same, and what to log about them
    metrics = task.evaluate(model, tokenizer, ref_model)  # {"eval/accuracy": ...} or {"toy/tv": ...}
"""
import importlib
import random
from dataclasses import dataclass

import torch

from llm import models, precision
from plumbing.flags import TASK_DEFAULT, at_least, flag, one_of


@dataclass
class Prompt:
    text: str                 # what the model sees, formatted (chat template or plain)
    ids: list                 # its token ids, without padding
    index: int                # position in its split; the replay buffer stores it
    answer: str | None = None  # the gold answer, for tasks that have one


# A task's own settings, beside the core ones of `config.Config`: each task declares them as a
# dataclass (`Task.Settings`), with the same flag names on the command line and in recipes;
# `--help` lists them under their task, and a run's settings are Config's and its task's.
@dataclass
class TaskSettings:
    """The toy task's settings: none beside the core ones."""


@dataclass
class LanguageSettings(TaskSettings):
    """language tasks (arith, gsm8k, summarize, tldr, redteam)."""
    trust_remote_code: bool = flag(False, "allow model repositories to run their own code")


@dataclass
class PromptSettings(LanguageSettings):
    """language tasks evaluated on test prompts (arith, gsm8k, summarize, tldr)."""
    prompt_style: str = flag("auto", "language tasks: chat (the tokenizer's chat template) or "
                                     "plain ('[MATH TASK] Problem: ...', '...\\nTL;DR:'); auto: "
                                     "chat when the tokenizer has a chat template",
                       one_of("auto", "chat", "plain"))
    max_prompt_len: int = flag(None, "language tasks: skip prompts longer than this, in tokens "
                                     f"{TASK_DEFAULT}", at_least(1))
    eval_batch_size: int = flag(64, "prompts per batch of evaluation: larger batches decode "
                                    "faster and hold more memory", at_least(1))
    eval_samples: int = flag(None, "math tasks: also sample this many completions per test prompt "
                                   "at --temperature and log their mean reward as "
                                   "eval/sampled_accuracy (0: greedy only); summarize, tldr: "
                                   "summaries sampled per test text for eval/win_rate and "
                                   f"eval/kl (at least 1) {TASK_DEFAULT}",
                             at_least(0))


def data_dir_flag():
    """--data-dir, declared by each task that reads its data from files."""
    return flag("", "gsm8k, summarize, tldr: folder holding train.jsonl and test.jsonl "
                    "(gsm8k default: ../shared/data/gsm8k when it exists, else the hub's "
                    "openai/gsm8k)")


class Task:
    """Base class. Subclasses set `name`, override `defaults` and implement the three methods."""

    name = ""
    Settings = TaskSettings           # its own settings (a dataclass of flags)
    # Does `evaluate` use the reference model? If not, an asynchronous trainer keeps no copy.
    eval_needs_reference = False
    # Does `score` return an "embeddings" [N, D] info (then `embedding_dim` = D once loaded)?
    # The replay buffer's near-duplicate merge (--merge-cosine) compares them.
    embeds_completions = False
    embedding_dim = 0
    # The fewest --eval-samples its evaluation works with (0: it can evaluate greedily only).
    min_eval_samples = 0
    # Config fields a task chooses when the user leaves them unset (None on the command line).
    defaults = dict(steps=200, prompts_per_step=4, group_size=8, max_new_tokens=256,
                    temperature=1.0, beta=0.05, beta_final=0.05, beta_steps=0, lr=1e-5,
                    warmup_steps=10, decay_steps=0, eval_every=50, eval_n=0, sync_every=2,
                    recent_frac=0.95, min_buffer=8, buffer_capacity=8000, max_reuse=4,
                    micro_groups=0, activation_checkpointing=False, save_every=50)

    reads_model = True                # --model names the policy (False: the task builds its own)

    def __init__(self, cfg):
        self.cfg = cfg

    @classmethod
    def check_settings(cls, cfg):
        """The rules of the task's own settings, with the run's (ValueError: one line saying
        what is wrong and how to fix it). Called by `config.resolve`."""
        if cls.min_eval_samples and cfg.eval_samples < cls.min_eval_samples:
            raise ValueError(f"--eval-samples {cfg.eval_samples}: {cfg.task} evaluates on "
                             f"sampled completions: use {cls.min_eval_samples} or more")
        context, prompt = cls.context_length(cfg), getattr(cfg, "max_prompt_len", None)
        if context and (prompt or 1) + cfg.max_new_tokens > context:
            longest = (f"--max-prompt-len {prompt} + --max-new-tokens {cfg.max_new_tokens}"
                       if prompt else f"the prompt + --max-new-tokens {cfg.max_new_tokens}")
            fix = (f"lower --max-new-tokens to {context - (prompt or 1)} or less"
                   if (prompt or 1) < context else "lower --max-prompt-len")
            raise ValueError(f"{longest} tokens exceed the policy's context of {context}: {fix}")

    @classmethod
    def context_length(cls, cfg):
        """The policy's context in tokens, from its config (None: not known before it loads)."""
        return models.context_length(cfg.model or models.DEFAULT_MODEL)

    def load_model(self, device):
        """The policy's starting point, which is also the frozen reference."""
        return models.load_model(self.cfg.model or models.DEFAULT_MODEL, device=device,
                                 trust_remote_code=self.cfg.trust_remote_code)

    def examples(self, split):
        """The raw examples of a split ("train" or "test"), for tasks read from data; the others
        make their prompts in code."""
        return []

    def check_data(self):
        """Read both splits now: `assembly.load.load` calls this before any model loads, so that a missing
        or broken data file is named in a second, not after the minutes a model takes."""
        for split in ("train", "test"):
            self.examples(split)

    def prompts(self, split, tokenizer):
        raise NotImplementedError

    def reward(self, prompts, completions):
        raise NotImplementedError

    def score(self, prompts, completions):
        """(rewards, info): the rewards, and what the task wants logged about these completions,
        computed where they were scored (a searcher process) and handed to `search_metrics` in
        the trainer's. Most tasks have nothing to add."""
        return self.reward(prompts, completions), None

    def demonstrations(self, prompts):
        """(prompt, completion text) pairs written by people, which `--replay-groups` may store
        in its buffer before the first step, scored as sampled ones are (red-teaming's
        human-written attacks with --seed-attacks). Most tasks have none."""
        return []

    def search_metrics(self, infos):
        """Training-row metrics from the `score` infos of the batches generated since the last
        row (in the trainer's process, so the task may keep state across rows)."""
        return {}

    def state_dict(self):
        """The state `search_metrics` keeps, for checkpoints (tensors and plain values only)."""
        return {}

    def load_state_dict(self, state):
        pass

    def evaluate(self, model, tokenizer, ref_model, step=None):
        """Metrics of the policy now. Its forward passes (and its reference's) run under
        `policy_precision`; the task's scorers outside it, as `score` runs in training."""
        raise NotImplementedError

    def policy_precision(self, model):
        """The context of the policy's forward passes at evaluation: the trainer's autocast, as
        in a searcher (`searcher.sample_groups`). Around the policy only: a scorer (a victim, a
        classifier, a reward model) under it would measure at another precision than the
        training reward, and autocast would keep low-precision copies of its weights."""
        return precision.autocast(next(model.parameters()).device,
                               getattr(torch, getattr(self.cfg, "dtype", "float32")))


# Imported on demand, so that a task's optional dependencies are only needed when it is used.
TASKS = {"toy": "tasks.toy:ToyTask", "gsm8k": "tasks.gsm8k:Gsm8kTask",
         "arith": "tasks.arith:ArithTask", "redteam": "tasks.redteam:RedTeamTask",
         "summarize": "tasks.summarize:SummarizeTask", "tldr": "tasks.summarize:TldrTask"}


def prompt_batches(prompts, batch_size, seed):
    """Endless batches of prompts: each epoch is a fresh shuffle, so all are seen equally."""
    rng = random.Random(seed)
    order = []
    while True:
        batch = []
        while len(batch) < batch_size:
            if not order:
                order = list(prompts)
                rng.shuffle(order)
            batch.append(order.pop())
        yield batch


def task_class(name):
    """A registered task by name, or any Task subclass as "package.module:Class"."""
    spec = TASKS.get(name, name if ":" in name else None)
    if spec is None:
        raise ValueError(f"unknown task {name!r}: choose one of {', '.join(TASKS)}, "
                         "or name your own as module:Class")
    module, _, cls = spec.partition(":")
    if not module or not cls.isidentifier():
        raise ValueError(f"--task {name}: name your own task as module:Class, e.g. "
                         "mytasks:Sorting (a module on PYTHONPATH and a Task subclass in it)")
    try:
        found = getattr(importlib.import_module(module), cls)
    except ImportError as e:
        raise ValueError(f"--task {name}: cannot import {module} ({e}): run from the folder "
                         "that holds it, or add that folder to PYTHONPATH") from None
    except AttributeError:
        raise ValueError(f"--task {name}: {module} has no {cls}: check the class name") from None
    except Exception as e:               # the module itself fails: a syntax error, a raise, ...
        raise ValueError(f"--task {name}: importing {module} failed ({type(e).__name__}: "
                         f"{e}): fix the module") from None
    if not (isinstance(found, type) and issubclass(found, Task)):
        raise ValueError(f"--task {name}: {module}.{cls} is not a Task subclass: subclass "
                         "tasks.Task (see tasks/toy.py)")
    return found


def make_task(cfg):
    return task_class(cfg.task)(cfg)
