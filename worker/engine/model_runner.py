"""Turns a scheduled step into tensors, runs the model over the paged cache, samples.

How a batch changes form:
    scheduler: [(request, num_tokens), ...]                       (Python, CPU)
 -> packed by numpy into two pinned buffers (``mixed_graphs.StepInputs``): int64 ids |
    positions | slots | logits indices; int32 block tables | query_start_loc | seq_lens
 -> two host-to-device copies, views of them                      (tensors, model device)
 -> model forward over [num_tokens] -> hidden [num_tokens, H]
 -> prompt logprobs, for the chunks of requests that ask: the LM head over every prompt
    position of the chunk, not only its last, fetched to the host (``prompt_logprobs.py``)
 -> hidden[logits_indices] -> logits [num_sampled, V] float32
 -> grammar bitmask [num_structured, V / 32] int32, filled on the host (llguidance), one H2D copy
 -> sampler (mask applied first) -> ids (one D2H copy)
 -> raw logprobs of the rows that ask: log-softmax [m, V] taken before the sampler, one
    topk, copied to the host ahead of the ids (``sampler.RawLogprobs``)

On CUDA with the Triton backend and ``enforce_eager`` off, no step runs eagerly but one
that scores prompt logprobs: a step in which every sequence has one query token and
samples (a decode step) replays a decode graph (``cuda_graphs.py``), and any other step
(prefill chunks, alone or beside decode tokens) replays the mixed-step graph of its
token-count bucket (``mixed_graphs.py``; ``mixed_cuda_graphs`` off: eager). Every Triton
kernel is compiled and every graph captured here, at start-up, so nothing compiles while
requests wait. Nothing in a step waits on the device except the copy of the sampled ids
(and that of the prompt logprobs, in a step that scores them).

Grammar masks (``worker/structured/``) are filled on the host after the step's forward
pass and LM head are enqueued, so on CUDA they are computed while the device runs that
step; a step without a structured request builds none.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

import torch

from shared.protocol import TokenLogprobs
from shared.settings import EngineSettings
from worker.engine.cuda_graphs import DecodeGraphs
from worker.engine.mixed_graphs import MixedGraphs, StepInputs
from worker.engine.prompt_logprobs import compute_prompt_logprobs, prompt_spans
from worker.engine.request import Request
from worker.engine.sampler import RawLogprobs, Sampler
from worker.engine.scheduler import ScheduledRequest
from worker.models.attention import AttentionMetadata, select_backend
from worker.models.config import ModelConfig
from worker.models.llama import KVCache, LlamaForCausalLM
from worker.structured.bitmask import GrammarMasks

log = logging.getLogger(__name__)


def slot(block_table: Sequence[int], position: int, block_size: int) -> int:
    """The KV-cache slot of the token at ``position``: its block's id times
    ``block_size`` plus its offset in the block (``slot_mapping``'s entries)."""
    return block_table[position // block_size] * block_size + position % block_size


def decode_inputs(requests: Sequence[Request]) -> tuple[list[int], list[int]]:
    """``(positions, input_ids)`` of a decode step whose inputs are on the host: each
    request's first token without KV (``num_computed_tokens``)."""
    positions = [r.num_computed_tokens for r in requests]
    return positions, [r.token_ids[p] for r, p in zip(requests, positions)]


def allocate_kv_cache(cfg: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype,
                      device: torch.device) -> list[KVCache]:
    """Per layer ``(k_cache, v_cache)``, each ``[num_blocks, block_size, num_kv_heads, head_dim]``."""
    shape = (num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
    return [(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
            for _ in range(cfg.num_layers)]


class DecodeLaunch:
    """A decode step enqueued on the GPU: its sampled ids on the device, and a copy of
    them to pinned host memory that ``token_ids`` waits for."""

    def __init__(self, sampled: torch.Tensor) -> None:
        self.sampled = sampled  # [n] int64, device
        self._host = torch.empty(sampled.shape, dtype=sampled.dtype, pin_memory=True)
        self._host.copy_(sampled, non_blocking=True)
        self._ready = torch.cuda.Event()
        self._ready.record()

    def token_ids(self) -> list[int]:
        """The sampled ids; blocks until the step has run."""
        self._ready.synchronize()
        return self._host.tolist()


class ModelRunner:
    """Owns the model, the KV cache tensors, the CUDA graphs and the sampler."""

    def __init__(self, model: LlamaForCausalLM, settings: EngineSettings, num_blocks: int, max_model_len: int,
                 dtype: torch.dtype, device: torch.device, seed: int = 0) -> None:
        """``max_model_len``: the longest sequence, tokens (``shared.model_source.max_model_len``;
        the model's rotary table covers it), which sizes the graphs' block tables."""
        self.model = model
        self.cfg = model.config
        self.device = device
        self.dtype = dtype
        self.block_size = settings.block_size
        self.num_blocks = num_blocks
        self.kv_caches = allocate_kv_cache(self.cfg, num_blocks, self.block_size, dtype, device)
        self.backend = select_backend(settings.attention_backend, device)
        self.sampler = Sampler(device, seed)
        self.grammar_masks = GrammarMasks(self.cfg.vocab_size, device)
        self.max_model_len = max_model_len
        self.graphs: DecodeGraphs | None = None
        self.mixed: MixedGraphs | None = None
        self.num_eager_steps = 0  # steps run outside the graphs (all of them on CPU)
        self.capture_time_s = 0.0  # start-up: graph captures and warm-up, seconds
        self.graph_memory_bytes = 0  # device memory the graphs and warm-up kept
        if device.type == "cuda" and not settings.enforce_eager and self.backend.name == "triton":
            self._capture(settings)
        log.info("model runner: %d KV blocks of %d tokens, %s attention, %s on %s, decode graphs %s, "
                 "mixed-step graphs %s", num_blocks, self.block_size, self.backend.name, dtype, device,
                 self.graphs.buckets if self.graphs else "off", self.mixed.buckets if self.mixed else "off")

    def _capture(self, settings: EngineSettings) -> None:
        """Capture the mixed-step graphs (largest activations first) and the decode
        graphs into one memory pool, then warm the sampler up, and log the time and the
        memory the graphs took."""
        t0 = time.perf_counter()
        torch.cuda.empty_cache()  # so that free memory counts only what the graphs keep
        free_before = torch.cuda.mem_get_info(self.device)[0]
        max_blocks = -(-self.max_model_len // self.block_size)
        pool = torch.cuda.graph_pool_handle()
        if settings.mixed_cuda_graphs:
            self.mixed = MixedGraphs(self.model, self.kv_caches, self.backend, settings.max_num_seqs,
                                     settings.max_num_batched_tokens, max_blocks, self.max_model_len,
                                     self.block_size, self.device)
            self.mixed.capture(pool)
        self.graphs = DecodeGraphs(self.model, self.kv_caches, self.backend, settings.max_num_seqs, max_blocks,
                                   self.max_model_len, self.device)
        self.graphs.capture(pool)
        self.sampler.warm_up(settings.max_num_seqs, self.cfg.vocab_size)
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()  # the eager warm-up passes' blocks, cached for the side stream
        self.capture_time_s = time.perf_counter() - t0
        self.graph_memory_bytes = free_before - torch.cuda.mem_get_info(self.device)[0]
        log.info("CUDA graphs and warm-up: %.1f s, %.2f GiB of device memory", self.capture_time_s,
                 self.graph_memory_bytes / 2**30)

    def prepare(self, batch: Sequence[ScheduledRequest]
                ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor]:
        """Flatten a step into ``(input_ids, positions, metadata, logits_indices)``, in
        buffers sized exactly for it (the eager path)."""
        max_blocks = max(len(item.request.block_table) for item in batch)
        num_tokens = sum(item.num_tokens for item in batch)
        inputs = StepInputs(num_tokens, len(batch), max_blocks, self.block_size, self.device)
        shape = inputs.fill(batch)
        inputs.upload()
        return inputs.views(num_tokens, len(batch), shape.num_sampled, shape.max_query_len, shape.max_seq_len,
                            shape)

    def _decode_logits(self, requests: Sequence[Request], positions: Sequence[int],
                       input_ids: Sequence[int] | torch.Tensor) -> torch.Tensor:
        """Logits ``[n, vocab]`` of a decode step (one token per request) through the
        captured graphs, enqueued without waiting for the GPU.

        Args:
            requests: the sequences, each with a block table that already holds
                ``positions[i]``.
            positions: the position of each request's input token (tokens).
            input_ids: the input tokens, on the host, or ``[n]`` int64 on the device (the
                sampled ids of the step still in flight: async scheduling).
        """
        graphs = self.graphs
        assert graphs is not None and len(requests) <= graphs.max_batch_size
        bs = self.block_size
        on_device = isinstance(input_ids, torch.Tensor)
        host_ids = [0] * len(requests) if on_device else list(input_ids)  # type: ignore[arg-type]
        slots = [slot(r.block_table, p, bs) for r, p in zip(requests, positions)]
        lens = [p + 1 for p in positions]
        graphs.inputs.fill(host_ids, list(positions), slots, [r.block_table for r in requests], lens)
        graphs.inputs.upload()
        if on_device:  # stream-ordered after the upload and the step that sampled them
            graphs.inputs.dev64[:len(requests)].copy_(input_ids)  # type: ignore[arg-type]
        return graphs.run(len(requests), max(lens), upload=False)

    def _sample(self, logits: torch.Tensor, requests: Sequence[Request]) -> tuple[torch.Tensor, RawLogprobs | None]:
        """``Sampler.sample`` of one row of ``logits`` per request, under the grammar
        masks of the requests that have one: ``[n]`` int64 ids on the device, not
        synchronised, and the raw logprobs of the rows that ask (None: no row does).
        The masks follow each grammar's host state, so a request with a grammar must
        have had its previous token applied (no async step)."""
        params = [r.sampling for r in requests]
        raw = RawLogprobs(logits, params) if RawLogprobs.wanted(params) else None  # before sample edits logits
        mask = self.grammar_masks.mask([r.grammar for r in requests])
        ids = self.sampler.sample(logits, [r.request_id for r in requests], params,
                                  [r.token_ids for r in requests], [r.num_prompt_tokens for r in requests], mask)
        if raw is not None:
            raw.gather(ids)
        return ids, raw

    def can_launch_decode(self, n: int) -> bool:
        """True when a decode step of ``n`` sequences can run as a graph replay
        (``launch_decode``)."""
        return self.graphs is not None and n <= self.graphs.max_batch_size

    @torch.inference_mode()
    def launch_decode(self, requests: Sequence[Request], positions: Sequence[int],
                      input_ids: Sequence[int] | torch.Tensor) -> DecodeLaunch:
        """Enqueue a decode step (one token per request) through the CUDA graphs and its
        sampling, without waiting for the GPU. Arguments as ``_decode_logits``.

        Returns:
            The launch; ``DecodeLaunch.token_ids()`` waits for and returns the sampled ids.
        """
        ids, raw = self._sample(self._decode_logits(requests, positions, input_ids), requests)
        assert raw is None, "requests with logprobs take the synchronous path (LLMEngine._async_decode_ok)"
        return DecodeLaunch(ids)

    @torch.inference_mode()
    def execute(self, batch: Sequence[ScheduledRequest]
                ) -> tuple[list[int | None], list[TokenLogprobs | None], list[list[TokenLogprobs] | None]]:
        """Run one step. Returns, per scheduled request, its sampled token or ``None``
        (a partial prefill chunk samples nothing), its token's logprobs or ``None``
        (it samples nothing or did not ask), and the prompt logprobs of the positions its
        chunk scored or ``None`` (``prompt_logprobs.prompt_spans``: it did not ask, or has
        them all). A step with prompt positions to score runs eagerly: the graphs keep
        the hidden rows of the sampled tokens only."""
        sampled_items = [item for item in batch if item.samples]
        spans = prompt_spans(batch)
        prompt: list[list[TokenLogprobs] | None] = [None] * len(batch)
        logits: torch.Tensor | None = None
        if not spans and self.can_launch_decode(len(batch)) and all(
                item.num_tokens == 1 and item.samples for item in batch):
            requests = [item.request for item in batch]
            logits = self._decode_logits(requests, *decode_inputs(requests))
        elif not spans and self.mixed is not None and self.mixed.fits(sum(item.num_tokens for item in batch),
                                                                      len(batch)):
            rows = self.mixed.run(batch)
            if sampled_items:
                logits = self.model.compute_logits(rows)
        else:
            self.num_eager_steps += 1
            input_ids, positions, meta, logits_indices = self.prepare(batch)
            hidden = self.model(input_ids, positions, self.kv_caches, meta, self.backend)
            if spans:
                prompt = compute_prompt_logprobs(hidden, self.model.compute_logits, batch, spans)
            if sampled_items:
                if len(sampled_items) < hidden.shape[0]:
                    hidden = hidden.index_select(0, logits_indices)
                logits = self.model.compute_logits(hidden)
        tokens: list[int] = []
        logprobs: list[TokenLogprobs | None] = []
        if logits is not None:  # the step's one synchronisation: the ids' copy to the host
            ids, raw = self._sample(logits, [item.request for item in sampled_items])
            tokens = ids.tolist()
            logprobs = raw.fetch() if raw is not None else [None] * len(tokens)
        it, lps = iter(tokens), iter(logprobs)
        return ([next(it) if item.samples else None for item in batch],
                [next(lps) if item.samples else None for item in batch], prompt)
