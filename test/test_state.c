/*
test_state.c — the optimizer object around the math (DESIGN.md §5.1, §5.5, §7, §11, §12): state files
(save -> load -> continue is byte-identical to never stopping; every corrupted or mismatched file is
refused with a status and a message naming it, and leaves the optimizer as it was; atomic writes),
the file size and memory accounting of 8-bit states, min_8bit_size, API misuse, and the ablation
options in files (the map, one absmax per tensor; a file from before them still loads).

The state file layout is written here from bnb8.c's description (little-endian):
  header  "BNB8OPT\0", u32 version, u32 kind, u32 tensor count, u32 CRC-32 of those 20 bytes
  record  u32 name length, name, i64 n, u32 format, u32 states, i64 block size, i64 step,
          u64 bytes, the state memory, then the weights (version 2: every tensor's in its dtype,
          except beside an fp32 master; version 1: corrected tensors' only), u32 CRC-32 of the record
The CRC-32 (IEEE, reflected 0xEDB88320) is test.h's, computed bit by bit, to forge files whose
only fault is the one under test. BNB8_TEST_VERBOSE=1 prints the loader's messages and the sizes.
*/
#define _POSIX_C_SOURCE 200809L   // mkdtemp
#define BNB8_INTERNAL             // bnb8_load, bnb8_store and bnb8_fail
#include "test.h"
#include "bnb8.h"
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <signal.h>
#include <dirent.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <sys/resource.h>

static int verbose;
static char dir[64];

static const char *path_in(char *path, size_t size, const char *name) {
    snprintf(path, size, "%s/%s", dir, name);
    return path;
}

static void spit(const char *path, const void *data, size_t size) {
    FILE *f = fopen(path, "wb");
    EXPECT(f && (size == 0 || fwrite(data, 1, size, f) == size), "cannot write %s", path);
    if (f) fclose(f);
}

static int files_equal(const char *a, const char *b) {
    size_t na, nb;
    uint8_t *x = test_slurp(a, &na), *y = test_slurp(b, &nb);
    int same = x && y && na == nb && memcmp(x, y, na) == 0;
    free(x); free(y);
    return same;
}

static int exists(const char *path) { struct stat st; return stat(path, &st) == 0; }

static uint32_t get32(const uint8_t *p) { uint32_t v; memcpy(&v, p, 4); return v; }
static uint64_t get64(const uint8_t *p) { uint64_t v; memcpy(&v, p, 8); return v; }
static void put32(uint8_t *p, uint32_t v) { memcpy(p, &v, 4); }
static void put64(uint8_t *p, uint64_t v) { memcpy(p, &v, 8); }

// Byte offsets of one tensor record.
typedef struct {
    size_t start;                // the name length
    size_t fields;               // n; format at +8, states +12, block size +16, step +24, bytes +32
    size_t data, crc, end;
    uint64_t bytes;
} record;

// Parses the records of a state file; returns how many, -1 if malformed.
static int parse_records(const uint8_t *f, size_t size, record *r, int max) {
    if (size < 24 || memcmp(f, "BNB8OPT", 8) != 0) return -1;
    int count = (int)get32(f + 16);
    size_t at = 24;
    for (int i = 0; i < count; i++) {
        if (i >= max || at + 4 > size) return -1;
        r[i].start = at;
        r[i].fields = at + 4 + get32(f + at);
        if (r[i].fields + 40 > size) return -1;
        r[i].bytes = get64(f + r[i].fields + 32);
        r[i].data = r[i].fields + 40;
        if (r[i].bytes > size || r[i].data + r[i].bytes + 4 > size) return -1;
        r[i].crc = r[i].data + (size_t)r[i].bytes;
        r[i].end = at = r[i].crc + 4;
    }
    return at == size ? count : -1;
}

// The CRCs of a forged file made right again, so that only the forged field is wrong.
static void fix_crcs(uint8_t *f, size_t size) {
    put32(f + 20, test_crc32(f, 20));
    record r[8];
    int count = parse_records(f, size, r, 8);
    for (int i = 0; i < count; i++) put32(f + r[i].crc, test_crc32(f + r[i].start, r[i].crc - r[i].start));
}

// A set of tensors registered with an optimizer: params 0.1 randn, gradients 0.01 randn.
typedef struct { const char *name; int64_t n; bnb8_dtype pdt, gdt; } tensor_spec;
typedef struct {
    bnb8_optimizer *opt;
    int count;
    tensor_spec spec[8];
    void *p[8], *g[8];
} model;

static int model_new(model *m, bnb8_optim kind, const bnb8_config *c, const tensor_spec *spec, int count, test_rng *rng) {
    memset(m, 0, sizeof *m);
    int status = bnb8_optimizer_create(&m->opt, kind, c);
    EXPECT(status == 0, "create: %s", bnb8_last_error());
    if (status) return 0;
    m->count = count;
    for (int j = 0; j < count; j++) {
        m->spec[j] = spec[j];
        m->p[j] = malloc(bnb8_dtype_size(spec[j].pdt) * (size_t)spec[j].n);
        m->g[j] = calloc((size_t)spec[j].n, bnb8_dtype_size(spec[j].gdt));
        for (int64_t i = 0; i < spec[j].n; i++) bnb8_store(m->p[j], spec[j].pdt, i, (float)(0.1 * test_randn(rng)));
        status = bnb8_optimizer_add(m->opt, spec[j].name, m->p[j], spec[j].pdt, m->g[j], spec[j].gdt, spec[j].n, NULL);
        EXPECT(status == 0, "add %s: %s", spec[j].name, bnb8_last_error());
    }
    return status == 0;
}

static void model_grads(model *m, test_rng *rng) {
    for (int j = 0; j < m->count; j++)
        for (int64_t i = 0; i < m->spec[j].n; i++) bnb8_store(m->g[j], m->spec[j].gdt, i, (float)(0.01 * test_randn(rng)));
}

static void model_steps(model *m, int steps, float lr, test_rng *rng) {
    for (int s = 0; s < steps; s++) {
        model_grads(m, rng);
        EXPECT(bnb8_optimizer_step(m->opt, lr * (1.0f - 0.05f * (float)s), 1.0f, NULL) == 0, "step: %s", bnb8_last_error());
    }
}

static int params_equal(const model *a, const model *b) {
    for (int j = 0; j < a->count; j++)
        if (memcmp(a->p[j], b->p[j], bnb8_dtype_size(a->spec[j].pdt) * (size_t)a->spec[j].n) != 0) return 0;
    return 1;
}

static void model_free(model *m) {
    for (int j = 0; j < m->count; j++) { free(m->p[j]); free(m->g[j]); }
    bnb8_optimizer_free(m->opt);
    memset(m, 0, sizeof *m);
}

// The temporaries of path in its folder (names path.tmp.<pid>.<n>: bnb8_write_atomically).
static int temporaries_of(const char *path) {
    char folder[256], prefix[300];
    snprintf(folder, sizeof folder, "%s", path);
    char *slash = strrchr(folder, '/');
    if (!slash) return 0;
    *slash = 0;
    snprintf(prefix, sizeof prefix, "%s.tmp.", slash + 1);
    DIR *d = opendir(folder);
    int n = 0;
    struct dirent *e;
    while (d && (e = readdir(d))) n += strncmp(e->d_name, prefix, strlen(prefix)) == 0;
    if (d) closedir(d);
    return n;
}

// Saves and checks that the atomic write left no temporary file behind.
static int save_checked(bnb8_optimizer *opt, const char *path) {
    int status = bnb8_optimizer_save(opt, path);
    EXPECT(status == 0, "save %s: %s", path, bnb8_last_error());
    EXPECT(temporaries_of(path) == 0, "save left %d temporaries of %s behind", temporaries_of(path), path);
    return status;
}

static const char *kind_names[BNB8_NUM_OPTIMIZERS] = {"AdamW", "Adam", "SGD", "Lion", "RMSprop", "Adagrad",
                                                       "LAMB", "LARS", "AdEMAMix"};

// A failed call must replace this message with its own.
static void arm_error(void) { bnb8_fail(BNB8_ERR_ARG, "sentinel"); }
static int error_replaced(void) {
    const char *e = bnb8_last_error();
    return e && e[0] != 0 && strncmp(e, "sentinel", 8) != 0;
}

// ------------------------------------------------------------------------------------------------
// 1. Save -> load -> continue equals never stopping, byte for byte

// A runs 3 steps, saves, runs 3 more and saves; B starts from garbage weights, loads the file (which
// restores A's weights at the save), runs the same 3 steps (the same gradients, the same lr schedule) and saves. B's parameters
// and final file must equal A's, byte for byte, and B's file right after the load must equal the
// file it loaded. The tensors mix dtypes, and with min_8bit_size 1000 the 8-bit runs hold a 32-bit
// tensor too; percentile clipping puts the gradient norm history into the file. A control C, which
// skips the load, must end elsewhere (else the comparison could not see a load that does nothing).
static void resume_case(bnb8_optim kind, bnb8_config c, const char *label) {
    const tensor_spec spec[3] = {{"wte", 5000, BNB8_F32, BNB8_F32}, {"ln", 300, BNB8_BF16, BNB8_BF16},
                                 {"h.0", 2100, BNB8_F16, BNB8_F32}};
    char mid_a[256], end_a[256], mid_b[256], end_b[256], end_c[256];
    path_in(mid_a, sizeof mid_a, "mid_a.bin"); path_in(end_a, sizeof end_a, "end_a.bin");
    path_in(mid_b, sizeof mid_b, "mid_b.bin"); path_in(end_b, sizeof end_b, "end_b.bin");
    path_in(end_c, sizeof end_c, "end_c.bin");
    c.min_8bit_size = 1000;
    c.percentile_clipping = 50;
    c.weight_decay = 0.05f;
    test_rng rng = test_rng_new();
    model A, B, C;
    if (!model_new(&A, kind, &c, spec, 3, &rng)) return;
    model_steps(&A, 3, c.lr, &rng);
    save_checked(A.opt, mid_a);
    if (!model_new(&B, kind, &c, spec, 3, &rng) || !model_new(&C, kind, &c, spec, 3, &rng)) return;
    for (int j = 0; j < 3; j++) {   // B's weights are garbage: the file holds every tensor's
        size_t bytes = bnb8_dtype_size(spec[j].pdt) * (size_t)spec[j].n;
        for (size_t i = 0; i < bytes; i++) ((uint8_t *)B.p[j])[i] = (uint8_t)test_u64(&rng);
        memcpy(C.p[j], A.p[j], bytes);
    }
    test_rng again = rng, control = rng;   // the same gradients for A's, B's and C's last steps
    model_steps(&A, 3, c.lr, &rng);
    save_checked(A.opt, end_a);
    int status = bnb8_optimizer_load(B.opt, mid_a);
    EXPECT(status == 0, "%s: load: %s", label, bnb8_last_error());
    for (int j = 0; j < 3; j++)
        EXPECT(bnb8_optimizer_step_count(B.opt, j) == 3, "%s: %lld steps after the load, expected 3", label,
               (long long)bnb8_optimizer_step_count(B.opt, j));
    save_checked(B.opt, mid_b);
    EXPECT(files_equal(mid_a, mid_b), "%s: the loaded optimizer saves a different file", label);
    model_steps(&B, 3, c.lr, &again);
    save_checked(B.opt, end_b);
    EXPECT(params_equal(&A, &B), "%s: parameters after resuming differ from the run that never stopped", label);
    EXPECT(files_equal(end_a, end_b), "%s: states after resuming differ from the run that never stopped", label);
    model_steps(&C, 3, c.lr, &control);
    save_checked(C.opt, end_c);
    EXPECT(!files_equal(end_a, end_c) && !params_equal(&A, &C), "%s: the control without a load ended in the "
           "same place: the comparison cannot see a load", label);
    model_free(&A); model_free(&B); model_free(&C);
    remove(mid_a); remove(end_a); remove(mid_b); remove(end_b); remove(end_c);
}

