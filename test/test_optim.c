/*
test_optim.c — the optimizers (DESIGN.md §5, §7, §12) against an independent double-precision
reference.

The reference at the top is written from DESIGN.md §5.3 alone: it never calls bnb8_direction or
bnb8_apply.
Next to every state element it carries a bound on how far a float32 evaluation of the same formulas
can be from its double value (each float32 rounding moves a result by at most 2^-24 of its size;
we charge ROUNDINGS of them per update, on the magnitude of the terms). Those bounds decide the only
places where the library may legitimately differ from the reference: a Lion sign of a value that is
zero within rounding, an 8-bit code next to a decision threshold, an absmax. Everything else is
checked against the bars of DESIGN.md §12, element by element, with fresh random inputs.

The library's states are read back through its own state file (bnb8_optimizer_save; layout in
bnb8.c: per tensor the gradient-norm history, the absmax of each state, the states, the weights).
BNB8_TEST_VERBOSE=1 prints the measured numbers quoted in the comments.

Sections: 1. 32-bit optimizers over 20 steps; 2. 8-bit vs 32-bit free running (DESIGN.md §12 bar, and
the bars derived from it for every optimizer); 3. one 8-bit step at a time, the reference restarted
from the library's dequantized states (checked_step; every optimizer, block size, dtype, and sign
preservation); 4. non-finite gradients; 5. percentile clipping, max_unorm and per-name overrides,
each against the reference and against a twin without the feature; 6. subset stepping; 7. the
paper's ablations (linear map, one absmax per tensor): against the reference, exactly against a
32-bit twin, and independent of the number of threads. The state files, memory accounting,
min_8bit_size and API misuse are in test_state.c.
*/
#define _POSIX_C_SOURCE 200809L   // mkdtemp
#define BNB8_INTERNAL             // bnb8_load, bnb8_store and the per-element step it checks
#include "test.h"
#include "bnb8.h"
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#ifdef _OPENMP
#include <omp.h>
#endif

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
// [map][is_signed]: the golden dynamic maps, and the linear maps written here from DESIGN.md §3
static float map_code[BNB8_NUM_MAPS][2][256], map_thresh[BNB8_NUM_MAPS][2][256];

// ------------------------------------------------------------------------------------------------
// The double-precision reference of DESIGN.md §5.3

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

