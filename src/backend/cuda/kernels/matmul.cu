// The matmul's non-GEMM parts: the bias seeded into the output before cuBLAS
// accumulates onto it, and the bias gradient's column sums.

// out (N,OC) row r := bias (OC).
extern "C" __global__ void bias_seed_kernel(void* out, int odt, const void* bias, int bdt, i64 n, i64 oc) {
    FOR_EACH(idx, n * oc) st(out, odt, idx, ld(bias, bdt, idx % oc));
}

// dbias (OC) += sum over rows of dout (N,OC). Block (32, 8): threadIdx.x picks
// a column of the block's 32, threadIdx.y a row lane; each lane sums its rows
// in order, then the 8 lane sums are added in lane order. Deterministic.
extern "C" __global__ void bias_grad_kernel(void* dbias, int bdt, const void* dout, int odt, i64 n, i64 oc) {
    __shared__ float part[8][33];
    i64 col = (i64)blockIdx.x * 32 + threadIdx.x;
    float acc = 0.0f;
    if (col < oc)
        for (i64 r = threadIdx.y; r < n; r += 8) acc += ld(dout, odt, r * oc + col);
    part[threadIdx.y][threadIdx.x] = acc;
    __syncthreads();
    if (threadIdx.y == 0 && col < oc) {
        float s = 0.0f;
        for (int j = 0; j < 8; j++) s += part[j][threadIdx.x];
        st(dbias, bdt, col, ld(dbias, bdt, col) + s);
    }
}
