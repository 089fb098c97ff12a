// The library's C entry points (called through ctypes, see library.py), declared once: the
// files that define them include this too, so the compiler checks each definition against it,
// and layer.cpp calls them by these declarations.

#pragma once

#include <cstdint>

extern "C" {

void parashift_rms_norm(int dtype, void* out, void* residual_out, const void* x,
                        int64_t x_stride, const void* residual, int64_t residual_stride,
                        const void* weight, int64_t rows, int64_t hidden, float eps,
                        int num_threads);
void parashift_rotary(int dtype, void* x, int64_t token_stride, const void* cos, const void* sin,
                      int64_t tokens, int64_t heads, int64_t head_dim, int num_threads);
void parashift_silu_and_mul(int dtype, void* out, const void* x, int64_t x_stride,
                            int64_t tokens, int64_t d, int num_threads);
void parashift_write_kv(int dtype, void* key_cache, void* value_cache, const void* key,
                        const void* value, int64_t key_stride, int64_t value_stride,
                        const int64_t* slot_mapping, int64_t tokens, int64_t row_elements,
                        int num_threads);
void parashift_paged_decode_attention(int dtype, void* out, const void* query,
                                      int64_t query_stride, const void* key_cache,
                                      const void* value_cache, const int32_t* block_tables,
                                      int64_t table_width, const int32_t* seq_lens, int64_t seqs,
                                      int64_t heads, int64_t kv_heads, int64_t head_dim,
                                      int64_t block_size, int64_t window, float scale,
                                      int num_threads);
void parashift_argmax_rows(int dtype, int64_t* out, const void* x, int64_t rows, int64_t cols,
                           int num_threads);
// sampling.cpp: top_k, top_p and min_p may be null (no row uses them), uniforms too when every
// row is greedy (temperature 0).
// Overrides (null: none): row r's logits at override_ids[override_starts[r] ..
// override_starts[r + 1]) read as override_values there.
void parashift_sample_rows(int dtype, int64_t* out, const void* logits, int64_t row_stride,
                           int64_t rows, int64_t vocab, const float* temperature,
                           const int64_t* top_k, const float* top_p, const float* min_p,
                           const double* uniforms, const int64_t* override_starts,
                           const int64_t* override_ids, const float* override_values,
                           int num_threads);
// 1 where it ran (bf16, head_dim 64, AMX or AVX512-BF16; decode_order: AVX512-BF16 only); 0:
// not taken, nothing written.
int parashift_prefill_attention_bf16(void* out, const void* query, int64_t query_stride,
                                     const void* key_cache, const void* value_cache,
                                     const int32_t* block_tables, int64_t table_width,
                                     const int32_t* query_starts, const int32_t* seq_lens,
                                     int64_t seqs, int64_t heads, int64_t kv_heads,
                                     int64_t head_dim, int64_t block_size, float scale,
                                     int decode_order, int num_threads);
int parashift_cpu_bf16_dot();
int parashift_cpu_bf16_attention();
int parashift_cpu_bf16_gemm();  // 0: no gemm_bf16 here; 1 FMA, 2 vdpbf16ps, 3 AMX
void parashift_pack_bf16(void* packed, const void* weight, int64_t w_stride, int64_t n,
                         int64_t k, int num_threads);
void parashift_gemm_bf16(void* out, int64_t out_stride, const void* x, int64_t x_stride,
                         const void* packed, const void* bias, int64_t m, int64_t n, int64_t k,
                         int num_threads);
void parashift_pack_int8(void* packed, const void* weight, int64_t w_stride, int64_t n,
                         int64_t k, int num_threads);
void parashift_gemm_int8(void* out, int64_t out_stride, const void* x, int64_t x_stride,
                         const void* packed, const void* scale, const void* bias, int64_t m,
                         int64_t n, int64_t k, const void* next_packed, int64_t next_n,
                         int64_t next_k, int num_threads);
void parashift_gemm_bf16_then(void* out, int64_t out_stride, const void* x, int64_t x_stride,
                              const void* packed, const void* bias, int64_t m, int64_t n,
                              int64_t k, const void* next_packed, int64_t next_n,
                              int64_t next_k, int num_threads);
// layer.cpp's parashift_llama_layer_bf16 takes structs: declared there, beside them.

}  // extern "C"
