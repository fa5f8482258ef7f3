/*
trainer/tensors.c — where the optimizer finds each tensor: its slices (one per layer under gradient
release and the prev and est rules), its optimizer ids, backward's groups, and each rank's shards over
NCCL (tensors.h). Pure functions of the model's shape and the settings, so that the optimizer, the
clipping rules, the checkpoints and NCCL all number the tensors alike.
*/
#include <stdlib.h>
#include "tensors.h"

// The optimizer's tensors, registered in parameter order. Under gradient release each per-layer
// tensor is registered as L slices, "qkvw.0" .. "qkvw.L-1", so that a layer's slices can be stepped
// as soon as backward has its gradients; so is it under the prev and est clipping rules (prev sums
// the optimizer's per-tensor sums, est steps layer by layer): the same tensors make the same bits
// with release and without. So is it for weights rounded stochastically, whatever the rule: a tensor's
// random bits follow its name (DESIGN.md §6.6), and a slice named "qkvw.3" draws other bits than the
// same elements of "qkvw" would.
int64_t slices_of(const Trainer *t, int L, int i) {   // in a model of L layers
    int sliced = t->a.release || t->rule != CLIP_EXACT || t->lay.correction_bytes == BNB8_CORRECTION_STOCHASTIC;
    return sliced && gpt2_param_is_layer(i) ? L : 1;
}
int64_t tensor_slices(const Trainer *t, int i) { return slices_of(t, t->model.config.num_layers, i); }
// Slice l (of n elements) of tensor i's gradients, where the optimizer reads them; under release the
// one slice every layer's gradients pass through.
void *slice_grad(const Trainer *t, int i, int64_t l, int64_t n) {
    return (char *)t->grad[i] + (t->a.release ? 0 : bnb8_dtype_size(t->lay.grads) * (size_t)(l * n));
}
// The optimizer id of slice l of tensor i.
int optimizer_id(const Trainer *t, int i, int64_t l) {
    int64_t id = l;
    for (int k = 0; k < i; k++) if (t->model.param_sizes[k]) id += tensor_slices(t, k);
    return (int)id;
}
// Offset of tensor i in the parameter layout.
int64_t param_offset(const GPT2 *m, int i) {
    int64_t off = 0;
    for (int k = 0; k < i; k++) off += m->param_sizes[k];
    return off;
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
int group_of(const Trainer *t, int which) {
    return which == GPT2_GRADS_LNF ? 0 : which == GPT2_GRADS_EMBED ? t->model.config.num_layers + 1
                                       : t->model.config.num_layers - which;
}


// The shards of the tensors over ranks (ZeRO-1, DESIGN.md §5.6): the exchange buffer's layout, tensor
// j (n[j] elements) at at[j], a multiple of SHARD_ALIGN; the elements per rank S, a multiple of
// SHARD_ALIGN, ranks S >= the end of the last tensor.
int64_t shard_layout(const int64_t *n, int count, int ranks, int64_t *at) {
    int64_t end = 0;
    for (int j = 0; j < count; j++) { at[j] = end; end += (n[j] + SHARD_ALIGN - 1) / SHARD_ALIGN * SHARD_ALIGN; }
    return (end / SHARD_ALIGN + ranks - 1) / ranks * SHARD_ALIGN;
}

// The part of a tensor at `at` of n elements that rank holds, [*offset, *offset + *count) of the
// tensor; 0 when none.
int shard_part(int64_t at, int64_t n, int64_t S, int rank, int64_t *offset, int64_t *count) {
    int64_t lo = rank * S, hi = lo + S, from = at > lo ? at : lo, to = at + n < hi ? at + n : hi;
    if (from >= to) return 0;
    *offset = from - at;
    *count = to - from;
    return 1;
}

// The weights a rank holds of a model of shape c (ranks 0: every weight), the optimizer file's least
// content, before anything of that shape is allocated; -1 out of memory. Under release over NCCL each
// backward group has its own layout (nccl.c): 0, no bound (the library's loader checks the file).
int64_t rank_weights(const Trainer *t, const GPT2Config *c, int rank, int ranks) {
    int64_t sizes[GPT2_NUM_PARAMS], total = 0, count = 0, held = 0, off, part;
    gpt2_param_sizes(c, sizes);
    for (int i = 0; i < GPT2_NUM_PARAMS; i++) { total += sizes[i]; count += sizes[i] ? slices_of(t, c->num_layers, i) : 0; }
    if (ranks == 0) return total;
    if (t->a.release) return 0;
    int64_t *n = (int64_t *)malloc(sizeof(int64_t) * (size_t)(2 * count)), *at = n + count, j = 0;
    if (!n) return train_fail("out of memory");
    for (int i = 0; i < GPT2_NUM_PARAMS; i++)
        for (int64_t l = 0; sizes[i] && l < slices_of(t, c->num_layers, i); l++) n[j++] = sizes[i] / slices_of(t, c->num_layers, i);
    int64_t S = shard_layout(n, (int)count, ranks, at);
    for (j = 0; j < count; j++) held += shard_part(at[j], n[j], S, rank, &off, &part) ? part : 0;
    free(n);
    return held;
}
