// test_quant.c — maps, nearest-code rule, 16-bit conversions and block-wise quantization
// (DESIGN.md §2-§4, bars of §12).
// Every check compares the library with a reference written here independently: exact formulas in
// double, brute-force loops, the golden tables in test/data. Set BNB8_TEST_VERBOSE=1 to print the
// measured round-trip errors.
#define BNB8_INTERNAL             // the codebook and the nearest-code and 16-bit conversion functions it checks
#include "test.h"
#include "bnb8.h"
#include <stdlib.h>
#include <string.h>
#include <float.h>

// ------------------------------------------------------------------------------------------------
// Helpers

static const bnb8_dtype all_dtypes[3] = {BNB8_F32, BNB8_F16, BNB8_BF16};

static const char *dtype_name(bnb8_dtype d) { return d == BNB8_F32 ? "f32" : d == BNB8_F16 ? "f16" : "bf16"; }
static size_t dtype_bytes(bnb8_dtype d) { return d == BNB8_F32 ? 4 : 2; }

static uint32_t fbits(float x) { uint32_t u; memcpy(&u, &x, 4); return u; }
static float bitsf(uint32_t u) { float x; memcpy(&x, &u, 4); return x; }

static int verbose(void) { const char *v = getenv("BNB8_TEST_VERBOSE"); return v && *v && *v != '0'; }

// Spacing of floats at |x| (one float ulp), as a double.
static double ulpf(double x) {
    float f = (float)fabs(x);
    return (double)nextafterf(f, INFINITY) - (double)f;
}

static void *xmalloc(size_t bytes) {
    void *p = malloc(bytes ? bytes : 1);
    if (!p) { fprintf(stderr, "test_quant: out of memory (%zu bytes)\n", bytes); exit(2); }
    return p;
}

// Reads a golden map: 256 lines "0x%08x". Returns the number of values read (256 when good).
static int read_hex_map(const char *name, uint32_t bits[256]) {
    FILE *f = fopen(test_data_path(name), "r");
    if (!f) return -1;
    int count = 0;
    unsigned int v;
    while (count < 257 && fscanf(f, " 0x%x", &v) == 1) {
        if (count < 256) bits[count] = v;
        count++;
    }
    fclose(f);
    return count;
}

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

// The 255 decision thresholds of DESIGN.md §3, computed here: t_k = (c_k + c_{k+1}) * 0.5f in float.
static void ref_thresholds(const float code[256], float t[255]) {
    for (int k = 0; k < 255; k++) {
        float sum = code[k] + code[k + 1];
        t[k] = sum * 0.5f;
    }
}

// Brute-force nearest code: the number of thresholds strictly below x; if x equals a threshold,
// the even index of that threshold's pair. The thresholds ascend, so the lowest threshold equal to
// x is t[below] and its pair is (below, below + 1).
static int ref_nearest(const float t[255], float x) {
    int below = 0, equal = 0;
    for (int k = 0; k < 255; k++) {
        below += t[k] < x;
        equal += t[k] == x;
    }
    return equal ? below + (below & 1) : below;
}

// ---- 16-bit formats, from their fields: fp16 = 1/5/10 bits, bias 15; bf16 = 1/8/7 bits, bias 127.

static double ref16_decode(uint16_t h, int fp16) {
    int mbits = fp16 ? 10 : 7, ebits = fp16 ? 5 : 8, bias = fp16 ? 15 : 127;
    int e = (h >> mbits) & ((1 << ebits) - 1), m = h & ((1 << mbits) - 1);
    double v;
    if (e == (1 << ebits) - 1) v = m ? NAN : INFINITY;
    else if (e == 0) v = ldexp((double)m, 1 - bias - mbits);                 // subnormal or zero
    else v = ldexp((double)((1 << mbits) + m), e - bias - mbits);
    return (h & 0x8000) ? -v : v;
}

static uint16_t ref16_max_finite(int fp16) { return fp16 ? 0x7bff : 0x7f7f; }

// Values of the non-negative finite patterns 0..max, ascending (the patterns are monotonic).
static const double *ref16_table(int fp16) {
    static double table[2][0x8000];
    static int built[2];
    if (!built[fp16]) {
        for (int h = 0; h <= ref16_max_finite(fp16); h++) table[fp16][h] = ref16_decode((uint16_t)h, fp16);
        built[fp16] = 1;
    }
    return table[fp16];
}

// float -> 16-bit by search: the two neighbouring 16-bit values lo <= |f| < up, compared through
// the exact midpoint (2|f| and lo + up are exact in double); a tie goes to the even pattern. Past
// the largest finite value the next value is max + ulp (2^16, 2^128), whose pattern is inf: IEEE
// round-to-nearest-even overflows there. NaN gives a quiet NaN (callers check only NaN-ness, sign).
static uint16_t ref16_encode(float f, int fp16) {
    uint16_t sign = signbit(f) ? 0x8000 : 0, maxf = ref16_max_finite(fp16);
    uint16_t inf = fp16 ? 0x7c00 : 0x7f80;
    if (isnan(f)) return sign | inf | (fp16 ? 0x200 : 0x40);
    if (isinf(f)) return sign | inf;
    const double *tab = ref16_table(fp16);
    double v = fabs((double)f);
    int lo = 0, hi = maxf;                       // invariant: tab[lo] <= v
    while (lo < hi) {
        int mid = (lo + hi + 1) / 2;
        if (tab[mid] <= v) lo = mid; else hi = mid - 1;
    }
    if (tab[lo] == v) return sign | (uint16_t)lo;
    double up = lo < maxf ? tab[lo + 1] : (fp16 ? 65536.0 : ldexp(1.0, 128));
    double twice = 2.0 * v, sum = tab[lo] + up;
    int pick = twice < sum ? lo : twice > sum ? lo + 1 : lo + (lo & 1);
    return sign | (uint16_t)pick;
}

// Element i of an array of dtype as float, decoded by the reference; and the reference's bits of v
// stored in dtype (f32: the float's own bits).
static float ref_load(const void *x, bnb8_dtype d, int64_t i) {
    if (d == BNB8_F32) return ((const float *)x)[i];
    return (float)ref16_decode(((const uint16_t *)x)[i], d == BNB8_F16);
}
static void ref_store(void *x, bnb8_dtype d, int64_t i, float v) {
    if (d == BNB8_F32) ((float *)x)[i] = v;
    else ((uint16_t *)x)[i] = ref16_encode(v, d == BNB8_F16);
}
// Bit pattern of element i (to compare outputs exactly).
static uint32_t elem_bits(const void *x, bnb8_dtype d, int64_t i) {
    if (d == BNB8_F32) return fbits(((const float *)x)[i]);
    return ((const uint16_t *)x)[i];
}

// Poison values: absmax and float outputs start as NaN, codes as 0xAB, so a skipped write shows.
static void poison_floats(float *a, int64_t n) { for (int64_t i = 0; i < n; i++) a[i] = bitsf(0x7fc0dead); }
static void poison_bytes(void *p, size_t bytes) { memset(p, 0xAB, bytes); }

// Mean abs error and mean relative error |a - b| / (|a| + 1e-8) over n elements, in double.
static void round_trip_errors(const float *a, const float *b, int64_t n, double *mean_abs, double *mean_rel) {
    double sum_abs = 0.0, sum_rel = 0.0;
    for (int64_t i = 0; i < n; i++) {
        double d = fabs((double)a[i] - (double)b[i]);
        sum_abs += d;
        sum_rel += d / (fabs((double)a[i]) + 1e-8);
    }
    *mean_abs = sum_abs / (double)n;
    *mean_rel = sum_rel / (double)n;
}

// Quantizes x (dtype d) and dequantizes into the same dtype; returns the round trip as floats.
static void quant_round_trip(const void *x, bnb8_dtype d, int64_t n, const float *code, int64_t blocksize,
                             float *back) {
    int64_t nblocks = (n + blocksize - 1) / blocksize;
    uint8_t *q = (uint8_t *)xmalloc((size_t)n);
    float *absmax = (float *)xmalloc((size_t)nblocks * sizeof(float));
    void *out = xmalloc((size_t)n * dtype_bytes(d));
    poison_bytes(q, (size_t)n);
    poison_floats(absmax, nblocks);
    memset(out, 0xff, (size_t)n * dtype_bytes(d));            // NaN in every dtype
    int s1 = bnb8_quantize_blockwise(x, d, n, code, blocksize, q, absmax);
    int s2 = bnb8_dequantize_blockwise(q, absmax, n, code, blocksize, out, d);
    EXPECT(s1 == 0 && s2 == 0, "round trip %s block %lld: status %d, %d (%s)", dtype_name(d),
           (long long)blocksize, s1, s2, bnb8_last_error());
    for (int64_t i = 0; i < n; i++) back[i] = ref_load(out, d, i);
    free(q); free(absmax); free(out);
}

