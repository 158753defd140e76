// The loops of csrc/cpu/aggregate.cpp.  aggregate.cpp includes this file twice: inside namespace
// pfl::base (the portable build, SSE2 on x86-64) and inside pfl::avx2 (compiled with
// #pragma GCC target("avx2"), chosen at run time), with kVecBytes set to the vector width.
// Not a public header.  No FMA in either build, and every sum runs over j in increasing
// order starting from 0: the dense, the zero-skipping and the sparse loops give the same bits
// (but for the sign of a zero), and so do both builds.

// Rows of a dense micro-tile: kR x (two vectors) sums live in registers (12 of the 16 vector
// registers) while the loop over j streams the panel.
constexpr int kR = 6;

// Copies params[0:M, 0:tw] (row stride sp) into buf [M][ld] in acc_t, zero-padding columns
// tw..ld.  Returns whether every value was finite (x * 0 is NaN exactly for NaN and ±Inf).
template <typename acc_t, typename scalar_t>
bool pack_panel(const scalar_t* __restrict src, int64_t sp, int64_t M, int64_t tw, int64_t ld,
                acc_t* __restrict buf) {
  constexpr int L = 16;
  acc_t probe[L] = {};
  for (int64_t j = 0; j < M; ++j) {
    const scalar_t* __restrict s = src + j * sp;
    acc_t* __restrict d = buf + j * ld;
    int64_t c = 0;
    for (; c + L <= tw; c += L) {
      for (int l = 0; l < L; ++l) {
        const acc_t v = static_cast<acc_t>(s[c + l]);
        d[c + l] = v;
        probe[l] += v * acc_t(0);
      }
    }
    for (; c < tw; ++c) {
      const acc_t v = static_cast<acc_t>(s[c]);
      d[c] = v;
      probe[0] += v * acc_t(0);
    }
    for (; c < ld; ++c) d[c] = acc_t(0);
  }
  bool finite = true;
  for (int l = 0; l < L; ++l) finite = finite && probe[l] == acc_t(0);
  return finite;
}

// Whether out[0:K, 0:tw] (row stride so) is all finite.
template <typename scalar_t>
bool all_finite(const scalar_t* __restrict out, int64_t so, int64_t K, int64_t tw) {
  constexpr int L = 16;
  scalar_t probe[L] = {};
  for (int64_t k = 0; k < K; ++k) {
    const scalar_t* __restrict o = out + k * so;
    int64_t c = 0;
    for (; c + L <= tw; c += L) {
      for (int l = 0; l < L; ++l) probe[l] += o[c + l] * scalar_t(0);
    }
    for (; c < tw; ++c) probe[0] += o[c] * scalar_t(0);
  }
  bool finite = true;
  for (int l = 0; l < L; ++l) finite = finite && probe[l] == scalar_t(0);
  return finite;
}

// GCC/Clang vector types of the build's width: explicit vectors keep the sums of a micro-tile
// in registers (written as arrays of scalars, GCC kept them on the stack: 0.7 GFLOP/s).
template <typename acc_t>
struct Vec {
  typedef acc_t type __attribute__((vector_size(kVecBytes)));
  static constexpr int kLanes = static_cast<int>(kVecBytes / sizeof(acc_t));
};

