"""GSM8K: grade-school math word problems, rewarded 1 for the right final number.

The paper's main task. 7,473 training and 1,319 test problems, each with a worked solution that
ends in "#### <answer>". The data comes from a local folder holding `train.jsonl` and
`test.jsonl` in that original format (--data-dir; by default the repository's sibling folder
../shared/data/gsm8k when it exists), else from the Hugging Face hub (`openai/gsm8k`) through
the `datasets` package.
"""
import functools
import importlib.util
import json
from pathlib import Path

from llm import models
from dataclasses import dataclass

from tasks import PromptSettings, data_dir_flag
from tasks.answers import AnswerTask, extract_answer

LOCAL_DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "gsm8k"
HUB_ID, HUB_CONFIG = "openai/gsm8k", "main"
HOW_TO_GET = ("pass --data-dir FOLDER holding train.jsonl and test.jsonl from "
              "https://github.com/openai/grade-school-math (grade_school_math/data), "
              "or `pip install datasets` on a machine that reaches the Hugging Face hub")


def read_jsonl(path):
    """[(question, solution)] from a GSM8K jsonl file; a bad line is named by file and number."""
    pairs = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path} line {number} is not valid JSON ({e.msg}): fix or remove "
                             "it") from None
        if not (isinstance(row, dict) and isinstance(row.get("question"), str)
                and isinstance(row.get("answer"), str)):
            raise ValueError(f"{path} line {number} lacks the text fields \"question\" and "
                             "\"answer\" of a GSM8K row: fix or remove it")
        pairs.append((row["question"], row["answer"]))
    return pairs


@functools.cache
def load_gsm8k(data_dir=""):
    """{"train": [(question, solution), ...], "test": [...]}, from a folder or the hub.

    Cached, so the trainer's evaluations and the searchers' prompts read the files once per
    process.
    """
    folder = Path(data_dir).expanduser() if data_dir else LOCAL_DATA
    if data_dir or folder.is_dir():
        files = {split: folder / f"{split}.jsonl" for split in ("train", "test")}
        missing = [str(f) for f in files.values() if not f.is_file()]
        if missing:
            raise ValueError(f"GSM8K data not found ({', '.join(missing)} missing): {HOW_TO_GET}")
        return {split: read_jsonl(f) for split, f in files.items()}
    # The hub: only tried when it answers at once, so an offline machine fails in seconds.
    if importlib.util.find_spec("datasets") is None or not models._hub_reachable():
        raise ValueError(f"GSM8K data not found locally and the hub is not usable: {HOW_TO_GET}")
    import datasets
    data = datasets.load_dataset(HUB_ID, HUB_CONFIG)
    return {split: list(zip(data[split]["question"], data[split]["answer"]))
            for split in ("train", "test")}


@dataclass
class Gsm8kSettings(PromptSettings):
    """gsm8k: where its data is."""
    data_dir: str = data_dir_flag()


class Gsm8kTask(AnswerTask):
    name = "gsm8k"
    Settings = Gsm8kSettings
    # For SmolLM2-135M on a CPU, where a step of 4 prompts × 8 completions × up to 256 tokens
    # takes minutes; 256 tokens hold most of its solutions. SmolLM2 solves ~4% greedily and
    # fewer when sampling at temperature 1, so 0.7 (as for arith) gives more groups with a
    # success to learn from, and β stays at 0.05, the value that worked on arith.
    # micro_groups=1 and activation_checkpointing: one group (8 × ~450 tokens) per backward
    # pass, keeping only each layer's input, takes 2.3 GB above the trainer's state for 1.2×
    # the step time (5.8 GB without checkpointing; `python bench/memory.py step`).
    # eval_n: greedy evaluation of all 1,319 test questions takes over half an hour on a CPU,
    # so the default is the first 128 (±2 points); pass --eval-n 0 on a GPU.
    # The paper's recipe for a 4-GPU machine and a GSM8K-tuned 1B model: K=20, 7 prompts per
    # step, 512 new tokens, β 0.014 → 0.004 over 500 steps, lr 1e-5, m=0.95, k=2.
    defaults = dict(AnswerTask.defaults, steps=500, temperature=0.7, decay_steps=50, eval_n=128,
                    min_buffer=4, micro_groups=1, activation_checkpointing=True)

    def examples(self, split):
        """(question, gold answer) pairs: the gold answer is the number after the solution's ####."""
        return [(q, extract_answer(solution))
                for q, solution in load_gsm8k(self.cfg.data_dir)[split]]

