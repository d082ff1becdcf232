// The decode-attention kernel of attention.cpp for one instruction set: included once per set,
// inside `#pragma GCC target` and a namespace of its own that define `kWidth` (floats per
// vector), the vector type `Vec` and `vzero`, `vload`, `vstore`, `vsplat`, `vfma`, `vmul` and
// `vmax` on it.

// Keys per block of scores: two vectors, so that each query row keeps two independent sums.
constexpr int kKeys = 2 * kWidth;

// Query rows [0, G) of one (key/value head, sequence) pair: q row j at q + j * a.q_head, its
// output at out + j * D. `e` holds G rows of `a.row` floats, `tail` D * kKeys.
template <int G>
inline __attribute__((always_inline)) void attend(const Args& a, const float* q,
                                                  const float* kt, const float* v,
                                                  const float* add, float* out, float* e,
                                                  float* tail) {
  const int64_t len = a.len, d_len = a.head_dim, row = a.row;
  const Vec scale = vsplat(a.scale);
  // Scores, one block of keys at a time: for each of the head's widths, one key row
  // (transposed keys: the block's keys are adjacent) times each query's element.
  for (int64_t t0 = 0; t0 < row; t0 += kKeys) {
    const float* k = kt + t0;
    int64_t k_dim = a.k_dim;
    if (t0 + kKeys > a.readable) {
      // The last block would read past what the key rows hold: a zero-padded copy (the
      // scores past the context are masked either way).
      for (int64_t d = 0; d < d_len; ++d) {
        for (int64_t i = 0; i < kKeys; ++i) {
          tail[d * kKeys + i] = t0 + i < len ? kt[d * a.k_dim + t0 + i] : 0.0f;
        }
      }
      k = tail;
      k_dim = kKeys;
    }
    Vec acc[G][2];
    for (int j = 0; j < G; ++j) acc[j][0] = acc[j][1] = vzero();
    for (int64_t d = 0; d < d_len; ++d) {
      const Vec k0 = vload(k + d * k_dim), k1 = vload(k + d * k_dim + kWidth);
      for (int j = 0; j < G; ++j) {
        const Vec qj = vsplat(q[j * a.q_head + d]);
        acc[j][0] = vfma(qj, k0, acc[j][0]);
        acc[j][1] = vfma(qj, k1, acc[j][1]);
      }
    }
    const Vec add0 = vload(add + t0), add1 = vload(add + t0 + kWidth);
    for (int j = 0; j < G; ++j) {
      vstore(e + j * row + t0, vfma(acc[j][0], scale, add0));
      vstore(e + j * row + t0 + kWidth, vfma(acc[j][1], scale, add1));
    }
  }
  // Softmax numerators in place (masked scores are -inf and get weight 0), and 1 / their sum.
  float inverse[G];
  for (int j = 0; j < G; ++j) {
    float* ej = e + j * row;
    Vec top = vsplat(-INFINITY);
    for (int64_t t = 0; t < row; t += kWidth) top = vmax(top, vload(ej + t));
    alignas(64) float tops[kWidth];
    vstore(tops, top);
    float max = tops[0];
    for (int l = 1; l < kWidth; ++l) max = std::max(max, tops[l]);
    float lanes[kWidth];
    for (int l = 0; l < kWidth; ++l) lanes[l] = 0.0f;
    for (int64_t t = 0; t < row; t += kWidth) {
      for (int l = 0; l < kWidth; ++l) {
        const float s = ej[t + l];
        const float w = s == -INFINITY ? 0.0f : exp_nonpositive(s - max);
        ej[t + l] = w;
        lanes[l] += w;
      }
    }
    float sum = 0.0f;
    for (int l = 0; l < kWidth; ++l) sum += lanes[l];
    // A row that attends nothing sums to 0: zeros out, not NaN (the runner's batches never
    // hold one: a padding query attends key 0).
    inverse[j] = sum > 0.0f ? 1.0f / sum : 0.0f;
  }
  // The weighted sum of the values, kKeys of the head's widths at a time.
  int64_t d0 = 0;
  for (; d0 + kKeys <= d_len; d0 += kKeys) {
    Vec acc[G][2];
    for (int j = 0; j < G; ++j) acc[j][0] = acc[j][1] = vzero();
    for (int64_t t = 0; t < len; ++t) {
      const float* vt = v + t * a.v_pos + d0;
      const Vec x0 = vload(vt), x1 = vload(vt + kWidth);
      for (int j = 0; j < G; ++j) {
        const Vec w = vsplat(e[j * row + t]);
        acc[j][0] = vfma(w, x0, acc[j][0]);
        acc[j][1] = vfma(w, x1, acc[j][1]);
      }
    }
    for (int j = 0; j < G; ++j) {
      vstore(out + j * d_len + d0, vmul(acc[j][0], vsplat(inverse[j])));
      vstore(out + j * d_len + d0 + kWidth, vmul(acc[j][1], vsplat(inverse[j])));
    }
  }
  // A width of one vector (a head of 16 floats on AVX-512), then single floats.
  for (; d0 + kWidth <= d_len; d0 += kWidth) {
    Vec acc[G];
    for (int j = 0; j < G; ++j) acc[j] = vzero();
    for (int64_t t = 0; t < len; ++t) {
      const Vec x = vload(v + t * a.v_pos + d0);
      for (int j = 0; j < G; ++j) acc[j] = vfma(vsplat(e[j * row + t]), x, acc[j]);
    }
    for (int j = 0; j < G; ++j) vstore(out + j * d_len + d0, vmul(acc[j], vsplat(inverse[j])));
  }
  for (; d0 < d_len; ++d0) {
    for (int j = 0; j < G; ++j) {
      float s = 0.0f;
      for (int64_t t = 0; t < len; ++t) s += e[j * row + t] * v[t * a.v_pos + d0];
      out[j * d_len + d0] = s * inverse[j];
    }
  }
}

// Pairs [begin, end) of the a.kv_heads * (a.batch * a.queries) (head-major), each group's
// query heads four, two or one at a time.
void attend_pairs(const Args& a, int64_t begin, int64_t end) {
  std::vector<float> scratch(4 * a.row + a.head_dim * kKeys);
  float* e = scratch.data();
  float* tail = e + 4 * a.row;
  for (int64_t p = begin; p < end; ++p) {
    const int64_t rows = a.batch * a.queries;
    const int64_t h = p / rows, r = p % rows, b = r / a.queries;
    const float* kt = a.kt + h * a.k_head + b * a.k_seq;
    const float* v = a.v + h * a.v_head + b * a.v_seq;
    const float* add = a.add + r * a.row;
    for (int64_t j = 0; j < a.group;) {
      const int64_t head = h * a.group + j;
      const float* q = a.q + r * a.q_row + head * a.q_head;
      float* out = a.out + (r * a.heads + head) * a.head_dim;
      const int64_t left = a.group - j;
      if (left >= 4) {
        attend<4>(a, q, kt, v, add, out, e, tail);
        j += 4;
      } else if (left >= 2) {
        attend<2>(a, q, kt, v, add, out, e, tail);
        j += 2;
      } else {
        attend<1>(a, q, kt, v, add, out, e, tail);
        j += 1;
      }
    }
  }
}
