"""Our engine against Hugging Face transformers ``generate`` on the real SmolLM2 weights
(float32, CPU): greedy outputs must be equal token for token, run singly, all in one
batch, and with a block pool so small that preemption and chunked prefill happen.

Both sides ignore EOS, so every prompt compares ``NEW_TOKENS`` tokens (a prompt whose
answer is short would otherwise compare next to nothing); stopping on EOS is compared
once, on the prompt whose answer has one."""

from __future__ import annotations

import pytest
import torch

from shared.sampling import SamplingParams
from worker.llm import LLM

pytestmark = pytest.mark.slow

NEW_TOKENS = 32
TEXTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
    "List three colors:",
    " ".join(["The history of the Roman Empire spans many centuries and includes"] * 12),
    " ".join(f"Item {i}: a short description of thing number {i}." for i in range(30)),
]


@pytest.fixture(scope="module")
def prompts(smollm_tokenizer) -> list[list[int]]:
    chat = smollm_tokenizer.apply_chat_template([{"role": "user", "content": "What is 2 + 2?"}],
                                                add_generation_prompt=True, tokenize=True)
    ids = [list(smollm_tokenizer.encode(t)) for t in TEXTS[:-1]] + [list(chat["input_ids"])]
    ids[-1:-1] = [list(smollm_tokenizer.encode(TEXTS[-1]))]
    lengths = sorted(len(p) for p in ids)
    assert len(ids) >= 6 and lengths[0] < 10 and lengths[-1] > 200, lengths
    return ids


@pytest.fixture(scope="module")
def hf_outputs(smollm_source, prompts) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(smollm_source.path), dtype=torch.float32).eval()
    outs = []
    with torch.inference_mode():
        for p in prompts:
            ids = torch.tensor([p])
            # eos_token_id=None: go on past EOS, as ignore_eos does. The explicit mask keeps
            # generate from inferring one from the pad id (2, <|im_end|>, inside chat prompts).
            g = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS, do_sample=False,
                               eos_token_id=None)[0, len(p):].tolist()
            assert len(g) == NEW_TOKENS
            outs.append(g)
    return outs


GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
GREEDY_STOP = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0)  # ends on EOS


def test_single_requests_equal_hf(prompts, hf_outputs, offline, smollm_source) -> None:
    from shared.model_source import eos_token_ids

    llm = offline
    for p, expected in zip(prompts, hf_outputs, strict=True):
        (out,) = llm.generate([p], GREEDY)
        assert out.token_ids == expected and out.finish_reason == "length"
    # Without ignore_eos the request ends on HF's first EOS, which it keeps.
    eos = eos_token_ids(smollm_source.config)
    num_stopped = 0
    for p, expected in zip(prompts, hf_outputs, strict=True):
        first_eos = next((k for k, t in enumerate(expected) if t in eos), None)
        if first_eos is not None:
            (out,) = llm.generate([p], GREEDY_STOP)
            assert out.token_ids == expected[:first_eos + 1] and out.finish_reason == "stop"
            num_stopped += 1
    assert num_stopped >= 1, "no prompt's greedy answer has an EOS within NEW_TOKENS"
    assert llm.engine.stats().kv_usage == 0.0


def test_one_batch_equals_hf(prompts, hf_outputs) -> None:
    llm = LLM(max_num_seqs=16, enable_prefix_caching=False)
    outs = llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == hf_outputs
    assert llm.engine.stats().kv_usage == 0.0


def test_preemption_and_chunked_prefill_equal_hf(prompts, hf_outputs) -> None:
    longest = max(len(p) for p in prompts) + NEW_TOKENS
    # Room for the longest sequence plus a little: the batch must preempt to finish.
    llm = LLM(block_size=16, num_kv_blocks=longest // 16 + 4, max_num_batched_tokens=64,
              enable_prefix_caching=False)
    outs = llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == hf_outputs
    assert llm.engine.scheduler.num_preemptions > 0
    assert llm.engine.stats().kv_usage == 0.0


def test_an_itl_target_keeps_the_tokens_and_learns_the_step_cost(prompts, hf_outputs) -> None:
    """``itl_target_ms`` changes only how prompts are chunked beside decodes: the tokens
    stay Hugging Face's. The engine feeds its step cost model every step while busy."""
    from worker.engine.step_cost import MIN_OBSERVATIONS

    llm = LLM(block_size=16, max_num_batched_tokens=64, itl_target_ms=0.001)
    outs = llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == hf_outputs
    assert llm.engine.step_cost.num_observations >= MIN_OBSERVATIONS
    assert llm.engine.scheduler.itl_target_s == pytest.approx(1e-6)


def test_chat_answer_names_paris(smollm_tokenizer, offline) -> None:
    llm = offline
    chat = smollm_tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                                add_generation_prompt=True, tokenize=True)
    (out,) = llm.generate([list(chat["input_ids"])], GREEDY_STOP)
    assert "Paris" in out.text and out.finish_reason == "stop"
