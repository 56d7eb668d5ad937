"""Token sampling on the model's device: greedy, temperature, top-k, top-p, min-p,
per-request seeds, and repetition/presence/frequency penalties.

One step samples every row in a few batched tensor ops; the only host work is one
copy of the sampled ids. Sampling draws ``argmax(p / E)`` with ``E ~ Exp(1)`` per
token, which picks token ``i`` with probability ``p_i`` (the exponential race / Gumbel
trick) and lets a seeded request draw its own noise row from its own generator.

Sources: top-p from Holtzman et al., "The Curious Case of Neural Text Degeneration"
(2020); min-p from Nguyen et al. (2024); repetition penalty from Keskar et al., CTRL
(2019), applied as in HF transformers; presence/frequency penalties as in the OpenAI API.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from shared.sampling import SamplingParams


class Sampler:
    """Samples one token per row of a logits matrix; keeps seeded generators per request."""

    def __init__(self, device: torch.device, seed: int = 0) -> None:
        self.device = device
        self._generator = torch.Generator(device=device).manual_seed(seed)
        self._seeded: dict[str, torch.Generator] = {}

    def free(self, request_id: str) -> None:
        """Drop a finished request's generator."""
        self._seeded.pop(request_id, None)

    def __call__(self, logits: torch.Tensor, request_ids: Sequence[str], params: Sequence[SamplingParams],
                 token_ids: Sequence[Sequence[int]], num_prompt_tokens: Sequence[int]) -> list[int]:
        """``sample`` and fetch the ids to the host (the step's one synchronisation)."""
        return self.sample(logits, request_ids, params, token_ids, num_prompt_tokens).tolist()

    def sample(self, logits: torch.Tensor, request_ids: Sequence[str], params: Sequence[SamplingParams],
               token_ids: Sequence[Sequence[int]], num_prompt_tokens: Sequence[int]) -> torch.Tensor:
        """Sample the next token of each row, on the logits' device, without synchronising.

        Args:
            logits: ``[n, vocab_size]`` float32, modified in place.
            request_ids, params: per row.
            token_ids: per row, prompt + output so far (for penalties).
            num_prompt_tokens: per row, how many of ``token_ids`` are prompt.

        Returns:
            ``[n]`` int64 token ids on the logits' device.
        """
        if any(p.needs_penalties for p in params):
            self._apply_penalties(logits, params, token_ids, num_prompt_tokens)
        if all(p.greedy for p in params):
            return logits.argmax(dim=-1)

        n = logits.shape[0]
        dev = logits.device
        greedy = torch.tensor([p.greedy for p in params], device=dev)
        temps = torch.tensor([p.temperature if not p.greedy else 1.0 for p in params], device=dev)
        argmax = logits.argmax(dim=-1)
        logits.div_(temps.unsqueeze(1))
        if any(p.top_k > 0 for p in params) or any(p.top_p < 1.0 for p in params):
            self._top_k_top_p(logits, params)
        probs = torch.softmax(logits, dim=-1)
        if any(p.min_p > 0.0 for p in params):
            min_p = torch.tensor([p.min_p for p in params], device=dev)
            probs.masked_fill_(probs < min_p.unsqueeze(1) * probs.amax(dim=-1, keepdim=True), 0.0)
        noise = _exponential(probs.shape, self._generator, dev)
        for row, (rid, p) in enumerate(zip(request_ids, params)):
            if p.seed is not None and not p.greedy:
                gen = self._seeded.get(rid)
                if gen is None:
                    gen = self._seeded[rid] = torch.Generator(device=dev).manual_seed(p.seed)
                noise[row] = _exponential(probs.shape[1:], gen, dev)
        sampled = (probs / noise).argmax(dim=-1)
        out = torch.where(greedy, argmax, sampled)
        assert out.shape == (n,)
        return out

    @staticmethod
    def _top_k_top_p(logits: torch.Tensor, params: Sequence[SamplingParams]) -> None:
        """Mask (to -inf) tokens outside each row's top-k and top-p nucleus."""
        dev, vocab = logits.device, logits.shape[1]
        top_k = torch.tensor([p.top_k if p.top_k > 0 else vocab for p in params], device=dev)
        top_p = torch.tensor([p.top_p for p in params], device=dev)
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        ranks = torch.arange(vocab, device=dev).unsqueeze(0)
        drop = ranks >= top_k.unsqueeze(1)
        sorted_logits.masked_fill_(drop, float("-inf"))
        probs = sorted_logits.softmax(dim=-1)
        # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
        before = probs.cumsum(dim=-1) - probs
        sorted_logits.masked_fill_(before >= top_p.unsqueeze(1), float("-inf"))
        logits.scatter_(1, order, sorted_logits)

    def _apply_penalties(self, logits: torch.Tensor, params: Sequence[SamplingParams],
                         token_ids: Sequence[Sequence[int]], num_prompt_tokens: Sequence[int]) -> None:
        dev, vocab = logits.device, logits.shape[1]
        for row, p in enumerate(params):
            if not p.needs_penalties:
                continue
            tokens = torch.tensor(token_ids[row], device=dev, dtype=torch.long)
            if p.repetition_penalty != 1.0 and tokens.numel():
                seen = torch.unique(tokens)
                vals = logits[row, seen]
                logits[row, seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
            out = tokens[num_prompt_tokens[row]:]
            if out.numel() and (p.presence_penalty or p.frequency_penalty):
                counts = torch.bincount(out, minlength=vocab).to(logits.dtype)
                logits[row] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(logits.dtype)


def _exponential(shape: torch.Size, generator: torch.Generator, device: torch.device) -> torch.Tensor:
    """``Exp(1)`` noise of ``shape``, float32, as ``-log(U)`` with ``U ~ Uniform[0, 1)``:
    on CPU 4x faster than ``Tensor.exponential_`` (16 x 49152 draws: 9 vs 40 ms). A draw
    of ``U = 0`` gives ``inf``, whose token then never wins the race."""
    return torch.rand(shape, generator=generator, device=device).log_().neg_()
