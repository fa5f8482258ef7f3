/*
bnb8.h — 8-bit optimizers in C and CUDA, version 2.0.0
Copyright (c) 2026 the bnb8 authors, MIT licence (LICENSE)
SPDX-License-Identifier: MIT

bnb8 keeps an optimizer's states in 8 bits instead of 32. Its 8-bit states are bitsandbytes'
block-wise dynamic quantization: a byte per element, a code of a 256-value map, and a float scale
per block of elements. Its flash states are FlashOptim's: companded codes with a scale per 32
elements, and bf16/fp16 weights that carry a master weight correction, so that they step like fp32
weights. Its 4-bit states are Li, Chen and Zhu's (16-value maps, blocks of 128, the second moment
rank-1 normalized) or flash's companding with 16 codes, two codes per byte. It has AdamW, Adam,
SGD, Lion, RMSprop, Adagrad, LAMB, LARS and AdEMAMix; tensors live in CPU or GPU memory, and both
give the same bits. The library is three files: this header, bnb8.c
(the CPU, with OpenMP) and bnb8_cuda.cu (the GPU). This header is its reference; DESIGN.md holds
the formats, the numerics and the reasons.

CONTENTS (search for the tag in brackets)
  PUBLIC API
    [api.status]     version, dtypes, status codes, limits, error messages
    [api.maps]       quantization maps
    [api.blockwise]  block-wise quantization and nested absmax
    [api.config]     optimizer kinds, state formats, maps, bnb8_config
    [api.optimizer]  the optimizer object: create, add, step, memory, state files, fp32 masters
    [api.flash]      master weight correction and companded states, as array functions
    [api.cuda]       GPU twins of the block-wise functions
    [api.files]      atomic writes and checked opens, for a trainer's own files
    [api.bf16]       float <-> bf16, inline on the host and the device
  INTERNALS, seen only where BNB8_INTERNAL is defined before the include (bnb8.c, bnb8_cuda.cu,
  the tests): names and signatures may change
    [internal.fail]  recording a failure's message
    [math.convert]   float <-> fp16 / e6m10, loads and stores of any dtype
    [math.round]     stochastic rounding of a weight: the counter-based hash, bf16 and fp16
    [math.codes]     thresholds, the nearest code, the codebook lookup
    [math.step]      one optimizer update of one element
    [math.sumsq]     the sum of g^2 in one fixed order
    [math.flash]     master weight correction and companding of one element
    [math.four]      4-bit states: the 16-value maps and their lookups, nibbles, rank-1 scales, companded 4-bit codes
    [math.fast]      the GPU's vouched fast forms of the flash math
    [gpu.step]       one step's tensor descriptors, the launch, memory helpers

EXAMPLE: AdamW with 8-bit states on a tensor in CPU memory
    #include "bnb8.h"
    #include <stdio.h>

    int main(void) {
        static float w[4096], g[4096];
        for (int i = 0; i < 4096; i++) w[i] = 0.01f * (float)(i % 100);
        bnb8_config cfg = bnb8_config_default(BNB8_ADAMW);   // 8-bit states, blocks of 256
        cfg.lr = 1e-3f;
        bnb8_optimizer *opt = NULL;
        bnb8_status s = bnb8_optimizer_create(&opt, BNB8_ADAMW, &cfg);
        if (s == BNB8_OK) s = bnb8_optimizer_add(opt, "w", w, BNB8_F32, g, BNB8_F32, 4096, NULL);
        for (int step = 1; step <= 10 && s == BNB8_OK; step++) {
            for (int i = 0; i < 4096; i++) g[i] = w[i] - 0.5f;   // the gradient of this step
            s = bnb8_optimizer_step(opt, cfg.lr, 1.0f, NULL);     // lr of a schedule, no scaling
        }
        if (s == BNB8_OK) s = bnb8_optimizer_save(opt, "w.bnb8");
        if (s != BNB8_OK) printf("bnb8: %s\n", bnb8_last_error());
        bnb8_optimizer_free(opt);
        return s == BNB8_OK ? 0 : 1;
    }

BUILD: compile bnb8.c, and bnb8_cuda.cu for the GPU, beside your program (`make` builds them
into build/libbnb8.a):
    cc -std=c11 -O2 -ffp-contract=off -fopenmp -c bnb8.c                  CPU only
    cc -std=c11 -O2 -ffp-contract=off -fopenmp -DBNB8_CUDA -c bnb8.c      with bnb8_cuda.cu:
    nvcc -std=c++17 -O3 -fmad=false -Xcompiler -ffp-contract=off -c bnb8_cuda.cu
    link with -lm and -fopenmp (or -lgomp), and -lcudart with the GPU.
  -DBNB8_CUDA makes bnb8.c call the GPU back end directly, which an archive needs; without it,
  weak references let bnb8.o link alone, and every tensor is then taken for host memory (a GPU
  pointer is the caller's error, not detected). Without OpenMP the CPU runs on one
  thread. Contraction into fused multiply-adds (-ffp-contract, -fmad) and fast-math would change
  the rounding, and with it the bits that the CPU and the GPU share: never use them here.

CONVENTIONS (DESIGN.md §1, §2)
  - A call that can fail returns a bnb8_status (BNB8_OK = 0): bnb8_strerror(status) says what it
    means, bnb8_last_error() names the argument or file. The library never prints or exits.
  - One argument order: inputs, then parameters, then outputs. An array comes with its dtype or
    width; n follows a plain float input and its dtype (x, dtype, n), and an encoded input after
    all its parts (q + absmax, narrow weights + correction, codes + scales). Three stated
    exceptions: every optimizer call takes the optimizer first, bnb8_optimizer_create too (the
    address where it puts the new one); a call that runs on the GPU takes its stream last;
    bnb8_compand and bnb8_expand take the scales' dtype among the parameters, as it describes the
    scales on either side.
  - Master weight correction ("correction"): what makes bf16/fp16 weights a near-fp32 or fp32
    master, whatever the state format: an int8 or int16 per element, or a full fp32 master (the
    weights are then its RNE): cfg.correction_bytes 0 (none), 1, 2 or 4, bnb8_memory.correction,
    and the functions bnb8_ecc_* ("ecc": FlashOptim's "error correction"). Or none at all, with the
    weights stored by stochastic rounding: cfg.correction_bytes BNB8_CORRECTION_STOCHASTIC.
  - CPU and GPU results are bit-identical: both compile the same per-element math (the internals
    below). See BUILD for the flags that keep it so.
*/
#ifndef BNB8_H
#define BNB8_H

#include <stdint.h>
#include <stddef.h>
#include <stdio.h>    // FILE, for [api.files]
#include <string.h>   // memcpy, for [api.bf16]

