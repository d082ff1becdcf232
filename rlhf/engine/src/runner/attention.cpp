// The CPU decode step's attention-side kernels: writing a step's keys and values into the paged
// cache and the decode lanes, and the decode attention.
//
// Decode attention on the CPU: one query per sequence over its decode lanes (keys transposed,
// `decode_lanes.rs`), scores, softmax and the weighted sum of values in one pass per (key/value
// head, sequence) pair, with the query heads that share the pair's keys in registers at once.
// libtorch runs this as a batched product, a softmax and a second batched product; at decode
// sizes MKL spends most of each product packing its operands (the 27M-parameter benchmark
// model, 64 sequences, 96 positions: 150-180 µs per layer against 66 here on AVX-512, 92 on
// AVX2). Compiled for AVX2+FMA and for AVX-512F, picked at run time; without AVX2 the runner
// keeps libtorch's products. The sums run in a different order than MKL's, and FMA rounds
// once where MKL may not: results agree with the products within float rounding, not bit for
// bit (as MKL's own kernels differ between CPUs). Built by build.rs; the Rust side is
// `runner/cpu_kernels.rs`.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include "shim.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace {

struct Args {
  const float* q;  // [batch * queries, heads, head_dim]: query row r is of sequence r / queries
  int64_t q_row, q_head;
  const float* kt;  // [kv_heads, batch, head_dim, len]: keys transposed
  int64_t k_head, k_seq, k_dim;
  const float* v;  // [kv_heads, batch, len, head_dim]
  int64_t v_head, v_seq, v_pos;
  const float* add;  // [batch * queries, row]: 0 where a position is attended, else -inf
  float* out;        // [batch * queries, heads * head_dim]
  int64_t batch, queries, heads, group, head_dim, len, row;
  int64_t readable;  // positions each key row holds finite values for (len or more)
  float scale;
};

using rtrun::check;
using rtrun::exp_nonpositive;
using rtrun::has_avx2;

using rtrun::has_avx512;

#if defined(__x86_64__)