// Sets the last error to a sentinel, so a later check can see that a failing call wrote its own.
static void set_error_sentinel(void) { bnb8_fail(BNB8_ERR_IO, "sentinel"); }
static int error_text_fresh(void) {
    const char *e = bnb8_last_error();
    return e && e[0] && strncmp(e, "sentinel", 8) != 0;
}

// ------------------------------------------------------------------------------------------------
// 1. Dynamic maps

static void test_dynamic_maps(void) {
    for (int is_signed = 1; is_signed >= 0; is_signed--) {
        const char *file = is_signed ? "dynamic_map_signed.hex" : "dynamic_map_unsigned.hex";
        uint32_t golden[256];
        int count = read_hex_map(file, golden);
        EXPECT(count == 256, "%s: read %d values, expected 256", file, count);
        if (count != 256) continue;

        float code[256];
        memset(code, 0xAB, sizeof code);
        bnb8_map_dynamic(is_signed, code);
        for (int i = 0; i < 256; i++)
            EXPECT(fbits(code[i]) == golden[i], "%s[%d]: 0x%08x, golden 0x%08x", file, i, fbits(code[i]), golden[i]);

        // The exact formula of DESIGN.md §3 in double: level i of 7, 2^i (signed, both signs) or 2^(i+1)
        // (unsigned) bins, plus 0 and 1.
        double exact[256];
        int m = 0;
        for (int lvl = 0; lvl <= 6; lvl++) {
            int bins = is_signed ? 1 << lvl : 1 << (lvl + 1);
            for (int k = 0; k < bins; k++) {
                double v = pow(10.0, lvl - 6) * (0.1 + 0.9 * (2.0 * k + 1.0) / (2.0 * bins));
                exact[m++] = v;
                if (is_signed) exact[m++] = -v;
            }
        }
        exact[m++] = 0.0;
        exact[m++] = 1.0;
        EXPECT(m == 256, "%s: the formula gives %d values", file, m);
        qsort(exact, 256, sizeof(double), cmp_double);
        int differing = 0;
        for (int i = 0; i < 256; i++) {
            double err = fabs((double)code[i] - exact[i]);
            differing += code[i] != (float)exact[i];
            EXPECT(err <= 2.0 * ulpf(exact[i]), "%s[%d] = %.9g, exact %.12g: off by %.2f ulp", file, i,
                   (double)code[i], exact[i], err / ulpf(exact[i]));
        }
        for (int i = 0; i < 255; i++)
            EXPECT(code[i] < code[i + 1], "%s not ascending at %d: %.9g, %.9g", file, i, (double)code[i], (double)code[i + 1]);
        if (is_signed) {
            EXPECT(fbits(code[127]) == 0, "signed[127] = %.9g (0x%08x), expected +0", (double)code[127], fbits(code[127]));
            EXPECT(code[255] == 1.0f, "signed[255] = %.9g", (double)code[255]);
            EXPECT(code[0] == -0.99296875f, "signed[0] = %.9g", (double)code[0]);
        } else {
            EXPECT(fbits(code[0]) == 0, "unsigned[0] = %.9g (0x%08x), expected +0", (double)code[0], fbits(code[0]));
            EXPECT(code[255] == 1.0f, "unsigned[255] = %.9g", (double)code[255]);
        }
        if (verbose()) printf("    %s: %d entries differ from the rounded exact formula\n", file, differing);
    }
}

// ------------------------------------------------------------------------------------------------
// 2. Linear maps

static void test_linear_maps(void) {
    float code[256];
    memset(code, 0xAB, sizeof code);
    bnb8_map_linear(1, code);
    for (int i = 0; i < 256; i++) {
        int k = i <= 127 ? i : i - 1;             // the zero (k = 127) appears twice, at 127 and 128
        double exact = -1.0 + 2.0 * k / 254.0;
        if (k == 127) EXPECT(code[i] == 0.0f, "linear signed[%d] = %.9g, expected 0", i, (double)code[i]);
        else EXPECT(fabs((double)code[i] - exact) <= ulpf(exact), "linear signed[%d] = %.9g, exact %.12g",
                    i, (double)code[i], exact);
    }
    EXPECT(code[0] == -1.0f && code[255] == 1.0f, "linear signed ends %.9g, %.9g", (double)code[0], (double)code[255]);
    for (int i = 0; i < 255; i++)
        EXPECT(i == 127 ? code[i] == code[i + 1] : code[i] < code[i + 1], "linear signed not ascending at %d", i);

    memset(code, 0xAB, sizeof code);
    bnb8_map_linear(0, code);
    for (int i = 0; i < 256; i++) {
        double exact = i / 255.0;
        EXPECT(fabs((double)code[i] - exact) <= ulpf(exact), "linear unsigned[%d] = %.9g, exact %.12g",
               i, (double)code[i], exact);
    }
    EXPECT(code[0] == 0.0f && code[255] == 1.0f, "linear unsigned ends %.9g, %.9g", (double)code[0], (double)code[255]);
    for (int i = 0; i < 255; i++) EXPECT(code[i] < code[i + 1], "linear unsigned not ascending at %d", i);
}

// ------------------------------------------------------------------------------------------------
// 3. Quantile map

// The quantile map computed here: quantiles of the finite samples at p_j = 1/512 + j (1 - 2/512)/254
// by linear interpolation between order statistics at p (m - 1), plus 0, divided by the largest
// magnitude among them (bitsandbytes' create_quantile_map: q / q.abs().max(), so max |code| = 1).
static void ref_quantile_map(const float *x, int64_t n, double out[256]) {
    double *s = (double *)xmalloc((size_t)n * sizeof(double));
    int64_t m = 0;
    for (int64_t i = 0; i < n; i++) if (isfinite(x[i])) s[m++] = x[i];
    qsort(s, (size_t)m, sizeof(double), cmp_double);
    double biggest = 0.0;
    for (int j = 0; j < 255; j++) {
        double p = 1.0 / 512.0 + j * (1.0 - 2.0 / 512.0) / 254.0, pos = p * (double)(m - 1);
        int64_t lo = (int64_t)floor(pos);
        double frac = pos - (double)lo, next = lo + 1 < m ? s[lo + 1] : s[lo];
        out[j] = s[lo] + frac * (next - s[lo]);
        if (fabs(out[j]) > biggest) biggest = fabs(out[j]);
    }
    out[255] = 0.0;
    for (int j = 0; j < 256; j++) out[j] /= biggest;
    qsort(out, 256, sizeof(double), cmp_double);
    free(s);
}

