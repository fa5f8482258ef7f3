/*
test_round.c — stochastic rounding of bf16/fp16 weights (cfg.correction_bytes
BNB8_CORRECTION_STOCHASTIC, DESIGN.md §6.6) against the test's own reference: the hash written here
from DESIGN.md §6.6 (splitmix64's finalizer, FNV-1a of the tensor's name, the key of seed, tensor and
step, splitmix64's stream over the whole tensor's element index), and the two neighbours of a value
computed in double from its exponent.

1. One value: every result is one of its two neighbours, the one the random bits choose against the
   dropped fraction (exactly, for edge bits too); representable values never move; over many draws
   the fraction of round-ups is the dropped fraction within a Bernstein bound derived below (fp16's
   deep subnormals within their documented 16-bit resolution); the hash's bits are the documented ones.
2. Optimizers: SGD with momentum over many steps equals the test's own loop (whole tensors, shards,
   a tensor stepped less often, non-finite gradients and round-ups to inf); every kind and state
   format (32-bit, 8-bit, one absmax per tensor, flash, 4-bit, flash4) rounds its step's fp32 result
   as the hash says, against a twin that keeps that result as an fp32 master, and rounds up as
   often as the dropped fractions say; other seeds choose otherwise;
   a resume through a state file is bit-exact whatever seed the new optimizer was made with; files
   of another master are refused naming both; memory, export and import.
3. Quality: on a quadratic whose updates are below half an ulp, nearest rounding without a master
   stalls and stochastic rounding follows exact gradient descent in expectation.
*/
#define BNB8_INTERNAL             // the per-element rounding and hash it checks
#define _POSIX_C_SOURCE 200809L   // mkdtemp
#include "test.h"
#include "bnb8.h"
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static char dir[64];

// ------------------------------------------------------------------------------------------------
// The reference: DESIGN.md §6.6 written out again

static uint64_t ref_identity(const char *name) {                  // FNV-1a, 64 bits
    uint64_t h = 14695981039346656037ull;
    for (size_t i = 0; name[i]; i++) h = (h ^ (uint8_t)name[i]) * 1099511628211ull;
    return h;
}
static uint64_t ref_key(uint64_t seed, uint64_t identity, int64_t step) {
    return test_mix64(test_mix64(test_mix64(seed) + identity) + (uint64_t)step);
}
static uint32_t ref_bits(uint64_t key, int64_t element) {
    return (uint32_t)(test_mix64(key + (uint64_t)element * 0x9e3779b97f4a7c15ull) >> 48);
}

// The value of 16 bits of bf16 or fp16, from the formats' definitions.
static double ref_widen(uint16_t h, bnb8_dtype dt) {
    if (dt == BNB8_BF16) {
        uint32_t u = (uint32_t)h << 16;
        float f;
        memcpy(&f, &u, 4);
        return f;
    }
    int e = (h >> 10) & 31, m = h & 1023;
    double v = e == 31 ? (m ? NAN : INFINITY) : e ? ldexp(1024 + m, e - 25) : ldexp(m, -24);
    return h >> 15 ? -v : v;
}
static double ref_max(bnb8_dtype dt) { return dt == BNB8_BF16 ? ldexp(255.0, 120) : 65504.0; }
static const char *dt_name(bnb8_dtype dt) { return dt == BNB8_BF16 ? "bf16" : "f16"; }

// The neighbours of a finite |x| = ax: lower = ax cut toward zero to the dtype's precision (p
// significant bits, exponents from emin, subnormals below), upper = lower + ulp (past the largest
// finite value: inf). frac: where ax lies between them, in [0, 1), exact (dyadic numbers).
static void ref_neighbours(double ax, bnb8_dtype dt, double *lower, double *ulp, double *frac) {
    int p = dt == BNB8_BF16 ? 8 : 11, emin = dt == BNB8_BF16 ? -126 : -14, e = 0;
    frexp(ax, &e);                                   // ax = f 2^e, f in [0.5, 1): its exponent is e - 1
    int E = ax > 0.0 && e - 1 > emin ? e - 1 : emin;
    *ulp = ldexp(1.0, E - (p - 1));
    *lower = floor(ax / *ulp) * *ulp;
    *frac = (ax - *lower) / *ulp;
}
// x rounded with random bits r: up when r + floor(frac 2^16) >= 2^16 (the 16 bits of the dropped
// fraction the library keeps; all of it for bf16 and fp16 normals), inf above the largest finite.
static double ref_round(float x, bnb8_dtype dt, uint32_t r) {
    double lower, ulp, frac;
    ref_neighbours(fabs((double)x), dt, &lower, &ulp, &frac);
    double v = (double)r + floor(frac * 65536.0) >= 65536.0 ? lower + ulp : lower;
    return copysign(v > ref_max(dt) ? INFINITY : v, (double)x);
}
// The nearest neighbour, ties to the even one (the one whose last mantissa bit is 0).
static double ref_nearest(float x, bnb8_dtype dt) {
    double lower, ulp, frac;
    ref_neighbours(fabs((double)x), dt, &lower, &ulp, &frac);
    int up = frac > 0.5 || (frac == 0.5 && fmod(lower / ulp, 2.0) == 1.0);
    double v = up ? lower + ulp : lower;
    return copysign(v > ref_max(dt) ? INFINITY : v, (double)x);
}
// For the other tests' references (test.h): x rounded as element e of the tensor called name at
// step count step under seed.
double test_round_ref(float x, bnb8_dtype dt, uint64_t seed, const char *name, int64_t step, int64_t e) {
    return ref_round(x, dt, ref_bits(ref_key(seed, ref_identity(name), step), e));
}
// Exact equality of doubles, the sign of zero included.
static int same(double a, double b) { return a == b && signbit(a) == signbit(b); }

// ------------------------------------------------------------------------------------------------
// 1. One value

static float from_bits(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }

// Classes of values: each a range of exponent fields (and a dtype), random mantissa and sign.
typedef struct { const char *name; bnb8_dtype dt; int emin, emax; int exact; } value_class;
static const value_class classes[] = {
    {"bf16 normal", BNB8_BF16, 1, 254, 1},
    {"bf16 of fp32 subnormals", BNB8_BF16, 0, 0, 1},
    {"bf16 near the largest (may round to inf)", BNB8_BF16, 254, 254, 1},
    {"f16 normal", BNB8_F16, 113, 142, 1},
    {"f16 subnormal from 2^-17", BNB8_F16, 110, 112, 1},
    {"f16 subnormal below 2^-17", BNB8_F16, 103, 109, 0},
    {"f16 below its smallest subnormal", BNB8_F16, 80, 102, 0},
    {"f16 from 65504 (may round to inf)", BNB8_F16, 142, 142, 1},
};
enum { NUM_CLASSES = sizeof classes / sizeof classes[0] };

