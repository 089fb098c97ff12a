// The elementwise kernels of the CPU decode path: RMSNorm with the residual add, rotary,
// SiLU-and-mul, the greedy argmax and the KV write.

#include "common.h"
#include "entry_points.h"

namespace {

// out = w * T(x * rsqrt(mean(x^2) + eps)), x = T(hidden + residual) when residual is given
// (then also written to residual_out): RMSNorm's reference, in one pass over each row.
template <class T>
void rms_norm(T* out, T* residual_out, const T* x, int64_t x_stride, const T* residual,
              int64_t residual_stride, const T* weight, int64_t rows, int64_t hidden, float eps,
              int num_threads) {
#pragma omp parallel num_threads(threads_for(rows * hidden, num_threads))
  {
  std::vector<float> row(hidden);
#pragma omp for
  for (int64_t r = 0; r < rows; ++r) {
    const T* xr = x + r * x_stride;
    T* o = out + r * hidden;
    if (residual != nullptr) {
      const T* rr = residual + r * residual_stride;
      T* ro = residual_out + r * hidden;
      for (int64_t i = 0; i < hidden; ++i) {
        T sum = from_f<T>(to_f(xr[i]) + to_f(rr[i]));
        ro[i] = sum;
        row[i] = to_f(sum);
      }
    } else {
      for (int64_t i = 0; i < hidden; ++i) row[i] = to_f(xr[i]);
    }
    float squares = 0.f;
    for (int64_t i = 0; i < hidden; ++i) squares += row[i] * row[i];
    float inv = 1.f / std::sqrt(squares / static_cast<float>(hidden) + eps);
    for (int64_t i = 0; i < hidden; ++i)
      o[i] = from_f<T>(to_f(weight[i]) * round_to<T>(row[i] * inv));
  }
  }
}

// Neox rotary in place on x [tokens, heads, head_dim] (token stride given, heads contiguous):
// (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin), cos/sin [tokens, head_dim / 2] in T.
template <class T>
void rotary(T* x, int64_t token_stride, const T* cos, const T* sin, int64_t tokens,
            int64_t heads, int64_t head_dim, int num_threads) {
  const int64_t half = head_dim / 2;
#pragma omp parallel num_threads(threads_for(tokens * heads * head_dim, num_threads))
  {
    std::vector<float> c(half), s(half), a(half), b(half);
#pragma omp for
    for (int64_t t = 0; t < tokens; ++t) {
      for (int64_t i = 0; i < half; ++i) c[i] = to_f(cos[t * half + i]);
      for (int64_t i = 0; i < half; ++i) s[i] = to_f(sin[t * half + i]);
      for (int64_t h = 0; h < heads; ++h) {
        T* x1 = x + t * token_stride + h * head_dim;
        T* x2 = x1 + half;
        for (int64_t i = 0; i < half; ++i) a[i] = to_f(x1[i]);
        for (int64_t i = 0; i < half; ++i) b[i] = to_f(x2[i]);
        for (int64_t i = 0; i < half; ++i)
          x1[i] = from_f<T>(round_to<T>(a[i] * c[i]) - round_to<T>(b[i] * s[i]));
        for (int64_t i = 0; i < half; ++i)
          x2[i] = from_f<T>(round_to<T>(b[i] * c[i]) + round_to<T>(a[i] * s[i]));
      }
    }
  }
}

// out [tokens, d] = T(silu(gate)) * up, x [tokens, 2d] = (gate | up) with a row stride.
template <class T>
void silu_and_mul(T* out, const T* x, int64_t x_stride, int64_t tokens, int64_t d,
                  int num_threads) {
#pragma omp parallel for num_threads(threads_for(tokens * d, num_threads))
  for (int64_t t = 0; t < tokens; ++t) {
    const T* gate = x + t * x_stride;
    const T* up = gate + d;
    T* o = out + t * d;
    for (int64_t i = 0; i < d; ++i) {
      float g = to_f(gate[i]);
      o[i] = from_f<T>(round_to<T>(g / (1.f + fast_exp(-g))) * to_f(up[i]));
    }
  }
}

// A float's bits as an int32 that orders like the float (-0 equal to +0; a NaN past both
// infinities): max reductions on it vectorize, where a float max with NaN semantics does not.
inline int32_t order_key(float f) {
  int32_t i;
  std::memcpy(&i, &f, 4);
  return i >= 0 ? i : -(i & 0x7fffffff);
}
inline int32_t order_key(bf16 x) { return order_key(to_f(x)); }
inline bool is_nan_key(int32_t key) { return key > 0x7f800000 || key < -0x7f800000; }

// The index of each row's largest value (the first of equals; a NaN wins, as in torch): chunk
// maxima in one vectorized pass, then a scan of the first chunk that holds the maximum.
template <class T>
void argmax_rows(int64_t* out, const T* x, int64_t rows, int64_t cols, int num_threads) {
  constexpr int64_t kChunk = 256;
  const int64_t chunks = (cols + kChunk - 1) / kChunk;
#pragma omp parallel num_threads(threads_for(rows * cols, num_threads))
  {
    std::vector<int32_t> chunk_max(chunks);
#pragma omp for
    for (int64_t r = 0; r < rows; ++r) {
      const T* row = x + r * cols;
      int nans = 0;
      for (int64_t c = 0; c < chunks; ++c) {
        const int64_t end = std::min(cols, (c + 1) * kChunk);
        int32_t top = INT32_MIN;
        for (int64_t i = c * kChunk; i < end; ++i) {
          const int32_t key = order_key(row[i]);
          top = key > top ? key : top;
          nans += is_nan_key(key);
        }
        chunk_max[c] = top;
      }
      int64_t best = 0;
      if (nans) {
        while (!is_nan_key(order_key(row[best]))) ++best;
      } else {
        int64_t c = 0;
        for (int64_t k = 1; k < chunks; ++k)
          if (chunk_max[k] > chunk_max[c]) c = k;
        for (best = c * kChunk; order_key(row[best]) != chunk_max[c]; ++best) {}
      }
      out[r] = best;
    }
  }
}

// The new tokens' K and V into their cache slots; a slot of -1 is skipped (padding).
// key/value [tokens, kv_heads, head_dim] with a token stride; caches [slots, kv_heads, head_dim].
// On every thread for a prefill chunk: the cache lines written are read from memory first.
template <class T>
void write_kv(T* key_cache, T* value_cache, const T* key, const T* value, int64_t key_stride,
              int64_t value_stride, const int64_t* slot_mapping, int64_t tokens,
              int64_t row_elements, int num_threads) {
#pragma omp parallel for num_threads(threads_for(tokens * row_elements, num_threads))
  for (int64_t t = 0; t < tokens; ++t) {
    int64_t slot = slot_mapping[t];
    if (slot < 0) continue;
    std::memcpy(key_cache + slot * row_elements, key + t * key_stride, row_elements * sizeof(T));
    std::memcpy(value_cache + slot * row_elements, value + t * value_stride,
                row_elements * sizeof(T));
  }
}
}  // namespace

