"""Where each process runs and how the weights reach it: each process's device, CPU threads and
set-up (placement.py), and the weight channel from the trainer to the searchers (weights.py)."""
