/*
train_gpt2_8bit.c — trains GPT-2 with bnb8's optimizers: 32-bit states with an fp32 master (llm.c's
16-byte layout), 8-bit block-wise states (Dettmers et al.) with an fp32 master or an int8 correction,
or FlashOptim's flash recipe; AdamW, Lion or SGD with momentum; on the CPU (gpt2_cpu.c) or on the
GPU (gpt2_cuda.cu, in the -DTRAIN_CUDA build: the bf16 model, or the fp32 one for parity), with
gradient release there.

One file read top to bottom, in the spirit of llm.c's train_gpt2.c:
  - recipes and optimizers: tables of rows that drive both devices;
  - settings: the command line, its defaults, the learning-rate schedule;
  - checkpoints: the optimizer state (every weight as the run keeps it, its master, the states) +
    the trainer state + a DONE marker, each written atomically, each piece of state once, and the
    bit-exact resume from them; llm.c model files out (-X: fp32 version 3 or bf16 version 5) and in;
  - the devices: one table of operations with a CPU row and a GPU row, the only place where the
    two differ;
  - the run, phase by phase: settings, model, data, device and optimizer, banner, steps, results,
    report (every buffer, persistent bytes per parameter from the optimizer's own accounting,
    tokens/s, losses, a sample).
The model lives in gpt2_cpu.c / gpt2_cuda.cu, the files and the data loader in gpt2_data.c, what
they share in gpt2.h; this file's interface for the tests is train_gpt2_8bit.h.

Determinism: both models compute each element in a fixed order, so with the optimizer state, the
data position and the RNG in a checkpoint, a resumed run is bit-identical to one that never stopped.

Build and run: `make train` (`GPU=1`: build/train_gpt2_8bit_cuda), `./build/train_gpt2_8bit -h`.
Compiled with -DTRAIN_NO_MAIN this file has no main, for the tests.
*/
#define _POSIX_C_SOURCE 200809L   // mkdir, opendir, clock_gettime
#define _DEFAULT_SOURCE           // flock
#include <stdio.h>
#include <stdlib.h>
#include <stdint.h>
#include <string.h>
#include <math.h>
#include <time.h>
#include <errno.h>
#include <dirent.h>
#include <sys/types.h>
#include <sys/stat.h>
#include <unistd.h>
#include <fcntl.h>
#include <sys/file.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#include "train_gpt2_8bit.h"

void (*train_after_backward)(GPT2 *m, float *grads, bnb8_optimizer *opt, int64_t step);

