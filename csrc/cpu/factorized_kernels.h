// The kernels of csrc/cpu/factorized.cpp.  Deliberately without an include guard: that file
// includes this one twice, inside namespace pfl::base and inside pfl::avx2 (compiled with
// #pragma GCC target("avx2")), and picks one at run time.  Not a public header.
// dst[j * ld + i] = src[i * ls + j] for i, j < 4.
template <typename T>
inline void transpose4(const T* __restrict src, int64_t ls, T* __restrict dst, int64_t ld) {
  T block[4][4];
  for (int i = 0; i < 4; ++i)
    for (int j = 0; j < 4; ++j) block[j][i] = src[i * ls + j];
  for (int j = 0; j < 4; ++j)
    for (int i = 0; i < 4; ++i) dst[j * ld + i] = block[j][i];
}

#if defined(__SSE2__)
// Four row loads, eight shuffles, four row stores (compilers do the loads one element at a time).
inline void transpose4(const float* __restrict src, int64_t ls, float* __restrict dst, int64_t ld) {
  __m128 r0 = _mm_loadu_ps(src), r1 = _mm_loadu_ps(src + ls);
  __m128 r2 = _mm_loadu_ps(src + 2 * ls), r3 = _mm_loadu_ps(src + 3 * ls);
  _MM_TRANSPOSE4_PS(r0, r1, r2, r3);
  _mm_storeu_ps(dst, r0);
  _mm_storeu_ps(dst + ld, r1);
  _mm_storeu_ps(dst + 2 * ld, r2);
  _mm_storeu_ps(dst + 3 * ld, r3);
}
#endif

#if defined(__SSE2__)
// The same for 2-byte elements: four 8-byte loads, four unpacks, four 8-byte stores.
inline void transpose4(const c10::BFloat16* __restrict src, int64_t ls, c10::BFloat16* __restrict dst,
                       int64_t ld) {
  auto load = [&](int64_t i) { return _mm_loadl_epi64(reinterpret_cast<const __m128i*>(src + i * ls)); };
  auto store = [&](int64_t j, __m128i x) { _mm_storel_epi64(reinterpret_cast<__m128i*>(dst + j * ld), x); };
  const __m128i r01 = _mm_unpacklo_epi16(load(0), load(1)), r23 = _mm_unpacklo_epi16(load(2), load(3));
  const __m128i c01 = _mm_unpacklo_epi32(r01, r23), c23 = _mm_unpackhi_epi32(r01, r23);
  store(0, c01);
  store(1, _mm_unpackhi_epi64(c01, c01));
  store(2, c23);
  store(3, _mm_unpackhi_epi64(c23, c23));
}
#endif

// dst[j * ld + i] = src[i * ls + j] for i < ni, j < nj, in 4 x 4 blocks so that both sides move
// whole vectors: an element-by-element transpose is bound by one store per element.  Edges
// take a last block that overlaps the one before (it rewrites equal values), so that a tile
// of R = 9 rows, say, needs no scalar loop.
template <typename T>
void transpose(const T* src, int64_t ls, T* dst, int64_t ld, int64_t ni, int64_t nj) {
  if (ni < 4 || nj < 4) {
    for (int64_t i = 0; i < ni; ++i)
      for (int64_t j = 0; j < nj; ++j) dst[j * ld + i] = src[i * ls + j];
    return;
  }
  for (int64_t i0 = 0; i0 < ni; i0 += 4) {
    const int64_t i = std::min(i0, ni - 4);
    for (int64_t j0 = 0; j0 < nj; j0 += 4) {
      const int64_t j = std::min(j0, nj - 4);
      transpose4(src + i * ls + j, ls, dst + j * ld + i, ld);
    }
  }
}

// dst[r * ld + i] = src[r * ls + i * s] for r < rows, i < n (n = kN when kN > 0).
template <int kN, typename T>
void copy_rows_n(const T* src, int64_t ls, int64_t s, T* dst, int64_t ld, int64_t rows, int64_t n) {
  if (kN > 0) n = kN;
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t i = 0; i < n; ++i) dst[r * ld + i] = src[r * ls + i * s];
}

template <typename T>
void copy_rows(const T* src, int64_t ls, int64_t s, T* dst, int64_t ld, int64_t rows, int64_t n) {
  switch (n) {  // short runs (simfed's B = kw): a constant length lets the compiler unroll them
    case 2: return copy_rows_n<2>(src, ls, s, dst, ld, rows, n);
    case 3: return copy_rows_n<3>(src, ls, s, dst, ld, rows, n);
    case 4: return copy_rows_n<4>(src, ls, s, dst, ld, rows, n);
    case 5: return copy_rows_n<5>(src, ls, s, dst, ld, rows, n);
    case 7: return copy_rows_n<7>(src, ls, s, dst, ld, rows, n);
    default: return copy_rows_n<0>(src, ls, s, dst, ld, rows, n);
  }
}

