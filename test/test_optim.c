/*
test_optim.c — the optimizers (SPEC §5, §7, §9) against an independent double-precision reference.

The reference at the top is written from SPEC §5.3 alone: it never calls bnb8_direction/bnb8_apply.
Next to every state element it carries a bound on how far a float32 evaluation of the same formulas
can be from its double value (each float32 rounding moves a result by at most 2^-24 of its size;
we charge ROUNDINGS of them per update, on the magnitude of the terms). Those bounds decide the only
places where the library may legitimately differ from the reference: a Lion sign of a value that is
zero within rounding, an 8-bit code next to a decision threshold, an absmax. Everything else is
checked against the bars of the SPEC and the issue, element by element, with fresh random inputs.

The library's states are read back through its own state file (bnb8_optimizer_save; layout in
bnb8.c: per tensor the gradient-norm history, the absmax of each state, then the states).
BNB8_TEST_VERBOSE=1 prints the measured numbers quoted in the comments.
*/
#define _POSIX_C_SOURCE 200809L   // mkdtemp
#include "test.h"
#include "bnb8.h"
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define U32 0x1p-24        // float32 unit roundoff: one rounding changes a value by at most U32 of it
#define ROUNDINGS 8.0      // roundings charged per state update (the §5.3 formulas have at most 7:
                           // dequantized input, g*scale, wd*p, the float constants, products, sum)
// Parameters are p ~ 0.1 randn; the relative bar 1e-6 is applied as 1e-6 * max(|ref|, P_FLOOR).
// Why a floor: a step's float32 error is a few 2^-24 of |p| plus a few 2^-24 of the step itself
// (|lr u| <= ~1e-3 with the learning rates below), so for |p| << |lr u| a pure relative bar would
// demand more than float32 can give. P_FLOOR = 0.1 sigma_p keeps 1e-6 * P_FLOOR = 1e-8, still far
// below one step (1e-4..1e-3) and above its rounding (~1e-10).
#define P_FLOOR 0.01

static int verbose;
static char tmpdir[64];
static float map_code[2][256], map_thresh[2][256];   // [is_signed]: the golden dynamic maps

// ------------------------------------------------------------------------------------------------
// The double-precision reference of SPEC §5.3

typedef struct {
    bnb8_optim kind;
    bnb8_config c;                // the tensor's configuration (base or override)
    int64_t n, t;                 // elements; steps taken (t of the last step, 1-based)
    int nstates;
    double *p, *s[3];             // parameter and states
    double *e[3];                 // per state element: bound on |float32 state - s|
    double *u;                    // this step's update direction per element (NAN: skipped)
    double *ue;                   // bound on |float32 u - u|: where u is ill-conditioned (a
                                  // denominator near eps, L2 cancelling the gradient) float32
                                  // cannot give 1e-6, and the parameter bar widens by lr * ue
    uint8_t *tie;                 // Lion: this step's sign was of a value zero within rounding
    double hist[100];             // percentile clipping: the last 100 squared gradient norms
    double trust, scale;          // this step's trust ratio (LAMB/LARS) and gradient scale
} ref_tensor;

// SPEC §5.1: which states each optimizer keeps, and which are non-negative (unsigned map).
static int ref_nstates(bnb8_optim kind, const bnb8_config *c) {
    switch (kind) {
    case BNB8_ADAMW: case BNB8_ADAM: case BNB8_LAMB: return 2;          // m, v
    case BNB8_ADEMAMIX: return 3;                                        // m1, m2 (slow), v
    case BNB8_SGD: case BNB8_LARS: return c->momentum != 0.0f ? 1 : 0;   // momentum buffer
    default: return 1;                                                   // Lion m; RMSprop/Adagrad s
    }
}
static int ref_signed(bnb8_optim kind, int k) {
    switch (kind) {
    case BNB8_ADAMW: case BNB8_ADAM: case BNB8_LAMB: return k == 0;
    case BNB8_ADEMAMIX: return k < 2;
    case BNB8_RMSPROP: case BNB8_ADAGRAD: return 0;
    default: return 1;
    }
}
static int ref_decoupled(bnb8_optim kind) {
    return kind == BNB8_ADAMW || kind == BNB8_LION || kind == BNB8_LAMB || kind == BNB8_ADEMAMIX;
}

