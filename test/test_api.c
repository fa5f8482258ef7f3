/*
test_api.c — bnb8 as another trainer uses it, through the public header alone (no BNB8_INTERNAL):
a small model trained with every recipe the way doc/your_trainer.md shows (weights in the trainer's
own dtype, the lr of its schedule and its hyperparameters passed every step, per-tensor weight
decay set after the add, its own step numbers, its own clip factor, the optimizer state inside its
own checkpoint file), and the calls that guide leans on, each against an independent expectation:
hyperparameters changed after the add, the step count set, gnorm_scale 0 and infinity, the count of
unchanged elements as a status, the state written to and read from a stream, stacked small tensors.
*/
#define _POSIX_C_SOURCE 200809L   // fmemopen
#include "bnb8.h"
#include "test/test.h"
#include <stdlib.h>
#include <string.h>
#include <math.h>

// The model: y = W x + b, W (ROWS x COLS), fitted to targets of a random W* (mean squared error).
enum { ROWS = 64, COLS = 128, BATCH = 16, STEPS = 80 };

typedef struct {
    const char *name;
    bnb8_state_format format;
    bnb8_dtype weights;       // the trainer's weights and gradients: fp32 or bf16
    int correction_bytes;     // bf16 weights: their master
} Recipe;

static const Recipe recipes[] = {
    {"fp32", BNB8_STATE_32BIT, BNB8_F32, 0},
    {"8bit", BNB8_STATE_8BIT, BNB8_F32, 0},
    {"8bit-int8", BNB8_STATE_8BIT, BNB8_BF16, 1},
    {"8bit + fp32 master", BNB8_STATE_8BIT, BNB8_BF16, 4},
    {"flash", BNB8_STATE_FLASH, BNB8_BF16, BNB8_CORRECTION_AUTO},
};
enum { NUM_RECIPES = sizeof recipes / sizeof recipes[0] };

typedef struct {
    const Recipe *r;
    void *w, *b, *gw, *gb;     // in the recipe's dtype
    bnb8_optimizer *opt;
    bnb8_config cfg;           // the configuration it was created with
    float x[BATCH][COLS], y[BATCH][ROWS];
} Model;

static float get(const void *p, bnb8_dtype dtype, int64_t i) {
    return dtype == BNB8_F32 ? ((const float *)p)[i] : bnb8_bf16_to_f32(((const uint16_t *)p)[i]);
}
static void put(void *p, bnb8_dtype dtype, int64_t i, float v) {
    if (dtype == BNB8_F32) ((float *)p)[i] = v;
    else ((uint16_t *)p)[i] = bnb8_f32_to_bf16(v);
}

// Fresh weights (small, from seed) and the model's optimizer, built as a trainer would: the
// recipe's format and master, decay on the matrix only (set after the add), one config.
static int model_open(Model *m, const Recipe *r, uint64_t seed) {
    memset(m, 0, sizeof *m);
    m->r = r;
    size_t es = r->weights == BNB8_F32 ? 4 : 2;
    m->w = calloc(ROWS * COLS, es); m->gw = calloc(ROWS * COLS, es);
    m->b = calloc(ROWS, es); m->gb = calloc(ROWS, es);
    if (!m->w || !m->gw || !m->b || !m->gb) return -1;
    test_rng rng = {seed};
    for (int i = 0; i < ROWS * COLS; i++) put(m->w, r->weights, i, (float)(0.02 * test_randn(&rng)));
    bnb8_config cfg = bnb8_config_default(BNB8_ADAMW);
    cfg.format = r->format;
    cfg.correction_bytes = r->correction_bytes;
    cfg.weight_decay = 0.0f;
    m->cfg = cfg;
    bnb8_status s = bnb8_optimizer_create(&m->opt, BNB8_ADAMW, &cfg);
    if (!s) s = bnb8_optimizer_add(m->opt, "w", m->w, r->weights, m->gw, r->weights, ROWS * COLS, NULL);
    if (!s) s = bnb8_optimizer_add(m->opt, "b", m->b, r->weights, m->gb, r->weights, ROWS, NULL);
    cfg.weight_decay = 0.01f;
    if (!s) s = bnb8_optimizer_override(m->opt, "w", &cfg);   // after the add: decay on the matrix only
    return s ? -1 : 0;
}

