/*
test_gpu.cu — the GPU back end against the CPU one: block-wise quantization and every optimizer
(32-bit, 8-bit and flash states, with the flash weights' correction and scales) must give
bit-identical results (DESIGN.md §9). Run with `make test-gpu` on a machine with a GPU.
The CPU path is the reference; it is itself tested against double precision by `make test`.
Norm-based options (LAMB, LARS, percentile clipping) sum in a different order on the GPU: those
are checked bit for bit too, and when they differ, within 1e-5 relative (stated per test).
8-bit states with one absmax per tensor (blocksize 0) are checked the same way.
The harness is test/test.h's: random inputs from TEST_SEED (printed; set it to repeat a run),
TEST_ONLY=text picks tests.
*/
#define BNB8_INTERNAL             // the per-element math that the GPU results are compared with
#include "bnb8.h"
#include "test/test.h"
#include <cuda_runtime.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <vector>
#include <unistd.h>

static test_rng rng;   // the run's random inputs (test.h: TEST_SEED repeats them)

// Fills a host array of dtype with scale * randn (a counter-based hash, so threads can share it),
// converted with the library's rounding.
static void fill_random(void *x, bnb8_dtype dtype, int64_t n, float scale) {
    uint64_t seed = test_u64(&rng);
    #pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < n; i++) {
        uint64_t z = test_mix64(seed + (uint64_t)i * 0x9e3779b97f4a7c15ull);
        float u1 = (float)(z >> 40) * 0x1.0p-24f, u2 = (float)((z >> 16) & 0xffffff) * 0x1.0p-24f;
        bnb8_store(x, dtype, i, scale * sqrtf(-2.0f * logf(1.0f - u1)) * cosf(6.2831853f * u2));
    }
}

template <typename T> static T *device_copy(const T *host, size_t count) {
    T *d = NULL;
    CUDA_CHECK(cudaMalloc(&d, count * sizeof(T) + 1));
    CUDA_CHECK(cudaMemcpy(d, host, count * sizeof(T), cudaMemcpyHostToDevice));
    return d;
}

// ------------------------------------------------------------------------------------------------
// Quantization

static void quantize_parity(bnb8_dtype dtype, int64_t n, int64_t blocksize, const float *code) {
    size_t es = bnb8_dtype_size(dtype);
    int64_t nblocks = (n + blocksize - 1) / blocksize;
    std::vector<uint8_t> x(n * es), out_cpu(n * es), out_gpu(n * es), q_cpu(n), q_gpu(n);
    std::vector<float> a_cpu(nblocks), a_gpu(nblocks);
    fill_random(x.data(), dtype, n, 3.0f);
    if (n > 100) {                                   // a few non-finite values and an all-zero block
        bnb8_store(x.data(), dtype, 7, NAN);
        bnb8_store(x.data(), dtype, n - 3, INFINITY);
        for (int64_t i = blocksize; i < 2 * blocksize && i < n; i++) bnb8_store(x.data(), dtype, i, 0.0f);
    }
    int64_t bad_cpu = -1;
    EXPECT(bnb8_quantize_blockwise_ex(x.data(), dtype, n, code, blocksize, q_cpu.data(), a_cpu.data(), &bad_cpu) == 0, "cpu");
    uint8_t *dx = device_copy(x.data(), x.size()), *dq, *dout;
    float *da, *dcode = device_copy(code, 256);
    int64_t *dbad;
    CUDA_CHECK(cudaMalloc(&dq, n)); CUDA_CHECK(cudaMalloc(&da, nblocks * 4)); CUDA_CHECK(cudaMalloc(&dout, n * es));
    CUDA_CHECK(cudaMalloc(&dbad, 8));
    CUDA_CHECK(cudaMemset(dq, 0xab, n)); CUDA_CHECK(cudaMemset(da, 0xff, nblocks * 4)); CUDA_CHECK(cudaMemset(dout, 0xff, n * es));
    EXPECT(bnb8_cuda_quantize_blockwise_ex(dx, dtype, n, dcode, blocksize, dq, da, dbad, NULL) == 0, "gpu: %s", bnb8_last_error());
    EXPECT(bnb8_cuda_dequantize_blockwise(dq, da, n, dcode, blocksize, dout, dtype, NULL) == 0, "gpu: %s", bnb8_last_error());
    int64_t bad_gpu = -1;
    CUDA_CHECK(cudaMemcpy(q_gpu.data(), dq, n, cudaMemcpyDeviceToHost));
    CUDA_CHECK(cudaMemcpy(a_gpu.data(), da, nblocks * 4, cudaMemcpyDeviceToHost));
    CUDA_CHECK(cudaMemcpy(out_gpu.data(), dout, n * es, cudaMemcpyDeviceToHost));
    CUDA_CHECK(cudaMemcpy(&bad_gpu, dbad, 8, cudaMemcpyDeviceToHost));
    bnb8_dequantize_blockwise(q_cpu.data(), a_cpu.data(), n, code, blocksize, out_cpu.data(), dtype);
    EXPECT(memcmp(q_cpu.data(), q_gpu.data(), n) == 0, "codes differ: dtype %d n %lld block %lld", dtype, (long long)n, (long long)blocksize);
    EXPECT(memcmp(a_cpu.data(), a_gpu.data(), nblocks * 4) == 0, "absmax differs: dtype %d n %lld block %lld", dtype, (long long)n, (long long)blocksize);
    EXPECT(memcmp(out_cpu.data(), out_gpu.data(), n * es) == 0, "dequantized differs: dtype %d n %lld block %lld", dtype, (long long)n, (long long)blocksize);
    EXPECT(bad_cpu == bad_gpu, "non-finite count cpu %lld gpu %lld", (long long)bad_cpu, (long long)bad_gpu);
    cudaFree(dx); cudaFree(dq); cudaFree(da); cudaFree(dout); cudaFree(dcode); cudaFree(dbad);
}

// BNB8_TEST_QUICK=1 (for compute-sanitizer, ~100x slower): a smaller largest size, 5 steps, and no
// tensor above 2^31.
static bool quick;
static int64_t largest(void) { return quick ? 70001 : 1000003; }
static int steps(int full) { return quick ? 5 : full; }

static void test_quantize_parity(void) {
    const int64_t sizes[] = {1, 255, 257, 4097, largest()};
    float maps[3][256];
    bnb8_map_dynamic(1, maps[0]);
    bnb8_map_dynamic(0, maps[1]);
    bnb8_map_linear(1, maps[2]);
    for (int m = 0; m < 3; m++)
        for (int d = 0; d < 3; d++)
            for (int64_t bs = 64; bs <= 4096; bs *= 2)
                for (int s = 0; s < 5; s++) quantize_parity((bnb8_dtype)d, sizes[s], bs, maps[m]);
    // Without memory pools (as on some vGPU / WDDM drivers) the codebook goes in plain device memory.
    setenv("BNB8_NO_MEMORY_POOLS", "1", 1);
    for (int s = 0; s < 5; s++) quantize_parity(BNB8_F32, sizes[s], 256, maps[s % 3]);
    unsetenv("BNB8_NO_MEMORY_POOLS");
}

// One tensor above 2^31 elements (bf16, 4.3 GB): every code and absmax equal to the CPU's.
static void test_quantize_above_2g(void) {
    if (quick) { printf("    skipped (BNB8_TEST_QUICK)\n"); return; }
    int64_t n = (1ll << 31) + 4097, blocksize = 4096, nblocks = (n + blocksize - 1) / blocksize;
    std::vector<uint16_t> x(n);
    #pragma omp parallel for
    for (int64_t i = 0; i < n; i++) {   // a cheap hash per element: different values everywhere
        uint64_t z = (uint64_t)i * 0x9e3779b97f4a7c15ull;
        z ^= z >> 29;
        x[i] = bnb8_f32_to_bf16(((float)(z & 0xffff) - 32768.0f) * (1.0f + (float)((z >> 16) & 7)));
    }
    float code[256];
    bnb8_map_dynamic(1, code);
    std::vector<uint8_t> q_cpu(n), q_gpu(n);
    std::vector<float> a_cpu(nblocks), a_gpu(nblocks);
    EXPECT(bnb8_quantize_blockwise(x.data(), BNB8_BF16, n, code, blocksize, q_cpu.data(), a_cpu.data()) == 0, "cpu");
    uint16_t *dx = device_copy(x.data(), n);
    uint8_t *dq; float *da, *dcode = device_copy(code, 256);
    CUDA_CHECK(cudaMalloc(&dq, n)); CUDA_CHECK(cudaMalloc(&da, nblocks * 4));
    CUDA_CHECK(cudaMemset(dq, 0xab, n)); CUDA_CHECK(cudaMemset(da, 0xff, nblocks * 4));
    EXPECT(bnb8_cuda_quantize_blockwise(dx, BNB8_BF16, n, dcode, blocksize, dq, da, NULL) == 0, "gpu: %s", bnb8_last_error());
    CUDA_CHECK(cudaMemcpy(q_gpu.data(), dq, n, cudaMemcpyDeviceToHost));
    CUDA_CHECK(cudaMemcpy(a_gpu.data(), da, nblocks * 4, cudaMemcpyDeviceToHost));
    EXPECT(memcmp(q_cpu.data(), q_gpu.data(), n) == 0, "codes differ above 2^31");
    EXPECT(memcmp(a_cpu.data(), a_gpu.data(), nblocks * 4) == 0, "absmax differs above 2^31");
    EXPECT(a_cpu[nblocks - 1] > 0.0f, "last block absmax is %g", a_cpu[nblocks - 1]);
    cudaFree(dx); cudaFree(dq); cudaFree(da); cudaFree(dcode);
}

static void test_bad_arguments(void) {
    float *d;
    CUDA_CHECK(cudaMalloc(&d, 4096));
    float host[256];
    uint8_t *dq;
    CUDA_CHECK(cudaMalloc(&dq, 1024));
    EXPECT(bnb8_cuda_quantize_blockwise(d, BNB8_F32, -1, d, 256, dq, d, NULL) == BNB8_ERR_SIZE, "n < 0");
    EXPECT(bnb8_cuda_quantize_blockwise(d, BNB8_F32, 10, d, 100, dq, d, NULL) == BNB8_ERR_BLOCKSIZE, "block 100");
    EXPECT(bnb8_cuda_quantize_blockwise(d, (bnb8_dtype)9, 10, d, 256, dq, d, NULL) == BNB8_ERR_DTYPE, "dtype 9");
    EXPECT(bnb8_cuda_quantize_blockwise(NULL, BNB8_F32, 10, d, 256, dq, d, NULL) == BNB8_ERR_NULL, "NULL");
    EXPECT(bnb8_cuda_quantize_blockwise(host, BNB8_F32, 10, d, 256, dq, d, NULL) == BNB8_ERR_DEVICE, "host pointer");
    cudaFree(d); cudaFree(dq);
}

// ------------------------------------------------------------------------------------------------
// Optimizers: the same tensors, gradients and steps on the CPU and on the GPU; afterwards the
// parameters, the state files (codes, absmax or scales, fp32 states, corrections, corrected
// weights, step counts) and the fp32 masters of bnb8_optimizer_export_fp32 must be byte-identical.