static void test_quantile_map(void) {
    test_rng r = test_rng_new();
    const int64_t n = 200000;
    float *x = (float *)xmalloc((size_t)n * sizeof(float));
    for (int64_t i = 0; i < n; i++) x[i] = (float)test_randn(&r);

    float code[256];
    poison_floats(code, 256);
    int status = bnb8_map_quantile(x, n, code);
    EXPECT(status == 0, "bnb8_map_quantile: status %d (%s)", status, bnb8_last_error());
    double ref[256];
    ref_quantile_map(x, n, ref);
    // The shape first (sorted, in [-1, 1], a 0, max |code| exactly 1), then every value.
    int has_zero = 0;
    float biggest = 0.0f;
    for (int i = 0; i < 256; i++) {
        EXPECT(code[i] >= -1.0f && code[i] <= 1.0f, "quantile code[%d] = %.9g outside [-1, 1]", i, (double)code[i]);
        has_zero |= code[i] == 0.0f;
        if (fabsf(code[i]) > biggest) biggest = fabsf(code[i]);
    }
    EXPECT(biggest == 1.0f, "quantile map: max |code| = %.9g, expected exactly 1", (double)biggest);
    EXPECT(has_zero, "quantile map has no 0");
    for (int i = 0; i < 255; i++)
        EXPECT(code[i] <= code[i + 1], "quantile map not ascending at %d: %.9g, %.9g", i, (double)code[i], (double)code[i + 1]);
    for (int i = 0; i < 256; i++)
        EXPECT(fabs((double)code[i] - ref[i]) <= ulpf(ref[i]), "quantile code[%d] = %.9g, reference %.12g",
               i, (double)code[i], ref[i]);

    // Non-finite samples are ignored: the same finite samples with NaN and +-Inf mixed in give the
    // same map, bit for bit.
    const int64_t extra = 1000;
    float *y = (float *)xmalloc((size_t)(n + extra) * sizeof(float));
    int64_t k = 0, put = 0;
    for (int64_t i = 0; i < n; i++) {
        while (put < extra && test_uniform(&r) < (double)extra / (double)n) {
            int kind = (int)(put % 3);
            y[k++] = kind == 0 ? NAN : kind == 1 ? INFINITY : -INFINITY;
            put++;
        }
        y[k++] = x[i];
    }
    while (put < extra) { y[k++] = NAN; put++; }
    float code2[256];
    poison_floats(code2, 256);
    status = bnb8_map_quantile(y, k, code2);
    EXPECT(status == 0, "bnb8_map_quantile with non-finite samples: status %d (%s)", status, bnb8_last_error());
    for (int i = 0; i < 256; i++)
        EXPECT(fbits(code2[i]) == fbits(code[i]), "with non-finite samples, code[%d] = %.9g, without %.9g",
               i, (double)code2[i], (double)code[i]);

    // Bad input: non-zero status, a message of its own, the output untouched.
    float zeros[1000], nans[10];
    memset(zeros, 0, sizeof zeros);
    for (int i = 0; i < 10; i++) nans[i] = NAN;
    float zeros_and_one[1000];                   // one non-zero sample, but every quantile is 0: no map
    memset(zeros_and_one, 0, sizeof zeros_and_one);
    zeros_and_one[500] = 1.0f;
    struct { const char *what; const float *x; int64_t n; float *code; } bad[] = {
        {"NULL x", NULL, 100, code2}, {"NULL code", x, 100, NULL}, {"n = 0", x, 0, code2},
        {"n = -5", x, -5, code2}, {"all-zero sample", zeros, 1000, code2}, {"all-NaN sample", nans, 10, code2},
        {"sample whose quantiles are all 0", zeros_and_one, 1000, code2},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        poison_floats(code2, 256);
        set_error_sentinel();
        status = bnb8_map_quantile(bad[i].x, bad[i].n, bad[i].code);
        EXPECT(status != 0, "bnb8_map_quantile(%s) returned 0", bad[i].what);
        EXPECT(error_text_fresh(), "bnb8_map_quantile(%s): last error '%s'", bad[i].what, bnb8_last_error());
        for (int j = 0; j < 256; j++)
            EXPECT(fbits(code2[j]) == 0x7fc0dead, "bnb8_map_quantile(%s) wrote code[%d]", bad[i].what, j);
    }
    free(x);
    free(y);
}

// ------------------------------------------------------------------------------------------------
// 4. Nearest-code rule

// Both the binary search and the table lookup (bnb8_nearest_code_fast) against brute force.
static bnb8_codebook *check_book;
static void check_nearest(const char *map, const float lib_t[256], const float t[255], float x) {
    int got = bnb8_nearest_code(lib_t, x), want = ref_nearest(t, x);
    EXPECT(got == want, "%s: nearest(%.9g = 0x%08x) = %d, brute force %d", map, (double)x, fbits(x), got, want);
    int fast = bnb8_nearest_code_fast(check_book, x);
    EXPECT(fast == want, "%s: nearest_code_fast(%.9g = 0x%08x) = %d, brute force %d", map, (double)x, fbits(x), fast, want);
}

// A map whose thresholds sit 1..17 floats from the edges of lookup buckets (2^16 floats each), on
// both sides of an edge and for both signs: pairs of equal codes put a threshold on the code itself.
static void map_near_bucket_edges(float code[256]) {
    for (int i = 0; i < 64; i++) {
        uint32_t edge = 0x3a000000u + (uint32_t)i * 0x40000u, d = 1u + (uint32_t)i % 17u;
        float v = bnb8_bits_f32(i % 2 ? edge - d : edge + d);
        code[128 + 2 * i] = code[129 + 2 * i] = v;
        code[127 - 2 * i] = code[126 - 2 * i] = -v;
    }
}

// A signed map (0 is code 127) with many thresholds in one lookup bucket: its codebook searches.
static void map_searching(float code[256]) {
    for (int k = 0; k < 256; k++) code[k] = k < 128 ? -1.0f + (float)k / 127.0f : 0.5f + 1e-6f * (float)(k - 128);
}

// The division-free code (bnb8_code_near on x * (1/a)) equals the code of the correctly rounded
// x / a wherever it does not ask for the division, on every map (one whose codebook searches asks
// always); x is drawn at random and within a few ulps of every threshold times a, a over the whole
// float range. The optimizer's form (a codebook with a zero code, bnb8_quantize_value_near and
// bnb8_quantize_value) against brute force with bnb8_keep_sign's rule written out, -0 included.
static void test_nearest_code_near(void) {
    test_rng r = test_rng_new();
    float maps[7][256];
    bnb8_map_dynamic(1, maps[0]);
    bnb8_map_dynamic(0, maps[1]);
    bnb8_map_linear(1, maps[2]);            // a threshold at 0, in the tiny bucket
    bnb8_map_linear(0, maps[3]);
    map_near_bucket_edges(maps[4]);
    map_searching(maps[5]);
    bnb8_map_dynamic(1, maps[6]);           // a threshold at 2^-29, inside the tiny bucket: searches
    maps[6][128] = 0x1p-28f;
    bnb8_codebook *book = (bnb8_codebook *)xmalloc(sizeof *book), *signs = (bnb8_codebook *)xmalloc(sizeof *signs);
    for (int m = 0; m < 7; m++) {
        float t[255];
        ref_thresholds(maps[m], t);
        int zero_code = m == 1 || m == 3 ? 0 : 127;     // bnb8_zero_code of the map's kind
        bnb8_codebook_init(book, maps[m], 0);
        bnb8_codebook_init(signs, maps[m], zero_code);
        int search = m >= 5;
        EXPECT(book->search == search && signs->search == search, "map %d: search %d %d", m, book->search, signs->search);
        int64_t checked = 0, divided = 0;
        for (int i = 0; i < 600000 && test_failures() < 20; i++) {
            float a = (float)pow(2.0, -140.0 + 280.0 * test_uniform(&r));     // subnormal .. 2^140
            if (i % 97 == 0) a = i % 2 ? 0x1p-125f : 0x1p125f;
            float x;
            if (i % 2) x = (float)((2.0 * test_uniform(&r) - 1.0) * a * pow(10.0, -8.0 * test_uniform(&r)));
            else {
                x = t[test_u64(&r) % 255] * a;                                 // near a threshold
                for (int k = (int)(test_u64(&r) % 25) - 12; k != 0; k += k > 0 ? -1 : 1)
                    x = nextafterf(x, k > 0 ? INFINITY : -INFINITY);
                if (fabsf(x) > a) x = x > 0 ? a : -a;
            }
            if (i % 1009 == 0) x = i % 2 ? -0.0f : -0x1p-149f;                 // -0, and one that underflows
            if (!isfinite(a) || a == 0.0f) continue;
            float rec = bnb8_reciprocal(a);
            int redo = book->search, got = bnb8_code_near(book, x * rec, &redo);
            int want = ref_nearest(t, x / a);
            int want_signed = x < 0.0f && zero_code > 0 && want >= zero_code ? zero_code - 1 : want;
            checked++;
            divided += redo;
            EXPECT(redo || got == want, "map %d: x %.9g a %.9g: near code %d, exact %d", m, (double)x, (double)a, got, want);
            redo = signs->search;
            got = bnb8_quantize_value_near(signs, x, rec, &redo);
            EXPECT(redo || got == want_signed, "map %d: x %.9g a %.9g: quantize_value_near %d, want %d", m, (double)x,
                   (double)a, got, want_signed);
            got = bnb8_quantize_value(signs, zero_code, x, a);
            EXPECT(got == want_signed, "map %d: x %.9g a %.9g: quantize_value %d, want %d", m, (double)x, (double)a,
                   got, want_signed);
        }
        printf("    map %d: %lld values, %.3f%% needed the division\n", m, (long long)checked,
               100.0 * (double)divided / (double)checked);
    }
    free(book);
    free(signs);
}

