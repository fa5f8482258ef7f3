/*
bench_cpu.c — `make bench-cpu`: CPU throughput of block-wise quantization and of one optimizer step
(32-bit and 8-bit AdamW), with 1 thread and with all threads (OpenMP). Median of 7 timed runs.
*/
#define _POSIX_C_SOURCE 200809L
#include "bnb8.h"
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#ifdef _OPENMP
#include <omp.h>
#endif

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

static int compare_doubles(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

#define TIME_MEDIAN(result, body) do { double t_[7]; body; \
    for (int r_ = 0; r_ < 7; r_++) { double s_ = now(); body; t_[r_] = now() - s_; } \
    qsort(t_, 7, sizeof(double), compare_doubles); result = t_[3]; } while (0)

int main(void) {
    const int64_t n = 1 << 24;                   // 16M elements, 64 MB of fp32: far beyond the caches
    float *x = malloc(n * sizeof(float)), *y = malloc(n * sizeof(float)), *g = malloc(n * sizeof(float));
    float *absmax = malloc(n / 64 * sizeof(float)), code[256];
    uint8_t *q = malloc(n);
    if (!x || !y || !g || !absmax || !q) { printf("out of memory\n"); return 1; }
    uint64_t z = 88172645463325252ull;
    for (int64_t i = 0; i < n; i++) {
        z ^= z << 13; z ^= z >> 7; z ^= z << 17;
        x[i] = ((float)(z >> 40) * 0x1.0p-24f - 0.5f) * 0.2f;
        g[i] = ((float)((z >> 8) & 0xffffff) * 0x1.0p-24f - 0.5f) * 0.02f;
    }
    bnb8_map_dynamic(1, code);
    int max_threads = 1;
#ifdef _OPENMP
    max_threads = omp_get_max_threads();
#endif
    printf("bnb8 CPU bench: %lld elements, threads 1 and %d\n", (long long)n, max_threads);
    printf("| %-40s | %7s | %14s | %12s |\n", "operation", "threads", "M elements/s", "ns/element");
    printf("|------------------------------------------|---------|----------------|--------------|\n");
    for (int threads = 1; threads <= max_threads; threads = threads == max_threads ? threads + 1 : max_threads) {
#ifdef _OPENMP
        omp_set_num_threads(threads);
#endif
        double s;
        TIME_MEDIAN(s, bnb8_quantize_blockwise(x, BNB8_F32, n, code, 4096, q, absmax));
        printf("| %-40s | %7d | %14.1f | %12.2f |\n", "quantize fp32 -> 8-bit, block 4096", threads, n / s / 1e6, s / n * 1e9);
        TIME_MEDIAN(s, bnb8_dequantize_blockwise(q, absmax, n, code, 4096, y, BNB8_F32));
        printf("| %-40s | %7d | %14.1f | %12.2f |\n", "dequantize 8-bit -> fp32, block 4096", threads, n / s / 1e6, s / n * 1e9);
        for (int format = 0; format < 2; format++) {
            bnb8_config cfg = bnb8_config_default(BNB8_ADAMW);
            cfg.format = (bnb8_state_format)format;
            bnb8_optimizer *opt;
            if (bnb8_optimizer_create(&opt, BNB8_ADAMW, &cfg) ||
                bnb8_optimizer_add(opt, "w", x, BNB8_F32, g, BNB8_F32, n, NULL)) {
                printf("error: %s\n", bnb8_last_error());
                return 1;
            }
            TIME_MEDIAN(s, bnb8_optimizer_step(opt, 1e-3f, 1.0f, NULL));
            printf("| %-40s | %7d | %14.1f | %12.2f |\n", format ? "AdamW step, 8-bit states (block 256)" : "AdamW step, 32-bit states",
                   threads, n / s / 1e6, s / n * 1e9);
            bnb8_optimizer_free(opt);
        }
        if (threads == max_threads) break;
    }
    free(x); free(y); free(g); free(absmax); free(q);
    return 0;
}
