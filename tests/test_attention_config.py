"""The Triton attention's launch configs fit the GPU's shared memory (a CPU test: the
choice is Python over shapes; ``kernels/paged_attention.py`` ``_attention_config``).

Limits are the opt-in maxima per program that Triton checks: Hopper (H100/H200) 232,448
bytes, A100 166,912, Ada/consumer cards 101,376. The byte count is
``shared_memory_bytes``, checked against what Triton reported on an H200 for a config
that did not fit (its docstring)."""

from __future__ import annotations

import itertools

import pytest
import torch

from kernels.paged_attention import _attention_config, fit_shared_memory, shared_memory_bytes

HOPPER, A100, ADA = 232_448, 166_912, 101_376
#: (num_seqs, max_query_len, max_seq_len): decode batches small and large, short and
#: long prefill chunks, a mixed-step graph's 256 slots.
SHAPES = [(1, 1, 330), (256, 1, 4096), (2, 2048, 2048), (1, 30000, 30000), (1, 13616, 30000), (256, 2048, 4096),
          (64, 100, 2100), (8, 512, 512)]


def _configs(head_dim: int, limit: int | None, dtype: torch.dtype = torch.bfloat16) -> list[dict]:
    return [_attention_config(dtype, qpk, n, 4, q, s, 132, new_kv=new_kv, head_dim=head_dim, smem_limit=limit)
            for (n, q, s), qpk, new_kv in itertools.product(SHAPES, (1, 7), (False, True))]


@pytest.mark.parametrize("limit", [HOPPER, A100, ADA], ids=["hopper", "a100", "ada"])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_every_config_fits_the_limit(head_dim: int, limit: int, dtype: torch.dtype) -> None:
    for cfg in _configs(head_dim, limit, dtype):
        assert shared_memory_bytes(cfg, head_dim, dtype.itemsize) <= limit, cfg
        assert cfg["TILE"] >= 16 and cfg["num_stages"] >= 1


def test_the_measured_configs_stay_as_they_are_on_hopper() -> None:
    """Heads of 128 in bfloat16 fit a Hopper GPU as chosen: the fit changes nothing there
    (the H200 figures in docs/benchmarks.md were taken with these configs)."""
    assert _configs(128, HOPPER) == _configs(128, None)


def test_heads_of_256_lose_stages_then_tile_length() -> None:
    # Gemma 3's heads: a long prompt's launch (one head, 128 x 128 tiles, 3 stages with
    # TMA) would need 459,776 bytes.
    cfg = _attention_config(torch.bfloat16, 2, 1, 8, 30000, 30000, 132, new_kv=True, head_dim=256)
    assert shared_memory_bytes(cfg, 256, 2) > HOPPER
    fit = _attention_config(torch.bfloat16, 2, 1, 8, 30000, 30000, 132, new_kv=True, head_dim=256,
                            smem_limit=HOPPER)
    assert (fit["num_stages"], fit["TILE"]) == (2, 64)
    assert {k: v for k, v in fit.items() if k not in ("num_stages", "TILE")} == \
        {k: v for k, v in cfg.items() if k not in ("num_stages", "TILE")}


def test_a_config_that_cannot_fit_comes_back_at_its_smallest() -> None:
    cfg = {"BLOCK_M": 128, "TILE": 128, "num_stages": 3, "NEW_KV_TMA": False}
    assert fit_shared_memory(cfg, 128, 2, 1) == dict(cfg, TILE=16, num_stages=1)


@pytest.mark.parametrize(("num_seqs", "expected"), [(8, (32, 2)), (64, (128, 3)), (98, (128, 3)), (99, (64, 2)),
                                                    (256, (64, 2))])
def test_decode_tiles_follow_the_waves_of_programs(num_seqs: int, expected: tuple[int, int]) -> None:
    """bfloat16 decode on 132 SMs, 4 KV heads: a split launch below one wave of
    programs, long tiles and three stages up to three, short tiles and two stages from
    three waves (396 programs) on (the H200 sweep in the kernel's comment)."""
    cfg = _attention_config(torch.bfloat16, 7, num_seqs, 4, 1, 330, 132)
    assert (cfg["TILE"], cfg["num_stages"]) == expected
