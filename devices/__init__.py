"""Where each process runs and how the weights reach it: each process's device, CPU threads and
set-up (placement.py), the weight channel from the trainer to the searchers (weights.py) and the
check that each sync arrived (sync_check.py), and how many groups fit in a GPU's pass
(memory.py)."""
