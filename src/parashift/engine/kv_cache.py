"""Paged KV cache bookkeeping, in plain Python: which blocks each request owns, which blocks
hold a reusable prefix, and which can be handed out next. The tensors live in the workers.

Prefix caching: a full block is identified by the chained hash of (parent block's hash, its
token ids), from engine/block_hash.py (the API servers' router computes the same); a request's
cache_salt enters its first block's, so requests of different salts share no block. Blocks
whose reference count drops to zero stay in the hash table until they are reused, so a later
request with the same prefix picks them up; the free queue is ordered so the least recently
freed block is evicted first."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass

from parashift.engine.block_hash import block_hashes
from parashift.engine.request import Request


class KVCacheBlock:
    __slots__ = ("block_id", "ref_cnt", "block_hash")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: int | None = None


class BlockPool:
    def __init__(self, num_blocks: int):
        if num_blocks < 1:
            raise ValueError(f"the KV cache needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        # Blocks with ref_cnt 0, least recently freed first. Cached ones stay reusable here
        # until they are popped for a new owner.
        self.free_queue: OrderedDict[int, KVCacheBlock] = OrderedDict(
            (b.block_id, b) for b in self.blocks
        )
        self.cached: dict[int, KVCacheBlock] = {}
        self.num_resets = 0  # times every cached prefix was forgotten (the routers follow)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    def lookup(self, block_hash: int) -> KVCacheBlock | None:
        return self.cached.get(block_hash)

    def allocate(self, num_blocks: int) -> list[KVCacheBlock]:
        assert num_blocks <= self.num_free_blocks
        out = []
        for _ in range(num_blocks):
            _, block = self.free_queue.popitem(last=False)
            if block.block_hash is not None:  # evict its cached content
                del self.cached[block.block_hash]
                block.block_hash = None
            block.ref_cnt = 1
            out.append(block)
        return out

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference on cached blocks (a prefix hit)."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self.free_queue[block.block_id]
            block.ref_cnt += 1

    def free(self, blocks: Iterable[KVCacheBlock]) -> None:
        for block in blocks:
            block.ref_cnt -= 1
            assert block.ref_cnt >= 0, f"block {block.block_id} freed twice"
            if block.ref_cnt == 0:
                self.free_queue[block.block_id] = block

    def cache(self, block: KVCacheBlock, block_hash: int) -> None:
        if block.block_hash is None and block_hash not in self.cached:
            block.block_hash = block_hash
            self.cached[block_hash] = block

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix. Refused (False) while any block is in use."""
        if self.num_free_blocks != self.num_blocks:
            return False
        for block in self.cached.values():
            block.block_hash = None
        self.cached.clear()
        self.num_resets += 1
        return True


@dataclass
class PrefixCacheStats:
    queried_tokens: int = 0
    hit_tokens: int = 0


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool):
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks)
        self.req_blocks: dict[str, list[KVCacheBlock]] = {}
        self.num_cached_blocks: dict[str, int] = {}  # how many of a request's blocks are hashed
        self.stats = PrefixCacheStats()

    @property
    def usage(self) -> float:
        return self.pool.usage

    def block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_blocks.get(request_id, [])]

    def _update_block_hashes(self, request: Request, num_tokens: int) -> None:
        hashes = request.block_hashes
        if (len(hashes) + 1) * self.block_size <= num_tokens:  # a block was filled
            hashes[:] = block_hashes(request.all_token_ids[:num_tokens], self.block_size,
                                     known=hashes, salt=request.cache_salt)

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """The longest cached prefix of a new request, in whole blocks. At least one token is
        always left to compute, so the request still produces logits."""
        if not self.enable_prefix_caching:
            return [], 0
        self._update_block_hashes(request, request.num_tokens)
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits = []
        for block_hash in request.block_hashes[:max_blocks]:
            block = self.pool.lookup(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits, len(hits) * self.block_size

    def record_admission(self, num_tokens: int, num_hit_tokens: int) -> None:
        """Count a prefix lookup once, when its request is actually admitted."""
        if self.enable_prefix_caching:
            self.stats.queried_tokens += num_tokens
            self.stats.hit_tokens += num_hit_tokens

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       computed_blocks: list[KVCacheBlock] | None = None) -> list[int] | None:
        """Reserve blocks so that `num_new_tokens` more tokens fit after the request's computed
        ones (plus `computed_blocks`, a prefix hit being admitted). Returns the ids of the newly
        allocated blocks, or None (and changes nothing) when the pool is too small."""
        if not computed_blocks and self._fits(request, num_new_tokens):
            return []  # a decode step's usual case: nothing to allocate or register
        computed_blocks = computed_blocks or []
        blocks = self.req_blocks.setdefault(request.request_id, [])
        num_computed = request.num_computed_tokens + len(computed_blocks) * self.block_size
        total = num_computed + num_new_tokens
        num_needed = -(-total // self.block_size) - len(blocks) - len(computed_blocks)
        num_reclaimed = sum(1 for b in computed_blocks if b.ref_cnt == 0)
        if num_needed > self.pool.num_free_blocks - num_reclaimed:
            if not blocks:
                del self.req_blocks[request.request_id]
            return None
        self.pool.touch(computed_blocks)
        blocks.extend(computed_blocks)
        new_blocks = self.pool.allocate(max(num_needed, 0))
        blocks.extend(new_blocks)
        if self.enable_prefix_caching:
            # Blocks this step fills are registered now: every layer writes the step's K/V
            # before attending, so a request admitted later in the same step may share them.
            # Not a block holding a placeholder (a token in flight, async scheduling): its
            # hash needs the token, and the next step registers it.
            known = min(total, request.num_tokens)
            self._update_block_hashes(request, known)
            start = self.num_cached_blocks.get(request.request_id, 0)
            num_full = known // self.block_size
            for i in range(start, num_full):
                self.pool.cache(blocks[i], request.block_hashes[i])
            self.num_cached_blocks[request.request_id] = max(start, num_full)
        return [b.block_id for b in new_blocks]

    def _fits(self, request: Request, num_new_tokens: int) -> bool:
        """Whether the request's blocks hold `num_new_tokens` more tokens and, with prefix
        caching, no block of its known tokens fills up (its hash would be registered now)."""
        blocks = self.req_blocks.get(request.request_id)
        total = request.num_computed_tokens + num_new_tokens
        if blocks is None or total > len(blocks) * self.block_size:
            return False
        return (not self.enable_prefix_caching
                or min(total, request.num_tokens) // self.block_size
                <= self.num_cached_blocks.get(request.request_id, 0))

    def free(self, request: Request) -> None:
        # Tail blocks go to the free queue first, so they are evicted before the shared prefix.
        self.pool.free(reversed(self.req_blocks.pop(request.request_id, [])))
        self.num_cached_blocks.pop(request.request_id, None)
