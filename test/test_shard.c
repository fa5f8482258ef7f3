/*
test_shard.c — shards of a tensor (data parallel, ZeRO-1; DESIGN.md §5.6): N optimizers, each owning
a contiguous range of one tensor (cfg.shard_offset, cfg.shard_total), stepped apart, make the same
bits as one optimizer stepping the whole tensor: weights, every state array (codes, absmax, group
scales, 32-bit states, corrections, fp32 masters) and the non-finite count; every optimizer kind
and state format, N = 1..8 at random cut points, sizes that are multiples of nothing. Shard files
round-trip and a file of another sharding is refused with both ranges; ranges that split a block
or need the whole tensor are refused; memory adds up over the shards; sum_squares adds up in rank
order within the bound of two orders of one double sum.

The states are compared in the files bnb8_optimizer_save writes, sliced with the layout bnb8.c
describes (DESIGN.md §7): per record, after the header fields (version 3: the shard's offset and
total after n), the state memory: an fp32 master (n floats), per state absmax (8-bit: a float per
block) or scales (flash: one per group of 32), 32-bit states (n floats each), an int8/int16
correction (n), codes (n bytes per state); then the weights (none beside an fp32 master).
*/
#define BNB8_INTERNAL   // bnb8_store and bnb8_load: the per-element writes and reads of the shards' arrays
#define _POSIX_C_SOURCE 200809L   // mkdtemp
#include "test.h"
#include "bnb8.h"
#include "trainer/tensors.h"   // shard_layout, shard_part
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static char dir[64];
#define MAX_SHARDS 8

static const char *kind_names[BNB8_NUM_OPTIMIZERS] = {"AdamW", "Adam", "SGD", "Lion", "RMSprop", "Adagrad",
                                                       "LAMB", "LARS", "AdEMAMix"};

static uint32_t get32(const uint8_t *p) { uint32_t v; memcpy(&v, p, 4); return v; }
static int64_t get64(const uint8_t *p) { int64_t v; memcpy(&v, p, 8); return v; }

// One array of a record: count entries of size bytes, each covering unit elements of the tensor.
typedef struct { const uint8_t *data; int64_t count, unit; size_t size; } array;
// A state file of one tensor, parsed: its version, the shard, and its arrays (the state memory,
// then the weights); 0 if it does not parse.
typedef struct { uint32_t version; int64_t n, offset, total, step; int narrays; array a[16]; uint8_t *file; } record;

static int record_read(const char *path, record *r) {
    size_t size;
    memset(r, 0, sizeof *r);
    uint8_t *f = r->file = test_slurp(path, &size);
    if (!f || size < 28 || memcmp(f, "BNB8OPT", 8) || get32(f + 16) != 1) return 0;
    r->version = get32(f + 8);
    size_t at = 24 + 4 + get32(f + 24);
    if (at + 16 > size) return 0;
    r->n = get64(f + at); at += 8;
    r->total = r->n;
    if (r->version >= 3) { r->offset = get64(f + at); r->total = get64(f + at + 8); at += 16; }
    if (at + 32 + 4 > size) return 0;
    uint32_t format = get32(f + at), nstates = get32(f + at + 4);
    int64_t block = get64(f + at + 8);
    r->step = get64(f + at + 16);
    int64_t bytes = get64(f + at + 24);
    at += 32;
    int fmt = format & 0xff, cb = (format >> 16) & 0xff;
    bnb8_dtype sdt = (bnb8_dtype)((format >> 8) & 0xff), pdt = (bnb8_dtype)(format >> 24);
    int64_t n = r->n, groups = (n + 31) / 32, blocks = fmt == BNB8_STATE_8BIT ? (n + block - 1) / block : 0;
    size_t ssize = sdt == BNB8_F32 ? 4 : 2;
    const uint8_t *p = f + at;
    #define ARR(cnt, unt, sz) do { r->a[r->narrays++] = (array){p, (cnt), (unt), (sz)}; p += (size_t)(cnt) * (sz); } while (0)
    if (cb == 4) ARR(n, 1, 4);
    for (uint32_t k = 0; k < nstates; k++) {
        if (fmt == BNB8_STATE_8BIT) ARR(blocks, block, 4);
        if (fmt == BNB8_STATE_FLASH) ARR(groups, 32, ssize);
    }
    for (uint32_t k = 0; fmt == BNB8_STATE_32BIT && k < nstates; k++) ARR(n, 1, 4);
    if (cb == 1 || cb == 2) ARR(n, 1, (size_t)cb);
    for (uint32_t k = 0; fmt != BNB8_STATE_32BIT && k < nstates; k++) ARR(n, 1, 1);
    if (cb != 4) ARR(n, 1, bnb8_dtype_size(pdt));
    #undef ARR
    return p == f + at + bytes && (size_t)(p - f) + 4 == size;
}

