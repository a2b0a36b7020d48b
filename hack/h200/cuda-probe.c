/*
 * cuda-probe: what a container's process can do with CUDA, as one JSON line on stdout.
 *
 * For tests/hardware/test_hw_pod.py, inside the test image on the GPU host. It loads the
 * driver's libcuda.so.1 at run time (from the CDI spec's mounts, or the image's own copy),
 * lists the CUDA devices with their UUIDs in nvidia-smi's form, and runs a small kernel on
 * device 0: y = a*x + y over 1M floats, from PTX that the driver's JIT compiles (no CUDA
 * toolkit in the image), checked against the same sum on the CPU. It also names the
 * libcuda file it loaded, with its st_dev and st_ino, so a test can tell the CDI spec's
 * bind mount of the driver's file from a copy in the image.
 *
 * `cuda-probe 5 20` then also reports the context's free and total memory and tries to
 * allocate 5 GiB and 20 GiB (each freed again): the memory-share pods' check of their MPS limit.
 *
 * It never fails silently: every CUDA error is reported by name in the JSON, and the
 * exit status is 0 only when at least one device was found and the kernel's result is right.
 * Built by hack/h200/build.sh (gcc, glibc; nothing from CUDA at build time).
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <link.h>
#include <sys/stat.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <math.h>

typedef int CUresult;
typedef int CUdevice;
typedef void *CUcontext;
typedef void *CUmodule;
typedef void *CUfunction;
typedef unsigned long long CUdeviceptr;
typedef struct { unsigned char bytes[16]; } CUuuid;

#define CU_JIT_ERROR_LOG_BUFFER 5
#define CU_JIT_ERROR_LOG_BUFFER_SIZE_BYTES 6

static const char PTX[] =
    ".version 7.0\n"
    ".target sm_50\n"
    ".address_size 64\n"
    ".visible .entry axpy(.param .u64 px, .param .u64 py, .param .f32 pa, .param .u32 pn)\n"
    "{\n"
    "  .reg .pred p;\n"
    "  .reg .b32 r<6>;\n"
    "  .reg .f32 f<4>;\n"
    "  .reg .b64 rd<8>;\n"
    "  ld.param.u64 rd1, [px];\n"
    "  ld.param.u64 rd2, [py];\n"
    "  ld.param.f32 f1, [pa];\n"
    "  ld.param.u32 r1, [pn];\n"
    "  mov.u32 r2, %ctaid.x;\n"
    "  mov.u32 r3, %ntid.x;\n"
    "  mov.u32 r4, %tid.x;\n"
    "  mad.lo.s32 r5, r2, r3, r4;\n"
    "  setp.ge.u32 p, r5, r1;\n"
    "  @p bra DONE;\n"
    "  cvta.to.global.u64 rd3, rd1;\n"
    "  cvta.to.global.u64 rd4, rd2;\n"
    "  mul.wide.u32 rd5, r5, 4;\n"
    "  add.s64 rd6, rd3, rd5;\n"
    "  add.s64 rd7, rd4, rd5;\n"
    "  ld.global.f32 f2, [rd6];\n"
    "  ld.global.f32 f3, [rd7];\n"
    "  fma.rn.f32 f3, f1, f2, f3;\n"
    "  st.global.f32 [rd7], f3;\n"
    "DONE:\n"
    "  ret;\n"
    "}\n";

static void *lib;
static char libcuda[600] = "";  /* ", \"libcuda\": [path, st_dev, st_ino]" once loaded */
static CUresult (*pGetErrorName)(CUresult, const char **);

static void *sym(const char *name) {
    void *p = dlsym(lib, name);
    if (!p) {
        printf("{\"uid\": %d, \"device_count\": 0, \"error\": \"libcuda.so.1 has no %s\"}\n", (int)getuid(), name);
        exit(1);
    }
    return p;
}

static const char *errname(CUresult r) {
    const char *s = "?";
    if (pGetErrorName) pGetErrorName(r, &s);
    return s;
}

/* Prints the JSON line for a failed call and exits 1. */
static void fail(const char *call, CUresult r, int count, const char *devices) {
    printf("{\"uid\": %d, \"device_count\": %d, \"devices\": [%s], \"error\": \"%s: %d %s\"%s}\n",
           (int)getuid(), count, devices, call, r, errname(r), libcuda);
    exit(1);
}

