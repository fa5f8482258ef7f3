/*
test_four.c — 4-bit optimizer states (DESIGN.md §5.7), each against an independent reference written
here from DESIGN.md: double precision or brute force, fresh random inputs, every element checked.

  1. The 4-bit maps against their definitions computed here in double (the dynamic construction with
     4 bits; (i + 1)/16; with cfg.map linear, v's map with zero i/15); the nearest code against
     brute force over all 16 codes (the float thresholds of §3 counted one by one, and the nearest
     value by distance) on random values, every threshold and its neighbours, zeros and non-finite
     values, on each of the three maps, by the binary search and by the lookup (every bucket's
     edges, their neighbours and random values inside); the code of a state value (sign kept, zero blocks); the
     companded 4-bit codes of flash4 against their definition and the nearest level by brute force.
  2. The optimizers with 4-bit states (every kind; flash4 for AdamW, Adam, SGD, Lion) against a
     reference loop here: it keeps its own codes and scales, dequantizes, applies §5.3's update in
     float32 with the step constants computed in double as §2 says, requantizes (block maxima,
     rank-1 row and column maxima by brute force, flash4 group scales) and packs nothing: each of
     the library's nibbles (low = even element, an odd n's pad) is read from its state file and
     compared, and so is every weight, absmax, maximum and scale, bit for bit, every step. With v's
     map with zero, and with bf16 weights rounded stochastically (the rounding by test_round.c's
     own reference of DESIGN.md §6.6).
  3. Rank-1 normalization on several matrix shapes (1 x n, n x 1, ...): the maxima equal brute-force
     ones and the dequantized state lies within the map's spacing of the value it came from.
  4. Save, load, continue gives the bytes of never stopping, for every new format, stochastic
     rounding too (into an optimizer of another seed); a file of another block size, matrix shape
     or map is refused; memory accounting against a hand count; misuse refused.
  5. Quality: the zero-excluding map of v keeps every update under a bound derived from the stored
     scales, where v's map with zero (cfg.map linear) exceeds it by orders of magnitude; 4-bit
     AdamW stays within the 8-bit bar of §12 times the ratio of the two signed maps' widest gaps.
*/
#define _POSIX_C_SOURCE 200809L   // mkdtemp
#define BNB8_INTERNAL             // the per-element 4-bit math, held here to its definition
#include "test.h"
#include "bnb8.h"
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <float.h>

static char fdir[64];
static int verbose;
static void fpath(char *path, size_t size, const char *name) { snprintf(path, size, "%s/%s", fdir, name); }

// ------------------------------------------------------------------------------------------------
// 1. Maps, nearest codes, companded codes

// The maps by index: 0 unsigned (cfg.map dynamic), 1 signed (either map), 2 unsigned with zero
// (cfg.map linear, the zero-point ablation).
enum { MAP_UNSIGNED = 0, MAP_SIGNED = 1, MAP_ZERO = 2, NUM_REF_MAPS = 3 };
static float ref_map[NUM_REF_MAPS][16];   // [map index][code], from the definitions in double
static float ref_t[NUM_REF_MAPS][16];     // their float thresholds, t[15] = +inf
static bnb8_four_book ref_book[NUM_REF_MAPS];   // the library's lookups of them (bnb8_four_book_init)
static const char *map_label(int m) { return m == MAP_SIGNED ? "signed" : m == MAP_ZERO ? "unsigned with zero" : "unsigned"; }
// The map index of a state of the given sign under cfg.map.
static int map_index(int is_signed, bnb8_map map) { return is_signed ? MAP_SIGNED : map == BNB8_MAP_LINEAR ? MAP_ZERO : MAP_UNSIGNED; }

static int compare_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

// Signed: per level i = 0..2 the 2^i values 10^(i-2) (0.1 + 0.9 (2k+1)/2^(i+1)) with both signs, 0 and
// 1, ascending (DESIGN.md §3 with 4 bits). Unsigned: (i + 1)/16; with zero: i/15 (the exact quotient
// in double, then rounded to float: no double rounding can meet a float tie, as i/15's bits repeat
// with period 4). Thresholds (c_k + c_{k+1}) * 0.5f.
static void ref_maps_init(void) {
    double v[16];
    int m = 0;
    for (int i = 0; i < 3; i++)
        for (int k = 0; k < (1 << i); k++) {
            double x = pow(10.0, i - 2) * (0.1 + 0.9 * (2.0 * k + 1.0) / pow(2.0, i + 1));
            v[m++] = x;
            v[m++] = -x;
        }
    v[m++] = 0.0;
    v[m++] = 1.0;
    qsort(v, 16, sizeof(double), compare_double);
    for (int c = 0; c < 16; c++) {
        ref_map[1][c] = (float)v[c];
        ref_map[0][c] = (float)((c + 1) / 16.0);
        ref_map[2][c] = (float)(c / 15.0);
    }
    for (int s = 0; s < NUM_REF_MAPS; s++)
        for (int k = 0; k < 16; k++) ref_t[s][k] = k < 15 ? (ref_map[s][k] + ref_map[s][k + 1]) * 0.5f : INFINITY;
    for (int s = 0; s < NUM_REF_MAPS; s++) bnb8_four_book_init(&ref_book[s], ref_map[s]);
}

// The nearest code by brute force: the thresholds strictly below x, counted one by one; x exactly on
// t_k takes the even one of k, k + 1 (DESIGN.md §3). NaN is below nothing: code 0.
static int ref_nearest(int m, float x) {
    int q = 0;
    for (int k = 0; k < 15; k++) q += ref_t[m][k] < x || (ref_t[m][k] == x && (k & 1));
    return q;
}

// The code of a state value s under scale a on map m (DESIGN.md §5.7): the zero code for a = 0;
// else the nearest code of s / a, and a negative s whose code decodes to zero or above takes the
// largest negative code.
static int ref_code(int m, float s, float a) {
    if (!(a > 0.0f)) return m == MAP_SIGNED ? 7 : 0;
    int q = ref_nearest(m, s / a);
    if (m == MAP_SIGNED && s < 0.0f && ref_map[1][q] >= 0.0f) q = 6;
    return q;
}

// bnb8_four_map under both values of cfg.map against the definitions, and the thresholds the library
// makes of it (bnb8_threshold_of) against the reference's: linear changes only the unsigned map, to
// one that holds zero at code 0.
static void test_maps(void) {
    for (int map = 0; map < BNB8_NUM_MAPS; map++)
        for (int s = 0; s < 2; s++) {
            const int m = map_index(s, (bnb8_map)map);
            float lib[16];
            for (int c = 0; c < 16; c++) lib[c] = bnb8_four_map(map, s, c);
            for (int c = 0; c < 16; c++) {
                float t = bnb8_threshold_of(lib, 16, c);
                EXPECT(memcmp(&lib[c], &ref_map[m][c], 4) == 0, "cfg.map %d, %s map code %d: %.9g, definition %.9g", map,
                       map_label(m), c, (double)lib[c], (double)ref_map[m][c]);
                EXPECT(memcmp(&t, &ref_t[m][c], 4) == 0, "%s map threshold %d: %.9g, reference %.9g", map_label(m), c,
                       (double)t, (double)ref_t[m][c]);
                EXPECT(c == 0 || ref_map[m][c - 1] < ref_map[m][c], "%s map not ascending at %d", map_label(m), c);
                EXPECT(m != MAP_UNSIGNED || ref_map[m][c] > 0.0f, "the unsigned map holds a zero at %d", c);
            }
        }
    EXPECT(ref_map[MAP_ZERO][0] == 0.0f && ref_map[MAP_ZERO][15] == 1.0f && bnb8_four_map(BNB8_MAP_LINEAR, 0, 0) == 0.0f,
           "the map with zero: code 0 %g, code 15 %g", (double)ref_map[MAP_ZERO][0], (double)ref_map[MAP_ZERO][15]);
    EXPECT(ref_map[1][bnb8_four_zero_code(1)] == 0.0f && bnb8_four_zero_code(0) == 0, "zero codes %d, %d",
           bnb8_four_zero_code(1), bnb8_four_zero_code(0));
    EXPECT(ref_map[1][15] == 1.0f && ref_map[1][0] == -0.8875f && ref_map[1][6] == -0.0055f, "signed map's ends");
    EXPECT(bnb8_four_pad(BNB8_STATE_4BIT, 1) == 7 && bnb8_four_pad(BNB8_STATE_4BIT, 0) == 0 &&
           bnb8_four_pad(BNB8_STATE_FLASH4, 1) == 0 && bnb8_four_pad(BNB8_STATE_FLASH4, 0) == 0, "pad codes");
}

// The library's nearest code of x against brute force, and against the nearest value by distance: the
// chosen code's value is at most as far from x as any other's, up to the half ulp by which the float
// threshold may miss the true midpoint.
static void check_nearest(int s, float x) {
    int got = bnb8_nearest_code_of(ref_t[s], 16, x), want = ref_nearest(s, x), looked_up = bnb8_four_nearest(&ref_book[s], x);
    EXPECT(got == want, "%s nearest code of %.9g: %d, brute force %d", map_label(s), (double)x, got, want);
    EXPECT(looked_up == want, "%s nearest code of %.9g by the lookup: %d, brute force %d", map_label(s), (double)x,
           looked_up, want);
    if (!(fabsf(x) <= 2.0f)) return;
    double d = fabs((double)x - ref_map[s][got]);
    for (int c = 0; c < 16; c++) {
        double e = fabs((double)x - ref_map[s][c]), slack = ldexp(fabs((double)ref_map[s][c]) + fabs((double)x), -24);
        EXPECT(d <= e + slack, "%s: %.9g takes code %d (%.9g away), code %d is %.9g away", map_label(s),
               (double)x, got, d, c, e);
    }
}

