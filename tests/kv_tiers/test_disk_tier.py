"""The disk tier: blocks round-trip and survive a restart; a block of another identity or key,
truncated or flipped, is refused and deleted; the folder must be private; eviction is LRU under
the size bound; a full disk only makes writes fail; the writer thread drains the host arena."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading

import pytest

from parashift.kv_tiers.disk_tier import HEADER, DiskTier
from parashift.kv_tiers.disk_writer import DiskWriter

PAYLOAD = 256
FILE = HEADER.size + PAYLOAD
IDENTITY = bytes(range(32))


def block(key: int) -> bytes:
    return bytes((key * 7 + i) % 251 for i in range(PAYLOAD))


def make_tier(folder, num_blocks: int = 8, writer: bool = True,
              identity: bytes = IDENTITY) -> DiskTier:
    return DiskTier(str(folder), num_blocks * FILE, identity, PAYLOAD, writer)


def read(tier: DiskTier, key: int) -> bytes | None:
    out = bytearray(PAYLOAD)
    return bytes(out) if tier.read_into(key, memoryview(out)) else None


def stored_keys(folder) -> set[int]:
    return {int(name[:16], 16) for name in os.listdir(folder) if name.endswith(".kv")}


def set_ages(tier: DiskTier, ages: dict[int, int]) -> None:
    """Each block's mtime `age` seconds in the past: a deterministic LRU order on disk."""
    now = os.stat(tier.folder).st_mtime_ns
    for key, age in ages.items():
        t = now - age * 10**9
        os.utime(tier.path(key), ns=(t, t))


def test_a_block_round_trips_with_its_header(tmp_path):
    tier = make_tier(tmp_path / "a" / "kv")  # parents created
    assert os.stat(tmp_path / "a" / "kv").st_mode & 0o777 == 0o700
    assert not tier.contains(5) and read(tier, 5) is None
    assert tier.write(5, block(5)) and tier.write(5, block(5))  # the second is skipped
    path = tier.path(5)
    assert os.path.basename(path) == "0000000000000005.kv"
    assert os.stat(path).st_mode & 0o777 == 0o600 and os.path.getsize(path) == FILE
    with open(path, "rb") as f:
        assert f.read(4) == b"PSKV"
    assert tier.contains(5) and read(tier, 5) == block(5)
    reader = make_tier(tier.folder, writer=False)
    assert reader.contains(5) and read(reader, 5) == block(5)
    assert tier.stats.hits == 1 and tier.stats.misses == 1
    assert tier.stats.bytes_written == PAYLOAD and tier.stats.bytes_read == PAYLOAD


@pytest.mark.parametrize("damage", ["identity", "key", "truncated", "flipped"])
def test_a_wrong_or_damaged_block_is_refused_and_deleted(tmp_path, damage):
    tier = make_tier(tmp_path)
    tier.write(1, block(1))
    key = 1
    if damage == "identity":
        tier = make_tier(tmp_path, writer=False, identity=bytes(32))
    elif damage == "key":
        key = 2
        os.rename(tier.path(1), tier.path(2))
    elif damage == "truncated":
        os.truncate(tier.path(1), FILE - 1)
    else:
        with open(tier.path(1), "r+b") as f:
            f.seek(FILE - 1)
            last = f.read(1)[0]
            f.seek(FILE - 1)
            f.write(bytes([last ^ 1]))
    assert read(tier, key) is None
    assert not os.path.exists(tier.path(key)) and not tier.contains(key)
    assert tier.stats.dropped_corrupt == 1 and tier.stats.misses == 1


def test_an_open_folder_is_refused_naming_it(tmp_path):
    folder = tmp_path / "kv"
    folder.mkdir(mode=0o755)
    folder.chmod(0o755)
    with pytest.raises(ValueError, match=f"{folder} has mode 755.*chmod 700"):
        make_tier(folder)
    folder.chmod(0o700)
    make_tier(folder)


def test_a_linked_folder_or_a_file_is_refused_naming_it(tmp_path):
    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    link = tmp_path / "link"
    link.symlink_to(real)
    with pytest.raises(ValueError, match=f"{link} is a symbolic link"):
        make_tier(link)
    plain = tmp_path / "file"
    plain.write_bytes(b"")
    with pytest.raises(ValueError, match=f"{plain} is not a folder"):
        make_tier(plain)


@pytest.mark.skipif(os.getuid() != 0, reason="giving a folder to another user needs root")
def test_a_folder_of_another_user_is_refused_naming_it(tmp_path):
    folder = tmp_path / "kv"
    folder.mkdir(mode=0o700)
    os.chown(folder, 4242, -1)
    with pytest.raises(ValueError, match=f"{folder} belongs to uid 4242.*chown"):
        make_tier(folder)


def test_eviction_keeps_the_bound_and_drops_the_least_recently_used(tmp_path):
    tier = make_tier(tmp_path, num_blocks=3)
    for key in (1, 2, 3):
        assert tier.write(key, block(key))
    assert read(tier, 1) == block(1)  # 2 is now the least recently used
    assert tier.write(4, block(4))
    assert stored_keys(tmp_path) == {1, 3, 4} and tier.num_blocks() == 3
    assert tier.write(5, block(5))
    assert stored_keys(tmp_path) == {1, 4, 5}
    assert sum(os.path.getsize(tier.path(k)) for k in stored_keys(tmp_path)) <= 3 * FILE


