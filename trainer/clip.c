/*
trainer/clip.c — the clipping rules (clip.h): exact (this step's norm after backward), prev (the
previous step's, summed by the optimizer) and est (this step's, estimated group by group as backward
finishes them). In one file so that a rule is read, changed or added in one place; the device rows
and NCCL call these for the parts that are the same on every device.
*/
#include <stdlib.h>
#include <math.h>
#include <float.h>
#include "clip.h"
#include "tensors.h"

// gnorm_scale of a step whose gradients are the sum of accum micro-batches' mean gradients, norm
// the norm of their mean: the mean, clipped at clip (0 = off; a NAN norm, none known: not clipped).
// A clip far below a finite norm (a tiny -g, a huge norm) would round the scale to 0, which the
// library refuses mid-run: it is kept at the least positive float instead, the nearest to what was
// asked. No bound on -g could prevent that alone, for the norm has none.
float step_scale(double norm, float clip, int64_t accum) {
    float scale = clip > 0.0f && norm > clip ? (float)(clip / norm) : 1.0f;
    scale /= (float)accum;
    return scale > 0.0f ? scale : FLT_TRUE_MIN;
}

// The norm a step clips with: this step's (exact) or the previous step's (prev).
double clip_norm(const Trainer *t, double norm) { return t->rule == CLIP_PREV ? t->prev_norm : norm; }

// The est rule (clip.h, DESIGN.md §6.4): the shares F(j) of the groups, from the profile
// (before step 1, the parameters' own shares).
void est_shares(const double profile[3], const GPT2Config *c, double *shares) {
    int L = c->num_layers, top = (L + 1) / 2, bottom = L - top;
    double p[3] = {profile[0], profile[1], profile[2]};
    if (isnan(p[0])) {
        int64_t sizes[GPT2_NUM_PARAMS], total = 0, layers = 0;
        gpt2_param_sizes(c, sizes);
        for (int i = 0; i < GPT2_NUM_PARAMS; i++) { total += sizes[i]; layers += gpt2_param_is_layer(i) ? sizes[i] : 0; }
        p[0] = (double)(sizes[GPT2_LNFW] + sizes[GPT2_LNFB]) / (double)total;
        p[1] = (double)layers / (double)total * top / L;
        p[2] = (double)layers / (double)total * bottom / L;
    }
    for (int j = 0; j <= L; j++) {   // j layers final after group 0
        double f = p[0] + p[1] * (j < top ? j : top) / top + (j > top ? p[2] * (j - top) / bottom : 0.0);
        shares[j] = f > 0.0 && f <= 1.0 ? f : 1.0;   // none expected so far (or rounding past 1): the sum itself
    }
    shares[L + 1] = 1.0;
}

void est_update(double profile[3], const double *sums, int L) {
    int top = (L + 1) / 2;
    double total = 0.0, part[3] = {sums[0], 0.0, 0.0};
    for (int j = 0; j < L + 2; j++) total += sums[j];
    for (int j = 1; j <= L; j++) part[j <= top ? 1 : 2] += sums[j];
    if (!(total > 0.0 && isfinite(total))) return;
    for (int k = 0; k < 3; k++)
        profile[k] = isnan(profile[k]) ? part[k] / total : EST_DECAY * profile[k] + (1.0 - EST_DECAY) * (part[k] / total);
}

// The est rule's norm for group g from this step's sums of the groups 0..g, and its scale.
double est_norm(const Trainer *t, int g) {
    double prefix = 0.0;
    for (int j = 0; j <= g; j++) prefix += t->group_sums[j];
    return sqrt(prefix / t->shares[g]) / (double)t->a.accum;
}

// One group of a step: without est, stepped at gnorm_scale scale; with est, its sums and scale
// first (the device row), then its step at 1 (the optimizer reads the scale where it lies).
int step_group(Trainer *t, int g, float lr, float scale, struct CUstream_st *stream) {
    int ids[GPT2_NUM_PARAMS], count;
    void *grads[GPT2_NUM_PARAMS];
    int64_t n[GPT2_NUM_PARAMS];
    count = group_tensors(t, g, ids, grads, n);
    if (t->rule == CLIP_EST && t->dev->clip_group(t, g, grads, n, count)) return -1;
    if (bnb8_optimizer_step_tensors(t->opt, ids, count, lr, t->rule == CLIP_EST ? 1.0f : scale, stream))
        return train_fail("optimizer step: %s", bnb8_last_error());
    return 0;
}
// The est rule after a step (its sums in t->group_sums): the norm of the step's mean gradient,
// the range of the norms its layers were stepped with, the profile for the next step.
void est_finish(Trainer *t, double *norm) {
    int L = t->model.config.num_layers;
    t->est_lo = INFINITY; t->est_hi = -INFINITY;
    for (int g = 1; g <= L; g++) {
        double e = est_norm(t, g);
        t->est_lo = e < t->est_lo ? e : t->est_lo;
        t->est_hi = e > t->est_hi ? e : t->est_hi;
    }
    *norm = est_norm(t, L + 1);
    est_update(t->profile, t->group_sums, L);
}

