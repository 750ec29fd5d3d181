// Optimizer steps: AdamW, 8-bit AdamW (blockwise dynamic quantisation), SGD,
// Adafactor. Each follows the cpu backend (cpu/mod.rs `adamw_update`,
// cpu/optim.rs) operation for operation, so the results agree bit for bit
// where the order of a reduction is not involved: the multiply-adds are
// written with opt_mul/opt_add, which the GPU build maps to __fmul_rn /
// __fadd_rn so NVRTC (--fmad=true) cannot contract them into FMAs the cpu does
// not do. Division and sqrtf are IEEE (prec_div, prec_sqrt).
//
// Reductions are deterministic: per-block f64 partial sums (fixed grid, fixed
// lane order) written to the backend's scratch and added in block order on the
// host; no float atomics.

#ifdef MEMFIT_SIMT
__device__ __forceinline__ float opt_mul(float a, float b) { return a * b; }
__device__ __forceinline__ float opt_add(float a, float b) { return a + b; }
#else
__device__ __forceinline__ float opt_mul(float a, float b) { return __fmul_rn(a, b); }
__device__ __forceinline__ float opt_add(float a, float b) { return __fadd_rn(a, b); }
#endif
__device__ __forceinline__ float opt_sub(float a, float b) { return opt_add(a, -b); }

// ----------------------------------------------------------------------------
// AdamW

// The cpu's AdamW on one element: p, m, v in fp32 registers, updated in place.
__device__ __forceinline__ void opt_adamw_elem(float& p, float& m, float& v, float g, float lr, float beta1,
                                               float beta2, float eps, float wd, float m_corr, float v_corr,
                                               float grad_scale) {
    g = opt_mul(g, grad_scale);
    m = opt_add(opt_mul(beta1, m), opt_mul(1.0f - beta1, g));
    v = opt_add(opt_mul(beta2, v), opt_mul(opt_mul(1.0f - beta2, g), g));
    float m_hat = opt_mul(m, m_corr);
    float v_hat = opt_mul(v, v_corr);
    float step = opt_add(m_hat / opt_add(sqrtf(v_hat), eps), opt_mul(wd, p));
    p = opt_sub(p, opt_mul(lr, step));
}

// Grid-stride over n elements; every buffer has its own float type.
extern "C" __global__ void opt_adamw_kernel(void* param, int pdt, const void* grad, int gdt, void* m, int mdt, void* v,
                                            int vdt, i64 n, float lr, float beta1, float beta2, float eps, float wd,
                                            float m_corr, float v_corr, float grad_scale) {
    FOR_EACH(i, n) {
        float p = ld(param, pdt, i), mi = ld(m, mdt, i), vi = ld(v, vdt, i);
        opt_adamw_elem(p, mi, vi, ld(grad, gdt, i), lr, beta1, beta2, eps, wd, m_corr, v_corr, grad_scale);
        st(m, mdt, i, mi);
        st(v, vdt, i, vi);
        st(param, pdt, i, p);
    }
}

// ----------------------------------------------------------------------------
// 8-bit AdamW

// cpu/optim.rs `quantize`: the index of the entry of the ascending 256-entry
// `map` nearest to x, ties to the lower index, clamped to the ends; NaN gets
// `zero`. c = number of entries < x by binary lifting, then the nearer of
// map[c-1], map[c] with the distances in f64 (exact for two f32 in [-1, 1]).
__device__ __forceinline__ u8 opt_quantize(const float* map, float x, u8 zero) {
    if (x != x) return zero;
    int c = 0;
    for (int s = 128; s > 0; s >>= 1)
        if (map[c + s - 1] < x) c += s;
    if (map[c] < x) c += 1;
    if (c == 0) return 0;
    if (c == 256) return 255;
    double lo = (double)map[c - 1], hi = (double)map[c], xd = (double)x;
    return (hi - xd < xd - lo) ? (u8)c : (u8)(c - 1);
}

