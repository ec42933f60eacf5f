"""Sans-IO protocol tests: frames in and out of :class:`FrameReader` without sockets, plus the batch helpers.

Nothing here opens a socket; every test drives ``feed`` or the ``writable``/``advance`` pair the I/O layer
uses, so each behaviour of the reader is pinned down independently of the node and the client.
"""

from __future__ import annotations

import random
import struct
import tracemalloc
from typing import Any

import crc32c
import msgpack
import numpy as np
import pytest

from kvtier.kvstore.wire.fields import (
    bad,
    field,
    pack_keys,
    unpack_array,
    unpack_headers,
    unpack_keys,
)
from kvtier.kvstore.wire.protocol import (
    HEADER,
    HEADER_SIZE,
    KEPT_META_BYTES,
    MAGIC,
    PROTOCOL_VERSION,
    UNSET,
    ErrorCode,
    Frame,
    FrameReader,
    Limits,
    MetaBudget,
    Op,
    ProtocolError,
    Request,
    Schemas,
    Unset,
    encode_error,
    encode_head,
    parse_header,
    parse_meta,
)

TINY = Limits(max_meta_bytes=64, max_payload_bytes=128, max_batch=8)


# -- helpers ---------------------------------------------------------------------------------------------


def raw_header(
    opcode: int = Op.MATCH,
    request_id: int = 1,
    meta_len: int = 0,
    payload_len: int = 0,
    *,
    magic: bytes = MAGIC,
    version: int = PROTOCOL_VERSION,
    flags: int = 0,
    crc: int | None = None,
) -> bytes:
    """A 32-byte header with any field set, including invalid ones; the crc is correct unless given."""
    head = HEADER.pack(magic, version, opcode, flags, request_id, meta_len, payload_len, 0)[:28]
    if crc is None:
        crc = crc32c.crc32c(head)
    return head + struct.pack("<I", crc)


def raw_frame(opcode: int, request_id: int, body: bytes, payload: bytes = b"") -> bytes:
    """A frame whose metadata section is ``body`` verbatim (so it can be something other than a map)."""
    return raw_header(opcode, request_id, len(body), len(payload)) + body + payload


def frame_bytes(opcode: int, request_id: int, meta: dict[str, Any], payload: bytes = b"") -> bytes:
    return encode_head(opcode, request_id, meta, len(payload)) + payload


def payload_of(frame: Frame) -> bytes:
    return b"" if frame.payload is None else bytes(frame.payload)


def feed_by_recv(reader: FrameReader, data: bytes, chunk_sizes: list[int]) -> list[Frame]:
    """Drive the reader the way the node and the client do: copy into ``writable()``, then ``advance``.

    Each chunk size is one simulated ``recvmsg_into`` call; it is capped by what ``writable()`` offers.
    """
    frames: list[Frame] = []
    view = memoryview(data)
    sizes = iter(chunk_sizes)
    while view:
        want = next(sizes, len(view))
        targets = reader.writable()
        assert targets, "writable() offered no buffer while input remained"
        n = 0
        for target in targets:
            take = min(len(target), len(view), want - n)
            target[:take] = view[:take]
            view = view[take:]
            n += take
            if n == want or not view:
                break
        reader.advance(n)
        frame = reader.next_frame()
        if frame is not None:
            frames.append(frame)
    return frames


# -- round trips -----------------------------------------------------------------------------------------


def test_frame_without_payload_round_trips():
    meta = {"keys": b"\x01" * 32, "klen": 16, "name": "x", "n": [1, 2, 3], "nested": {"a": None}}
    frames = FrameReader().feed(frame_bytes(Op.MATCH, 42, meta))
    assert len(frames) == 1
    frame = frames[0]
    assert (frame.opcode, frame.request_id, frame.meta, frame.payload_len) == (Op.MATCH, 42, meta, 0)
    assert frame.payload is None


def test_frame_with_payload_round_trips():
    payload = bytes(range(256)) * 10
    frames = FrameReader().feed(frame_bytes(Op.PUT_SHARDS, 2**63 + 5, {"cls": "agent"}, payload))
    assert len(frames) == 1
    frame = frames[0]
    assert (frame.opcode, frame.request_id, frame.meta) == (Op.PUT_SHARDS, 2**63 + 5, {"cls": "agent"})
    assert frame.payload_len == len(payload)
    assert payload_of(frame) == payload


def test_reply_opcode_and_error_frame_round_trip():
    reply, error = FrameReader().feed(
        frame_bytes(Op.GET_SHARDS | Op.REPLY, 9, {"st": b"\x00"}) + encode_error(10, ErrorCode.TOO_LARGE, "big")
    )
    assert reply.opcode == Op.GET_SHARDS | Op.REPLY
    assert (error.opcode, error.request_id) == (Op.ERROR, 10)
    assert error.meta == {"code": ErrorCode.TOO_LARGE, "message": "big"}


