"""Row ids as fixed-width keys, and a compact table of them: how a job remembers millions of ids in numpy arrays.

A job held every id it had met as a Python object in a dict or set: about 150 bytes an id, 1.5 GB for 10M
ids. Here an id is a 64-bit key and a 32-bit check, computed for a whole Arrow array at once:

- an integer id: key = splitmix64(id), check = 0. splitmix64 is a bijection on 64-bit integers, so two
  integer ids never share a key: exact.
- a string id: two 64-bit hashes of its UTF-8 bytes with different seeds (``_string_hash``); key = the first,
  check = the top 32 bits of the second.

Two ids count as the same id when key and check are both equal: 96 bits. For N distinct string ids the odds
that some two of them share both are below N²/2^97: 6e-16 for 10M ids, 6e-12 for a billion. An integer and a
string id share key and check with odds 2^-96 a pair. The keys are the same in every process and on every
machine (numpy's uint64 arithmetic wraps modulo 2^64; words are read little-endian).

``KeyTable`` is a hash table of (key, check) pairs in numpy arrays, with an optional uint64 value and uint8
flags a slot: 12 bytes an id (21 with value and flags) at a load of 3/8 to 3/4. Lookups and inserts take
whole arrays of keys.
"""

from __future__ import annotations

from typing import Optional

import numpy as np
import pyarrow as pa

U64 = np.uint64
_GOLDEN = U64(0x9E3779B97F4A7C15)
_M1, _M2 = U64(0xFF51AFD7ED558CCD), U64(0xC4CEB9FE1A85EC53)  # MurmurHash3's fmix64
_S1, _S2 = U64(0xBF58476D1CE4E5B9), U64(0x94D049BB133111EB)  # splitmix64
_SEED_A, _SEED_B = U64(0x6F766572_6E696768), U64(0x74206B65_79732121)
_MUL_B = U64(0xC2B2AE3D27D4EB4F)
CHUNK = 65536  # keys placed at a time when a table grows
# MASKS[r]: the low r bytes of a word (r = 0..8)
_MASKS = np.array([(1 << (8 * r)) - 1 for r in range(8)] + [(1 << 64) - 1], dtype=U64)


def _fmix(x: np.ndarray) -> np.ndarray:
    """MurmurHash3's 64-bit finalizer, in place: a bijection that mixes every bit into every other."""
    x ^= x >> U64(33)
    x *= _M1
    x ^= x >> U64(33)
    x *= _M2
    x ^= x >> U64(33)
    return x


def _splitmix(v: np.ndarray) -> np.ndarray:
    z = v.astype(U64, copy=True)
    z += _GOLDEN
    z ^= z >> U64(30)
    z *= _S1
    z ^= z >> U64(27)
    z *= _S2
    z ^= z >> U64(31)
    return z


def string_parts(arr: pa.Array) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(starts, lengths, padded bytes) of a string or binary array: row i is bytes[starts[i]:starts[i]+lengths[i]],
    and bytes has 8 zero bytes past the last row's end."""
    is_view = getattr(pa.types, "is_string_view", None)
    if is_view is not None and is_view(arr.type):
        arr = arr.cast(pa.string())
    large = pa.types.is_large_string(arr.type) or pa.types.is_large_binary(arr.type)
    bufs = arr.buffers()
    n = len(arr)
    offsets = np.frombuffer(bufs[1], dtype=np.int64 if large else np.int32)[arr.offset:arr.offset + n + 1]
    offsets = offsets.astype(np.int64)
    lo, hi = (int(offsets[0]), int(offsets[-1])) if n else (0, 0)
    data = np.zeros(hi - lo + 8, dtype=np.uint8)
    if hi > lo:
        data[:hi - lo] = np.frombuffer(bufs[2], dtype=np.uint8)[lo:hi]
    return offsets[:-1] - lo, np.diff(offsets), data


