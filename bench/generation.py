"""Generation: a searcher's sampling path against bare HF `generate`, same model, batch, settings.

    python bench/generation.py [--model PATH_OR_ID] [--prompts 4] [--group-size 4] [--max-new-tokens 64]

Both sample K completions for each of the first GSM8K test questions (chat template), at
temperature 1 with top-k/top-p off, from the same seed, so they generate the same tokens.
`sampling.generate` is what a searcher calls to sample. Goal: >= 0.9x bare generate.
Prints one `name value unit` line per figure, then a markdown table.
"""
import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from transformers import GenerationConfig

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from llm import sampling  # noqa: E402
from llm import models  # noqa: E402


def timed(fns, repeats):
    """Median seconds and tokens generated of each function, run in turn (A, B, A, B, ...) so
    that a load on the machine that comes and goes weighs on both alike. Same seed every run."""
    seconds = [[] for _ in fns]
    tokens = [0 for _ in fns]
    for _ in range(repeats):
        for i, fn in enumerate(fns):
            torch.manual_seed(0)
            start = time.perf_counter()
            tokens[i] = fn()
            seconds[i].append(time.perf_counter() - start)
    return [(statistics.median(s), t) for s, t in zip(seconds, tokens)]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=models.DEFAULT_MODEL)
    parser.add_argument("--data", default=str(ROOT.parent / "shared/data/gsm8k/test.jsonl"))
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: all cores)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    model, tokenizer = models.load_model(args.model)
    questions = [json.loads(line)["question"] for line in open(args.data)][:args.prompts]
    prompt_ids = [tokenizer.apply_chat_template([{"role": "user", "content": q}],
                                                add_generation_prompt=True, tokenize=True,
                                                return_dict=True)["input_ids"] for q in questions]
    k, n = args.group_size, args.max_new_tokens

    def ours():
        _, _, _, response_len = sampling.generate(model, tokenizer, prompt_ids, num_samples=k,
                                                  max_new_tokens=n, temperature=1.0)
        return int(response_len.sum())

    def bare():
        ids, mask = sampling.left_pad(prompt_ids, tokenizer.pad_token_id)
        config = GenerationConfig(max_new_tokens=n, do_sample=True, temperature=1.0, top_k=0,
                                  top_p=1.0, num_return_sequences=k,
                                  pad_token_id=tokenizer.pad_token_id,
                                  eos_token_id=tokenizer.eos_token_id)
        out = model.generate(input_ids=ids, attention_mask=mask, generation_config=config)
        response = out[:, ids.shape[1]:]
        is_eos = response == tokenizer.eos_token_id
        return int(torch.where(is_eos.any(-1), is_eos.float().argmax(-1) + 1,
                               response.shape[1]).sum())

    (bare_s, bare_tokens), (ours_s, ours_tokens) = timed([bare, ours], args.repeats)
    figures = {"bare_generate_tokens_per_s": bare_tokens / bare_s,
               "searcher_generate_tokens_per_s": ours_tokens / ours_s}
    figures["searcher_over_bare"] = (figures["searcher_generate_tokens_per_s"]
                                     / figures["bare_generate_tokens_per_s"])
    units = {"searcher_over_bare": "x"}
    for name, value in figures.items():
        print(f"{name} {value:.3f} {units.get(name, 'tokens/s')}")
    print(f"\n| figure (batch {args.prompts}x{k}, {n} new tokens, {torch.get_num_threads()} threads) "
          "| value | goal |\n| --- | --- | --- |")
    for name, value in figures.items():
        goal = (">= 0.9x " + ("(met)" if value >= 0.9 else "(missed)")) if name.endswith("bare") else ""
        print(f"| {name} | {value:.1f} {units.get(name, 'tokens/s')} | {goal} |")


if __name__ == "__main__":
    main()
