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
(and that of the prompt logprobs, in a step that scores them) and, while the engine's
stop check is armed, the end of each piece of a replayed step but the last
(``graph_pieces``; ``finish_pieces``).

Grammar masks (``worker/structured/``) are filled on the host after the step's forward
pass and LM head are enqueued, so on CUDA they are computed while the device runs that
step; a step without a structured request builds none.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

import torch

from kernels.kv_cache_write import FP8_KV_DTYPE
from shared.protocol import TokenLogprobs
from shared.settings import EngineSettings
from worker.engine.arrivals import StepStop
from worker.engine.cuda_graphs import DecodeGraphs, PiecewiseReplay
from worker.engine.kv_calibration import calibrate_kv_cache, default_calibration_ids
from worker.engine.mixed_graphs import MixedGraphs, StepInputs
from worker.engine.prompt_logprobs import compute_prompt_logprobs, prompt_spans, warm_up_steps
from worker.engine.request import Request
from worker.engine.sampler import RawLogprobs, Sampler, host_list_to_device
from worker.engine.spec_decode import verify
from worker.engine.step_types import ScheduledRequest
from worker.models.attention import AttentionMetadata, select_backend
from worker.models.config import ModelConfig
from worker.models.llama import ForwardStopped, KVCache, LlamaForCausalLM
from worker.parallel import all_reduce
from worker.parallel import group as tp_group
from worker.parallel.layers import TensorParallelLM
from worker.parallel.step_sync import StepSync
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


def kv_cache_dtype(setting: str, model_dtype: torch.dtype) -> torch.dtype:
    """The KV cache's element type for ``EngineSettings.kv_cache_dtype``: the model's
    dtype for ``auto``, ``float8_e4m3fn`` for ``fp8`` (one byte: a bfloat16 model's
    memory holds twice the tokens)."""
    return FP8_KV_DTYPE if setting == "fp8" else model_dtype


