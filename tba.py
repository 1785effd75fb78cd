"""tba: Trajectory Balance with Asynchrony, on one machine.

    python tba.py --task toy --searchers 0        # the synchronous baseline on the exact toy task
    python tba.py --help                          # every setting

This file is the loop: the settings (`config.py`), the run's parts (`assembly/load.py`: the
task, the policy and its frozen reference, the optimiser, the source of groups, the loss), then
`train`: draw B groups of K scored completions, take a trajectory-balance step
(`trainer.tb_loss`), ship the weights to the searchers every k steps, repeat; the trained model
ends in runs/<name>/final.
Where the groups come from (this process, searcher processes, Ray actors) is the business of
`engines/sources.py`; the run's records (its folder, metrics rows, evaluations, checkpoints, a
failure's message) are `plumbing/bookkeeping.py`'s, resuming and stopping `plumbing/run.py`'s.
"""
import sys
import time

import torch

from assembly import load
import config
from devices import placement
from llm import models
from plumbing import plot, run, schedules
from plumbing.bookkeeping import Bookkeeping
import trainer


def train(cfg, setup):
    """Draw groups, take a trainer step, send the weights back, repeat; `Bookkeeping` keeps the
    run's records around it (metrics rows, evaluations, checkpoints, the final model).
    -> the last evaluation"""
    source, policy = setup.source, setup.policy
    with Bookkeeping(cfg, setup) as books:
        source.start(policy, version=books.first_step)   # searchers begin with these weights
        books.fill(source)                  # the first evaluation while the buffer fills
        for step in range(books.first_step + 1, cfg.steps + 1):
            setup.stop.check()
            version = step - 1                   # updates the policy has had before this step
            beta = schedules.beta_at(version, cfg.beta, cfg.beta_final, cfg.beta_steps)
            reward_temp = schedules.reward_temp_at(version, cfg.reward_temp, cfg.reward_temp_steps)
            lr = setup.scheduler.get_last_lr()[0]
            # --- the algorithm: B groups of K from the buffer, one TB step, weights out ---
            batch, source_metrics = source.next_batch(version)
            t0 = time.time()
            stats = trainer.train_step(
                policy, setup.optimizer, setup.scheduler, batch, beta=beta, loss=setup.loss,
                temperature=cfg.temperature, micro_groups=cfg.micro_groups,
                max_grad_norm=cfg.max_grad_norm, micro_completions=cfg.micro_completions,
                dtype=getattr(torch, cfg.dtype), scaler=setup.scaler, reward_temp=reward_temp,
                learned_log_z=setup.log_z, version=version)
            placement.release_freed_heap(setup.layout.device)   # its activations, to the system
            train_s = time.time() - t0
            sync = (source.publish(policy, version=step) if step % cfg.sync_every == 0
                    else {"sync_s": 0.0})                  # seconds, of each leg too
            source.poll()                                  # the searchers' reports
            # --- the records ---
            books.step_done(step, source_metrics["trained_completions"],
                            {**stats, "beta": beta, "reward_temp": reward_temp, "lr": lr,
                             "version": version, **source_metrics, **sync,
                             "train_s": round(train_s, 4)})
        metrics = books.finish()
    print(books.summary())
    return metrics


def main(argv=None):
    """The command line. Exit codes: 0 done, 2 bad input (one `error:` line, nothing written),
    1 the run failed part-way (one `error:` line saying how to continue), 130 stopped by a
    signal."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["plot"]:
        return plot.main(argv[1:])
    try:
        cfg, given, actions = config.parse_args(argv)
        cfg = (config.resumed_config(cfg, given) if cfg.resume
               else config.resolve(cfg, recipe=actions["recipe"], measure=not actions["dry_run"],
                                   recipe_steps=actions["recipe_steps"]))
        config.check_given(cfg, given - set(actions["recipe"]))
        run.check_out_folder(cfg, try_writing=not actions["dry_run"])
        print(config.describe(cfg, given, recipe=actions["recipe"],
                              recipe_steps=actions["recipe_steps"]), flush=True)
        print(placement.describe(placement.plan_layout(cfg)), flush=True)
        if actions["dry_run"]:
            return 0
        setup = load.load(cfg)
    except (ValueError, models.ModelLoadError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        with setup.stop.on_signals():
            train(cfg, setup)
    except run.RunFailed as e:
        print(f"error: {e}; {run.how_to_continue(cfg.out)}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"interrupted after step {setup.progress.step}; {run.how_to_continue(cfg.out)}",
              file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