// DESIGN.md §5.1: which states each optimizer keeps, and which are non-negative (unsigned map).
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
// it is (DESIGN.md §5.2).
static void ref_step(ref_tensor *r, const double *g, double lr, double gnorm_scale) {
    const bnb8_config *c = &r->c;
    const double t = (double)++r->t, R = ROUNDINGS * U32;
    double b1 = c->beta1, b2 = c->beta2, b3 = c->beta3, eps = c->eps, wd = c->weight_decay;
    double alpha = c->alpha, mu = c->momentum, damp = c->dampening;

    // Percentile clipping (DESIGN.md §5.4): history of squared norms of the raw gradient, all 100 set to
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

// A tensor's states as the library holds them, parsed from its state file.
typedef struct {
    int64_t n, step, blocksize, nblocks;
    int64_t block;                // elements per absmax: the block size, or n for block size 0
    uint32_t format, nstates;     // format: its low byte (bnb8_state_format)
    uint32_t map;                 // 8-bit: the map (bits 8..15 of the format field)
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
    uint8_t *f = test_slurp(path, &size);
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
        s[i].map = (s[i].format >> 8) & 0xffu;
        uint32_t dtype = s[i].format >> 24, corr = (s[i].format >> 16) & 0xffu;
        s[i].format &= 0xffu;
        if (s[i].format > BNB8_STATE_8BIT || s[i].map >= BNB8_NUM_MAPS || s[i].blocksize < 0 || corr) { ok = 0; break; }
        s[i].block = s[i].blocksize > 0 ? s[i].blocksize : s[i].n;
        int64_t n = s[i].n, nb = s[i].format ? (n + s[i].block - 1) / s[i].block : 0;
        uint64_t per_state = s[i].format ? (uint64_t)n + 4u * (uint64_t)nb : 4u * (uint64_t)n;
        uint64_t weights = (uint64_t)n * (dtype == BNB8_F32 ? 4u : 2u);   // after the states (DESIGN.md §7)
        uint64_t history = bytes - weights - per_state * s[i].nstates;
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
    if (!ok) snap_free(s, count);
    EXPECT(ok, "state file could not be parsed");
    free(f);
    return ok;
}

// Element i of state k as a double: code[q] * absmax exactly, or the float.
static double snap_value(const snap *s, bnb8_optim kind, int k, int64_t i) {
    if (s->format == BNB8_STATE_32BIT) return s->f32[k][i];
    return (double)map_code[s->map][ref_signed(kind, k)][s->codes[k][i]] * (double)s->absmax[k][i / s->block];
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

// Nearest code by brute force over the 255 float32 thresholds t_k = (c_k + c_{k+1}) * 0.5f
// (DESIGN.md §3): the number strictly below x; exactly on t_k goes to the even index of (k, k+1).
// For signed maps a negative state s whose code decodes to zero (or above) takes the largest code
// below zero instead (DESIGN.md §5.2): 126 in the dynamic map (zero at 127) and in the linear one
// (zeros at 127, 128).
static int ref_code(int map, int is_signed, double x, double s) {
    const float *code = map_code[map][is_signed];
    int q = 0;
    for (int k = 0; k < 255; k++) {
        double t = map_thresh[map][is_signed][k];
        if (t < x || (t == x && (k & 1))) q++;
    }
    if (is_signed && s < 0.0 && code[q] >= 0.0f)
        for (q = 0; code[q + 1] < 0.0f; q++) {}
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
    double lr_scale;              // this tensor's lr / the lr passed to the step (overrides)
    int hist_valid;               // ref.hist follows the library's (the last step was checked)
} pair;

static void pair_init(pair *t, bnb8_optim kind, const bnb8_config *c, int64_t n, bnb8_dtype pdt,
                      bnb8_dtype gdt, test_rng *rng) {
    t->n = n; t->pdt = pdt; t->gdt = gdt; t->id = -1; t->lr_scale = 1.0; t->hist_valid = 1;
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
// between the two codes, or (signed) where s is zero within e. Returns the largest absmax miss as a
// fraction of its bound through *amax_miss (in ulps it can be large where a block's few elements
// cancel, e.g. a one-element tail block of 0.9 buf + g + wd p).
static void pair_check_states8(const pair *t, const snap *s, const char *label, double *amax_miss,
                               int64_t *near_threshold) {
    const ref_tensor *r = &t->ref;
    EXPECT(s->format == BNB8_STATE_8BIT && (int)s->nstates == r->nstates, "%s: format %u, %u states",
           label, s->format, s->nstates);
    for (int k = 0; k < r->nstates && s->codes[k]; k++) {
        int is_signed = ref_signed(r->kind, k);
        const float *code = map_code[s->map][is_signed], *thresh = map_thresh[s->map][is_signed];
        for (int64_t b = 0; b < s->nblocks; b++) {
            int64_t start = b * s->block, end = start + s->block < t->n ? start + s->block : t->n;
            double amax = 0.0, emax_at = 0.0;
            for (int64_t i = start; i < end; i++)
                if (fabs(r->s[k][i]) > amax) { amax = fabs(r->s[k][i]); emax_at = r->e[k][i]; }
            double eamax = 0.0;   // elements that can be the float32 maximum
            for (int64_t i = start; i < end; i++)
                if (fabs(r->s[k][i]) + r->e[k][i] + emax_at >= amax) eamax = fmax(eamax, r->e[k][i]);
            double lib_amax = s->absmax[k][b];
            if (lib_amax != amax) *amax_miss = fmax(*amax_miss, eamax > 0.0 ? fabs(lib_amax - amax) / eamax : INFINITY);
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
                int want = ref_code(s->map, is_signed, x, r->s[k][i]);
                if (q == want) continue;
                // One code apart next to the threshold between them; or a signed state zero within its
                // rounding, whose float32 value may have the other sign: the largest negative code
                // (126) against a code of zero (127; or 128, the linear map's second zero).
                int lo = q < want ? q : want, hi = q < want ? want : q;
                double ex = (r->e[k][i] + fabs(x) * eamax) / (amax - eamax) + 2.0 * U32 * fabs(x);
                int ok = hi - lo == 1 && fabs(x - thresh[lo]) <= ex;
                if (is_signed && lo == 126 && code[hi] == 0.0f && (fabs(r->s[k][i]) <= r->e[k][i] || fabs(x) <= ex)) ok = 1;
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
// 2. 8-bit vs 32-bit, free running (DESIGN.md §12)
//
// Two optimizers, one with 8-bit and one with 32-bit states, start from the same p = 0.1 randn and
// see the same fresh g = 0.01 randn every step; neither is pulled back toward the other. The bar is
// a fixed fraction F of the distance the optimizer's updates cover: bar = F * A * sum_t lr rms(u_t),
// with rms(u_t) the rms of the update direction at step t, derived in closed form (not measured)
// for i.i.d. N(0, sigma^2) gradients and parameters of rms 0.1 (nominal_step):
//   Adam family (AdamW, Adam, AdEMAMix)  (1-b1)/(1-b1^t) sqrt((1-b1^2t)/(1-b1^2)): the bias-corrected
//                          m over sqrt(v) ~ sigma; 1 at t = 1, 0.229 later (AdEMAMix's alpha m2 adds
//                          alpha (1-b3) sqrt(t) <= 0.005 and is left out)
//   LAMB                   min(that, max_unorm rms(p)): the trust ratio caps |update| at max_unorm |p|
//   Lion                   1 (a sign)
//   RMSprop                1/sqrt(1 - alpha^t): s = (1 - alpha^t) sigma^2, no bias correction
//   Adagrad                1/sqrt(t): s = t sigma^2
//   SGD momentum           sigma sqrt((1 - mu^2t)/(1 - mu^2)): the rms of the buffer
//   LARS                   min(that, max_unorm rms(p)), the trust ratio cap
// F comes from DESIGN.md §12's one number: AdamW, 1024 x 1024, 100 steps, lr 1e-3, mean |p8 - p32| <=
// 2.5e-4, and sum_t rms(u_t) = 26.53 over its 100 steps, so F = 2.5e-4 / 26.53e-3 = 0.00942.
// A is the amplification of requantization noise in the state that sets the direction, relative to
// Adam's m: an EMA of decay b accumulates per-step noise e to e / sqrt(1 - b^2). Adam's m, SGD's and
// LARS' buffers, AdEMAMix's m1 all decay at 0.9: A = 1. Lion's m decays at beta2 = 0.99: A =
// sqrt((1 - 0.81)/(1 - 0.9801)) = 3.09 (without it Lion measures 1.25 of the bar). The unsigned
// accumulators of RMSprop and Adagrad enter through a square root and are given A = 1 (strict).
// Measured (BNB8_TEST_VERBOSE=1; several seeds agree to about 2%), mean |p8 - p32| / bar:
//   AdamW 0.73, Adam (L2 1e-2) 0.75, SGD 0.76, Lion 0.41, RMSprop 0.05, Adagrad 0.05, LAMB 0.86,
//   LARS 0.75, AdEMAMix 0.73.
// AdamW runs that bar's 1024 x 1024 (also under AddressSanitizer); the others 256 x 1024 to keep the
// suite fast (a mean over 2.6e5 elements is stable to well under 1% between seeds).
// The test also requires that the 8-bit run differs from the 32-bit one at all and that the 32-bit
// run moved the parameters by more than 4 bars (else the bar would say nothing).

#define FREE_F (2.5e-4 / 26.526126e-3)   // DESIGN.md §12's AdamW bar over its sum_t lr rms(u_t)

// lr * rms(u_t) * A of optimizer kind at step t (see above), sigma the gradients' deviation, prms
// the parameters' rms.
static double nominal_step(bnb8_optim kind, const bnb8_config *c, int t, double sigma, double prms) {
    double b1 = c->beta1, mu = c->momentum;
    double adam = (1.0 - b1) / (1.0 - pow(b1, t)) * sqrt((1.0 - pow(b1, 2.0 * t)) / (1.0 - b1 * b1));
    double sgd = sigma * sqrt((1.0 - pow(mu, 2.0 * t)) / (1.0 - mu * mu));
    switch (kind) {
    case BNB8_LAMB: return c->lr * fmin(adam, c->max_unorm * prms);
    case BNB8_LION: return c->lr * sqrt((1.0 - b1 * b1) / (1.0 - (double)c->beta2 * c->beta2));
    case BNB8_RMSPROP: return c->lr / sqrt(1.0 - pow(c->alpha, t));
    case BNB8_ADAGRAD: return c->lr / sqrt((double)t);
    case BNB8_SGD: return c->lr * sgd;
    case BNB8_LARS: return c->lr * fmin(sgd, c->max_unorm * prms);
    default: return c->lr * adam;   // AdamW, Adam, AdEMAMix
    }
}

// x[0..n) = sigma * N(0, 1), Box-Muller pairs from the harness generator, in chunks of 2^16 whose
// seeds are drawn from rng in order: the same numbers for any number of threads, made in parallel.
static void fill_randn(float *x, int64_t n, double sigma, test_rng *rng) {
    int64_t chunks = (n + 65535) >> 16;
    uint64_t *seeds = malloc(sizeof(uint64_t) * (size_t)chunks);
    for (int64_t c = 0; c < chunks; c++) seeds[c] = test_u64(rng);
    #pragma omp parallel for schedule(static)
    for (int64_t c = 0; c < chunks; c++) {
        test_rng r = {seeds[c]};
        int64_t end = (c + 1) << 16 < n ? (c + 1) << 16 : n;
        for (int64_t i = c << 16; i < end; i += 2) {
            double radius = sigma * sqrt(-2.0 * log(1.0 - test_uniform(&r))), angle = 6.283185307179586 * test_uniform(&r);
            x[i] = (float)(radius * cos(angle));
            if (i + 1 < end) x[i + 1] = (float)(radius * sin(angle));
        }
    }
    free(seeds);
}

// Runs the 8-bit and the 32-bit optimizer side by side; returns mean |p8 - p32| and, through
// *moved, mean |p32 - p0|.
static double free_running(bnb8_optim kind, bnb8_config c, int64_t n, int steps, double *moved) {
    test_rng rng = test_rng_new();
    float *p0 = malloc(sizeof(float) * (size_t)n), *p8 = malloc(sizeof(float) * (size_t)n);
    float *p32 = malloc(sizeof(float) * (size_t)n), *g = malloc(sizeof(float) * (size_t)n);
    fill_randn(p0, n, 0.1, &rng);
    memcpy(p8, p0, sizeof(float) * (size_t)n);
    memcpy(p32, p0, sizeof(float) * (size_t)n);
    bnb8_optimizer *o8 = NULL, *o32 = NULL;
    bnb8_config c8 = c, c32 = c;
    c8.format = BNB8_STATE_8BIT;
    c32.format = BNB8_STATE_32BIT;
    EXPECT(bnb8_optimizer_create(&o8, kind, &c8) == 0 && bnb8_optimizer_create(&o32, kind, &c32) == 0,
           "create: %s", bnb8_last_error());
    EXPECT(o8 && o32 && bnb8_optimizer_add(o8, "w", p8, BNB8_F32, g, BNB8_F32, n, NULL) == 0 &&
           bnb8_optimizer_add(o32, "w", p32, BNB8_F32, g, BNB8_F32, n, NULL) == 0, "add: %s", bnb8_last_error());
    double diff = 0.0;
    *moved = 0.0;
    for (int step = 0; o8 && o32 && step < steps; step++) {
        fill_randn(g, n, 0.01, &rng);   // one gradient buffer, read by both optimizers
        EXPECT(bnb8_optimizer_step(o8, c.lr, 1.0f, NULL) == 0 && bnb8_optimizer_step(o32, c.lr, 1.0f, NULL) == 0,
               "step: %s", bnb8_last_error());
    }
    for (int64_t i = 0; i < n; i++) {
        diff += fabs((double)p8[i] - p32[i]);
        *moved += fabs((double)p32[i] - p0[i]);
    }
    bnb8_optimizer_free(o8);
    bnb8_optimizer_free(o32);
    free(p0); free(p8); free(p32); free(g);
    *moved /= (double)n;
    return diff / (double)n;
}

static void test_8bit_vs_32bit(void) {
    const int steps = 100;
    for (int kind = 0; kind < BNB8_NUM_OPTIMIZERS; kind++) {
        bnb8_config c = bnb8_config_default((bnb8_optim)kind);
        if (kind == BNB8_ADAM) c.weight_decay = 1e-2f;    // L2 on: its placement is part of the run
        if (kind == BNB8_ADAMW) c.lr = 1e-3f;             // the bar's case (also the default)
        int64_t n = kind == BNB8_ADAMW ? 1024 * 1024 : 256 * 1024;
        double path = 0.0, moved;
        for (int t = 1; t <= steps; t++) path += nominal_step((bnb8_optim)kind, &c, t, 0.01, 0.1);
        double bar = FREE_F * path, diff = free_running((bnb8_optim)kind, c, n, steps, &moved);
        EXPECT(diff <= bar, "%s: mean |p8 - p32| = %.3g > bar %.3g", kind_name((bnb8_optim)kind), diff, bar);
        EXPECT(diff > 0.0, "%s: the 8-bit run equals the 32-bit run: 8-bit states not used?", kind_name((bnb8_optim)kind));
        EXPECT(moved > 4.0 * bar, "%s: the parameters moved only %.3g (bar %.3g): the bar would say nothing",
               kind_name((bnb8_optim)kind), moved, bar);
        if (verbose)
            printf("    %-9s n %7lld: mean |p8 - p32| %.3e, bar %.3e (%.3f of it); 32-bit moved %.3e\n",
                   kind_name((bnb8_optim)kind), (long long)n, diff, bar, diff / bar, moved);
    }
}

// ------------------------------------------------------------------------------------------------
// 3. Single steps checked element by element against the reference restarted from the library's
//    own states: 8-bit states dequantized (code * absmax, exact in double), updated in double,
//    requantized by brute force (pair_check_states8)

#define MAXT 8

typedef struct {
    double param, state32, amax;        // worst miss: parameters (of the bar), 32-bit states and
                                        // 8-bit absmax (of their rounding bounds)
    int64_t near;                       // codes one off the brute force, next to a threshold
} check_stats;

static int snap_equal(const snap *a, const snap *b) {
    if (a->n != b->n || a->step != b->step || a->format != b->format || a->nstates != b->nstates ||
        a->blocksize != b->blocksize || a->has_history != b->has_history)
        return 0;
    if (a->has_history && memcmp(a->history, b->history, sizeof a->history) != 0) return 0;
    for (uint32_t k = 0; k < a->nstates; k++) {
        if (a->format == BNB8_STATE_8BIT) {
            if (memcmp(a->absmax[k], b->absmax[k], 4 * (size_t)a->nblocks) != 0 ||
                memcmp(a->codes[k], b->codes[k], (size_t)a->n) != 0)
                return 0;
        } else if (memcmp(a->f32[k], b->f32[k], 4 * (size_t)a->n) != 0) {
            return 0;
        }
    }
    return 1;
}

// One step of the tensors ids[0..nids) (ids NULL: all, through bnb8_optimizer_step) at lr (each
// tensor's lr is lr * lr_scale) and gscale; the caller has set the gradients. Each stepped tensor
// is checked against the reference restarted from the library's states and parameters, with the
// reference's own step count (per tensor) and gradient-norm history; tensors not stepped must keep
// their parameters, states and step count byte for byte. out (may be NULL) receives the states after
// the step (the caller frees them with snap_free).
static void checked_step(bnb8_optimizer *opt, pair *T, int count, const int *ids, int nids, float lr,
                         float gscale, const char *label, check_stats *st, snap *out) {
    snap before[MAXT], after[MAXT];
    void *p_before[MAXT];
    int stepped[MAXT];
    for (int j = 0; j < count; j++) stepped[j] = ids == NULL;
    for (int i = 0; ids && i < nids; i++) stepped[ids[i]] = 1;
    if (out) memset(out, 0, sizeof(snap) * (size_t)count);
    if (!snap_take(opt, before, count)) return;
    for (int j = 0; j < count; j++) {
        pair *t = &T[j];
        size_t bytes = bnb8_dtype_size(t->pdt) * (size_t)t->n;
        p_before[j] = malloc(bytes);
        memcpy(p_before[j], t->p, bytes);
        EXPECT(before[j].step == t->ref.t, "%s tensor %d: step count %lld, expected %lld", label, j,
               (long long)before[j].step, (long long)t->ref.t);
        // The history of squared gradient norms must be the one the reference kept: the float of
        // each double norm, 1e-6 relative.
        int bad_history = 0;
        for (int h = 0; before[j].has_history && t->hist_valid && h < 100; h++)
            bad_history += fabs(before[j].history[h] - t->ref.hist[h]) > 1e-6 * t->ref.hist[h];
        EXPECT(bad_history == 0, "%s tensor %d: %d of 100 gradient-norm history entries differ from the reference",
               label, j, bad_history);
        ref_sync_states(&t->ref, &before[j]);
        for (int64_t i = 0; i < t->n; i++) t->ref.p[i] = load_d(t->p, t->pdt, i);
    }
    int status = ids ? bnb8_optimizer_step_tensors(opt, ids, nids, lr, gscale, NULL)
                     : bnb8_optimizer_step(opt, lr, gscale, NULL);
    EXPECT(status == 0, "%s: step: %s", label, bnb8_last_error());
    for (int j = 0; j < count; j++) {
        pair *t = &T[j];
        if (!stepped[j]) {
            EXPECT(memcmp(p_before[j], t->p, bnb8_dtype_size(t->pdt) * (size_t)t->n) == 0,
                   "%s: tensor %d was not stepped but its parameters changed", label, j);
            continue;
        }
        double *p_old = malloc(sizeof(double) * (size_t)t->n);
        memcpy(p_old, t->ref.p, sizeof(double) * (size_t)t->n);
        ref_step(&t->ref, t->gd, (double)lr * t->lr_scale, gscale);
        t->hist_valid = 1;
        st->param = fmax(st->param, pair_check_params(t, p_old, (double)lr * t->lr_scale, label));
        free(p_old);
    }
    if (snap_take(opt, after, count)) {
        for (int j = 0; j < count; j++) {
            if (!stepped[j]) {
                EXPECT(snap_equal(&before[j], &after[j]), "%s: tensor %d was not stepped but its states or "
                       "step count changed", label, j);
                continue;
            }
            EXPECT(after[j].step == T[j].ref.t, "%s tensor %d: step count %lld after the step, expected %lld",
                   label, j, (long long)after[j].step, (long long)T[j].ref.t);
            if (after[j].format == BNB8_STATE_8BIT) pair_check_states8(&T[j], &after[j], label, &st->amax, &st->near);
            else st->state32 = fmax(st->state32, pair_check_states32(&T[j], &after[j], label));
        }
    }
    if (out) memcpy(out, after, sizeof(snap) * (size_t)count);
    else snap_free(after, count);
    snap_free(before, count);
    for (int j = 0; j < count; j++) free(p_before[j]);
}

// Steps the library alone (warm-up); the references count the step and restart from the library's
// states at the next checked step.
static void unchecked_step(bnb8_optimizer *opt, pair *T, int count, float lr) {
    EXPECT(bnb8_optimizer_step(opt, lr, 1.0f, NULL) == 0, "warm-up step: %s", bnb8_last_error());
    for (int j = 0; j < count; j++) { T[j].ref.t++; T[j].hist_valid = 0; }
}

// Elements with no history: p = 0 and g = 0 in the warm-up steps, so all their states are exactly
// zero (and L2 adds nothing); at the checked step they get g = +-1e-10, states far below the zero
// code's threshold: a negative one must keep its sign (code 126, DESIGN.md §5.2), a positive one takes
// the zero code.
static int quiet(int64_t i) { return i % 29 == 3; }

static void quiet_grad(pair *t, test_rng *rng, int warmup) {
    for (int64_t i = 0; i < t->n; i++) {
        double g = !quiet(i) ? 0.01 * test_randn(rng) : warmup ? 0.0 : (i % 58 == 3 ? -1e-10 : 1e-10) * (1.0 + test_uniform(rng));
        bnb8_store(t->g, t->gdt, i, (float)g);
        t->gd[i] = load_d(t->g, t->gdt, i);
    }
}

// One checked 8-bit step of kind with configuration c (min_8bit_size 0): parameters f32 (f32 grads),
// bf16 (bf16 grads), f16 (f32 grads) of the given sizes; three warm-up steps make the states
// non-trivial, then one step at a scheduled lr and a gradient scale of 0.8 is checked. Then the sign
// rule on its own: a signed state that is negative beyond its float32 rounding must decode below
// zero, and one whose nearest code decodes to zero must be stored as the largest negative code, 126
// (counted in *kept_sign).
static void one_step_run(bnb8_optim kind, bnb8_config c, const int64_t sizes[3], const char *label,
                         check_stats *st, int64_t *kept_sign, int64_t *elements) {
    const bnb8_dtype pdts[3] = {BNB8_F32, BNB8_BF16, BNB8_F16}, gdts[3] = {BNB8_F32, BNB8_BF16, BNB8_F32};
    c.min_8bit_size = 0;
    c.format = BNB8_STATE_8BIT;
    test_rng rng = test_rng_new();
    bnb8_optimizer *opt = NULL;
    EXPECT(bnb8_optimizer_create(&opt, kind, &c) == 0, "%s: create: %s", label, bnb8_last_error());
    if (!opt) return;
    pair T[3];
    for (int j = 0; j < 3; j++) {
        pair_init(&T[j], kind, &c, sizes[j], pdts[j], gdts[j], &rng);
        for (int64_t i = 0; i < sizes[j]; i++) if (quiet(i)) bnb8_store(T[j].p, pdts[j], i, 0.0f);
        char name[16];
        snprintf(name, sizeof name, "t%d", j);
        EXPECT(bnb8_optimizer_add(opt, name, T[j].p, pdts[j], T[j].g, gdts[j], sizes[j], NULL) == 0,
               "%s: add: %s", label, bnb8_last_error());
        *elements += sizes[j];
    }
    for (int w = 0; w < 3; w++) {
        for (int j = 0; j < 3; j++) quiet_grad(&T[j], &rng, 1);
        unchecked_step(opt, T, 3, c.lr * (1.0f - 0.1f * (float)w));
    }
    for (int j = 0; j < 3; j++) quiet_grad(&T[j], &rng, 0);
    snap after[3];
    checked_step(opt, T, 3, NULL, 0, c.lr * 0.7f, 0.8f, label, st, after);
    for (int j = 0; j < 3; j++)
        for (int k = 0; k < T[j].ref.nstates && after[j].codes[k]; k++) {
            if (!ref_signed(kind, k)) continue;
            const float *code = map_code[after[j].map][1];
            for (int64_t i = 0; i < T[j].n; i++) {
                double s = T[j].ref.s[k][i], a = after[j].absmax[k][i / after[j].block];
                int q = after[j].codes[k][i];
                if (!(s + T[j].ref.e[k][i] < 0.0 && a > 0.0)) continue;
                if (code[q] >= 0.0f && test_failures() < 20)
                    EXPECT(0, "%s state %d [%lld]: negative %.3g stored as code %d, which decodes to %g (sign lost)",
                           label, k, (long long)i, s, q, (double)code[q]);
                if (!(s / a > map_thresh[after[j].map][1][126])) continue;
                (*kept_sign)++;
                if (q != 126 && test_failures() < 20)
                    EXPECT(0, "%s state %d [%lld]: negative %.3g stored as code %d, not 126", label, k, (long long)i, s, q);
            }
        }
    snap_free(after, 3);
    for (int j = 0; j < 3; j++) pair_free(&T[j]);
    bnb8_optimizer_free(opt);
}

// Every optimizer, block sizes 64..4096, sizes 3 blocks + 37, one block - 5, 2 blocks + 1.
static void test_8bit_one_step(void) {
    static const int64_t blocksizes[4] = {64, 256, 2048, 4096};
    for (int kind = 0; kind < BNB8_NUM_OPTIMIZERS; kind++) {
        check_stats st = {0};
        int64_t kept_sign = 0, elements = 0;
        for (int b = 0; b < 4; b++) {
            int64_t bs = blocksizes[b], sizes[3] = {3 * bs + 37, bs - 5, 2 * bs + 1};
            bnb8_config c = cfg_for((bnb8_optim)kind);
            c.blocksize = bs;
            char label[64];
            snprintf(label, sizeof label, "%s block %lld", kind_name((bnb8_optim)kind), (long long)bs);
            one_step_run((bnb8_optim)kind, c, sizes, label, &st, &kept_sign, &elements);
        }
        if (ref_signed((bnb8_optim)kind, 0))
            EXPECT(kept_sign > 0, "%s: no negative state rounded to the zero code: sign preservation untested",
                   kind_name((bnb8_optim)kind));
        if (verbose)
            printf("    %-9s %6lld elements: worst param miss %.3f of the bar, absmax %.3f of its bound, %lld "
                   "codes one off next to a threshold, %lld negative states kept their sign\n", kind_name((bnb8_optim)kind),
                   (long long)elements, st.param, st.amax, (long long)st.near, (long long)kept_sign);
    }
}

// ------------------------------------------------------------------------------------------------
// 4. Non-finite gradients (DESIGN.md §5.2)

// Gradients with NaN, +Inf and -Inf spread over blocks 0 and 1 and filling block 2 entirely; the
// step is checked against the reference (which leaves those elements as they are and updates the
// rest), the parameters of those elements must be bit-identical, their 32-bit states too (8-bit:
// the old value requantized with the block's new absmax, which pair_check_states8 checks), every
// absmax and state finite, and the count taken once.
static void test_nonfinite(void) {
    static const int64_t scattered[4] = {3, 10, 200, 300};
    const float bad[3] = {NAN, INFINITY, -INFINITY};
    const int64_t n = 1000, per_tensor = 4 + 256;
    for (int format = 0; format < 2; format++) {
        check_stats st = {0};
        for (int kind = 0; kind < BNB8_NUM_OPTIMIZERS; kind++) {
            bnb8_config c = cfg_for((bnb8_optim)kind);
            c.format = (bnb8_state_format)format;
            c.min_8bit_size = 0;
            char label[64];
            snprintf(label, sizeof label, "%s %s", kind_name((bnb8_optim)kind), format ? "8-bit" : "32-bit");
            test_rng rng = test_rng_new();
            bnb8_optimizer *opt = NULL;
            EXPECT(bnb8_optimizer_create(&opt, (bnb8_optim)kind, &c) == 0, "%s: create: %s", label, bnb8_last_error());
            if (!opt) return;
            pair T[2];
            pair_init(&T[0], (bnb8_optim)kind, &c, n, BNB8_F32, BNB8_F32, &rng);
            pair_init(&T[1], (bnb8_optim)kind, &c, n, BNB8_BF16, BNB8_F16, &rng);
            EXPECT(bnb8_optimizer_add(opt, "a", T[0].p, T[0].pdt, T[0].g, T[0].gdt, n, NULL) == 0 &&
                   bnb8_optimizer_add(opt, "b", T[1].p, T[1].pdt, T[1].g, T[1].gdt, n, NULL) == 0, "%s: add", label);
            for (int w = 0; w < 2; w++) {
                for (int j = 0; j < 2; j++) pair_grad(&T[j], &rng, 0.01);
                unchecked_step(opt, T, 2, c.lr);
            }
            EXPECT(test_take_nonfinite(opt) == 0, "%s: non-finite count after finite steps", label);
            void *p_old[2];
            snap pre[2], after[2];
            for (int j = 0; j < 2; j++) {
                pair_grad(&T[j], &rng, 0.01);
                for (int m = 0; m < 4; m++) bnb8_store(T[j].g, T[j].gdt, scattered[m], bad[m % 3]);
                for (int64_t i = 512; i < 768; i++) bnb8_store(T[j].g, T[j].gdt, i, bad[i % 3]);
                for (int64_t i = 0; i < n; i++) T[j].gd[i] = load_d(T[j].g, T[j].gdt, i);
                p_old[j] = malloc(bnb8_dtype_size(T[j].pdt) * (size_t)n);
                memcpy(p_old[j], T[j].p, bnb8_dtype_size(T[j].pdt) * (size_t)n);
            }
            int have_pre = snap_take(opt, pre, 2);
            checked_step(opt, T, 2, NULL, 0, c.lr, 1.0f, label, &st, after);
            int64_t counted = test_take_nonfinite(opt);
            EXPECT(counted == 2 * per_tensor, "%s: %lld non-finite gradients counted, %lld given", label,
                   (long long)counted, (long long)(2 * per_tensor));
            EXPECT(test_take_nonfinite(opt) == 0, "%s: the count is not reset by taking it", label);
            for (int j = 0; j < 2; j++) {
                size_t es = bnb8_dtype_size(T[j].pdt);
                int64_t kept = 0, bad_p = 0, bad_s = 0, nonfinite_states = 0;
                for (int64_t i = 0; i < n; i++) {
                    if (isfinite(T[j].gd[i])) continue;
                    kept++;
                    bad_p += memcmp((uint8_t *)p_old[j] + es * (size_t)i, (uint8_t *)T[j].p + es * (size_t)i, es) != 0;
                    for (int k = 0; have_pre && format == BNB8_STATE_32BIT && k < T[j].ref.nstates && after[j].f32[k]; k++)
                        bad_s += memcmp(&pre[j].f32[k][i], &after[j].f32[k][i], 4) != 0;
                }
                for (int k = 0; k < T[j].ref.nstates; k++) {
                    for (int64_t b = 0; after[j].absmax[k] && b < after[j].nblocks; b++)
                        nonfinite_states += !isfinite(after[j].absmax[k][b]);
                    for (int64_t i = 0; after[j].f32[k] && i < n; i++) nonfinite_states += !isfinite(after[j].f32[k][i]);
                }
                EXPECT(kept == per_tensor, "%s: %lld non-finite gradients in the test, expected %lld", label,
                       (long long)kept, (long long)per_tensor);
                EXPECT(bad_p == 0, "%s tensor %d: %lld parameters with a non-finite gradient changed", label, j, (long long)bad_p);
                EXPECT(bad_s == 0, "%s tensor %d: %lld 32-bit states with a non-finite gradient changed", label, j, (long long)bad_s);
                EXPECT(nonfinite_states == 0, "%s tensor %d: %lld non-finite absmax or states", label, j,
                       (long long)nonfinite_states);
                free(p_old[j]);
            }
            snap_free(pre, 2);
            snap_free(after, 2);
            for (int j = 0; j < 2; j++) pair_free(&T[j]);
            bnb8_optimizer_free(opt);
        }
        if (verbose)
            printf("    %s: worst param miss %.3f of the bar, 32-bit states %.3f of their bound, absmax %.3f "
                   "of its bound\n", format ? "8-bit" : "32-bit", st.param, st.state32, st.amax);
    }
}

// ------------------------------------------------------------------------------------------------
// 5. Percentile clipping, max_unorm, per-name overrides: each is checked against the reference, and
//    a twin optimizer without the feature, fed the same gradients, must end measurably elsewhere

// steps checked steps of kind with configuration on, and a twin with configuration off stepped
// alongside; returns max |p_on - p_off|. *active counts the steps where the reference clipped (its
// gradient scale or trust ratio below 1). The gradients' deviation at step t is 0.01 scale[t]
// exp(0.1 randn) (scale NULL: 1).
static double feature_run(bnb8_optim kind, bnb8_config on, bnb8_config off, int steps, const double *scale,
                          const char *label, int *active, check_stats *st) {
    const int64_t n = 3000;
    test_rng rng = test_rng_new();
    bnb8_optimizer *o_on = NULL, *o_off = NULL;
    EXPECT(bnb8_optimizer_create(&o_on, kind, &on) == 0 && bnb8_optimizer_create(&o_off, kind, &off) == 0,
           "%s: create: %s", label, bnb8_last_error());
    if (!o_on || !o_off) { bnb8_optimizer_free(o_on); bnb8_optimizer_free(o_off); return 0.0; }
    pair T;
    pair_init(&T, kind, &on, n, BNB8_F32, BNB8_F32, &rng);
    float *twin = malloc(sizeof(float) * (size_t)n);
    memcpy(twin, T.p, sizeof(float) * (size_t)n);
    EXPECT(bnb8_optimizer_add(o_on, "w", T.p, BNB8_F32, T.g, BNB8_F32, n, NULL) == 0 &&
           bnb8_optimizer_add(o_off, "w", twin, BNB8_F32, T.g, BNB8_F32, n, NULL) == 0, "%s: add", label);
    *active = 0;
    for (int step = 0; step < steps; step++) {
        pair_grad(&T, &rng, 0.01 * (scale ? scale[step] : 1.0) * exp(0.1 * test_randn(&rng)));
        checked_step(o_on, &T, 1, NULL, 0, on.lr, 1.0f, label, st, NULL);
        EXPECT(bnb8_optimizer_step(o_off, on.lr, 1.0f, NULL) == 0, "%s: twin step", label);
        *active += T.ref.scale < 0.999 || T.ref.trust < 0.999;
    }
    double diff = 0.0;
    for (int64_t i = 0; i < n; i++) diff = fmax(diff, fabs(((const float *)T.p)[i] - twin[i]));
    free(twin);
    pair_free(&T);
    bnb8_optimizer_free(o_on);
    bnb8_optimizer_free(o_off);
    return diff;
}

// A difference the feature must make: 100 times the parameter bar's floor (1e-6 * P_FLOOR); one
// clipped step of these runs moves a parameter by ~1e-5 or more.
#define FEATURE_MIN_DIFF (100.0 * 1e-6 * P_FLOOR)

static void test_clipping(void) {
    for (int format = 0; format < 2; format++) {
        const char *fmt = format ? "8-bit" : "32-bit";
        char label[64];
        int active;
        check_stats st = {0};
        // Percentile clipping at the 10th percentile of the last 100 norms, on SGD (linear in g). The
        // history starts as 100 copies of the first norm, so within 12 steps the clip value stays
        // the first norm: the 8 steps with a larger scale are clipped, the 3 with a smaller one not.
        // Every ratio to the first is >= 2 or <= 0.4, 4.9 sigma of the exp(0.1 randn) noise of two
        // steps away from 1: the counts hold for every seed.
        static const double scale[12] = {0.5, 1.0, 0.2, 2.0, 1.0, 0.15, 1.5, 1.5, 3.0, 0.1, 1.2, 1.0};
        bnb8_config on = cfg_for(BNB8_SGD), off;
        on.format = (bnb8_state_format)format;
        on.min_8bit_size = 0;
        on.percentile_clipping = 10;
        off = on;
        off.percentile_clipping = 100;
        snprintf(label, sizeof label, "SGD percentile 10 %s", fmt);
        double diff = feature_run(BNB8_SGD, on, off, 12, scale, label, &active, &st);
        EXPECT(active == 8, "%s: the reference clipped %d of 12 steps, expected 8", label, active);
        EXPECT(diff > FEATURE_MIN_DIFF, "%s: clipping changed the parameters by only %.3g", label, diff);
        if (verbose) printf("    %-26s clipped %2d of 12 steps, max |p - p unclipped| %.3g, worst miss %.3f\n", label, active, diff, st.param);
        // max_unorm, LAMB and LARS: the trust ratio against the same optimizer with it off.
        for (int lars = 0; lars < 2; lars++) {
            bnb8_optim kind = lars ? BNB8_LARS : BNB8_LAMB;
            check_stats st2 = {0};
            on = cfg_for(kind);
            on.format = (bnb8_state_format)format;
            on.min_8bit_size = 0;
            on.max_unorm = lars ? 0.02f : 0.5f;
            off = on;
            off.max_unorm = 0.0f;
            snprintf(label, sizeof label, "%s max_unorm %g %s", kind_name(kind), (double)on.max_unorm, fmt);
            diff = feature_run(kind, on, off, 5, NULL, label, &active, &st2);
            EXPECT(active == 5, "%s: the reference's trust ratio was below 1 in only %d of 5 steps", label, active);
            EXPECT(diff > FEATURE_MIN_DIFF, "%s: max_unorm changed the parameters by only %.3g", label, diff);
            if (verbose) printf("    %-26s clipped %2d of  5 steps, max |p - p unclipped| %.3g, worst miss %.3f\n", label, active, diff, st2.param);
        }
    }
}

// Overrides: "wte" keeps 32-bit states at 3x the lr, beta1 0.8 and no weight decay; "h1" has block
// size 128, half the lr and weight decay 0.3; "h0" has the base configuration (AdamW, 8-bit, block
// 256, wd 0.1). The steps pass a scheduled lr (0.6x the base): an override's lr must follow it.
// Checked against references with each tensor's own configuration, the formats and block sizes
// read from the state file, and a twin without overrides: "h0" must be bit-identical in both,
// "wte" and "h1" far apart.
static void test_overrides(void) {
    const int64_t sizes[3] = {5000, 4500, 4700};
    const char *names[3] = {"wte", "h0", "h1"};
    bnb8_config base = cfg_for(BNB8_ADAMW), over[3];
    over[0] = over[1] = over[2] = base;
    over[0].format = BNB8_STATE_32BIT; over[0].lr = 3.0f * base.lr; over[0].beta1 = 0.8f; over[0].weight_decay = 0.0f;
    over[2].blocksize = 128; over[2].lr = 0.5f * base.lr; over[2].weight_decay = 0.3f;
    test_rng rng = test_rng_new();
    bnb8_optimizer *opt = NULL, *twin = NULL;
    EXPECT(bnb8_optimizer_create(&opt, BNB8_ADAMW, &base) == 0 && bnb8_optimizer_create(&twin, BNB8_ADAMW, &base) == 0,
           "create: %s", bnb8_last_error());
    if (!opt || !twin) { bnb8_optimizer_free(opt); bnb8_optimizer_free(twin); return; }
    // h1 twice (the second replaces the first), from a buffer overwritten after (the name is copied)
    char h1[3] = "h1";
    EXPECT(bnb8_optimizer_override(opt, "wte", &over[0]) == 0 && bnb8_optimizer_override(opt, h1, &over[0]) == 0 &&
           bnb8_optimizer_override(opt, h1, &over[2]) == 0 && bnb8_optimizer_override(opt, "not_added", &over[0]) == 0,
           "override: %s", bnb8_last_error());
    strcpy(h1, "xx");
    pair T[3];
    float *tp[3];
    for (int j = 0; j < 3; j++) {
        pair_init(&T[j], BNB8_ADAMW, &over[j], sizes[j], BNB8_F32, BNB8_F32, &rng);
        T[j].lr_scale = (double)over[j].lr / base.lr;
        tp[j] = malloc(sizeof(float) * (size_t)sizes[j]);
        memcpy(tp[j], T[j].p, sizeof(float) * (size_t)sizes[j]);
        EXPECT(bnb8_optimizer_add(opt, names[j], T[j].p, BNB8_F32, T[j].g, BNB8_F32, sizes[j], NULL) == 0 &&
               bnb8_optimizer_add(twin, names[j], tp[j], BNB8_F32, T[j].g, BNB8_F32, sizes[j], NULL) == 0,
               "add %s: %s", names[j], bnb8_last_error());
    }
    check_stats st = {0};
    snap s[3];
    for (int step = 0; step < 3; step++) {
        for (int j = 0; j < 3; j++) pair_grad(&T[j], &rng, 0.01);
        float lr = 0.6f * base.lr;
        checked_step(opt, T, 3, NULL, 0, lr, 1.0f, "overrides", &st, s);
        EXPECT(bnb8_optimizer_step(twin, lr, 1.0f, NULL) == 0, "twin step");
        EXPECT(s[0].format == BNB8_STATE_32BIT && s[1].format == BNB8_STATE_8BIT && s[2].format == BNB8_STATE_8BIT,
               "formats %u %u %u, expected 32-bit for wte, 8-bit for h0, h1", s[0].format, s[1].format, s[2].format);
        EXPECT(s[1].blocksize == 256 && s[2].blocksize == 128, "block sizes %lld %lld, expected 256, 128",
               (long long)s[1].blocksize, (long long)s[2].blocksize);
        snap_free(s, 3);
    }
    double diff[3] = {0.0, 0.0, 0.0};
    for (int j = 0; j < 3; j++)
        for (int64_t i = 0; i < sizes[j]; i++) diff[j] = fmax(diff[j], fabs(((const float *)T[j].p)[i] - tp[j][i]));
    EXPECT(diff[1] == 0.0, "h0 has no override, yet differs from the twin by %.3g", diff[1]);
    EXPECT(diff[0] > FEATURE_MIN_DIFF && diff[2] > FEATURE_MIN_DIFF, "overrides changed wte by %.3g, h1 by %.3g only",
           diff[0], diff[2]);
    if (verbose)
        printf("    worst param miss %.3f of the bar, 32-bit states %.3f of their bound; max |p - p without "
               "overrides|: wte %.3g, h0 %.3g, h1 %.3g\n", st.param, st.state32, diff[0], diff[1], diff[2]);
    for (int j = 0; j < 3; j++) { pair_free(&T[j]); free(tp[j]); }
    bnb8_optimizer_free(opt);
    bnb8_optimizer_free(twin);
}

// ------------------------------------------------------------------------------------------------
// 6. Subset stepping (bnb8_optimizer_step_tensors, DESIGN.md §5.5)

// AdamW (its bias correction depends on the step count) with three tensors, stepped as all, {0},
// {0}, {2, 0}, {1}, {} with fresh gradients for every tensor each time: the stepped ones match the
// reference run with their own step counts (4, 2, 2 at the end), the others keep parameters, states
// and step counts byte for byte (checked_step).
static void test_step_subset(void) {
    const int64_t sizes[3] = {1500, 2000, 700};
    const bnb8_dtype pdts[3] = {BNB8_F32, BNB8_BF16, BNB8_F16};
    static const int sets[6][2] = {{-1, -1}, {0, -1}, {0, -1}, {2, 0}, {1, -1}, {-1, -1}};
    static const int set_sizes[6] = {3, 1, 1, 2, 1, 0};
    const int64_t want[3] = {4, 2, 2};
    for (int format = 0; format < 2; format++) {
        bnb8_config c = cfg_for(BNB8_ADAMW);
        c.format = (bnb8_state_format)format;
        c.min_8bit_size = 0;
        const char *label = format ? "subset 8-bit" : "subset 32-bit";
        test_rng rng = test_rng_new();
        bnb8_optimizer *opt = NULL;
        EXPECT(bnb8_optimizer_create(&opt, BNB8_ADAMW, &c) == 0, "create: %s", bnb8_last_error());
        if (!opt) return;
        pair T[3];
        for (int j = 0; j < 3; j++) {
            pair_init(&T[j], BNB8_ADAMW, &c, sizes[j], pdts[j], BNB8_F32, &rng);
            char name[16];
            snprintf(name, sizeof name, "t%d", j);
            EXPECT(bnb8_optimizer_add(opt, name, T[j].p, pdts[j], T[j].g, BNB8_F32, sizes[j], &T[j].id) == 0 &&
                   T[j].id == j, "add: %s", bnb8_last_error());
        }
        check_stats st = {0};
        for (int r = 0; r < 6; r++) {
            for (int j = 0; j < 3; j++) pair_grad(&T[j], &rng, 0.01);
            int all = r == 0;
            checked_step(opt, T, 3, all ? NULL : sets[r], all ? 0 : set_sizes[r], c.lr, 1.0f, label, &st, NULL);
        }
        for (int j = 0; j < 3; j++)
            EXPECT(bnb8_optimizer_step_count(opt, j) == want[j] && T[j].ref.t == want[j], "%s: tensor %d has %lld steps, "
                   "expected %lld", label, j, (long long)bnb8_optimizer_step_count(opt, j), (long long)want[j]);
        if (verbose)
            printf("    %s: worst param miss %.3f of the bar, 32-bit states %.3f of their bound, absmax %.3f of its bound\n",
                   label, st.param, st.state32, st.amax);
        for (int j = 0; j < 3; j++) pair_free(&T[j]);
        bnb8_optimizer_free(opt);
    }
}

// ------------------------------------------------------------------------------------------------
// 7. The paper's ablations: the linear map, and one absmax per tensor (blocksize 0)

// Every optimizer, one checked step as in section 3: the linear map in blocks of 256 (sizes 3
// blocks + 37, one block - 5, 2 blocks + 1), and one absmax per tensor with either map (sizes over
// several of the CPU's 4096-element chunks, under one, and one past two).
static void test_ablation_one_step(void) {
    static const int64_t blocked[3] = {3 * 256 + 37, 256 - 5, 2 * 256 + 1}, whole[3] = {3 * 4096 + 37, 4091, 2 * 4096 + 1};
    for (int kind = 0; kind < BNB8_NUM_OPTIMIZERS; kind++)
        for (int v = 0; v < 3; v++) {
            bnb8_config c = cfg_for((bnb8_optim)kind);
            c.map = v == 2 ? BNB8_MAP_DYNAMIC : BNB8_MAP_LINEAR;
            c.blocksize = v == 0 ? 256 : 0;
            char label[64];
            snprintf(label, sizeof label, "%s %s block %lld", kind_name((bnb8_optim)kind), v == 2 ? "dynamic" : "linear",
                     (long long)c.blocksize);
            check_stats st = {0};
            int64_t kept_sign = 0, elements = 0;
            one_step_run((bnb8_optim)kind, c, v == 0 ? blocked : whole, label, &st, &kept_sign, &elements);
            if (ref_signed((bnb8_optim)kind, 0))
                EXPECT(kept_sign > 0, "%s: no negative state rounded to a zero code: the sign rule is untested", label);
            if (verbose)
                printf("    %-26s %6lld elements: worst param miss %.3f of the bar, absmax %.3f of its bound, %lld "
                       "codes one off next to a threshold, %lld negative states kept their sign\n", label,
                       (long long)elements, st.param, st.amax, (long long)st.near, (long long)kept_sign);
        }
}

// Sets the 32-bit states of opt's only tensor (without gradient-norm history) to v[k][0..n) through
// its own state file: saved, the state bytes replaced, the record's CRC made right, loaded (the
// weights in the file are the tensor's own: they stay).
static int set_states32(bnb8_optimizer *opt, int nstates, int64_t n, float *const v[3]) {
    char path[256];
    tmp_path(path, sizeof path, "twin.bin");
    size_t size = 0;
    uint8_t *f = bnb8_optimizer_save(opt, path) == 0 ? test_slurp(path, &size) : NULL;
    uint32_t name_len = 0;
    if (f && size > 28) memcpy(&name_len, f + 24, 4);
    // The header (24 bytes), the name, 40 bytes of fields, the states, the weights (as they are, fp32
    // or 16-bit), the record's CRC.
    size_t record = 24, data = record + 4 + name_len + 40, states = 4 * (size_t)n * (size_t)nstates;
    int ok = f && (data + states + 4 * (size_t)n + 4 == size || data + states + 2 * (size_t)n + 4 == size);
    for (int k = 0; ok && k < nstates; k++) memcpy(f + data + 4 * (size_t)n * (size_t)k, v[k], 4 * (size_t)n);
    if (ok) {
        uint32_t crc = test_crc32(f + record, size - 4 - record);
        memcpy(f + size - 4, &crc, 4);
        FILE *out = fopen(path, "wb");
        ok = out && fwrite(f, 1, size, out) == size;
        if (out) ok &= fclose(out) == 0;
        ok = ok && bnb8_optimizer_load(opt, path) == 0;
    }
    EXPECT(ok, "setting the twin's states failed: %s", bnb8_last_error());
    free(f);
    remove(path);
    return ok;
}

// Exact codes, every element, every step. An 8-bit optimizer and a 32-bit twin of the same
// configuration take the same gradients; before each step the twin's states are set to the 8-bit
// states dequantized in float32 (code * absmax: what the 8-bit step starts from), so both compute
// the same fresh float32 states, and the twin keeps them. Then the parameters must be bit-identical,
// every absmax the max |state| over its block (the whole tensor for blocksize 0), every code the
// brute-force nearest code of state / absmax (IEEE float division, DESIGN.md §5.2) with the sign rule
// (ref_code), and no negative state may decode to 0 or above. Quiet elements (p = 0, g = 0 or
// +-1e-10) give states exactly 0 and tiny ones of both signs; elements 256..511 stay exactly 0 (an
// all-zero block at blocksize 256). *kept_sign counts the negative states whose nearest code
// decoded to zero.
static void twin_run(bnb8_optim kind, bnb8_config c, int64_t n, int steps, const char *label, int64_t *kept_sign) {
    c.min_8bit_size = 0;
    bnb8_config c8 = c, c32 = c;
    c8.format = BNB8_STATE_8BIT;
    c32.format = BNB8_STATE_32BIT;
    test_rng rng = test_rng_new();
    bnb8_optimizer *o8 = NULL, *o32 = NULL;
    EXPECT(bnb8_optimizer_create(&o8, kind, &c8) == 0 && bnb8_optimizer_create(&o32, kind, &c32) == 0,
           "%s: create: %s", label, bnb8_last_error());
    float *p8 = malloc(sizeof(float) * (size_t)n), *p32 = malloc(sizeof(float) * (size_t)n), *g = malloc(sizeof(float) * (size_t)n);
    float *v[3];
    for (int k = 0; k < 3; k++) v[k] = malloc(sizeof(float) * (size_t)n);
    for (int64_t i = 0; i < n; i++) p8[i] = p32[i] = quiet(i) || (i >= 256 && i < 512) ? 0.0f : (float)(0.1 * test_randn(&rng));
    EXPECT(o8 && o32 && bnb8_optimizer_add(o8, "w", p8, BNB8_F32, g, BNB8_F32, n, NULL) == 0 &&
           bnb8_optimizer_add(o32, "w", p32, BNB8_F32, g, BNB8_F32, n, NULL) == 0, "%s: add: %s", label, bnb8_last_error());
    int nstates = ref_nstates(kind, &c);
    for (int step = 1; o8 && o32 && step <= steps && test_failures() < 20; step++) {
        for (int64_t i = 0; i < n; i++)
            g[i] = i >= 256 && i < 512 ? 0.0f : !quiet(i) ? (float)(0.01 * test_randn(&rng))
                 : i % 3 == 0 ? 0.0f : (float)((i % 2 ? 1e-10 : -1e-10) * (1.0 + test_uniform(&rng)));
        snap s8, s32;
        if (!snap_take(o8, &s8, 1)) break;
        for (int k = 0; k < nstates; k++)
            for (int64_t i = 0; i < n; i++)
                v[k][i] = map_code[s8.map][ref_signed(kind, k)][s8.codes[k][i]] * s8.absmax[k][i / s8.block];
        snap_free(&s8, 1);
        if (!set_states32(o32, nstates, n, v)) break;
        float lr = c.lr * (1.0f - 0.1f * (float)step);
        EXPECT(bnb8_optimizer_step(o8, lr, 0.8f, NULL) == 0 && bnb8_optimizer_step(o32, lr, 0.8f, NULL) == 0,
               "%s: step: %s", label, bnb8_last_error());
        EXPECT(memcmp(p8, p32, sizeof(float) * (size_t)n) == 0, "%s step %d: the parameters differ from the 32-bit twin's",
               label, step);
        if (!snap_take(o8, &s8, 1)) break;
        if (!snap_take(o32, &s32, 1)) { snap_free(&s8, 1); break; }
        EXPECT(s8.map == (uint32_t)c.map && s8.blocksize == c.blocksize && s8.nblocks == (c.blocksize ? (n + c.blocksize - 1) / c.blocksize : 1),
               "%s: the file records map %u, block size %lld, %lld blocks", label, s8.map, (long long)s8.blocksize, (long long)s8.nblocks);
        for (int k = 0; k < nstates && s8.codes[k] && s32.f32[k]; k++) {
            int is_signed = ref_signed(kind, k);
            const float *code = map_code[c.map][is_signed];
            for (int64_t b = 0; b < s8.nblocks; b++) {
                int64_t start = b * s8.block, end = start + s8.block < n ? start + s8.block : n;
                float amax = 0.0f;
                for (int64_t i = start; i < end; i++) amax = fabsf(s32.f32[k][i]) > amax ? fabsf(s32.f32[k][i]) : amax;
                EXPECT(memcmp(&amax, &s8.absmax[k][b], 4) == 0, "%s step %d state %d block %lld: absmax %.9g, max |state| %.9g",
                       label, step, k, (long long)b, (double)s8.absmax[k][b], (double)amax);
                for (int64_t i = start; i < end && test_failures() < 20; i++) {
                    float x = s32.f32[k][i], q = amax > 0.0f ? x / amax : 0.0f;
                    int want = amax > 0.0f ? ref_code(c.map, is_signed, q, x) : is_signed ? 127 : 0, got = s8.codes[k][i];
                    EXPECT(got == want, "%s step %d state %d [%lld]: code %d, brute force %d (state %.9g, absmax %.9g)",
                           label, step, k, (long long)i, got, want, (double)x, (double)amax);
                    EXPECT(!(x < 0.0f) || code[got] < 0.0f, "%s step %d state %d [%lld]: negative %.9g decodes to %g",
                           label, step, k, (long long)i, (double)x, (double)code[got]);
                    if (is_signed && x < 0.0f && amax > 0.0f && q > map_thresh[c.map][1][126]) (*kept_sign)++;
                }
            }
        }
        snap_free(&s8, 1);
        snap_free(&s32, 1);
    }
    for (int k = 0; k < 3; k++) free(v[k]);
    free(p8); free(p32); free(g);
    bnb8_optimizer_free(o8);
    bnb8_optimizer_free(o32);
}

// AdamW (signed m, unsigned v), Lion and SGD with momentum, each map, in blocks of 256 and with one
// absmax per tensor; 4 steps each. The dynamic map in blocks is today's 8-bit path, checked the same way.
static void test_ablation_exact(void) {
    float lib[256];
    for (int is_signed = 0; is_signed < 2; is_signed++) {
        bnb8_map_linear(is_signed, lib);
        EXPECT(memcmp(lib, map_code[BNB8_MAP_LINEAR][is_signed], sizeof lib) == 0,
               "bnb8_map_linear(%d) differs from DESIGN.md §3's values rounded once", is_signed);
    }
    const bnb8_optim kinds[3] = {BNB8_ADAMW, BNB8_LION, BNB8_SGD};
    for (int kk = 0; kk < 3; kk++) {
        int64_t kept_sign = 0;
        for (int map = 0; map < BNB8_NUM_MAPS; map++)
            for (int whole = 0; whole < 2; whole++) {
                bnb8_config c = cfg_for(kinds[kk]);
                c.map = (bnb8_map)map;
                c.blocksize = whole ? 0 : 256;
                char label[64];
                snprintf(label, sizeof label, "%s %s block %lld", kind_name(kinds[kk]), map ? "linear" : "dynamic",
                         (long long)c.blocksize);
                twin_run(kinds[kk], c, whole ? 3 * 4096 + 77 : 2000, 4, label, &kept_sign);
            }
        EXPECT(kept_sign > 0, "%s: no negative state landed next to zero: the sign rule is untested", kind_name(kinds[kk]));
        if (verbose) printf("    %-6s codes and absmax exact; %lld negative states next to zero kept their sign\n",
                            kind_name(kinds[kk]), (long long)kept_sign);
    }
    // Where state / absmax underflows to -0 (the linear map's tie at 0 goes to its second zero, 128)
    // a negative state must still take 126: SGD's first buffer is the gradient, -2^-149 next to 3.
    // A second tensor of zeros only: absmax 0 and the zero code (127 signed) everywhere.
    for (int map = 0; map < BNB8_NUM_MAPS; map++)
        for (int whole = 0; whole < 2; whole++) {
            bnb8_config c = bnb8_config_default(BNB8_SGD);
            c.map = (bnb8_map)map;
            c.blocksize = whole ? 0 : 256;
            c.min_8bit_size = 0;
            float p[2][1000] = {{0}}, g[2][1000] = {{0}};
            g[0][0] = -0x1p-149f;
            g[0][1] = 3.0f;
            bnb8_optimizer *opt = NULL;
            EXPECT(bnb8_optimizer_create(&opt, BNB8_SGD, &c) == 0 && opt &&
                   bnb8_optimizer_add(opt, "u", p[0], BNB8_F32, g[0], BNB8_F32, 1000, NULL) == 0 &&
                   bnb8_optimizer_add(opt, "z", p[1], BNB8_F32, g[1], BNB8_F32, 1000, NULL) == 0 &&
                   bnb8_optimizer_step(opt, c.lr, 1.0f, NULL) == 0, "underflow: %s", bnb8_last_error());
            snap sn[2];
            if (opt && snap_take(opt, sn, 2)) {
                EXPECT(sn[0].codes[0][0] == 126 && sn[0].absmax[0][0] == 3.0f, "%s map, block %lld: -2^-149 next to 3 "
                       "stored as code %d (absmax %g), expected 126", map ? "linear" : "dynamic", (long long)c.blocksize,
                       sn[0].codes[0][0], (double)sn[0].absmax[0][0]);
                int64_t wrong = 0;
                for (int64_t i = 0; i < 1000; i++) wrong += sn[1].codes[0][i] != 127;
                for (int64_t b = 0; b < sn[1].nblocks; b++) wrong += sn[1].absmax[0][b] != 0.0f;
                EXPECT(wrong == 0, "%s map, block %lld: %lld codes or absmax of an all-zero tensor are not 127 and 0",
                       map ? "linear" : "dynamic", (long long)c.blocksize, (long long)wrong);
                snap_free(sn, 2);
            }
            bnb8_optimizer_free(opt);
        }
}

// One absmax per tensor does not depend on the number of threads: the same run with 1 and with 3
// OpenMP threads gives the same parameters and the same state file, byte for byte. And a tensor
// that fits in one block of 4096 gets from blocksize 0 exactly what blocksize 4096 gives it (the
// same one block, in two passes instead of one).
static void test_per_tensor_threads(void) {
    const int64_t n = 10 * 4096 + 7, small = 3001;
    char path[2][256];
    tmp_path(path[0], sizeof path[0], "threads1.bin");
    tmp_path(path[1], sizeof path[1], "threads3.bin");
    for (int map = 0; map < BNB8_NUM_MAPS; map++) {
        bnb8_config c = cfg_for(BNB8_ADAMW);
        c.map = (bnb8_map)map;
        c.blocksize = 0;
        c.min_8bit_size = 0;
        float *p[2], *g = malloc(sizeof(float) * (size_t)n);
        test_rng seeds = test_rng_new();
#ifdef _OPENMP
        int threads = omp_get_max_threads();
#endif
        for (int run = 0; run < 2; run++) {
#ifdef _OPENMP
            omp_set_num_threads(run == 0 ? 1 : 3);
#endif
            test_rng rng = seeds;
            bnb8_optimizer *opt = NULL;
            p[run] = malloc(sizeof(float) * (size_t)n);
            for (int64_t i = 0; i < n; i++) p[run][i] = (float)(0.1 * test_randn(&rng));
            EXPECT(bnb8_optimizer_create(&opt, BNB8_ADAMW, &c) == 0 && opt &&
                   bnb8_optimizer_add(opt, "w", p[run], BNB8_F32, g, BNB8_F32, n, NULL) == 0, "create/add: %s", bnb8_last_error());
            for (int step = 0; opt && step < 5; step++) {
                for (int64_t i = 0; i < n; i++) g[i] = (float)(0.01 * test_randn(&rng));
                if (step == 3) g[n / 2] = NAN;
                EXPECT(bnb8_optimizer_step(opt, c.lr, 1.0f, NULL) == 0, "step: %s", bnb8_last_error());
            }
            EXPECT(opt && test_take_nonfinite(opt) == 1, "the NaN gradient was not counted once");
            EXPECT(opt && bnb8_optimizer_save(opt, path[run]) == 0, "save: %s", bnb8_last_error());
            bnb8_optimizer_free(opt);
        }
#ifdef _OPENMP
        omp_set_num_threads(threads);
#endif
        size_t size[2];
        uint8_t *f[2] = {test_slurp(path[0], &size[0]), test_slurp(path[1], &size[1])};
        EXPECT(f[0] && f[1] && size[0] == size[1] && memcmp(f[0], f[1], size[0]) == 0,
               "%s map: the state file with 3 threads differs from the one with 1", map ? "linear" : "dynamic");
        EXPECT(memcmp(p[0], p[1], sizeof(float) * (size_t)n) == 0, "%s map: the parameters with 3 threads differ from 1 thread's",
               map ? "linear" : "dynamic");
        free(f[0]); free(f[1]); free(p[0]); free(p[1]); free(g);

        // blocksize 0 against blocksize 4096 on a tensor of one block.
        bnb8_optimizer *o[2] = {NULL, NULL};
        float *q[2];
        test_rng rng = test_rng_new();
        float *g2 = malloc(sizeof(float) * (size_t)small);
        for (int j = 0; j < 2; j++) {
            bnb8_config cj = c;
            cj.blocksize = j ? 4096 : 0;
            q[j] = malloc(sizeof(float) * (size_t)small);
            for (int64_t i = 0; i < small; i++) q[j][i] = (float)(0.1 * ((i * 7919) % 1000 - 500) / 500.0);
            EXPECT(bnb8_optimizer_create(&o[j], BNB8_ADAMW, &cj) == 0 && o[j] &&
                   bnb8_optimizer_add(o[j], "w", q[j], BNB8_F32, g2, BNB8_F32, small, NULL) == 0, "create/add: %s", bnb8_last_error());
        }
        for (int step = 0; o[0] && o[1] && step < 5; step++) {
            for (int64_t i = 0; i < small; i++) g2[i] = (float)(0.01 * test_randn(&rng));
            EXPECT(bnb8_optimizer_step(o[0], c.lr, 1.0f, NULL) == 0 && bnb8_optimizer_step(o[1], c.lr, 1.0f, NULL) == 0, "step");
        }
        snap s[2];
        if (o[0] && o[1] && snap_take(o[0], &s[0], 1)) {
            if (snap_take(o[1], &s[1], 1)) {
                EXPECT(s[0].blocksize == 0 && s[1].blocksize == 4096 && s[0].nblocks == 1 && s[1].nblocks == 1,
                       "block sizes %lld, %lld", (long long)s[0].blocksize, (long long)s[1].blocksize);
                s[1].blocksize = 0;   // the only field that may differ
                EXPECT(snap_equal(&s[0], &s[1]), "%s map: blocksize 0 and blocksize 4096 differ on a tensor of %lld elements",
                       map ? "linear" : "dynamic", (long long)small);
                snap_free(&s[1], 1);
            }
            snap_free(&s[0], 1);
        }
        EXPECT(memcmp(q[0], q[1], sizeof(float) * (size_t)small) == 0, "blocksize 0 and 4096: the parameters differ");
        for (int j = 0; j < 2; j++) { bnb8_optimizer_free(o[j]); free(q[j]); }
        free(g2);
    }
    remove(path[0]);
    remove(path[1]);
}

// ------------------------------------------------------------------------------------------------

// cfg.sum_squares: each tensor's sum of g^2 (finite elements only) equals the order bnb8.h
// documents ([math.sumsq]), redone here, bit for bit, and a plain double sum within the recursive
// summation bound (every term >= 0: each sum within (terms - 1) u S of the exact one, u = 2^-53). Off: 0. Sizes cover a
// partial quad, a partial unit, several strands, and more units than strands.
static double test_butterfly(double *v) {
    for (int d = 16; d > 0; d >>= 1) {
        double w[32];
        for (int k = 0; k < 32; k++) w[k] = v[k] + v[k ^ d];
        memcpy(v, w, sizeof w);
    }
    return v[0];
}
static double test_sumsq_order(const float *g, int64_t n) {
    int64_t units = (n + 127) / 128;
    double strand[256], total = 0.0;
    for (int s = 0; s < 256; s++) {
        strand[s] = 0.0;
        for (int64_t u = s; u < units; u += 256) {
            double v[32];
            for (int q = 0; q < 32; q++) {
                v[q] = 0.0;
                for (int j = 0; j < 4; j++) {
                    int64_t i = 128 * u + 4 * q + j;
                    if (i < n && isfinite(g[i])) v[q] += (double)g[i] * g[i];
                }
            }
            strand[s] += test_butterfly(v);
        }
    }
    for (int w = 0; w < 8; w++) total += test_butterfly(strand + 32 * w);
    return total;
}
// cfg.gnorm_scale_at: a step at gnorm_scale a with the float it points to holding b equals a step at
// a*b (exact products of powers of two and a float) bit for bit, for 8-bit and flash states, with
// percentile clipping after it (the GPU's order); the float is read as each step runs.
static void test_gnorm_scale_at(void) {
    const int64_t n = 3000;
    test_rng rng = test_rng_new();
    for (int f = 0; f < 2; f++) {
        bnb8_config c = bnb8_config_default(BNB8_ADAMW);
        c.format = f ? BNB8_STATE_FLASH : BNB8_STATE_8BIT;
        c.percentile_clipping = 90;
        float factor = 1.0f;
        bnb8_optimizer *a = NULL, *b = NULL;
        EXPECT(bnb8_optimizer_create(&a, BNB8_ADAMW, &c) == 0, "%s", bnb8_last_error());
        c.gnorm_scale_at = &factor;
        EXPECT(bnb8_optimizer_create(&b, BNB8_ADAMW, &c) == 0, "%s", bnb8_last_error());
        uint16_t *pa = malloc(2 * n), *pb = malloc(2 * n), *g = malloc(2 * n);
        if (!a || !b || !pa || !pb || !g) { EXPECT(0, "setup"); free(pa); free(pb); free(g); bnb8_optimizer_free(a); bnb8_optimizer_free(b); return; }
        for (int64_t i = 0; i < n; i++) pa[i] = pb[i] = bnb8_f32_to_bf16((float)(0.1 * test_randn(&rng)));
        EXPECT(bnb8_optimizer_add(a, "w", pa, BNB8_BF16, g, BNB8_BF16, n, NULL) == 0 &&
               bnb8_optimizer_add(b, "w", pb, BNB8_BF16, g, BNB8_BF16, n, NULL) == 0, "%s", bnb8_last_error());
        const float scale[6] = {0.375f, 1.0f, 0.015625f, 0.7f, 0.25f, 1.0f};
        for (int step = 0; step < 6; step++) {
            for (int64_t i = 0; i < n; i++) g[i] = bnb8_f32_to_bf16((float)((1.0 + 9.0 * (step == 3)) * test_randn(&rng)));
            factor = scale[step];
            float host = step % 2 ? 0.5f : 1.0f;
            EXPECT(bnb8_optimizer_step(a, 1e-3f, host * factor, NULL) == 0 && bnb8_optimizer_step(b, 1e-3f, host, NULL) == 0,
                   "%s", bnb8_last_error());
        }
        EXPECT(memcmp(pa, pb, 2 * n) == 0, "%s: steps through gnorm_scale_at differ from the products as gnorm_scale",
               f ? "flash" : "8bit");
        free(pa); free(pb); free(g);
        bnb8_optimizer_free(a); bnb8_optimizer_free(b);
    }
}

static void test_sum_squares(void) {
    const int64_t sizes[] = {3, 130, 5000, 256 * 128 * 3 + 77};
    const int ns = 4;
    test_rng rng = test_rng_new();
    for (int dt = 0; dt < 2; dt++) {
        bnb8_dtype gdt = dt ? BNB8_BF16 : BNB8_F32;
        bnb8_config c = bnb8_config_default(BNB8_ADAMW);
        c.sum_squares = 1;
        bnb8_optimizer *opt = NULL;
        EXPECT(bnb8_optimizer_create(&opt, BNB8_ADAMW, &c) == 0, "%s", bnb8_last_error());
        if (!opt) return;
        c.sum_squares = 0;
        EXPECT(bnb8_optimizer_override(opt, "off", &c) == 0, "%s", bnb8_last_error());
        float *p[5], *gf[5];
        void *g[5];
        for (int k = 0; k <= ns; k++) {
            int64_t n = k < ns ? sizes[k] : 1000;
            p[k] = (float *)calloc((size_t)n, sizeof(float));
            gf[k] = (float *)malloc(sizeof(float) * (size_t)n);
            g[k] = malloc(sizeof(float) * (size_t)n);
            for (int64_t i = 0; i < n; i++) {
                double x = test_randn(&rng) * (i % 7 == 0 ? 1e3 : i % 5 == 0 ? 1e-6 : 0.01);
                if (i % 997 == 11) x = i % 2 ? INFINITY : NAN;
                bnb8_store(g[k], gdt, i, (float)x);
                gf[k][i] = bnb8_load(g[k], gdt, i);
            }
            EXPECT(bnb8_optimizer_add(opt, k < ns ? (char[2]){(char)('a' + k), 0} : "off", p[k], BNB8_F32, g[k], gdt, n, NULL) == 0,
                   "%s", bnb8_last_error());
        }
        double out[5] = {-1, -1, -1, -1, -1};
        EXPECT(bnb8_optimizer_sum_squares(opt, out) == 0 && out[0] == 0.0, "before a step: %g", out[0]);
        EXPECT(bnb8_optimizer_step(opt, 1e-3f, 0.5f, NULL) == 0, "%s", bnb8_last_error());
        EXPECT(bnb8_optimizer_sum_squares(opt, out) == 0, "%s", bnb8_last_error());
        for (int k = 0; k < ns; k++) {
            double order = test_sumsq_order(gf[k], sizes[k]), plain = 0.0;
            for (int64_t i = 0; i < sizes[k]; i++) if (isfinite(gf[k][i])) plain += (double)gf[k][i] * gf[k][i];
            double bound = 2.0 * (double)sizes[k] * 0x1p-53 * plain;   // both sums within n u S of the exact one
            EXPECT(memcmp(&out[k], &order, sizeof order) == 0, "%s n=%lld: %.17g, the documented order %.17g",
                   dt ? "bf16" : "f32", (long long)sizes[k], out[k], order);
            EXPECT(fabs(out[k] - plain) <= bound, "%s n=%lld: %.17g vs double %.17g (bound %.3g)", dt ? "bf16" : "f32",
                   (long long)sizes[k], out[k], plain, bound);
        }
        EXPECT(out[ns] == 0.0, "sum_squares off: %g", out[ns]);
        c.sum_squares = 2;
        bnb8_optimizer *bad = NULL;
        EXPECT(bnb8_optimizer_create(&bad, BNB8_ADAMW, &c) != 0 && strstr(bnb8_last_error(), "sum_squares"),
               "sum_squares 2: '%s'", bnb8_last_error());
        for (int k = 0; k <= ns; k++) { free(p[k]); free(gf[k]); free(g[k]); }
        bnb8_optimizer_free(opt);
    }
}

void tests_optim(void) {
    verbose = getenv("BNB8_TEST_VERBOSE") != NULL;
    for (int is_signed = 0; is_signed < 2; is_signed++) {
        size_t size;
        float *dynamic = map_code[BNB8_MAP_DYNAMIC][is_signed], *linear = map_code[BNB8_MAP_LINEAR][is_signed];
        uint8_t *text = test_slurp(test_data_path(is_signed ? "dynamic_map_signed.hex" : "dynamic_map_unsigned.hex"), &size);
        char *at = (char *)text;
        for (int i = 0; i < 256 && text; i++) {
            uint32_t bits = (uint32_t)strtoul(at, &at, 16);
            memcpy(&dynamic[i], &bits, 4);
        }
        if (!text) { printf("test_optim: cannot read the golden maps in test/data\n"); bnb8_map_dynamic(is_signed, dynamic); }
        free(text);
        // DESIGN.md §3: signed, 255 evenly spaced values over [-1, 1] (k/127 - 1) plus a second exact 0
        // after the first; unsigned, 256 over [0, 1]. Each rounded once from double.
        for (int i = 0; i < 256; i++)
            linear[i] = is_signed ? (float)((double)((i <= 127 ? i : i - 1) - 127) / 127.0) : (float)((double)i / 255.0);
        for (int m = 0; m < BNB8_NUM_MAPS; m++) {
            for (int k = 0; k < 255; k++) map_thresh[m][is_signed][k] = (map_code[m][is_signed][k] + map_code[m][is_signed][k + 1]) * 0.5f;
            map_thresh[m][is_signed][255] = INFINITY;
        }
    }
    snprintf(tmpdir, sizeof tmpdir, "/tmp/bnb8_optim_XXXXXX");
    if (!mkdtemp(tmpdir)) { printf("test_optim: mkdtemp failed\n"); return; }

    test_run("optim: 32-bit vs double reference, all optimizers and dtypes", test_32bit_reference);
    test_run("optim: sum_squares: the documented order bit for bit, a double sum within rounding", test_sum_squares);
    test_run("optim: gnorm_scale_at: a step reads its scale factor where it points, bit for bit", test_gnorm_scale_at);
    test_run("optim: 8-bit vs 32-bit free running, every optimizer (DESIGN.md §12)", test_8bit_vs_32bit);
    test_run("optim: one 8-bit step vs dequantize-update-requantize, all optimizers", test_8bit_one_step);
    test_run("optim: non-finite gradients keep params and states, and are counted", test_nonfinite);
    test_run("optim: percentile clipping and max_unorm match the reference", test_clipping);
    test_run("optim: per-name overrides (format, lr, betas, wd, block size)", test_overrides);
    test_run("optim: step_tensors steps a subset with per-tensor step counts", test_step_subset);
    test_run("optim: linear map and one absmax per tensor vs the reference, all optimizers", test_ablation_one_step);
    test_run("optim: linear map and one absmax per tensor: codes exactly brute force", test_ablation_exact);
    test_run("optim: one absmax per tensor: same bits with 1 and 3 threads", test_per_tensor_threads);

    rmdir(tmpdir);
}
