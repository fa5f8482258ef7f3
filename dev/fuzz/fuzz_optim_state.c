/*
fuzz_optim_state.c — libFuzzer harness for the optimizer state file loader (bnb8_optimizer_load).

Input: one control byte, then the file. The control byte picks the registered tensors (bits 1-2:
one of three optimizers mixing 8-bit states of two block sizes, linear-map 8-bit states with one
absmax per tensor, 32-bit states, a gradient-norm history, bf16/f16 tensors, a tensor with no state
at all) and, with bit 0 set, has the harness write correct CRC-32s into the file's header and
records first, so that the fuzzer also reaches the checks behind the CRCs (names, sizes, formats,
block sizes, step counts, lengths).

A refused file must leave the optimizer as it was (its next save gives the same bytes as before);
an accepted one must save back to a file that loads and saves to the same bytes, and step.
*/
#define BNB8_INTERNAL             // bnb8_store, to fill the seed tensors
#include "../../bnb8.h"
#include "fuzz_util.h"

#define SETUPS 3
typedef struct { const char *name; int64_t n; bnb8_dtype pdt, gdt; int override; } fuzz_tensor;

static uint32_t crc32_of(const uint8_t *p, size_t len) {
    uint32_t crc = 0xffffffffu;
    for (size_t i = 0; i < len; i++) {
        crc ^= p[i];
        for (int k = 0; k < 8; k++) crc = crc & 1 ? 0xedb88320u ^ (crc >> 1) : crc >> 1;
    }
    return ~crc;
}

// Recomputes the header CRC and the CRC of every record that lies whole inside the file.
static void fix_crcs(uint8_t *f, size_t size) {
    if (size < 24) return;
    uint32_t c = crc32_of(f, 20);
    memcpy(f + 20, &c, 4);
    size_t at = 24;
    while (at + 4 <= size) {
        uint32_t name_len;
        memcpy(&name_len, f + at, 4);
        size_t fields = at + 4 + (size_t)name_len;
        if (name_len > size || fields + 40 > size) return;
        uint64_t bytes;
        memcpy(&bytes, f + fields + 32, 8);
        if (bytes > size || fields + 40 + bytes + 4 > size) return;
        size_t end = fields + 40 + (size_t)bytes;
        c = crc32_of(f + at, end - at);
        memcpy(f + end, &c, 4);
        at = end + 4;
    }
}

typedef struct {
    bnb8_optimizer *opt;
    void *mem[4];
} fuzz_setup;

static void setup_free(fuzz_setup *s) {
    bnb8_optimizer_free(s->opt);
    for (int i = 0; i < 4; i++) free(s->mem[i]);
    memset(s, 0, sizeof *s);
}

// The three optimizers. Parameters and gradients are small deterministic values.
static int setup_make(fuzz_setup *s, int which) {
    static const fuzz_tensor t0[] = {{"a", 300, BNB8_F32, BNB8_F32, 0}, {"b", 100, BNB8_F32, BNB8_F32, 0},
                                     {"c.weight", 260, BNB8_BF16, BNB8_F16, 1}};
    static const fuzz_tensor t1[] = {{"w", 10, BNB8_F32, BNB8_F32, 0}, {"h", 700, BNB8_F16, BNB8_BF16, 1}};
    static const fuzz_tensor t2[] = {{"x", 100, BNB8_F32, BNB8_BF16, 0}, {"y", 64, BNB8_F32, BNB8_F32, 1}};
    const fuzz_tensor *ts[SETUPS] = {t0, t1, t2};
    const int counts[SETUPS] = {3, 2, 2};
    const bnb8_optim kinds[SETUPS] = {BNB8_ADAMW, BNB8_SGD, BNB8_ADEMAMIX};
    memset(s, 0, sizeof *s);
    bnb8_config c = bnb8_config_default(kinds[which]), o;
    c.min_8bit_size = 256;
    o = c;
    if (which == 0) { o.blocksize = 64; o.percentile_clipping = 5; }           // 8-bit, block 64, history
    if (which == 1) { c.momentum = 0.0f; o = c; o.percentile_clipping = 50; }  // no states; history only
    if (which == 2) {                              // 8-bit override: linear map, one absmax per tensor
        c.format = BNB8_STATE_32BIT; o = c; o.format = BNB8_STATE_8BIT; o.min_8bit_size = 0;
        o.map = BNB8_MAP_LINEAR; o.blocksize = 0;
    }
    if (bnb8_optimizer_create(&s->opt, kinds[which], &c)) return -1;
    for (int i = 0; i < counts[which]; i++) {
        const fuzz_tensor *t = &ts[which][i];
        size_t es = bnb8_dtype_size(t->pdt), gs = bnb8_dtype_size(t->gdt);
        uint8_t *p = (uint8_t *)malloc(es * (size_t)t->n + gs * (size_t)t->n);
        if (!p) return -1;
        s->mem[i] = p;
        for (int64_t j = 0; j < t->n; j++) {
            bnb8_store(p, t->pdt, j, 0.01f * (float)(j % 13) - 0.05f);
            bnb8_store(p + es * (size_t)t->n, t->gdt, j, 0.001f * (float)(j % 7) - 0.003f);
        }
        if (t->override && bnb8_optimizer_override(s->opt, t->name, &o)) return -1;
        if (bnb8_optimizer_add(s->opt, t->name, p, t->pdt, p + es * (size_t)t->n, t->gdt, t->n, NULL)) return -1;
    }
    return 0;
}

