"""Calls the CPU kernels through ctypes, once `build.py` has built them for the CPU at hand.
OpenMP comes from the runtime torch already loaded (the same soname), so the kernels share
torch's threads instead of starting a second pool."""

from __future__ import annotations

import ctypes
import functools
import os
from ctypes import POINTER, byref, c_float, c_int, c_int64, c_void_p

import torch

from . import huge_pages
from .build import build, open_intact
from .checks import check_gemm, check_sampling
from .layer_structs import LayerStep, LayerWeights, ptr_or_null

_DTYPES = {torch.float32: 0, torch.bfloat16: 1}


def _profiled(fn):
    """Under torch.profiler a kernel call is an event of its own (ctypes calls are invisible
    to it otherwise, and `bench latency --breakdown` would count them as Python)."""
    label = f"parashift_cpu::{fn.__name__}"

    @functools.wraps(fn)
    def call(*args, **kwargs):
        if not torch.autograd._profiler_enabled():
            return fn(*args, **kwargs)
        with torch.profiler.record_function(label):
            return fn(*args, **kwargs)

    return call


class CpuOps:
    """Tensor-level entry points of the compiled kernels (float32 and bfloat16 CPU tensors)."""

    def __init__(self, path: str, load_from: str | None = None):
        """`load_from`: where to dlopen the library at `path` from (its checked descriptor)."""
        lib = ctypes.CDLL(load_from or path)
        i64, ptr = c_int64, c_void_p
        signatures = {
            "parashift_rms_norm": [c_int, ptr, ptr, ptr, i64, ptr, i64, ptr, i64, i64, c_float,
                                   c_int],
            "parashift_rotary": [c_int, ptr, i64, ptr, ptr, i64, i64, i64, c_int],
            "parashift_silu_and_mul": [c_int, ptr, ptr, i64, i64, i64, c_int],
            "parashift_argmax_rows": [c_int, ptr, ptr, i64, i64, c_int],
            "parashift_sample_rows": [c_int, ptr, ptr, i64, i64, i64, ptr, ptr, ptr, ptr, ptr,
                                      ptr, ptr, ptr, c_int],
            "parashift_write_kv": [c_int, ptr, ptr, ptr, ptr, i64, i64, ptr, i64, i64, c_int],
            "parashift_paged_decode_attention": [c_int, ptr, ptr, i64, ptr, ptr, ptr, i64, ptr,
                                                 i64, i64, i64, i64, i64, i64, c_float, c_int],
            "parashift_pack_bf16": [ptr, ptr, i64, i64, i64, c_int],
            "parashift_gemm_bf16": [ptr, i64, ptr, i64, ptr, ptr, i64, i64, i64, c_int],
            "parashift_pack_int8": [ptr, ptr, i64, i64, i64, c_int],
            "parashift_gemm_int8": [ptr, i64, ptr, i64, ptr, ptr, ptr, i64, i64, i64, ptr, i64,
                                    i64, c_int],
            "parashift_llama_layer_bf16": [POINTER(LayerWeights), POINTER(LayerStep), ptr, ptr,
                                           c_int],
            "parashift_prefill_attention_bf16": [ptr, ptr, i64, ptr, ptr, ptr, i64, ptr, ptr,
                                                 i64, i64, i64, i64, i64, c_float, c_int,
                                                 c_int],
        }
        for name, argtypes in signatures.items():
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = argtypes, None
        lib.parashift_prefill_attention_bf16.restype = c_int
        self._lib = lib
        self.path = path
        # bf16 attention with head_dim 64 or 128 runs on AVX512-BF16 dot products here
        self.bf16_dot = bool(lib.parashift_cpu_bf16_dot())
        # ... or at least on vectors (AVX2 without them)
        self.bf16_attention = bool(lib.parashift_cpu_bf16_attention())
        # gemm_bf16's instructions: "fma" (AVX2 or AVX-512F), "dpbf16" (AVX512-BF16), "amx"
        # (tiles, k a multiple of 32, where the OS allows them), or None: no such GEMM here
        self.bf16_gemm = {1: "fma", 2: "dpbf16", 3: "amx"}.get(lib.parashift_cpu_bf16_gemm())
        self.amx = self.bf16_gemm == "amx"
        # gemm_int8 runs on the same kernels (AMX where k % 32 == 0), its weight widened
        self.int8_gemm = self.bf16_gemm is not None

    def pack_bf16(self, weight: torch.Tensor) -> torch.Tensor:
        """A bf16 weight [n, k] (k even) in `gemm_bf16`'s layout: [ceil(n / 16), k / 2, 32]
        (tiles of 64 columns, each k pair's columns side by side; see gemm.cpp). RuntimeError
        where this CPU or the weight cannot take it."""
        return self._pack(weight, torch.bfloat16, "bf16", self.bf16_gemm is not None,
                          self._lib.parashift_pack_bf16)

    @_profiled
    def gemm_bf16(self, x: torch.Tensor, packed: torch.Tensor, n: int,
                  bias: torch.Tensor | None) -> torch.Tensor:
        """x [rows, k] bf16 (rows may be strided) -> x W^T + bias [rows, n] bf16, W packed by
        `pack_bf16`."""
        check_gemm(x, packed, n, torch.bfloat16, bias)
        rows, k = x.shape
        out = torch.empty((rows, n), dtype=torch.bfloat16)
        self._lib.parashift_gemm_bf16(out.data_ptr(), n, x.data_ptr(), x.stride(0),
                                      packed.data_ptr(), ptr_or_null(bias), rows, n, k,
                                      torch.get_num_threads())
        return out

    def pack_int8(self, q: torch.Tensor) -> torch.Tensor:
        """An int8 weight [n, k] (k even) in `gemm_int8`'s layout: pack_bf16's, a byte an
        element, [ceil(n / 16), k / 2, 32]. RuntimeError where this CPU or the weight cannot take
        it."""
        return self._pack(q, torch.int8, "int8", self.int8_gemm, self._lib.parashift_pack_int8)

    def _pack(self, weight: torch.Tensor, dtype: torch.dtype, name: str, available: bool,
              entry) -> torch.Tensor:
        n, k = weight.shape
        if not available or weight.dtype != dtype or k % 2:
            why = ("it needs AVX2 with FMA" if not available else
                   f"it takes {dtype}" if weight.dtype != dtype else "k must be even")
            raise RuntimeError(f"no {name} GEMM of ours for a {weight.dtype} [{n}, {k}] "
                               f"weight on this CPU ({why})")
        weight = weight.contiguous()
        packed = huge_pages.zeros(((n + 15) // 16, k // 2, 32), dtype)  # streamed every step
        entry(packed.data_ptr(), weight.data_ptr(), k, n, k, torch.get_num_threads())
        return packed

    @_profiled
    def gemm_int8(self, x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor,
                  bias: torch.Tensor | None) -> torch.Tensor:
        """x [rows, k] bf16 (rows may be strided) -> (x Q^T) * scale + bias [rows, n] bf16, Q
        packed by `pack_int8`, scale [n] and bias [n] bf16."""
        n = scale.shape[0]
        check_gemm(x, packed, n, torch.int8, scale, bias)
        rows, k = x.shape
        out = torch.empty((rows, n), dtype=torch.bfloat16)
        self._lib.parashift_gemm_int8(out.data_ptr(), n, x.data_ptr(), x.stride(0),
                                      packed.data_ptr(), scale.data_ptr(), ptr_or_null(bias),
                                      rows, n, k, None, 0, 0, torch.get_num_threads())
        return out

    def llama_layer_bf16(self, weights: LayerWeights, step: LayerStep, hidden: torch.Tensor,
                         residual: torch.Tensor, first: bool) -> None:
        """One decoder layer (layer.cpp) on hidden and residual [tokens, hidden], in place."""
        self._lib.parashift_llama_layer_bf16(byref(weights), byref(step), hidden.data_ptr(),
                                             residual.data_ptr(), int(first))

    @_profiled
    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float,
                 residual: torch.Tensor | None = None):
        """x [rows, hidden] (rows may be strided) -> normed, or (normed, x + residual) with
        `residual`; nothing is written in place."""
        rows, hidden = x.shape
        out = torch.empty((rows, hidden), dtype=x.dtype)
        residual_out = None if residual is None else torch.empty_like(out)
        self._lib.parashift_rms_norm(
            _DTYPES[x.dtype], out.data_ptr(), ptr_or_null(residual_out), x.data_ptr(), x.stride(0),
            ptr_or_null(residual), 0 if residual is None else residual.stride(0), weight.data_ptr(),
            rows, hidden, eps, torch.get_num_threads())
        return out if residual is None else (out, residual_out)

    @_profiled
    def rotary_(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotates x [tokens, heads, head_dim] (heads contiguous, tokens strided) in place;
        cos/sin [tokens, head_dim / 2] contiguous, x's dtype."""
        tokens, heads, head_dim = x.shape
        self._lib.parashift_rotary(_DTYPES[x.dtype], x.data_ptr(), x.stride(0), cos.data_ptr(),
                                   sin.data_ptr(), tokens, heads, head_dim,
                                   torch.get_num_threads())
        return x

    @_profiled
    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        tokens, width = x.shape
        out = torch.empty((tokens, width // 2), dtype=x.dtype)
        self._lib.parashift_silu_and_mul(_DTYPES[x.dtype], out.data_ptr(), x.data_ptr(),
                                         x.stride(0), tokens, width // 2,
                                         torch.get_num_threads())
        return out

    @_profiled
    def argmax(self, x: torch.Tensor) -> torch.Tensor:
        """[rows, cols] contiguous -> [rows] int64: torch.argmax(x, dim=-1), in one pass that
        widens nothing (torch's bfloat16 argmax runs 3x slower than widening first)."""
        rows, cols = x.shape
        out = torch.empty(rows, dtype=torch.int64)
        self._lib.parashift_argmax_rows(_DTYPES[x.dtype], out.data_ptr(), x.data_ptr(), rows,
                                        cols, torch.get_num_threads())
        return out

    @_profiled
    def sample(self, logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor | None,
               top_p: torch.Tensor | None, min_p: torch.Tensor | None, uniforms: torch.Tensor,
               overrides: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
               ) -> torch.Tensor:
        """[rows, vocab] logits (rows strided, vocab contiguous) -> [rows] int64 token ids:
        temperature (float32, 0: greedy), top_k (int64, 0: off), top_p (float32, 1: off), min_p
        (float32, 0: off), one uniform in [0, 1) per row (float64); the filters may be None,
        the uniforms too when every temperature is 0.
        `overrides`: (starts [rows + 1] int64, token ids int64, values float32), row r's
        logits at ids[starts[r]:starts[r + 1]] read as those values (penalized logits)."""
        rows, vocab = logits.shape
        columns = ((temperature, torch.float32), (top_k, torch.int64), (top_p, torch.float32),
                   (min_p, torch.float32), (uniforms, torch.float64))
        check_sampling(logits, columns, overrides)
        pointers = (None, None, None) if overrides is None else (ptr_or_null(t) for t in overrides)
        out = torch.empty(rows, dtype=torch.int64)
        self._lib.parashift_sample_rows(
            _DTYPES[logits.dtype], out.data_ptr(), logits.data_ptr(), logits.stride(0), rows,
            vocab, *(ptr_or_null(c) for c, _ in columns), *pointers, torch.get_num_threads())
        return out

    @_profiled
    def write_kv(self, key_cache: torch.Tensor, value_cache: torch.Tensor, key: torch.Tensor,
                 value: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """key/value [tokens, kv_heads, head_dim] (tokens strided) into their slots (int64;
        -1 skips the token) of caches [blocks, block_size, kv_heads, head_dim]."""
        tokens = key.shape[0]
        self._lib.parashift_write_kv(
            _DTYPES[key.dtype], key_cache.data_ptr(), value_cache.data_ptr(), key.data_ptr(),
            value.data_ptr(), key.stride(0), value.stride(0), slot_mapping.data_ptr(), tokens,
            key.shape[1] * key.shape[2], torch.get_num_threads())

    @_profiled
    def prefill_attention(self, out: torch.Tensor, query: torch.Tensor, key_cache: torch.Tensor,
                          value_cache: torch.Tensor, block_tables: torch.Tensor,
                          query_starts: torch.Tensor, seq_lens: torch.Tensor,
                          scale: float, decode_order: bool = False) -> bool:
        """Causal attention of prefill chunks over their sequences' cached keys (the chunks'
        own K/V written first): out [tokens, heads, head_dim] contiguous, query likewise (tokens
        strided); chunk i is tokens query_starts[i]:query_starts[i + 1] (int32, from 0), the
        last of seq_lens[i] keys; block_tables [seqs, width] int32. False, writing nothing,
        where this CPU or shape has no such kernel (it takes bf16, head_dim 64, on AMX or
        AVX512-BF16). On AVX512-BF16 it takes the decode kernel's reduction order, so each
        token gets the bits `paged_decode_attention` gives it as a query over the same keys;
        `decode_order` (--deterministic): that path on AMX CPUs too, not the tiles."""
        seqs = seq_lens.shape[0]
        _, heads, head_dim = query.shape
        _, block_size, kv_heads, _ = key_cache.shape
        if query.dtype != torch.bfloat16 or seqs == 0:
            return False
        return bool(self._lib.parashift_prefill_attention_bf16(
            out.data_ptr(), query.data_ptr(), query.stride(0), key_cache.data_ptr(),
            value_cache.data_ptr(), block_tables.data_ptr(), block_tables.shape[1],
            query_starts.data_ptr(), seq_lens.data_ptr(), seqs, heads, kv_heads, head_dim,
            block_size, scale, int(decode_order), torch.get_num_threads()))

    @_profiled
    def paged_decode_attention(self, out: torch.Tensor, query: torch.Tensor,
                               key_cache: torch.Tensor, value_cache: torch.Tensor,
                               block_tables: torch.Tensor, seq_lens: torch.Tensor,
                               window: int | None, scale: float) -> None:
        """out [seqs, heads, head_dim] contiguous <- one query token per sequence, query
        [seqs, heads, head_dim] (tokens strided), over the paged caches; block_tables
        [seqs, width] and seq_lens [seqs] int32, contiguous."""
        seqs, heads, head_dim = query.shape
        _, block_size, kv_heads, _ = key_cache.shape
        self._lib.parashift_paged_decode_attention(
            _DTYPES[query.dtype], out.data_ptr(), query.data_ptr(), query.stride(0),
            key_cache.data_ptr(), value_cache.data_ptr(), block_tables.data_ptr(),
            block_tables.shape[1], seq_lens.data_ptr(), seqs, heads, kv_heads, head_dim,
            block_size, window or 0, scale, torch.get_num_threads())


def load(build_dir: str, march: str | None = None) -> CpuOps:
    """Build (if need be) and load this CPU's kernels (or those for `march`); RuntimeError if
    they cannot be built. A cached library that does not load (a truncated file) is built
    again."""
    path = build(build_dir, march)
    try:
        return _load_intact(path)
    except OSError:
        os.remove(f"{path}.sha256")
        return _load_intact(build(build_dir, march))


def _load_intact(path: str) -> CpuOps:
    """The library at `path` loaded through the descriptor its check read (no file swapped
    in between the check and the load). The descriptor stays open: dlopen knows a library by
    the name it was given, and a closed descriptor's number, reused, would name another."""
    fd = open_intact(path)
    if fd is None:
        raise OSError(f"{path} is not the library this build wrote")
    return CpuOps(path, f"/proc/self/fd/{fd}")