#ifdef __cplusplus
extern "C" {
#endif

// ==== [api.status] version, dtypes, status codes, limits, error messages =========================
#define BNB8_VERSION_MAJOR 2
#define BNB8_VERSION_MINOR 0
#define BNB8_VERSION_PATCH 0
#define BNB8_VERSION_STRING "2.0.0"

// BNB8_E6M10: flash group scales only (cfg.scale_dtype): an unsigned 16-bit float, 6 exponent bits
// (bias 40), 10 mantissa bits, 2^-49 .. BNB8_E6M10_MAX, no inf or NaN (DESIGN.md §6.2).
typedef enum { BNB8_F32 = 0, BNB8_F16 = 1, BNB8_BF16 = 2, BNB8_E6M10 = 3 } bnb8_dtype;
#define BNB8_E6M10_MAX 0x1.ffcp23f
struct CUstream_st;              // cudaStream_t, for the calls that run on the GPU
typedef enum bnb8_status {
    BNB8_OK = 0,
    BNB8_ERR_NULL,        // a required pointer is NULL
    BNB8_ERR_SIZE,        // a size is negative or out of range
    BNB8_ERR_BLOCKSIZE,   // block size is not a power of two in 64..4096
    BNB8_ERR_DTYPE,       // unknown or unsupported dtype
    BNB8_ERR_ARG,         // another argument is out of range
    BNB8_ERR_NOMEM,       // an allocation failed
    BNB8_ERR_IO,          // a file could not be opened, read or written
    BNB8_ERR_FORMAT,      // a file is malformed, truncated or does not match
    BNB8_ERR_CUDA,        // a CUDA call failed
    BNB8_ERR_DEVICE,      // a pointer is on the wrong device for this call
    BNB8_NUM_ERRORS
} bnb8_status;

// Element and block counts: 0..2^52 (no byte count can overflow; DESIGN.md §9), else BNB8_ERR_SIZE.
// Tensor names: at most BNB8_MAX_NAME bytes (what a state file holds).
#define BNB8_MAX_ELEMENTS (INT64_C(1) << 52)
#define BNB8_MAX_NAME 4096
// The meaning of a status, e.g. "block size is not a power of two in 64..4096".
const char *bnb8_strerror(bnb8_status status);
// The message of this thread's last failed call, naming the argument or file.
const char *bnb8_last_error(void);
// Bytes of one element of dtype (4 or 2), 0 for an unknown dtype.
size_t bnb8_dtype_size(bnb8_dtype dtype);

// ==== [api.maps] maps: 256 floats ascending in [-1, 1], the index is the byte (DESIGN.md §3) =====
// bitsandbytes' dynamic (tree) map, bit for bit: signed, or unsigned over [0, 1]. BNB8_ERR_NULL
// for a NULL code.
bnb8_status bnb8_map_dynamic(int is_signed, float code[256]);
// Linear map: signed, 255 values over [-1, 1] and a second 0 (bitsandbytes'); unsigned, 256 over [0, 1].
bnb8_status bnb8_map_linear(int is_signed, float code[256]);
// The 255 quantiles of a sample (non-finite values left out) and 0, divided by the largest magnitude.
bnb8_status bnb8_map_quantile(const float *x, int64_t n, float code[256]);

// ==== [api.blockwise] block-wise quantization (DESIGN.md §4) =====================================
// blocksize: a power of two, 64..4096; absmax: ceil(n / blocksize) floats (the last block may be partial).
// absmax[b] = max |x| over block b; q[i] = the nearest code of x[i] / absmax[b].
bnb8_status bnb8_quantize_blockwise(const void *x, bnb8_dtype dtype, int64_t n, const float *code,
                                    int64_t blocksize, uint8_t *q, float *absmax);
// As above; NaN and Inf stay out of absmax, get the code of 0 and are counted in *nonfinite (may be NULL).
bnb8_status bnb8_quantize_blockwise_ex(const void *x, bnb8_dtype dtype, int64_t n, const float *code,
                                       int64_t blocksize, uint8_t *q, float *absmax, int64_t *nonfinite);
// out[i] = code[q[i]] * absmax[b], computed in float32 and rounded to dtype.
bnb8_status bnb8_dequantize_blockwise(const uint8_t *q, const float *absmax, int64_t n, const float *code,
                                      int64_t blocksize, void *out, bnb8_dtype dtype);
// Nested absmax: the mean subtracted, then block-wise with the signed dynamic map; q2 has nblocks
// bytes, absmax2 ceil(nblocks / blocksize) floats.
bnb8_status bnb8_nest_absmax(const float *absmax, int64_t nblocks, int64_t blocksize, uint8_t *q2,
                             float *absmax2, float *mean);
// Its inverse: absmax[i] = code[q2[i]] * absmax2[b] + mean.
bnb8_status bnb8_unnest_absmax(const uint8_t *q2, const float *absmax2, float mean, int64_t nblocks,
                               int64_t blocksize, float *absmax);

// ==== [api.config] optimizer kinds, state formats, maps, configuration (DESIGN.md §5, §6) ========
// Update rules: DESIGN.md §5.3.
typedef enum {
    BNB8_ADAMW = 0, BNB8_ADAM, BNB8_SGD, BNB8_LION, BNB8_RMSPROP, BNB8_ADAGRAD, BNB8_LAMB, BNB8_LARS,
    BNB8_ADEMAMIX, BNB8_NUM_OPTIMIZERS
} bnb8_optim;
// fp32 states; 8-bit block-wise codes + an fp32 absmax per block; flash (AdamW, Adam, SGD, Lion):
// companded codes + a scale per 32, and bf16/fp16 weights carry a master weight correction.
// 4-bit (DESIGN.md §5.7), two codes per byte (the low nibble the even element): BNB8_STATE_4BIT, Li et
// al.'s block-wise codes of 16-value maps + an fp32 absmax per block (the paper's block: 128), the
// second moment optionally rank-1 normalized (cfg.row_size); BNB8_STATE_FLASH4 (AdamW, Adam, SGD,
// Lion), companded 4-bit codes + a scale per 32 as flash.
typedef enum {
    BNB8_STATE_32BIT = 0, BNB8_STATE_8BIT = 1, BNB8_STATE_FLASH = 2, BNB8_STATE_4BIT = 3, BNB8_STATE_FLASH4 = 4
} bnb8_state_format;
// Maps of 8-bit states: signed states take the signed map, non-negative ones (Adam's v) the unsigned.
// Of 4-bit states (DESIGN.md §5.7): BNB8_MAP_DYNAMIC is Li et al.'s (signed: the 4-bit dynamic map;
// non-negative: linear without zero, (c + 1)/16); BNB8_MAP_LINEAR changes only the non-negative
// states' map, to linear with zero, c/15: the ablation of the paper's zero-point problem.
typedef enum { BNB8_MAP_DYNAMIC = 0, BNB8_MAP_LINEAR = 1, BNB8_NUM_MAPS } bnb8_map;

#define BNB8_CORRECTION_AUTO (-1)   // cfg.correction_bytes: the state format's own (int8 for flash)
#define BNB8_CORRECTION_STOCHASTIC (-2)   // cfg.correction_bytes: no master, stochastic rounding (DESIGN.md §6.6)
#define BNB8_BLOCKSIZE_4BIT 128      // Li et al.'s block size for 4-bit states (cfg.blocksize)
typedef struct {
    float lr;                    // base learning rate; each step passes the scheduled one
    float beta1, beta2, beta3;   // moment decays (beta3: AdEMAMix's slow EMA)
    float eps, weight_decay;
    float momentum, dampening;   // SGD, LARS
    int nesterov;
    float alpha;                 // RMSprop smoothing; AdEMAMix weight of the slow EMA
    int64_t t_alpha, t_beta3;    // AdEMAMix warm-up steps for alpha and beta3 (0 = none)
    float max_unorm;             // LAMB / LARS trust bound (0 = off)
    int percentile_clipping;     // 1..99: clip g at that percentile of the last 100 norms; 100 = off
    bnb8_state_format format;    // 32-bit, 8-bit block-wise, flash (companded), 4-bit or flash4 states
    int64_t blocksize;           // 8-bit: a power of two in 64..4096 (default 256), or 0: one absmax
                                 // per tensor (the paper's ablation; two passes per step). 4-bit: a
                                 // power of two in 64..4096 (Li et al.'s 128: BNB8_BLOCKSIZE_4BIT)
    bnb8_map map;                // 8-bit: dynamic (default) or linear. 4-bit: dynamic (default: Li et al.'s
                                 // maps) or linear (v's map linear with zero, c/15: the zero-point ablation).
                                 // A GPU tensor keeps the optimizer's. Flash and flash4 states have their own
                                 // codes: dynamic only
    int64_t row_size;            // 4-bit: the tensor as a matrix of rows of row_size elements (n = rows x
                                 // row_size): its non-negative states (Adam's v) are normalized by
                                 // min(row max, column max) instead of blocks (rank-1; two passes per
                                 // step; a whole tensor only). 0 (default): blocks for every state
    int64_t min_8bit_size;       // tensors with fewer elements keep 32-bit states (default 4096)
    int64_t stacked;             // a tensor that stacks this many logical tensors (a trainer that keeps
                                 // its L layers' layernorms in one tensor, as llm.c does): min_8bit_size
                                 // applies to each, n / stacked elements (default 0: one tensor)
    int correction_bytes;        // bf16/fp16 weights, any state format: the master weight correction's
                                 // bytes, 0 (none: each step's result rounded to nearest), 1 (int8), 2 (int16),
                                 // 4 (an fp32 master), BNB8_CORRECTION_AUTO (default): int8 in a flash or flash4
                                 // configuration, else none; or BNB8_CORRECTION_STOCHASTIC: none, each step's
                                 // result rounded stochastically (DESIGN.md §6.6; any state format, 4-bit and
                                 // flash4 too; fp32 weights are refused).
                                 // bnb8_optimizer_add starts the master at the weights (bnb8_optimizer_import_fp32
                                 // sets other values)
    bnb8_dtype scale_dtype;      // flash: the group scales' type: BNB8_E6M10 (default: fp16's precision and
                                 // bf16's range, nearest), BNB8_BF16 or BNB8_F16 (rounded up), BNB8_F32
    int sum_squares;             // 1: each step also sums g^2 of the finite raw gradients (before gnorm_scale),
                                 // read back with bnb8_optimizer_sum_squares (default 0); see it for the order
    const float *gnorm_scale_at; // NULL (default), or a float by which each step multiplies its gnorm_scale, read
                                 // as the step runs: in the tensor's memory (GPU: device memory, read in stream
                                 // order, so a kernel before the step may write it). >= 0, as gnorm_scale
    int64_t shard_offset;        // a shard (data parallel, ZeRO-1; DESIGN.md §5.6): the tensor added is elements
    int64_t shard_total;         // [shard_offset, shard_offset + n) of one of shard_total; 0 (default): whole
    uint64_t seed;               // BNB8_CORRECTION_STOCHASTIC: the seed of the rounding's random bits (default
                                 // 0), with the tensor's name, step count and element index (DESIGN.md §6.6);
                                 // a state file records it, and bnb8_optimizer_load takes the file's
} bnb8_config;

// ==== [api.optimizer] the optimizer object (DESIGN.md §5.5, §6.5, §7) ============================
typedef struct bnb8_optimizer bnb8_optimizer;
// The defaults of an optimizer kind (PyTorch's and bitsandbytes'; 8-bit states, blocks of 256).
bnb8_config bnb8_config_default(bnb8_optim kind);
// Creates an optimizer of kind with configuration cfg (NULL = the defaults) into *opt.
bnb8_status bnb8_optimizer_create(bnb8_optimizer **opt, bnb8_optim kind, const bnb8_config *cfg);
// Frees the optimizer and the states it owns (not the tensors).
void bnb8_optimizer_free(bnb8_optimizer *opt);
// Gives the tensor called name its own configuration (its lr follows the base lr's schedule).
// Before bnb8_optimizer_add of that name: any field. After it: the hyperparameters (lr, beta1,
// beta2, beta3, eps, weight_decay, momentum, dampening, nesterov, alpha, t_alpha, t_beta3,
// max_unorm, gnorm_scale_at) change from the next step; the fields that lay out its states (format,
// blocksize, map, row_size, min_8bit_size, stacked, correction_bytes, scale_dtype, percentile_clipping,
// sum_squares, shard_offset, shard_total, seed) must be the tensor's own, or the call is refused naming
// the field. name NULL: cfg's hyperparameters for every tensor added and every later one, each keeping
// its layout (cfg's layout fields must be the optimizer's): a trainer that passes its betas, eps or
// weight decay each step calls this with its creation config, changed there.
bnb8_status bnb8_optimizer_override(bnb8_optimizer *opt, const char *name, const bnb8_config *cfg);
// Registers a tensor of n elements; its states are allocated where param lives (CPU or GPU). grad
// may be NULL until set; *id (may be NULL) receives its index.
// A shard (its cfg's shard_total > 0, set with bnb8_optimizer_override): param and grad point at
// element shard_offset of the whole tensor, n elements. Its blocks and groups are the whole tensor's,
// so N shards stepped apart make the whole tensor's bits: the state format follows shard_total (not
// n) against min_8bit_size, and a shard must start and end on a boundary of its states: a multiple
// of the block size (8-bit, 4-bit) or of 32 (flash, flash4) from the tensor's start, the end also at
// shard_total (4096 suits every format). Refused for a part of a tensor (n < shard_total), as they
// need the whole tensor: one absmax per tensor (blocksize 0), rank-1 normalization (row_size > 0: its
// column maxima), percentile clipping, LAMB/LARS trust ratios (max_unorm > 0). cfg.sum_squares then gives the shard's part (see bnb8_optimizer_sum_squares).
bnb8_status bnb8_optimizer_add(bnb8_optimizer *opt, const char *name, void *param, bnb8_dtype param_dtype,
                               void *grad, bnb8_dtype grad_dtype, int64_t n, int *id);
// Points tensor id at another gradient buffer (gradient release reuses buffers).
bnb8_status bnb8_optimizer_set_grad(bnb8_optimizer *opt, int id, void *grad);
// One step of every tensor at learning rate lr, gradients scaled by gnorm_scale (1 = none). GPU
// tensors: one launch on stream (NULL = default; two when some round stochastically and some do
// not), not synchronized. gnorm_scale >= 0: 0 steps with a zero gradient (the clip factor of an
// infinite norm: moments decay, weight decay applies); an element whose scaled gradient is not
// finite (inf x g, 0 x inf) is left unchanged and counted (bnb8_optimizer_take_nonfinite). NaN or
// negative is refused.
bnb8_status bnb8_optimizer_step(bnb8_optimizer *opt, float lr, float gnorm_scale, struct CUstream_st *stream);
// One step of the count tensors in ids only; each tensor keeps its own step count.
bnb8_status bnb8_optimizer_step_tensors(bnb8_optimizer *opt, const int *ids, int count, float lr,
                                        float gnorm_scale, struct CUstream_st *stream);
// Elements left unchanged since the last call, because their gradient was not finite or because
// their step's result was not (a finite gradient whose new weight, in the weights' dtype, or new
// state would be NaN or Inf: an overflow); resets the count. Either way the element keeps its
// weight, correction and states, so nothing non-finite spreads; a count above 0 is the caller's
// signal to skip or stop. *count: the number (GPU: waits for the device; a failed copy is an error,
// never a count of 0).
bnb8_status bnb8_optimizer_take_nonfinite(bnb8_optimizer *opt, int64_t *count);
// out[id] (bnb8_optimizer_count doubles): tensor id's sum of g^2 at its latest step (cfg.sum_squares; else 0),
// summed in one fixed order, the same bits on CPU and GPU (DESIGN.md §5.4). GPU: waits for the device.
// A shard's sum is of its own elements: ranks add theirs in rank order (the same bits on every rank
// and every run of that sharding); that order differs from the whole tensor's, by a few ulps of a double.
bnb8_status bnb8_optimizer_sum_squares(const bnb8_optimizer *opt, double *out);
// The number of tensors; the step count of tensor id (-1 when there is none).
int bnb8_optimizer_count(const bnb8_optimizer *opt);
int64_t bnb8_optimizer_step_count(const bnb8_optimizer *opt, int id);
// Sets tensor id's step count (id -1: every tensor's), 0..2^52: its next step is count + 1 (bias
// corrections, AdEMAMix's schedules). For a trainer that numbers its own steps, as llm.c does, and
// skips some without calling step.
bnb8_status bnb8_optimizer_set_step_count(bnb8_optimizer *opt, int id, int64_t count);

// Persistent bytes of the registered tensors (the trainer's bytes-per-parameter report, DESIGN.md §8.6);
// of a shard, its own n elements (a rank's share).
typedef struct {
    int64_t params;              // number of parameters
    double weights;              // the parameters themselves
    double gradients;            // the gradient buffers (0 when with_grads is 0: gradient release)
    double states;               // optimizer states with their absmax / scales
    double correction;           // the master weight corrections or fp32 masters of bf16/fp16 weights (0 under
                                 // stochastic rounding: no master)
} bnb8_memory;
bnb8_memory bnb8_optimizer_memory(const bnb8_optimizer *opt, int with_grads);

// Writes every tensor's states (and weights) to path atomically: a temporary of its own
// (path.tmp.<pid>.<n>), flushed, renamed; on failure path is untouched and no temporary is left.
bnb8_status bnb8_optimizer_save(const bnb8_optimizer *opt, const char *path);
// Reads a file of bnb8_optimizer_save that matches the registered tensors; on any error nothing changes.
// Each shard's record names its range: a file of another sharding is refused with both ranges. A
// record of another master (e.g. stochastic rounding against none) is refused naming both; a
// stochastically rounded tensor takes the file's seed with its step count (a resume continues bit
// for bit whatever cfg.seed the optimizer was created with).
bnb8_status bnb8_optimizer_load(bnb8_optimizer *opt, const char *path);
// A digest of a file of bnb8_optimizer_save from its header and records' CRC-32s, their data seeked
// over (not such a file: BNB8_ERR_FORMAT); a trainer stores it beside its own state to bind the two.
bnb8_status bnb8_optimizer_file_digest(const char *path, uint64_t *digest);
// The same bytes written to / read from an open stream at its position, for a trainer that keeps
// the optimizer inside its own checkpoint file (or memory: fmemopen, open_memstream). write does not
// flush or close f; read stops after the state's last byte (what follows is the caller's) and on
// any error changes nothing (f's position is then undefined).
bnb8_status bnb8_optimizer_write(const bnb8_optimizer *opt, FILE *f);
bnb8_status bnb8_optimizer_read(bnb8_optimizer *opt, FILE *f);
// The fp32 master of tensor id into out (n floats): host memory, or for a GPU tensor also device
// memory (then computed there, without a copy through the host; the same bits). Waits for the device.
// Without a correction (stochastic rounding too) the master is the weights themselves, widened.
bnb8_status bnb8_optimizer_export_fp32(const bnb8_optimizer *opt, int id, float *out);
// Sets tensor id's weights and correction from n fp32 masters in (host memory, or device memory for a
// GPU tensor, as export): RNE + correction; import(export(w)) may move a corrected weight by one bf16
// ulp (DESIGN.md §6.5). Not needed to start: bnb8_optimizer_add starts every master at its weights.
// Without a correction (stochastic rounding too) the weights become RNE(in): import rounds to nearest.
bnb8_status bnb8_optimizer_import_fp32(bnb8_optimizer *opt, int id, const float *in);

// ==== [api.flash] master weight correction and companded states as arrays (DESIGN.md §6) =========
// narrow[i] = RNE(x[i]) in bf16/fp16 and, when corr is not NULL, its correction (corr_bytes 1: int8,
// 2: int16, 4: x itself, an fp32 master).
bnb8_status bnb8_ecc_encode(const float *x, int64_t n, void *narrow, bnb8_dtype narrow_dtype,
                            void *corr, int corr_bytes);
// out[i] = narrow[i] with its correction applied (corr NULL: the narrow value widened).
bnb8_status bnb8_ecc_decode(const void *narrow, bnb8_dtype narrow_dtype, const void *corr, int corr_bytes,
                            int64_t n, float *out);
// Per group of 32 a scale (max |x|, or max sqrt(x) if unsigned) stored in scale_dtype (e6m10 rounds
// to nearest, bf16 and fp16 round up; DESIGN.md §6.2), and the codes: softsign int8 (is_signed) or
// sqrt uint8. Non-finite values stay out of the scale and get code 0.
bnb8_status bnb8_compand(const float *x, int64_t n, int is_signed, bnb8_dtype scale_dtype,
                         uint8_t *codes, void *scales);
// out[i] = the value of codes[i] under its group's stored scale.
bnb8_status bnb8_expand(const uint8_t *codes, const void *scales, int64_t n, int is_signed,
                        bnb8_dtype scale_dtype, float *out);

// ==== [api.cuda] GPU twins (bnb8_cuda.cu): device pointers, a stream (NULL = default), no sync ===
bnb8_status bnb8_cuda_quantize_blockwise(const void *x, bnb8_dtype dtype, int64_t n, const float *code,
                                         int64_t blocksize, uint8_t *q, float *absmax,
                                         struct CUstream_st *stream);
bnb8_status bnb8_cuda_dequantize_blockwise(const uint8_t *q, const float *absmax, int64_t n, const float *code,
                                           int64_t blocksize, void *out, bnb8_dtype dtype,
                                           struct CUstream_st *stream);
// nonfinite: device memory (may be NULL).
bnb8_status bnb8_cuda_quantize_blockwise_ex(const void *x, bnb8_dtype dtype, int64_t n, const float *code,
                                            int64_t blocksize, uint8_t *q, float *absmax, int64_t *nonfinite,
                                            struct CUstream_st *stream);

// ==== [api.files] atomic writes and checked opens, for a trainer's own files (DESIGN.md §7) ======
// A trainer writes checkpoint files of its own beside the optimizer's state file. These are the two
// calls under bnb8_optimizer_save and bnb8_optimizer_load, so that its files get the same care: a
// crash never leaves a half-written file under its name, and a FIFO or a directory given as an
// input is refused with a message instead of blocking or failing later.
//
// Writes path atomically: writer fills a temporary of this call's own, path.tmp.<pid>.<n> (created
// exclusively, so that no other writer's temporary is ever opened), which is flushed to disk,
// closed and renamed over path. On any failure the temporary is removed and path is untouched.
// writer returns 0, -1 when a write failed (BNB8_ERR_IO), or a status of its own (> 0), which this
// call returns as it is.
bnb8_status bnb8_write_atomically(const char *path, int (*writer)(FILE *f, const void *ctx), const void *ctx);
// Opens path for reading if it is a regular file: a directory, FIFO, device or socket is refused
// (the file is opened non-blocking to find out: fopen would wait on a FIFO for a writer). NULL
// then, with bnb8_last_error() "who: path is a FIFO, not a regular file" or "who: cannot open path:
// reason" (BNB8_ERR_IO).
FILE *bnb8_open_regular(const char *path, const char *who);

// ==== [api.bf16] float <-> bf16, inline on the host and the device ===============================
#ifdef __CUDACC__
#define BNB8_HD static inline __host__ __device__
#else
#define BNB8_HD static inline
#endif
// float -> bf16, round to nearest even; NaN stays NaN (sign kept, quiet bit set).
BNB8_HD uint16_t bnb8_f32_to_bf16(float x) {
    uint32_t u;
    memcpy(&u, &x, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x0040u);
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);   // the carry rounds up into inf
}
BNB8_HD float bnb8_bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float x;
    memcpy(&x, &u, 4);
    return x;
}

