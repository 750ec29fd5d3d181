// A C-level test double of the CUDA driver API, cuBLAS and NCCL: the calls
// memfit's real GPU path makes through cudarc, so that path (context, module
// load, kernel parameter marshalling, streams, copies, the cuBLAS call's
// transposes, strides and types, NCCL's id, init, collectives, and its
// grouped point-to-point sends and receives) runs in `cargo test` on a
// machine without a GPU.
//
// build.rs compiles this file with the SIMT emulator (src/backend/cuda/simt,
// every kernel compiled for the host) into one shared object and lays it out
// as an NVIDIA install would: $OUT_DIR/cuda_double/libcuda.so.1,
// libcublas.so.13, libcublasLt.so.13 and libnccl.so.2 all name the same file,
// which the loader maps once, so the driver, cuBLAS and NCCL share one table
// of allocations. Point MEMFIT_CUDA_LIBS at that folder (or put it on
// LD_LIBRARY_PATH) and `--device cuda` runs on it; NVRTC is the real one
// (from its PyPI wheel), and the module it produced is what cuModuleLoadData
// receives.
//
// Device memory is host memory between guard pages (memfit_simt_alloc), so a
// kernel that strays faults at once. Kernels run by name through the SIMT
// launcher the emulated driver uses (memfit_simt_launch), with the real
// parameter array; GEMMs through the same reference (memfit_simt_gemm).
// Work is synchronous, so streams complete as soon as a call returns.
//
// Misuse the real driver rejects fails here too, with a line on stderr
// ("cuda double: ...") and the driver's error code: a call with no current
// context, a pointer that is not live device memory (freed, never
// allocated, or another device's), launch dimensions or dynamic shared
// memory over the device's limits, PTX newer than the driver, a module for
// another architecture, a kernel the module does not hold, GEMM leading
// dimensions too small or operands that run past their allocation. NCCL
// misuse fails with ncclInvalidArgument or ncclInvalidUsage: a send and its
// receive of different counts or types (which real NCCL leaves undefined),
// an ncclGroupEnd without its ncclGroupStart, a send to itself whose receive
// is not in the same group (a hang on real NCCL), and a collective inside a
// group (which this double cannot defer).
//
// Configuration (environment, read at cuInit):
//   MEMFIT_CUDA_DOUBLE_MEMORY   device memory in bytes (K/M/G/KiB/MiB/GiB
//                               suffixes), default 4 GiB
//   MEMFIT_CUDA_DOUBLE_DEVICES  number of GPUs, default 1 (at most 8)
//   MEMFIT_CUDA_DOUBLE_CC       compute capability, default 9.0
//   MEMFIT_CUDA_DOUBLE_DRIVER   driver CUDA version, default 13000 (13.0)
//   MEMFIT_CUDA_DOUBLE_THREADS  host threads a launch or GEMM uses, default 2
//   MEMFIT_NCCL_DOUBLE_TIMEOUT  seconds a collective waits for its peers,
//                               default 300

#include <fcntl.h>
#include <sched.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdarg>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <set>
#include <string>
#include <vector>

#define API extern "C" __attribute__((visibility("default")))

// The SIMT emulator, compiled into this object (see build.rs).
#include "simt_api.h"

namespace {

void say(const char* fmt, ...) {
    char line[1024];
    va_list ap;
    va_start(ap, fmt);
    std::vsnprintf(line, sizeof line, fmt, ap);
    va_end(ap);
    std::fprintf(stderr, "cuda double: %s\n", line);
}

unsigned long long env_bytes(const char* name, unsigned long long dflt) {
    const char* v = std::getenv(name);
    if (!v || !*v) return dflt;
    char* end = nullptr;
    double x = std::strtod(v, &end);
    std::string unit = end ? end : "";
    for (auto& ch : unit) ch = (char)std::tolower((unsigned char)ch);
    double mul = 1;
    if (unit == "k" || unit == "kib") mul = 1024.0;
    if (unit == "m" || unit == "mib") mul = 1024.0 * 1024;
    if (unit == "g" || unit == "gib") mul = 1024.0 * 1024 * 1024;
    return (unsigned long long)(x * mul);
}

long env_int(const char* name, long dflt) {
    const char* v = std::getenv(name);
    return v && *v ? std::strtol(v, nullptr, 10) : dflt;
}

// ---------------------------------------------------------------- driver

enum : int {
    CUDA_SUCCESS = 0,
    CUDA_ERROR_INVALID_VALUE = 1,
    CUDA_ERROR_OUT_OF_MEMORY = 2,
    CUDA_ERROR_NOT_INITIALIZED = 3,
    CUDA_ERROR_INVALID_DEVICE = 101,
    CUDA_ERROR_INVALID_IMAGE = 200,
    CUDA_ERROR_INVALID_CONTEXT = 201,
    CUDA_ERROR_NO_BINARY_FOR_GPU = 209,
    CUDA_ERROR_INVALID_PTX = 218,
    CUDA_ERROR_UNSUPPORTED_PTX_VERSION = 222,
    CUDA_ERROR_INVALID_HANDLE = 400,
    CUDA_ERROR_NOT_FOUND = 500,
    CUDA_ERROR_ILLEGAL_ADDRESS = 700,
    CUDA_ERROR_LAUNCH_FAILED = 719,
};

const int MAX_DEVICES = 8;

struct Ctx {
    int dev;
    int refs;
};

struct Alloc {
    size_t bytes;
    int dev;  // -1: host-mapped (portable, valid in every context)
};

struct Module {
    int dev;
    std::set<std::string> kernels;
};

struct Func {
    Module* mod;
    int kernel;
};

struct State {
    std::mutex mu;
    bool init = false;
    int devices = 1, cc_major = 9, cc_minor = 0, driver = 13000;
    unsigned threads = 2;
    unsigned long long capacity = 4ull << 30;
    unsigned long long live[MAX_DEVICES] = {};
    Ctx ctx[MAX_DEVICES];
    std::map<uintptr_t, Alloc> allocs;  // by start address
    std::set<Module*> modules;
    std::set<Func*> funcs;
    std::set<void*> streams;
};

State& S() {
    static State* s = new State;  // never destroyed: calls may come from exit handlers
    return *s;
}

thread_local Ctx* current = nullptr;

// The device of the current context, or -1 (after saying why).
int need_ctx(const char* fn) {
    if (!S().init) {
        say("%s before cuInit", fn);
        return -2;
    }
    if (!current || current->refs <= 0) {
        say("%s with no current context (cuCtxSetCurrent first)", fn);
        return -1;
    }
    return current->dev;
}

int ctx_error(int dev) { return dev == -2 ? CUDA_ERROR_NOT_INITIALIZED : CUDA_ERROR_INVALID_CONTEXT; }

// The live allocation holding [p, p+n) that the current device may use, or
// nullptr after saying why. Caller holds the lock.
const Alloc* find(uintptr_t p, size_t n, int dev, const char* fn, const char* what) {
    auto& a = S().allocs;
    auto it = a.upper_bound(p);
    if (it != a.begin()) {
        --it;
        if (p >= it->first && p + n <= it->first + it->second.bytes) {
            if (it->second.dev >= 0 && it->second.dev != dev) {
                say("%s: %s 0x%llx is device %d's memory, used from device %d's context", fn, what,
                    (unsigned long long)p, it->second.dev, dev);
                return nullptr;
            }
            return &it->second;
        }
        if (p >= it->first && p < it->first + it->second.bytes) {
            say("%s: %s 0x%llx + %zu bytes runs past its allocation of %zu bytes at 0x%llx", fn, what,
                (unsigned long long)p, n, it->second.bytes, (unsigned long long)it->first);
            return nullptr;
        }
    }
    say("%s: %s 0x%llx (%zu bytes) is not live device memory (freed, or never allocated)", fn, what,
        (unsigned long long)p, n);
    return nullptr;
}

bool stream_ok(void* s, const char* fn) {
    if (s == nullptr || S().streams.count(s)) return true;
    say("%s: stream %p is not a live stream", fn, s);
    return false;
}

// PTX ISA version a driver of CUDA `v` (e.g. 12040) accepts at most, times 10:
// CUDA 12.x reads PTX 8.x (8.8 from 12.9 on), 13.x reads 9.x (PTX ISA notes
// in NVIDIA's "PTX ISA" release history).
int max_ptx(int v) {
    int major = v / 1000, minor = v / 10 % 100;
    if (major >= 13) return 90 + minor;
    if (major == 12) return 80 + (minor > 8 ? 8 : minor);
    return 78;
}

// Kernel names in a CUBIN (ELF64 for EM_CUDA): its global FUNC symbols.
int cubin_kernels(const unsigned char* img, std::set<std::string>& out) {
    auto u16 = [&](size_t o) { uint16_t v; std::memcpy(&v, img + o, 2); return v; };
    auto u32 = [&](size_t o) { uint32_t v; std::memcpy(&v, img + o, 4); return v; };
    auto u64 = [&](size_t o) { uint64_t v; std::memcpy(&v, img + o, 8); return v; };
    if (img[4] != 2 || u16(0x12) != 190) {
        say("cuModuleLoadData: an ELF image that is not a 64-bit CUDA binary (e_machine %u)", u16(0x12));
        return CUDA_ERROR_INVALID_IMAGE;
    }
    uint64_t shoff = u64(0x28);
    unsigned shentsize = u16(0x3a), shnum = u16(0x3c);
    for (unsigned i = 0; i < shnum; i++) {
        size_t sh = shoff + (size_t)i * shentsize;
        if (u32(sh + 4) != 2) continue;  // SHT_SYMTAB
        uint64_t off = u64(sh + 0x18), size = u64(sh + 0x20), entsize = u64(sh + 0x38);
        unsigned link = u32(sh + 0x28);
        uint64_t stroff = u64(shoff + (size_t)link * shentsize + 0x18);
        for (uint64_t s = 0; entsize && s + entsize <= size; s += entsize) {
            size_t sym = off + s;
            unsigned char info = img[sym + 4];
            if ((info & 0xf) == 2 && (info >> 4) == 1)  // STT_FUNC, STB_GLOBAL
                out.insert(reinterpret_cast<const char*>(img + stroff + u32(sym)));
        }
    }
    return CUDA_SUCCESS;
}

// Kernel names in PTX text, after checking its version and target.
int ptx_kernels(const char* ptx, int dev_cc, std::set<std::string>& out) {
    const char* v = std::strstr(ptx, ".version ");
    const char* t = std::strstr(ptx, ".target sm_");
    if (!v || !t) {
        say("cuModuleLoadData: PTX without .version or .target");
        return CUDA_ERROR_INVALID_PTX;
    }
    int vmaj = 0, vmin = 0;
    std::sscanf(v + 9, "%d.%d", &vmaj, &vmin);
    if (vmaj * 10 + vmin > max_ptx(S().driver)) {
        say("cuModuleLoadData: PTX ISA %d.%d is newer than this driver (CUDA %d.%d) accepts", vmaj, vmin,
            S().driver / 1000, S().driver / 10 % 100);
        return CUDA_ERROR_UNSUPPORTED_PTX_VERSION;
    }
    int sm = std::atoi(t + 11);
    if (sm > dev_cc) {
        say("cuModuleLoadData: PTX for sm_%d on an sm_%d device", sm, dev_cc);
        return CUDA_ERROR_NO_BINARY_FOR_GPU;
    }
    for (const char* p = ptx; (p = std::strstr(p, ".entry ")); p += 7) {
        const char* b = p + 7;
        const char* e = b;
        while (*e && *e != '(' && *e != ' ' && *e != '\n') e++;
        out.insert(std::string(b, e));
    }
    return CUDA_SUCCESS;
}

}  // namespace

