// Causal self-attention (host side and design: ../attention.rs).
//
// Eager: the products go to cuBLAS; here are only the row softmax (forward,
// in place on the scaled scores the GEMM wrote into `att`) and its backward (in
// place on `datt`), one warp per row of T.
//
// Flash (Dao et al., FlashAttention-2): the forward keeps a 32-row query tile
// in shared memory and streams 32-key tiles of K, then V, through one shared
// buffer with an online softmax; the backward recomputes P = exp(S - lse) in
// 16 x 16 tiles, one kernel for dK/dV (a block owns a key tile of one kv head
// and loops over every query head of the group and every query tile at or
// below the diagonal) and one for dQ (a block owns a query tile of one head
// and loops over the key tiles up to the diagonal). Every output element is
// written by exactly one thread after a fixed-order sum: no atomics, the
// results are bit-identical run to run.
//
// Tiles are fp32 in shared memory with rows padded to ATTN_LDS floats, so the
// column walks of a tile hit distinct banks. Block: 128 threads as (ty, tx) =
// (tid / 8, tid % 8); a thread owns output columns e = tx + 8j (j < 16, e <
// head_dim), so head_dim is at most ATTN_MAXD.

#ifdef MEMFIT_SIMT
#define ATTN_UNROLL
#else
#define ATTN_UNROLL _Pragma("unroll")
#endif

#define ATTN_MAXD 128            // largest head_dim of the flash kernels
#define ATTN_LDS (ATTN_MAXD + 1)  // row stride of a shared q/k/v tile, in floats
#define ATTN_DPT (ATTN_MAXD / 8)  // output columns per thread
#define ATTN_FT 32                // forward tile: query rows = keys
#define ATTN_BT 16                // backward tile: query rows = keys

// ----------------------------------------------------------------------------
// Eager: row softmax and its backward. Rows are (b, h, i), each T long; row
// ri belongs to query i = ri % T, which sees keys 0..i.

// att (B*H*T rows of T): scaled scores in, probabilities out, the masked part
// (keys after the query) exactly 0. One warp a row, grid-stride over rows.
extern "C" __global__ void attn_softmax_forward_kernel(void* att, int adt, i64 rows, int T) {
    const int lane = threadIdx.x & 31;
    const i64 warps = (i64)gridDim.x * (blockDim.x >> 5);
    for (i64 ri = (i64)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5); ri < rows; ri += warps) {
        const i64 base = ri * T;
        const int live = (int)(ri % T) + 1;
        float mx = F32_NEG_INF;
        for (int j = lane; j < live; j += 32) mx = fmaxf(mx, ld(att, adt, base + j));
        mx = warp_max(mx);
        float sum = 0.0f;
        for (int j = lane; j < live; j += 32) sum += expf(ld(att, adt, base + j) - mx);
        const float inv = 1.0f / warp_sum(sum);
        for (int j = lane; j < T; j += 32)
            st(att, adt, base + j, j < live ? expf(ld(att, adt, base + j) - mx) * inv : 0.0f);
    }
}

// datt (B*H*T rows of T): dP in, dS = P * (dP - rowsum(P * dP)) out (unscaled;
// the dQ and dK GEMMs apply 1/sqrt(hd)), masked part 0.
extern "C" __global__ void attn_softmax_backward_kernel(void* datt, int ddt, const void* att, int adt, i64 rows,
                                                        int T) {
    const int lane = threadIdx.x & 31;
    const i64 warps = (i64)gridDim.x * (blockDim.x >> 5);
    for (i64 ri = (i64)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5); ri < rows; ri += warps) {
        const i64 base = ri * T;
        const int live = (int)(ri % T) + 1;
        float dot = 0.0f;
        for (int j = lane; j < live; j += 32) dot += ld(att, adt, base + j) * ld(datt, ddt, base + j);
        dot = warp_sum(dot);
        for (int j = lane; j < T; j += 32) {
            float v = 0.0f;
            if (j < live) v = ld(att, adt, base + j) * (ld(datt, ddt, base + j) - dot);
            st(datt, ddt, base + j, v);
        }
    }
}

// ----------------------------------------------------------------------------
// Flash helpers