def test_byte_at_a_time_feeding_yields_each_frame_exactly_once():
    data = frame_bytes(Op.HELLO, 1, {"token": "t" * 32}) + frame_bytes(Op.PUT_SHARDS, 2, {"x": 1}, b"abcdefgh")
    reader = FrameReader()
    frames = []
    completed_at = []
    for i in range(len(data)):
        got = reader.feed(data[i : i + 1])
        frames += got
        if got:
            completed_at.append(i + 1)
    assert [f.request_id for f in frames] == [1, 2]
    first_len = len(frame_bytes(Op.HELLO, 1, {"token": "t" * 32}))
    assert completed_at == [first_len, len(data)]  # a frame completes on its last byte, not before
    assert frames[0].meta == {"token": "t" * 32}
    assert payload_of(frames[1]) == b"abcdefgh"


def test_many_frames_in_one_buffer_come_out_in_order():
    rng = random.Random(1)
    expected = []
    data = b""
    for rid in range(200):
        payload = rng.randbytes(rng.choice([0, 0, 1, 7, 300]))
        meta = {"i": rid, "b": rng.randbytes(rng.randrange(20))}
        expected.append((rid, meta, payload))
        data += frame_bytes(Op.GET_SHARDS, rid, meta, payload)
    frames = FrameReader().feed(data)
    assert [(f.request_id, f.meta, payload_of(f)) for f in frames] == expected


def test_empty_metadata_section_parses_as_empty_map():
    frames = FrameReader().feed(raw_header(Op.STAT, 3, meta_len=0, payload_len=4) + b"wxyz")
    assert len(frames) == 1
    assert frames[0].meta == {}
    assert payload_of(frames[0]) == b"wxyz"


def test_header_only_frame_completes_on_its_32nd_byte():
    reader = FrameReader()
    assert reader.feed(raw_header(Op.DELETE, 8)[:31]) == []
    frames = reader.feed(raw_header(Op.DELETE, 8)[31:])
    assert [(f.opcode, f.request_id, f.meta) for f in frames] == [(Op.DELETE, 8, {})]


def test_next_frame_returns_a_completed_frame_once():
    reader = FrameReader()
    data = frame_bytes(Op.MATCH, 5, {"a": 1})
    reader.writable()[0][:] = data[:HEADER_SIZE]
    reader.advance(HEADER_SIZE)
    assert reader.next_frame() is None
    reader.writable()[0][:] = data[HEADER_SIZE:]
    reader.advance(len(data) - HEADER_SIZE)
    frame = reader.next_frame()
    assert frame is not None and frame.request_id == 5
    assert reader.next_frame() is None


def test_writable_never_extends_past_the_current_frame():
    """A recv into ``writable()`` can never swallow bytes of the next frame."""
    meta = {"k": b"z" * 50}
    payload = b"p" * 1000
    data = frame_bytes(Op.PUT_SHARDS, 1, meta, payload)
    meta_len = len(data) - HEADER_SIZE - len(payload)
    reader = FrameReader()
    assert [len(v) for v in reader.writable()] == [HEADER_SIZE]
    reader.writable()[0][:10] = data[:10]
    reader.advance(10)
    assert [len(v) for v in reader.writable()] == [HEADER_SIZE - 10]
    reader.writable()[0][:] = data[10:HEADER_SIZE]
    reader.advance(HEADER_SIZE - 10)
    assert [len(v) for v in reader.writable()] == [meta_len]
    reader.writable()[0][:] = data[HEADER_SIZE : HEADER_SIZE + meta_len]
    reader.advance(meta_len)
    assert sum(len(v) for v in reader.writable()) == len(payload)


def test_recv_style_feeding_with_random_chunk_sizes_matches_feed():
    rng = random.Random(7)
    data = b"".join(
        frame_bytes(Op.GET_SHARDS | Op.REPLY, i, {"i": i}, rng.randbytes(rng.randrange(0, 2000))) for i in range(50)
    )
    expected = [(f.request_id, f.meta, payload_of(f)) for f in FrameReader().feed(data)]
    sizes = [rng.randrange(1, 700) for _ in range(len(data))]
    got = feed_by_recv(FrameReader(), data, sizes)
    assert [(f.request_id, f.meta, payload_of(f)) for f in got] == expected


# -- sink and discard ------------------------------------------------------------------------------------


def test_head_is_available_after_metadata_and_before_payload():
    data = frame_bytes(Op.GET_SHARDS | Op.REPLY, 77, {"lens": b"\x01\x02"}, b"x" * 100)
    reader = FrameReader()
    assert reader.head is None
    assert reader.feed(data[:-100]) == []
    head = reader.head
    assert head is not None
    assert (head.request_id, head.meta, head.payload_len) == (77, {"lens": b"\x01\x02"}, 100)
    reader.feed(data[-100:])
    assert reader.head is None


