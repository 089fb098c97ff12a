"""The head node's KV server: prefill/decode pools over nodes. The prefill ranks run on the
head, and their prompts' blocks are in the head node's host tier. A decode rank on another
node misses them in its own node's tier; its connector then fetches them here
(kv_tiers/remote_tier.py) before it loads them.

A ROUTER the head launcher binds on tcp, in its CURVE context: only engines holding a rank's
key are answered. A peer that holds only the cluster secret is answered nothing; a peer
without the secret cannot complete the handshake. The blocks are pinned while they are
copied into the answer, so no eviction can change them halfway; each answer is bounded
(MAX_FETCH_BLOCKS, MAX_FETCH_BYTES)."""

from __future__ import annotations

import logging

import zmq

from parashift.kv_tiers.host_arena import HostArena
from parashift.wire import protocol as p
from parashift.wire.rank_server import RankServer

logger = logging.getLogger(__name__)

MAX_FETCH_BLOCKS = 4096  # a fetch's keys: 64k tokens of 16
MAX_FETCH_BYTES = 256 << 20  # an answer's blocks (the rest: fetched again, or computed)


class KVServer(RankServer):
    link = "kv-server"

    def __init__(self, ctx: zmq.Context, host: str, arena_path: str):
        super().__init__(ctx, f"tcp://{host}:0", "parashift-kv-server")
        self.sock.setsockopt(zmq.SNDHWM, 0)
        self.arena_path = arena_path
        self.arena: HostArena | None = None  # mapped at the first fetch (an engine makes it)

    def closed(self) -> None:
        if self.arena is not None:
            self.arena.close(unlink=False)

    def serve(self, identity: bytes, frame: zmq.Frame) -> None:
        fetch = p.decode_or_drop(frame.buffer, p.KVFetch, self.link)
        if fetch is None:
            return
        keys = fetch.keys[:MAX_FETCH_BLOCKS]
        blocks = self._read(keys)
        self.sock.send_multipart([identity, p.encode(p.KVBlocks(fetch.fetch_id, len(blocks))),
                                  *blocks])

    def _read(self, keys: list[int]) -> list[bytes]:
        """The run of `keys` from the first that the node's tier holds, copied out."""
        if self.arena is None:
            try:
                self.arena = HostArena.attach(self.arena_path, None)
            except (OSError, ValueError) as e:  # no engine made it yet, or it went
                logger.warning("KV server: the host tier %s is not there (%s)",
                               self.arena_path, e)
                return []
        keys = keys[:max(1, MAX_FETCH_BYTES // self.arena.slot_bytes)]
        slots = self.arena.lookup(keys)
        try:
            return [bytes(self.arena.slot(slot)) for slot in slots]
        finally:
            self.arena.unpin(slots)