int main(int argc, char **argv) {
    lib = dlopen("libcuda.so.1", RTLD_NOW);
    if (!lib) {
        printf("{\"uid\": %d, \"device_count\": 0, \"error\": \"dlopen libcuda.so.1: %s\"}\n", (int)getuid(), dlerror());
        return 1;
    }
    struct link_map *map = NULL;
    struct stat st;
    if (dlinfo(lib, RTLD_DI_LINKMAP, &map) == 0 && map && stat(map->l_name, &st) == 0)
        snprintf(libcuda, sizeof libcuda, ", \"libcuda\": [\"%s\", %lu, %lu]", map->l_name,
                 (unsigned long)st.st_dev, (unsigned long)st.st_ino);
    pGetErrorName = (CUresult(*)(CUresult, const char **))dlsym(lib, "cuGetErrorName");
    CUresult (*cuInit)(unsigned) = sym("cuInit");
    CUresult (*cuDeviceGetCount)(int *) = sym("cuDeviceGetCount");
    CUresult (*cuDeviceGet)(CUdevice *, int) = sym("cuDeviceGet");
    CUresult (*cuDeviceGetName)(char *, int, CUdevice) = sym("cuDeviceGetName");
    CUresult (*cuDeviceGetUuid)(CUuuid *, CUdevice) = sym("cuDeviceGetUuid_v2");
    CUresult (*cuDevicePrimaryCtxRetain)(CUcontext *, CUdevice) = sym("cuDevicePrimaryCtxRetain");
    CUresult (*cuCtxSetCurrent)(CUcontext) = sym("cuCtxSetCurrent");
    CUresult (*cuModuleLoadDataEx)(CUmodule *, const void *, unsigned, int *, void **) = sym("cuModuleLoadDataEx");
    CUresult (*cuModuleGetFunction)(CUfunction *, CUmodule, const char *) = sym("cuModuleGetFunction");
    CUresult (*cuMemAlloc)(CUdeviceptr *, size_t) = sym("cuMemAlloc_v2");
    CUresult (*cuMemcpyHtoD)(CUdeviceptr, const void *, size_t) = sym("cuMemcpyHtoD_v2");
    CUresult (*cuMemcpyDtoH)(void *, CUdeviceptr, size_t) = sym("cuMemcpyDtoH_v2");
    CUresult (*cuLaunchKernel)(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                               void *, void **, void **) = sym("cuLaunchKernel");
    CUresult (*cuCtxSynchronize)(void) = sym("cuCtxSynchronize");
    CUresult (*cuMemFree)(CUdeviceptr) = sym("cuMemFree_v2");
    CUresult (*cuMemGetInfo)(size_t *, size_t *) = sym("cuMemGetInfo_v2");

    CUresult r = cuInit(0);
    if (r) fail("cuInit", r, 0, "");
    int count = 0;
    r = cuDeviceGetCount(&count);
    if (r) fail("cuDeviceGetCount", r, 0, "");

    char devices[4096] = "";
    for (int i = 0; i < count && i < 16; i++) {
        CUdevice d;
        char name[256] = "";
        CUuuid u;
        if ((r = cuDeviceGet(&d, i))) fail("cuDeviceGet", r, count, devices);
        if ((r = cuDeviceGetName(name, sizeof name, d))) fail("cuDeviceGetName", r, count, devices);
        if ((r = cuDeviceGetUuid(&u, d))) fail("cuDeviceGetUuid_v2", r, count, devices);
        const unsigned char *b = u.bytes;
        char one[512];
        snprintf(one, sizeof one,
                 "%s{\"index\": %d, \"name\": \"%s\", \"uuid\": \"GPU-%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-"
                 "%02x%02x%02x%02x%02x%02x\"}",
                 i ? ", " : "", i, name, b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7], b[8], b[9], b[10], b[11],
                 b[12], b[13], b[14], b[15]);
        strncat(devices, one, sizeof devices - strlen(devices) - 1);
    }
    if (count == 0) {
        printf("{\"uid\": %d, \"device_count\": 0, \"devices\": []%s}\n", (int)getuid(), libcuda);
        return 1;
    }

    CUdevice dev;
    CUcontext ctx;
    CUmodule mod;
    CUfunction fn;
    char log[8192] = "";
    int opts[2] = {CU_JIT_ERROR_LOG_BUFFER, CU_JIT_ERROR_LOG_BUFFER_SIZE_BYTES};
    void *vals[2] = {log, (void *)(size_t)sizeof log};
    if ((r = cuDeviceGet(&dev, 0))) fail("cuDeviceGet", r, count, devices);
    if ((r = cuDevicePrimaryCtxRetain(&ctx, dev))) fail("cuDevicePrimaryCtxRetain", r, count, devices);
    if ((r = cuCtxSetCurrent(ctx))) fail("cuCtxSetCurrent", r, count, devices);
    if ((r = cuModuleLoadDataEx(&mod, PTX, 2, opts, vals))) {
        for (char *c = log; *c; c++)
            if (*c == '"' || *c == '\\' || *c == '\n') *c = ' ';
        fprintf(stderr, "JIT log: %s\n", log);
        fail("cuModuleLoadDataEx", r, count, devices);
    }
    if ((r = cuModuleGetFunction(&fn, mod, "axpy"))) fail("cuModuleGetFunction", r, count, devices);

    unsigned n = 1u << 20;
    float a = 2.5f;
    float *x = malloc(n * sizeof *x), *y = malloc(n * sizeof *y), *out = malloc(n * sizeof *out);
    for (unsigned i = 0; i < n; i++) {
        x[i] = (float)(i % 1000) * 0.001f;
        y[i] = (float)(i % 7) - 3.0f;
    }
    CUdeviceptr dx, dy;
    if ((r = cuMemAlloc(&dx, n * sizeof *x))) fail("cuMemAlloc", r, count, devices);
    if ((r = cuMemAlloc(&dy, n * sizeof *y))) fail("cuMemAlloc", r, count, devices);
    if ((r = cuMemcpyHtoD(dx, x, n * sizeof *x))) fail("cuMemcpyHtoD", r, count, devices);
    if ((r = cuMemcpyHtoD(dy, y, n * sizeof *y))) fail("cuMemcpyHtoD", r, count, devices);
    void *args[] = {&dx, &dy, &a, &n};
    if ((r = cuLaunchKernel(fn, (n + 255) / 256, 1, 1, 256, 1, 1, 0, NULL, args, NULL)))
        fail("cuLaunchKernel", r, count, devices);
    if ((r = cuCtxSynchronize())) fail("cuCtxSynchronize", r, count, devices);
    if ((r = cuMemcpyDtoH(out, dy, n * sizeof *out))) fail("cuMemcpyDtoH", r, count, devices);
    double max_err = 0;
    for (unsigned i = 0; i < n; i++) {
        double want = (double)a * x[i] + y[i];
        double err = fabs(out[i] - want);
        if (err > max_err) max_err = err;
    }
    int ok = max_err < 1e-5;
    cuMemFree(dx);
    cuMemFree(dy);

    char memory[2048] = "";
    if (argc > 1) {
        size_t free_b = 0, total_b = 0;
        if ((r = cuMemGetInfo(&free_b, &total_b))) fail("cuMemGetInfo_v2", r, count, devices);
        snprintf(memory, sizeof memory, ", \"mem_free_gib\": %.2f, \"mem_total_gib\": %.2f, \"allocs\": {",
                 free_b / 1073741824.0, total_b / 1073741824.0);
        for (int i = 1; i < argc; i++) {
            double gib = atof(argv[i]);
            CUdeviceptr p;
            r = cuMemAlloc(&p, (size_t)(gib * 1073741824.0));
            if (!r) cuMemFree(p);
            char one[160];
            snprintf(one, sizeof one, "%s\"%s\": \"%s\"", i > 1 ? ", " : "", argv[i], r ? errname(r) : "ok");
            strncat(memory, one, sizeof memory - strlen(memory) - 2);
        }
        strcat(memory, "}");
    }
    printf("{\"uid\": %d, \"device_count\": %d, \"devices\": [%s], \"axpy_n\": %u, \"axpy_max_abs_err\": %.3g, "
           "\"axpy_ok\": %s%s%s}\n",
           (int)getuid(), count, devices, n, max_err, ok ? "true" : "false", memory, libcuda);
    return ok ? 0 : 1;
}