typedef struct {
    int64_t n;
    std::vector<uint8_t> p_cpu, g_cpu;   // host tensors of the CPU optimizer
    void *p_gpu, *g_gpu;                 // device tensors of the GPU optimizer
} pair_tensor;

static const char *optimizer_names[] = {"AdamW", "Adam", "SGD", "Lion", "RMSprop", "Adagrad", "LAMB", "LARS", "AdEMAMix"};

// Runs steps on both back ends; returns the largest relative parameter difference seen at the end
// (0 when bit-identical) and in *equal whether the state files and the fp32 exports are byte-identical.
// override_name: that tensor gets 32-bit states; per_tensor_name: that one one absmax per tensor
// (blocksize 0). Every 4th step is a subset step of `subset` tensors: ids step, step - 1, ... mod
// the count (from 2 on, a later tensor before an earlier one). huge: at step 1, elements 32..34 of
// each tensor get the gradients {huge, 0, 1} (group scales at their dtype's largest value).
// g_scale: the gradients' magnitude (51 times it every 7th step). t1: "t1"'s own configuration (another
// master or state format in the same launches).
static double optimizer_parity(bnb8_optim kind, bnb8_config cfg, bnb8_dtype pdtype, bnb8_dtype gdtype,
                               const std::vector<int64_t> &sizes, int steps, int *equal, const char *override_name,
                               const char *per_tensor_name = NULL, int subset = 1, float p_scale = 0.1f,
                               int64_t t0_blocks = 0, float huge = 0.0f, float g_scale = 0.01f,
                               const bnb8_config *t1 = NULL,
                               void (*configure)(bnb8_optimizer *opt, const bnb8_config &cfg) = NULL) {
    bnb8_optimizer *cpu = NULL, *gpu = NULL;
    if (bnb8_optimizer_create(&cpu, kind, &cfg) || bnb8_optimizer_create(&gpu, kind, &cfg)) {
        EXPECT(0, "create: %s", bnb8_last_error());
        return 1.0;
    }
    if (configure) { configure(cpu, cfg); configure(gpu, cfg); }   // the caller's per-tensor overrides
    if (override_name) {                 // a per-tensor override: 32-bit states, twice the lr
        bnb8_config o = cfg;
        // flash: 32-bit states by the size threshold, so that narrow weights keep their correction
        if (cfg.format == BNB8_STATE_FLASH) o.min_8bit_size = INT64_MAX;
        else o.format = BNB8_STATE_32BIT;
        o.lr = cfg.lr * 2.0f;
        o.weight_decay = 0.0f;
        bnb8_optimizer_override(cpu, override_name, &o);
        bnb8_optimizer_override(gpu, override_name, &o);
    }
    if (t0_blocks) {                     // t0 8-bit with blocks of t0_blocks (of 4096: chunks of 4 rows)
        bnb8_config o = cfg;
        o.format = BNB8_STATE_8BIT;
        o.blocksize = t0_blocks;
        o.correction_bytes = 0;
        bnb8_optimizer_override(cpu, "t0", &o);
        bnb8_optimizer_override(gpu, "t0", &o);
    }
    if (per_tensor_name) {
        bnb8_config o = cfg;
        o.blocksize = 0;
        bnb8_optimizer_override(cpu, per_tensor_name, &o);
        bnb8_optimizer_override(gpu, per_tensor_name, &o);
    }
    if (t1) {
        bnb8_optimizer_override(cpu, "t1", t1);
        bnb8_optimizer_override(gpu, "t1", t1);
    }
    size_t ps = bnb8_dtype_size(pdtype), gs = bnb8_dtype_size(gdtype);
    std::vector<pair_tensor> t(sizes.size());
    for (size_t i = 0; i < sizes.size(); i++) {
        char name[32];
        snprintf(name, sizeof name, "t%zu", i);
        t[i].n = sizes[i];
        t[i].p_cpu.resize(sizes[i] * ps);
        t[i].g_cpu.resize(sizes[i] * gs);
        fill_random(t[i].p_cpu.data(), pdtype, sizes[i], p_scale);
        t[i].p_gpu = device_copy(t[i].p_cpu.data(), t[i].p_cpu.size());
        CUDA_CHECK(cudaMalloc(&t[i].g_gpu, sizes[i] * gs));
        int a = bnb8_optimizer_add(cpu, name, t[i].p_cpu.data(), pdtype, t[i].g_cpu.data(), gdtype, sizes[i], NULL);
        int b = bnb8_optimizer_add(gpu, name, t[i].p_gpu, pdtype, t[i].g_gpu, gdtype, sizes[i], NULL);
        EXPECT(a == 0 && b == 0, "add: %s", bnb8_last_error());
    }
    int sums_equal = 1;
    for (int step = 1; step <= steps; step++) {
        for (size_t i = 0; i < t.size(); i++) {
            fill_random(t[i].g_cpu.data(), gdtype, t[i].n, g_scale * (1.0f + (step % 7 == 0) * 50.0f));
            if (step % 10 == 3 && t[i].n > 10) bnb8_store(t[i].g_cpu.data(), gdtype, step % t[i].n, NAN);
            if (huge != 0.0f && step == 1 && t[i].n > 34) {
                bnb8_store(t[i].g_cpu.data(), gdtype, 32, huge);
                bnb8_store(t[i].g_cpu.data(), gdtype, 33, 0.0f);
                bnb8_store(t[i].g_cpu.data(), gdtype, 34, 1.0f);
            }
            // a finite gradient whose v = g^2 (or an SGD weight in fp16) overflows: counted and kept
            if (step % 10 == 6 && t[i].n > 20) bnb8_store(t[i].g_cpu.data(), gdtype, (7 * step) % t[i].n, 1e30f);
            CUDA_CHECK(cudaMemcpy(t[i].g_gpu, t[i].g_cpu.data(), t[i].n * gs, cudaMemcpyHostToDevice));
        }
        float lr = cfg.lr * (0.5f + 0.5f * cosf(3.14159265f * step / steps)), gnorm_scale = step % 5 == 0 ? 0.5f : 1.0f;
        if (step % 4 == 0 && t.size() > 1) {  // a subset step now and then: tensors keep their own counts
            std::vector<int> ids;
            for (int k = 0; k < subset && k < (int)t.size(); k++) ids.push_back((int)((step + (t.size() - 1) * k) % t.size()));
            int count = (int)ids.size();
            EXPECT(bnb8_optimizer_step_tensors(cpu, ids.data(), count, lr, gnorm_scale, NULL) == 0, "cpu: %s", bnb8_last_error());
            EXPECT(bnb8_optimizer_step_tensors(gpu, ids.data(), count, lr, gnorm_scale, NULL) == 0, "gpu: %s", bnb8_last_error());
        } else {
            EXPECT(bnb8_optimizer_step(cpu, lr, gnorm_scale, NULL) == 0, "cpu: %s", bnb8_last_error());
            EXPECT(bnb8_optimizer_step(gpu, lr, gnorm_scale, NULL) == 0, "gpu: %s", bnb8_last_error());
        }
        if (cfg.sum_squares) {   // cfg.sum_squares (bnb8.h [math.sumsq]): the same bits, every step
            std::vector<double> sa(t.size(), -1.0), sb(t.size(), -2.0);
            EXPECT(bnb8_optimizer_sum_squares(cpu, sa.data()) == 0 && bnb8_optimizer_sum_squares(gpu, sb.data()) == 0,
                   "sum_squares: %s", bnb8_last_error());
            if (memcmp(sa.data(), sb.data(), sizeof(double) * t.size()) != 0) sums_equal = 0;
            for (size_t i = 0; i < t.size(); i++)
                if (sa[i] != sb[i]) printf("      step %d tensor %zu (n %lld): sum of g^2 cpu %.17g gpu %.17g\n", step, i,
                                           (long long)t[i].n, sa[i], sb[i]);
            if (step == 1 && !(sa.back() > 0.0)) sums_equal = 0;
        }
    }
    CUDA_CHECK(cudaDeviceSynchronize());
    int64_t bad_cpu = test_take_nonfinite(cpu), bad_gpu = test_take_nonfinite(gpu);
    EXPECT(bad_cpu == bad_gpu && bad_cpu > 0, "non-finite counts cpu %lld gpu %lld", (long long)bad_cpu, (long long)bad_gpu);
    double worst = 0.0;
    int exports_equal = 1;
    std::vector<float> x_cpu, x_gpu;
    for (size_t i = 0; i < t.size(); i++) {
        std::vector<uint8_t> back(t[i].p_cpu.size());
        CUDA_CHECK(cudaMemcpy(back.data(), t[i].p_gpu, back.size(), cudaMemcpyDeviceToHost));
        for (int64_t j = 0; j < t[i].n; j++) {
            double a = bnb8_load(t[i].p_cpu.data(), pdtype, j), b = bnb8_load(back.data(), pdtype, j);
            if (a != b) { double rel = fabs(a - b) / fmax(fabs(a), 1e-30); worst = rel > worst ? rel : worst; }
        }
        x_cpu.assign(t[i].n, 1.0f);      // poisoned apart: an export that writes nothing differs
        x_gpu.assign(t[i].n, -1.0f);
        int ea = bnb8_optimizer_export_fp32(cpu, (int)i, x_cpu.data()), eb = bnb8_optimizer_export_fp32(gpu, (int)i, x_gpu.data());
        EXPECT(ea == 0 && eb == 0, "export_fp32: %s", bnb8_last_error());
        if (ea || eb || memcmp(x_cpu.data(), x_gpu.data(), t[i].n * sizeof(float)) != 0) exports_equal = 0;
    }
    char path_cpu[64], path_gpu[64];
    snprintf(path_cpu, sizeof path_cpu, "/tmp/bnb8_parity_cpu_%d.state", (int)getpid());
    snprintf(path_gpu, sizeof path_gpu, "/tmp/bnb8_parity_gpu_%d.state", (int)getpid());
    EXPECT(bnb8_optimizer_save(cpu, path_cpu) == 0 && bnb8_optimizer_save(gpu, path_gpu) == 0, "save: %s", bnb8_last_error());
    FILE *a = fopen(path_cpu, "rb"), *b = fopen(path_gpu, "rb");
    int files_equal = a && b;
    for (int ca = 0, cb = 0; files_equal && (ca != EOF || cb != EOF);) {
        ca = fgetc(a);
        cb = fgetc(b);
        if (ca != cb) files_equal = 0;
    }
    if (a) fclose(a);
    if (b) fclose(b);
    remove(path_cpu);
    remove(path_gpu);
    *equal = files_equal && exports_equal && sums_equal;
    for (size_t i = 0; i < t.size(); i++) {   // after the save: it reads corrected weights from the GPU
        cudaFree(t[i].p_gpu);
        cudaFree(t[i].g_gpu);
    }
    bnb8_optimizer_free(cpu);
    bnb8_optimizer_free(gpu);
    return worst;
}

