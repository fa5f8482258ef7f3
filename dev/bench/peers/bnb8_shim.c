/*
bnb8_shim.c — one optimizer over one tensor behind flat C calls, for the peers' Python scripts
(ctypes): scale_accuracy_peers.py steps bnb8 on the same GPU tensors as PyTorch and FlashOptim.
Built as build/libbnb8_shim.so by `make build/libbnb8_shim.so` (a GPU machine: nvcc and -fPIC).
Every call returns 0 or a status; shim_error() is the library's message.
*/
#include "bnb8.h"
#include <stddef.h>

// AdamW with these settings over param/grad (device pointers, dtypes as bnb8_dtype), its masters set
// from the n fp32 values p0 (host). scale_dtype < 0 and correction_bytes = -1 keep the defaults.
int shim_open(bnb8_optimizer **opt, int format, int correction_bytes, int scale_dtype, float lr, float beta1,
              float beta2, float eps, float weight_decay, void *param, int param_dtype, void *grad,
              int grad_dtype, long long n, const float *p0) {
    bnb8_config c = bnb8_config_default(BNB8_ADAMW);
    c.lr = lr; c.beta1 = beta1; c.beta2 = beta2; c.eps = eps; c.weight_decay = weight_decay;
    c.format = (bnb8_state_format)format; c.min_8bit_size = 0;
    c.correction_bytes = correction_bytes;
    if (scale_dtype >= 0) c.scale_dtype = (bnb8_dtype)scale_dtype;
    int id = -1;
    *opt = NULL;
    if (bnb8_optimizer_create(opt, BNB8_ADAMW, &c)) return -1;
    if (bnb8_optimizer_add(*opt, "w", param, (bnb8_dtype)param_dtype, grad, (bnb8_dtype)grad_dtype, n, &id) ||
        bnb8_optimizer_import_fp32(*opt, id, p0)) {
        bnb8_optimizer_free(*opt);
        *opt = NULL;
        return -1;
    }
    return 0;
}
int shim_step(bnb8_optimizer *opt, float lr) { return bnb8_optimizer_step(opt, lr, 1.0f, NULL); }
int shim_export(const bnb8_optimizer *opt, float *out) { return bnb8_optimizer_export_fp32(opt, 0, out); }
void shim_free(bnb8_optimizer *opt) { bnb8_optimizer_free(opt); }
const char *shim_error(void) { return bnb8_last_error(); }