#ifdef __cplusplus
}
#endif
#endif // BNB8_H

// =================================================================================================
// INTERNALS: bnb8.c and bnb8_cuda.cu define BNB8_INTERNAL before including this header, and so do
// the tests that hold the per-element math to its bounds. Both back ends compile the BNB8_HD
// functions below, which is what makes their results bit-identical (DESIGN.md §2). Not part of the
// API: names and signatures may change. A guard of their own lets a file include bnb8.h plainly
// first (through another header) and then again with BNB8_INTERNAL defined.
// =================================================================================================
#if defined(BNB8_INTERNAL) && !defined(BNB8_INTERNAL_H)
#define BNB8_INTERNAL_H

#include <math.h>

#ifdef __cplusplus
extern "C" {
#endif

// ==== [internal.fail] recording a failure's message ==============================================
// Records the detailed message of a failure for bnb8_last_error() and returns status, so that a
// check reads `return bnb8_fail(BNB8_ERR_SIZE, "bnb8_quantize_blockwise: n = %lld < 0", n);`.
bnb8_status bnb8_fail(bnb8_status status, const char *fmt, ...);

// ==== [math.convert] float <-> fp16 / e6m10 (bf16: [api.bf16]), loads and stores of any dtype ===

BNB8_HD uint32_t bnb8_f32_bits(float x) { uint32_t u; memcpy(&u, &x, 4); return u; }
BNB8_HD float bnb8_bits_f32(uint32_t u) { float x; memcpy(&x, &u, 4); return x; }

// The positive finite float of bits u below 2^(k + 24) in units of 2^k, rounded to nearest even
// (the subnormals of fp16, k = -24, and of e6m10, k = -49): 0 below half a unit.
BNB8_HD uint32_t bnb8_units_rne(uint32_t u, int k) {
    int shift = 150 + k - (int)(u >> 23);                             // u = m 2^(e - 150), m of 24 bits
    if (shift > 24) return 0;
    uint32_t m = (u & 0x7fffffu) | 0x800000u, q = m >> shift, rest = m & ((1u << shift) - 1u), half = 1u << (shift - 1);
    return q + (rest > half || (rest == half && (q & 1u)));
}

// float -> IEEE half, round to nearest even, with subnormals, overflow to inf, and NaN kept quiet.
BNB8_HD uint16_t bnb8_f32_to_f16(float x) {
    uint32_t u = bnb8_f32_bits(x);
    uint16_t sign = (uint16_t)((u >> 16) & 0x8000u);
    u &= 0x7fffffffu;
    if (u > 0x7f800000u) return (uint16_t)(sign | 0x7e00u | ((u >> 13) & 0x3ffu));
    if (u >= 0x47800000u) return (uint16_t)(sign | 0x7c00u);          // >= 65536 (and inf)
    if (u >= 0x38800000u) {                                           // normal half: rebias 127 -> 15
        uint32_t r = u - 0x38000000u;
        return (uint16_t)(sign | ((r + 0xfffu + ((r >> 13) & 1u)) >> 13));  // may carry into inf
    }
    return (uint16_t)(sign | bnb8_units_rne(u, -24));                 // subnormal half (a carry makes it normal)
}
BNB8_HD float bnb8_f16_to_f32(uint16_t h) {
    uint32_t sign = ((uint32_t)h & 0x8000u) << 16, e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
    if (e == 0) {                                                     // zero or subnormal: m * 2^-24
        float v = ldexpf((float)m, -24);
        return bnb8_bits_f32(bnb8_f32_bits(v) | sign);
    }
    if (e == 31) return bnb8_bits_f32(sign | 0x7f800000u | (m << 13));
    return bnb8_bits_f32(sign | ((e + 112u) << 23) | (m << 13));
}

// e6m10 (flash group scales, DESIGN.md §6.2): bits e (6) m (10); e > 0: (1 + m/1024) 2^(e - 40),
// e = 0: m 2^-49. The encoder takes a >= 0, rounds to nearest even and saturates at BNB8_E6M10_MAX
// (0xffff) from MAX + half an ulp on; below 2^-50 (and NaN) it gives 0.
BNB8_HD float bnb8_e6m10_to_f32(uint16_t h) {
    if (h < 0x400u) return (float)h * 0x1p-49f;                       // zero and subnormals, exact
    return bnb8_bits_f32(((uint32_t)h + (87u << 10)) << 13);          // rebias 40 -> 127
}
BNB8_HD uint16_t bnb8_f32_to_e6m10(float a) {
    uint32_t u = bnb8_f32_bits(a);
    if (!(a > 0.0f)) return 0;
    if (u < (88u << 23)) return (uint16_t)bnb8_units_rne(u, -49);     // below 2^-39: subnormal (may carry to normal)
    uint32_t r = u - (87u << 23);
    r = (r + 0xfffu + ((r >> 13) & 1u)) >> 13;                        // inf and large values pass 0xffff
    return r > 0xffffu ? (uint16_t)0xffffu : (uint16_t)r;
}

// Element i of an array of dtype (not e6m10), as float; and the store with round to nearest even.
BNB8_HD float bnb8_load(const void *x, bnb8_dtype dtype, int64_t i) {
    if (dtype == BNB8_F32) return ((const float *)x)[i];
    if (dtype == BNB8_BF16) return bnb8_bf16_to_f32(((const uint16_t *)x)[i]);
    return bnb8_f16_to_f32(((const uint16_t *)x)[i]);
}
BNB8_HD void bnb8_store(void *x, bnb8_dtype dtype, int64_t i, float v) {
    if (dtype == BNB8_F32) ((float *)x)[i] = v;
    else if (dtype == BNB8_BF16) ((uint16_t *)x)[i] = bnb8_f32_to_bf16(v);
    else ((uint16_t *)x)[i] = bnb8_f32_to_f16(v);
}

BNB8_HD int bnb8_isfinite(float x) { return fabsf(x) <= 0x1.fffffep127f; }   // false for NaN

// ==== [math.round] stochastic rounding of a weight (DESIGN.md §6.6) ==============================
// A step's fp32 result x is stored as its lower neighbour in the narrow dtype (x rounded toward
// zero) or its upper one (the next away from zero), up with probability (|x| - |lower|) / (|upper| -
// |lower|), from 16 random bits r that a counter-based hash gives each element: no state, the same
// bits on either back end and after a resume. A representable x never moves; NaN stays NaN (as the
// nearest rounding makes it); an |x| above the largest finite value may round up to inf (the caller
// counts that as an overflow, bnb8_results_finite).

// splitmix64's finalizer: a bijection of 64-bit words in which every output bit depends on every input bit.
BNB8_HD uint64_t bnb8_mix64(uint64_t z) {
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}
// The key of one step of one tensor: the seed, the tensor's identity (bnb8.c: FNV-1a of its name)
// and its step count, this step included. Computed once per tensor and step, on the host.
BNB8_HD uint64_t bnb8_round_key(uint64_t seed, uint64_t tensor, int64_t step) {
    return bnb8_mix64(bnb8_mix64(bnb8_mix64(seed) + tensor) + (uint64_t)step);
}
// The 16 random bits of element e of the whole tensor (a shard's offset + its index), under key:
// splitmix64's output e of the stream that starts at key, its top 16 bits.
BNB8_HD uint32_t bnb8_round_bits(uint64_t key, int64_t e) {
    return (uint32_t)(bnb8_mix64(key + (uint64_t)e * 0x9e3779b97f4a7c15ull) >> 48);
}
// bf16: x's 16 dropped bits d plus r carry into the kept ones exactly when r >= 65536 - d, with
// probability d / 65536, which is the fraction exactly (the dropped bits count fp32 steps of one
// binade, and the upper neighbour lies 65536 of them above the lower one; subnormals alike).
BNB8_HD uint16_t bnb8_bf16_stochastic(float x, uint32_t r) {
    uint32_t u = bnb8_f32_bits(x);
    if ((u & 0x7fffffffu) > 0x7f800000u) return bnb8_f32_to_bf16(x);   // NaN
    return (uint16_t)((u + r) >> 16);      // a magnitude up to inf's plus r never reaches the sign bit
}
// x (bits u, positive) below 2^(k + 24) in units of 2^k, rounded down or up as above: x / 2^k cut to 16
// bits of fraction f16 (a 64-bit integer: q 2^16 + f16) plus r. Up with probability f16 / 65536: the
// fraction exactly when it has at most 16 bits (x >= 2^(k + 7) for the subnormals of fp16, k = -24),
// else less by below 2^-16; 0 from x < 2^(k - 16) on.
BNB8_HD uint32_t bnb8_units_stochastic(uint32_t u, int k, uint32_t r) {
    int shift = 150 + k - (int)(u >> 23);                 // u = m 2^(e - 150), m of 24 bits
    if (shift > 40) return 0;
    uint64_t w = ((uint64_t)((u & 0x7fffffu) | 0x800000u) << 16) >> shift;
    return (uint32_t)((w + r) >> 16);
}
// fp16: a normal result drops 13 bits, whose carry takes r's top 13 (probability exact); a subnormal
// one counts units of 2^-24 (bnb8_units_stochastic: exact from |x| >= 2^-17, within 2^-16 below it
// under that). From 65504 a round up gives inf; from 65536 on x is inf, as the nearest rounding has it.
BNB8_HD uint16_t bnb8_f16_stochastic(float x, uint32_t r) {
    uint32_t u = bnb8_f32_bits(x), sign = (u >> 16) & 0x8000u;
    u &= 0x7fffffffu;
    if (u >= 0x47800000u) return bnb8_f32_to_f16(x);                 // NaN, inf and |x| >= 65536
    if (u >= 0x38800000u) return (uint16_t)(sign | ((u - 0x38000000u + (r >> 3)) >> 13));   // rebias 127 -> 15
    return (uint16_t)(sign | bnb8_units_stochastic(u, -24, r));       // a carry into 1024 is the smallest normal
}
// x rounded stochastically to bf16 or fp16 with the random bits r (0..65535).
BNB8_HD uint16_t bnb8_narrow_stochastic(float x, bnb8_dtype narrow, uint32_t r) {
    return narrow == BNB8_BF16 ? bnb8_bf16_stochastic(x, r) : bnb8_f16_stochastic(x, r);
}

// A tensor's rounding in one step, computed on the host: on (stochastic, else the store's nearest),
// the key of its seed, identity and step count, and the whole tensor's index of its element 0.
typedef struct {
    uint64_t key;
    int64_t base;
    int32_t on, unused;
} bnb8_rounding;

// The new weight p of element i (its index in the tensor as added) as the weights will hold it:
// when r is on, the value of its stochastic rounding in dtype (bf16 or fp16), which the nearest
// rounding of the store keeps exactly and bnb8_results_finite then checks (a round up to inf is an
// overflow); else p itself, rounded by the store.
BNB8_HD float bnb8_round_result(const bnb8_rounding *r, float p, bnb8_dtype dtype, int64_t i) {
    if (!r->on) return p;
    uint16_t h = bnb8_narrow_stochastic(p, dtype, bnb8_round_bits(r->key, r->base + i));
    return dtype == BNB8_BF16 ? bnb8_bf16_to_f32(h) : bnb8_f16_to_f32(h);
}

// ==== [math.codes] thresholds, the nearest code, the codebook lookup (DESIGN.md §3) ==============

// The 255 decision thresholds of a map, t[k] = (code[k] + code[k+1]) * 0.5f, padded with +inf at
// t[255] so that a branch-free binary search over 256 slots works (a 4-bit map: 15 and t[15]).
BNB8_HD float bnb8_threshold_of(const float *code, int size, int k) {
    return k < size - 1 ? (code[k] + code[k + 1]) * 0.5f : bnb8_bits_f32(0x7f800000u);
}
BNB8_HD float bnb8_threshold(const float code[256], int k) { return bnb8_threshold_of(code, 256, k); }
BNB8_HD void bnb8_thresholds(const float code[256], float t[256]) {
    for (int k = 0; k < 256; k++) t[k] = bnb8_threshold(code, k);
}

// Number of thresholds t[0..size - 2] strictly below v (or at most v): a branch-free binary search
// over size slots (a power of two; t[size - 1] = +inf): 256 for the 8-bit maps, 16 for the 4-bit ones.
BNB8_HD int bnb8_count_below_of(const float *t, int size, float v) {
    int i = 0;
    for (int step = size / 2; step > 0; step >>= 1)
        if (t[i + step - 1] < v) i += step;
    return i;
}
BNB8_HD int bnb8_count_below(const float t[256], float v) { return bnb8_count_below_of(t, 256, v); }
BNB8_HD int bnb8_count_at_most(const float t[256], float v) {
    int i = 0;
    for (int step = 128; step > 0; step >>= 1)
        if (i + step - 1 < 255 && t[i + step - 1] <= v) i += step;
    return i;
}

// Nearest code of x (DESIGN.md §3): the number of thresholds strictly below x, and a value exactly on a
// threshold goes to the even index of its pair. The reference form, 8 comparisons (4 for 16 codes).
BNB8_HD int bnb8_nearest_code_of(const float *t, int size, float x) {
    int i = bnb8_count_below_of(t, size, x);
    if (i < size - 1 && t[i] == x && (i & 1)) i++;
    return i;
}
BNB8_HD int bnb8_nearest_code(const float t[256], float x) { return bnb8_nearest_code_of(t, 256, x); }

// The same function, faster: a table indexed by the sign, exponent and top 7 mantissa bits of x
// (bucket 2k + sign: k = 0 for |x| < 2^-24, one k per 2^16 floats of exponents 103..126, then
// [1, inf], then NaN). Within a bucket a value's position is its low 16 bits (complemented for a
// negative x, so that positions grow with the value). Each entry holds the number j of thresholds
// below the bucket and the position pt of the one threshold that decides inside it, biased by
// BNB8_LOOKUP_MARGIN: a threshold inside, or one at most that many floats outside an edge
// (positions -16..-1 below, 0x10000.. above; then j counts from the threshold below it), so that a
// value that lands in the bucket from a neighbour's side still sees the threshold it is near; with
// none, pt is out of reach (BNB8_ENTRY_NONE). An entry is j << 24 | (0xffffff - pt): adding a
// value's biased position carries into the top byte exactly when the value lies above the
// threshold. Buckets with two such thresholds, NaN and a few more (bnb8_codebook_entry) hold 0:
// the binary search (for the dynamic and linear maps only NaN). A codebook built with a
// zero code z > 0 gives negative values at most z - 1 (bnb8_keep_sign's rule, in the table).
#define BNB8_LOOKUP_BITS 7
#define BNB8_LOOKUP_E0 103             // exponents below (|x| < 2^-24) share one bucket
#define BNB8_LOOKUP_EXACT ((127 - BNB8_LOOKUP_E0) << BNB8_LOOKUP_BITS)   // buckets of one exponent
#define BNB8_LOOKUP_HALF (BNB8_LOOKUP_EXACT + 3)   // per sign: tiny, exact..., [1, inf], NaN
#define BNB8_LOOKUP_K0 ((BNB8_LOOKUP_E0 << BNB8_LOOKUP_BITS) - 1)   // bits 16..30 of |x| at k = 0
#define BNB8_LOOKUP_SIZE ((2 * (0x3fff - BNB8_LOOKUP_K0 + 1) + 3) & ~3)   // bnb8_code_near's reach (bits 16..29)
#define BNB8_LOOKUP_MARGIN 16u         // floats outside a bucket whose thresholds it must know
#define BNB8_ENTRY_NONE 0x1ffffu       // the biased position of no threshold
#define BNB8_NEAR_LIMIT 1.0078125f     // |q| below it: a bucket up to [1, inf] (1 + 2^-7 in bits 16..22)

typedef struct {
    uint32_t entry[BNB8_LOOKUP_SIZE];      // bucket 2k + sign: j << 24 | (0xffffff - pt), or 0: search
    float t[256];                          // thresholds, t[255] = +inf
    int search;                            // a bucket below BNB8_NEAR_LIMIT searches: no fast path
    int unused[3];                         // 16-byte multiple: the GPU copies it in vectors
} bnb8_codebook;

BNB8_HD int bnb8_bucket(float x) {
    uint32_t u = bnb8_f32_bits(x), mag = u & 0x7fffffffu;
    int k = (int)(mag >> (23 - BNB8_LOOKUP_BITS)) - BNB8_LOOKUP_K0;
    k = k < 0 ? 0 : k;                                               // tiny
    k = k > BNB8_LOOKUP_HALF - 2 ? BNB8_LOOKUP_HALF - 2 : k;         // [1, inf]
    k = mag > 0x7f800000u ? BNB8_LOOKUP_HALF - 1 : k;                // NaN
    return 2 * k + (int)(u >> 31);
}

// Entry b of the table: the bucket's magnitudes [lo, hi] are values [lo, hi] or [-hi, -lo].
BNB8_HD uint32_t bnb8_codebook_entry(const float t[256], int b, int zero_code) {
    int negative = b & 1, k = b >> 1;
    if (k >= BNB8_LOOKUP_HALF - 1) return 0;                                     // NaN, and past it
    uint32_t lo = 0, hi = 0x7f800000u;                                           // [1, inf]: lo below
    if (k == 0) hi = (BNB8_LOOKUP_E0 << 23) - 1u;
    else if (k == BNB8_LOOKUP_HALF - 2) lo = 0x3f800000u;
    else { lo = (uint32_t)(k + BNB8_LOOKUP_K0) << (23 - BNB8_LOOKUP_BITS); hi = lo + 0xffffu; }
    // The bucket's values [first, last] and the margins beside them (magnitudes clamped to [0, inf]).
    uint32_t wide_lo = lo > BNB8_LOOKUP_MARGIN ? lo - BNB8_LOOKUP_MARGIN : 0u;
    uint32_t wide_hi = hi + BNB8_LOOKUP_MARGIN < 0x7f800000u ? hi + BNB8_LOOKUP_MARGIN : 0x7f800000u;
    float a = bnb8_bits_f32(lo), z = bnb8_bits_f32(hi), wa = bnb8_bits_f32(wide_lo), wz = bnb8_bits_f32(wide_hi);
    float first = negative ? -z : a, last = negative ? -a : z;
    uint32_t j = (uint32_t)bnb8_count_below(t, first), inside = (uint32_t)bnb8_count_at_most(t, last) - j;
    uint32_t below = j - (uint32_t)bnb8_count_below(t, negative ? -wz : wa);
    uint32_t above = (uint32_t)bnb8_count_at_most(t, negative ? -wa : wz) - j - inside;
    // The tiny and [1, inf] buckets span many exponents, where low bits order only the values near
    // their edges: a threshold inside is searched, except 0 in the tiny bucket (all of its other
    // values lie on one side of it; the ones whose low bits tie with it are redone as near).
    int exact = k > 0 && k < BNB8_LOOKUP_HALF - 2;
    uint32_t pt = BNB8_ENTRY_NONE;
    if (inside + below + above > 1 || (inside && !exact && !(k == 0 && t[j] == 0.0f))) return 0;
    // The one threshold: its position (low bits, complemented for a negative bucket, so that they
    // grow with the value) when inside; past 0xffff or below 0 by its distance in floats from the
    // bucket's top or bottom value (magnitudes top and bottom: a negative bucket is mirrored).
    uint32_t top = negative ? lo : hi, bottom = negative ? hi : lo;
    if (inside) {
        pt = ((bnb8_f32_bits(t[j]) ^ (negative ? 0xffffu : 0u)) & 0xffffu) + BNB8_LOOKUP_MARGIN;
    } else if (above) {
        uint32_t m = bnb8_f32_bits(t[j]) & 0x7fffffffu, d = negative ? top - m : m - top;      // 1..16 above
        pt = 0xffffu + d + BNB8_LOOKUP_MARGIN;
    } else if (below) {
        uint32_t m = bnb8_f32_bits(t[j - 1]) & 0x7fffffffu, d = negative ? m - bottom : bottom - m;   // 1..16 below
        j = j - 1;
        pt = BNB8_LOOKUP_MARGIN - d;
    }
    if (zero_code > 0 && negative && j >= (uint32_t)zero_code - 1) { j = (uint32_t)zero_code - 1; pt = BNB8_ENTRY_NONE; }
    return j << 24 | (0xffffffu - pt);
}
// zero_code > 0: the codes of negative values stay below it (an optimizer's signed map); else 0.
// Whether entry b sends bnb8_code_near's values to the binary search: 0 in a bucket it can reach
// (the first BNB8_NEAR_ENTRIES, up to [1, inf]).
#define BNB8_NEAR_ENTRIES (2 * (BNB8_LOOKUP_HALF - 1))
BNB8_HD int bnb8_entry_searches(uint32_t entry, int b) { return entry == 0 && b < BNB8_NEAR_ENTRIES; }
BNB8_HD void bnb8_codebook_init(bnb8_codebook *cb, const float code[256], int zero_code) {
    bnb8_thresholds(code, cb->t);
    cb->search = 0;
    for (int b = 0; b < BNB8_LOOKUP_SIZE; b++) {
        cb->entry[b] = bnb8_codebook_entry(cb->t, b, zero_code);
        cb->search |= bnb8_entry_searches(cb->entry[b], b);
    }
}

// The position of x in its bucket: its low 16 bits, complemented for a negative x.
BNB8_HD uint32_t bnb8_low_bits(float x) {
    uint32_t u = bnb8_f32_bits(x);
    return (u ^ (uint32_t)((int32_t)u >> 31)) & 0xffffu;
}

// Exact for every x: the tiny and [1, inf] buckets search (their entries serve bnb8_code_near).
BNB8_HD int bnb8_nearest_code_fast(const bnb8_codebook *cb, float x) {
    int b = bnb8_bucket(x), k = b >> 1;
    uint32_t e = cb->entry[b];
    if (e == 0 || k == 0 || k == BNB8_LOOKUP_HALF - 2) return bnb8_nearest_code(cb->t, x);
    uint32_t j = e >> 24, px = bnb8_low_bits(x) + BNB8_LOOKUP_MARGIN, pt = 0xffffffu - (e & 0xffffffu);
    return (int)(j + (px > pt) + ((px == pt) & j & 1u));   // x on the threshold: to the even index
}

// The code of x / a from q = x * r, r = bnb8_reciprocal(a), |x| <= a, without the division; sets
// *redo where the caller must divide (bnb8_quantize_code, bnb8_quantize_value), and
// leaves it otherwise. q is within 3 ulps of the correctly rounded x / a (two roundings of relative
// error 2^-24 each, r normal), so they have the same code unless q lies within 8 floats of the
// threshold its bucket knows (the table knows those up to BNB8_LOOKUP_MARGIN floats past its edges).
// Also redone: |q| not below BNB8_NEAR_LIMIT (NaN: a zero or huge a, a non-finite x); a codebook
// that searches redoes everything: the caller starts *redo at cb->search. No branch: the bucket's
// byte offset 8k + 4 sign comes from bits 16..29 of q (a larger q reads past the buckets, inside
// the table, and is redone).
BNB8_HD int bnb8_code_near(const bnb8_codebook *cb, float q, int *redo) {
    uint32_t u = bnb8_f32_bits(q), sign = (uint32_t)((int32_t)u >> 31);
    int32_t k8 = (int32_t)((u >> 13) & 0x1fff8u) - 8 * BNB8_LOOKUP_K0;
    uint32_t e = *(const uint32_t *)((const char *)cb->entry + ((uint32_t)(k8 > 0 ? k8 : 0) | (sign & 4u)));
    // + the biased position + 9: the top byte is j, + 1 above the threshold; the low 24 bits are
    // at most 16 exactly within 8 floats of it.
    uint32_t t = e + bnb8_low_bits(q) + BNB8_LOOKUP_MARGIN + 9u;
    *redo = *redo || !(fabsf(q) < BNB8_NEAR_LIMIT) || (t & 0xffffffu) <= 16u;
    return (int)(t >> 24);
}

// The code of exact zero in an optimizer's maps (DESIGN.md §3): 127 signed, 0 unsigned; all-zero blocks
// store it. Written out rather than nearest(0): the linear signed map holds 0 twice (127 and 128)
// and its tie at 0 goes to the even 128; the dynamic maps give the same 127 and 0 either way.
BNB8_HD int bnb8_zero_code(int is_signed) { return is_signed ? 127 : 0; }

// Code of a state value s in a block of absmax a (a > 0). For signed maps (zero code z > 0) a
// negative value never decodes to zero or above: a code at or above z (z itself, or the linear
// map's second zero when s / a underflows to -0) becomes z - 1, the largest negative code.
BNB8_HD int bnb8_keep_sign(int q, int zero_code, float s) {
    return q >= zero_code && zero_code > 0 && s < 0.0f ? zero_code - 1 : q;
}
// With the optimizer's codebook (built with zero_code): s + 0 turns -0 into +0, which is not
// negative, so that the table's cap (for a negative q) agrees with bnb8_keep_sign. A zero block
// (a = 0) gets the zero code.
BNB8_HD int bnb8_quantize_value(const bnb8_codebook *cb, int zero_code, float s, float a) {
    s = s + 0.0f;
    return a > 0.0f ? bnb8_keep_sign(bnb8_nearest_code_fast(cb, s / a), zero_code, s) : zero_code;
}
// Block-wise quantization's code of x (DESIGN.md §4) with the division: the zero code for a zero block
// and for a non-finite x. What the callers of bnb8_code_near take where *redo is set.
BNB8_HD int bnb8_quantize_code(const bnb8_codebook *cb, int zero_code, float x, float a) {
    return a > 0.0f && bnb8_isfinite(x) ? bnb8_nearest_code_fast(cb, x / a) : zero_code;
}

// The same code from r = bnb8_reciprocal(a), without dividing: bnb8_code_near (the table keeps
// the sign); where *redo is set, the caller must take bnb8_quantize_value's.
BNB8_HD int bnb8_quantize_value_near(const bnb8_codebook *cb, float s, float r, int *redo) {
    return bnb8_code_near(cb, (s + 0.0f) * r, redo);
}
// 1 / a for a block's absmax a, or NaN when 1 / a would not be a normal float (so that every
// value of the block is redone).
BNB8_HD float bnb8_reciprocal(float a) {
    return a >= 0x1p-125f && a <= 0x1p125f ? 1.0f / a : bnb8_bits_f32(0x7fc00000u);
}

// ==== [math.step] one optimizer update of one element (DESIGN.md §5.3) ===========================
// The host computes everything that is transcendental or in
// double (bias corrections, schedules) once per tensor and step into bnb8_step_args; the kernels
// and the CPU loops call bnb8_direction and bnb8_apply with them.

typedef struct {
    int kind;                    // bnb8_optim
    int nstates;                 // states per element: 0..3
    int first;                   // t == 1 (SGD's buffer starts at g')
    int nesterov;
    float gnorm_scale;           // g' = g * gnorm_scale
    float l2;                    // g' += l2 * p (Adam, SGD, RMSprop, Adagrad, LARS)
    float decay;                 // p *= decay = 1 - lr wd (AdamW, Lion, LAMB, AdEMAMix)
    float step_size;             // lr / bc1 for the Adam family, lr otherwise
    float beta1, one_minus_beta1, beta2, one_minus_beta2, beta3, one_minus_beta3;
    float inv_sqrt_bc2;          // 1 / sqrt(1 - beta2^t): a product, not a second division
    float inv_bc1;               // 1 / bc1 (AdEMAMix's m1 only)
    float eps, alpha, momentum, one_minus_dampening;
    float max_unorm;             // LAMB / LARS (0 = off)
} bnb8_step_args;

// Which states an optimizer keeps, and whether each is signed (else non-negative: unsigned map).
BNB8_HD int bnb8_state_count(int kind, float momentum) {
    switch (kind) {
    case BNB8_ADAMW: case BNB8_ADAM: case BNB8_LAMB: return 2;
    case BNB8_ADEMAMIX: return 3;
    case BNB8_SGD: case BNB8_LARS: return momentum != 0.0f ? 1 : 0;
    default: return 1;           // Lion, RMSprop, Adagrad
    }
}
// AdamW, Lion, LAMB and AdEMAMix decay the weight (p *= 1 - lr wd); the others add wd p to g.
BNB8_HD int bnb8_decoupled_decay(int kind) {
    return kind == BNB8_ADAMW || kind == BNB8_LION || kind == BNB8_LAMB || kind == BNB8_ADEMAMIX;
}
BNB8_HD int bnb8_state_signed(int kind, int state) {
    if (kind == BNB8_RMSPROP || kind == BNB8_ADAGRAD) return 0;
    if (kind == BNB8_ADEMAMIX) return state < 2;
    return state == 0;           // Adam family: m signed, v not; SGD, Lion: one signed state
}

// Updates the states s[] of one element in place and returns its update direction u (before the
// step size): p_new = bnb8_apply(a, p, u, trust). g is the raw gradient, finite. *root: the
// Adam family's sqrtf(s[1]), which its denominator needs (the GPU's fast codes reuse it); else 0.
BNB8_HD float bnb8_direction_root(const bnb8_step_args *a, float p, float g, float s[3], float *root) {
    float gs = g * a->gnorm_scale;
    if (a->l2 != 0.0f) gs = gs + a->l2 * p;
    *root = 0.0f;
    switch (a->kind) {
    case BNB8_ADAMW: case BNB8_ADAM: case BNB8_LAMB:
        s[0] = a->beta1 * s[0] + a->one_minus_beta1 * gs;
        s[1] = a->beta2 * s[1] + a->one_minus_beta2 * (gs * gs);
        *root = sqrtf(s[1]);
        return s[0] / (*root * a->inv_sqrt_bc2 + a->eps);
    case BNB8_SGD: case BNB8_LARS:
        if (a->nstates == 0) return gs;
        s[0] = a->first ? gs : a->momentum * s[0] + a->one_minus_dampening * gs;
        return a->nesterov ? gs + a->momentum * s[0] : s[0];
    case BNB8_LION: {
        float c = a->beta1 * s[0] + a->one_minus_beta1 * gs;
        s[0] = a->beta2 * s[0] + a->one_minus_beta2 * gs;
        return (float)((c > 0.0f) - (c < 0.0f));
    }
    case BNB8_RMSPROP:           // RMSprop's smoothing alpha is passed as beta2
        s[0] = a->beta2 * s[0] + a->one_minus_beta2 * (gs * gs);
        return gs / (sqrtf(s[0]) + a->eps);
    case BNB8_ADAGRAD:
        s[0] = s[0] + gs * gs;
        return gs / (sqrtf(s[0]) + a->eps);
    default:                     // AdEMAMix
        s[0] = a->beta1 * s[0] + a->one_minus_beta1 * gs;
        s[1] = a->beta3 * s[1] + a->one_minus_beta3 * gs;
        s[2] = a->beta2 * s[2] + a->one_minus_beta2 * (gs * gs);
        return (s[0] * a->inv_bc1 + a->alpha * s[1]) / (sqrtf(s[2]) * a->inv_sqrt_bc2 + a->eps);
    }
}

BNB8_HD float bnb8_direction(const bnb8_step_args *a, float p, float g, float s[3]) {
    float root;
    return bnb8_direction_root(a, p, g, s, &root);
}

BNB8_HD float bnb8_apply(const bnb8_step_args *a, float p, float u, float trust) {
    return p * a->decay - (a->step_size * trust) * u;
}

// Whether an element's step results can be kept: the new weight p finite in the weights' dtype
// (bf16 rounds |p| >= 0x1.ffp127 up to inf, fp16 |p| >= 65520) and its nstates new states finite.
// An element whose results are not keeps its weight and states and is counted, as one with a
// non-finite gradient (DESIGN.md §5.2): a finite gradient never spreads NaN or Inf.
BNB8_HD int bnb8_results_finite(float p, bnb8_dtype dtype, const float s[3], int nstates) {
    int ok = fabsf(p) < (dtype == BNB8_BF16 ? 0x1.ffp127f : dtype == BNB8_F16 ? 65520.0f : bnb8_bits_f32(0x7f800000u));
    for (int k = 0; k < nstates; k++) ok &= bnb8_isfinite(s[k]);
    return ok;
}

// LAMB / LARS: the factor that shrinks an update of squared norm u2 to at most max_unorm |p|.
BNB8_HD float bnb8_trust_ratio(float max_unorm, float p2, float u2) {
    if (max_unorm <= 0.0f || !(u2 > 0.0f)) return 1.0f;
    float limit = max_unorm * sqrtf(p2), unorm = sqrtf(u2);
    return unorm > limit ? limit / unorm : 1.0f;
}

// Percentile clipping: history holds the last 100 squared gradient norms (all set to the first at
// step 1); returns the gradient scale that clips the norm at that percentile of the history.
BNB8_HD float bnb8_percentile_scale(float history[100], int64_t step, float gnorm2, int percentile) {
    if (step <= 1) for (int i = 0; i < 100; i++) history[i] = gnorm2;
    else history[step % 100] = gnorm2;
    float sorted[100];
    for (int i = 0; i < 100; i++) {          // insertion sort: 100 values, once per tensor and step
        float v = history[i];
        int j = i;
        for (; j > 0 && sorted[j - 1] > v; j--) sorted[j] = sorted[j - 1];
        sorted[j] = v;
    }
    float clip = sqrtf(sorted[percentile]), current = sqrtf(gnorm2);
    return current > clip ? clip / current : 1.0f;
}

// ==== [math.sumsq] cfg.sum_squares: the sum of g^2 in one fixed order (DESIGN.md §5.4) ===========
// A quad (elements 4k..4k+3 of the tensor): a = 0, then a += g^2 in double (exact) for each finite
// g in order. A unit (128 elements, 32 quads) is a butterfly: for d = 16, 8, 4, 2, 1 every
// v[k] = v[k] + v[k ^ d] (the GPU's warp shuffles), its value v[0]. The tensor: strand s < 256 sums
// units s, s + 256, ... in order from 0; each 32 strands a butterfly; the 8 results in order from 0.
#define BNB8_SUMSQ_UNIT 128
#define BNB8_SUMSQ_STRANDS 256
BNB8_HD double bnb8_sumsq_quad(const float g[4]) {
    double a = 0.0;
    for (int j = 0; j < 4; j++) if (bnb8_isfinite(g[j])) a += (double)g[j] * g[j];
    return a;
}

// ==== [math.flash] master weight correction and companding of one element (DESIGN.md §6) =========
// A flash step of one group of 32 elements, on either back end:
//   per element  p = bnb8_master_load(...); g = bnb8_load(grad, ...);
//                s[k] = bnb8_expand_value(code_k, bnb8_scale_load(scales_k, scale_dtype, group), signed_k);
//                pn = bnb8_apply(a, p, bnb8_direction(a, p, g, s'), 1) on a copy s' of the states;
//                if bnb8_isfinite(g) and bnb8_results_finite(pn, dtype, s', nstates): bnb8_master_store(..., pn), s = s'
//                (else count it: weight, correction and s[k] stay as they were)
//   per group    amax_k = fmaxf over the group of bnb8_compand_magnitude(s[k], signed_k), from 0.0f;
//                scale_k = bnb8_scale_round(amax_k, scale_dtype); bnb8_scale_store(scales_k, scale_dtype, group, scale_k)
//   per element  code_k = bnb8_compand_value(s[k], scale_k, signed_k)

#define BNB8_FLASH_GROUP 32

BNB8_HD float bnb8_narrow_to_f32(uint16_t bits, bnb8_dtype narrow) {
    return narrow == BNB8_BF16 ? bnb8_bf16_to_f32(bits) : bnb8_f16_to_f32(bits);
}
BNB8_HD uint16_t bnb8_f32_to_narrow(float x, bnb8_dtype narrow) {
    return narrow == BNB8_BF16 ? bnb8_f32_to_bf16(x) : bnb8_f32_to_f16(x);
}

// Master weight correction (DESIGN.md §6.1). L such that 2^L is half an ulp of the narrow value n: its
// unbiased exponent E from its own bits (zero and subnormals: 1 - bias), L = E - M - 1.
BNB8_HD int bnb8_ecc_shift(uint16_t bits, bnb8_dtype narrow) {
    if (narrow == BNB8_BF16) { int e = (bits >> 7) & 0xff; return (e ? e : 1) - 127 - 7 - 1; }
    int e = (bits >> 10) & 0x1f;
    return (e ? e : 1) - 15 - 10 - 1;
}
BNB8_HD int32_t bnb8_ecc_qmax(int corr_bytes) { return corr_bytes == 1 ? 127 : 32767; }

// 2^e as a float, e in -149..127 (a power of two is exact there). x * bnb8_pow2(e) is ldexpf(x, e)
// whenever 2^e is a float: both are the exact product rounded once.
BNB8_HD float bnb8_pow2(int e) {
    return e >= -126 ? bnb8_bits_f32((uint32_t)(e + 127) << 23) : bnb8_bits_f32(1u << (e + 149));
}

// The correction of x whose narrow value is bits (= RNE(x)): round half away from zero of
// clamp((x - n) 2^-L, -1, 1) QMAX; 0 when n is not finite. x - n is exact, and so is the scaling
// by a power of two.
BNB8_HD int32_t bnb8_ecc_code(float x, uint16_t bits, bnb8_dtype narrow, int32_t qmax) {
    float n = bnb8_narrow_to_f32(bits, narrow);
    if (!bnb8_isfinite(n)) return 0;
    // (x - n) 2^-L, exactly: -L reaches 134 for bf16, past the largest float power of two, but
    // then x - n is tiny and the first factor 2^64 cannot overflow.
    float d = x - n;
    int up = -bnb8_ecc_shift(bits, narrow);
    if (up > 127) { d = d * 0x1p64f; up -= 64; }
    float t = d * bnb8_pow2(up);
    return (int32_t)roundf(fminf(fmaxf(t, -1.0f), 1.0f) * (float)qmax);
}
// q / QMAX, the correction's fraction of half an ulp (a table of 256 for int8 on the GPU).
BNB8_HD float bnb8_ecc_unit(int32_t q, int32_t qmax) { return (float)q / (float)qmax; }
// The master from the narrow bits, the code q and its unit: n + unit 2^L; n itself (its sign of
// zero too) when q = 0. L >= -134, so 2^L is a float.
BNB8_HD float bnb8_ecc_value_unit(uint16_t bits, bnb8_dtype narrow, int32_t q, float unit) {
    float n = bnb8_narrow_to_f32(bits, narrow);
    if (q == 0) return n;
    return n + unit * bnb8_pow2(bnb8_ecc_shift(bits, narrow));
}
// The master: n + (q / QMAX) 2^L.
BNB8_HD float bnb8_ecc_value(uint16_t bits, bnb8_dtype narrow, int32_t q, int32_t qmax) {
    return bnb8_ecc_value_unit(bits, narrow, q, bnb8_ecc_unit(q, qmax));
}

// Element i of a parameter as its master: bf16/fp16 with a correction array (corr_bytes 1 or 2),
// an fp32 master (corr_bytes 4), or the plain value (corr_bytes 0, fp32). The store writes RNE(x)
// and x's new correction (for an fp32 master, x).
BNB8_HD float bnb8_master_load(const void *param, bnb8_dtype dtype, const void *corr, int corr_bytes, int64_t i) {
    if (dtype == BNB8_F32 || corr_bytes == 0) return bnb8_load(param, dtype, i);
    if (corr_bytes == 4) return ((const float *)corr)[i];
    int32_t q = corr_bytes == 1 ? (int32_t)((const int8_t *)corr)[i] : (int32_t)((const int16_t *)corr)[i];
    return bnb8_ecc_value(((const uint16_t *)param)[i], dtype, q, bnb8_ecc_qmax(corr_bytes));
}
BNB8_HD void bnb8_master_store(void *param, bnb8_dtype dtype, void *corr, int corr_bytes, int64_t i, float x) {
    if (dtype == BNB8_F32 || corr_bytes == 0) { bnb8_store(param, dtype, i, x); return; }
    uint16_t bits = bnb8_f32_to_narrow(x, dtype);
    ((uint16_t *)param)[i] = bits;
    if (corr_bytes == 4) { ((float *)corr)[i] = x; return; }
    int32_t q = bnb8_ecc_code(x, bits, dtype, bnb8_ecc_qmax(corr_bytes));
    if (corr_bytes == 1) ((int8_t *)corr)[i] = (int8_t)q;
    else ((int16_t *)corr)[i] = (int16_t)q;
}

// Companded 8-bit states (DESIGN.md §6.2). What a group's scale covers: |x| of a signed state, sqrt(x)
// of a non-negative one; +0 for non-finite values (and negative ones of an unsigned state).
BNB8_HD float bnb8_compand_magnitude(float x, int is_signed) {
    if (!bnb8_isfinite(x)) return 0.0f;
    if (is_signed) return fabsf(x);
    return x > 0.0f ? sqrtf(x) : 0.0f;
}
// The stored scale of a group of absmax amax >= 0 (finite), a value that bnb8_scale_store keeps
// exactly: e6m10 rounds to nearest even (a value may exceed its scale by half an ulp, 2^-11 of it),
// bf16 and fp16 round up (scale >= amax), fp32 keeps amax. Each saturates at its largest finite
// value, never inf: the codes of values above it clamp at the top.
BNB8_HD float bnb8_scale_round(float amax, bnb8_dtype dtype) {
    if (dtype == BNB8_E6M10) return bnb8_e6m10_to_f32(bnb8_f32_to_e6m10(amax));
    if (dtype == BNB8_F32) return amax;
    if (dtype == BNB8_BF16) {   // the truncation, plus one unit where bits were cut
        uint32_t u = (bnb8_f32_bits(amax) + 0xffffu) & 0xffff0000u;
        return bnb8_bits_f32(u < 0x7f800000u ? u : 0x7f7f0000u);
    }
    uint16_t b = bnb8_f32_to_f16(amax);
    if (bnb8_f16_to_f32(b) < amax) b++;               // the next value up
    return bnb8_f16_to_f32(b < 0x7c00u ? b : 0x7bffu);
}
// Scale g of an array of group scales of dtype (any, e6m10 too); the store of a bnb8_scale_round value.
BNB8_HD float bnb8_scale_load(const void *scales, bnb8_dtype dtype, int64_t g) {
    if (dtype == BNB8_E6M10) return bnb8_e6m10_to_f32(((const uint16_t *)scales)[g]);
    return bnb8_load(scales, dtype, g);
}
BNB8_HD void bnb8_scale_store(void *scales, bnb8_dtype dtype, int64_t g, float scale) {
    if (dtype == BNB8_E6M10) ((uint16_t *)scales)[g] = bnb8_f32_to_e6m10(scale);
    else bnb8_store(scales, dtype, g, scale);
}
// The code byte of a state value x in a group of stored scale s. Signed: z = x/s, softsign
// y = 2z/(1+|z|), q = floor(127 y + 0.5) in [-127, 127] as int8. Unsigned: z = sqrt(x)/s,
// q = floor(255 z + 0.5). Scale 0 (an all-zero group), non-finite x or z: code 0.
// bnb8_compand_code takes m = bnb8_compand_magnitude(x, is_signed), which the group's scale
// needed already (a square root saved per unsigned value).
BNB8_HD uint8_t bnb8_compand_code(float x, float m, float scale, int is_signed) {
    if (!(scale > 0.0f) || !bnb8_isfinite(x)) return 0;
    if (is_signed) {
        float z = x / scale, y = (2.0f * z) / (1.0f + fabsf(z)), q = floorf(y * 127.0f + 0.5f);
        if (!(q == q)) return 0;
        return (uint8_t)(int)fminf(fmaxf(q, -127.0f), 127.0f);   // two's complement byte
    }
    float z = m / scale, q = floorf(z * 255.0f + 0.5f);
    if (!(q == q)) return 0;
    return (uint8_t)(int)fminf(fmaxf(q, 0.0f), 255.0f);
}
BNB8_HD uint8_t bnb8_compand_value(float x, float scale, int is_signed) {
    return bnb8_compand_code(x, bnb8_compand_magnitude(x, is_signed), scale, is_signed);
}
// The value of a code byte under scale s: signed y = q/127, z = y/(2 - |y|), x = z s; unsigned
// x = (q/255 s)^2. Code 0 is exactly 0 whatever the scale.
// Split in two so that the GPU reads the part that depends on the code alone from a table:
// unit = z for a signed code (y = q/127, z = y / (2 - |y|)), q/255 for an unsigned one.
BNB8_HD float bnb8_expand_unit(uint8_t code, int is_signed) {
    if (is_signed) {
        float y = (float)((int)code - (code & 0x80 ? 256 : 0)) / 127.0f;
        return y / (2.0f - fabsf(y));
    }
    return (float)code / 255.0f;
}
BNB8_HD float bnb8_expand_from_unit(float unit, float scale, int is_signed) {
    if (is_signed) return unit * scale;
    float w = unit * scale;
    return w * w;
}
BNB8_HD float bnb8_expand_value(uint8_t code, float scale, int is_signed) {
    if (code == 0) return 0.0f;
    return bnb8_expand_from_unit(bnb8_expand_unit(code, is_signed), scale, is_signed);
}

// ==== [math.four] 4-bit states: 16-value maps, nibbles, rank-1 scales, companded codes (DESIGN.md §5.7)
// Two codes per byte: element 2j in the low nibble of byte j, 2j + 1 in the high one. The high
// nibble of an odd n's last byte holds the pad code (bnb8_four_pad), which every writer keeps.
//   BNB8_STATE_4BIT (Li, Chen, Zhu, NeurIPS 2023): per state, an fp32 absmax per block as the 8-bit
//     format, or for the non-negative state of a matrix (cfg.row_size) the rank-1 scale of element
//     (r, c): min(row max r, column max c) of the state (bnb8_rank1_scale). Value = map[code] * scale
//     (map = bnb8_four_map of cfg.map), code = bnb8_four_code(book of the map, is_signed, x, scale).
//   BNB8_STATE_FLASH4: per state a scale per group of 32 as flash (bnb8_compand_magnitude,
//     bnb8_scale_round), code = bnb8_compand4_code, value = bnb8_expand4_value.
#define BNB8_FOUR_CODES 16

// Code c of a 4-bit map (map: cfg.map, BNB8_MAP_DYNAMIC or BNB8_MAP_LINEAR). Signed (m, momentum,
// Lion's EMA), either map: the dynamic map built as the 8-bit one (DESIGN.md §3) with 4 bits: a
// sign, then 3 levels i = 0..2 of 2^i values 10^(i-2) (0.1 + 0.9 (2k+1)/2^(i+1)) each, both signs, 0
// and 1, ascending; the exact values rounded to float. Unsigned (v, accumulators): under
// BNB8_MAP_DYNAMIC (the default) the linear map without zero, (c + 1) / 16: no value decodes to 0
// under a non-zero scale, so 1 / (sqrt(v) + eps) stays bounded (the paper's zero-point problem);
// under BNB8_MAP_LINEAR the linear map with zero, c / 15 rounded to float (IEEE division): the
// ablation that shows the problem.
BNB8_HD float bnb8_four_map(int map, int is_signed, int c) {
    const float dynamic[BNB8_FOUR_CODES] = {-0.8875f, -0.6625f, -0.4375f, -0.2125f, -0.0775f, -0.0325f, -0.0055f, 0.0f,
                                            0.0055f, 0.0325f, 0.0775f, 0.2125f, 0.4375f, 0.6625f, 0.8875f, 1.0f};
    if (is_signed) return dynamic[c & 15];
    return map == BNB8_MAP_LINEAR ? (float)(c & 15) / 15.0f : (float)((c & 15) + 1) * 0.0625f;
}
// The code of exact zero, which an all-zero block stores: 7 signed (the map's 0), 0 unsigned (c /
// 15's 0, or 1/16 of an absmax of 0, which decodes to 0).
BNB8_HD int bnb8_four_zero_code(int is_signed) { return is_signed ? 7 : 0; }
// The code an all-zero state holds: what bnb8_optimizer_add writes and what pads an odd n's last
// byte (the zero code of 4-bit states; code 0 of flash4, whose value is 0 under a zero scale).
BNB8_HD int bnb8_four_pad(int format, int is_signed) {
    return format == BNB8_STATE_4BIT ? bnb8_four_zero_code(is_signed) : 0;
}

// A 4-bit map's thresholds t (bnb8_threshold_of(map, 16, k)) and a lookup that gives
// bnb8_nearest_code_of(t, 16, x) with one table read instead of a binary search of four dependent
// reads (bnb8_four_nearest). Bucket 2k + sign of x (bnb8_four_bucket): k = 0 for |x| < 2^-12, then one
// k per 2^20 floats (8 per binade) up to 1, then [1, inf], then NaN. Its entry holds the number j of
// thresholds below the bucket's values and the one threshold t among them (NaN: none), so that the
// code of x is j + (t < x), or j + 1 for x = t at an odd j (the tie to the even index). A bucket with
// two or more thresholds has j = BNB8_FOUR_CODES and is searched (the maps of bnb8_four_map have none:
// their thresholds lie 1/16 apart or more above 2^-1, one per binade below).
#define BNB8_FOUR_LOOKUP_E0 115                                        // the exponent of 2^-12
#define BNB8_FOUR_LOOKUP_HALF ((127 - BNB8_FOUR_LOOKUP_E0) * 8 + 3)    // per sign: tiny, 96, [1, inf], NaN
typedef struct { float t; int32_t j; } bnb8_four_entry;
typedef struct {
    float t[BNB8_FOUR_CODES];                                // the thresholds, t[15] = +inf
    bnb8_four_entry entry[2 * BNB8_FOUR_LOOKUP_HALF];
} bnb8_four_book;

BNB8_HD int bnb8_four_bucket(float x) {
    uint32_t u = bnb8_f32_bits(x), mag = u & 0x7fffffffu;
    int k = (int)(mag >> 20) - (BNB8_FOUR_LOOKUP_E0 << 3) + 1;
    k = k < 0 ? 0 : k;                                                   // tiny
    k = k > BNB8_FOUR_LOOKUP_HALF - 2 ? BNB8_FOUR_LOOKUP_HALF - 2 : k;   // [1, inf]
    k = mag > 0x7f800000u ? BNB8_FOUR_LOOKUP_HALF - 1 : k;               // NaN
    return 2 * k + (int)(u >> 31);
}
// Entry b: the bucket's magnitudes [lo, hi] are its values [lo, hi] or [-hi, -lo]. NaN is below
// every threshold and equals none: j = 0, no threshold.
BNB8_HD bnb8_four_entry bnb8_four_entry_of(const float t[BNB8_FOUR_CODES], int b) {
    const int negative = b & 1, k = b >> 1;
    bnb8_four_entry e = {bnb8_bits_f32(0x7fc00000u), 0};
    if (k >= BNB8_FOUR_LOOKUP_HALF - 1) return e;
    uint32_t lo = 0, hi = 0x7f800000u;                                   // [1, inf]: lo below
    if (k == 0) hi = ((uint32_t)BNB8_FOUR_LOOKUP_E0 << 23) - 1u;
    else if (k == BNB8_FOUR_LOOKUP_HALF - 2) lo = 0x3f800000u;
    else { lo = (uint32_t)(k - 1 + (BNB8_FOUR_LOOKUP_E0 << 3)) << 20; hi = lo + 0xfffffu; }
    const float first = negative ? -bnb8_bits_f32(hi) : bnb8_bits_f32(lo), last = negative ? -bnb8_bits_f32(lo) : bnb8_bits_f32(hi);
    int inside = 0;
    for (int c = 0; c < BNB8_FOUR_CODES - 1; c++) {
        if (t[c] < first) e.j++;
        else if (t[c] <= last && inside++ == 0) e.t = t[c];
    }
    if (inside > 1) e.j = BNB8_FOUR_CODES;
    return e;
}
BNB8_HD void bnb8_four_book_init(bnb8_four_book *book, const float map[BNB8_FOUR_CODES]) {
    for (int k = 0; k < BNB8_FOUR_CODES; k++) book->t[k] = bnb8_threshold_of(map, BNB8_FOUR_CODES, k);
    for (int b = 0; b < 2 * BNB8_FOUR_LOOKUP_HALF; b++) book->entry[b] = bnb8_four_entry_of(book->t, b);
}
BNB8_HD int bnb8_four_nearest(const bnb8_four_book *book, float x) {
    const bnb8_four_entry e = book->entry[bnb8_four_bucket(x)];
    if (e.j >= BNB8_FOUR_CODES) return bnb8_nearest_code_of(book->t, BNB8_FOUR_CODES, x);
    return e.j + (e.t < x) + ((e.t == x) & e.j & 1);
}

// Code of state value s under scale a >= |s| (a block's absmax or a rank-1 scale): the nearest code
// of s / a (IEEE division) among the 16 of the map of book (bnb8_four_nearest: ties to the even
// index, as bnb8_nearest_code_of); a negative s never decodes to zero or above (bnb8_keep_sign: code
// 6 instead of 7 or more). a = 0 (an all-zero block, row or column): the zero code.
BNB8_HD int bnb8_four_code(const bnb8_four_book *book, int is_signed, float s, float a) {
    const int zero_code = bnb8_four_zero_code(is_signed);
    s = s + 0.0f;   // -0 is not negative: keep_sign leaves it at the zero code
    return a > 0.0f ? bnb8_keep_sign(bnb8_four_nearest(book, s / a), zero_code, s) : zero_code;
}

// Nibble i of packed codes q, and a byte of two.
BNB8_HD int bnb8_nibble(const uint8_t *q, int64_t i) { return (q[i >> 1] >> (4 * (int)(i & 1))) & 15; }
BNB8_HD uint8_t bnb8_nibble_pair(int even, int odd) { return (uint8_t)((even & 15) | (odd & 15) << 4); }

// Rank-1 normalization of a matrix of rows x cols (cfg.row_size = cols): maxima holds the rows' maxima
// (rows floats), then the columns' (cols floats); element i = r cols + c has the scale
// min(maxima[r], maxima[rows + c]), which is >= the element: its state / scale lies in [0, 1].
BNB8_HD float bnb8_rank1_min(const float *maxima, int64_t rows, int64_t r, int64_t c) {
    return fminf(maxima[r], maxima[rows + c]);
}
BNB8_HD float bnb8_rank1_scale(const float *maxima, int64_t rows, int64_t cols, int64_t i) {
    int64_t r = i / cols;
    return bnb8_rank1_min(maxima, rows, r, i - r * cols);
}

// Companded 4-bit codes (BNB8_STATE_FLASH4), flash's (§6.2) with 16 codes: m as bnb8_compand_code's.
// Signed: z = x/s, y = 2z/(1+|z|), q = floor(7 y + 0.5) in [-7, 7], the nibble its two's complement.
// Unsigned: z = sqrt(x)/s, k = floor(16 z + 0.5) (the nearest of 1..16, ties up), code k - 1 in
// [0, 15]: the levels (c + 1)/16 of the root exclude 0, as the 4-bit map of v does. Scale 0 (an
// all-zero group), a non-finite x: code 0.
BNB8_HD int bnb8_compand4_code(float x, float m, float scale, int is_signed) {
    if (!(scale > 0.0f) || !bnb8_isfinite(x)) return 0;
    if (is_signed) {
        float z = x / scale, y = (2.0f * z) / (1.0f + fabsf(z)), q = floorf(y * 7.0f + 0.5f);
        if (!(q == q)) return 0;
        return (int)fminf(fmaxf(q, -7.0f), 7.0f) & 15;
    }
    float q = floorf((m / scale) * 16.0f + 0.5f) - 1.0f;
    if (!(q == q)) return 0;
    return (int)fminf(fmaxf(q, 0.0f), 15.0f);
}
BNB8_HD int bnb8_compand4_value(float x, float scale, int is_signed) {
    return bnb8_compand4_code(x, bnb8_compand_magnitude(x, is_signed), scale, is_signed);
}
// The value of a companded 4-bit code under scale s: bnb8_expand_from_unit of its unit, y / (2 - |y|)
// for a signed code q (y = q/7, the nibble as two's complement; -8, never written, reads as -8/7),
// (c + 1)/16 for an unsigned one: x = unit s, or (unit s)^2. Code 0 signed is 0 whatever the scale;
// unsigned codes are 0 only under a zero scale.
BNB8_HD float bnb8_expand4_unit(int code, int is_signed) {
    if (is_signed) {
        float y = (float)((code & 7) - (code & 8)) / 7.0f;
        return y / (2.0f - fabsf(y));
    }
    return (float)((code & 15) + 1) * 0.0625f;
}
BNB8_HD float bnb8_expand4_value(int code, float scale, int is_signed) {
    return bnb8_expand_from_unit(bnb8_expand4_unit(code, is_signed), scale, is_signed);
}

// ==== [math.fast] the GPU's vouched fast forms of the flash math =================================
// Fast forms of the flash math for the GPU's default configuration (bf16 weights, int8
// corrections): each gives the exact function's result, or clears *ok where it cannot vouch for
// it (then the caller uses the exact function). Shared, so that the CPU tests hold them to the
// exact ones. The reciprocal may be the GPU's approximation, within 1 ulp of the correctly
// rounded value (CUDA's documented bound; test_gpu measures it on the device). A code is kept
// only when its w is at least BNB8_NEAR_CODE away from a tie: over 2.5x what the approximation
// and both sides' roundings can move it (2^-13.3 for 127 y, less for 255 z).
#define BNB8_NEAR_CODE 0x1p-11f

#ifndef BNB8_APPROX_TEST
#ifdef __CUDA_ARCH__
BNB8_HD float bnb8_rcp_approx(float x) { float r; asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(x)); return r; }
#else
BNB8_HD float bnb8_rcp_approx(float x) { return 1.0f / x; }
#endif
#else   // the test defines it, with the worst errors allowed
float bnb8_rcp_approx(float x);
#endif

