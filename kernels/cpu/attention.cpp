// Decode attention straight from the paged KV cache (prefill tokens take it too on
// AVX512-BF16: see cpu_backend.py); bf16 with head_dim 64 or 128 takes attention_bf16.h's
// path on AVX512-BF16, attention_avx2.h's on AVX2.

#include "attention_avx2.h"
#include "attention_bf16.h"
#include "common.h"
#include "entry_points.h"
#include "row_stream.h"

namespace {

// Decode attention straight from the paged cache: one query token per sequence. A sequence is
// a work item: its cached rows (every kv head side by side) are read once each, in order, a
// block of block_size rows at a time; each thread's rows come into L2 far ahead (RowStream,
// on into its next sequences) and into L1 a few rows ahead. Exact softmax (two passes over the
// scores, in float32), the output rounded to T once.
// query [seqs, heads, head_dim] with a token stride; out [seqs, heads, head_dim] contiguous;
// caches [blocks, block_size, kv_heads, head_dim]; block_tables [seqs, table_width] int32.
template <class T>
void paged_decode_attention(T* out, const T* query, int64_t query_stride, const T* key_cache,
                            const T* value_cache, const int32_t* block_tables,
                            int64_t table_width, const int32_t* seq_lens, int64_t seqs,
                            int64_t heads, int64_t kv_heads, int64_t head_dim,
                            int64_t block_size, int64_t window, float scale, int num_threads) {
  const int64_t group = heads / kv_heads;
  const int64_t row = kv_heads * head_dim;  // elements per cache slot
  constexpr int64_t kAhead = 8;  // rows prefetched ahead
  auto keys = [&](int64_t s) {
    const int64_t len = seq_lens[s];
    return window > 0 && len > window ? window : len;
  };
  int64_t total = 0;
  for (int64_t s = 0; s < seqs; ++s) total += keys(s);
#pragma omp parallel num_threads(num_threads)
  {
    std::vector<float> q(heads * head_dim), acc(heads * head_dim), row_f(row), scores, sums(heads);
    std::vector<uint32_t> pairs;  // bf16 weights of key pairs (the AVX512-BF16 path)
    // Each thread a run of consecutive sequences holding an even share of the keys (not a
    // sequence at a time from a shared counter): it knows which sequences come next, and its
    // fetches run on into their rows before this one ends.
    const int64_t nth = omp_get_num_threads(), tid = omp_get_thread_num();
    int64_t begin = seqs, end = seqs;
    for (int64_t s = 0, before = 0; s < seqs; before += keys(s), ++s) {
      const int64_t owner = total > 0 ? before * nth / total : 0;
      if (owner == tid && begin == seqs) begin = s;
      if (owner > tid) {
        end = s;
        break;
      }
    }
    begin = std::min(begin, end);  // none of its own: more threads than sequences to share
    // Where each key's row starts, block by block: a division per key and use (a runtime
    // block size) had cost as much as the dot products.
    RowStream<T> stream(key_cache, value_cache, row);
    int64_t rows = 0;
    for (int64_t s = begin; s < end; ++s) rows += keys(s);
    stream.reserve(end - begin, rows);
    for (int64_t s = begin; s < end; ++s) {
      const int64_t len = seq_lens[s], lo = len - keys(s);
      const int32_t* table = block_tables + s * table_width;
      int64_t* into = stream.add_sequence(len - lo);
      for (int64_t pos = lo, j = 0; pos < len;) {
        const int64_t base = static_cast<int64_t>(table[pos / block_size]) * block_size;
        for (int64_t in = pos % block_size; in < block_size && pos < len; ++in, ++pos)
          into[j++] = (base + in) * row;
      }
    }
    stream.start();
    for (int64_t s = begin; s < end; ++s) {
      const int64_t* offsets = stream.offsets(s - begin);
      const int64_t n = stream.rows(s - begin);
      auto slot = [&](int64_t j) { return offsets[j]; };
#if defined(PARASHIFT_BF16_DOT) || defined(PARASHIFT_BF16_ATTENTION_AVX2)
      if constexpr (std::is_same_v<T, bf16>) {
        if (decode_one_bf16(out + s * heads * head_dim, query + s * query_stride, key_cache,
                            value_cache, slot, n, heads, kv_heads, head_dim, scale, scores,
                            pairs, sums, stream))
          continue;
      }
#endif
      for (int64_t i = 0; i < heads * head_dim; ++i)
        q[i] = to_f(query[s * query_stride + i]) * scale;
      scores.resize(heads * n);
      for (int64_t j = 0; j < n; ++j) {  // scores[head][j] = q[head] . k[j][head's kv head]
        if (j + kAhead < n) prefetch_row(key_cache + slot(j + kAhead), row);
        stream.read(1);
        const T* k = key_cache + slot(j);
        for (int64_t i = 0; i < row; ++i) row_f[i] = to_f(k[i]);
        for (int64_t hq = 0; hq < heads; ++hq) {
          const float* qh = q.data() + hq * head_dim;
          const float* kh = row_f.data() + (hq / group) * head_dim;
          float dot = 0.f;
          for (int64_t i = 0; i < head_dim; ++i) dot += qh[i] * kh[i];
          scores[hq * n + j] = dot;
        }
      }
      for (int64_t hq = 0; hq < heads; ++hq) sums[hq] = exp_weights(scores.data() + hq * n, n);
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t j = 0; j < n; ++j) {  // acc[head] += p[head][j] * v[j][head's kv head]
        if (j + kAhead < n) prefetch_row(value_cache + slot(j + kAhead), row);
        stream.read(1);
        const T* v = value_cache + slot(j);
        for (int64_t i = 0; i < row; ++i) row_f[i] = to_f(v[i]);
        for (int64_t hq = 0; hq < heads; ++hq) {
          const float p = scores[hq * n + j];
          const float* vh = row_f.data() + (hq / group) * head_dim;
          float* a = acc.data() + hq * head_dim;
          for (int64_t i = 0; i < head_dim; ++i) a[i] += p * vh[i];
        }
      }
      for (int64_t hq = 0; hq < heads; ++hq) {
        T* o = out + (s * heads + hq) * head_dim;
        const float inv = sums[hq] > 0.f ? 1.f / sums[hq] : 0.f;
        for (int64_t i = 0; i < head_dim; ++i) o[i] = from_f<T>(acc[hq * head_dim + i] * inv);
      }
    }
  }
}

}  // namespace