static void model_free(Model *m) {
    bnb8_optimizer_free(m->opt);
    free(m->w); free(m->gw); free(m->b); free(m->gb);
    memset(m, 0, sizeof *m);
}

// Batch `step` of the task (the same for every recipe): x random, y = W* x + noise.
static void batch(Model *m, int64_t step) {
    test_rng rng = {0x5eedull * 7919u + (uint64_t)step};
    for (int k = 0; k < BATCH; k++)
        for (int j = 0; j < COLS; j++) m->x[k][j] = (float)test_randn(&rng);
    for (int k = 0; k < BATCH; k++)
        for (int i = 0; i < ROWS; i++) {
            double t = 0.0;
            for (int j = 0; j < COLS; j++) {
                uint64_t h = test_mix64((uint64_t)(i * COLS + j));   // W*: fixed, +-0.1
                t += ((h & 1) ? 0.1 : -0.1) * m->x[k][j];
            }
            m->y[k][i] = (float)(t + 0.01 * test_randn(&rng));
        }
}

// Forward and backward of the batch: the mean squared error; the gradients in the recipe's dtype.
static double forward_backward(Model *m) {
    bnb8_dtype d = m->r->weights;
    static float gw[ROWS * COLS];
    float gb[ROWS] = {0};
    memset(gw, 0, sizeof gw);
    double loss = 0.0;
    for (int k = 0; k < BATCH; k++)
        for (int i = 0; i < ROWS; i++) {
            float p = get(m->b, d, i);
            for (int j = 0; j < COLS; j++) p += get(m->w, d, i * COLS + j) * m->x[k][j];
            float e = p - m->y[k][i];
            loss += (double)e * e;
            float de = 2.0f * e / (BATCH * ROWS);
            gb[i] += de;
            for (int j = 0; j < COLS; j++) gw[i * COLS + j] += de * m->x[k][j];
        }
    for (int i = 0; i < ROWS * COLS; i++) put(m->gw, d, i, gw[i]);
    for (int i = 0; i < ROWS; i++) put(m->gb, d, i, gb[i]);
    return loss / (BATCH * ROWS);
}

// One step as llm.c's loop takes it: the schedule's lr, the hyperparameters passed again, the
// trainer's own step number, its clip factor; a count of unchanged elements stops the run.
static int train_step(Model *m, int64_t step, double *loss) {
    batch(m, step);
    *loss = forward_backward(m);
    float lr = (float)(1e-2 * (0.1 + 0.9 * 0.5 * (1.0 + cos(acos(-1.0) * (double)(step - 1) / STEPS))));
    bnb8_config hyper = m->cfg;
    hyper.beta1 = 0.9f; hyper.beta2 = 0.95f; hyper.eps = 1e-8f; hyper.weight_decay = 0.0f;
    int64_t unchanged = 0;
    bnb8_status s = bnb8_optimizer_override(m->opt, NULL, &hyper);
    hyper.weight_decay = 0.01f;
    if (!s) s = bnb8_optimizer_override(m->opt, "w", &hyper);
    if (!s) s = bnb8_optimizer_set_step_count(m->opt, -1, step - 1);
    if (!s) s = bnb8_optimizer_step(m->opt, lr, 1.0f, NULL);
    if (!s) s = bnb8_optimizer_take_nonfinite(m->opt, &unchanged);
    return s || unchanged ? -1 : 0;
}