// One block of 256 threads per 256-element quantisation block (grid-stride
// over blocks when there are more than the grid): thread t owns element
// b*256 + t. Dequantise (a fresh state, absmax 0, gives 0), AdamW in fp32 as
// above, the block's new absmax by a max-reduction (fmaxf ignores NaN like
// f32::max; the cpu starts from 0), then requantise state/absmax. `maps` is the
// signed map followed by the unsigned one (512 f32 in the backend's scratch).
extern "C" __global__ void opt_adamw8bit_kernel(void* param, int pdt, const void* grad, int gdt, u8* mq, u8* vq,
                                                void* m_absmax, int madt, void* v_absmax, int vadt,
                                                const float* maps, i64 n, float lr, float beta1, float beta2,
                                                float eps, float wd, float m_corr, float v_corr, float grad_scale) {
    __shared__ float smap[256];
    __shared__ float umap[256];
    __shared__ float red[32];
    smap[threadIdx.x] = maps[threadIdx.x];
    umap[threadIdx.x] = maps[256 + threadIdx.x];
    __syncthreads();
    i64 nb = (n + 255) / 256;
    for (i64 b = blockIdx.x; b < nb; b += gridDim.x) {
        i64 j = b * 256 + threadIdx.x;
        bool valid = j < n;
        float m_scale = ld(m_absmax, madt, b), v_scale = ld(v_absmax, vadt, b);
        float mf = 0.0f, vf = 0.0f;
        if (valid) {
            float p = ld(param, pdt, j);
            mf = opt_mul(smap[mq[j]], m_scale);
            vf = opt_mul(umap[vq[j]], v_scale);
            opt_adamw_elem(p, mf, vf, ld(grad, gdt, j), lr, beta1, beta2, eps, wd, m_corr, v_corr, grad_scale);
            st(param, pdt, j, p);
        }
        float m_max = fmaxf(block_max(valid ? fabsf(mf) : 0.0f, red), 0.0f);
        float v_max = fmaxf(block_max(valid ? vf : 0.0f, red), 0.0f);
        if (threadIdx.x == 0) {
            st(m_absmax, madt, b, m_max);
            st(v_absmax, vadt, b, v_max);
        }
        if (valid) {
            // absmax 0 -> 0/0 = NaN -> the code of 0 (127 signed, 0 unsigned)
            mq[j] = opt_quantize(smap, mf / m_max, 127);
            vq[j] = opt_quantize(umap, vf / v_max, 0);
        }
    }
}

// ----------------------------------------------------------------------------
// SGD

// PyTorch SGD (no dampening, no Nesterov). With use_momentum 0 the buffer is
// never touched (it may be empty).
extern "C" __global__ void opt_sgd_kernel(void* param, int pdt, const void* grad, int gdt, void* buf, int bdt, i64 n,
                                          float lr, float momentum, float wd, float grad_scale, int use_momentum) {
    FOR_EACH(i, n) {
        float p = ld(param, pdt, i);
        float g = opt_add(opt_mul(ld(grad, gdt, i), grad_scale), opt_mul(wd, p));
        if (use_momentum) {
            float b = opt_add(opt_mul(momentum, ld(buf, bdt, i)), g);
            st(buf, bdt, i, b);
            g = b;
        }
        st(param, pdt, i, opt_sub(p, opt_mul(lr, g)));
    }
}

// ----------------------------------------------------------------------------
// Adafactor

// u = g^2 + eps1 with g = x*grad_scale, in f32 (the cpu's closure `u`).
__device__ __forceinline__ float opt_af_u(float x, float gs, float eps1) {
    float g = opt_mul(x, gs);
    return opt_add(opt_mul(g, g), eps1);
}

// beta2t*s + (1-beta2t)*mean
__device__ __forceinline__ float opt_af_ema(float s, float mean, float beta2t) {
    return opt_add(opt_mul(beta2t, s), opt_mul(1.0f - beta2t, mean));
}

// partials[blockIdx.x] = sum over this block's grid-stride share of x (or x^2)
// in f64; the host adds the gridDim.x partials in order.
extern "C" __global__ void opt_sum_kernel(double* partials, const void* x, int dt, i64 n, int square) {
    __shared__ double red[32];
    double acc = 0.0;
    FOR_EACH(i, n) {
        double v = (double)ld(x, dt, i);
        acc += square ? v * v : v;
    }
    acc = block_sum_f64(acc, red);
    if (threadIdx.x == 0) partials[blockIdx.x] = acc;
}

// Factored second moment, row part: one block per row (grid-stride over rows),
// row[i] = ema(row[i], mean over cols of u), the sum in f64.
extern "C" __global__ void opt_adafactor_row_kernel(void* row, int rdt, const void* grad, int gdt, i64 rows, i64 cols,
                                                    float gs, float eps1, float beta2t) {
    __shared__ double red[32];
    for (i64 r = blockIdx.x; r < rows; r += gridDim.x) {
        double acc = 0.0;
        for (i64 j = threadIdx.x; j < cols; j += blockDim.x)
            acc += (double)opt_af_u(ld(grad, gdt, r * cols + j), gs, eps1);
        acc = block_sum_f64(acc, red);
        if (threadIdx.x == 0) st(row, rdt, r, opt_af_ema(ld(row, rdt, r), (float)(acc / (double)cols), beta2t));
    }
}