// Shard s's arrays are the whole record's entries from its offset on: 1 if every byte matches.
static int record_matches(const record *whole, const record *s, char *what, size_t what_size) {
    if (s->narrays != whole->narrays) { snprintf(what, what_size, "%d arrays, the whole tensor %d", s->narrays, whole->narrays); return 0; }
    for (int j = 0; j < s->narrays; j++) {
        const array *w = &whole->a[j], *a = &s->a[j];
        int64_t first = s->offset / w->unit;
        if (a->size != w->size || a->unit != w->unit || first + a->count > w->count) {
            snprintf(what, what_size, "array %d: %lld entries of %zu bytes at %lld, the whole %lld of %zu", j,
                     (long long)a->count, a->size, (long long)first, (long long)w->count, w->size);
            return 0;
        }
        for (int64_t e = 0; e < a->count; e++)
            if (memcmp(a->data + e * a->size, w->data + (first + e) * w->size, a->size)) {
                snprintf(what, what_size, "array %d (of %d, %zu-byte entries per %lld elements), entry %lld of the "
                         "shard (%lld of the tensor) differs", j, s->narrays, a->size, (long long)a->unit,
                         (long long)e, (long long)(first + e));
                return 0;
            }
    }
    return 1;
}

// A case: an optimizer kind, its configuration, the weights' dtype and the tensor's size.
typedef struct { bnb8_optim kind; bnb8_config c; bnb8_dtype pdt; int64_t total; char label[160]; } shard_case;

// Where shard boundaries may fall for a case: the state format's block (8-bit), group (flash), 1 (32-bit).
static int64_t case_unit(const shard_case *sc) {
    int eight = sc->c.format != BNB8_STATE_32BIT && sc->total >= sc->c.min_8bit_size;
    return !eight ? 1 : sc->c.format == BNB8_STATE_8BIT ? sc->c.blocksize : 32;
}

// N - 1 distinct random cuts at multiples of unit inside (0, total), sorted, as N + 1 bounds.
static int random_bounds(test_rng *rng, int64_t total, int64_t unit, int N, int64_t *bound) {
    int64_t slots = (total - 1) / unit;   // multiples of unit in (0, total)
    if (slots < N - 1) return 0;
    bound[0] = 0; bound[N] = total;
    for (int k = 1; k < N; k++) {
        int64_t c;
        int fresh;
        do {
            c = (1 + (int64_t)(test_uniform(rng) * (double)slots)) * unit;
            fresh = c < total;
            for (int j = 1; j < k; j++) fresh &= bound[j] != c;
        } while (!fresh);
        int j = k;
        while (j > 1 && bound[j - 1] > c) { bound[j] = bound[j - 1]; j--; }
        bound[j] = c;
    }
    return 1;
}

// Registers [offset, offset + n) of the tensor at p/g (whole when n == total) with an optimizer.
static bnb8_optimizer *shard_new(const shard_case *sc, void *p, void *g, int64_t offset, int64_t n, const float *master) {
    bnb8_optimizer *opt = NULL;
    bnb8_config o = sc->c;
    o.shard_offset = offset; o.shard_total = sc->total;
    size_t es = bnb8_dtype_size(sc->pdt);
    int status = bnb8_optimizer_create(&opt, sc->kind, &sc->c);
    if (!status) status = bnb8_optimizer_override(opt, "w", &o);
    if (!status) status = bnb8_optimizer_add(opt, "w", (uint8_t *)p + es * (size_t)offset, sc->pdt,
                                             (uint8_t *)g + es * (size_t)offset, sc->pdt, n, NULL);
    if (!status && sc->pdt != BNB8_F32) status = bnb8_optimizer_import_fp32(opt, 0, master + offset);
    EXPECT(status == 0, "%s: shard [%lld, %lld): %s", sc->label, (long long)offset, (long long)(offset + n), bnb8_last_error());
    if (status) { bnb8_optimizer_free(opt); return NULL; }
    return opt;
}