static void test_optimizer_parity(void) {
    std::vector<int64_t> sizes = {1, 255, 257, 4097, largest()};
    const bnb8_dtype dtypes[3] = {BNB8_F32, BNB8_BF16, BNB8_F16};
    for (int kind = 0; kind < BNB8_NUM_OPTIMIZERS; kind++)
        for (int format = 0; format < 2; format++)
            for (int d = 0; d < 3; d++) {
                bnb8_config cfg = bnb8_config_default((bnb8_optim)kind);
                cfg.format = (bnb8_state_format)format;
                cfg.min_8bit_size = 0;           // 8-bit even for the tiny tensors: every tail path
                cfg.weight_decay = 0.01f;
                cfg.sum_squares = d != 2;        // the sums of g^2 as the update kernel reads g
                if (kind == BNB8_SGD) cfg.nesterov = d == 1;
                if (kind == BNB8_ADEMAMIX) { cfg.t_alpha = 50; cfg.t_beta3 = 50; }
                bnb8_dtype gdtype = d == 0 ? BNB8_F32 : (d == 1 ? BNB8_BF16 : BNB8_F32);
                int equal = 0;
                double worst = optimizer_parity((bnb8_optim)kind, cfg, dtypes[d], gdtype, sizes, steps(100), &equal, "t3");
                int norm_based = kind == BNB8_LAMB || kind == BNB8_LARS;
                printf("    %-9s %s p %-4s: %s\n", optimizer_names[kind], format ? "8-bit " : "32-bit",
                       d == 0 ? "f32" : d == 1 ? "bf16" : "f16", worst == 0.0 && equal ? "bit-identical" : "DIFFERENT");
                if (norm_based) EXPECT(worst <= 1e-5, "%s: max relative parameter difference %g > 1e-5", optimizer_names[kind], worst);
                else EXPECT(worst == 0.0 && equal, "%s format %d dtype %d: params differ by %g rel, state files %s",
                            optimizer_names[kind], format, d, worst, equal ? "equal" : "differ");
            }
}

static const char *dtype_name(bnb8_dtype d) {
    return d == BNB8_F32 ? "f32" : d == BNB8_BF16 ? "bf16" : d == BNB8_E6M10 ? "e6m10" : "f16";
}

// A flash kind's name, SGD's with its momentum form.
static const char *flash_kind_name(bnb8_optim kind, int nesterov) {
    return kind != BNB8_SGD ? optimizer_names[kind] : nesterov ? "SGD nesterov" : "SGD momentum";
}

// Flash states (DESIGN.md §6): AdamW, Adam (L2), SGD with momentum (nesterov off and on), Lion; weights
// f32, and bf16 / f16 with no, int8 and int16 correction; e6m10 scales (the default: bf16 + int8
// with bf16 gradients is the fast path); bf16 + int8 with bf16 scales (the files from before e6m10,
// now the generic path) for every kind; then fp16 gradients, and f16 / f32 scales, on AdamW.
// min_8bit_size 0 makes every tensor flash (every tail group) except "t3", whose 32-bit states
// keep the correction of narrow weights.
static void test_flash_parity(void) {
    std::vector<int64_t> sizes = {1, 255, 257, 4097, largest()};
    typedef struct { bnb8_optim kind; int nesterov; bnb8_dtype pdtype, gdtype; int correction; bnb8_dtype scale; } flash_case;
    std::vector<flash_case> cases;
    const bnb8_optim kinds[5] = {BNB8_ADAMW, BNB8_ADAM, BNB8_SGD, BNB8_SGD, BNB8_LION};
    for (int k = 0; k < 5; k++) {
        int nesterov = k == 3;
        cases.push_back({kinds[k], nesterov, BNB8_F32, BNB8_F32, 0, BNB8_E6M10});
        for (int c = 0; c < 3; c++) cases.push_back({kinds[k], nesterov, BNB8_BF16, BNB8_BF16, c, BNB8_E6M10});
        for (int c = 0; c < 3; c++) cases.push_back({kinds[k], nesterov, BNB8_F16, BNB8_BF16, c, BNB8_E6M10});
        cases.push_back({kinds[k], nesterov, BNB8_BF16, BNB8_BF16, 1, BNB8_BF16});
    }
    cases.push_back({BNB8_ADAMW, 0, BNB8_F16, BNB8_F16, 1, BNB8_E6M10});
    cases.push_back({BNB8_ADAMW, 0, BNB8_BF16, BNB8_BF16, 1, BNB8_F16});
    cases.push_back({BNB8_ADAMW, 0, BNB8_BF16, BNB8_BF16, 1, BNB8_F32});
    const char *corr_names[3] = {"none", "int8", "int16"};
    for (const flash_case &c : cases) {
        bnb8_config cfg = bnb8_config_default(c.kind);
        cfg.format = BNB8_STATE_FLASH;
        cfg.min_8bit_size = 0;
        cfg.weight_decay = 0.01f;
        cfg.nesterov = c.nesterov;
        cfg.correction_bytes = c.correction;
        cfg.scale_dtype = c.scale;
        cfg.sum_squares = 1;             // the fast path's lanes, its fallback, the exact chunks
        int equal = 0;
        double worst = optimizer_parity(c.kind, cfg, c.pdtype, c.gdtype, sizes, steps(100), &equal, "t3");
        const char *name = flash_kind_name(c.kind, c.nesterov);
        const char *corr = c.pdtype == BNB8_F32 ? "-" : corr_names[c.correction];
        printf("    %-12s flash p %-4s g %-4s ecc %-5s scales %-5s: %s\n", name, dtype_name(c.pdtype), dtype_name(c.gdtype),
               corr, dtype_name(c.scale), worst == 0.0 && equal ? "bit-identical" : "DIFFERENT");
        EXPECT(worst == 0.0 && equal, "%s flash p %s g %s ecc %s scales %s: params differ by %g rel, states or exports %s",
               name, dtype_name(c.pdtype), dtype_name(c.gdtype), corr, dtype_name(c.scale), worst, equal ? "equal" : "differ");
    }
    // Flash tensors in a launch of 4-row chunks (an 8-bit tensor with blocks of 4096 among them): the
    // fast path with 16 elements per lane, for each flash kind.
    for (int k = 0; k < 5; k++) {
        bnb8_config cfg = bnb8_config_default(kinds[k]);
        cfg.format = BNB8_STATE_FLASH;
        cfg.min_8bit_size = 0;
        cfg.weight_decay = 0.01f;
        cfg.nesterov = k == 3;
        cfg.sum_squares = 1;             // 4-row chunks: the fast path's 16 elements per lane
        int equal = 0;
        double worst = optimizer_parity(kinds[k], cfg, BNB8_BF16, BNB8_BF16, sizes, steps(100), &equal, NULL, NULL, 1, 0.1f, 4096);
        const char *name = flash_kind_name(kinds[k], cfg.nesterov);
        printf("    %-12s flash p bf16 g bf16 ecc int8  with 8-bit blocks of 4096: %s\n", name,
               worst == 0.0 && equal ? "bit-identical" : "DIFFERENT");
        EXPECT(worst == 0.0 && equal, "%s flash among 8-bit blocks of 4096: params differ by %g rel, states or exports %s",
               name, worst, equal ? "equal" : "differ");
    }
    // Group scales at their dtype's largest value (a group absmax of 3.39e38 rounded up to bf16
    // would be inf): gradients {3.39e38, 0, 1} in a group at step 1 (SGD's momentum takes them as they
    // are; Lion's and AdamW's first moments a tenth; AdamW's second moment overflows to inf), on
    // bf16 + int8 weights: e6m10 scales with bf16 gradients (the fast path's chunks, saturated at
    // 1.68e7: sent to the exact path), bf16 scales with f32 gradients (3.39e38 is above bf16's 3.3895e38).
    for (int k : {0, 2, 4})
        for (bnb8_dtype sdt : {BNB8_E6M10, BNB8_BF16}) {
            bnb8_config cfg = bnb8_config_default(kinds[k]);
            cfg.format = BNB8_STATE_FLASH;
            cfg.min_8bit_size = 0;
            cfg.scale_dtype = sdt;
            int equal = 0;
            bnb8_dtype gdt = sdt == BNB8_BF16 ? BNB8_F32 : BNB8_BF16;
            double worst = optimizer_parity(kinds[k], cfg, BNB8_BF16, gdt, sizes, steps(100), &equal, NULL, NULL, 1, 0.1f, 0, 3.39e38f);
            const char *name = flash_kind_name(kinds[k], 0);
            printf("    %-12s flash p bf16 g %-4s ecc int8  scales %-5s, gradients 3.39e38: %s\n", name, dtype_name(gdt), dtype_name(sdt),
                   worst == 0.0 && equal ? "bit-identical" : "DIFFERENT");
            EXPECT(worst == 0.0 && equal, "%s flash, %s scales, gradients 3.39e38: params differ by %g rel, states or exports %s",
                   name, dtype_name(sdt), worst, equal ? "equal" : "differ");
        }
    // Gradients of 3e-13 (1.5e-11 every 7th step): group maxima around e6m10's smallest normal
    // 2^-39 (1.8e-12), so that the fast path meets subnormal scales, new and stored (a group that
    // grows past 2^-39 loads a subnormal one), and sends those chunks to the exact path.
    for (int k : {0, 1, 2, 4}) {
        bnb8_config c = bnb8_config_default(kinds[k]);
        c.format = BNB8_STATE_FLASH;
        c.min_8bit_size = 0;
        c.weight_decay = 0.01f;
        int same = 0;
        double w = optimizer_parity(kinds[k], c, BNB8_BF16, BNB8_BF16, sizes, steps(30), &same, NULL, NULL, 1, 0.1f, 0, 0.0f, 3e-13f);
        const char *name = flash_kind_name(kinds[k], 0);
        printf("    %-12s flash p bf16 g bf16 ecc int8  gradients 3e-13 (subnormal scales): %s\n", name,
               w == 0.0 && same ? "bit-identical" : "DIFFERENT");
        EXPECT(w == 0.0 && same, "%s flash, gradients 3e-13: params differ by %g rel, states or exports %s", name, w,
               same ? "equal" : "differ");
    }
    // Weights near the bottom of bf16's range (1e-36, lr 1e-37): the default configuration's fast
    // path leaves their corrections to the exact one (bnb8_ecc8_value_fast, bnb8_ecc8_code_fast).
    bnb8_config cfg = bnb8_config_default(BNB8_ADAMW);
    cfg.format = BNB8_STATE_FLASH;
    cfg.min_8bit_size = 0;
    cfg.lr = 1e-37f;
    int equal = 0;
    double worst = optimizer_parity(BNB8_ADAMW, cfg, BNB8_BF16, BNB8_BF16, sizes, steps(20), &equal, NULL, NULL, 1, 1e-36f);
    printf("    AdamW        flash p bf16 g bf16 ecc int8  tiny weights: %s\n", worst == 0.0 && equal ? "bit-identical" : "DIFFERENT");
    EXPECT(worst == 0.0 && equal, "AdamW flash, tiny weights: params differ by %g rel, states or exports %s", worst, equal ? "equal" : "differ");
}

