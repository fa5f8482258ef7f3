/*
trainer/clip.h — the clipping rules (clip.c): how a step's gradients are scaled to the global norm
clip -g, under the rule -N names (exact, prev, est: trainer.h). A new rule is a CLIP_ value, a name in
settings.c's clip_rule_names and its cases here.
*/
#ifndef TRAINER_CLIP_H
#define TRAINER_CLIP_H

#include "trainer.h"

// gnorm_scale of a step: 1/accum, times clip/norm when norm > clip > 0 (a NAN norm: none known, no clip).
float step_scale(double norm, float clip, int64_t accum);
// The norm a step clips with: this step's (exact, norm) or the previous step's (prev).
double clip_norm(const Trainer *t, double norm);

// The est rule. Groups in the order backward finishes them: 0 the final LayerNorm, 1..L layers L-1..0,
// L+1 the embeddings. Group j is stepped with the norm sqrt(S_0 + .. + S_j) / F(j) (this step's sums
// of squares of the groups final so far), F(j) the share of the squared norm that the profile expects
// in groups 0..j: 1 for the embeddings (their step has the exact norm). The profile: the shares of the
// final LayerNorm, of the first ceil(L/2) layers released and of the other layers (the embeddings hold
// the rest), a running mean over steps (EST_DECAY); NAN before step 1, which takes the parameters'
// shares. shares: L + 2 doubles, each in (0, 1].
#define EST_DECAY 0.9
void est_shares(const double profile[3], const GPT2Config *c, double *shares);
// The profile after a step whose groups' sums of squares are sums (L + 2); unchanged when they add up
// to 0 or to no finite number.
void est_update(double profile[3], const double *sums, int L);
// The est rule's norm for group g from this step's sums of the groups 0..g.
double est_norm(const Trainer *t, int g);
// One group of a step: without est, stepped at gnorm_scale scale; with est, its sums and scale first
// (the device row's clip_group), then its step at 1 (the optimizer reads the scale where it lies).
int step_group(Trainer *t, int g, float lr, float scale, struct CUstream_st *stream);
// After an est step: the step's norm, the range of its layers' norms, the profile for the next step.
void est_finish(Trainer *t, double *norm);
// After a prev step: the norm of this step's mean gradient from the optimizer's sums.
int prev_rule_norm(Trainer *t, double *norm);

// The run's side of the rules: their buffers (clip_open once the optimizer exists, clip_free), the
// start of a step, and its end: clip_step_end returns whether the step was clipped (by the norm it
// clipped with; est: the embeddings', the step's exact norm), keeps prev's norm for the next step and
// writes the step line's note on the rule and on what was clipped into text: " clipped", or under
// est the groups (" clipped: embeddings", " clipped: 7 of 14 groups, not the embeddings",
// " clipped: all 14 groups"). est_groups_clipped: how many groups the est step clipped (0 otherwise).
int clip_open(Trainer *t);
void clip_free(Trainer *t);
void clip_step_begin(Trainer *t);
int clip_step_end(Trainer *t, double norm, int skipped, char *text, size_t size);
int est_groups_clipped(const Trainer *t);
const char *clip_rule_about(int rule);    // for the banner
const char *clip_rule_report(int rule);   // for the report

#endif // TRAINER_CLIP_H