// The int8 correction table entry of code q: its unit, and -0 for q = 0 (x + -0 is x, even -0).
BNB8_HD float bnb8_ecc8_entry(int32_t q) { return q ? bnb8_ecc_unit(q, 127) : -0.0f; }

// bnb8_ecc_value(bits, BF16, q, 127) from entry = bnb8_ecc8_entry(q): 2^L from the exponent
// field e alone, vouched for e >= 9 (zero and tiny weights are left to the exact function: rare
// after the first step).
BNB8_HD float bnb8_ecc8_value_fast(uint32_t bits, float entry, int *ok) {
    uint32_t e = (bits << 16) & 0x7f800000u;
    *ok &= e >= (9u << 23);
    return bnb8_bf16_to_f32((uint16_t)bits) + entry * bnb8_bits_f32(e - (8u << 23));
}

// bnb8_ecc_code(x, bits, BF16, 127) when bits = RNE(x): (x - n) 2^-L 127 is one exact scaling
// and rounding, |t| <= 1 without the clamp, for exponent fields 14..254 (else t may be NaN: 0).
BNB8_HD int32_t bnb8_ecc8_code_fast(float x, uint32_t bits, int *ok) {
    uint32_t e = (bits << 16) & 0x7f800000u;
    int normal = e - (14u << 23) <= ((254u - 14u) << 23);
    *ok &= normal;
    float t = (x - bnb8_bf16_to_f32((uint16_t)bits)) * bnb8_bits_f32(0x867e0000u - e);   // 127 2^-L
    return (int32_t)roundf(normal ? t : 0.0f);
}

