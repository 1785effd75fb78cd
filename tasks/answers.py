"""What the tasks with a numeric answer share: read the answer, reward it, evaluate a policy.

GSM8K and the arithmetic problems differ only in where their questions come from. Everything
else lives here: `extract_answer` reads the final number of a solution, `answers_match`
compares two numbers written differently ("10", "10.0", "$10.00"), `AnswerTask` turns questions
into prompts (chat template or plain text) and rewards a completion 1 when its answer is right,
and `evaluate_answers` measures greedy pass@1 and keeps a few completions to read.
"""
import json
import re
from decimal import Decimal, InvalidOperation
from pathlib import Path

from tqdm.auto import tqdm

from plumbing import checkpoint
from llm import sampling
from tasks import Prompt, PromptSettings, Task

# A number: an optional sign, an optional "$", digits with optional thousands commas, optional
# decimals; what follows it ("%", "km", a full stop) is not part of it. Not inside a word
# ("abc123"). The sign counts only where it cannot be a binary minus: "3-4" is 3 then 4, not −4.
NUMBER = re.compile(r"(?<![\w.])([-−]?)\$?((?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.\d+)?|\.\d+)")
# Where a solution states its answer: GSM8K's "#### 18", or "The answer is 18".
MARKER = re.compile(r"####|\bthe (?:final )?answer is\b", re.IGNORECASE)
SENTENCE_END = re.compile(r"\n|\.(?:\s|$)")


def normalize_number(text):
    """'1,000.50' -> '1000.5', '10.0' -> '10', '-0' -> '0'; None when it is not a number."""
    try:
        value = Decimal(text.replace(",", "").replace("$", "").replace("−", "-").strip())
    except InvalidOperation:
        return None
    if not value.is_finite():                       # "nan", "inf"
        return None
    if value == value.to_integral_value():
        return str(int(value))
    return format(value.normalize(), "f")


def _numbers(text):
    """Every number in `text`, normalised, in order."""
    found = []
    for match in NUMBER.finditer(text):
        sign, digits = match.groups()
        if sign and text[:match.start()].rstrip().endswith(tuple("0123456789)]")):
            sign = ""                  # "5 -3" is a subtraction: this number is 3
        found.append(normalize_number(("-" if sign else "") + digits))
    return found


def extract_answer(text):
    """The final answer of a solution, as a normalised number string, or None.

    After the last "####" or "The answer is" when there is one, the last number of the sentence
    that follows it: "The answer is 80 - 20 = 60. Next, ..." gives 60, and what the model writes
    after its answer does not count. Else the last number in the text.
    """
    markers = list(MARKER.finditer(text))
    if markers:
        after = _numbers(SENTENCE_END.split(text[markers[-1].end():], maxsplit=1)[0])
        if after:
            return after[-1]
    numbers = _numbers(text)
    return numbers[-1] if numbers else None


def answers_match(pred, gold):
    """Equal as numbers ('10' == '10.00' == '$10'); an answer that is None matches nothing."""
    if pred is None or gold is None:
        return False
    pred_n, gold_n = normalize_number(pred), normalize_number(gold)
    if pred_n is None or gold_n is None:
        return pred.strip() == gold.strip()
    return pred_n == gold_n


def complete(task, model, tokenizer, prompts, max_new_tokens, batch_size, num_samples=1,
             temperature=1.0, greedy=True):
    """Completions for each prompt, -> list (per prompt) of `num_samples` strings. Prompts are
    generated in batches of similar length: less padding, so less wasted compute."""
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i].ids))
    completions = [None] * len(prompts)
    for s in tqdm(range(0, len(order), batch_size),
                  desc=f"eval ({len(prompts)} prompts{'' if greedy else f' × {num_samples}'})",
                  unit="batch", leave=False, disable=task.cfg.quiet):
        batch = order[s:s + batch_size]
        with task.policy_precision(model):
            _, _, response_ids, response_len = sampling.generate(
                model, tokenizer, [prompts[i].ids for i in batch], num_samples=num_samples,
                max_new_tokens=max_new_tokens, temperature=temperature, greedy=greedy)
        texts = sampling.decode(tokenizer, response_ids, response_len)       # batch × num_samples
        for n, i in enumerate(batch):
            completions[i] = texts[n * num_samples:(n + 1) * num_samples]
    return completions


