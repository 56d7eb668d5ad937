"""The oracle for model families: a tiny random model built by transformers' own class,
saved as a Hugging Face folder, run greedily by transformers and by our engine; the
tests compare the per-step logits and the tokens (``tests/test_model_families.py``).

Our per-step logits are those the engine samples from: ``compute_logits`` of the real
engine (scheduler, block manager, paged cache, the chosen attention backend) is wrapped
to record its output. Transformers' logits of step i are those of a forward pass over
the prompt and its first i greedy tokens, which its causal (and sliding-window) masks
make equal to its cached decode; a greedy token is the argmax of its step's logits.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from shared.sampling import SamplingParams
from worker.llm import LLM


@dataclass(slots=True)
class Greedy:
    """A greedy run: ``token_ids`` (``num_new``) and the logits each was picked from,
    ``[num_new, vocab_size]`` float32."""

    token_ids: list[int]
    logits: torch.Tensor


def save_random_model(model_cls: Any, config: Any, folder: Path, seed: int = 0) -> Any:
    """Build ``model_cls(config)`` (float32, eval) with transformers' random init, move
    every norm weight off its initial value (so a norm's ``weight`` vs ``1 + weight`` shows),
    save it to ``folder`` as safetensors and return it."""
    torch.manual_seed(seed)
    model = model_cls(config).float().eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(0.2 * torch.randn_like(param))
    model.save_pretrained(str(folder))
    return model


@torch.inference_mode()
def hf_greedy(model: Any, prompt: list[int], num_new: int) -> Greedy:
    """Transformers' greedy run (EOS ignored): tokens and per-step logits, one forward
    pass per token over the whole sequence so far (no KV cache to get wrong)."""
    ids, rows = list(prompt), []
    for _ in range(num_new):
        rows.append(model(torch.tensor([ids])).logits[0, -1].float())
        ids.append(int(rows[-1].argmax()))
    return Greedy(ids[len(prompt):], torch.stack(rows))


def engine_greedy(folder: Path, prompt: list[int], num_new: int, backend: str, max_model_len: int,
                  device: str = "cpu", dtype: str = "float32", **settings: Any) -> Greedy:
    """Our engine's greedy tokens and the logits it sampled them from (``logits`` empty
    where CUDA graphs ran the steps: their replays call no Python).

    Raises:
        ValueError: the engine refuses the model (e.g. a sliding window it cannot run).
    """
    llm = LLM(model=str(folder), dtype=dtype, device=device, attention_backend=backend,
              max_model_len=max_model_len, num_kv_blocks=2 * max_model_len // 16 + 2, block_size=16,
              enable_prefix_caching=False, **settings)
    model = llm.engine.runner.model
    recorded: list[torch.Tensor] = []
    compute_logits = model.compute_logits

    def recording(hidden: torch.Tensor) -> torch.Tensor:
        logits = compute_logits(hidden)
        recorded.append(logits.clone())
        return logits

    model.compute_logits = recording
    (out,) = llm.generate([prompt], SamplingParams(max_tokens=num_new, temperature=0.0, ignore_eos=True))
    assert all(r.shape[0] == 1 for r in recorded), "one sequence: one sampled row per step"
    return Greedy(out.token_ids, torch.cat(recorded).cpu() if recorded else torch.empty(0))


def assert_same_greedy(ours: Greedy, ref: Greedy, atol: float = 1e-4) -> None:
    """Tokens identical and every step's logits within ``atol`` (reported per step)."""
    assert ours.logits.shape == ref.logits.shape, (ours.logits.shape, ref.logits.shape)
    diff = (ours.logits - ref.logits).abs().amax(dim=-1)
    worst = int(diff.argmax())
    assert float(diff.max()) <= atol, f"step {worst}: max |logit diff| {float(diff.max()):.3g} > {atol}"
    assert ours.token_ids == ref.token_ids
