"""The options, one file each, every one chosen by a flag and tested against the plain version
it replaces: exploring samplers (exploration.py), an exact policy lag (policy_lag.py), replay in
the synchronous loop (replay_groups.py), a learned log Z (learned_log_z.py), RLOO and its
off-policy corrections (rloo.py)."""