// Calls f(a, b, c, n) for each run of columns [c, c + n) of [c0, c1) inside one block a of W
// (c = a*B + b), i.e. each run that is contiguous in W's innermost dimension.
template <typename F>
void for_each_run(int64_t c0, int64_t c1, int64_t B, const F& f) {
  for (int64_t c = c0; c < c1;) {
    const int64_t a = c / B, b = c - a * B, n = std::min(c1 - c, B - b);
    f(a, b, c, n);
    c += n;
  }
}

// W[a, r, b] = tile[r - r0, c - c0] (c = a*B + b) for one client's contiguous W [A, R, B].
template <typename T>
void store_tile(const T* tile, int64_t ld, T* w, const Geometry& g, int64_t r0, int64_t r1,
                int64_t c0, int64_t c1) {
  if (g.B == 1) {  // W = Mᵀ
    transpose(tile, ld, w + c0 * g.R + r0, g.R, r1 - r0, c1 - c0);
    return;
  }
  for_each_run(c0, c1, g.B, [&](int64_t a, int64_t b, int64_t c, int64_t n) {
    copy_rows(tile + (c - c0), ld, 1, w + (a * g.R + r0) * g.B + b, g.B, r1 - r0, n);
  });
}

// tile[r - r0, c - c0] = grad_W[a, r, b] for one client's grad_W with strides (sa, sr, sb).
template <typename T>
void load_tile(const T* gw, int64_t sa, int64_t sr, int64_t sb, const Geometry& g, int64_t r0, int64_t r1,
               int64_t c0, int64_t c1, T* tile, int64_t ld) {
  if (g.B == 1 && sr == 1) {  // G = grad_Wᵀ
    transpose(gw + c0 * sa + r0, sa, tile, ld, c1 - c0, r1 - r0);
    return;
  }
  for_each_run(c0, c1, g.B, [&](int64_t a, int64_t b, int64_t c, int64_t n) {
    copy_rows(gw + a * sa + r0 * sr + b * sb, sr, g.B == 1 ? sa : sb, tile + (c - c0), ld, r1 - r0, n);
  });
}

// ---------------------------------------------------------------- forward

template <typename scalar_t>
void forward_kernel(const at::Tensor& w, const at::Tensor& u_t, const at::Tensor& v_t,
                    const std::optional<at::Tensor>& mu_t, const std::optional<at::Tensor>& mask_t,
                    const Geometry& g, int64_t K) {
  using acc_t = at::opmath_type<scalar_t>;
  const auto u = strided<const scalar_t>(u_t), v = strided<const scalar_t>(v_t);
  const auto mu = strided<const scalar_t>(mu_t), mask = strided<const scalar_t>(mask_t);
  const bool has_mu = mu_t.has_value(), has_mask = mask_t.has_value();
  const int64_t rank = u_t.size(-1), R = g.R, C = g.C;
  scalar_t* out = w.data_ptr<scalar_t>();
  const Tiling t = make_tiling<acc_t>(g);
  const int64_t n_tasks = K * t.n_col_tiles * t.n_row_tiles;

  with_unit_stride(unit_columns({v.sy, has_mu ? mu.sy : 1, has_mask ? mask.sy : 1}, C), [&](auto unit) {
    constexpr bool kUnit = decltype(unit)::value;
    const int64_t vs = kUnit ? 1 : v.sy, mus = kUnit ? 1 : mu.sy, masks = kUnit ? 1 : mask.sy;
    at::parallel_for(0, n_tasks, task_grain(t), [&](int64_t begin, int64_t end) {
      constexpr bool kWide = !std::is_same_v<acc_t, scalar_t>;  // bfloat16: rows built in float
      std::unique_ptr<scalar_t[]> tile(new scalar_t[t.rows * t.cols]);
      std::unique_ptr<acc_t[]> wide(new acc_t[kWide ? t.cols : 0]);
      for (int64_t task = begin; task < end; ++task) {
        // Row tiles vary fastest: a thread's consecutive tasks fill one contiguous block of W.
        const int64_t k = task / (t.n_col_tiles * t.n_row_tiles);
        const int64_t c0 = (task / t.n_row_tiles % t.n_col_tiles) * t.cols, c1 = std::min(c0 + t.cols, C);
        const int64_t r0 = (task % t.n_row_tiles) * t.rows, r1 = std::min(r0 + t.rows, R);
        const int64_t nc = c1 - c0, a = c0 / g.B;
        scalar_t* wk = out + k * R * C;
        // Rows of M go straight to W where W holds them as rows (view layout), else to the
        // tile, which is then stored transposed (B == 1) or regrouped.
        const bool in_place = g.B > 1 && (c1 - 1) / g.B == a;
        for (int64_t r = r0; r < r1; ++r) {
          scalar_t* row = in_place ? wk + (a * R + r) * g.B + (c0 - a * g.B) : tile.get() + (r - r0) * t.cols;
          acc_t* __restrict m;
          if constexpr (kWide) {
            m = wide.get();
          } else {
            m = row;
          }
          // m = u[r, 0] v[0] + mu * mask, then + u[r, j] v[j] for j >= 1: one unit-stride pass
          // per rank term keeps the c loop innermost (and vectorized) for any rank.
          const scalar_t* mur = has_mu ? mu.row(k, r, c0) : nullptr;
          const scalar_t* maskr = has_mask ? mask.row(k, r, c0) : nullptr;
          auto first_pass = [&](auto uv) {
            if (!has_mu) {
              for (int64_t i = 0; i < nc; ++i) m[i] = uv(i);
            } else if (!has_mask) {
              for (int64_t i = 0; i < nc; ++i) m[i] = uv(i) + static_cast<acc_t>(mur[i * mus]);
            } else {
              for (int64_t i = 0; i < nc; ++i)
                m[i] = uv(i) + static_cast<acc_t>(mur[i * mus]) * static_cast<acc_t>(maskr[i * masks]);
            }
          };
          if (rank == 0) {
            first_pass([](int64_t) { return acc_t(0); });
          } else {
            const acc_t u0 = static_cast<acc_t>(*u.row(k, r, 0));
            const scalar_t* v0 = v.row(k, 0, c0);
            first_pass([&](int64_t i) { return u0 * static_cast<acc_t>(v0[i * vs]); });
          }
          for (int64_t j = 1; j < rank; ++j) {
            const acc_t uj = static_cast<acc_t>(*u.row(k, r, j));
            const scalar_t* vj = v.row(k, j, c0);
            for (int64_t i = 0; i < nc; ++i) m[i] += uj * static_cast<acc_t>(vj[i * vs]);
          }
          if constexpr (kWide) {
            for (int64_t i = 0; i < nc; ++i) row[i] = cast_to<scalar_t>(m[i]);
          }
        }
        if (!in_place) store_tile(tile.get(), t.cols, wk, g, r0, r1, c0, c1);
      }
    });
  });
}