// Every optimizer, 8-bit and 32-bit.
static void test_resume(void) {
    for (int format = 0; format < 2; format++)
        for (int kind = 0; kind < BNB8_NUM_OPTIMIZERS; kind++) {
            bnb8_config c = bnb8_config_default((bnb8_optim)kind);
            c.format = (bnb8_state_format)format;
            char label[64];
            snprintf(label, sizeof label, "%s %s", kind_names[kind], format ? "8-bit" : "32-bit");
            resume_case((bnb8_optim)kind, c, label);
        }
}

// ------------------------------------------------------------------------------------------------
// 2. Corrupted and mismatched files are refused; the optimizer stays as it was

static const char *before_path(void) { static char p[256]; return path_in(p, sizeof p, "before.bin"); }

// Loads path into opt and expects status want (-1: any failure), a message that names the file, and
// the optimizer byte for byte as it was (its saved file equals before_path()).
static void expect_refused(bnb8_optimizer *opt, const char *path, int want, const char *what) {
    char after[256];
    path_in(after, sizeof after, "after.bin");
    arm_error();
    int status = bnb8_optimizer_load(opt, path);
    const char *msg = bnb8_last_error();
    EXPECT(status != 0 && (want < 0 || status == want), "%s: load returned %d, expected %d (%s)", what, status, want, msg);
    EXPECT(error_replaced() && strstr(msg, path) != NULL, "%s: the message '%s' does not name the file", what, msg);
    EXPECT(status == 0 || bnb8_strerror(status)[0] != 0, "%s: no text for status %d", what, status);
    if (verbose) printf("    %-34s %d: %s\n", what, status, msg);
    EXPECT(bnb8_optimizer_save(opt, after) == 0, "%s: save after the failed load: %s", what, bnb8_last_error());
    EXPECT(files_equal(before_path(), after), "%s: the failed load changed the optimizer", what);
    remove(after);
}

// A file of another optimizer: kind, configuration and tensors as given, one step taken.
static void other_file(bnb8_optim kind, const bnb8_config *c, const tensor_spec *spec, int count, const char *path) {
    test_rng rng = test_rng_new();
    model m;
    if (!model_new(&m, kind, c, spec, count, &rng)) return;
    model_steps(&m, 1, c->lr, &rng);
    save_checked(m.opt, path);
    model_free(&m);
}

// One forged copy of the valid file: bytes [0, keep) with an edit, optionally the CRCs made right.
static void forge(const uint8_t *valid, size_t size, size_t keep, size_t at, int width, uint64_t value,
                  int xor_, int fix, const char *path) {
    uint8_t *f = malloc(size + 128);
    memcpy(f, valid, size);
    memset(f + size, 0x5a, 128);
    if (width == 1) f[at] = (uint8_t)(xor_ ? f[at] ^ value : value);
    if (width == 4) put32(f + at, xor_ ? get32(f + at) ^ (uint32_t)value : (uint32_t)value);
    if (width == 8) put64(f + at, xor_ ? get64(f + at) ^ value : value);
    if (fix) fix_crcs(f, keep);
    spit(path, f, keep);
    free(f);
}

static void test_corrupt_files(void) {
    const tensor_spec spec[2] = {{"a", 5000, BNB8_F32, BNB8_F32}, {"b", 300, BNB8_F32, BNB8_F32}};
    bnb8_config c = bnb8_config_default(BNB8_ADAMW);   // 8-bit; "b" is under min_8bit_size: 32-bit
    char valid[256], bad[256];
    path_in(valid, sizeof valid, "valid.bin");
    path_in(bad, sizeof bad, "bad.bin");
    test_rng rng = test_rng_new();
    model m;
    if (!model_new(&m, BNB8_ADAMW, &c, spec, 2, &rng)) return;
    model_steps(&m, 2, c.lr, &rng);
    save_checked(m.opt, valid);
    model_steps(&m, 1, c.lr, &rng);        // the optimizer now differs from the valid file
    save_checked(m.opt, before_path());
    size_t size;
    uint8_t *v = test_slurp(valid, &size);
    record r[2];
    int count = v ? parse_records(v, size, r, 2) : -1;
    EXPECT(count == 2, "the valid file does not parse as the documented layout");
    if (count != 2) { free(v); model_free(&m); return; }
    EXPECT(test_crc32(v, 20) == get32(v + 20) && test_crc32(v + r[0].start, r[0].crc - r[0].start) == get32(v + r[0].crc),
           "the file's CRCs are not CRC-32 (IEEE) of the header and of the record");
    EXPECT(get32(v + r[0].fields + 8) == BNB8_STATE_8BIT && get32(v + r[1].fields + 8) == BNB8_STATE_32BIT,
           "formats in the file: %u %u", get32(v + r[0].fields + 8), get32(v + r[1].fields + 8));
    const int F = BNB8_ERR_FORMAT;

    // The header.
    forge(v, size, size, 0, 1, 0x20, 1, 0, bad); expect_refused(m.opt, bad, F, "bad magic");
    forge(v, size, size, 8, 4, 3, 0, 1, bad); expect_refused(m.opt, bad, F, "version 3 (CRC made right)");
    forge(v, size, size, 8, 4, 1, 0, 1, bad); expect_refused(m.opt, bad, F, "version 1 (CRC made right)");
    forge(v, size, size, 8, 4, 0, 0, 1, bad); expect_refused(m.opt, bad, F, "version 0 (CRC made right)");
    forge(v, size, size, 12, 4, BNB8_ADAM, 0, 1, bad); expect_refused(m.opt, bad, F, "kind Adam (CRC made right)");
    forge(v, size, size, 12, 4, 77, 0, 1, bad); expect_refused(m.opt, bad, F, "kind 77 (CRC made right)");
    forge(v, size, size, 16, 4, 1, 0, 1, bad); expect_refused(m.opt, bad, F, "count 1 (CRC made right)");
    forge(v, size, size, 16, 4, 3, 0, 1, bad); expect_refused(m.opt, bad, F, "count 3 (CRC made right)");
    forge(v, size, size, 16, 4, 0xffffffffu, 0, 1, bad); expect_refused(m.opt, bad, F, "count 2^32-1 (CRC made right)");
    forge(v, size, size, 13, 1, 0x01, 1, 0, bad); expect_refused(m.opt, bad, F, "flipped bit in the header");
    forge(v, size, size, 21, 1, 0x80, 1, 0, bad); expect_refused(m.opt, bad, F, "flipped bit in the header CRC");
    // The records: flipped bytes (CRC), then forged fields with the CRC made right.
    forge(v, size, size, r[0].start + 4, 1, 0x01, 1, 0, bad); expect_refused(m.opt, bad, F, "flipped bit in a name");
    forge(v, size, size, r[0].fields + 24, 1, 0x01, 1, 0, bad); expect_refused(m.opt, bad, F, "flipped bit in a step count");
    forge(v, size, size, r[0].data + r[0].bytes / 2, 1, 0x10, 1, 0, bad); expect_refused(m.opt, bad, F, "flipped bit in 8-bit states");
    forge(v, size, size, r[1].crc - 1, 1, 0x04, 1, 0, bad); expect_refused(m.opt, bad, F, "flipped bit, last state byte");
    forge(v, size, size, r[1].crc, 1, 0x01, 1, 0, bad); expect_refused(m.opt, bad, F, "flipped bit in a record CRC");
    forge(v, size, size, r[0].start + 4, 1, 'z', 0, 1, bad); expect_refused(m.opt, bad, F, "wrong name (CRC made right)");
    forge(v, size, size, r[0].fields, 8, 5001, 0, 1, bad); expect_refused(m.opt, bad, F, "wrong n (CRC made right)");
    forge(v, size, size, r[0].fields + 8, 4, BNB8_STATE_32BIT, 0, 1, bad); expect_refused(m.opt, bad, F, "wrong format (CRC made right)");
    forge(v, size, size, r[0].fields + 12, 4, 3, 0, 1, bad); expect_refused(m.opt, bad, F, "wrong state count (CRC made right)");
    forge(v, size, size, r[0].fields + 16, 8, 128, 0, 1, bad); expect_refused(m.opt, bad, F, "wrong block size (CRC made right)");
    forge(v, size, size, r[0].fields + 24, 8, (uint64_t)-1, 0, 1, bad); expect_refused(m.opt, bad, F, "step -1 (CRC made right)");
    forge(v, size, size, r[0].start, 4, 0xffffffffu, 0, 0, bad); expect_refused(m.opt, bad, F, "name length 2^32-1");
    forge(v, size, size, r[0].start, 4, 2, 0, 0, bad); expect_refused(m.opt, bad, F, "name length 2");
    forge(v, size, size, r[0].fields + 32, 8, 1ull << 60, 0, 0, bad); expect_refused(m.opt, bad, F, "record of 2^60 bytes");
    // Truncated at several offsets, and with bytes after the end.
    const size_t cuts[] = {0, 4, 8, 20, 23, 24, 25, r[0].fields + 3, r[0].data, r[0].data + r[0].bytes / 2,
                           r[0].crc + 2, r[0].end, r[1].start + 2, r[1].data + 5, size - 4, size - 1};
    for (size_t k = 0; k < sizeof cuts / sizeof cuts[0]; k++) {
        char what[64];
        snprintf(what, sizeof what, "truncated to %zu of %zu bytes", cuts[k], size);
        forge(v, size, cuts[k], 0, 0, 0, 0, 0, bad);
        expect_refused(m.opt, bad, F, what);
    }
    forge(v, size, size + 1, 0, 0, 0, 0, 0, bad); expect_refused(m.opt, bad, F, "one byte after the end");
    forge(v, size, size + 100, 0, 0, 0, 0, 0, bad); expect_refused(m.opt, bad, F, "100 bytes after the end");
    // Files of other optimizers: each differs from m in one respect.
    const tensor_spec renamed[2] = {{"a", 5000, BNB8_F32, BNB8_F32}, {"c", 300, BNB8_F32, BNB8_F32}};
    const tensor_spec resized[2] = {{"a", 5001, BNB8_F32, BNB8_F32}, {"b", 300, BNB8_F32, BNB8_F32}};
    const tensor_spec three[3] = {{"a", 5000, BNB8_F32, BNB8_F32}, {"b", 300, BNB8_F32, BNB8_F32}, {"c", 10, BNB8_F32, BNB8_F32}};
    bnb8_config c32 = c, cblock = c, cmin = c, cmom = bnb8_config_default(BNB8_SGD), cnomom = cmom;
    c32.format = BNB8_STATE_32BIT;
    cblock.blocksize = 128;
    cmin.min_8bit_size = 0;                // "b" becomes 8-bit
    cnomom.momentum = 0.0f;                // SGD without momentum has no state at all
    other_file(BNB8_ADAMW, &c, renamed, 2, bad); expect_refused(m.opt, bad, F, "another optimizer: tensor name");
    other_file(BNB8_ADAMW, &c, resized, 2, bad); expect_refused(m.opt, bad, F, "another optimizer: tensor size");
    other_file(BNB8_ADAMW, &c32, spec, 2, bad); expect_refused(m.opt, bad, F, "another optimizer: 32-bit format");
    other_file(BNB8_ADAMW, &cmin, spec, 2, bad); expect_refused(m.opt, bad, F, "another optimizer: min_8bit_size 0");
    other_file(BNB8_ADAMW, &cblock, spec, 2, bad); expect_refused(m.opt, bad, F, "another optimizer: block size 128");
    other_file(BNB8_ADAM, &c, spec, 2, bad); expect_refused(m.opt, bad, F, "another optimizer: kind Adam");
    other_file(BNB8_ADAMW, &c, spec, 1, bad); expect_refused(m.opt, bad, F, "another optimizer: 1 tensor");
    other_file(BNB8_ADAMW, &c, three, 3, bad); expect_refused(m.opt, bad, F, "another optimizer: 3 tensors");
    // SGD: momentum on against a file without it (0 states, empty records).
    model s;
    if (model_new(&s, BNB8_SGD, &cmom, spec, 2, &rng)) {
        model_steps(&s, 1, cmom.lr, &rng);
        save_checked(s.opt, before_path());
        other_file(BNB8_SGD, &cnomom, spec, 2, bad); expect_refused(s.opt, bad, F, "SGD file without momentum");
        model_free(&s);
        save_checked(m.opt, before_path());
    }
    // Not there, or not a file.
    remove(bad);
    path_in(bad, sizeof bad, "missing.bin");
    remove(bad);
    expect_refused(m.opt, bad, BNB8_ERR_IO, "missing file");
    expect_refused(m.opt, dir, -1, "a directory");
    // The valid file still loads (the refusals above were about the faults), and the state it gives
    // saves as the same bytes.
    int status = bnb8_optimizer_load(m.opt, valid);
    EXPECT(status == 0, "the valid file no longer loads: %s", bnb8_last_error());
    save_checked(m.opt, bad);
    EXPECT(files_equal(valid, bad), "load then save does not give the loaded file back");
    EXPECT(bnb8_optimizer_step_count(m.opt, 0) == 2 && bnb8_optimizer_step_count(m.opt, 1) == 2, "step counts after the load: %lld %lld",
           (long long)bnb8_optimizer_step_count(m.opt, 0), (long long)bnb8_optimizer_step_count(m.opt, 1));
    free(v);
    remove(valid); remove(bad); remove(before_path());
    model_free(&m);
}

