"""The host tier's arena in real shared memory: made by the first open and attached by the rest,
refused when its slots, mode or size do not fit; lookup finds the ready run from the first key
and pins it; a full set evicts its least recently used ready, unpinned slot; the disk writer's
unpersisted slots; another process sees the same slots and index; what a killed process pinned
or wrote is released."""

from __future__ import annotations

import glob
import json
import os
import re
import subprocess
import sys
import textwrap
import uuid

import numpy as np
import pytest

from parashift.kv_tiers.host_arena import FREE, READY, WAYS, WRITING, HostArena
from parashift.kv_tiers.shm_files import shm_path, sweep

SLOT_BYTES = 1024


@pytest.fixture
def path():
    """A unique arena name in /dev/shm; nothing of it (nor its temporary names) may outlive
    the test."""
    name = shm_path(f"parashift-test-arena-{uuid.uuid4().hex}")
    yield name
    left = glob.glob(name + "*")
    for leftover in left:
        os.unlink(leftover)
    assert not left, f"left in /dev/shm: {left}"


def make(path: str, num_slots: int = 2 * WAYS, slot_bytes: int = SLOT_BYTES) -> HostArena:
    arena = HostArena.open(path, HostArena.file_bytes(num_slots, slot_bytes), slot_bytes,
                           owner=True)
    assert arena.num_slots == num_slots
    return arena


def same_set(arena: HostArena, count: int, which: int = 0) -> list[int]:
    """`count` keys that all map to set `which`."""
    return [which + k * arena.num_sets for k in range(1, count + 1)]


def store(arena: HostArena, keys: list[int], **publish) -> list[int]:
    slots = arena.reserve(keys)
    assert None not in slots
    arena.publish(slots, **publish)
    return slots


# --- open, attach, refusals -----------------------------------------------------------------
def test_the_first_open_makes_the_arena_a_second_attaches_and_the_owner_unlinks(path):
    first = make(path)
    assert os.stat(path).st_mode & 0o777 == 0o600
    assert first.num_slots == 2 * WAYS and first.num_sets == 2 and first.num_ready() == 0
    assert all(first.state == FREE) and all(first.keys == -1)
    second = HostArena.open(path, 10 * HostArena.file_bytes(4 * WAYS, SLOT_BYTES), SLOT_BYTES,
                            owner=False)  # another size: the node's arena counts
    assert (second.num_slots, second.slot_bytes) == (first.num_slots, SLOT_BYTES)
    first.slot(3)[:4] = b"abcd"
    assert bytes(second.slot(3)[:4]) == b"abcd"
    [slot] = second.reserve([7])
    assert first.contains(7) and first.state[slot] == WRITING
    second.close()
    assert os.path.exists(path)  # not the owner
    first.close()
    assert not os.path.exists(path)


def test_attach_refuses_other_slot_sizes_and_an_open_mode(path):
    arena = make(path)
    with pytest.raises(ValueError, match=f"slots of {SLOT_BYTES} bytes.*take {2 * SLOT_BYTES}"):
        HostArena.attach(path, 2 * SLOT_BYTES)
    with pytest.raises(ValueError, match=f"{SLOT_BYTES}.*{2 * SLOT_BYTES}"):
        HostArena.open(path, 1 << 20, 2 * SLOT_BYTES, owner=False)
    for mode in (0o640, 0o604):
        os.chmod(path, mode)
        with pytest.raises(ValueError, match="not this user's private file"):
            HostArena.attach(path, SLOT_BYTES)
    arena.close()


def test_attach_needs_the_file(path):
    with pytest.raises(FileNotFoundError):
        HostArena.attach(path, SLOT_BYTES)


