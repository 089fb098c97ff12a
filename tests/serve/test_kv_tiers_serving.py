"""The KV tiers of issue 53 behind real servers: a prefix dp0 computed is served to dp1 from
the node's host tier; a stopped server's blocks, flushed to the disk tier, are the first
prefix hit of the next one; a disk folder open to others is refused at start; damaged block
files are dropped and recomputed, never used; a request whose last step filled its blocks
still gets them stored."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import stat
import subprocess
import sys
import time

import psutil
import pytest

from parashift.kv_tiers.disk_tier import HEADER

from .servers import STARTUP_TIMEOUT, TINY_ARGS, running_server, wait_gone

pytestmark = pytest.mark.slow

PROMPT = [(37 * i + 11) % 250 + 1 for i in range(100)]  # token ids: 6 whole blocks of 16
# Whole blocks only, and at least one prompt token left to compute: 6 * 16.
NUM_CACHED = (len(PROMPT) - 1) // 16 * 16
NUM_BLOCKS = NUM_CACHED // 16
OTHER = [(53 * i + 7) % 250 + 1 for i in range(100)]  # shares no block with PROMPT
HOST_TIER = ("--kv-offloading-size", "8MiB")


def complete(server, rank: int | None = None, prompt: list[int] = PROMPT) -> tuple[str, int]:
    """The greedy answer to `prompt` and its cached_tokens."""
    headers = {} if rank is None else {"X-data-parallel-rank": str(rank)}
    status, raw = server.request("POST", "/v1/completions", {
        "prompt": prompt, "max_tokens": 4, "temperature": 0, "ignore_eos": True},
        headers=headers, timeout=120)
    assert status == 200, raw
    body = json.loads(raw)
    return body["choices"][0]["text"], body["usage"]["prompt_tokens_details"]["cached_tokens"]


def poll_metric(server, name: str, labels: str, done) -> float | None:
    """The sample of /metrics once `done(value)` holds (engines report their tier counts with
    their outputs), or the last one if that does not come within 30 s."""
    deadline = time.monotonic() + 30
    while not done(value := server.metric(name, labels)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return value


def wait_metric(server, name: str, labels: str, done) -> float | None:
    """poll_metric, asserting that `done` came (with the value and the log if not)."""
    value = poll_metric(server, name, labels, done)
    assert done(value), f"{name}{{{labels}}} is {value}; output:\n{server.output()[-4000:]}"
    return value


def stored(server, rank: int = 0, at_least: float = 1, check: bool = True) -> float:
    """Until the engine stored `at_least` bytes in the host arena (its prompt blocks' copies end
    asynchronously, after the step that filled them); the bytes stored."""
    return (wait_metric if check else poll_metric)(
        server, "parashift_kv_tier_bytes", f'direction="store",engine="dp{rank}"',
        lambda v: (v or 0) >= at_least)


def block_files(folder) -> list[str]:
    return sorted(os.path.join(folder, n) for n in os.listdir(folder) if n.endswith(".kv"))


@pytest.fixture(scope="module")
def dp2(tiny_llama):
    with running_server(tiny_llama, *TINY_ARGS, "--data-parallel-size", "2", *HOST_TIER) as s:
        yield s


def test_a_prefix_dp0_computed_is_served_to_dp1_from_the_host_tier(dp2):
    cold, cached = complete(dp2, rank=0)
    assert cached == 0
    stored(dp2, rank=0)
    from_host, cached = complete(dp2, rank=1)  # dp1 never saw PROMPT: the node's arena
    assert cached == NUM_CACHED, dp2.output()[-4000:]
    wait_metric(dp2, "parashift_kv_tier_hit_blocks", 'engine="dp1",tier="host"',
                lambda v: v == NUM_BLOCKS)
    local, cached = complete(dp2, rank=0)  # dp0's own pool
    assert cached == NUM_CACHED
    # dp0 computed all 100 prompt tokens, dp1 only the last 4 on 96 loaded: on float32 the
    # greedy tokens agree; wrong KV bytes would not.
    assert from_host == cold == local


def test_a_request_that_ends_in_its_prefill_step_stores_its_blocks_too(dp2):
    """max_tokens 1: the step that fills the prompt's blocks is the request's last, so no
    later step of that request settles the copy. The engine must still end it (and dp1 find
    the blocks), not leave it until its next request. (The other tests' requests, max_tokens 4,
    leave three steps for their copies to end in: under load that can be too few, too.)"""
    before = dp2.metric("parashift_kv_tier_bytes", 'direction="store",engine="dp0"') or 0
    status, raw = dp2.request("POST", "/v1/completions", {
        "prompt": OTHER, "max_tokens": 1, "temperature": 0, "ignore_eos": True},
        headers={"X-data-parallel-rank": "0"}, timeout=120)
    assert status == 200, raw
    after = stored(dp2, rank=0, at_least=before + 1, check=False)
    _, cached = complete(dp2, rank=1, prompt=OTHER)
    assert cached == NUM_CACHED, (
        f"dp1 computed OTHER again; dp0's stored bytes went from {before} to {after} in 30 s "
        "after its max_tokens=1 request")


def disk_args(folder) -> tuple[str, ...]:
    return (*TINY_ARGS, *HOST_TIER, "--kv-disk-dir", str(folder), "--kv-disk-size", "64MiB")


def damage(path) -> None:
    """One byte of the block's payload flipped: its header, size and name stay right."""
    with open(path, "r+b") as f:
        f.seek(HEADER.size + 5)
        byte = f.read(1)[0]
        f.seek(HEADER.size + 5)
        f.write(bytes([byte ^ 0xFF]))