// Master weights whatever the state format (DESIGN.md §6.1): 8-bit block-wise and flash states (and
// "t3"'s 32-bit ones, which keep the configured master) on bf16 / f16 weights with an int8 or int16
// correction or an fp32 master, 100 steps: GPU equals CPU bit for bit (weights, masters, states). AdamW
// in every combination; Adam, SGD and Lion with int8 and fp32 masters; 8-bit blocks of 4096 (chunks of
// 4 rows) with both; a tensor with one absmax (blocksize 0: the two passes) with each master.
static void test_master_parity(void) {
    std::vector<int64_t> sizes = {1, 255, 257, 4097, largest()};
    typedef struct { bnb8_optim kind; bnb8_state_format format; bnb8_dtype pdtype; int correction; int64_t blocksize; } master_case;
    std::vector<master_case> cases;
    const bnb8_state_format formats[2] = {BNB8_STATE_8BIT, BNB8_STATE_FLASH};
    const bnb8_optim kinds[4] = {BNB8_ADAMW, BNB8_ADAM, BNB8_SGD, BNB8_LION};
    for (int f = 0; f < 2; f++) {
        for (int d = 0; d < 2; d++)
            for (int cb : {1, 2, 4}) cases.push_back({BNB8_ADAMW, formats[f], d ? BNB8_F16 : BNB8_BF16, cb, 256});
        for (int k = 1; k < 4; k++)
            for (int cb : {1, 4}) cases.push_back({kinds[k], formats[f], BNB8_BF16, cb, 256});
    }
    for (int cb : {1, 4}) cases.push_back({BNB8_ADAMW, BNB8_STATE_8BIT, BNB8_BF16, cb, 4096});
    for (int cb : {1, 2, 4}) cases.push_back({BNB8_ADAMW, BNB8_STATE_8BIT, BNB8_BF16, cb, 0});   // t2: one absmax
    const char *master_names[5] = {"none", "int8", "int16", "?", "fp32"};
    for (const master_case &c : cases) {
        bnb8_config cfg = bnb8_config_default(c.kind);
        cfg.format = c.format;
        cfg.min_8bit_size = 0;
        cfg.weight_decay = 0.01f;
        cfg.correction_bytes = c.correction;
        cfg.blocksize = c.blocksize;
        int equal = 0;
        // blocksize 0: t2 alone has one absmax (the two passes), among the blocked others
        if (c.blocksize == 0) cfg.blocksize = 256;
        double worst = optimizer_parity(c.kind, cfg, c.pdtype, BNB8_BF16, sizes, steps(100), &equal, "t3",
                                        c.blocksize == 0 ? "t2" : NULL);
        const char *fmt = c.format == BNB8_STATE_FLASH ? "flash" : c.blocksize == 4096 ? "8-bit 4096"
                        : c.blocksize == 0 ? "8-bit t2 one" : "8-bit";
        printf("    %-6s %-10s p %-4s master %-5s: %s\n", optimizer_names[c.kind], fmt, dtype_name(c.pdtype),
               master_names[c.correction], worst == 0.0 && equal ? "bit-identical" : "DIFFERENT");
        EXPECT(worst == 0.0 && equal, "%s %s p %s master %s: params differ by %g rel, states or exports %s",
               optimizer_names[c.kind], fmt, dtype_name(c.pdtype), master_names[c.correction], worst, equal ? "equal" : "differ");
    }
    // The fast chunks' tensors (bf16 weights and 8-bit states in blocks of 256 with int8 corrections
    // or fp32 masters, or 32-bit states with fp32 masters) with cfg.sum_squares (their lanes' sums),
    // and with weights near the bottom of bf16's range (1e-36, lr 1e-37), whose int8 corrections the
    // fast forms leave to the exact chunk.
    for (int run = 0; run < 6; run++) {
        const int tiny = run % 2, cb = run < 2 ? 1 : 4;
        const bnb8_state_format format = run < 4 ? BNB8_STATE_8BIT : BNB8_STATE_32BIT;
        bnb8_config cfg = bnb8_config_default(BNB8_ADAMW);
        cfg.format = format;
        cfg.min_8bit_size = 0;
        cfg.weight_decay = 0.01f;
        cfg.correction_bytes = cb;
        cfg.sum_squares = !tiny;
        if (tiny) cfg.lr = 1e-37f;
        int equal = 0;
        double worst = optimizer_parity(BNB8_ADAMW, cfg, BNB8_BF16, BNB8_BF16, sizes, steps(tiny ? 20 : 100), &equal, NULL, NULL,
                                        1, tiny ? 1e-36f : 0.1f);
        const char *what = tiny ? "tiny weights" : "sum of g^2", *fmt = format == BNB8_STATE_8BIT ? "8-bit" : "32-bit";
        printf("    AdamW  %-10s p bf16 master %-5s: %s: %s\n", fmt, master_names[cb], what,
               worst == 0.0 && equal ? "bit-identical" : "DIFFERENT");
        EXPECT(worst == 0.0 && equal, "AdamW %s p bf16 master %s, %s: params differ by %g rel, states or exports %s",
               fmt, master_names[cb], what, worst, equal ? "equal" : "differ");
    }
}

// An fp32 master of GPU weights starts as the weights widened, as on the CPU (the same bits:
// widening is exact): bnb8_optimizer_export_fp32 right after bnb8_optimizer_add gives (float)w for
// every element, and a zero-gradient step without weight decay leaves every weight's bits (AdamW,
// SGD and Lion update by zero there); 8-bit and flash states, bf16 and fp16 weights.
static void test_master_starts_at_weights(void) {
    const int64_t n = 3 * 4096 + 77;
    const bnb8_state_format fmts[2] = {BNB8_STATE_8BIT, BNB8_STATE_FLASH};
    const bnb8_optim kinds[3] = {BNB8_ADAMW, BNB8_SGD, BNB8_LION};
    std::vector<uint16_t> w0(n), w1(n);
    std::vector<float> master(n);
    float *dg = NULL;
    CUDA_CHECK(cudaMalloc(&dg, sizeof(float) * n));
    CUDA_CHECK(cudaMemset(dg, 0, sizeof(float) * n));
    for (int run = 0; run < 12; run++) {   // format, kind, weight dtype
        int f = run / 6, k = run / 2 % 3;
        bnb8_dtype pdt = run % 2 ? BNB8_F16 : BNB8_BF16;
        bnb8_config c = bnb8_config_default(kinds[k]);
        c.correction_bytes = 4; c.weight_decay = 0.0f; c.format = fmts[f]; c.min_8bit_size = 0;
        fill_random(w0.data(), pdt, n, 0.1f);
        uint16_t *dw = device_copy(w0.data(), (size_t)n);
        bnb8_optimizer *opt = NULL;
        int ok = bnb8_optimizer_create(&opt, kinds[k], &c) == 0 &&
                 bnb8_optimizer_add(opt, "w", dw, pdt, dg, BNB8_F32, n, NULL) == 0 &&
                 bnb8_optimizer_export_fp32(opt, 0, master.data()) == 0;
        EXPECT(ok, "%s format %d %s: %s", optimizer_names[kinds[k]], (int)fmts[f], dtype_name(pdt), bnb8_last_error());
        int64_t bad_master = -1, bad_weight = -1;
        for (int64_t i = 0; ok && i < n && bad_master < 0; i++) {
            float want = pdt == BNB8_BF16 ? bnb8_bf16_to_f32(w0[i]) : bnb8_f16_to_f32(w0[i]);
            if (memcmp(&master[i], &want, 4) != 0) bad_master = i;
        }
        ok = ok && bnb8_optimizer_step(opt, 1e-2f, 1.0f, NULL) == 0;
        EXPECT(ok, "%s format %d %s: step: %s", optimizer_names[kinds[k]], (int)fmts[f], dtype_name(pdt), bnb8_last_error());
        CUDA_CHECK(cudaDeviceSynchronize());
        CUDA_CHECK(cudaMemcpy(w1.data(), dw, 2 * (size_t)n, cudaMemcpyDeviceToHost));
        for (int64_t i = 0; ok && i < n && bad_weight < 0; i++) if (w1[i] != w0[i]) bad_weight = i;
        EXPECT(bad_master < 0, "%s format %d %s: master %lld is %.9g after add, not its weight widened",
               optimizer_names[kinds[k]], (int)fmts[f], dtype_name(pdt), (long long)bad_master,
               bad_master < 0 ? 0.0 : (double)master[bad_master]);
        EXPECT(bad_weight < 0, "%s format %d %s: a zero-gradient step moved weight %lld from 0x%04x to 0x%04x",
               optimizer_names[kinds[k]], (int)fmts[f], dtype_name(pdt), (long long)bad_weight,
               bad_weight < 0 ? 0 : w0[bad_weight], bad_weight < 0 ? 0 : w1[bad_weight]);
        bnb8_optimizer_free(opt);
        cudaFree(dw);
    }
    cudaFree(dg);
}

// fp32 masters to and from device memory: for every correction (none, int8, int16, fp32 master)
// and weight dtype, import_fp32 of device values gives the weights and correction that import of the
// same host values gives, and export_fp32 into device memory the host export's floats, bit for bit
// (the outputs poisoned first). A CPU tensor with device values is refused.
static void test_masters_in_device_memory(void) {
    const int64_t n = 2 * 4096 + 333;
    const int corrections[4] = {0, 1, 2, 4};
    std::vector<float> x(n), out_host(n), out_dev(n);
    std::vector<uint8_t> w_host(4 * n), w_dev(4 * n), c_host(4 * n), c_dev(4 * n);
    float *dx = NULL, *dout = NULL, *dg = NULL;
    CUDA_CHECK(cudaMalloc(&dx, sizeof(float) * n));
    CUDA_CHECK(cudaMalloc(&dout, sizeof(float) * n));
    CUDA_CHECK(cudaMalloc(&dg, sizeof(float) * n));
    for (int run = 0; run < 8; run++) {
        int cb = corrections[run % 4];
        bnb8_dtype pdt = run < 4 ? BNB8_BF16 : BNB8_F16;
        fill_random(x.data(), BNB8_F32, n, 0.5f);
        CUDA_CHECK(cudaMemcpy(dx, x.data(), sizeof(float) * n, cudaMemcpyHostToDevice));
        bnb8_config c = bnb8_config_default(BNB8_ADAMW);
        c.correction_bytes = cb;
        void *dw[2] = {NULL, NULL};
        bnb8_optimizer *opt[2] = {NULL, NULL};
        int ok = 1;
        for (int k = 0; k < 2; k++) {
            CUDA_CHECK(cudaMalloc(&dw[k], 2 * (size_t)n));
            CUDA_CHECK(cudaMemset(dw[k], 0, 2 * (size_t)n));
            ok = ok && bnb8_optimizer_create(&opt[k], BNB8_ADAMW, &c) == 0 &&
                 bnb8_optimizer_add(opt[k], "w", dw[k], pdt, dg, BNB8_F32, n, NULL) == 0;
        }
        ok = ok && bnb8_optimizer_import_fp32(opt[0], 0, x.data()) == 0 && bnb8_optimizer_import_fp32(opt[1], 0, dx) == 0;
        EXPECT(ok, "correction %d %s: import: %s", cb, dtype_name(pdt), bnb8_last_error());
        CUDA_CHECK(cudaMemcpy(w_host.data(), dw[0], 2 * (size_t)n, cudaMemcpyDeviceToHost));
        CUDA_CHECK(cudaMemcpy(w_dev.data(), dw[1], 2 * (size_t)n, cudaMemcpyDeviceToHost));
        EXPECT(memcmp(w_host.data(), w_dev.data(), 2 * (size_t)n) == 0, "correction %d %s: weights of a device import differ", cb, dtype_name(pdt));
        // the corrections show in the exports: the masters of both must match bit for bit
        CUDA_CHECK(cudaMemset(dout, 0xff, sizeof(float) * n));
        std::fill(out_host.begin(), out_host.end(), NAN);
        ok = ok && bnb8_optimizer_export_fp32(opt[0], 0, out_host.data()) == 0 && bnb8_optimizer_export_fp32(opt[1], 0, dout) == 0;
        EXPECT(ok, "correction %d %s: export: %s", cb, dtype_name(pdt), bnb8_last_error());
        CUDA_CHECK(cudaMemcpy(out_dev.data(), dout, sizeof(float) * n, cudaMemcpyDeviceToHost));
        EXPECT(memcmp(out_host.data(), out_dev.data(), sizeof(float) * n) == 0, "correction %d %s: a device export differs", cb, dtype_name(pdt));
        if (cb == 4) EXPECT(memcmp(out_dev.data(), x.data(), sizeof(float) * n) == 0, "%s: an fp32 master is not its import", dtype_name(pdt));
        for (int k = 0; k < 2; k++) { bnb8_optimizer_free(opt[k]); cudaFree(dw[k]); }
    }
    std::vector<float> hw(n), hg(n);
    bnb8_optimizer *cpu = NULL;
    EXPECT(bnb8_optimizer_create(&cpu, BNB8_ADAMW, NULL) == 0 && bnb8_optimizer_add(cpu, "w", hw.data(), BNB8_F32, hg.data(), BNB8_F32, n, NULL) == 0 &&
           bnb8_optimizer_import_fp32(cpu, 0, dx) == BNB8_ERR_DEVICE && bnb8_optimizer_export_fp32(cpu, 0, dout) == BNB8_ERR_DEVICE,
           "a CPU tensor with device fp32 values: not refused (%s)", bnb8_last_error());
    bnb8_optimizer_free(cpu);
    cudaFree(dx); cudaFree(dout); cudaFree(dg);
}

