// QLoRA's NF4 dequantisation: a weight stored in `nf4::Nf4::to_bytes`'s layout
// (src/nf4.rs) into a float buffer, value for value the cpu backend's
// `nf4::dequantize_bytes` and one rounding to the output's type.
//
// Layout of `numel` values, bytes from the start of the buffer:
//   packed codes  ceil(numel/2)   value 2k in the high nibble, 2k+1 in the low
//   absmax codes  blocks          int8, one per 64 values (blocks = ceil(numel/64))
//   group scales  4 * groups      fp32 little-endian, one per 256 blocks
//   mean          4               fp32 little-endian
// The scales and the mean follow byte-sized sections, so they are not 4-byte
// aligned in general: they are read a byte at a time.
//
// absmax = code * scale + mean, rounded after the multiply and after the add
// as the cpu computes it (nf4_mul/nf4_add: __fmul_rn/__fadd_rn on the GPU, so
// NVRTC's --fmad=true cannot fuse them into one FMA); value = NF4[c] * absmax.

#define NF4_BLOCK 64
#define NF4_ABSMAX_BLOCK 256

// The 16 NF4 values (nf4::NF4, QLoRA Appendix E); every literal is an exact
// f32.
__constant__ float NF4_VALUES[16] = {
    -1.0f,
    -0.6961928009986877f,
    -0.5250730514526367f,
    -0.39491748809814453f,
    -0.28444138169288635f,
    -0.18477343022823334f,
    -0.09105003625154495f,
    0.0f,
    0.07958029955625534f,
    0.16093020141124725f,
    0.24611230194568634f,
    0.33791524171829224f,
    0.44070982933044434f,
    0.5626170039176941f,
    0.7229568362236023f,
    1.0f,
};

#ifdef MEMFIT_SIMT
__device__ __forceinline__ float nf4_mul(float a, float b) { return a * b; }
__device__ __forceinline__ float nf4_add(float a, float b) { return a + b; }
#else
__device__ __forceinline__ float nf4_mul(float a, float b) { return __fmul_rn(a, b); }
__device__ __forceinline__ float nf4_add(float a, float b) { return __fadd_rn(a, b); }
#endif

// A little-endian fp32 at any byte offset.
__device__ __forceinline__ float nf4_f32_at(const u8* p) {
    return __uint_as_float((u32)p[0] | ((u32)p[1] << 8) | ((u32)p[2] << 16) | ((u32)p[3] << 24));
}

// out[0..numel) from the layout at src. One thread per packed byte (two
// values, always in the same 64-block since 64 is even), grid-stride.
extern "C" __global__ void nf4_dequantize_kernel(void* out, int odt, const u8* src, i64 numel) {
    i64 pairs = (numel + 1) / 2;
    i64 blocks = (numel + NF4_BLOCK - 1) / NF4_BLOCK;
    i64 groups = (blocks + NF4_ABSMAX_BLOCK - 1) / NF4_ABSMAX_BLOCK;
    const u8* codes = src + pairs;
    const u8* scales = codes + blocks;
    float mean = nf4_f32_at(scales + 4 * groups);
    FOR_EACH(p, pairs) {
        i64 i = 2 * p;
        i64 b = i / NF4_BLOCK;
        float scale = nf4_f32_at(scales + 4 * (b / NF4_ABSMAX_BLOCK));
        float absmax = nf4_add(nf4_mul((float)(signed char)codes[b], scale), mean);
        u32 byte = src[p];
        st(out, odt, i, NF4_VALUES[byte >> 4] * absmax);
        if (i + 1 < numel) st(out, odt, i + 1, NF4_VALUES[byte & 0x0fu] * absmax);
    }
}