// ---------------------------------------------------------------- backward

// The sum of rank_term's lanes, in its order.
template <typename acc_t>
inline acc_t sum_lanes(const acc_t* lane) {
  return ((lane[0] + lane[4]) + (lane[1] + lane[5])) + ((lane[2] + lane[6]) + (lane[3] + lane[7]));
}

// One rank term of a row g of G: returns g · v (if kDot) and adds uj * g to acc (if kAxpy), in
// one pass.  Eight independent lanes let the dot product vectorize without -ffast-math.
template <bool kDot, bool kAxpy, bool kUnit, typename acc_t, typename scalar_t>
acc_t rank_term(const acc_t* __restrict g, const scalar_t* __restrict v, int64_t vs, acc_t uj,
                acc_t* __restrict acc, int64_t n) {
  if (kUnit) vs = 1;
  acc_t lane[8] = {};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    for (int l = 0; l < 8; ++l) {
      if (kDot) lane[l] += g[i + l] * static_cast<acc_t>(v[(i + l) * vs]);
      if (kAxpy) acc[i + l] += uj * g[i + l];
    }
  }
  for (; i < n; ++i) {
    if (kDot) lane[0] += g[i] * static_cast<acc_t>(v[i * vs]);
    if (kAxpy) acc[i] += uj * g[i];
  }
  return sum_lanes(lane);
}

#if defined(PFL_FACTORIZED_IN_AVX2)
// ---------------------------------------------------------------- backward, B == 1, AVX2
//
// Where W is Mᵀ (B == 1: spatial, linear) column c of G is grad_W's row c, R floats long.  The
// generic path gathers G's tile with 4 x 4 transposes (R = 9, every 3x3 conv, costs 12 rows'
// worth) and then adds each row into grad_v's accumulator in memory.  For tiles of up to 32
// rows the AVX2 build takes two steps per task instead:
//  (1) 8 columns at a time, straight from grad_W into registers: an 8 x 8 transpose per 8 rows
//      (with loads of 128-bit halves, so no shuffle crosses them), and a leftover row (R = 9
//      and 25 leave one) as 8 unaligned loads whose lane j is already in place, merged by 7
//      blends (4 or more leftover rows take an overlapping 8 x 8 block).  The rows go to the
//      tile and, while in registers, into grad_v; R = 9 and 25 are compile-time constants.
//  (2) Row by row over the tile: grad_mu (= G * mask) and grad_mask, and grad_u's lanes.  This
//      keeps mask and grad_mu single long streams: writing all R rows of grad_mu 8 columns at
//      a time keeps 2R streams C floats apart in flight, which for a power-of-two C (most
//      layers) all fall into one cache set and evict each other (2.5x slower at 256x256x3x3).
//      The tile's rows are padded for the same reason.
// The arithmetic is the generic path's, operation for operation and in the same order
// (grad_u's 8 lanes are the column offsets mod 8 within the tile, a tail of < 8 columns goes to
// lane 0, sum_lanes adds them; grad_v adds the rows in ascending order; no FMA), so results are
// bitwise equal to the baseline build's, which runs the generic path with the same tiling.

// Padding of the tile's rows: 16 floats (a cache line) keep R rows of a power-of-two length
// out of one cache set.
constexpr int64_t kB1Pad = 16;