// The approximation the fast flash path may use (bnb8.h: bnb8_rcp_approx within 1 ulp of the
// correctly rounded value), measured on every float of [1, 4): the hardware scales the exponent,
// so these binades stand for the normal range.
__global__ void approx_errors_kernel(unsigned *ulps) {
    uint32_t u = 0x3f800000u + blockIdx.x * blockDim.x + threadIdx.x;   // [1, 4): 2^24 floats
    float x = bnb8_bits_f32(u);
    int d = (int)bnb8_f32_bits(bnb8_rcp_approx(x)) - (int)bnb8_f32_bits(__frcp_rn(x));
    atomicMax(ulps, (unsigned)(d < 0 ? -d : d));
}
static void test_fast_approximations(void) {
    unsigned *d_ulps, ulps;
    CUDA_CHECK(cudaMalloc(&d_ulps, sizeof ulps));
    CUDA_CHECK(cudaMemset(d_ulps, 0, sizeof ulps));
    approx_errors_kernel<<<(1 << 24) / 256, 256>>>(d_ulps);
    CUDA_CHECK(cudaGetLastError());
    CUDA_CHECK(cudaMemcpy(&ulps, d_ulps, sizeof ulps, cudaMemcpyDeviceToHost));
    printf("    reciprocal: %u ulp from the correctly rounded value\n", ulps);
    EXPECT(ulps <= 1, "the approximate reciprocal is %u ulp off (the fast codes assume 1)", ulps);
    cudaFree(d_ulps);
}

// Block sizes, percentile clipping, and a GPT-2-like list of 148 tensors in one launch (32-bit,
// 8-bit, and flash with the small tensors' 32-bit states keeping their correction).
static void test_optimizer_options(void) {
    std::vector<int64_t> sizes = {1, 255, 257, 4097, largest()};
    for (int64_t bs = 64; bs <= 4096; bs *= 2) {
        bnb8_config cfg = bnb8_config_default(BNB8_ADAMW);
        cfg.blocksize = bs;
        cfg.min_8bit_size = 0;
        int equal = 0;
        double worst = optimizer_parity(BNB8_ADAMW, cfg, BNB8_F32, BNB8_F32, sizes, steps(30), &equal, NULL);
        EXPECT(worst == 0.0 && equal, "AdamW 8-bit block %lld differs (%g)", (long long)bs, worst);
    }
    bnb8_config cfg = bnb8_config_default(BNB8_ADAMW);
    cfg.percentile_clipping = 5;
    int equal = 0;
    double worst = optimizer_parity(BNB8_ADAMW, cfg, BNB8_F32, BNB8_F32, sizes, steps(100), &equal, NULL);
    printf("    percentile clipping: %s (max rel diff %g)\n", worst == 0.0 && equal ? "bit-identical" : "differs", worst);
    EXPECT(worst <= 1e-5, "percentile clipping: max relative parameter difference %g > 1e-5", worst);
    // GPT-2 d12's 148 tensors at a small width: wte, wpe, 12 x 12 per layer, ln_f w and b.
    std::vector<int64_t> gpt2;
    const int64_t C = 128, V = 1000, T = 256;
    gpt2.push_back(V * C);
    gpt2.push_back(T * C);
    for (int l = 0; l < 12; l++) {
        const int64_t layer[12] = {C, C, 3 * C * C, 3 * C, C * C, C, C, C, 4 * C * C, 4 * C, 4 * C * C, C};
        for (int k = 0; k < 12; k++) gpt2.push_back(layer[k]);
    }
    gpt2.push_back(C);
    gpt2.push_back(C);
    for (int format = 0; format < 3; format++)
        for (int d = 0; d < 2; d++) {
            if (format == BNB8_STATE_FLASH && d == 0) continue;   // flash: bf16 weights, int8 correction, bf16 grads
            cfg = bnb8_config_default(BNB8_ADAMW);
            cfg.format = (bnb8_state_format)format;
            worst = optimizer_parity(BNB8_ADAMW, cfg, d ? BNB8_BF16 : BNB8_F32, d ? BNB8_BF16 : BNB8_F32, gpt2, steps(100), &equal, "t0");
            EXPECT(gpt2.size() == 148 && worst == 0.0 && equal, "GPT-2 list format %d dtype %d differs (%g)", format, d, worst);
        }
    // The linear map (the paper's ablation), every optimizer: the GPU steps with the optimizer's map
    // and the zero code of bnb8_zero_code, as the CPU does ("t3" keeps 32-bit states).
    for (int kind = 0; kind < BNB8_NUM_OPTIMIZERS; kind++) {
        cfg = bnb8_config_default((bnb8_optim)kind);
        cfg.map = BNB8_MAP_LINEAR;
        cfg.min_8bit_size = 0;
        worst = optimizer_parity((bnb8_optim)kind, cfg, BNB8_F32, BNB8_F32, sizes, steps(30), &equal, "t3");
        int norm_based = kind == BNB8_LAMB || kind == BNB8_LARS;
        printf("    %-9s 8-bit linear map: %s\n", optimizer_names[kind], worst == 0.0 && equal ? "bit-identical" : "DIFFERENT");
        EXPECT(norm_based ? worst <= 1e-5 : worst == 0.0 && equal, "%s linear map: params differ by %g rel, state files %s",
               optimizer_names[kind], worst, equal ? "equal" : "differ");
    }
    // A GPU tensor keeps the optimizer's map: an 8-bit GPU tensor asking otherwise is refused when
    // added; one under min_8bit_size is not.
    void *dp, *dg;
    CUDA_CHECK(cudaMalloc(&dp, 8192 * 4));
    CUDA_CHECK(cudaMalloc(&dg, 8192 * 4));
    bnb8_optimizer *o = NULL;
    bnb8_config lin = bnb8_config_default(BNB8_ADAMW);
    lin.map = BNB8_MAP_LINEAR;
    EXPECT(bnb8_optimizer_create(&o, BNB8_ADAMW, NULL) == 0 && bnb8_optimizer_override(o, "w", &lin) == 0 &&
           bnb8_optimizer_override(o, "small", &lin) == 0, "create");
    int status = bnb8_optimizer_add(o, "w", dp, BNB8_F32, dg, BNB8_F32, 8192, NULL);
    EXPECT(status == BNB8_ERR_ARG, "a GPU tensor with its own map: status %d (%s)", status, bnb8_last_error());
    EXPECT(bnb8_optimizer_add(o, "small", dp, BNB8_F32, dg, BNB8_F32, 100, NULL) == 0, "a 32-bit GPU tensor: %s", bnb8_last_error());
    bnb8_optimizer_free(o);
    cudaFree(dp);
    cudaFree(dg);
}

// One absmax per tensor (blocksize 0, the paper's "no blocks" ablation): the GPU's two passes must
// give the CPU's parameters, codes and absmax bit for bit. Every optimizer, f32 and bf16 weights,
// every tensor 8-bit with one absmax (subset steps included, see optimizer_parity); LAMB and LARS
// and percentile clipping take norms summed in another order, so as above they must agree within
// 1e-5 and are reported bit-identical or not. Then one blocksize-0 tensor among blocked and 32-bit
// ones in one optimizer (blocks of 256: chunks of 2 rows, of 4096: 4 rows), with subset steps of
// two tensors, among them the blocksize-0 t4 with the 32-bit t3 and the blocked t0 with t4.
static void test_per_tensor_parity(void) {
    std::vector<int64_t> sizes = {1, 255, 257, 4097, largest()};
    for (int kind = 0; kind < BNB8_NUM_OPTIMIZERS; kind++)
        for (int d = 0; d < 2; d++) {
            bnb8_config cfg = bnb8_config_default((bnb8_optim)kind);
            cfg.blocksize = 0;
            cfg.min_8bit_size = 0;
            cfg.weight_decay = 0.01f;
            cfg.sum_squares = 1;         // summed in the store pass only (not twice)
            if (kind == BNB8_ADEMAMIX) { cfg.t_alpha = 50; cfg.t_beta3 = 50; }
            bnb8_dtype dtype = d ? BNB8_BF16 : BNB8_F32;
            int equal = 0;
            double worst = optimizer_parity((bnb8_optim)kind, cfg, dtype, dtype, sizes, steps(100), &equal, NULL);
            int norm_based = kind == BNB8_LAMB || kind == BNB8_LARS;
            printf("    %-9s 8-bit one absmax p %-4s: %s\n", optimizer_names[kind], dtype_name(dtype),
                   worst == 0.0 && equal ? "bit-identical" : "DIFFERENT");
            EXPECT(norm_based ? worst <= 1e-5 : worst == 0.0 && equal, "%s one absmax p %s: params differ by %g rel, state files %s",
                   optimizer_names[kind], dtype_name(dtype), worst, equal ? "equal" : "differ");
        }
    bnb8_config cfg = bnb8_config_default(BNB8_ADAMW);
    cfg.blocksize = 0;
    cfg.min_8bit_size = 0;
    cfg.percentile_clipping = 5;
    int equal = 0;
    double worst = optimizer_parity(BNB8_ADAMW, cfg, BNB8_F32, BNB8_F32, sizes, steps(100), &equal, NULL);
    printf("    one absmax, percentile clipping: %s (max rel diff %g)\n", worst == 0.0 && equal ? "bit-identical" : "differs", worst);
    EXPECT(worst <= 1e-5, "one absmax, percentile clipping: max relative parameter difference %g > 1e-5", worst);
    const bnb8_optim mixed[2] = {BNB8_ADAMW, BNB8_LAMB};
    for (int m = 0; m < 2; m++)
        for (int64_t bs = 256; bs <= 4096; bs *= 16)
            for (int d = 0; d < 2; d++) {
                cfg = bnb8_config_default(mixed[m]);
                cfg.blocksize = bs;
                cfg.min_8bit_size = 0;
                bnb8_dtype dtype = d ? BNB8_BF16 : BNB8_F32;
                // t4 (the largest) one absmax, t3 32-bit, the others blocks of bs
                worst = optimizer_parity(mixed[m], cfg, dtype, dtype, sizes, steps(100), &equal, "t3", "t4", 2);
                printf("    %-9s one absmax among blocks of %-4lld p %-4s: %s\n", optimizer_names[mixed[m]], (long long)bs,
                       dtype_name(dtype), worst == 0.0 && equal ? "bit-identical" : "DIFFERENT");
                EXPECT(mixed[m] == BNB8_LAMB ? worst <= 1e-5 : worst == 0.0 && equal,
                       "%s one absmax among blocks of %lld p %s: params differ by %g rel, state files %s",
                       optimizer_names[mixed[m]], (long long)bs, dtype_name(dtype), worst, equal ? "equal" : "differ");
            }
}

