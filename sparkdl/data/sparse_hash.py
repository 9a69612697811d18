"""The stable id -> table row mapping of categorical inputs, in pure Python and numpy.

The one documented rule (the same in Spark, data/sparse_inputs.py, and here, for serving):
- an integer id in [0, num_rows) is its own row;
- a string, and an integer id outside [0, num_rows) under out_of_range="hash", goes to row
  `pmod(xxhash64(value), num_rows)`, where xxhash64 is Spark's SQL function (XXH64, seed 42) of the
  string's UTF-8 bytes or of the id as a 64-bit integer (every integer type is widened to bigint
  first: Spark hashes an `int` column otherwise than a `bigint` one), read as a signed 64-bit
  number, and pmod is the non-negative remainder.

So the same id lands on the same row in every run, on every Spark version with xxhash64 (3.0+),
and in a Python process without Spark. XXH64 is the published algorithm (Collet); the functions
below implement it from its specification, checked against Spark in tests/spark/test_sparse_inputs.py.
Imports numpy and sparkdl.errors only: workers and serving may use it.
"""
from __future__ import annotations

from typing import Iterable, Sequence

import numpy as np

from sparkdl.errors import SchemaError

SEED = 42  # Spark's xxhash64 seed (fixed by Spark: `xxhash64(col)` takes no seed argument)



class SparseIdError(SchemaError):
    """Integer ids outside their table's range, under out_of_range="refuse"."""


_MASK = (1 << 64) - 1
_P1 = 11400714785074694791
_P2 = 14029467366897019727
_P3 = 1609587929392839161
_P4 = 9650029242287828579
_P5 = 2870177450012600261


def _rotl(x: int, r: int) -> int:
    return ((x << r) | (x >> (64 - r))) & _MASK


def _round(acc: int, lane: int) -> int:
    acc = (acc + lane * _P2) & _MASK
    return (_rotl(acc, 31) * _P1) & _MASK


def _merge(acc: int, value: int) -> int:
    acc ^= _round(0, value)
    return (acc * _P1 + _P4) & _MASK


def _avalanche(h: int) -> int:
    h ^= h >> 33
    h = (h * _P2) & _MASK
    h ^= h >> 29
    h = (h * _P3) & _MASK
    return h ^ (h >> 32)


def _signed(h: int) -> int:
    return h - (1 << 64) if h >= 1 << 63 else h


def xxh64(data: bytes, seed: int = SEED) -> int:
    """XXH64 of `data` as an unsigned 64-bit integer."""
    length, offset = len(data), 0
    seed &= _MASK
    if length >= 32:
        v = [(seed + _P1 + _P2) & _MASK, (seed + _P2) & _MASK, seed, (seed - _P1) & _MASK]
        while offset + 32 <= length:
            for i in range(4):
                v[i] = _round(v[i], int.from_bytes(data[offset + 8 * i: offset + 8 * i + 8], "little"))
            offset += 32
        h = (_rotl(v[0], 1) + _rotl(v[1], 7) + _rotl(v[2], 12) + _rotl(v[3], 18)) & _MASK
        for lane in v:
            h = _merge(h, lane)
    else:
        h = (seed + _P5) & _MASK
    h = (h + length) & _MASK
    while offset + 8 <= length:
        h ^= _round(0, int.from_bytes(data[offset: offset + 8], "little"))
        h = (_rotl(h, 27) * _P1 + _P4) & _MASK
        offset += 8
    if offset + 4 <= length:
        h ^= (int.from_bytes(data[offset: offset + 4], "little") * _P1) & _MASK
        h = (_rotl(h, 23) * _P2 + _P3) & _MASK
        offset += 4
    while offset < length:
        h ^= (data[offset] * _P5) & _MASK
        h = (_rotl(h, 11) * _P1) & _MASK
        offset += 1
    return _avalanche(h)


def spark_xxhash64_string(text: str) -> int:
    """Spark's `xxhash64(s)` of a string (UTF-8 bytes), signed as Spark returns it."""
    return _signed(xxh64(text.encode("utf-8")))


