"""What a run keeps besides its weights: the run folder, `config.json`, a metrics row a step
(and the loggers), the progress bar, evaluations, checkpoints, the final model, and a failure
turned into one message. `tba.train` opens one around its loop and reports each step to it."""
import time
from pathlib import Path

from tqdm.auto import tqdm

from plumbing import checkpoint, loggers, run


class Bookkeeping:
    """The run's records for `tba.train`. As a context manager: the folder and the files are
    opened on entry; on leaving, a Ctrl-C between steps writes a checkpoint, any other failure
    becomes `run.RunFailed` (naming the last completed step), and the searchers are stopped."""

    def __init__(self, cfg, setup):
        self.cfg, self.setup, self.out = cfg, setup, Path(cfg.out)
        self.progress = setup.progress    # step, samples, tokens, ... (a checkpoint's on --resume)
        self.first_step = self.progress.step
        self.start = time.time() - self.progress.elapsed    # wall time spans a run's sessions
        self.earlier = (self.progress.tokens, self.progress.groups)   # earlier sessions'
        self.last = time.time()
        self.log, self.metrics = None, {}
        self.bar = tqdm(total=cfg.steps, initial=self.first_step, desc="train", unit="step",
                        disable=cfg.quiet, dynamic_ncols=True)

    def __enter__(self):
        cfg, out = self.cfg, self.out
        try:
            run.make_folder(cfg)
            record = run.run_record(cfg, self.setup.layout)
            run.write_json(out / "config.json", record)
            self.log = run.MetricsLog(
                out / "metrics.jsonl", resume_step=self.first_step if cfg.resume else None,
                loggers=loggers.open_loggers(cfg.report_to, out=out, record=record,
                                             resume=bool(cfg.resume), quiet=cfg.quiet))
        except BaseException as e:
            self.__exit__(type(e), e, e.__traceback__)
            raise
        return self

    def __exit__(self, kind, error, traceback):
        try:
            if kind is KeyboardInterrupt:
                if self.setup.stop.between_steps() and self.progress.step > self.first_step:
                    tqdm.write(f"saved {self.save_checkpoint()}; continue with: "
                               f"python tba.py --resume {self.out}")     # keep what was done
            elif kind is not None and issubclass(kind, Exception):
                raise run.failure(error, step=self.progress.step, out=self.out) from error
        finally:
            self.bar.close()
            self.setup.source.close()
            if self.log:
                self.log.close()

    def fill(self, source):
        """Evaluate the starting policy while the searchers fill the buffer. On --resume, only
        an evaluation that was due at the checkpoint's step and is not in metrics.jsonl (the run
        stopped during it): the resumed run logs what the run that never stopped did."""
        cfg, step = self.cfg, self.first_step
        if not cfg.resume or (cfg.eval_every and step % cfg.eval_every == 0
                              and not self.log.has_evaluation(step)):
            self.evaluate()
        with tqdm(total=source.fill_target, desc="filling the buffer", unit="group",
                  disable=self.cfg.quiet or not source.fill_target, leave=False) as fill:
            source.fill(fill)
        self.last = time.time()

    def step_done(self, step, trained, columns):
        """Step `step` trained on `trained` completions: its metrics row (`columns`, with the
        throughput), the bar, and the checkpoint and evaluation that are due."""
        cfg, progress, source = self.cfg, self.progress, self.setup.source
        progress.step, progress.samples = step, progress.samples + trained
        progress.tokens, progress.groups = (self.earlier[0] + source.tokens,
                                            self.earlier[1] + source.groups)
        now = time.time()
        row = {"step": step, "time": round(now - self.start, 3), "samples": progress.samples,
               **columns, "gen_groups": progress.groups,
               "gen_tokens_per_s": round(progress.tokens / (now - self.start), 2),
               "samples_per_s": round(trained / (now - self.last), 2),
               **self.setup.task.search_metrics(source.take_infos())}
        self.log.write(row)
        self.last = now
        self.bar.set_postfix(reward=f"{row['reward_mean']:.3f}", loss=f"{row['loss']:.3g}",
                             stale=f"{row.get('staleness_mean', 0.0):.1f}",
                             samples_s=f"{row['samples_per_s']:.1f}", refresh=False)
        self.bar.update()
        if cfg.save_every and step % cfg.save_every == 0 and step < cfg.steps:
            self.save_checkpoint()                       # the last step's is written by `finish`
        if (cfg.eval_every and step % cfg.eval_every == 0) or step == cfg.steps:
            self.evaluate()

    def evaluate(self):
        setup = self.setup
        self.metrics = evaluate(setup.task, setup.policy, setup.tokenizer, setup.ref_model,
                                step=self.progress.step, start=self.start, log=self.log)

    def save_checkpoint(self):
        setup, progress = self.setup, self.progress
        progress.elapsed = time.time() - self.start
        state = run.state(progress, optimizer=setup.optimizer, scheduler=setup.scheduler,
                          scaler=setup.scaler, task=setup.task, source=setup.source,
                          log_z=setup.log_z)
        path = checkpoint.save(self.out, progress.step, setup.policy, setup.tokenizer, state,
                               keep=self.cfg.keep_checkpoints)
        if self.cfg.quiet:
            tqdm.write(f"step {progress.step}: checkpoint {path}")
        return path

    def finish(self):
        """The last checkpoint (none with --save-every 0: no optimiser or buffer state on disk)
        and the trained model in OUT/final, then the summary line. -> the last evaluation"""
        if self.cfg.save_every:
            self.save_checkpoint()
        checkpoint.save_pretrained(self.setup.policy, self.setup.tokenizer, self.out / "final")
        return self.metrics

    def summary(self):
        summary = " ".join(f"{k}={v:.4g}" for k, v in self.metrics.items())
        return (f"final ({self.cfg.steps} steps, {time.time() - self.start:.0f} s, "
                f"{self.progress.samples} samples): {summary}\n"
                f"the trained model is in {self.out / 'final'} "
                f"(AutoModelForCausalLM.from_pretrained loads it)")


def evaluate(task, model, tokenizer, ref_model, *, step, start, log):
    """The task's evaluation of the policy now, logged as a metrics row and printed. The task
    runs the policy at training's precision and its scorers as training scores
    (`Task.policy_precision`). -> the metrics"""
    metrics = task.evaluate(model, tokenizer, ref_model, step=step)
    log.write({"step": step, "time": round(time.time() - start, 3), **metrics})
    tqdm.write(f"step {step}: " + " ".join(f"{k}={v:.4g}" for k, v in metrics.items()))
    return metrics
