"""FP8 weights under tensor parallelism: which rows or columns of each FP8 projection a
rank holds, and whether its scales split with them so that TP=N holds TP=1's weights.

A rank's FP8 weight is its slice of the full weight (``layers.tensor_slice``) in the
layout TP=1 uses (``worker/models/fp8.py``):

- ``channel`` (FP8 checkpoints; ``weight_scale [N]``, one scale per output row): a
  column-parallel rank (``qkv_proj``, ``gate_up_proj``: rows split) reads the scales of its
  rows, a row-parallel one (``o_proj``, ``down_proj``: columns split) reads them all. A
  projection the checkpoint left unquantized is quantized per row from its full rows, so a
  row-parallel rank quantizes the whole tensor and keeps its columns. Every split works:
  each rank's dequantized slice is TP=1's, bit for bit.
- ``block`` (quantized at load; ``weight_scale [ceil(N / 128), ceil(K / 128)]``): each rank
  quantizes the slice it loaded (``Linear.to_fp8``). Where every slice starts and ends on
  a multiple of 128, in each part of a fused weight (q, k and v of ``qkv_proj``, gate and
  up of ``gate_up_proj``; the parts' offsets in the full and in the shard's fused weight
  are then multiples of 128 too) and along the columns of the row-parallel projections,
  each 128x128 block of a slice is a block of the full weight: same values, same amax,
  same scale, same E4M3 codes, so the shard holds TP=1's weights bit for bit (the K
  blocks of a column-parallel slice are the full weight's, partial last block included,
  since K is not split). Where a slice does not fall on blocks, one block of the shard
  would mix rows of two parts or of two ranks' slices and scale them together, and TP=N
  would serve other numbers than TP=1: such a split is refused at start
  (``check_fp8_shards``), as vLLM refuses block-FP8 shards that are not multiples of the
  block (``validate_fp8_block_shape``).

Inputs: block-scaled products round their input per 1x128 group (``fp8.round_inputs`` on
CPU, the group quantizer on CUDA); a row-parallel rank's input is its columns of the full
input, whose groups are then the full input's groups, so TP=N rounds as TP=1 does. A
``channel`` product rounds its input per token: over the rank's columns in a row-parallel
projection, so its input scale (and rounding) differs from TP=1's there, by at most e4m3's
rounding of each element (as in vLLM, whose per-token activation scales are per rank too).

Every FP8 projection of the shard must also meet ``torch._scaled_mm``'s multiples of 16
where the full projection does, or the shard would keep in the model dtype a projection
that TP=1 stores in FP8.
"""

from __future__ import annotations

from dataclasses import dataclass

from worker.models.config import ModelConfig
from worker.models.fp8 import FP8_BLOCK, FP8_SCHEMES, SCALED_MM_ALIGN, scaled_mm_fits
from worker.parallel.layers import ShardSpec, shard_spec

#: FP8 projection -> (sharded dim of its weight: 0 rows, column-parallel; 1 columns,
#: row-parallel; its parts along that dim as (name, ``ShardSpec.rows`` kind), in order).
PROJECTIONS: dict[str, tuple[int, tuple[tuple[str, str], ...]]] = {
    "qkv_proj": (0, (("q", "q"), ("k", "kv"), ("v", "kv"))),
    "o_proj": (1, (("input", "q"),)),
    "gate_up_proj": (0, (("gate", "mlp"), ("up", "mlp"))),
    "down_proj": (1, (("input", "mlp"),)),
}


@dataclass(frozen=True, slots=True)
class ShardCut:
    """Rank ``rank``'s slice ``[start, stop)`` of one part of an FP8 projection's weight,
    along ``dim`` (0: output rows, 1: input columns), in the part's own indices."""

    rank: int
    projection: str
    part: str
    dim: int
    #: the part's rows (``dim`` 0) or columns (``dim`` 1) in the full weight
    full_size: int
    start: int
    stop: int

    @property
    def size(self) -> int:
        return self.stop - self.start

    @property
    def on_blocks(self) -> bool:
        """Whether the slice starts and ends on ``FP8_BLOCK`` boundaries of its part."""
        return self.start % FP8_BLOCK == 0 and self.size % FP8_BLOCK == 0

    def describe(self) -> str:
        """E.g. ``qkv_proj's k rows (192 in all) split 96 to a rank``."""
        what = "rows" if self.dim == 0 else "columns"
        return f"{self.projection}'s {self.part} {what} ({self.full_size} in all) split {self.size} to a rank"


