/*
 * nvml_double: a scripted stand-in for libnvidia-ml.so, so that memfit's
 * telemetry (src/telemetry.rs, through nvml-wrapper) runs for real on
 * machines without a GPU. build.rs compiles it to
 * $OUT_DIR/libnvml_double.so and exports the path as the compile-time env
 * MEMFIT_NVML_DOUBLE; load it with MEMFIT_NVML_LIB=<that path> (or
 * Telemetry::open_with).
 *
 * THE SCRIPT
 *
 * The figures come from a text file, re-read on EVERY call, so a test (or a
 * child process) can change them while NVML is open. Which file:
 *   1. $NVML_DOUBLE_SCRIPT, when set and non-empty;
 *   2. otherwise "<path this library was loaded from>.script", e.g.
 *      /tmp/t1/libnvml_double.so.script. dlopen() shares one instance per
 *      file, so in-process tests copy the library to a directory of their own
 *      and put its script next to it: no process-wide env needed.
 * An empty or unreadable script counts as none. None at nvmlInit_v2: it
 * fails with NVML_ERROR_LIBRARY_NOT_FOUND (12) and says why on stderr. None
 * later (a writer truncating it) is ignored: the last one read stays in
 * force. Writers should still replace the file atomically (write a temp file,
 * then rename it over the script) so no reader sees half of it.
 *
 * One directive per line; '#' starts a comment; numbers are decimal
 * integers (bytes, %, mW, MHz, degrees C); names are "quoted" or one word.
 *
 *   gpus N               number of GPUs (default: 1 + the highest GPU index
 *                        named by any gpu/proc/proc_from_file line, at least 1)
 *   gpu I KEY VALUE ...  figures of GPU I, KEYs in any order, any subset:
 *                          name "NVIDIA H200"     (default "NVML double GPU I")
 *                          total BYTES            (default 85899345920, 80 GiB)
 *                          used BYTES             (default: the sum of the
 *                                                  GPU's processes' bytes)
 *                          util PCT memutil PCT   (default 0, 0)
 *                          power_mw MW limit_mw MW (default 100000, 700000)
 *                          sm_mhz MHZ temp C      (default 1980, 40)
 *                          mig 0|1                (MIG mode, current and
 *                                                  pending; default 0)
 *                        several gpu lines for one GPU add up (later wins).
 *   proc I PID BYTES     a compute process on GPU I; BYTES may be "na"
 *                        (NVML_VALUE_NOT_AVAILABLE, e.g. under WDDM)
 *   proc_from_file I PATH
 *                        more processes on GPU I, read from PATH on every
 *                        call: lines "PID BYTES"; a missing file means none.
 *                        Lets a child process publish its own pid and bytes.
 *   self I BYTES         the process that loaded the library is a compute
 *                        process on GPU I with BYTES (each rank of a
 *                        launched job, loading it itself, sees only itself)
 *   children I BYTES     every child process of the process that loaded
 *                        the library (found in /proc) is a compute process
 *                        on GPU I with BYTES: a sweep's trial processes,
 *                        whose pids no script can know in advance
 *   used_step I BYTES    every nvmlDeviceGetMemoryInfo(_v2) on GPU I adds
 *                        BYTES to the used figure (a rising curve; the
 *                        count lives in the loaded library, from its load on)
 *   unsupported I WHAT.. the queries WHAT on GPU I return
 *                        NVML_ERROR_NOT_SUPPORTED (3)
 *   fail I WHAT CODE     the query WHAT on GPU I returns nvmlReturn_t CODE
 *   lost I               every query on GPU I returns NVML_ERROR_GPU_IS_LOST
 *                        (15), the handle lookup included
 *                        WHAT is one of: handle name memory util power limit
 *                        clock temp procs mig all
 *   init_error CODE      nvmlInit_v2/nvmlInitWithFlags return CODE
 *                        (e.g. 9 = NVML_ERROR_DRIVER_NOT_LOADED)
 *   count_error CODE     nvmlDeviceGetCount_v2 returns CODE
 *   driver VERSION       nvmlSystemGetDriverVersion (default "999.99.99")
 *
 * Example:
 *   gpus 2
 *   gpu 0 name "NVIDIA H200" total 150000000000 used 1000000 util 37 memutil 12
 *   gpu 0 power_mw 300000 limit_mw 700000 sm_mhz 1980 temp 45
 *   proc 0 4242 1000000
 *   lost 1
 *
 * EXPORTED SYMBOLS (what nvml-wrapper 0.13 calls for memfit's queries):
 *   nvmlInit_v2 nvmlInitWithFlags nvmlShutdown nvmlErrorString
 *   nvmlSystemGetDriverVersion nvmlSystemGetNVMLVersion
 *   nvmlSystemGetCudaDriverVersion nvmlSystemGetCudaDriverVersion_v2
 *   nvmlDeviceGetCount_v2 nvmlDeviceGetHandleByIndex_v2 nvmlDeviceGetIndex
 *   nvmlDeviceGetName nvmlDeviceGetMemoryInfo nvmlDeviceGetMemoryInfo_v2
 *   nvmlDeviceGetUtilizationRates nvmlDeviceGetPowerUsage
 *   nvmlDeviceGetEnforcedPowerLimit nvmlDeviceGetClockInfo
 *   nvmlDeviceGetTemperature nvmlDeviceGetComputeRunningProcesses_v3
 * Anything else is absent: nvml-wrapper reports it as a symbol that failed to
 * load.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <pthread.h>
#include <stdint.h>
#include <dirent.h>
#include <stdio.h>
#include <unistd.h>
#include <stdlib.h>
#include <string.h>

#define EXPORT __attribute__((visibility("default")))

typedef unsigned int nvmlReturn_t;
enum {
    NVML_SUCCESS = 0,
    NVML_ERROR_UNINITIALIZED = 1,
    NVML_ERROR_INVALID_ARGUMENT = 2,
    NVML_ERROR_NOT_SUPPORTED = 3,
    NVML_ERROR_NOT_FOUND = 6,
    NVML_ERROR_INSUFFICIENT_SIZE = 7,
    NVML_ERROR_DRIVER_NOT_LOADED = 9,
    NVML_ERROR_LIBRARY_NOT_FOUND = 12,
    NVML_ERROR_GPU_IS_LOST = 15,
    NVML_ERROR_ARGUMENT_VERSION_MISMATCH = 25,
    NVML_ERROR_UNKNOWN = 999,
};

/* Layouts as in nvml.h / nvml-wrapper-sys 0.10 bindings. */
typedef struct {
    unsigned int gpu;
    unsigned int memory;
} nvmlUtilization_t;

