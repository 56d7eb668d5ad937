"""``shared/token_ids.py``: a prompt's ids as little-endian int32 bytes, as the gateway
queues them (``GenerateRequest.prompt_token_ids``, protocol version 3) and hashes them
for placement."""

from __future__ import annotations

import struct

import msgspec
import pytest

from shared import protocol
from shared.block_hashes import block_hashes, sampled_block_hashes
from shared.protocol import GenerateRequest, ProtocolError
from shared.sampling import SamplingParams
from shared.token_ids import TokenIds, token_bytes

IDS = [0, 1, 127, 128, 65535, 65536, 151_000, 2**31 - 1]


def _request(prompt: object) -> GenerateRequest:
    return GenerateRequest(request_id="r", model="m", prompt_token_ids=prompt, sampling=SamplingParams(),  # type: ignore[arg-type]
                           reply_channel="c", deadline_unix_s=1.0)


def test_token_ids_are_int32_bytes_and_a_sequence_of_ints() -> None:
    t = TokenIds.of(IDS)
    assert t.data == struct.pack(f"<{len(IDS)}i", *IDS) == token_bytes(IDS)
    assert token_bytes(t) is t.data and TokenIds.of(t) is t
    assert len(t) == len(IDS) and t.tolist() == IDS and list(t) == IDS
    assert t[0] == 0 and t[-1] == 2**31 - 1 and t[2:4] == [127, 128]
    assert t == IDS and t == tuple(IDS) and t == TokenIds.of(IDS) and t != IDS[:-1]
    assert not TokenIds(b"") and len(TokenIds(b"")) == 0
    with pytest.raises(ValueError):
        TokenIds(b"\x01\x02\x03")
    with pytest.raises(struct.error):
        TokenIds.of([2**31])


def test_generate_request_carries_its_prompt_as_bytes_on_the_wire() -> None:
    """A list given to the struct becomes ``TokenIds``; the entry holds the int32 bytes as
    one msgpack bin (not an array of ints) and decodes back equal."""
    request = _request(IDS)
    assert isinstance(request.prompt_token_ids, TokenIds)
    payload = protocol.encode(request)
    raw = msgspec.msgpack.decode(payload)
    assert raw["prompt_token_ids"] == token_bytes(IDS) and raw["v"] == protocol.PROTOCOL_VERSION == 3
    back = protocol.decode(payload)
    assert back == request and back.prompt_token_ids.tolist() == IDS
    # Failover's continuation keeps them.
    assert msgspec.structs.replace(back, attempt=1).prompt_token_ids == IDS


def test_a_prompt_that_is_not_whole_int32_bytes_is_refused() -> None:
    raw = msgspec.msgpack.decode(protocol.encode(_request(IDS)))
    for bad in ([1, 2, 3], b"\x01\x02\x03", "abc"):
        with pytest.raises(ProtocolError):
            protocol.decode(msgspec.msgpack.encode({**raw, "prompt_token_ids": bad}))


def test_hashes_of_token_ids_equal_those_of_the_list() -> None:
    ids = [(7 * i) % 50_000 for i in range(1000)]
    t = TokenIds.of(ids)
    assert block_hashes(t, 16) == block_hashes(ids, 16)
    for with_tail in (False, True):
        assert sampled_block_hashes(t, 16, 8, with_tail, num_tokens=999) == \
            sampled_block_hashes(ids, 16, 8, with_tail, num_tokens=999)
