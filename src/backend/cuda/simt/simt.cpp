// The SIMT emulator's scheduler, launcher and guarded allocator (see simt.h).
// build.rs compiles this file together with every kernel source and a
// generated table of the kernels, into a static library the emulated cuda
// driver (src/backend/cuda/emu.rs) calls.
#include "simt.h"
#include "simt_api.h"

#include <sys/mman.h>
#include <ucontext.h>
#include <unistd.h>

#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <mutex>
#include <thread>
#include <utility>
#include <vector>

namespace simt {

thread_local Thread* cur = nullptr;

namespace {

enum State : unsigned char { RUN, WAIT_BLOCK, WAIT_WARP, DONE };

#if defined(__x86_64__)
// A fiber switch that saves what the System V ABI says a call preserves
// (rbx, rbp, r12-r15, the SSE and x87 control words) and the stack pointer,
// and nothing else. swapcontext also saves and restores the signal mask, a
// system call each way, which made the system calls most of the
// emulation's time (and they are slow under a sandboxing kernel).
extern "C" void memfit_simt_switch(void** save_sp, void* load_sp);
asm(R"(
    .text
    .p2align 4
    .type memfit_simt_switch,@function
memfit_simt_switch:
    pushq %rbp
    pushq %rbx
    pushq %r12
    pushq %r13
    pushq %r14
    pushq %r15
    subq $8, %rsp
    stmxcsr (%rsp)
    fnstcw 4(%rsp)
    movq %rsp, (%rdi)
    movq %rsi, %rsp
    ldmxcsr (%rsp)
    fldcw 4(%rsp)
    addq $8, %rsp
    popq %r15
    popq %r14
    popq %r13
    popq %r12
    popq %rbx
    popq %rbp
    ret
    .size memfit_simt_switch, .-memfit_simt_switch
    .section .note.GNU-stack,"",@progbits
    .text
)");

struct Ctx {
    void* sp = nullptr;
};

inline void ctx_switch(Ctx* from, Ctx* to) { memfit_simt_switch(&from->sp, to->sp); }

// A context that starts `fn` (which never returns) on `stack`: the frame
// memfit_simt_switch pops, with `fn` as its return address.
void ctx_make(Ctx* c, char* stack, size_t size, void (*fn)()) {
    void** sp = reinterpret_cast<void**>(reinterpret_cast<uintptr_t>(stack + size) & ~uintptr_t(15));
    *--sp = nullptr;                       // fn's return address: it never returns
    *--sp = reinterpret_cast<void*>(fn);   // where the first switch returns to
    for (int i = 0; i < 6; i++) *--sp = nullptr;  // rbp, rbx, r12-r15
    --sp;
    uint32_t cw[2] = {0x1F80, 0x037F};  // MXCSR and x87 control word at reset
    std::memcpy(sp, cw, sizeof cw);
    c->sp = sp;
}
#else
struct Ctx {
    ucontext_t uc;
};

inline void ctx_switch(Ctx* from, Ctx* to) { swapcontext(&from->uc, &to->uc); }

void ctx_make(Ctx* c, char* stack, size_t size, void (*fn)()) {
    getcontext(&c->uc);
    c->uc.uc_stack.ss_sp = stack;
    c->uc.uc_stack.ss_size = size;
    c->uc.uc_link = nullptr;
    makecontext(&c->uc, fn, 0);
}
#endif

// Kernels keep small per-thread arrays; 64 KiB leaves room for libm.
constexpr size_t STACK_BYTES = 64 * 1024;

struct Fiber {
    Ctx ctx;
    Thread t;
    State st;
    unsigned long long slot;
};

struct Worker {
    Ctx main;
    std::vector<Fiber> fibers;
    std::vector<char*> stacks;
    std::vector<unsigned char> dyn;
    Fiber* running = nullptr;
    void (*run)(void**) = nullptr;
    void** args = nullptr;
    ~Worker() {
        for (char* s : stacks) std::free(s);
    }
};

thread_local Worker W;

void entry() {
    Worker& w = W;
    w.run(w.args);
    w.running->st = DONE;
    ctx_switch(&w.running->ctx, &w.main);
    std::abort();  // a finished fiber is never resumed
}

void yield(State s) {
    Fiber* f = W.running;
    f->st = s;
    ctx_switch(&f->ctx, &W.main);
}

// Runs one block to completion. Returns 0, or 1 with `err` filled.
int run_block(uint3 bid, dim3 bdim, dim3 gdim, size_t shmem, char* err, size_t errlen) {
    Worker& w = W;
    const unsigned n = bdim.x * bdim.y * bdim.z;
    while (w.stacks.size() < n) {
        char* s = static_cast<char*>(std::malloc(STACK_BYTES));
        if (!s) {
            std::snprintf(err, errlen, "out of host memory for %u fiber stacks", n);
            return 1;
        }
        w.stacks.push_back(s);
    }
    w.fibers.resize(n);
    // Uninitialised dynamic shared memory reads as NaN (0xff bytes), so a
    // kernel that reads before it writes fails its comparison.
    w.dyn.assign(shmem, 0xff);
    for (unsigned i = 0; i < n; i++) {
        Fiber& f = w.fibers[i];
        f.t.tid = uint3{i % bdim.x, (i / bdim.x) % bdim.y, i / (bdim.x * bdim.y)};
        f.t.bid = bid;
        f.t.bdim = bdim;
        f.t.gdim = gdim;
        f.t.linear = i;
        f.st = RUN;
        ctx_make(&f.ctx, w.stacks[i], STACK_BYTES, entry);
    }
    const unsigned nwarps = (n + 31) / 32;
    for (;;) {
        for (unsigned i = 0; i < n; i++) {
            Fiber& f = w.fibers[i];
            if (f.st == RUN) {
                w.running = &f;
                cur = &f.t;
                ctx_switch(&w.main, &f.ctx);
            }
        }
        bool released = false;
        unsigned live = 0, at_block = 0;
        for (unsigned wi = 0; wi < nwarps; wi++) {
            unsigned lo = wi * 32, hi = lo + 32 < n ? lo + 32 : n;
            unsigned wl = 0, ww = 0, wd = 0;
            for (unsigned i = lo; i < hi; i++) {
                State s = w.fibers[i].st;
                wl += s != DONE;
                ww += s == WAIT_WARP;
                wd += s == DONE;
                at_block += s == WAIT_BLOCK;
            }
            live += wl;
            if (ww > 0 && ww == wl) {
                if (wd > 0) {
                    std::snprintf(err, errlen,
                                  "block (%u,%u,%u) warp %u: %u lanes meet at a warp primitive that %u "
                                  "exited lanes never reach",
                                  bid.x, bid.y, bid.z, wi, ww, wd);
                    return 1;
                }
                for (unsigned i = lo; i < hi; i++) w.fibers[i].st = RUN;
                released = true;
            }
        }
        if (released) continue;
        if (live == 0) return 0;
        if (at_block == live) {
            for (unsigned i = 0; i < n; i++)
                if (w.fibers[i].st == WAIT_BLOCK) w.fibers[i].st = RUN;
            continue;
        }
        std::snprintf(err, errlen,
                      "block (%u,%u,%u): deadlock, %u of %u live threads wait at __syncthreads while "
                      "the others wait at a warp primitive part of their warp never reaches",
                      bid.x, bid.y, bid.z, at_block, live);
        return 1;
    }
}

}  // namespace

void syncthreads() { yield(WAIT_BLOCK); }
void syncwarp() { yield(WAIT_WARP); }
unsigned int lane() { return cur->linear % 32; }
void* dyn_shared() { return W.dyn.data(); }

unsigned long long exchange(unsigned long long mine, unsigned int src) {
    Fiber* f = W.running;
    f->slot = mine;
    yield(WAIT_WARP);
    unsigned int me = f->t.linear;
    unsigned int from = me - me % 32 + src;
    unsigned long long v = from < W.fibers.size() ? W.fibers[from].slot : mine;
    yield(WAIT_WARP);  // nobody overwrites its slot before every lane has read
    return v;
}

int run_blocks(void (*run)(void**), const unsigned* grid, const unsigned* block, size_t shmem, void** args,
               unsigned long long begin, unsigned long long end, char* err, size_t errlen) {
    Worker& w = W;
    w.run = run;
    w.args = args;
    dim3 gdim{grid[0], grid[1], grid[2]};
    dim3 bdim{block[0], block[1], block[2]};
    for (unsigned long long b = begin; b < end; b++) {
        uint3 bid{unsigned(b % gdim.x), unsigned((b / gdim.x) % gdim.y), unsigned(b / (gdim.x * gdim.y))};
        if (run_block(bid, bdim, gdim, shmem, err, errlen)) return 1;
    }
    return 0;
}

// Calls F with the launch's argument array, as cuLaunchKernel does.
template <class... A, std::size_t... I>
void call_with(void (*f)(A...), void** args, std::index_sequence<I...>) {
    f(*static_cast<A*>(args[I])...);
}
template <class F>
struct Arity;
template <class... A>
struct Arity<void (*)(A...)> {
    static constexpr std::size_t n = sizeof...(A);
};
template <auto F>
void thunk(void** args) {
    call_with(F, args, std::make_index_sequence<Arity<decltype(F)>::n>{});
}

// Runs f(0..n) on `workers` threads: the caller and workers-1 helpers kept
// by the calling thread (thread_local, so ranks launching from their own
// threads never share a pool), handing out indices one at a time.
class Pool {
   public:
    ~Pool() {
        {
            std::lock_guard<std::mutex> g(m_);
            stop_ = true;
        }
        wake_.notify_all();
        for (auto& t : helpers_) t.join();
    }
    void run(unsigned workers, unsigned long long n, const std::function<void(unsigned long long)>& f) {
        if (workers <= 1 || n <= 1) {
            for (unsigned long long i = 0; i < n; i++) f(i);
            return;
        }
        while (helpers_.size() + 1 < workers) helpers_.emplace_back([this, g0 = gen_] { serve(g0); });
        {
            std::lock_guard<std::mutex> g(m_);
            job_ = &f;
            n_ = n;
            next_ = 0;
            busy_ = helpers_.size();
            gen_++;
        }
        wake_.notify_all();
        drain(f, n);
        std::unique_lock<std::mutex> g(m_);
        done_.wait(g, [this] { return busy_ == 0; });
        job_ = nullptr;
    }