typedef struct {
    unsigned long long total;
    unsigned long long free;
    unsigned long long used;
} nvmlMemory_t;

typedef struct {
    unsigned int version;
    unsigned long long total;
    unsigned long long reserved;
    unsigned long long free;
    unsigned long long used;
} nvmlMemory_v2_t;

typedef struct {
    unsigned int pid;
    unsigned long long usedGpuMemory;
    unsigned int gpuInstanceId;
    unsigned int computeInstanceId;
} nvmlProcessInfo_t; /* nvmlProcessInfo_v2_t, used by the _v3 query */

#define NVML_STRUCT_VERSION_MEMORY_2 ((unsigned int)(sizeof(nvmlMemory_v2_t) | (2u << 24)))
#define NVML_VALUE_NOT_AVAILABLE_ULL (~0ULL)
#define NO_INSTANCE 0xFFFFFFFFu

#define MAX_GPUS 16
#define MAX_PROCS 64
#define MAX_FILES 4

enum { Q_HANDLE, Q_NAME, Q_MEMORY, Q_UTIL, Q_POWER, Q_LIMIT, Q_CLOCK, Q_TEMP, Q_PROCS, Q_MIG, Q_COUNT };
static const char *const QUERY_NAMES[Q_COUNT] = {
    "handle", "name", "memory", "util", "power", "limit", "clock", "temp", "procs", "mig",
};

typedef struct {
    unsigned int pid;
    unsigned long long bytes;
} proc_t;

typedef struct {
    char name[96];
    unsigned long long total, used, step;
    int used_set;
    unsigned int util, memutil, power_mw, limit_mw, sm_mhz, temp, mig;
    nvmlReturn_t fail[Q_COUNT];
    proc_t procs[MAX_PROCS];
    unsigned int nprocs;
    char files[MAX_FILES][512];
    unsigned int nfiles;
} gpu_t;

typedef struct {
    int loaded; /* a script has been read */
    unsigned int gpus;
    int gpus_set;
    nvmlReturn_t init_error, count_error;
    char driver[80];
    gpu_t gpu[MAX_GPUS];
} script_t;

typedef struct {
    int index;
} device_t;

