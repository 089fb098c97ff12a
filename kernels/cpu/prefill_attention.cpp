// Causal prefill attention in bf16 (head_dim 64, no sliding window), on AMX tiles or, without
// them, on AVX512-BF16 dot products: each prefill chunk's queries, 16 tokens at a time, over
// every key of its sequence in the paged cache (the chunk's own K/V written there first). The
// decode kernel took prefill tokens one query at a time, each re-reading its prefix, at ~145
// GFLOP/s on a Xeon with AMX: 6% of a W1 run; on a Zen 4 (no AMX) 10% of a 2,048-token
// prefill step.
//
// Per (sequence, kv head): the keys are packed once as B operands of Q K^T (a 16 x 16 transpose
// of 32-bit dim pairs) and the values as B operands of P V (two keys' rows interleaved). Then
// per 16-token block and query head: S = Q K^T for the keys the block can see, the softmax row
// by row in fp32 lanes (exp(s - max), the weights rounded to bf16 as torch's bf16 attention and
// the decode kernel round them), O = P V accumulated over all keys, O / sum -> bf16
// (prefill_blocks.h). On AMX S and O are tiles (prefill_amx.h); with vdpbf16ps, register blocks
// (prefill_dot.h). No online rescaling: a block's scores fit in a buffer, as in the decode
// kernel.
//
// The vdpbf16ps blocks take the decode kernel's reduction order: a token attends bit for bit as
// it would in a decode step, chunked, cached or recomputed. `decode_order` (--deterministic):
// those blocks on AMX CPUs too, never the tiles.

#include "entry_points.h"
#include "prefill_amx.h"
#include "prefill_dot.h"

extern "C" {

int parashift_prefill_attention_bf16(void* out, const void* query, int64_t query_stride,
                                     const void* key_cache, const void* value_cache,
                                     const int32_t* block_tables, int64_t table_width,
                                     const int32_t* query_starts, const int32_t* seq_lens,
                                     int64_t seqs, int64_t heads, int64_t kv_heads,
                                     int64_t head_dim, int64_t block_size, float scale,
                                     int decode_order, int num_threads) {
#ifdef PARASHIFT_TILED_PREFILL
  if (head_dim != kDim) return 0;
  [[maybe_unused]] bool amx = false;
#ifdef PARASHIFT_AMX
  amx = !decode_order && amx_permitted();
#endif
#ifndef PARASHIFT_BF16_DOT
  if (!amx) return 0;
#endif
  const int64_t group = heads / kv_heads, row = kv_heads * head_dim;
  const uint16_t* kc = static_cast<const uint16_t*>(key_cache);
  const uint16_t* vc = static_cast<const uint16_t*>(value_cache);
  const uint16_t* qs = static_cast<const uint16_t*>(query);
  uint16_t* os = static_cast<uint16_t*>(out);
#pragma omp parallel num_threads(num_threads)
  {
    SequenceKeys packed;
    std::vector<int64_t> offsets;
    std::vector<float> scores;
    std::vector<uint16_t> weights;
#ifdef PARASHIFT_AMX
    int configured = -1;
#endif
#pragma omp for schedule(dynamic)
    for (int64_t task = 0; task < seqs * kv_heads; ++task) {
      const int64_t s = task / kv_heads, h = task % kv_heads, n = seq_lens[s];
      const int64_t q0 = query_starts[s], tokens = query_starts[s + 1] - q0;
      const int32_t* table = block_tables + s * table_width;
      offsets.resize(n);
      for (int64_t j = 0; j < n; ++j)
        offsets[j] =
            (static_cast<int64_t>(table[j / block_size]) * block_size + j % block_size) * row;
      pack_keys(packed, kc, vc, offsets, n, h);
      for (int64_t t0 = 0; t0 < tokens; t0 += 16) {
        const int rows = static_cast<int>(std::min<int64_t>(16, tokens - t0));
#ifdef PARASHIFT_AMX
        if (amx && rows != configured) {
          configure_tiles(rows, 0);
          configured = rows;
        }
#endif
        const int64_t first_keys = n - tokens + t0 + 1;
        for (int64_t g = 0; g < group; ++g) {
          const int64_t hq = h * group + g;
          const Block block{os + (q0 + t0) * heads * head_dim + hq * head_dim,
                            heads * head_dim, qs + (q0 + t0) * query_stride + hq * head_dim,
                            query_stride, rows, first_keys};
#ifdef PARASHIFT_AMX
          if (amx) {
            attend_block_amx(block, packed, scale, scores, weights);
            continue;
          }
#endif
#ifdef PARASHIFT_BF16_DOT
          attend_block_dot(block, packed, scale, scores, weights);
#endif
        }
      }
    }
  }
  return 1;
#else
  return 0;
#endif
}

}  // extern "C"
