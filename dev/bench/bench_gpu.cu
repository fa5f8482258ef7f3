/*
bench_gpu.cu — `make bench`: times bnb8's kernels on the GPU against the copy bandwidth measured in
the same run (SPEC §10). CUDA events, 3 warm-ups, median of 20, buffers far larger than L2, random
data made on the GPU (never zeros). Prints ms per 1e9 elements, GB/s and % of copy bandwidth.
*/
#include "bnb8.h"
#include <cuda_runtime.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <algorithm>
#include <vector>

#define CUDA_CHECK(call) do { cudaError_t e_ = (call); if (e_ != cudaSuccess) { \
    printf("CUDA error %s at %s:%d\n", cudaGetErrorString(e_), __FILE__, __LINE__); exit(1); } } while (0)
#define BNB8_CHECK(call) do { int s_ = (call); if (s_) { printf("bnb8 error: %s\n", bnb8_last_error()); exit(1); } } while (0)

static double copy_gbs;                      // measured device-to-device copy, bytes read + written

// Normal-ish random values (sum of uniforms from a hash), scale * N(0, 1), stored as dtype.
__global__ void fill_random_kernel(void *x, bnb8_dtype dtype, int64_t n, float scale, uint64_t seed) {
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
        uint64_t z = (uint64_t)i * 0x9e3779b97f4a7c15ull + seed;
        float s = 0.0f;
        for (int k = 0; k < 4; k++) {
            z ^= z >> 31; z *= 0xbf58476d1ce4e5b9ull; z ^= z >> 27;
            s += (float)(z >> 40) * 0x1.0p-24f;
        }
        bnb8_store(x, dtype, i, scale * (s - 2.0f) * 1.7320508f);
    }
}

static void fill_random(void *x, bnb8_dtype dtype, int64_t n, float scale) {
    static uint64_t seed = 12345;
    fill_random_kernel<<<1024, 256>>>(x, dtype, n, scale, seed += 0x632be59bd9b4e019ull);
    CUDA_CHECK(cudaGetLastError());
}

// Median milliseconds of fn over 20 timed runs after 3 warm-ups.
template <typename F> static double time_ms(F fn) {
    cudaEvent_t a, b;
    CUDA_CHECK(cudaEventCreate(&a));
    CUDA_CHECK(cudaEventCreate(&b));
    for (int i = 0; i < 3; i++) fn();
    std::vector<float> ms;
    for (int i = 0; i < 20; i++) {
        CUDA_CHECK(cudaEventRecord(a));
        fn();
        CUDA_CHECK(cudaEventRecord(b));
        CUDA_CHECK(cudaEventSynchronize(b));
        float t;
        CUDA_CHECK(cudaEventElapsedTime(&t, a, b));
        ms.push_back(t);
    }
    CUDA_CHECK(cudaGetLastError());
    cudaEventDestroy(a);
    cudaEventDestroy(b);
    std::sort(ms.begin(), ms.end());
    return (ms[9] + ms[10]) / 2.0;
}

// After freeing many gigabytes the driver goes on working on the freed memory for ~30 ms (measured on
// an H200: a kernel started then ran up to 65% slower, and a copy 11%; after a 300 ms pause, neither).
// Each benchmark's frees are followed by this pause, so that the next one times its kernel alone.
static void settle_after_free(void) { usleep(500 * 1000); }

static void report(const char *what, const char *layout, double ms, int64_t n, double bytes_per_element, const char *target) {
    double per_1e9 = ms * 1e9 / (double)n, gbs = bytes_per_element * (double)n / (ms * 1e6);
    double floor = bytes_per_element * 1e9 / (copy_gbs * 1e6);
    printf("| %-34s | %-12s | %8.2f | %7.0f | %5.1f%% | %6.2f | %-10s |\n", what, layout, per_1e9, gbs,
           100.0 * gbs / copy_gbs, floor, target);
    fflush(stdout);
}

