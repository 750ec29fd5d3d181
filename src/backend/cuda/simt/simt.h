// SIMT emulation for running memfit's CUDA kernels on the host.
//
// The kernel sources under ../kernels are compiled twice: by NVRTC for the GPU,
// and by the host C++ compiler with this header included first. Here a CUDA
// block is a set of fibers (coroutines; a few lines of assembly switch them on
// x86-64, ucontext elsewhere) on one OS thread, one fiber per
// CUDA thread; `__syncthreads()` and the warp-level primitives are scheduling
// points. A fiber runs until it reaches a barrier, then the next one runs, so a
// block behaves as if its threads ran in lock-step between barriers, which is
// the only guarantee CUDA gives. Blocks of one launch run on several OS threads
// (`memfit_simt_launch`), so shared memory is `static thread_local`.
//
// What it checks that a GPU would not report: a barrier some threads of a block
// never reach (a deadlock on the GPU) and warp shuffles executed by only part of
// a warp are reported as launch errors instead of hanging.
#pragma once

#include <math.h>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>

struct uint3 {
    unsigned int x, y, z;
};
struct dim3 {
    unsigned int x, y, z;
};

namespace simt {

struct Thread {
    uint3 tid;
    uint3 bid;
    dim3 bdim;
    dim3 gdim;
    unsigned int linear;  // x + y*bdim.x + z*bdim.x*bdim.y
};

extern thread_local Thread* cur;

void syncthreads();
void syncwarp();
// Exchanges 64-bit values within the current warp: returns the value lane
// `src` passed (every lane of the warp must call it).
unsigned long long exchange(unsigned long long mine, unsigned int src);
void* dyn_shared();
unsigned int lane();

template <class T>
inline unsigned long long to_bits(T v) {
    static_assert(sizeof(T) <= 8, "shuffle of a value wider than 64 bits");
    unsigned long long b = 0;
    std::memcpy(&b, &v, sizeof(T));
    return b;
}
template <class T>
inline T from_bits(unsigned long long b) {
    T v;
    std::memcpy(&v, &b, sizeof(T));
    return v;
}

}  // namespace simt

#define threadIdx (simt::cur->tid)
#define blockIdx (simt::cur->bid)
#define blockDim (simt::cur->bdim)
#define gridDim (simt::cur->gdim)
#define warpSize 32

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __noinline__
#define __restrict__ __restrict
#define __shared__ static thread_local
// Constant memory is an ordinary global here (kernels only read it).
#define __constant__
#define __align__(n) alignas(n)
#define __launch_bounds__(...)

inline void __syncthreads() { simt::syncthreads(); }
inline void __syncwarp(unsigned int = 0xffffffffu) { simt::syncwarp(); }

template <class T>
inline T __shfl_xor_sync(unsigned int, T v, int lane_mask, int width = 32) {
    unsigned int l = simt::lane();
    unsigned int src = l ^ (unsigned int)lane_mask;
    if (src / (unsigned)width != l / (unsigned)width) src = l;
    return simt::from_bits<T>(simt::exchange(simt::to_bits(v), src));
}
template <class T>
inline T __shfl_down_sync(unsigned int, T v, unsigned int delta, int width = 32) {
    unsigned int l = simt::lane();
    unsigned int src = (l % width) + delta < (unsigned)width ? l + delta : l;
    return simt::from_bits<T>(simt::exchange(simt::to_bits(v), src));
}
template <class T>
inline T __shfl_sync(unsigned int, T v, int src_lane, int width = 32) {
    unsigned int l = simt::lane();
    unsigned int src = (l / width) * width + ((unsigned)src_lane % width);
    return simt::from_bits<T>(simt::exchange(simt::to_bits(v), src));
}

inline float __uint_as_float(unsigned int u) { return simt::from_bits<float>(u); }
inline unsigned int __float_as_uint(float f) { return (unsigned int)simt::to_bits(f); }
inline float __int_as_float(int u) { return simt::from_bits<float>((unsigned int)u); }
inline int __float_as_int(float f) { return (int)(unsigned int)simt::to_bits(f); }
inline int __clz(int x) { return x == 0 ? 32 : __builtin_clz((unsigned)x); }
inline float rsqrtf(float x) { return 1.0f / std::sqrt(x); }
inline float __expf(float x) { return std::exp(x); }
inline float __logf(float x) { return std::log(x); }
inline float __fdividef(float a, float b) { return a / b; }
inline float __saturatef(float x) { return x < 0.f ? 0.f : (x > 1.f ? 1.f : x); }
inline void __sincosf(float x, float* s, float* c) { *s = std::sin(x); *c = std::cos(x); }
inline void sincosf(float x, float* s, float* c) { *s = std::sin(x); *c = std::cos(x); }
inline void sincos(double x, double* s, double* c) { *s = std::sin(x); *c = std::cos(x); }
// expf, logf, sqrtf, ... come from <math.h> in the global namespace, as on the GPU.
using std::isfinite; using std::isinf; using std::isnan;

template <class T>
inline T __ldg(const T* p) { return *p; }

// Atomics: blocks of one launch run concurrently on OS threads.
inline float atomicAdd(float* p, float v) {
    unsigned int* u = reinterpret_cast<unsigned int*>(p);
    unsigned int old = __atomic_load_n(u, __ATOMIC_RELAXED);
    for (;;) {
        unsigned int next = (unsigned int)simt::to_bits(simt::from_bits<float>(old) + v);
        if (__atomic_compare_exchange_n(u, &old, next, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST))
            return simt::from_bits<float>(old);
    }
}
inline int atomicAdd(int* p, int v) { return __atomic_fetch_add(p, v, __ATOMIC_SEQ_CST); }
inline unsigned int atomicAdd(unsigned int* p, unsigned int v) { return __atomic_fetch_add(p, v, __ATOMIC_SEQ_CST); }
inline unsigned int atomicMax(unsigned int* p, unsigned int v) {
    unsigned int old = __atomic_load_n(p, __ATOMIC_RELAXED);
    while (old < v && !__atomic_compare_exchange_n(p, &old, v, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST)) {
    }
    return old;
}
inline void __threadfence() { __atomic_thread_fence(__ATOMIC_SEQ_CST); }