def test_sink_directs_payload_into_caller_buffers_split_across_memoryviews():
    payload = bytes(range(256)) * 4  # 1024 bytes
    data = frame_bytes(Op.GET_SHARDS | Op.REPLY, 3, {"st": b"\x00"}, payload)
    reader = FrameReader()
    assert reader.feed(data[: len(data) - len(payload)]) == []
    first = bytearray(100)
    second = np.zeros(200, dtype=np.float32)  # 800 bytes, a non-byte format the reader must cast
    big = bytearray(500)
    third = memoryview(big)[10:134]  # 124 bytes in the middle of a larger buffer
    reader.sink([memoryview(first), memoryview(bytearray(0)), memoryview(second), third])
    frames = []
    for i in range(len(data) - len(payload), len(data), 37):  # chunks straddle buffer boundaries
        frames += reader.feed(data[i : i + 37])
    assert len(frames) == 1
    assert frames[0].payload is None  # the payload went to the caller, not to a buffer of the reader's
    assert bytes(first) == payload[:100]
    assert second.tobytes() == payload[100:900]
    assert bytes(third) == payload[900:]
    assert big[:10] == bytes(10) and big[134:] == bytes(366)  # nothing written outside the views


def test_sink_buffers_are_what_writable_returns():
    data = frame_bytes(Op.GET_SHARDS | Op.REPLY, 3, {}, b"abcdefghij")
    reader = FrameReader()
    reader.feed(data[:-10])
    a, b = bytearray(4), bytearray(6)
    reader.sink([memoryview(a), memoryview(b)])
    views = reader.writable()
    assert [len(v) for v in views] == [4, 6]
    views[0][:3] = b"abc"
    reader.advance(3)
    assert [len(v) for v in reader.writable()] == [1, 6]  # the partly filled buffer resumes, not restarts
    reader.feed(b"defghij")
    assert (bytes(a), bytes(b)) == (b"abcd", b"efghij")


def test_sink_rejects_buffers_that_do_not_add_up_to_the_payload():
    reader = FrameReader()
    reader.feed(frame_bytes(Op.GET_SHARDS | Op.REPLY, 1, {}, b"x" * 10)[:-10])
    with pytest.raises(ValueError):
        reader.sink([memoryview(bytearray(9))])
    with pytest.raises(ValueError):
        reader.sink([memoryview(bytearray(6)), memoryview(bytearray(6))])
    reader.sink([memoryview(bytearray(10))])  # a failed sink() leaves the frame claimable


def test_sink_without_a_frame_head_or_twice_is_refused():
    reader = FrameReader()
    with pytest.raises(RuntimeError):
        reader.sink([memoryview(bytearray(1))])
    reader.feed(frame_bytes(Op.GET_SHARDS | Op.REPLY, 1, {}, b"x" * 10)[:-10])
    reader.sink([memoryview(bytearray(10))])
    with pytest.raises(RuntimeError):
        reader.sink([memoryview(bytearray(10))])


def test_sink_after_payload_bytes_arrived_is_refused():
    reader = FrameReader()
    reader.feed(frame_bytes(Op.GET_SHARDS | Op.REPLY, 1, {}, b"x" * 10)[:-5])
    with pytest.raises(RuntimeError):
        reader.sink([memoryview(bytearray(10))])


def test_discard_payload_drops_the_rest_and_the_next_frame_still_parses():
    payload = bytes(range(200))
    data = frame_bytes(Op.GET_SHARDS | Op.REPLY, 1, {"st": b"\x00"}, payload)
    nxt = frame_bytes(Op.MATCH | Op.REPLY, 2, {"live": b"\x01\x00"})
    reader = FrameReader()
    reader.feed(data[: len(data) - len(payload)])
    first, second, third = bytearray(b"\xee" * 50), bytearray(b"\xee" * 100), bytearray(b"\xee" * 50)
    reader.sink([memoryview(first), memoryview(second), memoryview(third)])
    assert reader.feed(payload[:70]) == []  # all of ``first`` and 20 bytes of ``second``
    reader.discard_payload(memoryview(bytearray(16)))  # scratch far smaller than what is left
    frames = reader.feed(payload[70:] + nxt)
    assert [f.request_id for f in frames] == [1, 2]
    assert frames[1].meta == {"live": b"\x01\x00"}
    assert bytes(first) == payload[:50]
    assert bytes(second) == payload[50:70] + b"\xee" * 80  # nothing written after the discard
    assert bytes(third) == b"\xee" * 50


def test_discard_payload_before_any_payload_byte_arrived():
    data = frame_bytes(Op.GET_SHARDS | Op.REPLY, 1, {}, b"q" * 1000)
    reader = FrameReader()
    reader.feed(data[:-1000])
    reader.discard_payload(memoryview(bytearray(64)))
    frames = reader.feed(data[-1000:] + frame_bytes(Op.STAT | Op.REPLY, 2, {"ok": True}, b"tail"))
    assert [f.request_id for f in frames] == [1, 2]
    assert payload_of(frames[1]) == b"tail"


def test_discard_payload_after_part_of_an_unsunk_payload_arrived():
    data = frame_bytes(Op.GET_SHARDS | Op.REPLY, 1, {}, b"q" * 1000)
    reader = FrameReader()
    reader.feed(data[:-600])  # 400 payload bytes into the reader's own buffer
    reader.discard_payload(memoryview(bytearray(128)))
    frames = reader.feed(data[-600:] + frame_bytes(Op.DELETE | Op.REPLY, 2, {"removed": 3}))
    assert [f.request_id for f in frames] == [1, 2]
    assert frames[1].meta == {"removed": 3}