static void test_nearest(void) {
    test_rng rng = test_rng_new();
    for (int s = 0; s < NUM_REF_MAPS; s++) {
        for (int i = 0; i < 200000 && test_failures() < 20; i++) {
            float x = (float)(test_uniform(&rng) * 2.4 - (s == MAP_SIGNED ? 1.2 : 0.2));
            if (i % 4 == 1) x = (float)(ldexp(test_uniform(&rng), -(int)(test_u64(&rng) % 30)) * (s == MAP_SIGNED && i % 8 == 1 ? -1 : 1));
            check_nearest(s, x);
        }
        for (int k = 0; k < 15; k++) {   // every threshold (a tie: the even index) and its neighbours
            float t = ref_t[s][k];
            EXPECT(bnb8_nearest_code_of(ref_t[s], 16, t) == ((k & 1) ? k + 1 : k), "%s: the tie at threshold %d (%.9g) took %d",
                   map_label(s), k, (double)t, bnb8_nearest_code_of(ref_t[s], 16, t));
            float x = t;
            for (int j = 0; j < 4; j++) x = nextafterf(x, -INFINITY), check_nearest(s, x);
            x = t;
            for (int j = 0; j < 4; j++) x = nextafterf(x, INFINITY), check_nearest(s, x);
            check_nearest(s, t);
        }
        // The lookup: its thresholds are the map's, no bucket of these maps is searched, and every
        // bucket's first and last values, their float neighbours and random values inside take
        // the brute-force code (bnb8_four_bucket puts each in its bucket).
        EXPECT(memcmp(ref_book[s].t, ref_t[s], sizeof ref_t[s]) == 0, "%s: the lookup's thresholds", map_label(s));
        for (int b = 0; b < 2 * BNB8_FOUR_LOOKUP_HALF; b++) {
            EXPECT(ref_book[s].entry[b].j < 16, "%s: bucket %d is searched", map_label(s), b);
            const int k = b >> 1, negative = b & 1;
            if (k >= BNB8_FOUR_LOOKUP_HALF - 1) continue;                     // NaN: below
            uint32_t lo = k == 0 ? 0u : k == BNB8_FOUR_LOOKUP_HALF - 2 ? 0x3f800000u
                        : (uint32_t)(k - 1 + BNB8_FOUR_LOOKUP_E0 * 8) << 20;
            uint32_t hi = k == 0 ? (BNB8_FOUR_LOOKUP_E0 << 23) - 1u : k == BNB8_FOUR_LOOKUP_HALF - 2 ? 0x7f800000u : lo + 0xfffffu;
            for (int e = 0; e < 2; e++) {
                uint32_t edge = e ? hi : lo;
                float x = bnb8_bits_f32(edge | (negative ? 0x80000000u : 0u));
                EXPECT(bnb8_four_bucket(x) == b, "%s: %.9g lies in bucket %d, not %d", map_label(s), (double)x,
                       bnb8_four_bucket(x), b);
                check_nearest(s, x);
                check_nearest(s, nextafterf(x, -INFINITY));
                check_nearest(s, nextafterf(x, INFINITY));
            }
            for (int j = 0; j < 20; j++) {
                uint32_t u = lo + (uint32_t)(test_u64(&rng) % ((uint64_t)hi - lo + 1));
                check_nearest(s, bnb8_bits_f32(u | (negative ? 0x80000000u : 0u)));
            }
        }
        EXPECT(bnb8_four_nearest(&ref_book[s], NAN) == 0 && bnb8_four_nearest(&ref_book[s], -NAN) == 0,
               "%s: NaN by the lookup", map_label(s));
        const float special[] = {0.0f, -0.0f, 1e-45f, -1e-45f, 1.0f, -1.0f, 2.0f, -2.0f, INFINITY, -INFINITY};
        for (size_t j = 0; j < sizeof special / sizeof special[0]; j++) check_nearest(s, special[j]);
        EXPECT(bnb8_nearest_code_of(ref_t[s], 16, NAN) == 0 && bnb8_nearest_code_of(ref_t[s], 16, INFINITY) == 15 &&
               bnb8_nearest_code_of(ref_t[s], 16, -INFINITY) == 0, "non-finite values: NaN %d, inf %d, -inf %d",
               bnb8_nearest_code_of(ref_t[s], 16, NAN), bnb8_nearest_code_of(ref_t[s], 16, INFINITY),
               bnb8_nearest_code_of(ref_t[s], 16, -INFINITY));
    }
    // The code of a state value: random values under random scales, with tiny negatives (the sign
    // rule), zeros of both signs and zero scales; on the map with zero, values near zero too.
    int64_t kept = 0, zeros = 0;
    for (int i = 0; i < 300000 && test_failures() < 20; i++) {
        int m = i % 3, s = m == MAP_SIGNED;
        float a = (float)ldexp(0.5 + test_uniform(&rng), (int)(test_u64(&rng) % 60) - 40), x = (float)(test_uniform(&rng) * 2.0 - 1.0) * a;
        if (i % 16 == 3) x = -a * 1e-4f;
        if (i % 16 == 4) x = i % 32 == 4 ? -0.0f : 0.0f;
        if (i % 64 == 6) a = 0.0f;
        if (!s) x = fabsf(x);
        int got = bnb8_four_code(&ref_book[m], s, x, a), want = ref_code(m, x, a);
        EXPECT(got == want, "%s code of %.9g under %.9g: %d, reference %d", map_label(m), (double)x, (double)a, got, want);
        EXPECT(!(x < 0.0f && a > 0.0f) || ref_map[1][got] < 0.0f, "negative %.9g decodes to %g", (double)x, (double)ref_map[1][got]);
        kept += s && x < 0.0f && a > 0.0f && ref_nearest(1, x / a) >= 7;
        zeros += m == MAP_ZERO && a > 0.0f && x > 0.0f && got == 0;   // a positive value stored as zero
    }
    EXPECT(kept > 1000, "the sign rule was met only %lld times", (long long)kept);
    EXPECT(zeros > 1000, "the map with zero coded only %lld positive values to 0", (long long)zeros);
}

// flash4's codes by their definition (DESIGN.md §5.7), in float as written there: signed
// q = floor(7 y + 0.5) of the softsign y = 2z/(1 + |z|), z = x/s, clamped to [-7, 7], as a nibble;
// unsigned k = floor(16 sqrt(x)/s + 0.5) clamped to 1..16, code k - 1. Scale 0, non-finite x: 0.
static int ref_compand4(float x, float scale, int is_signed) {
    if (!(scale > 0.0f) || !(fabsf(x) <= FLT_MAX)) return 0;
    if (is_signed) {
        float z = x / scale, y = (2.0f * z) / (1.0f + fabsf(z)), q = floorf(y * 7.0f + 0.5f);
        q = q < -7.0f ? -7.0f : q > 7.0f ? 7.0f : q;
        return (int)q & 15;
    }
    float root = x > 0.0f ? sqrtf(x) : 0.0f, k = floorf((root / scale) * 16.0f + 0.5f);
    k = k < 1.0f ? 1.0f : k > 16.0f ? 16.0f : k;
    return (int)k - 1;
}
// The value of a flash4 code (DESIGN.md §5.7): y = q/7, z = y/(2 - |y|), x = z s; (((c + 1)/16) s)^2.
static float ref_expand4(int c, float scale, int is_signed) {
    if (is_signed) {
        float y = (float)(c >= 8 ? c - 16 : c) / 7.0f, z = y / (2.0f - fabsf(y));
        return z * scale;
    }
    float w = ((float)(c + 1) * 0.0625f) * scale;
    return w * w;
}

static void test_compand4(void) {
    test_rng rng = test_rng_new();
    for (int i = 0; i < 400000 && test_failures() < 20; i++) {
        int s = i & 1;
        float scale = (float)ldexp(0.5 + test_uniform(&rng), (int)(test_u64(&rng) % 40) - 20);
        float x = s ? (float)(test_uniform(&rng) * 2.0 - 1.0) * scale : (float)(test_uniform(&rng) * scale) * scale;
        if (i % 50 == 3) x = 0.0f;
        if (i % 97 == 5) x = i % 2 ? NAN : INFINITY;
        if (i % 89 == 7) scale = 0.0f;
        int got = bnb8_compand4_value(x, scale, s), want = ref_compand4(x, scale, s);
        EXPECT(got == want, "%s flash4 code of %.9g under %.9g: %d, definition %d", s ? "signed" : "unsigned", (double)x,
               (double)scale, got, want);
        float v = bnb8_expand4_value(got, scale, s), r = ref_expand4(got, scale, s);
        EXPECT(memcmp(&v, &r, 4) == 0, "%s flash4 value of code %d under %.9g: %.9g, definition %.9g", s ? "signed" : "unsigned",
               got, (double)scale, (double)v, (double)r);
        if (!(scale > 0.0f) || !(fabsf(x) <= FLT_MAX)) continue;
        // Brute force: the level of the code is the nearest of all 15 (signed: y in q/7) or 16 (unsigned:
        // the root in (c + 1)/16), up to a float rounding of the companded value.
        double y = s ? 2.0 * (x / (double)scale) / (1.0 + fabs(x / (double)scale)) : sqrt((double)x) / scale;
        double best = INFINITY, mine = s ? fabs(y - (got >= 8 ? got - 16 : got) / 7.0) : fabs(y - (got + 1) / 16.0);
        for (int c = s ? -7 : 0; c <= (s ? 7 : 15); c++) best = fmin(best, fabs(y - (s ? c / 7.0 : (c + 1) / 16.0)));
        EXPECT(mine <= best + 1e-6, "%s flash4 code %d of %.9g: its level is %.3g away, the nearest %.3g", s ? "signed" : "unsigned",
               got, (double)x, mine, best);
    }
}

// ------------------------------------------------------------------------------------------------
// 2. Optimizers against a reference loop