// Factored second moment, column part: block (32, 32) covers 32 columns;
// threadIdx.x picks the column, threadIdx.y a row lane that walks rows
// y, y+32, ... in order (coalesced: a warp reads 32 adjacent columns of one
// row); the 32 lane sums are added in lane order by thread y = 0.
extern "C" __global__ void opt_adafactor_col_kernel(void* col, int cdt, const void* grad, int gdt, i64 rows, i64 cols,
                                                    float gs, float eps1, float beta2t) {
    __shared__ double part[32][33];
    i64 j = (i64)blockIdx.x * 32 + threadIdx.x;
    double acc = 0.0;
    if (j < cols)
        for (i64 r = threadIdx.y; r < rows; r += 32) acc += (double)opt_af_u(ld(grad, gdt, r * cols + j), gs, eps1);
    part[threadIdx.y][threadIdx.x] = acc;
    __syncthreads();
    if (threadIdx.y == 0 && j < cols) {
        double s = 0.0;
        for (int k = 0; k < 32; k++) s += part[k][threadIdx.x];
        st(col, cdt, j, opt_af_ema(ld(col, cdt, j), (float)(s / (double)rows), beta2t));
    }
}

// The raw (unclipped) update of element idx: factored
// (rsqrt(row[i]/row_mean) * rsqrt(col[j])) * g, full rsqrt(v[idx]) * g, with
// rsqrt(x) = 1/sqrtf(x) as the cpu computes it.
__device__ __forceinline__ float opt_af_update(const void* s1, int s1dt, const void* s2, int s2dt, i64 idx, i64 cols,
                                               int factored, float x, float gs, float row_mean) {
    float g = opt_mul(x, gs);
    if (factored) {
        i64 i = idx / cols, j = idx - i * cols;
        float rf = 1.0f / sqrtf(ld(s1, s1dt, i) / row_mean);
        float cf = 1.0f / sqrtf(ld(s2, s2dt, j));
        return opt_mul(opt_mul(rf, cf), g);
    }
    return opt_mul(1.0f / sqrtf(ld(s1, s1dt, idx)), g);
}

// Pass 1, factored: partials of sum(update^2) (f64), grid-stride.
extern "C" __global__ void opt_adafactor_rms_kernel(double* partials, const void* grad, int gdt, const void* row,
                                                    int rdt, const void* col, int cdt, i64 n, i64 cols, float gs,
                                                    float row_mean) {
    __shared__ double red[32];
    double acc = 0.0;
    FOR_EACH(idx, n) {
        double w = (double)opt_af_update(row, rdt, col, cdt, idx, cols, 1, ld(grad, gdt, idx), gs, row_mean);
        acc += w * w;
    }
    acc = block_sum_f64(acc, red);
    if (threadIdx.x == 0) partials[blockIdx.x] = acc;
}

// Pass 1, full: v = ema(v, u) and the partials of sum(update^2), update =
// rsqrt(v_new)*g (v_new as stored when v is f32).
extern "C" __global__ void opt_adafactor_full_kernel(double* partials, void* v, int vdt, const void* grad, int gdt,
                                                     i64 n, float gs, float eps1, float beta2t) {
    __shared__ double red[32];
    double acc = 0.0;
    FOR_EACH(i, n) {
        float x = ld(grad, gdt, i);
        float vi = opt_af_ema(ld(v, vdt, i), opt_af_u(x, gs, eps1), beta2t);
        st(v, vdt, i, vi);
        double w = (double)opt_mul(1.0f / sqrtf(vi), opt_mul(x, gs));
        acc += w * w;
    }
    acc = block_sum_f64(acc, red);
    if (threadIdx.x == 0) partials[blockIdx.x] = acc;
}

// Pass 2 (cpu `finish`): recompute the update, clip, scale by lr, optional
// first moment, weight decay from the param's own value, param -= update.
extern "C" __global__ void opt_adafactor_finish_kernel(void* param, int pdt, void* m, int mdt, const void* grad, int gdt,
                                                       const void* s1, int s1dt, const void* s2, int s2dt, i64 n,
                                                       i64 cols, int factored, int has_m, float gs, float row_mean,
                                                       float clip_div, float lr, float beta1, float neg_wd_lr) {
    FOR_EACH(idx, n) {
        float u = opt_af_update(s1, s1dt, s2, s2dt, idx, cols, factored, ld(grad, gdt, idx), gs, row_mean);
        u = opt_mul(u / clip_div, lr);
        if (has_m) {
            u = opt_add(opt_mul(beta1, ld(m, mdt, idx)), opt_mul(1.0f - beta1, u));
            st(m, mdt, idx, u);
        }
        float p = ld(param, pdt, idx);
        if (neg_wd_lr != 0.0f) p = opt_add(p, opt_mul(neg_wd_lr, p));
        st(param, pdt, idx, opt_sub(p, u));
    }
}
