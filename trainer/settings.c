/*
trainer/settings.c — the recipes, optimizers and scale dtypes, the command line and its defaults, the
learning rate schedule, the check of a run's settings (settings.h). Nothing here touches a device, a
file or the optimizer: it decides what the run is, the other files do it.
*/
#include <stdlib.h>
#include <string.h>
#include <math.h>
#include <errno.h>
#include "settings.h"

// On the GPU every recipe is a bf16 mixed-precision run (DESIGN.md §8.7): bf16 weights and gradients,
// with an fp32 master the optimizer owns and rounds into the weights, an int8 correction each (a
// near-fp32 master, §6.1), or no master, each step's result rounded stochastically into the weights
// (§6.6, seeded from -d), or, the ablation of that, rounded to nearest (-rn). Tensors under
// min_8bit_size and StableEmbedding's wte keep 32-bit states and their master (or its absence). A
// row's index is the trainer state file's: new rows go last.
const Recipe recipes[] = {
    {"fp32", BNB8_STATE_32BIT, BNB8_BF16, BNB8_BF16, 4, "32-bit states, fp32 master (llm.c's layout)"},
    {"8bit", BNB8_STATE_8BIT, BNB8_BF16, BNB8_BF16, 4, "8-bit block-wise states, fp32 master (bitsandbytes)"},
    {"flash", BNB8_STATE_FLASH, BNB8_BF16, BNB8_BF16, 1, "companded 8-bit states, int8 correction (FlashOptim)"},
    {"8bit-int8", BNB8_STATE_8BIT, BNB8_BF16, BNB8_BF16, 1, "8-bit block-wise states, int8 correction"},
    {"8bit-sr", BNB8_STATE_8BIT, BNB8_BF16, BNB8_BF16, BNB8_CORRECTION_STOCHASTIC,
     "8-bit block-wise states, no master: stochastic rounding"},
    {"4bit-int8", BNB8_STATE_4BIT, BNB8_BF16, BNB8_BF16, 1, "4-bit states (Li et al.'s maps, blocks of 128), int8 correction"},
    {"4bit-sr", BNB8_STATE_4BIT, BNB8_BF16, BNB8_BF16, BNB8_CORRECTION_STOCHASTIC,
     "4-bit states (Li et al.'s maps, blocks of 128), no master: stochastic rounding"},
    {"8bit-rn", BNB8_STATE_8BIT, BNB8_BF16, BNB8_BF16, 0, "8-bit block-wise states, no master: rounded to nearest (ablation)"},
    {"4bit-rn", BNB8_STATE_4BIT, BNB8_BF16, BNB8_BF16, 0,
     "4-bit states (Li et al.'s maps, blocks of 128), no master: rounded to nearest (ablation)"},
};
const int num_recipes = (int)(sizeof recipes / sizeof recipes[0]);

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
Layout run_layout(const Recipe *r, int on_gpu, int parity) {
    Layout l = {r->weights, r->grads, r->correction_bytes};
    if (parity || (!on_gpu && r->correction_bytes == 4)) { l.weights = l.grads = BNB8_F32; l.correction_bytes = 0; }
    return l;
}
const char *dtype_name(bnb8_dtype d) { return d == BNB8_F32 ? "fp32" : d == BNB8_BF16 ? "bf16" : "fp16"; }

