/*
trainer/trainer.h — the types every part of the trainer shares: the settings of a run (TrainArgs),
its results (TrainResult), a recipe and an optimizer row, what a run keeps (Layout), the trainer
state a checkpoint records, the device table (Device) and the run in progress (Trainer). It holds
types and no code, so that every file of the trainer can include it without including each other;
the run's own entry points (train_gpt2_8bit.c) are declared at its end for the tests.
*/
#ifndef TRAINER_H
#define TRAINER_H

#include <stdio.h>
#include "bnb8.h"
#include "gpt2.h"
#include "gpt2_cpu.h"
#include "gpt2_data.h"
#include "gpt2_cuda.h"

#ifdef __cplusplus
extern "C" {
#endif

// A recipe: the optimizer states and the master weights, in the layout of the GPU's bf16 model
// (bf16 weights, activations and gradients). run_layout (settings.h) gives what a run keeps on its
// device: the fp32 parity model (-P fp32) has fp32 weights and gradients and no master; the CPU
// computes in fp32, keeps fp32 weights where the master is fp32 (they are one), and otherwise the
// optimizer's bf16 weights and gradients (widened before the forward, rounded to nearest even after
// the backward).
typedef struct {
    const char *name;
    bnb8_state_format states;
    bnb8_dtype weights, grads;   // the persistent weights, the gradients the optimizer reads
    int correction_bytes;        // the master of bf16 weights: 4 an fp32 master, 1 an int8 correction,
                                 // BNB8_CORRECTION_STOCHASTIC none (stochastic rounding), 0 none (rounded
                                 // to nearest: the ablation)
    const char *about;
} Recipe;

typedef struct {
    const char *name;
    bnb8_optim kind;
    float lr, weight_decay;    // defaults for this trainer (-l, -c override them)
} OptimizerChoice;

// The flash recipe's group scale dtypes (-S); a row's index is the trainer state file's (word 24):
// new rows go last.
typedef struct {
    const char *name;
    bnb8_dtype dtype;
} ScaleDtype;

// A run whose training loss is not finite, whose update is skipped (a non-finite gradient norm),
// or whose gradients or update hold NaN or Inf (elements left unchanged), this many steps in a row
// has diverged, or its model or data give NaN: it stops with an error, exit status 1 (doc/guarantees.md,
// "The trainer").
#define TRAIN_MAX_BAD_STEPS 10

// Clipping rules (-N): this step's global norm, formed after backward; the previous step's, summed
// by the optimizer as it read that step's gradients; this step's, estimated group by group as
// backward finishes them (est, DESIGN.md §6.4). prev and est work with gradient release. The rules
// themselves are in clip.c.
enum { CLIP_EXACT = 0, CLIP_PREV = 1, CLIP_EST = 2 };

// The command line.
typedef struct {
    const char *train_path, *val_path, *tokenizer_path;   // "" = none (val, tokenizer)
    const char *model;        // descriptor (d12, d4c128h4, ...) or an llm.c .bin model file
    char given[128];          // given[c]: the caller set flag -c (parse_args: it was on the command line).
                              // A resumed run refuses an -e of another shape and -n, -l, -u, -q, -c, -g, -M,
                              // -K, -V of other values than its checkpoint's; those left out take the checkpoint's
    const char *out_dir;      // checkpoints go here; "" = none
    int64_t B, T, steps;
    int64_t accum;            // micro-batches of (B, T) per optimizer step (gradient accumulation)
    float lr;                 // < 0: the optimizer's default; 0 changes no weight
    float weight_decay;       // < 0: the optimizer's default
    int64_t warmup;           // linear warm-up steps, then cosine decay to final_lr_frac * lr
    float final_lr_frac;
    float grad_clip;          // global gradient norm clip (0 = off)
    int clip_rule;            // the norm grad_clip clips with: CLIP_EXACT, CLIP_PREV, CLIP_EST, or -1: est under release, else exact
    const char *recipe, *optimizer;
    int map;                  // 8-bit states' map, or 4-bit states' second moment's: BNB8_MAP_DYNAMIC or
                              // BNB8_MAP_LINEAR (ablations; 4-bit: v's map with zero)
    int64_t blocksize;        // 8-bit block size, 64..4096, or 0: one absmax per tensor (ablation)
    int rank1;                // -V: 4-bit states, AdamW: 1 normalizes each matrix's v rank-1 (cfg.row_size), 0 blocks
    int scale_dtype;          // -S, flash only: the group scales' dtype, an index of scale_dtypes[] (0 e6m10,
                              // 1 bf16, 2 fp16, 3 fp32); -1: e6m10, or the checkpoint's when resuming
    int device;               // 0: the GPU when there is one, 1: the CPU, 2: the GPU
    int parity;               // 1: the fp32 parity model (-P fp32): fp32 weights and gradients, no master
    int release;              // gradient release (GPU): step each layer inside backward
    int recompute;            // GPU: keep each layer's output only, recompute the rest in backward
    int stable_embedding;     // 1 on, 0 off, -1 auto: on for descriptors, as the file says for .bin
    int64_t eval_every, val_batches, sample_every, ckpt_every;
    int64_t gen_tokens;       // tokens per sample, at most T - 1; -1: DEFAULT_GEN_TOKENS, or T - 1 when less
    int64_t keep_checkpoints; // -L: keep the newest this many complete checkpoints in out_dir; 0 = all
    int64_t stop_after;       // stop after this step (the schedule still spans `steps`); 0 = no
    uint64_t seed;
    int resume;
    const char *export_path;  // -X: the final weights as an llm.c model file; "" = none
    int export_bf16;          // -F: 1 bf16 (version 5, llm.c's default build), 0 fp32 (version 3)
    int verbose;              // 0: print nothing (tests)
} TrainArgs;

typedef struct {
    float *losses;            // optional, (steps): train loss of step s at [s-1]; steps not run are left
    double *norms;            // optional, (steps): the norm of step s's mean gradient at [s-1] (NAN: none)
    float *final_params;      // optional, (final_params_count): the fp32 masters at the end
    int64_t final_params_count;
    int64_t first_step, last_step;     // the steps this call ran
    float first_loss, last_loss, val_loss;
    double tokens_per_second;
    bnb8_memory memory;
    int64_t skipped_steps;    // steps whose gradient had a NaN or Inf: no update made
    int64_t clipped_steps;    // steps whose gradients were scaled down by the clip
    int on_gpu;               // the run trained on the GPU
    double gpu_computed, gpu_measured;   // GPU: device bytes the report computes, and measures
    int64_t checkpoint_bytes; // the last checkpoint this call wrote (its files' sizes), or 0
} TrainResult;

// The trainer state a checkpoint records (checkpoint.h: its file, state_s.bin).
typedef struct {
    int64_t step, position, B, T, recipe, optimizer, stable_embedding, steps;
    uint64_t rng, seed;
    int64_t release;          // the optimizer's tensors are per-layer slices (word 12; 0 in older files)
    int64_t accum;            // micro-batches per step (word 13; 0 in older files, meaning 1)
    int64_t weight_bytes;     // the run's weights: 4 fp32, 2 bf16 (word 14; 0 in older files: read as
                              // fp32 for an fp32-master recipe, bf16 for the others)
    int64_t version;          // of the file read (1: the model file holds the weights); written: STATE_VERSION
    GPT2Config config;        // the model's shape (version 2, words 15..20)
    int64_t opt_steps;        // every optimizer tensor's step count (version 2, word 21): the optimizer
                              // file must match it (files of different steps are not one checkpoint)
    int64_t clip_rule;        // CLIP_EXACT, CLIP_PREV or CLIP_EST (word 22)
    double prev_norm;         // CLIP_PREV: the norm of this step's mean gradient, which the next step
                              // clips with; NAN: none (word 23, the double's bits)
    int64_t scale_dtype;      // flash: the group scales' dtype, an index of scale_dtypes[] (word 24; 0:
                              // e6m10, and 0 for the other recipes); version 1 with flash: 1 (bf16)
    int64_t train_tokens;     // the training tokens' count and digest (tokens_digest; words 25, 26):
    int64_t train_digest;     // a resume on other data is refused (0: not recorded, older files)
    double est_profile[3];    // CLIP_EST: the profile after this step (words 28..30, the doubles' bits; NAN: none)
    int64_t ranks;            // word 27: 0 a single process (optim_s.bin); N the ranks over NCCL, whose
                              // optimizer files optim_s.rank<r>of<N>.bin hold their shards
    // Version 3 (words 31..38; NAN or 0 in older files, which do not record them): the rest of what
    // defines the run, and the digest that binds the checkpoint's optimizer files to this state.
    double lr, final_lr_frac, weight_decay, grad_clip;   // -l, -q, -c, -g as the run used them (floats)
    int64_t warmup, map, blocksize;                      // -u, -M, -K
    int64_t rank1;            // version 4 (word 39): -V, 1 rank1, 0 block (read as 0 from version 3, which had blocks only)
    int64_t optim_digest;     // checkpoint_optim_digest of the checkpoint's optimizer files
} TrainerState;

// Paths of checkpoint files: an -o of up to TRAIN_PATH_MAX - 64 bytes (longer ones are refused at start).
#define TRAIN_PATH_MAX 4096

// The GPU row's state (gpt2_cuda's model, its gradients, what the release callback needs).
typedef struct {
    GPT2Cuda *model;
    GPT2CudaGrads grads;         // every gradient, or under release the release layout
    size_t grads_bytes;
    char name[128];              // the GPU's
    size_t total_bytes;          // its memory
    size_t used_before;          // in use before this run allocated anything (cudaMemGetInfo)
    size_t used_peak;            // the most in use at the end of a step since
    float *logits;               // (Vp) host: one row of logits, for sampling
} Gpu;

// A run in progress. The device rows (device_cpu.c, device_gpu.c) do the work that differs between
// the CPU model and the GPU model; everything else is written once.
typedef struct Trainer Trainer;
typedef struct {
    const char *name;
    // The model on the device, where the optimizer finds each tensor, the optimizer (and its
    // checkpointed state when resuming).
    int (*open)(Trainer *t);
    // Forward and backward of one micro-batch: gradients overwritten (accumulate 0) or added to.
    int (*micro_step)(Trainer *t, const int *inputs, const int *targets, int accumulate, float lr, float *loss);
    // The optimizer step: *norm the mean gradient's norm (NAN when not formed), *skipped 1 when
    // it was not finite and nothing changed.
    int (*step)(Trainer *t, float lr, double *norm, int *skipped);
    int (*eval)(Trainer *t, const int *inputs, const int *targets, float *loss);   // mean loss, no backward
    // The (Vp) logits after tokens[0..n-1], one sequence; *logits stays valid until the next call.
    int (*logits)(Trainer *t, const int *tokens, int64_t n, float **logits);
    // The fp32 masters of every weight on the host (valid until the next step).
    int (*masters)(Trainer *t, float **out);
    double (*print_activations)(Trainer *t);   // the report's activation lines; their bytes
    // Device memory computed by the accounting and measured (0: the device has none of its own).
    int (*device_memory)(Trainer *t, double *computed, double *measured);
    void (*close)(Trainer *t);
    // The est rule: group g's sum of squares of the count gradient buffers grads (n[i] elements each)
    // and, from the sums so far, the scale its step reads (cfg.gnorm_scale_at), in the device's order.
    int (*clip_group)(Trainer *t, int g, void *const *grads, const int64_t *n, int count);
} Device;

// What a run keeps (run_layout): its weights' and gradients' dtypes and the master of its weights
// (cfg.correction_bytes: 0 none, 1 int8, 4 an fp32 master, BNB8_CORRECTION_STOCHASTIC none with
// stochastic rounding).
typedef struct {
    bnb8_dtype weights, grads;
    int correction_bytes;
} Layout;

struct Trainer {
    TrainArgs a;
    const Recipe *recipe;
    Layout lay;                      // the recipe on this run's device and model
    const OptimizerChoice *oc;
    float lr, wd;                    // peak learning rate and weight decay of this run
    int scale;                       // flash: the group scales' dtype, an index of scale_dtypes[]
    const Device *dev;
    char where[192];                 // the device, for the banner and the report
    GPT2 model;                      // CPU: the model; GPU: the host copy of its weights
    char model_path[TRAIN_PATH_MAX];
    int lock_fd;                      // the -o directory's lock (LOCK, flock'ed), or -1
    int64_t resume_limit;             // resume from the newest complete checkpoint before this step
    int damaged;                      // the last failure was the checkpoint's (trainer_open falls back)
    TokenFile train_file, val_file;
    int64_t train_digest;             // tokens_digest of train_file (with -o), for the trainer state
    Tokenizer tok;
    DataLoader loader;
    // Where the optimizer finds tensor i: its weights and gradients, on the device, in lay's
    // dtypes. Under release the per-layer gradients are one layer's slice, shared by every layer.
    void *param[GPT2_NUM_PARAMS], *grad[GPT2_NUM_PARAMS];
    bnb8_optimizer *opt;
    double state_bytes[GPT2_NUM_PARAMS];   // each tensor's optimizer state, by the library's accounting
    Rng rng;                          // sampling
    int64_t start, end, step;         // this call runs steps start+1 .. end; step is the one running
    TrainerState resumed;             // the checkpoint's trainer state (start > 0)
    int rule;                         // the clipping rule in use (CLIP_EXACT, CLIP_PREV, CLIP_EST)
    double prev_norm;                 // CLIP_PREV: the previous step's norm (NAN: none yet, no clip)
    double *sums;                     // CLIP_PREV: (optimizer count) bnb8_optimizer_sum_squares
    double profile[3];                // CLIP_EST: the shares' running mean (NAN: none yet)
    double *group_sums, *shares;      // CLIP_EST: (L + 2) this step's sums of squares, its shares F(j)
    double est_lo, est_hi;            // CLIP_EST: the least and largest norm a layer was stepped with this step
    float *scale_at;                  // CLIP_EST: the scale the optimizer reads (cfg.gnorm_scale_at):
    float cpu_scale;                  //   the CPU's, or the GPU model's device float
    // the CPU row: fp32 gradients; for bf16 weights the persistent bf16 weights and gradients
    // (model.params_memory and grads are then the fp32 working copies)
    float *grads;
    uint16_t *weights16, *grads16;
    Gpu gpu;                          // the GPU row
    struct Nccl *nccl;                // several GPUs (nccl.c), or NULL: one process
};

// A byte count in a column of the memory report: every file that prints one prints it this way.
static inline void print_bytes(double b) {
    if (b >= 1e9) printf("%9.2f GB", b / 1e9);
    else if (b >= 1e6) printf("%9.2f MB", b / 1e6);
    else if (b >= 1e3) printf("%9.2f kB", b / 1e3);
    else printf("%9.0f B ", b);
}

// The run (train_gpt2_8bit.c). train_run: the model (or the newest checkpoint of -o), the data, the
// device, the steps, the report; res (may be NULL) receives the results; 0 or -1 with the message
// in train_error_text. trainer_open: the run's phases up to the first step (settings, model, data,
// device and optimizer); trainer_free undoes them. generate: up to gen_tokens tokens after an
// end-of-text (at most T in all) into out (out[0] is the start): their number, or -1 on a device error.
int train_run(const TrainArgs *a, TrainResult *res);
int trainer_open(Trainer *t, const TrainArgs *a);
void trainer_free(Trainer *t);
int64_t generate(Trainer *t, int eot, int64_t gen_tokens, int *out);

#ifdef __cplusplus
}
#endif
#endif // TRAINER_H