// A tensor as the reference keeps it: its weights (fp32, or bf16 with an int8 correction, or bf16
// rounded stochastically), and per state its codes (one per element, unpacked) and scales: per
// block absmax (4-bit), the rows' then the columns' maxima (a rank-1 state), or per group of 32 the
// stored scale's value (flash4).
typedef struct {
    bnb8_optim kind;
    bnb8_config c;
    int64_t n, rows, cols, t, nonfinite;
    int nstates, rank1_k;         // the rank-1 state, or -1
    int map[3];                   // each state's map index (map_index of its sign and cfg.map)
    bnb8_dtype pdt;               // BNB8_F32, or BNB8_BF16 with an int8 correction or none (sr)
    int sr;                       // cfg.correction_bytes BNB8_CORRECTION_STOCHASTIC: bf16 bits, no correction
    float *p;                     // fp32 weights
    uint16_t *bits;               // bf16 weights
    int8_t *corr;                 // their correction (all 0 under sr)
    int *code[3];
    float *scale[3];
} ref4;

static int ref_signed(bnb8_optim kind, int k) {
    if (kind == BNB8_RMSPROP || kind == BNB8_ADAGRAD) return 0;
    if (kind == BNB8_ADEMAMIX) return k < 2;
    return k == 0;
}
static int ref_nstates(bnb8_optim kind, const bnb8_config *c) {
    if (kind == BNB8_ADAMW || kind == BNB8_ADAM || kind == BNB8_LAMB) return 2;
    if (kind == BNB8_ADEMAMIX) return 3;
    if (kind == BNB8_SGD || kind == BNB8_LARS) return c->momentum != 0.0f;
    return 1;
}
static int64_t ref_nscales(const ref4 *r, int k) {
    if (r->c.format == BNB8_STATE_FLASH4) return (r->n + 31) / 32;
    return k == r->rank1_k ? r->rows + r->cols : (r->n + r->c.blocksize - 1) / r->c.blocksize;
}

static void ref4_init(ref4 *r, bnb8_optim kind, const bnb8_config *c, int64_t n, bnb8_dtype pdt, const float *p0) {
    memset(r, 0, sizeof *r);
    r->kind = kind; r->c = *c; r->n = n; r->pdt = pdt; r->rank1_k = -1;
    r->sr = c->correction_bytes == BNB8_CORRECTION_STOCHASTIC;
    r->nstates = ref_nstates(kind, c);
    for (int k = 0; k < 3; k++) r->map[k] = map_index(ref_signed(kind, k), c->map);
    if (c->row_size > 0) {
        r->cols = c->row_size;
        r->rows = n / c->row_size;
        for (int k = r->nstates - 1; k >= 0; k--) if (!ref_signed(kind, k)) r->rank1_k = k;
    }
    r->p = malloc(sizeof(float) * (size_t)n);
    r->bits = malloc(sizeof(uint16_t) * (size_t)n);
    r->corr = calloc((size_t)n, 1);
    for (int64_t i = 0; i < n; i++) {
        r->p[i] = p0[i];
        r->bits[i] = bnb8_f32_to_bf16(p0[i]);   // the add leaves the correction 0: the bf16 weight is the master
    }
    for (int k = 0; k < r->nstates; k++) {
        r->code[k] = malloc(sizeof(int) * (size_t)n);
        r->scale[k] = calloc((size_t)ref_nscales(r, k), sizeof(float));
        for (int64_t i = 0; i < n; i++) r->code[k][i] = c->format == BNB8_STATE_4BIT && r->map[k] == MAP_SIGNED ? 7 : 0;
    }
}
static void ref4_free(ref4 *r) {
    free(r->p); free(r->bits); free(r->corr);
    for (int k = 0; k < 3; k++) { free(r->code[k]); free(r->scale[k]); }
}

// State k of element i, dequantized: map[code] scale (the block's absmax, or min(row max, column max)),
// or flash4's value under its group's scale.
static float ref4_value(const ref4 *r, int k, int64_t i) {
    int s = ref_signed(r->kind, k), m = r->map[k], c = r->code[k][i];
    if (r->c.format == BNB8_STATE_FLASH4) return ref_expand4(c, r->scale[k][i / 32], s);
    if (k == r->rank1_k) {
        int64_t row = i / r->cols, col = i % r->cols;
        return ref_map[m][c] * fminf(r->scale[k][row], r->scale[k][r->rows + col]);
    }
    return ref_map[m][c] * r->scale[k][i / r->c.blocksize];
}
static float ref4_master(const ref4 *r, int64_t i) {
    return r->pdt == BNB8_F32 ? r->p[i] : bnb8_master_load(r->bits, BNB8_BF16, r->corr, 1, i);
}
// The weight element i keeps of the step's fp32 result pn: itself (fp32 weights; the store of a
// correction rounds it in bnb8_master_store), or under stochastic rounding its bf16 neighbour that
// test_round.c's reference of DESIGN.md §6.6 chooses (tensor "w", this step's count), as a float:
// inf when it rounds past the largest finite bf16.
static float ref4_kept(const ref4 *r, float pn, int64_t i) {
    return r->sr ? (float)test_round_ref(pn, BNB8_BF16, r->c.seed, "w", r->t, i) : pn;
}

// One step's constants (DESIGN.md §2, §5.3): computed in double once, used as floats.
typedef struct {
    float gs, l2, decay, step_size, b1, omb1, b2, omb2, b3, omb3, inv_sqrt_bc2, inv_bc1, eps, alpha, mom, omd;
    int first, nesterov;
} ref_args;
static ref_args ref_args_for(const ref4 *r, float lr, float gnorm_scale) {
    const bnb8_config *c = &r->c;
    double t = (double)r->t, bc1 = 1.0 - pow(c->beta1, t), bc2 = 1.0 - pow(c->beta2, t);
    int decoupled = r->kind == BNB8_ADAMW || r->kind == BNB8_LION || r->kind == BNB8_LAMB || r->kind == BNB8_ADEMAMIX;
    int adam = r->kind == BNB8_ADAMW || r->kind == BNB8_ADAM || r->kind == BNB8_LAMB;
    ref_args a = {0};
    a.gs = gnorm_scale;
    a.l2 = decoupled ? 0.0f : c->weight_decay;
    a.decay = decoupled ? (float)(1.0 - (double)lr * c->weight_decay) : 1.0f;
    a.step_size = (float)(adam ? (double)lr / bc1 : (double)lr);
    a.b1 = c->beta1; a.omb1 = (float)(1.0 - c->beta1);
    a.b2 = r->kind == BNB8_RMSPROP ? c->alpha : c->beta2;
    a.omb2 = (float)(1.0 - (r->kind == BNB8_RMSPROP ? c->alpha : c->beta2));
    a.b3 = c->beta3; a.omb3 = (float)(1.0 - c->beta3);
    a.inv_sqrt_bc2 = (float)(1.0 / sqrt(bc2));
    a.inv_bc1 = (float)(1.0 / bc1);
    a.eps = c->eps; a.alpha = c->alpha; a.mom = c->momentum; a.omd = (float)(1.0 - c->dampening);
    a.first = r->t == 1;
    a.nesterov = c->nesterov;
    return a;
}

// The update direction of §5.3 in float32, in the order DESIGN.md writes it; s[] becomes the new states.
static float ref_direction(bnb8_optim kind, int nstates, const ref_args *a, float p, float g, float s[3]) {
    float gs = g * a->gs;
    if (a->l2 != 0.0f) gs = gs + a->l2 * p;
    switch (kind) {
    case BNB8_ADAMW: case BNB8_ADAM: case BNB8_LAMB:
        s[0] = a->b1 * s[0] + a->omb1 * gs;
        s[1] = a->b2 * s[1] + a->omb2 * (gs * gs);
        return s[0] / (sqrtf(s[1]) * a->inv_sqrt_bc2 + a->eps);
    case BNB8_SGD: case BNB8_LARS:
        if (nstates == 0) return gs;
        s[0] = a->first ? gs : a->mom * s[0] + a->omd * gs;
        return a->nesterov ? gs + a->mom * s[0] : s[0];
    case BNB8_LION: {
        float c = a->b1 * s[0] + a->omb1 * gs;
        s[0] = a->b2 * s[0] + a->omb2 * gs;
        return (float)((c > 0.0f) - (c < 0.0f));
    }
    case BNB8_RMSPROP:
        s[0] = a->b2 * s[0] + a->omb2 * (gs * gs);
        return gs / (sqrtf(s[0]) + a->eps);
    case BNB8_ADAGRAD:
        s[0] = s[0] + gs * gs;
        return gs / (sqrtf(s[0]) + a->eps);
    default:
        s[0] = a->b1 * s[0] + a->omb1 * gs;
        s[1] = a->b3 * s[1] + a->omb3 * gs;
        s[2] = a->b2 * s[2] + a->omb2 * (gs * gs);
        return (s[0] * a->inv_bc1 + a->alpha * s[1]) / (sqrtf(s[2]) * a->inv_sqrt_bc2 + a->eps);
    }
}

// LAMB / LARS: the trust ratio max_unorm |p| / |u| when |u| exceeds it (norms summed in double over the
// weights and the finite gradients' directions from the old states; the library's sums differ in order,
// which moves a double's last bits only).
static float ref_trust(const ref4 *r, const ref_args *a, const float *g) {
    if (!((r->kind == BNB8_LAMB || r->kind == BNB8_LARS) && r->c.max_unorm > 0.0f)) return 1.0f;
    double p2 = 0.0, u2 = 0.0;
    for (int64_t i = 0; i < r->n; i++) {
        float p = r->p[i], s[3] = {0.0f, 0.0f, 0.0f};
        p2 += (double)p * p;
        if (!(fabsf(g[i]) <= FLT_MAX)) continue;
        for (int k = 0; k < r->nstates; k++) s[k] = ref4_value(r, k, i);
        float u = ref_direction(r->kind, r->nstates, a, p, g[i], s);
        u2 += (double)u * u;
    }
    float limit = r->c.max_unorm * sqrtf((float)p2), unorm = sqrtf((float)u2);
    return u2 > 0.0 && unorm > limit ? limit / unorm : 1.0f;
}

