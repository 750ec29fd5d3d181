// Row-wise kernels: embedding, LayerNorm, RMSNorm, RoPE, cross-entropy and
// the sum of squares (host side in ../norm.rs).
//
// Layouts and formulas follow the cpu backend (src/backend/cpu/mod.rs): every
// value is computed in fp32 registers from widened inputs and rounded once on
// store; "accumulates" is load + add in fp32 + one rounding store. Nothing here
// uses float atomics: every reduction has a fixed order for a given shape, so
// results are bitwise reproducible run to run.
//
// Shapes of the launches (see norm.rs):
// * warp per row (LayerNorm, RMSNorm): blocks of NORM_WARPS warps, warp w of
//   block b owns row b*NORM_WARPS + w; lanes stride the row (coalesced), sums
//   by warp shuffles, no barriers. A warp past the last row exits as a whole.
// * block per row (embedding forward, cross-entropy): a grid-stride loop over
//   rows, threads stride the row, block reductions (prelude.cuh).
// * parameter gradients over rows (dw, db): column blocks of 32, 8 row lanes,
//   optionally split over row ranges into fp32 partials that a second kernel
//   adds in split order (norm_wgrad_*).

#define NORM_WARPS 4
#define NORM_VOCAB_ROWS 32
#define NORM_NAN __int_as_float(0x7fc00000)

// The lanes of this warp whose `pred` is set, as a bit mask. Every lane of the
// warp must call it. The emulator has no ballot, so it ORs the bits with
// shuffles there (the same mask).
__device__ __forceinline__ unsigned norm_ballot(bool pred) {
#ifdef MEMFIT_SIMT
    unsigned m = pred ? 1u << (threadIdx.x % 32) : 0u;
    for (int o = 16; o > 0; o >>= 1) m |= __shfl_xor_sync(0xffffffffu, m, o);
    return m;
#else
    return __ballot_sync(0xffffffffu, pred);
#endif
}

// Index of the lowest set bit of a non-zero mask.
__device__ __forceinline__ int norm_ctz(unsigned m) {
#ifdef MEMFIT_SIMT
    return __builtin_ctz(m);
#else
    return __ffs((int)m) - 1;
#endif
}

// ---------------------------------------------------------------------------
// Embedding

// out (N,C) = wte[tokens[r]] (+ wpe[r % t]). Block per row, threads over
// columns. A token id past the table (vocab rows) writes NaN instead of
// reading out of bounds (the cpu backend panics there). A vocabulary-parallel
// part (`part`) holds rows lo .. lo + vocab: other tokens give 0.
extern "C" __global__ void embed_forward_kernel(void* out, int odt, const u32* tokens, const void* wte, int edt,
                                                const void* wpe, int pdt, int has_wpe, i64 n, i64 t, i64 c,
                                                i64 vocab, i64 lo, int part) {
    for (i64 r = blockIdx.x; r < n; r += gridDim.x) {
        const i64 tok = (i64)tokens[r] - lo;
        const bool in = tok >= 0 && tok < vocab;
        const i64 pos = r % t;
        for (i64 j = threadIdx.x; j < c; j += blockDim.x) {
            float v = in ? ld(wte, edt, tok * c + j) : (part ? 0.0f : NORM_NAN);
            if (has_wpe) v += ld(wpe, pdt, pos * c + j);
            st(out, odt, r * c + j, v);
        }
    }
}