static pthread_mutex_t LOCK = PTHREAD_MUTEX_INITIALIZER;
static script_t SCRIPT;        /* the last script read */
static int INITS;              /* nvmlInit refcount */
static unsigned long long STEPS[MAX_GPUS]; /* memory queries so far, per GPU */
static device_t DEVICES[MAX_GPUS];

/* ---- reading the script ---- */

static const char *script_path(char *buf, size_t len) {
    const char *env = getenv("NVML_DOUBLE_SCRIPT");
    if (env && *env) return env;
    Dl_info info;
    if (dladdr((void *)&script_path, &info) && info.dli_fname && *info.dli_fname) {
        snprintf(buf, len, "%s.script", info.dli_fname);
        return buf;
    }
    return NULL;
}

/* Next token of *s: a "quoted string" or a run of non-blanks; NULL at the end. */
static char *token(char **s) {
    char *p = *s;
    while (*p == ' ' || *p == '\t' || *p == '\r' || *p == '\n') p++;
    if (!*p || *p == '#') {
        *s = p;
        return NULL;
    }
    char *start;
    if (*p == '"') {
        start = ++p;
        while (*p && *p != '"') p++;
    } else {
        start = p;
        while (*p && *p != ' ' && *p != '\t' && *p != '\r' && *p != '\n') p++;
    }
    if (*p) *p++ = 0;
    *s = p;
    return start;
}

static unsigned long long num(const char *t) {
    return t ? strtoull(t, NULL, 10) : 0;
}

static int gpu_index(const char *t, unsigned int *highest) {
    if (!t) return -1;
    long i = strtol(t, NULL, 10);
    if (i < 0 || i >= MAX_GPUS) return -1;
    if ((unsigned int)i + 1 > *highest) *highest = (unsigned int)i + 1;
    return (int)i;
}

static int query_of(const char *t) {
    for (int q = 0; q < Q_COUNT; q++)
        if (strcmp(t, QUERY_NAMES[q]) == 0) return q;
    if (strcmp(t, "all") == 0) return Q_COUNT;
    return -1;
}

static void set_fail(gpu_t *g, int q, nvmlReturn_t code) {
    if (q == Q_COUNT) {
        for (int i = 0; i < Q_COUNT; i++) g->fail[i] = code;
    } else if (q >= 0) {
        g->fail[q] = code;
    }
}

static void add_proc(gpu_t *g, const char *pid, const char *bytes) {
    if (!pid || !bytes || g->nprocs >= MAX_PROCS) return;
    proc_t *p = &g->procs[g->nprocs++];
    p->pid = (unsigned int)num(pid);
    p->bytes = strcmp(bytes, "na") == 0 ? NVML_VALUE_NOT_AVAILABLE_ULL : num(bytes);
}

/* Adds every process whose parent is this process (from /proc/PID/stat). */
static void add_children(gpu_t *g, const char *bytes) {
    DIR *d = opendir("/proc");
    if (!d) return;
    long self = (long)getpid();
    struct dirent *e;
    while ((e = readdir(d)) != NULL) {
        if (e->d_name[0] < '0' || e->d_name[0] > '9') continue;
        char path[300];
        snprintf(path, sizeof path, "/proc/%s/stat", e->d_name);
        FILE *f = fopen(path, "r");
        if (!f) continue;
        char buf[1024];
        size_t n = fread(buf, 1, sizeof buf - 1, f);
        fclose(f);
        buf[n] = 0;
        /* pid (comm) state ppid ...: the comm may hold spaces, so parse
         * after its closing parenthesis. */
        char *close = strrchr(buf, ')');
        char state;
        long ppid;
        if (close && sscanf(close + 1, " %c %ld", &state, &ppid) == 2 && ppid == self)
            add_proc(g, e->d_name, bytes);
    }
    closedir(d);
}

static char *slurp(const char *path) {
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    size_t cap = 4096, len = 0;
    char *buf = malloc(cap + 1);
    size_t n;
    while (buf && (n = fread(buf + len, 1, cap - len, f)) > 0) {
        len += n;
        if (len == cap) {
            char *more = realloc(buf, 2 * cap + 1);
            if (!more) {
                free(buf);
                buf = NULL;
                break;
            }
            buf = more;
            cap *= 2;
        }
    }
    fclose(f);
    if (buf) buf[len] = 0;
    return buf;
}