// Steps the whole tensor and N shards of it (fresh random gradients, some not finite) and compares
// weights, the states in their files, the non-finite counts, the memory and the sums of g^2.
static void shard_parity(const shard_case *sc, int N, test_rng *rng) {
    int64_t total = sc->total, bound[MAX_SHARDS + 1];
    if (!random_bounds(rng, total, case_unit(sc), N, bound)) return;
    size_t es = bnb8_dtype_size(sc->pdt), bytes = es * (size_t)total;
    void *pw = malloc(bytes), *ps = malloc(bytes), *g = malloc(bytes);
    float *master = (float *)malloc(sizeof(float) * (size_t)total);
    bnb8_optimizer *whole = NULL, *shard[MAX_SHARDS] = {0};
    for (int64_t i = 0; i < total; i++) {
        master[i] = (float)(0.1 * test_randn(rng));
        bnb8_store(pw, sc->pdt, i, master[i]);
    }
    memcpy(ps, pw, bytes);
    int ok = (whole = shard_new(sc, pw, g, 0, total, master)) != NULL;
    for (int k = 0; ok && k < N; k++) ok = (shard[k] = shard_new(sc, ps, g, bound[k], bound[k + 1] - bound[k], master)) != NULL;
    for (int s = 1; ok && s <= 3 && !test_failures(); s++) {
        for (int64_t i = 0; i < total; i++) {
            double u = test_uniform(rng);
            float x = u < 0.002 ? NAN : u < 0.003 ? INFINITY : (float)(0.01 * test_randn(rng));
            bnb8_store(g, sc->pdt, i, x);
        }
        float lr = sc->c.lr * (1.0f - 0.1f * (float)s), scale = (float)(0.5 + test_uniform(rng));
        ok = bnb8_optimizer_step(whole, lr, scale, NULL) == 0;
        for (int k = 0; ok && k < N; k++) ok = bnb8_optimizer_step(shard[k], lr, scale, NULL) == 0;
        EXPECT(ok, "%s, N %d: step %d: %s", sc->label, N, s, bnb8_last_error());
        int64_t nf = 0;
        for (int k = 0; k < N; k++) nf += test_take_nonfinite(shard[k]);
        int64_t want = test_take_nonfinite(whole);
        EXPECT(nf == want, "%s, N %d, step %d: %lld non-finite elements in the shards, %lld whole", sc->label, N, s,
               (long long)nf, (long long)want);
        for (int64_t i = 0; i < total; i++)
            if (memcmp((uint8_t *)pw + es * i, (uint8_t *)ps + es * i, es)) {
                EXPECT(0, "%s, N %d, step %d: weight %lld differs (%.9g sharded, %.9g whole)", sc->label, N, s,
                       (long long)i, (double)bnb8_load(ps, sc->pdt, i), (double)bnb8_load(pw, sc->pdt, i));
                break;
            }
        if (sc->c.sum_squares) {   // rank order against the whole tensor's order: both sums of the same squares
            double sum = 0.0, part, w;
            for (int k = 0; k < N; k++) { bnb8_optimizer_sum_squares(shard[k], &part); sum += part; }
            bnb8_optimizer_sum_squares(whole, &w);
            double bar = 2.0 * (double)total * 0x1p-53 * w;   // (m - 1) u sum per order, m <= total
            EXPECT(N == 1 ? sum == w : fabs(sum - w) <= bar, "%s, N %d: sum of g^2 %.17g in rank order, %.17g whole "
                   "(bar %.3g)", sc->label, N, sum, w, bar);
        }
    }
    // every state array, entry by entry, through the files
    char path[256], what[256];
    record rw = {0}, rs = {0};
    snprintf(path, sizeof path, "%s/whole.bin", dir);
    if (ok && bnb8_optimizer_save(whole, path) == 0 && record_read(path, &rw)) {
        EXPECT(rw.version == 2, "%s: a whole tensor's file has version %u, expected 2", sc->label, rw.version);
        bnb8_memory mw = bnb8_optimizer_memory(whole, 1), sum = {0};
        for (int k = 0; k < N && !test_failures(); k++) {
            snprintf(path, sizeof path, "%s/shard%d.bin", dir, k);
            int read = bnb8_optimizer_save(shard[k], path) == 0 && record_read(path, &rs);
            EXPECT(read, "%s: shard %d's file: %s", sc->label, k, bnb8_last_error());
            if (read) {
                int part = N > 1;
                EXPECT(rs.version == (part ? 3u : 2u) && rs.offset == bound[k] && rs.total == (part ? total : rs.n) &&
                       rs.n == bound[k + 1] - bound[k] && rs.step == 3, "%s: shard %d of %d: version %u, [%lld, +%lld) of %lld, "
                       "step %lld", sc->label, k, N, rs.version, (long long)rs.offset, (long long)rs.n, (long long)rs.total,
                       (long long)rs.step);
                EXPECT(record_matches(&rw, &rs, what, sizeof what), "%s, N %d, shard %d [%lld, %lld): %s", sc->label, N, k,
                       (long long)bound[k], (long long)bound[k + 1], what);
                rs.offset = 0;   // the comparison can fail: shard 1 against the tensor's first elements
                EXPECT(k != 1 || !record_matches(&rw, &rs, what, sizeof what), "%s, N %d: shard 1 matches at offset 0", sc->label, N);
            }
            free(rs.file);
        }
        for (int k = 0; k < N; k++) {
            bnb8_memory m = bnb8_optimizer_memory(shard[k], 1);
            sum.params += m.params; sum.weights += m.weights; sum.gradients += m.gradients;
            sum.states += m.states; sum.correction += m.correction;
        }
        EXPECT(sum.params == mw.params && sum.weights == mw.weights && sum.gradients == mw.gradients &&
               sum.states == mw.states && sum.correction == mw.correction, "%s, N %d: the shards' memory (%g states, %g "
               "correction) is not the whole tensor's (%g, %g)", sc->label, N, sum.states, sum.correction, mw.states, mw.correction);
    } else {
        EXPECT(!ok, "%s: the whole tensor's file: %s", sc->label, bnb8_last_error());
    }
    free(rw.file);
    bnb8_optimizer_free(whole);
    for (int k = 0; k < N; k++) bnb8_optimizer_free(shard[k]);
    free(pw); free(ps); free(g); free(master);
}

