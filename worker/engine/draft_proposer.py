"""The draft-model proposer of speculative decoding (``--speculative-method draft``).

A small model that shares the target's tokenizer (``--speculative-model``) runs in the
same worker, on the same device, with its own paged KV cache: its own block pool
(``BlockManager``, no prefix caching) and cache tensors. Each step, for every running
request that ``Proposer.propose`` picks (a decoding request, ``k > 0`` from the adaptive
draft length), it:

1. catches the draft's KV up with the request's tokens (``_sync``): the draft keeps a
   shadow ``Request`` per request whose ``token_ids`` are the target's tokens followed by
   the drafts it proposed last; the longest prefix of them that the target kept (its
   accepted drafts) stays computed, the rest is rolled back as the target's is, by
   trimming ``num_computed_tokens`` and freeing the blocks past it (``free_tail``). A new
   request (or one back from preemption) starts from nothing, so the draft prefills it
   in its first proposal step: the draft's prefill follows the target's lazily;
2. runs ``k`` greedy decode steps of the draft over all such requests together: the
   first feeds every token without draft KV (the catch-up, then the last token), each
   later one the previous step's argmax, which stays on the device (one host copy of
   all drafts at the end). With the requests sorted by ``k``, those still drafting at
   step ``j`` are a prefix of the batch.

The proposals are point masses (greedy draft, ``q = delta_d``): ``spec_decode.verify``
then applies the Leviathan et al. 2023 / Chen et al. 2023 rule exactly (accept with
``p(d)``, resample from ``p`` without ``d``), so sampled requests keep the target's
distribution; a draft that sampled from its own ``q`` would be accepted more often but
would need ``q`` at verification. The draft's argmax ignores ``logit_bias``.

Memory: the draft's pool has the target's block count plus, per sequence, the blocks
of ``k - 1`` drafts and one partial block (``draft_num_blocks``), so it never runs out
before the target's does: it holds at most a request's tokens plus ``k - 1`` drafts,
and nothing for waiting or preempted requests. On CUDA ``LLMEngine`` sizes both caches
from one budget (``num_kv_blocks``: a block's bytes are the target's plus the draft's).
Steps of one token per request replay the draft's own decode CUDA graphs
(``cuda_graphs.DecodeGraphs``); catch-ups of several tokens run eagerly.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path

import torch

from shared.model_source import ModelSource, resolve_model
from shared.settings import EngineSettings, ModelSettings, SettingsError
from worker.engine.block_manager import BlockManager
from worker.engine.cuda_graphs import DecodeGraphs
from worker.engine.mixed_graphs import StepInputs
from worker.engine.model_runner import allocate_kv_cache, kv_cache_dtype, slot
from worker.engine.request import Request
from worker.engine.spec_decode import Proposer
from worker.engine.step_types import ScheduledRequest
from worker.models.attention import select_backend
from worker.models.config import ModelConfig
from worker.models.llama import LlamaForCausalLM
from worker.models.loader import build_model

log = logging.getLogger(__name__)


def _refuse(value: str, why: str) -> SettingsError:
    f = next(f for f in dataclasses.fields(EngineSettings) if f.name == "speculative_model")
    return SettingsError(f, value, why)


def _tokenizer_vocab(path: Path | None) -> dict[str, int] | None:
    """The ``tokenizer.json`` vocabulary of a model folder (added tokens included), or
    None when there is none."""
    if path is None or not (path / "tokenizer.json").exists():
        return None
    data = json.loads((path / "tokenizer.json").read_text())
    vocab = dict(data.get("model", {}).get("vocab") or {})
    vocab.update({t["content"]: int(t["id"]) for t in data.get("added_tokens", [])})
    return vocab


def check_shared_vocab(target: ModelSource, draft: ModelSource, value: str) -> None:
    """Refuse a draft whose token ids mean something else than the target's: another
    ``vocab_size``, or (both folders having a ``tokenizer.json``) another vocabulary.

    Raises:
        SettingsError: naming ``--speculative-model`` and ``value``.
    """
    sizes = int(draft.config["vocab_size"]), int(target.config["vocab_size"])
    if sizes[0] != sizes[1]:
        raise _refuse(value, f"the draft's vocab_size is {sizes[0]}, the target's {sizes[1]}: a draft model "
                             "must share the target's tokenizer")
    if draft.path is not None and target.path is not None and draft.path.resolve() != target.path.resolve():
        ours, theirs = _tokenizer_vocab(draft.path), _tokenizer_vocab(target.path)
        if ours is not None and theirs is not None and ours != theirs:
            raise _refuse(value, "the draft's tokenizer differs from the target's: a draft model must share it")


def load_draft_model(es: EngineSettings, ms: ModelSettings, target: ModelSource, dtype: torch.dtype,
                     device: torch.device, max_model_len: int) -> LlamaForCausalLM:
    """Resolve ``--speculative-model`` (a folder or the default model's name), check its
    vocabulary against the target's and build it in ``dtype`` on ``device`` (weights per
    ``--speculative-model-load-format``), with rotary tables for ``max_model_len``.

    Raises:
        SettingsError: another vocabulary (``check_shared_vocab``).
        ModelSourceError, WeightLoadError: as for the target model.
    """
    source = resolve_model(es.speculative_model, es.speculative_model_load_format, ms.model_cache_dir)
    check_shared_vocab(target, source, es.speculative_model)
    model = build_model(ModelConfig.from_hf(source.config), source.path, source.dummy, dtype, device,
                        max_model_len, ms.seed)
    log.info("draft model %s: %d layers, hidden %d", source.name, model.config.num_layers, model.config.hidden_size)
    return model


def draft_num_blocks(num_target_blocks: int, es: EngineSettings) -> int:
    """The draft's KV blocks: the target's plus, per sequence, ``k - 1`` drafts' blocks
    and a partial one (module docstring)."""
    return num_target_blocks + es.max_num_seqs * (-(-(es.num_speculative_tokens - 1) // es.block_size) + 1)


class DraftProposer(Proposer):
    """Proposes each request's drafts by greedy decoding with a draft model over its own
    paged KV cache (module docstring). Not thread-safe (the engine's thread)."""

    def __init__(self, model: LlamaForCausalLM, es: EngineSettings, num_blocks: int, max_model_len: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        """``num_blocks``: the draft's KV blocks (``draft_num_blocks``); ``max_model_len``:
        the target's, tokens (it sizes the block tables of the graphs)."""
        super().__init__(es.num_speculative_tokens, es.speculative_token_cost)
        self.model, self.device = model, device
        self.block_size = es.block_size
        self.max_num_batched_tokens = es.max_num_batched_tokens
        self.block_manager = BlockManager(num_blocks, es.block_size, enable_prefix_caching=False)
        self.kv_caches = allocate_kv_cache(model.config, num_blocks, es.block_size,
                                           kv_cache_dtype(es.kv_cache_dtype, dtype), device)
        self.backend = select_backend(es.attention_backend, device, es.kv_cache_dtype)
        model.check_backend(self.backend)
        self._seqs: dict[str, Request] = {}  # request id -> the draft's shadow request
        self._num_kept: dict[str, int] = {}  # request id -> the target's token count at its last sync
        self.graphs: DecodeGraphs | None = None
        if device.type == "cuda" and not es.enforce_eager and self.backend.name == "triton":
            self.graphs = DecodeGraphs(model, self.kv_caches, self.backend, es.max_num_seqs,
                                       -(-max_model_len // es.block_size), max_model_len, device)
            self.graphs.capture()

    def _sync(self, request: Request) -> Request:
        """The draft's shadow of ``request`` with the target's tokens, its draft KV rolled
        back to the longest prefix of its tokens that the target kept."""
        rid, target = request.request_id, request.token_ids
        seq = self._seqs.get(rid)
        if seq is None:
            seq = self._seqs[rid] = Request(rid, request.prompt_token_ids, request.sampling)
            self._num_kept[rid] = 0
        kept = self._num_kept[rid]  # positions below it hold the target's tokens already
        # The last token is fed again even when its KV is there (its drafts were not
        # verified and the target emitted the first one): its logits give the next draft.
        limit = min(seq.num_computed_tokens, len(target) - 1)
        i = min(kept, limit)
        while i < limit and seq.token_ids[i] == target[i]:
            i += 1
        seq.num_computed_tokens = i
        self.block_manager.free_tail(seq)
        del seq.token_ids[kept:]
        seq.token_ids.extend(target[kept:])
        self._num_kept[rid] = len(target)
        return seq

    @torch.inference_mode()
    def _propose(self, wanted: list[tuple[Request, int]]) -> None:
        wanted = sorted(wanted, key=lambda rk: -rk[1])  # the requests still drafting are a prefix
        bm, budget = self.block_manager, self.max_num_batched_tokens
        first: list[ScheduledRequest] = []
        ks: list[int] = []
        targets: list[Request] = []
        for r, k in wanted:
            seq = self._sync(r)
            num_new = seq.num_tokens - seq.num_computed_tokens
            # KV for the catch-up and the last token, then for k - 1 drafts.
            if num_new > budget or not bm.can_allocate(seq, num_new + k - 1):
                continue
            bm.allocate(seq, num_new + k - 1)
            first.append(ScheduledRequest(seq, num_new))
            ks.append(k)
            targets.append(r)
            budget -= num_new
        if not first:
            return
        seqs = [item.request for item in first]
        ids = self._argmax(first, None)  # every request's first draft
        for item in first:
            item.request.num_computed_tokens += item.num_tokens
        drafted = [ids]
        for j in range(1, ks[0]):  # draft j + 1 from draft j, for the requests with k > j
            n = sum(k > j for k in ks)
            for seq in seqs[:n]:
                seq.token_ids.append(0)  # draft j's place: its id stays on the device
            ids = self._argmax([ScheduledRequest(seq, 1) for seq in seqs[:n]], ids[:n])
            for seq in seqs[:n]:
                seq.num_computed_tokens += 1
            drafted.append(ids)
        flat = torch.cat(drafted).tolist()  # the one wait for the device
        offsets = [0]
        for d in drafted:
            offsets.append(offsets[-1] + len(d))
        for i, (r, seq, k) in enumerate(zip(targets, seqs, ks)):
            drafts = [flat[offsets[j] + i] for j in range(k)]
            # The last draft has no draft KV, as a request's last token has none.
            seq.token_ids[r.num_tokens:] = drafts
            r.spec_token_ids = drafts

    def _argmax(self, step: list[ScheduledRequest], input_ids: torch.Tensor | None) -> torch.Tensor:
        """One draft forward pass over ``step``; the argmax token per item, ``[n]`` int64
        on the device, not synchronised. ``input_ids``: ``[n]`` int64 on the device, the
        items' input tokens (each item one token), instead of their ``token_ids``."""
        n = len(step)
        graphs = self.graphs
        if graphs is not None and n <= graphs.max_batch_size and all(item.num_tokens == 1 for item in step):
            seqs = [item.request for item in step]
            positions = [s.num_computed_tokens for s in seqs]
            lens = [p + 1 for p in positions]
            graphs.inputs.fill([s.token_ids[p] for s, p in zip(seqs, positions)], positions,
                               [slot(s.block_table, p, self.block_size) for s, p in zip(seqs, positions)],
                               [s.block_table for s in seqs], lens)
            graphs.inputs.upload()
            if input_ids is not None:  # stream-ordered after the upload
                graphs.inputs.dev64[:n].copy_(input_ids)
            return graphs.run(n, max(lens), upload=False).argmax(dim=-1)
        num_tokens = sum(item.num_tokens for item in step)
        inputs = StepInputs(num_tokens, n, max(len(item.request.block_table) for item in step), self.block_size,
                            self.device, max_sampled=n)
        shape = inputs.fill(step)
        inputs.upload()
        ids, positions, meta, logits_indices = inputs.views(num_tokens, n, shape.num_sampled, shape.max_query_len,
                                                            shape.max_seq_len, shape)
        if input_ids is not None:
            ids.copy_(input_ids)
        hidden = self.model(ids, positions, self.kv_caches, meta, self.backend)
        return self.model.compute_logits(hidden.index_select(0, logits_indices)).argmax(dim=-1)

    def _release(self, request_id: str) -> None:
        seq = self._seqs.pop(request_id, None)
        self._num_kept.pop(request_id, None)
        if seq is not None:
            self.block_manager.free(seq)

    def preempted(self, request_id: str) -> None:
        """Free the draft's blocks of a preempted request; it catches up when it runs again."""
        self._release(request_id)

    def free(self, request_id: str) -> None:
        super().free(request_id)
        self._release(request_id)
