"""A prompt's token ids in the form the gateway queues them for a worker and hashes them
for placement: little-endian int32 bytes (``TokenIds``).

The gateway turns the tokenizer's list into these bytes once; the same bytes go into the
stream entry (msgpack ``bin``, copied, not re-encoded id by id) and into SHA-256 for the
prefix-cache block hashes (``shared/block_hashes.py``), and the worker turns them back
into a list in one C call. Before, the gateway encoded the list twice, for msgpack and for
the hash, and the worker decoded it id by id (docs/benchmarks.md, "What placement costs
the gateway").

Raises at import on a big-endian host: ``memoryview.cast`` reads native byte order.
"""

from __future__ import annotations

import functools
import struct
import sys
from collections.abc import Iterator, Sequence
from typing import overload

if sys.byteorder != "little" or struct.calcsize("i") != 4:
    raise ImportError("inferq's token-id bytes need a little-endian host with a 4-byte C int")


@functools.lru_cache(maxsize=256)
def _int32s(num_tokens: int) -> struct.Struct:
    # A compiled Struct per length: ``Struct.pack(*ids)`` builds one argument tuple, where
    # ``struct.pack(fmt, *ids)`` first copies the ids into a list behind the format
    # (~8 µs of ~50 for 4,000 ids).
    return struct.Struct(f"<{num_tokens}i")


def token_bytes(token_ids: Sequence[int]) -> bytes:
    """``token_ids`` as little-endian int32 bytes (4 per token); a ``TokenIds``' own bytes
    as they are.

    ``struct`` is the fastest way here from a list of Python ints (~10 ns a token; array,
    numpy, pickle and marshal are all slower).

    Raises:
        struct.error: a token id outside int32.
    """
    if isinstance(token_ids, TokenIds):
        return token_ids.data
    return _int32s(len(token_ids)).pack(*token_ids)


class TokenIds(Sequence[int]):
    """Token ids held as little-endian int32 bytes (``data``): a read-only sequence of
    ints (``len``, indexing, slices as lists, iteration, ``==`` against another
    ``TokenIds`` or a list or tuple of the same ids); ``tolist()`` makes the list.

    Raises:
        ValueError: ``data`` whose length is not a multiple of 4.
    """

    __slots__ = ("data",)

    def __init__(self, data: bytes) -> None:
        if len(data) % 4:
            raise ValueError(f"token-id bytes must be whole int32s, got {len(data)} bytes")
        self.data = bytes(data)

    @classmethod
    def of(cls, token_ids: Sequence[int]) -> TokenIds:
        """``token_ids`` as ``TokenIds`` (itself when it is one already).

        Raises:
            struct.error: a token id outside int32.
        """
        return token_ids if isinstance(token_ids, TokenIds) else cls(token_bytes(token_ids))

    def tolist(self) -> list[int]:
        """The ids as a list of ints (one C call)."""
        return memoryview(self.data).cast("i").tolist()

    def __len__(self) -> int:
        return len(self.data) >> 2

    @overload
    def __getitem__(self, index: int) -> int: ...

    @overload
    def __getitem__(self, index: slice) -> list[int]: ...

    def __getitem__(self, index: int | slice) -> int | list[int]:
        view = memoryview(self.data).cast("i")
        return view[index].tolist() if isinstance(index, slice) else view[index]

    def __iter__(self) -> Iterator[int]:
        return iter(self.tolist())

    def __eq__(self, other: object) -> bool:
        if isinstance(other, TokenIds):
            return self.data == other.data
        if isinstance(other, list | tuple):
            return self.tolist() == list(other)
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"TokenIds({self.tolist()!r})"