   private:
    void drain(const std::function<void(unsigned long long)>& f, unsigned long long n) {
        for (;;) {
            unsigned long long i = __atomic_fetch_add(&next_, 1ull, __ATOMIC_RELAXED);
            if (i >= n) return;
            f(i);
        }
    }
    // `seen`: the generation when this helper was made (not its job).
    void serve(unsigned long long seen) {
        for (;;) {
            const std::function<void(unsigned long long)>* f;
            unsigned long long n;
            {
                std::unique_lock<std::mutex> g(m_);
                wake_.wait(g, [&] { return stop_ || gen_ != seen; });
                if (stop_) return;
                seen = gen_;
                f = job_;
                n = n_;
            }
            drain(*f, n);
            std::lock_guard<std::mutex> g(m_);
            if (--busy_ == 0) done_.notify_all();
        }
    }
    std::mutex m_;
    std::condition_variable wake_, done_;
    std::vector<std::thread> helpers_;
    const std::function<void(unsigned long long)>* job_ = nullptr;
    unsigned long long n_ = 0, next_ = 0, gen_ = 0;
    size_t busy_ = 0;
    bool stop_ = false;
};

void parallel_for(unsigned workers, unsigned long long n, const std::function<void(unsigned long long)>& f) {
    static thread_local Pool pool;
    pool.run(workers, n, f);
}

}  // namespace simt