// dwte (V,C) += scatter of dout (N,C) by tokens (N), deterministic without
// atomics and with one rounding per element, as the cpu backend does.
//
// Several rows can hit the same token, so the scatter is partitioned over the
// output: block (x, y) owns table rows [32x, 32x + 32) and columns
// [y*blockDim, (y+1)*blockDim), one column per thread, and keeps those 32 rows
// of its columns in fp32 shared memory (32 * blockDim floats, dynamic). It
// scans all N token ids in order, blockDim at a time: each warp ballots which
// of its 32 ids fall in the block's rows, the masks go through shared memory,
// and every thread walks the masks in row order, adding dout[r, col] for the
// hits. So each element is summed in row order, rounded once at the end.
//
// Why this and not one thread per column looping over all N tokens: that has
// only C threads (768 for GPT-2) each doing N dependent read-modify-writes,
// and rounds every add for 16-bit gradients. Here the grid is (V/32) x (C/256)
// blocks (~4700 for GPT-2), the scan costs one coalesced id load and one
// ballot per warp per 32 ids, and the adds (N*C in all) are spread over the
// blocks that own the hit rows.
extern "C" __global__ void embed_backward_wte_kernel(void* dwte, int wdt, const void* dout, int odt,
                                                     const u32* tokens, i64 n, i64 c, i64 vocab, i64 lo) {
    DYNAMIC_SHARED(float, acc);
    __shared__ unsigned masks[2][32];
    const int tid = threadIdx.x, bd = blockDim.x, nw = blockDim.x / 32;
    const i64 v0 = (i64)blockIdx.x * NORM_VOCAB_ROWS;
    const i64 rows = vocab - v0 < NORM_VOCAB_ROWS ? vocab - v0 : NORM_VOCAB_ROWS;
    const i64 col = (i64)blockIdx.y * bd + tid;
    const bool active = col < c;
    for (i64 k = 0; k < rows; k++) acc[k * bd + tid] = active ? ld(dwte, wdt, (v0 + k) * c + col) : 0.0f;
    int tile = 0;
    for (i64 base = 0; base < n; base += bd, tile ^= 1) {
        const i64 r = base + tid;
        // A vocabulary-parallel part's rows start at token lo.
        const i64 tok = r < n ? (i64)tokens[r] - lo : -1;
        const unsigned m = norm_ballot(tok >= v0 && tok < v0 + rows);
        // Double-buffered: a thread writes masks[tile] again two tiles later,
        // past the next tile's barrier, which a thread reaches only after it
        // has walked these masks. So one barrier per tile.
        if (tid % 32 == 0) masks[tile][tid / 32] = m;
        __syncthreads();
        for (int w = 0; w < nw; w++) {
            unsigned mm = masks[tile][w];
            while (mm) {
                const int j = norm_ctz(mm);
                mm &= mm - 1;
                const i64 rr = base + w * 32 + j;
                const i64 k = (i64)tokens[rr] - lo - v0;
                if (active) acc[k * bd + tid] += ld(dout, odt, rr * c + col);
            }
        }
    }
    if (active)
        for (i64 k = 0; k < rows; k++) st(dwte, wdt, (v0 + k) * c + col, acc[k * bd + tid]);
}

// dwpe (T,C) += sum over the B sequences of dout (B*T,C) at each position:
// one thread per (position, column), sequences added in order.
extern "C" __global__ void embed_backward_wpe_kernel(void* dwpe, int pdt, const void* dout, int odt, i64 nb, i64 t,
                                                     i64 c) {
    FOR_EACH(i, t * c) {
        float acc = ld(dwpe, pdt, i);
        for (i64 b = 0; b < nb; b++) acc += ld(dout, odt, b * t * c + i);
        st(dwpe, pdt, i, acc);
    }
}

// ---------------------------------------------------------------------------
// LayerNorm and RMSNorm, warp per row