def test_a_size_below_ways_slots_says_how_much_to_give(path):
    slot_bytes = 1 << 16  # WAYS slots and the index: a little over 1 MiB
    with pytest.raises(ValueError, match=f"fewer than {WAYS} KV blocks of {slot_bytes} bytes"
                       ) as refused:
        HostArena.open(path, HostArena.file_bytes(WAYS, slot_bytes) - 1, slot_bytes, owner=True)
    assert not glob.glob(path + "*")
    advice = re.search(r"at least ([\d.]+) MiB", str(refused.value))
    assert advice is not None
    arena = HostArena.open(path, int(float(advice[1]) * 2**20), slot_bytes, owner=True)
    assert arena.num_slots == WAYS
    arena.close()


# --- lookup, reserve, publish, abandon, unpin -----------------------------------------------
def test_lookup_pins_the_ready_run_from_the_first_key(path):
    arena = make(path)
    a, b, c, d = 11, 12, 13, 14
    slots = arena.reserve([a, b, c])
    assert None not in slots and len(set(slots)) == 3
    assert all(arena.state[slots] == WRITING)
    assert arena.lookup([a]) == []  # being written: not found
    arena.publish(slots[:2])
    assert arena.num_ready() == 2
    assert arena.lookup([a, b, c]) == slots[:2]  # c is still WRITING
    assert list(arena.pins[slots]) == [1, 1, 0]
    assert arena.lookup([d, a]) == [] and arena.lookup([c, a]) == []  # the run starts at d, c
    assert arena.lookup([b]) == [slots[1]]
    assert list(arena.pins[slots]) == [1, 2, 0]
    arena.unpin(slots[:2])
    arena.unpin([slots[1]])
    assert list(arena.pins[slots]) == [0, 0, 0]
    arena.close()


def test_reserve_refuses_held_keys_and_abandon_frees(path):
    arena = make(path)
    [a] = store(arena, [1])
    [b] = arena.reserve([2])
    assert arena.reserve([1, 2]) == [None, None]  # READY, WRITING
    [c, again] = arena.reserve([3, 3])
    assert c is not None and again is None
    arena.abandon([b, c])
    assert not arena.contains(2) and not arena.contains(3)
    assert arena.state[b] == FREE and arena.keys[b] == -1
    assert arena.contains(1) and arena.lookup([1]) == [a]
    [b2] = arena.reserve([2])
    arena.publish([b2], pin=True)
    assert arena.state[b2] == READY and arena.pins[b2] == 1
    arena.close()


# --- eviction -------------------------------------------------------------------------------
def test_a_full_set_evicts_its_least_recently_used_ready_unpinned_slot(path):
    arena = make(path)
    [neighbour] = store(arena, same_set(arena, 1, which=1))
    keys = same_set(arena, WAYS + 2)
    slots = arena.reserve(keys[:WAYS])  # ticks in this order; publish leaves them
    assert sorted(slots) == list(range(WAYS))  # set 0, every way
    # the oldest: slots[0] still WRITING, slots[1] pinned, then slots[2], slots[3], ...
    arena.publish(slots[1:2], pin=True)
    arena.publish(slots[2:])
    assert arena.lookup([keys[3]]) == [slots[3]]  # a use: keys[3] is now the newest
    arena.unpin([slots[3]])
    assert arena.reserve(keys[WAYS:]) == [slots[2], slots[4]]
    assert [arena.contains(k) for k in keys[:5]] == [True, True, False, True, False]
    assert arena.state[slots[0]] == WRITING and arena.pins[slots[1]] == 1
    assert arena.keys[neighbour] == same_set(arena, 1, which=1)[0]  # set 1 had room: no matter
    arena.close()


def test_a_set_of_pinned_and_writing_ways_reserves_nothing(path):
    arena = make(path)
    keys = same_set(arena, WAYS + 1)
    slots = arena.reserve(keys[:WAYS])
    half = WAYS // 2
    arena.publish(slots[:half], pin=True)
    arena.lookup([keys[0]])  # pinned twice
    assert arena.reserve([keys[WAYS]]) == [None]
    [free_set] = arena.reserve(same_set(arena, 1, which=1))  # another set still has room
    assert free_set is not None
    arena.unpin(slots[:1])
    assert arena.reserve([keys[WAYS]]) == [None]  # keys[0] still pinned once
    arena.unpin(slots[:1])
    assert arena.reserve([keys[WAYS]]) == [slots[0]]
    arena.close()