// The write is atomic: a temporary of its own (path.tmp.<pid>.<n>, created exclusively), then a
// rename. A save whose write fails (a file-size limit, as a full disk) or whose rename fails (a
// directory under the name) fails with a message, leaves no temporary and the previous file under
// the real name intact; a save into a missing folder fails; a successful save replaces the file.
// Another writer's temporaries (a fixed name path.tmp, and one of path.tmp.<pid>.<n> form) are
// never opened: they keep their bytes. Two processes saving the same path 40 times each at once
// both succeed every time and leave a whole file (with a fixed temporary name one truncates or
// renames the other's).
static void test_atomic_save(void) {
    const tensor_spec spec[1] = {{"w", 5000, BNB8_F32, BNB8_F32}};
    bnb8_config c = bnb8_config_default(BNB8_ADAMW);
    char path[256], copy[256], nowhere[300], theirs[2][300], blocked[256], inside[300];
    path_in(path, sizeof path, "atomic.bin");
    path_in(copy, sizeof copy, "atomic_copy.bin");
    path_in(blocked, sizeof blocked, "atomic_blocked.bin");
    snprintf(inside, sizeof inside, "%s/x", blocked);
    snprintf(theirs[0], sizeof theirs[0], "%s.tmp", path);
    snprintf(theirs[1], sizeof theirs[1], "%s.tmp.%ld.0", path, (long)getpid() + 1);
    snprintf(nowhere, sizeof nowhere, "%s/no/such/folder/state.bin", dir);
    test_rng rng = test_rng_new();
    model m;
    if (!model_new(&m, BNB8_ADAMW, &c, spec, 1, &rng)) return;
    model_steps(&m, 1, c.lr, &rng);
    save_checked(m.opt, path);
    size_t size;
    uint8_t *first = test_slurp(path, &size);
    spit(copy, first, size);
    model_steps(&m, 1, c.lr, &rng);
    // a write that fails: RLIMIT_FSIZE below the file's size, SIGXFSZ ignored (EFBIG, as a full disk)
    struct rlimit old, small;
    EXPECT(getrlimit(RLIMIT_FSIZE, &old) == 0, "getrlimit");
    small = old;
    small.rlim_cur = (rlim_t)(size / 2);
    void (*handler)(int) = signal(SIGXFSZ, SIG_IGN);
    EXPECT(setrlimit(RLIMIT_FSIZE, &small) == 0, "setrlimit");
    arm_error();
    int status = bnb8_optimizer_save(m.opt, path);
    setrlimit(RLIMIT_FSIZE, &old);
    signal(SIGXFSZ, handler);
    EXPECT(status == BNB8_ERR_IO && error_replaced() && strstr(bnb8_last_error(), "disk full") &&
           strstr(bnb8_last_error(), ".tmp."), "save past the file-size limit: status %d, '%s'", status, bnb8_last_error());
    EXPECT(files_equal(path, copy) && temporaries_of(path) == 0, "a failed write changed the file or left %d temporaries",
           temporaries_of(path));
    // a rename that fails: a directory (not empty) under the name
    FILE *x = mkdir(blocked, 0700) == 0 ? fopen(inside, "wb") : NULL;
    EXPECT(x && fclose(x) == 0, "cannot make %s", inside);
    arm_error();
    status = bnb8_optimizer_save(m.opt, blocked);
    EXPECT(status == BNB8_ERR_IO && error_replaced() && strstr(bnb8_last_error(), "cannot rename") &&
           temporaries_of(blocked) == 0 && exists(inside), "save onto a directory: status %d, '%s', %d temporaries", status,
           bnb8_last_error(), temporaries_of(blocked));
    remove(inside); rmdir(blocked);
    arm_error();
    status = bnb8_optimizer_save(m.opt, nowhere);
    EXPECT(status == BNB8_ERR_IO && error_replaced() && strstr(bnb8_last_error(), "cannot create"),
           "save into a missing folder: status %d, '%s'", status, bnb8_last_error());
    // another writer's temporaries stay as they are
    for (int k = 0; k < 2; k++) spit(theirs[k], "another writer's", 16);
    EXPECT(bnb8_optimizer_save(m.opt, path) == 0, "save beside another writer's temporaries: %s", bnb8_last_error());
    EXPECT(!files_equal(path, copy), "a second save did not replace the file");
    for (int k = 0; k < 2; k++) {
        size_t n = 0;
        uint8_t *b = test_slurp(theirs[k], &n);
        EXPECT(b && n == 16 && memcmp(b, "another writer's", 16) == 0, "another writer's temporary %s was touched", theirs[k]);
        free(b);
        remove(theirs[k]);
    }
    // two processes saving the same path at once
    save_checked(m.opt, copy);
    pid_t pid[2];
    for (int k = 0; k < 2; k++) {
        fflush(stdout);
        pid[k] = fork();
        if (pid[k] == 0) {
            int bad = 0;
            for (int i = 0; i < 40; i++) bad += bnb8_optimizer_save(m.opt, path) != 0;
            _exit(bad ? 1 : 0);
        }
    }
    for (int k = 0; k < 2; k++) {
        int st = -1;
        EXPECT(pid[k] > 0 && waitpid(pid[k], &st, 0) == pid[k] && WIFEXITED(st) && WEXITSTATUS(st) == 0,
               "writer %d of two at once: a save failed (status %d)", k, st);
    }
    EXPECT(files_equal(path, copy) && temporaries_of(path) == 0, "two writers at once: the file is not whole, or %d "
           "temporaries are left", temporaries_of(path));
    free(first);
    remove(path); remove(copy);
    model_free(&m);
}

// ------------------------------------------------------------------------------------------------
// 3. Memory: file size, bnb8_optimizer_memory, min_8bit_size (DESIGN.md §5.1)

// Bytes of a tensor's states by DESIGN.md §5.1: per state n floats (32-bit) or n codes + an absmax per
// block (8-bit), plus the 100-float norm history when percentile clipping is on.
static double expect_state_bytes(int64_t n, int nstates, int eight_bit, int64_t blocksize) {
    if (!eight_bit) return 4.0 * (double)n * nstates;
    return (double)nstates * ((double)n + 4.0 * (double)((n + blocksize - 1) / blocksize));
}