static void test_nearest_code(void) {
    test_rng r = test_rng_new();
    float maps[7][256];
    const char *names[7] = {"dynamic signed", "dynamic unsigned", "linear signed", "linear unsigned", "quantile",
                            "clustered", "thresholds next to bucket edges"};
    bnb8_map_dynamic(1, maps[0]);
    bnb8_map_dynamic(0, maps[1]);
    bnb8_map_linear(1, maps[2]);
    bnb8_map_linear(0, maps[3]);
    {
        const int64_t n = 20000;                 // a quantile map of skewed data: uneven thresholds
        float *x = (float *)xmalloc((size_t)n * sizeof(float));
        for (int64_t i = 0; i < n; i++) { double g = test_randn(&r); x[i] = (float)(g * fabs(g) + 0.3); }
        int status = bnb8_map_quantile(x, n, maps[4]);
        EXPECT(status == 0, "bnb8_map_quantile: status %d", status);
        free(x);
    }
    // A map whose codes crowd into a few lookup buckets (and around 0 and 2^-24): the table's
    // binary-search fallback must give the same function.
    for (int k = 0; k < 256; k++)
        maps[5][k] = k < 64 ? -1.0f + 0.01f * (float)k
                   : k < 128 ? -0x1p-25f + 1e-9f * (float)(k - 64)
                   : k < 192 ? 0.5f + 1e-6f * (float)(k - 128) : 0.75f + 0.001f * (float)(k - 192);
    map_near_bucket_edges(maps[6]);
    check_book = (bnb8_codebook *)xmalloc(sizeof *check_book);
    for (int m = 0; m < 7; m++) {
        const float *c = maps[m];
        float t[255], lib_t[256];
        bnb8_codebook_init(check_book, c, 0);
        ref_thresholds(c, t);
        memset(lib_t, 0xAB, sizeof lib_t);
        bnb8_thresholds(c, lib_t);
        for (int k = 0; k < 255; k++)
            EXPECT(fbits(lib_t[k]) == fbits(t[k]), "%s: threshold %d = %.9g, expected %.9g", names[m], k,
                   (double)lib_t[k], (double)t[k]);
        EXPECT(lib_t[255] == INFINITY, "%s: threshold pad = %.9g, expected +inf", names[m], (double)lib_t[255]);

        // 1e6 random values: uniform over [-1.1, 1.1], tiny values around the smallest codes, and
        // exact code values (with their neighbours).
        for (int i = 0; i < 1000000 && test_failures() < 20; i++) {
            float x;
            if (i % 3 == 0) x = (float)(-1.1 + 2.2 * test_uniform(&r));
            else if (i % 3 == 1) x = (float)(test_randn(&r) * pow(10.0, -3.0 - 6.0 * test_uniform(&r)));
            else {
                x = c[test_u64(&r) % 256];
                int step = (int)(test_u64(&r) % 3);
                if (step == 1) x = nextafterf(x, INFINITY);
                if (step == 2) x = nextafterf(x, -INFINITY);
            }
            check_nearest(names[m], lib_t, t, x);
        }
        // Every threshold and the 20 floats on either side of it (past a bucket edge, when near one).
        for (int k = 0; k < 255; k++) {
            check_nearest(names[m], lib_t, t, t[k]);
            float up = t[k], down = t[k];
            for (int step = 0; step < 20; step++) {
                up = nextafterf(up, INFINITY);
                down = nextafterf(down, -INFINITY);
                check_nearest(names[m], lib_t, t, up);
                check_nearest(names[m], lib_t, t, down);
            }
        }
        // Outside the map: below c_0 gives 0, above c_255 gives 255; and both zeros.
        float below[] = {-1.1f, -INFINITY, -FLT_MAX, nextafterf(c[0], -INFINITY)};
        float above[] = {1.1f, INFINITY, FLT_MAX, nextafterf(c[255], INFINITY)};
        for (int i = 0; i < 4; i++) {
            if (below[i] < c[0]) EXPECT(bnb8_nearest_code(lib_t, below[i]) == 0, "%s: nearest(%.9g) = %d, expected 0",
                                        names[m], (double)below[i], bnb8_nearest_code(lib_t, below[i]));
            EXPECT(bnb8_nearest_code(lib_t, above[i]) == 255, "%s: nearest(%.9g) = %d, expected 255",
                   names[m], (double)above[i], bnb8_nearest_code(lib_t, above[i]));
        }
        float special[] = {0.0f, -0.0f, NAN, -NAN, INFINITY, -INFINITY, 1.0f, -1.0f, 0x1p-24f, -0x1p-24f,
                           0x1p-149f, -0x1p-149f, nextafterf(1.0f, 0.0f), nextafterf(-1.0f, 0.0f)};
        for (int i = 0; i < (int)(sizeof special / sizeof special[0]); i++) check_nearest(names[m], lib_t, t, special[i]);
        // Every float of a few bucket-sized stretches around thresholds (all 2^16 low bits).
        for (int k = 0; k < 255; k += 37)
            for (uint32_t low = 0; low < 0x10000u; low += 7) {
                uint32_t bits = (fbits(t[k]) & ~0xffffu) | low;
                float x;
                memcpy(&x, &bits, 4);
                check_nearest(names[m], lib_t, t, x);
            }
    }
    free(check_book);
}

// ------------------------------------------------------------------------------------------------
// 5. bf16 and fp16 conversions

static void check_to16(int fp16, float f) {
    uint16_t got = fp16 ? bnb8_f32_to_f16(f) : bnb8_f32_to_bf16(f), want = ref16_encode(f, fp16);
    const char *name = fp16 ? "f16" : "bf16";
    if (isnan(f)) {
        EXPECT(isnan(ref16_decode(got, fp16)) && (got & 0x8000) == (want & 0x8000),
               "%s(NaN 0x%08x) = 0x%04x, expected a NaN of the same sign", name, fbits(f), got);
    } else {
        EXPECT(got == want, "%s(%.9g = 0x%08x) = 0x%04x, expected 0x%04x", name, (double)f, fbits(f), got, want);
    }
}

static void test_conversions(void) {
    test_rng r = test_rng_new();
    for (int fp16 = 0; fp16 <= 1; fp16++) {
        const char *name = fp16 ? "f16" : "bf16";
        // Decode: all 2^16 patterns against the field-by-field reference; and the round trip
        // 16 -> 32 -> 16 is the identity (NaN stays a NaN of the same sign).
        for (uint32_t h = 0; h < 0x10000u; h++) {
            float got = fp16 ? bnb8_f16_to_f32((uint16_t)h) : bnb8_bf16_to_f32((uint16_t)h);
            double want = ref16_decode((uint16_t)h, fp16);
            uint16_t back = fp16 ? bnb8_f32_to_f16(got) : bnb8_f32_to_bf16(got);
            if (isnan(want)) {
                EXPECT(isnan(got) && !!signbit(got) == !!(h & 0x8000), "%s 0x%04x -> %.9g, expected NaN", name, h, (double)got);
                EXPECT(isnan(ref16_decode(back, fp16)) && (back & 0x8000) == (h & 0x8000),
                       "%s NaN 0x%04x round trip -> 0x%04x", name, h, back);
            } else {
                EXPECT(fbits(got) == fbits((float)want), "%s 0x%04x -> %.9g (0x%08x), expected %.9g (0x%08x)", name, h,
                       (double)got, fbits(got), want, fbits((float)want));
                EXPECT(back == h, "%s 0x%04x round trip -> 0x%04x", name, h, back);
            }
        }
        // Encode: 2e6 float bit patterns uniform over all 2^32.
        for (int i = 0; i < 2000000; i++) check_to16(fp16, bitsf((uint32_t)test_u64(&r)));
        // Encode: 1e6 floats with exponents inside and around the 16-bit range (subnormals included).
        int emin = fp16 ? -27 : -136, emax = fp16 ? 17 : 127;
        for (int i = 0; i < 1000000; i++) {
            int e = emin + (int)(test_u64(&r) % (uint64_t)(emax - emin + 1));
            float f = ldexpf(1.0f + (float)(test_u64(&r) >> 41) * 0x1.0p-23f, e);
            check_to16(fp16, (test_u64(&r) & 1) ? -f : f);
        }
        // Encode: every tie (the exact midpoint of two consecutive 16-bit values, including the
        // subnormal range and max..max+ulp, which rounds to inf) and its two float neighbours.
        const double *tab = ref16_table(fp16);
        uint16_t maxf = ref16_max_finite(fp16);
        int ties = 0;
        for (int h = 0; h <= maxf; h++) {
            double up = h < maxf ? tab[h + 1] : (fp16 ? 65536.0 : ldexp(1.0, 128));
            double mid = (tab[h] + up) / 2.0;
            float f = (float)mid;
            if ((double)f != mid) continue;       // not a float: no tie to test
            ties++;
            float cases[3] = {f, nextafterf(f, INFINITY), nextafterf(f, 0.0f)};
            for (int j = 0; j < 3; j++) { check_to16(fp16, cases[j]); check_to16(fp16, -cases[j]); }
        }
        EXPECT(ties == maxf + 1, "%s: only %d of %d midpoints are floats", name, ties, maxf + 1);
        // Special values.
        float specials[] = {0.0f, -0.0f, INFINITY, -INFINITY, NAN, -NAN, FLT_MAX, -FLT_MAX, FLT_MIN,
                            bitsf(1), 65504.0f, 65519.99f, 65520.0f, 65536.0f, 0x1p-24f, 0x1p-25f,
                            nextafterf(0x1p-25f, 1.0f), 0x1.8p-24f, 0x1p-14f, 0x1.ff8p-15f, 3.3895314e38f,
                            bitsf(0x7f7f8000), bitsf(0x7f7f7fff), bitsf(0x00008000), bitsf(0x7fa00000)};
        for (size_t i = 0; i < sizeof specials / sizeof specials[0]; i++) {
            check_to16(fp16, specials[i]);
            check_to16(fp16, -specials[i]);
        }
    }
    // A few facts written out, so the reference itself is checked too.
    EXPECT(bnb8_f32_to_f16(65519.0f) == 0x7bff && bnb8_f32_to_f16(65520.0f) == 0x7c00, "f16 overflow boundary");
    EXPECT(bnb8_f32_to_f16(0x1p-25f) == 0x0000 && bnb8_f32_to_f16(0x1.8p-24f) == 0x0002, "f16 subnormal ties");
    EXPECT(bnb8_f32_to_bf16(bitsf(0x7f7f8000)) == 0x7f80 && bnb8_f32_to_bf16(bitsf(0x3f808000)) == 0x3f80,
           "bf16 ties (overflow to inf; 1 + 2^-8 to 1)");
    EXPECT(bnb8_f32_to_bf16(-0.0f) == 0x8000 && bnb8_f32_to_f16(-0.0f) == 0x8000, "negative zero");
}

