// Shared by every kernel source. Header-free: NVRTC compiles it without any
// toolkit header, and the host build (MEMFIT_SIMT, see ../simt/simt.h) with
// the emulation header in front.
//
// Conventions, as in the cpu backend: buffers are flat, element counts are
// `long long`, 16-bit floats are stored as raw bits and converted here in
// software (round to nearest even, the same bits as the `half` crate), every
// kernel computes in fp32 registers and rounds once on store.

typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned char u8;
typedef long long i64;

// Element types, the discriminants of `DType` in src/backend/cuda/mod.rs.
#define DT_F32 0
#define DT_BF16 1
#define DT_F16 2

#ifdef MEMFIT_SIMT
#define DYNAMIC_SHARED(T, name) T* name = reinterpret_cast<T*>(simt::dyn_shared())
#else
#define DYNAMIC_SHARED(T, name) \
    extern __shared__ __align__(16) unsigned char name##_raw[]; \
    T* name = reinterpret_cast<T*>(name##_raw)
#endif

#define F32_INF __int_as_float(0x7f800000)
#define F32_NEG_INF __int_as_float(0xff800000)

__device__ __forceinline__ float bf16_to_f32(u16 h) { return __uint_as_float(((u32)h) << 16); }

__device__ __forceinline__ u16 f32_to_bf16(float f) {
    u32 x = __float_as_uint(f);
    if ((x & 0x7fffffffu) > 0x7f800000u) return (u16)((x >> 16) | 0x0040u);  // quiet NaN
    return (u16)((x + 0x7fffu + ((x >> 16) & 1u)) >> 16);
}

__device__ __forceinline__ float f16_to_f32(u16 h) {
    u32 sign = ((u32)(h & 0x8000u)) << 16;
    u32 exp = h & 0x7c00u;
    u32 man = h & 0x03ffu;
    if ((h & 0x7fffu) == 0) return __uint_as_float(sign);
    if (exp == 0x7c00u) {
        if (man == 0) return __uint_as_float(sign | 0x7f800000u);
        return __uint_as_float(sign | 0x7fc00000u | (man << 13));
    }
    if (exp == 0) {  // subnormal: man * 2^-24, leading one at bit p
        int p = 31 - __clz((int)man);
        return __uint_as_float(sign | ((u32)(p + 103) << 23) | ((man << (23 - p)) & 0x7fffffu));
    }
    return __uint_as_float(sign | (((exp >> 10) + 112u) << 23) | (man << 13));
}

__device__ __forceinline__ u16 f32_to_f16(float f) {
    u32 x = __float_as_uint(f);
    u32 sign = (x >> 16) & 0x8000u;
    u32 exp = x & 0x7f800000u;
    u32 man = x & 0x007fffffu;
    if (exp == 0x7f800000u) {
        u32 nan_bit = man == 0 ? 0u : 0x0200u;
        return (u16)(sign | 0x7c00u | nan_bit | (man >> 13));
    }
    int half_exp = (int)(exp >> 23) - 127 + 15;
    if (half_exp >= 0x1f) return (u16)(sign | 0x7c00u);
    if (half_exp <= 0) {
        if (14 - half_exp > 24) return (u16)sign;
        man |= 0x00800000u;
        u32 half_man = man >> (14 - half_exp);
        u32 round_bit = 1u << (13 - half_exp);
        if ((man & round_bit) != 0 && (man & (3u * round_bit - 1u)) != 0) half_man++;
        return (u16)(sign | half_man);
    }
    u32 h = sign | ((u32)half_exp << 10) | (man >> 13);
    u32 round_bit = 0x1000u;
    if ((man & round_bit) != 0 && (man & (3u * round_bit - 1u)) != 0) h++;
    return (u16)h;
}

// Element i of a float buffer of type dt, widened to fp32.
__device__ __forceinline__ float ld(const void* p, int dt, i64 i) {
    if (dt == DT_F32) return ((const float*)p)[i];
    if (dt == DT_BF16) return bf16_to_f32(((const u16*)p)[i]);
    return f16_to_f32(((const u16*)p)[i]);
}

// Stores v as element i of a float buffer of type dt, rounded once.
__device__ __forceinline__ void st(void* p, int dt, i64 i, float v) {
    if (dt == DT_F32)
        ((float*)p)[i] = v;
    else if (dt == DT_BF16)
        ((u16*)p)[i] = f32_to_bf16(v);
    else
        ((u16*)p)[i] = f32_to_f16(v);
}

// Sums over the 32 lanes of a warp; every lane gets the total.
__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

__device__ __forceinline__ double warp_sum_f64(double v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// Sum over a block whose size is a multiple of 32 (at most 1024); every thread
// gets the total. `scratch` is 32 floats of shared memory, free on entry and
// on return (the trailing barrier lets the caller reuse it at once).
__device__ __forceinline__ float block_sum(float v, float* scratch) {
    int lane = threadIdx.x % 32, warp = threadIdx.x / 32, nw = blockDim.x / 32;
    v = warp_sum(v);
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    float t = lane < nw ? scratch[lane] : 0.0f;
    t = warp_sum(t);
    __syncthreads();
    return t;
}

__device__ __forceinline__ float block_max(float v, float* scratch) {
    int lane = threadIdx.x % 32, warp = threadIdx.x / 32, nw = blockDim.x / 32;
    v = warp_max(v);
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    float t = lane < nw ? scratch[lane] : F32_NEG_INF;
    t = warp_max(t);
    __syncthreads();
    return t;
}

__device__ __forceinline__ double block_sum_f64(double v, double* scratch) {
    int lane = threadIdx.x % 32, warp = threadIdx.x / 32, nw = blockDim.x / 32;
    v = warp_sum_f64(v);
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    double t = lane < nw ? scratch[lane] : 0.0;
    t = warp_sum_f64(t);
    __syncthreads();
    return t;
}

// Grid-stride loop over [0, n).
#define FOR_EACH(i, n) \
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < (n); i += (i64)gridDim.x * blockDim.x)
