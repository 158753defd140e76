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
  return ((lane[0] + lane[4]) + (lane[1] + lane[5])) + ((lane[2] + lane[6]) + (lane[3] + lane[7]));
}

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
  const Tiling t = make_tiling<acc_t>(g);
  const int64_t n_tasks = K * t.n_col_tiles * t.n_row_tiles;

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

  with_unit_stride(unit_columns({v.sy, need_gmask ? mu.sy : 1, has_mask && need_gmu ? mask.sy : 1}, C),
                   [&](auto unit) {
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
      for (int64_t task = begin; task < end; ++task) {
        const int64_t k = task / (t.n_col_tiles * t.n_row_tiles);
        const int64_t ct = task / t.n_row_tiles % t.n_col_tiles, rt = task % t.n_row_tiles;
        const int64_t c0 = ct * t.cols, c1 = std::min(c0 + t.cols, C), nc = c1 - c0;
        const int64_t r0 = rt * t.rows, r1 = std::min(r0 + t.rows, R), a = c0 / g.B;
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
