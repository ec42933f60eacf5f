"""Reed-Solomon RS(10, 2) erasure codec over GF(2^8) for KV-cache blocks.

A block of ``L`` bytes is cut into ``DATA_SHARDS`` data shards of ``S = shard_size(L)`` bytes (the last
ones zero-padded) and extended with ``PARITY_SHARDS`` parity shards of ``S`` bytes; any ``DATA_SHARDS``
of the ``TOTAL_SHARDS`` shards rebuild the block.

The code is fixed, because clients on different backends must interoperate: it is ISA-L's
``gf_gen_cauchy1_matrix(a, 12, 10)`` (identity on the data rows; parity row ``i`` in {10, 11}, column ``j``
holds ``gf_inv(i ^ j)``) over GF(2^8) with ISA-L's field polynomial 0x11d. Every backend yields the same
bytes:

* ``"isal"``: the system's ISA-L (``libisal``, e.g. Debian's ``libisal2``) through ctypes;
* ``"isal-pyeclib"``: the ISA-L copy bundled in the pyeclib wheel (``site-packages/pyeclib.libs``);
* ``"numpy"``: a portable, much slower implementation with multiplication tables.

The ISA-L calls run without the GIL. Shard buffers are any C-contiguous objects that support the buffer
protocol (bytes, bytearray, memoryview slices, numpy arrays); they are used in place, never copied.
"""

import ctypes
import ctypes.util
import functools
import importlib.util
import os
import struct
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from operator import attrgetter
from pathlib import Path
from typing import Protocol, TypeAlias

import numpy as np

from kvtier.kvstore import _native

__all__ = [
    "BACKENDS",
    "DATA_SHARDS",
    "PARITY_SHARDS",
    "TOTAL_SHARDS",
    "Buffer",
    "Codec",
    "CodecUnavailableError",
    "WritableBuffer",
    "available_backends",
    "default_codec",
    "shard_size",
]

DATA_SHARDS = 10
PARITY_SHARDS = 2
TOTAL_SHARDS = DATA_SHARDS + PARITY_SHARDS

BACKENDS = ("isal-pyeclib", "isal", "numpy")
"""Backend names, fastest first: the order in which ``Codec()`` tries them. The ISA-L inside the pyeclib
wheel (2.32, with GFNI/AVX-512 code) measured twice as fast here as Debian's libisal2 (2.30)."""

ENV_VAR = "KVTIER_CODEC"
"""Environment variable that forces a backend for ``Codec()`` and ``default_codec()``."""

Buffer: TypeAlias = bytes | bytearray | memoryview | np.ndarray
"""A C-contiguous object supporting the buffer protocol."""
WritableBuffer: TypeAlias = bytearray | memoryview | np.ndarray
"""A writable, C-contiguous object supporting the buffer protocol."""

_MAX_SHARD = 2**31 - 1  # ISA-L takes the shard length as a C int
_ALL_INDICES = frozenset(range(TOTAL_SHARDS))
_PTR_SIZE = ctypes.sizeof(ctypes.c_void_p)


class CodecUnavailableError(RuntimeError):
    """The requested backend cannot be loaded on this machine."""