def test_a_read_by_another_process_counts_for_lru(tmp_path):
    tier = make_tier(tmp_path, num_blocks=3)
    for key in (1, 2, 3):
        tier.write(key, block(key))
    set_ages(tier, {1: 300, 2: 200, 3: 100})
    tier = make_tier(tmp_path, num_blocks=3)  # its index takes the ages above
    assert read(make_tier(tmp_path, writer=False), 1) == block(1)  # touches 1's file
    tier.write(4, block(4))
    assert stored_keys(tmp_path) == {1, 3, 4}


def test_a_restart_rebuilds_the_index_from_the_folder(tmp_path):
    tier = make_tier(tmp_path, num_blocks=4)
    for key in (1, 2, 3, 4):
        tier.write(key, block(key))
    set_ages(tier, {1: 100, 2: 400, 3: 200, 4: 300})
    (tmp_path / ".0000000000000009.77.0.tmp").write_bytes(b"cut short")  # a crash mid-write
    (tmp_path / "0000000000000008.kv").write_bytes(b"short")
    (tmp_path / "notes.txt").write_text("not ours")
    # Restarted with the size lowered to 3 blocks: the oldest (2) goes.
    tier = make_tier(tmp_path, num_blocks=3)
    assert sorted(os.listdir(tmp_path)) == sorted(
        [os.path.basename(tier.path(k)) for k in (1, 3, 4)] + ["notes.txt"])
    assert all(read(tier, k) == block(k) for k in (1, 3, 4))  # order now 1, 3, 4
    tier.write(5, block(5))
    assert stored_keys(tmp_path) == {3, 4, 5}


FULL_DISK = """
import json, logging, os, resource, signal, sys
from parashift.kv_tiers.disk_tier import DiskTier
logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
folder, payload = sys.argv[1], int(sys.argv[2])
tier = DiskTier(folder, 16 * (payload + 100), bytes(32), payload, True)
first = tier.write(1, b"a" * payload)
# Past this size a write fails with EFBIG (SIGXFSZ ignored), as on a full disk.
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (payload // 2, resource.RLIM_INFINITY))
failed = [tier.write(k, b"b" * payload) for k in (2, 3)]
out = bytearray(payload)
back = tier.read_into(1, memoryview(out)) and bytes(out) == b"a" * payload
print(json.dumps({"first": first, "failed": failed, "back": back, "files": sorted(
    os.listdir(folder)), "errors": tier.stats.write_errors, "has_2": tier.contains(2)}))
"""


def test_a_full_disk_fails_writes_and_keeps_serving(tmp_path):
    folder = tmp_path / "kv"
    run = subprocess.run([sys.executable, "-c", textwrap.dedent(FULL_DISK), str(folder),  # nosec
                          str(PAYLOAD)], capture_output=True, text=True, check=True)
    result = json.loads(run.stdout)
    assert result == {"first": True, "failed": [False, False], "back": True,
                      "files": ["0000000000000001.kv"], "errors": 2, "has_2": False}
    assert run.stderr.count("further write errors of this kind are only counted") == 1
    assert "File too large" in run.stderr


class FakeArena:
    """The host arena's interface to DiskWriter: numbered slots of one block each."""

    def __init__(self, keys: list[int]):
        self.keys = dict(enumerate(keys))
        self.data = {slot: block(key) for slot, key in self.keys.items()}
        self.persisted: set[int] = set()
        self.pins = dict.fromkeys(self.keys, 0)
        self.drained = threading.Event()  # set when a call finds nothing left to persist
        self.lock = threading.Lock()

    def unpersisted(self, limit: int) -> list[tuple[int, int]]:
        with self.lock:
            batch = [(s, k) for s, k in self.keys.items() if s not in self.persisted][:limit]
            for slot, _ in batch:
                self.pins[slot] += 1
            if not batch:
                self.drained.set()
            return batch

    def slot(self, index: int) -> memoryview:
        assert self.pins[index] > 0, "read while unpinned"
        return memoryview(self.data[index])

    def mark_persisted(self, slots: list[int]) -> None:
        with self.lock:
            self.persisted.update(slots)

    def unpin(self, slots: list[int]) -> None:
        with self.lock:
            for slot in slots:
                self.pins[slot] -= 1


def test_a_batch_marks_only_what_was_written_and_unpins_all(tmp_path):
    tier = make_tier(tmp_path, num_blocks=8)
    arena = FakeArena([10, 11, 12])
    write = tier.write
    tier.write = lambda key, data: key != 11 and write(key, data)  # 11 meets a disk error
    writer = DiskWriter(tier, arena)
    assert writer.persist_batch() == (2, 1)
    assert arena.persisted == {0, 2} and set(arena.pins.values()) == {0}
    assert writer.persist_batch() == (0, 1)  # 11 is offered again
    assert stored_keys(tmp_path) == {10, 12}


def test_the_writer_thread_persists_the_arena_and_stops(tmp_path):
    tier = make_tier(tmp_path, num_blocks=200)
    keys = list(range(100, 250))  # three batches
    arena = FakeArena(keys)
    writer = DiskWriter(tier, arena)
    assert writer.name == "parashift-kv-disk" and writer.daemon
    writer.start()
    writer.wake()
    assert arena.drained.wait(timeout=60)  # a hang guard, not a time limit
    writer.stop()
    assert not writer.is_alive()
    assert arena.persisted == set(arena.keys) and set(arena.pins.values()) == {0}
    reader = make_tier(tmp_path, writer=False)
    assert all(read(reader, key) == block(key) for key in keys)