#include "elementwise_bf16.h"  // the bf16 specializations, in AVX-512 lanes

extern "C" {

void parashift_rms_norm(int dtype, void* out, void* residual_out, const void* x,
                        int64_t x_stride, const void* residual, int64_t residual_stride,
                        const void* weight, int64_t rows, int64_t hidden, float eps,
                        int num_threads) {
  if (dtype == 0)
    rms_norm<float>(P(float, out), P(float, residual_out), P(const float, x), x_stride,
                    P(const float, residual), residual_stride, P(const float, weight), rows,
                    hidden, eps, num_threads);
  else
    rms_norm<bf16>(P(bf16, out), P(bf16, residual_out), P(const bf16, x), x_stride,
                   P(const bf16, residual), residual_stride, P(const bf16, weight), rows, hidden,
                   eps, num_threads);
}

void parashift_rotary(int dtype, void* x, int64_t token_stride, const void* cos, const void* sin,
                      int64_t tokens, int64_t heads, int64_t head_dim, int num_threads) {
  if (dtype == 0)
    rotary<float>(P(float, x), token_stride, P(const float, cos), P(const float, sin), tokens,
                  heads, head_dim, num_threads);
  else
    rotary<bf16>(P(bf16, x), token_stride, P(const bf16, cos), P(const bf16, sin), tokens, heads,
                 head_dim, num_threads);
}

void parashift_silu_and_mul(int dtype, void* out, const void* x, int64_t x_stride,
                            int64_t tokens, int64_t d, int num_threads) {
  if (dtype == 0)
    silu_and_mul<float>(P(float, out), P(const float, x), x_stride, tokens, d, num_threads);
  else
    silu_and_mul<bf16>(P(bf16, out), P(const bf16, x), x_stride, tokens, d, num_threads);
}

void parashift_argmax_rows(int dtype, int64_t* out, const void* x, int64_t rows, int64_t cols,
                           int num_threads) {
  if (dtype == 0)
    argmax_rows<float>(out, P(const float, x), rows, cols, num_threads);
  else
    argmax_rows<bf16>(out, P(const bf16, x), rows, cols, num_threads);
}

void parashift_write_kv(int dtype, void* key_cache, void* value_cache, const void* key,
                        const void* value, int64_t key_stride, int64_t value_stride,
                        const int64_t* slot_mapping, int64_t tokens, int64_t row_elements,
                        int num_threads) {
  if (dtype == 0)
    write_kv<float>(P(float, key_cache), P(float, value_cache), P(const float, key),
                    P(const float, value), key_stride, value_stride, slot_mapping, tokens,
                    row_elements, num_threads);
  else
    write_kv<bf16>(P(bf16, key_cache), P(bf16, value_cache), P(const bf16, key),
                   P(const bf16, value), key_stride, value_stride, slot_mapping, tokens,
                   row_elements, num_threads);
}

}  // extern "C"