// ------------------------------------------------------------------------------------------------
// 6. Round-trip error bars

static void test_round_trip_error_bars(void) {
    test_rng r = test_rng_new();
    const int64_t n = 1024 * 1024;
    float *data = (float *)xmalloc((size_t)n * sizeof(float));
    float *a = (float *)xmalloc((size_t)n * sizeof(float));
    float *back = (float *)xmalloc((size_t)n * sizeof(float));
    void *x = xmalloc((size_t)n * 4);
    float code[2][256];
    bnb8_map_dynamic(0, code[0]);
    bnb8_map_dynamic(1, code[1]);
    for (int uniform = 0; uniform <= 1; uniform++) {
        for (int64_t i = 0; i < n; i++) data[i] = (float)(uniform ? test_uniform(&r) : test_randn(&r));
        for (int di = 0; di < 3; di++) {
            bnb8_dtype d = all_dtypes[di];
            // The input is the data rounded to the dtype; errors are measured against it.
            for (int64_t i = 0; i < n; i++) { ref_store(x, d, i, data[i]); a[i] = ref_load(x, d, i); }
            for (int64_t bs = 64; bs <= 4096; bs *= 2) {
                quant_round_trip(x, d, n, code[uniform ? 0 : 1], bs, back);
                double mae, mre;
                round_trip_errors(a, back, n, &mae, &mre);
                // DESIGN.md §12 bars +5%: randn 256 for blocks up to 256, randn 4096 above (the
                // error grows with the block), uniform [0, 1) with the unsigned map for every block.
                double bar_abs = uniform ? 0.00160 : bs <= 256 ? 0.00852 : 0.01003;
                double bar_rel = uniform ? 0.00501 : bs <= 256 ? 0.01537 : 0.01698;
                const char *what = uniform ? "uniform/unsigned" : "randn/signed";
                EXPECT(mae <= 1.05 * bar_abs, "%s %s block %lld: mean abs error %.5f > %.5f (+5%%)", what,
                       dtype_name(d), (long long)bs, mae, 1.05 * bar_abs);
                EXPECT(mre <= 1.05 * bar_rel, "%s %s block %lld: mean rel error %.5f > %.5f (+5%%)", what,
                       dtype_name(d), (long long)bs, mre, 1.05 * bar_rel);
                if (verbose()) printf("    %-16s %-4s block %4lld: mean abs %.5f  mean rel %.5f\n", what,
                                      dtype_name(d), (long long)bs, mae, mre);
            }
        }
    }
    free(data); free(a); free(back); free(x);
}

// ------------------------------------------------------------------------------------------------
// 7. Quantize / dequantize exactness

// Quantizes x (n elements of dtype d) with the library and checks absmax, q and the dequantized
// output (in every dtype) against the brute-force reference, element by element.
static void check_exact(const char *what, const void *x, bnb8_dtype d, int64_t n, const float *code, int64_t bs) {
    const int64_t pad = 64, nblocks = (n + bs - 1) / bs;
    float t[255];
    ref_thresholds(code, t);
    int zero_code = ref_nearest(t, 0.0f);
    uint8_t *q = (uint8_t *)xmalloc((size_t)(n + pad)), *q2 = (uint8_t *)xmalloc((size_t)(n + pad));
    float *absmax = (float *)xmalloc((size_t)(nblocks + pad) * sizeof(float));
    int64_t nonfinite = -7;
    poison_bytes(q, (size_t)(n + pad));
    poison_floats(absmax, nblocks + pad);
    int status = bnb8_quantize_blockwise_ex(x, d, n, code, bs, q, absmax, &nonfinite);
    EXPECT(status == 0, "%s: quantize status %d (%s)", what, status, bnb8_last_error());
    EXPECT(nonfinite == 0, "%s: nonfinite = %lld for finite input", what, (long long)nonfinite);
    // A second run over a different poison must give the same bytes: no code is left unwritten.
    memset(q2, 0x54, (size_t)(n + pad));
    status = bnb8_quantize_blockwise(x, d, n, code, bs, q2, absmax);
    EXPECT(status == 0 && memcmp(q, q2, (size_t)n) == 0, "%s: two runs over different poison differ", what);
    for (int64_t i = n; i < n + pad; i++) EXPECT(q[i] == 0xAB, "%s: wrote q[%lld] past n", what, (long long)i);
    for (int64_t b = nblocks; b < nblocks + pad; b++)
        EXPECT(fbits(absmax[b]) == 0x7fc0dead, "%s: wrote absmax[%lld] past the blocks", what, (long long)b);

    for (int64_t b = 0; b < nblocks && test_failures() < 20; b++) {
        int64_t start = b * bs, end = start + bs < n ? start + bs : n;
        float amax = 0.0f;
        for (int64_t i = start; i < end; i++) { float v = fabsf(ref_load(x, d, i)); if (v > amax) amax = v; }
        EXPECT(fbits(absmax[b]) == fbits(amax), "%s: absmax[%lld] = %.9g, expected %.9g", what, (long long)b,
               (double)absmax[b], (double)amax);
        for (int64_t i = start; i < end; i++) {
            float xi = ref_load(x, d, i);
            int want = amax > 0.0f ? ref_nearest(t, xi / amax) : zero_code;
            EXPECT(q[i] == want, "%s: q[%lld] = %d for x = %.9g, absmax %.9g: expected %d", what, (long long)i,
                   q[i], (double)xi, (double)amax, want);
        }
    }
    // Dequantize into every dtype: out = code[q] * absmax in float, rounded by the reference.
    void *out = xmalloc((size_t)(n + pad) * 4);
    for (int oi = 0; oi < 3; oi++) {
        bnb8_dtype od = all_dtypes[oi];
        memset(out, 0xff, (size_t)(n + pad) * 4);
        status = bnb8_dequantize_blockwise(q, absmax, n, code, bs, out, od);
        EXPECT(status == 0, "%s: dequantize to %s: status %d (%s)", what, dtype_name(od), status, bnb8_last_error());
        for (int64_t i = 0; i < n && test_failures() < 20; i++) {
            float prod = code[q[i]] * absmax[i / bs];
            uint32_t want = od == BNB8_F32 ? fbits(prod) : ref16_encode(prod, od == BNB8_F16);
            EXPECT(elem_bits(out, od, i) == want, "%s: dequantized to %s [%lld] = 0x%x, expected 0x%x (%.9g)", what,
                   dtype_name(od), (long long)i, elem_bits(out, od, i), want, (double)prod);
        }
        const uint8_t *tail = (const uint8_t *)out + (size_t)n * dtype_bytes(od);
        for (int64_t i = 0; i < pad; i++) EXPECT(tail[i] == 0xff, "%s: dequantize to %s wrote past n", what, dtype_name(od));
    }
    free(q); free(q2); free(absmax); free(out);
}

