"""The host tier: KV blocks in one shared-memory file per node, readable and writable by every
engine and worker process of the node (DP ranks share what any of them stored).

The file holds a small index and the slots. The index is set-associative, as a CPU cache is:
a block's key picks a set of WAYS consecutive slots and the block lives in one of them, so a
lookup reads WAYS entries, needs no separate hash table, and stays bounded by the file's size;
a full set evicts its least recently used ready slot. A slot is FREE, WRITING (a store or a
disk read fills it) or READY; a pinned slot (a load or a disk write reads it) is never
evicted. Index updates take a lock: flock on the file between processes, a thread lock
within one (flock is per open file, so threads sharing it would not exclude each other).

Pins and WRITING slots are kept per holder: a process that pins or reserves first claims one
of MAX_HOLDERS holder numbers, with an open file description lock on that number's byte of
the file, which the kernel drops when the process dies. A holder that died (SIGKILL, the OOM
killer) leaves pins and half-written slots that no one would release; whoever claims its
number next, or finds a set with nothing to evict, sees its byte unlocked and releases them.

Keys are 63-bit digests of (the tier identity, the block hash), kv_tiers/identity.py: blocks
of another model, dtype or shard layout never match."""

from __future__ import annotations

import contextlib
import fcntl
import logging
import mmap
import os
import struct
import threading
import weakref
from collections.abc import Iterator, Sequence

import numpy as np

from parashift.kv_tiers.shm_files import FLOCK, hold, remove

logger = logging.getLogger(__name__)

WAYS = 16
MAX_HOLDERS = 64  # processes of a node that pin or write at once (engines, not workers)
FREE, WRITING, READY = 0, 1, 2
_MAGIC = b"PSKVHOST"
_VERSION = 2
_HEADER = struct.Struct("<8sIIQQQ")  # magic, version, ways, num_slots, slot_bytes, clock offset
_PAGE = 4096