// cfg.gnorm_scale_at on the GPU: the factor a kernel wrote into device memory before each step, read
// by the launch in stream order (flash and 8-bit tensors in one launch),
// equals the CPU stepping at the product as gnorm_scale, bit for bit; a host float for GPU tensors is
// refused (BNB8_ERR_DEVICE).
__global__ static void set_factor(float *at, float v) { *at = v; }
static void test_gnorm_scale_at(void) {
    const int64_t n = 5000;
    const int formats[2] = {BNB8_STATE_FLASH, BNB8_STATE_8BIT};
    float *dfactor = NULL, host_factor = 1.0f;
    CUDA_CHECK(cudaMalloc(&dfactor, sizeof(float)));
    bnb8_config c = bnb8_config_default(BNB8_ADAMW);
    c.format = BNB8_STATE_FLASH;
    bnb8_optimizer *cpu = NULL, *gpu = NULL, *bad = NULL;
    EXPECT(bnb8_optimizer_create(&cpu, BNB8_ADAMW, &c) == 0, "%s", bnb8_last_error());
    c.gnorm_scale_at = dfactor;
    EXPECT(bnb8_optimizer_create(&gpu, BNB8_ADAMW, &c) == 0, "%s", bnb8_last_error());
    c.gnorm_scale_at = &host_factor;
    EXPECT(bnb8_optimizer_create(&bad, BNB8_ADAMW, &c) == 0, "%s", bnb8_last_error());
    std::vector<std::vector<uint16_t>> p(2), g(2);
    uint16_t *dp[2], *dg[2];
    for (int k = 0; k < 2; k++) {
        bnb8_config o = bnb8_config_default(BNB8_ADAMW);
        o.format = (bnb8_state_format)formats[k];
        char name[8];
        snprintf(name, sizeof name, "t%d", k);
        o.gnorm_scale_at = NULL;
        bnb8_optimizer_override(cpu, name, &o);
        o.gnorm_scale_at = dfactor;
        bnb8_optimizer_override(gpu, name, &o);
        p[k].resize(n); g[k].resize(n);
        for (int64_t i = 0; i < n; i++) p[k][i] = bnb8_f32_to_bf16((float)(0.1 * test_randn(&rng)));
        dp[k] = device_copy(p[k].data(), n);
        CUDA_CHECK(cudaMalloc(&dg[k], 2 * n));
        EXPECT(bnb8_optimizer_add(cpu, name, p[k].data(), BNB8_BF16, g[k].data(), BNB8_BF16, n, NULL) == 0 &&
               bnb8_optimizer_add(gpu, name, dp[k], BNB8_BF16, dg[k], BNB8_BF16, n, NULL) == 0, "add: %s", bnb8_last_error());
    }
    EXPECT(bnb8_optimizer_add(bad, "t", dp[0], BNB8_BF16, dg[0], BNB8_BF16, n, NULL) == BNB8_ERR_DEVICE,
           "a host gnorm_scale_at for GPU tensors: %s", bnb8_last_error());
    const float factor[5] = {0.375f, 1.0f, 0.015625f, 0.6f, 0.125f};
    for (int step = 0; step < 5; step++) {
        for (int k = 0; k < 2; k++) {
            for (int64_t i = 0; i < n; i++) g[k][i] = bnb8_f32_to_bf16((float)((1.0 + 9.0 * (step == 3)) * test_randn(&rng)));
            CUDA_CHECK(cudaMemcpy(dg[k], g[k].data(), 2 * n, cudaMemcpyHostToDevice));
        }
        set_factor<<<1, 1>>>(dfactor, factor[step]);   // on the stream the step runs on, before it
        EXPECT(bnb8_optimizer_step(cpu, 1e-3f, 0.5f * factor[step], NULL) == 0 && bnb8_optimizer_step(gpu, 1e-3f, 0.5f, NULL) == 0,
               "step: %s", bnb8_last_error());
    }
    CUDA_CHECK(cudaDeviceSynchronize());
    int same = 1;
    for (int k = 0; k < 2; k++) {
        std::vector<uint16_t> back(n);
        CUDA_CHECK(cudaMemcpy(back.data(), dp[k], 2 * n, cudaMemcpyDeviceToHost));
        same &= memcmp(back.data(), p[k].data(), 2 * n) == 0;
        cudaFree(dp[k]); cudaFree(dg[k]);
    }
    EXPECT(same, "gnorm_scale_at on the GPU differs from the CPU stepping at the products");
    printf("  gnorm_scale_at: flash + 8-bit, 5 steps: GPU = CPU, %s\n", same ? "bit-identical" : "DIFFERENT");
    bnb8_optimizer_free(cpu); bnb8_optimizer_free(gpu); bnb8_optimizer_free(bad);
    cudaFree(dfactor);
}

// ------------------------------------------------------------------------------------------------
// Shards (DESIGN.md §5.6): N shards of one tensor registered with one GPU optimizer (as a rank of the
// trainer holds its shards of every tensor), stepped in one launch, against the same shards on the
// CPU (the state files byte for byte) and the whole tensor on the CPU (weights and fp32 masters):
// test_shard.c holds the CPU's shards to the CPU's whole tensor, state by state.

static bool file_bytes_equal(const char *pa, const char *pb) {
    FILE *a = fopen(pa, "rb"), *b = fopen(pb, "rb");
    bool same = a && b;
    for (int ca = 0, cb = 0; same && (ca != EOF || cb != EOF);) { ca = fgetc(a); cb = fgetc(b); same = ca == cb; }
    if (a) fclose(a);
    if (b) fclose(b);
    return same;
}

static void shard_gpu_case(bnb8_optim kind, bnb8_config cfg, bnb8_dtype pdt, int N, int64_t unit, const char *label) {
    int64_t total = unit * (4 * N + (int64_t)(test_uniform(&rng) * 8)) + 1 + (int64_t)(test_uniform(&rng) * (double)(unit - 1));
    std::vector<int64_t> b(N + 1, 0);
    b[N] = total;
    for (int k = 1; k < N; k++) b[k] = b[k - 1] + unit * (1 + (int64_t)(test_uniform(&rng) * 4));   // uneven, inside
    size_t es = bnb8_dtype_size(pdt), bytes = es * (size_t)total;
    std::vector<uint8_t> pw(bytes), ps(bytes), g(bytes), back(bytes);
    std::vector<float> master(total), xw(total), xs(total);
    fill_random(master.data(), BNB8_F32, total, 0.1f);
    for (int64_t i = 0; i < total; i++) bnb8_store(pw.data(), pdt, i, master[i]);
    ps = pw;
    uint8_t *pd = device_copy(pw.data(), bytes), *gd = NULL;
    CUDA_CHECK(cudaMalloc(&gd, bytes));
    bnb8_optimizer *whole = NULL, *cpu = NULL, *gpu = NULL;
    int ok = bnb8_optimizer_create(&whole, kind, &cfg) == 0 && bnb8_optimizer_create(&cpu, kind, &cfg) == 0 &&
             bnb8_optimizer_create(&gpu, kind, &cfg) == 0 &&
             bnb8_optimizer_add(whole, "w", pw.data(), pdt, g.data(), pdt, total, NULL) == 0;
    if (ok && pdt != BNB8_F32) ok = bnb8_optimizer_import_fp32(whole, 0, master.data()) == 0;
    for (int k = 0; ok && k < N; k++) {
        char name[16];
        snprintf(name, sizeof name, "w.%d", k);
        bnb8_config o = cfg;
        o.shard_offset = b[k]; o.shard_total = total;
        size_t at = es * (size_t)b[k];
        int64_t n = b[k + 1] - b[k];
        ok = bnb8_optimizer_override(cpu, name, &o) == 0 && bnb8_optimizer_override(gpu, name, &o) == 0 &&
             bnb8_optimizer_add(cpu, name, ps.data() + at, pdt, g.data() + at, pdt, n, NULL) == 0 &&
             bnb8_optimizer_add(gpu, name, pd + at, pdt, gd + at, pdt, n, NULL) == 0;
        if (ok && pdt != BNB8_F32)
            ok = bnb8_optimizer_import_fp32(cpu, k, master.data() + b[k]) == 0 && bnb8_optimizer_import_fp32(gpu, k, master.data() + b[k]) == 0;
    }
    EXPECT(ok, "%s: %s", label, bnb8_last_error());
    for (int step = 1; ok && step <= 20; step++) {
        fill_random(g.data(), pdt, total, 0.01f);
        if (step % 7 == 3) bnb8_store(g.data(), pdt, step % total, NAN);
        CUDA_CHECK(cudaMemcpy(gd, g.data(), bytes, cudaMemcpyHostToDevice));
        float lr = cfg.lr * (1.0f - 0.03f * (float)step);
        ok = bnb8_optimizer_step(whole, lr, 1.0f, NULL) == 0 && bnb8_optimizer_step(cpu, lr, 1.0f, NULL) == 0 &&
             bnb8_optimizer_step(gpu, lr, 1.0f, NULL) == 0;
        EXPECT(ok, "%s: step %d: %s", label, step, bnb8_last_error());
    }
    CUDA_CHECK(cudaMemcpy(back.data(), pd, bytes, cudaMemcpyDeviceToHost));
    int64_t nw = test_take_nonfinite(whole), nc = test_take_nonfinite(cpu), ng = test_take_nonfinite(gpu);
    EXPECT(nw == nc && nc == ng && nw > 0, "%s: non-finite counts whole %lld, CPU shards %lld, GPU shards %lld", label,
           (long long)nw, (long long)nc, (long long)ng);
    EXPECT(memcmp(pw.data(), ps.data(), bytes) == 0, "%s: the CPU shards' weights differ from the whole tensor's", label);
    EXPECT(memcmp(ps.data(), back.data(), bytes) == 0, "%s: the GPU shards' weights differ from the CPU's", label);
    EXPECT(bnb8_optimizer_export_fp32(whole, 0, xw.data()) == 0, "%s", bnb8_last_error());
    for (int k = 0; k < N; k++) EXPECT(bnb8_optimizer_export_fp32(gpu, k, xs.data() + b[k]) == 0, "%s", bnb8_last_error());
    EXPECT(memcmp(xw.data(), xs.data(), sizeof(float) * (size_t)total) == 0, "%s: the GPU shards' fp32 masters differ", label);
    char path_cpu[64], path_gpu[64];
    snprintf(path_cpu, sizeof path_cpu, "/tmp/bnb8_shard_cpu_%d.state", (int)getpid());
    snprintf(path_gpu, sizeof path_gpu, "/tmp/bnb8_shard_gpu_%d.state", (int)getpid());
    EXPECT(bnb8_optimizer_save(cpu, path_cpu) == 0 && bnb8_optimizer_save(gpu, path_gpu) == 0, "save: %s", bnb8_last_error());
    EXPECT(file_bytes_equal(path_cpu, path_gpu), "%s: the GPU shards' state file differs from the CPU's", label);
    remove(path_cpu);
    remove(path_gpu);
    bnb8_optimizer_free(whole); bnb8_optimizer_free(cpu); bnb8_optimizer_free(gpu);
    cudaFree(pd); cudaFree(gd);
}

