"""A task small enough to know the answer exactly.

Two prompts, a vocabulary of four letters and an end-of-sequence token, and completions of at
most five tokens: 1,365 possible completions per prompt, few enough to score every one. So the
policy's whole distribution can be computed, and compared with the exact target of trajectory
balance,  p*(y|x) ∝ p_ref(y|x) · exp(r(x, y) / β),  by total variation (`toy/tv`), and how many of the six modes it covers (`toy/modes`).

The reward has separated modes: a completion of exactly four letters scores the fraction of
positions it shares with the nearest of three mode strings; anything else scores 0. The model is
a two-layer GPT-2 with random weights, built in code; those initial weights are the reference.
"""
import itertools

import torch
from tokenizers import Tokenizer, models as tok_models, pre_tokenizers
from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast

from tasks import Prompt, Task
from llm.logprobs import completion_logprobs

LETTERS = ["a", "b", "c", "d"]
EOS = "<eos>"
# prompt -> its reward modes (distinct first letters). Prompts are written in the same four
# letters: a token that only prompts used could still be sampled, outside the enumeration.
MODES = {
    "a": ["a b c d", "b d b d", "c c a a"],
    "d": ["d c b a", "a a d d", "b b b b"],
}
MAX_NEW_TOKENS = 5
POSITIONS = 16                    # the model's context: the prompt and the completion
MODEL_SEED = 1234                         # fixed, so every run (and process) has the same p_ref


def build_tokenizer():
    vocab = {tok: i for i, tok in enumerate([EOS, *LETTERS])}
    tokenizer = Tokenizer(tok_models.WordLevel(vocab, unk_token=EOS))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    # pad == eos on purpose: the same trap as SmolLM2, so the tiny runs exercise it too.
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=EOS, pad_token=EOS,
                                   padding_side="left")


def build_model(vocab_size):
    """A two-layer GPT-2 with random weights. Absolute position embeddings matter here: with
    only relative ones (RoPE) a model cannot tell the prefix "a" from "a a", whose attention
    averages the same vectors, so a mode like "a b c d" after the prompt "a" is unlearnable."""
    # No pad_token_id here: `generate` gets the tokenizer's, and with one in the config
    # transformers warns of padding whenever a sampled EOS (= pad) is fed back.
    config = GPT2Config(vocab_size=vocab_size, n_positions=POSITIONS, n_embd=64, n_layer=2,
                        n_head=4, bos_token_id=0, eos_token_id=0, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0,
                        initializer_range=0.005)   # small: p_ref near uniform, modes balanced
    with torch.random.fork_rng():
        torch.manual_seed(MODEL_SEED)
        return GPT2LMHeadModel(config).eval()


def reward_of(prompt_text, completion):
    letters = completion.split()
    if len(letters) != 4:
        return 0.0
    return max(sum(a == b for a, b in zip(letters, mode.split())) / 4 for mode in MODES[prompt_text])


def all_completions():
    """Every possible completion as token strings: n letters then EOS (n < 5), or 5 letters."""
    ended = [list(p) + [EOS] for n in range(MAX_NEW_TOKENS) for p in itertools.product(LETTERS, repeat=n)]
    return ended + [list(p) for p in itertools.product(LETTERS, repeat=MAX_NEW_TOKENS)]


def mode_basins(prompt, completions):
    """[M, n] bool: for each mode of the prompt, the completions within one letter of it (its
    string and the 12 four-letter completions that differ in one place, rewarded 1 and 0.75).
    The modes' strings are 3 or more letters apart, so no completion is in two basins."""
    basins = torch.zeros(len(MODES[prompt]), len(completions), dtype=torch.bool)
    for m, mode in enumerate(MODES[prompt]):
        for i, c in enumerate(completions):
            letters = [t for t in c if t != EOS]
            basins[m, i] = len(letters) == 4 and sum(
                a != b for a, b in zip(letters, mode.split())) <= 1
    return basins


@torch.no_grad()
def exact_logprobs(model, tokenizer, prompt, completions, temperature):
    """log p(y|x) for every completion y: [n]. Sums to one over `all_completions()`."""
    device = next(model.parameters()).device
    rows = [tokenizer.convert_tokens_to_ids(c) for c in completions]
    response_ids = torch.full((len(rows), max(map(len, rows))), tokenizer.pad_token_id)  # [n, R]
    for i, row in enumerate(rows):
        response_ids[i, :len(row)] = torch.tensor(row)
    prompt_ids = torch.tensor([tokenizer.convert_tokens_to_ids([prompt])])          # [1, 1]
    return completion_logprobs(model, prompt_ids.to(device), torch.ones_like(prompt_ids).to(device),
                               response_ids.to(device), torch.tensor(list(map(len, rows))).to(device),
                               owner=torch.zeros(len(rows), dtype=torch.long, device=device),
                               temperature=temperature).cpu()


class ToyTask(Task):
    name = "toy"
    eval_needs_reference = True       # the exact target p* is built from p_ref
    reads_model = False               # its model is built in code, the same in every process
    # β starts high, where p* is close to p_ref and every mode is easy to reach, and is annealed
    # to its final value: at a fixed small β on-policy TB tends to lock onto some modes and lose
    # the others (its on-policy gradient is that of the mode-seeking KL(p_θ || p*)).
    defaults = dict(Task.defaults, steps=1500, prompts_per_step=2, group_size=64,
                    max_new_tokens=MAX_NEW_TOKENS, beta=0.5, beta_final=0.07, beta_steps=1000,
                    lr=5e-4, decay_steps=300, eval_every=100, min_buffer=4, buffer_capacity=12800,
                    save_every=500)

    @classmethod
    def context_length(cls, cfg):
        return POSITIONS

    def load_model(self, device):
        tokenizer = build_tokenizer()
        return build_model(len(tokenizer)).to(device), tokenizer

    def prompts(self, split, tokenizer):
        return [Prompt(text=p, ids=tokenizer.convert_tokens_to_ids([p]), index=i)
                for i, p in enumerate(MODES)]

    def reward(self, prompts, completions):
        return [reward_of(p.text, c) for p, c in zip(prompts, completions)]

    def target_logprobs(self, ref_model, tokenizer, prompt, completions):
        """log p*(y|x) = log p_ref(y|x) + r(x, y)/β − log Z(x), by enumeration."""
        ref = exact_logprobs(ref_model, tokenizer, prompt, completions, self.cfg.temperature)
        reward = torch.tensor([reward_of(prompt, " ".join(t for t in c if t != EOS))
                               for c in completions])
        unnormalised = ref + reward / self.cfg.beta_final
        return unnormalised - torch.logsumexp(unnormalised, 0)

    def evaluate(self, model, tokenizer, ref_model, step=None):
        completions = all_completions()
        metrics, covered = {}, 0
        for prompt in MODES:
            with self.policy_precision(model):
                policy = exact_logprobs(model, tokenizer, prompt, completions,
                                        self.cfg.temperature).exp()
                target = self.target_logprobs(ref_model, tokenizer, prompt, completions).exp()
            metrics[f"toy/tv/{prompt}"] = 0.5 * (policy - target).abs().sum().item()
            basins = mode_basins(prompt, completions).float()                  # [M, n]
            # a mode is covered when the policy holds at least half of the target's mass there
            covered += int((basins @ policy >= 0.5 * (basins @ target)).sum())
        metrics["toy/tv"] = sum(metrics.values()) / len(MODES)
        metrics["toy/modes"] = covered
        return metrics
