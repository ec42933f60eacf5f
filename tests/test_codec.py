"""RS(10, 2) codec: recovery from every loss pattern, backend interoperability, input validation."""

from itertools import combinations

import numpy as np
import pytest

from kvtier.kvstore import codec as codec_mod
from kvtier.kvstore.codec import (
    DATA_SHARDS,
    PARITY_SHARDS,
    TOTAL_SHARDS,
    Codec,
    CodecUnavailableError,
    available_backends,
    shard_size,
)

BACKENDS = available_backends()
SIZES = [1, 7, 10, 11, 1000, 65537, (1 << 20) + 3]
LOSSES = [(i,) for i in range(TOTAL_SHARDS)] + list(combinations(range(TOTAL_SHARDS), 2))

# Parity of KAT_BLOCK under ISA-L's gf_gen_cauchy1_matrix(12, 10) over GF(2^8)/0x11d; pyeclib's
# liberasurecode ("isa_l_rs_cauchy", k=10, m=2) produces the same fragment payloads.
KAT_BLOCK = bytes((i * 37 + 11) % 256 for i in range(160))
KAT_PARITY = ("280848af3eded92afde80bf52bdb99ff", "29ffe7211a2d532b0a47858dd851bd08")


def random_block(size: int, seed: int = 0) -> bytes:
    return np.random.default_rng(seed).bytes(size)


def test_shard_size_is_a_tenth_rounded_up_and_at_least_one():
    assert [shard_size(n) for n in (0, 1, 10, 11, 100, 101)] == [1, 1, 1, 2, 10, 11]


def test_numpy_backend_is_always_available():
    assert BACKENDS[-1] == "numpy"


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("size", SIZES)
def test_every_loss_of_one_or_two_shards_is_recovered(backend, size):
    codec = Codec(backend)
    block = random_block(size)
    shards = codec.encode(block)
    for lost in LOSSES:
        present = {i: s for i, s in enumerate(shards) if i not in lost}
        want = {i: bytearray(shard_size(size)) for i in lost}
        codec.reconstruct(present, want)
        assert {i: bytes(b) for i, b in want.items()} == {i: shards[i] for i in lost}, f"lost {lost}"
        assert codec.decode(present, size) == block, f"lost {lost}"


@pytest.mark.parametrize("backend", BACKENDS)
def test_encode_splits_block_into_zero_padded_data_shards(backend):
    block = random_block(23)
    shards = Codec(backend).encode(block)
    assert len(shards) == TOTAL_SHARDS
    assert all(len(s) == 3 for s in shards)
    assert b"".join(shards[:DATA_SHARDS]) == block + bytes(7)


@pytest.mark.parametrize("backend", BACKENDS)
def test_known_answer_parity(backend):
    shards = Codec(backend).encode(KAT_BLOCK)
    assert (shards[10].hex(), shards[11].hex()) == KAT_PARITY


@pytest.mark.parametrize("size", [1, 11, 4101, 65537])
def test_backends_produce_identical_parity(size):
    if len(BACKENDS) < 2:
        pytest.skip("only one backend loads here")
    block = random_block(size, seed=size)
    parities = {name: Codec(name).encode(block)[DATA_SHARDS:] for name in BACKENDS}
    assert all(p == parities["numpy"] for p in parities.values()), list(parities)


@pytest.mark.parametrize("encoder", BACKENDS)
def test_shards_encoded_by_one_backend_decode_on_every_other(encoder):
    block = random_block(5003)
    shards = Codec(encoder).encode(block)
    present = {i: s for i, s in enumerate(shards) if i not in (0, 7)}
    for decoder in BACKENDS:
        assert Codec(decoder).decode(present, len(block)) == block, decoder


@pytest.mark.parametrize("backend", BACKENDS)
def test_encode_parity_accepts_read_only_memoryview_slices(backend):
    codec = Codec(backend)
    size = 4099
    block = random_block(DATA_SHARDS * size)
    view = memoryview(block)
    assert view.readonly
    parity = [bytearray(size) for _ in range(PARITY_SHARDS)]
    codec.encode_parity([view[i * size : (i + 1) * size] for i in range(DATA_SHARDS)], parity)
    assert [bytes(p) for p in parity] == codec.encode(block)[DATA_SHARDS:]


@pytest.mark.parametrize("backend", BACKENDS)
def test_encode_parity_writes_into_numpy_arrays_and_memoryview_slices(backend):
    codec = Codec(backend)
    block = random_block(DATA_SHARDS * 64)
    data = np.frombuffer(block, np.uint8).reshape(DATA_SHARDS, 64)
    out = np.zeros(PARITY_SHARDS * 64, np.uint8)
    view = memoryview(out)
    codec.encode_parity(list(data), [view[:64], view[64:]])
    assert [out[:64].tobytes(), out[64:].tobytes()] == codec.encode(block)[DATA_SHARDS:]


