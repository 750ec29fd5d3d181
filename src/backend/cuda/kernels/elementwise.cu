// Elementwise kernels: fill, convert/copy, add, GELU, SwiGLU. One thread per
// element in a grid-stride loop; 16-bit buffers are read and written through
// ld/st (prelude.cuh), every result rounded once.

extern "C" __global__ void fill_kernel(void* buf, int dt, i64 n, float value) {
    FOR_EACH(i, n) st(buf, dt, i, value);
}

// dst[dst_off + i] = src[src_off + i] (or +=), converted to dst's type.
extern "C" __global__ void copy_slice_kernel(void* dst, int ddt, i64 dst_off, const void* src, int sdt,
                                             i64 src_off, i64 n, int accumulate) {
    FOR_EACH(i, n) {
        float v = ld(src, sdt, src_off + i);
        if (accumulate) v += ld(dst, ddt, dst_off + i);
        st(dst, ddt, dst_off + i, v);
    }
}

extern "C" __global__ void add_kernel(void* out, int odt, const void* a, int adt, const void* b, int bdt, i64 n) {
    FOR_EACH(i, n) st(out, odt, i, ld(a, adt, i) + ld(b, bdt, i));
}

// The cpu backend's sigmoid: 1 / (1 + exp(-z)).
__device__ __forceinline__ float sigmoidf_(float z) { return 1.0f / (1.0f + expf(-z)); }

// tanh-approximated GELU as x * sigmoid(2u), u = sqrt(2/pi) (x + 0.044715 x^3)
// (Hendrycks & Gimpel 2016; the identity 0.5 (1 + tanh u) = sigmoid(2u)).
#define GELU_SCALE 0.7978846f
#define GELU_CUBE 0.044715f

extern "C" __global__ void gelu_forward_kernel(void* out, int odt, const void* inp, int idt, i64 n) {
    FOR_EACH(i, n) {
        float x = ld(inp, idt, i);
        float u = GELU_SCALE * (x + GELU_CUBE * x * x * x);
        st(out, odt, i, x * sigmoidf_(2.0f * u));
    }
}

// In place: dout *= gelu'(inp).
extern "C" __global__ void gelu_backward_kernel(void* dout, int ddt, const void* inp, int idt, i64 n) {
    FOR_EACH(i, n) {
        float x = ld(inp, idt, i);
        float u = GELU_SCALE * (x + GELU_CUBE * x * x * x);
        float du = GELU_SCALE * (1.0f + 3.0f * GELU_CUBE * x * x);
        float s = sigmoidf_(2.0f * u);
        st(dout, ddt, i, ld(dout, ddt, i) * (s + 2.0f * x * s * (1.0f - s) * du));
    }
}

// out (N,I) = silu(gu[:, :I]) * gu[:, I:].
extern "C" __global__ void swiglu_forward_kernel(void* out, int odt, const void* gu, int gdt, i64 n, i64 inner) {
    FOR_EACH(idx, n * inner) {
        i64 r = idx / inner, j = idx % inner;
        float g = ld(gu, gdt, r * 2 * inner + j);
        float u = ld(gu, gdt, r * 2 * inner + inner + j);
        st(out, odt, idx, g * sigmoidf_(g) * u);
    }
}

// dgu (N,2I) from dout (N,I): silu'(g) = s (1 + g (1 - s)), s = sigmoid(g).
extern "C" __global__ void swiglu_backward_kernel(void* dgu, int ddt, const void* dout, int odt, const void* gu,
                                                  int gdt, i64 n, i64 inner) {
    FOR_EACH(idx, n * inner) {
        i64 r = idx / inner, j = idx % inner;
        float dy = ld(dout, odt, idx);
        float g = ld(gu, gdt, r * 2 * inner + j);
        float u = ld(gu, gdt, r * 2 * inner + inner + j);
        float s = sigmoidf_(g);
        st(dgu, ddt, r * 2 * inner + j, dy * u * s * (1.0f + g * (1.0f - s)));
        st(dgu, ddt, r * 2 * inner + inner + j, dy * g * s);
    }
}