static void test_quantize_exact(void) {
    test_rng r = test_rng_new();
    const int64_t sizes[] = {1, 255, 257, 4097, 1000003};
    const int64_t blocks[] = {64, 256, 4096};
    float code[2][256];
    bnb8_map_dynamic(0, code[0]);
    bnb8_map_dynamic(1, code[1]);
    for (int si = 0; si < 5; si++) {
        int64_t n = sizes[si];
        void *x = xmalloc((size_t)n * 4);
        for (int di = 0; di < 3; di++) {
            bnb8_dtype d = all_dtypes[di];
            for (int bi = 0; bi < 3; bi++) {
                int64_t bs = blocks[bi];
                if (n > 100000 && bi != di) continue;   // the large size: one block size per dtype (run time)
                // randn with a scale per block from 1e-3 to 1e3 (inside fp16's range), some exact
                // zeros and repeated values; signed map. Then |x| with the unsigned map.
                double scale = 1.0;
                for (int64_t i = 0; i < n; i++) {
                    if (i % bs == 0) scale = pow(10.0, -3.0 + 6.0 * test_uniform(&r));
                    double u = test_uniform(&r);
                    float v = u < 0.02 ? 0.0f : u < 0.04 && i > 0 ? ref_load(x, d, i - 1) : (float)(test_randn(&r) * scale);
                    ref_store(x, d, i, v);
                }
                char what[96];
                snprintf(what, sizeof what, "n %lld %s block %lld signed", (long long)n, dtype_name(d), (long long)bs);
                check_exact(what, x, d, n, code[1], bs);
                for (int64_t i = 0; i < n; i++) ref_store(x, d, i, fabsf(ref_load(x, d, i)));
                snprintf(what, sizeof what, "n %lld %s block %lld unsigned", (long long)n, dtype_name(d), (long long)bs);
                check_exact(what, x, d, n, code[0], bs);
            }
        }
        free(x);
    }
}

// ------------------------------------------------------------------------------------------------
// 8. Edge cases: n = 0, zero blocks, non-finite inputs

static void test_edge_cases(void) {
    test_rng r = test_rng_new();
    float code[3][256];
    bnb8_map_dynamic(0, code[0]);
    bnb8_map_dynamic(1, code[1]);
    map_searching(code[2]);                 // every value takes the exact path

    // n = 0: status 0, nothing written (the counter reports 0 met); NULL arrays are fine too.
    {
        float x[4] = {1, 2, 3, 4}, absmax[4], out[4];
        uint8_t q[4];
        int64_t nonfinite = -7;
        poison_bytes(q, sizeof q);
        poison_floats(absmax, 4);
        poison_floats(out, 4);
        int s1 = bnb8_quantize_blockwise_ex(x, BNB8_F32, 0, code[1], 256, q, absmax, &nonfinite);
        int s2 = bnb8_dequantize_blockwise(q, absmax, 0, code[1], 256, out, BNB8_F32);
        EXPECT(s1 == 0 && s2 == 0, "n = 0: status %d, %d", s1, s2);
        EXPECT(nonfinite == 0, "n = 0: nonfinite = %lld", (long long)nonfinite);
        for (int i = 0; i < 4; i++)
            EXPECT(q[i] == 0xAB && fbits(absmax[i]) == 0x7fc0dead && fbits(out[i]) == 0x7fc0dead, "n = 0 wrote element %d", i);
        s1 = bnb8_quantize_blockwise(NULL, BNB8_F32, 0, NULL, 256, NULL, NULL);
        s2 = bnb8_dequantize_blockwise(NULL, NULL, 0, NULL, 256, NULL, BNB8_BF16);
        int s3 = bnb8_quantize_blockwise_ex(NULL, BNB8_F16, 0, NULL, 4096, NULL, NULL, NULL);
        EXPECT(s1 == 0 && s2 == 0 && s3 == 0, "n = 0 with NULL arrays: status %d, %d, %d", s1, s2, s3);
    }

    // All-zero blocks (with -0.0 in them): absmax 0, the zero code (127 signed, 0 unsigned), and 0 back.
    const int64_t bs = 256, n = 4 * bs + 100;      // blocks 0, 2 and the partial last one are zero
    for (int di = 0; di < 3; di++) {
        bnb8_dtype d = all_dtypes[di];
        void *x = xmalloc((size_t)n * 4), *out = xmalloc((size_t)n * 4);
        for (int m = 0; m <= 2; m++) {
            int is_signed = m != 0, zero_code = is_signed ? 127 : 0;
            for (int64_t i = 0; i < n; i++) {
                int64_t b = i / bs;
                float v = (b == 0 || b == 2 || b == 4) ? ((i & 1) ? -0.0f : 0.0f) : (float)test_randn(&r);
                ref_store(x, d, i, is_signed ? v : fabsf(v));
            }
            uint8_t q[4 * 256 + 100];
            float absmax[5];
            poison_bytes(q, sizeof q);
            poison_floats(absmax, 5);
            memset(out, 0xff, (size_t)n * 4);
            int s1 = bnb8_quantize_blockwise(x, d, n, code[m], bs, q, absmax);
            int s2 = bnb8_dequantize_blockwise(q, absmax, n, code[m], bs, out, d);
            EXPECT(s1 == 0 && s2 == 0, "zero blocks %s: status %d, %d", dtype_name(d), s1, s2);
            for (int b = 0; b <= 4; b += 2) {
                EXPECT(absmax[b] == 0.0f, "zero block %d %s: absmax %.9g", b, dtype_name(d), (double)absmax[b]);
                for (int64_t i = b * bs; i < n && i < (b + 1) * bs; i++) {
                    EXPECT(q[i] == zero_code, "zero block %s %s: q[%lld] = %d, expected %d", dtype_name(d),
                           is_signed ? "signed" : "unsigned", (long long)i, q[i], zero_code);
                    EXPECT(ref_load(out, d, i) == 0.0f, "zero block %s: out[%lld] = %.9g", dtype_name(d),
                           (long long)i, (double)ref_load(out, d, i));
                }
            }
            EXPECT(absmax[1] > 0.0f && absmax[3] > 0.0f, "random blocks got absmax %.9g, %.9g", (double)absmax[1], (double)absmax[3]);
        }
        free(x); free(out);
    }

    // NaN and +-Inf: left out of absmax, given the zero code, counted exactly. Random positions and
    // counts (block starts and ends included), every dtype, every map; block 1 entirely non-finite.
    for (int trial = 0; trial < 60; trial++) {
        bnb8_dtype d = all_dtypes[trial % 3];
        int m = (trial / 3) % 3, is_signed = m != 0, zero_code = is_signed ? 127 : 0;
        float *v = (float *)xmalloc((size_t)n * sizeof(float));
        void *x = xmalloc((size_t)n * 4), *out = xmalloc((size_t)n * 4);
        for (int64_t i = 0; i < n; i++) { float g = (float)test_randn(&r); v[i] = is_signed ? g : fabsf(g); }
        const float bad_values[4] = {NAN, INFINITY, -INFINITY, -NAN};
        int counts[] = {1, 2, 3, 7, 40};
        int count = counts[trial % 5];
        for (int k = 0; k < count; k++) {
            int64_t pos = k == 0 ? (trial % 2 ? 0 : n - 1) : k == 1 ? bs - 1 : (int64_t)(test_u64(&r) % (uint64_t)n);
            v[pos] = bad_values[test_u64(&r) % 4];
        }
        int whole_block = trial % 4 == 0;         // block 1 is all NaN / Inf
        if (whole_block) for (int64_t i = bs; i < 2 * bs; i++) v[i] = bad_values[i % 4];
        int64_t expected_bad = 0;
        for (int64_t i = 0; i < n; i++) { ref_store(x, d, i, v[i]); expected_bad += !isfinite(v[i]); }

        uint8_t q[4 * 256 + 100];
        float absmax[5];
        int64_t nonfinite = -7;
        poison_bytes(q, sizeof q);
        poison_floats(absmax, 5);
        int status = bnb8_quantize_blockwise_ex(x, d, n, code[m], bs, q, absmax, &nonfinite);
        EXPECT(status == 0, "non-finite trial %d: status %d", trial, status);
        EXPECT(nonfinite == expected_bad, "non-finite trial %d (%s): counted %lld, expected %lld", trial,
               dtype_name(d), (long long)nonfinite, (long long)expected_bad);
        float t[255];
        ref_thresholds(code[m], t);
        for (int b = 0; b < 5; b++) {
            float amax = 0.0f;
            for (int64_t i = b * bs; i < n && i < (b + 1) * bs; i++) {
                float xi = ref_load(x, d, i);
                if (isfinite(xi) && fabsf(xi) > amax) amax = fabsf(xi);
            }
            if (b == 1 && whole_block) EXPECT(amax == 0.0f, "reference: block 1 should be all non-finite");
            EXPECT(fbits(absmax[b]) == fbits(amax), "non-finite trial %d (%s) block %d: absmax %.9g, expected %.9g",
                   trial, dtype_name(d), b, (double)absmax[b], (double)amax);
            for (int64_t i = b * bs; i < n && i < (b + 1) * bs; i++) {
                float xi = ref_load(x, d, i);
                int want = isfinite(xi) && amax > 0.0f ? ref_nearest(t, xi / amax) : zero_code;
                EXPECT(q[i] == want, "non-finite trial %d (%s): q[%lld] = %d for x = %g, expected %d", trial,
                       dtype_name(d), (long long)i, q[i], (double)xi, want);
            }
        }
        memset(out, 0xff, (size_t)n * 4);
        status = bnb8_dequantize_blockwise(q, absmax, n, code[m], bs, out, d);
        EXPECT(status == 0, "non-finite trial %d: dequantize status %d", trial, status);
        for (int64_t i = 0; i < n; i++)
            if (!isfinite(v[i]))
                EXPECT(ref_load(out, d, i) == 0.0f, "non-finite trial %d: element %lld dequantizes to %g, expected 0",
                       trial, (long long)i, (double)ref_load(out, d, i));
        free(v); free(x); free(out);
    }
}