// An 8-bit AdamW state file of a 2^20-element f32 tensor, block 256: the weights 4 + the states
// 2 + 8/256 = 6.03125 bytes per parameter (32-bit states: 4 + 8 = 12) plus a header of 24 + 4 +
// name + 40 + 4 bytes; bnb8_optimizer_memory gives states /
// params = 2.03125 (8-bit) and 8 (32-bit), and with f32 params and grads 4 + 4 + 2.03125 =
// 10.03125 persistent bytes per parameter (6.03125 under gradient release; bf16: 6.03125).
static void test_memory_and_file_size(void) {
    const int64_t n = 1 << 20;
    char path[256];
    path_in(path, sizeof path, "size.bin");
    for (int format = 0; format < 2; format++)
        for (int bf16 = 0; bf16 < 2; bf16++) {
            bnb8_config c = bnb8_config_default(BNB8_ADAMW);
            c.format = (bnb8_state_format)format;
            bnb8_dtype dt = bf16 ? BNB8_BF16 : BNB8_F32;
            double es = bf16 ? 2.0 : 4.0, per_state = format ? 2.03125 : 8.0;
            bnb8_optimizer *opt = NULL;
            void *p = calloc((size_t)n, (size_t)es), *g = calloc((size_t)n, (size_t)es);
            EXPECT(bnb8_optimizer_create(&opt, BNB8_ADAMW, &c) == 0 && opt &&
                   bnb8_optimizer_add(opt, "w", p, dt, g, dt, n, NULL) == 0, "create/add: %s", bnb8_last_error());
            bnb8_memory mem = bnb8_optimizer_memory(opt, 1), release = bnb8_optimizer_memory(opt, 0);
            EXPECT(mem.params == n && mem.states / (double)n == per_state, "states / params = %.6f, expected %.6f",
                   mem.states / (double)n, per_state);
            double total = (mem.weights + mem.gradients + mem.states) / (double)n;
            EXPECT(total == 2.0 * es + per_state, "persistent bytes / param = %.6f, expected %.6f", total, 2.0 * es + per_state);
            EXPECT(release.gradients == 0.0 && (release.weights + release.states) / (double)n == es + per_state,
                   "with gradient release: %.6f bytes / param", (release.weights + release.states) / (double)n);
            if (!bf16) {
                save_checked(opt, path);
                size_t size;
                uint8_t *f = test_slurp(path, &size);
                double want = 24.0 + 4 + 1 + 40 + 4 + (es + per_state) * n;
                EXPECT((double)size == want, "%s file: %zu bytes, expected %.0f", format ? "8-bit" : "32-bit", size, want);
                double target = format ? 6.03125 : 12.0;
                EXPECT(fabs((double)size / n - target) < 1e-4, "%s file: %.6f bytes per parameter, expected %.5f",
                       format ? "8-bit" : "32-bit", (double)size / n, target);
                if (verbose)
                    printf("    %s AdamW, 2^20 f32 params: file %.6f bytes/param, states %.6f, with f32 params + grads %.6f\n",
                           format ? "8-bit" : "32-bit", (double)size / n, mem.states / n, total);
                free(f);
            }
            bnb8_optimizer_free(opt);
            free(p); free(g);
        }
    remove(path);
}

// Tensors under min_8bit_size keep 32-bit states (DESIGN.md §5.1): the format field of each record and
// bnb8_optimizer_memory against sizes computed here; min_8bit_size 0 makes a 100-element tensor
// 8-bit; an override can raise it for one name; a 32-bit configuration stays 32-bit at any size.
static void test_min_8bit_size(void) {
    const tensor_spec spec[5] = {{"t100", 100, BNB8_F32, BNB8_F32}, {"t4095", 4095, BNB8_F32, BNB8_F32},
                                 {"t4096", 4096, BNB8_F32, BNB8_F32}, {"t10000", 10000, BNB8_F32, BNB8_F32},
                                 {"big", 10000, BNB8_F32, BNB8_F32}};
    char path[256];
    path_in(path, sizeof path, "min8.bin");
    for (int variant = 0; variant < 3; variant++) {   // default 4096, 0, a 32-bit configuration
        bnb8_config c = bnb8_config_default(BNB8_ADAMW), big = c;
        if (variant == 1) c.min_8bit_size = 0;
        if (variant == 2) { c.format = BNB8_STATE_32BIT; c.min_8bit_size = 0; }
        big.min_8bit_size = 1 << 20;
        test_rng rng = test_rng_new();
        model m;   // built by hand: the override must come before the adds
        memset(&m, 0, sizeof m);
        EXPECT(bnb8_optimizer_create(&m.opt, BNB8_ADAMW, &c) == 0 && m.opt, "create: %s", bnb8_last_error());
        if (!m.opt) return;
        EXPECT(bnb8_optimizer_override(m.opt, "big", &big) == 0, "override: %s", bnb8_last_error());
        m.count = 5;
        for (int j = 0; j < 5; j++) {
            m.spec[j] = spec[j];
            m.p[j] = calloc((size_t)spec[j].n, 4);
            m.g[j] = calloc((size_t)spec[j].n, 4);
            EXPECT(bnb8_optimizer_add(m.opt, spec[j].name, m.p[j], BNB8_F32, m.g[j], BNB8_F32, spec[j].n, NULL) == 0, "add");
        }
        model_steps(&m, 1, c.lr, &rng);
        save_checked(m.opt, path);
        size_t size;
        uint8_t *f = test_slurp(path, &size);
        record r[5];
        int count = f ? parse_records(f, size, r, 5) : -1;
        EXPECT(count == 5, "variant %d: the file does not parse", variant);
        double want_states = 0.0;
        for (int j = 0; j < 5 && count == 5; j++) {
            int64_t min8 = j == 4 ? big.min_8bit_size : c.min_8bit_size;
            int eight = c.format == BNB8_STATE_8BIT && spec[j].n >= min8;
            uint32_t format = get32(f + r[j].fields + 8);
            EXPECT(format == (uint32_t)eight, "variant %d: %s (n %lld, min_8bit_size %lld) has format %u, expected %d",
                   variant, spec[j].name, (long long)spec[j].n, (long long)min8, format, eight);
            EXPECT((double)r[j].bytes == expect_state_bytes(spec[j].n, 2, eight, 256) + 4.0 * (double)spec[j].n,
                   "variant %d: %s has %llu state and weight bytes",
                   variant, spec[j].name, (unsigned long long)r[j].bytes);
            want_states += expect_state_bytes(spec[j].n, 2, eight, 256);
        }
        bnb8_memory mem = bnb8_optimizer_memory(m.opt, 1);
        EXPECT(mem.states == want_states, "variant %d: memory says %.0f state bytes, expected %.0f", variant, mem.states, want_states);
        if (verbose) printf("    variant %d: %.0f state bytes for 28291 parameters\n", variant, mem.states);
        free(f);
        model_free(&m);
    }
    remove(path);
}

// ------------------------------------------------------------------------------------------------
// 4. API misuse: a status, a message, no crash, nothing changed (DESIGN.md §11)

#define MISUSE(call, what) do {                                                                        \
        arm_error();                                                                                   \
        int status_ = (call);                                                                          \
        EXPECT(status_ > 0 && status_ < BNB8_NUM_ERRORS, "%s: returned %d", what, status_);           \
        EXPECT(error_replaced(), "%s: no message (last error '%s')", what, bnb8_last_error());       \
        if (verbose) printf("    %-40s %d: %s\n", what, status_, bnb8_last_error());                 \
    } while (0)