static float draw(const value_class *c, test_rng *g) {
    uint32_t e = c->emin + (uint32_t)(test_u64(g) % (uint64_t)(c->emax - c->emin + 1));
    uint32_t m = (uint32_t)test_u64(g) & 0x7fffffu, sign = (uint32_t)(test_u64(g) & 1) << 31;
    if (c->dt == BNB8_BF16 && c->emin == 254) m |= 0x7f0000u;         // the top bf16 mantissas
    if (c->dt == BNB8_F16 && c->emin == 142) m |= 0x7fe000u;          // [65504, 65536)
    if (test_u64(g) % 4 == 0) {                                       // near a power of two: few bits set
        int k = (int)(test_u64(g) % 3);
        m = k == 0 ? m & 0xffu : k == 1 ? 0x7fffffu - (m & 0xffu) : m & 0x1ffffu;
    }
    return from_bits(sign | e << 23 | m);
}

// The library's rounding of x with bits r, as a value.
static double lib_round(float x, bnb8_dtype dt, uint32_t r) { return ref_widen(bnb8_narrow_stochastic(x, dt, r), dt); }

static void test_rounding_choices(void) {
    test_rng g = test_rng_new();
    int64_t checked = 0;
    for (int c = 0; c < NUM_CLASSES && test_failures() < 10; c++) {
        bnb8_dtype dt = classes[c].dt;
        for (int v = 0; v < 3000; v++) {
            float x = draw(&classes[c], &g);
            double lower, ulp, frac;
            ref_neighbours(fabs((double)x), dt, &lower, &ulp, &frac);
            uint32_t cut = 65536u - (uint32_t)floor(frac * 65536.0);  // the first r that rounds up (65536: none)
            uint32_t rs[12] = {0, 65535, cut > 0 ? cut - 1 : 0, cut < 65536 ? cut : 65535};
            for (int k = 4; k < 12; k++) rs[k] = (uint32_t)(test_u64(&g) >> 48);
            for (int k = 0; k < 12; k++) {
                double got = lib_round(x, dt, rs[k]), want = ref_round(x, dt, rs[k]);
                double up = lower + ulp > ref_max(dt) ? INFINITY : lower + ulp;
                EXPECT(same(got, want) && (fabs(got) == lower || fabs(got) == up), "%s: x = %a (bits %08x), r = %u: "
                       "%a, expected %a (neighbours %a, %a)", classes[c].name, (double)x, bnb8_f32_bits(x), rs[k], got,
                       want, lower, up);
                checked++;
            }
        }
    }
    // Representable values never move, whatever the bits: every bf16 pattern and every finite fp16 one.
    for (uint32_t h = 0; h < 65536; h++) {
        for (int d = 0; d < 2; d++) {
            bnb8_dtype dt = d ? BNB8_F16 : BNB8_BF16;
            double x = ref_widen((uint16_t)h, dt);
            if (!(fabs(x) <= ref_max(dt))) continue;                      // inf and NaN: below
            uint32_t rs[5] = {0, 1, 32768, 65535, (uint32_t)(test_u64(&g) >> 48)};
            for (int k = 0; k < 5; k++) {
                uint16_t got = bnb8_narrow_stochastic((float)x, dt, rs[k]);
                EXPECT(got == h, "%s %04x (%a) with r = %u became %04x", dt_name(dt), h, x, rs[k], got);
            }
        }
        if (test_failures() > 10) break;
    }
    // inf stays inf, NaN stays NaN (quiet, with its sign), for every r.
    for (int d = 0; d < 2; d++) {
        bnb8_dtype dt = d ? BNB8_F16 : BNB8_BF16;
        for (uint32_t r = 0; r < 65536; r += 65535) {
            EXPECT(lib_round(INFINITY, dt, r) == INFINITY && lib_round(-INFINITY, dt, r) == -INFINITY, "%s inf, r %u", dt_name(dt), r);
            double n = lib_round(-NAN, dt, r);
            EXPECT(n != n && signbit(n), "%s -NaN with r %u: %a", dt_name(dt), r, n);
        }
    }
    EXPECT(checked == NUM_CLASSES * 3000 * 12 || test_failures() > 0, "%lld choices checked", (long long)checked);
}

// Over N draws of the library's bits (bnb8_round_bits along one key's stream), the number S of
// round-ups of x. The library rounds up with q = floor(p 2^16) / 2^16 for the dropped fraction p
// (q = p for bf16, fp16 normals and fp16 subnormals from 2^-17: checked; 0 <= p - q < 2^-16 else).
// For independent draws, Bernstein's inequality gives P(|S - N q| >= t) <= 2 exp(-t^2 / (2 (N q (1 - q)
// + t / 3))); at delta = 1e-9 per value, t = L/3 + sqrt(L^2/9 + 2 L N q (1 - q)), L = ln(2 / delta).
// The bar on S against the exact fraction: |S - N p| <= t + N (p - q). Over all values together the
// standardized sum Z = sum (S - N q) / sqrt(sum N q (1 - q)) is within 6 (a normal tail of 2e-9).
static void test_rounding_fractions(void) {
    const int N = 8192, VALUES = 48;
    const double L = log(2.0 / 1e-9);
    test_rng g = test_rng_new();
    double z_num = 0.0, z_var = 0.0, worst = 0.0;
    for (int c = 0; c < NUM_CLASSES; c++) {
        bnb8_dtype dt = classes[c].dt;
        for (int v = 0; v < VALUES; v++) {
            float x = draw(&classes[c], &g);
            double lower, ulp, p;
            ref_neighbours(fabs((double)x), dt, &lower, &ulp, &p);
            double q = floor(p * 65536.0) / 65536.0;
            EXPECT(!classes[c].exact || q == p, "%s: x = %a drops a fraction %a of more than 16 bits", classes[c].name, (double)x, p);
            EXPECT(p - q >= 0.0 && p - q < 0x1p-16, "%s: x = %a: p - q = %a", classes[c].name, (double)x, p - q);
            uint64_t key = test_u64(&g);
            int64_t ups = 0;
            for (int e = 0; e < N; e++) ups += fabs(lib_round(x, dt, bnb8_round_bits(key, e))) > lower;
            double t = L / 3.0 + sqrt(L * L / 9.0 + 2.0 * L * N * q * (1.0 - q)), dev = fabs((double)ups - N * p);
            EXPECT(dev <= t + N * (p - q), "%s: x = %a (fraction %.6f): %lld of %d up, %.1f from N p, bar %.1f",
                   classes[c].name, (double)x, p, (long long)ups, N, dev, t + N * (p - q));
            worst = fmax(worst, dev / (t + N * (p - q)));
            z_num += (double)ups - N * q;
            z_var += N * q * (1.0 - q);
        }
    }
    double z = z_var > 0.0 ? z_num / sqrt(z_var) : 0.0;
    EXPECT(fabs(z) <= 6.0, "all values: standardized sum of round-ups %.2f", z);
    printf("    %d classes x %d values x %d draws: largest deviation %.2f of its bar, standardized sum %+.2f\n",
           NUM_CLASSES, VALUES, N, worst, z);
}

