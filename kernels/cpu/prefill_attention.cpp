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
// the decode kernel round them), O = P V accumulated over all keys, O / sum -> bf16. On AMX S
// and O are tiles; with vdpbf16ps, register blocks: S 8 rows x 32 keys, O 4 rows x 64 dims,
// each query's (weight's) dim (key) pair broadcast against 16 keys' (dims') pairs. No online
// rescaling: a block's scores fit in a buffer, as in the decode kernel.

#include "amx.h"
#include "entry_points.h"

#if defined(PARASHIFT_AMX) || defined(PARASHIFT_BF16_DOT)
#define PARASHIFT_TILED_PREFILL 1
namespace {

constexpr int64_t kDim = 64;  // head_dim this kernel takes

struct SequenceKeys {
  std::vector<uint32_t> keys_t;  // [n / 16][2 halves][16 dim pairs][16 keys]
  std::vector<uint32_t> values;  // [n / 32][4 dim blocks][16 key pairs][16 dims]
  int64_t padded = 0;            // keys rounded up to 32
};

// Packs one kv head's n keys and values (rows at key_cache + offsets[j] + head * kDim).
void pack_keys(SequenceKeys& p, const uint16_t* key_cache, const uint16_t* value_cache,
               const std::vector<int64_t>& offsets, int64_t n, int64_t head) {
  p.padded = (n + 31) / 32 * 32;
  p.keys_t.assign(p.padded * kDim / 2, 0);
  p.values.assign(p.padded * kDim / 2, 0);
  for (int64_t j = 0; j < n; ++j) {
    const uint32_t* k = reinterpret_cast<const uint32_t*>(key_cache + offsets[j] + head * kDim);
    uint32_t* dst = p.keys_t.data() + (j / 16) * 512 + (j % 16);
    for (int64_t r = 0; r < kDim / 2; ++r) dst[(r / 16) * 256 + (r % 16) * 16] = k[r];
  }
  for (int64_t j = 0; j < n; j += 2) {
    const __m512i zero = _mm512_setzero_si512();
    const uint16_t* v0 = value_cache + offsets[j] + head * kDim;
    const uint16_t* v1 = j + 1 < n ? value_cache + offsets[j + 1] + head * kDim : nullptr;
    uint32_t* dst = p.values.data() + (j / 32) * 1024 + ((j % 32) / 2) * 16;
    for (int64_t c = 0; c < 4; ++c) {
      const __m512i a = _mm512_cvtepu16_epi32(_mm256_loadu_si256(
          reinterpret_cast<const __m256i*>(v0 + 16 * c)));
      const __m512i b = v1 ? _mm512_cvtepu16_epi32(_mm256_loadu_si256(
          reinterpret_cast<const __m256i*>(v1 + 16 * c))) : zero;
      _mm512_storeu_si512(dst + c * 256, _mm512_or_si512(a, _mm512_slli_epi32(b, 16)));
    }
  }
}

// The block's scores [rows][padded] (raw dots; row i sees first_keys + i keys) -> its softmax
// weights [rows][padded] bf16 (zero past each row's keys) and each row's sum of them.
void softmax_rows(float* scores, uint16_t* weights, int64_t padded, int rows,
                  int64_t first_keys, float scale, float* sums) {
  for (int i = 0; i < rows; ++i) {
    const int64_t n = first_keys + i;
    float* s = scores + i * padded;
    __m512 top = _mm512_set1_ps(-INFINITY);
    for (int64_t j = 0; j < n; j += 16) {
      const __mmask16 m = first_lanes(n - j);
      top = _mm512_mask_max_ps(top, m, top, _mm512_maskz_loadu_ps(m, s + j));
    }
    const float t = _mm512_reduce_max_ps(top) * scale;
    float sum = 0.f;
    for (int64_t j = 0; j < n; ++j) {
      s[j] = fast_exp(s[j] * scale - t);
      sum += s[j];
    }
    sums[i] = sum;
    uint16_t* w = weights + i * padded;
    for (int64_t j = 0; j < n; ++j) w[j] = from_f<bf16>(s[j]).bits;
  }
}

// o [rows][kDim] fp32 sums of weighted values / the rows' sums -> out rows (out_stride) bf16.
void finish_rows(uint16_t* out, int64_t out_stride, const float* o, const float* sums,
                 int rows) {
  for (int i = 0; i < rows; ++i) {
    const __m512 inv = _mm512_set1_ps(sums[i] > 0.f ? 1.f / sums[i] : 0.f);
    for (int c = 0; c < 4; ++c) {
      const __m512 sums_c = _mm512_loadu_ps(o + i * kDim + 16 * c);
      const __m256bh y = _mm512_cvtneps_pbh(_mm512_mul_ps(sums_c, inv));
      std::memcpy(out + i * out_stride + 16 * c, &y, 32);
    }
  }
}

// One block of `rows` tokens (query rows q, stride q_stride elements) of one query head; the
// block's first token sees `first_keys` keys and each next one a key more. out rows: out_stride.
struct Block {
  uint16_t* out;
  int64_t out_stride;
  const uint16_t* q;
  int64_t q_stride;
  int rows;
  int64_t first_keys;
};

#ifdef PARASHIFT_AMX
void attend_block_amx(const Block& b, const SequenceKeys& p, float scale,
                      std::vector<float>& scores, std::vector<uint16_t>& weights) {
  const int64_t visible = b.first_keys + b.rows - 1;  // keys the last row sees
  const int64_t blocks16 = (visible + 15) / 16, padded = (visible + 31) / 32 * 32;
  scores.resize(16 * padded);
  weights.assign(16 * padded, 0);
  _tile_loadd(4, b.q, b.q_stride * 2);
  _tile_loadd(5, b.q + 32, b.q_stride * 2);
  for (int64_t jb = 0; jb < blocks16; ++jb) {
    const uint32_t* kt = p.keys_t.data() + jb * 512;
    _tile_zero(0);
    _tile_loadd(6, kt, 64);
    _tile_loadd(7, kt + 256, 64);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(0, 5, 7);
    _tile_stored(0, scores.data() + jb * 16, padded * 4);
  }
  float sums[16];
  softmax_rows(scores.data(), weights.data(), padded, b.rows, b.first_keys, scale, sums);
  _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
  for (int64_t kb = 0; kb < padded / 32; ++kb) {
    const uint32_t* v = p.values.data() + kb * 1024;
    _tile_loadd(4, weights.data() + kb * 32, padded * 2);
    _tile_loadd(6, v, 64);
    _tile_loadd(7, v + 256, 64);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    _tile_loadd(6, v + 512, 64);
    _tile_loadd(7, v + 768, 64);
    _tile_dpbf16ps(2, 4, 6);
    _tile_dpbf16ps(3, 4, 7);
  }
  alignas(64) float o[16 * kDim];
  _tile_stored(0, o, kDim * 4); _tile_stored(1, o + 16, kDim * 4);
  _tile_stored(2, o + 32, kDim * 4); _tile_stored(3, o + 48, kDim * 4);
  finish_rows(b.out, b.out_stride, o, sums, b.rows);
}
#endif

#ifdef PARASHIFT_BF16_DOT
// scores rows [R][padded] <- R query rows against `groups` groups of 32 packed keys.
template <int R>
void dot_scores(float* scores, int64_t padded, const uint16_t* q, int64_t q_stride,
                const uint32_t* keys_t, int64_t groups) {
  const int32_t* rows[R];
  for (int i = 0; i < R; ++i) rows[i] = reinterpret_cast<const int32_t*>(q + i * q_stride);
  for (int64_t g = 0; g < groups; ++g) {
    const uint32_t* kt = keys_t + g * 1024;  // two 16-key blocks, a dim pair's keys 16 apart
    __m512 acc[R][2];
    for (int i = 0; i < R; ++i) acc[i][0] = acc[i][1] = _mm512_setzero_ps();
    for (int r = 0; r < kDim / 2; ++r) {
      const __m512bh k0 = (__m512bh)_mm512_loadu_si512(kt + 16 * r);
      const __m512bh k1 = (__m512bh)_mm512_loadu_si512(kt + 512 + 16 * r);
      for (int i = 0; i < R; ++i) {
        const __m512bh a = (__m512bh)_mm512_set1_epi32(rows[i][r]);
        acc[i][0] = _mm512_dpbf16_ps(acc[i][0], a, k0);
        acc[i][1] = _mm512_dpbf16_ps(acc[i][1], a, k1);
      }
    }
    for (int i = 0; i < R; ++i) {
      _mm512_storeu_ps(scores + i * padded + 32 * g, acc[i][0]);
      _mm512_storeu_ps(scores + i * padded + 32 * g + 16, acc[i][1]);
    }
  }
}

// o [R][kDim] <- R rows of weights [padded] bf16 times the packed values (padded / 32 groups).
template <int R>
void dot_values(float* o, const uint16_t* weights, int64_t padded, const uint32_t* values) {
  const int32_t* rows[R];
  for (int i = 0; i < R; ++i) rows[i] = reinterpret_cast<const int32_t*>(weights + i * padded);
  __m512 acc[R][4];
  for (int i = 0; i < R; ++i)
    for (int c = 0; c < 4; ++c) acc[i][c] = _mm512_setzero_ps();
  for (int64_t kp = 0; kp < padded / 2; ++kp) {  // key pairs; 16 per group of 32 keys
    const uint32_t* v = values + (kp / 16) * 1024 + (kp % 16) * 16;
    __m512bh vv[4];
    for (int c = 0; c < 4; ++c) vv[c] = (__m512bh)_mm512_loadu_si512(v + 256 * c);
    for (int i = 0; i < R; ++i) {
      const __m512bh a = (__m512bh)_mm512_set1_epi32(rows[i][kp]);
      for (int c = 0; c < 4; ++c) acc[i][c] = _mm512_dpbf16_ps(acc[i][c], a, vv[c]);
    }
  }
  for (int i = 0; i < R; ++i)
    for (int c = 0; c < 4; ++c) _mm512_storeu_ps(o + i * kDim + 16 * c, acc[i][c]);
}

void attend_block_dot(const Block& b, const SequenceKeys& p, float scale,
                      std::vector<float>& scores, std::vector<uint16_t>& weights) {
  const int64_t visible = b.first_keys + b.rows - 1;
  const int64_t padded = (visible + 31) / 32 * 32, groups = padded / 32;
  scores.resize(16 * padded);
  weights.assign(16 * padded, 0);
  float* s = scores.data();
  int i = 0;
  for (; i + 8 <= b.rows; i += 8)
    dot_scores<8>(s + i * padded, padded, b.q + i * b.q_stride, b.q_stride, p.keys_t.data(),
                  groups);
  for (; i < b.rows; ++i)
    dot_scores<1>(s + i * padded, padded, b.q + i * b.q_stride, b.q_stride, p.keys_t.data(),
                  groups);
  float sums[16];
  softmax_rows(s, weights.data(), padded, b.rows, b.first_keys, scale, sums);
  alignas(64) float o[16 * kDim];
  const uint16_t* w = weights.data();
  i = 0;
  for (; i + 4 <= b.rows; i += 4)
    dot_values<4>(o + i * kDim, w + i * padded, padded, p.values.data());
  for (; i < b.rows; ++i) dot_values<1>(o + i * kDim, w + i * padded, padded, p.values.data());
  finish_rows(b.out, b.out_stride, o, sums, b.rows);
}
#endif

}  // namespace
#endif

extern "C" {

int parashift_prefill_attention_bf16(void* out, const void* query, int64_t query_stride,
                                     const void* key_cache, const void* value_cache,
                                     const int32_t* block_tables, int64_t table_width,
                                     const int32_t* query_starts, const int32_t* seq_lens,
                                     int64_t seqs, int64_t heads, int64_t kv_heads,
                                     int64_t head_dim, int64_t block_size, float scale,
                                     int num_threads) {
#ifdef PARASHIFT_TILED_PREFILL
  if (head_dim != kDim) return 0;
  [[maybe_unused]] bool amx = false;
#ifdef PARASHIFT_AMX
  amx = amx_permitted();
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