static void test_api_misuse(void) {
    bnb8_optimizer *opt = NULL, *o = NULL;
    bnb8_config c = bnb8_config_default(BNB8_ADAMW), bad;
    float p[300] = {0}, g[300] = {0}, q[300] = {0};
    int id = -7;

    MISUSE(bnb8_map_dynamic(1, NULL), "map_dynamic: code NULL");     // refused, not written through
    MISUSE(bnb8_map_linear(0, NULL), "map_linear: code NULL");
    MISUSE(bnb8_optimizer_create(NULL, BNB8_ADAMW, &c), "create: opt NULL");
    MISUSE(bnb8_optimizer_create(&o, (bnb8_optim)-1, &c), "create: kind -1");
    EXPECT(o == NULL, "create failed but gave an optimizer");
    MISUSE(bnb8_optimizer_create(&o, BNB8_NUM_OPTIMIZERS, &c), "create: kind out of range");
    static const int64_t blocksizes[] = {-1, -256, 32, 63, 100, 255, 257, 4095, 4097, 8192};
    for (size_t k = 0; k < sizeof blocksizes / sizeof blocksizes[0]; k++) {
        char what[64];
        snprintf(what, sizeof what, "create: blocksize %lld", (long long)blocksizes[k]);
        bad = c; bad.blocksize = blocksizes[k];
        arm_error();
        int status = bnb8_optimizer_create(&o, BNB8_ADAMW, &bad);
        EXPECT(status == BNB8_ERR_BLOCKSIZE && error_replaced() && o == NULL, "%s: status %d", what, status);
    }
    bad = c; bad.beta1 = 1.5f; MISUSE(bnb8_optimizer_create(&o, BNB8_ADAMW, &bad), "create: beta1 1.5");
    bad = c; bad.beta2 = NAN; MISUSE(bnb8_optimizer_create(&o, BNB8_ADAMW, &bad), "create: beta2 NaN");
    bad = c; bad.lr = INFINITY; MISUSE(bnb8_optimizer_create(&o, BNB8_ADAMW, &bad), "create: lr inf");
    bad = c; bad.eps = -1.0f; MISUSE(bnb8_optimizer_create(&o, BNB8_ADAMW, &bad), "create: eps -1");
    bad = c; bad.percentile_clipping = 0; MISUSE(bnb8_optimizer_create(&o, BNB8_ADAMW, &bad), "create: percentile 0");
    bad = c; bad.percentile_clipping = 101; MISUSE(bnb8_optimizer_create(&o, BNB8_ADAMW, &bad), "create: percentile 101");
    bad = c; bad.format = (bnb8_state_format)5; MISUSE(bnb8_optimizer_create(&o, BNB8_ADAMW, &bad), "create: format 5");
    bad = c; bad.min_8bit_size = -1; MISUSE(bnb8_optimizer_create(&o, BNB8_ADAMW, &bad), "create: min_8bit_size -1");
    bad = c; bad.map = (bnb8_map)-1; MISUSE(bnb8_optimizer_create(&o, BNB8_ADAMW, &bad), "create: map -1");
    bad = c; bad.map = BNB8_NUM_MAPS; MISUSE(bnb8_optimizer_create(&o, BNB8_ADAMW, &bad), "create: map out of range");
    // Flash states have their own codes and groups of 32: a map or a per-tensor absmax is a mistake there.
    bad = c; bad.format = BNB8_STATE_FLASH; bad.map = BNB8_MAP_LINEAR;
    MISUSE(bnb8_optimizer_create(&o, BNB8_ADAMW, &bad), "create: flash with the linear map");
    bad = c; bad.format = BNB8_STATE_FLASH; bad.blocksize = 0;
    MISUSE(bnb8_optimizer_create(&o, BNB8_ADAMW, &bad), "create: flash with blocksize 0");
    EXPECT(o == NULL, "a failed create gave an optimizer");
    // blocksize 0 (one absmax per tensor) and the linear map are valid 8-bit configurations.
    bad = c; bad.blocksize = 0; bad.map = BNB8_MAP_LINEAR;
    EXPECT(bnb8_optimizer_create(&o, BNB8_ADAMW, &bad) == 0 && o, "create: blocksize 0, linear map: %s", bnb8_last_error());
    bnb8_optimizer_free(o);
    o = NULL;

    EXPECT(bnb8_optimizer_create(&opt, BNB8_ADAMW, &c) == 0 && opt, "create: %s", bnb8_last_error());
    if (!opt) return;
    bad = c; bad.blocksize = 96;
    MISUSE(bnb8_optimizer_override(NULL, "x", &c), "override: opt NULL");
    bad = c; bad.format = BNB8_STATE_FLASH;
    MISUSE(bnb8_optimizer_override(opt, NULL, &bad), "override of every tensor: another layout");
    MISUSE(bnb8_optimizer_override(opt, "x", NULL), "override: cfg NULL");
    bad = c; bad.blocksize = 96;
    MISUSE(bnb8_optimizer_override(opt, "x", &bad), "override: blocksize 96");
    bad = c; bad.map = (bnb8_map)7;
    MISUSE(bnb8_optimizer_override(opt, "x", &bad), "override: map 7");
    bad = c; bad.blocksize = -4096;
    MISUSE(bnb8_optimizer_override(opt, "x", &bad), "override: blocksize -4096");

    MISUSE(bnb8_optimizer_add(NULL, "w", p, BNB8_F32, g, BNB8_F32, 300, NULL), "add: opt NULL");
    MISUSE(bnb8_optimizer_add(opt, NULL, p, BNB8_F32, g, BNB8_F32, 300, NULL), "add: name NULL");
    MISUSE(bnb8_optimizer_add(opt, "w", NULL, BNB8_F32, g, BNB8_F32, 300, NULL), "add: param NULL");
    MISUSE(bnb8_optimizer_add(opt, "w", p, BNB8_F32, g, BNB8_F32, 0, NULL), "add: n 0");
    MISUSE(bnb8_optimizer_add(opt, "w", p, BNB8_F32, g, BNB8_F32, -5, NULL), "add: n -5");
    MISUSE(bnb8_optimizer_add(opt, "w", p, (bnb8_dtype)9, g, BNB8_F32, 300, NULL), "add: param dtype 9");
    MISUSE(bnb8_optimizer_add(opt, "w", p, BNB8_F32, g, (bnb8_dtype)-1, 300, NULL), "add: grad dtype -1");
    EXPECT(bnb8_optimizer_count(opt) == 0, "failed adds registered %d tensors", bnb8_optimizer_count(opt));
    EXPECT(bnb8_optimizer_add(opt, "w", p, BNB8_F32, g, BNB8_F32, 300, &id) == 0 && id == 0, "add: %s", bnb8_last_error());
    MISUSE(bnb8_optimizer_add(opt, "w", q, BNB8_F32, g, BNB8_F32, 300, NULL), "add: duplicate name");
    bad = c; bad.blocksize = 512;
    MISUSE(bnb8_optimizer_override(opt, "w", &bad), "override after add: another block size");
    EXPECT(bnb8_optimizer_add(opt, "nograd", q, BNB8_F32, NULL, BNB8_F32, 300, &id) == 0 && id == 1, "add without grad");
    EXPECT(bnb8_optimizer_count(opt) == 2, "%d tensors, expected 2", bnb8_optimizer_count(opt));

    // Steps that must be refused before anything moves: "w" has a gradient, "nograd" not yet.
    for (int i = 0; i < 300; i++) { p[i] = 0.1f * (float)(i % 7) - 0.3f; g[i] = 0.01f * (float)(i % 5) - 0.02f; }
    float p_before[300];
    memcpy(p_before, p, sizeof p);
    const int ids_bad_low[1] = {-1}, ids_bad_high[1] = {2}, ids_nograd[2] = {0, 1}, ids_ok[1] = {0};
    MISUSE(bnb8_optimizer_step(NULL, 1e-3f, 1.0f, NULL), "step: opt NULL");
    MISUSE(bnb8_optimizer_step(opt, 1e-3f, 1.0f, NULL), "step before grads set");
    MISUSE(bnb8_optimizer_step_tensors(opt, ids_nograd, 2, 1e-3f, 1.0f, NULL), "step_tensors: a tensor without grad");
    MISUSE(bnb8_optimizer_step_tensors(opt, ids_bad_low, 1, 1e-3f, 1.0f, NULL), "step_tensors: id -1");
    MISUSE(bnb8_optimizer_step_tensors(opt, ids_bad_high, 1, 1e-3f, 1.0f, NULL), "step_tensors: id 2 of 2");
    MISUSE(bnb8_optimizer_step_tensors(opt, NULL, 1, 1e-3f, 1.0f, NULL), "step_tensors: ids NULL");
    MISUSE(bnb8_optimizer_step_tensors(opt, ids_ok, -1, 1e-3f, 1.0f, NULL), "step_tensors: count -1");
    MISUSE(bnb8_optimizer_step_tensors(NULL, ids_ok, 1, 1e-3f, 1.0f, NULL), "step_tensors: opt NULL");
    MISUSE(bnb8_optimizer_step_tensors(opt, ids_ok, 1, NAN, 1.0f, NULL), "step_tensors: lr NaN");
    MISUSE(bnb8_optimizer_step(opt, 1e-3f, INFINITY, NULL), "step: gnorm_scale inf");
    MISUSE(bnb8_optimizer_set_grad(NULL, 0, g), "set_grad: opt NULL");
    MISUSE(bnb8_optimizer_set_grad(opt, -1, g), "set_grad: id -1");
    MISUSE(bnb8_optimizer_set_grad(opt, 2, g), "set_grad: id 2 of 2");
    EXPECT(memcmp(p, p_before, sizeof p) == 0, "a refused step changed the parameters");
    EXPECT(bnb8_optimizer_step_count(opt, 0) == 0 && bnb8_optimizer_step_count(opt, 1) == 0, "a refused step counted: %lld %lld",
           (long long)bnb8_optimizer_step_count(opt, 0), (long long)bnb8_optimizer_step_count(opt, 1));

    char path[256];
    path_in(path, sizeof path, "misuse.bin");
    MISUSE(bnb8_optimizer_save(NULL, path), "save: opt NULL");
    MISUSE(bnb8_optimizer_save(opt, NULL), "save: path NULL");
    MISUSE(bnb8_optimizer_load(NULL, path), "load: opt NULL");
    MISUSE(bnb8_optimizer_load(opt, NULL), "load: path NULL");
    EXPECT(bnb8_optimizer_step_count(opt, -1) == -1 && bnb8_optimizer_step_count(opt, 2) == -1 && bnb8_optimizer_step_count(NULL, 0) == -1,
           "steps of a tensor that does not exist");
    EXPECT(bnb8_optimizer_count(NULL) == 0 && bnb8_optimizer_take_nonfinite(NULL, NULL) == BNB8_ERR_NULL, "count / take_nonfinite of NULL");
    bnb8_memory none = bnb8_optimizer_memory(NULL, 1);
    EXPECT(none.params == 0 && none.weights == 0.0 && none.gradients == 0.0 && none.states == 0.0, "memory of NULL");
    bnb8_optimizer_free(NULL);
    for (int s = 0; s < BNB8_NUM_ERRORS; s++) EXPECT(bnb8_strerror(s)[0] != 0, "no text for status %d", s);
    EXPECT(strstr(bnb8_strerror(-1), "unknown") && strstr(bnb8_strerror(BNB8_NUM_ERRORS), "unknown"), "unknown statuses");

    // After all that, the optimizer works: set the missing gradient, step, both tensors count 1.
    EXPECT(bnb8_optimizer_set_grad(opt, 1, g) == 0 && bnb8_optimizer_step(opt, 1e-3f, 1.0f, NULL) == 0,
           "step after the misuse: %s", bnb8_last_error());
    EXPECT(bnb8_optimizer_step_count(opt, 0) == 1 && bnb8_optimizer_step_count(opt, 1) == 1 && memcmp(p, p_before, sizeof p) != 0,
           "the step after the misuse did not step");
    bnb8_optimizer_free(opt);
}

