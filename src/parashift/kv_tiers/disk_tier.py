"""The disk tier of the KV cache: one file per block in a private folder, each with a header
naming the block's tier identity and key and a checksum of its bytes, so that a block of another
model, dtype, shard or layout, or one damaged on disk, is dropped and recomputed, never used.
One process of the node writes and evicts (writer=True, with an LRU index rebuilt from the folder
at start, so the tier survives a restart); the others only read."""

from __future__ import annotations

import hashlib
import itertools
import logging
import os
import re
import stat
import struct
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

logger = logging.getLogger(__name__)

MAGIC = b"PSKV"
FORMAT_VERSION = 1
# magic, format version, reserved (0), identity, key, payload length, blake2b-256 of the payload
HEADER = struct.Struct("<4sHH32sQQ32s")
IDENTITY_BYTES = 32
KEY_LIMIT = 2**63
# One flat folder, no 256 subfolders: on ext4 (htree directories) creating, stat-ing, unlinking
# and listing 100k block files measured the same within noise either way (list + stat of all
# 100k: 0.23-0.36 s; stat 4-7 us; unlink 9-13 us), so subfolders would be code for no gain.
_BLOCK_NAME = re.compile(r"[0-9a-f]{16}\.kv")
_TMP_SUFFIX = ".tmp"  # a write in progress, or one a crash cut short (names start with ".")


def check_private_folder(folder: str) -> None:
    """Create `folder` (mode 0700, parents as needed) if missing. ValueError naming it and the fix
    unless it is a real folder (no link), this user's, with no group or other bits: the blocks
    hold what users wrote, and a planted block would be served to them."""
    if not os.path.lexists(folder):
        os.makedirs(folder, mode=0o700, exist_ok=True)
    st = os.lstat(folder)
    mode = stat.S_IMODE(st.st_mode)
    if stat.S_ISLNK(st.st_mode):
        problem, fix = "is a symbolic link", "give the folder it points to instead"
    elif not stat.S_ISDIR(st.st_mode):
        problem, fix = "is not a folder", "remove it or choose another path"
    elif st.st_uid != os.getuid():
        problem = f"belongs to uid {st.st_uid}, not to this user (uid {os.getuid()})"
        fix = f"chown {os.getuid()} {folder}"
    elif mode & 0o077:
        problem, fix = f"has mode {mode:o}, open to group or others", f"chmod 700 {folder}"
    else:
        return
    raise ValueError(f"the KV disk tier folder (--kv-disk-dir) {folder} {problem}: {fix}")


@dataclass
class DiskTierStats:
    hits: int = 0
    misses: int = 0  # absent, unreadable or dropped as corrupt
    bytes_read: int = 0  # payload bytes, comparable with the other tiers
    bytes_written: int = 0
    write_errors: int = 0
    dropped_corrupt: int = 0
    read_seconds: float = 0.0  # all read_into calls, hits and misses


