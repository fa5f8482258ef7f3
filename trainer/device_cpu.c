/*
trainer/device_cpu.c — the CPU row of the device table (device.h): gpt2_cpu.c's fp32 model, the
trainer's own gradients, bnb8's optimizer on the host. Beside the GPU row so that what differs between
the devices is side by side in two files and everywhere else the run calls t->dev.

For bf16 weights (8bit-int8, flash) the optimizer's weights and gradients are bf16 copies: the model's
fp32 weights are those widened (exact), and the backward's fp32 gradients are rounded to bf16 for the step.
*/
#include <stdlib.h>
#include <string.h>
#include <math.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#include "device.h"
#include "optimizer.h"
#include "tensors.h"
#include "clip.h"

void (*train_after_backward)(GPT2 *m, float *grads, bnb8_optimizer *opt, int64_t step);

static void cpu_widen_weights(Trainer *t) {
    float *w = t->model.params_memory;
    const uint16_t *w16 = t->weights16;
    #pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < t->model.num_parameters; i++) w[i] = bnb8_bf16_to_f32(w16[i]);
}
static void cpu_round_grads(Trainer *t) {
    const float *g = t->grads;
    uint16_t *g16 = t->grads16;
    #pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < t->model.num_parameters; i++) g16[i] = bnb8_f32_to_bf16(g[i]);
}

static int cpu_open(Trainer *t) {
    GPT2 *m = &t->model;
    int64_t n = m->num_parameters;
    int bf16 = t->lay.weights == BNB8_BF16;
#ifdef _OPENMP
    int threads = omp_get_max_threads();
#else
    int threads = 1;
#endif
    snprintf(t->where, sizeof t->where, "CPU, %d OpenMP threads (fp32 model)", threads);
    if (gpt2_alloc_acts(m, t->a.B, t->a.T)) return -1;
    t->grads = (float *)calloc((size_t)n, sizeof(float));
    if (!t->grads) return train_fail("out of memory for the gradients of %lld parameters", (long long)n);
    if (bf16) {
        t->weights16 = (uint16_t *)malloc(sizeof(uint16_t) * (size_t)n);
        t->grads16 = (uint16_t *)calloc((size_t)n, sizeof(uint16_t));
        if (!t->weights16 || !t->grads16)
            return train_fail("out of memory for the bf16 weights and gradients of %lld parameters", (long long)n);
    }
    for (int i = 0; i < GPT2_NUM_PARAMS; i++) {
        if (!m->param_sizes[i]) continue;
        int64_t off = param_offset(m, i);
        t->param[i] = bf16 ? (void *)(t->weights16 + off) : (void *)(m->params_memory + off);
        t->grad[i] = bf16 ? (void *)(t->grads16 + off) : (void *)(t->grads + off);
    }
    t->cpu_scale = 1.0f;
    t->scale_at = &t->cpu_scale;
    if (optimizer_open(t)) return -1;
    // the optimizer's bf16 weights are the truth (a checkpoint's file holds them exactly; importing
    // its fp32 masters alone may move a few by a bf16 ulp): the fp32 working copy follows them
    if (bf16) cpu_widen_weights(t);
    return 0;
}

static int cpu_micro_step(Trainer *t, const int *inputs, const int *targets, int accumulate, float lr, float *loss) {
    (void)lr;
    *loss = gpt2_forward(&t->model, inputs, targets, t->a.B, t->a.T);
    return gpt2_backward(&t->model, t->grads, accumulate, NULL, NULL);
}

// Gradient i of an array of fp32 or bf16 ones (the CPU row's two dtypes), as float.
static float grad_at(const void *g, bnb8_dtype dtype, int64_t i) {
    return dtype == BNB8_F32 ? ((const float *)g)[i] : bnb8_bf16_to_f32(((const uint16_t *)g)[i]);
}

// The sum of squares of n gradients of dtype (finite_only: of the finite ones): fixed chunks summed in
// double, then in order (the same bits for any number of threads).
static double cpu_sum_squares(const void *g, bnb8_dtype dtype, int64_t n, int finite_only) {
    const int64_t CHUNK = 1 << 16;
    int64_t nchunks = (n + CHUNK - 1) / CHUNK;
    double *partial = (double *)malloc(sizeof(double) * (size_t)nchunks);
    if (!partial) return NAN;
    #pragma omp parallel for schedule(static)
    for (int64_t k = 0; k < nchunks; k++) {
        int64_t e = (k + 1) * CHUNK < n ? (k + 1) * CHUNK : n;
        double s = 0.0;
        for (int64_t i = k * CHUNK; i < e; i++) {
            double v = grad_at(g, dtype, i);
            if (!finite_only || isfinite(v)) s += v * v;
        }
        partial[k] = s;
    }
    double total = 0.0;
    for (int64_t k = 0; k < nchunks; k++) total += partial[k];
    free(partial);
    return total;
}