static void defaults(script_t *sc) {
    memset(sc, 0, sizeof *sc);
    sc->loaded = 1;
    snprintf(sc->driver, sizeof sc->driver, "999.99.99");
    for (int i = 0; i < MAX_GPUS; i++) {
        gpu_t *g = &sc->gpu[i];
        snprintf(g->name, sizeof g->name, "NVML double GPU %d", i);
        g->total = 85899345920ULL;
        g->power_mw = 100000;
        g->limit_mw = 700000;
        g->sm_mhz = 1980;
        g->temp = 40;
    }
}

/* Reads the script into SCRIPT; keeps the old one when there is none to read. */
static void reload(void) {
    char pathbuf[4096];
    const char *path = script_path(pathbuf, sizeof pathbuf);
    char *text = path ? slurp(path) : NULL;
    if (!text || !*text) {
        free(text);
        return;
    }
    static script_t sc; /* big: not on the stack; LOCK is held */
    defaults(&sc);
    unsigned int highest = 0;
    char *rest = text;
    while (*rest) {
        char *line = rest;
        char *nl = strchr(rest, '\n');
        if (nl) {
            *nl = 0;
            rest = nl + 1;
        } else {
            rest += strlen(rest);
        }
        char *t = token(&line);
        if (!t) continue;
        if (strcmp(t, "gpus") == 0) {
            sc.gpus = (unsigned int)num(token(&line));
            if (sc.gpus > MAX_GPUS) sc.gpus = MAX_GPUS;
            sc.gpus_set = 1;
        } else if (strcmp(t, "init_error") == 0) {
            sc.init_error = (nvmlReturn_t)num(token(&line));
        } else if (strcmp(t, "count_error") == 0) {
            sc.count_error = (nvmlReturn_t)num(token(&line));
        } else if (strcmp(t, "driver") == 0) {
            char *v = token(&line);
            if (v) snprintf(sc.driver, sizeof sc.driver, "%s", v);
        } else if (strcmp(t, "gpu") == 0) {
            int i = gpu_index(token(&line), &highest);
            if (i < 0) continue;
            gpu_t *g = &sc.gpu[i];
            char *k, *v;
            while ((k = token(&line)) && (v = token(&line))) {
                if (strcmp(k, "name") == 0) snprintf(g->name, sizeof g->name, "%s", v);
                else if (strcmp(k, "total") == 0) g->total = num(v);
                else if (strcmp(k, "used") == 0) g->used = num(v), g->used_set = 1;
                else if (strcmp(k, "util") == 0) g->util = (unsigned int)num(v);
                else if (strcmp(k, "memutil") == 0) g->memutil = (unsigned int)num(v);
                else if (strcmp(k, "power_mw") == 0) g->power_mw = (unsigned int)num(v);
                else if (strcmp(k, "limit_mw") == 0) g->limit_mw = (unsigned int)num(v);
                else if (strcmp(k, "sm_mhz") == 0) g->sm_mhz = (unsigned int)num(v);
                else if (strcmp(k, "temp") == 0) g->temp = (unsigned int)num(v);
                else if (strcmp(k, "mig") == 0) g->mig = (unsigned int)num(v);
                else fprintf(stderr, "nvml_double: unknown gpu key `%s`\n", k);
            }
        } else if (strcmp(t, "proc") == 0) {
            int i = gpu_index(token(&line), &highest);
            char *pid = token(&line);
            char *bytes = token(&line);
            if (i >= 0) add_proc(&sc.gpu[i], pid, bytes);
        } else if (strcmp(t, "proc_from_file") == 0) {
            int i = gpu_index(token(&line), &highest);
            char *p = token(&line);
            if (i >= 0 && p && sc.gpu[i].nfiles < MAX_FILES)
                snprintf(sc.gpu[i].files[sc.gpu[i].nfiles++], 512, "%s", p);
        } else if (strcmp(t, "self") == 0) {
            int i = gpu_index(token(&line), &highest);
            char *bytes = token(&line);
            char pid[32];
            snprintf(pid, sizeof pid, "%ld", (long)getpid());
            if (i >= 0 && bytes) add_proc(&sc.gpu[i], pid, bytes);
        } else if (strcmp(t, "children") == 0) {
            int i = gpu_index(token(&line), &highest);
            char *bytes = token(&line);
            if (i >= 0 && bytes) add_children(&sc.gpu[i], bytes);
        } else if (strcmp(t, "used_step") == 0) {
            int i = gpu_index(token(&line), &highest);
            unsigned long long step = num(token(&line));
            if (i >= 0) sc.gpu[i].step = step;
        } else if (strcmp(t, "unsupported") == 0) {
            int i = gpu_index(token(&line), &highest);
            char *w;
            while (i >= 0 && (w = token(&line))) set_fail(&sc.gpu[i], query_of(w), NVML_ERROR_NOT_SUPPORTED);
        } else if (strcmp(t, "fail") == 0) {
            int i = gpu_index(token(&line), &highest);
            char *w = token(&line);
            nvmlReturn_t code = (nvmlReturn_t)num(token(&line));
            if (i >= 0 && w) set_fail(&sc.gpu[i], query_of(w), code);
        } else if (strcmp(t, "lost") == 0) {
            int i = gpu_index(token(&line), &highest);
            if (i >= 0) set_fail(&sc.gpu[i], Q_COUNT, NVML_ERROR_GPU_IS_LOST);
        } else {
            fprintf(stderr, "nvml_double: unknown directive `%s`\n", t);
        }
    }
    free(text);
    if (!sc.gpus_set) sc.gpus = highest ? highest : 1;
    /* Processes published through files. */
    for (unsigned int i = 0; i < sc.gpus; i++) {
        gpu_t *g = &sc.gpu[i];
        for (unsigned int f = 0; f < g->nfiles; f++) {
            char *body = slurp(g->files[f]);
            if (!body) continue;
            char *r = body;
            while (*r) {
                char *l = r;
                char *nl = strchr(r, '\n');
                if (nl) {
                    *nl = 0;
                    r = nl + 1;
                } else {
                    r += strlen(r);
                }
                char *pid = token(&l);
                char *bytes = token(&l);
                add_proc(g, pid, bytes);
            }
            free(body);
        }
    }
    SCRIPT = sc;
}

