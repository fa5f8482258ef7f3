/*
trainer/nccl.h — several GPUs (nccl.c, DESIGN.md §8.8): data parallel over NCCL with sharded optimizer
states, on when OMPI_COMM_WORLD_SIZE or BNB8_RANKS is set. A leaf of the trainer: it reads the run's
types and calls the tensors, checkpoint and clipping files below it, never the run or a device row.
With one process (t->nccl NULL) every call the run or a device row makes is a no-op or the plain
path, so they need not ask whether there are ranks.
*/
#ifndef TRAINER_NCCL_H
#define TRAINER_NCCL_H

#include "trainer.h"

typedef struct Nccl Nccl;
// main, first: the rank's GPU before anything touches CUDA.
void nccl_pick_device(void);
// Settings: the ranks, the GPU, the communicator (t->nccl stays NULL without rank variables).
int nccl_setup(Trainer *t);
// The exchange buffer, before the optimizer is built.
int nccl_open(Trainer *t);
// Optimizer tensor j's part on this rank: [*offset, *offset + *count) and its gradients (*grad); 0 for
// none. One process: 1, the arguments left as they are (the whole tensor).
int nccl_share(Trainer *t, int j, int64_t *offset, int64_t *count, void **grad);
// The step over the ranks (exchanges, this rank's shards; est group by group), the norm but est's.
int nccl_step(Trainer *t, float lr, double *norm, int *skipped);
// Gradient release: group g's gradients are final (backward's callback, on the model's stream).
int nccl_release_group(Trainer *t, int g, float lr, float scale, struct CUstream_st *stream);
void nccl_batch(Trainer *t);                     // this rank's batch (one process: the loader's next)
int nccl_mean_loss(Trainer *t, float *loss);     // the ranks' mean loss (one process: unchanged)
int nccl_total_count(Trainer *t, int64_t *count);  // the ranks' total of a count of their own (one process: unchanged)
double nccl_extra_bytes(const Trainer *t);       // device bytes beyond the optimizer's (one process: 0)
void nccl_print_memory(const Trainer *t);        // the report's per-GPU lines (one process: none)
void nccl_free(Trainer *t);

// Checkpoints over NCCL. nccl_ranks: the ranks (0 without NCCL) and *rank (may be NULL) this one.
// nccl_agree: trainer_open's outcome (status) on every rank made one: 0 when every rank opened the
// same checkpoint (or none); -1 otherwise, with t->damaged set when each failure was the checkpoint's
// (every rank then falls back below t->start). nccl_gather_weights: the shards' weights all-gathered
// into every rank's model (after a resume, each rank loaded only its own). nccl_masters: this rank's
// shards' fp32 masters checked: *where the first that is not finite ("" when none). nccl_barrier:
// returns once every rank has called it (the ranks open in turns). nccl_gather_masters: every rank's
// shards' fp32 masters into rank 0's out (the model's layout; the others pass NULL and send theirs;
// rank 0 passes NULL when it has no memory for them: every rank then fails). nccl_checkpoint_save:
// the checkpoint of s->step (rank files, state, DONE last); *bytes every rank's files, *own this
// rank's optimizer file. nccl_hint: on a machine of several GPUs and no rank variables, how to train
// on all of them (the banner).
int nccl_ranks(const Trainer *t, int *rank);
int nccl_agree(Trainer *t, int status);
int nccl_gather_weights(Trainer *t);
int nccl_masters(Trainer *t, char *where, size_t size);
int nccl_barrier(Trainer *t);
int nccl_gather_masters(Trainer *t, float *out);
int nccl_checkpoint_save(Trainer *t, const TrainerState *s, int64_t *bytes, int64_t *own);
void nccl_hint(void);

#endif // TRAINER_NCCL_H