static double now_seconds(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

// ------------------------------------------------------------------------------------------------
// Recipes and optimizers

// On the GPU every recipe is a bf16 mixed-precision run (DESIGN.md §8.7): bf16 weights and gradients,
// with an fp32 master the optimizer owns and rounds into the weights, or an int8 correction each (a
// near-fp32 master, §6.1). Tensors under min_8bit_size and StableEmbedding's wte keep 32-bit states and
// their master. A row's index is the trainer state file's: new rows go last.
const Recipe recipes[] = {
    {"fp32", BNB8_STATE_32BIT, BNB8_BF16, BNB8_BF16, 4, "32-bit states, fp32 master (llm.c's layout)"},
    {"8bit", BNB8_STATE_8BIT, BNB8_BF16, BNB8_BF16, 4, "8-bit block-wise states, fp32 master (bitsandbytes)"},
    {"flash", BNB8_STATE_FLASH, BNB8_BF16, BNB8_BF16, 1, "companded 8-bit states, int8 correction (FlashOptim)"},
    {"8bit-int8", BNB8_STATE_8BIT, BNB8_BF16, BNB8_BF16, 1, "8-bit block-wise states, int8 correction"},
};
const int num_recipes = (int)(sizeof recipes / sizeof recipes[0]);
#define RECIPE_NAMES "fp32, 8bit, 8bit-int8, flash"

const OptimizerChoice optimizers[] = {
    {"adamw", BNB8_ADAMW, 3e-3f, 0.1f},
    {"lion", BNB8_LION, 3e-4f, 1.0f},    // Lion: ~10x smaller lr, ~10x larger decay (its paper)
    {"sgd", BNB8_SGD, 0.3f, 0.0f},       // SGD with momentum 0.9; decay is L2 for SGD
};
const int num_optimizers = (int)(sizeof optimizers / sizeof optimizers[0]);

int find_recipe(const char *name) {
    for (int i = 0; i < num_recipes; i++) if (strcmp(recipes[i].name, name) == 0) return i;
    return -1;
}
int find_optimizer(const char *name) {
    for (int i = 0; i < num_optimizers; i++) if (strcmp(optimizers[i].name, name) == 0) return i;
    return -1;
}

const ScaleDtype scale_dtypes[] = {{"e6m10", BNB8_E6M10}, {"bf16", BNB8_BF16}, {"fp16", BNB8_F16}, {"fp32", BNB8_F32}};
const int num_scale_dtypes = (int)(sizeof scale_dtypes / sizeof scale_dtypes[0]);
int find_scale_dtype(const char *name) {
    for (int i = 0; i < num_scale_dtypes; i++) if (strcmp(scale_dtypes[i].name, name) == 0) return i;
    return -1;
}

// What a run keeps, from the recipe, the device and -P (the one place they meet): the GPU's bf16
// model the recipe's row; the fp32 parity model (-P fp32, either device) fp32 weights and gradients,
// no master; the CPU fp32 weights where the master is fp32 (they are one: the same trajectory), else the row.
static Layout run_layout(const Recipe *r, int on_gpu, int parity) {
    Layout l = {r->weights, r->grads, r->correction_bytes};
    if (parity || (!on_gpu && r->correction_bytes == 4)) { l.weights = l.grads = BNB8_F32; l.correction_bytes = 0; }
    return l;
}
static const char *dtype_name(bnb8_dtype d) { return d == BNB8_F32 ? "fp32" : d == BNB8_BF16 ? "bf16" : "fp16"; }
static const char *master_name(const Layout *l) {
    return l->correction_bytes == 4 ? "+ an fp32 master" : l->correction_bytes == 1 ? "+ an int8 correction"
         : l->weights == BNB8_F32 ? "(their own master)" : "(no master)";
}

// The optimizer's tensors, registered in parameter order. Under gradient release each per-layer
// tensor is registered as L slices, "qkvw.0" .. "qkvw.L-1", so that a layer's slices can be stepped
// as soon as backward has its gradients; so is it under the prev and est clipping rules (prev sums
// the optimizer's per-tensor sums, est steps layer by layer): the same tensors make the same bits
// with release and without.
static int64_t slices_of(const Trainer *t, int L, int i) {   // in a model of L layers
    return (t->a.release || t->rule != CLIP_EXACT) && gpt2_param_is_layer(i) ? L : 1;
}
int64_t tensor_slices(const Trainer *t, int i) { return slices_of(t, t->model.config.num_layers, i); }
// Slice l (of n elements) of tensor i's gradients, where the optimizer reads them; under release the
// one slice every layer's gradients pass through.
void *slice_grad(const Trainer *t, int i, int64_t l, int64_t n) {
    return (char *)t->grad[i] + (t->a.release ? 0 : bnb8_dtype_size(t->lay.grads) * (size_t)(l * n));
}
// The optimizer id of slice l of tensor i.
static int optimizer_id(const Trainer *t, int i, int64_t l) {
    int64_t id = l;
    for (int k = 0; k < i; k++) if (t->model.param_sizes[k]) id += tensor_slices(t, k);
    return (int)id;
}
// Offset of tensor i in the parameter layout.
static int64_t param_offset(const GPT2 *m, int i) {
    int64_t off = 0;
    for (int k = 0; k < i; k++) off += m->param_sizes[k];
    return off;
}

// Registers every parameter tensor where t->param and t->grad say, in the run's dtypes, and sets
// the weights (bf16 + master for bf16 weights) from the fp32 weights of t->model. Biases and
// layernorm parameters get weight decay 0 (per-name overrides); with StableEmbedding wte keeps
// 32-bit states, as bitsandbytes' StableEmbedding asks; a release slice takes its whole tensor's
// state format.
static int optimizer_build(Trainer *t) {
    const GPT2 *m = &t->model;
    const Recipe *r = t->recipe;
    const Layout *lay = &t->lay;
    bnb8_config cfg = bnb8_config_default(t->oc->kind);
    cfg.lr = t->lr;
    cfg.weight_decay = t->wd;
    cfg.format = r->states;
    if (r->states == BNB8_STATE_8BIT) { cfg.map = (bnb8_map)t->a.map; cfg.blocksize = t->a.blocksize; }
    if (r->states == BNB8_STATE_FLASH) cfg.scale_dtype = scale_dtypes[t->scale].dtype;
    cfg.correction_bytes = lay->correction_bytes;   // every tensor, whatever its states
    cfg.sum_squares = t->rule == CLIP_PREV;         // the norm the next step clips with
    cfg.gnorm_scale_at = t->rule == CLIP_EST ? t->scale_at : NULL;   // each group's scale, set before its step
    if (t->oc->kind == BNB8_ADAMW) cfg.beta2 = 0.95f;   // GPT-2 practice (llm.c, nanoGPT)
    size_t es = bnb8_dtype_size(lay->weights);
    if (bnb8_optimizer_create(&t->opt, t->oc->kind, &cfg)) return train_fail("optimizer: %s", bnb8_last_error());
    for (int i = 0; i < GPT2_NUM_PARAMS; i++) {
        t->state_bytes[i] = 0.0;
        if (m->param_sizes[i] == 0) continue;
        int stable_wte = i == GPT2_WTE && m->config.stable_embedding;
        int64_t slices = tensor_slices(t, i), n = m->param_sizes[i] / slices;
        for (int64_t l = 0; l < slices; l++) {
            char name[64];
            if (slices > 1) snprintf(name, sizeof name, "%s.%lld", gpt2_param_names[i], (long long)l);
            else snprintf(name, sizeof name, "%s", gpt2_param_names[i]);
            // a tensor's gradients; under release, the one slice every layer's gradients pass through
            void *grad = slice_grad(t, i, l, n);
            int64_t off = 0, count = n;   // several GPUs: this rank's shard of it, or none
            if (t->nccl && !nccl_share(t, optimizer_id(t, i, l), &off, &count, &grad)) continue;
            if (!gpt2_param_is_matrix[i] || stable_wte || slices > 1 || count < n) {
                bnb8_config o = cfg;
                if (!gpt2_param_is_matrix[i]) o.weight_decay = 0.0f;
                if (stable_wte) o.format = BNB8_STATE_32BIT;   // the master stays: cfg names it
                if (slices > 1) o.min_8bit_size = m->param_sizes[i] >= cfg.min_8bit_size ? 0 : INT64_MAX;
                if (count < n) { o.shard_offset = off; o.shard_total = n; }
                if (bnb8_optimizer_override(t->opt, name, &o)) return train_fail("optimizer: %s", bnb8_last_error());
            }
            double before = bnb8_optimizer_memory(t->opt, 0).states;
            int id = -1;
            char *param = (char *)t->param[i] + es * (size_t)(l * n + off);
            if (bnb8_optimizer_add(t->opt, name, param, lay->weights, grad, lay->grads, count, &id))
                return train_fail("optimizer: %s", bnb8_last_error());
            // bf16 weights: bf16 + master of the fp32 weights (fp32 ones already are the weights)
            if (lay->weights != BNB8_F32 && bnb8_optimizer_import_fp32(t->opt, id, m->params_memory + param_offset(m, i) + l * n + off))
                return train_fail("optimizer: %s", bnb8_last_error());
            t->state_bytes[i] += bnb8_optimizer_memory(t->opt, 0).states - before;
        }
    }
    return 0;
}

// The fp32 masters of every tensor (bf16 weight + correction decoded, the fp32 master, or the weights).
static int export_masters(const Trainer *t, float *out) {
    const GPT2 *m = &t->model;
    for (int i = 0; i < GPT2_NUM_PARAMS; i++) {
        if (!m->param_sizes[i]) continue;
        int64_t slices = tensor_slices(t, i), n = m->param_sizes[i] / slices;
        for (int64_t l = 0; l < slices; l++)
            if (bnb8_optimizer_export_fp32(t->opt, optimizer_id(t, i, l), out + param_offset(m, i) + l * n))
                return train_fail("export of '%s': %s", gpt2_param_names[i], bnb8_last_error());
    }
    return 0;
}

// The optimizer over the tensors the device row placed, and, when resuming, its checkpointed state:
// the states and, from a checkpoint of trainer state version 2, every weight, which must then be finite.
static int optimizer_open(Trainer *t) {
    if (optimizer_build(t)) return -1;
    if (t->rule == CLIP_PREV && !(t->sums = (double *)malloc(sizeof(double) * (size_t)bnb8_optimizer_count(t->opt))))
        return train_fail("out of memory");
    size_t groups = (size_t)t->model.config.num_layers + 2;
    if (t->rule == CLIP_EST && (!(t->group_sums = (double *)calloc(groups, sizeof(double))) ||
                                !(t->shares = (double *)calloc(groups, sizeof(double)))))
        return train_fail("out of memory");
    if (t->start > 0) {
        char path[TRAIN_PATH_MAX], where[160] = "";
        int rank = 0, ranks = nccl_ranks(t, &rank);
        checkpoint_optim_path(path, sizeof path, t->a.out_dir, t->start, rank, ranks);
        t->damaged = 1;   // until the file has passed every check: a failure here is the checkpoint's
        if (bnb8_optimizer_load(t->opt, path)) return train_fail("%s", bnb8_last_error());
        float *masters = t->grads;   // the CPU's gradient buffer, free now; the GPU's host weights
        if (!masters || t->lay.weights == BNB8_F32) masters = t->model.params_memory;
        for (int i = 0; t->resumed.version >= 2 && i < bnb8_optimizer_count(t->opt); i++)
            if (bnb8_optimizer_steps(t->opt, i) != t->resumed.opt_steps)
                return train_fail("%s: tensor %d has taken %lld optimizer steps, the trainer state of step %lld says %lld: "
                                  "files of different checkpoints; resume from an earlier checkpoint", path, i,
                                  (long long)bnb8_optimizer_steps(t->opt, i), (long long)t->resumed.step,
                                  (long long)t->resumed.opt_steps);
        if (t->resumed.version >= 2 && (t->nccl ? nccl_masters(t, where, sizeof where) : export_masters(t, masters))) return -1;
        if (t->resumed.version >= 2 && !t->nccl) gpt2_params_nonfinite(&t->model.config, masters, where, sizeof where);
        if (where[0])   // over NCCL: this rank's shards
            return train_fail("%s: the weights are not finite after loading it (%s): a damaged or incomplete file; "
                              "resume from an earlier checkpoint", path, where);
        t->damaged = 0;
    }
    return 0;
}

// gnorm_scale of a step whose gradients are the sum of accum micro-batches' mean gradients, norm
// the norm of their mean: the mean, clipped at clip (0 = off; a NAN norm, none known: not clipped).
float step_scale(double norm, float clip, int64_t accum) {
    float scale = clip > 0.0f && norm > clip ? (float)(clip / norm) : 1.0f;
    return scale / (float)accum;
}

// The norm a step clips with: this step's (exact) or the previous step's (prev).
static double clip_norm(const Trainer *t, double norm) { return t->rule == CLIP_PREV ? t->prev_norm : norm; }

const char *const clip_rule_names[3] = {"exact", "prev", "est"};

// The est rule (train_gpt2_8bit.h, DESIGN.md §6.4): the shares F(j) of the groups, from the profile
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

// Group g in backward's order (0 the final LayerNorm, 1..L layers L-1..0, L+1 the embeddings): its
// optimizer ids, with their gradients and sizes where the optimizer reads them; returns the count.
int group_tensors(const Trainer *t, int g, int *ids, void **grads, int64_t *n) {
    static const int lnf[] = {GPT2_LNFW, GPT2_LNFB}, embed[] = {GPT2_WTE, GPT2_WPE, GPT2_LNEW, GPT2_LNEB};
    const GPT2 *m = &t->model;
    int L = m->config.num_layers, count = 0;
    if (g >= 1 && g <= L) {
        for (int i = GPT2_FIRST_LAYER_PARAM; i <= GPT2_LAST_LAYER_PARAM; i++) {
            n[count] = m->param_sizes[i] / L;
            grads[count] = slice_grad(t, i, L - g, n[count]);
            ids[count++] = optimizer_id(t, i, L - g);
        }
        return count;
    }
    const int *list = g == 0 ? lnf : embed;
    for (int k = 0; k < (g == 0 ? 2 : 4); k++) {
        if (!m->param_sizes[list[k]]) continue;
        n[count] = m->param_sizes[list[k]];
        grads[count] = t->grad[list[k]];
        ids[count++] = optimizer_id(t, list[k], 0);
    }
    return count;
}
// backward's group `which` (GPT2_GRADS_LNF, a layer, GPT2_GRADS_EMBED) as a group index.
static int group_of(const Trainer *t, int which) {
    return which == GPT2_GRADS_LNF ? 0 : which == GPT2_GRADS_EMBED ? t->model.config.num_layers + 1
                                       : t->model.config.num_layers - which;
}

// The est rule's norm for group g from this step's sums of the groups 0..g, and its scale.
static double est_norm(const Trainer *t, int g) {
    double prefix = 0.0;
    for (int j = 0; j <= g; j++) prefix += t->group_sums[j];
    return sqrt(prefix / t->shares[g]) / (double)t->a.accum;
}

// One group of a step: without est, stepped at gnorm_scale scale; with est, its sums and scale
// first (the device row), then its step at 1 (the optimizer reads the scale where it lies).
static int step_group(Trainer *t, int g, float lr, float scale, struct CUstream_st *stream) {
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
static void est_finish(Trainer *t, double *norm) {
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
static int prev_rule_norm(Trainer *t, double *norm) {
    int count = bnb8_optimizer_count(t->opt);
    if (bnb8_optimizer_sum_squares(t->opt, t->sums)) return train_fail("gradient norm: %s", bnb8_last_error());
    double total = 0.0;
    for (int i = 0; i < count; i++) total += t->sums[i];
    *norm = sqrt(total) / (double)t->a.accum;
    return 0;
}

// ------------------------------------------------------------------------------------------------
// Settings (the command line)

void train_args_default(TrainArgs *a) {
    memset(a, 0, sizeof *a);
    a->train_path = DEFAULT_DATA_DIR "fortunes_train.bin";
    a->val_path = DEFAULT_DATA_DIR "fortunes_val.bin";
    a->tokenizer_path = DEFAULT_DATA_DIR "gpt2_tokenizer.bin";
    a->model = "d4c128h4";
    a->out_dir = "";
    a->B = 8; a->T = 64; a->steps = 150; a->accum = 1;
    a->lr = -1.0f; a->weight_decay = -1.0f;
    a->warmup = 10; a->final_lr_frac = 0.1f; a->grad_clip = 1.0f; a->clip_rule = -1;
    a->recipe = "8bit"; a->optimizer = "adamw";
    a->map = BNB8_MAP_DYNAMIC; a->blocksize = 256; a->scale_dtype = -1;
    a->stable_embedding = -1;
    a->eval_every = 50; a->val_batches = 10; a->sample_every = 0; a->gen_tokens = 48; a->ckpt_every = 0;
    a->stop_after = 0; a->seed = 1337; a->resume = 0; a->verbose = 1;
    a->export_path = ""; a->export_bf16 = 1;
}

float lr_schedule(const TrainArgs *a, float lr, int64_t s) {
    if (s <= a->warmup) return (float)((double)lr * (double)s / (double)a->warmup);
    double progress = a->steps > a->warmup ? (double)(s - a->warmup) / (double)(a->steps - a->warmup) : 1.0;
    double lo = (double)lr * a->final_lr_frac;
    return (float)(lo + 0.5 * (1.0 + cos(3.141592653589793 * progress)) * ((double)lr - lo));
}

void usage(FILE *f) {
    TrainArgs d;
    train_args_default(&d);
    fprintf(f,
        "usage: train_gpt2_8bit [-flag value]...   trains GPT-2 on the CPU with bnb8's optimizers\n"
        "  -i <file>   training tokens, llm.c format   (default %s)\n"
        "  -j <file>   validation tokens, \"\" for none  (default %s)\n"
        "  -z <file>   tokenizer, \"\" for none          (default %s)\n"
        "  -e <model>  descriptor dL[cC][hH][vV][tT] (d12 = GPT-2 124M, d4c128h4, ...) or an llm.c\n"
        "              model .bin (fp32 v3 or bf16 v5)  (default %s)\n"
        "  -o <dir>    output directory for checkpoints: each the optimizer file (every weight as the run keeps it,\n"
        "              with its master, and the states) + the trainer state; fp32 12, 8bit 6.03, 8bit-int8 5.03,\n"
        "              flash 5.125 bytes per parameter (README); over NCCL an optimizer file per rank, resumed by as\n"
        "              many ranks (default none)\n"
        "  -r <name>   recipe (states + master): fp32 | 8bit | 8bit-int8 | flash (README's table)  (default %s)\n"
        "  -p <name>   optimizer: adamw | lion | sgd  (default %s)\n"
        "  -M <name>   8bit, 8bit-int8: the states' quantization map, dynamic | linear (ablation)  (default dynamic)\n"
        "  -K <int>    8bit, 8bit-int8: block size 64..4096 (a power of two), 0 = one per tensor (default %lld)\n"
        "  -S <name>   flash: the group scales' dtype, e6m10 | bf16 | fp16 | fp32 (default e6m10; resuming: the\n"
        "              checkpoint's, bf16 for one of the layout before P12)\n"
        "  -D <name>   device: auto (the GPU when this build has one and it is there) | cpu | gpu  (default auto)\n"
        "  -P <name>   model: bf16 | fp32 (the parity model: fp32 weights and gradients, no master)  (default bf16)\n"
        "  -R <0|1>    gradient release (GPU): each layer stepped inside backward, no gradient buffer: 2 bytes per\n"
        "              parameter less (plus a scratch for the embeddings' gradients), no extra pass over the gradients,\n"
        "              two small launches per layer for -N est; clips with -N est or prev, not exact; not with -A.\n"
        "              Costs (H100, d12 flash): 3%% of tokens/s at B=16 T=1024, 22%% at B=8 T=128 (per-layer launches)\n"
        "              (default 0; 1 on the GPU for flash, see below)\n"
        "  -C <0|1>    GPU: recompute each layer's activations in backward (less memory, one more forward) (default 0)\n"
        "  -w <0|1>    StableEmbedding: layernorm after the token embedding, Xavier init, 32-bit state for wte\n"
        "              (default: on for a descriptor, as recorded in a .bin model)\n"
        "  -b <int>    batch size B                     (default %lld)\n"
        "  -t <int>    sequence length T                (default %lld)\n"
        "  -n <int>    training steps                   (default %lld)\n"
        "  -A <int>    micro-batches of B x T per step (gradient accumulation; not with -R 1)  (default 1)\n"
        "  -l <float>  peak learning rate (default per optimizer: adamw %g, lion %g, sgd %g; 0 changes no weight)\n"
        "  -u <int>    warm-up steps, then cosine decay (default %lld)\n"
        "  -q <float>  final learning rate, fraction of -l (default %g)\n"
        "  -c <float>  weight decay on matrices (default per optimizer: adamw %g, lion %g, sgd %g)\n"
        "  -g <float>  clip the global gradient norm at this, 0 = off (default %g)\n"
        "  -N <rule>   the norm -g clips with: exact (this step's, formed after backward; not with -R 1) | prev\n"
        "              (the previous step's, summed by the optimizer as it reads gradients: works with -R 1; step 1\n"
        "              is not clipped) | est (this step's, estimated as backward finishes each layer: its sums so\n"
        "              far over their usual share, exact for the embeddings; works with -R 1) (default: est with\n"
        "              -R 1, else exact)\n"
        "  -v <int>    evaluate the validation loss every this many steps and at the end, 0 = never (default %lld)\n"
        "  -m <int>    at most this many validation batches, 0 = all of the file's (default %lld)\n"
        "  -s <int>    print a sample every this many steps, 0 = only at the end (default %lld)\n"
        "  -G <int>    tokens per sample, 0 = none      (default %lld)\n"
        "  -k <int>    checkpoint every this many steps (and at the end) into -o (default %lld = end only)\n"
        "  -y <0|1>    resume from the newest complete checkpoint in -o (a damaged one: the one before); without\n"
        "              it an -o that holds checkpoints is refused. The checkpoint's model, RNG and data position\n"
        "              continue: an -e or -w of another model and an -i of other tokens are refused, -d is not\n"
        "              used (default %d)\n"
        "  -x <int>    stop after this step, checkpointing it into -o (needed); the schedule still spans -n; on\n"
        "              resume, past the checkpoint's step (default off)\n"
        "  -d <int>    random seed (initialization and sampling) (default %llu)\n"
        "  -X <file>   at the end, write the weights as an llm.c model file (-F); with -y 1 and the newest\n"
        "              checkpoint at or past -n (e.g. -n 1), that checkpoint's, without training (default none)\n"
        "  -F <name>   -X's format: bf16 (version 5, llm.c's default build) | fp32 (version 3, PRECISION=FP32)\n"
        "              (default bf16)\n"
        "  -h          this text\n"
        "On the GPU, flags left out take the GPU's defaults: -e d12 -r flash -R 1 -N est (release by default for\n"
        "flash, unless -N exact) -b 16 -t 1024 -n 200 -v 25, and -l the optimizer's default / 5 (adamw 6e-4).\n"
        "A training loss that is not finite, or a skipped update, %d steps in a row stops the run (exit 1).\n"
        "Several GPUs (a build with NCCL): one process per GPU, `mpirun -np N train_gpt2_8bit_cuda ...` or\n"
        "BNB8_RANKS=N BNB8_RANK=r (BNB8_LOCAL_RANK, BNB8_NCCL_ID) for r = 0..N-1; the global batch is N x B x T x A;\n"
        "-N exact, est or prev as on one GPU, -o / -y per rank, -X from rank 0; not yet: -P fp32 (README).\n"
        "threads: OMP_NUM_THREADS (default: all cores)\n",
        d.train_path, d.val_path, d.tokenizer_path, d.model, d.recipe, d.optimizer, (long long)d.blocksize,
        (long long)d.B, (long long)d.T, (long long)d.steps, (double)optimizers[0].lr, (double)optimizers[1].lr,
        (double)optimizers[2].lr, (long long)d.warmup, (double)d.final_lr_frac, (double)optimizers[0].weight_decay,
        (double)optimizers[1].weight_decay, (double)optimizers[2].weight_decay, (double)d.grad_clip,
        (long long)d.eval_every, (long long)d.val_batches, (long long)d.sample_every, (long long)d.gen_tokens,
        (long long)d.ckpt_every, d.resume, (unsigned long long)d.seed, TRAIN_MAX_BAD_STEPS);
}

static int parse_int(const char *flag, const char *s, int64_t lo, int64_t hi, int64_t *out) {
    char *end;
    errno = 0;
    long long v = strtoll(s, &end, 10);
    if (errno || end == s || *end || v < lo || v > hi)
        return train_fail("%s expects an integer in %lld..%lld, got '%s'", flag, (long long)lo, (long long)hi, s);
    *out = v;
    return 0;
}
static int parse_float(const char *flag, const char *s, double lo, double hi, float *out) {
    char *end;
    errno = 0;
    double v = strtod(s, &end);
    if (errno || end == s || *end || !(v >= lo && v <= hi))
        return train_fail("%s expects a number in [%g, %g], got '%s'", flag, lo, hi, s);
    *out = (float)v;
    return 0;
}

int parse_args(int argc, char **argv, TrainArgs *a, char given[128]) {
    train_args_default(a);
    memset(given, 0, 128);
    for (int i = 1; i < argc; i += 2) {
        const char *f = argv[i];
        if (strcmp(f, "-h") == 0 || strcmp(f, "--help") == 0) return 1;
        if (f[0] != '-' || !f[1] || f[2]) return train_fail("unexpected argument '%s' (flags are -x value)", f);
        if (!strchr("ijzeorpMKSDPRCwbtnAluqcgvmsGkyxdNXF", f[1])) return train_fail("unknown flag '%s'", f);
        if (i + 1 >= argc) return train_fail("%s needs a value", f);
        const char *v = argv[i + 1];
        int64_t n = 0;
        int st = 0;
        given[(unsigned char)f[1] & 127] = 1;
        switch (f[1]) {
        case 'i': a->train_path = v; break;
        case 'j': a->val_path = v; break;
        case 'z': a->tokenizer_path = v; break;
        case 'e': a->model = v; a->model_given = 1; break;
        case 'o': a->out_dir = v; break;
        case 'r': a->recipe = v; if (find_recipe(v) < 0) st = train_fail("-r: unknown recipe '%s' (%s)", v, RECIPE_NAMES); break;
        case 'p': a->optimizer = v; if (find_optimizer(v) < 0) st = train_fail("-p: unknown optimizer '%s' (adamw, lion, sgd)", v); break;
        case 'D':
            if (strcmp(v, "auto") == 0) a->device = 0;
            else if (strcmp(v, "cpu") == 0) a->device = 1;
            else if (strcmp(v, "gpu") == 0) a->device = 2;
            else st = train_fail("-D: unknown device '%s' (auto, cpu, gpu)", v);
            break;
        case 'P': a->parity = strcmp(v, "fp32") == 0;
            if (!a->parity && strcmp(v, "bf16") != 0) st = train_fail("-P: unknown model '%s' (bf16, fp32)", v);
            break;
        case 'R': st = parse_int(f, v, 0, 1, &n); a->release = (int)n; break;
        case 'C': st = parse_int(f, v, 0, 1, &n); a->recompute = (int)n; break;
        case 'M':
            if (strcmp(v, "dynamic") == 0) a->map = BNB8_MAP_DYNAMIC;
            else if (strcmp(v, "linear") == 0) a->map = BNB8_MAP_LINEAR;
            else st = train_fail("-M: unknown map '%s' (dynamic, linear)", v);
            break;
        case 'K': st = parse_int(f, v, 0, 4096, &a->blocksize); break;
        case 'S': a->scale_dtype = find_scale_dtype(v);
            if (a->scale_dtype < 0) st = train_fail("-S: unknown scale dtype '%s' (e6m10, bf16, fp16, fp32)", v);
            break;
        case 'w': st = parse_int(f, v, 0, 1, &n); a->stable_embedding = (int)n; break;
        case 'b': st = parse_int(f, v, 1, 1 << 20, &a->B); break;
        case 't': st = parse_int(f, v, 1, 1 << 20, &a->T); break;
        case 'n': st = parse_int(f, v, 1, INT64_C(1) << 40, &a->steps); break;
        case 'A': st = parse_int(f, v, 1, 1 << 20, &a->accum); break;
        case 'l': st = parse_float(f, v, 0, 1e3, &a->lr); break;
        case 'u': st = parse_int(f, v, 0, INT64_C(1) << 40, &a->warmup); break;
        case 'q': st = parse_float(f, v, 0.0, 1.0, &a->final_lr_frac); break;
        case 'c': st = parse_float(f, v, 0.0, 1e3, &a->weight_decay); break;
        case 'g': st = parse_float(f, v, 0.0, 1e9, &a->grad_clip); break;
        case 'N':
            if (strcmp(v, "exact") == 0) a->clip_rule = CLIP_EXACT;
            else if (strcmp(v, "prev") == 0) a->clip_rule = CLIP_PREV;
            else if (strcmp(v, "est") == 0) a->clip_rule = CLIP_EST;
            else st = train_fail("-N: unknown clipping rule '%s' (exact, prev, est)", v);
            break;
        case 'v': st = parse_int(f, v, 0, INT64_C(1) << 40, &a->eval_every); break;
        case 'm': st = parse_int(f, v, 0, INT64_C(1) << 40, &a->val_batches); break;
        case 's': st = parse_int(f, v, 0, INT64_C(1) << 40, &a->sample_every); break;
        case 'G': st = parse_int(f, v, 0, 1 << 20, &a->gen_tokens); break;
        case 'k': st = parse_int(f, v, 0, INT64_C(1) << 40, &a->ckpt_every); break;
        case 'y': st = parse_int(f, v, 0, 1, &n); a->resume = (int)n; break;
        case 'x': st = parse_int(f, v, 0, INT64_C(1) << 40, &a->stop_after); break;
        case 'd': st = parse_int(f, v, 0, INT64_MAX, &n); a->seed = (uint64_t)n; break;
        case 'X': a->export_path = v; break;
        case 'F': a->export_bf16 = strcmp(v, "bf16") == 0;
            if (!a->export_bf16 && strcmp(v, "fp32") != 0) st = train_fail("-F: unknown model file format '%s' (bf16, fp32)", v);
            break;
        default: return train_fail("unknown flag '%s'", f);
        }
        if (st) return -1;
    }
    return 0;
}

// On the GPU, what `make train` shows by default: GPT-2 124M with the flash recipe and gradient
// release (clipped with this step's norm, estimated: est), B=16 x T=1024 (flags given on the command line win).
void apply_gpu_defaults(TrainArgs *a, const char given[128]) {
    if (!given['e']) a->model = "d12";
    if (!given['r']) a->recipe = "flash";
    if (!given['R']) a->release = strcmp(a->recipe, "flash") == 0 && a->clip_rule != CLIP_EXACT;
    if (!given['b']) a->B = 16;
    if (!given['t']) a->T = 1024;
    if (!given['n']) a->steps = 200;
    if (!given['v']) a->eval_every = 25;
    if (!given['l']) a->lr = optimizers[find_optimizer(a->optimizer)].lr / 5.0f;
}

// ------------------------------------------------------------------------------------------------
// Checkpoints (train_gpt2_8bit.h, DESIGN.md §8.4, §8.5)

// FNV-1a, 64 bits, of the trainer state's words before the last: a damaged file is refused.
static int64_t state_checksum(const int64_t *w, int words) {
    uint64_t h = 0xcbf29ce484222325ull;
    const uint8_t *p = (const uint8_t *)w;
    for (size_t i = 0; i < sizeof(int64_t) * (size_t)words; i++) h = (h ^ p[i]) * 0x100000001b3ull;
    return (int64_t)h;
}

int state_writer(FILE *f, const void *state) {
    const TrainerState *s = (const TrainerState *)state;
    const GPT2Config *c = &s->config;
    int64_t w[STATE_WORDS] = {STATE_MAGIC, STATE_VERSION, s->step, s->position, (int64_t)s->rng, s->B, s->T,
                              s->recipe, s->optimizer, c->stable_embedding, (int64_t)s->seed, s->steps, s->release,
                              s->accum, s->weight_bytes, c->max_seq_len, c->vocab_size, c->padded_vocab_size,
                              c->num_layers, c->num_heads, c->channels, s->opt_steps, s->clip_rule};
    memcpy(&w[23], &s->prev_norm, sizeof(double));
    w[24] = s->scale_dtype;
    w[25] = s->train_tokens;
    w[26] = s->train_digest;
    w[27] = s->ranks;
    memcpy(&w[28], s->est_profile, sizeof s->est_profile);
    w[STATE_WORDS - 1] = state_checksum(w, STATE_WORDS - 1);
    return fwrite(w, sizeof w, 1, f) == 1 ? 0 : -1;
}

// Version 2 (STATE_WORDS words, the model's shape, a checksum) or version 1 (16 words, the shape in
// the checkpoint's model file).
int state_load(TrainerState *s, const char *path) {
    FILE *f = open_input(path, "trainer state");
    if (!f) return -1;
    int64_t w[STATE_WORDS] = {0}, size;   // version 1 (16 words): the exact rule, no norm (word 23 NaN)
    double none[3] = {NAN, NAN, NAN};
    memcpy(&w[23], none, sizeof(double));
    memcpy(&w[28], none, sizeof none);
    int status = file_size_of(f, path, &size);
    if (!status && size >= 16 && fread(w, 16, 1, f) != 1) status = train_fail("%s: read failed", path);
    int64_t words = w[1] == 1 ? 16 : STATE_WORDS;   // by the version, when the file has one
    if (!status && size != 8 * words)
        status = train_fail("%s: %s trainer state file: %lld bytes, expected %lld", path,
                            size < 8 * words ? "truncated" : "oversized", (long long)size, (long long)(8 * words));
    if (!status && fread(w + 2, 8 * (size_t)(words - 2), 1, f) != 1) status = train_fail("%s: read failed", path);
    fclose(f);
    if (!status && w[0] != STATE_MAGIC) status = train_fail("%s: not a trainer state file (magic %lld)", path, (long long)w[0]);
    if (!status && w[1] != 1 && w[1] != STATE_VERSION)
        status = train_fail("%s: trainer state version %lld, expected 1 or %d", path, (long long)w[1], STATE_VERSION);
    if (!status && w[1] == STATE_VERSION && w[STATE_WORDS - 1] != state_checksum(w, STATE_WORDS - 1))
        status = train_fail("%s: trainer state checksum mismatch (a damaged file)", path);
    if (status) return status;
    s->version = w[1];
    s->step = w[2]; s->position = w[3]; s->rng = (uint64_t)w[4]; s->B = w[5]; s->T = w[6]; s->recipe = w[7];
    s->optimizer = w[8]; s->stable_embedding = w[9]; s->seed = (uint64_t)w[10]; s->steps = w[11]; s->release = w[12];
    s->accum = w[13] == 0 ? 1 : w[13]; s->weight_bytes = w[14]; s->opt_steps = w[21]; s->clip_rule = w[22];
    memcpy(&s->prev_norm, &w[23], sizeof(double));
    s->train_tokens = w[25]; s->train_digest = w[26]; s->ranks = w[27];
    int flash = s->recipe >= 0 && s->recipe < num_recipes && recipes[s->recipe].states == BNB8_STATE_FLASH;
    s->scale_dtype = s->version == 1 ? flash : w[24];   // version 1 (before e6m10): bf16 scales
    memcpy(s->est_profile, &w[28], sizeof s->est_profile);
    // each field against its range, the message naming the first that is out of it
    const struct { const char *name; int64_t v, lo, hi; } f_[] = {
        {"step", s->step, 1, INT64_MAX}, {"data position", s->position, 0, INT64_MAX}, {"B", s->B, 1, 1 << 20},
        {"T", s->T, 1, 1 << 20}, {"recipe", s->recipe, 0, num_recipes - 1}, {"optimizer", s->optimizer, 0, num_optimizers - 1},
        {"release", s->release, 0, 1}, {"micro-batches", s->accum, 1, 1 << 20}, {"StableEmbedding", s->stable_embedding, 0, 1},
        {"optimizer steps", s->opt_steps, 0, s->step}, {"clipping rule", s->clip_rule, CLIP_EXACT, CLIP_EST},
        {"training token count", s->train_tokens, 0, INT64_MAX}, {"ranks", s->ranks, 0, 1 << 20},
        {"scale dtype", s->scale_dtype, 0, flash ? num_scale_dtypes - 1 : 0},
        {"weight bytes", s->weight_bytes, s->version == 2 ? 2 : 0, 4}};
    size_t last = sizeof f_ / sizeof f_[0] - 1;
    for (size_t i = 0; i <= last; i++)
        if (f_[i].v < f_[i].lo || f_[i].v > f_[i].hi || (i == last && f_[i].v != 0 && f_[i].v != 2 && f_[i].v != 4))
            return train_fail("%s: inconsistent trainer state: %s is %lld, expected %s%lld..%lld", path, f_[i].name,
                              (long long)f_[i].v, i == last ? "0, 2 or 4 in " : "", (long long)f_[i].lo, (long long)f_[i].hi);
    if (!(isnan(s->prev_norm) || s->prev_norm >= 0.0))
        return train_fail("%s: inconsistent trainer state: the previous step's norm is %g", path, s->prev_norm);
    const double *p = s->est_profile;   // est: none yet, or three shares that add up to at most 1
    int none_yet = isnan(p[0]) && isnan(p[1]) && isnan(p[2]);
    if (s->clip_rule == CLIP_EST && !none_yet && !(p[0] >= 0.0 && p[1] >= 0.0 && p[2] >= 0.0 && p[0] + p[1] + p[2] <= 1.0 + 1e-9))
        return train_fail("%s: inconsistent trainer state: the est rule's shares are %g, %g, %g", path, p[0], p[1], p[2]);
    int64_t shape[6] = {w[15], w[16], w[17], w[18], w[19], w[20]};
    int shape_ok = 1;
    for (int k = 0; k < 6; k++) shape_ok &= shape[k] >= 0 && shape[k] <= INT32_MAX;
    GPT2Config c = {(int)shape[0], (int)shape[1], (int)shape[2], (int)shape[3], (int)shape[4], (int)shape[5], (int)w[9]};
    s->config = c;
    if (s->version == 2 && !shape_ok) return train_fail("%s: inconsistent trainer state (model shape out of range)", path);
    if (s->version == 2 && gpt2_config_check(&s->config, path)) return -1;
    return 0;
}

static int empty_writer(FILE *f, const void *ctx) { (void)f; (void)ctx; return 0; }

void checkpoint_path(char *buf, size_t size, const char *dir, const char *kind, int64_t step, const char *ext) {
    snprintf(buf, size, "%s/%s_%08lld%s", dir, kind, (long long)step, ext);
}

void checkpoint_optim_path(char *buf, size_t size, const char *dir, int64_t step, int rank, int ranks) {
    char ext[64] = ".bin";
    if (ranks > 0) snprintf(ext, sizeof ext, ".rank%dof%d.bin", rank, ranks);
    checkpoint_path(buf, size, dir, "optim", step, ext);
}

int checkpoint_missing_rank(const char *dir, int64_t step, int ranks) {
    char path[TRAIN_PATH_MAX];
    for (int r = 0; r < ranks; r++) {
        checkpoint_optim_path(path, sizeof path, dir, step, r, ranks);
        if (access(path, F_OK) != 0) return r;
    }
    return -1;
}

static int64_t path_size(const char *path) { struct stat st; return stat(path, &st) == 0 ? (int64_t)st.st_size : 0; }

// The optimizer file holds every weight as the run keeps it (with its master) and the states; the
// trainer state the rest, with the model's shape: each piece once (DESIGN.md §8.4).
int checkpoint_save(const char *dir, const float *masters, bnb8_optimizer *opt, const TrainerState *s, int64_t *bytes) {
    char path[TRAIN_PATH_MAX], where[160];
    // Weights that are no longer finite are never saved: the newest checkpoint stays a good one.
    if (gpt2_params_nonfinite(&s->config, masters, where, sizeof where))
        return train_fail("step %lld: the weights are not finite (%s): checkpoint not written; the newest complete "
                          "checkpoint in %s is the last good one", (long long)s->step, where, dir);
    static const char *kinds[2] = {"optim", "state"};
    int status = 0;
    int64_t total = 0;
    checkpoint_path(path, sizeof path, dir, "optim", s->step, ".bin");
    if (bnb8_optimizer_save(opt, path)) status = train_fail("%s", bnb8_last_error());
    total += path_size(path);
    checkpoint_path(path, sizeof path, dir, "state", s->step, ".bin");
    if (!status) status = write_atomically(path, state_writer, s);
    total += path_size(path);
    checkpoint_path(path, sizeof path, dir, "DONE", s->step, "");
    if (!status) status = write_atomically(path, empty_writer, NULL);
    if (status)    // no DONE: the files of this step are useless; a full disk gets their space back
        for (int k = 0; k < 2; k++) { checkpoint_path(path, sizeof path, dir, kinds[k], s->step, ".bin"); remove(path); }
    if (bytes) *bytes = status ? 0 : total;
    return status;
}

// The step a DONE marker's name gives: exactly what checkpoint_path writes ("DONE_" and the step in
// at least 8 digits, no more leading zeros), else 0.
int64_t checkpoint_done_step(const char *name) {
    size_t len = strlen(name);
    if (strncmp(name, "DONE_", 5) != 0 || len < 13 || len > 5 + 13) return 0;   // steps up to 2^40: 13 digits
    int64_t v = 0;
    for (size_t i = 5; i < len; i++) {
        if (name[i] < '0' || name[i] > '9') return 0;
        v = 10 * v + (name[i] - '0');
    }
    char canonical[32];
    snprintf(canonical, sizeof canonical, "DONE_%08lld", (long long)v);
    return strcmp(canonical, name) == 0 ? v : 0;
}

int64_t checkpoint_before(const char *dir, int64_t limit) {
    DIR *d = opendir(dir);
    if (!d) return 0;
    int64_t best = 0;
    struct dirent *e;
    while ((e = readdir(d))) {
        int64_t v = checkpoint_done_step(e->d_name);
        if (v > best && v < limit) best = v;
    }
    closedir(d);
    return best;
}
int64_t checkpoint_latest(const char *dir) { return checkpoint_before(dir, INT64_MAX); }

// The -o directory, before anything trains (DESIGN.md §8.4): made if missing, its path short enough
// for every checkpoint file, writable (a probe file made and removed), and this run's alone: an
// exclusive lock on its LOCK file, held until the run ends (trainer_free). Over NCCL rank 0 holds the
// lock for every rank (the others may make the directory at the same moment).
static int open_dir(Trainer *t, const char *dir) {
    struct stat st;
    size_t len = strlen(dir);
    if (len > TRAIN_PATH_MAX - 64)
        return train_fail("the output directory's path is %zu bytes, at most %d are supported: use a shorter -o", len,
                          TRAIN_PATH_MAX - 64);
    if (stat(dir, &st) == 0 && !S_ISDIR(st.st_mode)) return train_fail("output path %s is not a directory", dir);
    if (stat(dir, &st) != 0 && mkdir(dir, 0755) != 0 && errno != EEXIST) return train_fail("cannot create output directory %s: %s", dir, strerror(errno));
    char path[TRAIN_PATH_MAX];
    snprintf(path, sizeof path, "%s/.probe_%ld", dir, (long)getpid());
    int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC, 0644);
    if (fd < 0 || close(fd) != 0 || remove(path) != 0)
        return train_fail("cannot write into the output directory %s (%s): found before training, so that the run "
                          "does not end without its checkpoints", dir, strerror(errno));
    int rank = 0;
    if (nccl_ranks(t, &rank) && rank > 0) return 0;
    snprintf(path, sizeof path, "%s/LOCK", dir);
    t->lock_fd = open(path, O_RDWR | O_CREAT, 0644);
    if (t->lock_fd < 0) return train_fail("cannot create %s: %s", path, strerror(errno));
    if (flock(t->lock_fd, LOCK_EX | LOCK_NB) != 0)
        return train_fail("%s is in use by another run (it holds %s): give each run its own -o", dir, path);
    return 0;
}

// Removes the temporaries a run killed while writing left in dir (regular files whose names hold
// ".tmp": name.tmp.<pid>.<n>, bnb8_write_atomically, or the older name.tmp; a kill or SIGXFSZ
// between create and rename), saying so. Called at start, once the run holds dir's lock.
static void remove_stale_temporaries(const char *dir, int verbose) {
    DIR *d = opendir(dir);
    if (!d) return;
    struct dirent *e;
    struct stat st;
    char path[TRAIN_PATH_MAX];
    while ((e = readdir(d)))
        if (strstr(e->d_name, ".tmp") && snprintf(path, sizeof path, "%s/%s", dir, e->d_name) < (int)sizeof path &&
            lstat(path, &st) == 0 && S_ISREG(st.st_mode) && unlink(path) == 0 && verbose)
            printf("note: removed %s, a temporary file an interrupted run left\n", path);
    closedir(d);
}

static void print_bytes(double b) {
    if (b >= 1e9) printf("%9.2f GB", b / 1e9);
    else if (b >= 1e6) printf("%9.2f MB", b / 1e6);
    else if (b >= 1e3) printf("%9.2f kB", b / 1e3);
    else printf("%9.0f B ", b);
}

// ------------------------------------------------------------------------------------------------
// The devices: what differs between the CPU and the GPU, as one table of operations (Device in
// train_gpt2_8bit.h) with a row for each. The rest of the trainer calls t->dev and nothing else.

// The CPU row. gpt2_cpu.c's model computes in fp32; the gradients are the trainer's. For bf16
// weights (8bit-int8, flash) the optimizer's weights and gradients are bf16 copies: the model's fp32
// weights are those widened (exact), and the backward's fp32 gradients are rounded to bf16 for the step.

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
            double v = bnb8_load(g, dtype, i);
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
    return export_masters(t, t->grads);
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

// The GPU row: gpt2_cuda.cu's model (the same tensors in the same layout), bnb8's optimizer on the
// device, and gradient release. Linked in the TRAIN_CUDA build; in the CPU-only build the gpt2_cuda
// functions are weak and NULL, so gpu_open says the GPU is not available and the run stays on the CPU.

#ifndef TRAIN_CUDA
#pragma weak gpt2_cuda_last_error
#pragma weak gpt2_cuda_device
#pragma weak gpt2_cuda_create
#pragma weak gpt2_cuda_free
#pragma weak gpt2_cuda_stream
#pragma weak gpt2_cuda_param_tensor
#pragma weak gpt2_cuda_set_params
#pragma weak gpt2_cuda_get_params
#pragma weak gpt2_cuda_forward
#pragma weak gpt2_cuda_loss
#pragma weak gpt2_cuda_get_logits
#pragma weak gpt2_cuda_backward
#pragma weak gpt2_cuda_grad_norm
#pragma weak gpt2_cuda_clip_group
#pragma weak gpt2_cuda_clip_scale
#pragma weak gpt2_cuda_clip_sums
#pragma weak gpt2_cuda_grads_alloc
#pragma weak gpt2_cuda_grads_free
#pragma weak gpt2_cuda_param_bytes
#pragma weak gpt2_cuda_act_bytes
#pragma weak gpt2_cuda_num_act_tensors
#pragma weak gpt2_cuda_act_name
#pragma weak gpt2_cuda_act_tensor_bytes
#define gpu_linked() (gpt2_cuda_device != NULL)
#else
#define gpu_linked() 1
#endif

int gpu_available(void) {
    return gpu_linked() && gpt2_cuda_device(NULL, 0, NULL, NULL) == 0;
}

// The model on the GPU from the host model's fp32 weights: the bf16 model (bf16 weights and
// gradients: flash holds 2 + 1 + 2 + 2.125 bytes per parameter, fp32 2 + 4 + 2 + 8), or the fp32
// parity model (-P fp32: fp32 weights and gradients, no master).
static int gpu_open(Trainer *t) {
    Gpu *g = &t->gpu;
    GPT2 *m = &t->model;
    size_t free_bytes = 0;
    if (!gpu_linked()) return train_fail("this trainer was built without the GPU model (make on a machine with nvcc)");
    if (gpt2_cuda_device(g->name, sizeof g->name, &free_bytes, &g->total_bytes))
        return train_fail("GPU: %s", gpt2_cuda_last_error());
    g->used_before = g->used_peak = g->total_bytes - free_bytes;
    int bf16 = t->lay.weights == BNB8_BF16;
    snprintf(t->where, sizeof t->where, "GPU %s (%s model)", g->name, bf16 ? "bf16" : "fp32 parity");
    const GPT2Config *c = &m->config;
    GPT2CudaConfig gc = {c->max_seq_len, c->vocab_size, c->padded_vocab_size, c->num_layers, c->num_heads,
                         c->channels, c->stable_embedding, t->a.recompute};
    int precision = bf16 ? GPT2_CUDA_BF16 : GPT2_CUDA_FP32;
    g->logits = (float *)malloc(sizeof(float) * (size_t)c->padded_vocab_size);
    if (!g->logits) return train_fail("out of memory");
    if (gpt2_cuda_create(&g->model, &gc, precision, (int)t->a.B, (int)t->a.T) ||
        gpt2_cuda_set_params(g->model, m->params_memory) ||
        gpt2_cuda_grads_alloc(g->model, &g->grads, precision, t->a.release, &g->grads_bytes))
        return train_fail("GPU model: %s", gpt2_cuda_last_error());
    m->batch_size = t->a.B;
    m->seq_len = t->a.T;
    for (int i = 0; i < GPT2_NUM_PARAMS; i++)
        if (m->param_sizes[i]) { t->param[i] = gpt2_cuda_param_tensor(g->model, i); t->grad[i] = g->grads.tensor[i]; }
    t->scale_at = gpt2_cuda_clip_scale(g->model);
    if (t->nccl && nccl_open(t)) return -1;
    return optimizer_open(t);
}

// Device memory in use now, kept as the peak when it is the most so far.
static void gpu_note_memory(Gpu *g) {
    size_t free_bytes = 0, total = 0;
    if (gpt2_cuda_device(NULL, 0, &free_bytes, &total) == 0 && total - free_bytes > g->used_peak) g->used_peak = total - free_bytes;
}

// The est rule's group g on the GPU, in stream order: its sum of squares and the scale the
// optimizer reads, on the device (no wait).
static int gpu_clip_group(Trainer *t, int g, void *const *grads, const int64_t *n, int count) {
    int dtype = t->lay.grads == BNB8_BF16 ? GPT2_CUDA_BF16 : GPT2_CUDA_FP32;
    if (gpt2_cuda_clip_group(t->gpu.model, grads, n, count, dtype, g, t->shares[g], t->a.grad_clip, t->a.accum))
        return train_fail("GPU clipping: %s", gpt2_cuda_last_error());
    return 0;
}

// Gradient release: backward calls this as each group's gradients become final (the final
// LayerNorm, then layer L-1 .. 0, then the embeddings); their tensors are stepped right there, on
// the model's stream, before backward overwrites the shared slices with the next layer's.
// A step that fails there keeps its own message (failed = 1).
typedef struct { Trainer *t; float lr, scale; int failed; } ReleaseStep;
static int gpu_grads_ready(void *ctx, int which, struct CUstream_st *stream) {
    ReleaseStep *r = (ReleaseStep *)ctx;
    int g = group_of(r->t, which);
    r->failed = r->t->nccl ? nccl_release_group(r->t, g, r->lr, r->scale, stream) != 0 : step_group(r->t, g, r->lr, r->scale, stream) != 0;
    return r->failed;
}

// Waits for the loss; with release each layer is stepped inside backward (at lr, clipped with the
// previous step's norm or this step's estimated: check_settings allows only these rules with release).
static int gpu_micro_step(Trainer *t, const int *inputs, const int *targets, int accumulate, float lr, float *loss) {
    Gpu *g = &t->gpu;
    ReleaseStep r = {t, lr, step_scale(t->prev_norm, t->a.grad_clip, t->a.accum), 0};
    if (gpt2_cuda_forward(g->model, inputs, targets, (int)t->a.B, (int)t->a.T, 1) ||
        gpt2_cuda_backward(g->model, &g->grads, accumulate, t->a.release ? gpu_grads_ready : NULL, &r))
        return r.failed ? -1 : train_fail("GPU step: %s", gpt2_cuda_last_error());
    if (gpt2_cuda_loss(g->model, loss, NULL)) return train_fail("GPU loss: %s", gpt2_cuda_last_error());
    return 0;
}

// exact: the norm after backward, then one launch (skipped when the norm is not finite). prev: one
// launch clipped with the previous norm, or under release the layers were stepped in backward; the
// optimizer summed this step's norm as it read the gradients. est: group by group in backward's
// order, as under release (where backward stepped them). Then the device memory in use.
static int gpu_step(Trainer *t, float lr, double *norm, int *skipped) {
    Gpu *g = &t->gpu;
    *norm = NAN;
    *skipped = 0;
    if (t->nccl) {   // several GPUs: the exchanges and the steps (est: group by group), the norm but est's
        if (nccl_step(t, lr, norm, skipped)) return -1;
    } else {
        if (t->rule == CLIP_EXACT) {
            if (gpt2_cuda_grad_norm(g->model, &g->grads, norm)) return train_fail("GPU gradient norm: %s", gpt2_cuda_last_error());
            *norm /= (double)t->a.accum;
            *skipped = !isfinite(*norm);
        }
        for (int k = 0; t->rule == CLIP_EST && !t->a.release && k < t->model.config.num_layers + 2; k++)
            if (step_group(t, k, lr, 1.0f, gpt2_cuda_stream(g->model))) return -1;
        if (!t->a.release && !*skipped && t->rule != CLIP_EST &&
            bnb8_optimizer_step(t->opt, lr, step_scale(clip_norm(t, *norm), t->a.grad_clip, t->a.accum), gpt2_cuda_stream(g->model)))
            return train_fail("optimizer step: %s", bnb8_last_error());
        if (t->rule == CLIP_PREV && prev_rule_norm(t, norm)) return -1;
    }
    if (t->rule == CLIP_EST) {
        if (gpt2_cuda_clip_sums(g->model, t->group_sums)) return train_fail("GPU clipping: %s", gpt2_cuda_last_error());
        est_finish(t, norm);
    }
    gpu_note_memory(g);
    return 0;
}

static int gpu_eval(Trainer *t, const int *inputs, const int *targets, float *loss) {
    Gpu *g = &t->gpu;
    if (gpt2_cuda_forward(g->model, inputs, targets, (int)t->a.B, (int)t->a.T, 0) || gpt2_cuda_loss(g->model, loss, NULL))
        return train_fail("GPU forward: %s", gpt2_cuda_last_error());
    return 0;
}

static int gpu_logits(Trainer *t, const int *tokens, int64_t n, float **logits) {
    Gpu *g = &t->gpu;
    if (gpt2_cuda_forward(g->model, tokens, NULL, 1, (int)n, 0) || gpt2_cuda_get_logits(g->model, g->logits, n - 1, 1))
        return train_fail("GPU forward: %s", gpt2_cuda_last_error());
    *logits = g->logits;
    return 0;
}

// Over NCCL each rank drops its host fp32 copy of the weights once the GPU model and the optimizer hold
// them (trainer_open_before): 8 ranks of a 30e9 model would hold 8 x 120 GB. What needs one again (the
// final weights of a single rank) gets a fresh one here.
static void host_weights_drop(GPT2 *m) {
    free(m->params_memory);
    m->params_memory = NULL;
    memset(&m->params, 0, sizeof m->params);
}
static int host_weights_back(GPT2 *m) {
    if (m->params_memory) return 0;
    if (!(m->params_memory = (float *)calloc((size_t)m->num_parameters, sizeof(float))))
        return train_fail("out of memory for the host copy of %lld weights", (long long)m->num_parameters);
    gpt2_point_params(&m->params, m->params_memory, m->param_sizes);
    return 0;
}

// Into the host copy of the weights: bf16 ones' masters (decoded, or the fp32 master), fp32 ones copied.
// Over NCCL every rank's shards are gathered on rank 0; the other ranks send theirs and get NULL.
static int gpu_masters(Trainer *t, float **out) {
    int rank = 0;
    *out = NULL;
    if (t->nccl) {
        nccl_ranks(t, &rank);
        float *host = rank == 0 && host_weights_back(&t->model) == 0 ? t->model.params_memory : NULL;
        if (nccl_gather_masters(t, host)) return -1;
        *out = host;
        return 0;
    }
    if (host_weights_back(&t->model)) return -1;
    *out = t->model.params_memory;
    if (t->lay.weights != BNB8_F32) return export_masters(t, t->model.params_memory);
    if (gpt2_cuda_get_params(t->gpu.model, t->model.params_memory)) return train_fail("GPU weights: %s", gpt2_cuda_last_error());
    return 0;
}

static double gpu_print_activations(Trainer *t) {
    for (int i = 0; i < gpt2_cuda_num_act_tensors(); i++) {
        double b = (double)gpt2_cuda_act_tensor_bytes(t->gpu.model, i);
        if (b == 0.0) continue;
        printf("    %-18s ", gpt2_cuda_act_name(i)); print_bytes(b); printf("\n");
    }
    printf("    %-18s ", "total");
    return (double)gpt2_cuda_act_bytes(t->gpu.model);
}

// Computed: weights, master, gradients (or the release scratch), optimizer states, activations
// (with every scratch buffer and cuBLASLt's workspace); measured: cudaMemGetInfo's most in use
// after a step, less what was in use before the run.
static int gpu_device_memory(Trainer *t, double *computed, double *measured) {
    const Gpu *g = &t->gpu;
    bnb8_memory mem = bnb8_optimizer_memory(t->opt, 0);
    *computed = mem.weights + mem.correction + (double)g->grads_bytes + mem.states + (double)gpt2_cuda_act_bytes(g->model);
    if (t->nccl) *computed += nccl_extra_bytes(t);
    *measured = (double)(g->used_peak - g->used_before);
    return 1;
}

static void gpu_close(Trainer *t) {
    Gpu *g = &t->gpu;
    if (g->model) { gpt2_cuda_grads_free(&g->grads); gpt2_cuda_free(g->model); }
    free(g->logits);
    memset(g, 0, sizeof *g);
}

enum { DEVICE_CPU, DEVICE_GPU };
static const Device devices[2] = {
    {"cpu", cpu_open, cpu_micro_step, cpu_step, cpu_eval, cpu_logits, cpu_masters, cpu_print_activations,
     cpu_device_memory, cpu_close, cpu_clip_group},
    {"gpu", gpu_open, gpu_micro_step, gpu_step, gpu_eval, gpu_logits, gpu_masters, gpu_print_activations,
     gpu_device_memory, gpu_close, gpu_clip_group},
};
// ------------------------------------------------------------------------------------------------
// The run, phase by phase. 1. settings

static int check_settings(Trainer *t) {
    const TrainArgs *a = &t->a;
    int ri = find_recipe(a->recipe), oi = find_optimizer(a->optimizer);
    if (ri < 0) return train_fail("unknown recipe '%s' (%s)", a->recipe, RECIPE_NAMES);
    if (oi < 0) return train_fail("unknown optimizer '%s' (adamw, lion, sgd)", a->optimizer);
    if (a->B < 1 || a->T < 1 || a->steps < 1 || a->accum < 1 || a->warmup < 0 || a->stop_after < 0 || a->eval_every < 0 ||
        a->sample_every < 0 || a->ckpt_every < 0 || a->gen_tokens < 0 || !(a->grad_clip >= 0.0f) ||
        !(a->final_lr_frac >= 0.0f && a->final_lr_frac <= 1.0f) || a->device < 0 || a->device > 2 ||
        a->release < 0 || a->release > 1 || a->recompute < 0 || a->recompute > 1 || a->parity < 0 || a->parity > 1 ||
        a->map < 0 || a->map >= BNB8_NUM_MAPS || a->blocksize < 0)
        return train_fail("bad settings: B, T and steps must be >= 1, the others >= 0, final lr fraction in [0, 1]");
    if ((a->resume || a->ckpt_every) && !a->out_dir[0]) return train_fail("checkpoints and resume need an output directory (-o)");
    if (a->stop_after && !a->out_dir[0])   // it would stop early and save nothing
        return train_fail("-x %lld stops after that step to checkpoint it: it needs an output directory (-o) (to train "
                          "fewer steps without checkpoints, lower -n)", (long long)a->stop_after);
    t->recipe = &recipes[ri];
    t->oc = &optimizers[oi];
    t->lr = a->lr >= 0.0f ? a->lr : t->oc->lr;   // -1: the optimizer's; 0 trains nothing (checks)
    t->wd = a->weight_decay >= 0.0f ? a->weight_decay : t->oc->weight_decay;
    if ((double)t->lr * t->wd >= 1.0)   // the library refuses it too (bnb8_optimizer_create); here with the flags
        return train_fail("-l %g x -c %g = %g: the learning rate times the weight decay must be below 1 (the decay "
                          "factor 1 - lr x decay would zero or flip the weights)", (double)t->lr, (double)t->wd,
                          (double)t->lr * t->wd);
    t->dev = &devices[a->device == 2 || (a->device == 0 && gpu_available()) ? DEVICE_GPU : DEVICE_CPU];
    int on_gpu = t->dev == &devices[DEVICE_GPU];
    t->lay = run_layout(t->recipe, on_gpu, a->parity);
    if ((a->map != BNB8_MAP_DYNAMIC || a->blocksize != 256) && t->recipe->states != BNB8_STATE_8BIT)
        return train_fail("-M and -K set the 8-bit block-wise states' map and block size: they need -r 8bit or 8bit-int8");
    if (a->scale_dtype < -1 || a->scale_dtype >= num_scale_dtypes) return train_fail("unknown scale dtype %d", a->scale_dtype);
    if (a->scale_dtype >= 0 && t->recipe->states != BNB8_STATE_FLASH)
        return train_fail("-S sets the flash states' group scale dtype: it needs -r flash");
    t->scale = a->scale_dtype >= 0 ? a->scale_dtype : 0;
    if (a->recompute && !on_gpu)
        return train_fail("activation recomputation (-C 1) is for the GPU model (-D gpu); the CPU model keeps every activation");
    t->rule = a->clip_rule >= 0 ? a->clip_rule : a->release ? CLIP_EST : CLIP_EXACT;
    if (a->clip_rule < -1 || a->clip_rule > CLIP_EST) return train_fail("unknown clipping rule %d", a->clip_rule);
    if (a->release) {   // each layer is stepped inside backward: this step's global norm comes after
        const char *why = !on_gpu ? "runs on the GPU only (-D gpu)"
                        : t->rule == CLIP_EXACT   // even at -g 0: its norm pass needs every layer's gradients
                            ? "steps each layer inside backward, before this step's global gradient norm exists, so "
                              "not with -N exact: clip with an estimate of it (-N est, the default with -R 1), the "
                              "previous step's (-N prev) or not at all (-g 0 with either)"
                        : a->accum > 1 ? "steps each layer inside backward, so gradients cannot accumulate over "
                                         "micro-batches: use -A 1" : NULL;
        if (why) return train_fail("gradient release (-R 1) %s", why);
    }
    t->prev_norm = NAN;
    t->profile[0] = t->profile[1] = t->profile[2] = NAN;
    return nccl_setup(t);   // several GPUs, when the environment names ranks
}

// 2. The model: from the newest complete checkpoint when resuming, else from -e.

// A checkpoint is resumed by as many ranks as wrote it (ranks 0: a single process): each optimizer
// file holds one rank's shards (the library refuses another sharding, file by file).
static int ranks_refused(const char *path, const TrainerState *st, int ranks) {
    char was[96], now[64], how[160];
    if (st->ranks) snprintf(was, sizeof was, "%lld ranks over NCCL (one optimizer file per rank)", (long long)st->ranks);
    else snprintf(was, sizeof was, "a single process (one optimizer file)");
    if (ranks) snprintf(now, sizeof now, "%d ranks", ranks);
    else snprintf(now, sizeof now, "a single process");
    if (st->ranks) snprintf(how, sizeof how, "with %lld ranks (mpirun -np %lld, or BNB8_RANKS=%lld and BNB8_RANK=0..%lld)",
                            (long long)st->ranks, (long long)st->ranks, (long long)st->ranks, (long long)st->ranks - 1);
    else snprintf(how, sizeof how, "as a single process (no OMPI_COMM_WORLD_SIZE or BNB8_RANKS)");
    return train_fail("%s: the checkpoint of step %lld was written by %s, this run is %s: resume it %s, or train "
                      "afresh in another -o (a checkpoint is not re-sharded)", path, (long long)st->step, was, now, how);
}

// The weights a rank holds of a model of shape c (ranks 0: every weight), the optimizer file's least
// content, before anything of that shape is allocated; -1 out of memory. Under release over NCCL each
// backward group has its own layout (train_nccl.c): 0, no bound (the library's loader checks the file).
static int64_t rank_weights(const Trainer *t, const GPT2Config *c, int rank, int ranks) {
    int64_t sizes[GPT2_NUM_PARAMS], total = 0, count = 0, held = 0, off, part;
    gpt2_param_sizes(c, sizes);
    for (int i = 0; i < GPT2_NUM_PARAMS; i++) { total += sizes[i]; count += sizes[i] ? slices_of(t, c->num_layers, i) : 0; }
    if (ranks == 0) return total;
    if (t->a.release) return 0;
    int64_t *n = (int64_t *)malloc(sizeof(int64_t) * (size_t)(2 * count)), *at = n + count, j = 0;
    if (!n) return train_fail("out of memory");
    for (int i = 0; i < GPT2_NUM_PARAMS; i++)
        for (int64_t l = 0; sizes[i] && l < slices_of(t, c->num_layers, i); l++) n[j++] = sizes[i] / slices_of(t, c->num_layers, i);
    int64_t S = nccl_layout(n, (int)count, ranks, at);
    for (j = 0; j < count; j++) held += nccl_part(at[j], n[j], S, rank, &off, &part) ? part : 0;
    free(n);
    return held;
}

static int resume_state(Trainer *t) {
    const TrainArgs *a = &t->a;
    TrainerState *st = &t->resumed;
    char path[TRAIN_PATH_MAX];
    checkpoint_path(path, sizeof path, a->out_dir, "state", t->start, ".bin");
    t->damaged = 1;   // a failure of the checkpoint's files (not of this run's settings): trainer_open falls back
    if (state_load(st, path)) return -1;
    if (st->step != t->start)
        return train_fail("%s: the trainer state of step %lld: files of different checkpoints", path, (long long)st->step);
    t->damaged = 0;
    int rank = 0, ranks = nccl_ranks(t, &rank);
    if (st->ranks != ranks) return ranks_refused(path, st, ranks);
    int missing = checkpoint_missing_rank(a->out_dir, t->start, ranks);
    if (missing >= 0) {
        checkpoint_optim_path(t->model_path, sizeof t->model_path, a->out_dir, t->start, missing, ranks);
        t->damaged = 1;
        return train_fail("%s: rank %d's optimizer file of this checkpoint is missing: an incomplete checkpoint", t->model_path, missing);
    }
    int ri = (int)(t->recipe - recipes), oi = (int)(t->oc - optimizers);
    if (st->clip_rule != t->rule)
        return train_fail("%s: the checkpoint was made with clipping rule %s, this run asks for %s (-N)", path,
                          clip_rule_names[st->clip_rule], clip_rule_names[t->rule]);
    t->prev_norm = st->prev_norm;
    // the checkpoint's group scales; version 1 records none (bf16 before e6m10): -S may name them
    if (a->scale_dtype >= 0 && a->scale_dtype != st->scale_dtype && st->version >= 2)
        return train_fail("%s: the checkpoint's flash group scales are %s, this run asks for %s (-S): leave -S out to "
                          "resume with the checkpoint's", path, scale_dtypes[st->scale_dtype].name, scale_dtypes[a->scale_dtype].name);
    t->scale = a->scale_dtype >= 0 ? a->scale_dtype : (int)st->scale_dtype;
    memcpy(t->profile, st->est_profile, sizeof t->profile);
    if (st->B != a->B || st->T != a->T || st->recipe != ri || st->optimizer != oi ||
        st->release != a->release || st->accum != a->accum)
        return train_fail("%s: the checkpoint was made with step %lld, B=%lld, T=%lld, A=%lld, recipe %s, optimizer %s, "
                          "release %lld; this run asks for B=%lld, T=%lld, A=%lld, recipe %s, optimizer %s, release %d", path,
                          (long long)st->step, (long long)st->B, (long long)st->T, (long long)st->accum,
                          recipes[st->recipe].name, optimizers[st->optimizer].name, (long long)st->release, (long long)a->B,
                          (long long)a->T, (long long)a->accum, t->recipe->name, t->oc->name, a->release);
    // the optimizer file holds the weights as the run kept them (before P10: fp32 for fp32 and 8bit)
    int64_t wb = st->weight_bytes ? st->weight_bytes : recipes[st->recipe].correction_bytes == 4 ? 4 : 2;
    if (wb != (int64_t)bnb8_dtype_size(t->lay.weights))
        return train_fail("%s: the checkpoint keeps %s weights, this run %s ones: resume it on the model it was made "
                          "with (-D, -P)", path, wb == 4 ? "fp32" : "bf16", dtype_name(t->lay.weights));
    t->damaged = 1;
    if (st->version == 1) {   // the older layout: the fp32 masters in an llm.c model file beside it
        checkpoint_path(t->model_path, sizeof t->model_path, a->out_dir, "model", t->start, ".bin");
        if (access(t->model_path, F_OK) != 0)
            return train_fail("%s: a checkpoint of the older layout (trainer state version 1), whose model file %s is "
                              "missing: restore that file, or resume from a newer checkpoint", path, t->model_path);
        if (gpt2_load(&t->model, t->model_path)) return -1;
        t->damaged = 0;
        return 0;
    }
    // Every weight comes from the optimizer file: until then they are NaN, so that one it did not
    // restore cannot pass for a weight (checked after the load, optimizer_open).
    checkpoint_optim_path(t->model_path, sizeof t->model_path, a->out_dir, t->start, rank, ranks);
    int64_t held = rank_weights(t, &st->config, rank, ranks), least = held * wb, size = path_size(t->model_path);
    if (held < 0) return -1;
    if (size < least)   // checked before allocating: a bad shape cannot ask for terabytes
        return train_fail("%s: %lld bytes, too few for the %lld weights the trainer state %s describes%s: a damaged or "
                          "mismatched checkpoint", t->model_path, (long long)size, (long long)held, path,
                          ranks ? " (this rank's shards)" : "");
    t->damaged = 0;
    if (gpt2_create(&t->model, &st->config)) return -1;
    for (int64_t i = 0; i < t->model.num_parameters; i++) t->model.params_memory[i] = NAN;
    return 0;
}

// "L=12 C=768 NH=12 V=50257 (padded 50304) maxT=1024", for messages.
static const char *shape_text(char *buf, size_t size, const GPT2Config *c) {
    snprintf(buf, size, "L=%d C=%d NH=%d V=%d (padded %d) maxT=%d", c->num_layers, c->channels, c->num_heads,
             c->vocab_size, c->padded_vocab_size, c->max_seq_len);
    return buf;
}

// A resumed run continues its checkpoint's model, RNG and data position (DESIGN.md §8.4): an -e that
// describes another model is refused (-w: open_model, as for a .bin model); a seed (-d) other than
// the checkpoint's is noted; the training tokens (-i) are checked once loaded (open_data).
static int check_resumed_model(Trainer *t) {
    const TrainArgs *a = &t->a;
    const GPT2Config *m = &t->model.config;
    char have[128], want[128];
    if (a->model_given) {
        GPT2Config c;
        size_t len = strlen(a->model);
        int bin = len > 4 && strcmp(a->model + len - 4, ".bin") == 0;
        if (bin ? gpt2_load_config(&c, a->model) : gpt2_config_from_descriptor(&c, a->model)) return -1;
        if (c.max_seq_len != m->max_seq_len || c.vocab_size != m->vocab_size || c.padded_vocab_size != m->padded_vocab_size ||
            c.num_layers != m->num_layers || c.num_heads != m->num_heads || c.channels != m->channels ||
            (bin && c.stable_embedding != m->stable_embedding))
            return train_fail("-e %s is %s%s; the checkpoint of step %lld in %s holds %s%s: a resumed run continues the "
                              "checkpoint's model (leave -e out, or train the other model in another -o)", a->model,
                              shape_text(want, sizeof want, &c), bin && c.stable_embedding ? " with StableEmbedding" : "",
                              (long long)t->start, a->out_dir, shape_text(have, sizeof have, m),
                              m->stable_embedding ? " with StableEmbedding" : "");
    }
    if (a->seed != t->resumed.seed && a->verbose)
        printf("note: resuming: the random numbers continue from the checkpoint (its run's seed %llu); -d %llu is not "
               "used\n", (unsigned long long)t->resumed.seed, (unsigned long long)a->seed);
    t->a.seed = t->resumed.seed;   // the run's seed, which its next checkpoints record again
    return 0;
}

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
    int rank = 0;
    nccl_ranks(t, &rank);
    if (a->out_dir[0] && open_dir(t, a->out_dir)) return -1;
    if (a->out_dir[0] && rank == 0) remove_stale_temporaries(a->out_dir, a->verbose);   // it holds the lock
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
        if (resume_state(t) || check_resumed_model(t)) return -1;
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
        return train_fail("%s: the checkpoint is at step %lld, not before the last step %lld (raise -n)", a->out_dir,
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
    if (check_settings(t)) return -1;
    // Over NCCL the ranks open in turns, each dropping its host copy of the weights at the end of its
    // turn: one host holds one fp32 copy at a time. A rank that fails waits out the turns (nccl_agree).
    int rank = 0, ranks = nccl_ranks(t, &rank), status = 0;
    for (int r = 0; r < (ranks ? ranks : 1); r++) {
        if (r == rank) status = open_model(t) || open_data(t) || t->dev->open(t);
        if (r == rank && !status && t->nccl) host_weights_drop(&t->model);
        if (t->nccl && nccl_barrier(t)) return -1;
    }
    if (status) return -1;
    if (t->start > 0) {
        t->loader.position = t->resumed.position;
        t->rng.s = t->resumed.rng;
    }
    t->end = last_step(a);
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
        int status = trainer_open_before(t, a, limit);
        if (t->nccl) status = nccl_agree(t, status);
        if (status == 0) return t->nccl && t->start > 0 ? nccl_gather_weights(t) : 0;
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
    if (t->lock_fd > 0) close(t->lock_fd);   // releases the -o directory's lock
    bnb8_optimizer_free(t->opt);
    free(t->sums);
    free(t->group_sums);
    free(t->shares);
    nccl_free(t);
    if (t->dev) t->dev->close(t);
    loader_free(&t->loader);
    tokenizer_free(&t->tok);
    free(t->train_file.tokens);
    free(t->val_file.tokens);
    gpt2_free(&t->model);
    memset(t, 0, sizeof *t);
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

static void print_memory(Trainer *t) {
    const GPT2 *m = &t->model;
    const Recipe *r = t->recipe;
    const Layout *l = &t->lay;
    int release = t->a.release, working = t->weights16 != NULL;   // working: the CPU's fp32 copies of bf16 weights
    bnb8_memory mem = bnb8_optimizer_memory(t->opt, !release);
    double es = (double)bnb8_dtype_size(l->weights), gs = (double)bnb8_dtype_size(l->grads), cs = l->correction_bytes;
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
    if (t->nccl) nccl_print_memory(t);
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
    printf("\n");
    printf("optim    %s, lr %.3g (warm-up %lld, cosine to %.3g), weight decay %.3g on matrices, clip %.3g (%s)\n",
           t->oc->name, (double)t->lr, (long long)a->warmup, (double)(t->lr * a->final_lr_frac), (double)t->wd,
           (double)a->grad_clip, t->rule == CLIP_PREV ? "prev: the previous step's norm"
                                 : t->rule == CLIP_EST ? "est: this step's norm, estimated layer by layer" : "exact: this step's norm");
    char micro[64] = "";
    if (a->accum > 1) snprintf(micro, sizeof micro, ", %lld micro-batches per step", (long long)a->accum);
    if (t->end > t->start)
        printf("train    B=%lld T=%lld%s, steps %lld..%lld of %lld%s\n", (long long)a->B, (long long)a->T, micro,
               (long long)t->start + 1, (long long)t->end, (long long)a->steps, t->start > 0 ? " (resumed)" : "");
    else printf("train    no steps: the checkpoint of step %lld as it is, for -X\n", (long long)t->start);
    if (!t->nccl && t->gpu.model) nccl_hint();   // several GPUs here, this run on one
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
    if (t->rule == CLIP_EST) est_shares(t->profile, &t->model.config, t->shares);
    for (int64_t micro = 0; micro < t->a.accum; micro++) {
        if (t->nccl) nccl_batch(t);
        else loader_next(&t->loader);
        float micro_loss = NAN;
        if (t->dev->micro_step(t, t->loader.inputs, t->loader.targets, micro > 0, lr, &micro_loss)) return -1;
        *loss += micro_loss / (float)t->a.accum;
    }
    if (t->nccl && nccl_mean_loss(t, loss)) return -1;
    if (t->dev->step(t, lr, norm, skipped)) return -1;
    *unchanged = *skipped ? 0 : bnb8_optimizer_take_nonfinite(t->opt);
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
    if (isfinite(loss) && t->nccl && nccl_mean_loss(t, &after)) return -1;   // every rank decides alike
    *kept = isfinite(after);
    if (!*kept && t->a.verbose)
        printf("step %lld: the weights give a non-finite loss (%g %s the step): no checkpoint written; the newest in %s "
               "is the last good one\n", (long long)s, (double)after, isfinite(loss) ? "after" : "before", t->a.out_dir);
    return 0;
}

// The device row gives the fp32 masters, checked for finite values before anything is written.
static int save_checkpoint(Trainer *t, int64_t s, int64_t *bytes) {
    const TrainArgs *a = &t->a;
    TrainerState save = {s, t->loader.position, a->B, a->T, t->recipe - recipes, t->oc - optimizers,
                         t->model.config.stable_embedding, a->steps, t->rng.s, a->seed, a->release, a->accum,
                         (int64_t)bnb8_dtype_size(t->lay.weights), STATE_VERSION, t->model.config,
                         bnb8_optimizer_steps(t->opt, 0), t->rule, t->prev_norm, t->recipe->states == BNB8_STATE_FLASH ? t->scale : 0,
                         t->train_file.count, t->train_digest,
                         {t->profile[0], t->profile[1], t->profile[2]}, nccl_ranks(t, NULL)};
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
    return 0;
}

// The weights as an llm.c model file (DESIGN.md §8.1): the fp32 masters (version 3), or their RNE to
// bf16 (version 5, what llm.c's default bf16 build reads).
static int export_model(Trainer *t) {
    const TrainArgs *a = &t->a;
    float *masters;
    char where[160];
    if (t->dev->masters(t, &masters)) return -1;
    if (!masters) return 0;   // over NCCL, a rank other than 0: it sent its shards; rank 0 writes
    if (gpt2_params_nonfinite(&t->model.config, masters, where, sizeof where))
        return train_fail("export to %s: the weights are not finite (%s)", a->export_path, where);
    if (gpt2_save_params(&t->model.config, masters, a->export_path, a->export_bf16)) return -1;
    if (a->verbose)
        printf("export   step %lld's weights to %s: llm.c model file version %d (%s), %lld bytes\n", (long long)t->end,
               a->export_path, a->export_bf16 ? 5 : 3, a->export_bf16 ? "bf16" : "fp32", (long long)path_size(a->export_path));
    return 0;
}

typedef struct {
    double train_time;
    int64_t trained;
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
        t->step = s;
        double prev = t->prev_norm;
        if (train_step(t, step_lr, &loss, &norm, &skipped, &unchanged)) return -1;
        double with = t->rule == CLIP_PREV ? prev : norm;   // the norm this step clipped with (est: the embeddings')
        int clipped = !skipped && a->grad_clip > 0.0f && with > a->grad_clip;
        res->clipped_steps += clipped;
        if (t->rule == CLIP_PREV) t->prev_norm = norm;
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
            char rule[48] = "";
            if (t->rule == CLIP_PREV) snprintf(rule, sizeof rule, " (prev %6.3f)", with);
            if (t->rule == CLIP_EST) snprintf(rule, sizeof rule, " (est %.3f..%.3f)", t->est_lo, t->est_hi);
            printf("step %5lld/%lld | loss %.4f | lr %.3e | norm %6.3f%s%s | %7.1f ms | %7.0f tok/s\n", (long long)s,
                   (long long)a->steps, (double)loss, (double)step_lr, norm, rule, clipped ? " clipped" : "", 1e3 * dt,
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
    res->on_gpu = t->dev == &devices[DEVICE_GPU];
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
    if (a->grad_clip > 0.0f)
        printf("clip     at %g with %s: %lld of %lld steps clipped\n", (double)a->grad_clip,
               t->rule == CLIP_PREV ? "the previous step's norm (prev)"
               : t->rule == CLIP_EST ? "this step's norm, estimated layer by layer (est; exact for the embeddings)"
               : "this step's norm (exact)",
               (long long)res->clipped_steps, (long long)(t->end - t->start));
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
    Progress pr = {0.0, 0, NAN, NAN, NAN, NAN};
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
        fprintf(stderr, "error: %s\n\n", train_error_text);
        usage(stderr);
        return 1;
    }
    if (args.device == 2 || (args.device == 0 && gpu_available())) {
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