def _round_up(n: int, to: int) -> int:
    return -(-n // to) * to


def _holder_byte(holder: int) -> int:
    return 1 + holder  # byte 0 is `hold`'s


class HostArena:
    """A mapped arena: `open` makes or maps the node's file, `attach` maps it (a worker)."""

    def __init__(self, path: str, fd: int, owner: bool):
        self.path, self._fd, self.owner = path, fd, owner
        # The owner's name goes when it closes, or at the latest when the process exits (an
        # LLM never shut down would leave the arena's memory taken until a reboot).
        self._unlink = weakref.finalize(self, remove, path) if owner else None
        hold(fd)
        size = os.fstat(fd).st_size
        if size < _PAGE:
            raise ValueError(f"KV host tier {path}: {size} bytes, not an arena")
        self._map = mmap.mmap(fd, size)
        magic, version, ways, num_slots, slot_bytes, _ = _HEADER.unpack_from(self._map, 0)
        if magic != _MAGIC or version != _VERSION or ways != WAYS:
            raise ValueError(f"KV host tier {path}: not an arena of this parashift version")
        self.num_slots, self.slot_bytes = num_slots, slot_bytes
        self.num_sets = num_slots // WAYS
        self._stride = _round_up(slot_bytes, 64)
        buf = memoryview(self._map)
        offset = _PAGE

        def array(dtype, count: int = num_slots) -> np.ndarray:
            nonlocal offset
            out = np.frombuffer(buf, dtype=dtype, count=count, offset=offset)
            offset += _round_up(out.nbytes, 64)
            return out

        self._clock = array(np.uint64, 1)
        self.keys = array(np.int64)
        self.state = array(np.uint8)
        self.persisted = array(np.uint8)
        self.ticks = array(np.uint64)
        self._writer = array(np.int16)  # a WRITING slot's holder, plus one (0: none)
        self._live = array(np.uint8, MAX_HOLDERS)  # holder numbers claimed
        self._pins = array(np.int32, MAX_HOLDERS * num_slots).reshape(MAX_HOLDERS, num_slots)
        self._holder: int | None = None
        self._data_offset = _round_up(offset, _PAGE)
        if self._data_offset + num_slots * self._stride > size:
            raise ValueError(f"KV host tier {path}: truncated")
        self._data = buf
        self._thread_lock = threading.Lock()

    @staticmethod
    def file_bytes(num_slots: int, slot_bytes: int) -> int:
        widths = (8, 1, 1, 8, 2, 4 * MAX_HOLDERS)
        index = (sum(_round_up(num_slots * width, 64) for width in widths) + 64
                 + _round_up(MAX_HOLDERS, 64))
        return _round_up(_PAGE + index, _PAGE) + num_slots * _round_up(slot_bytes, 64)

    @classmethod
    def open(cls, path: str, size_bytes: int, slot_bytes: int, owner: bool) -> HostArena:
        """The node's arena at `path`: made by whichever process comes first (written under
        a temporary name, then linked, so no one maps a half-made file), mapped by the rest.
        `owner`: this process unlinks the name when it closes (the launcher, or an engine
        with an arena of its own)."""
        try:
            return cls._attach(path, slot_bytes, owner)
        except FileNotFoundError:
            pass
        num_slots = size_bytes // _round_up(slot_bytes, 64) // WAYS * WAYS
        while num_slots and cls.file_bytes(num_slots, slot_bytes) > size_bytes:
            num_slots -= WAYS
        if num_slots < WAYS:
            tenths = -(-cls.file_bytes(WAYS, slot_bytes) * 10 // 2**20)  # rounded up: enough
            raise ValueError(f"--kv-offloading-size {size_bytes / 2**20:.1f} MiB holds fewer "
                             f"than {WAYS} KV blocks of {slot_bytes} bytes: give it at least "
                             f"{tenths / 10:.1f} MiB")
        temp = f"{path}.{os.getpid()}.{threading.get_ident()}"
        fd = os.open(temp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        try:
            os.ftruncate(fd, cls.file_bytes(num_slots, slot_bytes))
            with mmap.mmap(fd, _PAGE) as head:
                _HEADER.pack_into(head, 0, _MAGIC, _VERSION, WAYS, num_slots, slot_bytes, 0)
            arena = cls(path, fd, owner)
            arena.keys[:] = -1
            os.link(temp, path)
        except FileExistsError:
            arena.close(unlink=False)
            return cls._attach(path, slot_bytes, owner)
        except BaseException:
            os.close(fd)
            raise
        finally:
            os.unlink(temp)
        return arena

    @classmethod
    def attach(cls, path: str, slot_bytes: int | None) -> HostArena:
        """`slot_bytes`: what the caller's blocks take (None: whatever the arena's take)."""
        return cls._attach(path, slot_bytes, owner=False)

    @classmethod
    def _attach(cls, path: str, slot_bytes: int | None, owner: bool) -> HostArena:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
        try:
            st = os.fstat(fd)
            if st.st_uid != os.getuid() or st.st_mode & 0o077:
                raise ValueError(f"KV host tier {path}: not this user's private file")
            arena = cls(path, fd, owner)
        except BaseException:
            os.close(fd)
            raise
        if slot_bytes is not None and arena.slot_bytes != slot_bytes:
            arena.close(unlink=False)
            raise ValueError(f"KV host tier {path}: slots of {arena.slot_bytes} bytes, this "
                             f"engine's blocks take {slot_bytes}")
        return arena

    def close(self, unlink: bool = True) -> None:
        """Unmaps (a view still alive keeps the map until it goes); the owner unlinks. This
        process's pins go; a slot it still writes (a worker's copy may not have ended) stays
        WRITING until its holder number is next claimed or found dead, once this file is
        closed."""
        if self._holder is not None:
            with self._locked():
                self._pins[self._holder] = 0
                self._live[self._holder] = (self._writer == self._holder + 1).any()
        for name in ("keys", "state", "persisted", "ticks", "_writer", "_live", "_pins",
                     "_clock"):
            setattr(self, name, None)
        with contextlib.suppress(BufferError):  # a view still alive: the map goes with it
            self._data.release()
            self._map.close()
        os.close(self._fd)
        if self._unlink is not None:
            self._unlink() if unlink else self._unlink.detach()

    # --- the data ---------------------------------------------------------------------------
    def slot(self, index: int) -> memoryview:
        start = self._data_offset + index * self._stride
        return self._data[start:start + self.slot_bytes]

    def data(self) -> memoryview:
        """Every slot, `slot_stride` bytes apart (the workers' copies index it)."""
        return self._data[self._data_offset:self._data_offset + self.num_slots * self._stride]

    @property
    def slot_stride(self) -> int:
        return self._stride

    # --- the index ----------------------------------------------------------------------------
    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        with self._thread_lock:
            fcntl.flock(self._fd, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(self._fd, fcntl.LOCK_UN)

    @property
    def pins(self) -> np.ndarray:
        """Each slot's pins, every holder's together (a copy)."""
        return self._pins.sum(axis=0)

    def _me(self) -> int:
        """This open file's holder number, claimed at its first pin or reservation (under the
        index lock). A number whose last holder died is released first, then taken."""
        if self._holder is None:
            for holder in range(MAX_HOLDERS):
                try:
                    fcntl.fcntl(self._fd, fcntl.F_OFD_SETLK, FLOCK.pack(
                        fcntl.F_WRLCK, os.SEEK_SET, _holder_byte(holder), 1, 0))
                except OSError:  # (EAGAIN) a live process holds it
                    continue
                if self._live[holder]:
                    self._release(holder)
                self._live[holder], self._holder = 1, holder
                break
            else:
                raise RuntimeError(f"KV host tier {self.path}: more than {MAX_HOLDERS} "
                                   "processes pin its blocks at once")
        return self._holder

    def _release(self, holder: int) -> None:
        """What a dead holder held: its pins go, its half-written slots are freed."""
        writing = np.flatnonzero((self._writer == holder + 1) & (self.state == WRITING))
        self.keys[writing], self.state[writing], self._writer[writing] = -1, FREE, 0
        num_pins = int(self._pins[holder].sum())
        self._pins[holder] = 0
        self._live[holder] = 0
        if num_pins or len(writing):
            logger.warning("KV host tier: released %d pins and %d slots being written that a "
                           "closed or dead process held", num_pins, len(writing))

    def _reclaim(self) -> bool:
        """Releases what dead holders held (a probe per claimed number: only a set with
        nothing to evict asks); True if any."""
        found = False
        for holder in np.flatnonzero(self._live):
            if holder == self._holder:
                continue
            probe = FLOCK.pack(fcntl.F_WRLCK, os.SEEK_SET, _holder_byte(int(holder)), 1, 0)
            kind = FLOCK.unpack(fcntl.fcntl(self._fd, fcntl.F_OFD_GETLK, probe))[0]
            if kind == fcntl.F_UNLCK:
                self._release(int(holder))
                found = True
        return found

    def _tick(self) -> int:
        self._clock[0] += 1
        return int(self._clock[0])

    def _find(self, key: int) -> int | None:
        base = key % self.num_sets * WAYS
        ways = np.flatnonzero(self.keys[base:base + WAYS] == key)
        return base + int(ways[0]) if len(ways) else None

    def lookup(self, keys: Sequence[int]) -> list[int]:
        """The slots of the longest run of `keys`, from the first, that are READY; each is
        pinned (`unpin` when read) and counts as a use."""
        out = []
        with self._locked():
            me = self._me()
            for key in keys:
                slot = self._find(key)
                if slot is None or self.state[slot] != READY:
                    break
                self._pins[me, slot] += 1
                self.ticks[slot] = self._tick()
                out.append(slot)
        return out

    def contains(self, key: int) -> bool:
        """Held, or being written."""
        with self._locked():
            return self._find(key) is not None

    def reserve(self, keys: Sequence[int]) -> list[int | None]:
        """A WRITING slot for each key (to `publish` or `abandon`), or None where the key is
        held already or its set has nothing to evict (every way written or pinned)."""
        out: list[int | None] = []
        with self._locked():
            me = self._me()
            for key in keys:
                if self._find(key) is not None:
                    out.append(None)
                    continue
                base = key % self.num_sets * WAYS
                ways = slice(base, base + WAYS)
                evictable = (self.state[ways] == READY) & ~self._pins[:, ways].any(axis=0)
                if not (evictable.any() or (self.state[ways] == FREE).any()) and self._reclaim():
                    evictable = (self.state[ways] == READY) & ~self._pins[:, ways].any(axis=0)
                free = np.flatnonzero(self.state[ways] == FREE)
                if len(free):
                    slot = base + int(free[0])
                else:
                    if not evictable.any():
                        out.append(None)
                        continue
                    # LRU, on disk already first: an evicted block is then still there
                    ticks = np.where(evictable, self.ticks[ways] + np.where(
                        self.persisted[ways] == 1, 0, 1 << 62).astype(np.uint64),
                        np.iinfo(np.uint64).max)
                    slot = base + int(np.argmin(ticks))
                self.keys[slot], self.state[slot], self._writer[slot] = key, WRITING, me + 1
                self.persisted[slot] = 0
                self.ticks[slot] = self._tick()
                out.append(slot)
        return out

    def publish(self, slots: Sequence[int], persisted: bool = False, pin: bool = False) -> None:
        """Filled: WRITING -> READY (`persisted`: read from the disk tier, on it already;
        `pin`: pinned for a load that follows)."""
        with self._locked():
            me = self._me()
            for slot in slots:
                self.state[slot], self._writer[slot] = READY, 0
                self.persisted[slot] = persisted
                self._pins[me, slot] += pin

    def abandon(self, slots: Sequence[int]) -> None:
        """Not filled after all: WRITING -> FREE."""
        with self._locked():
            for slot in slots:
                self.keys[slot], self.state[slot], self._writer[slot] = -1, FREE, 0

    def unpin(self, slots: Sequence[int]) -> None:
        with self._locked():
            me = self._me()
            for slot in slots:
                self._pins[me, slot] -= 1

    def unpersisted(self, limit: int) -> list[tuple[int, int]]:
        """Up to `limit` READY slots not on disk yet, as (slot, key), each pinned."""
        with self._locked():
            slots = np.flatnonzero((self.state == READY) & (self.persisted == 0))[:limit]
            self._pins[self._me(), slots] += 1
            return [(int(s), int(self.keys[s])) for s in slots]

    def mark_persisted(self, slots: Sequence[int]) -> None:
        with self._locked():
            self.persisted[list(slots)] = 1

    def num_ready(self) -> int:
        return int(np.count_nonzero(self.state == READY))