def allocate_kv_cache(cfg: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype,
                      device: torch.device) -> list[KVCache]:
    """Per layer ``(k_cache, v_cache)``, each ``[num_blocks, block_size, num_kv_heads, head_dim]``
    of ``dtype`` (``kv_cache_dtype``: the model's dtype, or ``float8_e4m3fn``)."""
    shape = (num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
    return [(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
            for _ in range(cfg.num_layers)]


class StepLaunch:
    """A step enqueued on the GPU (a decode step, or any step that ``launch_step`` took):
    its sampled ids on the device, one per sampling item in batch order, and a copy of
    them to pinned host memory that ``token_ids`` waits for. On CPU the step has run
    already and the ids are the host's."""

    def __init__(self, sampled: torch.Tensor) -> None:
        self.sampled = sampled  # [num_sampled] int64, device
        self._ready: torch.cuda.Event | None = None
        if sampled.device.type != "cuda":
            self._host = sampled
            return
        self._host = torch.empty(sampled.shape, dtype=sampled.dtype, pin_memory=True)
        self._host.copy_(sampled, non_blocking=True)
        self._ready = torch.cuda.Event()
        self._ready.record()

    def token_ids(self) -> list[int]:
        """The sampled ids; blocks until the step has run."""
        if self._ready is not None:
            self._ready.synchronize()
        return self._host.tolist()


class ModelRunner:
    """Owns the model, the KV cache tensors, the CUDA graphs and the sampler."""

    def __init__(self, model: LlamaForCausalLM, settings: EngineSettings, num_blocks: int, max_model_len: int,
                 dtype: torch.dtype, device: torch.device, seed: int = 0,
                 kv_calibration_ids: Sequence[int] = ()) -> None:
        """``max_model_len``: the longest sequence, tokens (``shared.model_source.max_model_len``;
        the model's rotary table covers it), which sizes the graphs' block tables.
        ``kv_calibration_ids``: the prefill that calibrates an fp8 cache
        (``kv_calibration.kv_calibration_ids``; empty: ``default_calibration_ids``); unused otherwise."""
        self.model = model
        self.cfg = model.config
        self.device = device
        self.dtype = dtype
        self.block_size = settings.block_size
        # Tensor parallelism (worker/parallel/): every rank runs this constructor in
        # lockstep (graph captures hold collectives); the smallest rank's block count is the
        # group's (each sized it from its own shard's KV bytes and its own free memory).
        self.tp = tp_group.current()
        if settings.tensor_parallel_size != (self.tp.world_size if self.tp else 1):
            raise RuntimeError(f"--tensor-parallel-size {settings.tensor_parallel_size} but this process is in "
                               f"no group of that size (start one first: worker/parallel/group.py)")
        if self.tp is not None:
            # Ranks built with other settings would capture other graphs and wait forever
            # in each other's collectives: refuse that at once, on every rank.
            if not self.tp.same_everywhere(repr(settings)):
                raise ValueError("tensor parallel: this group's ranks were given other engine settings; start "
                                 "the followers with rank 0's (worker.parallel.follower.start_for_engine)")
            num_blocks = self.tp.min_int(num_blocks)
            if device.type == "cuda" and settings.custom_all_reduce:  # collective: every rank, here
                all_reduce.install(self.tp.group, self.tp.device, first_group=tp_group.groups_joined() == 1)
        self.step_sync: StepSync | None = None  # rank 0 of a group: announces each model call
        #: Checked between the layers of an eager step (``LlamaForCausalLM.forward``'s
        #: ``stop``) and between the pieces of a replayed one (``finish_pieces``); set by
        #: the engine, never under tensor parallelism; None: run whole.
        self.step_stop: StepStop | None = None
        self.num_blocks = num_blocks
        self.kv_caches = allocate_kv_cache(model.shard_config, num_blocks, self.block_size,
                                           kv_cache_dtype(settings.kv_cache_dtype, dtype), device)
        self.backend = select_backend(settings.attention_backend, device, settings.kv_cache_dtype)
        model.check_backend(self.backend)  # e.g. a sliding window the backend cannot honour
        if settings.kv_cache_dtype == "fp8":  # before any graph capture: they hold the encoding
            calibrate_kv_cache(model, self.kv_caches, kv_calibration_ids
                               or default_calibration_ids(self.cfg.vocab_size, max_model_len), device)
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
        if self.tp is not None and self.tp.rank == 0 and isinstance(model, TensorParallelLM):
            self.step_sync = model.sync = StepSync(self.tp.group, self.tp.device, self.cfg.hidden_size, dtype)
        log.info("model runner: %d KV blocks of %d tokens (%s), %s attention, %s on %s, decode graphs %s, "
                 "mixed-step graphs %s", num_blocks, self.block_size, self.kv_caches[0][0].dtype,
                 self.backend.name, dtype, device,
                 self.graphs.buckets if self.graphs else "off", self.mixed.buckets if self.mixed else "off")

    def _capture(self, settings: EngineSettings) -> None:
        """Capture the mixed-step graphs (largest activations first) and the decode
        graphs into one memory pool, then warm the sampler and the eager path of prompt
        logprobs up, and log the time and the memory the graphs took."""
        t0 = time.perf_counter()
        torch.cuda.empty_cache()  # so that free memory counts only what the graphs keep
        free_before = torch.cuda.mem_get_info(self.device)[0]
        max_blocks = -(-self.max_model_len // self.block_size)
        pool = torch.cuda.graph_pool_handle()
        # Steps in pieces only where the engine may stop them: not under TP (every rank
        # runs each pass whole), not with speculative decoding.
        pieces = settings.graph_pieces if self.tp is None and settings.speculative_method == "off" else 1
        if settings.mixed_cuda_graphs:  # under TP every rank captures the same buckets
            self.mixed = MixedGraphs(self.model, self.kv_caches, self.backend, settings.max_num_seqs,
                                     settings.max_num_batched_tokens, max_blocks, self.max_model_len,
                                     self.block_size, self.device, pieces)
            self.mixed.capture(pool)
        self.graphs = DecodeGraphs(self.model, self.kv_caches, self.backend, settings.max_num_seqs, max_blocks,
                                   self.max_model_len, self.device, pieces)
        self.graphs.capture(pool)
        self.sampler.warm_up(settings.max_num_seqs, self.cfg.vocab_size)
        for step in warm_up_steps(settings.max_num_seqs, settings.max_num_batched_tokens, self.block_size,
                                  self.num_blocks):
            self.execute(step)  # the eager path that prompt logprobs take
            for item in step:
                self.sampler.free(item.request.request_id)
        self.num_eager_steps = 0
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
        inputs = StepInputs(num_tokens, len(batch), max_blocks, self.block_size, self.device, max_sampled=num_tokens)
        shape = inputs.fill(batch)
        inputs.upload()
        return inputs.views(num_tokens, len(batch), shape.num_sampled, shape.max_query_len, shape.max_seq_len,
                            shape)

    def _eager_inputs(self, batch: Sequence[ScheduledRequest]
                      ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor]:
        """``prepare``'s tuple for an eager step. With the mixed-step graphs, a step that
        fits them (one that scores prompt logprobs; not a speculative one) is packed as a
        replay would be: the graphs' buffers, tokens padded to the bucket, ``max_num_seqs`` sequences, their
        hints; so its Triton kernels get the arguments they were compiled for at capture
        (Triton specialises on integer values and pointer alignment), and nothing compiles
        when such a request first comes. Its hidden rows past the step's tokens are padding."""
        if not self.takes_mixed_graphs(batch):
            return self.prepare(batch)
        mixed = self.mixed
        assert mixed is not None
        num_tokens = sum(item.num_tokens for item in batch)
        bucket = next(b for b in mixed.buckets if b >= num_tokens)
        shape = mixed.inputs.fill(batch, pad_tokens_to=bucket)
        mixed.inputs.upload()
        return mixed.inputs.views(bucket, mixed.max_num_seqs, shape.num_sampled, max_query_len=bucket,
                                  max_seq_len=mixed.max_seq_len)

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
        return self._replay_decode(len(requests), self._prepare_decode(requests, positions, input_ids))

    def _prepare_decode(self, requests: Sequence[Request], positions: Sequence[int],
                        input_ids: Sequence[int] | torch.Tensor,
                        from_device: tuple[torch.Tensor, torch.Tensor] | None = None) -> int:
        """Fill the graphs' inputs and enqueue their upload (arguments as
        ``_decode_logits``; ``from_device``: ``(rows, ids)`` on the device, input ids
        that replace those rows of ``input_ids`` after the upload, as ``launch_step``'s);
        returns the longest context, tokens. Under tensor parallelism the inputs then go
        to the other ranks, complete."""
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
        if from_device is not None:  # the input ids lead the graphs' int64 buffer
            graphs.inputs.dev64.index_copy_(0, *from_device)
        if self.step_sync is not None:  # the other ranks replay the same bucket on these inputs
            self.step_sync.send_decode(graphs.inputs.dev64, graphs.inputs.dev32, len(requests), max(lens))
        return max(lens)

    def _begin_mixed(self, batch: Sequence[ScheduledRequest],
                     device_ids: tuple[torch.Tensor, torch.Tensor] | None = None) -> PiecewiseReplay:
        """``MixedGraphs.begin``; under tensor parallelism the packed inputs go to the
        other ranks before the replay (its all-reduces wait for theirs)."""
        mixed = self.mixed
        assert mixed is not None
        bucket, num_sampled = mixed.pack(batch, device_ids)
        if self.step_sync is not None:
            self.step_sync.send_mixed(mixed.inputs.dev64, mixed.inputs.dev32, bucket, num_sampled)
        return mixed.replay(bucket, num_sampled)

    def _replay_decode(self, n: int, max_seq_len: int) -> torch.Tensor:
        assert self.graphs is not None
        return self.graphs.run(n, max_seq_len, upload=False)

    def _sample(self, logits: torch.Tensor, requests: Sequence[Request]) -> tuple[torch.Tensor, RawLogprobs | None]:
        """``Sampler.sample`` of one row of ``logits`` per request, under the grammar
        masks of the requests that have one: ``[n]`` int64 ids on the device, not
        synchronised, and the raw logprobs of the rows that ask (None: no row does).
        The masks follow each grammar's host state, so a request with a grammar must
        have had its previous token applied (no async step)."""
        params = [r.sampling for r in requests]
        raw = RawLogprobs(logits, params) if RawLogprobs.wanted(params) else None  # before sample edits logits
        mask = self.grammar_masks.mask([r.grammar for r in requests])
        if mask is not None and not logits.is_contiguous():
            # Under tensor parallelism the gathered logits are a column slice (the last
            # shard's vocabulary padding cut off) when the vocabulary does not split evenly.
            logits = logits.contiguous()
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
                      input_ids: Sequence[int] | torch.Tensor) -> StepLaunch:
        """Enqueue a decode step (one token per request) through the CUDA graphs and its
        sampling, without waiting for the GPU. Arguments as ``_decode_logits``.

        Returns:
            The launch; ``StepLaunch.token_ids()`` waits for and returns the sampled ids.
        """
        return self.launch_sample(self.launch_forward(requests, positions, input_ids), requests)

    @torch.inference_mode()
    def prepare_decode(self, requests: Sequence[Request], positions: Sequence[int],
                       input_ids: Sequence[int] | torch.Tensor) -> int:
        """The first part of ``launch_decode``, for a step that may yet be dropped: fill
        the graphs' inputs and enqueue their upload (stream-ordered after the step in
        flight, which has read its own), and return the longest context (tokens) for
        ``replay_decode``. Dropped, it leaves nothing behind: the next decode step fills
        them again. Not under tensor parallelism (the inputs go to the other ranks here).

        Raises:
            AssertionError: no graphs, too many requests, or a tensor-parallel group.
        """
        assert self.step_sync is None, "a tensor-parallel step cannot be dropped once prepared"
        return self._prepare_decode(requests, positions, input_ids)

    @torch.inference_mode()
    def replay_decode(self, requests: Sequence[Request], max_seq_len: int) -> StepLaunch:
        """The rest of ``launch_decode`` after ``prepare_decode``: replay the graph and
        enqueue the sampling; ``max_seq_len`` is what ``prepare_decode`` returned."""
        return self.launch_sample(self._replay_decode(len(requests), max_seq_len), requests)

    @property
    def decode_pieces(self) -> int:
        """Graphs per decode step (``EngineSettings.graph_pieces``, 1 under tensor
        parallelism or speculative decoding; 0 without decode graphs)."""
        return len(self.graphs.pieces) if self.graphs is not None else 0

    @torch.inference_mode()
    def begin_decode(self, requests: Sequence[Request], max_seq_len: int) -> PiecewiseReplay:
        """As ``replay_decode``, but replay the step's first piece only: ``finish_pieces``
        replays the others (or stops), then ``launch_sample`` samples its ``output``."""
        assert self.graphs is not None
        return self.graphs.begin(len(requests), max_seq_len, upload=False)

    @torch.inference_mode()
    def finish_pieces(self, replay: PiecewiseReplay) -> torch.Tensor:
        """Replay the pieces left of a step, and return its ``output`` (enqueued, not
        waited for). While ``step_stop`` is armed, wait for each piece to run before the
        next, and stop there when ``step_stop()`` says so.

        Raises:
            ForwardStopped: stopped between two pieces; the step's later layers never
                ran, and nothing of it may be applied.
        """
        stop = self.step_stop
        while replay.remaining:
            if stop is not None and stop.armed:
                replay.wait()
                if stop():
                    raise ForwardStopped(f"stopped with {replay.remaining} piece(s) of the step left")
            replay.replay_next()
        return replay.output

    @torch.inference_mode()
    def launch_forward(self, requests: Sequence[Request], positions: Sequence[int],
                       input_ids: Sequence[int] | torch.Tensor) -> torch.Tensor:
        """The first half of ``launch_decode``: enqueue the forward pass only and return
        its logits ``[n, vocab]`` float32 on the device, not synchronised. The engine
        applies the previous step's tokens to the grammars while the GPU runs this, then
        samples under masks that follow them (``launch_sample``)."""
        return self._decode_logits(requests, positions, input_ids)

    @torch.inference_mode()
    def launch_sample(self, logits: torch.Tensor, requests: Sequence[Request]) -> StepLaunch:
        """The second half of ``launch_decode``: sample ``logits`` (``launch_forward``'s)
        under the requests' grammar masks, filled now on the host, and enqueue the ids'
        copy to the host without waiting."""
        ids, raw = self._sample(logits, requests)
        assert raw is None, "requests with logprobs take the synchronous path (LLMEngine._async_decode_ok)"
        return StepLaunch(ids)

    def takes_decode_graphs(self, batch: Sequence[ScheduledRequest]) -> bool:
        """Whether a step of ``batch`` replays the decode graphs: every item decodes one
        token (and samples it), and the graphs hold that many sequences."""
        return self.can_launch_decode(len(batch)) and all(item.num_tokens == 1 and item.samples for item in batch)

    def takes_mixed_graphs(self, batch: Sequence[ScheduledRequest]) -> bool:
        """Whether the mixed-step graphs hold a step of ``batch``: its tokens and sequences
        fit their largest bucket, and no item verifies drafts (a speculative step scores
        1 + k rows per sequence: more than the graphs' buffers hold)."""
        return (self.mixed is not None and not any(item.num_spec_tokens for item in batch)
                and self.mixed.fits(sum(item.num_tokens for item in batch), len(batch)))

    def can_launch_step(self, batch: Sequence[ScheduledRequest]) -> bool:
        """True when ``launch_step`` can enqueue ``batch`` without waiting: a decode step
        the decode graphs hold, or a step the mixed-step graphs hold; no item verifies
        drafts or scores prompt positions. On CPU (no graphs) any such step: it runs
        eagerly there (``launch_step``)."""
        if any(item.num_spec_tokens for item in batch) or prompt_spans(batch):
            return False
        if self.device.type != "cuda" or self.takes_decode_graphs(batch):
            return True
        return self.takes_mixed_graphs(batch)

    @torch.inference_mode()
    def launch_step(self, batch: Sequence[ScheduledRequest], from_device: Sequence[tuple[int, int]] = (),
                    sampled: torch.Tensor | None = None) -> StepLaunch:
        """Enqueue a step (check ``can_launch_step``) and its sampling without waiting for
        the GPU: through the decode graphs when every item decodes one token, else the
        mixed-step graphs, whole (not piece by piece); eagerly on CPU.

        Args:
            batch: the step, packed from the requests' state now (``StepInputs.fill``).
            from_device: ``(token index in the step, row of sampled)`` for each input
                token sampled by the step still in flight (``Request.num_pending_tokens``:
                ``input_token_ids`` holds a 0 there); the launch copies those ids on the
                device, after the inputs' upload, so nothing waits for them.
            sampled: ``[m]`` int64 on the device, that step's sampled ids
                (``StepLaunch.sampled``); needed when ``from_device`` is not empty.

        Returns:
            The launch: ``StepLaunch.token_ids()`` gives one id per item that samples,
            in batch order.

        Raises:
            AssertionError: an item asks for logprobs (``RawLogprobs`` is fetched with the
                ids: the engine runs such a step synchronously).
        """
        sampled_requests = [item.request for item in batch if item.samples]
        ids = ids_index = None
        if from_device:
            assert sampled is not None
            index = host_list_to_device([i for i, _ in from_device] + [row for _, row in from_device],
                                        torch.int64, self.device)
            ids_index, ids = index[:len(from_device)], sampled.index_select(0, index[len(from_device):])
        if self.device.type == "cuda" and self.takes_decode_graphs(batch):
            requests = [item.request for item in batch]
            pending = (ids_index, ids) if ids_index is not None and ids is not None else None
            max_seq_len = self._prepare_decode(requests, [item.request.num_computed_tokens for item in batch],
                                               [item.input_token_ids()[0] for item in batch], pending)
            logits = self._replay_decode(len(requests), max_seq_len)
        elif self.device.type == "cuda":
            assert self.mixed is not None
            rows = self._begin_mixed(batch, (ids_index, ids) if ids is not None else None).finish()
            logits = self.model.compute_logits(rows) if sampled_requests else None
        else:
            self.num_eager_steps += 1
            input_ids, positions, meta, logits_indices = self.prepare(batch)
            if ids is not None:
                input_ids.index_copy_(0, ids_index, ids)
            hidden = self.model(input_ids, positions, self.kv_caches, meta, self.backend)
            logits = self.model.compute_logits(hidden.index_select(0, logits_indices)) if sampled_requests else None
        if logits is None:
            return StepLaunch(torch.empty(0, dtype=torch.int64, device=self.device))
        return self.launch_sample(logits, sampled_requests)

    @torch.inference_mode()
    def execute(self, batch: Sequence[ScheduledRequest], while_gpu_runs: Callable[[], None] | None = None
                ) -> tuple[list[int | list[int] | None], list[TokenLogprobs | None], list[list[TokenLogprobs] | None]]:
        """Run one step; ``while_gpu_runs()`` is called once the step's work is enqueued,
        before the host waits for its tokens (host work that would otherwise run between
        two steps, with the GPU idle: ``Scheduler.hash_ahead``). Returns, per scheduled
        request, its sampled token or ``None`` (a partial prefill chunk samples nothing)
        or, for a speculative item
        (``num_spec_tokens > 0``), its accepted drafts and the target's token
        (``spec_decode.verify``), its token's logprobs or ``None``
        (it samples nothing or did not ask), and the prompt logprobs of the positions its
        chunk scored or ``None`` (``prompt_logprobs.prompt_spans``: it did not ask, or has
        them all). A step with prompt positions to score runs eagerly: the graphs keep
        the hidden rows of the sampled tokens only. So does a speculative step: the
        graphs keep one row per sequence, and the decode graphs take one token each."""
        sampled_items = [item for item in batch if item.samples]
        spans = prompt_spans(batch)
        prompt: list[list[TokenLogprobs] | None] = [None] * len(batch)
        logits: torch.Tensor | None = None
        speculative = any(item.num_spec_tokens for item in batch)
        if not spans and not speculative and self.takes_decode_graphs(batch):
            requests = [item.request for item in batch]
            logits = self._decode_logits(requests, *decode_inputs(requests))
        elif not spans and self.takes_mixed_graphs(batch):
            rows = self.finish_pieces(self._begin_mixed(batch))
            if sampled_items:
                logits = self.model.compute_logits(rows)
        else:
            self.num_eager_steps += 1
            input_ids, positions, meta, logits_indices = self._eager_inputs(batch)
            hidden = self.model(input_ids, positions, self.kv_caches, meta, self.backend, self.step_stop)
            if spans:
                prompt = compute_prompt_logprobs(hidden, self.model.compute_logits, batch, spans)
            if sampled_items:
                if logits_indices.shape[0] < hidden.shape[0]:
                    hidden = hidden.index_select(0, logits_indices)
                logits = self.model.compute_logits(hidden)
        tokens: list[int | list[int]] = []
        logprobs: list[TokenLogprobs | None] = []
        if logits is not None and speculative:
            if while_gpu_runs is not None:
                while_gpu_runs()
            tokens, logprobs = self._verify(logits, sampled_items)
        elif logits is not None:  # the step's one synchronisation: the ids' copy to the host
            ids, raw = self._sample(logits, [item.request for item in sampled_items])
            if while_gpu_runs is not None:
                while_gpu_runs()
            tokens = ids.tolist()
            logprobs = raw.fetch() if raw is not None else [None] * len(tokens)
        elif while_gpu_runs is not None:  # nothing sampled: nothing waited for
            while_gpu_runs()
        it, lps = iter(tokens), iter(logprobs)
        return ([next(it) if item.samples else None for item in batch],
                [next(lps) if item.samples else None for item in batch], prompt)

    def _verify(self, logits: torch.Tensor, items: Sequence[ScheduledRequest]
                ) -> tuple[list[int | list[int]], list[TokenLogprobs | None]]:
        """Tokens of a speculative step's sampled items from their logits rows (one per
        plain item, ``1 + num_spec_tokens`` per speculative one, in order), and each
        item's token logprobs or None: plain rows go through ``_sample`` together (a
        request that asks for logprobs is never speculated, but may share the step:
        its logprobs come from there), each speculative item through
        ``spec_decode.verify`` against ``Sampler.target_probs``."""
        sizes = [1 + item.num_spec_tokens for item in items]
        starts = [sum(sizes[:i]) for i in range(len(items))]
        plain = [i for i, item in enumerate(items) if not item.num_spec_tokens]
        out: list[int | list[int]] = [0] * len(items)
        logprobs: list[TokenLogprobs | None] = [None] * len(items)
        if plain:
            rows = host_list_to_device([starts[i] for i in plain], torch.int64, logits.device)
            ids, raw = self._sample(logits.index_select(0, rows), [items[i].request for i in plain])
            plain_ids = ids.tolist()
            plain_logprobs = raw.fetch() if raw is not None else [None] * len(plain)
            for i, t, lp in zip(plain, plain_ids, plain_logprobs, strict=True):
                out[i], logprobs[i] = t, lp
        for i, item in enumerate(items):
            if item.num_spec_tokens:
                r = item.request
                probs, argmax = self.sampler.target_probs(logits[starts[i]:starts[i] + sizes[i]], r.sampling)
                out[i] = verify(probs, argmax, r.spec_token_ids[:item.num_spec_tokens],
                                self.sampler.generator(r.request_id, r.sampling), r.sampling.seed is not None)
        return out, logprobs
