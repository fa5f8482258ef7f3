/*
test_threads.c — the library called from several threads at once, each on its own optimizer: every
thread steps, saves and loads its own state file, and every file loads back equal. The library
keeps no shared mutable state besides the temporary names' counter (atomic) and the error text
(per thread), so nothing here may differ from doing the same work one thread after another.

This group runs first in the CPU suite: the first save of the process is the one that would meet a
lazily built table, so it must be made by several threads at once. `make test-tsan` runs it under
ThreadSanitizer, which reports a race even where the bytes happen to come out right.
*/
#define _POSIX_C_SOURCE 200809L   // mkdtemp, pthread_barrier_t
#define BNB8_INTERNAL             // bnb8_store
#include "test.h"
#include "bnb8.h"
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

enum { THREADS = 12, TENSORS = 3 };

static const struct { const char *name; int64_t n; bnb8_dtype dtype; bnb8_state_format format; } spec[TENSORS] = {
    {"wte", 6000, BNB8_F32, BNB8_STATE_8BIT}, {"h.0", 4100, BNB8_BF16, BNB8_STATE_FLASH},
    {"ln", 700, BNB8_F16, BNB8_STATE_32BIT}};

typedef struct {
    char path[128];
    uint64_t seed;
    pthread_barrier_t *start;
    char failure[256];   // the first failure of this thread (EXPECT is the main thread's alone)
} job;

// An AdamW optimizer over spec's tensors (their own formats), weights w, gradients g.
static bnb8_optimizer *job_optimizer(void *w[TENSORS], float *g[TENSORS], char *failure) {
    bnb8_optimizer *opt = NULL;
    bnb8_config c = bnb8_config_default(BNB8_ADAMW);
    c.min_8bit_size = 0;
    if (bnb8_optimizer_create(&opt, BNB8_ADAMW, &c)) {
        snprintf(failure, 256, "create: %s", bnb8_last_error());
        return NULL;
    }
    for (int j = 0; j < TENSORS; j++) {
        bnb8_config tc = c;
        tc.format = spec[j].format;
        if (bnb8_optimizer_override(opt, spec[j].name, &tc) ||
            bnb8_optimizer_add(opt, spec[j].name, w[j], spec[j].dtype, g[j], BNB8_F32, spec[j].n, NULL)) {
            snprintf(failure, 256, "add %s: %s", spec[j].name, bnb8_last_error());
            bnb8_optimizer_free(opt);
            return NULL;
        }
    }
    return opt;
}

// Steps an optimizer twice, saves it (all threads at the same moment), loads the file into a second
// optimizer over garbage weights, and saves that one: its weights and its file must equal the first's.
static void *job_run(void *arg) {
    job *J = (job *)arg;
    void *wa[TENSORS], *wb[TENSORS];
    float *g[TENSORS];
    uint64_t s = J->seed;
    for (int j = 0; j < TENSORS; j++) {
        size_t bytes = bnb8_dtype_size(spec[j].dtype) * (size_t)spec[j].n;
        wa[j] = malloc(bytes); wb[j] = malloc(bytes);
        g[j] = (float *)malloc(sizeof(float) * (size_t)spec[j].n);
        for (int64_t i = 0; i < spec[j].n; i++)
            bnb8_store(wa[j], spec[j].dtype, i, (float)((double)(test_mix64(s += 0x9e3779b97f4a7c15ull) >> 11) * 0x1.0p-53 - 0.5));
        for (size_t i = 0; i < bytes; i++) ((uint8_t *)wb[j])[i] = (uint8_t)test_mix64(s += 0x9e3779b97f4a7c15ull);
    }
    bnb8_optimizer *a = job_optimizer(wa, g, J->failure), *b = a ? job_optimizer(wb, g, J->failure) : NULL;
    for (int step = 0; b && step < 2; step++) {
        for (int j = 0; j < TENSORS; j++)
            for (int64_t i = 0; i < spec[j].n; i++)
                g[j][i] = (float)((double)(test_mix64(s += 0x9e3779b97f4a7c15ull) >> 11) * 0x1.0p-60 - 0x1.0p-8);
        if (bnb8_optimizer_step(a, 1e-3f, 1.0f, NULL)) snprintf(J->failure, 256, "step: %s", bnb8_last_error());
    }
    pthread_barrier_wait(J->start);
    if (b && !J->failure[0]) {
        char again[160];
        snprintf(again, sizeof again, "%s.again", J->path);
        size_t sa = 0, sb = 0;
        uint8_t *fa = NULL, *fb = NULL;
        if (bnb8_optimizer_save(a, J->path)) snprintf(J->failure, 256, "save: %s", bnb8_last_error());
        else if (bnb8_optimizer_load(b, J->path)) snprintf(J->failure, 256, "the file just saved does not load: %s", bnb8_last_error());
        else if (bnb8_optimizer_save(b, again)) snprintf(J->failure, 256, "save after the load: %s", bnb8_last_error());
        else if (!(fa = test_slurp(J->path, &sa)) || !(fb = test_slurp(again, &sb)) || sa != sb || memcmp(fa, fb, sa) != 0)
            snprintf(J->failure, 256, "the loaded optimizer saves another file (%zu and %zu bytes)", sa, sb);
        for (int j = 0; j < TENSORS && !J->failure[0]; j++)
            if (memcmp(wa[j], wb[j], bnb8_dtype_size(spec[j].dtype) * (size_t)spec[j].n) != 0)
                snprintf(J->failure, 256, "'%s': the weights after the load differ from the saved ones", spec[j].name);
        free(fa); free(fb);
        remove(J->path); remove(again);
    }
    bnb8_optimizer_free(a); bnb8_optimizer_free(b);
    for (int j = 0; j < TENSORS; j++) { free(wa[j]); free(wb[j]); free(g[j]); }
    return NULL;
}

static void test_threads_save_and_load(void) {
    char dir[] = "/tmp/bnb8_threads_XXXXXX";
    if (!mkdtemp(dir)) { EXPECT(0, "mkdtemp failed"); return; }
    test_rng rng = test_rng_new();
    job jobs[THREADS];
    pthread_t threads[THREADS];
    pthread_barrier_t start;
    pthread_barrier_init(&start, NULL, THREADS);
    for (int t = 0; t < THREADS; t++) {
        memset(&jobs[t], 0, sizeof jobs[t]);
        snprintf(jobs[t].path, sizeof jobs[t].path, "%s/optim_%d.bin", dir, t);
        jobs[t].seed = test_u64(&rng);
        jobs[t].start = &start;
    }
    int started = 0;
    for (int t = 0; t < THREADS; t++) started += pthread_create(&threads[t], NULL, job_run, &jobs[t]) == 0;
    EXPECT(started == THREADS, "only %d of %d threads started", started, THREADS);
    if (started != THREADS) { test_remove_tree(dir, 1); return; }   // the barrier would wait forever
    for (int t = 0; t < THREADS; t++) pthread_join(threads[t], NULL);
    pthread_barrier_destroy(&start);
    for (int t = 0; t < THREADS; t++) EXPECT(!jobs[t].failure[0], "thread %d: %s", t, jobs[t].failure);
    test_remove_tree(dir, 1);
}

void tests_threads(void) {
    test_run("threads: optimizers saved and loaded by 12 threads at once load back equal", test_threads_save_and_load);
}