// One step of the reference: the update of every element (kept only when its gradient and results are
// finite, else counted), then its new codes and scales.
static void ref4_step(ref4 *r, const float *g, float lr, float gnorm_scale) {
    r->t++;
    ref_args a = ref_args_for(r, lr, gnorm_scale);
    float trust = ref_trust(r, &a, g);
    float *fresh[3];
    for (int k = 0; k < r->nstates; k++) fresh[k] = malloc(sizeof(float) * (size_t)r->n);
    for (int64_t i = 0; i < r->n; i++) {
        float p = ref4_master(r, i), s[3] = {0.0f, 0.0f, 0.0f}, sn[3];
        for (int k = 0; k < r->nstates; k++) s[k] = ref4_value(r, k, i);
        memcpy(sn, s, sizeof sn);
        int take = fabsf(g[i]) <= FLT_MAX;
        float pn = take ? ref4_kept(r, p * a.decay - (a.step_size * trust) * ref_direction(r->kind, r->nstates, &a, p, g[i], sn), i) : p;
        take = take && (r->pdt == BNB8_F32 ? fabsf(pn) <= FLT_MAX : fabsf(pn) < 0x1.ffp127f);
        for (int k = 0; k < r->nstates; k++) take = take && fabsf(sn[k]) <= FLT_MAX;
        r->nonfinite += !take;
        if (take) {
            if (r->pdt == BNB8_F32) r->p[i] = pn;
            else if (r->sr) r->bits[i] = bnb8_f32_to_bf16(pn);   // a bf16 value already: exact
            else bnb8_master_store(r->bits, BNB8_BF16, r->corr, 1, i, pn);
            memcpy(s, sn, sizeof s);
        }
        for (int k = 0; k < r->nstates; k++) fresh[k][i] = s[k];
    }
    for (int k = 0; k < r->nstates; k++) {
        int sg = ref_signed(r->kind, k);
        if (r->c.format == BNB8_STATE_FLASH4) {
            for (int64_t g0 = 0; g0 < r->n; g0 += 32) {
                float amax = 0.0f;
                for (int64_t i = g0; i < g0 + 32 && i < r->n; i++)
                    amax = fmaxf(amax, sg ? fabsf(fresh[k][i]) : fresh[k][i] > 0.0f ? sqrtf(fresh[k][i]) : 0.0f);
                float scale = bnb8_scale_round(amax, r->c.scale_dtype);   // the rounding test_flash holds to e6m10's definition
                r->scale[k][g0 / 32] = scale;
                for (int64_t i = g0; i < g0 + 32 && i < r->n; i++) r->code[k][i] = ref_compand4(fresh[k][i], scale, sg);
            }
        } else if (k == r->rank1_k) {            // brute force: each row's max, each column's max
            for (int64_t row = 0; row < r->rows; row++) {
                float m = 0.0f;
                for (int64_t col = 0; col < r->cols; col++) m = fmaxf(m, fresh[k][row * r->cols + col]);
                r->scale[k][row] = m;
            }
            for (int64_t col = 0; col < r->cols; col++) {
                float m = 0.0f;
                for (int64_t row = 0; row < r->rows; row++) m = fmaxf(m, fresh[k][row * r->cols + col]);
                r->scale[k][r->rows + col] = m;
            }
            for (int64_t i = 0; i < r->n; i++) {
                float a = fminf(r->scale[k][i / r->cols], r->scale[k][r->rows + i % r->cols]);
                r->code[k][i] = ref_code(r->map[k], fresh[k][i], a);
                // The dequantized state lies within half the map's spacing (1/32, or 1/30 with zero) of the
                // value it came from, or below the first level (1/16) for values under it: in double,
                // with a float's slack.
                double x = fresh[k][i], e = fabs((double)ref_map[r->map[k]][r->code[k][i]] * a - x);
                double bound = (r->map[k] == MAP_ZERO ? a / 30.0 : x < a / 16.0 ? a / 16.0 : a / 32.0) + ldexp(a, -22);
                EXPECT(e <= bound, "rank-1 state %d [%lld]: %.9g decodes %.3g away (scale %.9g)", k, (long long)i, x, e, (double)a);
            }
        } else {
            int64_t B = r->c.blocksize;
            for (int64_t b0 = 0; b0 < r->n; b0 += B) {
                float amax = 0.0f;
                for (int64_t i = b0; i < b0 + B && i < r->n; i++) amax = fmaxf(amax, fabsf(fresh[k][i]));
                r->scale[k][b0 / B] = amax;
                for (int64_t i = b0; i < b0 + B && i < r->n; i++) r->code[k][i] = ref_code(r->map[k], fresh[k][i], amax);
            }
        }
        free(fresh[k]);
    }
}

// The library's only tensor from its state file (DESIGN.md §7), checked against the reference: the
// record's fields, then every scale, nibble (low = even element; an odd n's last high nibble the pad)
// and weight. Returns the number of mismatches.
static int64_t lib4_compare(bnb8_optimizer *opt, const ref4 *r, const void *weights, const char *label) {
    char path[256];
    fpath(path, sizeof path, "snap4.bin");
    size_t size = 0;
    uint8_t *f = bnb8_optimizer_save(opt, path) == 0 ? test_slurp(path, &size) : NULL;
    remove(path);
    EXPECT(f != NULL, "%s: save: %s", label, bnb8_last_error());
    if (!f) return 1;
    // the correction's bytes per element, and the format word's field of the master (0x80: stochastic rounding)
    int sg_pad[3], cb = r->pdt == BNB8_F32 || r->sr ? 0 : 1, master = r->sr ? 0x80 : cb;
    int64_t n = r->n, mism = 0;
    size_t ssize = r->c.format == BNB8_STATE_FLASH4 ? bnb8_dtype_size(r->c.scale_dtype) : 4, at = 24, nb = (size_t)(n + 1) / 2;
    uint32_t version, name_len, format, nstates;
    int64_t fn, block, step;
    uint64_t bytes, seed = 0;
    memcpy(&version, f + 8, 4);
    memcpy(&name_len, f + at, 4); at += 4 + name_len;
    memcpy(&fn, f + at, 8); at += version >= 3 ? 24 : 8;   // versions 3, 4: the shard's offset and total
    memcpy(&format, f + at, 4); memcpy(&nstates, f + at + 4, 4); memcpy(&block, f + at + 8, 8); memcpy(&step, f + at + 16, 8);
    at += 24;
    if (version >= 4) { memcpy(&seed, f + at, 8); at += 8; }   // the rounding's seed
    memcpy(&bytes, f + at, 8);
    at += 8;
    uint32_t want_format = (uint32_t)r->c.format | (uint32_t)(r->c.format == BNB8_STATE_FLASH4 ? r->c.scale_dtype : r->c.map) << 8 |
                           (uint32_t)master << 16 | (uint32_t)r->pdt << 24;
    int64_t want_block = r->c.format == BNB8_STATE_FLASH4 ? 32 : r->c.blocksize + r->cols * 65536;
    uint64_t want_bytes = (uint64_t)n * (uint64_t)(cb + bnb8_dtype_size(r->pdt));
    for (int k = 0; k < r->nstates; k++) want_bytes += nb + ssize * (uint64_t)ref_nscales(r, k);
    EXPECT(version == (r->sr ? 4u : 2u) && seed == (r->sr ? r->c.seed : 0), "%s: file version %u, seed %llx", label, version,
           (unsigned long long)seed);
    EXPECT(fn == n && format == want_format && nstates == (uint32_t)r->nstates && block == want_block && step == r->t &&
           bytes == want_bytes && at + bytes + 4 == size,
           "%s: record n %lld format 0x%x states %u block %lld step %lld bytes %llu; expected %lld 0x%x %d %lld %lld %llu",
           label, (long long)fn, format, nstates, (long long)block, (long long)step, (unsigned long long)bytes, (long long)n,
           want_format, r->nstates, (long long)want_block, (long long)r->t, (unsigned long long)want_bytes);
    if (bytes != want_bytes || at + bytes + 4 != size) { free(f); return 1; }
    const uint8_t *d = f + at;
    for (int k = 0; k < r->nstates; k++) {        // the scales of each state
        for (int64_t j = 0; j < ref_nscales(r, k) && mism < 5; j++) {
            float held = 0.0f, v = 0.0f;   // the file's bytes lie unaligned: the scale copied out first
            memcpy(&held, d + ssize * (size_t)j, (size_t)ssize);
            if (r->c.format == BNB8_STATE_FLASH4) v = bnb8_scale_load(&held, r->c.scale_dtype, 0);
            if (r->c.format != BNB8_STATE_FLASH4) memcpy(&v, d + 4 * j, 4);
            int ok = memcmp(&v, &r->scale[k][j], 4) == 0;
            mism += !ok;
            EXPECT(ok, "%s step %lld state %d scale %lld: %.9g, reference %.9g", label, (long long)r->t, k, (long long)j,
                   (double)v, (double)r->scale[k][j]);
        }
        d += ssize * (size_t)ref_nscales(r, k);
        sg_pad[k] = r->c.format == BNB8_STATE_4BIT && r->map[k] == MAP_SIGNED ? 7 : 0;
    }
    const uint8_t *corr = d;
    d += (size_t)(n * cb);
    for (int k = 0; k < r->nstates; k++, d += nb) {   // the nibbles of each state
        for (int64_t i = 0; i < n && mism < 5; i++) {
            int got = (d[i / 2] >> (i % 2 ? 4 : 0)) & 15, ok = got == r->code[k][i];
            mism += !ok;
            EXPECT(ok, "%s step %lld state %d [%lld]: code %d, reference %d (value %.9g)", label, (long long)r->t, k,
                   (long long)i, got, r->code[k][i], (double)ref4_value(r, k, i));
        }
        EXPECT(n % 2 == 0 || d[n / 2] >> 4 == sg_pad[k], "%s state %d: the pad nibble is %d, not %d", label, k, d[n / 2] >> 4, sg_pad[k]);
    }
    for (int64_t i = 0; i < n && mism < 5; i++) {
        int ok = r->pdt == BNB8_F32 ? memcmp((const float *)weights + i, &r->p[i], 4) == 0
               : ((const uint16_t *)weights)[i] == r->bits[i] && (cb == 0 || (int8_t)corr[i] == r->corr[i]);
        mism += !ok;
        EXPECT(ok, "%s step %lld [%lld]: the weight differs from the reference's (%.9g)", label, (long long)r->t, (long long)i,
               (double)ref4_master(r, i));
    }
    free(f);
    return mism;
}