def evaluate_answers(task, model, tokenizer, prompts, max_new_tokens, batch_size, out_dir=None,
                     step=None, n_shown=4, sampled=0, temperature=1.0):
    """Greedy pass@1: the share of `prompts` whose greedy completion has the right answer.

    Greedy decoding makes the number reproducible and independent of the sampling temperature.
    With `sampled` > 0, also the mean reward of that many completions per prompt sampled at
    `temperature`: the expected reward of the policy as trained, which RL moves first (it
    sharpens the sampling distribution before it changes the greedy answers).
    With `out_dir`, the greedy completions of the first `n_shown` prompts go to
    <out_dir>/samples.jsonl, one JSON object a line: the same questions at every evaluation, so
    a run can be read (how do the answers change?) and not only plotted.
    """
    completions = [c[0] for c in complete(task, model, tokenizer, prompts, max_new_tokens,
                                          batch_size)]
    rewards = task.reward(prompts, completions)
    if out_dir:
        checkpoint.append_lines(Path(out_dir) / "samples.jsonl", [
            json.dumps({"step": step, "index": p.index, "prompt": p.text, "completion": c,
                        "answer": extract_answer(c), "gold": p.answer, "reward": r}) + "\n"
            for p, c, r in list(zip(prompts, completions, rewards))[:n_shown]])
    metrics = {"eval/accuracy": sum(rewards) / max(len(rewards), 1), "eval/n": len(rewards)}
    if sampled:
        samples = complete(task, model, tokenizer, prompts, max_new_tokens,
                           max(1, batch_size // sampled), sampled, temperature, greedy=False)
        repeated = [p for p in prompts for _ in range(sampled)]
        rewards = task.reward(repeated, [c for per_prompt in samples for c in per_prompt])
        metrics["eval/sampled_accuracy"] = sum(rewards) / max(len(rewards), 1)
    return metrics


# SmolLM2-135M ignores "end with '#### <number>'" but follows this, and often ends with it anyway.
CHAT_INSTRUCTION = "Solve this math problem step by step. End your response with 'The answer is <number>.'"
PLAIN_TEMPLATE = "[MATH TASK] Problem:\n{question}\n\nSolution:\n"


class AnswerTask(Task):
    """A task whose examples are (question, gold answer) pairs and whose reward is exactness.

    Subclasses implement `examples(split)` -> list of (question, gold answer string).
    """
    Settings = PromptSettings
    defaults = dict(Task.defaults, eval_samples=0, max_prompt_len=512)
    instruction = CHAT_INSTRUCTION          # appended to the question in chat-style prompts

    def __init__(self, cfg):
        super().__init__(cfg)
        self._prompts = {}        # split -> prompts, built once per process
        self.skipped = {}         # split -> prompts dropped for being longer than max_prompt_len

    def examples(self, split):
        raise NotImplementedError

    def prompt_style(self, tokenizer):
        """`chat` for models with a chat template (instruct models), `plain` otherwise."""
        style = self.cfg.prompt_style
        if style == "auto":
            return "chat" if tokenizer.chat_template else "plain"
        if style not in ("chat", "plain"):
            raise ValueError(f"--prompt-style must be auto, chat or plain (got {style!r})")
        if style == "chat" and not tokenizer.chat_template:
            raise ValueError("--prompt-style chat needs a tokenizer with a chat template; "
                             "use --prompt-style plain")
        return style

    def format(self, question, tokenizer, style):
        if style == "plain":
            return PLAIN_TEMPLATE.format(question=question)
        messages = [{"role": "user", "content": f"{question}\n\n{self.instruction}"}]
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

    def prompts(self, split, tokenizer):
        """Formatted, tokenised prompts; those longer than --max-prompt-len are skipped and
        counted (the replay buffer and the batches are sized by the longest prompt)."""
        if split not in self._prompts:
            style = self.prompt_style(tokenizer)
            examples = self.examples(split)
            texts = [self.format(q, tokenizer, style) for q, _ in examples]
            # The chat template already writes the special tokens; plain text gets the usual BOS.
            ids = tokenizer(texts, add_special_tokens=style == "plain")["input_ids"]
            self._prompts[split] = [Prompt(text=t, ids=i, index=n, answer=a)
                                    for n, (t, i, (_, a)) in enumerate(zip(texts, ids, examples))
                                    if len(i) <= self.cfg.max_prompt_len]
            self.skipped[split] = len(examples) - len(self._prompts[split])
            if self.skipped[split]:
                print(f"{self.name}: skipped {self.skipped[split]} of {len(examples)} {split} "
                      f"prompts longer than --max-prompt-len {self.cfg.max_prompt_len} tokens")
            if not self._prompts[split]:
                raise ValueError(f"every {split} prompt is longer than --max-prompt-len "
                                 f"{self.cfg.max_prompt_len} tokens: raise it")
        return self._prompts[split]

    def reward(self, prompts, completions):
        return [float(answers_match(extract_answer(c), p.answer))
                for p, c in zip(prompts, completions)]

    def evaluate(self, model, tokenizer, ref_model, step=None):
        """Greedy pass@1 on the first --eval-n test prompts (0: all), and the sampled accuracy
        with --eval-samples."""
        test = self.prompts("test", tokenizer)
        test = test[:self.cfg.eval_n] if self.cfg.eval_n else test
        return evaluate_answers(self, model, tokenizer, test, self.cfg.max_new_tokens,
                                self.cfg.eval_batch_size, out_dir=self.cfg.out or None, step=step,
                                sampled=self.cfg.eval_samples, temperature=self.cfg.temperature)