// Rows r0..r0+nrows of one head of a row-major (T, w) sequence into a shared
// tile (row stride ATTN_LDS): element (r, d) from x[base + r*w + d], zero for
// rows at or past T. All threads of the block take part; the caller syncs.
__device__ __forceinline__ void attn_load_tile(float* tile, const void* x, int dt, i64 base, i64 w, int r0,
                                               int nrows, int T, int hd) {
    for (int idx = threadIdx.x; idx < nrows * hd; idx += blockDim.x) {
        const int r = idx / hd, d = idx - r * hd;
        const int row = r0 + r;
        tile[r * ATTN_LDS + d] = row < T ? ld(x, dt, base + (i64)row * w + d) : 0.0f;
    }
}

// Max and sum over the 8 lanes of a row group (lanes 8k..8k+7, the tx of one ty).
__device__ __forceinline__ float attn_group8_max(float v) {
    for (int o = 4; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}
__device__ __forceinline__ float attn_group8_sum(float v) {
    for (int o = 4; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// ----------------------------------------------------------------------------
// Flash forward

// out (B,T,nh*hd), lse (B,nh,T) from qkv (B,T,(nh+2*nkv)*hd).
// Grid (ceil(T/32), nh, B), block 128: query tile (reversed, so the longest
// rows start first) of head h in sequence b. Thread (ty, tx) owns query rows
// 2ty, 2ty+1 of the tile: their scores against keys tx + 8k (k < 4) of each key
// tile, and their output columns tx + 8j. Shared: q tile, one k-then-v tile,
// the probabilities (37 KiB).
extern "C" __global__ void attn_flash_forward_kernel(void* out, int odt, void* lse, int ldt, const void* qkv, int qdt,
                                                     int T, int nh, int nkv, int hd, float scale) {
    __shared__ float qs[ATTN_FT * ATTN_LDS];
    __shared__ float kvs[ATTN_FT * ATTN_LDS];
    __shared__ float ps[ATTN_FT * (ATTN_FT + 1)];
    const int tid = threadIdx.x, ty = tid >> 3, tx = tid & 7;
    const int qb = gridDim.x - 1 - blockIdx.x, h = blockIdx.y, b = blockIdx.z;
    const int g = h / (nh / nkv);
    const i64 w = (i64)(nh + 2 * nkv) * hd, ow = (i64)nh * hd;
    const i64 seq = (i64)b * T * w;
    const int r0 = qb * ATTN_FT;
    attn_load_tile(qs, qkv, qdt, seq + (i64)h * hd, w, r0, ATTN_FT, T, hd);

    float m[2], l[2], acc[2][ATTN_DPT];
    ATTN_UNROLL
    for (int i = 0; i < 2; i++) {
        m[i] = F32_NEG_INF;
        l[i] = 0.0f;
        ATTN_UNROLL
        for (int j = 0; j < ATTN_DPT; j++) acc[i][j] = 0.0f;
    }
    // Key tiles 0..qb: tiles are as tall as query tiles, so every row of the
    // block sees at least one key (key c0 <= r0) in every tile it visits.
    for (int c0 = 0; c0 <= r0; c0 += ATTN_FT) {
        __syncthreads();  // kvs and ps free (and qs published on the first pass)
        attn_load_tile(kvs, qkv, qdt, seq + (i64)(nh + g) * hd, w, c0, ATTN_FT, T, hd);
        __syncthreads();
        float s[2][4];
        ATTN_UNROLL
        for (int i = 0; i < 2; i++) {
            ATTN_UNROLL
            for (int k = 0; k < 4; k++) s[i][k] = 0.0f;
        }
        for (int d = 0; d < hd; d++) {
            const float q0 = qs[(2 * ty) * ATTN_LDS + d], q1 = qs[(2 * ty + 1) * ATTN_LDS + d];
            ATTN_UNROLL
            for (int k = 0; k < 4; k++) {
                const float kv = kvs[(tx + 8 * k) * ATTN_LDS + d];
                s[0][k] += q0 * kv;
                s[1][k] += q1 * kv;
            }
        }
        ATTN_UNROLL
        for (int i = 0; i < 2; i++) {
            const int r = r0 + 2 * ty + i;
            float mx = F32_NEG_INF;
            ATTN_UNROLL
            for (int k = 0; k < 4; k++) {
                const int c = c0 + tx + 8 * k;
                s[i][k] = (c <= r && c < T) ? s[i][k] * scale : F32_NEG_INF;
                mx = fmaxf(mx, s[i][k]);
            }
            const float mnew = fmaxf(m[i], attn_group8_max(mx));
            // Online softmax: rescale what was summed under the old max.
            const float base = mnew == F32_NEG_INF ? 0.0f : mnew;
            float sum = 0.0f;
            ATTN_UNROLL
            for (int k = 0; k < 4; k++) {
                const float p = expf(s[i][k] - base);
                ps[(2 * ty + i) * (ATTN_FT + 1) + tx + 8 * k] = p;
                sum += p;
            }
            sum = attn_group8_sum(sum);
            const float corr = expf(m[i] - base);
            l[i] = l[i] * corr + sum;
            m[i] = mnew;
            ATTN_UNROLL
            for (int j = 0; j < ATTN_DPT; j++) acc[i][j] *= corr;
        }
        __syncthreads();  // scores done with K; ps complete
        attn_load_tile(kvs, qkv, qdt, seq + (i64)(nh + nkv + g) * hd, w, c0, ATTN_FT, T, hd);
        __syncthreads();
        for (int c = 0; c < ATTN_FT; c++) {
            const float p0 = ps[(2 * ty) * (ATTN_FT + 1) + c], p1 = ps[(2 * ty + 1) * (ATTN_FT + 1) + c];
            ATTN_UNROLL
            for (int j = 0; j < ATTN_DPT; j++) {
                const int e = tx + 8 * j;
                if (e < hd) {
                    const float v = kvs[c * ATTN_LDS + e];
                    acc[0][j] += p0 * v;
                    acc[1][j] += p1 * v;
                }
            }
        }
    }
    ATTN_UNROLL
    for (int i = 0; i < 2; i++) {
        const int r = r0 + 2 * ty + i;
        if (r < T) {
            const float inv = 1.0f / l[i];
            const i64 o = ((i64)b * T + r) * ow + (i64)h * hd;
            ATTN_UNROLL
            for (int j = 0; j < ATTN_DPT; j++) {
                const int e = tx + 8 * j;
                if (e < hd) st(out, odt, o + e, acc[i][j] * inv);
            }
            if (tx == 0) st(lse, ldt, ((i64)b * nh + h) * T + r, m[i] + logf(l[i]));
        }
    }
}

// ----------------------------------------------------------------------------
// Flash backward

// dd (B,nh,T) = rowsum(dout * out) per head row (FlashAttention-2's D, equal
// to rowsum(P * dP)). Rows (b, t, h) of hd elements; one warp a row.
extern "C" __global__ void attn_flash_rowdot_kernel(float* dd, const void* dout, int ddt, const void* out, int odt,
                                                    i64 rows, int T, int nh, int hd) {
    const int lane = threadIdx.x & 31;
    const i64 warps = (i64)gridDim.x * (blockDim.x >> 5);
    for (i64 ri = (i64)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5); ri < rows; ri += warps) {
        float acc = 0.0f;
        for (int e = lane; e < hd; e += 32) acc += ld(dout, ddt, ri * hd + e) * ld(out, odt, ri * hd + e);
        acc = warp_sum(acc);
        if (lane == 0) {
            const i64 bt = ri / nh, h = ri % nh;
            const i64 b = bt / T, t = bt % T;
            dd[(b * nh + h) * T + t] = acc;
        }
    }
}

// dK, dV (the k and v columns of dqkv, overwritten). Grid (ceil(T/16), nkv, B),
// block 128: key tile kb of kv head g in sequence b. For each query head of the
// group in order, and each query tile from the diagonal down, thread (ty, tx)
// recomputes P and dS for key ty against query rows tx, tx + 8, then adds
// P^T dO and dS^T Q into its key's columns tx + 8j. Shared: k, v, q, dO tiles,
// P and dS (35 KiB).
extern "C" __global__ void attn_flash_backward_dkv_kernel(void* dqkv, int gdt, const void* dout, int odt,
                                                          const void* lse, int ldt, const float* dd, const void* qkv,
                                                          int qdt, int T, int nh, int nkv, int hd, float scale) {
    __shared__ float ks[ATTN_BT * ATTN_LDS];
    __shared__ float vs[ATTN_BT * ATTN_LDS];
    __shared__ float qs[ATTN_BT * ATTN_LDS];
    __shared__ float dos[ATTN_BT * ATTN_LDS];
    __shared__ float ps[ATTN_BT * (ATTN_BT + 1)];
    __shared__ float dss[ATTN_BT * (ATTN_BT + 1)];
    __shared__ float lses[ATTN_BT];
    __shared__ float dds[ATTN_BT];
    const int tid = threadIdx.x, ty = tid >> 3, tx = tid & 7;
    const int g = blockIdx.y, b = blockIdx.z, rep = nh / nkv;
    const i64 w = (i64)(nh + 2 * nkv) * hd, ow = (i64)nh * hd;
    const i64 seq = (i64)b * T * w;
    const int c0 = blockIdx.x * ATTN_BT, c = c0 + ty;
    attn_load_tile(ks, qkv, qdt, seq + (i64)(nh + g) * hd, w, c0, ATTN_BT, T, hd);
    attn_load_tile(vs, qkv, qdt, seq + (i64)(nh + nkv + g) * hd, w, c0, ATTN_BT, T, hd);

    float dk[ATTN_DPT], dv[ATTN_DPT];
    ATTN_UNROLL
    for (int j = 0; j < ATTN_DPT; j++) dk[j] = dv[j] = 0.0f;
    for (int hi = 0; hi < rep; hi++) {
        const int h = g * rep + hi;
        const i64 hrow = ((i64)b * nh + h) * T;
        for (int r0 = c0; r0 < T; r0 += ATTN_BT) {
            __syncthreads();  // the previous tiles are consumed (ks, vs published)
            attn_load_tile(qs, qkv, qdt, seq + (i64)h * hd, w, r0, ATTN_BT, T, hd);
            attn_load_tile(dos, dout, odt, (i64)b * T * ow + (i64)h * hd, ow, r0, ATTN_BT, T, hd);
            if (tid < ATTN_BT) {
                const int r = r0 + tid;
                lses[tid] = r < T ? ld(lse, ldt, hrow + r) : 0.0f;
                dds[tid] = r < T ? dd[hrow + r] : 0.0f;
            }
            __syncthreads();
            float s[2] = {0.0f, 0.0f}, dp[2] = {0.0f, 0.0f};
            for (int d = 0; d < hd; d++) {
                const float kd = ks[ty * ATTN_LDS + d], vd = vs[ty * ATTN_LDS + d];
                ATTN_UNROLL
                for (int k = 0; k < 2; k++) {
                    s[k] += kd * qs[(tx + 8 * k) * ATTN_LDS + d];
                    dp[k] += vd * dos[(tx + 8 * k) * ATTN_LDS + d];
                }
            }
            ATTN_UNROLL
            for (int k = 0; k < 2; k++) {
                const int rl = tx + 8 * k, r = r0 + rl;
                float p = 0.0f, ds = 0.0f;
                if (c <= r && r < T) {
                    p = expf(s[k] * scale - lses[rl]);
                    ds = p * (dp[k] - dds[rl]) * scale;
                }
                ps[ty * (ATTN_BT + 1) + rl] = p;
                dss[ty * (ATTN_BT + 1) + rl] = ds;
            }
            __syncthreads();
            for (int rl = 0; rl < ATTN_BT; rl++) {
                const float p = ps[ty * (ATTN_BT + 1) + rl], ds = dss[ty * (ATTN_BT + 1) + rl];
                ATTN_UNROLL
                for (int j = 0; j < ATTN_DPT; j++) {
                    const int e = tx + 8 * j;
                    if (e < hd) {
                        dv[j] += p * dos[rl * ATTN_LDS + e];
                        dk[j] += ds * qs[rl * ATTN_LDS + e];
                    }
                }
            }
        }
    }
    if (c < T) {
        const i64 row = seq + (i64)c * w;
        ATTN_UNROLL
        for (int j = 0; j < ATTN_DPT; j++) {
            const int e = tx + 8 * j;
            if (e < hd) {
                st(dqkv, gdt, row + (i64)(nh + g) * hd + e, dk[j]);
                st(dqkv, gdt, row + (i64)(nh + nkv + g) * hd + e, dv[j]);
            }
        }
    }
}

// dQ (the q columns of dqkv, overwritten). Grid (ceil(T/16), nh, B), block
// 128: query tile (reversed, longest rows first) of head h in sequence b.
// Thread (ty, tx) recomputes P and dS for query row ty against keys tx, tx + 8
// of each key tile up to the diagonal, then adds dS K into its row's columns
// tx + 8j. Shared: q, dO, k, v tiles and dS (34 KiB).
extern "C" __global__ void attn_flash_backward_dq_kernel(void* dqkv, int gdt, const void* dout, int odt,
                                                         const void* lse, int ldt, const float* dd, const void* qkv,
                                                         int qdt, int T, int nh, int nkv, int hd, float scale) {
    __shared__ float qs[ATTN_BT * ATTN_LDS];
    __shared__ float dos[ATTN_BT * ATTN_LDS];
    __shared__ float ks[ATTN_BT * ATTN_LDS];
    __shared__ float vs[ATTN_BT * ATTN_LDS];
    __shared__ float dss[ATTN_BT * (ATTN_BT + 1)];
    const int tid = threadIdx.x, ty = tid >> 3, tx = tid & 7;
    const int qb = gridDim.x - 1 - blockIdx.x, h = blockIdx.y, b = blockIdx.z;
    const int g = h / (nh / nkv);
    const i64 w = (i64)(nh + 2 * nkv) * hd, ow = (i64)nh * hd;
    const i64 seq = (i64)b * T * w;
    const int r0 = qb * ATTN_BT, r = r0 + ty;
    attn_load_tile(qs, qkv, qdt, seq + (i64)h * hd, w, r0, ATTN_BT, T, hd);
    attn_load_tile(dos, dout, odt, (i64)b * T * ow + (i64)h * hd, ow, r0, ATTN_BT, T, hd);
    const i64 hrow = ((i64)b * nh + h) * T;
    const float lse_r = r < T ? ld(lse, ldt, hrow + r) : 0.0f;
    const float d_r = r < T ? dd[hrow + r] : 0.0f;

    float dq[ATTN_DPT];
    ATTN_UNROLL
    for (int j = 0; j < ATTN_DPT; j++) dq[j] = 0.0f;
    for (int c0 = 0; c0 <= r0; c0 += ATTN_BT) {
        __syncthreads();  // ks, vs, dss free (and qs, dos published on the first pass)
        attn_load_tile(ks, qkv, qdt, seq + (i64)(nh + g) * hd, w, c0, ATTN_BT, T, hd);
        attn_load_tile(vs, qkv, qdt, seq + (i64)(nh + nkv + g) * hd, w, c0, ATTN_BT, T, hd);
        __syncthreads();
        float s[2] = {0.0f, 0.0f}, dp[2] = {0.0f, 0.0f};
        for (int d = 0; d < hd; d++) {
            const float qd = qs[ty * ATTN_LDS + d], od = dos[ty * ATTN_LDS + d];
            ATTN_UNROLL
            for (int k = 0; k < 2; k++) {
                s[k] += qd * ks[(tx + 8 * k) * ATTN_LDS + d];
                dp[k] += od * vs[(tx + 8 * k) * ATTN_LDS + d];
            }
        }
        ATTN_UNROLL
        for (int k = 0; k < 2; k++) {
            const int cl = tx + 8 * k, c = c0 + cl;
            float ds = 0.0f;
            if (c <= r && r < T) {
                const float p = expf(s[k] * scale - lse_r);
                ds = p * (dp[k] - d_r) * scale;
            }
            dss[ty * (ATTN_BT + 1) + cl] = ds;
        }
        __syncthreads();
        for (int cl = 0; cl < ATTN_BT; cl++) {
            const float ds = dss[ty * (ATTN_BT + 1) + cl];
            ATTN_UNROLL
            for (int j = 0; j < ATTN_DPT; j++) {
                const int e = tx + 8 * j;
                if (e < hd) dq[j] += ds * ks[cl * ATTN_LDS + e];
            }
        }
    }
    if (r < T) {
        const i64 row = seq + (i64)r * w + (i64)h * hd;
        ATTN_UNROLL
        for (int j = 0; j < ATTN_DPT; j++) {
            const int e = tx + 8 * j;
            if (e < hd) st(dqkv, gdt, row + e, dq[j]);
        }
    }
}