/* Every entry point: lock, re-read the script, check init. */
#define ENTER()                                         \
    pthread_mutex_lock(&LOCK);                          \
    reload();                                           \
    script_t *sc = &SCRIPT;                             \
    (void)sc;                                           \
    if (INITS <= 0) {                                   \
        pthread_mutex_unlock(&LOCK);                    \
        return NVML_ERROR_UNINITIALIZED;                \
    }
#define LEAVE(code)                  \
    do {                             \
        nvmlReturn_t r_ = (code);    \
        pthread_mutex_unlock(&LOCK); \
        return r_;                   \
    } while (0)

/* The GPU behind a handle, or LEAVE with the error of query q. */
#define GPU(device, q)                                                  \
    device_t *d_ = (device_t *)(device);                                \
    if (!d_ || d_ < DEVICES || d_ >= DEVICES + MAX_GPUS ||              \
        (unsigned int)d_->index >= sc->gpus)                            \
        LEAVE(NVML_ERROR_INVALID_ARGUMENT);                             \
    gpu_t *g = &sc->gpu[d_->index];                                     \
    if (g->fail[q]) LEAVE(g->fail[q]);

static unsigned long long procs_sum(const gpu_t *g) {
    unsigned long long s = 0;
    for (unsigned int i = 0; i < g->nprocs; i++)
        if (g->procs[i].bytes != NVML_VALUE_NOT_AVAILABLE_ULL) s += g->procs[i].bytes;
    return s;
}

static unsigned long long used_of(const gpu_t *g, int index) {
    unsigned long long used = g->used_set ? g->used : procs_sum(g);
    used += g->step * STEPS[index];
    return used > g->total ? g->total : used;
}

static nvmlReturn_t copy_string(const char *s, char *out, unsigned int len) {
    if (!out) return NVML_ERROR_INVALID_ARGUMENT;
    if (strlen(s) + 1 > len) return NVML_ERROR_INSUFFICIENT_SIZE;
    memcpy(out, s, strlen(s) + 1);
    return NVML_SUCCESS;
}

/* ---- the API ---- */

static nvmlReturn_t init(void) {
    pthread_mutex_lock(&LOCK);
    reload();
    nvmlReturn_t r = NVML_SUCCESS;
    if (!SCRIPT.loaded) {
        char buf[4096];
        const char *p = script_path(buf, sizeof buf);
        fprintf(stderr, "nvml_double: no script (set NVML_DOUBLE_SCRIPT or write %s)\n",
                p ? p : "<library path>.script");
        r = NVML_ERROR_LIBRARY_NOT_FOUND;
    } else if (SCRIPT.init_error) {
        r = SCRIPT.init_error;
    } else {
        INITS++;
        for (int i = 0; i < MAX_GPUS; i++) DEVICES[i].index = i;
    }
    pthread_mutex_unlock(&LOCK);
    return r;
}