static void bench_copy(void) {
    size_t bytes = 2ull << 30;
    void *a, *b;
    CUDA_CHECK(cudaMalloc(&a, bytes));
    CUDA_CHECK(cudaMalloc(&b, bytes));
    fill_random(a, BNB8_F32, bytes / 4, 1.0f);
    double ms = time_ms([&] { CUDA_CHECK(cudaMemcpyAsync(b, a, bytes, cudaMemcpyDeviceToDevice)); });
    copy_gbs = 2.0 * (double)bytes / (ms * 1e6);
    printf("copy bandwidth: %.0f GB/s (2 GiB device-to-device, read + write)\n\n", copy_gbs);
    cudaFree(a);
    cudaFree(b);
    settle_after_free();
}

static void bench_quantize(void) {
    int64_t n = 1ll << 28;
    float *x, *y, *absmax, *code, host_code[256];
    uint8_t *q;
    CUDA_CHECK(cudaMalloc(&x, n * 4));
    CUDA_CHECK(cudaMalloc(&y, n * 4));
    CUDA_CHECK(cudaMalloc(&q, n));
    CUDA_CHECK(cudaMalloc(&absmax, n / 64 * 4));
    CUDA_CHECK(cudaMalloc(&code, 256 * 4));
    bnb8_map_dynamic(host_code, 1);
    CUDA_CHECK(cudaMemcpy(code, host_code, sizeof host_code, cudaMemcpyHostToDevice));
    fill_random(x, BNB8_F32, n, 1.0f);
    const int64_t blocks[] = {4096, 256};
    for (int i = 0; i < 2; i++) {
        char name[64];
        snprintf(name, sizeof name, "quantize fp32 -> 8-bit, block %lld", (long long)blocks[i]);
        double ms = time_ms([&] { BNB8_CHECK(bnb8_cuda_quantize_blockwise(x, BNB8_F32, n, code, blocks[i], q, absmax, NULL)); });
        report(name, "2^28", ms, n, 5.0, ">= 2.7 TB/s");
        snprintf(name, sizeof name, "dequantize 8-bit -> fp32, block %lld", (long long)blocks[i]);
        ms = time_ms([&] { BNB8_CHECK(bnb8_cuda_dequantize_blockwise(q, absmax, n, code, blocks[i], y, BNB8_F32, NULL)); });
        report(name, "2^28", ms, n, 5.0, ">= 2.8 TB/s");
    }
    cudaFree(x); cudaFree(y); cudaFree(q); cudaFree(absmax); cudaFree(code);
    settle_after_free();
}

// GPT-2 XL's 580 tensors (L 48, C 1600, V padded 50304, T 1024): 1.56e9 parameters.
static std::vector<int64_t> gpt2_xl_sizes(void) {
    const int64_t C = 1600, V = 50304, T = 1024;
    std::vector<int64_t> s = {V * C, T * C};
    for (int l = 0; l < 48; l++) {
        const int64_t layer[12] = {C, C, 3 * C * C, 3 * C, C * C, C, C, C, 4 * C * C, 4 * C, 4 * C * C, C};
        s.insert(s.end(), layer, layer + 12);
    }
    s.push_back(C);
    s.push_back(C);
    return s;
}

// One AdamW row: its state format, weight and gradient dtypes, the weights' correction (flash, narrow
// weights), and the bytes per element that SPEC §10 counts for it.
typedef struct {
    const char *what;
    bnb8_state_format format;
    bnb8_dtype param_dtype, grad_dtype;
    int correction_bytes;
    double bytes_per_element;
    const char *target;
} optimizer_row;