// What no optimizer can use: each refused at create, at override and,
// for the per-step values, at step, with a message, nothing moved. The kinds that divide by
// 1 - beta^t (Adam family, AdEMAMix) need betas below 1; those that divide by sqrt(v) + eps need
// eps > 0; every kind needs a finite, non-negative lr and weight decay with lr wd < 1.
static void test_refused_hyperparameters(void) {
    for (int kind = 0; kind < BNB8_NUM_OPTIMIZERS; kind++) {
        bnb8_optim k = (bnb8_optim)kind;
        bnb8_config c = bnb8_config_default(k), bad;
        bnb8_optimizer *o = NULL, *opt = NULL;
        int bias_corrected = k == BNB8_ADAMW || k == BNB8_ADAM || k == BNB8_LAMB || k == BNB8_ADEMAMIX;
        int divides = bias_corrected || k == BNB8_RMSPROP || k == BNB8_ADAGRAD;
        char what[96];
#define REFUSED(field, value) do {                                                                   \
            bad = c; bad.field = (value);                                                            \
            snprintf(what, sizeof what, "%s: " #field " = %g", kind_names[kind], (double)bad.field);    \
            MISUSE(bnb8_optimizer_create(&o, k, &bad), what);                                        \
            EXPECT(o == NULL, "%s: a refused create gave an optimizer", what);                       \
            if (opt) MISUSE(bnb8_optimizer_override(opt, "x", &bad), what);                          \
        } while (0)
        EXPECT(bnb8_optimizer_create(&opt, k, &c) == 0, "%s: defaults refused: %s", kind_names[kind], bnb8_last_error());
        if (bias_corrected) { REFUSED(beta1, 1.0f); REFUSED(beta2, 1.0f); }
        if (divides) REFUSED(eps, 0.0f);
        if (k == BNB8_RMSPROP) { REFUSED(alpha, 1.5f); REFUSED(alpha, -0.5f); }
        REFUSED(beta1, -0.1f); REFUSED(beta2, 1.01f); REFUSED(momentum, 2.0f);
        REFUSED(lr, -1e-3f); REFUSED(lr, NAN); REFUSED(lr, INFINITY);
        REFUSED(eps, INFINITY); REFUSED(eps, NAN); REFUSED(eps, -1e-8f);
        REFUSED(alpha, INFINITY); REFUSED(max_unorm, INFINITY); REFUSED(max_unorm, -1.0f);
        REFUSED(weight_decay, -1e30f); REFUSED(weight_decay, -0.01f); REFUSED(weight_decay, NAN);
        REFUSED(weight_decay, 1.5f / c.lr);
        c.lr = 0.5f;
        REFUSED(weight_decay, 2.0f);                   // lr wd = 1 exactly: the decay factor 0
        c = bnb8_config_default(k);
#undef REFUSED
        // What each kind can use stays accepted: beta 1 where nothing divides by 1 - beta^t (an
        // EMA that never moves), eps 0 where nothing divides by it, lr 0, wd 0.
        bad = c; bad.lr = 0.0f; bad.weight_decay = 0.0f;
        if (!bias_corrected) bad.beta1 = 1.0f;
        if (!divides) bad.eps = 0.0f;
        EXPECT(bnb8_optimizer_create(&o, k, &bad) == 0, "%s: lr 0, wd 0 refused: %s", kind_names[kind], bnb8_last_error());
        bnb8_optimizer_free(o);
        o = NULL;
        bnb8_optimizer_free(opt);
    }
    // AdamW with beta1 = beta2 = 1 and eps = 0 would turn every weight into NaN, silently: refused.
    bnb8_config c = bnb8_config_default(BNB8_ADAMW);
    c.beta1 = 1.0f; c.beta2 = 1.0f; c.eps = 0.0f;
    bnb8_optimizer *o = NULL, *opt = NULL;
    MISUSE(bnb8_optimizer_create(&o, BNB8_ADAMW, &c), "create: beta1 = beta2 = 1, eps = 0");

    // Names and the per-step values: lr and gnorm_scale, the scheduled lr wd, duplicate ids.
    c = bnb8_config_default(BNB8_ADAMW);             // lr 1e-3, wd 1e-2
    float p[300], g[300], q[300];
    for (int i = 0; i < 300; i++) { p[i] = q[i] = 0.01f * (float)(i % 11) - 0.05f; g[i] = 0.001f * (float)(i % 7) - 0.003f; }
    EXPECT(bnb8_optimizer_create(&opt, BNB8_ADAMW, &c) == 0, "create: %s", bnb8_last_error());
    if (!opt) return;
    MISUSE(bnb8_optimizer_add(opt, "", p, BNB8_F32, g, BNB8_F32, 300, NULL), "add: empty name");
    MISUSE(bnb8_optimizer_override(opt, "", &c), "override: empty name");
    int ids[2] = {0, 1}, dup[2] = {0, 0};
    EXPECT(bnb8_optimizer_add(opt, "a", p, BNB8_F32, g, BNB8_F32, 300, &ids[0]) == 0 &&
           bnb8_optimizer_add(opt, "b", q, BNB8_F32, g, BNB8_F32, 300, &ids[1]) == 0, "add: %s", bnb8_last_error());
    float p0[300];
    memcpy(p0, p, sizeof p);
    MISUSE(bnb8_optimizer_step(opt, -1e-3f, 1.0f, NULL), "step: lr -1e-3");
    MISUSE(bnb8_optimizer_step(opt, 1e-3f, -1.0f, NULL), "step: gnorm_scale -1");
    MISUSE(bnb8_optimizer_step(opt, 1e-3f, NAN, NULL), "step: gnorm_scale NaN");
    MISUSE(bnb8_optimizer_step(opt, 200.0f, 1.0f, NULL), "step: scheduled lr 200 x wd 0.01 = 2");
    MISUSE(bnb8_optimizer_step_tensors(opt, dup, 2, 1e-3f, 1.0f, NULL), "step_tensors: id 0 twice");
    EXPECT(memcmp(p, p0, sizeof p) == 0 && bnb8_optimizer_step_count(opt, 0) == 0, "a refused step moved or counted");
    EXPECT(bnb8_optimizer_step_tensors(opt, ids, 2, 1e-3f, 1.0f, NULL) == 0 && bnb8_optimizer_step_count(opt, 0) == 1,
           "a good step after the refusals: %s", bnb8_last_error());
    bnb8_optimizer_free(opt);
}

// A finite gradient whose step result is not finite: v = g^2 overflows at
// g = 1e30, a weight of 3e38 stepped past FLT_MAX, a bf16 weight at its largest finite value
// stepped past bf16's range. The element is counted and keeps its weight and states, as a
// non-finite gradient's; the others step; a second, ordinary step leaves every weight finite
// (an 8-bit block whose absmax became inf would not).
static void test_nonfinite_results(void) {
    const int64_t n = 8192;                              // above min_8bit_size: 8-bit and flash states
    float *p = (float *)malloc(sizeof(float) * (size_t)n), *g = (float *)malloc(sizeof(float) * (size_t)n);
    float *before = (float *)malloc(sizeof(float) * (size_t)n);
    uint16_t *w = (uint16_t *)malloc(2 * (size_t)n), *gw = (uint16_t *)malloc(2 * (size_t)n);
    if (!p || !g || !before || !w || !gw) { free(p); free(g); free(before); free(w); free(gw); EXPECT(0, "out of memory"); return; }
    test_rng rng = test_rng_new();
    const bnb8_state_format formats[3] = {BNB8_STATE_32BIT, BNB8_STATE_8BIT, BNB8_STATE_FLASH};
    for (int f = 0; f < 3; f++) {
        bnb8_config c = bnb8_config_default(BNB8_ADAMW);
        c.format = formats[f];
        bnb8_optimizer *opt = NULL;
        int64_t k = (int64_t)(test_u64(&rng) % (uint64_t)n);
        for (int64_t i = 0; i < n; i++) { p[i] = (float)(0.1 * test_randn(&rng)); g[i] = (float)(0.01 * test_randn(&rng)); }
        g[k] = 1e30f;                                   // finite; its square is not
        memcpy(before, p, sizeof(float) * (size_t)n);
        EXPECT(bnb8_optimizer_create(&opt, BNB8_ADAMW, &c) == 0 && bnb8_optimizer_add(opt, "w", p, BNB8_F32, g, BNB8_F32, n, NULL) == 0,
               "format %d: %s", f, bnb8_last_error());
        if (!opt) continue;
        EXPECT(bnb8_optimizer_step(opt, 1e-3f, 1.0f, NULL) == 0, "format %d: step: %s", f, bnb8_last_error());
        int64_t bad = test_take_nonfinite(opt), moved = 0;
        EXPECT(bad == 1, "format %d: %lld elements counted, expected 1 (g = 1e30 at %lld)", f, (long long)bad, (long long)k);
        EXPECT(p[k] == before[k], "format %d: element %lld moved to %g", f, (long long)k, (double)p[k]);
        for (int64_t i = 0; i < n; i++) moved += i != k && p[i] != before[i] && isfinite(p[i]);
        EXPECT(moved == n - 1, "format %d: %lld of %lld other elements stepped to finite values", f, (long long)moved, (long long)(n - 1));
        for (int64_t i = 0; i < n; i++) g[i] = (float)(0.01 * test_randn(&rng));
        EXPECT(bnb8_optimizer_step(opt, 1e-3f, 1.0f, NULL) == 0 && test_take_nonfinite(opt) == 0,
               "format %d: the second step: %s", f, bnb8_last_error());
        int64_t finite = 0;
        for (int64_t i = 0; i < n; i++) finite += isfinite(p[i]) && p[i] != before[i];
        EXPECT(finite == n, "format %d: after a second step %lld of %lld weights finite and moved", f, (long long)finite, (long long)n);
        bnb8_optimizer_free(opt);
    }
    // Weights stepped past their dtype's range by SGD (lr 1, no momentum, no state): fp32 past
    // FLT_MAX, bf16 past its largest finite value 0x7f7f (fp32 still finite there).
    for (int bf16 = 0; bf16 < 2; bf16++) {
        bnb8_config c = bnb8_config_default(BNB8_SGD);
        c.momentum = 0.0f; c.format = BNB8_STATE_32BIT; c.correction_bytes = 0;
        bnb8_optimizer *opt = NULL;
        float top = bf16 ? bnb8_bf16_to_f32(0x7f7f) : 3e38f, push = bf16 ? -1e36f : -1e38f;
        for (int64_t i = 0; i < n; i++) { p[i] = 0.5f; g[i] = 0.25f; }
        p[0] = top; g[0] = push;                        // top + 1e36 rounds to bf16 inf; 3e38 + 1e38 is fp32 inf
        p[1] = top; g[1] = 1e36f;                       // stepped down: finite, taken
        for (int64_t i = 0; i < n; i++) { w[i] = bnb8_f32_to_bf16(p[i]); gw[i] = bnb8_f32_to_bf16(g[i]); }
        void *param = bf16 ? (void *)w : (void *)p, *grad = bf16 ? (void *)gw : (void *)g;
        bnb8_dtype dt = bf16 ? BNB8_BF16 : BNB8_F32;
        EXPECT(bnb8_optimizer_create(&opt, BNB8_SGD, &c) == 0 && bnb8_optimizer_add(opt, "w", param, dt, grad, dt, n, NULL) == 0,
               "SGD %s: %s", bf16 ? "bf16" : "fp32", bnb8_last_error());
        if (!opt) continue;
        EXPECT(bnb8_optimizer_step(opt, 1.0f, 1.0f, NULL) == 0, "SGD: step: %s", bnb8_last_error());
        int64_t bad = test_take_nonfinite(opt);
        float w0 = bnb8_load(param, dt, 0), w1 = bnb8_load(param, dt, 1), w2 = bnb8_load(param, dt, 2);
        EXPECT(bad == 1 && w0 == top && isfinite(w1) && w1 < top && w2 == bnb8_load(param, dt, 3) && w2 != 0.5f,
               "SGD %s weights: %lld counted (expected 1), w0 %g (kept: %g), w1 %g, w2 %g", bf16 ? "bf16" : "fp32",
               (long long)bad, (double)w0, (double)top, (double)w1, (double)w2);
        bnb8_optimizer_free(opt);
    }
    free(p); free(g); free(before); free(w); free(gw);
}

// ------------------------------------------------------------------------------------------------
// 5. The paper's ablations in state files: the map (bits 8..15 of an 8-bit record's format) and one
//    absmax per tensor (block size 0)

static const char *ablation_name(const bnb8_config *c) {
    static char names[2][48];    // two in turn: a message may name two configurations
    static int turn;
    char *name = names[turn ^= 1];
    snprintf(name, sizeof names[0], "%s map, block %lld", c->map == BNB8_MAP_LINEAR ? "linear" : "dynamic", (long long)c->blocksize);
    return name;
}

