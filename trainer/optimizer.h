/*
trainer/optimizer.h — the run's optimizer (optimizer.c): built over the tensors the device row placed
(t->param, t->grad), with its checkpointed state when resuming, and the fp32 masters read back out.
*/
#ifndef TRAINER_OPTIMIZER_H
#define TRAINER_OPTIMIZER_H

#include "trainer.h"

// The optimizer over the tensors the device row placed, the clipping rule's buffers, and, when
// resuming, the optimizer file of t->start (its weights then checked finite).
int optimizer_open(Trainer *t);
// The fp32 masters of every tensor into out (the model's layout): bf16 weight + correction decoded,
// the fp32 master, or the fp32 weights.
int optimizer_masters(const Trainer *t, float *out);

#endif // TRAINER_OPTIMIZER_H