# --- the disk writer's side -----------------------------------------------------------------
def test_unpersisted_offers_ready_slots_pinned_until_marked(path):
    arena = make(path)
    fresh = store(arena, [1, 2, 3])
    from_disk = store(arena, [4], persisted=True)
    arena.reserve([5])  # WRITING: not offered
    offered = arena.unpersisted(limit=2)
    held = sorted(zip(fresh, [1, 2, 3], strict=True))  # (slot, key), in slot order
    assert offered == held[:2]
    assert all(arena.pins[[s for s, _ in offered]] == 1)
    arena.mark_persisted([s for s, _ in offered])
    arena.unpin([s for s, _ in offered])
    [(last, key)] = arena.unpersisted(limit=10)
    assert (last, key) == held[2] and arena.pins[last] == 1
    assert from_disk[0] != last
    arena.mark_persisted([last])
    arena.unpin([last])
    assert arena.unpersisted(limit=10) == []
    assert all(arena.persisted[fresh + from_disk] == 1) and all(arena.pins[fresh] == 0)
    arena.close()


# --- across processes -----------------------------------------------------------------------
OTHER_PROCESS = """
    import json, sys
    from parashift.kv_tiers.host_arena import HostArena
    path, slot_bytes, key, new_key = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), \\
        int(sys.argv[4])
    arena = HostArena.open(path, 1 << 30, slot_bytes, owner=False)  # there: attached
    [slot] = arena.lookup([key])
    data = bytes(arena.slot(slot)).hex()
    arena.unpin([slot])
    [reserved] = arena.reserve([new_key])
    arena.slot(reserved)[:] = bytes(reversed(bytes.fromhex(data)))
    arena.publish([reserved])
    print(json.dumps({"num_slots": arena.num_slots, "slot": slot, "data": data,
                      "reserved": reserved}))
    arena.close()
"""


def test_another_process_shares_the_slots_and_the_index(path):
    arena = make(path)
    payload = bytes(np.random.default_rng(0).integers(0, 256, SLOT_BYTES, dtype=np.uint8))
    [slot] = arena.reserve([42])
    arena.slot(slot)[:] = payload
    arena.publish([slot])
    run = subprocess.run([sys.executable, "-c", textwrap.dedent(OTHER_PROCESS), path,  # nosec
                          str(SLOT_BYTES), "42", "43"], capture_output=True, text=True,
                         check=True)
    seen = json.loads(run.stdout)
    assert seen["num_slots"] == arena.num_slots
    assert seen["slot"] == slot and bytes.fromhex(seen["data"]) == payload
    assert arena.pins[slot] == 0  # its pin and unpin count here
    assert arena.contains(43) and arena.reserve([43]) == [None]
    [found] = arena.lookup([43])
    assert found == seen["reserved"] and bytes(arena.slot(found)) == payload[::-1]
    arena.close()


PINNER = """
    import sys
    from parashift.kv_tiers.host_arena import HostArena
    arena = HostArena.attach(sys.argv[1], int(sys.argv[2]))
    keys = [int(k) for k in sys.argv[3:]]
    pinned = arena.lookup(keys[:-1])
    [writing] = arena.reserve(keys[-1:])
    print(len(pinned), writing, flush=True)
    sys.stdin.read()  # until the test kills it
"""