// Resume is byte-identical with either option (every optimizer kind with signed and unsigned
// states); the records say the map and the block size; memory and file size count one absmax per
// state per tensor; and a file made with one map or block size is refused, with a message that
// says so, by an optimizer configured with another.
static void test_ablation_files(void) {
    const bnb8_map maps[4] = {BNB8_MAP_DYNAMIC, BNB8_MAP_LINEAR, BNB8_MAP_DYNAMIC, BNB8_MAP_LINEAR};
    const int64_t blocks[4] = {256, 256, 0, 0};
    for (int kind = 0; kind < BNB8_NUM_OPTIMIZERS; kind++)
        for (int v = 1; v < 4; v++) {
            bnb8_config c = bnb8_config_default((bnb8_optim)kind);
            c.map = maps[v];
            c.blocksize = blocks[v];
            char label[96];
            snprintf(label, sizeof label, "%s 8-bit, %s", kind_names[kind], ablation_name(&c));
            resume_case((bnb8_optim)kind, c, label);
        }

    // The records and the sizes: AdamW, "a" 8-bit (n 5000), "b" 32-bit (under min_8bit_size).
    const tensor_spec spec[2] = {{"a", 5000, BNB8_F32, BNB8_F32}, {"b", 300, BNB8_F32, BNB8_F32}};
    char path[256], bad[256];
    path_in(path, sizeof path, "ablation.bin");
    path_in(bad, sizeof bad, "ablation_other.bin");
    for (int v = 0; v < 4; v++) {
        bnb8_config c = bnb8_config_default(BNB8_ADAMW);
        c.map = maps[v];
        c.blocksize = blocks[v];
        test_rng rng = test_rng_new();
        model m;
        if (!model_new(&m, BNB8_ADAMW, &c, spec, 2, &rng)) return;
        model_steps(&m, 2, c.lr, &rng);
        save_checked(m.opt, path);
        size_t size;
        uint8_t *f = test_slurp(path, &size);
        record r[2];
        int count = f ? parse_records(f, size, r, 2) : -1;
        EXPECT(count == 2, "%s: the file does not parse", ablation_name(&c));
        if (count == 2) {
            uint32_t format = get32(f + r[0].fields + 8);
            int64_t block = (int64_t)get64(f + r[0].fields + 16);
            EXPECT(format == (BNB8_STATE_8BIT | (uint32_t)c.map << 8) && block == c.blocksize, "%s: the 8-bit record has "
                   "format 0x%x and block size %lld", ablation_name(&c), format, (long long)block);
            EXPECT(get32(f + r[1].fields + 8) == BNB8_STATE_32BIT, "%s: the 32-bit record has format 0x%x", ablation_name(&c),
                   get32(f + r[1].fields + 8));
            double want = expect_state_bytes(5000, 2, 1, c.blocksize ? c.blocksize : 5000) + expect_state_bytes(300, 2, 0, 1);
            double weights = 4.0 * (5000 + 300);   // the f32 weights follow each record's states
            EXPECT((double)(r[0].bytes + r[1].bytes) == want + weights && bnb8_optimizer_memory(m.opt, 1).states == want,
                   "%s: %llu state bytes in the file, %.0f in memory, expected %.0f", ablation_name(&c),
                   (unsigned long long)(r[0].bytes + r[1].bytes), bnb8_optimizer_memory(m.opt, 1).states, want);
        }
        free(f);
        // Files of the three other configurations are refused, and the message names the map and
        // the block size; the optimizer stays as it was.
        save_checked(m.opt, before_path());
        for (int w = 0; w < 4; w++) {
            if (w == v) continue;
            bnb8_config o = c;
            o.map = maps[w];
            o.blocksize = blocks[w];
            char what[128];
            snprintf(what, sizeof what, "%s file into %s", ablation_name(&o), ablation_name(&c));
            other_file(BNB8_ADAMW, &o, spec, 2, bad);
            expect_refused(m.opt, bad, BNB8_ERR_FORMAT, what);
            const char *msg = bnb8_last_error();
            EXPECT(strstr(msg, "map") && strstr(msg, "block size"), "%s: the message '%s' does not say map and block size", what, msg);
        }
        EXPECT(bnb8_optimizer_load(m.opt, path) == 0, "%s: its own file no longer loads: %s", ablation_name(&c), bnb8_last_error());
        model_free(&m);
    }
    remove(path);
    remove(bad);
}

// A state file of version 1, which has no map and per-tensor options and not the weights of every
// tensor (test/data/state_adamw_v1.bin), is still read.
// Loaded into an optimizer of the same tensors on the weights the same deterministic run ends with,
// it saves the bytes today's run saves: its states are read as they were written, and the weights it
// does not hold stay as they are. The run uses integer-hashed inputs only, so that nothing but the
// library decides the bytes.
static bnb8_optimizer *golden_run(float *pa, uint16_t *pb, float *ga, uint16_t *gb) {
    bnb8_optimizer *opt = NULL;
    bnb8_config c = bnb8_config_default(BNB8_ADAMW);   // 8-bit, dynamic maps, block 256
    test_rng r = {20240601};
    for (int i = 0; i < 5000; i++) pa[i] = (float)(0.2 * (test_uniform(&r) - 0.5));
    for (int i = 0; i < 300; i++) pb[i] = bnb8_f32_to_bf16((float)(0.2 * (test_uniform(&r) - 0.5)));
    if (bnb8_optimizer_create(&opt, BNB8_ADAMW, &c) || bnb8_optimizer_add(opt, "a", pa, BNB8_F32, ga, BNB8_F32, 5000, NULL) ||
        bnb8_optimizer_add(opt, "b", pb, BNB8_BF16, gb, BNB8_BF16, 300, NULL)) {
        bnb8_optimizer_free(opt);
        return NULL;
    }
    for (int step = 0; step < 3; step++) {
        for (int i = 0; i < 5000; i++) ga[i] = (float)(0.02 * (test_uniform(&r) - 0.5)) * (i % 37 == 0 ? 1e-9f : 1.0f);
        for (int i = 0; i < 300; i++) gb[i] = bnb8_f32_to_bf16((float)(0.02 * (test_uniform(&r) - 0.5)));
        if (bnb8_optimizer_step(opt, 1e-3f * (float)(step + 1), 1.0f, NULL)) { bnb8_optimizer_free(opt); return NULL; }
    }
    return opt;
}

// A golden version-1 file's checks: run (the golden run's optimizer) saves today's (version 2) file,
// which the test's own version-1 writer (test_state_file_v1) turns into the golden file's bytes
// (BNB8_TEST_WRITE_GOLDEN=1 rewrites the golden file from it); fresh, an optimizer of the same
// tensors on the run's final weights, loads the golden file and saves today's bytes. Frees both.
static void golden_check(const char *name, bnb8_optimizer *run, bnb8_optimizer *fresh) {
    char golden[256], today[256], path[256];
    snprintf(golden, sizeof golden, "%s", test_data_path(name));
    path_in(today, sizeof today, "golden_today.bin");
    path_in(path, sizeof path, "golden_again.bin");
    EXPECT(run != NULL && fresh != NULL, "the golden run or the fresh optimizer failed: %s", bnb8_last_error());
    if (run) save_checked(run, today);
    size_t size = 0, gsize = 0;
    uint8_t *t = run ? test_slurp(today, &size) : NULL, *v1 = t ? test_state_file_v1(t, size, &size) : NULL;
    if (v1 && getenv("BNB8_TEST_WRITE_GOLDEN")) {
        FILE *f = fopen(golden, "wb");
        EXPECT(f && fwrite(v1, 1, size, f) == size && fclose(f) == 0, "cannot rewrite %s", golden);
    }
    uint8_t *g = test_slurp(golden, &gsize);
    EXPECT(g && gsize > 24 && get32(g + 8) == 1, "%s is not a version 1 file", golden);
    EXPECT(v1 && g && size == gsize && memcmp(v1, g, size) == 0, "the same run, rewritten as version 1, is no longer %s", golden);
    free(t); free(v1); free(g);
    int status = fresh ? (int)bnb8_optimizer_load(fresh, golden) : -1;
    EXPECT(status == 0, "%s does not load: %s", golden, bnb8_last_error());
    if (status == 0) {
        save_checked(fresh, path);
        EXPECT(files_equal(today, path), "%s loaded and saved again differs from today's run's file", golden);
    }
    bnb8_optimizer_free(run);
    bnb8_optimizer_free(fresh);
    remove(path); remove(today);
}

// A version 1 file of a tensor with no state (SGD without momentum) and fp32 weights holds an empty
// record (version 1 kept no weights beside no master): it loads, and the weights stay as they are.
// The ASan + UBSan suite checks the empty record's staging (CI's fuzz found pointer arithmetic on NULL).
static void test_old_empty_record(void) {
    bnb8_config c = bnb8_config_default(BNB8_SGD);
    c.momentum = 0.0f;
    float w[40], g[40], before[40];
    for (int i = 0; i < 40; i++) { w[i] = 0.01f * (float)i; g[i] = 0.5f; }
    bnb8_optimizer *opt = NULL;
    char path[128];
    snprintf(path, sizeof path, "%s/empty_v1.bin", dir);
    EXPECT(bnb8_optimizer_create(&opt, BNB8_SGD, &c) == 0 && bnb8_optimizer_add(opt, "w", w, BNB8_F32, g, BNB8_F32, 40, NULL) == 0 &&
           bnb8_optimizer_step(opt, 0.1f, 1.0f, NULL) == 0 && bnb8_optimizer_save(opt, path) == 0, "%s", bnb8_last_error());
    size_t size = 0;
    uint8_t *v2 = test_slurp(path, &size), *v1 = v2 ? test_state_file_v1(v2, size, &size) : NULL;
    FILE *f = v1 ? fopen(path, "wb") : NULL;
    EXPECT(f && fwrite(v1, 1, size, f) == size && fclose(f) == 0, "cannot write the version 1 file %s", path);
    memcpy(before, w, sizeof w);
    EXPECT(bnb8_optimizer_load(opt, path) == 0, "a version 1 file with an empty record: %s", bnb8_last_error());
    EXPECT(memcmp(before, w, sizeof w) == 0 && bnb8_optimizer_step_count(opt, 0) == 1, "the load changed the weights or the step count");
    bnb8_optimizer_free(opt);
    free(v2); free(v1);
    remove(path);
}

static void test_old_file(void) {
    static float pa[5000], ga[5000];
    static uint16_t pb[300], gb[300];
    bnb8_optimizer *run = golden_run(pa, pb, ga, gb), *fresh = NULL;
    bnb8_config c = bnb8_config_default(BNB8_ADAMW);
    if (bnb8_optimizer_create(&fresh, BNB8_ADAMW, &c) || bnb8_optimizer_add(fresh, "a", pa, BNB8_F32, ga, BNB8_F32, 5000, NULL) ||
        bnb8_optimizer_add(fresh, "b", pb, BNB8_BF16, gb, BNB8_BF16, 300, NULL)) {
        bnb8_optimizer_free(fresh);
        fresh = NULL;
    }
    golden_check("state_adamw_v1.bin", run, fresh);
}

