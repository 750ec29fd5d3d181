// The SIMT emulator's C interface: what the emulated driver (emu.rs, through
// Rust's FFI) and the C-level CUDA double (tests/cuda_double) call. Defined
// in simt.cpp.
#pragma once
#include <cstddef>

extern "C" {
unsigned int memfit_simt_kernel_count();
const char* memfit_simt_kernel_name(unsigned int i);
// Argument kinds, one letter a parameter: P(ointer), L (i64), I (i32), U (u32), F (f32).
const char* memfit_simt_kernel_args(unsigned int i);
// Index of the kernel named `name`, or -1.
int memfit_simt_kernel_index(const char* name);
// The launch limits of sm_80 and newer: 0, or 1 with `err` filled.
int memfit_simt_check(unsigned int k, const unsigned* grid, const unsigned* block, size_t shmem, char* err,
                      size_t errlen);
// One launch, as cuLaunchKernel takes it (`args[i]` points at parameter i):
// 0, 1 when refused by the limits, 2 on a fault the emulation detects.
int memfit_simt_launch(unsigned int k, const unsigned* grid, const unsigned* block, size_t shmem, void** args,
                       unsigned threads, char* err, size_t errlen);
// Device memory between guard pages.
void* memfit_simt_alloc(size_t bytes);
void memfit_simt_free(void* p, size_t bytes);

// A strided batched GEMM with cuBLAS's column-major conventions (see
// `driver::Gemm`); types are the DT_* codes of prelude.cuh.
struct MemfitGemm {
    int transa, transb;
    long long m, n, k;
    float alpha;
    const void* a;
    long long lda, stride_a;
    const void* b;
    long long ldb, stride_b;
    int ab_type;
    float beta;
    void* c;
    long long ldc, stride_c;
    int c_type;
    long long batch;
};
void memfit_simt_gemm(const MemfitGemm* g, unsigned threads);
// Element i of a DT_* buffer as f32, and back (rounded to nearest even).
float memfit_simt_to_f32(const void* p, int t, long long i);
void memfit_simt_from_f32(void* p, int t, long long i, float v);
}