EXPORT nvmlReturn_t nvmlInit_v2(void) { return init(); }

EXPORT nvmlReturn_t nvmlInitWithFlags(unsigned int flags) {
    (void)flags;
    return init();
}

EXPORT nvmlReturn_t nvmlShutdown(void) {
    pthread_mutex_lock(&LOCK);
    nvmlReturn_t r = NVML_SUCCESS;
    if (INITS <= 0) r = NVML_ERROR_UNINITIALIZED;
    else INITS--;
    pthread_mutex_unlock(&LOCK);
    return r;
}

EXPORT const char *nvmlErrorString(nvmlReturn_t r) {
    switch (r) {
    case NVML_SUCCESS: return "Success";
    case NVML_ERROR_UNINITIALIZED: return "Uninitialized";
    case NVML_ERROR_INVALID_ARGUMENT: return "Invalid Argument";
    case NVML_ERROR_NOT_SUPPORTED: return "Not Supported";
    case NVML_ERROR_NOT_FOUND: return "Not Found";
    case NVML_ERROR_INSUFFICIENT_SIZE: return "Insufficient Size";
    case NVML_ERROR_DRIVER_NOT_LOADED: return "Driver Not Loaded";
    case NVML_ERROR_LIBRARY_NOT_FOUND: return "NVML Shared Library Not Found";
    case NVML_ERROR_GPU_IS_LOST: return "GPU is lost";
    case NVML_ERROR_ARGUMENT_VERSION_MISMATCH: return "Argument Version Mismatch";
    default: return "Unknown Error";
    }
}

EXPORT nvmlReturn_t nvmlSystemGetDriverVersion(char *version, unsigned int length) {
    ENTER();
    LEAVE(copy_string(sc->driver, version, length));
}

EXPORT nvmlReturn_t nvmlSystemGetNVMLVersion(char *version, unsigned int length) {
    ENTER();
    LEAVE(copy_string("12.999.99-double", version, length));
}

EXPORT nvmlReturn_t nvmlSystemGetCudaDriverVersion(int *version) {
    ENTER();
    if (!version) LEAVE(NVML_ERROR_INVALID_ARGUMENT);
    *version = 12080;
    LEAVE(NVML_SUCCESS);
}

EXPORT nvmlReturn_t nvmlSystemGetCudaDriverVersion_v2(int *version) {
    return nvmlSystemGetCudaDriverVersion(version);
}

EXPORT nvmlReturn_t nvmlDeviceGetCount_v2(unsigned int *count) {
    ENTER();
    if (!count) LEAVE(NVML_ERROR_INVALID_ARGUMENT);
    if (sc->count_error) LEAVE(sc->count_error);
    *count = sc->gpus;
    LEAVE(NVML_SUCCESS);
}

EXPORT nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned int index, void **device) {
    ENTER();
    if (!device || index >= sc->gpus) LEAVE(NVML_ERROR_INVALID_ARGUMENT);
    if (sc->gpu[index].fail[Q_HANDLE]) LEAVE(sc->gpu[index].fail[Q_HANDLE]);
    *device = &DEVICES[index];
    LEAVE(NVML_SUCCESS);
}

EXPORT nvmlReturn_t nvmlDeviceGetIndex(void *device, unsigned int *index) {
    ENTER();
    GPU(device, Q_HANDLE);
    (void)g;
    if (!index) LEAVE(NVML_ERROR_INVALID_ARGUMENT);
    *index = (unsigned int)d_->index;
    LEAVE(NVML_SUCCESS);
}

EXPORT nvmlReturn_t nvmlDeviceGetName(void *device, char *name, unsigned int length) {
    ENTER();
    GPU(device, Q_NAME);
    LEAVE(copy_string(g->name, name, length));
}

static nvmlReturn_t memory(void *device, unsigned long long *total, unsigned long long *used) {
    ENTER();
    GPU(device, Q_MEMORY);
    STEPS[d_->index]++;
    *total = g->total;
    *used = used_of(g, d_->index);
    LEAVE(NVML_SUCCESS);
}