// The trainer's checkpoint: a header of its own, the optimizer state inside, a trailer after it.
static int checkpoint_write(const Model *m, const char *path, int64_t step) {
    FILE *f = fopen(path, "wb");
    if (!f) return -1;
    int ok = fwrite("MYCKPT01", 8, 1, f) == 1 && fwrite(&step, 8, 1, f) == 1 &&
             bnb8_optimizer_write(m->opt, f) == BNB8_OK && fwrite("END!", 4, 1, f) == 1;
    return fclose(f) == 0 && ok ? 0 : -1;
}
static int checkpoint_read(Model *m, const char *path, int64_t *step) {
    FILE *f = fopen(path, "rb");
    if (!f) return -1;
    char magic[8], end[4];
    int ok = fread(magic, 8, 1, f) == 1 && memcmp(magic, "MYCKPT01", 8) == 0 && fread(step, 8, 1, f) == 1 &&
             bnb8_optimizer_read(m->opt, f) == BNB8_OK && fread(end, 4, 1, f) == 1 && memcmp(end, "END!", 4) == 0 &&
             fgetc(f) == EOF;
    fclose(f);
    return ok ? 0 : -1;
}

static int same_weights(const Model *a, const Model *b) {
    size_t es = a->r->weights == BNB8_F32 ? 4 : 2;
    return memcmp(a->w, b->w, ROWS * COLS * es) == 0 && memcmp(a->b, b->b, ROWS * es) == 0;
}

// Every recipe trains the task (its loss falls to the noise's level, and the 8-bit recipes end
// within 2% of fp32's, the trainer's bar); stopped halfway into the trainer's own checkpoint
// file and resumed in a fresh optimizer, each ends with the uninterrupted run's weights bit for bit.
static void test_every_recipe_through_the_header(void) {
    char path[64];
    snprintf(path, sizeof path, "/tmp/bnb8_api_%d.ckpt", (int)getpid());
    double final[NUM_RECIPES];
    for (int k = 0; k < NUM_RECIPES; k++) {
        const Recipe *r = &recipes[k];
        Model run, resumed;
        double first = 0.0, loss = 0.0;
        int ok = model_open(&run, r, 42) == 0 && model_open(&resumed, r, 42) == 0;
        EXPECT(ok, "%s: the model's optimizer: %s", r->name, bnb8_last_error());
        for (int64_t s = 1; ok && s <= STEPS; s++) {
            ok = train_step(&run, s, &loss) == 0;
            if (s == 1) first = loss;
        }
        EXPECT(ok, "%s: a step failed: %s", r->name, bnb8_last_error());
        final[k] = loss;
        EXPECT(loss < 0.05 * first, "%s: loss %.5f -> %.5f, not below 5%% of the first", r->name, first, loss);
        int64_t at = 0;
        double unused;
        for (int64_t s = 1; ok && s <= STEPS / 2; s++) ok = train_step(&resumed, s, &unused) == 0;
        ok = ok && checkpoint_write(&resumed, path, STEPS / 2) == 0;
        model_free(&resumed);
        ok = ok && model_open(&resumed, r, 7) == 0 && checkpoint_read(&resumed, path, &at) == 0 && at == STEPS / 2;
        EXPECT(ok, "%s: checkpoint inside the trainer's file: %s", r->name, bnb8_last_error());
        for (int64_t s = at + 1; ok && s <= STEPS; s++) ok = train_step(&resumed, s, &unused) == 0;
        EXPECT(ok && same_weights(&run, &resumed), "%s: the resumed run's weights differ from the uninterrupted run's", r->name);
        model_free(&run);
        model_free(&resumed);
        if (getenv("BNB8_TEST_VERBOSE")) printf("    %-20s loss %.5f -> %.6f\n", r->name, first, final[k]);
    }
    remove(path);
    for (int k = 1; k < NUM_RECIPES; k++)
        EXPECT(fabs(final[k] - final[0]) <= 0.02 * final[0], "%s: final loss %.6f, fp32's %.6f: more than 2%% apart",
               recipes[k].name, final[k], final[0]);
}