const char *const clip_rule_names[3] = {"exact", "prev", "est"};
static int find_clip_rule(const char *name) {
    for (int i = 0; i < 3; i++) if (strcmp(clip_rule_names[i], name) == 0) return i;
    return -1;
}

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
    a->map = BNB8_MAP_DYNAMIC; a->blocksize = 256; a->rank1 = 0; a->scale_dtype = -1;
    a->stable_embedding = -1;
    a->eval_every = 50; a->val_batches = 10; a->sample_every = 0; a->gen_tokens = -1; a->ckpt_every = 0;
    a->keep_checkpoints = 0;
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
        "              model .bin (fp32 v3 or bf16 v5; with StableEmbedding bnb8's 8003, 8005)  (default %s)\n"
        "  -o <dir>    output directory for checkpoints: each the optimizer file (every weight as the run keeps it,\n"
        "              with its master, and the states) + the trainer state, their bytes per parameter by recipe in\n"
        "              doc/trainer.md; over NCCL an optimizer file per rank, resumed by as many ranks (default none)\n"
        "  -r <name>   recipe (states + master): fp32 | 8bit | 8bit-int8 | flash | 8bit-sr | 4bit-int8 | 4bit-sr, and the\n"
        "              ablations without a master rounded to nearest: 8bit-rn | 4bit-rn (doc/trainer.md)  (default %s)\n"
        "  -p <name>   optimizer: adamw | lion | sgd  (default %s)\n"
        "  -M <name>   8bit*: the states' map, dynamic | linear (ablation); 4bit*: the second moment's map, dynamic\n"
        "              (Li et al.'s, without zero) | linear (with zero: the zero-point ablation)  (default dynamic)\n"
        "  -K <int>    8bit*: block size 64..4096 (a power of two), 0 = one per tensor (default %lld)\n"
        "  -V <name>   4bit* with adamw: each matrix's second moment normalized by blocks of 128 | rank1 (Li et al.'s\n"
        "              min of row and column maxima; over the whole tensor: its L layers' matrices stacked unless\n"
        "              -R 1, -N prev or est, or 4bit-sr; not for NCCL's shards) (default block)\n"
        "  -S <name>   flash: the group scales' dtype, e6m10 | bf16 | fp16 | fp32 (default e6m10; resuming: the\n"
        "              checkpoint's, bf16 for a checkpoint of the version 1 layout)\n"
        "  -D <name>   device: auto (the GPU when this build has one and it is there) | cpu | gpu  (default auto)\n"
        "  -P <name>   model: bf16 | fp32 (the parity model: fp32 weights and gradients, no master)  (default bf16)\n"
        "  -R <0|1>    gradient release (GPU): each layer stepped inside backward, no gradient buffer: 2 bytes per\n"
        "              parameter less (plus a scratch for the embeddings' gradients), no extra pass over the gradients,\n"
        "              two small launches per layer for -N est; clips with -N est or prev, not exact; not with -A.\n"
        "              Its cost in tokens/s grows as the batch shrinks (per-layer launches: doc/results.md)\n"
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
        "  -G <int>    tokens per sample, 0 = none; at most -t - 1, the positions the model holds besides the\n"
        "              first (default %d, or -t - 1 when less)\n"
        "  -k <int>    checkpoint every this many steps (and at the end) into -o (default %lld = end only)\n"
        "  -L <int>    keep the newest this many complete checkpoints in -o, removing older ones once a newer one\n"
        "              is complete; 0 = all (default %lld)\n"
        "  -y <0|1>    resume from the newest complete checkpoint in -o (a damaged one: the one before); without\n"
        "              it an -o that holds checkpoints is refused. The checkpoint's model, RNG and data position\n"
        "              continue: an -e or -w of another model and an -i of other tokens are refused, -d is not\n"
        "              used; -n -l -u -q -c -g -M -K -V left out take the checkpoint's, and given must equal it\n"
        "              (default %d)\n"
        "  -x <int>    stop after this step, checkpointing it into -o (needed); the schedule still spans -n; on\n"
        "              resume, past the checkpoint's step (default off)\n"
        "  -d <int>    random seed (initialization and sampling) (default %llu)\n"
        "  -X <file>   at the end, write the weights as an llm.c model file (-F); with -y 1 and -x at or below the\n"
        "              newest checkpoint's step (e.g. -x 1), that checkpoint's, without training (default none)\n"
        "  -F <name>   -X's format: bf16 (version 5, llm.c's default build) | fp32 (version 3, PRECISION=FP32)\n"
        "              (default bf16)\n"
        "  -h          this text\n"
        "On the GPU, flags left out take the GPU's defaults: -e d12 -r flash -R 1 -N est (release by default for\n"
        "flash, unless -N exact) -b 16 -t 1024 -n 200 -v 25, and -l the optimizer's default / 5 (adamw 6e-4).\n"
        "A training loss that is not finite, or a skipped update, %d steps in a row stops the run (exit 1).\n"
        "Several GPUs (a build with NCCL): one process per GPU, `mpirun -np N train_gpt2_8bit_cuda ...` or\n"
        "BNB8_RANKS=N BNB8_RANK=r (BNB8_LOCAL_RANK, BNB8_NCCL_ID) for r = 0..N-1; the global batch is N x B x T x A;\n"
        "-N exact, est or prev as on one GPU, -o / -y per rank, -X from rank 0; not yet: -P fp32 (doc/multi_gpu.md).\n"
        "threads: OMP_NUM_THREADS (default: all cores)\n",
        d.train_path, d.val_path, d.tokenizer_path, d.model, d.recipe, d.optimizer, (long long)d.blocksize,
        (long long)d.B, (long long)d.T, (long long)d.steps, (double)optimizers[0].lr, (double)optimizers[1].lr,
        (double)optimizers[2].lr, (long long)d.warmup, (double)d.final_lr_frac, (double)optimizers[0].weight_decay,
        (double)optimizers[1].weight_decay, (double)optimizers[2].weight_decay, (double)d.grad_clip,
        (long long)d.eval_every, (long long)d.val_batches, (long long)d.sample_every, DEFAULT_GEN_TOKENS,
        (long long)d.ckpt_every, (long long)d.keep_checkpoints, d.resume, (unsigned long long)d.seed, TRAIN_MAX_BAD_STEPS);
}