// CLIP_PREV, after a step: the norm of this step's mean gradient from the optimizer's per-tensor
// sums of g^2 (of the gradients it read), summed in tensor order; the next step clips with it.
int prev_rule_norm(Trainer *t, double *norm) {
    int count = bnb8_optimizer_count(t->opt);
    if (bnb8_optimizer_sum_squares(t->opt, t->sums)) return train_fail("gradient norm: %s", bnb8_last_error());
    double total = 0.0;
    for (int i = 0; i < count; i++) total += t->sums[i];
    *norm = sqrt(total) / (double)t->a.accum;
    return 0;
}

// The rule's buffers, once the optimizer exists: prev's per-tensor sums, est's per-group sums and shares.
int clip_open(Trainer *t) {
    if (t->rule == CLIP_PREV && !(t->sums = (double *)malloc(sizeof(double) * (size_t)bnb8_optimizer_count(t->opt))))
        return train_fail("out of memory");
    size_t groups = (size_t)t->model.config.num_layers + 2;
    if (t->rule == CLIP_EST && (!(t->group_sums = (double *)calloc(groups, sizeof(double))) ||
                                !(t->shares = (double *)calloc(groups, sizeof(double)))))
        return train_fail("out of memory");
    return 0;
}

void clip_free(Trainer *t) {
    free(t->sums);
    free(t->group_sums);
    free(t->shares);
    t->sums = t->group_sums = t->shares = NULL;
}

// Before a step's micro-batches: est's shares for this step, from the profile of the steps before.
void clip_step_begin(Trainer *t) {
    if (t->rule == CLIP_EST) est_shares(t->profile, &t->model.config, t->shares);
}

// The est rule steps each group with its own norm (est_norm, compared as step_scale does), so a step
// can clip some groups and not others: at step 1, before any profile, the layers' estimates can lie
// far below the norm the embeddings clip with exactly.
int est_groups_clipped(const Trainer *t) {
    int count = 0, groups = t->model.config.num_layers + 2;
    float clip = t->a.grad_clip;
    for (int g = 0; t->rule == CLIP_EST && clip > 0.0f && g < groups; g++) count += est_norm(t, g) > clip;
    return count;
}

// The step line's note on the groups an est step clipped ("" when none).
static void est_clipped_note(const Trainer *t, char *text, size_t size) {
    int L = t->model.config.num_layers, groups = L + 2, count = est_groups_clipped(t);
    int embeddings = t->a.grad_clip > 0.0f && est_norm(t, L + 1) > t->a.grad_clip;
    text[0] = 0;
    if (count == groups) snprintf(text, size, " clipped: all %d groups", groups);
    else if (count == 1 && embeddings) snprintf(text, size, " clipped: embeddings");
    else if (count > 0)
        snprintf(text, size, " clipped: %d of %d groups, %s", count, groups,
                 embeddings ? "the embeddings among them" : "not the embeddings");
}

int clip_step_end(Trainer *t, double norm, int skipped, char *text, size_t size) {
    double with = clip_norm(t, norm);   // the norm this step clipped with (est: the embeddings', the exact one)
    int clipped = !skipped && t->a.grad_clip > 0.0f && with > t->a.grad_clip;
    char note[128] = "";
    if (t->rule == CLIP_PREV) t->prev_norm = norm;
    if (t->rule == CLIP_EST) est_clipped_note(t, note, sizeof note);
    else if (clipped) snprintf(note, sizeof note, " clipped");
    text[0] = 0;
    if (t->rule == CLIP_PREV) snprintf(text, size, " (prev %6.3f)%s", with, note);
    else if (t->rule == CLIP_EST) snprintf(text, size, " (est %.3f..%.3f)%s", t->est_lo, t->est_hi, note);
    else snprintf(text, size, "%s", note);
    return clipped;
}

const char *clip_rule_about(int rule) {
    return rule == CLIP_PREV ? "prev: the previous step's norm"
         : rule == CLIP_EST ? "est: this step's norm, estimated layer by layer" : "exact: this step's norm";
}

const char *clip_rule_report(int rule) {
    return rule == CLIP_PREV ? "the previous step's norm (prev)"
         : rule == CLIP_EST ? "this step's norm, estimated layer by layer (est; exact for the embeddings)"
         : "this step's norm (exact)";
}