// The 128-bit halves [p_j[i..i+3] | p_{j+4}[i..i+3]] of the rows of an 8 x 8 block.
inline __m256 load_halves(const float* p, int64_t s, int64_t j, int64_t i) {
  return _mm256_insertf128_ps(_mm256_castps128_ps256(_mm_loadu_ps(p + j * s + i)),
                              _mm_loadu_ps(p + (j + 4) * s + i), 1);
}

// out[i] lane j = p[j * s + i] for i, j < 8: a 4 x 4 transpose within each 128-bit half, on
// rows loaded as load_halves (no lane-crossing shuffle).
inline void transpose8(const float* p, int64_t s, __m256 out[8]) {
  for (int64_t i = 0; i < 8; i += 4) {
    const __m256 a0 = load_halves(p, s, 0, i), a1 = load_halves(p, s, 1, i);
    const __m256 a2 = load_halves(p, s, 2, i), a3 = load_halves(p, s, 3, i);
    const __m256 t0 = _mm256_unpacklo_ps(a0, a1), t1 = _mm256_unpackhi_ps(a0, a1);
    const __m256 t2 = _mm256_unpacklo_ps(a2, a3), t3 = _mm256_unpackhi_ps(a2, a3);
    out[i] = _mm256_shuffle_ps(t0, t2, 0x44);
    out[i + 1] = _mm256_shuffle_ps(t0, t2, 0xEE);
    out[i + 2] = _mm256_shuffle_ps(t1, t3, 0x44);
    out[i + 3] = _mm256_shuffle_ps(t1, t3, 0xEE);
  }
}

// Lane j = p[j * s] for j < 8: lane j of the 8 floats at p + j * (s - 1).  For row r of 8
// columns of R floats each, s >= R apart, every load lies inside the columns' span
// [p - r, p - r + 7 s + R): the first ends at p + 8 <= p - r + 7 s + R, the last at p + 7 s + 1.
inline __m256 diagonal8(const float* p, int64_t s) {
  const int64_t d = s - 1;
  __m256 x = _mm256_loadu_ps(p);
  x = _mm256_blend_ps(x, _mm256_loadu_ps(p + d), 0x02);
  x = _mm256_blend_ps(x, _mm256_loadu_ps(p + 2 * d), 0x04);
  x = _mm256_blend_ps(x, _mm256_loadu_ps(p + 3 * d), 0x08);
  x = _mm256_blend_ps(x, _mm256_loadu_ps(p + 4 * d), 0x10);
  x = _mm256_blend_ps(x, _mm256_loadu_ps(p + 5 * d), 0x20);
  x = _mm256_blend_ps(x, _mm256_loadu_ps(p + 6 * d), 0x40);
  x = _mm256_blend_ps(x, _mm256_loadu_ps(p + 7 * d), 0x80);
  return x;
}

// One client's operands of a B == 1 task (float, unit column strides).
struct B1Operands {
  int64_t C;
  const float* u;  // u[r, j] = u[r * u_sr + j * u_sj]
  int64_t u_sr, u_sj;
  const float* v;  // v[j, c] = v[j * v_sj + c]
  int64_t v_sj;
  const float* mask;  // mask[r, c] = mask[r * mask_sr + c]; null: none (or grad_mu not wanted)
  int64_t mask_sr;
  const float* mu;  // read for grad_mask only (null: not wanted)
  int64_t mu_sr;
  float* gmu;  // grad_mu [R, C] (null: not wanted)
  float* gmask;  // grad_mask [R, C] (null: not wanted)
  float* gv;  // grad_v [rank, C] (null: not wanted)
  bool need_gu;
};

// Step (1) for 8 columns at p (column j at p + j * sa, from a row r0 on): rows r0 + i,
// kSkip <= i < kRows, to the tile at tc + i * pitch and, if gv, into gv[0..kRank) (ur: the
// rows' u, broadcast).  kRows >= 8 rows take 8 x 8 transposes, overlapping for the last 8.
template <int kRank, int kRows, int kSkip = 0>
inline void b1_rows_of_8(const float* p, int64_t sa, float* tc, int64_t pitch, const __m256* ur, __m256* gv) {
  constexpr int64_t kR8 = kRows / 8 * 8, kRem = kRows - kR8;
  static_assert(kSkip == 0 || kRows == 8, "rows are skipped only in a block of 8");
  auto put = [&](int64_t r, __m256 g) {
    _mm256_storeu_ps(tc + r * pitch, g);
    for (int j = 0; gv != nullptr && j < kRank; ++j) gv[j] = _mm256_add_ps(gv[j], _mm256_mul_ps(ur[r * kRank + j], g));
  };
  __m256 t[8];
  for (int64_t r = 0; r < kR8; r += 8) {
    transpose8(p + r, sa, t);
    for (int i = r == 0 ? kSkip : 0; i < 8; ++i) put(r + i, t[i]);
  }
  if constexpr (kRem >= 4 && kRows >= 8) {  // the last 8 rows, of which the first 8 - kRem are done
    transpose8(p + kRows - 8, sa, t);
    for (int64_t i = 8 - kRem; i < 8; ++i) put(kRows - 8 + i, t[i]);
  } else {
    for (int64_t r = kR8; r < kRows; ++r) put(r, diagonal8(p + r, sa));
  }
}

