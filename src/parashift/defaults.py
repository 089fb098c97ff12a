"""Engine defaults that `parashift plan` must reproduce exactly; kept free of heavy imports
so that the planner answers without loading torch."""

from __future__ import annotations

import functools
import re

DEFAULT_CPU_KV_CACHE_MEMORY = 2 << 30  # KV budget of a CPU worker without --kv-cache-memory
DEFAULT_BLOCK_SIZE = 16
# The node's host KV tier under prefill/decode pools without --kv-offloading-size: the prompts
# handed from the prefill to the decode pool go through it (LRU: only those in flight matter).
DEFAULT_HANDOFF_TIER = 512 << 20
DEFAULT_MAX_NUM_SEQS = 128
DEFAULT_GPU_MEMORY_UTILIZATION = 0.9
# A served engine's waiting queue holds at most this many batches' worth of requests
# (--max-waiting-requests overrides; offline LLM.generate queues whatever it is given).
SERVED_WAITING_PER_SEQ = 8


def served_max_waiting(max_num_seqs: int) -> int:
    return SERVED_WAITING_PER_SEQ * max_num_seqs


# The dtype table: --dtype names (and aliases) -> the dtype, and its bytes per value.
DTYPE_CHOICES = ("auto", "float32", "bfloat16", "float16")
DTYPE_ALIASES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16"}
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def resolve_dtype_name(dtype: str, checkpoint_dtype: str | None, device: str) -> str:
    """`auto` keeps the checkpoint's half precision on GPU. On CPU it uses bfloat16 for half
    checkpoints (float16 matmuls are slow on CPUs), and for float32 ones (a GGUF is dequantized
    to float32) where the CPU multiplies bf16 natively, as vLLM's CPU backend casts them (on
    every x86); elsewhere float32."""
    if dtype != "auto":
        name = DTYPE_ALIASES.get(dtype, dtype)
        if name not in DTYPE_BYTES:
            raise ValueError(f"--dtype {dtype!r} is not one of {', '.join(DTYPE_CHOICES)}")
        return name
    if checkpoint_dtype in ("float16", "bfloat16"):
        return checkpoint_dtype if device != "cpu" else "bfloat16"
    return "bfloat16" if device == "cpu" and cpu_multiplies_bf16() else "float32"


# /proc/cpuinfo flags of x86's bf16 dot products (AVX512-BF16, AMX): with them a bf16 model
# outran float32 2.2-2.7x in its GEMMs on a Zen 4 (docs/BENCHMARKS.md). Without them bf16 gained
# little or nothing (AVX2: even, by emulation); Arm's BF16 is unmeasured.
BF16_DOT_FLAGS = ("avx512_bf16", "amx_bf16")


@functools.cache
def cpu_multiplies_bf16(cpuinfo: str = "/proc/cpuinfo") -> bool:
    try:
        with open(cpuinfo) as f:
            m = re.search(r"^flags\s*:\s*(.+)$", f.read(), re.MULTILINE)
    except OSError:
        return False
    return m is not None and any(flag in m.group(1).split() for flag in BF16_DOT_FLAGS)


def default_max_num_batched_tokens(max_num_seqs: int, device: str,
                                   whole_prompts_of: int | None = None) -> int:
    """The per-step token budget without --max-num-batched-tokens. A CPU's GEMMs are already
    compute-bound at 512 rows (a prefill token cost less in 512-token steps than in 2048-token
    ones), and smaller steps let the running requests' decode tokens ride along with more of a
    burst's prefill, which shortens its decode-only tail (docs/BENCHMARKS.md, "Prefill in
    512-token steps on CPU"). Without chunked prefill a step must hold a whole prompt:
    `whole_prompts_of` is then --max-model-len."""
    return max(512 if device == "cpu" else 2048, max_num_seqs, whole_prompts_of or 0)

# --routing and its prefix policy's thresholds (serve/prefix_router.py; measured with
# `python scripts/bench_routing.py`, docs/BENCHMARKS.md)
DEFAULT_ROUTING = "prefix"
DEFAULT_DP_LOAD_SCORE = "tokens"  # the rank's work in tokens, or its requests (4 per waiting)
DEFAULT_ROUTING_BALANCE_THRESHOLD = 4  # in the requests score's units: one waiting request
DEFAULT_ROUTING_BALANCE_THRESHOLD_TOKENS = 1024  # in the tokens score's
DEFAULT_ROUTING_MIN_MATCH = 0.5  # of the prompt's full blocks

# --attention-backend: auto picks triton on CUDA, torch elsewhere (engine/args.py)
ATTENTION_BACKENDS = ("auto", "torch", "cpu", "triton")
QUANTIZATIONS = ("int8", "int4")  # weight-only, CPU: layers/quantization.py
# Bytes a quantized parameter takes (for `plan`): int8 a byte, int4 half a byte and a bf16
# scale and offset per group of 32; and per output row: int8's bf16 scale.
QUANTIZED_PARAM_BYTES = {"int8": 1.0, "int4": 0.5 + 4 / 32}
QUANTIZED_ROW_BYTES = {"int8": 2, "int4": 0}
