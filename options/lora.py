"""--lora-rank r: train a LoRA adapter instead of every weight (peft, through transformers'
`add_adapter`; GFlowNet red-teaming trains its attacker this way, r 32, α 16).

Each adapted linear layer computes W·x + (α/r)·B·A·x with W frozen and only A [r, in] and
B [out, r] trained; B starts at zero, so the adapted model starts as the model. The model keeps
its class (a Llama stays a Llama: the project's log-probs read its decoder and output layer as
before). What changes elsewhere: the optimiser holds the adapter's parameters only
(`schedules.make_optimizer`), the frozen reference is the model with its adapter switched off
(`models.frozen_copy`), only the adapter's weights travel to the searchers
(`devices/weights.shipped_state`), and a checkpoint's model folder holds the adapter with the
path of its base model (transformers loads both from it).
"""
from dataclasses import dataclass
from functools import partial

from plumbing.flags import POSITIVE, at_least, flag


@dataclass
class Settings:
    """LoRA (options/lora.py)"""
    lora_rank: int = flag(0, "train a LoRA adapter of this rank (peft) on the policy's attention "
                             "projections instead of every weight; the reference is the same "
                             "model with the adapter off, and only the adapter travels to the "
                             "searchers (0: full fine-tuning; GFlowNet red-teaming: 32)",
                          at_least(0))
    lora_alpha: float = flag(16.0, "--lora-rank: the adapter's scale α (its update is "
                                   "α/rank · B·A)", POSITIVE)


# A setting that acts only with another (config.NEEDS): (name, does it act in run c?, on what,
# why not, fix)
NEEDS = [("lora_alpha", lambda c: c.lora_rank, "a LoRA adapter", "--lora-rank is 0",
          "add --lora-rank R, or ")]


def check(cfg):
    """No rule ties LoRA's settings to the others' (--lora-alpha's one rule is in NEEDS)."""


def adapter(rank, alpha):
    """The searchers' `SearchOptions.adapt` for --lora-rank `rank`: None when 0."""
    return partial(add_adapter, rank=rank, alpha=alpha) if rank else None


def add_adapter(model, rank, alpha):
    """Give `model` a LoRA adapter of `rank` on its attention's query and value projections
    (peft's default for Llama-like models, and GFlowNet red-teaming's: they name no targets),
    no dropout and no bias, as theirs; every other weight is frozen. rank 0: unchanged."""
    if rank:
        from peft import LoraConfig       # imported when used: a second of start-up otherwise
        model.add_adapter(LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=0.0, bias="none",
                                     task_type="CAUSAL_LM"))
    return model