def spark_xxhash64_long(value: int) -> int:
    """Spark's `xxhash64(cast(v as bigint))`, signed: XXH64 of the 8 little-endian bytes."""
    return _signed(xxh64((value & _MASK).to_bytes(8, "little")))


def _rotl_np(x: np.ndarray, r: int) -> np.ndarray:
    return (x << np.uint64(r)) | (x >> np.uint64(64 - r))


def xxhash64_longs(values: Sequence[int] | np.ndarray) -> np.ndarray:
    """Spark's `xxhash64(cast(v as bigint))` of many ids at once (int64 out), vectorised: XXH64's
    8-byte path, in uint64 arithmetic that wraps as Java's long does."""
    x = np.asarray(values, dtype=np.int64).view(np.uint64)
    with np.errstate(over="ignore"):
        k = _rotl_np(x * np.uint64(_P2), 31) * np.uint64(_P1)
        h = np.full(x.shape, (SEED + _P5 + 8) & _MASK, dtype=np.uint64) ^ k
        h = _rotl_np(h, 27) * np.uint64(_P1) + np.uint64(_P4)
        h ^= h >> np.uint64(33)
        h *= np.uint64(_P2)
        h ^= h >> np.uint64(29)
        h *= np.uint64(_P3)
        h ^= h >> np.uint64(32)
    return h.view(np.int64)


def hashed_rows(hashes: np.ndarray, num_rows: int) -> np.ndarray:
    """pmod(hash, num_rows) on signed 64-bit hashes: numpy's % of a positive divisor is already
    non-negative, as Spark's pmod is."""
    return np.mod(hashes, np.int64(num_rows))


def integer_rows(ids: Sequence[int] | np.ndarray, num_rows: int, out_of_range: str = "hash") -> np.ndarray:
    """Table rows of integer ids (int64 out): ids in [0, num_rows) as they are, the others hashed,
    or under out_of_range="refuse" a SparseIdError naming how many and one of them."""
    _check_rows(num_rows)
    ids = np.asarray(ids, dtype=np.int64)
    inside = (ids >= 0) & (ids < num_rows)
    if inside.all():
        return ids.copy()
    if out_of_range == "refuse":
        outside = ids[~inside]
        raise SparseIdError(f"{outside.size} id(s) outside the table's range [0, {num_rows}), e.g. {int(outside[0])}",
                            hint="out_of_range='refuse' takes only ids in range; 'hash' maps the others to rows")
    return np.where(inside, ids, hashed_rows(xxhash64_longs(ids), num_rows))


def string_rows(ids: Iterable[str], num_rows: int) -> np.ndarray:
    """Table rows of string ids (int64 out): pmod(xxhash64(s), num_rows)."""
    _check_rows(num_rows)
    hashes = np.fromiter((spark_xxhash64_string(s) for s in ids), dtype=np.int64)
    return hashed_rows(hashes, num_rows)


def table_rows(ids: Sequence[int] | Sequence[str] | np.ndarray, num_rows: int,
               out_of_range: str = "hash") -> np.ndarray:
    """Table rows of one list of ids, all integers or all strings (one row's multi-hot ids, or one id
    per row of a batch), as Spark's prepared column holds them."""
    values = np.asarray(ids) if not isinstance(ids, np.ndarray) else ids
    if values.size == 0:
        return np.zeros(values.shape, dtype=np.int64)
    if values.dtype.kind in "iu":
        return integer_rows(values, num_rows, out_of_range)
    if values.dtype.kind == "U" or (values.dtype.kind == "O" and all(isinstance(v, str) for v in values.flat)):
        return string_rows(values.flat, num_rows).reshape(values.shape)
    raise TypeError(f"ids must be all integers or all strings, got an array of {values.dtype}")


def _check_rows(num_rows: int) -> None:
    if not isinstance(num_rows, (int, np.integer)) or isinstance(num_rows, bool) or num_rows < 1:
        raise ValueError(f"num_rows must be a positive integer, got {num_rows!r}")