def test_discard_payload_without_a_frame_in_progress_is_a_no_op():
    reader = FrameReader()
    reader.discard_payload(memoryview(bytearray(8)))
    frames = reader.feed(frame_bytes(Op.MATCH, 1, {"a": 1}, b"xyz"))
    assert payload_of(frames[0]) == b"xyz"


# -- header validation -----------------------------------------------------------------------------------


def _raises_code(code: ErrorCode, fn: Any, *args: Any) -> ProtocolError:
    with pytest.raises(ProtocolError) as info:
        fn(*args)
    assert info.value.code == code, str(info.value)
    return info.value


def test_bad_magic_raises_bad_frame():
    _raises_code(ErrorCode.BAD_FRAME, FrameReader().feed, raw_header(magic=b"HTTP"))
    _raises_code(ErrorCode.BAD_FRAME, FrameReader().feed, b"GET / HTTP/1.1\r\nHost: x\r\n\r\n" + b"\0" * 8)


def test_bad_header_crc_raises_bad_frame():
    good = raw_header(Op.MATCH, 1, 10, 0)
    bad_crc = raw_header(Op.MATCH, 1, 10, 0, crc=(struct.unpack("<I", good[28:])[0] ^ 1))
    _raises_code(ErrorCode.BAD_FRAME, FrameReader().feed, bad_crc)


def test_header_field_changed_without_crc_update_raises_bad_frame():
    head = bytearray(raw_header(Op.MATCH, 1, 10, 0))
    head[16] ^= 0x40  # meta_len
    _raises_code(ErrorCode.BAD_FRAME, FrameReader().feed, bytes(head))


@pytest.mark.parametrize("version", [0, PROTOCOL_VERSION - 1, PROTOCOL_VERSION + 1, 255])
def test_wrong_version_raises_bad_frame(version: int):
    _raises_code(ErrorCode.BAD_FRAME, FrameReader().feed, raw_header(version=version))


def test_meta_len_over_the_limit_raises_too_large():
    _raises_code(ErrorCode.TOO_LARGE, FrameReader(TINY).feed, raw_header(meta_len=TINY.max_meta_bytes + 1))


def test_payload_len_over_the_limit_raises_too_large():
    _raises_code(ErrorCode.TOO_LARGE, FrameReader(TINY).feed, raw_header(payload_len=TINY.max_payload_bytes + 1))


def test_limits_are_inclusive():
    body = msgpack.packb({"b": b"x" * (TINY.max_meta_bytes - 5)})  # fixmap, fixstr "b", bin8 header
    assert len(body) == TINY.max_meta_bytes
    frames = FrameReader(TINY).feed(raw_frame(Op.MATCH, 1, body, b"y" * TINY.max_payload_bytes))
    assert len(frames) == 1 and frames[0].payload_len == TINY.max_payload_bytes


def test_huge_payload_announcement_raises_on_the_header_alone():
    """A header announcing 2**40 payload bytes is refused as soon as its 32 bytes arrive."""
    tracemalloc.start()
    try:
        reader = FrameReader(TINY)
        with pytest.raises(ProtocolError) as info:
            reader.feed(raw_header(Op.PUT_SHARDS, 1, meta_len=0, payload_len=2**40))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert info.value.code == ErrorCode.TOO_LARGE
    assert peak < 1 << 20


@pytest.mark.parametrize(
    ("meta_len", "payload_len"),
    [(Limits().max_meta_bytes + 1, 0), (0, Limits().max_payload_bytes + 1), (2**32 - 1, 2**64 - 1)],
)
def test_oversized_header_raises_before_anything_is_allocated(meta_len: int, payload_len: int):
    """With the default limits (8 MiB metadata, 2 GiB payload) nothing near those sizes is allocated."""
    reader = FrameReader()
    tracemalloc.start()
    try:
        with pytest.raises(ProtocolError) as info:
            reader.feed(raw_header(Op.PUT_SHARDS, 1, meta_len=meta_len, payload_len=payload_len) + b"\x80")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert info.value.code == ErrorCode.TOO_LARGE
    assert peak < 1 << 20


def test_header_checks_run_in_order_magic_crc_version_sizes():
    assert "magic" in str(_raises_code(ErrorCode.BAD_FRAME, parse_header, raw_header(magic=b"XXXX", crc=0), TINY))
    assert "checksum" in str(_raises_code(ErrorCode.BAD_FRAME, parse_header, raw_header(version=9, crc=0), TINY))
    assert "version" in str(
        _raises_code(ErrorCode.BAD_FRAME, parse_header, raw_header(version=9, meta_len=10**9), TINY)
    )
    _raises_code(ErrorCode.TOO_LARGE, parse_header, raw_header(meta_len=10**9, payload_len=10**12), TINY)


def test_parse_header_returns_the_fields():
    assert parse_header(raw_header(Op.COMMIT, 99, 12, 34, flags=0), Limits()) == (Op.COMMIT, 0, 99, 12, 34)