typedef int CUresult;
typedef int CUdevice;
typedef unsigned long long CUdeviceptr;
typedef Ctx* CUcontext;
typedef Module* CUmodule;
typedef Func* CUfunction;
typedef void* CUstream;

API CUresult cuInit(unsigned int flags) {
    State& s = S();
    std::lock_guard<std::mutex> g(s.mu);
    if (flags != 0) {
        say("cuInit: flags must be 0 (got %u)", flags);
        return CUDA_ERROR_INVALID_VALUE;
    }
    if (!s.init) {
        s.capacity = env_bytes("MEMFIT_CUDA_DOUBLE_MEMORY", 4ull << 30);
        s.devices = (int)env_int("MEMFIT_CUDA_DOUBLE_DEVICES", 1);
        if (s.devices < 1 || s.devices > MAX_DEVICES) s.devices = 1;
        const char* cc = std::getenv("MEMFIT_CUDA_DOUBLE_CC");
        if (cc && *cc) std::sscanf(cc, "%d.%d", &s.cc_major, &s.cc_minor);
        s.driver = (int)env_int("MEMFIT_CUDA_DOUBLE_DRIVER", 13000);
        s.threads = (unsigned)env_int("MEMFIT_CUDA_DOUBLE_THREADS", 2);
        for (int d = 0; d < MAX_DEVICES; d++) s.ctx[d] = Ctx{d, 0};
        s.init = true;
    }
    return CUDA_SUCCESS;
}

API CUresult cuDriverGetVersion(int* v) {
    if (!v) return CUDA_ERROR_INVALID_VALUE;
    // Asked before cuInit too (doctor does), as the real driver allows.
    *v = (int)env_int("MEMFIT_CUDA_DOUBLE_DRIVER", 13000);
    return CUDA_SUCCESS;
}

API CUresult cuDeviceGetCount(int* n) {
    if (!S().init) return CUDA_ERROR_NOT_INITIALIZED;
    *n = S().devices;
    return CUDA_SUCCESS;
}

API CUresult cuDeviceGet(CUdevice* d, int ordinal) {
    if (!S().init) return CUDA_ERROR_NOT_INITIALIZED;
    if (ordinal < 0 || ordinal >= S().devices) {
        say("cuDeviceGet: ordinal %d of %d device(s)", ordinal, S().devices);
        return CUDA_ERROR_INVALID_DEVICE;
    }
    *d = ordinal;
    return CUDA_SUCCESS;
}

static bool dev_ok(CUdevice d, const char* fn) {
    if (!S().init) {
        say("%s before cuInit", fn);
        return false;
    }
    if (d < 0 || d >= S().devices) {
        say("%s: no device %d", fn, d);
        return false;
    }
    return true;
}

API CUresult cuDeviceGetName(char* name, int len, CUdevice d) {
    if (!dev_ok(d, "cuDeviceGetName")) return CUDA_ERROR_INVALID_DEVICE;
    std::snprintf(name, (size_t)len, "memfit CUDA double (sm_%d%d)", S().cc_major, S().cc_minor);
    return CUDA_SUCCESS;
}

API CUresult cuDeviceTotalMem_v2(size_t* bytes, CUdevice d) {
    if (!dev_ok(d, "cuDeviceTotalMem")) return CUDA_ERROR_INVALID_DEVICE;
    *bytes = S().capacity;
    return CUDA_SUCCESS;
}

API CUresult cuDeviceGetAttribute(int* v, int attr, CUdevice d) {
    if (!dev_ok(d, "cuDeviceGetAttribute")) return CUDA_ERROR_INVALID_DEVICE;
    switch (attr) {
        case 1: *v = 1024; break;                        // max threads per block
        case 2: case 3: *v = 1024; break;                // max block x, y
        case 4: *v = 64; break;                          // max block z
        case 5: *v = 0x7fffffff; break;                  // max grid x
        case 6: case 7: *v = 65535; break;               // max grid y, z
        case 8: *v = 48 << 10; break;                    // shared memory per block
        case 10: *v = 32; break;                         // warp size
        case 16: *v = 132; break;                        // multiprocessors
        case 19: case 41: *v = 1; break;                 // map host memory, unified addressing
        case 75: *v = S().cc_major; break;
        case 76: *v = S().cc_minor; break;
        default: *v = 0; break;
    }
    return CUDA_SUCCESS;
}

