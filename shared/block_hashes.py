"""Prefix-cache block hashes: the one definition that the worker's block manager (what it
caches) and the gateway's placement (where a prompt's prefix is cached) both compute, so
a hash a worker announces in its KV events means the same tokens to every gateway.

Block ``i`` of a token sequence (tokens ``[i * block_size, (i + 1) * block_size)``) is
named by a 128-bit BLAKE2b digest of its parent block's hash followed by its own tokens
(``chain_hash``), the first block's parent being a digest of a domain prefix and the
block size (``root_hash``): the chained hash of vLLM's automatic prefix caching. A
block's hash thus depends on every block before it: two prompts that share block ``i``'s
tokens but not the blocks before it never share its hash.

BLAKE2b and 128 bits: a collision would serve one prompt another prompt's KV (possibly
another tenant's), so the hash must resist chosen inputs (vLLM moved its prefix cache
to SHA-256 for the same reason); Python's ``hash`` or a polynomial hash would not.

Tokens are hashed as little-endian int32 (every vocabulary fits).
"""

from __future__ import annotations

import hashlib
import sys
from array import array
from collections.abc import Sequence

#: Bytes of one block hash (BLAKE2b digest size).
HASH_BYTES = 16
#: Prefix of the hashed stream; the version changes when the definition does.
_DOMAIN = b"inferq-kv-1:"

assert array("i").itemsize == 4


def _token_bytes(token_ids: Sequence[int]) -> bytes:
    buf = array("i", token_ids)
    if sys.byteorder != "little":
        buf.byteswap()
    return buf.tobytes()


class BlockHasher:
    """The block hashes of one growing token sequence, computed once each, in order.

    ``hashes[i]`` is the hash of block ``i``. ``extend(token_ids, num_blocks)`` hashes
    the blocks from ``len(hashes)`` up to ``num_blocks`` (``token_ids`` must hold at
    least ``num_blocks * block_size`` tokens, and its first blocks must be those already
    hashed: the sequence only grows).
    """

    __slots__ = ("_root", "block_size", "hashes")

    def __init__(self, block_size: int) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.block_size = block_size
        self.hashes: list[bytes] = []
        self._root = root_hash(block_size)

    def extend(self, token_ids: Sequence[int], num_blocks: int) -> list[bytes]:
        """Hash blocks ``len(hashes) .. num_blocks - 1``; returns ``hashes``.

        Raises:
            ValueError: ``token_ids`` holds fewer than ``num_blocks * block_size`` tokens.
        """
        out = self.hashes
        first = len(out)
        if num_blocks <= first:
            return out
        bs = self.block_size
        if len(token_ids) < num_blocks * bs:
            raise ValueError(f"{len(token_ids)} tokens hold fewer than {num_blocks} blocks of {bs}")
        data = _token_bytes(token_ids[first * bs:num_blocks * bs])
        step = 4 * bs
        parent = out[-1] if out else self._root
        blake = hashlib.blake2b
        for offset in range(0, len(data), step):
            parent = blake(parent + data[offset:offset + step], digest_size=HASH_BYTES).digest()
            out.append(parent)
        return out


def root_hash(block_size: int) -> bytes:
    """The parent hash of a sequence's first block: a digest of the domain prefix and
    ``block_size``, so hashes made with different block sizes never meet."""
    return hashlib.blake2b(_DOMAIN + block_size.to_bytes(4, "little"), digest_size=HASH_BYTES).digest()


def chain_hash(parent: bytes, block_token_ids: Sequence[int]) -> bytes:
    """The hash of one full block whose parent block hashes to ``parent`` (``root_hash``
    for the first block): BLAKE2b-128 of ``parent`` followed by the block's tokens."""
    return hashlib.blake2b(parent + _token_bytes(block_token_ids), digest_size=HASH_BYTES).digest()


def block_hashes(token_ids: Sequence[int], block_size: int) -> list[bytes]:
    """Hashes of every full block of ``token_ids`` (``len(token_ids) // block_size`` of
    them, ``HASH_BYTES`` bytes each), as ``BlockHasher`` computes them.

    Raises:
        ValueError: ``block_size`` not positive.
    """
    hasher = BlockHasher(block_size)
    return hasher.extend(token_ids, len(token_ids) // block_size)