# -- metadata validation ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "meta",
    [[1, 2, 3], 7, "text", b"bytes", None, True, 1.5],
    ids=["list", "int", "str", "bin", "nil", "bool", "float"],
)
def test_metadata_that_is_not_a_map_raises_bad_frame(meta: Any):
    _raises_code(ErrorCode.BAD_FRAME, FrameReader().feed, raw_frame(Op.MATCH, 1, msgpack.packb(meta)))


@pytest.mark.parametrize(
    "body",
    [
        b"\xc1",  # the one byte msgpack never uses
        b"\x82\xa1a\x01",  # a map announcing two entries with one present
        b"\xdb\xff\xff\xff\xff",  # str32 announcing 4 GiB
        msgpack.packb({"a": 1}) + b"\x00",  # trailing bytes after the map
        b"\x81\x01\x02",  # an integer map key
        b"\x81\x80\x02",  # a map as a map key
    ],
    ids=["reserved-byte", "truncated-map", "str32-too-long", "trailing-bytes", "int-key", "map-key"],
)
def test_metadata_that_is_not_valid_msgpack_raises_bad_frame(body: bytes):
    _raises_code(ErrorCode.BAD_FRAME, FrameReader().feed, raw_frame(Op.MATCH, 1, body))


def test_metadata_array_longer_than_max_batch_raises_bad_frame():
    body = msgpack.packb({"a": list(range(TINY.max_batch + 1))})
    _raises_code(ErrorCode.BAD_FRAME, parse_meta, body, TINY)
    assert parse_meta(msgpack.packb({"a": list(range(TINY.max_batch))}), TINY) == {"a": list(range(TINY.max_batch))}


def test_deeply_nested_metadata_raises_bad_frame():
    body = b"\x81\xa1a" * 5000 + b"\x80"  # {"a": {"a": ... {}}} nested 5,000 deep
    _raises_code(ErrorCode.BAD_FRAME, FrameReader(Limits(max_meta_bytes=1 << 20)).feed, raw_frame(Op.MATCH, 1, body))


# -- fuzzing ---------------------------------------------------------------------------------------------

FUZZ_LIMITS = Limits(max_meta_bytes=2048, max_payload_bytes=4096, max_batch=32)


def _random_value(rng: random.Random, depth: int = 0) -> Any:
    kinds = ["int", "neg", "bytes", "str", "none", "bool", "float"] + (["list", "map"] if depth < 3 else [])
    kind = rng.choice(kinds)
    if kind == "int":
        return rng.randrange(2**64)
    if kind == "neg":
        return -rng.randrange(2**63)
    if kind == "bytes":
        return rng.randbytes(rng.randrange(40))
    if kind == "str":
        return "".join(rng.choice("abcé€𝄞 ") for _ in range(rng.randrange(12)))
    if kind == "none":
        return None
    if kind == "bool":
        return rng.random() < 0.5
    if kind == "float":
        return rng.uniform(-1e9, 1e9)
    if kind == "list":
        return [_random_value(rng, depth + 1) for _ in range(rng.randrange(5))]
    return _random_meta(rng, depth + 1)


def _random_meta(rng: random.Random, depth: int = 0) -> dict[str, Any]:
    return {f"k{rng.randrange(1000)}": _random_value(rng, depth) for _ in range(rng.randrange(6))}


def _random_frame(rng: random.Random) -> tuple[int, int, dict[str, Any], bytes]:
    opcode = rng.choice(list(Op)) | (Op.REPLY if rng.random() < 0.3 else 0)
    return opcode, rng.randrange(2**64), _random_meta(rng), rng.randbytes(rng.choice([0, 0, 1, 13, 500, 4096]))


def _mutate(rng: random.Random, data: bytes) -> bytes:
    buf = bytearray(data)
    op = rng.randrange(9)
    if op == 0 and buf:  # flip a few bits anywhere
        for _ in range(rng.randrange(1, 4)):
            i = rng.randrange(len(buf))
            buf[i] ^= 1 << rng.randrange(8)
    elif op == 1 and buf:  # overwrite a run with random bytes
        i = rng.randrange(len(buf))
        buf[i : i + rng.randrange(1, 16)] = rng.randbytes(rng.randrange(1, 16))
    elif op == 2:  # truncate
        del buf[rng.randrange(len(buf) + 1) :]
    elif op == 3:  # insert random bytes
        i = rng.randrange(len(buf) + 1)
        buf[i:i] = rng.randbytes(rng.randrange(1, 40))
    elif op == 4 and buf:  # delete a slice
        i = rng.randrange(len(buf))
        del buf[i : i + rng.randrange(1, 40)]
    elif op == 5:  # duplicate a slice
        i = rng.randrange(len(buf) + 1)
        buf[i:i] = buf[i : i + rng.randrange(1, 64)]
    elif op in (6, 7) and len(buf) >= HEADER_SIZE:  # rewrite header fields, keeping the crc valid
        magic, version, opcode, flags, rid, meta_len, payload_len, _ = HEADER.unpack(bytes(buf[:HEADER_SIZE]))
        field_choice = rng.randrange(5)
        if field_choice == 0:
            meta_len = rng.choice([0, 1, meta_len - 1, meta_len + 1, rng.randrange(2**32)])
        elif field_choice == 1:
            payload_len = rng.choice([0, 1, payload_len + 1, rng.randrange(5000), rng.randrange(2**64)])
        elif field_choice == 2:
            version = rng.randrange(256)
        elif field_choice == 3:
            opcode, flags = rng.randrange(256), rng.randrange(2**16)
        else:
            magic = rng.choice([MAGIC, b"KVT\x02", rng.randbytes(4)])
        buf[:HEADER_SIZE] = raw_header(
            opcode, rid, max(meta_len, 0), max(payload_len, 0), magic=magic, version=version, flags=flags
        )
    elif op == 8 and len(buf) >= HEADER_SIZE:  # random metadata body of a consistent length
        body = rng.randbytes(rng.randrange(64))
        if rng.random() < 0.5:
            body = b"\x81\xa1k" + body  # a map header followed by junk reaches deeper into msgpack
        buf = bytearray(raw_header(Op.MATCH, 1, len(body), 0) + body)
    return bytes(buf)