// The reciprocal of a group scale for the fast codes; *ok cleared for scales outside
// [2^-120, 2^120] other than 0, where the approximation and the products could leave the normal
// range. Scale 0 (an all-zero group) gives 0: codes 0, as the exact ones.
BNB8_HD float bnb8_compand_rcp(float scale, int *ok) {
    *ok &= scale == 0.0f || (scale >= 0x1p-120f && scale <= 0x1p120f);
    return scale == 0.0f ? 0.0f : bnb8_rcp_approx(scale);
}

// The e6m10 bits of the scale of a group of absmax amax (>= 0, not NaN) for the fast codes, *ok
// cleared unless amax is 0 or in [2^-39, BNB8_E6M10_MAX]: then the scale is 0 or normal, so that
// no value exceeds it by more than half an ulp (2^-11 of it), and the top code's w (at most
// 127.03 signed, 255.13 unsigned) rounds to the code the exact function clamps to. Where vouched
// for, bnb8_f32_to_e6m10(amax) by its normal branch alone (no subnormal rounding, no saturation:
// MAX itself is 0xffff); elsewhere the bits mean nothing.
BNB8_HD uint32_t bnb8_scale_e6m10_fast(float amax, int *ok) {
    *ok &= amax == 0.0f || (amax >= 0x1p-39f && amax <= BNB8_E6M10_MAX);
    uint32_t r = bnb8_f32_bits(amax) - (87u << 23);
    r = (r + 0xfffu + ((r >> 13) & 1u)) >> 13;
    return amax > 0.0f ? r & 0xffffu : 0u;
}
// bnb8_e6m10_to_f32(h) for 0 and the normal scales; *ok cleared for a subnormal h (0 < h < 0x400),
// which a group of tiny values may have stored: the exact path decodes it.
BNB8_HD float bnb8_e6m10_fast_to_f32(uint32_t h, int *ok) {
    *ok &= h == 0 || h >= 0x400u;
    return h ? bnb8_bits_f32((h + (87u << 10)) << 13) : 0.0f;
}