// The est rule's group g on the CPU: its sum of squares, then the scale the optimizer reads.
static int cpu_clip_group(Trainer *t, int g, void *const *grads, const int64_t *n, int count) {
    double s = 0.0;
    for (int k = 0; k < count; k++) s += cpu_sum_squares(grads[k], t->lay.grads, n[k], 1);
    if (isnan(s)) return train_fail("out of memory");
    t->group_sums[g] = s;
    t->cpu_scale = step_scale(est_norm(t, g), t->a.grad_clip, t->a.accum);
    return 0;
}

// exact: the norm of the fp32 gradients first, a step skipped when it is not finite. prev: the
// optimizer steps at once (non-finite elements are left unchanged and counted, as under release),
// and sums the norm of the gradients it read (bf16 ones for bf16 weights). est: group by group in
// backward's order, as under release, each group's norm from the gradients the optimizer reads.
static int cpu_step(Trainer *t, float lr, double *norm, int *skipped) {
    if (train_after_backward) train_after_backward(&t->model, t->grads, t->opt, t->step);
    *skipped = 0;
    if (t->rule == CLIP_EXACT) {
        *norm = sqrt(cpu_sum_squares(t->grads, BNB8_F32, t->model.num_parameters, 0)) / (double)t->a.accum;
        *skipped = !isfinite(*norm);
        if (*skipped) return 0;
    }
    int bf16 = t->lay.weights == BNB8_BF16;
    if (bf16) cpu_round_grads(t);
    for (int g = 0; t->rule == CLIP_EST && g < t->model.config.num_layers + 2; g++)
        if (step_group(t, g, lr, 1.0f, NULL)) return -1;
    if (t->rule != CLIP_EST &&
        bnb8_optimizer_step(t->opt, lr, step_scale(clip_norm(t, *norm), t->a.grad_clip, t->a.accum), NULL))
        return train_fail("optimizer step: %s", bnb8_last_error());
    if (bf16) cpu_widen_weights(t);
    if (t->rule == CLIP_EST) est_finish(t, norm);
    return t->rule == CLIP_PREV ? prev_rule_norm(t, norm) : 0;
}

static int cpu_eval(Trainer *t, const int *inputs, const int *targets, float *loss) {
    *loss = gpt2_forward(&t->model, inputs, targets, t->a.B, t->a.T); return 0;
}

// Only the last position's logits are computed.
static int cpu_logits(Trainer *t, const int *tokens, int64_t n, float **logits) {
    gpt2_forward_hidden(&t->model, tokens, 1, n);
    gpt2_get_logits(&t->model, t->model.acts.logits, n - 1, 1);
    *logits = t->model.acts.logits;
    return 0;
}

// fp32 weights are their own masters; bf16 ones are decoded into the gradient buffer, free between
// steps.
static int cpu_masters(Trainer *t, float **out) {
    if (t->lay.weights == BNB8_F32) { *out = t->model.params_memory; return 0; }
    *out = t->grads;
    return optimizer_masters(t, t->grads);
}

static double cpu_print_activations(Trainer *t) {
    const GPT2 *m = &t->model;
    for (int i = 0; i < NUM_ACT_TENSORS; i++) {
        if (!m->act_sizes[i]) continue;
        printf("    %-18s %13lld ", gpt2_act_name(i), (long long)m->act_sizes[i]);
        print_bytes(4.0 * (double)m->act_sizes[i]);
        printf("\n");
    }
    printf("    %-18s %13lld ", "total", (long long)m->num_activations);
    return 4.0 * (double)m->num_activations;
}

static int cpu_device_memory(Trainer *t, double *computed, double *measured) {   // the host's: not measured
    (void)t; *computed = *measured = 0.0; return 0;
}

static void cpu_close(Trainer *t) {
    free(t->grads); free(t->weights16); free(t->grads16);
    t->grads = NULL; t->weights16 = t->grads16 = NULL;
}

const Device device_cpu = {"cpu", cpu_open, cpu_micro_step, cpu_step, cpu_eval, cpu_logits, cpu_masters,
                           cpu_print_activations, cpu_device_memory, cpu_close, cpu_clip_group};