// Gradients of a step: randn of a few scales, with quiet elements (0, or +-1e-10: states exactly 0 and
// tiny ones of both signs) and, at step 3, some non-finite ones.
static void four_grad(float *g, int64_t n, int step, test_rng *rng) {
    for (int64_t i = 0; i < n; i++) {
        double scale = i % 5 == 1 ? 0.1 : i % 7 == 2 ? 1e-3 : 0.01;
        g[i] = i % 29 == 3 ? (step % 2 ? 0.0f : (float)((i % 2 ? 1e-10 : -1e-10) * (1.0 + test_uniform(rng))))
             : (float)(scale * test_randn(rng));
        if (step == 3 && i % 401 == 7) g[i] = i % 3 == 0 ? NAN : i % 3 == 1 ? INFINITY : -INFINITY;
    }
}

// The library and the reference side by side for steps steps, compared after each.
static void four_run(bnb8_optim kind, bnb8_config c, int64_t n, bnb8_dtype pdt, int steps, const char *label) {
    test_rng rng = test_rng_new();
    c.min_8bit_size = 0;
    if (pdt != BNB8_F32 && c.correction_bytes != BNB8_CORRECTION_STOCHASTIC) c.correction_bytes = 1;
    float *p0 = malloc(sizeof(float) * (size_t)n), *g = malloc(sizeof(float) * (size_t)n);
    void *w = malloc(sizeof(float) * (size_t)n);
    for (int64_t i = 0; i < n; i++) {
        p0[i] = i % 29 == 3 ? 0.0f : (float)(0.1 * test_randn(&rng));
        if (pdt == BNB8_F32) ((float *)w)[i] = p0[i];
        else ((uint16_t *)w)[i] = bnb8_f32_to_bf16(p0[i]);
        if (pdt != BNB8_F32) p0[i] = bnb8_bf16_to_f32(((uint16_t *)w)[i]);
    }
    ref4 r;
    ref4_init(&r, kind, &c, n, pdt, p0);
    bnb8_optimizer *opt = NULL;
    int ok = bnb8_optimizer_create(&opt, kind, &c) == BNB8_OK && bnb8_optimizer_add(opt, "w", w, pdt, g, BNB8_F32, n, NULL) == BNB8_OK;
    EXPECT(ok, "%s: create/add: %s", label, bnb8_last_error());
    for (int step = 1; ok && step <= steps; step++) {
        four_grad(g, n, step, &rng);
        float lr = c.lr * (1.0f - 0.05f * (float)step), gnorm = step == 2 ? 0.5f : 1.0f;
        EXPECT(bnb8_optimizer_step(opt, lr, gnorm, NULL) == BNB8_OK, "%s: step: %s", label, bnb8_last_error());
        ref4_step(&r, g, lr, gnorm);
        int64_t bad = test_take_nonfinite(opt);
        EXPECT(bad == r.nonfinite, "%s step %d: %lld elements left unchanged, the reference %lld", label, step, (long long)bad,
               (long long)r.nonfinite);
        r.nonfinite = 0;
        if (lib4_compare(opt, &r, w, label)) break;
    }
    bnb8_optimizer_free(opt);
    ref4_free(&r);
    free(p0); free(g); free(w);
}

static bnb8_config four_cfg(bnb8_optim kind, bnb8_state_format format) {
    bnb8_config c = bnb8_config_default(kind);
    c.format = format;
    c.blocksize = BNB8_BLOCKSIZE_4BIT;
    if (kind == BNB8_ADEMAMIX) { c.t_alpha = 0; c.t_beta3 = 0; }
    return c;
}

static const bnb8_optim all_kinds[] = {BNB8_ADAMW, BNB8_ADAM, BNB8_SGD, BNB8_LION, BNB8_RMSPROP, BNB8_ADAGRAD,
                                       BNB8_LAMB, BNB8_LARS, BNB8_ADEMAMIX};
static const char *kind_label(bnb8_optim kind) {
    const char *names[] = {"adamw", "adam", "sgd", "lion", "rmsprop", "adagrad", "lamb", "lars", "ademamix"};
    return names[kind];
}

// Block-wise 4-bit states, every kind, an odd size with a partial last block; block sizes 64 and
// 4096; SGD with nesterov and without momentum; LAMB and LARS with and without trust ratios; bf16
// weights with an int8 correction.
static void test_four_steps(void) {
    char label[96];
    for (size_t j = 0; j < sizeof all_kinds / sizeof all_kinds[0]; j++) {
        bnb8_config c = four_cfg(all_kinds[j], BNB8_STATE_4BIT);
        snprintf(label, sizeof label, "4-bit %s", kind_label(all_kinds[j]));
        four_run(all_kinds[j], c, 128 * 5 + 37, BNB8_F32, 6, label);
    }
    bnb8_config c = four_cfg(BNB8_ADAMW, BNB8_STATE_4BIT);
    c.blocksize = 64;
    four_run(BNB8_ADAMW, c, 1001, BNB8_F32, 4, "4-bit adamw, blocks of 64");
    c.blocksize = 4096;
    four_run(BNB8_ADAMW, c, 4096 + 333, BNB8_F32, 4, "4-bit adamw, blocks of 4096");
    c = four_cfg(BNB8_ADAMW, BNB8_STATE_4BIT);
    four_run(BNB8_ADAMW, c, 700, BNB8_BF16, 5, "4-bit adamw, bf16 + int8 correction");
    c = four_cfg(BNB8_SGD, BNB8_STATE_4BIT);
    c.nesterov = 1;
    four_run(BNB8_SGD, c, 515, BNB8_F32, 5, "4-bit sgd, nesterov");
    c.momentum = 0.0f; c.nesterov = 0;
    four_run(BNB8_SGD, c, 515, BNB8_F32, 3, "4-bit sgd without momentum");
    c = four_cfg(BNB8_LAMB, BNB8_STATE_4BIT);
    c.max_unorm = 0.0f;
    four_run(BNB8_LAMB, c, 515, BNB8_F32, 4, "4-bit lamb without a trust ratio");
    c = four_cfg(BNB8_LARS, BNB8_STATE_4BIT);
    c.max_unorm = 0.0f;
    four_run(BNB8_LARS, c, 515, BNB8_F32, 4, "4-bit lars without a trust ratio");
}

// The second moment's map with zero (cfg.map linear, the zero-point ablation): every kind with a
// non-negative state, blocks and rank-1, fp32 weights and bf16 + int8; the signed states keep theirs.
static void test_four_zero_map(void) {
    const bnb8_optim kinds[] = {BNB8_ADAMW, BNB8_ADAM, BNB8_RMSPROP, BNB8_ADAGRAD, BNB8_LAMB, BNB8_ADEMAMIX, BNB8_SGD};
    char label[96];
    for (size_t j = 0; j < sizeof kinds / sizeof kinds[0]; j++) {
        bnb8_config c = four_cfg(kinds[j], BNB8_STATE_4BIT);
        c.map = BNB8_MAP_LINEAR;
        snprintf(label, sizeof label, "4-bit %s, v's map with zero", kind_label(kinds[j]));
        four_run(kinds[j], c, 128 * 5 + 37, BNB8_F32, 6, label);
    }
    bnb8_config c = four_cfg(BNB8_ADAMW, BNB8_STATE_4BIT);
    c.map = BNB8_MAP_LINEAR;
    c.row_size = 29;
    four_run(BNB8_ADAMW, c, 29 * 37, BNB8_F32, 5, "rank-1 adamw 37x29, v's map with zero");
    c.row_size = 0;
    four_run(BNB8_ADAMW, c, 700, BNB8_BF16, 5, "4-bit adamw, v's map with zero, bf16 + int8 correction");
}

// 4-bit and flash4 states with bf16 weights rounded stochastically (no master): the reference rounds
// each step's fp32 result with test_round.c's own hash and neighbours; blocks, rank-1, v's map with
// zero, every kind with a flash form, and a seed of all ones.
static void test_four_stochastic(void) {
    const bnb8_optim kinds[] = {BNB8_ADAMW, BNB8_ADAM, BNB8_SGD, BNB8_LION, BNB8_RMSPROP, BNB8_ADEMAMIX};
    char label[96];
    for (size_t j = 0; j < sizeof kinds / sizeof kinds[0]; j++)
        for (int f = 0; f < 2; f++) {
            if (f && (kinds[j] == BNB8_RMSPROP || kinds[j] == BNB8_ADEMAMIX)) continue;   // flash4: kinds with a flash form
            bnb8_config c = four_cfg(kinds[j], f ? BNB8_STATE_FLASH4 : BNB8_STATE_4BIT);
            c.correction_bytes = BNB8_CORRECTION_STOCHASTIC;
            c.seed = 0x1234567u + j;
            snprintf(label, sizeof label, "%s %s, stochastic rounding", f ? "flash4" : "4-bit", kind_label(kinds[j]));
            four_run(kinds[j], c, 128 * 5 + 37, BNB8_BF16, 6, label);
        }
    bnb8_config c = four_cfg(BNB8_ADAMW, BNB8_STATE_4BIT);
    c.correction_bytes = BNB8_CORRECTION_STOCHASTIC;
    c.seed = UINT64_MAX;
    c.row_size = 50;
    four_run(BNB8_ADAMW, c, 50 * 21, BNB8_BF16, 5, "rank-1 adamw 21x50, stochastic rounding");
    c.row_size = 0;
    c.map = BNB8_MAP_LINEAR;
    four_run(BNB8_ADAMW, c, 1001, BNB8_BF16, 5, "4-bit adamw, v's map with zero, stochastic rounding");
}

