// test_harness.c — the runner, checks, random numbers and file helpers of test.h, for every test
// program (the CPU suite, test_gpu, test_gpt2_cuda, ...): built once into build/test_harness.o.
#define BNB8_INTERNAL             // bnb8_f32_to_narrow, for random bf16 and fp16 arrays
#include "test.h"
#include "bnb8.h"
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <fcntl.h>
#include <unistd.h>

static int64_t tests_passed, tests_failed, failures_in_test;
static int announce, failures_shown = 5;
static uint64_t run_seed, rng_counter;
static int seeded;

void test_failure(const char *file, int line, const char *fmt, ...) {
    if (failures_in_test++ < failures_shown) {
        va_list ap;
        va_start(ap, fmt);
        printf("    FAIL %s:%d: ", file, line);
        vprintf(fmt, ap);
        printf("\n");
        va_end(ap);
    }
}

int64_t test_failures(void) { return failures_in_test; }

void test_announce(int on) { announce = on; }
void test_show_failures(int n) { failures_shown = n; }

void test_run(const char *name, void (*fn)(void)) {
    const char *only = getenv("TEST_ONLY");   // TEST_ONLY=text: only the tests whose name holds it
    if (only && *only && !strstr(name, only)) return;
    if (announce) printf("---- %s\n", name);
    fflush(stdout);
    failures_in_test = 0;
    clock_t start = clock();
    fn();
    double seconds = (double)(clock() - start) / CLOCKS_PER_SEC;
    if (failures_in_test == 0) tests_passed++;
    else tests_failed++;
    printf("%s %-64s %6.2fs cpu%s\n", failures_in_test ? "FAIL" : "ok  ", name, seconds,
           failures_in_test > failures_shown ? " (more failures not shown)" : "");
    fflush(stdout);
}

int test_summary(void) {
    printf("%lld passed, %lld failed\n", (long long)tests_passed, (long long)tests_failed);
    fflush(stdout);
    return tests_failed ? 1 : 0;
}

const char *test_data_path(const char *name) {
    static char path[512];
    snprintf(path, sizeof path, "test/data/%s", name);
    return path;
}

uint8_t *test_slurp(const char *path, size_t *size) {
    *size = 0;
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    fseek(f, 0, SEEK_END);
    long len = ftell(f);
    fseek(f, 0, SEEK_SET);
    uint8_t *data = malloc(len > 0 ? (size_t)len + 1 : 1);
    if (data && len > 0 && fread(data, 1, (size_t)len, f) != (size_t)len) len = 0;
    if (data) data[len > 0 ? len : 0] = 0;
    fclose(f);
    *size = len > 0 ? (size_t)len : 0;
    return data;
}

int test_stdout_in(const char *path, int (*fn)(void *ctx), void *ctx, char **text) {
    fflush(stdout);
    int saved = dup(1), fd = open(path, O_WRONLY | O_CREAT | O_TRUNC, 0644);
    if (saved >= 0 && fd >= 0) dup2(fd, 1);
    if (fd >= 0) close(fd);
    int status = fn(ctx);
    fflush(stdout);
    if (saved >= 0) { dup2(saved, 1); close(saved); }
    size_t n = 0;
    *text = (char *)test_slurp(path, &n);
    if (!*text) *text = (char *)calloc(1, 1);
    return status;
}

uint64_t test_seed(void) {
    if (!seeded) {
        const char *seed = getenv("TEST_SEED");
        run_seed = seed ? strtoull(seed, NULL, 10) : (uint64_t)time(NULL);
        seeded = 1;
    }
    return run_seed;
}

test_rng test_rng_new(void) {
    test_rng r = {test_seed() + 0x632be59bd9b4e019ull * ++rng_counter};
    return r;
}