EXPORT nvmlReturn_t nvmlDeviceGetMemoryInfo(void *device, nvmlMemory_t *m) {
    if (!m) return NVML_ERROR_INVALID_ARGUMENT;
    nvmlReturn_t r = memory(device, &m->total, &m->used);
    if (r == NVML_SUCCESS) m->free = m->total - m->used;
    return r;
}

EXPORT nvmlReturn_t nvmlDeviceGetMemoryInfo_v2(void *device, nvmlMemory_v2_t *m) {
    if (!m) return NVML_ERROR_INVALID_ARGUMENT;
    if (m->version != NVML_STRUCT_VERSION_MEMORY_2) return NVML_ERROR_ARGUMENT_VERSION_MISMATCH;
    nvmlReturn_t r = memory(device, &m->total, &m->used);
    if (r == NVML_SUCCESS) {
        m->reserved = 0;
        m->free = m->total - m->used;
    }
    return r;
}

EXPORT nvmlReturn_t nvmlDeviceGetUtilizationRates(void *device, nvmlUtilization_t *u) {
    ENTER();
    GPU(device, Q_UTIL);
    if (!u) LEAVE(NVML_ERROR_INVALID_ARGUMENT);
    u->gpu = g->util;
    u->memory = g->memutil;
    LEAVE(NVML_SUCCESS);
}

EXPORT nvmlReturn_t nvmlDeviceGetPowerUsage(void *device, unsigned int *power) {
    ENTER();
    GPU(device, Q_POWER);
    if (!power) LEAVE(NVML_ERROR_INVALID_ARGUMENT);
    *power = g->power_mw;
    LEAVE(NVML_SUCCESS);
}

EXPORT nvmlReturn_t nvmlDeviceGetEnforcedPowerLimit(void *device, unsigned int *limit) {
    ENTER();
    GPU(device, Q_LIMIT);
    if (!limit) LEAVE(NVML_ERROR_INVALID_ARGUMENT);
    *limit = g->limit_mw;
    LEAVE(NVML_SUCCESS);
}

/* nvmlClockType_t: 0 graphics, 1 SM, 2 memory, 3 video. */
EXPORT nvmlReturn_t nvmlDeviceGetClockInfo(void *device, unsigned int type, unsigned int *clock) {
    ENTER();
    GPU(device, Q_CLOCK);
    if (!clock || type > 3) LEAVE(NVML_ERROR_INVALID_ARGUMENT);
    if (type != 0 && type != 1) LEAVE(NVML_ERROR_NOT_SUPPORTED);
    *clock = g->sm_mhz;
    LEAVE(NVML_SUCCESS);
}

/* nvmlTemperatureSensors_t: 0 is the GPU die, the only one. */
EXPORT nvmlReturn_t nvmlDeviceGetTemperature(void *device, unsigned int sensor, unsigned int *temp) {
    ENTER();
    GPU(device, Q_TEMP);
    if (!temp || sensor != 0) LEAVE(NVML_ERROR_INVALID_ARGUMENT);
    *temp = g->temp;
    LEAVE(NVML_SUCCESS);
}

/* MIG mode (memfit doctor): current and pending, both the scripted one. */
EXPORT nvmlReturn_t nvmlDeviceGetMigMode(void *device, unsigned int *current, unsigned int *pending) {
    ENTER();
    GPU(device, Q_MIG);
    if (!current || !pending) LEAVE(NVML_ERROR_INVALID_ARGUMENT);
    *current = g->mig;
    *pending = g->mig;
    LEAVE(NVML_SUCCESS);
}

EXPORT nvmlReturn_t nvmlDeviceGetComputeRunningProcesses_v3(void *device, unsigned int *count,
                                                            nvmlProcessInfo_t *infos) {
    ENTER();
    GPU(device, Q_PROCS);
    if (!count) LEAVE(NVML_ERROR_INVALID_ARGUMENT);
    unsigned int room = *count;
    *count = g->nprocs;
    if (g->nprocs == 0) LEAVE(NVML_SUCCESS);
    if (!infos || room < g->nprocs) LEAVE(NVML_ERROR_INSUFFICIENT_SIZE);
    for (unsigned int i = 0; i < g->nprocs; i++) {
        infos[i].pid = g->procs[i].pid;
        infos[i].usedGpuMemory = g->procs[i].bytes;
        infos[i].gpuInstanceId = NO_INSTANCE;
        infos[i].computeInstanceId = NO_INSTANCE;
    }
    LEAVE(NVML_SUCCESS);
}