def is_whole(path) -> bool:
    with open(path, "rb") as f:
        header, payload = f.read(HEADER.size), f.read()
    return hashlib.blake2b(payload, digest_size=32).digest() == HEADER.unpack(header)[-1]


def test_the_disk_tier_serves_a_restarted_server_and_drops_damaged_blocks(tiny_llama,
                                                                         tmp_path):
    """One restart serves both: PROMPT from the disk tier first; then, every block file
    damaged, OTHER (whose blocks are still only on disk) is recomputed."""
    folder = tmp_path / "kv"  # made by the server
    with running_server(tiny_llama, *disk_args(folder)) as s:
        cold, cached = complete(s)
        assert cached == 0
        local, cached = complete(s)
        assert cached == NUM_CACHED
        one_prompt = stored(s)
        other_cold, cached = complete(s, prompt=OTHER)
        assert cached == 0
        stored(s, at_least=2 * one_prompt)  # in the arena, which the shutdown flushes to disk
    assert stat.S_IMODE(os.stat(folder).st_mode) == 0o700
    files = block_files(folder)
    assert len(files) >= 2 * NUM_BLOCKS, os.listdir(folder)
    assert all(stat.S_IMODE(os.stat(f).st_mode) == 0o600 and is_whole(f) for f in files)

    with running_server(tiny_llama, *disk_args(folder)) as s:
        text, cached = complete(s)  # this server's first request: its pool and arena are empty
        assert cached == NUM_CACHED, s.output()[-4000:]
        wait_metric(s, "parashift_kv_tier_hit_blocks", 'engine="dp0",tier="disk"',
                    lambda v: v == NUM_BLOCKS)
        # Loaded blocks and a local hit run the same path (4 tokens on 96 cached): same tokens.
        assert text == local

        for path in files:  # PROMPT's blocks are in the pool now; OTHER's only on disk
            damage(path)
        text, cached = complete(s, prompt=OTHER)
        assert cached == 0, s.output()[-4000:]
        assert text == other_cold  # computed again, as cold
        s.wait_line(r"KV disk tier: dropped .*checksum mismatch")
        wait_metric(s, "parashift_kv_tier_failed_loads", 'engine="dp0"', lambda v: v == 1)
        assert s.metric("parashift_kv_tier_hit_blocks", 'engine="dp0",tier="disk"') == NUM_BLOCKS
        stored(s)
    # The block found damaged was dropped, and written again from its recomputed copy at the
    # shutdown; the other damaged files are dropped in their turn, when a load reads them.
    assert sum(map(is_whole, block_files(folder))) >= 1


def test_a_disk_folder_open_to_others_is_refused_at_start(tiny_llama, tmp_path):
    folder = tmp_path / "kv"
    folder.mkdir()
    folder.chmod(0o755)
    log = tmp_path / "run.log"
    cmd = [sys.executable, "-m", "parashift.cli", "run", tiny_llama, "--host", "127.0.0.1",
           "--port", "0", *disk_args(folder)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
           "PYTHONUNBUFFERED": "1"}
    seen: dict[int, psutil.Process] = {}
    with open(log, "w") as out:  # a file, not a pipe: all of it is there once it exits
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
    try:
        # Until it exits; its processes are recorded as they come, to check none survives.
        deadline = time.monotonic() + STARTUP_TIMEOUT
        while (proc.poll() is None and time.monotonic() < deadline
               and "is serving" not in log.read_text(errors="replace")):  # not refused
            try:
                for p in psutil.Process(proc.pid).children(recursive=True):
                    seen.setdefault(p.pid, p)
            except psutil.NoSuchProcess:
                pass
            time.sleep(0.1)
    finally:
        if proc.poll() is None:
            for p in [*seen.values(), psutil.Process(proc.pid)]:
                with contextlib.suppress(psutil.Error):
                    p.kill()
        proc.wait(10)
    output = log.read_text(errors="replace")
    assert proc.returncode != 0, output
    assert str(folder) in output and "chmod 700" in output, output
    assert not wait_gone(list(seen.values()), 10), output
    assert stat.S_IMODE(os.stat(folder).st_mode) == 0o755  # refused, not changed
    assert not block_files(folder)