// The library's key and bits are the documented ones (the reference above), the same on every call.
static void test_hash(void) {
    test_rng g = test_rng_new();
    for (int k = 0; k < 100000 && test_failures() < 10; k++) {
        uint64_t seed = test_u64(&g), id = test_u64(&g);
        int64_t step = (int64_t)(test_u64(&g) >> 12), e = (int64_t)(test_u64(&g) >> (k % 2 ? 12 : 40));
        uint64_t key = bnb8_round_key(seed, id, step);
        EXPECT(key == ref_key(seed, id, step) && key == bnb8_round_key(seed, id, step), "key of %llx %llx %lld",
               (unsigned long long)seed, (unsigned long long)id, (long long)step);
        EXPECT(bnb8_round_bits(key, e) == ref_bits(key, e) && bnb8_round_bits(key, e) < 65536u, "bits of element %lld", (long long)e);
    }
    // Neighbouring seeds, steps, tensors and elements give unrelated bits: each of 16 bits flips in
    // about half of 4096 pairs (binomial sd 32: within 6 sd of 2048).
    int flips[4][16] = {{0}};
    for (int k = 0; k < 4096; k++) {
        uint64_t seed = test_u64(&g), id = test_u64(&g);
        int64_t step = (int64_t)(test_u64(&g) >> 20), e = (int64_t)(test_u64(&g) >> 20);
        uint32_t b = ref_bits(ref_key(seed, id, step), e);
        uint32_t o[4] = {bnb8_round_bits(bnb8_round_key(seed + 1, id, step), e), bnb8_round_bits(bnb8_round_key(seed, id + 1, step), e),
                         bnb8_round_bits(bnb8_round_key(seed, id, step + 1), e), bnb8_round_bits(bnb8_round_key(seed, id, step), e + 1)};
        for (int w = 0; w < 4; w++)
            for (int bit = 0; bit < 16; bit++) flips[w][bit] += ((b ^ o[w]) >> bit) & 1;
    }
    const char *what[4] = {"seed", "tensor", "step", "element"};
    for (int w = 0; w < 4; w++)
        for (int bit = 0; bit < 16; bit++)
            EXPECT(abs(flips[w][bit] - 2048) <= 6 * 32, "the next %s flips bit %d in %d of 4096", what[w], bit, flips[w][bit]);
}

// ------------------------------------------------------------------------------------------------
// 2. Optimizers

static const char *path_in(char *p, size_t size, const char *name) {
    snprintf(p, size, "%s/%s", dir, name);
    return p;
}

static bnb8_config sr_config(bnb8_optim kind, bnb8_state_format format, uint64_t seed) {
    bnb8_config c = bnb8_config_default(kind);
    c.format = format;
    c.correction_bytes = BNB8_CORRECTION_STOCHASTIC;
    c.seed = seed;
    return c;
}

// n values s randn into dtype (the library's store: any weights will do as a start).
static void fill(void *x, bnb8_dtype dt, int64_t n, double s, test_rng *g) {
    for (int64_t i = 0; i < n; i++) bnb8_store(x, dt, i, (float)(s * test_randn(g)));
}

// The test's SGD (DESIGN.md §5.3: momentum 0.9, no dampening, no decay, step count t) on narrow
// weights w held as their values, with a 32-bit buffer: the formulas in float as written there, the
// result rounded by ref_round with the test's hash (element offset + i under key). An element whose
// gradient, buffer or rounded result is not finite keeps its weight and buffer and is counted.
static int64_t ref_sgd(float *w, float *buf, const float *g, int64_t n, int64_t offset, bnb8_dtype dt, float lr,
                       uint64_t key, int64_t t) {
    int64_t bad = 0;
    for (int64_t i = 0; i < n; i++) {
        if (!isfinite(g[i])) { bad++; continue; }
        float b = t == 1 ? g[i] : 0.9f * buf[i] + g[i];
        float pn = w[i] - lr * b;
        double v = isfinite(pn) ? ref_round(pn, dt, ref_bits(key, offset + i)) : INFINITY;
        if (!isfinite(v) || !isfinite(b)) { bad++; continue; }
        w[i] = (float)v;
        buf[i] = b;
    }
    return bad;
}