// out (N,C) = (x - mean) * rstd * w (+ b); mean, rstd (N). Two passes over
// the row (mean, then squared deviations: no cancellation), as the cpu does.
extern "C" __global__ void layernorm_forward_kernel(void* out, int odt, void* mean, int mdt, void* rstd, int rdt,
                                                    const void* inp, int idt, const void* w, int wdt, const void* b,
                                                    int bdt, int has_b, i64 n, i64 c, float eps) {
    const i64 r = (i64)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    if (r >= n) return;  // the whole warp
    const int lane = threadIdx.x % 32;
    const i64 off = r * c;
    float s = 0.0f;
    for (i64 j = lane; j < c; j += 32) s += ld(inp, idt, off + j);
    const float m = warp_sum(s) / (float)c;
    float q = 0.0f;
    for (i64 j = lane; j < c; j += 32) {
        const float d = ld(inp, idt, off + j) - m;
        q += d * d;
    }
    const float rs = 1.0f / sqrtf(warp_sum(q) / (float)c + eps);
    for (i64 j = lane; j < c; j += 32) {
        float o = (ld(inp, idt, off + j) - m) * rs * ld(w, wdt, j);
        if (has_b) o += ld(b, bdt, j);
        st(out, odt, off + j, o);
    }
    if (lane == 0) {
        st(mean, mdt, r, m);
        st(rstd, rdt, r, rs);
    }
}

// dinp (N,C) += rstd * (dnorm - mean(dnorm) - norm * mean(dnorm * norm)),
// norm = (x - mean) * rstd, dnorm = dout * w. dw and db: norm_wgrad_*.
extern "C" __global__ void layernorm_backward_kernel(void* dinp, int xdt, const void* dout, int odt, const void* inp,
                                                     int idt, const void* w, int wdt, const void* mean, int mdt,
                                                     const void* rstd, int rdt, i64 n, i64 c) {
    const i64 r = (i64)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    if (r >= n) return;
    const int lane = threadIdx.x % 32;
    const i64 off = r * c;
    const float m = ld(mean, mdt, r), rs = ld(rstd, rdt, r);
    float sd = 0.0f, sdn = 0.0f;
    for (i64 j = lane; j < c; j += 32) {
        const float norm = (ld(inp, idt, off + j) - m) * rs;
        const float dnorm = ld(dout, odt, off + j) * ld(w, wdt, j);
        sd += dnorm;
        sdn += dnorm * norm;
    }
    const float dnorm_mean = warp_sum(sd) / (float)c;
    const float dnorm_norm_mean = warp_sum(sdn) / (float)c;
    for (i64 j = lane; j < c; j += 32) {
        const float norm = (ld(inp, idt, off + j) - m) * rs;
        const float g = (ld(dout, odt, off + j) * ld(w, wdt, j) - dnorm_mean - norm * dnorm_norm_mean) * rs;
        st(dinp, xdt, off + j, ld(dinp, xdt, off + j) + g);
    }
}

// out (N,C) = x * rstd * w, rstd (N) = 1 / sqrt(mean(x^2) + eps).
extern "C" __global__ void rmsnorm_forward_kernel(void* out, int odt, void* rstd, int rdt, const void* inp, int idt,
                                                  const void* w, int wdt, i64 n, i64 c, float eps) {
    const i64 r = (i64)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    if (r >= n) return;
    const int lane = threadIdx.x % 32;
    const i64 off = r * c;
    float s = 0.0f;
    for (i64 j = lane; j < c; j += 32) {
        const float x = ld(inp, idt, off + j);
        s += x * x;
    }
    const float rs = 1.0f / sqrtf(warp_sum(s) / (float)c + eps);
    for (i64 j = lane; j < c; j += 32) st(out, odt, off + j, ld(inp, idt, off + j) * rs * ld(w, wdt, j));
    if (lane == 0) st(rstd, rdt, r, rs);
}

// dinp (N,C) += r w dy - x r^3 / C * sum_i dy_i w_i x_i. dw: norm_wgrad_*.
extern "C" __global__ void rmsnorm_backward_kernel(void* dinp, int xdt, const void* dout, int odt, const void* inp,
                                                   int idt, const void* w, int wdt, const void* rstd, int rdt, i64 n,
                                                   i64 c) {
    const i64 r = (i64)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    if (r >= n) return;
    const int lane = threadIdx.x % 32;
    const i64 off = r * c;
    const float rs = ld(rstd, rdt, r);
    float s = 0.0f;
    for (i64 j = lane; j < c; j += 32) s += ld(dout, odt, off + j) * ld(w, wdt, j) * ld(inp, idt, off + j);
    const float k = warp_sum(s) * rs * rs * rs / (float)c;
    for (i64 j = lane; j < c; j += 32) {
        const float g = rs * ld(w, wdt, j) * ld(dout, odt, off + j) - ld(inp, idt, off + j) * k;
        st(dinp, xdt, off + j, ld(dinp, xdt, off + j) + g);
    }
}