// Flash records with bf16, fp16 and fp32 group scales written before the e6m10 scales existed
// (test/data/state_flash_v1.bin, by commit e70c2d0, the scale dtypes named explicitly since the
// default changed since): the same deterministic run with today's code writes the same bytes (the
// rounded-up scales of those dtypes did not change), and the file loads and saves back byte for
// byte. Weights: bf16 + int8, fp16 + int16, fp32; sizes not multiples of 32; some gradients of
// 1e-9 (fp16 scales' subnormals). BNB8_TEST_WRITE_GOLDEN=1 rewrites it (only after a deliberate change).
#define GF_A 1000
#define GF_B 300
#define GF_C 517
static bnb8_optimizer *golden_flash_new(void *pa, void *pb, float *pc, void *ga, void *gb, float *gc) {
    bnb8_optimizer *opt = NULL;
    bnb8_config c = bnb8_config_default(BNB8_ADAMW), o;
    c.format = BNB8_STATE_FLASH; c.min_8bit_size = 0; c.scale_dtype = BNB8_BF16;
    int status = bnb8_optimizer_create(&opt, BNB8_ADAMW, &c);
    o = c; o.scale_dtype = BNB8_F16; o.correction_bytes = 2;
    if (!status) status = bnb8_optimizer_override(opt, "b", &o);
    o = c; o.scale_dtype = BNB8_F32;
    if (!status) status = bnb8_optimizer_override(opt, "c", &o);
    if (!status) status = bnb8_optimizer_add(opt, "a", pa, BNB8_BF16, ga, BNB8_BF16, GF_A, NULL);
    if (!status) status = bnb8_optimizer_add(opt, "b", pb, BNB8_F16, gb, BNB8_F32, GF_B, NULL);
    if (!status) status = bnb8_optimizer_add(opt, "c", pc, BNB8_F32, gc, BNB8_F32, GF_C, NULL);
    if (status) { bnb8_optimizer_free(opt); return NULL; }
    return opt;
}
static bnb8_optimizer *golden_flash_run(uint16_t *pa, uint16_t *pb, float *pc, uint16_t *ga, float *gb, float *gc) {
    test_rng r = {20261125};
    for (int i = 0; i < GF_A; i++) pa[i] = 0;
    for (int i = 0; i < GF_B; i++) pb[i] = 0;
    for (int i = 0; i < GF_C; i++) pc[i] = (float)(0.2 * (test_uniform(&r) - 0.5));
    bnb8_optimizer *opt = golden_flash_new(pa, pb, pc, ga, gb, gc);
    if (!opt) return NULL;
    float w[GF_A];
    for (int i = 0; i < GF_A; i++) w[i] = (float)(0.2 * (test_uniform(&r) - 0.5));
    if (bnb8_optimizer_import_fp32(opt, 0, w) || bnb8_optimizer_import_fp32(opt, 1, w)) { bnb8_optimizer_free(opt); return NULL; }
    for (int step = 0; step < 3; step++) {
        for (int i = 0; i < GF_A; i++) ga[i] = bnb8_f32_to_bf16((float)(0.02 * (test_uniform(&r) - 0.5)));
        for (int i = 0; i < GF_B; i++) gb[i] = (float)(0.02 * (test_uniform(&r) - 0.5)) * (i / 32 == 3 ? 1e-7f : 1.0f);
        for (int i = 0; i < GF_C; i++) gc[i] = (float)(0.02 * (test_uniform(&r) - 0.5)) * (i % 37 == 0 ? 1e-9f : 1.0f);
        if (bnb8_optimizer_step(opt, 1e-3f * (float)(step + 1), 1.0f, NULL)) { bnb8_optimizer_free(opt); return NULL; }
    }
    return opt;
}

static void test_old_flash_file(void) {
    static uint16_t pa[GF_A], pb[GF_B], ga[GF_A];
    static float pc[GF_C], gb[GF_B], gc[GF_C];
    bnb8_optimizer *run = golden_flash_run(pa, pb, pc, ga, gb, gc);
    golden_check("state_flash_v1.bin", run, golden_flash_new(pa, pb, pc, ga, gb, gc));
}

// ------------------------------------------------------------------------------------------------
// 6. What a load rebuilds, and the block size of a record

// bf16 and fp16 weights beside an fp32 master (the file keeps the masters, not these weights): an
// optimizer over garbage weights that loads the file has, right after the load and before any step,
// the saved weights and the saved masters, every element bit for bit; 32-bit, 8-bit and flash states.
static void test_master_weights_after_load(void) {
    const tensor_spec spec[3] = {{"h.0", 5003, BNB8_F16, BNB8_F32}, {"h.1", 4200, BNB8_BF16, BNB8_F32},
                                 {"ln", 300, BNB8_F16, BNB8_BF16}};
    const bnb8_state_format fmts[3] = {BNB8_STATE_32BIT, BNB8_STATE_8BIT, BNB8_STATE_FLASH};
    char path[256];
    path_in(path, sizeof path, "masters.bin");
    float *ma = malloc(sizeof(float) * 5003), *mb = malloc(sizeof(float) * 5003);
    for (int f = 0; f < 3; f++) {
        bnb8_config c = bnb8_config_default(BNB8_ADAMW);
        c.format = fmts[f]; c.min_8bit_size = 0; c.correction_bytes = 4;
        test_rng rng = test_rng_new();
        model A, B;
        if (!model_new(&A, BNB8_ADAMW, &c, spec, 3, &rng)) break;
        model_steps(&A, 3, c.lr, &rng);
        save_checked(A.opt, path);
        if (!model_new(&B, BNB8_ADAMW, &c, spec, 3, &rng)) { model_free(&A); break; }
        for (int j = 0; j < 3; j++)
            for (size_t i = 0; i < 2 * (size_t)spec[j].n; i++) ((uint8_t *)B.p[j])[i] = (uint8_t)test_u64(&rng);
        EXPECT(bnb8_optimizer_load(B.opt, path) == 0, "format %d: load: %s", (int)fmts[f], bnb8_last_error());
        for (int j = 0; j < 3; j++) {
            int64_t bad_w = -1, bad_m = -1;
            for (int64_t i = 0; i < spec[j].n && bad_w < 0; i++)
                if (((uint16_t *)A.p[j])[i] != ((uint16_t *)B.p[j])[i]) bad_w = i;
            int ok = bnb8_optimizer_export_fp32(A.opt, j, ma) == 0 && bnb8_optimizer_export_fp32(B.opt, j, mb) == 0;
            for (int64_t i = 0; ok && i < spec[j].n && bad_m < 0; i++) if (memcmp(&ma[i], &mb[i], 4) != 0) bad_m = i;
            EXPECT(ok && bad_w < 0 && bad_m < 0, "format %d, %s %s: after the load weight %lld and master %lld differ from "
                   "the saved ones (-1: none) %s", (int)fmts[f], spec[j].name, spec[j].pdt == BNB8_F16 ? "fp16" : "bf16",
                   (long long)bad_w, (long long)bad_m, ok ? "" : bnb8_last_error());
        }
        model_free(&A); model_free(&B);
    }
    free(ma); free(mb);
    remove(path);
}

// A record's block size must be the optimizer's: a flash record whose block size says anything but
// the 32 of its scale groups, and an 8-bit record of another block size, each with the CRC made
// right, are refused and change nothing (the payload's size alone does not tell them apart).
static void test_record_block_size(void) {
    const tensor_spec spec[2] = {{"a", 5000, BNB8_BF16, BNB8_F32}, {"b", 4100, BNB8_F32, BNB8_F32}};
    const bnb8_state_format fmts[2] = {BNB8_STATE_FLASH, BNB8_STATE_8BIT};
    char valid[256], bad[256];
    path_in(valid, sizeof valid, "block_valid.bin");
    path_in(bad, sizeof bad, "block_bad.bin");
    for (int f = 0; f < 2; f++) {
        bnb8_config c = bnb8_config_default(BNB8_ADAMW);
        c.format = fmts[f]; c.min_8bit_size = 0;
        test_rng rng = test_rng_new();
        model m;
        if (!model_new(&m, BNB8_ADAMW, &c, spec, 2, &rng)) return;
        model_steps(&m, 2, c.lr, &rng);
        size_t size = 0;
        uint8_t *v = save_checked(m.opt, valid) || save_checked(m.opt, before_path()) ? NULL : test_slurp(valid, &size);
        record r[2];
        int count = v ? parse_records(v, size, r, 2) : -1;
        EXPECT(count == 2, "the saved file does not parse as the documented layout");
        for (int j = 0; j < count; j++) {
            uint64_t own = get64(v + r[j].fields + 16);
            EXPECT(own == (uint64_t)(fmts[f] == BNB8_STATE_FLASH ? 32 : c.blocksize), "record %d's block size is %llu", j,
                   (unsigned long long)own);
            const uint64_t others[4] = {0, own / 2, own * 2, own + 1};
            for (int k = 0; k < 4; k++) {
                char what[96];
                snprintf(what, sizeof what, "%s record %d of block size %llu (CRC made right)",
                         fmts[f] == BNB8_STATE_FLASH ? "flash" : "8-bit", j, (unsigned long long)others[k]);
                forge(v, size, size, r[j].fields + 16, 8, others[k], 0, 1, bad);
                expect_refused(m.opt, bad, BNB8_ERR_FORMAT, what);
            }
        }
        EXPECT(bnb8_optimizer_load(m.opt, valid) == 0, "the valid file no longer loads: %s", bnb8_last_error());
        free(v);
        model_free(&m);
    }
    remove(valid); remove(bad); remove(before_path());
}

// ------------------------------------------------------------------------------------------------

void tests_state(void) {
    verbose = getenv("BNB8_TEST_VERBOSE") != NULL;
    snprintf(dir, sizeof dir, "/tmp/bnb8_state_XXXXXX");
    if (!mkdtemp(dir)) { printf("test_state: mkdtemp failed\n"); return; }
    test_run("state: save -> load -> continue equals never stopping", test_resume);
    test_run("state: corrupted or mismatched files are refused, nothing changed", test_corrupt_files);
    test_run("state: saves are atomic (a temporary of their own + rename), failures keep the old file", test_atomic_save);
    test_run("state: file size (6.03125 bytes/param with f32 weights) and memory of 8-bit states", test_memory_and_file_size);
    test_run("state: tensors under min_8bit_size keep 32-bit states", test_min_8bit_size);
    test_run("state: API misuse returns a status and a message", test_api_misuse);
    test_run("state: hyper-parameters no optimizer can use are refused", test_refused_hyperparameters);
    test_run("state: a finite gradient's non-finite result is counted and kept out", test_nonfinite_results);
    test_run("state: linear map and one absmax per tensor: resume, records, sizes", test_ablation_files);
    test_run("state: a version 1 file (without those options and the weights) loads and is rewritten", test_old_file);
    test_run("state: a version 1 file with an empty record (no state, no weights) loads", test_old_empty_record);
    test_run("state: version 1 flash records with bf16, fp16, fp32 scales (no e6m10) load and are rewritten", test_old_flash_file);
    test_run("state: bf16/fp16 weights beside fp32 masters are the saved ones right after a load", test_master_weights_after_load);
    test_run("state: a record of another block size is refused (flash and 8-bit, CRC made right)", test_record_block_size);
    rmdir(dir);
}
