/*
bench_gpu.cu — `make bench`: times bnb8's kernels on the GPU against the copy bandwidth measured in
the same run (DESIGN.md §10). CUDA events, 3 warm-ups, median of 20, buffers far larger than L2, random
data made on the GPU (never zeros). Prints ms per 1e9 elements, GB/s and % of copy bandwidth.
`bench_gpu NAME` runs the benchmarks whose name holds NAME; `bench_gpu order` the walk-order study.
AdamW rows, each on one tensor and on GPT-2 XL's 580 tensors: 8-bit and 32-bit on fp32 weights and
gradients; on bf16 weights and gradients every recipe of the trainer (its fp32 and 8bit: an fp32
master; 8bit-int8 and flash: an int8 correction; 8bit-sr and 4bit-int8, which the rows name), 4-bit
states with stochastic rounding (4bit-sr) and flash4 (companded 4-bit states, int8 correction).
*/
#define BNB8_INTERNAL             // bnb8_store, to fill the benchmark tensors
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
    bnb8_map_dynamic(1, host_code);
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
// weights; BNB8_CORRECTION_STOCHASTIC: none, stochastic rounding), the bytes per element that
// DESIGN.md §10 counts for it, and its block size (0: the configuration's default, 256).
typedef struct {
    const char *what;
    bnb8_state_format format;
    bnb8_dtype param_dtype, grad_dtype;
    int correction_bytes;
    double bytes_per_element;
    const char *target;
    int64_t blocksize = 0;
} optimizer_row;