API CUresult cuDevicePrimaryCtxRetain(CUcontext* c, CUdevice d) {
    if (!dev_ok(d, "cuDevicePrimaryCtxRetain")) return CUDA_ERROR_INVALID_DEVICE;
    std::lock_guard<std::mutex> g(S().mu);
    S().ctx[d].refs++;
    *c = &S().ctx[d];
    return CUDA_SUCCESS;
}

API CUresult cuDevicePrimaryCtxRelease_v2(CUdevice d) {
    if (!dev_ok(d, "cuDevicePrimaryCtxRelease")) return CUDA_ERROR_INVALID_DEVICE;
    std::lock_guard<std::mutex> g(S().mu);
    if (S().ctx[d].refs <= 0) {
        say("cuDevicePrimaryCtxRelease: device %d's primary context is not retained", d);
        return CUDA_ERROR_INVALID_CONTEXT;
    }
    S().ctx[d].refs--;
    return CUDA_SUCCESS;
}

API CUresult cuCtxSetCurrent(CUcontext c) {
    if (!S().init) return CUDA_ERROR_NOT_INITIALIZED;
    if (c != nullptr && (c < &S().ctx[0] || c >= &S().ctx[MAX_DEVICES] || c->refs <= 0)) {
        say("cuCtxSetCurrent: %p is not a live context", (void*)c);
        return CUDA_ERROR_INVALID_CONTEXT;
    }
    current = c;
    return CUDA_SUCCESS;
}

API CUresult cuCtxGetCurrent(CUcontext* c) {
    *c = current;
    return CUDA_SUCCESS;
}

API CUresult cuCtxSynchronize() {
    int dev = need_ctx("cuCtxSynchronize");
    return dev < 0 ? ctx_error(dev) : CUDA_SUCCESS;
}

API CUresult cuMemGetInfo_v2(size_t* free_bytes, size_t* total) {
    int dev = need_ctx("cuMemGetInfo");
    if (dev < 0) return ctx_error(dev);
    std::lock_guard<std::mutex> g(S().mu);
    *total = S().capacity;
    *free_bytes = S().capacity - S().live[dev];
    return CUDA_SUCCESS;
}

API CUresult cuMemAlloc_v2(CUdeviceptr* p, size_t bytes) {
    int dev = need_ctx("cuMemAlloc");
    if (dev < 0) return ctx_error(dev);
    if (bytes == 0) {
        say("cuMemAlloc of 0 bytes");
        return CUDA_ERROR_INVALID_VALUE;
    }
    State& s = S();
    std::lock_guard<std::mutex> g(s.mu);
    if (s.live[dev] + bytes > s.capacity) return CUDA_ERROR_OUT_OF_MEMORY;
    void* m = memfit_simt_alloc(bytes);
    if (!m) return CUDA_ERROR_OUT_OF_MEMORY;
    s.live[dev] += bytes;
    s.allocs[(uintptr_t)m] = Alloc{bytes, dev};
    *p = (CUdeviceptr)(uintptr_t)m;
    return CUDA_SUCCESS;
}

API CUresult cuMemFree_v2(CUdeviceptr p) {
    int dev = need_ctx("cuMemFree");
    if (dev < 0) return ctx_error(dev);
    State& s = S();
    std::lock_guard<std::mutex> g(s.mu);
    auto it = s.allocs.find((uintptr_t)p);
    if (it == s.allocs.end() || it->second.dev < 0) {
        say("cuMemFree: 0x%llx is not the start of a live device allocation (double free?)", p);
        return CUDA_ERROR_INVALID_VALUE;
    }
    s.live[it->second.dev] -= it->second.bytes;
    memfit_simt_free((void*)(uintptr_t)p, it->second.bytes);
    s.allocs.erase(it);
    return CUDA_SUCCESS;
}

API CUresult cuMemHostAlloc(void** pp, size_t bytes, unsigned int flags) {
    int dev = need_ctx("cuMemHostAlloc");
    if (dev < 0) return ctx_error(dev);
    if (flags & ~0x7u) {
        say("cuMemHostAlloc: unknown flags 0x%x", flags);
        return CUDA_ERROR_INVALID_VALUE;
    }
    std::lock_guard<std::mutex> g(S().mu);
    void* m = memfit_simt_alloc(bytes ? bytes : 1);
    if (!m) return CUDA_ERROR_OUT_OF_MEMORY;
    S().allocs[(uintptr_t)m] = Alloc{bytes ? bytes : 1, -1};
    *pp = m;
    return CUDA_SUCCESS;
}

API CUresult cuMemHostGetDevicePointer_v2(CUdeviceptr* d, void* p, unsigned int flags) {
    int dev = need_ctx("cuMemHostGetDevicePointer");
    if (dev < 0) return ctx_error(dev);
    std::lock_guard<std::mutex> g(S().mu);
    auto it = S().allocs.find((uintptr_t)p);
    if (flags != 0 || it == S().allocs.end() || it->second.dev != -1) {
        say("cuMemHostGetDevicePointer: %p is not memory from cuMemHostAlloc", p);
        return CUDA_ERROR_INVALID_VALUE;
    }
    *d = (CUdeviceptr)(uintptr_t)p;  // unified addressing: the same address
    return CUDA_SUCCESS;
}

API CUresult cuMemFreeHost(void* p) {
    std::lock_guard<std::mutex> g(S().mu);
    auto it = S().allocs.find((uintptr_t)p);
    if (it == S().allocs.end() || it->second.dev != -1) {
        say("cuMemFreeHost: %p is not live memory from cuMemHostAlloc", p);
        return CUDA_ERROR_INVALID_VALUE;
    }
    memfit_simt_free(p, it->second.bytes);
    S().allocs.erase(it);
    return CUDA_SUCCESS;
}

static CUresult copy(void* dst, const void* src, size_t n, uintptr_t dev_ptr, const char* fn, CUstream st) {
    int dev = need_ctx(fn);
    if (dev < 0) return ctx_error(dev);
    std::lock_guard<std::mutex> g(S().mu);
    if (!stream_ok(st, fn)) return CUDA_ERROR_INVALID_HANDLE;
    if (n && !find(dev_ptr, n, dev, fn, "device pointer")) return CUDA_ERROR_INVALID_VALUE;
    if (n) std::memmove(dst, src, n);
    return CUDA_SUCCESS;
}

API CUresult cuMemcpyHtoD_v2(CUdeviceptr dst, const void* src, size_t n) {
    return copy((void*)(uintptr_t)dst, src, n, (uintptr_t)dst, "cuMemcpyHtoD", nullptr);
}
API CUresult cuMemcpyDtoH_v2(void* dst, CUdeviceptr src, size_t n) {
    return copy(dst, (const void*)(uintptr_t)src, n, (uintptr_t)src, "cuMemcpyDtoH", nullptr);
}
API CUresult cuMemcpyHtoDAsync_v2(CUdeviceptr dst, const void* src, size_t n, CUstream st) {
    return copy((void*)(uintptr_t)dst, src, n, (uintptr_t)dst, "cuMemcpyHtoDAsync", st);
}
API CUresult cuMemcpyDtoHAsync_v2(void* dst, CUdeviceptr src, size_t n, CUstream st) {
    return copy(dst, (const void*)(uintptr_t)src, n, (uintptr_t)src, "cuMemcpyDtoHAsync", st);
}

API CUresult cuMemsetD8Async(CUdeviceptr dst, unsigned char v, size_t n, CUstream st) {
    int dev = need_ctx("cuMemsetD8Async");
    if (dev < 0) return ctx_error(dev);
    std::lock_guard<std::mutex> g(S().mu);
    if (!stream_ok(st, "cuMemsetD8Async")) return CUDA_ERROR_INVALID_HANDLE;
    if (n && !find((uintptr_t)dst, n, dev, "cuMemsetD8Async", "destination")) return CUDA_ERROR_INVALID_VALUE;
    std::memset((void*)(uintptr_t)dst, v, n);
    return CUDA_SUCCESS;
}
API CUresult cuMemsetD8_v2(CUdeviceptr dst, unsigned char v, size_t n) { return cuMemsetD8Async(dst, v, n, nullptr); }