def _check_stream(reader: FrameReader, data: bytes, rng: random.Random, case: str) -> None:
    """Feed ``data`` in random chunks; every outcome must be a well-formed Frame or a ProtocolError."""
    try:
        if rng.random() < 0.5:
            frames: list[Frame] = []
            i = 0
            while i < len(data):
                step = rng.choice([1, 2, 7, 32, 100, len(data)])
                frames += reader.feed(data[i : i + step])
                i += step
        else:
            frames = feed_by_recv(reader, data, [rng.randrange(1, 200) for _ in range(len(data) + 1)])
    except ProtocolError as exc:
        assert isinstance(exc.code, ErrorCode), case
        return
    except Exception as exc:  # anything else is a reader bug
        pytest.fail(f"{case}: {type(exc).__name__}: {exc} on input {data[:80].hex()}…")
    for frame in frames:
        assert isinstance(frame, Frame), case
        assert isinstance(frame.meta, dict), case
        assert 0 <= frame.payload_len <= FUZZ_LIMITS.max_payload_bytes, case
        if frame.payload_len:
            assert frame.payload is not None and len(frame.payload) == frame.payload_len, case
        else:
            assert frame.payload is None, case


def test_fuzz_random_bytes_yield_only_frames_or_protocol_errors():
    rng = random.Random(20240601)
    for case in range(600):
        n = rng.choice([1, 31, 32, 33, 64, 200, 1000])
        data = rng.randbytes(n)
        roll = rng.random()
        if roll < 0.25:  # a real magic gets past the first check
            data = MAGIC + data
        elif roll < 0.5:  # a fully valid header makes the random bytes metadata and payload
            header = raw_header(rng.randrange(256), rng.randrange(2**64), rng.randrange(200), rng.randrange(300))
            data = header + data
        _check_stream(FrameReader(FUZZ_LIMITS), data, rng, f"random case {case}")


def test_fuzz_mutated_valid_frames_yield_only_frames_or_protocol_errors():
    rng = random.Random(424242)
    for case in range(1400):
        stream = b"".join(frame_bytes(*_random_frame(rng)) for _ in range(rng.randrange(1, 4)))
        for _ in range(rng.randrange(1, 4)):
            stream = _mutate(rng, stream)
        _check_stream(FrameReader(FUZZ_LIMITS), stream, rng, f"mutation case {case}")


def test_fuzz_valid_streams_round_trip_under_random_chunking():
    rng = random.Random(99)
    for case in range(300):
        frames = [_random_frame(rng) for _ in range(rng.randrange(1, 6))]
        data = b"".join(frame_bytes(*f) for f in frames)
        sizes = [rng.randrange(1, 300) for _ in range(len(data) + 1)]
        got = feed_by_recv(FrameReader(FUZZ_LIMITS), data, sizes)
        assert [(f.opcode, f.request_id, f.meta, payload_of(f)) for f in got] == frames, f"case {case}"


# -- batch encodings (wire/fields.py) ---------------------------------------------------------------------------


def _bad_request(fn: Any, *args: Any) -> None:
    _raises_code(ErrorCode.BAD_REQUEST, fn, *args)


@pytest.mark.parametrize("klen", [16, 32])
def test_pack_and_unpack_keys_round_trip(klen: int):
    keys = [bytes([i]) * klen for i in range(5)]
    blob, got_klen = pack_keys(keys)
    assert got_klen == klen
    assert unpack_keys({"keys": blob, "klen": klen}, max_batch=5) == keys


def test_pack_keys_of_no_keys_is_empty():
    blob, klen = pack_keys([])
    assert unpack_keys({"keys": blob, "klen": klen}, max_batch=1) == []


def test_pack_keys_rejects_mixed_or_bad_lengths():
    with pytest.raises(ValueError):
        pack_keys([b"a" * 16, b"b" * 32])
    with pytest.raises(ValueError):
        pack_keys([b"a" * 8])


