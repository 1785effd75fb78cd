"""A run's parts, put together: the task, the policy and its frozen reference, the optimiser,
the source of groups and the loss, with each option the settings ask for wired in here (LoRA, a
learned log Z, a --loss other than TB), so that the loop (`tba.train`) and the trainer read
none of them.
"""
from dataclasses import dataclass

import torch
from transformers.utils import logging as transformers_logging

import searcher
import tasks
import trainer
from buffer import ReplayBuffer, shared_bytes
from devices import placement
from devices.placement import check_shared_memory
from devices.weights import WeightChannel
from engines.async_source import SearcherProcesses
from engines.ray_source import RaySearchers
from engines.sources import SynchronousSource
from llm import logprobs, models
from options import exploration, learned_log_z, lora, losses
from options.policy_lag import Lag
from options.replay_groups import ReplayGroups
from plumbing import run, schedules


@dataclass
class Setup:
    """What `load` prepares for `tba.train`."""
    layout: placement.Layout          # the trainer's device, the searchers', threads per process
    task: tasks.Task
    policy: torch.nn.Module
    tokenizer: object
    ref_model: torch.nn.Module | None  # the frozen initial policy, if the trainer needs it
    optimizer: torch.optim.Optimizer
    scheduler: object                 # the learning rate's warmup-stable-decay schedule
    scaler: torch.amp.GradScaler      # loss scaling, on with --dtype float16 only
    source: object                    # where each step's groups come from (engines/sources.py)
    progress: run.Progress            # step, samples, tokens, ... (a checkpoint's on --resume)
    stop: run.StopRequests            # Ctrl-C or kill: stop at the end of the step
    loss: trainer.Loss                # --loss: what each step minimises (options/losses.py)
    log_z: learned_log_z.LearnedLogZ | None = None   # --log-z learned; None: the group estimate


def load(cfg):
    """Load the task, the policy and its frozen reference, the optimiser, the group source and,
    on --resume, the newest checkpoint: everything that can fail on bad input fails here, before
    anything is written."""
    layout = placement.plan_layout(cfg)
    device = placement.set_up_process(layout.device, layout.threads)   # where tensors go
    transformers_logging.disable_progress_bar()     # loading and saving bars: noise beside ours
    torch.manual_seed(cfg.seed)
    task = tasks.make_task(cfg)
    task.check_data()                     # a missing data file is found before a model loads
    policy, tokenizer = task.load_model(device)
    lora.add_adapter(policy, cfg.lora_rank, cfg.lora_alpha)     # --lora-rank: options/lora.py
    logprobs.check_logprobs(policy)
    if cfg.activation_checkpointing:
        logprobs.enable_activation_checkpointing(policy)
    # Searchers score the reference log-probs themselves: then the trainer needs a reference
    # copy only if the task's evaluation does.
    ref_model = (models.frozen_copy(policy, getattr(torch, cfg.dtype))
                 if not cfg.searchers or task.eval_needs_reference else None)
    prompts = task.prompts("train", tokenizer)
    task.prompts("test", tokenizer)       # read now: a bad test file must not end the run later
    log_z = (learned_log_z.LearnedLogZ(max(p.index for p in prompts) + 1, cfg.log_z_lr).to(device)
             if cfg.log_z == "learned" else None)
    optimizer, scheduler = schedules.make_optimizer(policy, lr=cfg.lr, total_steps=cfg.steps,
                                                    warmup_steps=cfg.warmup_steps,
                                                    decay_steps=cfg.decay_steps,
                                                    weight_decay=cfg.weight_decay,
                                                    lr_final=cfg.lr_final)
    scaler = torch.amp.GradScaler(device.type, enabled=cfg.dtype == "float16")
    stop = run.StopRequests()
    source = make_source(cfg, task=task, policy=policy, ref_model=ref_model,
                         tokenizer=tokenizer, prompts=prompts, layout=layout,
                         interrupt=stop.check)
    progress = run.Progress()
    if cfg.resume:
        progress = run.restore(cfg.out, steps=cfg.steps, policy=policy, optimizer=optimizer,
                               scheduler=scheduler, scaler=scaler, task=task, source=source,
                               log_z=log_z)
    source.connect(quiet=cfg.quiet)       # last (a Ray cluster): nothing after it can fail
    return Setup(layout=layout, task=task, policy=policy, tokenizer=tokenizer,
                 ref_model=ref_model, optimizer=optimizer, scheduler=scheduler, scaler=scaler,
                 source=source, progress=progress, stop=stop,
                 loss=losses.make(cfg.loss, cfg.is_clip), log_z=log_z)


def make_source(cfg, *, task, policy, ref_model, tokenizer, prompts, layout, interrupt):
    """The group source for this run's settings. Searchers (and --replay-groups) get a replay
    buffer sized for the longest prompt (in shared memory unless they are Ray actors);
    `interrupt` raises KeyboardInterrupt when a stop was requested, while the trainer waits for
    groups."""
    options = searcher.SearchOptions(sample=exploration.from_config(cfg),
                                     adapt=lora.adapter(cfg.lora_rank, cfg.lora_alpha))
    lag = Lag(cfg.lag, policy, cfg.out) if cfg.lag else None       # --searchers 0 only
    if not cfg.searchers and not cfg.replay_groups:
        return SynchronousSource(cfg, task, policy, ref_model, tokenizer, prompts, lag=lag,
                                 sample=options.sample)
    longest = max(len(p.ids) for p in prompts)
    n_prompts = max(p.index for p in prompts) + 1
    embedding_dim = task.embedding_dim if cfg.merge_cosine else 0
    need = ((WeightChannel.bytes_needed(policy) if cfg.searchers and not cfg.ray else 0)
            + shared_bytes(cfg.buffer_capacity, longest, cfg.max_new_tokens, n_prompts,
                           embedding_dim))
    check_shared_memory(need)
    buffer = ReplayBuffer(cfg.buffer_capacity, cfg.group_size, longest, cfg.max_new_tokens,
                          n_prompts=n_prompts, pad_id=tokenizer.pad_token_id,
                          per_prompt=cfg.buffer_per_prompt, evict=cfg.buffer_evict,
                          dedup=cfg.dedup, merge_cosine=cfg.merge_cosine,
                          embedding_dim=embedding_dim)
    if not cfg.searchers:
        return ReplayGroups(cfg, task, policy, ref_model, tokenizer, prompts, buffer, lag=lag,
                            sample=options.sample)
    if cfg.ray:
        return RaySearchers(cfg, buffer, layout.threads, interrupt, options)
    return SearcherProcesses(cfg, buffer, layout, interrupt, shared_bytes=need, options=options)