// The task of columns [c0, c1) of G (all R <= 32 rows: a single row tile), with
// G[r, c] = gw[c * sa + r] (sa >= R), for rank kRank; kRows = R when a compile-time constant,
// else 0.  Writes grad_mu, grad_mask, grad_v's columns and grad_u's lanes:
// lanes[(r * kRank + j) * 8 + l], as rank_term's.  tile: R rows of `pitch` >= c1 - c0 floats.
template <int kRank, int kRows>
void backward_tile_b1(const float* gw, int64_t sa, int64_t R, int64_t c0, int64_t c1, const B1Operands& o,
                      float* __restrict lanes, float* __restrict tile, int64_t pitch) {
  const int64_t C = o.C, c8 = c0 + (c1 - c0) / 8 * 8;
  const bool need_gv = o.gv != nullptr;
  // u[r, j], broadcast.
  __m256 ur[(kRows > 0 ? kRows : 32) * kRank];
  for (int64_t r = 0; r < R; ++r)
    for (int j = 0; j < kRank; ++j) ur[r * kRank + j] = _mm256_set1_ps(o.u[r * o.u_sr + j * o.u_sj]);

  // Step (1).
  for (int64_t c = c0; c < c8; c += 8) {
    const float* p = gw + c * sa;
    float* tc = tile + (c - c0);
    __m256 gv[kRank];
    for (int j = 0; j < kRank; ++j) gv[j] = _mm256_setzero_ps();
    if constexpr (kRows > 0) {
      b1_rows_of_8<kRank, kRows>(p, sa, tc, pitch, ur, need_gv ? gv : nullptr);
    } else {
      // R at run time: blocks of 8 rows, then the n = R % 8 leftover rows: from the block of
      // the last 8 rows where there are 4 or more (and R >= 8), else one by one.
      __m256* gvp = need_gv ? gv : nullptr;
      const int64_t r8 = R / 8 * 8;
      for (int64_t r = 0; r < r8; r += 8) b1_rows_of_8<kRank, 8>(p + r, sa, tc + r * pitch, pitch, ur + r * kRank, gvp);
      auto leftover = [&](auto n) {
        if (n >= 4 && R >= 8) {
          const int64_t r = R - 8;
          b1_rows_of_8<kRank, 8, 8 - n>(p + r, sa, tc + r * pitch, pitch, ur + r * kRank, gvp);
        } else {
          b1_rows_of_8<kRank, n>(p + r8, sa, tc + r8 * pitch, pitch, ur + r8 * kRank, gvp);
        }
      };
      switch (R - r8) {
        case 1: leftover(std::integral_constant<int, 1>{}); break;
        case 2: leftover(std::integral_constant<int, 2>{}); break;
        case 3: leftover(std::integral_constant<int, 3>{}); break;
        case 4: leftover(std::integral_constant<int, 4>{}); break;
        case 5: leftover(std::integral_constant<int, 5>{}); break;
        case 6: leftover(std::integral_constant<int, 6>{}); break;
        case 7: leftover(std::integral_constant<int, 7>{}); break;
        default: break;
      }
    }
    for (int j = 0; need_gv && j < kRank; ++j) _mm256_storeu_ps(o.gv + j * C + c, gv[j]);
  }

  // Step (2), with the operands' presence hoisted out of the loop.
  auto rows = [&](auto has_gmu, auto has_mask, auto need_gu) {
    const float* v = o.v;
    const int64_t v_sj = o.v_sj;
    for (int64_t r = 0; r < R; ++r) {
      const float* tr = tile + r * pitch - c0;
      const float* mask = has_mask ? o.mask + r * o.mask_sr : nullptr;
      const float* mu = o.mu != nullptr ? o.mu + r * o.mu_sr : nullptr;
      float* gmu = has_gmu ? o.gmu + r * C : nullptr;
      float* gmask = o.gmask != nullptr ? o.gmask + r * C : nullptr;
      __m256 acc[kRank];
      for (int j = 0; j < kRank; ++j) acc[j] = _mm256_setzero_ps();
      for (int64_t c = c0; c < c8; c += 8) {
        const __m256 g = _mm256_loadu_ps(tr + c);
        if constexpr (has_gmu) _mm256_storeu_ps(gmu + c, has_mask ? _mm256_mul_ps(g, _mm256_loadu_ps(mask + c)) : g);
        if (gmask != nullptr) _mm256_storeu_ps(gmask + c, _mm256_mul_ps(g, _mm256_loadu_ps(mu + c)));
        if constexpr (need_gu) {
          for (int j = 0; j < kRank; ++j)
            acc[j] = _mm256_add_ps(acc[j], _mm256_mul_ps(g, _mm256_loadu_ps(v + j * v_sj + c)));
        }
      }
      for (int j = 0; j < kRank; ++j) _mm256_storeu_ps(lanes + (r * kRank + j) * 8, acc[j]);
    }
  };
  using T = std::true_type;
  using F = std::false_type;
  if (o.gmu == nullptr) {
    o.need_gu ? rows(F{}, F{}, T{}) : rows(F{}, F{}, F{});
  } else if (o.mask == nullptr) {
    o.need_gu ? rows(T{}, F{}, T{}) : rows(T{}, F{}, F{});
  } else {
    o.need_gu ? rows(T{}, T{}, T{}) : rows(T{}, T{}, F{});
  }

  for (int64_t c = c8; c < c1; ++c) {  // the last < 8 columns, as rank_term's tail
    const float* p = gw + c * sa;
    float gv[kRank] = {};
    for (int64_t r = 0; r < R; ++r) {
      const float g = p[r];
      if (o.gmu != nullptr) o.gmu[r * C + c] = o.mask != nullptr ? g * o.mask[r * o.mask_sr + c] : g;
      if (o.gmask != nullptr) o.gmask[r * C + c] = g * o.mu[r * o.mu_sr + c];
      for (int j = 0; j < kRank; ++j) {
        if (o.need_gu) lanes[(r * kRank + j) * 8] += g * o.v[j * o.v_sj + c];
        gv[j] += o.u[r * o.u_sr + j * o.u_sj] * g;
      }
    }
    for (int j = 0; need_gv && j < kRank; ++j) o.gv[j * C + c] = gv[j];
  }
}

