"""The language model: loading it (models.py), sampling completions with HF `generate` and the
log-probs of what was sampled (sampling.py), and the trainer's fast sequence log-probs
(logprobs.py)."""
