/*
train_gpt2_8bit.c — trains GPT-2 with bnb8's optimizers: 32-bit states with an fp32 master (llm.c's
16-byte layout), 8-bit block-wise states (Dettmers et al.) with an fp32 master or an int8 correction,
or FlashOptim's flash recipe; AdamW, Lion or SGD with momentum; on the CPU (gpt2_cpu.c) or on the
GPU (gpt2_cuda.cu, in the -DTRAIN_CUDA build: the bf16 model, or the fp32 one for parity), with
gradient release there, and on several GPUs over NCCL.

This file is the run, phase by phase, read top to bottom in the spirit of llm.c's train_gpt2.cu:
settings, model, data, device and optimizer, the banner, the steps, the results, the report (every
buffer, persistent bytes per parameter from the optimizer's own accounting, tokens/s, losses, a
sample); then train_run and main. What the phases use lives in trainer/, one concern a file, each
calling only the files listed before it:
*/
#define _POSIX_C_SOURCE 200809L   // clock_gettime
#include <stdio.h>
#include <stdlib.h>
#include <stdint.h>
#include <string.h>
#include <math.h>
#include <time.h>
#include <unistd.h>
// defines: Recipe, TrainArgs, TrainResult, TrainerState, Layout, Device, Gpu, Trainer (types only)
#include "trainer/trainer.h"
// defines: the recipes, optimizers and scale dtypes tables, parse_args, usage, lr_schedule, check_settings
#include "trainer/settings.h"
// defines: tensor_slices, slice_grad, optimizer_id, group_tensors, shard_layout: where each tensor lies
#include "trainer/tensors.h"
// defines: state_writer/state_load, checkpoint_save, checkpoint_latest, checkpoint_dir_open, checkpoint_resume
#include "trainer/checkpoint.h"
// defines: step_scale, the est rule (est_shares, est_update, step_group), clip_step_begin/end
#include "trainer/clip.h"
// defines: nccl_setup, nccl_step, nccl_batch, nccl_checkpoint_save, ...: no-ops with one process
#include "trainer/nccl.h"
// defines: device_cpu, device_gpu (the two rows of the device table), gpu_wanted, train_after_backward
#include "trainer/device.h"

/*
The model lives in trainer/gpt2_cpu.c and trainer/gpt2_cuda.cu, the files and the data loader in
trainer/gpt2_data.c, what they share in trainer/gpt2.h.

Determinism: both models compute each element in a fixed order, so with the optimizer state, the
data position and the RNG in a checkpoint, a resumed run is bit-identical to one that never stopped.

Build and run: `make train` (`GPU=1`: build/train_gpt2_8bit_cuda), `./build/train_gpt2_8bit -h`.
Compiled with -DTRAIN_NO_MAIN this file has no main, for the tests.
*/

