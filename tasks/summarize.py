"""Summarisation with a reward model: the paper's preference-tuning task (TL;DR).

    python tba.py --task summarize    # offline: ACL abstracts -> summaries, similarity reward
    python tba.py --task tldr         # the paper's Reddit TL;DR, with a hub reward model

The policy writes a summary of each post; a reward model scores it. TB's target is
p_ref(summary) · exp(r / β): the reference policy keeps summaries fluent and close to what the
model wrote before (the KL the paper reports as perplexity), the reward pulls toward what the
reward model prefers. TB is unchanged by a constant added to every reward of a prompt (log Ẑ
absorbs it), so an uncalibrated reward model's offset does not matter; its scale does, and β
sets it. The rewards are therefore not normalised: a running mean and std would move the target
during the run.

Data (`--dataset`):
- `aclsum` (default of `--task summarize`; package `aclsum`, no hub): 100 training and 100 test
  ACL papers; the prompt is the abstract, the reference the paper's three one-sentence
  summaries (challenge, approach, outcome) joined.
- a hub id (default of `--task tldr`: `trl-lib/tldr`) read with `datasets`, rows of `prompt`
  (the post, ending in "TL;DR:") and `completion` (the reference summary), or
  `CarperAI/openai_summarize_tldr`'s `prompt` and `label`;
- `--data-dir` FOLDER of train.jsonl and test.jsonl with those fields.

Reward (`--reward-model`):
- `similarity` (default): a stand-in for a learned reward model, clearly not one: the cosine of
  the summary's and the reference's MiniLM sentence embeddings, minus a length term
  max(0, words / reference words − 1) / 2 so that copying the source does not pay.
- a hub id or local folder of an `AutoModelForSequenceClassification` with one output (e.g.
  `cleanrl/EleutherAI_pythia-1b-deduped__reward__tldr`), scoring the text
  post + "\nTL;DR:" + " " + summary, the format the TL;DR reward models were trained on.

Evaluation on `--eval-n` test posts: `--eval-samples` summaries per post sampled at the training
temperature (the distribution TB trains, which can improve while the greedy summary stays put),
with the same random draws at every evaluation. `eval/win_rate` is the share whose
`--judge-model` score beats the baseline's (ties count half), `eval/reward_mean` and
`eval/length` (tokens) their reward and length, `eval/kl` the mean of log p_θ − log p_ref over
them (the policy's drift from the reference). Beside them one greedy summary per post:
`eval/greedy_win_rate`, `eval/greedy_reward_mean`. The baseline is
the reference summary under a learned judge, as in the paper; under the similarity stand-in the
reference is the target itself (it always wins), so the baseline is the initial policy's own
summaries, drawn with the same dice: 0.5 at step 0, and above 0.5 means better than before.
"""
import functools
from dataclasses import dataclass
import importlib.util
import json
import re
from pathlib import Path

import torch

from plumbing import checkpoint
from plumbing.flags import TASK_DEFAULT, flag
from llm import sampling
from tasks import Prompt, PromptSettings, Task, data_dir_flag, scorers
from llm.logprobs import group_logprobs

SIMILARITY = "similarity"
ACLSUM = "aclsum"
INSTRUCTION = "Summarise the text above in two or three sentences."
TEXT_FIELDS = ("prompt", "post")                  # the text to summarise
SUMMARY_FIELDS = ("completion", "label", "summary")  # the reference summary
SAMPLES_LOGGED = 4


def detokenize(words):
    """ACL sentences come tokenised ("paper , we ( QA ) ."): undo the spaces around punctuation."""
    text = " ".join(words)
    text = re.sub(r" ([,.;:!?%)\]])", r"\1", text)
    return re.sub(r"([(\[]) ", r"\1", text)


def read_aclsum(split):
    """[(abstract, reference summary)] from the packaged aclsum files."""
    spec = importlib.util.find_spec(ACLSUM)         # importing it needs `sienna`: read the files
    if spec is None or not spec.submodule_search_locations:
        raise ValueError("the aclsum data is not installed: `pip install --no-deps aclsum`, "
                         "or pass --dataset trl-lib/tldr (hub) or --data-dir FOLDER")
    path = Path(list(spec.submodule_search_locations)[0]) / "dataset" / f"{split}.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [(detokenize(r["sentences"]["abstract"]),
             " ".join(r["summary"][part] for part in ("challenge", "approach", "outcome")))
            for r in rows]


def pick(row, fields):
    return next((row[f] for f in fields if isinstance(row.get(f), str)), None)