// w (|w| < 2^22) nearest to an integer k, as k's low byte; *ok cleared when w is within
// BNB8_NEAR_CODE of a tie, or NaN. 1.5 * 2^23 makes the float add round w to an integer.
BNB8_HD uint32_t bnb8_code_round(float w, int *ok) {
    float m = w + 0x1.8p23f, k = m - 0x1.8p23f;
    *ok &= fabsf(w - k) < 0.5f - BNB8_NEAR_CODE;
    return bnb8_f32_bits(m) & 0xffu;
}

// bnb8_compand_value(x, scale, 1) for |x| <= scale (a group's scale covers its values; or up to
// half an ulp above an e6m10 scale vouched for by bnb8_scale_e6m10_fast), from
// r254 = 254 * bnb8_compand_rcp(scale): 127 y = 254 z / (1 + |z|) = z254 / (1 + |z254| / 254).
BNB8_HD uint32_t bnb8_compand_signed_fast(float x, float r254, int *ok) {
    float z = x * r254;
    return bnb8_code_round(z * bnb8_rcp_approx(fmaf(fabsf(z), 1.0f / 254.0f, 1.0f)), ok);
}

// bnb8_compand_value(v, scale, 0) from root = sqrtf(v) (v >= 0, or not finite), for root <= scale (or as above),
// from r255 = 255 * bnb8_compand_rcp(scale): 255 root / scale. The exact code's m is that root.
BNB8_HD uint32_t bnb8_compand_root_fast(float root, float r255, int *ok) {
    return bnb8_code_round(root * r255, ok);
}