@pytest.mark.parametrize("blob_len", [1, 15, 17, 33, 47])
def test_unpack_keys_rejects_blob_not_a_multiple_of_klen(blob_len: int):
    _bad_request(unpack_keys, {"keys": b"k" * blob_len, "klen": 16}, 100)


def test_unpack_keys_rejects_32_byte_blob_remainder():
    _bad_request(unpack_keys, {"keys": b"k" * 48, "klen": 32}, 100)


@pytest.mark.parametrize("klen", [0, 1, 8, 15, 17, 24, 64, -16])
def test_unpack_keys_rejects_key_length_other_than_16_or_32(klen: int):
    _bad_request(unpack_keys, {"keys": b"k" * 64, "klen": klen}, 100)


def test_unpack_keys_rejects_batch_above_max_batch():
    _bad_request(unpack_keys, {"keys": b"k" * 16 * 9, "klen": 16}, 8)
    assert len(unpack_keys({"keys": b"k" * 16 * 8, "klen": 16}, 8)) == 8


@pytest.mark.parametrize(
    "meta",
    [
        {"klen": 16},
        {"keys": b"k" * 16},
        {"keys": "k" * 16, "klen": 16},
        {"keys": b"k" * 16, "klen": "16"},
        {"keys": b"k" * 16, "klen": 16.0},
        {"keys": b"k" * 16, "klen": True},
        {"keys": [b"k" * 16], "klen": 16},
    ],
    ids=["no-keys", "no-klen", "keys-str", "klen-str", "klen-float", "klen-bool", "keys-list"],
)
def test_unpack_keys_rejects_missing_or_mistyped_fields(meta: dict[str, Any]):
    _bad_request(unpack_keys, meta, 100)


@pytest.mark.parametrize(("dtype", "n", "values"), [("u1", 3, 2), ("u1", 3, 4), ("<u4", 2, 3), ("<u8", 4, 0)])
def test_unpack_array_rejects_length_mismatch(dtype: str, n: int, values: int):
    blob = np.zeros(values, dtype=dtype).tobytes()
    _bad_request(unpack_array, {"idx": blob}, "idx", dtype, n)


def test_unpack_array_returns_the_values():
    arr = unpack_array({"lens": np.array([1, 2, 70000], dtype="<u4").tobytes()}, "lens", "<u4", 3)
    assert arr.tolist() == [1, 2, 70000]


def test_unpack_array_rejects_missing_or_mistyped_field():
    _bad_request(unpack_array, {}, "idx", "u1", 0)
    _bad_request(unpack_array, {"idx": [0, 1]}, "idx", "u1", 2)


@pytest.mark.parametrize(("dtype", "blob_len", "n"), [("<u4", 5, 1), ("<u8", 12, 1), ("<u4", 3, 0)])
def test_unpack_array_rejects_blob_not_a_multiple_of_the_item_size(dtype: str, blob_len: int, n: int):
    _bad_request(unpack_array, {"lens": b"\x01" * blob_len}, "lens", dtype, n)


def test_unpack_headers_absent_means_none_per_entry():
    assert unpack_headers({}, 3) == [None, None, None]


@pytest.mark.parametrize(
    "hdr", [b"h" * 15, b"h" * 33, "h" * 32, [b"h" * 16, b"h" * 16]], ids=["short", "long", "str", "list"]
)
def test_unpack_headers_rejects_wrong_length_or_type(hdr: Any):
    _bad_request(unpack_headers, {"hdr": hdr}, 2)


def test_field_rejects_bool_where_int_is_expected():
    _bad_request(field, {"x": False}, "x", int)
    assert field({"x": 0}, "x", int) == 0


def test_bad_builds_a_bad_request_error():
    exc = bad("nope")
    assert isinstance(exc, ProtocolError) and exc.code == ErrorCode.BAD_REQUEST and str(exc) == "nope"


# -- metadata as it arrives: growth, budget, typed schemas -------------------------------------------------


def test_a_metadata_buffer_grows_with_the_bytes_that_arrive_not_with_the_announced_length():
    reader = FrameReader()
    tracemalloc.start()
    try:
        reader.feed(raw_header(Op.MATCH, 1, meta_len=8 << 20) + b"\x81" + bytes(1000))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert reader.in_frame
    assert peak < 256 << 10, f"{peak} bytes allocated for 1 KiB of an announced 8 MiB"


def test_metadata_arriving_in_pieces_across_growth_steps_decodes_whole():
    meta = {"keys": bytes(range(256)) * 1024, "klen": 16}  # 256 KiB: four growth steps
    data = frame_bytes(Op.MATCH, 7, meta)
    reader = FrameReader()
    frames = [f for i in range(0, len(data), 3001) for f in reader.feed(data[i : i + 3001])]
    assert [(f.request_id, f.meta) for f in frames] == [(7, meta)]


