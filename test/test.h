/*
test.h — the one harness of every test program, C and CUDA (test/test_harness.c, built into
build/test_harness.o): a check that records failures, a runner that counts tests and prints the
closing line "N passed, M failed", and a seeded random generator (fresh seed each run, printed;
TEST_SEED=n repeats a run). TEST_ONLY=text runs only the tests whose name holds text.

A test program, C or CUDA (nvcc compiles this header as C++), links build/test_harness.o and
defines main:
    int main(void) {
        printf("my tests, TEST_SEED=%llu\n", (unsigned long long)test_seed());   // its own header
        test_run("what the test checks", test_something);                      // EXPECT inside
        return test_summary();                                                 // "N passed, M failed"
    }
The CPU suite's main is test/test_main.c; test/test_gpu.cu and test/test_gpt2_cuda.cu are the CUDA ones.
*/
#ifndef BNB8_TEST_H
#define BNB8_TEST_H

#include "bnb8.h"
#include <stdint.h>
#include <stdio.h>
#include <math.h>
#include <stddef.h>
#include <string.h>
#include <dirent.h>
#include <unistd.h>

#ifdef __cplusplus
extern "C" {
#endif

// Inside a test: record a failure (the first few of each test are printed) if cond is false.
#define EXPECT(cond, ...) do { if (!(cond)) test_failure(__FILE__, __LINE__, __VA_ARGS__); } while (0)
void test_failure(const char *file, int line, const char *fmt, ...);
// Number of failures recorded so far in the running test (to stop early inside big loops).
int64_t test_failures(void);

// Runs one test (unless TEST_ONLY leaves it out) and prints "ok" or "FAIL", its name and its time.
void test_run(const char *name, void (*fn)(void));
// Prints "N passed, M failed" (the program's last line) and returns main's exit status: 1 if a test failed.
int test_summary(void);
// Options of the runner: print "---- name" before each test (for tests that print a lot), and how
// many failures of one test are printed (5 unless set).
void test_announce(int on);
void test_show_failures(int n);

// Path of a test data file (test/data/NAME), for tests run from the repository root.
const char *test_data_path(const char *name);

// The whole file at path (plus a terminating zero, for text) and its size; NULL if unreadable.
uint8_t *test_slurp(const char *path, size_t *size);
// Runs fn(ctx) with this process's stdout in the file at path: fn's result; *text (free it): what
// it printed.
int test_stdout_in(const char *path, int (*fn)(void *ctx), void *ctx, char **text);

// Random numbers: splitmix64 state, uniform in [0, 1), standard normal (Box-Muller, double).
// test_seed: the run's seed, TEST_SEED or else the time, fixed at the first call (print it in the header).
typedef struct { uint64_t s; } test_rng;
uint64_t test_seed(void);
test_rng test_rng_new(void);   // seeded from the run's seed and a counter
uint64_t test_u64(test_rng *r);
double test_uniform(test_rng *r);
double test_randn(test_rng *r);
// splitmix64's finalizer (test_u64 is test_mix64 of its state after a step of 0x9e3779b97f4a7c15):
// a counter-based stream for fills in parallel loops, test_mix64(seed + i * 0x9e3779b97f4a7c15) for
// element i, with seed from test_u64.
static inline uint64_t test_mix64(uint64_t z) {
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

// The CPU suite (test/test_main.c): each test file defines one function that registers its tests:
//   void tests_quant(void) { test_run("maps match the golden files", test_golden_maps); ... }
void tests_quant(void);
void tests_optim(void);
void tests_train(void);
void tests_state(void);
void tests_faults(void);
// test_faults.c runs this program again as the trainer it kills: main hands that child over here.
int test_faults_child(void);
void tests_flash(void);
void tests_guard(void);
void tests_shard(void);
void tests_resume(void);
void tests_export(void);
void tests_threads(void);
void tests_messages(void);
void tests_api(void);
void tests_llmc_adapter(void);
void tests_round(void);
void tests_four(void);

// CRC-32 (IEEE, reflected 0xEDB88320) computed bit by bit: the tests' own, to forge or rewrite state
// files (DESIGN.md §7) whose CRCs must still be right.
static inline uint32_t test_crc32(const uint8_t *p, size_t len) {
    uint32_t c = 0xffffffffu;
    for (size_t i = 0; i < len; i++) {
        c ^= p[i];
        for (int k = 0; k < 8; k++) c = (c >> 1) ^ (0xedb88320u & (0u - (c & 1u)));
    }
    return ~c;
}

// A version-2 optimizer state file rewritten as version 1 (the layout before every tensor's weights
// were in it), for the tests that old files still load; NULL if v2 does not parse.
uint8_t *test_state_file_v1(const uint8_t *v2, size_t size, size_t *out_size);

// DESIGN.md §6.6's stochastic rounding as test_round.c writes it out (its own hash and the two
// neighbours computed in double): the value a step's fp32 result x takes as element e (of the whole
// tensor) of the tensor called name, rounded at step count step (this step included) under seed, in
// bf16 or fp16; inf when it rounds past the largest finite value. For other tests' references.
double test_round_ref(float x, bnb8_dtype dt, uint64_t seed, const char *name, int64_t step, int64_t e);

// The elements an optimizer left unchanged since the last take (bnb8_optimizer_take_nonfinite), or
// -1 when the call failed: every comparison with a count then fails.
static inline int64_t test_take_nonfinite(bnb8_optimizer *opt) {
    int64_t count = -1;
    return bnb8_optimizer_take_nonfinite(opt, &count) == BNB8_OK ? count : -1;
}

// Removes everything below dir, and dir itself when and_dir (the tests' and fuzzers' scratch).
static inline void test_remove_tree(const char *dir, int and_dir) {
    DIR *d = opendir(dir);
    if (!d) return;
    struct dirent *e;
    char path[4096];
    while ((e = readdir(d))) {
        if (strcmp(e->d_name, ".") == 0 || strcmp(e->d_name, "..") == 0) continue;
        if (snprintf(path, sizeof path, "%s/%s", dir, e->d_name) >= (int)sizeof path) continue;
        if (remove(path) != 0) test_remove_tree(path, 1);
    }
    closedir(d);
    if (and_dir) rmdir(dir);
}

#ifdef __cplusplus
}
#endif

#ifdef __CUDACC__
#include <cuda_runtime.h>
#include <stdlib.h>
// A CUDA call that must succeed: otherwise the program prints the call, where, and CUDA's message,
// and exits 1 (the device may be unusable after it).
#define CUDA_CHECK(call) test_cuda_check((call), #call, __FILE__, __LINE__)
static inline void test_cuda_check(cudaError_t e, const char *call, const char *file, int line) {
    if (e == cudaSuccess) return;
    printf("CUDA error %s at %s:%d: %s\n", cudaGetErrorString(e), file, line, call);
    fflush(stdout);
    exit(1);
}
#endif

#endif