class DiskTier:
    def __init__(self, folder: str, size_bytes: int, identity: bytes, payload_bytes: int,
                 writer: bool):
        if len(identity) != IDENTITY_BYTES:
            raise ValueError(f"a KV tier identity has {IDENTITY_BYTES} bytes, not {len(identity)}")
        if payload_bytes <= 0:
            raise ValueError(f"payload_bytes must be positive, not {payload_bytes}")
        check_private_folder(folder)
        self.folder = folder
        self.identity = bytes(identity)
        self.payload_bytes = payload_bytes
        self.file_bytes = HEADER.size + payload_bytes
        self.capacity = max(size_bytes, 0) // self.file_bytes  # blocks
        if writer and self.capacity == 0:
            raise ValueError(f"the KV disk tier size ({size_bytes} bytes) holds no block of "
                             f"{self.file_bytes} bytes: raise it or turn the disk tier off")
        self.is_writer = writer
        self.stats = DiskTierStats()
        # The index and the stats are shared by the writer thread and the threads that load.
        self._lock = threading.Lock()
        self._index: OrderedDict[int, int] = OrderedDict()  # key -> mtime_ns, least recent first
        self._logged: set[tuple[str, object]] = set()
        self._tmp_ids = itertools.count()
        if writer:
            self._rebuild_index()

    def path(self, key: int) -> str:
        return os.path.join(self.folder, f"{key:016x}.kv")

    def contains(self, key: int) -> bool:
        if self.is_writer:
            return key in self._index
        try:
            os.stat(self.path(key))
        except OSError:
            return False
        return True

    def num_blocks(self) -> int:
        return len(self._index)

    # --- writing (the writer process only) --------------------------------------------------
    def write(self, key: int, data: memoryview | bytes) -> bool:
        """Store one block unless present, evicting the least recently used first so that the
        folder never exceeds size_bytes. False (logged once per kind of error) when the disk
        refuses: the block is then recomputed when needed, nothing fails."""
        assert self.is_writer, "only the node's writer process writes to the disk tier"
        assert 0 <= key < KEY_LIMIT, key
        payload = memoryview(data).cast("B")
        assert payload.nbytes == self.payload_bytes, (payload.nbytes, self.payload_bytes)
        path = self.path(key)
        if key in self._index:
            if os.path.exists(path):
                return True
            self._forget(key)  # a reader dropped it as corrupt
        self._evict_to(self.capacity - 1)
        checksum = hashlib.blake2b(payload, digest_size=32).digest()
        header = HEADER.pack(MAGIC, FORMAT_VERSION, 0, self.identity, key, self.payload_bytes,
                             checksum)
        tmp = os.path.join(self.folder,
                           f".{key:016x}.{os.getpid()}.{next(self._tmp_ids)}{_TMP_SUFFIX}")
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                         0o600)
            try:
                for part in (memoryview(header), payload):
                    while part:
                        part = part[os.write(fd, part):]
                mtime_ns = os.fstat(fd).st_mtime_ns
            finally:
                os.close(fd)
            # No fsync: after a power loss a renamed file may hold zeros, which the checksum
            # catches; the rename keeps a crash from leaving a half-written block under its name.
            os.replace(tmp, path)
        except OSError as e:
            self._remove(tmp)
            self._log_once("write", e)
            with self._lock:
                self.stats.write_errors += 1
            return False
        with self._lock:
            self._index[key] = mtime_ns
            self.stats.bytes_written += self.payload_bytes
        return True

    def _evict_to(self, num_blocks: int) -> None:
        # A candidate whose mtime moved since we recorded it was read by another process of the
        # node (readers touch what they use): it goes to the back instead, so LRU holds across
        # processes. Each touch buys one pass, so this ends.
        while True:
            with self._lock:
                if len(self._index) <= num_blocks:
                    return
                key, mtime_ns = self._index.popitem(last=False)
            path = self.path(key)
            try:
                now_ns = os.stat(path).st_mtime_ns
            except FileNotFoundError:
                continue
            except OSError:
                now_ns = mtime_ns
            if now_ns > mtime_ns:
                with self._lock:
                    self._index[key] = now_ns
            else:
                self._remove(path)

    def _rebuild_index(self) -> None:
        entries: list[tuple[int, int]] = []  # (mtime_ns, key)
        removed = 0
        with os.scandir(self.folder) as it:
            for entry in it:
                if entry.name.endswith(_TMP_SUFFIX):
                    removed += self._remove(entry.path)
                    continue
                if not _BLOCK_NAME.fullmatch(entry.name):
                    continue  # not ours: left alone
                key = int(entry.name[:16], 16)
                try:
                    st = entry.stat(follow_symlinks=False)
                except OSError:
                    continue
                if (key >= KEY_LIMIT or not stat.S_ISREG(st.st_mode)
                        or st.st_size != self.file_bytes):
                    removed += self._remove(entry.path)  # another block size, or cut short
                    continue
                entries.append((st.st_mtime_ns, key))
        entries.sort()
        self._index = OrderedDict((key, mtime_ns) for mtime_ns, key in entries)
        self._evict_to(self.capacity)  # the size may have been lowered since the last run
        logger.info("KV disk tier %s: %d blocks of %d bytes kept (at most %d), %d stale files "
                    "removed", self.folder, len(self._index), self.file_bytes, self.capacity,
                    removed)

    # --- reading (any process of the node) --------------------------------------------------
    def read_into(self, key: int, out: memoryview) -> bool:
        """Load one block into `out` (payload_bytes long). False when it is absent, unreadable
        or fails a check (then the file is deleted); `out` then holds nothing usable."""
        start = time.perf_counter()
        dest = out.cast("B") if out.format != "B" else out
        assert dest.nbytes == self.payload_bytes, (dest.nbytes, self.payload_bytes)
        path = self.path(key)
        header = bytearray(HEADER.size)
        num_read, size = 0, -1
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
            try:
                size = os.fstat(fd).st_size
                if size == self.file_bytes:
                    num_read = _read_fully(fd, [header, dest])
            finally:
                os.close(fd)
        except OSError as e:
            if isinstance(e, FileNotFoundError):
                self._forget(key)
            else:
                self._log_once("read", e)
            return self._miss(start)
        problem = (self._check(key, header, dest) if num_read == self.file_bytes
                   else ("size", f"size {size}, not {self.file_bytes}"))
        if problem is not None:
            self._drop(key, path, problem)
            return self._miss(start)
        now_ns = time.time_ns()
        try:
            os.utime(path, ns=(now_ns, now_ns), follow_symlinks=False)  # the LRU order on disk
        except OSError:
            pass  # evicted meanwhile: the bytes read are still whole and checked
        with self._lock:
            if key in self._index:
                self._index[key] = now_ns
                self._index.move_to_end(key)
            self.stats.hits += 1
            self.stats.bytes_read += self.payload_bytes
            self.stats.read_seconds += time.perf_counter() - start
        return True

    def _check(self, key: int, header: bytearray, payload: memoryview) -> tuple[str, str] | None:
        """(kind, what is wrong), or None for a block that may be used."""
        magic, version, _, identity, file_key, length, checksum = HEADER.unpack(header)
        if magic != MAGIC:
            return "magic", "not a parashift KV block"
        if version != FORMAT_VERSION:
            return "version", f"format version {version}, not {FORMAT_VERSION}"
        if identity != self.identity:
            return "identity", "written for another model, dtype, block size, shard or layout"
        if file_key != key:
            return "key", f"holds key {file_key:016x}"
        if length != self.payload_bytes:
            return "length", f"payload of {length} bytes, not {self.payload_bytes}"
        if hashlib.blake2b(payload, digest_size=32).digest() != checksum:
            return "checksum", "checksum mismatch"
        return None

    def _miss(self, start: float) -> bool:
        with self._lock:
            self.stats.misses += 1
            self.stats.read_seconds += time.perf_counter() - start
        return False

    def _drop(self, key: int, path: str, problem: tuple[str, str]) -> None:
        self._remove(path)
        self._forget(key)
        with self._lock:
            self.stats.dropped_corrupt += 1
        if ("drop", problem[0]) not in self._logged:
            self._logged.add(("drop", problem[0]))
            logger.warning("KV disk tier: dropped %s (%s); the block is recomputed, and further "
                           "drops of this kind are only counted", path, problem[1])

    # --- helpers ------------------------------------------------------------------------------
    def _forget(self, key: int) -> None:
        with self._lock:
            self._index.pop(key, None)

    def _remove(self, path: str) -> int:
        try:
            os.unlink(path)
        except OSError:
            return 0
        return 1

    def _log_once(self, op: str, error: OSError) -> None:
        kind = (op, error.errno)
        if kind in self._logged:
            return
        self._logged.add(kind)
        logger.warning("KV disk tier %s: a block %s failed (%s); such blocks are recomputed, and "
                       "further %s errors of this kind are only counted", self.folder, op,
                       error.strerror or error, op)


def _read_fully(fd: int, parts: Sequence[bytearray | memoryview]) -> int:
    """Fill `parts` in order from `fd`; the bytes read (fewer at the end of the file)."""
    views = [memoryview(p) for p in parts]
    total = 0
    while views:
        n = os.readv(fd, views)
        if n == 0:
            break
        total += n
        while views and n >= len(views[0]):
            n -= len(views.pop(0))
        if views:
            views[0] = views[0][n:]
    return total