// An optimizer of one fp32 tensor of n elements, 32-bit states, weights w0[i] = 0.01 i.
static bnb8_optimizer *one_tensor(const bnb8_config *cfg, float *w, float *g, int64_t n) {
    bnb8_optimizer *opt = NULL;
    for (int64_t i = 0; i < n; i++) w[i] = 0.01f * (float)(i % 97) - 0.4f;
    if (bnb8_optimizer_create(&opt, BNB8_ADAMW, cfg) || bnb8_optimizer_add(opt, "w", w, BNB8_F32, g, BNB8_F32, n, NULL)) {
        bnb8_optimizer_free(opt);
        return NULL;
    }
    return opt;
}

// Hyperparameters set after the add step exactly as those given at creation; a field that lays
// out the states is refused by name; SGD's momentum cannot appear after the add.
static void test_hyperparameters_after_the_add(void) {
    enum { N = 5000 };
    static float wa[N], wb[N], g[N];
    test_rng rng = test_rng_new();
    bnb8_config first = bnb8_config_default(BNB8_ADAMW), later = first;
    first.format = later.format = BNB8_STATE_8BIT;
    later.beta1 = 0.8f; later.beta2 = 0.95f; later.eps = 1e-6f; later.weight_decay = 0.1f;
    bnb8_optimizer *a = one_tensor(&first, wa, g, N), *b = one_tensor(&later, wb, g, N);
    EXPECT(a && b && bnb8_optimizer_override(a, NULL, &later) == BNB8_OK, "override after the add: %s", bnb8_last_error());
    for (int s = 0; a && b && s < 5; s++) {
        for (int i = 0; i < N; i++) g[i] = (float)test_randn(&rng);
        EXPECT(bnb8_optimizer_step(a, 1e-2f, 1.0f, NULL) == BNB8_OK && bnb8_optimizer_step(b, 1e-2f, 1.0f, NULL) == BNB8_OK,
               "steps: %s", bnb8_last_error());
    }
    EXPECT(memcmp(wa, wb, sizeof wa) == 0, "weights after hyperparameters set after the add differ from those set at creation");
    bnb8_config layout = later;
    layout.blocksize = 128;
    EXPECT(a && bnb8_optimizer_override(a, "w", &layout) == BNB8_ERR_ARG && strstr(bnb8_last_error(), "blocksize"),
           "a block size change after the add: '%s'", bnb8_last_error());
    bnb8_optimizer_free(a);
    bnb8_optimizer_free(b);
    bnb8_config sgd = bnb8_config_default(BNB8_SGD);
    sgd.momentum = 0.0f;
    bnb8_optimizer *c = NULL;
    EXPECT(bnb8_optimizer_create(&c, BNB8_SGD, &sgd) == BNB8_OK &&
           bnb8_optimizer_add(c, "w", wa, BNB8_F32, g, BNB8_F32, N, NULL) == BNB8_OK, "SGD: %s", bnb8_last_error());
    sgd.momentum = 0.9f;
    EXPECT(c && bnb8_optimizer_override(c, NULL, &sgd) == BNB8_ERR_ARG && strstr(bnb8_last_error(), "momentum"),
           "SGD given momentum after an add without it: '%s'", bnb8_last_error());
    bnb8_optimizer_free(c);
}

