// The SIMT emulator's scheduler, launcher and guarded allocator (see simt.h).
// build.rs compiles this file together with every kernel source and a
// generated table of the kernels, into a static library the emulated cuda
// driver (src/backend/cuda/emu.rs) calls.
#include "simt.h"

#include <sys/mman.h>
#include <ucontext.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <utility>
#include <vector>

namespace simt {

thread_local Thread* cur = nullptr;

namespace {

enum State : unsigned char { RUN, WAIT_BLOCK, WAIT_WARP, DONE };

// Kernels keep small per-thread arrays; 64 KiB leaves room for libm.
constexpr size_t STACK_BYTES = 64 * 1024;

struct Fiber {
    ucontext_t ctx;
    Thread t;
    State st;
    unsigned long long slot;
};

struct Worker {
    ucontext_t main;
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
    swapcontext(&w.running->ctx, &w.main);
    std::abort();  // a finished fiber is never resumed
}

void yield(State s) {
    Fiber* f = W.running;
    f->st = s;
    swapcontext(&f->ctx, &W.main);
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
        getcontext(&f.ctx);
        f.ctx.uc_stack.ss_sp = w.stacks[i];
        f.ctx.uc_stack.ss_size = STACK_BYTES;
        f.ctx.uc_link = nullptr;
        makecontext(&f.ctx, entry, 0);
    }
    const unsigned nwarps = (n + 31) / 32;
    for (;;) {
        for (unsigned i = 0; i < n; i++) {
            Fiber& f = w.fibers[i];
            if (f.st == RUN) {
                w.running = &f;
                cur = &f.t;
                swapcontext(&w.main, &f.ctx);
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

}  // namespace simt

#define MEMFIT_SIMT 1
#include "kernels.inc"  // generated by build.rs: the kernel sources and KERNELS[]

extern "C" {

unsigned int memfit_simt_kernel_count() { return sizeof(KERNELS) / sizeof(KERNELS[0]); }
const char* memfit_simt_kernel_name(unsigned int i) { return KERNELS[i].name; }

// Runs blocks [begin, end) of a launch of kernel `k` on the calling thread.
int memfit_simt_run(unsigned int k, const unsigned* grid, const unsigned* block, size_t shmem, void** args,
                    unsigned long long begin, unsigned long long end, char* err, size_t errlen) {
    return simt::run_blocks(KERNELS[k].run, grid, block, shmem, args, begin, end, err, errlen);
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
