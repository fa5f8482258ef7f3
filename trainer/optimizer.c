/*
trainer/optimizer.c — the run's optimizer (optimizer.h): bnb8's optimizer built over the tensors a device
row placed, each with its settings (decay, state format, master, shard), and opened from a checkpoint's
optimizer file when resuming. Shared by both device rows, which differ only in where the tensors lie.
*/
#include <stdlib.h>
#include <string.h>
#include "optimizer.h"
#include "settings.h"
#include "tensors.h"
#include "checkpoint.h"
#include "clip.h"
#include "nccl.h"

// The length of a row of matrix parameter i (its last dimension: C, or 4C for fcprojw), for the rank-1
// normalization of 4-bit states' second moment (-V rank1).
static int64_t param_row_size(const GPT2 *m, int i) {
    return (int64_t)m->config.channels * (i == GPT2_FCPROJW ? 4 : 1);
}

// Registers every parameter tensor where t->param and t->grad say, in the run's dtypes, and sets
// the weights (bf16 + master for bf16 weights) from the fp32 weights of t->model. Biases and
// layernorm parameters get weight decay 0 (per-name overrides); with StableEmbedding wte keeps
// 32-bit states, as bitsandbytes' StableEmbedding asks; a release slice takes its whole tensor's
// state format. 4-bit states: blocks of Li et al.'s 128 for every state (their rank-1 normalization
// of v trained worse here: DESIGN.md §5.7), unless -V rank1 asks for it on the matrices (not
// StableEmbedding's wte, which keeps 32-bit states; over NCCL a shard of one is refused by the
// library: its column maxima need every row); -M linear puts zero in v's map.
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
    if (r->states == BNB8_STATE_4BIT) { cfg.map = (bnb8_map)t->a.map; cfg.blocksize = BNB8_BLOCKSIZE_4BIT; }
    cfg.correction_bytes = lay->correction_bytes;   // every tensor, whatever its states
    cfg.seed = t->a.seed;                           // stochastic rounding's (a resume takes the file's)
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
            if (!nccl_share(t, optimizer_id(t, i, l), &off, &count, &grad)) continue;
            int64_t row = t->a.rank1 && r->states == BNB8_STATE_4BIT && gpt2_param_is_matrix[i] && !stable_wte
                        ? param_row_size(m, i) : 0;
            if (!gpt2_param_is_matrix[i] || stable_wte || slices > 1 || count < n || row) {
                bnb8_config o = cfg;
                o.row_size = row;
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
            // bf16 weights: bf16 + master of the fp32 weights (fp32 ones already are the weights;
            // without a master, stochastic rounding too, the weights are the fp32 ones rounded to nearest)
            if (lay->weights != BNB8_F32 && bnb8_optimizer_import_fp32(t->opt, id, m->params_memory + param_offset(m, i) + l * n + off))
                return train_fail("optimizer: %s", bnb8_last_error());
            t->state_bytes[i] += bnb8_optimizer_memory(t->opt, 0).states - before;
        }
    }
    return 0;
}

// The fp32 masters of every tensor (bf16 weight + correction decoded, the fp32 master, or the weights).
int optimizer_masters(const Trainer *t, float *out) {
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
int optimizer_open(Trainer *t) {
    if (optimizer_build(t) || clip_open(t)) return -1;
    if (t->start > 0) {
        char path[TRAIN_PATH_MAX], where[160] = "";
        int rank = 0, ranks = nccl_ranks(t, &rank);
        checkpoint_optim_path(path, sizeof path, t->a.out_dir, t->start, rank, ranks);
        t->damaged = 1;   // until the file has passed every check: a failure here is the checkpoint's
        if (bnb8_optimizer_load(t->opt, path)) return train_fail("%s", bnb8_last_error());
        float *masters = t->grads;   // the CPU's gradient buffer, free now; the GPU's host weights
        if (!masters || t->lay.weights == BNB8_F32) masters = t->model.params_memory;
        for (int i = 0; t->resumed.version >= 2 && i < bnb8_optimizer_count(t->opt); i++)
            if (bnb8_optimizer_step_count(t->opt, i) != t->resumed.opt_steps)
                return train_fail("%s: tensor %d has taken %lld optimizer steps, the trainer state of step %lld says %lld: "
                                  "files of different checkpoints; resume from an earlier checkpoint", path, i,
                                  (long long)bnb8_optimizer_step_count(t->opt, i), (long long)t->resumed.step,
                                  (long long)t->resumed.opt_steps);
        if (t->resumed.version >= 2 && (t->nccl ? nccl_masters(t, where, sizeof where) : optimizer_masters(t, masters))) return -1;
        if (t->resumed.version >= 2 && !t->nccl) gpt2_params_nonfinite(&t->model.config, masters, where, sizeof where);
        if (where[0])   // over NCCL: this rank's shards
            return train_fail("%s: the weights are not finite after loading it (%s): a damaged or incomplete file; "
                              "resume from an earlier checkpoint", path, where);
        t->damaged = 0;
    }
    return 0;
}