def read_jsonl(path):
    """[(text, reference summary)] from a jsonl file; a bad line is named by file and number."""
    pairs = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path} line {number} is not valid JSON ({e.msg}): fix or remove "
                             "it") from None
        text = pick(row, TEXT_FIELDS) if isinstance(row, dict) else None
        summary = pick(row, SUMMARY_FIELDS) if isinstance(row, dict) else None
        if text is None or summary is None:
            raise ValueError(f"{path} line {number} needs a text field ({' or '.join(TEXT_FIELDS)}) "
                             f"and a summary field ({' or '.join(SUMMARY_FIELDS)}): fix or remove it")
        pairs.append((text, summary))
    return pairs


def read_local(folder, split):
    path = Path(folder) / f"{split}.jsonl"
    if not path.is_file():
        raise ValueError(f"{path} not found: --data-dir needs train.jsonl and test.jsonl")
    return read_jsonl(path)


def read_hub(name, split):
    if importlib.util.find_spec("datasets") is None:
        raise ValueError(f"--dataset {name} comes from the Hugging Face hub: `pip install "
                         "datasets`, or use --dataset aclsum or --data-dir FOLDER")
    import datasets
    try:
        data = datasets.load_dataset(name, split=split)
    except Exception as e:                          # no hub, no such dataset, no such split
        raise ValueError(f"cannot load --dataset {name} ({str(e).splitlines()[0]}): use "
                         "--dataset aclsum or --data-dir FOLDER offline") from None
    pairs = [(pick(r, TEXT_FIELDS), pick(r, SUMMARY_FIELDS)) for r in data]
    if not pairs or None in pairs[0]:
        raise ValueError(f"--dataset {name} rows lack the fields {TEXT_FIELDS} and "
                         f"{SUMMARY_FIELDS}")
    return pairs


def strip_tldr(text):
    """The TL;DR posts end in "TL;DR:"; the chat prompt and the reward text add their own."""
    return re.sub(r"\s*TL;DR:\s*$", "", text)


class SimilarityReward:
    """Stand-in reward: cos(emb(summary), emb(reference)) − max(0, words/ref words − 1) / 2;
    an empty summary gets −1, the lowest cosine (MiniLM embeds "" at ~0.1 of anything)."""

    def __init__(self, device):
        self.embedder = scorers.load_embedder(scorers.DEFAULT_EMBEDDER, device)

    def __call__(self, texts, summaries, references):
        cosine = (self.embedder(summaries) * self.embedder(references)).sum(-1)           # [N]
        cosine[[not s.split() for s in summaries]] = -1.0    # no words: the lowest cosine
        ratio = torch.tensor([len(s.split()) / max(1, len(r.split()))
                              for s, r in zip(summaries, references)])                 # [N]
        return cosine - (ratio - 1).clamp(min=0) / 2


class RewardModel:
    """A sequence classifier with one output, scoring post + "\\nTL;DR:" + " " + summary."""

    def __init__(self, name, device, batch_size=16):
        from transformers import AutoModelForSequenceClassification, AutoTokenizer
        try:
            self.model = (AutoModelForSequenceClassification.from_pretrained(name).to(device)
                          .eval().requires_grad_(False))
            self.tokenizer = AutoTokenizer.from_pretrained(name)
        except (OSError, ValueError) as e:
            raise ValueError(f"cannot load --reward-model {name} ({str(e).splitlines()[0]}): pass "
                             f"a local folder, a hub id on a machine with a hub, or "
                             f"{SIMILARITY}") from None
        if self.model.config.num_labels != 1:
            raise ValueError(f"--reward-model {name} has {self.model.config.num_labels} outputs; "
                             "a reward model has one")
        if self.tokenizer.pad_token is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.model.config.pad_token_id = self.tokenizer.pad_token_id
        self.device, self.batch_size = device, batch_size

    @torch.no_grad()
    def __call__(self, texts, summaries, references=None):
        joined = [f"{strip_tldr(t)}\nTL;DR: {s}" for t, s in zip(texts, summaries)]
        scores = []
        for i in range(0, len(joined), self.batch_size):
            batch = self.tokenizer(joined[i:i + self.batch_size], return_tensors="pt",
                                   padding=True, truncation=True).to(self.device)
            scores.append(self.model(**batch).logits[:, 0].float().cpu())
        return torch.cat(scores)                                                      # [N]


def win_rate(ours, theirs):
    """[N] judge scores of two summaries of the same posts -> [N] 1 win, 0.5 tie, 0 loss."""
    return (ours > theirs).float() + 0.5 * (ours == theirs).float()


def load_reward(name, device):
    return SimilarityReward(device) if name == SIMILARITY else RewardModel(name, device)