static int same_file(const char *a, const char *b) {
    size_t na, nb;
    uint8_t *da = fuzz_slurp(a, &na), *db = fuzz_slurp(b, &nb);
    int same = da && db && na == nb && memcmp(da, db, na) == 0;
    free(da);
    free(db);
    return same;
}

static void fail(const char *what) {
    fprintf(stderr, "fuzz_optim_state: %s (last error: %s)\n", what, bnb8_last_error());
    abort();
}

// Seeds: each optimizer's file after one and after three steps, with and without the CRC fix.
int LLVMFuzzerInitialize(int *argc, char ***argv) {
    (void)argc; (void)argv;
    const char *dir = getenv("FUZZ_WRITE_SEEDS");
    if (!dir) return 0;
    for (int which = 0; which < SETUPS; which++) {
        fuzz_setup s;
        if (setup_make(&s, which)) fail("setup");
        for (int steps = 1; steps <= 3; steps += 2) {
            for (int k = 0; k < (steps == 1 ? 1 : 2); k++)
                if (bnb8_optimizer_step(s.opt, 1e-3f, 1.0f, NULL)) fail("step");
            const char *path = fuzz_path("seed.bin");
            if (bnb8_optimizer_save(s.opt, path)) fail("save");
            size_t size;
            uint8_t *d = fuzz_slurp(path, &size), *seed = (uint8_t *)malloc(size + 1);
            if (!d || !seed) fail("read");
            memcpy(seed + 1, d, size);
            for (int fix = 0; fix < 2; fix++) {
                char name[64];
                seed[0] = (uint8_t)(which << 1 | fix);
                snprintf(name, sizeof name, "setup%d_steps%d_fix%d", which, steps, fix);
                fuzz_put_seed(dir, name, seed, size + 1);
            }
            free(d);
            free(seed);
            remove(path);
        }
        setup_free(&s);
    }
    exit(0);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    // The three optimizers are made once (their code books are costly to build under coverage
    // instrumentation); each run starts from a baseline state file saved after one step.
    static fuzz_setup setups[SETUPS];
    static char baseline[SETUPS][256];
    if (!setups[0].opt) {
        for (int w = 0; w < SETUPS; w++) {
            char name[32];
            snprintf(name, sizeof name, "optim_baseline%d.bin", w);
            snprintf(baseline[w], sizeof baseline[w], "%s", fuzz_path(name));
            if (setup_make(&setups[w], w) || bnb8_optimizer_step(setups[w].opt, 1e-3f, 1.0f, NULL) ||
                bnb8_optimizer_save(setups[w].opt, baseline[w]))
                fail("setup");
        }
    }
    if (size < 1) return 0;
    int fix = data[0] & 1, which = (data[0] >> 1) % SETUPS;
    uint8_t *file = (uint8_t *)malloc(size);
    if (!file) return 0;
    memcpy(file, data + 1, size - 1);
    if (fix) fix_crcs(file, size - 1);
    const char *path = fuzz_write_file("optim.bin", file, size - 1);
    free(file);
    const char *after = fuzz_path("optim_after.bin"), *again = fuzz_path("optim_again.bin");

    bnb8_optimizer *opt = setups[which].opt;
    int status = bnb8_optimizer_load(opt, path);
    if (status) {
        if (status != BNB8_ERR_FORMAT && status != BNB8_ERR_IO) fail("unexpected status");
        if (!strstr(bnb8_last_error(), path)) fail("the message does not name the file");
        if (bnb8_optimizer_save(opt, after)) fail("save after a refusal");
        if (!same_file(baseline[which], after)) fail("a refused load changed the optimizer");
    } else {
        if (bnb8_optimizer_save(opt, after)) fail("save after a load");
        if (bnb8_optimizer_load(opt, after)) fail("the saved file does not load");
        if (bnb8_optimizer_save(opt, again) || !same_file(after, again)) fail("load + save is not stable");
        if (bnb8_optimizer_step(opt, 1e-3f, 1.0f, NULL)) fail("step after a load");
        int64_t unchanged = 0;
        bnb8_optimizer_take_nonfinite(opt, &unchanged);
        if (bnb8_optimizer_load(opt, baseline[which])) fail("the baseline does not load back");
    }
    remove(after);
    remove(again);
    return 0;
}