API CUresult cuStreamCreate(CUstream* st, unsigned int flags) {
    int dev = need_ctx("cuStreamCreate");
    if (dev < 0) return ctx_error(dev);
    if (flags > 1) return CUDA_ERROR_INVALID_VALUE;
    std::lock_guard<std::mutex> g(S().mu);
    void* h = std::malloc(1);
    S().streams.insert(h);
    *st = h;
    return CUDA_SUCCESS;
}

API CUresult cuStreamDestroy_v2(CUstream st) {
    std::lock_guard<std::mutex> g(S().mu);
    if (!S().streams.erase(st)) {
        say("cuStreamDestroy: %p is not a live stream", st);
        return CUDA_ERROR_INVALID_HANDLE;
    }
    std::free(st);
    return CUDA_SUCCESS;
}

API CUresult cuStreamSynchronize(CUstream st) {
    int dev = need_ctx("cuStreamSynchronize");
    if (dev < 0) return ctx_error(dev);
    std::lock_guard<std::mutex> g(S().mu);
    return stream_ok(st, "cuStreamSynchronize") ? CUDA_SUCCESS : CUDA_ERROR_INVALID_HANDLE;
}

// Work is synchronous: every stream is idle when a call returns.
API CUresult cuStreamQuery(CUstream st) {
    std::lock_guard<std::mutex> g(S().mu);
    return stream_ok(st, "cuStreamQuery") ? CUDA_SUCCESS : CUDA_ERROR_INVALID_HANDLE;
}

API CUresult cuModuleLoadData(CUmodule* m, const void* image) {
    int dev = need_ctx("cuModuleLoadData");
    if (dev < 0) return ctx_error(dev);
    if (!image) return CUDA_ERROR_INVALID_VALUE;
    auto img = static_cast<const unsigned char*>(image);
    std::set<std::string> names;
    int cc = S().cc_major * 10 + S().cc_minor;
    int rc = std::memcmp(img, "\x7f" "ELF", 4) == 0 ? cubin_kernels(img, names)
                                                     : ptx_kernels(static_cast<const char*>(image), cc, names);
    if (rc != CUDA_SUCCESS) return rc;
    if (names.empty()) {
        say("cuModuleLoadData: the image holds no kernel");
        return CUDA_ERROR_INVALID_IMAGE;
    }
    for (auto& n : names) {
        if (memfit_simt_kernel_index(n.c_str()) < 0) {
            say("cuModuleLoadData: kernel `%s` in the image is not one this double can run", n.c_str());
            return CUDA_ERROR_INVALID_IMAGE;
        }
    }
    std::lock_guard<std::mutex> g(S().mu);
    Module* mod = new Module{dev, std::move(names)};
    S().modules.insert(mod);
    *m = mod;
    return CUDA_SUCCESS;
}

API CUresult cuModuleGetFunction(CUfunction* f, CUmodule m, const char* name) {
    std::lock_guard<std::mutex> g(S().mu);
    if (!S().modules.count(m)) {
        say("cuModuleGetFunction: %p is not a loaded module", (void*)m);
        return CUDA_ERROR_INVALID_HANDLE;
    }
    if (!m->kernels.count(name)) {
        say("cuModuleGetFunction: the module has no kernel `%s`", name);
        return CUDA_ERROR_NOT_FOUND;
    }
    Func* fn = new Func{m, memfit_simt_kernel_index(name)};
    S().funcs.insert(fn);
    *f = fn;
    return CUDA_SUCCESS;
}

API CUresult cuModuleUnload(CUmodule m) {
    std::lock_guard<std::mutex> g(S().mu);
    if (!S().modules.erase(m)) {
        say("cuModuleUnload: %p is not a loaded module", (void*)m);
        return CUDA_ERROR_INVALID_HANDLE;
    }
    for (auto it = S().funcs.begin(); it != S().funcs.end();) {
        if ((*it)->mod == m) {
            delete *it;
            it = S().funcs.erase(it);
        } else {
            ++it;
        }
    }
    delete m;
    return CUDA_SUCCESS;
}

API CUresult cuLaunchKernel(CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,
                            unsigned bz, unsigned shmem, CUstream st, void** params, void** extra) {
    int dev = need_ctx("cuLaunchKernel");
    if (dev < 0) return ctx_error(dev);
    int k;
    {
        std::lock_guard<std::mutex> g(S().mu);
        if (!S().funcs.count(f)) {
            say("cuLaunchKernel: %p is not a function of a loaded module", (void*)f);
            return CUDA_ERROR_INVALID_HANDLE;
        }
        k = f->kernel;
        const char* name = memfit_simt_kernel_name((unsigned)k);
        if (f->mod->dev != dev) {
            say("cuLaunchKernel: `%s` belongs to device %d's module, launched in device %d's context", name,
                f->mod->dev, dev);
            return CUDA_ERROR_INVALID_CONTEXT;
        }
        if (!stream_ok(st, "cuLaunchKernel")) return CUDA_ERROR_INVALID_HANDLE;
        if (extra != nullptr || params == nullptr) {
            say("cuLaunchKernel: `%s` needs its parameters in kernelParams", name);
            return CUDA_ERROR_INVALID_VALUE;
        }
        // The hardware's limits first, before any parameter is read.
        unsigned grid[3] = {gx, gy, gz}, block[3] = {bx, by, bz};
        char err[512];
        if (memfit_simt_check((unsigned)k, grid, block, shmem, err, sizeof err)) {
            say("cuLaunchKernel: %s", err);
            return CUDA_ERROR_INVALID_VALUE;
        }
        // Every pointer parameter must be memory this device may use.
        const char* kinds = memfit_simt_kernel_args((unsigned)k);
        for (unsigned i = 0; kinds[i]; i++) {
            if (kinds[i] != 'P') continue;
            uintptr_t p;
            std::memcpy(&p, params[i], sizeof p);
            char what[96];
            std::snprintf(what, sizeof what, "kernel `%s` pointer parameter %u", name, i);
            if (p != 0 && !find(p, 0, dev, "cuLaunchKernel", what)) return CUDA_ERROR_ILLEGAL_ADDRESS;
        }
    }
    unsigned grid[3] = {gx, gy, gz}, block[3] = {bx, by, bz};
    char err[512];
    int rc = memfit_simt_launch((unsigned)k, grid, block, shmem, params, S().threads, err, sizeof err);
    if (rc == 1) {
        say("cuLaunchKernel: %s", err);
        return CUDA_ERROR_INVALID_VALUE;
    }
    if (rc != 0) {
        say("cuLaunchKernel: %s", err);
        return CUDA_ERROR_LAUNCH_FAILED;
    }
    return CUDA_SUCCESS;
}

// NVRTC looks for the driver and asks it for its private export tables;
// a driver without them answers "not supported", and NVRTC goes on.
API CUresult cuGetExportTable(const void** table, const void* uuid) {
    (void)uuid;
    if (table) *table = nullptr;
    return 801;  // CUDA_ERROR_NOT_SUPPORTED
}

API CUresult cuGetErrorString(CUresult e, const char** s) {
    switch (e) {
        case CUDA_SUCCESS: *s = "no error"; break;
        case CUDA_ERROR_INVALID_VALUE: *s = "invalid argument"; break;
        case CUDA_ERROR_OUT_OF_MEMORY: *s = "out of memory"; break;
        case CUDA_ERROR_INVALID_CONTEXT: *s = "invalid device context"; break;
        case CUDA_ERROR_ILLEGAL_ADDRESS: *s = "an illegal memory access was encountered"; break;
        default: *s = "cuda double error"; break;
    }
    return CUDA_SUCCESS;
}

API CUresult cuGetErrorName(CUresult e, const char** s) {
    static thread_local char buf[32];
    std::snprintf(buf, sizeof buf, "CUresult %d", e);
    *s = buf;
    return CUDA_SUCCESS;
}

// ---------------------------------------------------------------- cuBLAS

