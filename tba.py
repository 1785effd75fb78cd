"""tba: Trajectory Balance with Asynchrony, on one machine.

    python tba.py --task toy --searchers 0        # the synchronous baseline on the exact toy task
    python tba.py --help                          # every setting

This file is the loop: the settings (`config.py`), the run's parts (`assembly/load.py`: the
task, the policy and its frozen reference, the optimiser, the source of groups, the loss), then
`train`: draw B groups of K scored completions, take a trajectory-balance step
(`trainer.tb_loss`), ship the weights to the searchers every k steps, repeat; the trained model
ends in runs/<name>/final.
Where the groups come from (this process, searcher processes, Ray actors) is the business of
`engines/sources.py`; the run folder, resuming, stopping and failures are `plumbing/run.py`'s.
"""
import sys
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

from assembly import load
import config
from devices import placement
from llm import models
from plumbing import checkpoint, loggers, plot, run, schedules
import trainer


def train(cfg, setup):
    """Draw groups, take a trainer step, send the weights back, repeat; evaluate every
    --eval-every steps and write a checkpoint every --save-every. -> the last evaluation"""
    task, policy, tokenizer, source = setup.task, setup.policy, setup.tokenizer, setup.source
    progress, first_step = setup.progress, setup.progress.step
    out, dtype = Path(cfg.out), getattr(torch, cfg.dtype)
    start = time.time() - progress.elapsed            # wall time spans a run's sessions
    earlier = (progress.tokens, progress.groups)      # generated in earlier sessions
    bar = tqdm(total=cfg.steps, initial=first_step, desc="train", unit="step", disable=cfg.quiet,
               dynamic_ncols=True)

    def evaluate_now():
        return evaluate(task, policy, tokenizer, setup.ref_model, step=progress.step, start=start,
                        log=log)

    def save_checkpoint():
        progress.elapsed = time.time() - start
        state = run.state(progress, optimizer=setup.optimizer, scheduler=setup.scheduler,
                          scaler=setup.scaler, task=task, source=source, log_z=setup.log_z)
        path = checkpoint.save(out, progress.step, policy, tokenizer, state,
                               keep=cfg.keep_checkpoints)
        if cfg.quiet:
            tqdm.write(f"step {progress.step}: checkpoint {path}")
        return path

    log = None
    try:
        run.make_folder(cfg)
        record = run.run_record(cfg, setup.layout)
        run.write_json(out / "config.json", record)
        log = run.MetricsLog(out / "metrics.jsonl", resume_step=first_step if cfg.resume else None,
                             loggers=loggers.open_loggers(cfg.report_to, out=out, record=record,
                                                          resume=bool(cfg.resume), quiet=cfg.quiet))
        source.start(policy, version=first_step)
        if not cfg.resume:                       # the searchers fill the buffer meanwhile
            metrics = evaluate_now()
        with tqdm(total=source.fill_target, desc="filling the buffer", unit="group",
                  disable=cfg.quiet or not source.fill_target, leave=False) as fill:
            source.fill(fill)
        last = time.time()
        for step in range(first_step + 1, cfg.steps + 1):
            setup.stop.check()
            version = step - 1                   # updates the policy has had before this step
            beta = schedules.beta_at(version, cfg.beta, cfg.beta_final, cfg.beta_steps)
            reward_temp = schedules.reward_temp_at(version, cfg.reward_temp, cfg.reward_temp_steps)
            batch, source_metrics = source.next_batch(version)          # B groups of K
            lr = setup.scheduler.get_last_lr()[0]
            t0 = time.time()
            stats = trainer.train_step(
                policy, setup.optimizer, setup.scheduler, batch, beta=beta, loss=setup.loss,
                temperature=cfg.temperature, micro_groups=cfg.micro_groups,
                max_grad_norm=cfg.max_grad_norm, micro_completions=cfg.micro_completions,
                dtype=dtype, scaler=setup.scaler, reward_temp=reward_temp,
                learned_log_z=setup.log_z, version=version)
            placement.release_freed_heap(setup.layout.device)   # its activations, to the system
            train_s = time.time() - t0
            sync = (source.publish(policy, version=step) if step % cfg.sync_every == 0
                    else {"sync_s": 0.0})                  # seconds, of each leg too
            source.poll()
            trained = source_metrics["trained_completions"]      # what the step learnt from
            progress.step, progress.samples = step, progress.samples + trained
            progress.tokens, progress.groups = (earlier[0] + source.tokens,
                                                earlier[1] + source.groups)
            now = time.time()
            row = {"step": step, "time": round(now - start, 3), "samples": progress.samples,
                   **stats, "beta": beta, "reward_temp": reward_temp, "lr": lr,
                   "version": version,
                   **source_metrics, **sync, "train_s": round(train_s, 4),
                   "gen_groups": progress.groups,
                   "gen_tokens_per_s": round(progress.tokens / (now - start), 2),
                   "samples_per_s": round(trained / (now - last), 2),
                   **task.search_metrics(source.take_infos())}
            log.write(row)
            last = now
            bar.set_postfix(reward=f"{row['reward_mean']:.3f}", loss=f"{row['loss']:.3g}",
                            stale=f"{row.get('staleness_mean', 0.0):.1f}",
                            samples_s=f"{row['samples_per_s']:.1f}", refresh=False)
            bar.update()
            if cfg.save_every and step % cfg.save_every == 0 and step < cfg.steps:
                save_checkpoint()                        # the last step's is written below
            if (cfg.eval_every and step % cfg.eval_every == 0) or step == cfg.steps:
                metrics = evaluate_now()
        if cfg.save_every:                       # 0: no optimiser or buffer state on disk
            save_checkpoint()
        checkpoint.save_pretrained(policy, tokenizer, out / "final")
    except KeyboardInterrupt:
        if setup.stop.between_steps() and progress.step > first_step:   # keep what was done
            tqdm.write(f"saved {save_checkpoint()}; continue with: python tba.py --resume {out}")
        raise
    except Exception as e:
        raise run.failure(e, step=progress.step, out=out) from e
    finally:
        bar.close()
        source.close()
        if log:
            log.close()
    summary = " ".join(f"{k}={v:.4g}" for k, v in metrics.items())
    print(f"final ({cfg.steps} steps, {time.time() - start:.0f} s, {progress.samples} samples): "
          f"{summary}")
    print(f"the trained model is in {out / 'final'} (AutoModelForCausalLM.from_pretrained loads it)")
    return metrics


def evaluate(task, model, tokenizer, ref_model, *, step, start, log):
    """The task's evaluation of the policy now, logged as a metrics row and printed. The task
    runs the policy at training's precision and its scorers as training scores
    (`Task.policy_precision`)."""
    metrics = task.evaluate(model, tokenizer, ref_model, step=step)
    log.write({"step": step, "time": round(time.time() - start, 3), **metrics})
    tqdm.write(f"step {step}: " + " ".join(f"{k}={v:.4g}" for k, v in metrics.items()))
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