void print_flag_error(FILE *f, const char *program) {
    fprintf(f, "error: %s\nrun %s -h for the flags\n", train_error_text, program);
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
    // -0 passes v >= 0: a flag that refuses negative values refuses it too, by its sign bit
    if (errno || end == s || *end || !(v >= lo && v <= hi) || (lo >= 0.0 && signbit(v)))
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
        if (!strchr("ijzeorpMKVSDPRCwbtnAluqcgvmsGkLyxdNXF", f[1])) return train_fail("unknown flag '%s'", f);
        if (i + 1 >= argc) return train_fail("%s needs a value", f);
        const char *v = argv[i + 1];
        int64_t n = 0;
        int st = 0;
        given[(unsigned char)f[1] & 127] = a->given[(unsigned char)f[1] & 127] = 1;
        switch (f[1]) {
        case 'i': a->train_path = v; break;
        case 'j': a->val_path = v; break;
        case 'z': a->tokenizer_path = v; break;
        case 'e': a->model = v; break;
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
        case 'V':
            if (strcmp(v, "block") == 0) a->rank1 = 0;
            else if (strcmp(v, "rank1") == 0) a->rank1 = 1;
            else st = train_fail("-V: unknown normalization '%s' (block, rank1)", v);
            break;
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
        case 'N': a->clip_rule = find_clip_rule(v);
            if (a->clip_rule < 0) st = train_fail("-N: unknown clipping rule '%s' (exact, prev, est)", v);
            break;
        case 'v': st = parse_int(f, v, 0, INT64_C(1) << 40, &a->eval_every); break;
        case 'm': st = parse_int(f, v, 0, INT64_C(1) << 40, &a->val_batches); break;
        case 's': st = parse_int(f, v, 0, INT64_C(1) << 40, &a->sample_every); break;
        case 'G': st = parse_int(f, v, 0, 1 << 20, &a->gen_tokens); break;
        case 'k': st = parse_int(f, v, 0, INT64_C(1) << 40, &a->ckpt_every); break;
        case 'L': st = parse_int(f, v, 0, INT64_C(1) << 40, &a->keep_checkpoints); break;
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

// The run's settings, checked in the order the messages are most useful in.
int check_settings(Trainer *t, int on_gpu) {
    const TrainArgs *a = &t->a;
    int ri = find_recipe(a->recipe), oi = find_optimizer(a->optimizer);
    if (ri < 0) return train_fail("unknown recipe '%s' (%s)", a->recipe, RECIPE_NAMES);
    if (oi < 0) return train_fail("unknown optimizer '%s' (adamw, lion, sgd)", a->optimizer);
    if (a->B < 1 || a->T < 1 || a->steps < 1 || a->accum < 1 || a->warmup < 0 || a->stop_after < 0 || a->eval_every < 0 ||
        a->sample_every < 0 || a->ckpt_every < 0 || a->gen_tokens < -1 || a->keep_checkpoints < 0 || !(a->grad_clip >= 0.0f) ||
        !(a->final_lr_frac >= 0.0f && a->final_lr_frac <= 1.0f) || a->device < 0 || a->device > 2 ||
        a->release < 0 || a->release > 1 || a->recompute < 0 || a->recompute > 1 || a->parity < 0 || a->parity > 1 ||
        a->map < 0 || a->map >= BNB8_NUM_MAPS || a->blocksize < 0 || a->rank1 < 0 || a->rank1 > 1)
        return train_fail("bad settings: B, T and steps must be >= 1, the others >= 0, final lr fraction in [0, 1]");
    if ((a->resume || a->ckpt_every || a->keep_checkpoints) && !a->out_dir[0])
        return train_fail("checkpoints (-k, -L) and resume (-y) need an output directory (-o)");
    // A sample is generated in the model's T positions, the first holding the end-of-text token it
    // starts from: a -G past T - 1 could not be honoured, and the default shrinks to fit.
    if (a->gen_tokens > a->T - 1)
        return train_fail("-G %lld: a sample is at most T - 1 = %lld tokens (-t %lld: the model holds T positions, the "
                          "first for the end-of-text token a sample starts from): lower -G or raise -t",
                          (long long)a->gen_tokens, (long long)(a->T - 1), (long long)a->T);
    if (a->gen_tokens < 0) t->a.gen_tokens = DEFAULT_GEN_TOKENS < a->T - 1 ? DEFAULT_GEN_TOKENS : a->T - 1;
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
    t->lay = run_layout(t->recipe, on_gpu, a->parity);
    int four = t->recipe->states == BNB8_STATE_4BIT;
    if (a->blocksize != 256 && t->recipe->states != BNB8_STATE_8BIT)
        return train_fail("-K sets the 8-bit block-wise states' block size: it needs -r 8bit, 8bit-int8, 8bit-sr or 8bit-rn");
    if (a->map != BNB8_MAP_DYNAMIC && t->recipe->states != BNB8_STATE_8BIT && !four)
        return train_fail("-M sets the 8-bit states' map, or the 4-bit states' second moment's: it needs -r 8bit, 8bit-int8, "
                          "8bit-sr, 8bit-rn, 4bit-int8, 4bit-sr or 4bit-rn");
    if (a->rank1 && !four)
        return train_fail("-V rank1 normalizes the 4-bit states' second moment: it needs -r 4bit-int8, 4bit-sr or 4bit-rn");
    if (a->rank1 && t->oc->kind != BNB8_ADAMW)
        return train_fail("-V rank1 normalizes the second moment, which -p %s keeps none of: use -p adamw", t->oc->name);
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
    return 0;
}

// 2. The model: from the newest complete checkpoint when resuming, else from -e.