def shard_size(block_len: int) -> int:
    """Bytes per shard for a block of ``block_len`` bytes: ``ceil(block_len / 10)``, at least 1.

    Data shard ``i`` is ``block[i*S:(i+1)*S]``, zero-padded to ``S`` bytes. Raises ValueError if
    ``block_len`` is negative.
    """
    if block_len < 0:
        raise ValueError(f"block length must be >= 0, got {block_len}")
    return max(1, -(-block_len // DATA_SHARDS))


# --- GF(2^8) arithmetic in Python: the numpy backend, and decode rows for parity shards -----------------

_GF_POLY = 0x11D


def _gf_exp_log() -> tuple[list[int], list[int]]:
    exp, log = [0] * 510, [0] * 256
    x = 1
    for i in range(255):
        exp[i] = exp[i + 255] = x
        log[x] = i
        x <<= 1
        if x & 0x100:
            x ^= _GF_POLY
    return exp, log


_GF_EXP, _GF_LOG = _gf_exp_log()


def _gf_mul(a: int, b: int) -> int:
    return _GF_EXP[_GF_LOG[a] + _GF_LOG[b]] if a and b else 0


def _gf_inv(a: int) -> int:
    return _GF_EXP[255 - _GF_LOG[a]]


def _gf_mul_table() -> np.ndarray:
    """256x256 table: ``table[a][b] == a * b`` in GF(2^8)."""
    exp, log = np.array(_GF_EXP, np.uint8), np.array(_GF_LOG, np.intp)
    table = exp[log[:, None] + log[None, :]]
    table[0, :] = table[:, 0] = 0
    return table


_Matrix: TypeAlias = list[list[int]]


def _cauchy_matrix() -> _Matrix:
    """ISA-L's ``gf_gen_cauchy1_matrix(a, TOTAL_SHARDS, DATA_SHARDS)`` as rows."""
    identity = [[int(i == j) for j in range(DATA_SHARDS)] for i in range(DATA_SHARDS)]
    cauchy = [[_gf_inv(i ^ j) for j in range(DATA_SHARDS)] for i in range(DATA_SHARDS, TOTAL_SHARDS)]
    return identity + cauchy


def _gf_invert(matrix: _Matrix) -> _Matrix:
    """Inverse of a square matrix over GF(2^8) by Gauss-Jordan elimination; ValueError if singular."""
    n = len(matrix)
    rows = [[*row, *(int(i == j) for j in range(n))] for i, row in enumerate(matrix)]
    for col in range(n):
        pivot = next((r for r in range(col, n) if rows[r][col]), None)
        if pivot is None:
            raise ValueError("matrix is singular over GF(2^8)")
        rows[col], rows[pivot] = rows[pivot], rows[col]
        scale = _gf_inv(rows[col][col])
        rows[col] = [_gf_mul(scale, x) for x in rows[col]]
        for r in range(n):
            factor = rows[r][col]
            if r != col and factor:
                rows[r] = [x ^ _gf_mul(factor, y) for x, y in zip(rows[r], rows[col], strict=True)]
    return [row[n:] for row in rows]


def _gf_row_times(row: Sequence[int], matrix: _Matrix) -> list[int]:
    """The row vector ``row`` times ``matrix`` over GF(2^8)."""
    out = [0] * len(matrix[0])
    for coef, mrow in zip(row, matrix, strict=True):
        if coef:
            out = [acc ^ _gf_mul(coef, x) for acc, x in zip(out, mrow, strict=True)]
    return out


# --- Buffer addresses ------------------------------------------------------------------------------------


def _view_buf_offset() -> int | None:
    """Offset of ``Py_buffer.buf`` inside a CPython ``memoryview`` object, or None if not confirmed.

    No public Python API yields the address of a read-only buffer cheaply: ``np.frombuffer(b).ctypes.data``
    costs ~2 us a buffer, so 24 us a call, more than ISA-L takes to encode a 1 MiB block. A memoryview
    embeds its ``Py_buffer``, so the address is one read at a fixed offset. The offset is found here by
    scanning views with known addresses, and only trusted if exactly one pointer-aligned field matches all
    of them; otherwise the numpy route is used.
    """
    if sys.implementation.name != "cpython":
        return None
    probe = bytearray(256)
    base = ctypes.addressof(ctypes.c_char.from_buffer(probe))
    candidates = set(range(0, memoryview.__basicsize__ - _PTR_SIZE + 1, _PTR_SIZE))
    for shift in (0, 1, 77, 200):
        view = memoryview(probe)[shift:]
        raw = ctypes.string_at(id(view), memoryview.__basicsize__)
        want = (base + shift).to_bytes(_PTR_SIZE, sys.byteorder)
        candidates = {off for off in candidates if raw[off : off + _PTR_SIZE] == want}
    return candidates.pop() if len(candidates) == 1 else None


_VIEW_BUF_OFFSET = _view_buf_offset()
_NBYTES = attrgetter("nbytes")
_C_CONTIGUOUS = attrgetter("c_contiguous")
_READONLY = attrgetter("readonly")
_PACK_POINTERS = {n: struct.Struct(f"{n}P").pack for n in range(1, DATA_SHARDS + TOTAL_SHARDS + 1)}

if _VIEW_BUF_OFFSET is None:

    def _pointers(views: list[memoryview]) -> bytes:
        """The start addresses of C-contiguous ``views`` as a C array of pointers (valid while they live)."""
        return _PACK_POINTERS[len(views)](*[np.frombuffer(v, np.uint8).ctypes.data for v in views])

    def addresses(views: Sequence[memoryview]) -> np.ndarray:
        """The start addresses of C-contiguous ``views`` as int64s (valid while the views live)."""
        return np.asarray([np.frombuffer(v, np.uint8).ctypes.data for v in views], dtype=np.int64)

else:
    _AT_VIEW_BUF = _VIEW_BUF_OFFSET.__add__
    _VOID_P_AT = ctypes.c_void_p.from_address
    _VALUE = attrgetter("value")

    def _pointers(views: list[memoryview]) -> bytes:
        """The start addresses of C-contiguous ``views`` as a C array of pointers (valid while they live)."""
        return _PACK_POINTERS[len(views)](*map(_VALUE, map(_VOID_P_AT, map(_AT_VIEW_BUF, map(id, views)))))

    def addresses(views: Sequence[memoryview]) -> np.ndarray:
        """The start addresses of C-contiguous ``views`` as int64s (valid while the views live)."""
        found = map(_VALUE, map(_VOID_P_AT, map(_AT_VIEW_BUF, map(id, views))))
        return np.fromiter(found, dtype=np.int64, count=len(views))


def _shard_views(inputs: Sequence[Buffer], outputs: Sequence[WritableBuffer]) -> tuple[list[memoryview], int]:
    """Views of ``inputs`` then ``outputs``, and their common size.

    Raises ValueError unless all are C-contiguous and of one non-zero size, and ``outputs`` are writable.
    """
    views = [*map(memoryview, inputs), *map(memoryview, outputs)]
    sizes = set(map(_NBYTES, views))
    if len(sizes) != 1:
        raise ValueError(
            f"shards differ in size: {[v.nbytes for v in views[: len(inputs)]]} bytes in, "
            f"{[v.nbytes for v in views[len(inputs) :]]} bytes out"
        )
    size = sizes.pop()
    if not 0 < size <= _MAX_SHARD:
        raise ValueError(f"shard size must be between 1 and {_MAX_SHARD} bytes, got {size}")
    if not all(map(_C_CONTIGUOUS, views)):
        raise ValueError("shard buffers must be C-contiguous")
    if any(map(_READONLY, views[len(inputs) :])):
        raise ValueError("output shard buffers must be writable")
    return views, size


# --- Backends --------------------------------------------------------------------------------------------


class _Kernel(Protocol):
    """What a backend supplies: the code's matrix, inversion, and ``outputs = rows x inputs``."""

    path: str | None
    """The shared library it runs, if any."""

    def matrix(self) -> _Matrix: ...

    def invert(self, square: _Matrix) -> _Matrix: ...

    def tables(self, rows: _Matrix) -> object:
        """Precomputed form of ``rows`` (each ``DATA_SHARDS`` coefficients) for ``apply``."""
        ...

    def apply(self, tables: object, views: list[memoryview], size: int) -> None:
        """Writes output ``r`` (``views[DATA_SHARDS + r]``) = sum over ``j`` of ``rows[r][j] * views[j]``.

        All shards are ``size`` bytes.
        """
        ...

    def apply_at(self, tables: object, pointers: np.ndarray, sizes: np.ndarray) -> None:
        """``apply`` once per row of ``pointers`` (int64 addresses: ``DATA_SHARDS`` inputs, then the outputs),
        over ``sizes[row]`` bytes."""
        ...


class _IsalKernel:
    """ISA-L erasure-code routines from a shared library, through ctypes."""

    def __init__(self, path: str) -> None:
        try:
            lib = ctypes.CDLL(path)
            init_tables, encode = lib.ec_init_tables, lib.ec_encode_data
            invert, cauchy = lib.gf_invert_matrix, lib.gf_gen_cauchy1_matrix
        except (OSError, AttributeError) as exc:
            raise CodecUnavailableError(f"cannot use ISA-L from {path}: {exc}") from exc
        c_int, c_void_p = ctypes.c_int, ctypes.c_void_p
        init_tables.argtypes, init_tables.restype = [c_int, c_int, c_void_p, c_void_p], None
        encode.argtypes, encode.restype = [c_int, c_int, c_int, c_void_p, c_void_p, c_void_p], None
        invert.argtypes, invert.restype = [c_void_p, c_void_p, c_int], c_int
        cauchy.argtypes, cauchy.restype = [c_void_p, c_int, c_int], None
        self.path = path
        self._init_tables, self._encode, self._invert, self._cauchy = init_tables, encode, invert, cauchy
        self._encode_address = ctypes.cast(encode, c_void_p).value  # for stripe loops in compiled code

    def matrix(self) -> _Matrix:
        a = (ctypes.c_ubyte * (TOTAL_SHARDS * DATA_SHARDS))()
        self._cauchy(a, TOTAL_SHARDS, DATA_SHARDS)
        return [list(a[i * DATA_SHARDS : (i + 1) * DATA_SHARDS]) for i in range(TOTAL_SHARDS)]

    def invert(self, square: _Matrix) -> _Matrix:
        n = len(square)
        source = (ctypes.c_ubyte * (n * n))(*(x for row in square for x in row))
        inverse = (ctypes.c_ubyte * (n * n))()
        if self._invert(source, inverse, n) != 0:
            raise ValueError("matrix is singular over GF(2^8)")
        return [list(inverse[i * n : (i + 1) * n]) for i in range(n)]

    def tables(self, rows: _Matrix) -> ctypes.Array[ctypes.c_ubyte]:
        coefficients = (ctypes.c_ubyte * (len(rows) * DATA_SHARDS))(*(x for row in rows for x in row))
        tables = (ctypes.c_ubyte * (32 * DATA_SHARDS * len(rows)))()
        self._init_tables(DATA_SHARDS, len(rows), coefficients, tables)
        return tables

    def apply(self, tables: ctypes.Array[ctypes.c_ubyte], views: list[memoryview], size: int) -> None:
        pointers = _pointers(views)
        outputs = len(views) - DATA_SHARDS
        self._encode(size, DATA_SHARDS, outputs, tables, pointers, pointers[DATA_SHARDS * _PTR_SIZE :])

    def apply_at(self, tables: ctypes.Array[ctypes.c_ubyte], pointers: np.ndarray, sizes: np.ndarray) -> None:
        # one compiled loop over the stripes: a ctypes call each cost ~1.5 us, a third of encoding a 64 KiB block
        _native.ec_encode_stripes(self._encode_address, ctypes.addressof(tables), DATA_SHARDS, pointers, sizes)


class _NumpyKernel:
    """Portable GF(2^8) arithmetic with a 256x256 multiplication table."""

    path = None

    def __init__(self) -> None:
        self._mul = _gf_mul_table()

    def matrix(self) -> _Matrix:
        return _cauchy_matrix()

    def invert(self, square: _Matrix) -> _Matrix:
        return _gf_invert(square)

    def tables(self, rows: _Matrix) -> _Matrix:
        return rows

    def apply_at(self, tables: _Matrix, pointers: np.ndarray, sizes: np.ndarray) -> None:
        for row, size in zip(pointers.tolist(), sizes.tolist(), strict=True):
            views = [memoryview((ctypes.c_ubyte * size).from_address(address)).cast("B") for address in row]
            self.apply(tables, views, size)

    def apply(self, tables: _Matrix, views: list[memoryview], size: int) -> None:
        arrays = [np.frombuffer(v, np.uint8) for v in views]
        sources = arrays[:DATA_SHARDS]
        product = np.empty(size, np.uint8)
        for row, out in zip(tables, arrays[DATA_SHARDS:], strict=True):
            out.fill(0)
            for coef, src in zip(row, sources, strict=True):
                if coef == 1:
                    np.bitwise_xor(out, src, out=out)
                elif coef:
                    self._mul[coef].take(src, out=product)
                    np.bitwise_xor(out, product, out=out)


def _system_isal_path() -> str:
    return ctypes.util.find_library("isal") or "libisal.so.2"


def _pyeclib_isal_path() -> str:
    spec = importlib.util.find_spec("pyeclib")
    if spec is None or not spec.submodule_search_locations:
        raise CodecUnavailableError("pyeclib is not installed")
    libs = Path(next(iter(spec.submodule_search_locations))).parent / "pyeclib.libs"
    found = sorted(libs.glob("libisal*.so*"))
    if not found:
        raise CodecUnavailableError(f"no bundled ISA-L (libisal*.so*) in {libs}")
    return str(found[0])


_LOADERS: dict[str, Callable[[], _Kernel]] = {
    "isal": lambda: _IsalKernel(_system_isal_path()),
    "isal-pyeclib": lambda: _IsalKernel(_pyeclib_isal_path()),
    "numpy": _NumpyKernel,
}


@functools.cache
def _load(backend: str) -> _Kernel | str:
    """The loaded backend, or why it cannot be loaded; tried once per process."""
    try:
        return _LOADERS[backend]()
    except CodecUnavailableError as exc:
        return str(exc)


def _kernel(backend: str) -> _Kernel:
    """The loaded backend; CodecUnavailableError if it cannot be loaded."""
    loaded = _load(backend)
    if isinstance(loaded, str):
        raise CodecUnavailableError(loaded)
    return loaded


def _loadable() -> Iterator[str]:
    """Names of the backends that load on this machine, fastest first, loading them lazily."""
    for name in BACKENDS:
        try:
            _kernel(name)
        except CodecUnavailableError:
            continue
        yield name


def available_backends() -> list[str]:
    """Names of the backends that load on this machine, fastest first (always ends with ``"numpy"``)."""
    return list(_loadable())


# --- Codec -----------------------------------------------------------------------------------------------


class Codec:
    """RS(10, 2) encoder/decoder on one backend; thread-safe, and cheap to call on the data path.

    ``backend`` names one of ``BACKENDS``; None takes ``$KVTIER_CODEC`` if set, else the first backend of
    ``BACKENDS`` that loads. Raises ValueError for an unknown name and CodecUnavailableError when the named
    backend cannot be loaded.
    """

    backend: str
    """The GF(2^8) implementation in use: ``"isal"``, ``"isal-pyeclib"`` or ``"numpy"``."""
    library: str | None
    """Path of the ISA-L shared library in use, None for ``"numpy"``."""

    def __init__(self, backend: str | None = None) -> None:
        backend = backend or os.environ.get(ENV_VAR) or next(_loadable())
        if backend not in BACKENDS:
            raise ValueError(f"unknown codec backend {backend!r}; expected one of {', '.join(BACKENDS)}")
        self.backend = backend
        self._kernel = _kernel(backend)
        self.library = self._kernel.path
        self._matrix = self._kernel.matrix()
        self._encode_tables = self._kernel.tables(self._matrix[DATA_SHARDS:])
        self._decode_plan = functools.lru_cache(maxsize=4096)(self._make_decode_plan)

    def __repr__(self) -> str:
        return f"Codec(backend={self.backend!r})"

    def encode_parity(self, data: Sequence[Buffer], parity: Sequence[WritableBuffer]) -> None:
        """Computes the parity shards of ``data`` into ``parity``, in place.

        ``data`` is ``DATA_SHARDS`` buffers (read-only ones are fine, and are not copied), ``parity``
        ``PARITY_SHARDS`` writable buffers, all C-contiguous and of the same, non-zero size in bytes; parity
        must not overlap data. Raises ValueError otherwise (nothing is written then).
        """
        if len(data) != DATA_SHARDS or len(parity) != PARITY_SHARDS:
            raise ValueError(
                f"need {DATA_SHARDS} data and {PARITY_SHARDS} parity shards, got {len(data)} and {len(parity)}"
            )
        self._kernel.apply(self._encode_tables, *_shard_views(data, parity))

    def encode_parity_at(self, pointers: np.ndarray, sizes: np.ndarray) -> None:
        """``encode_parity`` for many stripes at raw addresses, one C call each: row ``r`` of ``pointers``
        (int64, ``n × TOTAL_SHARDS``) addresses ``DATA_SHARDS`` data then ``PARITY_SHARDS`` parity buffers of
        ``sizes[r]`` bytes. The caller keeps every address valid and the parity ones writable, not
        overlapping the data. Raises ValueError for a wrong shape or a size out of range (nothing written).
        """
        pointers = np.ascontiguousarray(pointers, dtype=np.int64)
        sizes = np.ascontiguousarray(sizes, dtype=np.int64)
        if pointers.ndim != 2 or pointers.shape[1] != TOTAL_SHARDS or sizes.shape != (len(pointers),):
            raise ValueError(f"need an n x {TOTAL_SHARDS} pointer table and n sizes")
        if len(sizes) and not (int(sizes.min()) > 0 and int(sizes.max()) <= _MAX_SHARD):
            raise ValueError(f"shard sizes must be between 1 and {_MAX_SHARD} bytes")
        self._kernel.apply_at(self._encode_tables, pointers, sizes)

    def reconstruct(self, present: Mapping[int, Buffer], want: Mapping[int, WritableBuffer]) -> None:
        """Computes the shards ``want`` names (data or parity) from the shards in ``present``, in place.

        ``present`` maps shard index (0..11) to its contents and needs at least ``DATA_SHARDS`` entries, of
        which the ``DATA_SHARDS`` lowest indices are read; ``want`` maps shard index to a writable buffer
        that receives it. All buffers are C-contiguous with the same non-zero size, and ``want`` buffers
        must not overlap the ones read. Raises ValueError otherwise (nothing is written then).
        """
        if not want:
            return
        tables, used = self._decode_plan(tuple(present), tuple(want))
        self._kernel.apply(tables, *_shard_views([*map(present.__getitem__, used)], [*want.values()]))

    def _make_decode_plan(self, present: tuple[int, ...], want: tuple[int, ...]) -> tuple[object, tuple[int, ...]]:
        """Tables that compute the shards ``want`` (in that order), and the present shards they read."""
        if len(present) < DATA_SHARDS:
            raise ValueError(
                f"need at least {DATA_SHARDS} of {TOTAL_SHARDS} shards to reconstruct, "
                f"got {len(present)}: {sorted(present)}"
            )
        if not (_ALL_INDICES.issuperset(present) and _ALL_INDICES.issuperset(want)):
            raise ValueError(
                f"shard indices must be in 0..{TOTAL_SHARDS - 1}, got present {sorted(present)}, want {sorted(want)}"
            )
        used = tuple(sorted(present)[:DATA_SHARDS])
        inverse = self._kernel.invert([self._matrix[i] for i in used])
        rows = [inverse[w] if w < DATA_SHARDS else _gf_row_times(self._matrix[w], inverse) for w in want]
        return self._kernel.tables(rows), used

    def encode(self, block: Buffer) -> list[bytes]:
        """The ``TOTAL_SHARDS`` shards of ``block`` (C-contiguous), each ``shard_size(len)`` bytes."""
        view = memoryview(block).cast("B")
        size = shard_size(view.nbytes)
        data = [bytes(view[i * size : (i + 1) * size]).ljust(size, b"\0") for i in range(DATA_SHARDS)]
        parity = [bytearray(size) for _ in range(PARITY_SHARDS)]
        self.encode_parity(data, parity)
        return [*data, *map(bytes, parity)]

    def decode(self, shards: Mapping[int, Buffer], block_len: int) -> bytes:
        """The ``block_len``-byte block whose shards (at least ``DATA_SHARDS`` of them, by index) are given.

        Raises ValueError if fewer than ``DATA_SHARDS`` shards are given, an index is out of range, or a
        shard is not ``shard_size(block_len)`` bytes.
        """
        size = shard_size(block_len)
        if len(shards) < DATA_SHARDS or not _ALL_INDICES.issuperset(shards):
            raise ValueError(
                f"need at least {DATA_SHARDS} shards with indices in 0..{TOTAL_SHARDS - 1}, got {sorted(shards)}"
            )
        sources = {i: memoryview(s).cast("B") for i, s in shards.items()}
        wrong = {i: v.nbytes for i, v in sources.items() if v.nbytes != size}
        if wrong:
            raise ValueError(f"a {block_len}-byte block has {size}-byte shards, got sizes {wrong}")
        out = memoryview(bytearray(DATA_SHARDS * size))
        slots = [out[i * size : (i + 1) * size] for i in range(DATA_SHARDS)]
        missing = {i: slot for i, slot in enumerate(slots) if i not in sources}
        for i, slot in enumerate(slots):
            if i in sources:
                slot[:] = sources[i]
        self.reconstruct(sources, missing)
        return bytes(out[:block_len])


@functools.cache
def default_codec() -> Codec:
    """The process-wide codec: ``$KVTIER_CODEC`` if set (read on the first call), else the fastest backend.

    Raises ValueError or CodecUnavailableError, as ``Codec()`` does, when ``$KVTIER_CODEC`` names an
    unknown or unloadable backend.
    """
    return Codec()