// Parameter gradients of both norms: dw (C) += sum_r dout[r,c] * norm[r,c],
// db (C) += sum_r dout[r,c] (LayerNorm with a bias), norm = (x - mean) * rstd
// (LayerNorm) or x * rstd (RMSNorm, rms = 1: `mean` is not read).
//
// Grid (ceil(C/32), nsplit), block (32, 8): threadIdx.x picks a column of the
// block's 32 (a warp reads 32 consecutive elements of a row), threadIdx.y a
// row lane. Split s covers rows [s*rps, (s+1)*rps); each lane sums its rows in
// order, then the 8 lane sums are added in lane order. With nsplit = 1 the
// sum goes straight into dw/db; otherwise into fp32 partials (dw's at
// part[s*C + col], db's at part[(nsplit + s)*C + col]) that
// norm_wgrad_finish_kernel adds in split order. The split only exists to give
// a GPU enough blocks when C is small (24 column blocks for C = 768).
extern "C" __global__ void norm_wgrad_partial_kernel(void* dw, int wdt, void* db, int bdt, int has_db, float* part,
                                                     const void* dout, int odt, const void* inp, int idt,
                                                     const void* mean, int mdt, const void* rstd, int rdt, int rms,
                                                     i64 n, i64 c, i64 nsplit) {
    __shared__ float pw[8][33];
    __shared__ float pb[8][33];
    const i64 col = (i64)blockIdx.x * 32 + threadIdx.x;
    const i64 rps = (n + nsplit - 1) / nsplit;
    const i64 r0 = (i64)blockIdx.y * rps;
    const i64 r1 = r0 + rps < n ? r0 + rps : n;
    float aw = 0.0f, ab = 0.0f;
    if (col < c) {
        for (i64 r = r0 + threadIdx.y; r < r1; r += 8) {
            const float dy = ld(dout, odt, r * c + col);
            const float x = ld(inp, idt, r * c + col);
            const float rs = ld(rstd, rdt, r);
            const float norm = rms ? x * rs : (x - ld(mean, mdt, r)) * rs;
            aw += dy * norm;
            ab += dy;
        }
    }
    pw[threadIdx.y][threadIdx.x] = aw;
    pb[threadIdx.y][threadIdx.x] = ab;
    __syncthreads();
    if (threadIdx.y == 0 && col < c) {
        float sw = 0.0f, sb = 0.0f;
        for (int l = 0; l < 8; l++) {
            sw += pw[l][threadIdx.x];
            sb += pb[l][threadIdx.x];
        }
        if (nsplit == 1) {
            st(dw, wdt, col, ld(dw, wdt, col) + sw);
            if (has_db) st(db, bdt, col, ld(db, bdt, col) + sb);
        } else {
            part[blockIdx.y * c + col] = sw;
            if (has_db) part[(nsplit + blockIdx.y) * c + col] = sb;
        }
    }
}

// dw (C) += sum over splits of the partials, in split order (and db).
extern "C" __global__ void norm_wgrad_finish_kernel(void* dw, int wdt, void* db, int bdt, int has_db,
                                                    const float* part, i64 c, i64 nsplit) {
    FOR_EACH(col, c) {
        float sw = 0.0f;
        for (i64 s = 0; s < nsplit; s++) sw += part[s * c + col];
        st(dw, wdt, col, ld(dw, wdt, col) + sw);
        if (has_db) {
            float sb = 0.0f;
            for (i64 s = 0; s < nsplit; s++) sb += part[(nsplit + s) * c + col];
            st(db, bdt, col, ld(db, bdt, col) + sb);
        }
    }
}

