"""The online-softmax step both attention kernels share (flash attention's running max and
sum over key tiles)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def online_softmax_step(s, m_i, l_i):
    """One tile of scores s [rows, keys] into the running max m_i and sum l_i [rows]. Returns
    the tile's probabilities, the factor that rescales what was accumulated before, and the
    new max and sum. A row that has seen no key yet keeps -inf and subtracts 0, not -inf."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp(s - m_safe[:, None])
    alpha = tl.exp(m_i - m_safe)
    return p, alpha, m_new, l_i * alpha + tl.sum(p, 1)