// backward_tile_b1 for a run-time rank of 1 to 4 (the layers' ranks; others take the generic
// path); the 3x3 and 5x5 kernels (R = 9, 25) get their row count at compile time.
inline void backward_tile_b1(int64_t rank, const float* gw, int64_t sa, int64_t R, int64_t c0, int64_t c1,
                             const B1Operands& o, float* lanes, float* tile, int64_t pitch) {
  auto run = [&](auto rows) {
    switch (rank) {
      case 1: return backward_tile_b1<1, rows>(gw, sa, R, c0, c1, o, lanes, tile, pitch);
      case 2: return backward_tile_b1<2, rows>(gw, sa, R, c0, c1, o, lanes, tile, pitch);
      case 3: return backward_tile_b1<3, rows>(gw, sa, R, c0, c1, o, lanes, tile, pitch);
      default: return backward_tile_b1<4, rows>(gw, sa, R, c0, c1, o, lanes, tile, pitch);
    }
  };
  switch (R) {
    case 9: return run(std::integral_constant<int, 9>{});
    case 25: return run(std::integral_constant<int, 25>{});
    default: return run(std::integral_constant<int, 0>{});
  }
}
#endif  // PFL_FACTORIZED_IN_AVX2

template <typename scalar_t>
void backward_kernel(const at::Tensor& gw_t, const at::Tensor& u_t, const at::Tensor& v_t,
                     const std::optional<at::Tensor>& mu_t, const std::optional<at::Tensor>& mask_t,
                     const Geometry& g, int64_t K, const at::Tensor& gu_t, const at::Tensor& gv_t,
                     const at::Tensor& gmu_t, const at::Tensor& gmask_t) {
  using acc_t = at::opmath_type<scalar_t>;
  const bool need_gu = gu_t.defined(), need_gv = gv_t.defined();
  const bool need_gmu = gmu_t.defined(), need_gmask = gmask_t.defined();
  const bool has_mask = mask_t.has_value();
  const auto u = strided<const scalar_t>(u_t), v = strided<const scalar_t>(v_t);
  const auto mu = strided<const scalar_t>(mu_t), mask = strided<const scalar_t>(mask_t);
  const int64_t rank = u_t.size(-1), R = g.R, C = g.C;

  // grad_W as [K?, A, R, B] with its own strides (a view when the strides allow one).
  at::Tensor gw = gw_t;
  std::vector<int64_t> view_shape = {g.A, R, g.B};
  if (u_t.dim() == 3) view_shape.insert(view_shape.begin(), K);
  auto view_strides = at::detail::computeStride(gw.sizes(), gw.strides(), at::IntArrayRef(view_shape));
  if (!view_strides) {  // strides no view can express: copy (rare; gradients are usually contiguous)
    gw = gw.contiguous();
    view_strides = at::detail::computeStride(gw.sizes(), gw.strides(), at::IntArrayRef(view_shape));
  }
  if (u_t.dim() == 2) view_strides->insert(view_strides->begin(), 0);  // K = 1
  const scalar_t* gwp = gw.const_data_ptr<scalar_t>();
  const int64_t gsk = (*view_strides)[0], gsa = (*view_strides)[1], gsr = (*view_strides)[2],
                gsb = (*view_strides)[3];

  const bool unit = unit_columns({v.sy, need_gmask ? mu.sy : 1, has_mask && need_gmu ? mask.sy : 1}, C);
  const Tiling t = make_tiling<acc_t>(g);
  const int64_t n_tasks = K * t.n_col_tiles * t.n_row_tiles;

  // grad_u is a sum over column tiles, grad_v over row tiles: with more than one tile, tasks
  // write per-tile partial sums (no two tasks write one element) and a second pass adds them.
  const bool gu_direct = t.n_col_tiles == 1, gv_direct = t.n_row_tiles == 1;
  std::unique_ptr<acc_t[]> gu_part, gv_part;
  if (need_gu && !gu_direct) gu_part.reset(new acc_t[K * t.n_col_tiles * R * rank]);
  if (need_gv && !gv_direct) gv_part.reset(new acc_t[K * t.n_row_tiles * rank * C]);
  scalar_t* gu = need_gu ? gu_t.data_ptr<scalar_t>() : nullptr;
  scalar_t* gv = need_gv ? gv_t.data_ptr<scalar_t>() : nullptr;
  scalar_t* gmu = need_gmu ? gmu_t.data_ptr<scalar_t>() : nullptr;
  scalar_t* gmask = need_gmask ? gmask_t.data_ptr<scalar_t>() : nullptr;

  with_unit_stride(unit, [&](auto unit) {
    constexpr bool kUnit = decltype(unit)::value;
    const int64_t vs = kUnit ? 1 : v.sy, mus = kUnit ? 1 : mu.sy, masks = kUnit ? 1 : mask.sy;
    auto term = [&](const acc_t* gr, const scalar_t* vj, acc_t uj, acc_t* acc, int64_t n) {
      if (need_gu && need_gv) return rank_term<true, true, kUnit>(gr, vj, vs, uj, acc, n);
      if (need_gu) return rank_term<true, false, kUnit>(gr, vj, vs, uj, acc, n);
      return rank_term<false, true, kUnit>(gr, vj, vs, uj, acc, n);
    };
    at::parallel_for(0, n_tasks, task_grain(t), [&](int64_t begin, int64_t end) {
      constexpr bool kWide = !std::is_same_v<acc_t, scalar_t>;  // bfloat16: rows widened to float
      std::unique_ptr<scalar_t[]> tile(new scalar_t[t.rows * t.cols]);
      std::unique_ptr<acc_t[]> wide(new acc_t[kWide ? t.cols : 0]);
      std::unique_ptr<acc_t[]> gv_acc(new acc_t[rank * t.cols]);
#if defined(PFL_FACTORIZED_IN_AVX2)
      // grad_W is Mᵀ with unit-stride columns of G and one row tile (spatial and linear with
      // R <= 32: every conv of the benchmarks): see backward_tile_b1.  sa >= R keeps its loads
      // inside grad_W.
      const bool b1 = std::is_same_v<scalar_t, float> && kUnit && g.B == 1 && gsr == 1 && gsa >= R &&
                      t.n_row_tiles == 1 && rank >= 1 && rank <= 4;
      std::unique_ptr<float[]> lanes(new float[b1 ? R * rank * 8 : 0]);
      std::unique_ptr<float[]> b1_tile(new float[b1 ? R * (t.cols + kB1Pad) : 0]);
#endif
      for (int64_t task = begin; task < end; ++task) {
        const int64_t k = task / (t.n_col_tiles * t.n_row_tiles);
        const int64_t ct = task / t.n_row_tiles % t.n_col_tiles, rt = task % t.n_row_tiles;
        const int64_t c0 = ct * t.cols, c1 = std::min(c0 + t.cols, C), nc = c1 - c0;
        const int64_t r0 = rt * t.rows, r1 = std::min(r0 + t.rows, R), a = c0 / g.B;
#if defined(PFL_FACTORIZED_IN_AVX2)
        if constexpr (kUnit && std::is_same_v<scalar_t, float>) {
          if (b1) {
            const B1Operands o{C,
                               u.row(k, 0, 0), u.sx, u.sy,
                               v.row(k, 0, 0), v.sx,
                               has_mask && need_gmu ? mask.row(k, 0, 0) : nullptr, mask.sx,
                               need_gmask ? mu.row(k, 0, 0) : nullptr, mu.sx,
                               need_gmu ? gmu + k * R * C : nullptr,
                               need_gmask ? gmask + k * R * C : nullptr,
                               need_gv ? gv + k * rank * C : nullptr,  // gv_direct: one row tile
                               need_gu};
            backward_tile_b1(rank, gwp + k * gsk, gsa, R, c0, c1, o, lanes.get(), b1_tile.get(), t.cols + kB1Pad);
            for (int64_t r = 0; need_gu && r < R; ++r) {
              for (int64_t j = 0; j < rank; ++j) {
                const float s = sum_lanes(lanes.get() + (r * rank + j) * 8);
                if (gu_direct) {
                  gu[(k * R + r) * rank + j] = s;
                } else {
                  gu_part[((k * t.n_col_tiles + ct) * R + r) * rank + j] = s;
                }
              }
            }
            continue;
          }
        }
#endif
        // Rows of G are read in place where grad_W holds them as unit-stride rows (view
        // layout), else gathered into the tile.
        const bool in_place = g.B > 1 && gsb == 1 && (c1 - 1) / g.B == a;
        const scalar_t* gwk = gwp + k * gsk;
        if (!in_place) load_tile(gwk, gsa, gsr, gsb, g, r0, r1, c0, c1, tile.get(), t.cols);
        std::fill(gv_acc.get(), gv_acc.get() + rank * t.cols, acc_t(0));
        for (int64_t r = r0; r < r1; ++r) {
          const scalar_t* row =
              in_place ? gwk + a * gsa + r * gsr + (c0 - a * g.B) : tile.get() + (r - r0) * t.cols;
          const acc_t* __restrict gr;
          if constexpr (kWide) {
            for (int64_t i = 0; i < nc; ++i) wide[i] = static_cast<acc_t>(row[i]);
            gr = wide.get();
          } else {
            gr = row;
          }
          const int64_t out_off = (k * R + r) * C + c0;  // [K, R, C] outputs are contiguous
          if (need_gmu) {
            scalar_t* __restrict dst = gmu + out_off;
            if (has_mask) {
              const scalar_t* maskr = mask.row(k, r, c0);
              for (int64_t i = 0; i < nc; ++i)
                dst[i] = cast_to<scalar_t>(gr[i] * static_cast<acc_t>(maskr[i * masks]));
            } else {
              for (int64_t i = 0; i < nc; ++i) dst[i] = cast_to<scalar_t>(gr[i]);
            }
          }
          if (need_gmask) {
            scalar_t* __restrict dst = gmask + out_off;
            const scalar_t* mur = mu.row(k, r, c0);
            for (int64_t i = 0; i < nc; ++i)
              dst[i] = cast_to<scalar_t>(gr[i] * static_cast<acc_t>(mur[i * mus]));
          }
          if (!need_gu && !need_gv) continue;
          // grad_u[k, r, j] = G[r, tile] · v[j, tile];  grad_v[k, j, tile] += u[r, j] G[r, tile]
          for (int64_t j = 0; j < rank; ++j) {
            const acc_t uj = static_cast<acc_t>(*u.row(k, r, j));
            const acc_t s = term(gr, v.row(k, j, c0), uj, gv_acc.get() + j * t.cols, nc);
            if (!need_gu) continue;
            if (gu_direct) {
              gu[(k * R + r) * rank + j] = static_cast<scalar_t>(s);
            } else {
              gu_part[((k * t.n_col_tiles + ct) * R + r) * rank + j] = s;
            }
          }
        }
        for (int64_t j = 0; need_gv && j < rank; ++j) {
          const acc_t* acc = gv_acc.get() + j * t.cols;
          if (gv_direct) {
            scalar_t* dst = gv + (k * rank + j) * C + c0;
            for (int64_t i = 0; i < nc; ++i) dst[i] = cast_to<scalar_t>(acc[i]);
          } else {
            std::copy(acc, acc + nc, gv_part.get() + ((k * t.n_row_tiles + rt) * rank + j) * C + c0);
          }
        }
      }
    });
  });

  // Add the partial sums in a fixed order (deterministic for any thread count).
  if (need_gu && !gu_direct) {
    const int64_t n = R * rank;
    at::parallel_for(0, K * n, kMinElemsPerThread / t.n_col_tiles + 1, [&](int64_t begin, int64_t end) {
      for (int64_t e = begin; e < end; ++e) {
        const acc_t* p = gu_part.get() + (e / n) * t.n_col_tiles * n + e % n;
        acc_t s = 0;
        for (int64_t ct = 0; ct < t.n_col_tiles; ++ct) s += p[ct * n];
        gu[e] = static_cast<scalar_t>(s);
      }
    });
  }
  if (need_gv && !gv_direct) {
    const int64_t n = rank * C;
    at::parallel_for(0, K * n, kMinElemsPerThread / t.n_row_tiles + 1, [&](int64_t begin, int64_t end) {
      for (int64_t e = begin; e < end; ++e) {
        const acc_t* p = gv_part.get() + (e / n) * t.n_row_tiles * n + e % n;
        acc_t s = 0;
        for (int64_t rt = 0; rt < t.n_row_tiles; ++rt) s += p[rt * n];
        gv[e] = static_cast<scalar_t>(s);
      }
    });
  }
}

// ---------------------------------------------------------------- soft threshold

// soft_threshold_'s formula on one entry: sign(x) * max(|x| - t, 0) as
// copysign(x - clamp(x, -t, t), x + 0), branch free (see soft_threshold_cpu).
template <typename scalar_t, typename acc_t>
C10_ALWAYS_INLINE scalar_t shrink(scalar_t x, acc_t t) {
  const acc_t a = static_cast<acc_t>(x);
  return cast_to<scalar_t>(std::copysign(a - std::min(std::max(a, -t), t), a + acc_t(0)));
}

// p[i] <- shrink(p[i], t) for i < n: the contiguous run, which the compiler vectorizes (8-wide
// float in the AVX2 build: the copysign's extra operations made the 4-wide one 10% slower).
template <typename scalar_t, typename acc_t>
void shrink_run(scalar_t* __restrict p, int64_t n, acc_t t) {
  for (int64_t i = 0; i < n; ++i) p[i] = shrink(p[i], t);
}