static void bench_optimizer(const optimizer_row &row, const std::vector<int64_t> &sizes, const char *layout) {
    bnb8_config cfg = bnb8_config_default(BNB8_ADAMW);
    cfg.format = row.format;
    cfg.correction_bytes = row.correction_bytes;
    bnb8_optimizer *opt;
    BNB8_CHECK(bnb8_optimizer_create(&opt, BNB8_ADAMW, &cfg));
    int64_t total = 0;
    for (int64_t s : sizes) total += s;
    size_t ps = bnb8_dtype_size(row.param_dtype), gs = bnb8_dtype_size(row.grad_dtype);
    char *p, *g;                                 // one allocation each, tensors inside (as llm.c)
    CUDA_CHECK(cudaMalloc(&p, total * ps));
    CUDA_CHECK(cudaMalloc(&g, total * gs));
    fill_random(p, row.param_dtype, total, 0.02f);
    fill_random(g, row.grad_dtype, total, 0.001f);
    int64_t offset = 0;
    for (size_t i = 0; i < sizes.size(); i++) {
        char name[32];
        snprintf(name, sizeof name, "t%zu", i);
        BNB8_CHECK(bnb8_optimizer_add(opt, name, p + offset * ps, row.param_dtype, g + offset * gs, row.grad_dtype, sizes[i], NULL));
        offset += sizes[i];
    }
    // One untimed step: a configuration this build cannot step gets a row saying so, and the
    // rows after it (and `make bench`'s peers) still run.
    if (bnb8_optimizer_step(opt, 1e-3f, 1.0f, NULL) == 0) {
        double ms = time_ms([&] { BNB8_CHECK(bnb8_optimizer_step(opt, 1e-3f, 1.0f, NULL)); });
        report(row.what, layout, ms, total, row.bytes_per_element, row.target);
    } else {
        printf("| %-34s | %-12s | not run: %s |\n", row.what, layout, bnb8_last_error());
        fflush(stdout);
    }
    bnb8_optimizer_free(opt);
    cudaFree(p);
    cudaFree(g);
    settle_after_free();
}

static const char *only;                     // argv[1]: run only the benchmarks whose name holds it
static bool wanted(const char *name) { return !only || strstr(name, only); }

int main(int argc, char **argv) {
    only = argc > 1 ? argv[1] : NULL;
    int devices = 0;
    if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
        printf("bnb8 bench: no CUDA GPU found; nothing was measured\n");
        return 2;
    }
    cudaDeviceProp prop;
    CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
    printf("bnb8 bench on %s (%d SMs, L2 %d MB)\n", prop.name, prop.multiProcessorCount, prop.l2CacheSize >> 20);
    bench_copy();
    printf("| %-34s | %-12s | %8s | %7s | %6s | %6s | %-10s |\n", "kernel", "layout", "ms/1e9", "GB/s", "% copy", "floor", "target");
    printf("|%s|%s|%s|%s|%s|%s|%s|\n", "------------------------------------", "--------------", "----------",
           "---------", "--------", "--------", "------------");
    if (wanted("quantize")) bench_quantize();
    std::vector<int64_t> one = {1ll << 28}, xl = gpt2_xl_sizes();
    // Bytes per element: 8-bit fp32 p r/w 8 + g 4 + m, v r/w 4; 32-bit p 8 + g 4 + m, v 16; flash
    // bf16 p r/w 4 + int8 correction r/w 2 + bf16 g 2 + m, v codes r/w 4 + bf16 scales per 32 ~0.25.
    const optimizer_row rows[] = {
        {"AdamW 8-bit, fp32 params + grads", BNB8_STATE_8BIT, BNB8_F32, BNB8_F32, 0, 16.0, "<= 6.0 ms"},
        {"AdamW 32-bit, fp32", BNB8_STATE_32BIT, BNB8_F32, BNB8_F32, 0, 28.0, "<= 10.0 ms"},
        {"AdamW flash, bf16 + int8 ECC + bf16 grads", BNB8_STATE_FLASH, BNB8_BF16, BNB8_BF16, 1, 12.25, "<= 4.6 ms"},
    };
    for (const optimizer_row &row : rows) {
        if (!wanted(row.what)) continue;
        bench_optimizer(row, one, "1 tensor");
        bench_optimizer(row, xl, "GPT-2 XL 580");
    }
    return 0;
}
