// A Llama-family decoder layer in bfloat16 as one call: the same kernels, in the same order and
// on the same buffers as the Python layers call them one by one (models/llama.py), so the
// results are the same bits. What goes is the Python between them: a dozen module calls,
// ctypes calls and tensor allocations per layer, about a tenth of a decode step at batch 32.

#include <cstring>

#include "entry_points.h"

extern "C" {

// One layer's weights (packed by parashift_pack_bf16, or by parashift_pack_int8 with a scale
// per output column under `--quantization int8`; the column-parallel biases may be null: the
// row-parallel ones are added after the GEMM in Python, a rounding of their own, so a layer with
// them does not come here) and KV cache.
struct ParashiftLayerWeights {
  const void* input_norm;
  const void* post_norm;
  const void* qkv;
  const void* qkv_bias;
  const void* o;
  const void* gate_up;
  const void* gate_up_bias;
  const void* down;
  void* key_cache;
  void* value_cache;
  const void* next_qkv;  // the following layer's, of the same kind (null: none): fetched ahead
  // int8 weights' scales [n] bf16 (null: the weights are bf16)
  const void* qkv_scale;
  const void* o_scale;
  const void* gate_up_scale;
  const void* down_scale;
};

// What every layer of one step shares: shapes, the step's tables and scratch buffers.
struct ParashiftLayerStep {
  int64_t tokens, hidden, heads, kv_heads, head_dim, intermediate;
  float eps, scale;
  const void* cos;               // [tokens, head_dim / 2]
  const void* sin;
  const int64_t* slot_mapping;   // [tokens]
  const int32_t* block_tables;   // [tokens, table_width]: every token a query over its prefix
  int64_t table_width;
  const int32_t* seq_lens;       // [tokens]
  int64_t block_size, window;
  void* normed;                  // [tokens, hidden]
  void* qkv;                     // [tokens, (heads + 2 kv_heads) head_dim]
  void* attn;                    // [tokens, heads head_dim]
  void* o;                       // [tokens, hidden]
  void* gate_up;                 // [tokens, 2 intermediate]
  void* act;                     // [tokens, intermediate]
  int num_threads;
  // Where prefills > 0: tokens from `decodes` on are prefill chunks (query_starts [prefills + 1]
  // from 0, chunk_seq_lens [prefills], chunk_tables [prefills, chunk_table_width]) for the tiled
  // prefill kernel; where it does not run, every token is a decode query as above.
  int64_t decodes, prefills;
  const int32_t* chunk_tables;
  int64_t chunk_table_width;
  const int32_t* query_starts;
  const int32_t* chunk_seq_lens;
  int decode_order;  // --deterministic: the tiled kernel off AMX tiles (the decode order)
};

namespace {

// One of the layer's GEMMs: int8 where its weight has scales, else bf16, naming the weight the
// layer multiplies by next (of the same kind) so that it starts coming in as this one ends.
void gemm(void* out, int64_t out_stride, const void* x, int64_t x_stride, const void* w,
          const void* scale, const void* bias, int64_t m, int64_t n, int64_t k,
          const void* next, int64_t next_n, int64_t next_k, int threads) {
  if (scale)
    parashift_gemm_int8(out, out_stride, x, x_stride, w, scale, bias, m, n, k, next, next_n,
                        next_k, threads);
  else
    parashift_gemm_bf16_then(out, out_stride, x, x_stride, w, bias, m, n, k, next, next_n,
                             next_k, threads);
}

}  // namespace

// hidden [tokens, hidden] <- the layer's output, residual [tokens, hidden] <- the new residual,
// both in place. `first`: the model's first layer, where the residual starts as the input.
// Without a dense MLP (gate_up null: an MoE layer) the layer stops at its post-attention norm:
// hidden <- the normed rows its experts take.
void parashift_llama_layer_bf16(const ParashiftLayerWeights* w, const ParashiftLayerStep* s,
                                void* hidden, void* residual, int first) {
  constexpr int kBf16 = 1;
  const int64_t t = s->tokens, h = s->hidden, d = s->head_dim, th = s->num_threads;
  const int64_t qkv_width = (s->heads + 2 * s->kv_heads) * d;
  const int64_t elements = t * h;
  // the kernels may run in place: each row is read whole before it is written
  if (first) {
    std::memcpy(residual, hidden, elements * 2);
    parashift_rms_norm(kBf16, s->normed, nullptr, hidden, h, nullptr, 0, w->input_norm, t, h,
                       s->eps, th);
  } else {
    parashift_rms_norm(kBf16, s->normed, residual, hidden, h, residual, h, w->input_norm, t, h,
                       s->eps, th);
  }
  const int64_t i2 = 2 * s->intermediate, attn_width = s->heads * d;
  // each GEMM names the next, whose weight it starts fetching as it ends
  gemm(s->qkv, qkv_width, s->normed, h, w->qkv, w->qkv_scale, w->qkv_bias, t, qkv_width, h, w->o,
       h, attn_width, th);
  char* qkv = static_cast<char*>(s->qkv);
  parashift_rotary(kBf16, qkv, qkv_width, s->cos, s->sin, t, s->heads + s->kv_heads, d, th);
  parashift_write_kv(kBf16, w->key_cache, w->value_cache, qkv + s->heads * d * 2,
                     qkv + (s->heads + s->kv_heads) * d * 2, qkv_width, qkv_width,
                     s->slot_mapping, t, s->kv_heads * d, th);
  int64_t queries = t;  // tokens for the decode kernel
  if (s->prefills > 0 &&
      parashift_prefill_attention_bf16(
          static_cast<char*>(s->attn) + s->decodes * attn_width * 2,
          qkv + s->decodes * qkv_width * 2, qkv_width, w->key_cache, w->value_cache,
          s->chunk_tables, s->chunk_table_width,
          s->query_starts, s->chunk_seq_lens, s->prefills, s->heads, s->kv_heads, d,
          s->block_size, s->scale, s->decode_order, th))
    queries = s->decodes;
  if (queries > 0)
    parashift_paged_decode_attention(kBf16, s->attn, qkv, qkv_width, w->key_cache,
                                     w->value_cache, s->block_tables, s->table_width, s->seq_lens,
                                     queries, s->heads, s->kv_heads, d, s->block_size, s->window,
                                     s->scale, th);
  gemm(s->o, h, s->attn, attn_width, w->o, w->o_scale, nullptr, t, h, attn_width, w->gate_up, i2,
       h, th);
  if (!w->gate_up) {  // an MoE layer: its experts run in torch, on the normed rows left in hidden
    parashift_rms_norm(kBf16, hidden, residual, s->o, h, residual, h, w->post_norm, t, h, s->eps,
                       th);
    return;
  }
  parashift_rms_norm(kBf16, s->normed, residual, s->o, h, residual, h, w->post_norm, t, h, s->eps,
                     th);
  gemm(s->gate_up, i2, s->normed, h, w->gate_up, w->gate_up_scale, w->gate_up_bias, t, i2, h,
       w->down, h, s->intermediate, th);
  parashift_silu_and_mul(kBf16, s->act, s->gate_up, i2, t, s->intermediate, th);
  gemm(hidden, h, s->act, s->intermediate, w->down, w->down_scale, nullptr, t, h, s->intermediate,
       w->next_qkv, qkv_width, h, th);
}

}  // extern "C"