// Every kind, every state format it has, fp32 weights and bf16 weights with each correction; a
// tensor size of a few blocks (so that shards are small: under min_8bit_size, the format still the
// whole tensor's) plus an odd remainder; N = 1..8 in turn over the cases (each N meets ~24 cases,
// of every kind), every N of every case with BNB8_TEST_FULL=1.
static void test_shard_parity(void) {
    test_rng rng = test_rng_new();
    const int corrections[] = {-2, 0, 1, 2, 4};   // -2: fp32 weights
    int cases = 0, full = getenv("BNB8_TEST_FULL") != NULL;
    for (int kind = 0; kind < BNB8_NUM_OPTIMIZERS; kind++) {
        for (int form = 0; form < 4; form++) {
            int flash = form == 3;
            if (flash && !(kind == BNB8_ADAMW || kind == BNB8_ADAM || kind == BNB8_SGD || kind == BNB8_LION)) continue;
            for (int ci = 0; ci < 5; ci++) {
                shard_case sc;
                sc.kind = (bnb8_optim)kind;
                sc.c = bnb8_config_default(sc.kind);
                sc.c.max_unorm = 0.0f;    // LAMB / LARS: the trust ratio needs the whole tensor
                sc.c.format = form == 0 ? BNB8_STATE_32BIT : flash ? BNB8_STATE_FLASH : BNB8_STATE_8BIT;
                sc.c.blocksize = form == 2 ? 2048 : 256;
                if (kind == BNB8_SGD || kind == BNB8_LARS) sc.c.nesterov = ci & 1;
                sc.c.sum_squares = 1;
                sc.pdt = corrections[ci] == -2 ? BNB8_F32 : BNB8_BF16;
                sc.c.correction_bytes = corrections[ci] == -2 ? BNB8_CORRECTION_AUTO : corrections[ci];
                int64_t unit = form == 2 ? 2048 : form == 1 ? 256 : 32;
                int64_t blocks = MAX_SHARDS + (int64_t)(test_uniform(&rng) * 4);
                while (unit * blocks < 5000) blocks *= 2;   // over min_8bit_size, and shards under it
                sc.total = unit * blocks + 1 + (int64_t)(test_uniform(&rng) * (double)(unit - 2));
                if (form == 0 && ci == 0) sc.total = 1000 + (int64_t)(test_uniform(&rng) * 3000);   // any cut
                snprintf(sc.label, sizeof sc.label, "%s %s%s weights %s correction %d, %lld elements", kind_names[kind],
                         form == 0 ? "32-bit" : flash ? "flash" : "8-bit", form == 1 ? " 256" : form == 2 ? " 2048" : "",
                         sc.pdt == BNB8_F32 ? "fp32" : "bf16", sc.c.correction_bytes, (long long)sc.total);
                // every N in turn over the cases (BNB8_TEST_FULL=1: all of 1..8 in each)
                for (int N = 1; N <= MAX_SHARDS && !test_failures(); N++)
                    if (full || N == 1 + cases % MAX_SHARDS) shard_parity(&sc, N, &rng);
                cases++;
            }
        }
    }
    // an 8-bit configuration whose tensor is under min_8bit_size: 32-bit states, cut anywhere
    shard_case sc = {BNB8_ADAMW, bnb8_config_default(BNB8_ADAMW), BNB8_BF16, 4000 - 7, "AdamW 8-bit under min_8bit_size"};
    for (int N = 2; N <= MAX_SHARDS; N++) shard_parity(&sc, N, &rng);
    EXPECT(cases == 9 * 3 * 5 + 4 * 5, "%d cases", cases);
}