@pytest.mark.parametrize("backend", BACKENDS)
def test_encode_parity_at_encodes_every_stripe_of_a_pointer_table(backend):
    codec = Codec(backend)
    blocks = [np.frombuffer(random_block(DATA_SHARDS * size, seed=size), np.uint8) for size in (1, 64, 6554)]
    parity = [np.zeros(PARITY_SHARDS * block.nbytes // DATA_SHARDS, np.uint8) for block in blocks]
    sizes = np.asarray([block.nbytes // DATA_SHARDS for block in blocks])
    table = np.asarray(
        [
            [block.ctypes.data + i * size for i in range(DATA_SHARDS)] + [out.ctypes.data, out.ctypes.data + size]
            for block, out, size in zip(blocks, parity, sizes.tolist(), strict=True)
        ]
    )
    codec.encode_parity_at(table, sizes)
    for block, out in zip(blocks, parity, strict=True):
        assert out.tobytes() == b"".join(codec.encode(block.tobytes())[DATA_SHARDS:])
    with pytest.raises(ValueError, match="pointer table"):
        codec.encode_parity_at(table[:, :DATA_SHARDS], sizes)
    with pytest.raises(ValueError, match="between 1"):
        codec.encode_parity_at(table, sizes * 0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_reconstruct_recomputes_wanted_shards_that_are_also_present(backend):
    codec = Codec(backend)
    shards = codec.encode(random_block(999))
    want = {0: bytearray(100), 11: bytearray(100)}
    codec.reconstruct(dict(enumerate(shards)), want)
    assert (bytes(want[0]), bytes(want[11])) == (shards[0], shards[11])


@pytest.mark.parametrize("backend", BACKENDS)
def test_reconstruct_matches_buffers_to_indices_whatever_the_mapping_order(backend):
    codec = Codec(backend)
    shards = codec.encode(random_block(1234))
    present = {i: shards[i] for i in reversed(range(TOTAL_SHARDS)) if i not in (3, 5)}
    want = {10: bytearray(124), 5: bytearray(124), 3: bytearray(124)}
    codec.reconstruct(present, want)
    assert {i: bytes(b) for i, b in want.items()} == {i: shards[i] for i in want}


@pytest.mark.parametrize("backend", BACKENDS)
def test_reconstruct_with_fewer_than_ten_shards_raises(backend):
    codec = Codec(backend)
    shards = codec.encode(random_block(100))
    present = {i: shards[i] for i in range(3, TOTAL_SHARDS)}
    with pytest.raises(ValueError, match="at least 10 of 12 shards"):
        codec.reconstruct(present, {0: bytearray(10), 1: bytearray(10), 2: bytearray(10)})


def test_decode_with_fewer_than_ten_shards_raises():
    codec = Codec("numpy")
    shards = codec.encode(random_block(100))
    with pytest.raises(ValueError, match="at least 10 shards"):
        codec.decode({i: shards[i] for i in range(9)}, 100)


@pytest.mark.parametrize("backend", BACKENDS)
def test_encode_parity_with_mismatched_sizes_raises(backend):
    data = [bytes(16)] * 9 + [bytes(15)]
    with pytest.raises(ValueError, match="differ in size"):
        Codec(backend).encode_parity(data, [bytearray(16), bytearray(16)])
    with pytest.raises(ValueError, match="differ in size"):
        Codec(backend).encode_parity([bytes(16)] * 10, [bytearray(17), bytearray(17)])


@pytest.mark.parametrize("backend", BACKENDS)
def test_reconstruct_with_mismatched_sizes_raises(backend):
    codec = Codec(backend)
    shards = codec.encode(random_block(100))
    present = {i: shards[i] for i in range(2, TOTAL_SHARDS)}
    with pytest.raises(ValueError, match="differ in size"):
        codec.reconstruct(present, {0: bytearray(10), 1: bytearray(11)})
    with pytest.raises(ValueError, match="differ in size"):
        codec.reconstruct({**present, 11: shards[11] + b"\0"}, {0: bytearray(10)})


def test_decode_with_shards_of_the_wrong_size_for_the_block_raises():
    codec = Codec("numpy")
    shards = codec.encode(random_block(100))
    with pytest.raises(ValueError, match="11-byte shards"):
        codec.decode(dict(enumerate(shards)), 101)


@pytest.mark.parametrize("backend", BACKENDS)
def test_unusable_buffers_raise(backend):
    codec = Codec(backend)
    with pytest.raises(ValueError, match="need 10 data and 2 parity shards"):
        codec.encode_parity([bytes(8)] * 9, [bytearray(8), bytearray(8)])
    with pytest.raises(ValueError, match="writable"):
        codec.encode_parity([bytes(8)] * 10, [bytearray(8), bytes(8)])
    with pytest.raises(ValueError, match="C-contiguous"):
        codec.encode_parity([memoryview(bytes(16))[::2]] * 10, [bytearray(8), bytearray(8)])
    with pytest.raises(ValueError, match="between 1 and"):
        codec.encode_parity([b""] * 10, [bytearray(), bytearray()])
    with pytest.raises(ValueError, match=r"indices must be in 0\.\.11"):
        codec.reconstruct({i: bytes(8) for i in range(1, 13)}, {0: bytearray(8)})


def test_unknown_backend_raises():
    with pytest.raises(ValueError, match="unknown codec backend"):
        Codec("gf-complete")


def test_env_var_forces_backend(monkeypatch):
    monkeypatch.setenv("KVTIER_CODEC", "numpy")
    assert Codec().backend == "numpy"


def test_without_env_var_the_fastest_available_backend_is_chosen(monkeypatch):
    monkeypatch.delenv("KVTIER_CODEC", raising=False)
    assert Codec().backend == BACKENDS[0]


def test_forcing_an_unavailable_backend_raises(monkeypatch):
    monkeypatch.setattr(codec_mod, "_load", lambda backend: f"{backend} is not installed")
    monkeypatch.setenv("KVTIER_CODEC", "isal")
    with pytest.raises(CodecUnavailableError, match="isal is not installed"):
        Codec()


def test_buffer_addresses_match_numpy():
    owner = np.arange(64, dtype=np.uint8)
    buffers = [bytes(range(40)), memoryview(bytes(50))[3:13], bytearray(7), memoryview(bytearray(20))[5:], owner[8:]]
    views = [memoryview(b) for b in buffers]
    expected = [np.frombuffer(v, np.uint8).ctypes.data for v in views]
    assert codec_mod._pointers(views) == np.array(expected, np.uintp).tobytes()