// SGD with momentum, 32-bit buffers, 40 steps on tensor "w" (whole in one optimizer, in three shards
// in three more) and "v" (stepped two steps in three: its own step count), against ref_sgd: every
// weight bit and the non-finite counts. Element 0 of w starts at the largest finite weight and is
// pushed past it each step (a round up to inf: counted and kept; a round down stays); a NaN and an
// inf gradient every 5th step.
static void sgd_case(bnb8_dtype dt, test_rng *g) {
    enum { N = 5000, NV = 777, STEPS = 40 };
    const int64_t cuts[4] = {0, 1000, 3500, N};
    uint64_t seed = test_u64(g);
    bnb8_config c = sr_config(BNB8_SGD, BNB8_STATE_32BIT, seed);
    c.weight_decay = 0.0f;
    c.lr = 0.1f;
    uint16_t w[N], ws[N], v[NV];
    static float rw[N], rb[N], rv[NV], rvb[NV], gw[N], gv[NV];
    fill(w, dt, N, 0.1, g);
    fill(v, dt, NV, 0.1, g);
    w[0] = dt == BNB8_BF16 ? 0x7f7f : 0x7bff;
    memcpy(ws, w, sizeof w);
    for (int64_t i = 0; i < N; i++) { rw[i] = (float)ref_widen(w[i], dt); rb[i] = 0.0f; }
    for (int64_t i = 0; i < NV; i++) { rv[i] = (float)ref_widen(v[i], dt); rvb[i] = 0.0f; }
    bnb8_optimizer *whole = NULL, *part[3] = {NULL, NULL, NULL};
    int ok = bnb8_optimizer_create(&whole, BNB8_SGD, &c) == 0 &&
             bnb8_optimizer_add(whole, "w", w, dt, gw, BNB8_F32, N, NULL) == 0 &&
             bnb8_optimizer_add(whole, "v", v, dt, gv, BNB8_F32, NV, NULL) == 0;
    for (int s = 0; s < 3 && ok; s++) {
        bnb8_config o = c;
        o.shard_offset = cuts[s];
        o.shard_total = N;
        ok = bnb8_optimizer_create(&part[s], BNB8_SGD, &o) == 0 &&
             bnb8_optimizer_add(part[s], "w", ws + cuts[s], dt, gw + cuts[s], BNB8_F32, cuts[s + 1] - cuts[s], NULL) == 0;
    }
    EXPECT(ok, "%s: set up: %s", dt_name(dt), bnb8_last_error());
    int64_t tw = 0, tv = 0, bad = 0, bad_w = 0, got_parts = 0;
    double ulp_max = dt == BNB8_BF16 ? 0x1p120 : 32.0;
    for (int step = 1; ok && step <= STEPS; step++) {
        float lr = (float)(c.lr * (0.55 + 0.45 * cos(3.14159265 * step / STEPS)));
        for (int64_t i = 0; i < N; i++) gw[i] = (float)(0.01 * test_randn(g));
        for (int64_t i = 0; i < NV; i++) gv[i] = (float)(0.01 * test_randn(g));
        gw[0] = (float)(-0.3 * ulp_max / c.lr);   // the buffer's 10 x: 3 ulps past the largest at most
        if (step % 5 == 2) { gw[(7 * step) % N] = NAN; gv[step % NV] = INFINITY; }
        int ids[2] = {0, 1}, count = step % 3 == 0 ? 1 : 2;
        EXPECT(bnb8_optimizer_step_tensors(whole, ids, count, lr, 1.0f, NULL) == 0, "step: %s", bnb8_last_error());
        for (int s = 0; s < 3; s++) EXPECT(bnb8_optimizer_step(part[s], lr, 1.0f, NULL) == 0, "shard step: %s", bnb8_last_error());
        tw++;
        int64_t b = ref_sgd(rw, rb, gw, N, 0, dt, lr, ref_key(seed, ref_identity("w"), tw), tw);
        bad += b;
        bad_w += b;
        if (count == 2) {
            tv++;
            bad += ref_sgd(rv, rvb, gv, NV, 0, dt, lr, ref_key(seed, ref_identity("v"), tv), tv);
        }
    }
    for (int s = 0; ok && s < 3; s++) got_parts += test_take_nonfinite(part[s]);
    if (ok) {
        EXPECT(test_take_nonfinite(whole) == bad && got_parts == bad_w && bad_w > STEPS / 2,
               "%s: non-finite counts %lld (whole) and %lld (shards), expected %lld and %lld", dt_name(dt),
               (long long)bad, (long long)got_parts, (long long)bad, (long long)bad_w);
        EXPECT(bnb8_optimizer_step_count(whole, 1) == tv, "v's step count");
    }
    int64_t miss = 0;
    for (int64_t i = 0; ok && i < N; i++) {
        int bad_i = !same(ref_widen(w[i], dt), rw[i]) || ws[i] != w[i];
        if (bad_i && miss++ < 5) EXPECT(0, "%s: w[%lld] = %a, shard %a, reference %a", dt_name(dt), (long long)i,
                                        ref_widen(w[i], dt), ref_widen(ws[i], dt), (double)rw[i]);
    }
    for (int64_t i = 0; ok && i < NV; i++)
        if (!same(ref_widen(v[i], dt), rv[i]) && miss++ < 5)
            EXPECT(0, "%s: v[%lld] = %a, reference %a", dt_name(dt), (long long)i, ref_widen(v[i], dt), (double)rv[i]);
    EXPECT(miss == 0, "%s: %lld weights differ from the reference", dt_name(dt), (long long)miss);
    bnb8_optimizer_free(whole);
    for (int s = 0; s < 3; s++) bnb8_optimizer_free(part[s]);
}

static void test_sgd_reference(void) {
    test_rng g = test_rng_new();
    sgd_case(BNB8_BF16, &g);
    sgd_case(BNB8_F16, &g);
}

// One step of SGD (no momentum state: its first step, buffer = g) from the same weights under two
// seeds: an element takes different values exactly when the two draws straddle its cut, with
// probability 2 q (1 - q) for its rounded-up probability q (from the test's own fp32 result). The
// count D of such elements has mean E = sum 2 q (1 - q) and variance at most E: |D - E| <= 6 sqrt(E) + 1.
// The same seed gives the same bits.
static void test_seeds(void) {
    enum { N = 20000 };
    test_rng g = test_rng_new();
    static uint16_t w0[N], w[3][N];
    static float gr[N];
    fill(w0, BNB8_BF16, N, 0.1, &g);
    for (int64_t i = 0; i < N; i++) gr[i] = (float)(0.05 * test_randn(&g));
    uint64_t seed = test_u64(&g), seeds[3] = {seed, seed + 1, seed};
    for (int k = 0; k < 3; k++) {
        bnb8_config c = sr_config(BNB8_SGD, BNB8_STATE_32BIT, seeds[k]);
        c.weight_decay = 0.0f;
        bnb8_optimizer *opt = NULL;
        memcpy(w[k], w0, sizeof w0);
        EXPECT(bnb8_optimizer_create(&opt, BNB8_SGD, &c) == 0 && bnb8_optimizer_add(opt, "t", w[k], BNB8_BF16, gr, BNB8_F32, N, NULL) == 0 &&
               bnb8_optimizer_step(opt, c.lr, 1.0f, NULL) == 0, "seed %d: %s", k, bnb8_last_error());
        bnb8_optimizer_free(opt);
    }
    double e = 0.0;
    int64_t d = 0;
    for (int64_t i = 0; i < N; i++) {
        float pn = (float)ref_widen(w0[i], BNB8_BF16) - 1e-2f * gr[i];
        double lower, ulp, frac;
        ref_neighbours(fabs((double)pn), BNB8_BF16, &lower, &ulp, &frac);
        e += 2.0 * frac * (1.0 - frac);
        d += w[0][i] != w[1][i];
    }
    EXPECT(memcmp(w[0], w[2], sizeof w0) == 0, "the same seed gave other bits");
    EXPECT(fabs((double)d - e) <= 6.0 * sqrt(e) + 1.0 && e > 1000.0, "seeds s, s + 1: %lld elements differ, expected %.1f", (long long)d, e);
    printf("    seeds s, s + 1: %lld of %d elements differ (expected %.1f); seed s twice: the same bits\n", (long long)d, N, e);
}

