"""Where the trainer's groups come from: one interface (`GroupSource`), three engines and two
options.

`assembly.load.make_source` builds the one a run's settings ask for, on the devices `placement`
gives each process. The training loop (`tba.train`) asks a *group source* for each step's batch
and hands it new weights every --sync-every steps; it never touches processes, buffers or Ray
itself:

    source.connect(quiet)            what it needs before training (a Ray cluster), and a line on
                                     what it holds (shared memory); last in `load`: bad input
                                     found there is still found before anything is written
    source.start(policy, version)    searchers begin with these weights (version = steps so far)
    source.fill(progress)            wait until the first batch can be drawn
    source.next_batch(version)       -> (GroupBatch of --prompts-per-step groups, row metrics)
    source.publish(policy, version)  new weights for the searchers -> {"sync_s": seconds, ...}
    source.poll()                    take in the searchers' reports; SearcherError if one failed
    source.take_infos()              the task's `score` infos of the groups searched since
    source.tokens, source.groups     generated so far in this session
    source.state_dict(), load_state_dict(state, step)   for checkpoints
    source.close()                   stop every searcher; nothing is left running

    SynchronousSource          --searchers 0: the trainer samples each batch itself, on-policy
                       (--lag L: with the weights of L updates ago, options/policy_lag.py;
                       --replay-groups n: n of the B groups replayed, options/replay_groups.py)
    SearcherProcesses  --searchers N: processes on this machine filling a shared-memory replay
                       buffer, weights through shared-memory slots (async_source.py)
    RaySearchers       --searchers N --ray ADDRESS: Ray actors anywhere (ray_source.py)
"""
import time

import torch

import searcher
import tasks


class GroupSource:
    """The interface above, with what a source that runs nothing beside the trainer does:
    nothing to connect to, start, wait for or stop, and weights it need not be sent."""

    fill_target = 0                       # groups to wait for before the first step
    tokens = groups = 0

    def connect(self, quiet=False): pass

    def start(self, policy, version): pass

    def fill(self, progress=None): pass

    def next_batch(self, version):
        raise NotImplementedError

    def publish(self, policy, version): return {"sync_s": 0.0}

    def poll(self, wait_s=0.0): pass

    def take_infos(self):
        infos, self.infos = self.infos, []
        return infos

    def state_dict(self): return {}

    def load_state_dict(self, state, step): pass

    def close(self): pass


class SynchronousSource(GroupSource):
    """--searchers 0: each step samples B fresh groups from the trainer's own policy (with
    --lag, `lag` gives the model to sample with instead); its weights are the trainer's, so
    `publish` sends nothing."""

    def __init__(self, cfg, task, policy, ref_model, tokenizer, prompts, lag=None, sample=None):
        self.cfg, self.task, self.policy, self.ref_model, self.tokenizer = (
            cfg, task, policy, ref_model, tokenizer)
        self.train_prompts = list(prompts)
        self.prompts = tasks.prompt_batches(prompts, 1, cfg.seed)    # one at a time
        self.prompts_used, self.last_prompts = 0, []
        self.reference_pass = searcher.reference_pass_size(cfg)
        self.lag = lag                    # a policy_lag.Lag with --lag, else None
        self.sample = sample              # searcher.SearchOptions.sample: exploration, or None
        self.tokens = self.groups = 0
        self.infos = []

    def next_batch(self, version, n_groups=None, sample=None):
        """B (or `n_groups`) fresh groups, sampled by `sample` if given (else the run's)."""
        t0 = time.time()
        model, sampled = ((self.policy, version) if self.lag is None
                          else self.lag.sampling_model(self.policy, version))
        cfg = self.cfg
        prompts = [next(self.prompts)[0] for _ in range(n_groups or cfg.prompts_per_step)]
        self.prompts_used += len(prompts)
        batch, _ = searcher.sample_groups(
            model, self.ref_model, self.tokenizer, self.task, prompts,
            group_size=cfg.group_size, max_new_tokens=cfg.max_new_tokens,
            temperature=cfg.temperature, version=sampled, dtype=getattr(torch, cfg.dtype),
            reference_pass=self.reference_pass, sample=sample or self.sample)
        self.tokens += int(batch.response_len.sum())
        self.groups += len(prompts)
        self.last_prompts = prompts
        self.infos += [batch.info] if batch.info is not None else []
        return batch, {"trainer_wait_s": 0.0, "search_s": round(time.time() - t0, 4),
                       "reuse_mean": 1.0, "buffer_completions": 0, "recent_frac_actual": 1.0,
                       **batch.sampling_metrics(version)}

    def state_dict(self):
        return {"prompts_used": self.prompts_used}

    def load_state_dict(self, state, step):
        # The prompts an earlier synchronous session has seen (none if it ran searchers).
        self.prompts_used = state.get("prompts_used", 0)
        for _ in range(self.prompts_used):
            next(self.prompts)
        if self.lag is not None:
            self.lag.check_resume(step)