extern "C" {

// 1 where bf16 attention with head_dim 64 or 128 takes the AVX512-BF16 path.
int parashift_cpu_bf16_dot() {
#ifdef PARASHIFT_BF16_DOT
  return 1;
#else
  return 0;
#endif
}

// 1 where bf16 decode attention with head_dim 64 or 128 has a vector path (AVX512-BF16 or
// AVX2; the generic loops otherwise).
int parashift_cpu_bf16_attention() {
#if defined(PARASHIFT_BF16_DOT) || defined(PARASHIFT_BF16_ATTENTION_AVX2)
  return 1;
#else
  return 0;
#endif
}

void parashift_paged_decode_attention(int dtype, void* out, const void* query,
                                      int64_t query_stride, const void* key_cache,
                                      const void* value_cache, const int32_t* block_tables,
                                      int64_t table_width, const int32_t* seq_lens, int64_t seqs,
                                      int64_t heads, int64_t kv_heads, int64_t head_dim,
                                      int64_t block_size, int64_t window, float scale,
                                      int num_threads) {
  if (dtype == 0)
    paged_decode_attention<float>(P(float, out), P(const float, query), query_stride,
                                  P(const float, key_cache), P(const float, value_cache),
                                  block_tables, table_width, seq_lens, seqs, heads, kv_heads,
                                  head_dim, block_size, window, scale, num_threads);
  else
    paged_decode_attention<bf16>(P(bf16, out), P(const bf16, query), query_stride,
                                 P(const bf16, key_cache), P(const bf16, value_cache),
                                 block_tables, table_width, seq_lens, seqs, heads, kv_heads,
                                 head_dim, block_size, window, scale, num_threads);
}

}  // extern "C"