def part_size(cfg: ModelConfig, kind: str) -> int:
    """The full model's rows of a ``ShardSpec.rows`` kind: ``q``, ``kv`` or ``mlp``."""
    return {"q": cfg.num_heads * cfg.head_dim, "kv": cfg.num_kv_heads * cfg.head_dim,
            "mlp": cfg.intermediate_size}[kind]


def projection_shape(cfg: ModelConfig, projection: str) -> tuple[int, int]:
    """``(N, K)`` (out, in features) of ``projection``'s weight in a model of ``cfg`` (a
    shard's config gives the shard's)."""
    dim, parts = PROJECTIONS[projection]
    sharded = sum(part_size(cfg, kind) for _, kind in parts)
    return (sharded, cfg.hidden_size) if dim == 0 else (cfg.hidden_size, sharded)


def shard_cuts(spec: ShardSpec) -> list[ShardCut]:
    """Every slice of an FP8 projection that rank ``spec.rank`` holds: one per part of
    each projection in ``PROJECTIONS``, from ``spec.rows`` (where the loader reads)."""
    return [ShardCut(spec.rank, projection, part, dim, part_size(spec.full, kind), *spec.rows(kind))
            for projection, (dim, parts) in PROJECTIONS.items() for part, kind in parts]


def fp8_shard_error(cfg: ModelConfig, world_size: int, scheme: str) -> str | None:
    """Why FP8 weights in ``scheme`` (``fp8.FP8_SCHEMES``) cannot be split over
    ``world_size`` ranks so that each holds its slice of TP=1's weights (module
    docstring), or None where they can. The model must split at all (``shard_spec``).

    Raises:
        ValueError: the model does not split over ``world_size`` (``layers.shard_spec``),
            or an unknown ``scheme``.
    """
    if scheme not in FP8_SCHEMES:
        raise ValueError(f"unknown FP8 scheme {scheme!r} (supported: {', '.join(FP8_SCHEMES)})")
    if world_size == 1:  # nothing is split
        return None
    fp8 = {p for p in PROJECTIONS if scaled_mm_fits(*projection_shape(cfg, p))}
    for rank in range(world_size):
        spec = shard_spec(cfg, rank, world_size)
        for projection in sorted(fp8):
            shape = projection_shape(spec.config, projection)
            if not scaled_mm_fits(*shape):
                return (f"{projection} of a rank is {list(shape)}, not multiples of {SCALED_MM_ALIGN} as the FP8 "
                        "products need (torch._scaled_mm), so the rank would keep it unquantized")
        if scheme == "block":
            for cut in shard_cuts(spec):
                if cut.projection in fp8 and not cut.on_blocks:
                    return f"{cut.describe()}, not a multiple of the {FP8_BLOCK}x{FP8_BLOCK} FP8 weight block"
    return None


def fp8_tp_sizes(cfg: ModelConfig, scheme: str) -> list[int]:
    """The tensor-parallel sizes (divisors of the attention heads) over which ``cfg``
    splits with FP8 weights in ``scheme``."""
    sizes = []
    for n in range(1, cfg.num_heads + 1):
        if cfg.num_heads % n:
            continue
        try:
            if fp8_shard_error(cfg, n, scheme) is None:
                sizes.append(n)
        except ValueError:  # the model itself does not split over n
            continue
    return sizes


def check_fp8_shards(cfg: ModelConfig, world_size: int, scheme: str) -> None:
    """Refuse, in one line, FP8 weights in ``scheme`` that do not split over
    ``world_size`` ranks (``fp8_shard_error``); the message names the projection, its
    size and the sizes that work.

    Raises:
        ValueError: as ``fp8_shard_error``, or the split it finds.
    """
    error = fp8_shard_error(cfg, world_size, scheme)
    if error is not None:
        sizes = ", ".join(map(str, fp8_tp_sizes(cfg, scheme)))
        raise ValueError(f"--quantization fp8 ({scheme} scales) with --tensor-parallel-size {world_size}: {error}; "
                         f"tensor parallel sizes that work for this model: {sizes}")