static double now_seconds(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

// ------------------------------------------------------------------------------------------------
// The run, phase by phase. 1. Settings: the device chosen once (gpu_wanted), the settings checked
// against it, and the ranks when the environment names several.

static int open_settings(Trainer *t) {
    t->dev = gpu_wanted(&t->a) ? &device_gpu : &device_cpu;
    if (check_settings(t, t->dev == &device_gpu)) return -1;
    return nccl_setup(t);
}

// 2. The model: from the newest complete checkpoint when resuming (checkpoint_resume), else from -e.

// The batch against a model's shape, before the weights or any buffer of the batch are allocated:
// T <= maxT, and activations within GPT2_MAX_ACT_BYTES (no size product can overflow then).
static int check_batch(const TrainArgs *a, const GPT2Config *c) {
    int64_t sizes[NUM_ACT_TENSORS];
    if (a->T > c->max_seq_len)
        return train_fail("sequence length T=%lld exceeds the model's maxT=%d", (long long)a->T, c->max_seq_len);
    return gpt2_act_sizes(c, a->B, a->T, sizes);
}

static int open_model(Trainer *t) {
    const TrainArgs *a = &t->a;
    int rank = 0, ranks = nccl_ranks(t, &rank);
    if (a->out_dir[0] && checkpoint_dir_open(a->out_dir, rank == 0, &t->lock_fd)) return -1;
    if (a->out_dir[0] && rank == 0) checkpoint_remove_temporaries(a->out_dir, a->verbose);   // it holds the lock
    if (rank == 0 && export_check(a)) return -1;   // rank 0 writes the export
    if (a->resume) {
        t->start = checkpoint_before(a->out_dir, t->resume_limit);
        if (t->start == 0 && a->verbose) printf("note: no complete checkpoint in %s: starting from step 0\n", a->out_dir);
    } else if (a->out_dir[0] && checkpoint_latest(a->out_dir) > 0) {   // it would overwrite them step by step
        return train_fail("%s holds the checkpoints of a run (the newest at step %lld): resume it with -y 1, or start "
                          "afresh in another -o (or after removing them)", a->out_dir, (long long)checkpoint_latest(a->out_dir));
    }
    snprintf(t->model_path, sizeof t->model_path, "%s", a->model);
    size_t len = strlen(a->model);
    if (t->start > 0) {
        if (checkpoint_resume(t, rank, ranks)) return -1;
    } else if (len > 4 && strcmp(a->model + len - 4, ".bin") == 0) {
        if (gpt2_load(&t->model, a->model)) return -1;
    } else {
        GPT2Config c;
        if (gpt2_config_from_descriptor(&c, a->model)) return -1;
        c.stable_embedding = a->stable_embedding != 0;
        if (check_batch(a, &c) || gpt2_init_random(&t->model, &c, a->seed)) return -1;
    }
    if (a->stable_embedding >= 0 && a->stable_embedding != t->model.config.stable_embedding)   // a file's, or a checkpoint's
        return train_fail("%s was made %s StableEmbedding; -w %d cannot change that (leave -w out)", t->model_path,
                          t->model.config.stable_embedding ? "with" : "without", a->stable_embedding);
    if (check_batch(a, &t->model.config)) return -1;
    if (t->start >= a->steps && !a->export_path[0])   // -X exports the checkpoint as it is
        return train_fail("%s: the checkpoint is at step %lld, the last of its run (-n %lld): nothing to train (-X exports "
                          "it; to train on, start another run in another -o from the exported model, -e)", a->out_dir,
                          (long long)t->start, (long long)a->steps);
    if (a->stop_after > 0 && t->start >= a->stop_after && !a->export_path[0])
        return train_fail("%s: the checkpoint is at step %lld, -x %lld stops at or before it: nothing to train (raise -x, "
                          "or leave it out)", a->out_dir, (long long)t->start, (long long)a->stop_after);
    return 0;
}

// 3. Data and tokenizer

// The last step this run trains to: -x, or -n.
static int64_t last_step(const TrainArgs *a) { return a->stop_after > 0 && a->stop_after < a->steps ? a->stop_after : a->steps; }

static int open_data(Trainer *t) {
    const TrainArgs *a = &t->a;
    int V = t->model.config.vocab_size;
    if (tokens_load(&t->train_file, a->train_path) || tokens_check_vocab(&t->train_file, V)) return -1;
    if (a->out_dir[0]) t->train_digest = tokens_digest(&t->train_file);   // for the trainer state
    const TrainerState *st = &t->resumed;   // a resumed run that trains continues its checkpoint's data
    if (t->start > 0 && t->start < last_step(a) && st->train_tokens &&
        (st->train_tokens != t->train_file.count || st->train_digest != t->train_digest))
        return train_fail("%s: the checkpoint of step %lld was trained on %lld tokens (digest %016llx); -i %s holds %lld "
                          "(digest %016llx): resume on the same training data (-i)", a->out_dir, (long long)t->start,
                          (long long)st->train_tokens, (unsigned long long)st->train_digest, t->train_file.path,
                          (long long)t->train_file.count, (unsigned long long)t->train_digest);
    if (t->start > 0 && st->position > t->train_file.count)
        return train_fail("%s: data position %lld is past the end of %s", a->out_dir, (long long)st->position,
                          t->train_file.path);
    if (a->val_path[0]) {
        if (tokens_load(&t->val_file, a->val_path) || tokens_check_vocab(&t->val_file, V)) return -1;
        if (t->val_file.count < a->B * a->T + 1)
            return train_fail("%s has %lld tokens, fewer than one batch needs (B*T+1 = %lld)", t->val_file.path,
                              (long long)t->val_file.count, (long long)(a->B * a->T + 1));
    }
    if (a->tokenizer_path[0]) {
        if (tokenizer_load(&t->tok, a->tokenizer_path)) return -1;
        if (t->tok.vocab_size != V) {
            if (a->verbose)
                printf("note: %s has %d tokens, the model %d: samples are printed as ids\n", a->tokenizer_path,
                       t->tok.vocab_size, V);
            tokenizer_free(&t->tok);
        }
    }
    return loader_init(&t->loader, &t->train_file, a->B, a->T);
}

// 4. The device and the optimizer; a resumed run takes the data position and the RNG of its checkpoint.

static int trainer_open_before(Trainer *t, const TrainArgs *a, int64_t limit) {
    memset(t, 0, sizeof *t);
    t->lock_fd = -1;
    t->resume_limit = limit;
    t->a = *a;
    if (!t->a.val_path) t->a.val_path = "";
    if (!t->a.tokenizer_path) t->a.tokenizer_path = "";
    if (!t->a.out_dir) t->a.out_dir = "";
    if (!t->a.export_path) t->a.export_path = "";
    t->rng.s = a->seed;
    if (open_settings(t)) return -1;
    // Over NCCL the ranks open in turns, each dropping its host copy of the weights at the end of its
    // turn: one host holds one fp32 copy at a time. A rank that fails waits out the turns (nccl_agree).
    int rank = 0, ranks = nccl_ranks(t, &rank), status = 0;
    for (int r = 0; r < (ranks ? ranks : 1); r++) {
        if (r == rank) status = open_model(t) || open_data(t) || t->dev->open(t);
        if (r == rank && !status && t->nccl) host_weights_drop(&t->model);
        if (nccl_barrier(t)) return -1;
    }
    if (status) return -1;
    if (t->start > 0) {
        t->loader.position = t->resumed.position;
        t->rng.s = t->resumed.rng;
    }
    t->end = last_step(&t->a);   // a resume may have taken -n from its checkpoint
    if (t->end < t->start) t->end = t->start;   // -X from a checkpoint at or past -n or -x: no step to run
    return 0;
}

// A resume whose newest complete checkpoint is damaged (a file that does not load, weights that are
// not finite, files of different steps) falls back to the one before, saying so; when none is left,
// the newest one's error. Over NCCL every rank falls back when one rank's files are damaged
// (nccl_agree), and a resumed rank takes the others' shards of the weights.
int trainer_open(Trainer *t, const TrainArgs *a) {
    char newest[sizeof train_error_text] = "";
    int64_t limit = INT64_MAX;
    for (;;) {
        int status = nccl_agree(t, trainer_open_before(t, a, limit));
        if (status == 0) return t->start > 0 ? nccl_gather_weights(t) : 0;
        if (!t->damaged) return -1;
        if (!newest[0]) snprintf(newest, sizeof newest, "%s", train_error_text);
        limit = t->start;
        trainer_free(t);
        if (checkpoint_before(a->out_dir, limit) == 0) return train_fail("%s (and no earlier complete checkpoint)", newest);
        if (a->verbose) printf("warning: checkpoint %lld cannot be resumed: %s\nwarning: resuming from the one before\n",
                               (long long)limit, train_error_text);
    }
}

void trainer_free(Trainer *t) {
    if (t->lock_fd >= 0) close(t->lock_fd);   // releases the -o directory's lock (fd 0 too, when stdin was closed)
    bnb8_optimizer_free(t->opt);
    clip_free(t);
    nccl_free(t);
    if (t->dev) t->dev->close(t);
    loader_free(&t->loader);
    tokenizer_free(&t->tok);
    free(t->train_file.tokens);
    free(t->val_file.tokens);
    gpt2_free(&t->model);
    memset(t, 0, sizeof *t);
    t->lock_fd = -1;
}

// Evaluation and sampling

// " (not finite)" after a loss that is NaN or Inf, so that a report says so in words.
static const char *not_finite(float loss) { return isfinite(loss) ? "" : " (not finite)"; }

// Mean loss over the first val_batches batches of the file (all of them if fewer); NAN on a device error.
static float evaluate(Trainer *t) {
    int64_t B = t->a.B, T = t->a.T, n = (t->val_file.count - 1) / (B * T);
    if (t->a.val_batches > 0 && n > t->a.val_batches) n = t->a.val_batches;
    int *inputs = (int *)malloc(sizeof(int) * (size_t)(2 * B * T)), *targets = inputs + B * T;
    if (!inputs) return NAN;
    double sum = 0.0;
    for (int64_t i = 0; i < n; i++) {
        const uint16_t *p = t->val_file.tokens + i * B * T;
        for (int64_t j = 0; j < B * T; j++) { inputs[j] = p[j]; targets[j] = p[j + 1]; }
        float loss = NAN;
        if (t->dev->eval(t, inputs, targets, &loss)) break;
        sum += loss;
    }
    free(inputs);
    return n > 0 ? (float)(sum / (double)n) : NAN;
}

int64_t generate(Trainer *t, int eot, int64_t gen_tokens, int *out) {
    const GPT2Config *c = &t->model.config;
    int64_t n = gen_tokens + 1 < t->model.seq_len ? gen_tokens + 1 : t->model.seq_len;
    int64_t V = c->vocab_size, Vp = c->padded_vocab_size;
    out[0] = eot;
    for (int64_t i = 1; i < n; i++) {
        float *logits;   // (Vp)
        if (t->dev->logits(t, out, i, &logits)) return -1;
        gpt2_softmax_forward(logits, NULL, NULL, 1, V, Vp);
        float u = rng_uniform(&t->rng), cdf = 0.0f;
        int next = (int)V - 1;
        for (int64_t k = 0; k < V; k++) { cdf += logits[k]; if (u < cdf) { next = (int)k; break; } }
        out[i] = next;
    }
    return n;
}

static void print_sample(Trainer *t) {
    int *ids = (int *)malloc(sizeof(int) * (size_t)t->model.seq_len);
    if (!ids) return;
    int eot = t->tok.data ? t->tok.eot : t->model.config.vocab_size - 1;
    int64_t n = generate(t, eot, t->a.gen_tokens, ids);
    if (n < 0) printf("---- no sample: %s\n", train_error_text);
    else printf("---- sample (%lld tokens) ----\n", (long long)(n - 1));
    for (int64_t i = 1; i < n; i++) {
        if (t->tok.data) tokenizer_print(&t->tok, ids[i], stdout);
        else printf("%d ", ids[i]);
    }
    printf("\n------------------------------\n");
    free(ids);
}
// ------------------------------------------------------------------------------------------------
// 5. The banner and the report (DESIGN.md §8.6): every buffer, persistent bytes per parameter

// The master of a run's weights, in words.
static const char *master_name(const Layout *l) {
    return l->correction_bytes == 4 ? "+ an fp32 master" : l->correction_bytes == 1 ? "+ an int8 correction"
         : l->weights == BNB8_F32 ? "(their own master)"
         : l->correction_bytes == BNB8_CORRECTION_STOCHASTIC ? "(no master: stochastic rounding)" : "(no master: rounded to nearest)";
}

static void print_memory(Trainer *t) {
    const GPT2 *m = &t->model;
    const Recipe *r = t->recipe;
    const Layout *l = &t->lay;
    int release = t->a.release, working = t->weights16 != NULL;   // working: the CPU's fp32 copies of bf16 weights
    bnb8_memory mem = bnb8_optimizer_memory(t->opt, !release);
    double es = (double)bnb8_dtype_size(l->weights), gs = (double)bnb8_dtype_size(l->grads);
    double cs = l->correction_bytes > 0 ? l->correction_bytes : 0;   // stochastic rounding: no master bytes
    if (t->gpu.model) printf("memory: every buffer on the GPU (%s, %.1f GB)\n", t->gpu.name, (double)t->gpu.total_bytes / 1e9);
    printf("memory: %s weights %s, %s gradients; optimizer states as the library holds them%s\n", dtype_name(l->weights),
           master_name(l), dtype_name(l->grads), release ? "; gradient release: one layer's gradient slices, reused" : "");
    printf("  %-10s %-11s %13s %12s %12s %12s %12s %s\n", "parameter", "shape", "elements", "weights", "master",
           "gradients", "opt. state", " state B/elem");
    for (int i = 0; i < GPT2_NUM_PARAMS; i++) {
        if (!m->param_sizes[i]) continue;
        double n = (double)m->param_sizes[i];
        printf("  %-10s %-11s %13lld ", gpt2_param_names[i], gpt2_param_shapes[i], (long long)m->param_sizes[i]);
        print_bytes(es * n); printf("  "); print_bytes(cs * n); printf("  ");
        print_bytes(gs * n / (double)tensor_slices(t, i)); printf("  ");
        print_bytes(t->state_bytes[i]);
        printf("  %6.3f\n", t->state_bytes[i] / n);
    }
    printf("  %-10s %-11s %13lld ", "total", "", (long long)mem.params);
    print_bytes(mem.weights); printf("  "); print_bytes(mem.correction); printf("  ");
    print_bytes(release ? (double)t->gpu.grads_bytes : mem.gradients); printf("  "); print_bytes(mem.states);
    if (working) {
        printf("\n  fp32 working copies, not persistent (the CPU model computes in fp32):\n");
        printf("    %-34s ", "weights (the bf16 weights widened)"); print_bytes(4.0 * (double)m->num_parameters);
        printf("\n    %-34s ", "gradients (before rounding to bf16)"); print_bytes(4.0 * (double)m->num_parameters);
    }
    printf("\n  activations (B=%lld, T=%lld), one allocation:\n", (long long)m->batch_size, (long long)m->seq_len);
    double acts = t->dev->print_activations(t), P = (double)mem.params;
    print_bytes(acts);
    printf("\n  persistent bytes per parameter (recipe %s%s, from bnb8_optimizer_memory):\n", r->name,
           release ? " + gradient release" : "");
    printf("    weights %.3f + master %.3f + gradients %.3f + optimizer state %.3f = %.3f\n",
           mem.weights / P, mem.correction / P, mem.gradients / P, mem.states / P,
           (mem.weights + mem.correction + mem.gradients + mem.states) / P);
    if (release)
        printf("    gradient scratch under release (wte, wpe, final and StableEmbedding layernorms in full, one layer's\n"
               "    slices of the rest): %.3f bytes per parameter\n", (double)t->gpu.grads_bytes / P);
    if (working) printf("    working copies: %.3f bytes per parameter (fp32 weights and gradients for the CPU model)\n", 8.0);
    printf("    activations: %.3f bytes per parameter at this batch size\n", acts / P);
    nccl_print_memory(t);
    double computed, measured;
    if (t->dev->device_memory(t, &computed, &measured)) {
        printf("  device memory: computed (weights + master + gradients + states + activations) ");
        print_bytes(computed);
        printf("\n                 measured (cudaMemGetInfo, most in use after a step, minus before the run) ");
        if (measured > 0) {
            print_bytes(measured);
            printf("  (%+.1f%%)\n", 100.0 * (measured - computed) / computed);
        } else {
            printf("after the first step: in the report at the end\n");   // the banner comes before any step
        }
    }
}

// What reads a StableEmbedding model's export, said at start and on the export's line.
static const char stable_export_readers[] =
    "this trainer reads it (-e); llm.c refuses it (train with -w 0 for a model llm.c runs)";

static void print_banner(Trainer *t) {
    const TrainArgs *a = &t->a;
    const GPT2Config *cfg = &t->model.config;
    const Recipe *r = t->recipe;
    printf("bnb8 train_gpt2_8bit: %s\n", t->where);
    printf("model    %s: L=%d C=%d NH=%d V=%d (padded %d) maxT=%d, %lld parameters, StableEmbedding %s\n",
           t->model_path, cfg->num_layers, cfg->channels, cfg->num_heads, cfg->vocab_size, cfg->padded_vocab_size,
           cfg->max_seq_len, (long long)t->model.num_parameters, cfg->stable_embedding ? "on" : "off");
    printf("data     %s (%lld tokens), val %s (%lld tokens)\n", t->train_file.path, (long long)t->train_file.count,
           a->val_path[0] ? t->val_file.path : "none", (long long)t->val_file.count);
    printf("recipe   %s: %s%s", r->name, r->about, a->release ? "; gradient release" : "");
    const char *map = a->map == BNB8_MAP_LINEAR ? "linear" : "dynamic";
    if (r->states == BNB8_STATE_8BIT && a->blocksize) printf(" (%s map, blocks of %lld)", map, (long long)a->blocksize);
    if (r->states == BNB8_STATE_8BIT && !a->blocksize) printf(" (%s map, one absmax per tensor)", map);
    if (r->states == BNB8_STATE_FLASH) printf(" (%s group scales)", scale_dtypes[t->scale].name);
    if (r->states == BNB8_STATE_4BIT)
        printf(" (v: %s, %s)", a->map == BNB8_MAP_LINEAR ? "the linear map with zero" : "Li et al.'s map without zero",
               a->rank1 ? "rank-1 on the matrices" : "blocks of 128");
    printf("\n");
    printf("optim    %s, lr %.3g (warm-up %lld, cosine to %.3g), weight decay %.3g on matrices, clip %.3g (%s)\n",
           t->oc->name, (double)t->lr, (long long)a->warmup, (double)(t->lr * a->final_lr_frac), (double)t->wd,
           (double)a->grad_clip, clip_rule_about(t->rule));
    char micro[64] = "";
    if (a->accum > 1) snprintf(micro, sizeof micro, ", %lld micro-batches per step", (long long)a->accum);
    if (t->end > t->start)
        printf("train    B=%lld T=%lld%s, steps %lld..%lld of %lld%s\n", (long long)a->B, (long long)a->T, micro,
               (long long)t->start + 1, (long long)t->end, (long long)a->steps, t->start > 0 ? " (resumed)" : "");
    else printf("train    no steps: the checkpoint of step %lld as it is, for -X\n", (long long)t->start);
    if (a->export_path[0] && cfg->stable_embedding)   // said before training, not only once the file is written
        printf("note: -X %s: this model has StableEmbedding, which llm.c's GPT-2 lacks; the file will be version %d: "
               "%s\n", a->export_path, gpt2_model_file_version(cfg, a->export_bf16), stable_export_readers);
    if (t->gpu.model) nccl_hint();   // several GPUs here and no ranks: how to train on all of them
    print_memory(t);
    fflush(stdout);
}

// The process's resident memory (Linux /proc): field "VmHWM:" the peak, "VmRSS:" now; or -1.
static double resident_bytes(const char *field) {
    FILE *f = fopen("/proc/self/status", "r");
    if (!f) return -1.0;
    char line[256];
    double kb = -1.0;
    while (fgets(line, sizeof line, f))
        if (strncmp(line, field, strlen(field)) == 0) kb = atof(line + strlen(field));
    fclose(f);
    return kb < 0 ? -1.0 : kb * 1024.0;
}

// 6. The steps

// One optimizer step over accum micro-batches: their gradients add up (accum times the mean
// gradient), the loss is their mean.
// *unchanged: elements left unchanged for a non-finite gradient or update (the prev and est rules
// step the rest; exact skips the whole step instead, *skipped).
static int train_step(Trainer *t, float lr, float *loss, double *norm, int *skipped, int64_t *unchanged) {
    *loss = 0.0f;
    clip_step_begin(t);
    for (int64_t micro = 0; micro < t->a.accum; micro++) {
        nccl_batch(t);   // this rank's batch; one process: the loader's next
        float micro_loss = NAN;
        if (t->dev->micro_step(t, t->loader.inputs, t->loader.targets, micro > 0, lr, &micro_loss)) return -1;
        *loss += micro_loss / (float)t->a.accum;
    }
    if (nccl_mean_loss(t, loss)) return -1;
    if (t->dev->step(t, lr, norm, skipped)) return -1;
    *unchanged = 0;
    if (!*skipped && bnb8_optimizer_take_nonfinite(t->opt, unchanged)) return train_fail("optimizer: %s", bnb8_last_error());
    if (nccl_total_count(t, unchanged)) return -1;   // each rank counts its shards'; the stop is the ranks'
    if (*unchanged && t->a.verbose)
        printf("step %lld: %lld elements with a non-finite gradient or update left unchanged\n", (long long)t->step, (long long)*unchanged);
    return 0;
}

// A checkpoint is written only from a state whose weights give a finite loss: this step's loss
// was finite (else its weights, those the step started from, are the ones kept when it was
// skipped), and a forward of the step's last batch on the weights after it is finite too (one
// forward per checkpoint). Else nothing is written (*kept = 0): the newest checkpoint stays the
// last good one.
static int checkpoint_worthy(Trainer *t, int64_t s, float loss, int *kept) {
    float after = loss;
    if (isfinite(loss) && t->dev->eval(t, t->loader.inputs, t->loader.targets, &after)) return -1;
    if (isfinite(loss) && nccl_mean_loss(t, &after)) return -1;   // every rank decides alike
    *kept = isfinite(after);
    if (!*kept && t->a.verbose)
        printf("step %lld: the weights give a non-finite loss (%g %s the step): no checkpoint written; the newest in %s "
               "is the last good one\n", (long long)s, (double)after, isfinite(loss) ? "after" : "before", t->a.out_dir);
    return 0;
}

// -L: once the checkpoint of step s is complete, the older ones beyond the newest -L go. Over NCCL
// rank 0 removes every rank's files: -o is one directory that every rank writes into, and every
// rank's file of step s was written before rank 0 wrote its DONE. A file that cannot be removed is
// warned about, and the run goes on: its checkpoints are whole.
static void prune_checkpoints(Trainer *t, int64_t s) {
    const TrainArgs *a = &t->a;
    int rank = 0, ranks = nccl_ranks(t, &rank);
    CheckpointsPruned pruned;
    if (a->keep_checkpoints == 0 || rank != 0) return;
    int failed = checkpoint_prune(a->out_dir, s, a->keep_checkpoints, ranks, &pruned);
    if (a->verbose && pruned.count == 1)
        printf("step %5lld | -L %lld: removed the checkpoint of step %lld\n", (long long)s, (long long)a->keep_checkpoints,
               (long long)pruned.oldest);
    if (a->verbose && pruned.count > 1)
        printf("step %5lld | -L %lld: removed %lld checkpoints, of steps %lld..%lld\n", (long long)s,
               (long long)a->keep_checkpoints, (long long)pruned.count, (long long)pruned.oldest, (long long)pruned.newest);
    if (failed && a->verbose) printf("warning: %s\n", train_error_text);
}

// The device row gives the fp32 masters, checked for finite values before anything is written.
static int save_checkpoint(Trainer *t, int64_t s, int64_t *bytes) {
    const TrainArgs *a = &t->a;
    TrainerState save = {s, t->loader.position, a->B, a->T, t->recipe - recipes, t->oc - optimizers,
                         t->model.config.stable_embedding, a->steps, t->rng.s, a->seed, a->release, a->accum,
                         (int64_t)bnb8_dtype_size(t->lay.weights), STATE_VERSION, t->model.config,
                         bnb8_optimizer_step_count(t->opt, 0), t->rule, t->prev_norm, t->recipe->states == BNB8_STATE_FLASH ? t->scale : 0,
                         t->train_file.count, t->train_digest,
                         {t->profile[0], t->profile[1], t->profile[2]}, nccl_ranks(t, NULL),
                         .lr = t->lr, .final_lr_frac = a->final_lr_frac, .weight_decay = t->wd, .grad_clip = a->grad_clip,
                         .warmup = a->warmup, .map = a->map, .blocksize = a->blocksize, .rank1 = a->rank1,
                         .optim_digest = 0};   // checkpoint_save binds the optimizer files it writes
    float *masters;
    int64_t own = 0;
    if (t->nccl ? nccl_checkpoint_save(t, &save, bytes, &own)
                : t->dev->masters(t, &masters) || checkpoint_save(a->out_dir, masters, t->opt, &save, bytes))
        return -1;
    if (a->verbose)
        printf("step %5lld | checkpoint in %s: %lld bytes, %.3f bytes per parameter\n", (long long)s, a->out_dir,
               (long long)*bytes, (double)*bytes / (double)t->model.num_parameters);
    if (a->verbose && t->nccl)   // rank 0's file: its shards
        printf("             %lld ranks, an optimizer file each: rank 0's %lld bytes, %.3f bytes per parameter of its %lld\n",
               (long long)save.ranks, (long long)own, (double)own / (double)bnb8_optimizer_memory(t->opt, 0).params,
               (long long)bnb8_optimizer_memory(t->opt, 0).params);
    prune_checkpoints(t, s);
    return 0;
}

// The weights as a model file (DESIGN.md §8.1): the fp32 masters (version 3), or their RNE to bf16
// (version 5, what llm.c's default bf16 build reads). A StableEmbedding model's file has bnb8's
// version 8003 or 8005 instead, which llm.c refuses: it would run another network from it.
static int export_model(Trainer *t) {
    const TrainArgs *a = &t->a;
    const GPT2Config *c = &t->model.config;
    float *masters;
    char where[160];
    if (t->dev->masters(t, &masters)) return -1;
    if (!masters) return 0;   // over NCCL, a rank other than 0: it sent its shards; rank 0 writes
    if (gpt2_params_nonfinite(c, masters, where, sizeof where))
        return train_fail("export to %s: the weights are not finite (%s)", a->export_path, where);
    if (gpt2_save_params(c, masters, a->export_path, a->export_bf16)) return -1;
    if (a->verbose && !c->stable_embedding)
        printf("export   step %lld's weights to %s: llm.c model file version %d (%s), %lld bytes\n", (long long)t->end,
               a->export_path, gpt2_model_file_version(c, a->export_bf16), a->export_bf16 ? "bf16" : "fp32",
               (long long)path_size(a->export_path));
    if (a->verbose && c->stable_embedding)
        printf("export   step %lld's weights to %s: model file version %d (%s, StableEmbedding), %lld bytes: %s\n",
               (long long)t->end, a->export_path, gpt2_model_file_version(c, a->export_bf16),
               a->export_bf16 ? "bf16" : "fp32", (long long)path_size(a->export_path), stable_export_readers);
    return 0;
}

typedef struct {
    double train_time;
    int64_t trained;
    int64_t group_clipped;    // est: steps with one group clipped or more
    float first_loss, last_loss, val_first, val_last;
} Progress;

static int train_loop(Trainer *t, TrainResult *res, Progress *pr) {
    const TrainArgs *a = &t->a;
    int have_val = a->val_path[0] != 0;
    if (have_val && a->eval_every > 0 && t->start == 0) {
        pr->val_first = pr->val_last = evaluate(t);
        if (a->verbose) printf("step %5d | val loss %.4f%s\n", 0, (double)pr->val_first, not_finite(pr->val_first));
    }
    int64_t bad_steps = 0;      // in a row: the loss not finite or the update skipped
    for (int64_t s = t->start + 1; s <= t->end; s++) {
        double t0 = now_seconds(), norm = NAN;
        float step_lr = lr_schedule(a, t->lr, s), loss = 0.0f;
        int skipped = 0;
        int64_t unchanged = 0;
        char rule[192];
        t->step = s;
        if (train_step(t, step_lr, &loss, &norm, &skipped, &unchanged)) return -1;
        int clipped = clip_step_end(t, norm, skipped, rule, sizeof rule);
        res->clipped_steps += clipped;
        pr->group_clipped += est_groups_clipped(t) > 0;
        if (skipped) {
            res->skipped_steps++;
            if (a->verbose)
                printf("step %lld: non-finite gradient norm (%g), update skipped: weights and optimizer state unchanged\n",
                       (long long)s, norm);
        }
        double dt = now_seconds() - t0;
        if (s > t->start + 1 || t->end == t->start + 1) { pr->train_time += dt; pr->trained++; }   // the first step warms up
        if (s == t->start + 1) pr->first_loss = loss;
        pr->last_loss = loss;
        if (res->losses) res->losses[s - 1] = loss;
        if (res->norms) res->norms[s - 1] = norm;
        if (a->verbose) {
            printf("step %5lld/%lld | loss %.4f | lr %.3e | norm %6.3f%s | %7.1f ms | %7.0f tok/s\n", (long long)s,
                   (long long)a->steps, (double)loss, (double)step_lr, norm, rule, 1e3 * dt,
                   (double)(a->B * a->T * a->accum) / dt);
            fflush(stdout);
        }
        bad_steps = isfinite(loss) && !skipped && !unchanged ? 0 : bad_steps + 1;
        if (bad_steps >= TRAIN_MAX_BAD_STEPS)
            return train_fail("steps %lld..%lld: the training loss was not finite, or the gradients or update held NaN or Inf, %d "
                              "steps in a row (TRAIN_MAX_BAD_STEPS): the run has diverged, or its model or data give NaN; stopped%s%s%s",
                              (long long)(s - bad_steps + 1), (long long)s, TRAIN_MAX_BAD_STEPS,
                              a->out_dir[0] ? "; the newest complete checkpoint in " : "", a->out_dir,
                              a->out_dir[0] ? " is the last good one" : "");
        if (have_val && a->eval_every > 0 && (s % a->eval_every == 0 || s == a->steps)) {
            pr->val_last = evaluate(t);
            if (a->verbose) printf("step %5lld | val loss %.4f%s\n", (long long)s, (double)pr->val_last, not_finite(pr->val_last));
        }
        if (a->verbose && a->sample_every > 0 && s % a->sample_every == 0 && s != a->steps) print_sample(t);
        int due = a->out_dir[0] && ((a->ckpt_every > 0 && s % a->ckpt_every == 0) || s == a->steps || s == a->stop_after), kept = 1;
        if (due && checkpoint_worthy(t, s, loss, &kept)) return -1;
        if (due && kept && save_checkpoint(t, s, &res->checkpoint_bytes)) return -1;
        if (due && !kept && s == t->end)
            return train_fail("step %lld, the last of this run: its weights give a non-finite loss; no checkpoint written "
                              "(the newest complete one in %s is the last good one)", (long long)s, a->out_dir);
    }
    return 0;
}

// 7. Results and 8. the report

static int train_results(Trainer *t, TrainResult *res, Progress *pr) {
    const TrainArgs *a = &t->a;
    if (a->val_path[0] && a->eval_every > 0 && isnan(pr->val_last) && t->end >= a->steps) pr->val_last = evaluate(t);
    res->first_step = t->start + 1;
    res->last_step = t->end;
    res->first_loss = pr->first_loss;
    res->last_loss = pr->last_loss;
    res->val_loss = pr->val_last;
    res->tokens_per_second = pr->train_time > 0.0 ? (double)pr->trained * (double)(a->B * a->T * a->accum) / pr->train_time : 0.0;
    res->memory = bnb8_optimizer_memory(t->opt, !a->release);
    res->on_gpu = t->dev == &device_gpu;
    t->dev->device_memory(t, &res->gpu_computed, &res->gpu_measured);
    if (res->final_params && res->final_params_count == t->model.num_parameters) {
        float *masters;
        if (t->dev->masters(t, &masters)) return -1;
        if (masters) memcpy(res->final_params, masters, sizeof(float) * (size_t)t->model.num_parameters);
    }
    return 0;
}

static void print_report(Trainer *t, const TrainResult *res, const Progress *pr) {
    const TrainArgs *a = &t->a;
    printf("\n==== report ====\n");
    print_memory(t);
    double peak = resident_bytes("VmHWM:"), now = resident_bytes("VmRSS:");
    if (peak > 0) {
        printf("  peak resident memory of the process (VmHWM): ");
        print_bytes(peak);
        if (now > 0) { printf(", now (VmRSS): "); print_bytes(now); }   // over NCCL: without the host weights
        printf("\n");
    }
    printf("speed    %.0f tokens/s (%lld steps of %lld tokens in %.1f s, after the first step)\n", res->tokens_per_second,
           (long long)pr->trained, (long long)(a->B * a->T * a->accum), pr->train_time);
    if (t->end > t->start)
        printf("loss     train %.4f (step %lld) -> %.4f (step %lld)", (double)pr->first_loss, (long long)(t->start + 1),
               (double)pr->last_loss, (long long)t->end);
    else printf("loss     no steps run (step %lld)", (long long)t->end);
    if (a->val_path[0] && a->eval_every == 0) printf("; val not evaluated (-v 0)");
    else if (a->val_path[0] && t->start == 0)
        printf("; val %.4f%s -> %.4f%s", (double)pr->val_first, not_finite(pr->val_first), (double)pr->val_last, not_finite(pr->val_last));
    else if (a->val_path[0]) printf("; val %.4f%s (none at the start: a resumed run)", (double)pr->val_last, not_finite(pr->val_last));
    printf("\n");
    if (res->skipped_steps)
        printf("skipped  %lld steps whose gradients held NaN or Inf (no update made)\n", (long long)res->skipped_steps);
    if (a->grad_clip > 0.0f) {   // est: the steps whose exact norm was above the clip, and those with a group clipped
        printf("clip     at %g with %s: %lld of %lld steps clipped", (double)a->grad_clip, clip_rule_report(t->rule),
               (long long)res->clipped_steps, (long long)(t->end - t->start));
        if (t->rule == CLIP_EST) printf(", %lld with one group clipped or more", (long long)pr->group_clipped);
        printf("\n");
    }
    if (a->gen_tokens > 0) print_sample(t);
}

int train_run(const TrainArgs *a, TrainResult *res) {
    TrainResult dummy = {0};
    if (!res) res = &dummy;
    res->first_step = res->last_step = res->skipped_steps = res->clipped_steps = res->on_gpu = 0;
    res->first_loss = res->last_loss = res->val_loss = NAN;
    res->tokens_per_second = 0.0;
    res->checkpoint_bytes = 0;
    Trainer *t = (Trainer *)calloc(1, sizeof(Trainer));
    if (!t) return train_fail("out of memory");
    Progress pr = {0.0, 0, 0, NAN, NAN, NAN, NAN};
    int status = trainer_open(t, a);
    if (!status && a->verbose) print_banner(t);
    if (!status) status = train_loop(t, res, &pr);
    if (!status) status = train_results(t, res, &pr);
    if (!status && a->export_path && a->export_path[0]) status = export_model(t);
    if (!status && a->verbose) print_report(t, res, &pr);
    trainer_free(t);
    free(t);
    return status;
}

#ifndef TRAIN_NO_MAIN
int main(int argc, char **argv) {
    TrainArgs args;
    char given[128];
    nccl_pick_device();
    int p = parse_args(argc, argv, &args, given);
    if (p == 1) { usage(stdout); return 0; }
    if (p < 0) {
        print_flag_error(stderr, argv[0]);
        return 1;
    }
    if (gpu_wanted(&args)) {
        args.device = 2;
        apply_gpu_defaults(&args, given);
    }
    if (train_run(&args, NULL)) {
        fflush(stdout);
        fprintf(stderr, "error: %s\n", train_error_text);
        return 1;
    }
    return 0;
}
#endif