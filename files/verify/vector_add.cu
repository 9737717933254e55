// servestack verification sample: add two vectors on every GPU and check every element.
//
// Built on the host with the toolkit under test, for the GPUs' own architecture only
// (-gencode arch=compute_XY,code=sm_XY: machine code, no PTX to fall back on). A kernel
// built for the wrong architecture can launch and synchronise without any error and
// compute nothing, so this program checks cudaGetLastError() after the launch AND every
// result. One line per device:
//   device 0 sm_90 "NVIDIA H200": PASS bad=0/1048576 launch=no error sync=no error
// Exit status: 0 when every device passed, 1 when one failed, 2 when no device could be used.

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <cuda_runtime.h>

static const int N = 1 << 20;

__global__ void vector_add(const float *a, const float *b, float *c, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) {
        c[i] = a[i] + b[i];
    }
}

static const char *message(cudaError_t err) { return cudaGetErrorString(err); }

// Every call's error is reported; the first one ends the device's test.
#define STEP(call)                                                                   \
    do {                                                                             \
        cudaError_t step_err = (call);                                               \
        if (step_err != cudaSuccess) {                                               \
            printf("device %d sm_%d%d \"%s\": FAIL %s: %s\n", device, prop.major,     \
                   prop.minor, prop.name, #call, message(step_err));                  \
            return 1;                                                                \
        }                                                                            \
    } while (0)

static int test_device(int device) {
    cudaDeviceProp prop;
    memset(&prop, 0, sizeof(prop));
    STEP(cudaSetDevice(device));
    STEP(cudaGetDeviceProperties(&prop, device));

    size_t bytes = N * sizeof(float);
    float *a = (float *)malloc(bytes), *b = (float *)malloc(bytes), *c = (float *)malloc(bytes);
    if (!a || !b || !c) {
        printf("device %d: FAIL host allocation\n", device);
        return 1;
    }
    for (int i = 0; i < N; i++) {
        a[i] = (float)i;
        b[i] = 2.0f * (float)i;
    }

    float *da = NULL, *db = NULL, *dc = NULL;
    STEP(cudaMalloc(&da, bytes));
    STEP(cudaMalloc(&db, bytes));
    STEP(cudaMalloc(&dc, bytes));
    STEP(cudaMemcpy(da, a, bytes, cudaMemcpyHostToDevice));
    STEP(cudaMemcpy(db, b, bytes, cudaMemcpyHostToDevice));
    STEP(cudaMemset(dc, 0xff, bytes));  // NaN everywhere: an element the kernel skipped is wrong

    int threads = 256;
    vector_add<<<(N + threads - 1) / threads, threads>>>(da, db, dc, N);
    cudaError_t launch = cudaGetLastError();
    cudaError_t sync = cudaDeviceSynchronize();
    STEP(cudaMemcpy(c, dc, bytes, cudaMemcpyDeviceToHost));

    int bad = 0;
    for (int i = 0; i < N; i++) {
        if (c[i] != 3.0f * (float)i) {
            bad++;
        }
    }
    int ok = bad == 0 && launch == cudaSuccess && sync == cudaSuccess;
    printf("device %d sm_%d%d \"%s\": %s bad=%d/%d launch=%s sync=%s\n", device, prop.major, prop.minor,
           prop.name, ok ? "PASS" : "FAIL", bad, N, message(launch), message(sync));

    cudaFree(da);
    cudaFree(db);
    cudaFree(dc);
    free(a);
    free(b);
    free(c);
    return ok ? 0 : 1;
}

int main(void) {
    int count = 0;
    cudaError_t err = cudaGetDeviceCount(&count);
    if (err != cudaSuccess || count == 0) {
        printf("devices 0: FAIL cudaGetDeviceCount: %s\n", message(err));
        return 2;
    }
    int failed = 0;
    for (int device = 0; device < count; device++) {
        failed += test_device(device);
    }
    printf("devices %d: %s\n", count, failed ? "FAIL" : "PASS");
    return failed ? 1 : 0;
}