// ------------------------------------------------------------------------------------------------
// 9. Bad arguments

// Checks a failed call: the expected status, a text for it, a fresh detailed message.
static void check_failure(const char *what, int status, int expected) {
    EXPECT(status == expected, "%s: status %d, expected %d", what, status, expected);
    EXPECT(bnb8_strerror(status) && bnb8_strerror(status)[0], "%s: empty bnb8_strerror(%d)", what, status);
    EXPECT(error_text_fresh(), "%s: bnb8_last_error() = '%s'", what, bnb8_last_error());
}

static void test_bad_arguments(void) {
    float code[256], x[512], absmax[8], out[512], absmax2[8], mean = -3.0f;
    uint8_t q[512], q2[8];
    int64_t nonfinite = -7;
    bnb8_map_dynamic(1, code);
    for (int i = 0; i < 512; i++) x[i] = (float)(i - 256);
    // Snapshots of the outputs: nothing may be written on error.
    poison_bytes(q, sizeof q);
    poison_bytes(q2, sizeof q2);
    poison_floats(absmax, 8);
    poison_floats(absmax2, 8);
    poison_floats(out, 512);
    uint8_t q_before[512], q2_before[8];
    float absmax_before[8], absmax2_before[8], out_before[512];
    memcpy(q_before, q, sizeof q);
    memcpy(q2_before, q2, sizeof q2);
    memcpy(absmax_before, absmax, sizeof absmax);
    memcpy(absmax2_before, absmax2, sizeof absmax2);
    memcpy(out_before, out, sizeof out);
    const int64_t n = 300;
    const bnb8_dtype bad_dtype = (bnb8_dtype)7;
    const int64_t bad_blocks[] = {0, 32, 100, 8192, 65, -64};
    char what[96];

#define CALL(expected, call) do { set_error_sentinel(); check_failure(#call, (call), expected); } while (0)
    // quantize, quantize_ex, dequantize
    CALL(BNB8_ERR_NULL, bnb8_quantize_blockwise(NULL, BNB8_F32, n, code, 64, q, absmax));
    CALL(BNB8_ERR_NULL, bnb8_quantize_blockwise(x, BNB8_F32, n, NULL, 64, q, absmax));
    CALL(BNB8_ERR_NULL, bnb8_quantize_blockwise(x, BNB8_F32, n, code, 64, NULL, absmax));
    CALL(BNB8_ERR_NULL, bnb8_quantize_blockwise(x, BNB8_F32, n, code, 64, q, NULL));
    CALL(BNB8_ERR_SIZE, bnb8_quantize_blockwise(x, BNB8_F32, -1, code, 64, q, absmax));
    CALL(BNB8_ERR_DTYPE, bnb8_quantize_blockwise(x, bad_dtype, n, code, 64, q, absmax));
    CALL(BNB8_ERR_NULL, bnb8_quantize_blockwise_ex(NULL, BNB8_F16, n, code, 64, q, absmax, &nonfinite));
    CALL(BNB8_ERR_SIZE, bnb8_quantize_blockwise_ex(x, BNB8_F16, -1, code, 64, q, absmax, &nonfinite));
    CALL(BNB8_ERR_DTYPE, bnb8_quantize_blockwise_ex(x, bad_dtype, n, code, 64, q, absmax, &nonfinite));
    CALL(BNB8_ERR_NULL, bnb8_dequantize_blockwise(NULL, absmax, n, code, 64, out, BNB8_F32));
    CALL(BNB8_ERR_NULL, bnb8_dequantize_blockwise(q, NULL, n, code, 64, out, BNB8_F32));
    CALL(BNB8_ERR_NULL, bnb8_dequantize_blockwise(q, absmax, n, NULL, 64, out, BNB8_F32));
    CALL(BNB8_ERR_NULL, bnb8_dequantize_blockwise(q, absmax, n, code, 64, NULL, BNB8_F32));
    CALL(BNB8_ERR_SIZE, bnb8_dequantize_blockwise(q, absmax, -1, code, 64, out, BNB8_F32));
    CALL(BNB8_ERR_DTYPE, bnb8_dequantize_blockwise(q, absmax, n, code, 64, out, bad_dtype));
    for (int i = 0; i < 6; i++) {
        int64_t bs = bad_blocks[i];
        snprintf(what, sizeof what, "quantize blocksize %lld", (long long)bs);
        set_error_sentinel();
        check_failure(what, bnb8_quantize_blockwise(x, BNB8_F32, n, code, bs, q, absmax), BNB8_ERR_BLOCKSIZE);
        snprintf(what, sizeof what, "quantize_ex blocksize %lld", (long long)bs);
        set_error_sentinel();
        check_failure(what, bnb8_quantize_blockwise_ex(x, BNB8_BF16, n, code, bs, q, absmax, &nonfinite), BNB8_ERR_BLOCKSIZE);
        snprintf(what, sizeof what, "dequantize blocksize %lld", (long long)bs);
        set_error_sentinel();
        check_failure(what, bnb8_dequantize_blockwise(q, absmax, n, code, bs, out, BNB8_F32), BNB8_ERR_BLOCKSIZE);
        snprintf(what, sizeof what, "nest_absmax blocksize %lld", (long long)bs);
        set_error_sentinel();
        check_failure(what, bnb8_nest_absmax(x, 8, bs, q2, absmax2, &mean), BNB8_ERR_BLOCKSIZE);
        snprintf(what, sizeof what, "unnest_absmax blocksize %lld", (long long)bs);
        set_error_sentinel();
        check_failure(what, bnb8_unnest_absmax(q2, absmax2, 0.5f, 8, bs, absmax), BNB8_ERR_BLOCKSIZE);
    }
    // nested absmax
    CALL(BNB8_ERR_NULL, bnb8_nest_absmax(NULL, 8, 64, q2, absmax2, &mean));
    CALL(BNB8_ERR_NULL, bnb8_nest_absmax(x, 8, 64, NULL, absmax2, &mean));
    CALL(BNB8_ERR_NULL, bnb8_nest_absmax(x, 8, 64, q2, NULL, &mean));
    CALL(BNB8_ERR_NULL, bnb8_nest_absmax(x, 8, 64, q2, absmax2, NULL));
    CALL(BNB8_ERR_SIZE, bnb8_nest_absmax(x, -1, 64, q2, absmax2, &mean));
    CALL(BNB8_ERR_NULL, bnb8_unnest_absmax(NULL, absmax2, 0.5f, 8, 64, absmax));
    CALL(BNB8_ERR_NULL, bnb8_unnest_absmax(q2, NULL, 0.5f, 8, 64, absmax));
    CALL(BNB8_ERR_NULL, bnb8_unnest_absmax(q2, absmax2, 0.5f, 8, 64, NULL));
    CALL(BNB8_ERR_SIZE, bnb8_unnest_absmax(q2, absmax2, 0.5f, -1, 64, absmax));
#undef CALL

    EXPECT(memcmp(q, q_before, sizeof q) == 0, "a failed call wrote q");
    EXPECT(memcmp(q2, q2_before, sizeof q2) == 0, "a failed call wrote q2");
    EXPECT(memcmp(absmax, absmax_before, sizeof absmax) == 0, "a failed call wrote absmax");
    EXPECT(memcmp(absmax2, absmax2_before, sizeof absmax2) == 0, "a failed call wrote absmax2");
    EXPECT(memcmp(out, out_before, sizeof out) == 0, "a failed call wrote out");
    EXPECT(mean == -3.0f, "a failed call wrote mean (%g)", (double)mean);
    EXPECT(nonfinite == -7, "a failed call wrote nonfinite (%lld)", (long long)nonfinite);

    // Every status has its own non-empty text; unknown ones get a text too.
    for (int s = 0; s < BNB8_NUM_ERRORS; s++) {
        EXPECT(bnb8_strerror(s) && bnb8_strerror(s)[0], "bnb8_strerror(%d) is empty", s);
        for (int s2 = 0; s2 < s; s2++)
            EXPECT(strcmp(bnb8_strerror(s), bnb8_strerror(s2)) != 0, "bnb8_strerror(%d) == bnb8_strerror(%d)", s, s2);
    }
    EXPECT(bnb8_strerror(-1)[0] && bnb8_strerror(BNB8_NUM_ERRORS)[0] && bnb8_strerror(1000)[0], "unknown status: empty text");
}