// ---------------------------------------------------------------------------
// RoPE

// In place on the q and k heads of qkv (N, width): `heads` heads of hd at the
// start of each row, rotate_half pairs (i, i + hd/2), angle pos * theta^(-2i/hd)
// in double and rounded once (as the cpu backend), sign 1 rotates, -1 rotates
// back. One thread per (row, i): the angle is computed once and applied to
// every head; consecutive threads touch consecutive elements of a head.
extern "C" __global__ void rope_kernel(void* qkv, int dt, i64 n, i64 t, i64 width, int heads, int hd, float theta,
                                       float sign) {
    const int half = hd / 2;
    FOR_EACH(idx, n * half) {
        const i64 r = idx / half;
        const int i = (int)(idx % half);
        const double inv_freq = pow((double)theta, -2.0 * (double)i / (double)hd);
        double sd, cd;
        sincos((double)(r % t) * inv_freq, &sd, &cd);
        const float sn = sign * (float)sd, cs = (float)cd;
        for (int h = 0; h < heads; h++) {
            const i64 o = r * width + (i64)h * hd + i;
            const float x1 = ld(qkv, dt, o), x2 = ld(qkv, dt, o + half);
            st(qkv, dt, o, x1 * cs - x2 * sn);
            st(qkv, dt, o + half, x2 * cs + x1 * sn);
        }
    }
}

// ---------------------------------------------------------------------------
// Cross-entropy, block per row

// The row's max over [0, v) and sum of exp(x - max) in f64 (the cpu's
// logsumexp). Every thread of the block gets both.
__device__ __forceinline__ void norm_row_softmax_stats(const void* x, int dt, i64 off, i64 v, float* redf,
                                                       double* redd, float* m_out, double* s_out) {
    float m = F32_NEG_INF;
    for (i64 j = threadIdx.x; j < v; j += blockDim.x) m = fmaxf(m, ld(x, dt, off + j));
    m = block_max(m, redf);
    double s = 0.0;
    for (i64 j = threadIdx.x; j < v; j += blockDim.x) s += (double)expf(ld(x, dt, off + j) - m);
    *s_out = block_sum_f64(s, redd);
    *m_out = m;
}

// losses (N) = logsumexp(logits[r, :v]) - logits[r, target]; a target >= v
// gives NaN (the cpu backend panics).
extern "C" __global__ void crossentropy_forward_kernel(void* losses, int ldt, const void* logits, int xdt,
                                                       const u32* targets, i64 n, i64 v, i64 vp) {
    __shared__ float redf[32];
    __shared__ double redd[32];
    for (i64 r = blockIdx.x; r < n; r += gridDim.x) {
        float m;
        double s;
        norm_row_softmax_stats(logits, xdt, r * vp, v, redf, redd, &m, &s);
        if (threadIdx.x == 0) {
            const i64 tgt = targets[r];
            float loss = NORM_NAN;
            if (tgt < v) loss = (float)((double)m + log(s) - (double)ld(logits, xdt, r * vp + tgt));
            st(losses, ldt, r, loss);
        }
    }
}

// In place: logits[r, j] := dloss * (softmax_j - [j == target]) for j < v,
// 0 for the padding [v, vp); a row with a target >= v becomes NaN. Each
// thread rewrites only the elements it read, so no barrier is needed between
// the last read and the writes.
extern "C" __global__ void crossentropy_backward_kernel(void* logits, int xdt, const u32* targets, float dloss, i64 n,
                                                        i64 v, i64 vp) {
    __shared__ float redf[32];
    __shared__ double redd[32];
    for (i64 r = blockIdx.x; r < n; r += gridDim.x) {
        const i64 off = r * vp;
        float m;
        double s;
        norm_row_softmax_stats(logits, xdt, off, v, redf, redd, &m, &s);
        const float k = (float)((double)dloss / s);
        const i64 tgt = targets[r];
        for (i64 j = threadIdx.x; j < vp; j += blockDim.x) {
            float g = 0.0f;
            if (j < v) {
                g = expf(ld(logits, xdt, off + j) - m) * k;
                if (j == tgt) g -= dloss;
            }
            if (tgt >= v) g = NORM_NAN;
            st(logits, xdt, off + j, g);
        }
    }
}