// A state file of N shards: each rank's round-trips (load into a fresh optimizer of the same shard
// restores the weights and states: the next step is the same bits); a file of another sharding,
// a whole tensor's file into a shard and a shard's into a whole tensor are refused with both ranges.
static void test_shard_files(void) {
    test_rng rng = test_rng_new();
    shard_case sc = {BNB8_ADAMW, bnb8_config_default(BNB8_ADAMW), BNB8_BF16, 3 * 4096 + 777, "flash AdamW"};
    sc.c.format = BNB8_STATE_FLASH;
    int64_t total = sc.total, b2[3] = {0, 8192, total}, b3[4] = {0, 4096, 8192, total};
    size_t bytes = 2 * (size_t)total;
    uint16_t *p = malloc(bytes), *q = malloc(bytes), *g = malloc(bytes);
    float *master = malloc(sizeof(float) * (size_t)total);
    for (int64_t i = 0; i < total; i++) { master[i] = (float)test_randn(&rng); p[i] = bnb8_f32_to_bf16(master[i]); }
    memcpy(q, p, bytes);
    bnb8_optimizer *two[2], *back[2], *three = shard_new(&sc, q, g, b3[0], b3[1], master), *whole = shard_new(&sc, q, g, 0, total, master);
    char path[2][256], wpath[256];
    for (int k = 0; k < 2; k++) {
        two[k] = shard_new(&sc, p, g, b2[k], b2[k + 1] - b2[k], master);
        for (int s = 0; s < 2; s++) {
            for (int64_t i = 0; i < total; i++) g[i] = bnb8_f32_to_bf16((float)(0.01 * test_randn(&rng)));
            EXPECT(two[k] && bnb8_optimizer_step(two[k], 1e-3f, 1.0f, NULL) == 0, "step: %s", bnb8_last_error());
        }
        snprintf(path[k], sizeof path[k], "%s/rank%d.bin", dir, k);
        EXPECT(two[k] && bnb8_optimizer_save(two[k], path[k]) == 0, "save: %s", bnb8_last_error());
        // a fresh optimizer of the same shard, over other weights: the load restores them
        back[k] = shard_new(&sc, q, g, b2[k], b2[k + 1] - b2[k], master);
        EXPECT(back[k] && bnb8_optimizer_load(back[k], path[k]) == 0, "load of rank %d's file: %s", k, bnb8_last_error());
    }
    EXPECT(memcmp(p, q, bytes) == 0, "the loaded shards' weights differ from the saved ones");
    for (int64_t i = 0; i < total; i++) g[i] = bnb8_f32_to_bf16((float)(0.01 * test_randn(&rng)));
    for (int k = 0; k < 2; k++)
        EXPECT(bnb8_optimizer_step(two[k], 1e-3f, 1.0f, NULL) == 0 && bnb8_optimizer_step(back[k], 1e-3f, 1.0f, NULL) == 0 &&
               bnb8_optimizer_step_count(back[k], 0) == 3, "step after load: %s", bnb8_last_error());
    EXPECT(memcmp(p, q, bytes) == 0, "a step after the load differs from a step without stopping");
    // another sharding: rank 0 of 3 ([0, 4096)) cannot take rank 0 of 2's ([0, 8192))
    uint16_t before = q[5];
    int status = bnb8_optimizer_load(three, path[0]);
    const char *msg = bnb8_last_error();
    EXPECT(status == BNB8_ERR_FORMAT && strstr(msg, "saved as elements [0, 8192) of 13065") && strstr(msg, "holds [0, 4096) of 13065") &&
           strstr(msg, "another sharding"), "a file of 2 shards into 3: status %d, '%s'", status, msg);
    EXPECT(q[5] == before, "a refused load changed the weights");
    // a shard's file into the whole tensor, and the whole tensor's (version 2) into a shard
    status = bnb8_optimizer_load(whole, path[1]);
    EXPECT(status == BNB8_ERR_FORMAT && strstr(bnb8_last_error(), "saved as elements [8192, 13065) of 13065"),
           "a shard's file into the whole tensor: status %d, '%s'", status, bnb8_last_error());
    snprintf(wpath, sizeof wpath, "%s/whole.bin", dir);
    EXPECT(bnb8_optimizer_save(whole, wpath) == 0, "save: %s", bnb8_last_error());
    status = bnb8_optimizer_load(two[0], wpath);
    EXPECT(status == BNB8_ERR_FORMAT && strstr(bnb8_last_error(), "saved as elements [0, 13065) of 13065"),
           "the whole tensor's file into a shard: status %d, '%s'", status, bnb8_last_error());
    // a range no tensor can have (offset + n past INT64_MAX: found by the fuzzer) is refused, not summed
    FILE *f = fopen(path[0], "r+b");
    uint32_t name_len = 0;
    int64_t huge[2] = {INT64_MAX, INT64_MAX};
    EXPECT(f && fseek(f, 24, SEEK_SET) == 0 && fread(&name_len, 4, 1, f) == 1 && fseek(f, 24 + 4 + (long)name_len + 8, SEEK_SET) == 0 &&
           fwrite(huge, 8, 2, f) == 2, "patching %s", path[0]);
    if (f) fclose(f);
    status = bnb8_optimizer_load(two[0], path[0]);
    EXPECT(status == BNB8_ERR_FORMAT && strstr(bnb8_last_error(), "impossible element range"), "offset INT64_MAX: status %d, '%s'",
           status, bnb8_last_error());
    // a file with a tensor count of another sharding says so
    bnb8_optimizer *pair = NULL;
    bnb8_config o = sc.c;
    o.shard_total = total;
    EXPECT(bnb8_optimizer_create(&pair, BNB8_ADAMW, &sc.c) == 0 && bnb8_optimizer_override(pair, "w", &o) == 0 &&
           bnb8_optimizer_add(pair, "w", q, BNB8_BF16, g, BNB8_BF16, 4096, NULL) == 0 &&
           bnb8_optimizer_add(pair, "v", q, BNB8_BF16, g, BNB8_BF16, 10, NULL) == 0, "%s", bnb8_last_error());
    status = bnb8_optimizer_load(pair, path[0]);
    EXPECT(status == BNB8_ERR_FORMAT && strstr(bnb8_last_error(), "another sharding"), "tensor count: status %d, '%s'",
           status, bnb8_last_error());
    bnb8_optimizer_free(pair);
    for (int k = 0; k < 2; k++) { bnb8_optimizer_free(two[k]); bnb8_optimizer_free(back[k]); remove(path[k]); }
    bnb8_optimizer_free(three); bnb8_optimizer_free(whole);
    remove(wpath);
    free(p); free(q); free(g); free(master);
}

