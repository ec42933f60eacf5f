"""The chunk engine's in-memory index of committed shard records by name: what LMDB's ``slots`` table holds
(keyed there by place), looked up by name.

A shard's name is its tenant prefix, key and index byte (``chunks.shard_key``); its record is a ``RECORD`` row:
the packed ``ShardRecord`` fields, with the TTL class as a small id into ``ttl_classes``. Names of one tenant
and key length have one width, and each width has its own compiled fixed-width hash table
(``_shard_index.ShardIndexTable``, csrc/shard_index.c), so every call takes names of one width as a table (n
rows of that many bytes, as a request's keys give them) and answers with arrays: no Python object is made per
shard (a 64 KiB-block request brings a thousand). 1,024 lookups take about 50 us, against ~280 us in a dict of
bytes; memory is about the same (78 B a slot at 38-75 % load).

Rebuilt from LMDB at open (``add_packed``); not thread-safe (the engine calls it under its lock). Failure: a
name table of the wrong shape is ``ValueError``; nothing is changed then.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import numpy as np

from kvtier.kvstore._shard_index import ShardIndexTable
from kvtier.kvstore.codec import TOTAL_SHARDS
from kvtier.kvstore.keys import HEADER_DIGEST_BYTES

MAX_TTL_CLASSES = 255  # ids 0-254; 255 marks "no record" in read replies

# ``ShardRecord`` as stored (struct ``<BBHIIIQd16s``, 48 bytes), then the TTL class id
RECORD = np.dtype(
    {
        "names": ["state", "index", "size_class", "slot", "length", "crc", "block_len", "created", "header", "ttl"],
        "formats": ["u1", "u1", "<u2", "<u4", "<u4", "<u4", "<u8", "<f8", (np.uint8, HEADER_DIGEST_BYTES), "u1"],
    }
)
PACKED_BYTES = RECORD.itemsize - 1  # a packed ShardRecord's fixed part; its TTL class name follows


class ShardIndex:
    """Committed shard records by name (see the module docstring)."""

    def __init__(self) -> None:
        self._tables: dict[int, ShardIndexTable] = {}  # by name width
        self.ttl_classes: list[str] = []  # by id
        self._ttl_ids: dict[str, int] = {}

    def __len__(self) -> int:
        return sum(map(len, self._tables.values()))

    def ttl_id(self, ttl_class: str) -> int:
        """The id records carry for ``ttl_class``, given at its first use. Raises ValueError past 255 classes."""
        found = self._ttl_ids.get(ttl_class)
        if found is None:
            if len(self.ttl_classes) >= MAX_TTL_CLASSES:
                raise ValueError(f"a node holds at most {MAX_TTL_CLASSES} TTL classes")
            found = self._ttl_ids[ttl_class] = len(self.ttl_classes)
            self.ttl_classes.append(ttl_class)
        return found

    def lookup(self, names: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Per row of ``names`` (n × width uint8): whether it is here, and its ``RECORD`` (zeros where not)."""
        return self._records_of(names, take=False)

    def lookup_names(self, names: Sequence[bytes]) -> tuple[np.ndarray, np.ndarray]:
        """``lookup`` of names given as bytes, of any widths."""
        found, out = np.zeros(len(names), dtype=bool), np.zeros(len(names), dtype=RECORD)
        for rows, table in tables_by_width(names):
            found[rows], out[rows] = self.lookup(table)
        return found, out

    def contains(self, names: np.ndarray) -> np.ndarray:
        """Per row of ``names`` whether it is here."""
        table = self._tables.get(names.shape[1])
        if table is None or not len(names):
            return np.zeros(len(names), dtype=bool)
        return _mask(table.contains(np.ascontiguousarray(names)))

    def insert(self, names: np.ndarray, records: np.ndarray) -> np.ndarray:
        """Add ``records`` (``RECORD``) under ``names``, row by row; per row whether the name was here already (an
        earlier row of the same call counts), in which case the record there is kept and this one is not added."""
        width = names.shape[1]
        table = self._tables.get(width)
        if table is None:
            table = self._tables[width] = ShardIndexTable(width, RECORD.itemsize)
        return _mask(table.insert(np.ascontiguousarray(names), np.ascontiguousarray(records, dtype=RECORD), False))

    def remove(self, names: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Remove ``names``; per row whether it was here (a name listed twice: the first row), and the record it had."""
        return self._records_of(names, take=True)

    def _records_of(self, names: np.ndarray, take: bool) -> tuple[np.ndarray, np.ndarray]:
        out = np.zeros(len(names), dtype=RECORD)
        table = self._tables.get(names.shape[1])
        if table is None or not len(names):
            return np.zeros(len(names), dtype=bool), out
        found = (table.remove if take else table.lookup)(np.ascontiguousarray(names), out)
        return _mask(found), out

    def items(self) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """Every (names table, records), one pair per name width: a snapshot."""
        for width, table in list(self._tables.items()):
            names, records = table.items()
            yield np.frombuffer(names, dtype=np.uint8).reshape(-1, width), np.frombuffer(records, dtype=RECORD)

    def add_packed(self, names: Sequence[bytes], packed: Sequence[bytes]) -> None:
        """Add records as LMDB stores them (a packed ``ShardRecord``: fixed part, then the TTL class name), at open."""
        if not names:
            return
        fixed = np.frombuffer(b"".join(p[:PACKED_BYTES] for p in packed), dtype=np.uint8)
        records = np.zeros(len(packed), dtype=RECORD)
        records.view(np.uint8).reshape(-1, RECORD.itemsize)[:, :PACKED_BYTES] = fixed.reshape(-1, PACKED_BYTES)
        records["ttl"] = [self.ttl_id(bytes(p[PACKED_BYTES:]).decode()) for p in packed]
        for rows, table in tables_by_width(names):
            self.insert(table, records[rows])


def name_table(prefix: bytes, keys: bytes, klen: int, index: np.ndarray) -> np.ndarray:
    """prefix + key + index byte of every row (shard names, as the index and LMDB take them), as one table."""
    n, p = len(index), len(prefix)
    table = np.empty((n, p + klen + 1), dtype=np.uint8)
    table[:, :p] = np.frombuffer(prefix, dtype=np.uint8)
    table[:, p:-1] = np.frombuffer(keys, dtype=np.uint8).reshape(n, klen)
    table[:, -1] = index
    return table


def every_shard(prefix: bytes, keys: Sequence[bytes]) -> np.ndarray:
    """The names of all 12 shards of each of ``keys`` (one or more, all of one length), key after key, as one table."""
    indices = np.tile(np.arange(TOTAL_SHARDS, dtype=np.uint8), len(keys))
    return name_table(prefix, b"".join(key * TOTAL_SHARDS for key in keys), len(keys[0]), indices)


def table_names(table: np.ndarray) -> list[bytes]:
    """The rows of a name table as bytes (void scalars come back as bytes, trailing zeros kept)."""
    return np.ascontiguousarray(table).view(f"V{table.shape[1]}").ravel().tolist()


def _mask(flags: bytes) -> np.ndarray:
    return np.frombuffer(flags, dtype=bool)


def tables_by_width(names: Sequence[bytes]) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Names given as bytes, grouped by width: (their positions, their name table)."""
    widths = np.fromiter(map(len, names), dtype=np.int64, count=len(names))
    for width in np.unique(widths).tolist():
        rows = np.flatnonzero(widths == width)
        same = b"".join(names[i] for i in rows.tolist())
        yield rows, np.frombuffer(same, dtype=np.uint8).reshape(len(rows), width)