// Rank-1 normalization of the non-negative state, every kind that has one, on several shapes.
static void test_four_rank1(void) {
    const int64_t shapes[][2] = {{1, 777}, {777, 1}, {7, 13}, {37, 29}, {64, 48}, {3, 1024}};
    const bnb8_optim kinds[] = {BNB8_ADAMW, BNB8_ADAM, BNB8_RMSPROP, BNB8_ADAGRAD, BNB8_LAMB, BNB8_ADEMAMIX};
    char label[96];
    for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; s++)
        for (size_t j = 0; j < sizeof kinds / sizeof kinds[0]; j++) {
            if (s > 1 && s != 4 && j > 0) continue;   // every kind on three shapes, AdamW on all
            bnb8_config c = four_cfg(kinds[j], BNB8_STATE_4BIT);
            c.row_size = shapes[s][1];
            c.blocksize = 64;
            snprintf(label, sizeof label, "rank-1 %s %lldx%lld", kind_label(kinds[j]), (long long)shapes[s][0], (long long)shapes[s][1]);
            four_run(kinds[j], c, shapes[s][0] * shapes[s][1], BNB8_F32, 5, label);
        }
    bnb8_config c = four_cfg(BNB8_ADAMW, BNB8_STATE_4BIT);
    c.row_size = 50;
    four_run(BNB8_ADAMW, c, 50 * 21, BNB8_BF16, 4, "rank-1 adamw 21x50, bf16 + int8 correction");
}

// Flash4: AdamW, Adam, SGD, Lion with fp32 weights and with bf16 weights + int8 correction, each scale dtype.
static void test_flash4_steps(void) {
    const bnb8_optim kinds[] = {BNB8_ADAMW, BNB8_ADAM, BNB8_SGD, BNB8_LION};
    const bnb8_dtype scales[] = {BNB8_E6M10, BNB8_BF16, BNB8_F16, BNB8_F32};
    char label[96];
    for (size_t j = 0; j < 4; j++)
        for (int pdt = 0; pdt < 2; pdt++) {
            bnb8_config c = four_cfg(kinds[j], BNB8_STATE_FLASH4);
            snprintf(label, sizeof label, "flash4 %s %s", kind_label(kinds[j]), pdt ? "bf16 + int8" : "fp32");
            four_run(kinds[j], c, 32 * 20 + 13, pdt ? BNB8_BF16 : BNB8_F32, 6, label);
        }
    for (size_t d = 1; d < 4; d++) {
        bnb8_config c = four_cfg(BNB8_ADAMW, BNB8_STATE_FLASH4);
        c.scale_dtype = scales[d];
        snprintf(label, sizeof label, "flash4 adamw, scales %d", (int)scales[d]);
        four_run(BNB8_ADAMW, c, 32 * 9 + 5, BNB8_BF16, 4, label);
    }
}

// ------------------------------------------------------------------------------------------------
// 4. Files, memory, misuse

// An optimizer of one tensor "w" of n fp32 or bf16 weights p0 (bf16: RNE of them, an int8 correction
// for flash4 and whenever cfg asks), NULL on failure (recorded).
static bnb8_optimizer *four_make(bnb8_optim kind, bnb8_config c, int64_t n, bnb8_dtype pdt, const float *p0, void *w, float *g) {
    bnb8_optimizer *opt = NULL;
    for (int64_t i = 0; i < n; i++) {
        if (pdt == BNB8_F32) ((float *)w)[i] = p0[i];
        else ((uint16_t *)w)[i] = bnb8_f32_to_bf16(p0[i]);
    }
    if (bnb8_optimizer_create(&opt, kind, &c) || bnb8_optimizer_add(opt, "w", w, pdt, g, BNB8_F32, n, NULL)) {
        EXPECT(0, "create/add: %s", bnb8_last_error());
        bnb8_optimizer_free(opt);
        return NULL;
    }
    return opt;
}

// Save after 4 steps, load into a fresh optimizer, 3 more steps each: the same weights and the same
// state file bytes as the run that never stopped. A file of another block size, matrix shape or
// format is refused, naming what differs.
static void resume_case(bnb8_config c, bnb8_dtype pdt, const char *label) {
    const int64_t n = 21 * 50;
    test_rng rng = test_rng_new();
    c.min_8bit_size = 0;
    float *p0 = malloc(sizeof(float) * (size_t)n), *g = malloc(sizeof(float) * (size_t)n), *grads[7];
    void *wa = malloc(4 * (size_t)n), *wb = malloc(4 * (size_t)n);
    for (int64_t i = 0; i < n; i++) p0[i] = (float)(0.1 * test_randn(&rng));
    for (int s = 0; s < 7; s++) {
        grads[s] = malloc(sizeof(float) * (size_t)n);
        four_grad(grads[s], n, s + 10, &rng);
    }
    char mid[256], end_a[256], end_b[256];
    fpath(mid, sizeof mid, "mid.bin"); fpath(end_a, sizeof end_a, "end_a.bin"); fpath(end_b, sizeof end_b, "end_b.bin");
    // Under stochastic rounding the resumed optimizer is made with another seed: the file's must win.
    bnb8_config cb = c;
    if (c.correction_bytes == BNB8_CORRECTION_STOCHASTIC) cb.seed = c.seed ^ 0x5555u;
    bnb8_optimizer *a = four_make(BNB8_ADAMW, c, n, pdt, p0, wa, g), *b = four_make(BNB8_ADAMW, cb, n, pdt, p0, wb, g);
    for (int s = 0; s < 7 && a; s++) {
        memcpy(g, grads[s], sizeof(float) * (size_t)n);
        EXPECT(bnb8_optimizer_step(a, 1e-3f, 1.0f, NULL) == BNB8_OK, "%s: step", label);
        if (s == 3) EXPECT(bnb8_optimizer_save(a, mid) == BNB8_OK, "%s: save: %s", label, bnb8_last_error());
    }
    EXPECT(b && bnb8_optimizer_load(b, mid) == BNB8_OK, "%s: load: %s", label, bnb8_last_error());
    for (int s = 4; s < 7 && b; s++) {
        memcpy(g, grads[s], sizeof(float) * (size_t)n);
        EXPECT(bnb8_optimizer_step(b, 1e-3f, 1.0f, NULL) == BNB8_OK, "%s: step", label);
    }
    size_t sa = 0, sb = 0;
    uint8_t *fa = a && bnb8_optimizer_save(a, end_a) == 0 ? test_slurp(end_a, &sa) : NULL;
    uint8_t *fb = b && bnb8_optimizer_save(b, end_b) == 0 ? test_slurp(end_b, &sb) : NULL;
    EXPECT(fa && fb && sa == sb && memcmp(fa, fb, sa) == 0, "%s: the resumed run's state file differs from the uninterrupted one's", label);
    EXPECT(memcmp(wa, wb, bnb8_dtype_size(pdt) * (size_t)n) == 0, "%s: the resumed run's weights differ", label);
    free(fa); free(fb);
    // Files of another layout are refused with a message that names it.
    bnb8_config other[4] = {c, c, c, c};
    const char *names[4] = {"block size", "row size", "format", "map"};
    const char *words[4] = {"blocks of 128", "row_size 50", "", c.map == BNB8_MAP_LINEAR ? "4-bit linear map" : "4-bit dynamic map"};
    other[0].blocksize = c.format == BNB8_STATE_4BIT ? 256 : c.blocksize;
    other[1].row_size = c.row_size ? 42 : 0;
    other[2].format = c.format == BNB8_STATE_FLASH4 ? BNB8_STATE_4BIT : BNB8_STATE_FLASH4;
    other[2].row_size = 0;
    other[2].map = BNB8_MAP_DYNAMIC;
    if (other[2].format == BNB8_STATE_4BIT && c.correction_bytes != BNB8_CORRECTION_STOCHASTIC)
        other[2].correction_bytes = pdt == BNB8_F32 ? 0 : 1;
    other[3].map = c.map == BNB8_MAP_LINEAR ? BNB8_MAP_DYNAMIC : BNB8_MAP_LINEAR;
    for (int j = 0; j < 4; j++) {
        if ((j == 0 || j == 3) && c.format != BNB8_STATE_4BIT) continue;
        if (j == 1 && !c.row_size) continue;
        bnb8_optimizer *o = four_make(BNB8_ADAMW, other[j], n, pdt, p0, wb, g);
        int status = o ? bnb8_optimizer_load(o, mid) : BNB8_OK;
        const char *msg = bnb8_last_error();
        EXPECT(status == BNB8_ERR_FORMAT, "%s: a file of another %s loaded (%d)", label, names[j], status);
        EXPECT(strstr(msg, words[j]), "%s, another %s: message '%s'", label, names[j], msg);
        bnb8_optimizer_free(o);
    }
    bnb8_optimizer_free(a);
    bnb8_optimizer_free(b);
    for (int s = 0; s < 7; s++) free(grads[s]);
    free(p0); free(g); free(wa); free(wb);
    remove(mid); remove(end_a); remove(end_b);
}

static void test_four_resume(void) {
    bnb8_config c = four_cfg(BNB8_ADAMW, BNB8_STATE_4BIT);
    resume_case(c, BNB8_F32, "4-bit");
    c.row_size = 50;
    c.correction_bytes = 1;
    resume_case(c, BNB8_BF16, "4-bit rank-1, bf16 + int8");
    c = four_cfg(BNB8_ADAMW, BNB8_STATE_FLASH4);
    resume_case(c, BNB8_BF16, "flash4, bf16 + int8");
    c = four_cfg(BNB8_ADAMW, BNB8_STATE_4BIT);
    c.map = BNB8_MAP_LINEAR;
    resume_case(c, BNB8_F32, "4-bit, v's map with zero");
    c.map = BNB8_MAP_DYNAMIC;
    c.correction_bytes = BNB8_CORRECTION_STOCHASTIC;
    c.seed = 77;
    resume_case(c, BNB8_BF16, "4-bit, stochastic rounding");
    c.row_size = 50;
    resume_case(c, BNB8_BF16, "4-bit rank-1, stochastic rounding");
    c = four_cfg(BNB8_ADAMW, BNB8_STATE_FLASH4);
    c.correction_bytes = BNB8_CORRECTION_STOCHASTIC;
    c.seed = 78;
    resume_case(c, BNB8_BF16, "flash4, stochastic rounding");
}

