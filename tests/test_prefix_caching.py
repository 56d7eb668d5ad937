"""Prefix caching end to end on the real SmolLM2 (CPU, float32): requests that share a
500-token prefix produce the same greedy tokens with caching on and off, and with
it on they start from cached blocks."""

from __future__ import annotations

from shared.sampling import SamplingParams
from worker.llm import LLM

QUESTIONS = ["What is the capital of France?", "Name a prime number.", "Summarise the text above."]
PREFIX_LEN = 500  # 31 full blocks of 16 tokens, and 4 tokens of a 32nd
NUM_OUTPUT = 16  # compared per prompt: ignore_eos, so an early EOS cannot shorten the comparison


def _prompts(llm: LLM) -> list[list[int]]:
    assert llm.tokenizer is not None
    text = " ".join(f"Fact {i}: the river number {i} flows past the town of Ashford {i % 7}." for i in range(60))
    prefix = llm.encode(text)[:PREFIX_LEN]
    assert len(prefix) == PREFIX_LEN
    return [prefix + llm.encode(" " + q) for q in QUESTIONS]


def _run(enable: bool) -> tuple[list[list[int]], list[int]]:
    llm = LLM(dtype="float32", device="cpu", enable_prefix_caching=enable)
    prompts = _prompts(llm)
    params = SamplingParams(max_tokens=NUM_OUTPUT, temperature=0.0, ignore_eos=True)
    first = llm.generate(prompts[:1], params)  # fills the cache with the prefix's blocks
    rest = llm.generate(prompts[1:], params)
    outs = first + rest
    return [o.token_ids for o in outs], [o.num_cached_tokens for o in rest]


def test_prefix_caching_same_tokens() -> None:
    on_tokens, on_cached = _run(True)
    off_tokens, off_cached = _run(False)
    assert all(len(t) == NUM_OUTPUT for t in on_tokens)
    assert on_tokens == off_tokens
    assert all(n >= PREFIX_LEN // 16 * 16 for n in on_cached), on_cached  # the prefix's full blocks
    assert off_cached == [0, 0]


def test_siblings_added_together_prefill_their_prompt_once(offline, monkeypatch) -> None:
    """In-batch prefix caching (docs/architecture.md, "Block manager and prefix caching"):
    4 requests with one 100-token prompt, added together (the gateway's fan-out of
    ``n = 4``), compute its 6 full blocks once; their greedy tokens are those of the
    prompt run alone."""
    text = " ".join(f"Sibling {i} reads line {i * 3} of the ledger in Brackley." for i in range(40))
    prompt = offline.encode(text)[:100]
    assert len(prompt) == 100
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    scheduler = offline.engine.scheduler
    scheduler.block_manager.reset_prefix_cache()  # nothing cached from earlier tests
    schedule = scheduler.schedule
    num_prompt_tokens_computed = [0]

    def counting_schedule():  # prompt tokens each step computes, before it runs
        out = schedule()
        for item in out.scheduled:
            r = item.request
            num_prompt_tokens_computed[0] += max(0, min(item.num_tokens, r.num_prompt_tokens - r.num_computed_tokens))
        return out

    monkeypatch.setattr(scheduler, "schedule", counting_schedule)
    siblings = offline.generate([prompt] * 4, params)
    assert num_prompt_tokens_computed[0] == 100 + 3 * 4  # the prompt once, then each one's 4-token tail
    assert sorted(o.num_cached_tokens for o in siblings) == [0, 96, 96, 96]
    scheduler.block_manager.reset_prefix_cache()
    (alone,) = offline.generate([prompt], params)
    assert alone.num_cached_tokens == 0
    assert all(o.token_ids == alone.token_ids for o in siblings)


def test_a_step_hashes_the_blocks_it_fills_before_it_waits_for_its_tokens(offline, monkeypatch) -> None:
    """The full blocks a step's input tokens fill are hashed while the step runs
    (``Scheduler.hash_ahead``, which ``ModelRunner.execute`` calls before it waits for the
    sampled ids), so ``update`` finds every hash it registers already made."""
    scheduler = offline.engine.scheduler
    scheduler.block_manager.reset_prefix_cache()
    block_size = scheduler.block_manager.block_size
    update = scheduler.update
    seen: list[tuple[int, int]] = []

    def spying_update(out, sampled):  # hashes made vs full blocks, as update starts
        seen.extend((len(item.request.block_hashes), (item.request.num_computed_tokens + item.num_tokens) // block_size)
                    for item in out.scheduled)
        return update(out, sampled)

    monkeypatch.setattr(scheduler, "update", spying_update)
    prompt = [1000 + 7 * i for i in range(5 * block_size + 3)]
    offline.generate([prompt], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
    assert seen and seen[0] == (5, 5), seen
    assert all(made == full for made, full in seen), seen


def test_a_continued_prompt_reads_its_own_blocks_not_anothers_with_the_same_tokens(offline) -> None:
    """Chained block hashes (shared/block_hashes.py) on the real model: prompts a and b
    differ in their first block and share their second block's tokens; c continues b. c
    starts from b's two cached blocks (not a's second block, whose KV was computed after
    other tokens) and its greedy tokens are those of c run with nothing cached. Fails if
    a block's hash ignores its parent's."""
    block_size = offline.engine.scheduler.block_manager.block_size
    common = offline.encode(" Then the ferry left the harbour at dawn and crossed the grey water towards the "
                            "islands in the north")[:block_size]
    head_a = offline.encode("Recipe notes: boil the pasta in salted water for nine minutes, then drain it and "
                            "add the sauce")[:block_size]
    head_b = offline.encode("Ship log, day twelve: the wind turned north before the storm and the crew took "
                            "down the sails")[:block_size]
    assert len(common) == len(head_a) == len(head_b) == block_size
    question = offline.encode(" Where did it go next?")
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    offline.engine.scheduler.block_manager.reset_prefix_cache()
    offline.engine.take_kv_events()  # KV events from here on
    offline.generate([head_a + common + question, head_b + common + question],
                     SamplingParams(max_tokens=1, temperature=0.0))
    assert len(offline.engine.take_kv_events().stored) == 4  # two blocks each: none shared
    c = head_b + common + offline.encode(" Why did the ferry leave so early?")
    (cached,) = offline.generate([c], params)
    offline.engine.scheduler.block_manager.reset_prefix_cache()
    (fresh,) = offline.generate([c], params)
    assert cached.num_cached_tokens == 2 * block_size and fresh.num_cached_tokens == 0
    assert cached.token_ids == fresh.token_ids
