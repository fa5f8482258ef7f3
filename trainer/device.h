/*
trainer/device.h — the two rows of the device table (Device, trainer.h): the CPU's (device_cpu.c) and
the GPU's (device_gpu.c), the only places where the two devices differ. A new device is a new row:
a file that fills a Device, and a case in the choice below.
*/
#ifndef TRAINER_DEVICE_H
#define TRAINER_DEVICE_H

#include "trainer.h"

extern const Device device_cpu, device_gpu;
// Is there a GPU this build can train on?
int gpu_available(void);
// The device a run asks for: 1 the GPU (-D gpu, or -D auto with a GPU available), 0 the CPU.
int gpu_wanted(const TrainArgs *a);
// Over NCCL each rank drops its host fp32 copy of the weights once the GPU model and the optimizer
// hold them; gpu_masters makes a fresh one where it needs one.
void host_weights_drop(GPT2 *m);

// Tests only (NULL in the trainer): called on the CPU after each step's backward, before the
// optimizer step, with the fp32 gradients (the model's layout), to inject faults.
extern void (*train_after_backward)(GPT2 *m, float *grads, bnb8_optimizer *opt, int64_t step);

#endif // TRAINER_DEVICE_H