// ==== [gpu.step] one step's tensor descriptors, the launch, memory helpers (DESIGN.md §10) =======
// The optimizer's GPU path: bnb8.c describes each GPU tensor of a step (its arrays and
// the step's constants, computed on the host) and bnb8_cuda.cu steps them all in one launch, and
// the 8-bit ones with one absmax per tensor (blocksize 0) and the rank-1 4-bit ones in two more, as
// the CPU's two passes; tensors that round stochastically are stepped so apart from the others
// (kernels of their own).

typedef struct {
    void *param;
    const void *grad;
    void *state[3];              // (n) floats, (n) codes, or (ceil(n / 2)) bytes of 4-bit codes
    float *absmax[3];            // (ceil(n / blocksize)) per 8-bit or 4-bit state; (1) for blocksize 0;
                                 // (rows + row_size) maxima of a rank-1 state
    float *history;              // (100) squared gradient norms when percentile clipping is on
    int64_t n;
    int64_t step;                // the tensor's step count, this step included
    int64_t first_chunk;         // filled by bnb8_cuda.cu: index of this tensor's first chunk
    int32_t param_dtype, grad_dtype, eight_bit, blocksize, percentile;
    bnb8_step_args args;
    int32_t format;              // bnb8_state_format of the states (32-bit, 8-bit, flash, 4-bit, flash4)
    int32_t correction_bytes;    // 0, or 1 / 2 / 4: param is bf16/fp16 with an int8/int16 correction or fp32 master
    int32_t scale_dtype;         // flash states: the dtype of the group scales
    void *correction;            // (n) int8, int16 or fp32, when correction_bytes > 0
    void *scale[2];              // flash and flash4 states: (ceil(n / 32)) scales per state
    int64_t rows, row_size;      // 4-bit states of a matrix: state rank1_k is rank-1 normalized; else 0
    int32_t rank1_k;
    unsigned *rank1_max;         // filled by bnb8_cuda.cu: the step's new row and column maxima (float bits)
    double *sum_squares;         // (1) where this step's sum of g^2 goes (cfg.sum_squares), else NULL
    const float *gnorm_scale_at; // cfg.gnorm_scale_at: a device float args.gnorm_scale is multiplied by, or NULL
    double *units;               // filled by bnb8_cuda.cu: the tensor's per-128-element partial sums
    bnb8_rounding rounding;      // stochastic rounding (DESIGN.md §6.6): on for every tensor of a launch or none
} bnb8_gpu_tensor;