def test_a_reader_over_its_servers_metadata_budget_raises_busy_and_gives_back_what_it_took():
    budget = MetaBudget(300 << 10)
    first, second = FrameReader(budget=budget), FrameReader(budget=budget)
    first.feed(raw_header(Op.MATCH, 1, meta_len=1 << 20) + bytes(150 << 10))  # a 256 KiB buffer by now
    with pytest.raises(ProtocolError) as info:
        first.feed(bytes(120 << 10))  # would need 512 KiB
    assert info.value.code == ErrorCode.BUSY and info.value.request_id == 1
    second.feed(raw_header(Op.MATCH, 2, meta_len=40 << 10) + bytes(20 << 10))
    assert budget.used_bytes == (256 << 10) + (40 << 10)
    first.close()
    second.close()
    assert budget.used_bytes == 0


def test_a_decoded_frame_gives_a_metadata_buffer_larger_than_a_kept_one_back_to_the_budget():
    budget = MetaBudget(1 << 20)
    reader = FrameReader(budget=budget)
    assert len(reader.feed(frame_bytes(Op.MATCH, 1, {"keys": bytes(KEPT_META_BYTES), "klen": 16}))) == 1
    assert budget.used_bytes == 0


def test_small_frames_in_turn_decode_whole_in_one_kept_buffer_charged_until_the_reader_closes():
    budget = MetaBudget(1 << 20)
    reader = FrameReader(budget=budget)
    metas = [{"keys": bytes([i]) * n, "klen": 16} for i, n in enumerate((3000, 96, 2000, 0))]
    data = b"".join(frame_bytes(Op.MATCH, i, meta) for i, meta in enumerate(metas))
    frames = [f for at in range(0, len(data), 700) for f in reader.feed(data[at : at + 700])]
    assert [(f.request_id, f.meta) for f in frames] == list(enumerate(metas))
    assert 0 < budget.used_bytes <= KEPT_META_BYTES  # the first frame's buffer, kept: the others took nothing
    reader.close()
    assert budget.used_bytes == 0


def test_a_head_taken_whole_completes_a_frame_without_payload_and_leaves_a_payload_to_arrive():
    reader = FrameReader()
    frame = reader.take_head(encode_head(Op.MATCH | Op.REPLY, 5, {"live": b"\x01\x00"}))
    assert frame is not None and (frame.request_id, frame.meta) == (5, {"live": b"\x01\x00"})
    assert reader.take_head(encode_head(Op.GET_SHARDS | Op.REPLY, 6, {"st": b"\x00"}, 3)) is None
    [frame] = reader.feed(b"abc")  # the payload, as the poll loop receives it
    assert (frame.request_id, payload_of(frame)) == (6, b"abc")


def test_a_head_taken_whole_must_hold_exactly_its_metadata():
    head = encode_head(Op.MATCH | Op.REPLY, 7, {"live": b"\x01"})
    for wrong in (head[:-1], head + b"x"):
        assert _raises_code(ErrorCode.BAD_FRAME, FrameReader().take_head, wrong).request_id == 7
    reader = FrameReader()
    reader.feed(head[:10])
    with pytest.raises(RuntimeError, match="between frames"):
        reader.take_head(head)


class _Lookup(Request):
    keys: bytes | Unset = UNSET
    klen: int | Unset = UNSET


LOOKUPS = Schemas({Op.MATCH: _Lookup})


def test_a_schema_hands_on_the_fields_present():
    frames = FrameReader(schemas=LOOKUPS).feed(frame_bytes(Op.MATCH, 3, {"keys": b"k" * 16}))
    assert frames[0].meta == {"keys": b"k" * 16}


@pytest.mark.parametrize(
    ("meta", "code"),
    [
        ({"keys": [b"k"]}, ErrorCode.BAD_REQUEST),  # a list where bytes belong
        ({"keys": b"k", "extra": 1}, ErrorCode.BAD_REQUEST),  # a field the op does not have
        ({"klen": "16"}, ErrorCode.BAD_REQUEST),
    ],
    ids=["wrong-type", "unknown-field", "str-for-int"],
)
def test_metadata_that_does_not_fit_its_ops_schema_is_a_bad_request_naming_the_op(meta: dict[str, Any], code):
    error = _raises_code(code, FrameReader(schemas=LOOKUPS).feed, frame_bytes(Op.MATCH, 4, meta))
    assert "MATCH" in str(error) and error.request_id == 4


def test_an_opcode_without_a_schema_is_a_bad_request():
    _raises_code(ErrorCode.BAD_REQUEST, FrameReader(schemas=LOOKUPS).feed, frame_bytes(Op.STAT, 5, {}))


def test_a_msgpack_bomb_against_a_schema_is_refused_without_building_it():
    bomb = b"\xde\x00\x02\xa4keys\xc4\x01k\xa1x\xdd" + (1 << 20).to_bytes(4, "big") + b"\x90" * (1 << 20)
    tracemalloc.start()
    try:
        _raises_code(ErrorCode.BAD_REQUEST, FrameReader(schemas=LOOKUPS).feed, raw_frame(Op.MATCH, 1, bomb))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 8 << 20, f"{peak} bytes for 1 MiB of nested arrays (a list each: ~60 MiB)"