namespace {
enum : int {
    CUBLAS_STATUS_SUCCESS = 0,
    CUBLAS_STATUS_NOT_INITIALIZED = 1,
    CUBLAS_STATUS_INVALID_VALUE = 7,
    CUBLAS_STATUS_NOT_SUPPORTED = 15,
};
const int CUBLAS_VERSION = 130100;  // 13.1.0, as major*10000 + minor*100 + patch
struct Blas {
    int dev;
    void* stream;
};
std::set<Blas*>& blas_handles() {
    static auto* h = new std::set<Blas*>;
    return *h;
}
// cudaDataType codes: CUDA_R_32F 0, CUDA_R_16F 2, CUDA_R_16BF 14.
int dt_code(int t) { return t == 0 ? 0 : t == 14 ? 1 : t == 2 ? 2 : -1; }
}  // namespace

API int cublasCreate_v2(Blas** h) {
    int dev = need_ctx("cublasCreate");
    if (dev < 0) return CUBLAS_STATUS_NOT_INITIALIZED;
    std::lock_guard<std::mutex> g(S().mu);
    *h = new Blas{dev, nullptr};
    blas_handles().insert(*h);
    return CUBLAS_STATUS_SUCCESS;
}

API int cublasDestroy_v2(Blas* h) {
    std::lock_guard<std::mutex> g(S().mu);
    if (!blas_handles().erase(h)) {
        say("cublasDestroy: %p is not a live handle", (void*)h);
        return CUBLAS_STATUS_NOT_INITIALIZED;
    }
    delete h;
    return CUBLAS_STATUS_SUCCESS;
}

API int cublasSetStream_v2(Blas* h, void* st) {
    std::lock_guard<std::mutex> g(S().mu);
    if (!blas_handles().count(h)) return CUBLAS_STATUS_NOT_INITIALIZED;
    if (!stream_ok(st, "cublasSetStream")) return CUBLAS_STATUS_INVALID_VALUE;
    h->stream = st;
    return CUBLAS_STATUS_SUCCESS;
}

API int cublasSetWorkspace_v2(Blas* h, void* ws, size_t bytes) {
    std::lock_guard<std::mutex> g(S().mu);
    if (!blas_handles().count(h)) return CUBLAS_STATUS_NOT_INITIALIZED;
    if (bytes && !find((uintptr_t)ws, bytes, h->dev, "cublasSetWorkspace", "workspace"))
        return CUBLAS_STATUS_INVALID_VALUE;
    return CUBLAS_STATUS_SUCCESS;
}

API int cublasGetProperty(int type, int* v) {
    int parts[3] = {CUBLAS_VERSION / 10000, CUBLAS_VERSION / 100 % 100, CUBLAS_VERSION % 100};
    if (type < 0 || type > 2) return CUBLAS_STATUS_INVALID_VALUE;
    *v = parts[type];
    return CUBLAS_STATUS_SUCCESS;
}

API int cublasGetVersion_v2(Blas*, int* v) {
    *v = CUBLAS_VERSION;
    return CUBLAS_STATUS_SUCCESS;
}

API size_t cublasLtGetVersion() { return CUBLAS_VERSION; }

API int cublasGemmStridedBatchedEx(Blas* h, int transa, int transb, int m, int n, int k, const void* alpha,
                                   const void* A, int atype, int lda, long long stride_a, const void* B, int btype,
                                   int ldb, long long stride_b, const void* beta, void* C, int ctype, int ldc,
                                   long long stride_c, int batch, int compute, int algo) {
    const char* fn = "cublasGemmStridedBatchedEx";
    std::lock_guard<std::mutex> g(S().mu);
    if (!blas_handles().count(h)) {
        say("%s: %p is not a live handle", fn, (void*)h);
        return CUBLAS_STATUS_NOT_INITIALIZED;
    }
    if (current == nullptr || current->dev != h->dev) {
        say("%s: the handle was made in device %d's context, which is not current", fn, h->dev);
        return CUBLAS_STATUS_NOT_INITIALIZED;
    }
    (void)algo;
    if (transa > 1 || transb > 1 || transa < 0 || transb < 0) {
        say("%s: only CUBLAS_OP_N and CUBLAS_OP_T are supported here (got %d, %d)", fn, transa, transb);
        return CUBLAS_STATUS_INVALID_VALUE;
    }
    if (m < 0 || n < 0 || k < 0 || batch < 0) {
        say("%s: negative size m=%d n=%d k=%d batch=%d", fn, m, n, k, batch);
        return CUBLAS_STATUS_INVALID_VALUE;
    }
    int ra = transa ? k : m, rb = transb ? n : k;
    if (lda < (ra > 1 ? ra : 1) || ldb < (rb > 1 ? rb : 1) || ldc < (m > 1 ? m : 1)) {
        say("%s: leading dimensions lda=%d ldb=%d ldc=%d are below the rows of op(A)^T.. (%d, %d, %d)", fn, lda,
            ldb, ldc, ra, rb, m);
        return CUBLAS_STATUS_INVALID_VALUE;
    }
    int ab = dt_code(atype), c = dt_code(ctype);
    if (atype != btype || ab < 0 || c < 0 || (c != ab && c != 0) || compute != 68 /* CUBLAS_COMPUTE_32F */) {
        say("%s: types A=%d B=%d C=%d compute=%d are not a combination cuBLAS supports", fn, atype, btype, ctype,
            compute);
        return CUBLAS_STATUS_NOT_SUPPORTED;
    }
    if (m == 0 || n == 0 || batch == 0) return CUBLAS_STATUS_SUCCESS;
    // Each operand's last element must lie in the allocation its start does.
    auto extent = [](long long rows, long long cols, long long ld, long long stride, long long b, int t) {
        long long size = t == 0 ? 4 : 2;
        return (size_t)(((b - 1) * stride + (cols - 1) * ld + rows) * size);
    };
    if (k > 0 && (!find((uintptr_t)A, extent(ra, transa ? m : k, lda, stride_a, batch, ab), h->dev, fn, "A") ||
                  !find((uintptr_t)B, extent(rb, transb ? k : n, ldb, stride_b, batch, ab), h->dev, fn, "B")))
        return CUBLAS_STATUS_INVALID_VALUE;
    if (!find((uintptr_t)C, extent(m, n, ldc, stride_c, batch, c), h->dev, fn, "C")) return CUBLAS_STATUS_INVALID_VALUE;
    MemfitGemm gm{transa, transb, m, n, k, *static_cast<const float*>(alpha), A, lda, stride_a, B, ldb, stride_b,
                  ab, *static_cast<const float*>(beta), C, ldc, stride_c, c, batch};
    memfit_simt_gemm(&gm, S().threads);
    return CUBLAS_STATUS_SUCCESS;
}

// ---------------------------------------------------------------- NCCL

