/*
test.h — the CPU test suite's few helpers: a check that records failures, a runner that counts
tests, and a seeded random generator (fresh seed each run, printed; TEST_SEED=n repeats a run).
*/
#ifndef BNB8_TEST_H
#define BNB8_TEST_H

#include <stdint.h>
#include <stdio.h>
#include <math.h>
#include <stddef.h>
#include <string.h>
#include <dirent.h>
#include <unistd.h>

// Inside a test: record a failure (the first few of each test are printed) if cond is false.
#define EXPECT(cond, ...) do { if (!(cond)) test_failure(__FILE__, __LINE__, __VA_ARGS__); } while (0)
void test_failure(const char *file, int line, const char *fmt, ...);
// Number of failures recorded so far in the running test (to stop early inside big loops).
int64_t test_failures(void);

// Path of a test data file (test/data/NAME), for tests run from the repository root.
const char *test_data_path(const char *name);

// Random numbers: splitmix64 state, uniform in [0, 1), standard normal (Box-Muller, double).
typedef struct { uint64_t s; } test_rng;
test_rng test_rng_new(void);   // seeded from the run's seed and a counter
uint64_t test_u64(test_rng *r);
double test_uniform(test_rng *r);
double test_randn(test_rng *r);

// Each test file defines one function that registers its tests:
//   void tests_quant(void) { test_run("maps match the golden files", test_golden_maps); ... }
void test_run(const char *name, void (*fn)(void));
void tests_quant(void);
void tests_optim(void);
void tests_train(void);
void tests_state(void);
void tests_faults(void);
// test_faults.c runs this program again as the trainer it kills: main hands that child over here.
int test_faults_child(void);
void tests_flash(void);


// The whole file at path (plus a terminating zero, for text) and its size; NULL if unreadable.
uint8_t *test_slurp(const char *path, size_t *size);

// CRC-32 (IEEE, reflected 0xEDB88320) computed bit by bit: the tests' own, to forge or rewrite state
// files (SPEC §7) whose CRCs must still be right.
static inline uint32_t test_crc32(const uint8_t *p, size_t len) {
    uint32_t c = 0xffffffffu;
    for (size_t i = 0; i < len; i++) {
        c ^= p[i];
        for (int k = 0; k < 8; k++) c = (c >> 1) ^ (0xedb88320u & (0u - (c & 1u)));
    }
    return ~c;
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

#endif
