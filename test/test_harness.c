// test_harness.c — the runner, checks, random numbers and file helpers of test.h, for every test
// program (the CPU suite, test_gpu, test_gpt2_cuda, ...): built once into build/test_harness.o.
#include "test.h"
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

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