// Stochastic rounding (DESIGN.md §6.6): GPU equals CPU bit for bit (weights, state files with their
// seeds, exports) for every kind x state format x bf16/fp16 weights, with a tensor of one absmax per
// tensor, with 4-row chunks beside a tensor rounded to nearest, beside flash and 8-bit tensors with an
// int8 correction in the same launches; then shards named alike in N GPU optimizers (ranks) against
// the whole tensor on the CPU. LAMB and LARS run without their trust ratio here: its norms are summed
// in another order on each back end, and stochastic rounding turns a rounding-level difference of a
// result into an occasional other choice.
static void sr_parity_case(bnb8_optim kind, bnb8_config cfg, bnb8_dtype pdt, const char *what, const char *per_tensor = NULL,
                           int64_t t0_blocks = 0, const bnb8_config *t1 = NULL) {
    std::vector<int64_t> sizes = {1, 255, 257, 4097, largest()};
    int equal = 0;
    double worst = optimizer_parity(kind, cfg, pdt, BNB8_BF16, sizes, steps(100), &equal, "t3", per_tensor, 1, 0.1f, t0_blocks,
                                    0.0f, 0.01f, t1);
    printf("    %-9s p %-4s %-34s: %s\n", optimizer_names[kind], dtype_name(pdt), what, worst == 0.0 && equal ? "bit-identical" : "DIFFERENT");
    EXPECT(worst == 0.0 && equal, "%s p %s %s: params differ by %g rel, states or exports %s", optimizer_names[kind],
           dtype_name(pdt), what, worst, equal ? "equal" : "differ");
}

static bnb8_config sr_config(bnb8_optim kind, bnb8_state_format format) {
    bnb8_config cfg = bnb8_config_default(kind);
    cfg.format = format;
    cfg.min_8bit_size = 0;
    cfg.weight_decay = 0.01f;
    cfg.max_unorm = 0.0f;
    cfg.sum_squares = 1;
    cfg.correction_bytes = BNB8_CORRECTION_STOCHASTIC;
    cfg.seed = test_u64(&rng);
    return cfg;
}

static void test_stochastic_parity(void) {
    for (bnb8_dtype pdt : {BNB8_BF16, BNB8_F16}) {
        for (int kind = 0; kind < BNB8_NUM_OPTIMIZERS; kind++) {
            sr_parity_case((bnb8_optim)kind, sr_config((bnb8_optim)kind, BNB8_STATE_32BIT), pdt, "32-bit");
            sr_parity_case((bnb8_optim)kind, sr_config((bnb8_optim)kind, BNB8_STATE_8BIT), pdt, "8-bit");
            if (kind == BNB8_ADAMW || kind == BNB8_ADAM || kind == BNB8_SGD || kind == BNB8_LION)
                sr_parity_case((bnb8_optim)kind, sr_config((bnb8_optim)kind, BNB8_STATE_FLASH), pdt, "flash");
        }
        sr_parity_case(BNB8_ADAMW, sr_config(BNB8_ADAMW, BNB8_STATE_8BIT), pdt, "8-bit, t2 one absmax", "t2");
        sr_parity_case(BNB8_ADAMW, sr_config(BNB8_ADAMW, BNB8_STATE_8BIT), pdt, "8-bit, t0 nearest in blocks of 4096", NULL, 4096);
        bnb8_config flash_int8 = sr_config(BNB8_ADAMW, BNB8_STATE_FLASH), sr8 = sr_config(BNB8_ADAMW, BNB8_STATE_8BIT);
        flash_int8.correction_bytes = 1;
        sr8.seed = flash_int8.seed;
        sr_parity_case(BNB8_ADAMW, flash_int8, pdt, "flash int8, t1 8-bit stochastic", NULL, 0, &sr8);
        bnb8_config int8 = sr8;
        int8.correction_bytes = 1;
        sr_parity_case(BNB8_ADAMW, sr8, pdt, "8-bit stochastic, t1 8-bit int8", NULL, 0, &int8);
    }
    // Shards of one tensor "w" in N GPU optimizers (the trainer's ranks), against the whole on the CPU.
    for (int N : {2, 4}) {
        for (bnb8_state_format fmt : {BNB8_STATE_32BIT, BNB8_STATE_8BIT, BNB8_STATE_FLASH}) {
            bnb8_config cfg = sr_config(BNB8_ADAMW, fmt);
            const int64_t unit = 4096, total = unit * 4 * N + 77;
            const size_t bytes = 2 * (size_t)total;
            std::vector<uint8_t> pw(bytes), g(bytes), back(bytes);
            fill_random(pw.data(), BNB8_BF16, total, 0.1f);
            uint8_t *pd = device_copy(pw.data(), bytes), *gd = NULL;
            CUDA_CHECK(cudaMalloc(&gd, bytes));
            bnb8_optimizer *whole = NULL;
            std::vector<bnb8_optimizer *> rank(N, (bnb8_optimizer *)NULL);
            int ok = bnb8_optimizer_create(&whole, BNB8_ADAMW, &cfg) == 0 &&
                     bnb8_optimizer_add(whole, "w", pw.data(), BNB8_BF16, g.data(), BNB8_BF16, total, NULL) == 0;
            for (int k = 0; ok && k < N; k++) {
                bnb8_config o = cfg;
                o.shard_offset = unit * 4 * k;
                o.shard_total = total;
                int64_t n = k + 1 < N ? unit * 4 : total - o.shard_offset;
                ok = bnb8_optimizer_create(&rank[k], BNB8_ADAMW, &o) == 0 &&
                     bnb8_optimizer_add(rank[k], "w", pd + 2 * o.shard_offset, BNB8_BF16, gd + 2 * o.shard_offset, BNB8_BF16, n, NULL) == 0;
            }
            EXPECT(ok, "shards: %s", bnb8_last_error());
            for (int step = 1; ok && step <= 20; step++) {
                fill_random(g.data(), BNB8_BF16, total, 0.01f);
                if (step % 7 == 3) bnb8_store(g.data(), BNB8_BF16, (step * 4099) % total, NAN);
                CUDA_CHECK(cudaMemcpy(gd, g.data(), bytes, cudaMemcpyHostToDevice));
                ok = bnb8_optimizer_step(whole, cfg.lr, 1.0f, NULL) == 0;
                for (int k = 0; k < N; k++) ok = ok && bnb8_optimizer_step(rank[k], cfg.lr, 1.0f, NULL) == 0;
                EXPECT(ok, "shards: step %d: %s", step, bnb8_last_error());
            }
            CUDA_CHECK(cudaMemcpy(back.data(), pd, bytes, cudaMemcpyDeviceToHost));
            int64_t nw = test_take_nonfinite(whole), ng = 0;
            for (int k = 0; k < N; k++) ng += test_take_nonfinite(rank[k]);
            EXPECT(nw == ng && nw > 0, "%d shards format %d: non-finite counts whole %lld, shards %lld", N, (int)fmt, (long long)nw, (long long)ng);
            bool same = memcmp(pw.data(), back.data(), bytes) == 0;
            printf("    AdamW     p bf16 %d GPU shards, format %d vs the CPU's whole tensor: %s\n", N, (int)fmt, same ? "bit-identical" : "DIFFERENT");
            EXPECT(same, "%d shards format %d: the GPU shards' weights differ from the CPU's whole tensor", N, (int)fmt);
            bnb8_optimizer_free(whole);
            for (int k = 0; k < N; k++) bnb8_optimizer_free(rank[k]);
            cudaFree(pd);
            cudaFree(gd);
        }
    }
}