// The step count set: AdamW's next step is that count + 1, checked against the update computed in
// double from its definition (32-bit states, a first step from zero moments at step t).
static void test_step_count_set(void) {
    enum { N = 4096 };
    static float w[N], w0[N], g[N];
    test_rng rng = test_rng_new();
    bnb8_config cfg = bnb8_config_default(BNB8_ADAMW);
    cfg.format = BNB8_STATE_32BIT;
    cfg.weight_decay = 0.0f;
    bnb8_optimizer *opt = one_tensor(&cfg, w, g, N);
    memcpy(w0, w, sizeof w);
    for (int i = 0; i < N; i++) g[i] = (float)test_randn(&rng);
    int64_t t = 1 + (int64_t)(test_u64(&rng) % 50);
    EXPECT(opt && bnb8_optimizer_set_step_count(opt, -1, t - 1) == BNB8_OK && bnb8_optimizer_step(opt, 1e-3f, 1.0f, NULL) == BNB8_OK &&
           bnb8_optimizer_step_count(opt, 0) == t, "set_step_count(%lld) then a step: %s", (long long)(t - 1), bnb8_last_error());
    double worst = 0.0;
    for (int i = 0; i < N; i++) {
        double m = (1.0 - cfg.beta1) * g[i] / (1.0 - pow(cfg.beta1, (double)t));
        double v = (1.0 - cfg.beta2) * (double)g[i] * g[i] / (1.0 - pow(cfg.beta2, (double)t));
        double want = w0[i] - 1e-3 * m / (sqrt(v) + cfg.eps);
        double err = fabs(w[i] - want) / fmax(fabs(want), 1e-3);
        if (err > worst) worst = err;
    }
    EXPECT(worst <= 1e-6, "step %lld after set_step_count: relative error %.3g (SPEC: 1e-6)", (long long)t, worst);
    EXPECT(bnb8_optimizer_set_step_count(opt, 1, 0) == BNB8_ERR_ARG && bnb8_optimizer_set_step_count(opt, 0, -1) == BNB8_ERR_ARG,
           "a missing tensor or a negative count accepted");
    bnb8_optimizer_free(opt);
}

// gnorm_scale 0 steps as a zero gradient does (bit for bit); infinity leaves every element as it was
// and counts it; NaN and negative values are refused; the count needs somewhere to go.
static void test_gnorm_scale_zero_and_infinity(void) {
    enum { N = 5000 };
    static float wa[N], wb[N], ga[N], gb[N], before[N];
    test_rng rng = test_rng_new();
    bnb8_config cfg = bnb8_config_default(BNB8_ADAMW);
    bnb8_optimizer *a = one_tensor(&cfg, wa, ga, N), *b = one_tensor(&cfg, wb, gb, N);
    for (int i = 0; i < N; i++) { ga[i] = (float)test_randn(&rng); gb[i] = 0.0f; }
    EXPECT(a && b && bnb8_optimizer_step(a, 1e-2f, 0.0f, NULL) == BNB8_OK && bnb8_optimizer_step(b, 1e-2f, 1.0f, NULL) == BNB8_OK,
           "gnorm_scale 0: %s", bnb8_last_error());
    EXPECT(memcmp(wa, wb, sizeof wa) == 0, "gnorm_scale 0 does not step as a zero gradient");
    memcpy(before, wa, sizeof wa);
    int64_t count = -1;
    EXPECT(a && bnb8_optimizer_take_nonfinite(a, &count) == BNB8_OK && count == 0, "count after finite steps: %lld", (long long)count);
    EXPECT(a && bnb8_optimizer_step(a, 1e-2f, INFINITY, NULL) == BNB8_OK && bnb8_optimizer_take_nonfinite(a, &count) == BNB8_OK &&
           count == N, "gnorm_scale inf: %lld of %d elements counted (%s)", (long long)count, N, bnb8_last_error());
    EXPECT(memcmp(wa, before, sizeof wa) == 0, "gnorm_scale inf changed weights");
    EXPECT(a && bnb8_optimizer_step(a, 1e-2f, NAN, NULL) == BNB8_ERR_ARG && bnb8_optimizer_step(a, 1e-2f, -1.0f, NULL) == BNB8_ERR_ARG,
           "gnorm_scale NaN or negative accepted");
    EXPECT(bnb8_optimizer_take_nonfinite(a, NULL) == BNB8_ERR_NULL, "take_nonfinite without a count accepted");
    bnb8_optimizer_free(a);
    bnb8_optimizer_free(b);
}