// ------------------------------------------------------------------------------------------------
// 10. Nested absmax

static void test_nested_absmax(void) {
    test_rng r = test_rng_new();
    const int64_t n = 1024 * 1024, bs = 256, nblocks = n / bs;
    float *x = (float *)xmalloc((size_t)n * sizeof(float)), *back = (float *)xmalloc((size_t)n * sizeof(float));
    for (int64_t i = 0; i < n; i++) x[i] = (float)test_randn(&r);
    float code[256], t[255];
    bnb8_map_dynamic(1, code);
    ref_thresholds(code, t);
    uint8_t *q = (uint8_t *)xmalloc((size_t)n);
    float *absmax = (float *)xmalloc((size_t)nblocks * sizeof(float));
    int status = bnb8_quantize_blockwise(x, BNB8_F32, n, code, bs, q, absmax);
    EXPECT(status == 0, "quantize: status %d", status);

    // The largest gap between neighbouring codes bounds the error: |c - code*A| <= gap/2 * A.
    double max_gap = 0.0;
    for (int k = 0; k < 255; k++) if (code[k + 1] - code[k] > max_gap) max_gap = (double)code[k + 1] - code[k];

    const int64_t nest_blocks[] = {256, 64, 4096};
    for (int ni = 0; ni < 3; ni++) {
        int64_t nbs = nest_blocks[ni], n2 = (nblocks + nbs - 1) / nbs;
        uint8_t *q2 = (uint8_t *)xmalloc((size_t)nblocks);
        float *absmax2 = (float *)xmalloc((size_t)n2 * sizeof(float)), *rebuilt = (float *)xmalloc((size_t)nblocks * sizeof(float));
        float mean = NAN;
        poison_bytes(q2, (size_t)nblocks);
        poison_floats(absmax2, n2);
        poison_floats(rebuilt, nblocks);
        status = bnb8_nest_absmax(absmax, nblocks, nbs, q2, absmax2, &mean);
        int status2 = bnb8_unnest_absmax(q2, absmax2, mean, nblocks, nbs, rebuilt);
        EXPECT(status == 0 && status2 == 0, "nest / unnest (block %lld): status %d, %d", (long long)nbs, status, status2);
        double sum = 0.0;
        for (int64_t i = 0; i < nblocks; i++) sum += absmax[i];
        EXPECT(fabs((double)mean - sum / (double)nblocks) <= 1e-6 * fabs(sum / (double)nblocks),
               "nest block %lld: mean %.9g, expected %.9g", (long long)nbs, (double)mean, sum / (double)nblocks);
        // Exact structure: absmax2 = max |absmax - mean| per nested block; q2 = nearest of the
        // centered value / absmax2; rebuilt = code[q2] * absmax2 + mean, all in float.
        double worst = 0.0, worst_rel = 0.0;
        for (int64_t B = 0; B < n2; B++) {
            int64_t start = B * nbs, end = start + nbs < nblocks ? start + nbs : nblocks;
            float a2 = 0.0f;
            for (int64_t i = start; i < end; i++) { float c = absmax[i] - mean; if (fabsf(c) > a2) a2 = fabsf(c); }
            EXPECT(fbits(absmax2[B]) == fbits(a2), "nest block %lld: absmax2[%lld] = %.9g, expected %.9g",
                   (long long)nbs, (long long)B, (double)absmax2[B], (double)a2);
            for (int64_t i = start; i < end; i++) {
                float c = absmax[i] - mean;
                int want = a2 > 0.0f ? ref_nearest(t, c / a2) : 127;
                EXPECT(q2[i] == want, "nest block %lld: q2[%lld] = %d, expected %d", (long long)nbs, (long long)i, q2[i], want);
                float prod = code[q2[i]] * absmax2[B], expect = prod + mean;
                EXPECT(fbits(rebuilt[i]) == fbits(expect), "unnest block %lld: absmax[%lld] = %.9g, expected %.9g",
                       (long long)nbs, (long long)i, (double)rebuilt[i], (double)expect);
                // Bound: half the largest code gap times absmax2, plus three float roundings
                // (centering, product, adding the mean back).
                double err = fabs((double)rebuilt[i] - (double)absmax[i]);
                double bound = 0.5 * max_gap * a2 + ulpf(a2) + 2.0 * ulpf(absmax[i]);
                EXPECT(err <= bound, "nest block %lld: absmax[%lld] %.9g rebuilt %.9g: error %.3g > bound %.3g",
                       (long long)nbs, (long long)i, (double)absmax[i], (double)rebuilt[i], err, bound);
                if (a2 > 0.0f && err / a2 > worst) worst = err / a2;
                if (err / absmax[i] > worst_rel) worst_rel = err / absmax[i];
            }
        }
        if (verbose()) printf("    nested block %4lld: max error %.5f of the centered block max (bound %.5f), "
                              "%.5f of absmax\n", (long long)nbs, worst, 0.5 * max_gap, worst_rel);

        // Full round trip with the rebuilt absmax: within +10% of the plain round trip's error.
        if (nbs == 256) {
            double mae, mre, mae_n, mre_n;
            float *out = (float *)xmalloc((size_t)n * sizeof(float));
            status = bnb8_dequantize_blockwise(q, absmax, n, code, bs, out, BNB8_F32);
            round_trip_errors(x, out, n, &mae, &mre);
            status2 = bnb8_dequantize_blockwise(q, rebuilt, n, code, bs, back, BNB8_F32);
            round_trip_errors(x, back, n, &mae_n, &mre_n);
            EXPECT(status == 0 && status2 == 0, "dequantize: status %d, %d", status, status2);
            EXPECT(mae_n <= 1.10 * mae, "nested round trip: mean abs error %.5f > 1.10 x %.5f", mae_n, mae);
            EXPECT(mre_n <= 1.10 * mre, "nested round trip: mean rel error %.5f > 1.10 x %.5f", mre_n, mre);
            if (verbose()) printf("    round trip block 256: plain %.5f / %.5f, nested %.5f / %.5f\n", mae, mre, mae_n, mre_n);
            free(out);
        }
        free(q2); free(absmax2); free(rebuilt);
    }
    free(x); free(back); free(q); free(absmax);
}

// ------------------------------------------------------------------------------------------------

void tests_quant(void) {
    test_run("dynamic maps equal the golden tables and the exact formula", test_dynamic_maps);
    test_run("linear maps are evenly spaced with a doubled zero", test_linear_maps);
    test_run("quantile map matches a sorted double reference", test_quantile_map);
    test_run("nearest code equals brute force on every map", test_nearest_code);
    test_run("division-free codes equal the exact ones where they do not divide", test_nearest_code_near);
    test_run("bf16 and fp16 conversions round to nearest even", test_conversions);
    test_run("block-wise round trip stays within the DESIGN.md §12 error bars", test_round_trip_error_bars);
    test_run("quantize and dequantize match a brute-force reference exactly", test_quantize_exact);
    test_run("empty input, zero blocks and non-finite values are handled", test_edge_cases);
    test_run("bad arguments return the right status and write nothing", test_bad_arguments);
    test_run("nested absmax rebuilds absmax within its bound", test_nested_absmax);
}