static void bench_optimizer(const optimizer_row &row, const std::vector<int64_t> &sizes, const char *layout) {
    bnb8_config cfg = bnb8_config_default(BNB8_ADAMW);
    cfg.format = row.format;
    cfg.correction_bytes = row.correction_bytes;
    if (row.blocksize) cfg.blocksize = row.blocksize;
    cfg.seed = 1337;                             // the trainer's default -d; read by stochastic rounding only
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
    bool added = true;
    for (size_t i = 0; i < sizes.size() && added; i++) {
        char name[32];
        snprintf(name, sizeof name, "t%zu", i);
        added = bnb8_optimizer_add(opt, name, p + offset * ps, row.param_dtype, g + offset * gs, row.grad_dtype, sizes[i], NULL) == 0;
        offset += sizes[i];
    }
    // One untimed step: a configuration this build refuses to add or cannot step gets a row saying
    // so with the library's message, and the rows after it (and `make bench`'s peers) still run.
    if (added && bnb8_optimizer_step(opt, 1e-3f, 1.0f, NULL) == 0) {
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

// ------------------------------------------------------------------------------------------------
// The walk order (only when asked: `bench_gpu order`). Does the order in which CUDA blocks walk
// memory change the bandwidth a streaming kernel gets? The traffic of three bnb8 kernels with no
// arithmetic (dequantize: 1 byte in, 4 out; 8-bit AdamW: 10 in, 6 out; flash AdamW: 7 in, 5 out,
// per element) over tiles of 2048 elements (256 threads x 2 x 16 bytes of the widest array):
//   oneshot K   a block per K consecutive tiles, blocks launched in order
//   range       one wave of blocks, each walking a contiguous range of its own
//   stride      one wave, block b taking tiles b, b + grid, b + 2 grid, ...
//   atomic G    one wave, each block taking the next G tiles from a counter when it is free

#define TILE_VECTORS 2                           // 16-byte accesses of the widest array per thread and tile
struct arrays { char *a[5]; int64_t n4; float s; };   // n4: elements / 4

enum { MIX_DEQUANT, MIX_ADAM8, MIX_FLASH };

// Tile t of a mix: every load of the tile, then every store.
template <int MIX> __device__ void tile(const arrays &x, int64_t t) {
    const int64_t first = t * 256 * TILE_VECTORS + threadIdx.x;
    const float s = x.s;
    if (MIX == MIX_DEQUANT) {                    // (n) codes -> (n) floats
        const uint32_t *q = (const uint32_t *)x.a[0];
        float4 *out = (float4 *)x.a[1];
        uint32_t w[TILE_VECTORS];
        for (int u = 0; u < TILE_VECTORS; u++) w[u] = __ldcs(q + first + u * 256);
        for (int u = 0; u < TILE_VECTORS; u++)
            __stcs(out + first + u * 256, make_float4((w[u] & 255) * s, ((w[u] >> 8) & 255) * s, ((w[u] >> 16) & 255) * s, (w[u] >> 24) * s));
    } else if (MIX == MIX_ADAM8) {               // p, g floats; m, v codes
        float4 *p = (float4 *)x.a[0];
        const float4 *g = (const float4 *)x.a[1];
        uint32_t *m = (uint32_t *)x.a[2], *v = (uint32_t *)x.a[3];
        float4 pv[TILE_VECTORS], gv[TILE_VECTORS];
        uint32_t mv[TILE_VECTORS], vv[TILE_VECTORS];
        for (int u = 0; u < TILE_VECTORS; u++) {
            int64_t i = first + u * 256;
            pv[u] = __ldcs(p + i); gv[u] = __ldcs(g + i); mv[u] = __ldcs(m + i); vv[u] = __ldcs(v + i);
        }
        for (int u = 0; u < TILE_VECTORS; u++) {
            int64_t i = first + u * 256;
            __stcs(p + i, make_float4(pv[u].x - s * gv[u].x, pv[u].y - s * gv[u].y, pv[u].z - s * gv[u].z, pv[u].w - s * gv[u].w));
            __stcs(m + i, mv[u] ^ vv[u]);
            __stcs(v + i, mv[u] + vv[u]);
        }
    } else {                                     // p, g bf16; correction, m, v bytes
        uint2 *p = (uint2 *)x.a[0];
        uint32_t *c = (uint32_t *)x.a[1];
        const uint2 *g = (const uint2 *)x.a[2];
        uint32_t *m = (uint32_t *)x.a[3], *v = (uint32_t *)x.a[4];
        uint2 pv[TILE_VECTORS], gv[TILE_VECTORS];
        uint32_t cv[TILE_VECTORS], mv[TILE_VECTORS], vv[TILE_VECTORS];
        for (int u = 0; u < TILE_VECTORS; u++) {
            int64_t i = first + u * 256;
            pv[u] = __ldcs(p + i); gv[u] = __ldcs(g + i); cv[u] = __ldcs(c + i); mv[u] = __ldcs(m + i); vv[u] = __ldcs(v + i);
        }
        for (int u = 0; u < TILE_VECTORS; u++) {
            int64_t i = first + u * 256;
            __stcs(p + i, make_uint2(pv[u].x ^ gv[u].x, pv[u].y + gv[u].y));
            __stcs(c + i, cv[u] + 1);
            __stcs(m + i, mv[u] ^ vv[u]);
            __stcs(v + i, mv[u] + vv[u]);
        }
    }
}

template <int MIX> __global__ void __launch_bounds__(256) oneshot_kernel(arrays x, int64_t tiles, int k) {
    for (int64_t t = blockIdx.x * (int64_t)k; t < (blockIdx.x + 1) * (int64_t)k && t < tiles; t++) tile<MIX>(x, t);
}
template <int MIX> __global__ void __launch_bounds__(256) range_kernel(arrays x, int64_t tiles) {
    int64_t per = (tiles + gridDim.x - 1) / gridDim.x, begin = blockIdx.x * per, end = begin + per < tiles ? begin + per : tiles;
    for (int64_t t = begin; t < end; t++) tile<MIX>(x, t);
}
template <int MIX> __global__ void __launch_bounds__(256) stride_kernel(arrays x, int64_t tiles) {
    for (int64_t t = blockIdx.x; t < tiles; t += gridDim.x) tile<MIX>(x, t);
}
template <int MIX> __global__ void __launch_bounds__(256) atomic_kernel(arrays x, int64_t tiles, unsigned long long *taken, int g) {
    __shared__ int64_t grab[2];
    for (int grabs = 0;; grabs++) {
        if (threadIdx.x == 0) grab[grabs & 1] = (int64_t)atomicAdd(taken, (unsigned long long)g);
        __syncthreads();
        const int64_t first = grab[grabs & 1];
        if (first >= tiles) break;
        for (int64_t t = first; t < first + g && t < tiles; t++) tile<MIX>(x, t);
    }
}

template <int MIX> static void bench_order_mix(const char *what, const arrays &x, int64_t n, double bytes_per_element,
                                               unsigned long long *taken, int sms) {
    const int64_t tiles = x.n4 / (256 * TILE_VECTORS);
    char layout[32];
    for (int k : {1, 4, 16, 64}) {
        snprintf(layout, sizeof layout, "oneshot K%d", k);
        report(what, layout, time_ms([&] { oneshot_kernel<MIX><<<(tiles + k - 1) / k, 256>>>(x, tiles, k); }), n, bytes_per_element, "-");
    }
    for (int per_sm : {3, 8}) {
        snprintf(layout, sizeof layout, "range x%d", per_sm);
        report(what, layout, time_ms([&] { range_kernel<MIX><<<sms * per_sm, 256>>>(x, tiles); }), n, bytes_per_element, "-");
        snprintf(layout, sizeof layout, "stride x%d", per_sm);
        report(what, layout, time_ms([&] { stride_kernel<MIX><<<sms * per_sm, 256>>>(x, tiles); }), n, bytes_per_element, "-");
        for (int g : {1, 4, 16}) {
            snprintf(layout, sizeof layout, "atomic x%d G%d", per_sm, g);
            report(what, layout, time_ms([&] {
                CUDA_CHECK(cudaMemsetAsync(taken, 0, sizeof *taken));
                atomic_kernel<MIX><<<sms * per_sm, 256>>>(x, tiles, taken, g);
            }), n, bytes_per_element, "-");
        }
    }
}

static void bench_order(void) {
    const int64_t n = 1ll << 28;                 // elements: every array far larger than L2
    arrays x;
    x.n4 = n / 4;
    x.s = 0.1f;
    for (int i = 0; i < 5; i++) {
        CUDA_CHECK(cudaMalloc(&x.a[i], (size_t)n * 4));
        fill_random(x.a[i], BNB8_F32, n, 1.0f);
    }
    unsigned long long *taken;
    CUDA_CHECK(cudaMalloc(&taken, sizeof *taken));
    int sms = 0;
    CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
    bench_order_mix<MIX_DEQUANT>("walk order: dequantize traffic", x, n, 5.0, taken, sms);
    bench_order_mix<MIX_ADAM8>("walk order: 8-bit AdamW traffic", x, n, 16.0, taken, sms);
    bench_order_mix<MIX_FLASH>("walk order: flash AdamW traffic", x, n, 12.0, taken, sms);
    for (int i = 0; i < 5; i++) cudaFree(x.a[i]);
    cudaFree(taken);
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
    if (only && strcmp(only, "order") == 0) { bench_order(); return 0; }
    if (wanted("quantize")) bench_quantize();
    std::vector<int64_t> one = {1ll << 28}, xl = gpt2_xl_sizes();
    // Bytes per element: 8-bit fp32 p r/w 8 + g 4 + m, v r/w 4; 32-bit p 8 + g 4 + m, v 16; flash
    // bf16 p r/w 4 + int8 correction r/w 2 + bf16 g 2 + m, v codes r/w 4 + e6m10 scales per 32 ~0.25.
    const optimizer_row rows[] = {
        {"AdamW 8-bit, fp32 params + grads", BNB8_STATE_8BIT, BNB8_F32, BNB8_F32, 0, 16.0, "<= 6.0 ms"},
        {"AdamW 32-bit, fp32", BNB8_STATE_32BIT, BNB8_F32, BNB8_F32, 0, 28.0, "<= 10.0 ms"},
        {"AdamW flash, bf16 + int8 ECC + bf16 grads", BNB8_STATE_FLASH, BNB8_BF16, BNB8_BF16, 1, 12.25, "<= 4.6 ms"},
        // master weights with block-wise and 32-bit states: bf16 p r/w 4, + int8 correction r/w 2
        // or fp32 master r/w 8, bf16 g 2, m and v as above (8-bit: + absmax 2 x 8 / 256). Beside an
        // fp32 master, which holds the weight, the kernels never read the bf16 weights: p w 2.
        {"AdamW 8-bit, bf16 + int8 ECC + bf16 grads", BNB8_STATE_8BIT, BNB8_BF16, BNB8_BF16, 1, 12.0625, "-"},
        {"AdamW 8-bit, bf16 + fp32 master + bf16 grads", BNB8_STATE_8BIT, BNB8_BF16, BNB8_BF16, 4, 16.0625, "-"},
        {"AdamW 32-bit, bf16 + fp32 master + bf16 grads", BNB8_STATE_32BIT, BNB8_BF16, BNB8_BF16, 4, 28.0, "-"},
        // no master, bf16 p rounded stochastically r/w 4, bf16 g 2; 8-bit m and v r/w 4 + absmax 2 x 8 / 256
        {"AdamW 8bit-sr: 8-bit, bf16 SR + bf16 grads", BNB8_STATE_8BIT, BNB8_BF16, BNB8_BF16,
         BNB8_CORRECTION_STOCHASTIC, 10.0625, "-"},
        // 4-bit states in blocks of 128: m and v half a byte each r/w 2 + an fp32 absmax per block and
        // state r/w 2 x 8 / 128; with bf16 p r/w 4 and an int8 correction r/w 2, or p rounded
        // stochastically (no master); bf16 g 2
        {"AdamW 4bit-int8: 4-bit/128, bf16 + int8 ECC + bf16 grads", BNB8_STATE_4BIT, BNB8_BF16, BNB8_BF16, 1,
         10.125, "-", BNB8_BLOCKSIZE_4BIT},
        {"AdamW 4bit-sr: 4-bit/128, bf16 SR + bf16 grads", BNB8_STATE_4BIT, BNB8_BF16, BNB8_BF16,
         BNB8_CORRECTION_STOCHASTIC, 8.125, "-", BNB8_BLOCKSIZE_4BIT},
        // flash4: bf16 p r/w 4 + int8 correction r/w 2 + bf16 g 2 + companded 4-bit m and v r/w 2 +
        // e6m10 scales per 32 and state r/w 2 x 4 / 32
        {"AdamW flash4: bf16 + int8 ECC + bf16 grads", BNB8_STATE_FLASH4, BNB8_BF16, BNB8_BF16, 1, 10.25, "-"},
    };
    for (const optimizer_row &row : rows) {
        if (!wanted(row.what)) continue;
        bench_optimizer(row, one, "1 tensor");
        bench_optimizer(row, xl, "GPT-2 XL 580");
    }
    return 0;
}