// bnb8_optimizer_memory against a hand count (DESIGN.md §5.7): per state half a byte per value (an
// odd n rounds up) plus 4 bytes per block, 4 per row and column of a rank-1 state, or the scale
// dtype's bytes per group of 32; the correction a byte per value.
static void test_four_memory(void) {
    struct { bnb8_state_format format; int64_t n, row_size; bnb8_dtype pdt; double weights, states, correction; } cases[] = {
        {BNB8_STATE_4BIT, 1000, 0, BNB8_F32, 4000, 2 * (500 + 4 * 8), 0},
        {BNB8_STATE_4BIT, 1001, 0, BNB8_F32, 4004, 2 * (501 + 4 * 8), 0},
        {BNB8_STATE_4BIT, 1000, 50, BNB8_F32, 4000, (500 + 4 * 8) + (500 + 4 * (20 + 50)), 0},
        {BNB8_STATE_FLASH4, 1000, 0, BNB8_BF16, 2000, 2 * (500 + 2 * 32), 1000},
        {BNB8_STATE_FLASH4, 1001, 0, BNB8_BF16, 2002, 2 * (501 + 2 * 32), 1001},
    };
    float *p0 = calloc(2048, sizeof(float)), *g = calloc(2048, sizeof(float));
    void *w = calloc(2048, sizeof(float));
    for (size_t j = 0; j < sizeof cases / sizeof cases[0]; j++) {
        bnb8_config c = four_cfg(BNB8_ADAMW, cases[j].format);
        c.min_8bit_size = 0;
        c.row_size = cases[j].row_size;
        bnb8_optimizer *opt = four_make(BNB8_ADAMW, c, cases[j].n, cases[j].pdt, p0, w, g);
        bnb8_memory m = bnb8_optimizer_memory(opt, 1);
        EXPECT(opt && m.params == cases[j].n && m.weights == cases[j].weights && m.states == cases[j].states &&
               m.correction == cases[j].correction && m.gradients == 4.0 * (double)cases[j].n,
               "case %zu: params %lld weights %g states %g correction %g gradients %g; hand count %g %g %g", j,
               (long long)m.params, m.weights, m.states, m.correction, m.gradients, cases[j].weights, cases[j].states,
               cases[j].correction);
        bnb8_optimizer_free(opt);
    }
    // Under min_8bit_size a tensor keeps 32-bit states: 8 bytes per value for AdamW.
    bnb8_config c = four_cfg(BNB8_ADAMW, BNB8_STATE_4BIT);
    bnb8_optimizer *opt = four_make(BNB8_ADAMW, c, 1000, BNB8_F32, p0, w, g);
    EXPECT(opt && bnb8_optimizer_memory(opt, 0).states == 8000.0, "a small tensor's states: %g bytes",
           bnb8_optimizer_memory(opt, 0).states);
    bnb8_optimizer_free(opt);
    free(p0); free(g); free(w);
}

// What cannot work is refused, naming the field: rank-1 outside the 4-bit format or without a
// non-negative state, a size that is no matrix of its rows, a shard of a rank-1 tensor, an unknown
// map, a map for flash4, one absmax per tensor for 4-bit states, flash4 for the kinds without a flash
// form, a changed row_size or map after the add, stochastic rounding of fp32 weights. A shard of
// 4-bit states steps as its part of the whole tensor.
static void test_four_misuse(void) {
    struct { bnb8_optim kind; bnb8_state_format format; int64_t row_size, blocksize; int map; const char *word; } bad[] = {
        {BNB8_ADAMW, BNB8_STATE_8BIT, 64, 256, 0, "row_size"},
        {BNB8_ADAMW, BNB8_STATE_FLASH4, 64, 128, 0, "row_size"},
        {BNB8_SGD, BNB8_STATE_4BIT, 64, 128, 0, "row_size"},
        {BNB8_LION, BNB8_STATE_4BIT, 64, 128, 0, "row_size"},
        {BNB8_ADAMW, BNB8_STATE_4BIT, -1, 128, 0, "row_size"},
        {BNB8_ADAMW, BNB8_STATE_4BIT, 0, 0, 0, "blocksize 0"},
        {BNB8_ADAMW, BNB8_STATE_4BIT, 0, 100, 0, "blocksize"},
        {BNB8_ADAMW, BNB8_STATE_4BIT, 0, 128, 2, "unknown map"},
        {BNB8_ADAMW, BNB8_STATE_FLASH4, 0, 128, BNB8_MAP_LINEAR, "flash4 states have companded codes"},
        {BNB8_RMSPROP, BNB8_STATE_FLASH4, 0, 128, 0, "flash4"},
    };
    for (size_t j = 0; j < sizeof bad / sizeof bad[0]; j++) {
        bnb8_config c = four_cfg(bad[j].kind, bad[j].format);
        c.row_size = bad[j].row_size;
        c.blocksize = bad[j].blocksize;
        c.map = (bnb8_map)bad[j].map;
        bnb8_optimizer *opt = NULL;
        int status = bnb8_optimizer_create(&opt, bad[j].kind, &c);
        EXPECT(status != BNB8_OK && opt == NULL && strstr(bnb8_last_error(), bad[j].word), "case %zu: created (%d), message '%s'",
               j, status, bnb8_last_error());
        bnb8_optimizer_free(opt);
    }
    float p[4096] = {0}, g[4096] = {0}, q[4096] = {0};
    bnb8_config c = four_cfg(BNB8_ADAMW, BNB8_STATE_4BIT);
    c.min_8bit_size = 0;
    c.row_size = 100;
    bnb8_optimizer *opt = NULL;
    EXPECT(bnb8_optimizer_create(&opt, BNB8_ADAMW, &c) == BNB8_OK, "create: %s", bnb8_last_error());
    EXPECT(bnb8_optimizer_add(opt, "odd", p, BNB8_F32, g, BNB8_F32, 1050, NULL) == BNB8_ERR_ARG &&
           strstr(bnb8_last_error(), "row_size 100"), "1050 elements in rows of 100: %s", bnb8_last_error());
    bnb8_config shard = c;
    shard.shard_offset = 0;
    shard.shard_total = 2000;
    EXPECT(bnb8_optimizer_override(opt, "part", &shard) == BNB8_OK &&
           bnb8_optimizer_add(opt, "part", p, BNB8_F32, g, BNB8_F32, 1000, NULL) == BNB8_ERR_ARG &&
           strstr(bnb8_last_error(), "rank-1"), "a shard of a rank-1 tensor: %s", bnb8_last_error());
    EXPECT(bnb8_optimizer_add(opt, "m", p, BNB8_F32, g, BNB8_F32, 2000, NULL) == BNB8_OK, "add: %s", bnb8_last_error());
    bnb8_config changed = c;
    changed.row_size = 200;
    EXPECT(bnb8_optimizer_override(opt, "m", &changed) == BNB8_ERR_ARG && strstr(bnb8_last_error(), "row_size"),
           "row_size changed after the add: %s", bnb8_last_error());
    changed = c;
    changed.map = BNB8_MAP_LINEAR;
    EXPECT(bnb8_optimizer_override(opt, "m", &changed) == BNB8_ERR_ARG && strstr(bnb8_last_error(), "map"),
           "the map changed after the add: %s", bnb8_last_error());
    bnb8_optimizer_free(opt);
    // 4-bit states round fp32 weights no more than other states: nothing to round, refused at the add.
    bnb8_config sr = four_cfg(BNB8_ADAMW, BNB8_STATE_4BIT);
    sr.correction_bytes = BNB8_CORRECTION_STOCHASTIC;
    opt = NULL;
    EXPECT(bnb8_optimizer_create(&opt, BNB8_ADAMW, &sr) == BNB8_OK &&
           bnb8_optimizer_add(opt, "fp32 w", p, BNB8_F32, g, BNB8_F32, 4096, NULL) == BNB8_ERR_DTYPE &&
           strstr(bnb8_last_error(), "'fp32 w' has fp32 weights"), "4-bit, stochastic rounding of fp32 weights: %s", bnb8_last_error());
    bnb8_optimizer_free(opt);
    // Two shards of 4-bit states stepped apart give the whole tensor's weights; one that splits a block is refused.
    c.row_size = 0;
    test_rng rng = test_rng_new();
    for (int i = 0; i < 4096; i++) p[i] = q[i] = (float)(0.1 * test_randn(&rng));
    bnb8_optimizer *whole = NULL, *part[2] = {NULL, NULL};
    int ok = bnb8_optimizer_create(&whole, BNB8_ADAMW, &c) == BNB8_OK && bnb8_optimizer_add(whole, "w", p, BNB8_F32, g, BNB8_F32, 3001, NULL) == 0;
    for (int r = 0; r < 2; r++) {
        shard = c;
        shard.shard_offset = r ? 1024 : 0;
        shard.shard_total = 3001;
        ok = ok && bnb8_optimizer_create(&part[r], BNB8_ADAMW, &c) == BNB8_OK && bnb8_optimizer_override(part[r], "w", &shard) == 0 &&
             bnb8_optimizer_add(part[r], "w", q + shard.shard_offset, BNB8_F32, g + shard.shard_offset, BNB8_F32, r ? 1977 : 1024, NULL) == 0;
    }
    EXPECT(ok, "shards: %s", bnb8_last_error());
    for (int step = 0; ok && step < 4; step++) {
        four_grad(g, 3001, step + 1, &rng);
        ok = bnb8_optimizer_step(whole, 1e-3f, 1.0f, NULL) == 0 && bnb8_optimizer_step(part[0], 1e-3f, 1.0f, NULL) == 0 &&
             bnb8_optimizer_step(part[1], 1e-3f, 1.0f, NULL) == 0;
    }
    EXPECT(ok && memcmp(p, q, sizeof(float) * 3001) == 0, "two shards' weights differ from the whole tensor's");
    bnb8_optimizer_free(whole);
    bnb8_optimizer_free(part[0]);
    bnb8_optimizer_free(part[1]);
    shard = c;
    shard.shard_offset = 64;
    shard.shard_total = 3001;
    EXPECT(bnb8_optimizer_create(&opt, BNB8_ADAMW, &c) == BNB8_OK && bnb8_optimizer_override(opt, "w", &shard) == 0 &&
           bnb8_optimizer_add(opt, "w", q + 64, BNB8_F32, g + 64, BNB8_F32, 1024, NULL) == BNB8_ERR_ARG &&
           strstr(bnb8_last_error(), "block of 128"), "a shard inside a block: %s", bnb8_last_error());
    bnb8_optimizer_free(opt);
}