// Shards that split a block or a group, run past the tensor, or need the whole tensor are refused
// with a message that names the reason; a whole tensor registered as a "shard" of itself is not.
static void test_shard_refused(void) {
    float p[10000] = {0}, g[10000] = {0};
    struct { bnb8_optim kind; int format; int64_t blocksize; int percentile; float max_unorm; int64_t offset, n, total;
             int want; const char *text; } cases[] = {
        {BNB8_ADAMW, BNB8_STATE_8BIT, 256, 100, 0, 100, 1000, 9000, BNB8_ERR_ARG, "splits a block of 256"},
        {BNB8_ADAMW, BNB8_STATE_8BIT, 256, 100, 0, 256, 1000, 9000, BNB8_ERR_ARG, "splits a block of 256"},   // its end
        {BNB8_ADAMW, BNB8_STATE_8BIT, 256, 100, 0, 256, 1024, 9000, BNB8_OK, NULL},
        {BNB8_ADAMW, BNB8_STATE_8BIT, 256, 100, 0, 8960, 40, 9000, BNB8_OK, NULL},                          // the tail
        {BNB8_ADAM, BNB8_STATE_FLASH, 256, 100, 0, 48, 64, 9000, BNB8_ERR_ARG, "splits a group of 32"},
        {BNB8_ADAM, BNB8_STATE_FLASH, 256, 100, 0, 64, 64, 9000, BNB8_OK, NULL},
        {BNB8_ADAMW, BNB8_STATE_8BIT, 256, 100, 0, 8000, 1001, 9000, BNB8_ERR_SIZE, "runs past shard_total 9000"},
        {BNB8_ADAMW, BNB8_STATE_8BIT, 0, 100, 0, 0, 4608, 9000, BNB8_ERR_ARG, "one absmax per tensor"},
        {BNB8_ADAMW, BNB8_STATE_8BIT, 0, 100, 0, 0, 9000, 9000, BNB8_OK, NULL},                             // whole
        {BNB8_ADAMW, BNB8_STATE_32BIT, 256, 95, 0, 0, 4096, 9000, BNB8_ERR_ARG, "percentile clipping"},
        {BNB8_LAMB, BNB8_STATE_32BIT, 256, 100, 1.0f, 0, 4096, 9000, BNB8_ERR_ARG, "trust ratio"},
        {BNB8_LARS, BNB8_STATE_8BIT, 256, 100, 0.02f, 4096, 4904, 9000, BNB8_ERR_ARG, "trust ratio"},
        {BNB8_LARS, BNB8_STATE_8BIT, 256, 100, 0.0f, 4096, 4904, 9000, BNB8_OK, NULL},
        {BNB8_SGD, BNB8_STATE_32BIT, 256, 100, 0, 17, 101, 9000, BNB8_OK, NULL},                           // 32-bit: anywhere
        {BNB8_SGD, BNB8_STATE_8BIT, 256, 100, 0, 17, 101, 3000, BNB8_OK, NULL},                            // under min_8bit_size
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        bnb8_config c = bnb8_config_default(cases[i].kind);
        c.format = (bnb8_state_format)cases[i].format;
        c.blocksize = cases[i].blocksize; c.percentile_clipping = cases[i].percentile; c.max_unorm = cases[i].max_unorm;
        c.shard_offset = cases[i].offset; c.shard_total = cases[i].total;
        bnb8_optimizer *opt = NULL;
        int status = bnb8_optimizer_create(&opt, cases[i].kind, &c);
        if (!status) status = bnb8_optimizer_add(opt, "w", p, BNB8_F32, g, BNB8_F32, cases[i].n, NULL);
        EXPECT(status == cases[i].want && (!cases[i].text || strstr(bnb8_last_error(), cases[i].text)),
               "case %zu: status %d (want %d), '%s'", i, status, cases[i].want, status ? bnb8_last_error() : "");
        if (!status) EXPECT(bnb8_optimizer_step(opt, 1e-3f, 1.0f, NULL) == 0, "case %zu: %s", i, bnb8_last_error());
        bnb8_optimizer_free(opt);
    }
    // the configuration's own check: an offset outside the tensor
    const int64_t bad[][2] = {{-1, 100}, {100, 100}, {5, 0}, {0, -4}, {0, BNB8_MAX_ELEMENTS + 1}};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        bnb8_config c = bnb8_config_default(BNB8_ADAMW);
        c.shard_offset = bad[i][0]; c.shard_total = bad[i][1];
        bnb8_optimizer *opt = NULL;
        int status = bnb8_optimizer_create(&opt, BNB8_ADAMW, &c);
        EXPECT(status == BNB8_ERR_ARG && strstr(bnb8_last_error(), "shard_offset") && !opt, "offset %lld of %lld: status %d",
               (long long)bad[i][0], (long long)bad[i][1], status);
    }
}