@dataclass
class SummarizeSettings(PromptSettings):
    """summarize, tldr: the data, the reward model and the judge."""
    data_dir: str = data_dir_flag()
    dataset: str = flag(None, "summarize, tldr: aclsum (packaged), or a hub dataset of prompt "
                              "and completion (or label) rows, e.g. trl-lib/tldr; --data-dir "
                              f"takes local jsonl files instead {TASK_DEFAULT}")
    reward_model: str = flag("similarity", "summarize, tldr: similarity (a stand-in: MiniLM "
                                           "cosine to the reference, minus a length term), or a "
                                           "hub id or folder of a one-output sequence classifier, "
                                           "e.g. cleanrl/EleutherAI_pythia-1b-deduped__reward__tldr")
    judge_model: str = flag("", "summarize, tldr: scores eval/win_rate (default: --reward-model; "
                                "the paper judges with a larger 'gold' reward model)")


class SummarizeTask(Task):
    name = "summarize"
    Settings = SummarizeSettings
    eval_needs_reference = True          # eval/kl, and the initial policy's summaries
    min_eval_samples = 1                 # win rate and KL are measured on sampled summaries
    # For SmolLM2-135M on a 2-core CPU (~25 s a step, 7-8 min a run in bfloat16): 12 steps of
    # 4 abstracts × 4 summaries of at most 48 tokens. The similarity reward spreads ~0.1-0.2
    # within a group; β = 0.02 makes that 5-10 nats of r/β. ACL abstracts take 110-1,323 tokens
    # as chat prompts (median ~200) and a batch is padded to its longest: prompts over 192
    # tokens are skipped (45 training and 50 test abstracts stay), or one long abstract would
    # double a step's time. micro_groups=1: with the 16 summaries of a step in one pass the
    # trainer reached 10 GB; one abstract's 4 at a time keep its activations near 2 GB.
    # Evaluation (~40 s): 2 sampled and 1 greedy summary of 16 test abstracts, every 6 steps.
    defaults = dict(Task.defaults, dataset=ACLSUM, steps=12, group_size=4, max_new_tokens=48,
                    temperature=0.7, beta=0.02, beta_final=0.02, lr=3e-5, warmup_steps=2,
                    decay_steps=6, eval_every=6, eval_n=16, eval_samples=2, recent_frac=0.5,
                    min_buffer=4, buffer_capacity=2000, save_every=6, max_prompt_len=192,
                    micro_groups=1)

    def __init__(self, cfg):
        super().__init__(cfg)
        self._prompts = {}
        self.baseline = None                 # the initial policy's greedy eval summaries

    def load_model(self, device):
        self.reward_model = load_reward(self.cfg.reward_model, device)
        judge = self.cfg.judge_model or self.cfg.reward_model
        self.judge = (self.reward_model if judge == self.cfg.reward_model
                      else load_reward(judge, device))
        return super().load_model(device)

    @functools.cache
    def examples(self, split):
        """[(text, reference)] of a split: train, or test for evaluation."""
        if self.cfg.data_dir:
            return read_local(self.cfg.data_dir, split)
        if self.cfg.dataset == ACLSUM:
            return read_aclsum(split)
        return read_hub(self.cfg.dataset, split)

    def format(self, text, tokenizer):
        style = self.cfg.prompt_style
        if style == "auto":
            style = "chat" if tokenizer.chat_template else "plain"
        if style == "plain":
            return f"{strip_tldr(text)}\nTL;DR:"
        return tokenizer.apply_chat_template(
            [{"role": "user", "content": f"{strip_tldr(text)}\n\n{INSTRUCTION}"}],
            tokenize=False, add_generation_prompt=True)

    def prompts(self, split, tokenizer):
        if split not in self._prompts:
            examples = self.examples(split)
            texts = [self.format(t, tokenizer) for t, _ in examples]
            ids = tokenizer(texts, add_special_tokens=not tokenizer.chat_template)["input_ids"]
            kept = [Prompt(text=t, ids=i, index=n, answer=ref)
                    for n, (t, i, (_, ref)) in enumerate(zip(texts, ids, examples))
                    if len(i) <= self.cfg.max_prompt_len]
            if not kept:
                raise ValueError(f"every {split} prompt is longer than --max-prompt-len "
                                 f"{self.cfg.max_prompt_len} tokens: raise it")
            self._prompts[split] = kept
        return self._prompts[split]

    def reward(self, prompts, completions):
        texts = [self.examples("train")[p.index][0] for p in prompts]
        return self.reward_model(texts, completions, [p.answer for p in prompts]).tolist()

    @torch.no_grad()
    def evaluate(self, model, tokenizer, ref_model, step=None):
        prompts = self.prompts("test", tokenizer)
        prompts = prompts[:self.cfg.eval_n] if self.cfg.eval_n else prompts
        n = self.cfg.eval_samples
        texts = [self.examples("test")[p.index][0] for p in prompts]
        references = [p.answer for p in prompts]
        texts_n, references_n = ([x for x in xs for _ in range(n)] for xs in (texts, references))
        sampled, length, kl = self.sample(model, tokenizer, prompts, n, ref_model)      # N·n
        greedy, _, _ = self.summarize(model, tokenizer, prompts, greedy=True)           # N
        if self.baseline is None:            # once per run (see the module's docstring)
            if not isinstance(self.judge, SimilarityReward):
                self.baseline = references_n, references
            elif step == 0:                  # the policy is still the reference
                self.baseline = sampled, greedy
            else:
                self.baseline = (self.sample(ref_model, tokenizer, prompts, n)[0],
                                 self.summarize(ref_model, tokenizer, prompts, greedy=True)[0])
            self.baseline_scores = (self.judge(texts_n, self.baseline[0], references_n),
                                    self.judge(texts, self.baseline[1], references))
        reward = self.reward_model(texts_n, sampled, references_n)                      # [N·n]
        greedy_reward = self.reward_model(texts, greedy, references)                    # [N]
        judged = (reward, greedy_reward) if self.judge is self.reward_model else (
            self.judge(texts_n, sampled, references_n), self.judge(texts, greedy, references))
        wins = win_rate(judged[0], self.baseline_scores[0])                             # [N·n]
        greedy_wins = win_rate(judged[1], self.baseline_scores[1])                      # [N]
        metrics = {"eval/win_rate": wins.mean().item(),
                   "eval/reward_mean": reward.mean().item(),
                   "eval/kl": kl,
                   "eval/length": length,
                   "eval/greedy_win_rate": greedy_wins.mean().item(),
                   "eval/greedy_reward_mean": greedy_reward.mean().item(),
                   "eval/n": len(prompts)}
        if self.cfg.out:
            checkpoint.append_lines(Path(self.cfg.out) / "samples.jsonl", [
                json.dumps({"step": step, "summary": sampled[i * n], "greedy": greedy[i],
                            "reference": references[i], "reward": reward[i * n].item(),
                            "win": wins[i * n].item()}) + "\n"
                for i in range(min(SAMPLES_LOGGED, len(prompts)))])
        return metrics

    def sample(self, model, tokenizer, prompts, n, ref_model=None):
        """`summarize` with the same random draws at every evaluation (seeded by --seed, the
        training stream left as it was): the policy and the baseline are compared on common
        random numbers, so a win is a change of the policy, not of the dice."""
        device = next(model.parameters()).device
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            torch.manual_seed(self.cfg.seed)
            return self.summarize(model, tokenizer, prompts, greedy=False, n=n, ref_model=ref_model)

    def summarize(self, model, tokenizer, prompts, greedy, n=1, ref_model=None):
        """`n` summaries per prompt at the training temperature (one if greedy), in batches.
        -> (N·n summaries, their mean length in tokens, and with a `ref_model` the mean over
        them of log p_θ(y) − log p_ref(y): the KL of the policy from the reference, else None)"""
        from batch import GroupBatch
        summaries, lengths, log_ratios = [], [], []
        for i in range(0, len(prompts), self.cfg.eval_batch_size):
            part = prompts[i:i + self.cfg.eval_batch_size]
            with self.policy_precision(model):
                prompt_ids, prompt_mask, response_ids, response_len = sampling.generate(
                    model, tokenizer, [p.ids for p in part], num_samples=1 if greedy else n,
                    max_new_tokens=self.cfg.max_new_tokens, temperature=self.cfg.temperature,
                    greedy=greedy)                        # response_ids [b, n, R], len [b, n]
            summaries += sampling.decode(tokenizer, response_ids, response_len)
            lengths += response_len.flatten().tolist()
            if ref_model is not None:     # every tensor of the batch where the ids are
                zeros = torch.zeros(response_len.shape, device=response_len.device)   # [b, n]
                batch = GroupBatch(prompt_ids, prompt_mask, response_ids, response_len, zeros,
                                   zeros, torch.zeros(len(part), dtype=torch.long,
                                                      device=response_len.device),
                                   torch.arange(len(part), device=response_len.device))
                with self.policy_precision(model):
                    log_ratios.append(group_logprobs(model, batch, self.cfg.temperature)
                                      - group_logprobs(ref_model, batch, self.cfg.temperature))
        kl = torch.cat(log_ratios).mean().item() if log_ratios else None
        return summaries, sum(lengths) / len(lengths), kl


class TldrTask(SummarizeTask):
    name = "tldr"
    # The paper's data with plain prompts ("...\nTL;DR:"); its GPU recipe is in the README.
    defaults = dict(SummarizeTask.defaults, dataset="trl-lib/tldr", max_prompt_len=512)