// Vocabulary-parallel cross-entropy on one part (columns lo.., the first v
// real). Step 1: stats (N,2) = [max, sum exp(x - max)] (the sum in f64,
// stored fp32), tgt (N) = the target's logit when it is in the part, else 0.
extern "C" __global__ void crossentropy_part_stats_kernel(float* stats, float* tgt, const void* logits, int xdt,
                                                          const u32* targets, i64 n, i64 lo, i64 v, i64 vp) {
    __shared__ float redf[32];
    __shared__ double redd[32];
    for (i64 r = blockIdx.x; r < n; r += gridDim.x) {
        float m;
        double s;
        norm_row_softmax_stats(logits, xdt, r * vp, v, redf, redd, &m, &s);
        if (threadIdx.x == 0) {
            stats[2 * r] = m;
            stats[2 * r + 1] = (float)s;
            const i64 j = (i64)targets[r] - lo;
            tgt[r] = (j >= 0 && j < v) ? ld(logits, xdt, r * vp + j) : 0.0f;
        }
    }
}

// Step 2, thread per row: lse = M + ln(sum_p s_p exp(m_p - M)) over the parts'
// stats (parts,N,2), in f64, and losses = lse - tgt.
extern "C" __global__ void crossentropy_combine_kernel(float* losses, float* lse, const float* stats,
                                                       const float* tgt, i64 n, i64 parts) {
    FOR_EACH(r, n) {
        float m = F32_NEG_INF;
        for (i64 p = 0; p < parts; p++) m = fmaxf(m, stats[(p * n + r) * 2]);
        double s = 0.0;
        for (i64 p = 0; p < parts; p++) {
            const float sp = stats[(p * n + r) * 2 + 1];
            if (sp != 0.0f) s += (double)sp * exp((double)(stats[(p * n + r) * 2] - m));
        }
        const double l = (double)m + log(s);
        lse[r] = (float)l;
        losses[r] = (float)(l - (double)tgt[r]);
    }
}

// Step 3, in place: logits[r, j] := dloss * exp(x - lse[r]) - dloss * [lo + j
// == target] over the real columns, padding 0. Each thread rewrites only the
// elements it read.
extern "C" __global__ void crossentropy_part_backward_kernel(void* logits, int xdt, const float* lse,
                                                             const u32* targets, float dloss, i64 n, i64 lo,
                                                             i64 v, i64 vp) {
    for (i64 r = blockIdx.x; r < n; r += gridDim.x) {
        const i64 off = r * vp;
        const i64 tgt = (i64)targets[r] - lo;
        for (i64 j = threadIdx.x; j < vp; j += blockDim.x) {
            float g = 0.0f;
            if (j < v) {
                g = dloss * expf(ld(logits, xdt, off + j) - lse[r]);
                if (j == tgt) g -= dloss;
            }
            st(logits, xdt, off + j, g);
        }
    }
}

// ---------------------------------------------------------------------------
// Sum of squares

// part[block] = sum of x[i]^2 in f64 over the block's grid-stride share; the
// host adds the partials in block order (deterministic for a given n).
extern "C" __global__ void sum_squares_kernel(double* part, const void* x, int dt, i64 n) {
    __shared__ double red[32];
    double s = 0.0;
    FOR_EACH(i, n) {
        const double v = (double)ld(x, dt, i);
        s += v * v;
    }
    s = block_sum_f64(s, red);
    if (threadIdx.x == 0) part[blockIdx.x] = s;
}