// Steps count tensors on stream; *context holds the optimizer's device scratch (created on first
// use, freed by bnb8_cuda_context_free). Non-finite gradients are counted on the device. Either every
// tensor rounds stochastically (rounding.on: kernels of their own) or none does.
bnb8_status bnb8_cuda_step(void **context, const bnb8_gpu_tensor *tensors, int count,
                           const float code_unsigned[256], const float code_signed[256],
                           const float four_maps[2][BNB8_FOUR_CODES], const bnb8_codebook books[2],
                           struct CUstream_st *stream);
bnb8_status bnb8_cuda_take_nonfinite(void *context, int64_t *count);
void bnb8_cuda_context_free(void *context);
// Memory helpers for bnb8.c: is p GPU memory; allocate zeroed; free; copy (to_device: host -> GPU).
int bnb8_cuda_is_device_pointer(const void *p);
bnb8_status bnb8_cuda_alloc_zeroed(void **p, size_t bytes);
void bnb8_cuda_free(void *p);
bnb8_status bnb8_cuda_copy(void *dst, const void *src, size_t bytes, int to_device);
// fp32 masters of a GPU tensor, all in device memory: to_weights 1 stores fp32 into param + corr
// (bnb8_master_store), 0 loads them into fp32 (bnb8_master_load; corr_bytes 0: the weights widened).
// Waits for the device.
bnb8_status bnb8_cuda_masters(void *param, bnb8_dtype dtype, void *corr, int corr_bytes, int64_t n, float *fp32,
                              int to_weights);

#ifdef __cplusplus
}
#endif
#endif // BNB8_INTERNAL
