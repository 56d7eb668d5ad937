"""The packed step-input buffers that captured graphs read at fixed addresses: one home
for their layout, used by the decode graphs (``cuda_graphs.StaticInputs``) and the
mixed-step graphs (``mixed_graphs.StepInputs``).

Layout, for capacities of ``T`` tokens, ``S`` sequences, ``B`` blocks per sequence and
``K`` sampled rows:
    int64: input_ids [T] | positions [T] | slot_mapping [T] | logits_indices [K]
    int32: block_tables [S, B] | query_start_loc [S + 1] | seq_lens [S]
A pinned host copy is filled with numpy; ``upload`` is the step's two host-to-device
copies (on CPU the host buffers are the device buffers). A step's first ``t`` tokens and
``s`` sequences are read through ``device_views(t, s)``.
"""

from __future__ import annotations

import torch

from worker.models.attention import AttentionMetadata


class PackedStepBuffers:
    """The buffers of the module docstring's layout; the numpy views of the host copy are
    ``_ids``, ``_pos``, ``_slots``, ``_logits_idx``, ``_tables`` [S, B], ``_qsl``,
    ``_seq_lens``."""

    def __init__(self, max_tokens: int, max_seqs: int, max_blocks: int, device: torch.device,
                 max_sampled: int = 0) -> None:
        self.max_tokens, self.max_seqs, self.max_blocks = max_tokens, max_seqs, max_blocks
        on_cuda = device.type == "cuda"
        T, S, B = max_tokens, max_seqs, max_blocks
        n64 = 3 * T + max_sampled
        n32 = S * B + 2 * S + 1
        self.host64 = torch.zeros(n64, dtype=torch.int64, pin_memory=on_cuda)
        self.host32 = torch.zeros(n32, dtype=torch.int32, pin_memory=on_cuda)
        self.dev64 = torch.zeros(n64, dtype=torch.int64, device=device) if on_cuda else self.host64
        self.dev32 = torch.zeros(n32, dtype=torch.int32, device=device) if on_cuda else self.host32
        self.np64, self.np32 = self.host64.numpy(), self.host32.numpy()
        self._ids, self._pos, self._slots, self._logits_idx = (self.np64[:T], self.np64[T:2 * T],
                                                               self.np64[2 * T:3 * T], self.np64[3 * T:])
        self._tables = self.np32[:S * B].reshape(S, B)
        self._qsl = self.np32[S * B:S * B + S + 1]
        self._seq_lens = self.np32[S * B + S + 1:]
        # A copy may still be reading the pinned buffers when the next step refills them
        # (a step that samples nothing does not synchronise): ``wait_for_upload`` first.
        self._uploaded = torch.cuda.Event() if on_cuda else None

    def wait_for_upload(self) -> None:
        """Block until the last ``upload``'s copies have read the host buffers."""
        if self._uploaded is not None:
            self._uploaded.synchronize()

    def upload(self) -> None:
        """Enqueue the two host-to-device copies (nothing to do on CPU)."""
        if self._uploaded is None:
            return
        self.dev64.copy_(self.host64, non_blocking=True)
        self.dev32.copy_(self.host32, non_blocking=True)
        self._uploaded.record()

    def device_views(self, num_tokens: int, num_seqs: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                                                   torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(input_ids [t], positions [t], slot_mapping [t], block_tables [s, B],
        query_start_loc [s + 1], seq_lens [s])`` on the device, for ``t = num_tokens`` and
        ``s = num_seqs``."""
        T, S, B = self.max_tokens, self.max_seqs, self.max_blocks
        d64, d32 = self.dev64, self.dev32
        return (d64[:num_tokens], d64[T:T + num_tokens], d64[2 * T:2 * T + num_tokens],
                d32[:S * B].view(S, B)[:num_seqs], d32[S * B:S * B + num_seqs + 1],
                d32[S * B + S + 1:S * B + S + 1 + num_seqs])

    def attention_metadata(self, num_tokens: int, num_seqs: int, max_query_len: int, max_seq_len: int,
                           **extra: object) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """``(input_ids [t], positions [t], metadata of s sequences)`` from
        ``device_views``; ``extra`` goes to ``AttentionMetadata`` as is."""
        ids, pos, slots, tables, qsl, lens = self.device_views(num_tokens, num_seqs)
        meta = AttentionMetadata(slot_mapping=slots, block_tables=tables, query_start_loc=qsl, seq_lens=lens,
                                 max_query_len=max_query_len, max_seq_len=max_seq_len, **extra)  # type: ignore[arg-type]
        return ids, pos, meta
