/*
 * Stand-ins for the NVIDIA driver's nvidia-smi and libcuda.so.1, for REHEARSING the H200
 * pod test on a machine without a GPU (hack/h200/run.sh with H200_SIMULATE). Never used
 * on the GPU host, never shipped.
 *
 *   gcc -o nvidia-smi standin.c                   `nvidia-smi -L`: the claim's GPU (by the
 *                                                 UUID variable of its CDI spec) when the
 *                                                 container has /dev/nvidia0, else "No devices found."
 *   gcc -shared -fPIC -DLIBCUDA -o libcuda.so standin.c   the driver API calls cuda-probe makes,
 *                                                 on host memory, with the same device rule.
 *
 * They let a rehearsal exercise the plumbing (the spec's mounts, the image's copies, the
 * probe's output); what they answer proves nothing about a GPU.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static int has_gpu(void) { return access("/dev/nvidia0", F_OK) == 0; }

extern char **environ;

/* The first GPU_DRA_DEVICE_<device>_UUID (or _SHARE_UUID) the spec set. */
static const char *uuid(void) {
    for (char **e = environ; *e; e++) {
        const char *eq = strchr(*e, '=');
        if (strncmp(*e, "GPU_DRA_DEVICE_", 15) == 0 && eq && eq - *e > 5 && strncmp(eq - 5, "_UUID", 5) == 0)
            return eq + 1;
    }
    return "GPU-00000000-0000-0000-0000-000000000000";
}

#ifndef LIBCUDA
int main(void) {
    if (!has_gpu()) {
        puts("No devices found.");
        return 6;
    }
    printf("GPU 0: NVIDIA H200 (UUID: %s)\n", uuid());
    return 0;
}
#else
typedef unsigned long long P;

int cuInit(unsigned flags) { (void)flags; return has_gpu() ? 0 : 100; }
int cuGetErrorName(int r, const char **s) {
    *s = r == 100 ? "CUDA_ERROR_NO_DEVICE" : r == 2 ? "CUDA_ERROR_OUT_OF_MEMORY" : "CUDA_ERROR_UNKNOWN";
    return 0;
}
int cuDeviceGetCount(int *c) { *c = 1; return 0; }
int cuDeviceGet(int *d, int i) { *d = i; return 0; }
int cuDeviceGetName(char *n, int len, int d) { (void)d; snprintf(n, len, "NVIDIA H200"); return 0; }
int cuDeviceGetUuid_v2(unsigned char *u, int d) {
    /* GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx back to 16 bytes */
    const char *s = uuid() + 4;
    (void)d;
    for (int i = 0; i < 16 && *s; i++) {
        if (*s == '-') s++;
        unsigned b = 0;
        sscanf(s, "%2x", &b);
        u[i] = (unsigned char)b;
        s += 2;
    }
    return 0;
}
int cuDevicePrimaryCtxRetain(void **c, int d) { (void)c; (void)d; return 0; }
int cuCtxSetCurrent(void *c) { (void)c; return 0; }
int cuModuleLoadDataEx(void **m, const void *p, unsigned n, int *o, void **v) {
    (void)m; (void)p; (void)n; (void)o; (void)v;
    return 0;
}
int cuModuleGetFunction(void **f, void *m, const char *n) { (void)f; (void)m; (void)n; return 0; }
int cuMemAlloc_v2(P *p, size_t s) {
    if (s > (size_t)140 << 30) return 2;
    *p = (P)(size_t)malloc(s > (1u << 26) ? 16 : s);
    return 0;
}
int cuMemFree_v2(P p) { free((void *)(size_t)p); return 0; }
int cuMemcpyHtoD_v2(P d, const void *s, size_t n) { memcpy((void *)(size_t)d, s, n); return 0; }
int cuMemcpyDtoH_v2(void *d, P s, size_t n) { memcpy(d, (void *)(size_t)s, n); return 0; }
int cuLaunchKernel(void *f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz,
                   unsigned shm, void *st, void **args, void **extra) {
    (void)f; (void)gx; (void)gy; (void)gz; (void)bx; (void)by; (void)bz; (void)shm; (void)st; (void)extra;
    float *x = *(float **)args[0], *y = *(float **)args[1];
    float a = *(float *)args[2];
    unsigned n = *(unsigned *)args[3];
    for (unsigned i = 0; i < n; i++) y[i] = a * x[i] + y[i];
    return 0;
}
int cuCtxSynchronize(void) { return 0; }
int cuMemGetInfo_v2(size_t *f, size_t *t) { *f = (size_t)139 << 30; *t = (size_t)140 << 30; return 0; }
#endif