static void ref_init(ref_tensor *r, bnb8_optim kind, const bnb8_config *c, int64_t n, const double *p) {
    memset(r, 0, sizeof *r);
    r->kind = kind; r->c = *c; r->n = n; r->nstates = ref_nstates(kind, c);
    r->p = malloc(sizeof(double) * (size_t)n);
    r->u = malloc(sizeof(double) * (size_t)n);
    r->ue = calloc((size_t)n, sizeof(double));
    r->tie = calloc((size_t)n, 1);
    memcpy(r->p, p, sizeof(double) * (size_t)n);
    for (int k = 0; k < 3; k++) {
        r->s[k] = calloc((size_t)n, sizeof(double));
        r->e[k] = calloc((size_t)n, sizeof(double));
    }
}

static void ref_free(ref_tensor *r) {
    free(r->p); free(r->u); free(r->ue); free(r->tie);
    for (int k = 0; k < 3; k++) { free(r->s[k]); free(r->e[k]); }
}

// Bound on |sqrt(s + d) - sqrt(s)| for |d| <= e.
static double sqrt_error(double s, double e) { return s > 0.0 ? fmin(e / (2.0 * sqrt(s)), sqrt(e)) : sqrt(e); }

// Bound on the float32 error of u = num / D, with |num error| <= enum, D = sqrt(s)/sqrt(bc2) + eps and
// |s error| <= es: first order in both, plus the roundings of the division and the square root.
static double quotient_error(double u, double enum_, double s, double es, double sqrt_bc2, double eps) {
    double D = sqrt(s) / sqrt_bc2 + eps, eD = sqrt_error(s, es) / sqrt_bc2 + 4.0 * U32 * D;
    return D > eD ? (enum_ + fabs(u) * eD) / (D - eD) + 4.0 * U32 * fabs(u) : INFINITY;
}

