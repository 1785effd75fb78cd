"""No attention query row with every key masked, in the trainer's passes and in sampling's
prefill. A CPU returns 0 for such a row; cuDNN's SDPA backward on a GPU returns NaN there
(pytorch/pytorch#196678), and every arith run on an H200 stopped on a NaN gradient. The CPU
cannot show the NaN, so these tests check its cause: the masks that reach attention."""
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from llm import sampling
from llm.logprobs import group_logprobs, prompt_attention_mask
from trainer import sequence_logprobs
from test_trainer import random_batch


def tiny_llama(implementation="sdpa"):
    config = LlamaConfig(vocab_size=24, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         attn_implementation=implementation, eos_token_id=1, pad_token_id=1)
    torch.manual_seed(0)
    return LlamaForCausalLM(config).eval()


class Tokenizer:
    """What `sampling.generate` reads of a tokenizer."""
    pad_token_id = eos_token_id = 1


@pytest.fixture
def masks_seen(monkeypatch):
    """Every (attn_mask, is_causal) that reaches torch's scaled_dot_product_attention."""
    seen, sdpa = [], torch.nn.functional.scaled_dot_product_attention

    def spy(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, **kwargs):
        seen.append((None if attn_mask is None else attn_mask.detach().clone(), is_causal))
        return sdpa(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p,
                    is_causal=is_causal, **kwargs)
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    return seen


def empty_rows(mask):
    """How many query rows of a [B, 1, Q, K] mask see no key (bool: False; float: -inf or the
    dtype's lowest, added before the softmax)."""
    sees = mask if mask.dtype == torch.bool else mask > torch.finfo(mask.dtype).min / 2
    return int((~sees.any(-1)).sum())


def test_the_trainers_passes_leave_no_query_row_without_a_key(masks_seen):
    """Prompts of 5, 2 and 4 tokens, left-padded together: the prompt pass has 3 + 1 pad rows,
    each attending to itself, and the completion pass none; the log-probs are the plain ones."""
    model = tiny_llama()
    batch = random_batch(24)
    logp = group_logprobs(model, batch, temperature=0.8)
    assert masks_seen and all(mask is not None for mask, _ in masks_seen)    # padded: explicit
    assert [empty_rows(mask) for mask, _ in masks_seen] == [0] * len(masks_seen)
    torch.testing.assert_close(logp, sequence_logprobs(model, batch, 0.8), rtol=1e-5, atol=1e-5)


def test_a_pass_without_padding_keeps_the_plain_causal_path(masks_seen):
    """Prompts of one length: the prompt pass gets no mask at all (torch's is_causal)."""
    group_logprobs(tiny_llama(), random_batch(24, prompt_lengths=(4, 4, 4)))
    prompt_pass = masks_seen[: len(masks_seen) // 2]           # one call a layer, prompts first
    assert all(mask is None and causal for mask, causal in prompt_pass)


@pytest.mark.parametrize("cache", [sampling.PREFIX, sampling.STATIC])
@pytest.mark.parametrize("num_samples", [1, 3])
def test_samplings_prefill_leaves_no_query_row_without_a_key(masks_seen, cache, num_samples):
    """Greedy evaluation (one sample) and a searcher's groups, with the CPU's cache and the
    GPU's static one (prompts padded to 64): no empty row in the prefill or after it."""
    model = tiny_llama()
    sampling.generate(model, Tokenizer(), [[2, 3, 4, 5, 6], [7, 8], [9, 10, 11]],
                      num_samples=num_samples, max_new_tokens=4, temperature=0.9, cache=cache)
    masks = [mask for mask, _ in masks_seen if mask is not None]
    assert masks and [empty_rows(mask) for mask in masks] == [0] * len(masks)


def test_eager_attention_gets_the_same_mask_as_additive_numbers():
    """The eager implementation adds its mask to the scores: 0 where a key is seen, the lowest
    float elsewhere; the real tokens' log-probs equal sdpa's."""
    batch = random_batch(24)
    eager, sdpa = tiny_llama("eager"), tiny_llama("sdpa")
    mask = prompt_attention_mask(eager, batch.prompt_mask, padded=True)              # [3, 1, 5, 5]
    assert mask.dtype == torch.float32 and empty_rows(mask) == 0
    assert set(mask.unique().tolist()) == {0.0, torch.finfo(torch.float32).min}
    torch.testing.assert_close(group_logprobs(eager, batch), group_logprobs(sdpa, batch),
                               rtol=1e-5, atol=1e-5)


def test_a_pad_row_attends_to_itself_and_a_real_row_as_before():
    """The mask by hand for prompts of 3 and 1 tokens in 3 columns."""
    prompt_mask = torch.tensor([[1, 1, 1], [0, 0, 1]])
    mask = prompt_attention_mask(tiny_llama(), prompt_mask, padded=True)[:, 0]         # [2, 3, 3]
    assert mask.tolist() == [[[True, False, False], [True, True, False], [True, True, True]],
                             [[True, False, False], [False, True, False], [False, False, True]]]