// Every kind and state format: one step of a tensor of bf16/fp16 weights (at a random step count k,
// as a shard or whole) under stochastic rounding, and the same step of a twin that keeps its fp32
// master (correction_bytes 4): from the same weights and zero states the two compute the same fp32
// result, which the twin exports. Every weight must be ref_round of it with the test's hash of
// (seed, the tensor's name, k + 1, offset + i). And the number U of weights rounded up must be
// that of independent choices up with each one's probability q_i (its dropped fraction's top 16
// bits over 2^16, exactly what ref_round takes): mean E = sum q_i, variance sum q_i (1 - q_i) <= E,
// so |U - E| <= 6 sqrt(E) + 1 (a normal tail of 2e-9).
static void twin_case(bnb8_optim kind, bnb8_state_format fmt, int64_t blocksize, bnb8_dtype dt, int shard, test_rng *g) {
    enum { N = 2 * 4096 + 77 };
    const int64_t off = shard ? 4096 : 0;
    char name[32];
    snprintf(name, sizeof name, "h.%d.attn", (int)(test_u64(g) % 1000));
    uint64_t seed = test_u64(g);
    int64_t k = (int64_t)(test_u64(g) % 1000);
    bnb8_config c = sr_config(kind, fmt, seed);
    c.min_8bit_size = 0;
    c.blocksize = blocksize;
    if (shard) { c.shard_offset = off; c.shard_total = off + N; }
    bnb8_config m = c;
    m.correction_bytes = 4;
    static uint16_t w[N], wm[N], gr[N];
    static float pn[N];
    fill(w, dt, N, 0.1, g);
    fill(gr, BNB8_BF16, N, 0.01, g);
    memcpy(wm, w, sizeof w);
    bnb8_optimizer *sr = NULL, *tw = NULL;
    int ok = bnb8_optimizer_create(&sr, kind, &c) == 0 && bnb8_optimizer_create(&tw, kind, &m) == 0 &&
             bnb8_optimizer_add(sr, name, w, dt, gr, BNB8_BF16, N, NULL) == 0 &&
             bnb8_optimizer_add(tw, name, wm, dt, gr, BNB8_BF16, N, NULL) == 0 &&
             bnb8_optimizer_set_step_count(sr, -1, k) == 0 && bnb8_optimizer_set_step_count(tw, -1, k) == 0 &&
             bnb8_optimizer_step(sr, c.lr, 1.0f, NULL) == 0 && bnb8_optimizer_step(tw, c.lr, 1.0f, NULL) == 0 &&
             bnb8_optimizer_export_fp32(tw, 0, pn) == 0;
    const char *fname = fmt == BNB8_STATE_FLASH ? "flash" : fmt == BNB8_STATE_32BIT ? "32-bit" : fmt == BNB8_STATE_4BIT ? "4-bit"
                      : fmt == BNB8_STATE_FLASH4 ? "flash4" : blocksize ? "8-bit" : "8-bit one absmax";
    EXPECT(ok, "kind %d %s %s: %s", (int)kind, fname, dt_name(dt), bnb8_last_error());
    EXPECT(!ok || (test_take_nonfinite(sr) == 0 && test_take_nonfinite(tw) == 0), "kind %d %s: non-finite results", (int)kind, fname);
    uint64_t key = ref_key(seed, ref_identity(name), k + 1);
    int64_t miss = 0, moved = 0, ups = 0;
    double expected_ups = 0.0;
    for (int64_t i = 0; ok && i < N; i++) {
        double want = ref_round(pn[i], dt, ref_bits(key, off + i)), got = ref_widen(w[i], dt), lower, ulp, frac;
        ref_neighbours(fabs((double)pn[i]), dt, &lower, &ulp, &frac);
        expected_ups += floor(frac * 65536.0) / 65536.0;
        ups += fabs(got) > lower;
        moved += w[i] != wm[i];
        if (!same(got, want) && miss++ < 3)
            EXPECT(0, "kind %d %s %s%s, step %lld: w[%lld] = %a, the fp32 result %a rounds to %a", (int)kind, fname, dt_name(dt),
                   shard ? " shard" : "", (long long)k + 1, (long long)i, got, (double)pn[i], want);
    }
    EXPECT(miss == 0, "kind %d %s %s: %lld of %d weights", (int)kind, fname, dt_name(dt), (long long)miss, N);
    EXPECT(!ok || (fabs((double)ups - expected_ups) <= 6.0 * sqrt(expected_ups) + 1.0 && expected_ups > 1000.0),
           "kind %d %s %s: %lld weights rounded up, expected %.1f", (int)kind, fname, dt_name(dt), (long long)ups, expected_ups);
    // the twin's weights are RNE of the same results: most differ from a stochastic choice somewhere
    EXPECT(!ok || moved > 0, "kind %d %s %s: every weight equals the nearest rounding", (int)kind, fname, dt_name(dt));
    bnb8_optimizer_free(sr);
    bnb8_optimizer_free(tw);
}

static void test_every_format(void) {
    test_rng g = test_rng_new();
    for (int d = 0; d < 2; d++) {
        bnb8_dtype dt = d ? BNB8_F16 : BNB8_BF16;
        for (int kind = 0; kind < BNB8_NUM_OPTIMIZERS; kind++) {
            twin_case((bnb8_optim)kind, BNB8_STATE_32BIT, 256, dt, 0, &g);
            twin_case((bnb8_optim)kind, BNB8_STATE_8BIT, 256, dt, 0, &g);
            twin_case((bnb8_optim)kind, BNB8_STATE_8BIT, 0, dt, 0, &g);
            twin_case((bnb8_optim)kind, BNB8_STATE_4BIT, 128, dt, 0, &g);
            if (kind == BNB8_ADAMW || kind == BNB8_ADAM || kind == BNB8_SGD || kind == BNB8_LION) {
                twin_case((bnb8_optim)kind, BNB8_STATE_FLASH, 256, dt, 0, &g);
                twin_case((bnb8_optim)kind, BNB8_STATE_FLASH4, 256, dt, 0, &g);
            }
        }
        for (int f = 0; f < 5; f++) twin_case(BNB8_ADAMW, (bnb8_state_format)f, f == BNB8_STATE_4BIT ? 128 : 256, dt, 1, &g);
    }
}