// The vector operations attention_body.h uses, from the intrinsics of prefix P (`_mm256`,
// `_mm512`) on VEC, WIDTH floats wide.
#define RTRUN_VECTOR_OPS(P, VEC, WIDTH)                                  \
  constexpr int kWidth = WIDTH;                                          \
  using Vec = VEC;                                                       \
  inline Vec vzero() { return P##_setzero_ps(); }                        \
  inline Vec vload(const float* p) { return P##_loadu_ps(p); }           \
  inline void vstore(float* p, Vec x) { P##_storeu_ps(p, x); }           \
  inline Vec vsplat(float x) { return P##_set1_ps(x); }                  \
  inline Vec vfma(Vec a, Vec b, Vec c) { return P##_fmadd_ps(a, b, c); } \
  inline Vec vmul(Vec a, Vec b) { return P##_mul_ps(a, b); }             \
  inline Vec vmax(Vec a, Vec b) { return P##_max_ps(a, b); }

#pragma GCC push_options
#pragma GCC target("avx2,fma")
namespace avx2 {
RTRUN_VECTOR_OPS(_mm256, __m256, 8)
#include "attention_body.h"
}  // namespace avx2
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx512f,avx2,fma")
namespace avx512 {
RTRUN_VECTOR_OPS(_mm512, __m512, 16)
#include "attention_body.h"
}  // namespace avx512
#pragma GCC pop_options
#endif

// Copies element `i` of `src` to element `i` of `dst`, for `n` elements of `sizeof(E)` bytes
// `src_step` and `dst_step` bytes apart.
template <typename E>
void copy_elements(const char* src, int64_t src_step, char* dst, int64_t dst_step, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    E x;
    std::memcpy(&x, src + i * src_step, sizeof(E));
    std::memcpy(dst + i * dst_step, &x, sizeof(E));
  }
}

void copy_strided(const char* src, int64_t src_step, char* dst, int64_t dst_step, int64_t n,
                  int64_t size) {
  if (src_step == size && dst_step == size) {
    std::memcpy(dst, src, n * size);
    return;
  }
  switch (size) {
    case 2: copy_elements<uint16_t>(src, src_step, dst, dst_step, n); break;
    case 4: copy_elements<uint32_t>(src, src_step, dst, dst_step, n); break;
    case 8: copy_elements<uint64_t>(src, src_step, dst, dst_step, n); break;
    default: throw std::invalid_argument("unsupported element size " + std::to_string(size));
  }
}

}  // namespace

extern "C" {

// Writes a step's new keys and values, k and v: [T, kv_heads, d] (any strides, as the
// projections leave them), into the paged cache rows `rows`: [kv_heads
// * T] (int64, head-major: row of head h and token t at h * T + t) of cache_k, cache_v: [N, d]
// (contiguous); and, when lane_k is given, also into the decode lanes lane_k: [kv_heads, T, d,
// capacity] (keys transposed) and lane_v: [kv_heads, T, capacity, d] at `positions`: [T]
// (int64; token t is lane t). One pass instead of a permuted copy and an index_copy_ per tensor.
int rtrun_write_kv(const at::Tensor* k, const at::Tensor* v, const at::Tensor* rows,
                   const at::Tensor* cache_k, const at::Tensor* cache_v,
                   const at::Tensor* lane_k, const at::Tensor* lane_v,
                   const at::Tensor* positions, char* err, size_t len) {
  return rtrun::run(err, len, [&] {
    const auto kind = k->scalar_type();
    if (k->dim() != 3 || v->dim() != 3 || v->scalar_type() != kind || !k->device().is_cpu() ||
        !v->device().is_cpu()) {
      throw std::invalid_argument("the new keys and values should be 3-D CPU tensors of one "
                                  "kind, found " + c10::str(k->sizes()) + " and " +
                                  c10::str(v->sizes()));
    }
    check(*cache_k, "the key cache", 2, kind);
    check(*cache_v, "the value cache", 2, kind);
    check(*rows, "the cache rows", 1, at::kLong);
    const int64_t tokens = k->size(0), kv_heads = k->size(1), d = k->size(2);
    const int64_t slots = cache_k->size(0);
    if (v->sizes() != k->sizes() || cache_k->size(1) != d || cache_v->sizes() != cache_k->sizes() ||
        !cache_k->is_contiguous() || !cache_v->is_contiguous() ||
        rows->size(0) != kv_heads * tokens) {
      throw std::invalid_argument(
          "writing keys and values wants k, v [T, kv_heads, d], contiguous caches [N, d] and "
          "kv_heads * T rows; found " + c10::str(k->sizes()) + ", " + c10::str(v->sizes()) + ", " +
          c10::str(cache_k->sizes()) + ", " + c10::str(rows->sizes()));
    }
    const int64_t* row = rows->data_ptr<int64_t>();
    for (int64_t i = 0; i < kv_heads * tokens; ++i) {
      if (row[i] < 0 || row[i] >= slots) {
        throw std::invalid_argument("cache row " + std::to_string(row[i]) + " is outside the " +
                                    std::to_string(slots) + " rows of the cache");
      }
    }
    const int64_t* pos = nullptr;
    int64_t capacity = 0;
    // Every check before the first write: a refused step leaves the cache as it was.
    if (lane_k != nullptr) {
      check(*lane_k, "the key lanes", 4, kind);
      check(*lane_v, "the value lanes", 4, kind);
      check(*positions, "the lane positions", 1, at::kLong);
      capacity = lane_v->size(2);
      if (lane_k->size(0) != kv_heads || lane_k->size(1) != tokens || lane_k->size(2) != d ||
          lane_k->size(3) != capacity || lane_v->size(0) != kv_heads ||
          lane_v->size(1) != tokens || lane_v->size(3) != d || positions->size(0) != tokens) {
        throw std::invalid_argument(
            "writing the lanes wants key lanes [kv_heads, T, d, capacity], value lanes [kv_heads, "
            "T, capacity, d] and T positions; found " + c10::str(lane_k->sizes()) + ", " +
            c10::str(lane_v->sizes()) + ", " + c10::str(positions->sizes()) + " for " +
            c10::str(k->sizes()));
      }
      pos = positions->data_ptr<int64_t>();
      for (int64_t t = 0; t < tokens; ++t) {
        if (pos[t] < 0 || pos[t] >= capacity) {
          throw std::invalid_argument("lane position " + std::to_string(pos[t]) +
                                      " is outside the lanes' " + std::to_string(capacity));
        }
      }
    }
    const int64_t size = k->element_size();
    if (size != 2 && size != 4 && size != 8) {
      throw std::invalid_argument("unsupported element size " + std::to_string(size));
    }
    const char* kp = static_cast<const char*>(k->data_ptr());
    const char* vp = static_cast<const char*>(v->data_ptr());
    char* ckp = static_cast<char*>(cache_k->data_ptr());
    char* cvp = static_cast<char*>(cache_v->data_ptr());
    const int64_t k_tok = k->stride(0) * size, k_head = k->stride(1) * size;
    const int64_t v_tok = v->stride(0) * size, v_head = v->stride(1) * size;
    const int64_t k_el = k->stride(2) * size, v_el = v->stride(2) * size;
    char* lkp = lane_k == nullptr ? nullptr : static_cast<char*>(lane_k->data_ptr());
    char* lvp = lane_v == nullptr ? nullptr : static_cast<char*>(lane_v->data_ptr());
    const auto write = [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        const int64_t h = i / tokens, t = i % tokens, r = row[i];
        const char* key = kp + t * k_tok + h * k_head;
        const char* value = vp + t * v_tok + h * v_head;
        copy_strided(key, k_el, ckp + r * d * size, size, d, size);
        copy_strided(value, v_el, cvp + r * d * size, size, d, size);
        if (lkp == nullptr) continue;
        const int64_t p = pos[t];
        // Keys transposed: element e of the key goes to row e of the lane, column p.
        copy_strided(key, k_el, lkp + (h * lane_k->stride(0) + t * lane_k->stride(1) + p) * size,
                     lane_k->stride(2) * size, d, size);
        copy_strided(value, v_el,
                     lvp + (h * lane_v->stride(0) + t * lane_v->stride(1) +
                            p * lane_v->stride(2)) * size,
                     size, d, size);
      }
    };
    // (head, token) pairs in the order the attention kernel splits its (head, sequence) pairs
    // over the intra-op threads, so each thread writes the lanes it then reads. A transposed
    // key touches d cache lines of its lane: at 64 sequences a layer's writes are ~8k lines
    // the core must fetch before it can store, which one thread waits out alone.
    const int64_t pairs = kv_heads * tokens;
    if (pairs * d < 4096) write(0, pairs);
    else at::parallel_for(0, pairs, 1, write);
  });
}

// Whether this CPU runs the kernel (AVX2 and FMA).
int rtrun_decode_attention_supported() { return has_avx2() ? 1 : 0; }

// q: [batch * queries, heads, head_dim] (query row r of sequence r / queries: one row per
// sequence in a decode step, a chunk's rows in a prefill); kt: [kv_heads, batch, head_dim, len]
// (keys transposed); v: [kv_heads, batch, len, head_dim]; keep: [batch * queries, len] bool
// (positions each query row attends); readable: how many positions each key row may be read
// at (at least len; more where the rows hold finite values past it, as the lanes do). Any
// strides but a contiguous last dimension (keep: contiguous). `*out` receives a new contiguous [batch * queries, heads * head_dim]: softmax(q
// k^T * scale) v per query head, query head i reading key/value head i / (heads / kv_heads); a
// row that attends nothing gets zeros.
int rtrun_decode_attention(const at::Tensor* q, const at::Tensor* kt, const at::Tensor* v,
                           const at::Tensor* keep, int64_t readable, double scale,
                           at::Tensor** out, char* err, size_t len) {
  return rtrun::return_tensor(out, err, len, [&]() -> at::Tensor {
    check(*q, "the queries", 3, at::kFloat);
    check(*kt, "the transposed keys", 4, at::kFloat);
    check(*v, "the values", 4, at::kFloat);
    check(*keep, "the attention mask", 2, at::kBool);
    Args a{};
    const int64_t rows = q->size(0);
    a.batch = kt->size(1);
    a.queries = a.batch > 0 ? rows / a.batch : 0;
    a.heads = q->size(1);
    a.head_dim = q->size(2);
    a.len = kt->size(3);
    const int64_t kv_heads = kt->size(0);
    const bool fits = kv_heads > 0 && a.heads % kv_heads == 0 && a.batch > 0 &&
                      rows == a.batch * a.queries && kt->size(2) == a.head_dim &&
                      v->size(0) == kv_heads && v->size(1) == a.batch && v->size(2) == a.len &&
                      v->size(3) == a.head_dim && keep->size(0) == rows &&
                      keep->size(1) == a.len && keep->is_contiguous();
    if (!fits || a.len == 0) {
      throw std::invalid_argument(
          "attention wants q [batch * queries, heads, d], keys [kv_heads, batch, d, len], values "
          "[kv_heads, batch, len, d] and a contiguous mask [batch * queries, len], len > 0, "
          "heads a multiple of kv_heads; found " + c10::str(q->sizes()) + ", " +
          c10::str(kt->sizes()) + ", " + c10::str(v->sizes()) + ", " + c10::str(keep->sizes()));
    }
    if (!has_avx2()) throw std::invalid_argument("decode attention needs AVX2 and FMA");
    a.group = a.heads / kv_heads;
    a.scale = static_cast<float>(scale);
    // Scores are padded to whole blocks of the widest vector's keys; the padding is masked.
    a.row = (a.len + 31) / 32 * 32;
    // Key rows that hold finite values past the context (the lanes' headroom, zeros or keys)
    // are read in whole blocks; a last block beyond them is copied and zero-padded first.
    a.readable = std::max(a.len, std::min(readable, kt->stride(2)));
    if (a.readable > a.len) {
      const int64_t last = kt->storage_offset() + (kv_heads - 1) * kt->stride(0) +
                           (a.batch - 1) * kt->stride(1) + (a.head_dim - 1) * kt->stride(2);
      const int64_t held = static_cast<int64_t>(kt->storage().nbytes()) / sizeof(float);
      a.readable = std::max(a.len, std::min(a.readable, held - last));
    }
    at::Tensor add = at::full({rows, a.row}, -INFINITY, q->options());
    add.narrow(1, 0, a.len).masked_fill_(*keep, 0.0);
    at::Tensor y = at::empty({rows, a.heads * a.head_dim}, q->options());
    a.q = q->data_ptr<float>();
    a.q_row = q->stride(0);
    a.q_head = q->stride(1);
    a.kt = kt->data_ptr<float>();
    a.k_head = kt->stride(0);
    a.k_seq = kt->stride(1);
    a.k_dim = kt->stride(2);
    a.v = v->data_ptr<float>();
    a.v_head = v->stride(0);
    a.v_seq = v->stride(1);
    a.v_pos = v->stride(2);
    a.add = add.data_ptr<float>();
    a.out = y.data_ptr<float>();
#if defined(__x86_64__)
    const bool wide = has_avx512();
    // A pair (key/value head, query row) is ~4 * group * len * head_dim flops: split pairs
    // over the intra-op threads from ~64k flops of work on.
    const int64_t pairs = kv_heads * rows;
    const int64_t per_pair = std::max<int64_t>(1, 4 * a.group * a.len * a.head_dim);
    const auto run = [&](int64_t begin, int64_t end) {
      if (wide) avx512::attend_pairs(a, begin, end);
      else avx2::attend_pairs(a, begin, end);
    };
    if (pairs * per_pair < 65536) run(0, pairs);
    else at::parallel_for(0, pairs, std::max<int64_t>(1, 32768 / per_pair), run);
#endif
    return y;
  });
}
}