namespace {
enum : int {
    ncclSuccess = 0,
    ncclSystemError = 2,
    ncclInternalError = 3,
    ncclInvalidArgument = 4,
    ncclInvalidUsage = 5,
    ncclRemoteError = 6,
};
const int NCCL_VERSION = 22703;  // 2.27.3
const char MAGIC[] = "memfit-nccl-double";
const int MAX_RANKS = 64;
// Bytes each rank stages per step of a collective.
const size_t SLOT = 1 << 20;

// The segment all ranks of a communicator map: a header, one slot a rank,
// then a channel for every ordered pair of ranks (`Chan`, below).
struct Shared {
    std::atomic<int> joined;
    std::atomic<int> arrived;
    std::atomic<unsigned> generation;
    std::atomic<int> aborted;
    int nranks;
    pid_t pids[MAX_RANKS];
};

// Rank src's channel to rank dst, for ncclSend and ncclRecv: one message at
// a time, numbered from 1. Each side posts its count and type for message
// k (then stores k in `sent` or `received`) only once both sides finished
// k-1, so neither header is overwritten before the other side read it.
// `staged` and `taken` count the bytes ever put into the channel's buffer
// and taken out of it: the sender stages a chunk when they are equal.
struct Chan {
    std::atomic<uint64_t> sent, received;
    std::atomic<uint64_t> send_done, recv_done;
    std::atomic<uint64_t> staged, taken;
    uint64_t send_count, recv_count;
    int send_dt, recv_dt;
};

struct Comm {
    Shared* sh;
    size_t bytes;
    int rank, nranks, dev;
    std::atomic<int> error{ncclSuccess};
    double timeout;
    Chan* chans;                  // nranks * nranks, by source then destination
    unsigned char* chan_data;     // their buffers, chan_bytes each
    size_t chan_bytes;
    std::vector<uint64_t> sends, recvs;  // messages this rank posted to and from each peer
    unsigned char* slot(int r) { return reinterpret_cast<unsigned char*>(sh + 1) + (size_t)r * SLOT; }
    Chan* chan(int src, int dst) { return chans + (size_t)src * nranks + dst; }
    unsigned char* buffer(int src, int dst) { return chan_data + ((size_t)src * nranks + dst) * chan_bytes; }
};

// Where a segment's channels start, and its size: each rank's channels to
// its peers share one slot's worth of buffer.
size_t chans_at(int nranks) { return (sizeof(Shared) + (size_t)nranks * SLOT + 63) / 64 * 64; }
size_t chan_bytes(int nranks) { return SLOT / (size_t)nranks / 64 * 64; }
size_t segment_bytes(int nranks) {
    size_t pairs = (size_t)nranks * nranks;
    return chans_at(nranks) + pairs * sizeof(Chan) + pairs * chan_bytes(nranks);
}

double now() {
    timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

// Turn `spins` of a wait for peers that began at `t0`: an abort, an error
// on the comm, a dead peer or the timeout ends the wait with an error, as
// NCCL's watchdog would. ncclSuccess to wait on (`idle`, then look again).
int watch(Comm* c, unsigned spins, double t0) {
    Shared* sh = c->sh;
    if (sh->aborted.load() || c->error.load() != ncclSuccess) return ncclRemoteError;
    if (spins < 1000 || spins % 1000 != 0) return ncclSuccess;
    for (int r = 0; r < c->nranks; r++) {
        if (sh->pids[r] > 0 && kill(sh->pids[r], 0) != 0 && errno == ESRCH) {
            say("NCCL: rank %d (pid %d) is gone", r, (int)sh->pids[r]);
            sh->aborted.store(1);
            return ncclRemoteError;
        }
    }
    if (now() - t0 > c->timeout) {
        say("NCCL: rank %d waited %.0f s for its peers", c->rank, c->timeout);
        return ncclRemoteError;
    }
    return ncclSuccess;
}

void idle(unsigned spins) {
    if (spins < 1000)
        sched_yield();
    else
        usleep(100);
}

// Every rank arrives before any leaves.
int barrier(Comm* c) {
    Shared* sh = c->sh;
    unsigned gen = sh->generation.load();
    if (sh->arrived.fetch_add(1) == c->nranks - 1) {
        sh->arrived.store(0);
        sh->generation.fetch_add(1);
        return ncclSuccess;
    }
    double t0 = now();
    for (unsigned spins = 0; sh->generation.load() == gen; spins++) {
        if (int rc = watch(c, spins, t0)) return rc;
        idle(spins);
    }
    return ncclSuccess;
}

// ncclDataType_t: Float16 6, Float32 7, Bfloat16 9 (the types memfit sends).
int elem(int dt) { return dt == 7 ? 0 : dt == 9 ? 1 : dt == 6 ? 2 : -1; }
size_t esize(int e) { return e == 0 ? 4 : 2; }

float ld(const unsigned char* p, int e, size_t i) { return memfit_simt_to_f32(p, e, (long long)i); }
void st(unsigned char* p, int e, size_t i, float v) { memfit_simt_from_f32(p, e, (long long)i, v); }

std::set<Comm*>& comms() {
    static auto* c = new std::set<Comm*>;
    return *c;
}

int check_comm(Comm* c, const char* fn) {
    if (!comms().count(c)) {
        say("%s: %p is not a live communicator", fn, (void*)c);
        return ncclInvalidArgument;
    }
    if (c->error.load() != ncclSuccess) return c->error.load();
    if (current == nullptr || current->dev != c->dev) {
        say("%s: the communicator's device %d is not the current context's", fn, c->dev);
        return ncclInvalidUsage;
    }
    return ncclSuccess;
}

bool stream_live(void* st, const char* fn) {
    std::lock_guard<std::mutex> g(S().mu);
    return stream_ok(st, fn);
}

// Pointers NCCL reads or writes must be device memory of the comm's GPU.
bool buf_ok(const void* p, size_t n, Comm* c, const char* fn, const char* what) {
    std::lock_guard<std::mutex> g(S().mu);
    return n == 0 || find((uintptr_t)p, n, c->dev, fn, what) != nullptr;
}

int fail(Comm* c, int rc) {
    if (rc != ncclSuccess) c->error.store(rc);
    return rc;
}

}  // namespace

typedef struct {
    char internal[128];
} ncclUniqueId;

API int ncclGetVersion(int* v) {
    *v = NCCL_VERSION;
    return ncclSuccess;
}

API const char* ncclGetErrorString(int rc) {
    switch (rc) {
        case ncclSuccess: return "no error";
        case ncclSystemError: return "unhandled system error";
        case ncclInvalidArgument: return "invalid argument";
        case ncclInvalidUsage: return "invalid usage";
        case ncclRemoteError: return "remote process exited or there was a network error";
        default: return "internal error";
    }
}

API const char* ncclGetLastError(Comm*) { return ""; }

API int ncclGetUniqueId(ncclUniqueId* id) {
    std::memset(id, 0, sizeof *id);
    static std::atomic<unsigned> counter{0};
    timespec t;
    clock_gettime(CLOCK_REALTIME, &t);
    std::snprintf(id->internal, sizeof id->internal, "%s /memfit-nccl-%d-%ld-%u", MAGIC, (int)getpid(),
                  (long)t.tv_nsec, counter.fetch_add(1));
    return ncclSuccess;
}

API int ncclCommInitRank(Comm** out, int nranks, ncclUniqueId id, int rank) {
    const char* fn = "ncclCommInitRank";
    int dev = need_ctx(fn);
    if (dev < 0) return ncclInvalidUsage;
    if (std::strncmp(id.internal, MAGIC, sizeof MAGIC - 1) != 0) {
        say("%s: the unique id was not made by ncclGetUniqueId", fn);
        return ncclInvalidArgument;
    }
    if (nranks < 1 || nranks > MAX_RANKS || rank < 0 || rank >= nranks) {
        say("%s: rank %d of %d", fn, rank, nranks);
        return ncclInvalidArgument;
    }
    const char* name = std::strchr(id.internal, '/');
    size_t bytes = segment_bytes(nranks);
    int fd = shm_open(name, O_CREAT | O_RDWR, 0600);
    if (fd < 0 || ftruncate(fd, (off_t)bytes) != 0) {
        say("%s: shared memory %s: %s", fn, name, std::strerror(errno));
        if (fd >= 0) close(fd);
        return ncclSystemError;
    }
    void* m = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    close(fd);
    if (m == MAP_FAILED) return ncclSystemError;
    Comm* c = new Comm;
    c->sh = static_cast<Shared*>(m);
    c->bytes = bytes;
    c->rank = rank;
    c->nranks = nranks;
    c->dev = dev;
    c->timeout = (double)env_int("MEMFIT_NCCL_DOUBLE_TIMEOUT", 300);
    c->chans = reinterpret_cast<Chan*>(static_cast<unsigned char*>(m) + chans_at(nranks));
    c->chan_data = reinterpret_cast<unsigned char*>(c->chans + (size_t)nranks * nranks);
    c->chan_bytes = chan_bytes(nranks);
    c->sends.assign((size_t)nranks, 0);
    c->recvs.assign((size_t)nranks, 0);
    c->sh->pids[rank] = getpid();
    c->sh->joined.fetch_add(1);
    {
        std::lock_guard<std::mutex> g(S().mu);
        comms().insert(c);
    }
    int rc = barrier(c);
    if (rank == 0) shm_unlink(name);  // every rank has it mapped now
    if (rc != ncclSuccess) return rc;
    if (c->sh->joined.load() != nranks) {
        say("%s: %d ranks joined a communicator of %d", fn, c->sh->joined.load(), nranks);
        return ncclInvalidUsage;
    }
    *out = c;
    return ncclSuccess;
}

static int destroy(Comm* c, bool abort) {
    {
        std::lock_guard<std::mutex> g(S().mu);
        if (!comms().erase(c)) return ncclInvalidArgument;
    }
    if (abort) {
        // Another thread may still wait inside a collective on this comm:
        // tell every rank, and leave the mapping (a few MiB) in place.
        c->error.store(ncclRemoteError);
        c->sh->aborted.store(1);
        return ncclSuccess;
    }
    munmap(c->sh, c->bytes);
    delete c;
    return ncclSuccess;
}

API int ncclCommDestroy(Comm* c) { return destroy(c, false); }
API int ncclCommAbort(Comm* c) { return destroy(c, true); }

API int ncclCommGetAsyncError(Comm* c, int* rc) {
    std::lock_guard<std::mutex> g(S().mu);
    if (!comms().count(c)) return ncclInvalidArgument;
    *rc = c->error.load();
    return ncclSuccess;
}

API int ncclCommCount(Comm* c, int* n) {
    *n = c->nranks;
    return ncclSuccess;
}
API int ncclCommUserRank(Comm* c, int* r) {
    *r = c->rank;
    return ncclSuccess;
}
API int ncclCommCuDevice(Comm* c, int* d) {
    *d = c->dev;
    return ncclSuccess;
}

namespace {
// A queued ncclSend or ncclRecv, and how far it got (`step`).
struct P2p {
    Comm* c;
    bool send;
    int peer, dt, e;
    unsigned char* buf;
    size_t count;
    uint64_t seq;  // its message's number on its channel
    int phase;     // 0 post the header, 1 read the peer's, 2 move the data, 3 done
    size_t moved;  // bytes
};

// This thread's group (NCCL keeps it per thread too): its depth, the
// operations queued in it, and the first error a call in it returned.
thread_local int group_depth = 0;
thread_local std::vector<P2p> group_ops;
thread_local int group_error = ncclSuccess;

int group_fails(int rc) {
    if (group_depth > 0 && group_error == ncclSuccess) group_error = rc;
    return rc;
}
}  // namespace

// What every collective checks first: a live communicator on the current
// device, a type memfit sends (ncclSum where it reduces), a live stream.
// The element code, or -1 with `*rc` set.
int begin(Comm* c, const char* fn, int dt, int op, bool reduces, void* stream, int* rc) {
    if (group_depth > 0) {
        say("%s inside ncclGroupStart/ncclGroupEnd: this double runs collectives at once and cannot defer "
            "them (it groups ncclSend and ncclRecv only)",
            fn);
        *rc = group_fails(ncclInvalidUsage);
        return -1;
    }
    if ((*rc = check_comm(c, fn))) return -1;
    int e = elem(dt);
    if (e < 0 || (reduces && op != 0)) {
        say("%s: only ncclSum on float32, float16 and bfloat16 is supported here (type %d, op %d)", fn, dt, op);
        *rc = ncclInvalidArgument;
        return -1;
    }
    if (!stream_live(stream, fn)) {
        *rc = ncclInvalidArgument;
        return -1;
    }
    return e;
}

// The shape of every collective here: `count` elements in steps of at most
// `per`; each step, `put` stages this rank's part in its slot, every rank
// waits for the others, `take` reads what it needs from the slots, and
// every rank waits again before a slot is reused.
template <class Put, class Take>
int staged(Comm* c, size_t count, size_t per, Put put, Take take) {
    for (size_t off = 0; off < count; off += per) {
        size_t n = count - off < per ? count - off : per;
        put(off, n);
        int rc = barrier(c);
        if (rc) return fail(c, rc);
        take(off, n);
        if ((rc = barrier(c))) return fail(c, rc);
    }
    return ncclSuccess;
}

// Element `at` summed over the ranks' slots, in rank order, in fp32.
float sum_slots(Comm* c, int e, size_t at) {
    float acc = ld(c->slot(0), e, at);
    for (int r = 1; r < c->nranks; r++) acc += ld(c->slot(r), e, at);
    return acc;
}

// Sums are taken in rank order in fp32 and rounded once to the buffer's
// type; with two ranks that is every order NCCL could use.
API int ncclAllReduce(const void* send, void* recv, size_t count, int dt, int op, Comm* c, void* stream) {
    const char* fn = "ncclAllReduce";
    int rc, e = begin(c, fn, dt, op, true, stream, &rc);
    if (e < 0) return rc;
    size_t es = esize(e);
    if (!buf_ok(send, count * es, c, fn, "send buffer") || !buf_ok(recv, count * es, c, fn, "receive buffer"))
        return ncclInvalidArgument;
    auto in = static_cast<const unsigned char*>(send);
    auto out = static_cast<unsigned char*>(recv);
    return staged(
        c, count, SLOT / es, [&](size_t off, size_t n) { std::memcpy(c->slot(c->rank), in + off * es, n * es); },
        [&](size_t off, size_t n) {
            for (size_t i = 0; i < n; i++) st(out + off * es, e, i, sum_slots(c, e, i));
        });
}

API int ncclReduceScatter(const void* send, void* recv, size_t count, int dt, int op, Comm* c, void* stream) {
    const char* fn = "ncclReduceScatter";
    int rc, e = begin(c, fn, dt, op, true, stream, &rc);
    if (e < 0) return rc;
    size_t es = esize(e), N = (size_t)c->nranks;
    if (!buf_ok(send, count * N * es, c, fn, "send buffer") || !buf_ok(recv, count * es, c, fn, "receive buffer"))
        return ncclInvalidArgument;
    auto in = static_cast<const unsigned char*>(send);
    auto out = static_cast<unsigned char*>(recv);
    // Each step stages n elements for every destination rank.
    return staged(
        c, count, SLOT / es / N,
        [&](size_t off, size_t n) {
            for (size_t d = 0; d < N; d++)
                std::memcpy(c->slot(c->rank) + d * n * es, in + (d * count + off) * es, n * es);
        },
        [&](size_t off, size_t n) {
            for (size_t i = 0; i < n; i++) st(out + off * es, e, i, sum_slots(c, e, (size_t)c->rank * n + i));
        });
}

API int ncclAllGather(const void* send, void* recv, size_t count, int dt, Comm* c, void* stream) {
    const char* fn = "ncclAllGather";
    int rc, e = begin(c, fn, dt, 0, false, stream, &rc);
    if (e < 0) return rc;
    size_t es = esize(e), N = (size_t)c->nranks;
    if (!buf_ok(send, count * es, c, fn, "send buffer") || !buf_ok(recv, count * N * es, c, fn, "receive buffer"))
        return ncclInvalidArgument;
    auto in = static_cast<const unsigned char*>(send);
    auto out = static_cast<unsigned char*>(recv);
    return staged(
        c, count, SLOT / es, [&](size_t off, size_t n) { std::memcpy(c->slot(c->rank), in + off * es, n * es); },
        [&](size_t off, size_t n) {
            for (size_t r = 0; r < N; r++) std::memcpy(out + (r * count + off) * es, c->slot((int)r), n * es);
        });
}

API int ncclBroadcast(const void* send, void* recv, size_t count, int dt, int root, Comm* c, void* stream) {
    const char* fn = "ncclBroadcast";
    int rc, e = begin(c, fn, dt, 0, false, stream, &rc);
    if (e < 0) return rc;
    size_t es = esize(e);
    if (root < 0 || root >= c->nranks) {
        say("%s: root %d of %d ranks", fn, root, c->nranks);
        return ncclInvalidArgument;
    }
    if ((c->rank == root && !buf_ok(send, count * es, c, fn, "send buffer")) ||
        !buf_ok(recv, count * es, c, fn, "receive buffer"))
        return ncclInvalidArgument;
    auto in = static_cast<const unsigned char*>(send);
    auto out = static_cast<unsigned char*>(recv);
    return staged(
        c, count, SLOT / es,
        [&](size_t off, size_t n) {
            if (c->rank == root) std::memcpy(c->slot(root), in + off * es, n * es);
        },
        [&](size_t off, size_t n) { std::memcpy(out + off * es, c->slot(root), n * es); });
}

// ---------------------------------------------------------------- NCCL point-to-point

// ncclSend and ncclRecv, and the groups around them (NCCL's user guide,
// "Point-to-point communication" and "Group calls"). Between
// ncclGroupStart and ncclGroupEnd a thread's sends and receives are checked
// and queued; groups nest, and only the ncclGroupEnd that brings the depth
// back to 0 runs what was queued, all of it together, so a rank may post a
// send and a receive to every peer, itself included, in any order. A call
// outside a group is a group of its own. The n-th send from rank s to rank
// d meets the n-th receive d posts from s, through the pair's channel
// (`Chan`): both sides post their count and type, which must agree (NCCL
// requires it and checks nothing; here a mismatch fails both sides with
// ncclInvalidUsage before a byte moves), then the data goes through the
// channel's buffer a chunk at a time. The group polls every operation in
// turn until all are done, so no order of them can deadlock.

namespace {
const char* dt_name(int dt) { return dt == 7 ? "float32" : dt == 9 ? "bfloat16" : dt == 6 ? "float16" : "?"; }

// Advances `op` as far as it goes without waiting; sets `moved` when it
// did anything. ncclSuccess (done when `op.phase` is 3), or an error.
int step(P2p& op, bool& moved) {
    Comm* c = op.c;
    int src = op.send ? c->rank : op.peer, dst = op.send ? op.peer : c->rank;
    Chan* ch = c->chan(src, dst);
    uint64_t k = op.seq;
    if (op.phase == 0) {
        bool ready = op.send ? ch->send_done.load() == k - 1 && ch->recv_done.load() >= k - 1
                             : ch->recv_done.load() == k - 1 && ch->send_done.load() >= k - 1;
        if (!ready) return ncclSuccess;
        if (op.send) {
            ch->send_count = op.count;
            ch->send_dt = op.dt;
            ch->sent.store(k);
        } else {
            ch->recv_count = op.count;
            ch->recv_dt = op.dt;
            ch->received.store(k);
        }
        op.phase = 1;
        moved = true;
    }
    if (op.phase == 1) {
        if ((op.send ? ch->received.load() : ch->sent.load()) < k) return ncclSuccess;
        if (ch->send_count != ch->recv_count || ch->send_dt != ch->recv_dt) {
            say("%s: rank %d's send #%llu to rank %d is %llu %s, and rank %d's receive for it %llu %s: a send and "
                "its receive must have the same count and type",
                op.send ? "ncclSend" : "ncclRecv", src, (unsigned long long)k, dst,
                (unsigned long long)ch->send_count, dt_name(ch->send_dt), dst, (unsigned long long)ch->recv_count,
                dt_name(ch->recv_dt));
            return ncclInvalidUsage;
        }
        op.phase = 2;
        moved = true;
    }
    if (op.phase != 2) return ncclSuccess;
    size_t total = op.count * esize(op.e);
    unsigned char* box = c->buffer(src, dst);
    if (op.send) {
        if (op.moved < total && ch->staged.load() == ch->taken.load()) {
            size_t n = total - op.moved < c->chan_bytes ? total - op.moved : c->chan_bytes;
            std::memcpy(box, op.buf + op.moved, n);
            op.moved += n;
            ch->staged.fetch_add(n);
            moved = true;
        }
        if (op.moved == total) ch->send_done.store(k);
    } else {
        uint64_t staged = ch->staged.load(), taken = ch->taken.load();
        if (staged > taken) {
            size_t n = (size_t)(staged - taken);
            if (op.moved + n > total) {
                say("ncclRecv: rank %d staged %zu bytes past the %zu of message #%llu to rank %d", src,
                    op.moved + n - total, total, (unsigned long long)k, dst);
                return ncclInternalError;
            }
            std::memcpy(op.buf + op.moved, box, n);
            op.moved += n;
            ch->taken.store(staged);
            moved = true;
        }
        if (op.moved == total) ch->recv_done.store(k);
    }
    if (op.moved == total) op.phase = 3;
    return ncclSuccess;
}

// Runs a group's operations together until every one is done.
int launch(std::vector<P2p>& ops) {
    // The group is the only place a rank's send to itself can meet its
    // receive: this thread runs nothing else until the group is done.
    std::map<Comm*, int> self;
    for (auto& op : ops)
        if (op.peer == op.c->rank) self[op.c] += op.send ? 1 : -1;
    for (auto& s : self) {
        if (s.second != 0) {
            say("ncclGroupEnd: rank %d has %d more send(s) to itself than receive(s) from itself in one group; "
                "each needs its partner in the same group",
                s.first->rank, s.second);
            return ncclInvalidUsage;
        }
    }
    {
        std::lock_guard<std::mutex> g(S().mu);
        for (auto& op : ops) {
            if (!comms().count(op.c)) {
                say("ncclGroupEnd: communicator %p was destroyed after a call on it was queued", (void*)op.c);
                return ncclInvalidArgument;
            }
        }
    }
    for (auto& op : ops) {
        if (int rc = op.c->error.load()) return rc;
        op.seq = ++(op.send ? op.c->sends : op.c->recvs)[(size_t)op.peer];
    }
    double t0 = now();
    for (unsigned spins = 0;; spins++) {
        bool moved = false, done = true;
        for (auto& op : ops) {
            if (op.phase == 3) continue;
            if (int rc = step(op, moved)) return fail(op.c, rc);
            done = done && op.phase == 3;
        }
        if (done) return ncclSuccess;
        if (moved) {
            t0 = now();
            spins = 0;
            continue;
        }
        for (auto& op : ops)
            if (op.phase != 3)
                if (int rc = watch(op.c, spins, t0)) return fail(op.c, rc);
        idle(spins);
    }
}

int post(bool send, const void* buf, size_t count, int dt, int peer, Comm* c, void* stream) {
    const char* fn = send ? "ncclSend" : "ncclRecv";
    if (int rc = check_comm(c, fn)) return group_fails(rc);
    int e = elem(dt);
    if (e < 0) {
        say("%s: only float32, float16 and bfloat16 are supported here (type %d)", fn, dt);
        return group_fails(ncclInvalidArgument);
    }
    if (peer < 0 || peer >= c->nranks) {
        say("%s: peer %d of %d ranks", fn, peer, c->nranks);
        return group_fails(ncclInvalidArgument);
    }
    if (!stream_live(stream, fn) || !buf_ok(buf, count * esize(e), c, fn, send ? "send buffer" : "receive buffer"))
        return group_fails(ncclInvalidArgument);
    P2p op{c, send, peer, dt, e, static_cast<unsigned char*>(const_cast<void*>(buf)), count, 0, 0, 0};
    if (group_depth > 0) {
        group_ops.push_back(op);
        return ncclSuccess;
    }
    std::vector<P2p> one{op};
    return launch(one);
}
}  // namespace

API int ncclSend(const void* send, size_t count, int dt, int peer, Comm* c, void* stream) {
    return post(true, send, count, dt, peer, c, stream);
}

API int ncclRecv(void* recv, size_t count, int dt, int peer, Comm* c, void* stream) {
    return post(false, recv, count, dt, peer, c, stream);
}

API int ncclGroupStart() {
    group_depth++;
    return ncclSuccess;
}

// Only the outermost end runs the group; one whose calls failed runs none
// of them and returns the first failure, as NCCL does.
API int ncclGroupEnd() {
    if (group_depth == 0) {
        say("ncclGroupEnd without ncclGroupStart");
        return ncclInvalidUsage;
    }
    if (--group_depth > 0) return ncclSuccess;
    std::vector<P2p> ops;
    ops.swap(group_ops);
    int rc = group_error;
    group_error = ncclSuccess;
    if (rc != ncclSuccess) {
        say("ncclGroupEnd: a call in the group failed (%s), so none of its %zu queued operation(s) ran",
            ncclGetErrorString(rc), ops.size());
        return rc;
    }
    return launch(ops);
}