template <typename acc_t>
inline typename Vec<acc_t>::type load_vec(const acc_t* p) {
  typename Vec<acc_t>::type v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

// Dense micro-tiles over a finite panel: out[k0+r, c..c+V) for r < kR, from wpack's block
// [M][kR] (rows past K are zero) and the panel buf [M][ld] (columns past tw are zero; ld is a
// multiple of V).
template <typename acc_t, typename scalar_t>
void dense_rows(const acc_t* __restrict wblock, int rows, const acc_t* __restrict buf, int64_t ld, int64_t M,
                int64_t tw, scalar_t* __restrict out, int64_t so) {
  using vec = typename Vec<acc_t>::type;
  constexpr int L = Vec<acc_t>::kLanes;
  constexpr int V = 2 * L;
  for (int64_t c = 0; c < tw; c += V) {
    vec s0[kR], s1[kR];
    for (int r = 0; r < kR; ++r) {
      s0[r] = vec{} ;
      s1[r] = vec{};
    }
    for (int64_t j = 0; j < M; ++j) {
      const vec t0 = load_vec(buf + j * ld + c), t1 = load_vec(buf + j * ld + c + L);
      const acc_t* __restrict a = wblock + j * kR;
      for (int r = 0; r < kR; ++r) {
        const vec ar = vec{} + a[r];  // a broadcast
        s0[r] += ar * t0;
        s1[r] += ar * t1;
      }
    }
    const int64_t n = std::min<int64_t>(V, tw - c);
    for (int r = 0; r < rows; ++r) {
      alignas(64) acc_t v[V];
      std::memcpy(v, &s0[r], sizeof(vec));
      std::memcpy(v + L, &s1[r], sizeof(vec));
      scalar_t* __restrict o = out + r * so + c;
      if (n == V) {
        for (int l = 0; l < V; ++l) o[l] = cast_to<scalar_t>(v[l]);
      } else {
        for (int64_t l = 0; l < n; ++l) o[l] = cast_to<scalar_t>(v[l]);
      }
    }
  }
}

// Vectors of a row chunk in row_terms: the sums stay in kRowVecs registers while the terms
// stream past, and each term reads kRowVecs contiguous vectors of its row (AVX2: 256 bytes,
// four cache lines), which hides the latency of the rows' scattered addresses better than
// 4 vectors did (sparse 5% at K = 1000, P = 10^5, 2 cores: 449 -> 357 ms at tile 64).
constexpr int kRowVecs = 8;

// kRowVecs vectors of S converted to acc_t (bfloat16/float16 widen; same type: plain loads).
template <typename acc_t, typename S>
inline void load_row_chunk(const S* __restrict t, typename Vec<acc_t>::type (&x)[kRowVecs]) {
  constexpr int L = Vec<acc_t>::kLanes;
  if constexpr (std::is_same_v<S, acc_t>) {
    for (int q = 0; q < kRowVecs; ++q) x[q] = load_vec(t + q * L);
  } else {
    alignas(64) acc_t v[kRowVecs * L];
    for (int l = 0; l < kRowVecs * L; ++l) v[l] = static_cast<acc_t>(t[l]);
    for (int q = 0; q < kRowVecs; ++q) x[q] = load_vec(v + q * L);
  }
}

// One output row chunk, out[c..c+n) = Σ_e val(e) · src[row(e)][c..c+n), over the entries e of
// `terms` (which skips zero weights).  src rows are S (acc_t for a packed panel, scalar_t when
// read in place).
template <typename acc_t, typename S, typename scalar_t, typename Terms>
inline void row_terms(const S* __restrict src, int64_t ss, const Terms& terms, int64_t tw,
                      scalar_t* __restrict out) {
  using vec = typename Vec<acc_t>::type;
  constexpr int L = Vec<acc_t>::kLanes;
  constexpr int V = kRowVecs * L;
  int64_t c = 0;
  for (; c + V <= tw; c += V) {
    vec s[kRowVecs];
    for (int q = 0; q < kRowVecs; ++q) s[q] = vec{};
    terms([&](int64_t j, acc_t w) {
      vec x[kRowVecs];
      load_row_chunk<acc_t>(src + j * ss + c, x);
      const vec wv = vec{} + w;
      for (int q = 0; q < kRowVecs; ++q) s[q] += wv * x[q];
    });
    alignas(64) acc_t v[V];
    std::memcpy(v, s, sizeof(s));
    for (int l = 0; l < V; ++l) out[c + l] = cast_to<scalar_t>(v[l]);
  }
  if (c < tw) {
    acc_t s[V];
    const int64_t n = tw - c;
    for (int l = 0; l < V; ++l) s[l] = acc_t(0);
    terms([&](int64_t j, acc_t w) {
      const S* __restrict t = src + j * ss + c;
      for (int64_t l = 0; l < n; ++l) s[l] += w * static_cast<acc_t>(t[l]);
    });
    for (int64_t l = 0; l < n; ++l) out[c + l] = cast_to<scalar_t>(s[l]);
  }
}

// Rows k in [k0, k1) of a tile from CSR weights: out[k] = Σ_{e in row k} val[e] · src[col[e]].
template <typename acc_t, typename S, typename scalar_t>
void sparse_rows(const int64_t* ptr, const int32_t* col, const acc_t* val, int64_t k0, int64_t k1,
                 const S* src, int64_t ss, int64_t tw, scalar_t* out, int64_t so) {
  for (int64_t k = k0; k < k1; ++k) {
    const int64_t e0 = ptr[k], e1 = ptr[k + 1];
    auto terms = [&](const auto& f) {
      for (int64_t e = e0; e < e1; ++e) f(col[e], val[e]);
    };
    row_terms<acc_t>(src, ss, terms, tw, out + k * so);
  }
}

// Rows k in [k0, k1) of a tile from dense weights w [K][M], skipping zeros (the exact loop for
// a panel that holds NaN or Inf).
template <typename acc_t, typename scalar_t>
void skip_zero_rows(const acc_t* w, int64_t M, int64_t k0, int64_t k1, const acc_t* buf, int64_t ld, int64_t tw,
                    scalar_t* out, int64_t so) {
  for (int64_t k = k0; k < k1; ++k) {
    const acc_t* wk = w + k * M;
    auto terms = [&](const auto& f) {
      for (int64_t j = 0; j < M; ++j) {
        if (wk[j] != acc_t(0)) f(j, wk[j]);
      }
    };
    row_terms<acc_t>(buf, ld, terms, tw, out + k * so);
  }
}
