// Runs the CPU kernels' plain C++ paths on fixed pseudo-random inputs and prints every output
// value, one per line: test_cpu_kernels_on_arm.py runs it built for ARM (under qemu) and for
// baseline x86-64 (natively, the build that test_cpu_kernels.py holds to torch), and compares.

#include <cstdio>

#include "common.h"  // bf16, to_f, from_f: the kernels' own conversions
#include "entry_points.h"

namespace {

uint32_t state = 12345;

float uniform() {  // in [-1, 1)
  state = state * 1664525u + 1013904223u;
  return static_cast<float>(state >> 8) / 8388608.0f - 1.0f;
}

// A tensor of n values in both dtypes: the same numbers (rounded to bf16 first).
struct Values {
  std::vector<float> f32;
  std::vector<bf16> b16;
  explicit Values(size_t n, float scale = 1.0f) : f32(n), b16(n) {
    for (size_t i = 0; i < n; ++i) {
      b16[i] = from_f<bf16>(uniform() * scale);
      f32[i] = to_f(b16[i]);
    }
  }
  void* data(int dtype) { return dtype == 0 ? static_cast<void*>(f32.data()) : b16.data(); }
};

void print(const char* label, int dtype, const Values& v) {
  for (size_t i = 0; i < v.f32.size(); ++i)
    std::printf("%s %d %.9g\n", label, dtype, dtype == 0 ? v.f32[i] : to_f(v.b16[i]));
}

void check_kernels(int dtype) {
  {  // RMSNorm of strided rows, with the residual add
    const int64_t rows = 7, hidden = 96;
    Values x(rows * 2 * hidden), residual(rows * hidden), weight(hidden), out(rows * hidden),
        summed(rows * hidden);
    parashift_rms_norm(dtype, out.data(dtype), summed.data(dtype), x.data(dtype), 2 * hidden,
                       residual.data(dtype), hidden, weight.data(dtype), rows, hidden, 1e-6f, 2);
    print("rms_norm", dtype, out);
    print("rms_norm_sum", dtype, summed);
  }
  {  // SiLU and multiply, past exp's easy range
    const int64_t tokens = 9, d = 40;
    Values x(tokens * 2 * d, 8.0f), out(tokens * d);
    parashift_silu_and_mul(dtype, out.data(dtype), x.data(dtype), 2 * d, tokens, d, 2);
    print("silu_and_mul", dtype, out);
  }
  {  // rotary on the q and k heads of a qkv row, in place
    const int64_t tokens = 5, heads = 6, head_dim = 16;
    Values qkv(tokens * (heads + 2) * head_dim), cos(tokens * head_dim / 2),
        sin(tokens * head_dim / 2);
    parashift_rotary(dtype, qkv.data(dtype), (heads + 2) * head_dim, cos.data(dtype),
                     sin.data(dtype), tokens, heads, head_dim, 2);
    print("rotary", dtype, qkv);
  }
  for (int64_t head_dim : {16, 64}) {  // paged decode attention, blocks scattered, GQA
    const int64_t seqs = 6, heads = 9, kv_heads = 3, block_size = 4, blocks = 64, width = 8;
    const int32_t seq_lens[seqs] = {1, 4, 5, 17, 30, 9};
    std::vector<int32_t> tables(seqs * width);
    for (int64_t i = 0; i < seqs * width; ++i)
      tables[i] = static_cast<int32_t>((i * 37 + 5) % blocks);
    Values query(seqs * heads * head_dim), keys(blocks * block_size * kv_heads * head_dim),
        values(blocks * block_size * kv_heads * head_dim), out(seqs * heads * head_dim);
    for (int64_t window : {0, 7}) {
      parashift_paged_decode_attention(dtype, out.data(dtype), query.data(dtype), heads * head_dim,
                                       keys.data(dtype), values.data(dtype), tables.data(), width,
                                       seq_lens, seqs, heads, kv_heads, head_dim, block_size,
                                       window, 1.0f / std::sqrt(static_cast<float>(head_dim)), 2);
      print("decode_attention", dtype, out);
    }
  }
  {  // greedy argmax over a vocabulary-sized row, ties to the first
    const int64_t rows = 4, cols = 1000;
    Values x(rows * cols);
    std::vector<int64_t> best(rows);
    parashift_argmax_rows(dtype, best.data(), x.data(dtype), rows, cols, 2);
    for (int64_t b : best) std::printf("argmax %d %lld\n", dtype, static_cast<long long>(b));
  }
}

}  // namespace

int main() {
  check_kernels(0);  // float32
  check_kernels(1);  // bfloat16
  return 0;
}
