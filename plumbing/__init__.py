"""The run's plumbing: the run folder, metrics and resuming (run.py), checkpoints
(checkpoint.py), the optimiser and its schedules (schedules.py), metric loggers (loggers.py),
plots (plot.py), and the run's own errors (errors.py)."""