def _string_hash(starts: np.ndarray, lengths: np.ndarray, data: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Two 64-bit hashes of each row's bytes. Per lane, from h = seed ^ (length × golden):
    for each 8-byte little-endian word w (the last one zero-padded), lane a: h = fmix64(h ^ w);
    lane b: h = fmix64(h ^ (w × 0xC2B2AE3D27D4EB4F))."""
    n = len(starts)
    lens = lengths.astype(U64)
    a = _SEED_A ^ (lens * _GOLDEN)
    b = _SEED_B ^ (lens * _GOLDEN)
    if not n:
        return a, b
    # Every byte offset read as a little-endian uint64 (unaligned, overlapping; the 8 zero bytes make the last
    # row's word whole).
    words = np.ndarray(shape=(max(len(data) - 7, 1),), dtype="<u8", buffer=data, strides=(1,))
    nwords = (lengths + 7) // 8
    lo, hi = int(nwords.min()), int(nwords.max())
    for j in range(hi):
        rows = None if j < lo else np.flatnonzero(nwords > j)
        st = starts if rows is None else starts[rows]
        rem = np.minimum(lengths if rows is None else lengths[rows], 8 * (j + 1)) - 8 * j
        w = words[st + 8 * j] & _MASKS[rem]
        if rows is None:
            a ^= w
            _fmix(a)
            w *= _MUL_B
            b ^= w
            _fmix(b)
        else:
            a[rows] = _fmix(a[rows] ^ w)
            w *= _MUL_B
            b[rows] = _fmix(b[rows] ^ w)
    return a, b


def keys_of(arr) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(keys uint64, checks uint32, valid bool) of an Arrow array or chunked array of integer or string ids;
    a null id is not valid (its key and check are 0)."""
    if isinstance(arr, pa.ChunkedArray):
        parts = [keys_of(c) for c in arr.chunks]
        if not parts:
            return np.zeros(0, U64), np.zeros(0, np.uint32), np.zeros(0, bool)
        return tuple(np.concatenate(p) for p in zip(*parts))  # type: ignore[return-value]
    n = len(arr)
    valid = np.ones(n, bool) if arr.null_count == 0 else ~np.asarray(arr.is_null(), dtype=bool)
    t = arr.type
    if pa.types.is_integer(t):
        ints = arr.fill_null(0) if arr.null_count else arr
        v = np.asarray(ints.to_numpy(zero_copy_only=False)).astype(np.int64, copy=False).view(U64)
        keys, checks = _splitmix(v), np.zeros(n, np.uint32)
    elif pa.types.is_null(t):
        keys, checks = np.zeros(n, U64), np.zeros(n, np.uint32)
    else:
        if pa.types.is_dictionary(t):
            arr = arr.cast(t.value_type)
        ka, kb = _string_hash(*string_parts(arr))
        keys, checks = ka, (kb >> U64(32)).astype(np.uint32)
    if not valid.all():
        keys[~valid] = 0
        checks[~valid] = 0
    return keys, checks, valid


def key_of(value) -> tuple[int, int]:
    """(key, check) of one id (int or str), as keys_of computes it for an array."""
    k, c, _ = keys_of(pa.array([value]))
    return int(k[0]), int(c[0])


def hex16_to_u64(arr) -> np.ndarray:
    """16-hex-digit strings (a prompt_hash) as uint64, big-endian as written; 0 where null or not 16 hex digits."""
    if isinstance(arr, pa.ChunkedArray):
        return np.concatenate([hex16_to_u64(c) for c in arr.chunks]) if arr.num_chunks else np.zeros(0, U64)
    n = len(arr)
    out = np.zeros(n, U64)
    if n == 0 or arr.null_count == n:
        return out
    if pa.types.is_string(arr.type) and arr.null_count == 0:
        offsets = np.frombuffer(arr.buffers()[1], dtype=np.int32)[arr.offset:arr.offset + n + 1]
        base = int(offsets[0])
        if int(offsets[-1]) - base == 16 * n and (np.diff(offsets) == 16).all():  # the usual case
            raw = np.frombuffer(arr.buffers()[2], dtype=np.uint8)[base:base + 16 * n].reshape(n, 16)
            return _hex_rows(raw, np.arange(n), out)
    starts, lengths, data = string_parts(arr)
    ok = lengths == 16
    if arr.null_count:
        ok &= ~np.asarray(arr.is_null(), dtype=bool)
    rows = np.flatnonzero(ok)
    if len(rows):
        _hex_rows(data[starts[rows, None] + np.arange(16)], rows, out)
    return out


_HEX = np.full(256, 255, dtype=np.uint8)  # ASCII -> the value of a hex digit; 255 for anything else
_HEX[np.frombuffer(b"0123456789", np.uint8)] = np.arange(10)
_HEX[np.frombuffer(b"abcdef", np.uint8)] = np.arange(10, 16)
_HEX[np.frombuffer(b"ABCDEF", np.uint8)] = np.arange(10, 16)


def _hex_rows(raw: np.ndarray, rows: np.ndarray, out: np.ndarray) -> np.ndarray:
    """out[rows] = the value of each row of raw (16 ASCII hex digits), where all 16 are hex digits."""
    nib = np.take(_HEX, raw)
    v = ((nib[:, 0::2] << np.uint8(4)) | nib[:, 1::2]).view(">u8").reshape(-1).astype(U64)
    if (nib.reshape(-1) < 16).all():
        out[rows] = v
    else:
        good = (nib < 16).all(axis=1)
        out[rows[good]] = v[good]
    return out


def u64_to_hex16(v: int) -> str:
    return f"{int(v):016x}"


class KeyTable:
    """A set of (key, check) pairs in numpy arrays, each with an optional uint64 value and uint8 flags.

    Buckets of 8 slots; a pair lives in the first bucket, from its home bucket (the key's top bits) on, that
    had room when it was inserted (linear probing over buckets; nothing is ever removed, so a lookup stops at
    the first bucket that is not full). Doubles when 3/4 full."""

    SLOTS = 8
    MAX_LOAD = 0.75

    def __init__(self, capacity: int = 0, values: bool = False, flags: bool = False):
        self.has_values, self.has_flags = values, flags
        self.size = 0
        self._alloc(self._bits_for(capacity))

    # -- layout --------------------------------------------------------------------------------
    def _bits_for(self, n: int) -> int:
        bits = 4
        while (1 << bits) * self.SLOTS * self.MAX_LOAD < n:
            bits += 1
        return bits

    def _alloc(self, bits: int) -> None:
        self.bits = bits
        nb = 1 << bits
        self.keys = np.zeros((nb, self.SLOTS), U64)
        self.checks = np.zeros((nb, self.SLOTS), np.uint32)
        self.count = np.zeros(nb, np.uint8)
        self.values = np.zeros((nb, self.SLOTS), U64) if self.has_values else None
        self.flags = np.zeros((nb, self.SLOTS), np.uint8) if self.has_flags else None

    @property
    def num_buckets(self) -> int:
        return 1 << self.bits

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in (self.keys, self.checks, self.count, self.values, self.flags) if a is not None)

    def __len__(self) -> int:
        return self.size

    def _home(self, keys: np.ndarray) -> np.ndarray:
        return (keys >> U64(64 - self.bits)).astype(np.int64)

    def occupied(self) -> np.ndarray:
        """A (buckets, 8) mask of the slots in use."""
        return np.arange(self.SLOTS) < self.count[:, None]

    # -- lookups -------------------------------------------------------------------------------
    def find(self, keys: np.ndarray, checks: np.ndarray) -> np.ndarray:
        """Each pair's slot (bucket * 8 + position), or -1 where it is not in the table."""
        n = len(keys)
        out = np.full(n, -1, np.int64)
        if not n or not self.size:
            return out
        # Most pairs are settled by their home bucket: one gather of its 8 keys, and one of the matching check.
        # An empty slot's key is 0, so a key of 0 needs the slot counts (the general path below), and so do a
        # key that is in its home bucket twice (with different checks) and a bucket that overflowed.
        bucket = self._home(keys)
        # The 8 equalities of a row, as the 8 bytes of one uint64: nonzero where the key is in the bucket, and
        # its lowest set byte is the first slot that holds it.
        eq = (np.take(self.keys, bucket, axis=0) == keys[:, None]).view(U64).reshape(-1)
        cand = np.flatnonzero(eq)
        low = eq[cand]
        low &= U64(0) - low
        slot = bucket[cand] * self.SLOTS + (np.log2(low.astype(np.float64)).astype(np.int64) >> 3)
        ok = np.take(self.checks.reshape(-1), slot) == checks[cand]
        out[cand[ok]] = slot[ok]
        rest = ((eq == 0) & (np.take(self.count, bucket) == self.SLOTS)) | (keys == 0)
        rest[cand[~ok]] = True
        rest = np.flatnonzero(rest)
        if len(rest):
            out[rest] = self._find_slow(keys[rest], checks[rest])
        return out

    def _find_slow(self, keys: np.ndarray, checks: np.ndarray) -> np.ndarray:
        """find, bucket by bucket: every slot in use of each bucket from the home bucket on, until one is not full."""
        n = len(keys)
        out = np.full(n, -1, np.int64)
        mask = self.num_buckets - 1
        bucket = self._home(keys)
        idx = np.arange(n)
        while len(idx):
            b = bucket[idx]
            hit = np.take(self.keys, b, axis=0) == keys[idx, None]
            hit &= np.take(self.checks, b, axis=0) == checks[idx, None]
            hit &= np.arange(self.SLOTS) < np.take(self.count, b)[:, None]
            got = hit.any(axis=1)
            out[idx[got]] = b[got] * self.SLOTS + hit[got].argmax(axis=1)
            more = ~got & (np.take(self.count, b) == self.SLOTS)
            idx = idx[more]
            bucket[idx] = (bucket[idx] + 1) & mask
        return out

    def contains(self, keys: np.ndarray, checks: np.ndarray) -> np.ndarray:
        return self.find(keys, checks) >= 0

    # -- inserts -------------------------------------------------------------------------------
    def insert_new(self, keys: np.ndarray, checks: np.ndarray, values: Optional[np.ndarray] = None) -> np.ndarray:
        """Insert pairs known to be absent and distinct; returns their slots."""
        n = len(keys)
        if not n:
            return np.zeros(0, np.int64)
        if (self.size + n) > self.num_buckets * self.SLOTS * self.MAX_LOAD:
            self._grow(self.size + n)
        slots = self._place(keys)
        self.keys.reshape(-1)[slots] = keys
        self.checks.reshape(-1)[slots] = checks
        if self.values is not None and values is not None:
            self.values.reshape(-1)[slots] = values
        self.size += n
        return slots

    def add(self, keys: np.ndarray, checks: np.ndarray, values: Optional[np.ndarray] = None) -> np.ndarray:
        """Insert pairs that may be present already or repeated; a value given overwrites (the last one of a
        repeated pair wins). Returns each pair's slot."""
        slots = self.find(keys, checks)
        new = np.flatnonzero(slots < 0)
        if len(new):
            first = first_of_each(keys[new], checks[new])
            ins = new[first]
            slots[ins] = self.insert_new(keys[ins], checks[ins])
            if len(first) < len(new):  # a pair repeated within keys: its later copies find the first
                again = np.flatnonzero(slots < 0)
                slots[again] = self.find(keys[again], checks[again])
        if self.values is not None and values is not None:
            self.values.reshape(-1)[slots] = values
        return slots

    def _place(self, keys: np.ndarray) -> np.ndarray:
        """Free slots for keys about to be inserted (absent, distinct); reserves them in self.count."""
        n = len(keys)
        slots = np.empty(n, np.int64)
        bucket = self._home(keys)
        mask = self.num_buckets - 1
        idx = np.arange(n)
        while len(idx):
            b = bucket[idx]
            order = np.argsort(b, kind="stable")
            idx, b = idx[order], b[order]
            start = np.empty(len(b), bool)
            start[0] = True
            np.not_equal(b[1:], b[:-1], out=start[1:])
            first = np.flatnonzero(start)
            rank = np.arange(len(b)) - np.repeat(first, np.diff(np.append(first, len(b))))
            pos = self.count[b].astype(np.int64) + rank
            fits = pos < self.SLOTS
            slots[idx[fits]] = b[fits] * self.SLOTS + pos[fits]
            gb = b[first]
            sizes = np.diff(np.append(first, len(b)))
            self.count[gb] = np.minimum(self.SLOTS, self.count[gb].astype(np.int64) + sizes)
            idx = idx[~fits]
            bucket[idx] = (bucket[idx] + 1) & mask
        return slots

    def _grow(self, need: int) -> None:
        occ = self.occupied()
        keys, checks = self.keys[occ], self.checks[occ]
        values = self.values[occ] if self.values is not None else None
        flags = self.flags[occ] if self.flags is not None else None
        self._alloc(max(self.bits + 1, self._bits_for(need)))
        self.size = 0
        for s in range(0, len(keys), CHUNK):  # in chunks: a sort of 64k keys stays in the cache
            e = s + CHUNK
            slots = self.insert_new(keys[s:e], checks[s:e], None if values is None else values[s:e])
            if flags is not None:
                self.flags.reshape(-1)[slots] = flags[s:e]

    # -- per slot --------------------------------------------------------------------------------
    def value_at(self, slots: np.ndarray) -> np.ndarray:
        return self.values.reshape(-1)[slots]

    def flags_at(self, slots: np.ndarray) -> np.ndarray:
        return self.flags.reshape(-1)[slots]

    def set_flags(self, slots: np.ndarray, bits: int) -> None:
        f = self.flags.reshape(-1)
        f[slots] |= np.uint8(bits)


def first_of_each(keys: np.ndarray, checks: np.ndarray) -> np.ndarray:
    """Indices of the first occurrence of each distinct (key, check) pair, in ascending order."""
    n = len(keys)
    if n < 2:
        return np.arange(n)
    k = np.sort(keys)
    if not (k[1:] == k[:-1]).any():  # the usual case: no key twice
        return np.arange(n)
    order = np.lexsort((np.arange(n), checks, keys))
    k, c = keys[order], checks[order]
    start = np.empty(n, bool)
    start[0] = True
    start[1:] = (k[1:] != k[:-1]) | (c[1:] != c[:-1])
    return np.sort(order[start])