// The gradients of step s of tensor j: 0.01 randn from a hash of (salt, j, s, i), the same in every run.
static void grads_of(uint16_t *gr, int64_t n, uint64_t salt, int j, int s) {
    uint64_t base = test_mix64(salt ^ test_mix64((uint64_t)j << 32 | (uint64_t)s));
    for (int64_t i = 0; i < n; i++) {
        uint64_t z = test_mix64(base + (uint64_t)i * 0x9e3779b97f4a7c15ull);
        double u1 = ((z >> 11) + 1) * 0x1p-53, u2 = (z & 0xfffff) * 0x1p-20;
        bnb8_store(gr, BNB8_BF16, i, (float)(0.01 * sqrt(-2.0 * log(u1)) * cos(6.283185307179586 * u2)));
    }
}

enum { RA = 3 * 4096 + 5, RB = 1000 };   // "a" (8-bit or flash states), "b" (32-bit: under min_8bit_size)
typedef struct { bnb8_optimizer *opt; uint16_t a[RA], b[RB]; } run;
static uint16_t ga[RA], gb[RB];

// An optimizer of cfg over "a" and "b" (their weights w0), or NULL with a failed check.
static int run_open(run *r, const bnb8_config *c, const uint16_t *a0, const uint16_t *b0, bnb8_dtype dt) {
    memcpy(r->a, a0, sizeof r->a);
    memcpy(r->b, b0, sizeof r->b);
    r->opt = NULL;
    int ok = bnb8_optimizer_create(&r->opt, BNB8_ADAMW, c) == 0 &&
             bnb8_optimizer_add(r->opt, "a", r->a, dt, ga, BNB8_BF16, RA, NULL) == 0 &&
             bnb8_optimizer_add(r->opt, "b", r->b, dt, gb, BNB8_BF16, RB, NULL) == 0;
    EXPECT(ok, "open: %s", bnb8_last_error());
    return ok;
}
static void run_steps(run *r, int from, int to, uint64_t salt) {
    for (int s = from; s <= to; s++) {
        grads_of(ga, RA, salt, 0, s);
        grads_of(gb, RB, salt, 1, s);
        EXPECT(bnb8_optimizer_step(r->opt, 1e-3f * (float)(1.0 + 0.5 * cos(s)), 1.0f, NULL) == 0, "step %d: %s", s, bnb8_last_error());
    }
}

static uint32_t get32(const uint8_t *p) { uint32_t v; memcpy(&v, p, 4); return v; }
static uint64_t get64(const uint8_t *p) { uint64_t v; memcpy(&v, p, 8); return v; }

// Resume (DESIGN.md §7): 12 steps straight, against 5 steps, a save, a load into a fresh optimizer
// created with another seed over other weights, and 7 more steps: the same weights bit for bit and
// the same state file byte for byte. The file is version 4 and its first record holds the seed.
static void resume_case(bnb8_state_format fmt, bnb8_dtype dt, test_rng *g) {
    static uint16_t a0[RA], b0[RB];
    fill(a0, dt, RA, 0.1, g);
    fill(b0, dt, RB, 0.1, g);
    uint64_t seed = test_u64(g), salt = test_u64(g);
    bnb8_config c = sr_config(BNB8_ADAMW, fmt, seed), other = c;
    other.seed = seed ^ 0x5555u;
    static run straight, first, resumed;
    char path[256], p1[256], p3[256];
    path_in(path, sizeof path, "k.bnb8");
    path_in(p1, sizeof p1, "straight.bnb8");
    path_in(p3, sizeof p3, "resumed.bnb8");
    if (!run_open(&straight, &c, a0, b0, dt) || !run_open(&first, &c, a0, b0, dt)) return;
    fill(b0, dt, RB, 1.0, g);                           // the resumed run starts from other weights
    fill(a0, dt, RA, 1.0, g);
    if (!run_open(&resumed, &other, a0, b0, dt)) return;
    run_steps(&straight, 1, 12, salt);
    run_steps(&first, 1, 5, salt);
    EXPECT(bnb8_optimizer_save(first.opt, path) == 0, "save: %s", bnb8_last_error());
    EXPECT(bnb8_optimizer_load(resumed.opt, path) == 0, "load: %s", bnb8_last_error());
    run_steps(&resumed, 6, 12, salt);
    const char *fname = fmt == BNB8_STATE_FLASH ? "flash" : fmt == BNB8_STATE_8BIT ? "8-bit" : "32-bit";
    EXPECT(memcmp(straight.a, resumed.a, sizeof straight.a) == 0 && memcmp(straight.b, resumed.b, sizeof straight.b) == 0,
           "%s %s: the resumed weights differ from the straight run's", fname, dt_name(dt));
    EXPECT(bnb8_optimizer_save(straight.opt, p1) == 0 && bnb8_optimizer_save(resumed.opt, p3) == 0, "save: %s", bnb8_last_error());
    size_t s1 = 0, s3 = 0, sk = 0;
    uint8_t *f1 = test_slurp(p1, &s1), *f3 = test_slurp(p3, &s3), *fk = test_slurp(path, &sk);
    EXPECT(f1 && f3 && s1 == s3 && memcmp(f1, f3, s1) == 0, "%s %s: the state files differ", fname, dt_name(dt));
    // header (24 bytes), then "a": name length, name, n, offset, total, format, states, block, step, seed
    EXPECT(fk && sk > 90 && get32(fk + 8) == 4 && get32(fk + 24) == 1 && ((get32(fk + 53) >> 16) & 0xff) == 0x80 &&
           get64(fk + 69) == 5 && get64(fk + 77) == seed, "%s %s: version %u, format %08x, step %llu, seed %llx (expected 4, "
           "0x80 in bits 16..23, 5, %llx)", fname, dt_name(dt), fk ? get32(fk + 8) : 0, fk ? get32(fk + 53) : 0,
           fk ? (unsigned long long)get64(fk + 69) : 0, fk ? (unsigned long long)get64(fk + 77) : 0, (unsigned long long)seed);
    free(f1);
    free(f3);
    free(fk);
    // Memory: no master, the states of the nearest rounding; export widens, import rounds to nearest.
    bnb8_config nearest = c;
    nearest.correction_bytes = 0;
    static run twin;
    if (run_open(&twin, &nearest, a0, b0, dt)) {
        bnb8_memory ms = bnb8_optimizer_memory(straight.opt, 1), mn = bnb8_optimizer_memory(twin.opt, 1);
        EXPECT(ms.correction == 0.0 && ms.states == mn.states && ms.weights == mn.weights && ms.gradients == mn.gradients &&
               ms.params == mn.params, "%s %s: memory %g %g %g, nearest %g %g %g", fname, dt_name(dt), ms.correction, ms.states,
               ms.weights, mn.correction, mn.states, mn.weights);
        bnb8_optimizer_free(twin.opt);
    }
    static float x[RA];
    for (int64_t i = 0; i < RA; i++) x[i] = -1.0f;        // poison
    EXPECT(bnb8_optimizer_export_fp32(straight.opt, 0, x) == 0, "export: %s", bnb8_last_error());
    for (int64_t i = 0; i < RA; i++)
        if (!same(x[i], ref_widen(straight.a[i], dt))) { EXPECT(0, "export[%lld] = %a of %04x", (long long)i, (double)x[i], straight.a[i]); break; }
    for (int64_t i = 0; i < RA; i++) x[i] = (float)(0.3 * test_randn(g));
    x[0] = dt == BNB8_BF16 ? 1.0f + 0x1p-8f : 1.0f + 0x1p-11f;   // a tie: to the even 1.0
    EXPECT(bnb8_optimizer_import_fp32(straight.opt, 0, x) == 0, "import: %s", bnb8_last_error());
    for (int64_t i = 0; i < RA; i++)
        if (!same(ref_widen(straight.a[i], dt), ref_nearest(x[i], dt))) {
            EXPECT(0, "%s import[%lld] of %a gave %a", dt_name(dt), (long long)i, (double)x[i], ref_widen(straight.a[i], dt));
            break;
        }
    bnb8_optimizer_free(straight.opt);
    bnb8_optimizer_free(first.opt);
    bnb8_optimizer_free(resumed.opt);
    remove(path);
    remove(p1);
    remove(p3);
}