#define MEMFIT_SIMT 1
#include "kernels.inc"  // generated by build.rs: the kernel sources and KERNELS[]

extern "C" {

unsigned int memfit_simt_kernel_count() { return sizeof(KERNELS) / sizeof(KERNELS[0]); }
const char* memfit_simt_kernel_name(unsigned int i) { return KERNELS[i].name; }

const char* memfit_simt_kernel_args(unsigned int i) { return KERNELS[i].args; }

// Index of the kernel named `name`, or -1.
int memfit_simt_kernel_index(const char* name) {
    for (unsigned i = 0; i < memfit_simt_kernel_count(); i++)
        if (std::strcmp(KERNELS[i].name, name) == 0) return (int)i;
    return -1;
}

// One launch of kernel `k`, as cuLaunchKernel takes it: `args[i]` points at
// parameter i's value. First the limits every GPU memfit supports (sm_80 and
// newer) enforces, so a launch the hardware would refuse fails here too
// (return 1, `err` says which); then the blocks, spread over `threads` host
// threads (return 2 on a fault the emulation detects, such as a deadlock).
// The emulated driver (emu.rs) and the C-level CUDA double
// (tests/cuda_double) both launch through here.
// The launch limits alone (0, or 1 with `err` filled).
int memfit_simt_check(unsigned int k, const unsigned* grid, const unsigned* block, size_t shmem, char* err,
                      size_t errlen) {
    const char* name = KERNELS[k].name;
    unsigned long long nthreads = (unsigned long long)block[0] * block[1] * block[2];
    if (block[0] == 0 || block[1] == 0 || block[2] == 0 || grid[0] == 0 || grid[1] == 0 || grid[2] == 0) {
        std::snprintf(err, errlen, "kernel `%s`: empty launch, grid (%u,%u,%u) block (%u,%u,%u)", name, grid[0],
                      grid[1], grid[2], block[0], block[1], block[2]);
        return 1;
    }
    if (nthreads > 1024) {
        std::snprintf(err, errlen, "kernel `%s`: %llu threads a block (the limit is 1024)", name, nthreads);
        return 1;
    }
    if (block[2] > 64) {
        std::snprintf(err, errlen, "kernel `%s`: block z is %u (the limit is 64)", name, block[2]);
        return 1;
    }
    if (grid[0] > 0x7fffffffu || grid[1] > 65535 || grid[2] > 65535) {
        std::snprintf(err, errlen, "kernel `%s`: grid (%u,%u,%u) (x is at most 2^31-1, y and z at most 65535)",
                      name, grid[0], grid[1], grid[2]);
        return 1;
    }
    if (shmem > (48u << 10)) {
        std::snprintf(err, errlen,
                      "kernel `%s`: %zu bytes of dynamic shared memory (over 48 KiB needs an opt-in the backend "
                      "does not make)",
                      name, shmem);
        return 1;
    }
    return 0;
}

int memfit_simt_launch(unsigned int k, const unsigned* grid, const unsigned* block, size_t shmem, void** args,
                       unsigned threads, char* err, size_t errlen) {
    if (memfit_simt_check(k, grid, block, shmem, err, errlen)) return 1;
    const char* name = KERNELS[k].name;
    unsigned long long blocks = (unsigned long long)grid[0] * grid[1] * grid[2];
    unsigned workers = threads ? threads : 1;
    unsigned long long per = (blocks + workers * 4ull - 1) / (workers * 4ull);
    if (per == 0) per = 1;
    unsigned long long chunks = (blocks + per - 1) / per;
    std::mutex m;
    int rc = 0;
    simt::parallel_for(workers, chunks, [&](unsigned long long c) {
        char e[512];
        unsigned long long b = c * per, end = b + per < blocks ? b + per : blocks;
        if (simt::run_blocks(KERNELS[k].run, grid, block, shmem, args, b, end, e, sizeof e)) {
            std::lock_guard<std::mutex> g(m);
            if (rc == 0) {
                rc = 2;
                std::snprintf(err, errlen, "kernel `%s`: %s", name, e);
            }
        }
    });
    return rc;
}

// The reference GEMM: products accumulated in fp32 in order of k, C
// rounded once to its type.
static float gemm_load(const void* p, int t, long long i) {
    switch (t) {
        case DT_F32: return static_cast<const float*>(p)[i];
        case DT_BF16: return bf16_to_f32(static_cast<const u16*>(p)[i]);
        default: return f16_to_f32(static_cast<const u16*>(p)[i]);
    }
}

static void gemm_store(void* p, int t, long long i, float v) {
    switch (t) {
        case DT_F32: static_cast<float*>(p)[i] = v; break;
        case DT_BF16: static_cast<u16*>(p)[i] = f32_to_bf16(v); break;
        default: static_cast<u16*>(p)[i] = f32_to_f16(v); break;
    }
}

float memfit_simt_to_f32(const void* p, int t, long long i) { return gemm_load(p, t, i); }
void memfit_simt_from_f32(void* p, int t, long long i, float v) { gemm_store(p, t, i, v); }

static long long dt_size(int t) { return t == DT_F32 ? 4 : 2; }

void memfit_simt_gemm(const MemfitGemm* gp, unsigned threads) {
    const MemfitGemm g = *gp;
    simt::parallel_for(threads ? threads : 1, (unsigned long long)(g.batch * g.n), [&](unsigned long long bj) {
        long long bi = (long long)bj / g.n, j = (long long)bj % g.n;
        const char* a = static_cast<const char*>(g.a) + bi * g.stride_a * dt_size(g.ab_type);
        const char* b = static_cast<const char*>(g.b) + bi * g.stride_b * dt_size(g.ab_type);
        char* c = static_cast<char*>(g.c) + bi * g.stride_c * dt_size(g.c_type);
        for (long long i = 0; i < g.m; i++) {
            float acc = 0.0f;
            for (long long p = 0; p < g.k; p++) {
                float av = g.transa ? gemm_load(a, g.ab_type, p + i * g.lda) : gemm_load(a, g.ab_type, i + p * g.lda);
                float bv = g.transb ? gemm_load(b, g.ab_type, j + p * g.ldb) : gemm_load(b, g.ab_type, p + j * g.ldb);
                acc += av * bv;
            }
            long long idx = i + j * g.ldc;
            float v = g.alpha * acc;
            if (g.beta != 0.0f) v += g.beta * gemm_load(c, g.c_type, idx);
            gemm_store(c, g.c_type, idx, v);
        }
    });
}

// Device memory of the emulated GPU: each buffer ends at an inaccessible page
// and starts after one, so a kernel that indexes past either end faults at
// once instead of corrupting a neighbour. Start aligned to 16 bytes.
static size_t page_size() { return (size_t)sysconf(_SC_PAGESIZE); }
static size_t round_up(size_t x, size_t a) { return (x + a - 1) / a * a; }

void* memfit_simt_alloc(size_t bytes) {
    size_t pg = page_size();
    size_t body = round_up(bytes ? bytes : 1, pg);
    size_t total = body + 2 * pg;
    void* base = mmap(nullptr, total, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (base == MAP_FAILED) return nullptr;
    char* b = static_cast<char*>(base);
    if (mprotect(b + pg, body, PROT_READ | PROT_WRITE) != 0) {
        munmap(base, total);
        return nullptr;
    }
    return b + pg + (body - round_up(bytes ? bytes : 1, 16));
}

void memfit_simt_free(void* p, size_t bytes) {
    size_t pg = page_size();
    size_t body = round_up(bytes ? bytes : 1, pg);
    char* b = static_cast<char*>(p) - (body - round_up(bytes ? bytes : 1, 16)) - pg;
    munmap(b, body + 2 * pg);
}
}