// ------------------------------------------------------------------------------------------------
// 5. Quality

// The zero-point problem (Li et al.): a block of v holds one large value and small ones; a map with
// 0 decodes the small ones to 0, and an element whose gradient then is 0 divides its m by eps alone.
// The zero-excluding map decodes them to at least absmax/16, so every update of AdamW (weight decay
// 0) is bounded by what the stored scales allow: with m_old at most a_m, v_old at least a_v / 16,
//   |dp| <= step_size (beta1 a_m + (1 - beta1) |g|) / (sqrt(beta2 a_v / 16) / sqrt(bc2) + eps).
// The library holds every element under that bound (less the float rounding of the stored weight,
// half an ulp of it, and 1e-5 for the float evaluation of the update); the same run with v's map
// with zero (cfg.map linear, c/15: its codes checked against the reference in test_four_zero_map)
// exceeds its own bound by more than 1000x: the ablation shows the problem.
static void zero_point_scales(bnb8_optimizer *opt, int64_t blocks, float *am, float *av) {
    char path[256];
    fpath(path, sizeof path, "zero.bin");
    size_t size = 0;
    uint8_t *f = bnb8_optimizer_save(opt, path) == 0 ? test_slurp(path, &size) : NULL;
    remove(path);
    EXPECT(f && size > 24 + 4 + 1 + 40 + 8 * (size_t)blocks, "save: %s", bnb8_last_error());
    if (!f) return;
    size_t at = 24 + 4 + 1 + 40;   // header, name length, the name "w", the fields
    memcpy(am, f + at, 4 * (size_t)blocks);
    memcpy(av, f + at + 4 * (size_t)blocks, 4 * (size_t)blocks);
    free(f);
}

static void test_zero_point(void) {
    const int64_t B = 128, n = 64 * B, blocks = n / B;
    bnb8_config c = four_cfg(BNB8_ADAMW, BNB8_STATE_4BIT);
    c.min_8bit_size = 0;
    c.weight_decay = 0.0f;
    test_rng rng = test_rng_new();
    float *p0 = malloc(sizeof(float) * (size_t)n), *g = malloc(sizeof(float) * (size_t)n), *p[2], *before[2], *am[2], *av[2];
    bnb8_optimizer *opt[2];
    for (int64_t i = 0; i < n; i++) p0[i] = (float)(0.1 * test_randn(&rng));
    for (int z = 0; z < 2; z++) {   // z = 1: v's map with zero
        bnb8_config cz = c;
        cz.map = z ? BNB8_MAP_LINEAR : BNB8_MAP_DYNAMIC;
        p[z] = malloc(sizeof(float) * (size_t)n);
        before[z] = malloc(sizeof(float) * (size_t)n);
        am[z] = calloc((size_t)blocks, sizeof(float));
        av[z] = calloc((size_t)blocks, sizeof(float));
        opt[z] = four_make(BNB8_ADAMW, cz, n, BNB8_F32, p0, p[z], g);
    }
    double worst[2] = {0.0, 0.0};
    for (int t = 1; opt[0] && opt[1] && t <= 8; t++) {
        for (int64_t i = 0; i < n; i++)
            g[i] = i % B == 0 ? (float)test_randn(&rng) : (t % 2 == 0 && i % 2) ? 0.0f : (float)(0.05 * test_randn(&rng));
        double bc1 = 1.0 - pow(c.beta1, t), bc2 = 1.0 - pow(c.beta2, t), step_size = 1e-3 / bc1;
        for (int z = 0; z < 2; z++) {
            memcpy(before[z], p[z], sizeof(float) * (size_t)n);
            EXPECT(bnb8_optimizer_step(opt[z], 1e-3f, 1.0f, NULL) == BNB8_OK, "step: %s", bnb8_last_error());
            for (int64_t i = 0; i < n && t > 1; i++) {
                int64_t b = i / B;
                double bound = step_size * (c.beta1 * am[z][b] + (1.0 - c.beta1) * fabs(g[i])) /
                               (sqrt(c.beta2 * av[z][b] / 16.0) / sqrt(bc2) + c.eps);
                // the stored weight is the update rounded to float: up to half an ulp of p beyond it
                double rounding = ldexp(fmax(fabs((double)p[z][i]), fabs((double)before[z][i])), -24);
                worst[z] = fmax(worst[z], fmax(fabs((double)p[z][i] - before[z][i]) - rounding, 0.0) / bound);
            }
            zero_point_scales(opt[z], blocks, am[z], av[z]);   // the scales after the step
        }
    }
    if (verbose) printf("    zero point: library %.3g of the bound, v's map with zero %.3g\n", worst[0], worst[1]);
    EXPECT(worst[0] > 0.0 && worst[0] <= 1.0 + 1e-5, "the library's updates reach %.6g of the bound", worst[0]);
    EXPECT(worst[1] > 1000.0, "v's map with zero reaches only %.3g of the bound", worst[1]);
    for (int z = 0; z < 2; z++) {
        bnb8_optimizer_free(opt[z]);
        free(p[z]); free(before[z]); free(am[z]); free(av[z]);
    }
    free(p0); free(g);
}

// 4-bit AdamW free running against 32-bit AdamW (§12's run: p = 0.1 randn, g = 0.01 randn, 100 steps,
// lr 1e-3; 2^16 elements here): the 8-bit format's bar, mean |dp| <= 2.5e-4, scaled by how much
// coarser the 4-bit signed map is than the 8-bit one, the ratio of their widest gaps (16). Rank-1
// normalization and flash4 are held to the same bar.
static void test_four_vs_32bit(void) {
    const int64_t n = 1 << 16;
    float code8[256];
    bnb8_map_dynamic(1, code8);
    double gap8 = 0.0, gap4 = 0.0;
    for (int k = 0; k < 255; k++) gap8 = fmax(gap8, (double)code8[k + 1] - code8[k]);
    for (int k = 0; k < 15; k++) gap4 = fmax(gap4, (double)ref_map[1][k + 1] - ref_map[1][k]);
    double bar = 2.5e-4 * gap4 / gap8;
    test_rng rng = test_rng_new();
    float *p0 = malloc(sizeof(float) * (size_t)n), *g = malloc(sizeof(float) * (size_t)n), *w[4];
    bnb8_optimizer *o[4];
    const char *names[4] = {"32-bit", "4-bit", "4-bit rank-1", "flash4"};
    for (int64_t i = 0; i < n; i++) p0[i] = (float)(0.1 * test_randn(&rng));
    for (int j = 0; j < 4; j++) {
        bnb8_config c = four_cfg(BNB8_ADAMW, j == 0 ? BNB8_STATE_32BIT : j == 3 ? BNB8_STATE_FLASH4 : BNB8_STATE_4BIT);
        c.min_8bit_size = 0;
        c.row_size = j == 2 ? 256 : 0;
        w[j] = malloc(sizeof(float) * (size_t)n);
        o[j] = four_make(BNB8_ADAMW, c, n, BNB8_F32, p0, w[j], g);
    }
    for (int t = 0; t < 100 && o[0] && o[1] && o[2] && o[3]; t++) {
        for (int64_t i = 0; i < n; i++) g[i] = (float)(0.01 * test_randn(&rng));
        for (int j = 0; j < 4; j++) EXPECT(bnb8_optimizer_step(o[j], 1e-3f, 1.0f, NULL) == BNB8_OK, "step: %s", bnb8_last_error());
    }
    for (int j = 1; j < 4; j++) {
        double d = 0.0;
        for (int64_t i = 0; i < n; i++) d += fabs((double)w[j][i] - w[0][i]);
        d /= (double)n;
        if (verbose) printf("    %s: mean |p - p32| %.3g (bar %.3g)\n", names[j], d, bar);
        EXPECT(d <= bar, "%s AdamW is %.3g from 32-bit AdamW on average, the bar %.3g", names[j], d, bar);
    }
    for (int j = 0; j < 4; j++) { bnb8_optimizer_free(o[j]); free(w[j]); }
    free(p0); free(g);
}

void tests_four(void) {
    verbose = getenv("BNB8_TEST_VERBOSE") != NULL;
    snprintf(fdir, sizeof fdir, "/tmp/bnb8_four_XXXXXX");
    if (!mkdtemp(fdir)) { printf("test_four: mkdtemp failed\n"); return; }
    ref_maps_init();
    test_run("four: the 4-bit maps against their definitions", test_maps);
    test_run("four: nearest 4-bit codes against brute force", test_nearest);
    test_run("four: flash4 codes against their definition and brute force", test_compand4);
    test_run("four: 4-bit optimizers against a reference loop, every kind", test_four_steps);
    test_run("four: rank-1 4-bit states against a brute-force reference", test_four_rank1);
    test_run("four: v's map with zero (cfg.map linear) against a reference loop", test_four_zero_map);
    test_run("four: 4-bit and flash4 states with stochastic rounding against a reference loop", test_four_stochastic);
    test_run("four: flash4 optimizers against a reference loop", test_flash4_steps);
    test_run("four: save, load, continue is bit-exact; other layouts are refused", test_four_resume);
    test_run("four: memory of 4-bit states against a hand count", test_four_memory);
    test_run("four: misuse refused; shards of 4-bit states", test_four_misuse);
    test_run("four: the zero-excluding map bounds every update, the map with zero does not (zero-point problem)", test_zero_point);
    test_run("four: 4-bit AdamW within a derived distance of 32-bit AdamW", test_four_vs_32bit);
    test_remove_tree(fdir, 1);
}