static void test_resume(void) {
    test_rng g = test_rng_new();
    for (int f = 0; f < 3; f++) {
        resume_case((bnb8_state_format)f, BNB8_BF16, &g);
        resume_case((bnb8_state_format)f, BNB8_F16, &g);
    }
}

// Loads path into opt, which must refuse it with a message naming the file and both masters, and
// stay as it was (its state file before and after the attempt are the same bytes).
static void expect_refused(bnb8_optimizer *opt, const char *path, const char *theirs, const char *ours) {
    char before[256], after[256];
    path_in(before, sizeof before, "before.bnb8");
    path_in(after, sizeof after, "after.bnb8");
    EXPECT(bnb8_optimizer_save(opt, before) == 0, "save: %s", bnb8_last_error());
    int status = bnb8_optimizer_load(opt, path);
    const char *msg = bnb8_last_error();
    EXPECT(status == BNB8_ERR_FORMAT && strstr(msg, path) && strstr(msg, theirs) && strstr(msg, ours),
           "load of a file with %s into %s: status %d, '%s'", theirs, ours, status, msg);
    EXPECT(bnb8_optimizer_save(opt, after) == 0, "save: %s", bnb8_last_error());
    size_t sb = 0, sa = 0;
    uint8_t *fb = test_slurp(before, &sb), *fa = test_slurp(after, &sa);
    EXPECT(fb && fa && sb == sa && memcmp(fb, fa, sb) == 0, "the refused load changed the optimizer");
    free(fb);
    free(fa);
    remove(before);
    remove(after);
}

// Files of another master are refused naming both; fp32 weights, another seed after the add, and a
// correction_bytes of no meaning are refused with a message.
static void test_refused(void) {
    test_rng g = test_rng_new();
    enum { N = 5000 };
    static uint16_t w[4][N], gr[N];
    fill(gr, BNB8_BF16, N, 0.01, &g);
    const char *names[4] = {"sr.bnb8", "nearest.bnb8", "flash.bnb8", "flash_sr.bnb8"};
    bnb8_config c[4];
    c[0] = sr_config(BNB8_ADAMW, BNB8_STATE_8BIT, 7);
    c[1] = c[0];
    c[1].correction_bytes = 0;
    c[2] = bnb8_config_default(BNB8_ADAMW);
    c[2].format = BNB8_STATE_FLASH;                     // int8 correction (BNB8_CORRECTION_AUTO)
    c[3] = sr_config(BNB8_ADAMW, BNB8_STATE_FLASH, 7);
    bnb8_optimizer *opt[4] = {NULL, NULL, NULL, NULL};
    char path[4][256];
    for (int k = 0; k < 4; k++) {
        fill(w[k], BNB8_BF16, N, 0.1, &g);
        path_in(path[k], sizeof path[k], names[k]);
        EXPECT(bnb8_optimizer_create(&opt[k], BNB8_ADAMW, &c[k]) == 0 &&
               bnb8_optimizer_add(opt[k], "a", w[k], BNB8_BF16, gr, BNB8_BF16, N, NULL) == 0 &&
               bnb8_optimizer_step(opt[k], 1e-3f, 1.0f, NULL) == 0 && bnb8_optimizer_save(opt[k], path[k]) == 0,
               "%s: %s", names[k], bnb8_last_error());
    }
    const char *sr = "stochastic rounding", *none = "no master (rounded to nearest)", *int8 = "an int8 correction";
    expect_refused(opt[1], path[0], sr, none);
    expect_refused(opt[0], path[1], none, sr);
    expect_refused(opt[3], path[2], int8, sr);
    expect_refused(opt[2], path[3], sr, int8);
    // the seed lays out the rounding: fixed once added, for one tensor or all
    bnb8_config o = c[0];
    o.seed = 8;
    EXPECT(bnb8_optimizer_override(opt[0], "a", &o) == BNB8_ERR_ARG && strstr(bnb8_last_error(), "seed"),
           "another seed for an added tensor: '%s'", bnb8_last_error());
    EXPECT(bnb8_optimizer_override(opt[0], NULL, &o) == BNB8_ERR_ARG && strstr(bnb8_last_error(), "seed"),
           "another seed for every tensor: '%s'", bnb8_last_error());
    EXPECT(bnb8_optimizer_override(opt[0], NULL, &c[0]) == 0, "the optimizer's own configuration: %s", bnb8_last_error());
    for (int k = 0; k < 4; k++) {
        bnb8_optimizer_free(opt[k]);
        remove(path[k]);
    }
    // fp32 weights have nothing to round: refused at the add, naming the tensor
    static float w32[N], g32[N];
    bnb8_optimizer *f = NULL;
    EXPECT(bnb8_optimizer_create(&f, BNB8_ADAMW, &c[0]) == 0, "create: %s", bnb8_last_error());
    int status = bnb8_optimizer_add(f, "fp32 tensor", w32, BNB8_F32, g32, BNB8_F32, N, NULL);
    EXPECT(status == BNB8_ERR_DTYPE && strstr(bnb8_last_error(), "fp32 tensor") && strstr(bnb8_last_error(), "fp32 weights"),
           "fp32 weights: %d '%s'", status, bnb8_last_error());
    EXPECT(bnb8_optimizer_count(f) == 0, "a refused tensor was added");
    bnb8_optimizer_free(f);
    bnb8_config bad = c[0];
    bad.correction_bytes = -3;
    f = NULL;
    EXPECT(bnb8_optimizer_create(&f, BNB8_ADAMW, &bad) == BNB8_ERR_ARG && !f && strstr(bnb8_last_error(), "BNB8_CORRECTION_STOCHASTIC"),
           "correction_bytes -3: '%s'", bnb8_last_error());
}