static int compare_doubles(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

// One step of every element, g = the gradient as the library reads it, lr = this tensor's learning
// rate of the step, gnorm_scale = the caller's global scale. A non-finite g[i] leaves element i as
// it is (SPEC §5.2 item 6).
static void ref_step(ref_tensor *r, const double *g, double lr, double gnorm_scale) {
    const bnb8_config *c = &r->c;
    const double t = (double)++r->t, R = ROUNDINGS * U32;
    double b1 = c->beta1, b2 = c->beta2, b3 = c->beta3, eps = c->eps, wd = c->weight_decay;
    double alpha = c->alpha, mu = c->momentum, damp = c->dampening;

    // Percentile clipping (SPEC §5.4): history of squared norms of the raw gradient, all 100 set to
    // the first at step 1, then history[t % 100]; clip at sqrt(sorted[percentile]).
    r->scale = gnorm_scale;
    if (c->percentile_clipping < 100) {
        double g2 = 0.0, sorted[100];
        for (int64_t i = 0; i < r->n; i++) if (isfinite(g[i])) g2 += g[i] * g[i];
        if (r->t == 1) for (int i = 0; i < 100; i++) r->hist[i] = g2;
        else r->hist[r->t % 100] = g2;
        memcpy(sorted, r->hist, sizeof sorted);
        qsort(sorted, 100, sizeof(double), compare_doubles);
        double clip = sqrt(sorted[c->percentile_clipping]), norm = sqrt(g2);
        if (norm > clip) r->scale *= clip / norm;
    }
    double bc1 = 1.0 - pow(b1, t), bc2 = 1.0 - pow(b2, t);
    if (r->kind == BNB8_ADEMAMIX) {
        // The AdEMAMix paper's schedules: alpha rises linearly; beta3 interpolates the half-life
        // ln(0.5)/ln(beta) linearly from beta1's to beta3's, beta = 0.5^(1/half-life).
        if (c->t_alpha > 0 && t < c->t_alpha) alpha = alpha * t / (double)c->t_alpha;
        if (c->t_beta3 > 0 && t < c->t_beta3) {
            double a = t / (double)c->t_beta3, hl1 = log(0.5) / log(b1), hl3 = log(0.5) / log(b3);
            b3 = fmin(pow(0.5, 1.0 / ((1.0 - a) * hl1 + a * hl3)), b3);
        }
    }
    if (r->kind == BNB8_RMSPROP) b2 = alpha;
    const int decoupled = ref_decoupled(r->kind);
    const double l2 = decoupled ? 0.0 : wd;

    double p2 = 0.0, u2 = 0.0;
    for (int64_t i = 0; i < r->n; i++) {
        double p = r->p[i], *s0 = &r->s[0][i], *s1 = &r->s[1][i], *s2 = &r->s[2][i];
        double *e0 = &r->e[0][i], *e1 = &r->e[1][i], *e2 = &r->e[2][i];
        p2 += p * p;
        r->tie[i] = 0;
        if (!isfinite(g[i])) { r->u[i] = NAN; continue; }
        double gs = g[i] * r->scale + l2 * p;
        double ga = fabs(g[i] * r->scale) + l2 * fabs(p);   // |g'| for the error bounds
        double u, ue = 0.0, egs = R * ga;   // egs: bound on the float32 error of gs
        switch (r->kind) {
        case BNB8_ADAMW: case BNB8_ADAM: case BNB8_LAMB:
            *e0 = b1 * *e0 + R * (b1 * fabs(*s0) + (1.0 - b1) * ga);
            *e1 = b2 * *e1 + R * (b2 * *s1 + (1.0 - b2) * ga * ga);
            *s0 = b1 * *s0 + (1.0 - b1) * gs;
            *s1 = b2 * *s1 + (1.0 - b2) * gs * gs;
            u = *s0 / (sqrt(*s1) / sqrt(bc2) + eps);
            ue = quotient_error(u, *e0, *s1, *e1, sqrt(bc2), eps);
            break;
        case BNB8_SGD: case BNB8_LARS:
            if (r->nstates == 0) { u = gs; ue = egs; break; }
            if (r->t == 1) { *e0 = R * ga; *s0 = gs; }
            else {
                *e0 = mu * *e0 + R * (mu * fabs(*s0) + (1.0 - damp) * ga);
                *s0 = mu * *s0 + (1.0 - damp) * gs;
            }
            u = c->nesterov ? gs + mu * *s0 : *s0;
            ue = c->nesterov ? egs + mu * *e0 + R * fabs(u) : *e0;
            break;
        case BNB8_LION: {
            double ci = b1 * *s0 + (1.0 - b1) * gs;
            r->tie[i] = fabs(ci) <= b1 * *e0 + R * (b1 * fabs(*s0) + (1.0 - b1) * ga);
            u = (ci > 0.0) - (ci < 0.0);
            *e0 = b2 * *e0 + R * (b2 * fabs(*s0) + (1.0 - b2) * ga);
            *s0 = b2 * *s0 + (1.0 - b2) * gs;
            break;
        }
        case BNB8_RMSPROP:
            *e0 = b2 * *e0 + R * (b2 * *s0 + (1.0 - b2) * ga * ga);
            *s0 = b2 * *s0 + (1.0 - b2) * gs * gs;
            u = gs / (sqrt(*s0) + eps);
            ue = quotient_error(u, egs, *s0, *e0, 1.0, eps);
            break;
        case BNB8_ADAGRAD:
            *e0 = *e0 + R * (*s0 + ga * ga);
            *s0 = *s0 + gs * gs;
            u = gs / (sqrt(*s0) + eps);
            ue = quotient_error(u, egs, *s0, *e0, 1.0, eps);
            break;
        default:   // AdEMAMix: m1 (beta1), m2 (beta3), v (beta2)
            *e0 = b1 * *e0 + R * (b1 * fabs(*s0) + (1.0 - b1) * ga);
            *e1 = b3 * *e1 + R * (b3 * fabs(*s1) + (1.0 - b3) * ga);
            *e2 = b2 * *e2 + R * (b2 * *s2 + (1.0 - b2) * ga * ga);
            *s0 = b1 * *s0 + (1.0 - b1) * gs;
            *s1 = b3 * *s1 + (1.0 - b3) * gs;
            *s2 = b2 * *s2 + (1.0 - b2) * gs * gs;
            u = (*s0 / bc1 + alpha * *s1) / (sqrt(*s2) / sqrt(bc2) + eps);
            ue = quotient_error(u, *e0 / bc1 + alpha * *e1, *s2, *e2, sqrt(bc2), eps);
            break;
        }
        r->u[i] = u;
        r->ue[i] = ue;
        u2 += u * u;
    }
    // LAMB / LARS: the library norms u, the direction before the step size (LAMB: m/(sqrt(v)/sqrt(bc2)
    // + eps), without the 1/bc1 of the step size; LARS: the momentum buffer, or g' + mu buf with
    // nesterov), over the elements with a finite gradient; |p| over all elements, before the update.
    r->trust = 1.0;
    if ((r->kind == BNB8_LAMB || r->kind == BNB8_LARS) && c->max_unorm > 0.0f) {
        double limit = c->max_unorm * sqrt(p2), unorm = sqrt(u2);
        if (unorm > limit) r->trust = limit / unorm;
    }
    int adam = r->kind == BNB8_ADAMW || r->kind == BNB8_ADAM || r->kind == BNB8_LAMB;
    double step = adam ? lr / bc1 : lr, decay = decoupled ? 1.0 - lr * wd : 1.0;
    for (int64_t i = 0; i < r->n; i++)
        if (isfinite(r->u[i])) r->p[i] = r->p[i] * decay - step * r->trust * r->u[i];
}

// The Lion parameter for sign sgn instead of the reference's (for a tie), from the old value.
static double ref_lion_alternative(const ref_tensor *r, double p_old, double lr, double sgn) {
    return p_old * (1.0 - lr * r->c.weight_decay) - lr * sgn;
}

// ------------------------------------------------------------------------------------------------
// Helpers: dtypes, files, state snapshots

static double half_to_double(uint16_t h) {
    int e = (h >> 10) & 31, m = h & 1023;
    double v = e == 0 ? ldexp(m, -24) : e == 31 ? (m ? NAN : INFINITY) : ldexp(m + 1024, e - 25);
    return (h & 0x8000) ? -v : v;
}

// Element i of x as a double, decoded here (not by the library).
static double load_d(const void *x, bnb8_dtype dt, int64_t i) {
    if (dt == BNB8_F32) return ((const float *)x)[i];
    uint16_t h = ((const uint16_t *)x)[i];
    if (dt == BNB8_F16) return half_to_double(h);
    uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

// The next 16-bit value after h toward +inf (up) or -inf.
static uint16_t neighbour16(uint16_t h, int up) {
    if ((h & 0x7fff) == 0) return up ? 0x0001 : 0x8001;
    return (uint16_t)(up != (h >> 15) ? h + 1 : h - 1);
}

// How far the library's parameter x[i] is from the reference value, in units of the bar (<= 1
// passes). F32: |lib - ref| / (1e-6 max(|ref|, P_FLOOR)). F16/BF16: lib must be ref rounded to the
// 16-bit type, except within that same 1e-6 of a rounding midpoint: the distance beyond half the
// gap to lib's neighbour on ref's side, in the same units.
static double param_miss(bnb8_dtype dt, const void *x, int64_t i, double ref, double extra) {
    double lib = load_d(x, dt, i), tol = 1e-6 * fmax(fabs(ref), P_FLOOR) + extra;
    if (dt == BNB8_F32) return fabs(lib - ref) / tol;
    uint16_t h = ((const uint16_t *)x)[i], nb = neighbour16(h, ref > lib);
    double gap = fabs(load_d(&nb, dt, 0) - lib);
    return fmax(0.0, fabs(lib - ref) - 0.5 * gap) / tol;
}

static const char *dtype_name(bnb8_dtype dt) { return dt == BNB8_F32 ? "f32" : dt == BNB8_BF16 ? "bf16" : "f16"; }
static const char *kind_name(bnb8_optim kind) {
    static const char *names[] = {"AdamW", "Adam", "SGD", "Lion", "RMSprop", "Adagrad", "LAMB", "LARS", "AdEMAMix"};
    return names[kind];
}

static void tmp_path(char *path, size_t size, const char *name) { snprintf(path, size, "%s/%s", tmpdir, name); }

static uint8_t *slurp(const char *path, size_t *size) {
    *size = 0;
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    fseek(f, 0, SEEK_END);
    long len = ftell(f);
    fseek(f, 0, SEEK_SET);
    uint8_t *data = malloc(len > 0 ? (size_t)len + 1 : 1);   // + a terminating zero for text
    if (len > 0 && fread(data, 1, (size_t)len, f) != (size_t)len) len = 0;
    data[len > 0 ? len : 0] = 0;
    fclose(f);
    *size = (size_t)len;
    return data;
}

static void spit(const char *path, const void *data, size_t size) {
    FILE *f = fopen(path, "wb");
    EXPECT(f && fwrite(data, 1, size, f) == size, "cannot write %s", path);
    if (f) fclose(f);
}

static int files_equal(const char *a, const char *b) {
    size_t na, nb;
    uint8_t *x = slurp(a, &na), *y = slurp(b, &nb);
    int same = x && y && na == nb && memcmp(x, y, na) == 0;
    free(x); free(y);
    return same;
}

// A tensor's states as the library holds them, parsed from its state file.
typedef struct {
    int64_t n, step, blocksize, nblocks;
    uint32_t format, nstates;
    int has_history;
    float history[100];
    float *absmax[3];             // 8-bit: per block
    uint8_t *codes[3];            // 8-bit: per element
    float *f32[3];                // 32-bit: per element
} snap;

static void snap_free(snap *s, int count) {
    for (int i = 0; i < count; i++)
        for (int k = 0; k < 3; k++) { free(s[i].absmax[k]); free(s[i].codes[k]); free(s[i].f32[k]); }
    memset(s, 0, sizeof(snap) * (size_t)count);
}

// Saves opt and parses the first count tensors of the file into s[]. 1 on success.
static int snap_take(bnb8_optimizer *opt, snap *s, int count) {
    char path[256];
    tmp_path(path, sizeof path, "snapshot.bin");
    memset(s, 0, sizeof(snap) * (size_t)count);
    int status = bnb8_optimizer_save(opt, path);
    EXPECT(status == 0, "save for a snapshot: %s", bnb8_last_error());
    size_t size, at = 24;        // magic 8, version, kind, count, header CRC
    uint8_t *f = slurp(path, &size);
    remove(path);
    int ok = status == 0 && f != NULL;
#define TAKE(dst, len) do { if (!ok || at + (len) > size) { ok = 0; break; } memcpy((dst), f + at, (len)); at += (len); } while (0)
    for (int i = 0; ok && i < count; i++) {
        uint32_t name_len = 0;
        uint64_t bytes = 0;
        TAKE(&name_len, 4);
        at += name_len;
        TAKE(&s[i].n, 8); TAKE(&s[i].format, 4); TAKE(&s[i].nstates, 4);
        TAKE(&s[i].blocksize, 8); TAKE(&s[i].step, 8); TAKE(&bytes, 8);
        if (!ok || s[i].nstates > 3 || at + bytes + 4 > size) { ok = 0; break; }
        int64_t n = s[i].n, nb = s[i].format ? (n + s[i].blocksize - 1) / s[i].blocksize : 0;
        uint64_t per_state = s[i].format ? (uint64_t)n + 4u * (uint64_t)nb : 4u * (uint64_t)n;
        uint64_t history = bytes - per_state * s[i].nstates;
        s[i].nblocks = nb;
        s[i].has_history = history == 400;
        const uint8_t *d = f + at;
        if (s[i].has_history) memcpy(s[i].history, d, 400);
        for (uint32_t k = 0; k < s[i].nstates; k++) {
            if (s[i].format) {
                s[i].absmax[k] = malloc(4 * (size_t)nb);
                s[i].codes[k] = malloc((size_t)n);
                memcpy(s[i].absmax[k], d + history + 4 * (size_t)nb * k, 4 * (size_t)nb);
                memcpy(s[i].codes[k], d + history + 4 * (size_t)nb * s[i].nstates + (size_t)n * k, (size_t)n);
            } else {
                s[i].f32[k] = malloc(4 * (size_t)n);
                memcpy(s[i].f32[k], d + history + 4 * (size_t)n * k, 4 * (size_t)n);
            }
        }
        at += bytes + 4;
    }
#undef TAKE
    EXPECT(ok, "state file could not be parsed");
    free(f);
    return ok;
}

// Element i of state k as a double: code[q] * absmax exactly, or the float.
static double snap_value(const snap *s, bnb8_optim kind, int k, int64_t i) {
    if (s->format == BNB8_STATE_32BIT) return s->f32[k][i];
    return (double)map_code[ref_signed(kind, k)][s->codes[k][i]] * (double)s->absmax[k][i / s->blocksize];
}

// Starts a reference from the library's state: step count, history, dequantized states (their
// float32 product rounds by at most U32 of itself: the initial error bound).
static void ref_sync_states(ref_tensor *r, const snap *s) {
    r->t = s->step;
    for (int i = 0; i < 100; i++) r->hist[i] = s->history[i];
    for (int k = 0; k < r->nstates; k++)
        for (int64_t i = 0; i < r->n; i++) {
            r->s[k][i] = snap_value(s, r->kind, k, i);
            r->e[k][i] = s->format ? U32 * fabs(r->s[k][i]) : 0.0;
        }
}

// Nearest code by brute force over the 255 float32 thresholds t_k = (c_k + c_{k+1}) * 0.5f (SPEC
// §3): the number strictly below x; exactly on t_k goes to the even index of (k, k+1). For signed
// maps a negative value that lands on the zero code 127 takes 126 (SPEC §5.2).
static int ref_code(int is_signed, double x, double s) {
    int q = 0;
    for (int k = 0; k < 255; k++) {
        double t = map_thresh[is_signed][k];
        if (t < x || (t == x && (k & 1))) q++;
    }
    if (is_signed && q == 127 && s < 0.0) q = 126;
    return q;
}

// A tensor of the library with its reference: buffers in their dtypes, the gradient as read.
typedef struct {
    int64_t n;
    bnb8_dtype pdt, gdt;
    void *p, *g;
    double *gd;
    ref_tensor ref;
    int id;
} pair;

static void pair_init(pair *t, bnb8_optim kind, const bnb8_config *c, int64_t n, bnb8_dtype pdt,
                      bnb8_dtype gdt, test_rng *rng) {
    t->n = n; t->pdt = pdt; t->gdt = gdt;
    t->p = malloc(bnb8_dtype_size(pdt) * (size_t)n);
    t->g = calloc((size_t)n, bnb8_dtype_size(gdt));
    t->gd = calloc((size_t)n, sizeof(double));
    double *p0 = malloc(sizeof(double) * (size_t)n);
    for (int64_t i = 0; i < n; i++) {
        bnb8_store(t->p, pdt, i, (float)(0.1 * test_randn(rng)));
        p0[i] = load_d(t->p, pdt, i);
    }
    ref_init(&t->ref, kind, c, n, p0);
    free(p0);
}

static void pair_grad(pair *t, test_rng *rng, double sigma) {
    for (int64_t i = 0; i < t->n; i++) {
        bnb8_store(t->g, t->gdt, i, (float)(sigma * test_randn(rng)));
        t->gd[i] = load_d(t->g, t->gdt, i);
    }
}

static void pair_free(pair *t) { free(t->p); free(t->g); free(t->gd); ref_free(&t->ref); }

// Checks every parameter of t against its reference after a step; Lion ties may take any sign.
// 16-bit parameters (and tie elements) restart the reference from the library's value. Returns the
// largest miss (<= 1 passes).
static double pair_check_params(pair *t, const double *p_old, double lr, const char *label) {
    double worst = 0.0;
    const ref_tensor *r = &t->ref;
    int adam = r->kind == BNB8_ADAMW || r->kind == BNB8_ADAM || r->kind == BNB8_LAMB;
    double step = (adam ? lr / (1.0 - pow(r->c.beta1, (double)r->t)) : lr) * r->trust;
    for (int64_t i = 0; i < t->n; i++) {
        double extra = isfinite(r->u[i]) ? step * r->ue[i] : 0.0;
        double miss = param_miss(t->pdt, t->p, i, r->p[i], extra);
        if (r->tie[i] && miss > 1.0)
            for (int sg = -1; sg <= 1; sg++)
                miss = fmin(miss, param_miss(t->pdt, t->p, i, ref_lion_alternative(r, p_old[i], lr, sg), 0.0));
        if (miss > 1.0 && test_failures() < 20)
            EXPECT(0, "%s p %s/g %s [%lld]: lib %.9g ref %.9g (%.2f of the bar)", label, dtype_name(t->pdt),
                   dtype_name(t->gdt), (long long)i, load_d(t->p, t->pdt, i), t->ref.p[i], miss);
        worst = fmax(worst, miss);
        t->ref.p[i] = load_d(t->p, t->pdt, i);
    }
    return worst;
}

// Checks the library's 32-bit states against the reference within the tracked rounding bounds.
// Returns the largest |lib - ref| / bound.
static double pair_check_states32(const pair *t, const snap *s, const char *label) {
    double worst = 0.0;
    EXPECT(s->format == BNB8_STATE_32BIT && (int)s->nstates == t->ref.nstates,
           "%s: format %u, %u states", label, s->format, s->nstates);
    for (int k = 0; k < t->ref.nstates && s->f32[k]; k++)
        for (int64_t i = 0; i < t->n; i++) {
            double d = fabs(s->f32[k][i] - t->ref.s[k][i]), bound = t->ref.e[k][i];
            if (d > bound && test_failures() < 20)
                EXPECT(0, "%s state %d [%lld]: lib %.9g ref %.9g bound %.3g", label, k, (long long)i,
                       s->f32[k][i], t->ref.s[k][i], bound);
            if (bound > 0) worst = fmax(worst, d / bound);
            else if (d > 0) worst = INFINITY;
        }
    return worst;
}

// Checks the library's 8-bit states (codes and absmax) against the reference's fresh double states
// requantized by brute force. Tolerances, all derived from the tracked bounds e (|s_f32 - s| <= e):
// absmax: |amax_lib - amax| <= the largest e among the elements that can be the float max;
// a code may differ by one only where x = s/amax lies within the rounding of x of the threshold
// between the two codes, or (signed) where s is zero within e. Returns the largest absmax miss in
// float ulps through *amax_ulps.
static void pair_check_states8(const pair *t, const snap *s, const char *label, double *amax_ulps,
                               int64_t *near_threshold) {
    const ref_tensor *r = &t->ref;
    EXPECT(s->format == BNB8_STATE_8BIT && (int)s->nstates == r->nstates, "%s: format %u, %u states",
           label, s->format, s->nstates);
    for (int k = 0; k < r->nstates && s->codes[k]; k++) {
        int is_signed = ref_signed(r->kind, k);
        for (int64_t b = 0; b < s->nblocks; b++) {
            int64_t start = b * s->blocksize, end = start + s->blocksize < t->n ? start + s->blocksize : t->n;
            double amax = 0.0, emax_at = 0.0;
            for (int64_t i = start; i < end; i++)
                if (fabs(r->s[k][i]) > amax) { amax = fabs(r->s[k][i]); emax_at = r->e[k][i]; }
            double eamax = 0.0;   // elements that can be the float32 maximum
            for (int64_t i = start; i < end; i++)
                if (fabs(r->s[k][i]) + r->e[k][i] + emax_at >= amax) eamax = fmax(eamax, r->e[k][i]);
            double lib_amax = s->absmax[k][b], ulp = ldexp(1.0, ilogb(fmax(amax, 1e-38)) - 23);
            *amax_ulps = fmax(*amax_ulps, fabs(lib_amax - amax) / ulp);
            if (fabs(lib_amax - amax) > eamax && test_failures() < 20)
                EXPECT(0, "%s state %d block %lld: absmax lib %.9g ref %.9g (bound %.3g)", label, k,
                       (long long)b, lib_amax, amax, eamax);
            for (int64_t i = start; i < end; i++) {
                int q = s->codes[k][i];
                if (amax == 0.0) {
                    EXPECT(q == (is_signed ? 127 : 0), "%s: all-zero block code %d", label, q);
                    continue;
                }
                double x = r->s[k][i] / amax;
                int want = ref_code(is_signed, x, r->s[k][i]);
                if (q == want) continue;
                int ok = 0;
                if (abs(q - want) == 1) {
                    int lo = q < want ? q : want;
                    double ex = (r->e[k][i] + fabs(x) * eamax) / (amax - eamax) + 2.0 * U32 * fabs(x);
                    ok = fabs(x - map_thresh[is_signed][lo]) <= ex || (is_signed && lo == 126 && fabs(r->s[k][i]) <= r->e[k][i]);
                }
                *near_threshold += ok;
                if (!ok && test_failures() < 20)
                    EXPECT(0, "%s state %d [%lld]: code %d, reference %d (s %.9g, absmax %.9g)", label, k,
                           (long long)i, q, want, r->s[k][i], amax);
            }
        }
    }
}

// ------------------------------------------------------------------------------------------------
// 1. 32-bit optimizers against the reference: 20 steps, every optimizer, every dtype pair

static void run_32bit_case(bnb8_optim kind, bnb8_config c, const char *label) {
    const int64_t n = 5000;
    const int steps = 20;
    const bnb8_dtype dts[3] = {BNB8_F32, BNB8_BF16, BNB8_F16};
    c.format = BNB8_STATE_32BIT;
    test_rng rng = test_rng_new();
    bnb8_optimizer *opt = NULL;
    EXPECT(bnb8_optimizer_create(&opt, kind, &c) == 0, "create %s: %s", label, bnb8_last_error());
    if (!opt) return;
    pair T[9];
    for (int j = 0; j < 9; j++) {
        pair_init(&T[j], kind, &c, n, dts[j / 3], dts[j % 3], &rng);
        char name[32];
        snprintf(name, sizeof name, "t%d", j);
        EXPECT(bnb8_optimizer_add(opt, name, T[j].p, T[j].pdt, T[j].g, T[j].gdt, n, NULL) == 0, "add");
    }
    double worst = 0.0, worst_f32_end = 0.0, worst_state = 0.0;
    int clipped = 0, ties = 0;
    double *p_old = malloc(sizeof(double) * (size_t)n);
    for (int step = 1; step <= steps; step++) {
        float lr = c.lr * (1.0f - 0.02f * (float)step);     // a schedule: the lr passed per step counts
        float gscale = step % 3 == 0 ? 0.75f : 1.0f;          // the caller's global gradient scale
        for (int j = 0; j < 9; j++) pair_grad(&T[j], &rng, 0.01);
        EXPECT(bnb8_optimizer_step(opt, lr, gscale, NULL) == 0, "step: %s", bnb8_last_error());
        for (int j = 0; j < 9; j++) {
            memcpy(p_old, T[j].ref.p, sizeof(double) * (size_t)n);
            ref_step(&T[j].ref, T[j].gd, lr, gscale);
            clipped += T[j].ref.trust < 1.0;
            for (int64_t i = 0; i < n; i++) ties += T[j].ref.tie[i];
            double miss = pair_check_params(&T[j], p_old, lr, label);
            worst = fmax(worst, miss);
            if (step == steps && T[j].pdt == BNB8_F32) worst_f32_end = fmax(worst_f32_end, miss);
        }
    }
    snap s[9];
    if (snap_take(opt, s, 9))
        for (int j = 0; j < 9; j++) {
            EXPECT(s[j].step == steps, "%s: step count %lld", label, (long long)s[j].step);
            worst_state = fmax(worst_state, pair_check_states32(&T[j], &s[j], label));
        }
    snap_free(s, 9);
    if (kind == BNB8_LAMB || kind == BNB8_LARS)
        EXPECT(clipped > 0, "%s: max_unorm never clipped: the test would not see the trust ratio", label);
    if (verbose)
        printf("    %-22s worst param miss %.3f of the bar (f32 after %d steps %.3f), states %.3f of "
               "their bound, clipped %d, Lion ties %d\n", label, worst, steps, worst_f32_end, worst_state, clipped, ties);
    free(p_old);
    for (int j = 0; j < 9; j++) pair_free(&T[j]);
    bnb8_optimizer_free(opt);
}

static bnb8_config cfg_for(bnb8_optim kind) {
    bnb8_config c = bnb8_config_default(kind);
    c.weight_decay = 0.1f;    // non-zero everywhere: decoupled or L2 placement is part of the check
    return c;
}

static void test_32bit_reference(void) {
    bnb8_config c;
    c = cfg_for(BNB8_ADAMW); run_32bit_case(BNB8_ADAMW, c, "AdamW");
    c = cfg_for(BNB8_ADAM); run_32bit_case(BNB8_ADAM, c, "Adam (L2)");
    c = cfg_for(BNB8_SGD); c.dampening = 0.2f; run_32bit_case(BNB8_SGD, c, "SGD momentum+dampening");
    c = cfg_for(BNB8_SGD); c.nesterov = 1; run_32bit_case(BNB8_SGD, c, "SGD nesterov");
    c = cfg_for(BNB8_SGD); c.momentum = 0.0f; run_32bit_case(BNB8_SGD, c, "SGD no momentum");
    c = cfg_for(BNB8_LION); run_32bit_case(BNB8_LION, c, "Lion");
    c = cfg_for(BNB8_RMSPROP); c.lr = 1e-4f; run_32bit_case(BNB8_RMSPROP, c, "RMSprop");
    c = cfg_for(BNB8_ADAGRAD); c.lr = 1e-3f; run_32bit_case(BNB8_ADAGRAD, c, "Adagrad");
    c = cfg_for(BNB8_LAMB); c.max_unorm = 0.5f; run_32bit_case(BNB8_LAMB, c, "LAMB");
    c = cfg_for(BNB8_LARS); c.dampening = 0.1f; run_32bit_case(BNB8_LARS, c, "LARS");
    c = cfg_for(BNB8_ADEMAMIX); c.t_alpha = 10; c.t_beta3 = 12; run_32bit_case(BNB8_ADEMAMIX, c, "AdEMAMix warm-up");
    c = cfg_for(BNB8_ADEMAMIX); run_32bit_case(BNB8_ADEMAMIX, c, "AdEMAMix");
}

// ------------------------------------------------------------------------------------------------

void tests_optim(void) {
    verbose = getenv("BNB8_TEST_VERBOSE") != NULL;
    for (int is_signed = 0; is_signed < 2; is_signed++) {
        size_t size;
        uint8_t *text = slurp(test_data_path(is_signed ? "dynamic_map_signed.hex" : "dynamic_map_unsigned.hex"), &size);
        char *at = (char *)text;
        for (int i = 0; i < 256 && text; i++) {
            uint32_t bits = (uint32_t)strtoul(at, &at, 16);
            memcpy(&map_code[is_signed][i], &bits, 4);
        }
        if (!text) { printf("test_optim: cannot read the golden maps in test/data\n"); bnb8_map_dynamic(map_code[is_signed], is_signed); }
        free(text);
        for (int k = 0; k < 255; k++) map_thresh[is_signed][k] = (map_code[is_signed][k] + map_code[is_signed][k + 1]) * 0.5f;
        map_thresh[is_signed][255] = INFINITY;
    }
    snprintf(tmpdir, sizeof tmpdir, "/tmp/bnb8_optim_XXXXXX");
    if (!mkdtemp(tmpdir)) { printf("test_optim: mkdtemp failed\n"); return; }

    test_run("optim: 32-bit vs double reference, all optimizers and dtypes", test_32bit_reference);

    rmdir(tmpdir);
}