def test_what_a_killed_process_pinned_or_wrote_is_released(path):
    """A process pins every way of a set but one and writes the last, then dies by SIGKILL
    (an engine killed mid-load): the set looked full of live holds; after the death a
    reserve finds the holder's lock gone and takes the slots back."""
    arena = make(path)
    keys = same_set(arena, WAYS + 1)
    oldest = store(arena, keys[:WAYS - 1])[0]
    other = same_set(arena, 2, which=1)
    killed = subprocess.Popen([sys.executable, "-c", textwrap.dedent(PINNER), path,  # nosec
                               str(SLOT_BYTES), *map(str, keys[:WAYS - 1]), str(other[0])],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        num_pinned, writing = map(int, killed.stdout.readline().split())
        assert num_pinned == WAYS - 1 and arena.state[writing] == WRITING
        [last] = arena.reserve([keys[WAYS - 1]])  # the set's last way, written here
        assert arena.reserve([keys[WAYS]]) == [None]  # the rest pinned by a live process
    finally:
        killed.kill()
        killed.wait()
    # The dead holder's pins are gone: the least recently used way is evicted.
    assert arena.reserve([keys[WAYS]]) == [oldest]
    arena.publish([last])
    assert not arena.contains(keys[0]) and not arena.pins.any()
    assert arena.state[writing] == FREE and not arena.contains(other[0])
    [again] = arena.reserve([other[0]])  # its half-written slot is free to write
    assert again == writing
    arena.close()


def test_a_clean_close_drops_its_pins(path):
    arena = make(path)
    keys = same_set(arena, WAYS + 1)
    store(arena, keys[:WAYS])
    other = HostArena.attach(path, SLOT_BYTES)
    assert len(other.lookup(keys[:WAYS])) == WAYS
    assert arena.reserve([keys[WAYS]]) == [None]
    other.close()
    assert not arena.pins.any() and arena.reserve([keys[WAYS]]) != [None]
    arena.close()


HOLDER = """
    import sys
    from parashift.kv_tiers.host_arena import HostArena
    arena = HostArena.open(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), owner=True)
    print("held", flush=True)
    sys.stdin.read()  # until the test kills it, or closes its stdin (then it exits cleanly)
"""


def test_the_sweep_takes_only_arenas_no_live_process_holds(tmp_path):
    """A launch killed by SIGKILL leaves its arena (its exit handlers never ran); the next
    start's sweep removes it, and nothing else: not an arena a live process holds (in another
    process or in this one), not a file younger than the age limit, not a link or a name of
    another pattern."""
    size = HostArena.file_bytes(WAYS, SLOT_BYTES)
    dead, there, here = (str(tmp_path / f"parashift-kv-{n}-{h}")
                         for n, h in ((123, "aa11"), (124, "bb22"), (125, "cc33")))
    holders = []
    for name in (dead, there):
        holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(HOLDER), name,  # nosec
                                   str(size), str(SLOT_BYTES)], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, text=True)
        assert holder.stdout.readline() == "held\n"
        holders.append(holder)
    holders[0].kill()
    holders[0].wait()
    assert os.path.exists(dead)
    mine = HostArena.open(here, size, SLOT_BYTES, owner=False)
    (tmp_path / "parashift-kv-jobs-x1").write_bytes(b"\0")
    os.symlink(dead, tmp_path / "parashift-kv-126-dd44")
    (tmp_path / "kept-parashift-kv-127-ee55").write_bytes(b"\0")
    try:
        assert sweep(str(tmp_path), min_age_s=3600) == []  # all of them younger than that
        assert sweep(str(tmp_path), min_age_s=0) == [(dead, size)]
        assert sorted(os.listdir(tmp_path)) == ["kept-parashift-kv-127-ee55",
                                                "parashift-kv-124-bb22", "parashift-kv-125-cc33",
                                                "parashift-kv-126-dd44", "parashift-kv-jobs-x1"]
        [slot] = mine.reserve([7])  # still this process's arena
        mine.publish([slot])
    finally:
        mine.close(unlink=False)
        holders[1].stdin.close()  # it exits, and its arena goes with it (owner)
        assert holders[1].wait() == 0
    assert not os.path.exists(there)
    assert sweep(str(tmp_path), min_age_s=0) == [(here, size)]  # closed: nobody holds it