// The state written to a stream is save's file byte for byte; read from memory (fmemopen) it stops at
// its last byte and restores the optimizer; a damaged one is refused and changes nothing.
static void test_state_in_a_stream(void) {
    enum { N = 6000 };
    static float w[N], g[N], w2[N];
    test_rng rng = test_rng_new();
    bnb8_config cfg = bnb8_config_default(BNB8_ADAMW);
    bnb8_optimizer *a = one_tensor(&cfg, w, g, N), *b = one_tensor(&cfg, w2, g, N);
    for (int i = 0; i < N; i++) g[i] = (float)test_randn(&rng);
    EXPECT(a && b && bnb8_optimizer_step(a, 1e-2f, 1.0f, NULL) == BNB8_OK, "step: %s", bnb8_last_error());
    char path[64];
    snprintf(path, sizeof path, "/tmp/bnb8_api_stream_%d.bnb8", (int)getpid());
    size_t file_size = 0;
    uint8_t *file = a && bnb8_optimizer_save(a, path) == BNB8_OK ? test_slurp(path, &file_size) : NULL;
    remove(path);
    char *mem = NULL;
    size_t mem_size = 0;
    FILE *f = open_memstream(&mem, &mem_size);
    EXPECT(f && bnb8_optimizer_write(a, f) == BNB8_OK && fputs("tail", f) >= 0 && fclose(f) == 0, "write: %s", bnb8_last_error());
    EXPECT(file && mem && mem_size == file_size + 4 && memcmp(mem, file, file_size) == 0,
           "the stream's bytes (%zu) are not the saved file's (%zu) and the tail", mem_size, file_size);
    f = mem ? fmemopen(mem, mem_size, "rb") : NULL;
    char tail[5] = {0};
    EXPECT(f && bnb8_optimizer_read(b, f) == BNB8_OK && fread(tail, 1, 4, f) == 4 && strcmp(tail, "tail") == 0,
           "read from memory: '%s' (%s)", tail, bnb8_last_error());
    if (f) fclose(f);
    EXPECT(memcmp(w, w2, sizeof w) == 0, "read did not restore the weights");
    memcpy(w2, w, sizeof w);
    if (mem && mem_size > 100) mem[mem_size - 10] ^= 0x40;   // a byte of the last record
    f = mem ? fmemopen(mem, mem_size, "rb") : NULL;
    float stamp = w2[0] = 123.0f;
    EXPECT(f && bnb8_optimizer_read(b, f) == BNB8_ERR_FORMAT && w2[0] == stamp, "a damaged stream: status or change (%s)", bnb8_last_error());
    if (f) fclose(f);
    free(mem);
    free(file);
    bnb8_optimizer_free(a);
    bnb8_optimizer_free(b);
}

// A tensor stacking L logical tensors (llm.c's layernorms) keeps 32-bit states when each is below
// min_8bit_size, though the whole is above it; left out, the whole gets 8-bit states.
static void test_stacked_tensors_stay_32bit(void) {
    enum { L = 12, C = 768 };   // 9216 elements, 768 each
    static float w[L * C], g[L * C];
    for (int stacked = 0; stacked <= L; stacked += L) {
        bnb8_config cfg = bnb8_config_default(BNB8_ADAMW);
        cfg.stacked = stacked;
        bnb8_optimizer *opt = one_tensor(&cfg, w, g, L * C);
        double want = stacked ? 2.0 * 4.0 * L * C : 2.0 * (L * C + 4.0 * (L * C / 256));
        double got = opt ? bnb8_optimizer_memory(opt, 0).states : -1.0;
        EXPECT(got == want, "stacked %d: %g bytes of states, expected %g", stacked, got, want);
        bnb8_optimizer_free(opt);
    }
}

void tests_api(void) {
    test_run("every recipe trained through bnb8.h alone, resumed from the trainer's own file", test_every_recipe_through_the_header);
    test_run("hyperparameters set after the add step as at creation", test_hyperparameters_after_the_add);
    test_run("the step count set: the next step's bias correction", test_step_count_set);
    test_run("gnorm_scale 0 and infinity", test_gnorm_scale_zero_and_infinity);
    test_run("the state written to and read from a stream", test_state_in_a_stream);
    test_run("stacked small tensors keep 32-bit states", test_stacked_tensors_stay_32bit);
}
