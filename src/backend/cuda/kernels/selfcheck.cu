// Kernels that check the execution model itself (the SIMT emulator's warp
// primitives and barriers in `cargo test`; the same semantics on a GPU).
// The engine never launches them.

// out[3*t + 0..3] = the xor-1, down-3 and broadcast-5 shuffles of lane ids,
// then the block's sum of thread ids after a barrier.
extern "C" __global__ void selfcheck_warp_kernel(int* out, int* total) {
    __shared__ float scratch[32];
    int t = threadIdx.x;
    int lane = t % 32;
    out[3 * t + 0] = __shfl_xor_sync(0xffffffffu, lane, 1);
    out[3 * t + 1] = __shfl_down_sync(0xffffffffu, lane, 3);
    out[3 * t + 2] = __shfl_sync(0xffffffffu, lane, 5);
    float s = block_sum((float)t, scratch);
    if (t == 0) total[blockIdx.x] = (int)s;
}

// Threads below `skip` shuffle while the rest wait at a barrier: divergent
// warp and block barriers, undefined on a GPU and a reported deadlock in the
// emulator (launched only by the emulator's tests).
extern "C" __global__ void selfcheck_barrier_kernel(int* out, int skip) {
    int v = threadIdx.x;
    if ((int)threadIdx.x < skip)
        v = __shfl_xor_sync(0xffffffffu, v, 1);
    else
        __syncthreads();
    out[threadIdx.x] = v;
}