// ------------------------------------------------------------------------------------------------
// 3. Quality: gradient descent on f(w) = sum (w_i - c)^2 / 2 (gradient w - c), bf16 weights from 1.0
// toward c = 1.5, SGD without momentum at lr = 2^-8, T steps.
// Nearest rounding without a master: a step moves w by lr (c - w) <= 2^-9, less than half an ulp
// (2^-8 in [1, 2)): every weight stays at 1.0 forever (checked exactly).
// Stochastic rounding: w stays in [1, c] (c is a bf16 value, so no upper neighbour passes it), where
// the fp32 result w - lr (w - c) is exact (multiples of 2^-17 below 2) and its rounding unbiased for
// bf16 (up with the exact fraction), so E[w_{t+1} - c | w_t] = (1 - lr)(w_t - c): in expectation the
// exact descent, E[w_T - c] = (1 - lr)^T (w_0 - c). Each rounding adds a variance of at most ulp^2/4
// (ulp = 2^-7), so Var(w_T) <= ulp^2 / (4 lr (2 - lr)); the n elements draw independent bits, and the
// mean of w_T - c over them lies within 6 sqrt(Var / n) of its expectation (a normal tail of 2e-9).
static void test_quadratic(void) {
    enum { N = 4096, T = 256 };
    const double lr = 0x1p-8, target = 1.5, ulp = 0x1p-7;
    test_rng g = test_rng_new();
    static uint16_t w[2][N];
    static float gr[2][N];
    bnb8_optimizer *opt[2] = {NULL, NULL};
    for (int k = 0; k < 2; k++) {
        bnb8_config c = sr_config(BNB8_SGD, BNB8_STATE_32BIT, test_u64(&g));
        c.momentum = 0.0f;
        c.weight_decay = 0.0f;
        c.correction_bytes = k ? 0 : BNB8_CORRECTION_STOCHASTIC;
        for (int64_t i = 0; i < N; i++) w[k][i] = 0x3f80;   // 1.0
        EXPECT(bnb8_optimizer_create(&opt[k], BNB8_SGD, &c) == 0 &&
               bnb8_optimizer_add(opt[k], "q", w[k], BNB8_BF16, gr[k], BNB8_F32, N, NULL) == 0, "%s", bnb8_last_error());
    }
    for (int t = 0; t < T && test_failures() == 0; t++)
        for (int k = 0; k < 2; k++) {
            for (int64_t i = 0; i < N; i++) gr[k][i] = (float)(ref_widen(w[k][i], BNB8_BF16) - target);
            EXPECT(bnb8_optimizer_step(opt[k], (float)lr, 1.0f, NULL) == 0, "step: %s", bnb8_last_error());
        }
    double mean = 0.0, stalled = 0.0;
    for (int64_t i = 0; i < N; i++) {
        mean += (ref_widen(w[0][i], BNB8_BF16) - target) / N;
        stalled += fabs(ref_widen(w[1][i], BNB8_BF16) - 1.0);
    }
    double want = pow(1.0 - lr, T) * (1.0 - target), sd = sqrt(ulp * ulp / (4.0 * lr * (2.0 - lr)) / N);
    EXPECT(stalled == 0.0, "nearest rounding moved the weights (sum of |w - 1| = %g)", stalled);
    EXPECT(fabs(mean - want) <= 6.0 * sd, "stochastic rounding: mean w - c = %.5f after %d steps, expected %.5f +- %.5f",
           mean, T, want, 6.0 * sd);
    printf("    w - c after %d steps: nearest %.4f (stalled), stochastic %.5f (exact descent %.5f, bar %.5f)\n", T,
           1.0 - target, mean, want, 6.0 * sd);
    bnb8_optimizer_free(opt[0]);
    bnb8_optimizer_free(opt[1]);
}

void tests_round(void) {
    snprintf(dir, sizeof dir, "/tmp/bnb8_round_XXXXXX");
    if (!mkdtemp(dir)) { printf("test_round: mkdtemp failed\n"); return; }
    test_run("round: every result a neighbour, chosen by the bits against the dropped fraction; exact values stay",
             test_rounding_choices);
    test_run("round: the fraction of round-ups over many draws is the dropped fraction (Bernstein bound)",
             test_rounding_fractions);
    test_run("round: the key and bits are the documented hash; neighbouring inputs flip half the bits", test_hash);
    test_run("round: SGD on bf16/fp16 weights equals the test's loop (shards, own step counts, overflows)",
             test_sgd_reference);
    test_run("round: another seed changes the expected number of choices, the same seed none", test_seeds);
    test_run("round: every kind and state format (4-bit, flash4 too) rounds its fp32 result as the hash says, up as often as the fractions say",
             test_every_format);
    test_run("round: save, load into an optimizer of another seed, continue: bit-exact; memory, export, import",
             test_resume);
    test_run("round: files of another master, fp32 weights and a changed seed are refused", test_refused);
    test_run("round: a quadratic whose steps are below half an ulp: nearest stalls, stochastic descends", test_quadratic);
    test_remove_tree(dir, 1);
}