// 4-bit states (DESIGN.md §5.7): block-wise 4-bit and flash4 for AdamW, Adam, SGD (momentum, nesterov)
// and Lion on f32 weights and on bf16 / f16 weights with int8, int16 and fp32 masters, and with no
// master, rounded stochastically (FLASH mode 5, DESIGN.md §6.6), sizes 1 and odd ones (the pad
// nibble); blocks of 64 and of 4096 (4-row chunks); v's map with zero (cfg.map linear); "t3" 32-bit
// beside them; a 4-bit tensor rounded stochastically beside int8-corrected ones (two launches, modes 3
// and 5). Then rank-1 normalization (AdamW, Adam): every tensor a matrix (1 x 1, 15 x 17, 257 x 1, 17
// x 241, 1000 x 1001), with t1 8-bit with one absmax per tensor and t2 block-wise 4-bit in the same
// launches: the two passes of both kinds and the single launch at once; f32 weights, bf16 + int8, bf16
// rounded stochastically, and v's map with zero. 100 steps: GPU equals CPU bit for bit.
static const int64_t four_rows[5] = {1, 15, 257, 17, 1000}, four_cols[5] = {1, 17, 1, 241, 1001};
static void four_rank1_overrides(bnb8_optimizer *opt, const bnb8_config &cfg) {
    for (int i = 0; i < 5; i++) {
        char name[8];
        snprintf(name, sizeof name, "t%d", i);
        bnb8_config o = cfg;
        o.row_size = four_cols[i];
        if (i == 1) { o.format = BNB8_STATE_8BIT; o.blocksize = 0; o.row_size = 0; }
        if (i == 2) o.row_size = 0;
        EXPECT(bnb8_optimizer_override(opt, name, &o) == 0, "override %s: %s", name, bnb8_last_error());
    }
}
static void test_four_parity(void) {
    std::vector<int64_t> sizes = {1, 255, 257, 4097, largest()};
    const int SR = BNB8_CORRECTION_STOCHASTIC;
    typedef struct {
        bnb8_optim kind; int nesterov; bnb8_state_format format; bnb8_dtype pdtype, gdtype; int correction; int64_t blocksize;
        bnb8_map map; int t1_int8;   // t1_int8: "t1" keeps an int8 correction beside tensors rounded stochastically
    } four_case;
    std::vector<four_case> cases;
    const bnb8_optim kinds[5] = {BNB8_ADAMW, BNB8_ADAM, BNB8_SGD, BNB8_SGD, BNB8_LION};
    for (bnb8_state_format f : {BNB8_STATE_4BIT, BNB8_STATE_FLASH4})
        for (int k = 0; k < 5; k++) {
            cases.push_back({kinds[k], k == 3, f, BNB8_F32, BNB8_F32, 0, 128, BNB8_MAP_DYNAMIC, 0});
            cases.push_back({kinds[k], k == 3, f, BNB8_BF16, BNB8_BF16, 1, 128, BNB8_MAP_DYNAMIC, 0});
            cases.push_back({kinds[k], k == 3, f, BNB8_BF16, BNB8_BF16, SR, 128, BNB8_MAP_DYNAMIC, 0});
        }
    for (int cb : {0, 2, 4, SR}) cases.push_back({BNB8_ADAMW, 0, BNB8_STATE_4BIT, BNB8_F16, BNB8_BF16, cb, 128, BNB8_MAP_DYNAMIC, 0});
    for (int cb : {0, 4, SR}) cases.push_back({BNB8_ADAMW, 0, BNB8_STATE_FLASH4, BNB8_BF16, BNB8_F32, cb, 128, BNB8_MAP_DYNAMIC, 0});
    for (int64_t b : {64, 4096})
        for (int cb : {1, SR}) cases.push_back({BNB8_ADAMW, 0, BNB8_STATE_4BIT, BNB8_BF16, BNB8_BF16, cb, b, BNB8_MAP_DYNAMIC, 0});
    for (bnb8_optim kind : {BNB8_ADAMW, BNB8_ADAM}) {   // v's map with zero
        cases.push_back({kind, 0, BNB8_STATE_4BIT, BNB8_F32, BNB8_F32, 0, 128, BNB8_MAP_LINEAR, 0});
        cases.push_back({kind, 0, BNB8_STATE_4BIT, BNB8_BF16, BNB8_BF16, 1, 128, BNB8_MAP_LINEAR, 0});
        cases.push_back({kind, 0, BNB8_STATE_4BIT, BNB8_BF16, BNB8_BF16, SR, 128, BNB8_MAP_LINEAR, 0});
    }
    for (bnb8_state_format f : {BNB8_STATE_4BIT, BNB8_STATE_FLASH4})   // a launch of each rounding
        cases.push_back({BNB8_ADAMW, 0, f, BNB8_BF16, BNB8_BF16, SR, 128, BNB8_MAP_DYNAMIC, 1});
    for (const four_case &c : cases) {
        bnb8_config cfg = bnb8_config_default(c.kind);
        cfg.format = c.format;
        cfg.blocksize = c.blocksize;
        cfg.min_8bit_size = 0;
        cfg.weight_decay = 0.01f;
        cfg.nesterov = c.nesterov;
        cfg.correction_bytes = c.correction;
        cfg.map = c.map;
        cfg.seed = test_u64(&rng);
        cfg.sum_squares = 1;
        bnb8_config int8 = cfg;
        int8.correction_bytes = 1;
        int equal = 0;
        double worst = optimizer_parity(c.kind, cfg, c.pdtype, c.gdtype, sizes, steps(100), &equal, "t3", NULL, 1, 0.1f, 0, 0.0f,
                                        0.01f, c.t1_int8 ? &int8 : NULL);
        const char *name = flash_kind_name(c.kind, c.nesterov), *fmt = c.format == BNB8_STATE_4BIT ? "4-bit" : "flash4";
        const char *corr = c.pdtype == BNB8_F32 ? "-" : c.correction == SR ? (c.t1_int8 ? "sr, t1 int8" : "sr")
                         : c.correction == 0 ? "none" : c.correction == 1 ? "int8" : c.correction == 2 ? "int16" : "fp32";
        const char *map = c.map == BNB8_MAP_LINEAR ? ", v's map with zero" : "";
        printf("    %-12s %-6s block %-4lld p %-4s g %-4s master %-11s%s: %s\n", name, fmt, (long long)c.blocksize,
               dtype_name(c.pdtype), dtype_name(c.gdtype), corr, map, worst == 0.0 && equal ? "bit-identical" : "DIFFERENT");
        EXPECT(worst == 0.0 && equal, "%s %s block %lld p %s g %s master %s%s: params differ by %g rel, states or exports %s", name,
               fmt, (long long)c.blocksize, dtype_name(c.pdtype), dtype_name(c.gdtype), corr, map, worst, equal ? "equal" : "differ");
    }
    std::vector<int64_t> matrices;
    for (int i = 0; i < 5; i++) matrices.push_back(four_rows[i] * four_cols[i]);
    // d: f32 weights, bf16 + int8, bf16 rounded stochastically (the passes in mode 5); and each with
    // v's map with zero (the 8-bit t1 then on the linear 8-bit map: the optimizer's, as the GPU needs)
    const char *weights[3] = {"f32", "bf16 + int8", "bf16 sr"};
    for (bnb8_optim kind : {BNB8_ADAMW, BNB8_ADAM})
        for (int d = 0; d < 3; d++)
            for (int map = 0; map < BNB8_NUM_MAPS; map++) {
                if (map && kind == BNB8_ADAM && d != 2) continue;   // Adam with the map with zero: once
                bnb8_config cfg = bnb8_config_default(kind);
                cfg.format = BNB8_STATE_4BIT;
                cfg.blocksize = 128;
                cfg.min_8bit_size = 0;
                cfg.weight_decay = 0.01f;
                cfg.correction_bytes = d == 2 ? SR : d;
                cfg.map = (bnb8_map)map;
                cfg.seed = test_u64(&rng);
                cfg.sum_squares = 1;
                int equal = 0;
                double worst = optimizer_parity(kind, cfg, d ? BNB8_BF16 : BNB8_F32, d ? BNB8_BF16 : BNB8_F32, matrices, steps(100),
                                                &equal, NULL, NULL, 1, 0.1f, 0, 0.0f, 0.01f, NULL, four_rank1_overrides);
                printf("    %-12s 4-bit rank-1, 8-bit one absmax and 4-bit blocks beside, p %s%s: %s\n", optimizer_names[kind],
                       weights[d], map ? ", v's map with zero" : "", worst == 0.0 && equal ? "bit-identical" : "DIFFERENT");
                EXPECT(worst == 0.0 && equal, "%s rank-1 p %s%s: params differ by %g rel, states or exports %s",
                       optimizer_names[kind], weights[d], map ? ", v's map with zero" : "", worst, equal ? "equal" : "differ");
            }
}

static void test_shard_parity(void) {
    struct { bnb8_optim kind; int format; int64_t blocksize; bnb8_dtype pdt; int correction; } cases[] = {
        {BNB8_ADAMW, BNB8_STATE_FLASH, 256, BNB8_BF16, 1},    // the fast path
        {BNB8_ADAMW, BNB8_STATE_FLASH, 256, BNB8_BF16, 2},
        {BNB8_LION, BNB8_STATE_FLASH, 256, BNB8_BF16, 4},
        {BNB8_SGD, BNB8_STATE_FLASH, 256, BNB8_F16, 1},
        {BNB8_ADAMW, BNB8_STATE_8BIT, 256, BNB8_BF16, 1},
        {BNB8_ADAM, BNB8_STATE_8BIT, 2048, BNB8_F32, 0},
        {BNB8_ADEMAMIX, BNB8_STATE_8BIT, 256, BNB8_F32, 0},
        {BNB8_ADAMW, BNB8_STATE_32BIT, 256, BNB8_BF16, 4},
        {BNB8_RMSPROP, BNB8_STATE_32BIT, 256, BNB8_F32, 0},
    };
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++)
        for (int N = 1; N <= 8; N *= 2) {
            bnb8_config cfg = bnb8_config_default(cases[c].kind);
            cfg.format = (bnb8_state_format)cases[c].format;
            cfg.blocksize = cases[c].blocksize;
            cfg.correction_bytes = cases[c].correction;
            cfg.sum_squares = 1;
            int64_t unit = cfg.format == BNB8_STATE_8BIT ? cfg.blocksize : cfg.format == BNB8_STATE_FLASH ? 32 : 1;
            if (c % 2) unit = 4096;   // the trainer's boundaries
            char label[128];
            snprintf(label, sizeof label, "%s format %d block %lld weights %s correction %d, N %d, cuts at %lld",
                     optimizer_names[cases[c].kind], cases[c].format, (long long)cases[c].blocksize, dtype_name(cases[c].pdt),
                     cases[c].correction, N, (long long)unit);
            shard_gpu_case(cases[c].kind, cfg, cases[c].pdt, N, unit, label);
        }
}

int main(void) {
    int devices = 0;
    if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
        printf("bnb8 GPU tests: no CUDA GPU found (cudaGetDeviceCount: %d); nothing was tested\n", devices);
        return 2;
    }
    cudaDeviceProp prop;
    CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
    quick = getenv("BNB8_TEST_QUICK") != NULL;
    printf("bnb8 GPU tests on %s, TEST_SEED=%llu\n", prop.name, (unsigned long long)test_seed());
    rng = test_rng_new();
    test_run("quantize/dequantize: GPU equals CPU for every map, dtype, block size and size", test_quantize_parity);
    test_run("quantize: a tensor above 2^31 elements equals the CPU's", test_quantize_above_2g);
    test_run("quantize: bad arguments and host pointers are refused", test_bad_arguments);
    test_run("optimizers: 100 steps, GPU equals CPU for every optimizer x format x dtype", test_optimizer_parity);
    test_run("flash: the fast path's approximate reciprocal is within its bound", test_fast_approximations);
    test_run("flash: 100 steps, GPU equals CPU for every flash optimizer x weight dtype x correction x scale dtype", test_flash_parity);
    test_run("master weights: 100 steps, GPU equals CPU for 8-bit and flash states x int8, int16, fp32 masters", test_master_parity);
    test_run("master weights: an fp32 master starts at its bf16/fp16 GPU weights; a zero-gradient step keeps them", test_master_starts_at_weights);
    test_run("master weights: import and export of fp32 values in device memory equal the host's", test_masters_in_device_memory);
    test_run("optimizers: block sizes, percentile clipping, 148 GPT-2 tensors in one launch, the linear map", test_optimizer_options);
    test_run("one absmax per tensor: 100 steps, GPU equals CPU for every optimizer, alone and among blocked tensors", test_per_tensor_parity);
    test_run("gnorm_scale_at: a device factor written before each step, GPU equals CPU at the products", test_gnorm_scale_at);
    test_run("shards: N = 1, 2, 4, 8 shards in one GPU launch equal the CPU's shards and whole tensor", test_shard_parity);
    test_run("stochastic rounding: 100 steps, GPU equals CPU for every optimizer x format x bf16/fp16, mixed launches, shards",
             test_stochastic_parity);
    test_run("4-bit states: 100 steps, GPU equals CPU for 4-bit, flash4 and rank-1 states x weights x masters", test_four_parity);
    return test_summary();
}