// The trainer's layout over NCCL (trainer/tensors.c, shard_layout): every tensor at a multiple of 4096 in G, rank r
// owning [r S, (r + 1) S). Each tensor's parts over the ranks tile it in rank order at multiples of
// 4096 of the tensor; ranks each stepping their parts (the same gradients: the reduce-scatter's mean
// of identical ranks) give the one-optimizer weights bit for bit, 8-bit blocks of 4096 and flash.
static void test_trainer_layout(void) {
    test_rng rng = test_rng_new();
    enum { T = 7 };
    for (int form = 0; form < 2; form++)
        for (int N = 1; N <= MAX_SHARDS; N++) {
            int64_t n[T], at[T], total = 0;
            for (int j = 0; j < T; j++) {
                n[j] = j % 3 == 0 ? 1 + (int64_t)(test_uniform(&rng) * 2000) : 4096 * (int64_t)(test_uniform(&rng) * 6) + 1 + (int64_t)(test_uniform(&rng) * 9000);
                total += n[j];
            }
            int64_t S = shard_layout(n, T, N, at);
            EXPECT(S % 4096 == 0 && S * N >= at[T - 1] + n[T - 1], "N %d: S %lld", N, (long long)S);
            bnb8_config c = bnb8_config_default(BNB8_ADAMW);
            c.format = form ? BNB8_STATE_FLASH : BNB8_STATE_8BIT;
            c.blocksize = 4096;
            bnb8_optimizer *whole = NULL, *rank[MAX_SHARDS] = {0};
            uint16_t *pw = malloc(2 * (size_t)total), *ps = malloc(2 * (size_t)total), *g = malloc(2 * (size_t)total);
            EXPECT(bnb8_optimizer_create(&whole, BNB8_ADAMW, &c) == 0, "%s", bnb8_last_error());
            for (int r = 0; r < N; r++) EXPECT(bnb8_optimizer_create(&rank[r], BNB8_ADAMW, &c) == 0, "%s", bnb8_last_error());
            for (int64_t i = 0; i < total; i++) pw[i] = ps[i] = bnb8_f32_to_bf16((float)(0.1 * test_randn(&rng)));
            int64_t base = 0;
            for (int j = 0; j < T; j++) {
                char name[16];
                snprintf(name, sizeof name, "t%d", j);
                EXPECT(at[j] % 4096 == 0 && (j == 0 || at[j] >= at[j - 1] + n[j - 1]), "N %d: tensor %d at %lld", N, j, (long long)at[j]);
                EXPECT(bnb8_optimizer_add(whole, name, pw + base, BNB8_BF16, g + base, BNB8_BF16, n[j], NULL) == 0, "%s", bnb8_last_error());
                int64_t covered = 0;
                for (int r = 0; r < N; r++) {
                    int64_t off, cnt;
                    if (!shard_part(at[j], n[j], S, r, &off, &cnt)) continue;
                    EXPECT(off == covered && off % 4096 == 0 && ((off + cnt) % 4096 == 0 || off + cnt == n[j]) &&
                           at[j] + off >= r * S && at[j] + off + cnt <= (r + 1) * S, "N %d: tensor %d's part on rank %d: [%lld, +%lld)",
                           N, j, r, (long long)off, (long long)cnt);
                    covered = off + cnt;
                    bnb8_config o = c;
                    if (cnt < n[j]) { o.shard_offset = off; o.shard_total = n[j]; }
                    EXPECT(bnb8_optimizer_override(rank[r], name, &o) == 0 &&
                           bnb8_optimizer_add(rank[r], name, ps + base + off, BNB8_BF16, g + base + off, BNB8_BF16, cnt, NULL) == 0,
                           "N %d, rank %d, %s: %s", N, r, name, bnb8_last_error());
                }
                EXPECT(covered == n[j], "N %d: tensor %d: the ranks hold %lld of %lld elements", N, j, (long long)covered, (long long)n[j]);
                base += n[j];
            }
            for (int s = 0; s < 3 && !test_failures(); s++) {
                for (int64_t i = 0; i < total; i++) g[i] = bnb8_f32_to_bf16((float)(0.01 * test_randn(&rng)));
                EXPECT(bnb8_optimizer_step(whole, 1e-3f, 1.0f, NULL) == 0, "%s", bnb8_last_error());
                for (int r = 0; r < N; r++) EXPECT(bnb8_optimizer_step(rank[r], 1e-3f, 1.0f, NULL) == 0, "%s", bnb8_last_error());
            }
            EXPECT(memcmp(pw, ps, 2 * (size_t)total) == 0, "%s, N %d: the ranks' weights differ from one optimizer's",
                   form ? "flash" : "8-bit 4096", N);
            bnb8_optimizer_free(whole);
            for (int r = 0; r < N; r++) bnb8_optimizer_free(rank[r]);
            free(pw); free(ps); free(g);
        }
}

void tests_shard(void) {
    snprintf(dir, sizeof dir, "/tmp/bnb8_shard_XXXXXX");
    if (!mkdtemp(dir)) { printf("test_shard: mkdtemp failed\n"); return; }
    test_run("shard: N = 1..8 shards of every kind and format step the whole tensor's bits", test_shard_parity);
    test_run("shard: files per shard round-trip; another sharding is refused", test_shard_files);
    test_run("shard: ranges that split a block or need the whole tensor are refused", test_shard_refused);
    test_run("shard: the trainer's NCCL layout tiles every tensor at 4096; N ranks step one optimizer's bits", test_trainer_layout);
    test_remove_tree(dir, 1);
}
