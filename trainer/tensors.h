/*
trainer/tensors.h — where the optimizer finds each tensor (tensors.c): slices, ids, backward's groups,
the shards of several ranks. Every other file of the trainer numbers the tensors through these.
*/
#ifndef TRAINER_TENSORS_H
#define TRAINER_TENSORS_H

#include "trainer.h"

// Optimizer tensors of parameter tensor i in a model of L layers (slices_of), in this run's model
// (tensor_slices).
int64_t slices_of(const Trainer *t, int L, int i);
int64_t tensor_slices(const Trainer *t, int i);
// Slice l (n elements) of tensor i's gradients where the optimizer reads them (release: the shared slice).
void *slice_grad(const Trainer *t, int i, int64_t l, int64_t n);
int optimizer_id(const Trainer *t, int i, int64_t l);   // the optimizer id of slice l of tensor i
int64_t param_offset(const GPT2 *m, int i);             // offset of tensor i in the parameter layout
// Backward's group g (0 the final LayerNorm, 1..L layers L-1..0, L+1 the embeddings; per-layer tensors
// sliced): its tensors' ids in the plain numbering, gradients and sizes; returns their count.
int group_tensors(const Trainer *t, int g, int *ids, void **grads, int64_t *n);
// backward's group `which` (GPT2_GRADS_LNF, a layer, GPT2_GRADS_EMBED) as a group index.
int group_of(const Trainer *t, int which);

// The shards of several ranks (no NCCL needed; the tests' too): tensor j of n[j] elements at at[j], a
// multiple of SHARD_ALIGN; returns S, each rank's elements. shard_part: rank's part of a tensor, 0 if none.
#define SHARD_ALIGN 4096   // elements: a multiple of every 8-bit block size and of flash's groups of 32
int64_t shard_layout(const int64_t *n, int count, int ranks, int64_t *at);
int shard_part(int64_t at, int64_t n, int64_t S, int rank, int64_t *offset, int64_t *count);
// The weights a rank holds of a model of shape c (ranks 0: every weight), or 0: no bound; -1 out of memory.
int64_t rank_weights(const Trainer *t, const GPT2Config *c, int rank, int ranks);

#endif // TRAINER_TENSORS_H