uint64_t test_u64(test_rng *r) { return test_mix64(r->s += 0x9e3779b97f4a7c15ull); }
double test_uniform(test_rng *r) { return (double)(test_u64(r) >> 11) * 0x1.0p-53; }
double test_randn(test_rng *r) {
    double u1 = test_uniform(r), u2 = test_uniform(r);
    return sqrt(-2.0 * log(1.0 - u1)) * cos(6.283185307179586 * u2);
}

// Version 2 -> version 1 of an optimizer state file (DESIGN.md §7), written from the layouts, not
// from bnb8.c: version 1 held only corrected tensors' weights (bf16/fp16 weights beside an fp32 master
// too, which version 2 rebuilds as RNE(master)) and named the weights' dtype only for them.
uint8_t *test_state_file_v1(const uint8_t *v2, size_t size, size_t *out_size) {
    uint8_t *out = malloc(2 * size + 64);
    uint32_t count, version;
    *out_size = 0;
    if (!out || size < 24 || memcmp(v2, "BNB8OPT", 8) != 0) { free(out); return NULL; }
    memcpy(&version, v2 + 8, 4);
    memcpy(&count, v2 + 16, 4);
    if (version != 2) { free(out); return NULL; }
    memcpy(out, v2, 24);
    version = 1;
    memcpy(out + 8, &version, 4);
    uint32_t crc = test_crc32(out, 20);
    memcpy(out + 20, &crc, 4);
    size_t at = 24, put = 24;
    for (uint32_t i = 0; i < count; i++) {
        uint32_t name_len, format, nstates;
        int64_t n, block;
        uint64_t bytes;
        if (at + 4 > size) { free(out); return NULL; }
        memcpy(&name_len, v2 + at, 4);
        size_t fields = at + 4 + name_len, start = put;
        if (fields + 40 > size) { free(out); return NULL; }
        memcpy(&n, v2 + fields, 8);
        memcpy(&format, v2 + fields + 8, 4);
        memcpy(&nstates, v2 + fields + 12, 4);
        memcpy(&block, v2 + fields + 16, 8);
        memcpy(&bytes, v2 + fields + 32, 8);
        if (fields + 40 + bytes + 4 > size || n < 1) { free(out); return NULL; }
        uint32_t states = format & 0xff, sdt = (format >> 8) & 0xff, corr = (format >> 16) & 0xff, dtype = format >> 24;
        size_t wsize = dtype == BNB8_F32 ? 4 : 2;
        uint64_t kept = corr == 0 ? bytes - wsize * (uint64_t)n : bytes, added = corr == 4 ? wsize * (uint64_t)n : 0;
        memcpy(out + put, v2 + at, fields + 40 - at);
        put += fields + 40 - at;
        if (corr == 0) { uint32_t f1 = format & 0xffffu; memcpy(out + put - 32, &f1, 4); }
        uint64_t b1 = kept + added;
        memcpy(out + put - 8, &b1, 8);
        memcpy(out + put, v2 + fields + 40, kept);
        put += kept;
        if (corr == 4) {   // the master follows the percentile history, whatever the payload's states leave
            uint64_t nb = states == 1 ? (uint64_t)((n + (block ? block : n) - 1) / (block ? block : n)) : (uint64_t)((n + 31) / 32);
            uint64_t per_state = states == 0 ? 4 * (uint64_t)n : (uint64_t)n + nb * (states == 1 || sdt == BNB8_F32 ? 4 : 2);
            uint64_t history = bytes - 4 * (uint64_t)n - nstates * per_state;
            for (int64_t j = 0; j < n; j++) {
                float x;
                memcpy(&x, v2 + fields + 40 + history + 4 * (uint64_t)j, 4);
                uint16_t w = bnb8_f32_to_narrow(x, (bnb8_dtype)dtype);
                memcpy(out + put, &w, 2);
                put += 2;
            }
        }
        crc = test_crc32(out + start, put - start);
        memcpy(out + put, &crc, 4);
        put += 4;
        at = fields + 40 + bytes + 4;
    }
    if (at != size) { free(out); return NULL; }
    *out_size = put;
    return out;
}
