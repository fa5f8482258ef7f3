/*
gpt2_cuda.cu — the GPT-2 model (gpt2_cpu.c's, the same tensors and math) on one NVIDIA GPU: forward and backward in
fp32 (parity with the CPU model) or bf16 (speed), interface in gpt2_cuda.h.

Written from the math, in the flat style of the CPU model: one kernel per operation, shapes in
comments, N = B*T rows. Matrix products go through cuBLASLt with fp32 accumulation
(CUBLAS_COMPUTE_32F: no TF32, so the fp32 mode stays within rounding of the CPU); attention is the
plain form, two batched products around a causal softmax, with the probabilities kept per layer.
Activation recomputation (config recompute = 1) keeps only each layer's output, the residual stream,
and re-runs a layer's forward (layer_forward, the one the forward runs) into one layer's buffers just
before that layer's backward.
Row kernels (LayerNorm, softmax, cross-entropy, head permutes) move 16 bytes per access when the row
length allows it and fall back to scalar versions otherwise (both paths are tested).

Determinism: every reduction (bias and LayerNorm parameter gradients, wpe and wte gradients, the
gradient norm) sums in a fixed order, without atomics, so a step gives the same bits every run
(given the same cuBLASLt algorithms).
*/
#include "gpt2_cuda.h"
#include "bnb8.h"          // bnb8_f32_to_bf16 / bnb8_bf16_to_f32: round to nearest even, as the GPU's
#include <cuda_runtime.h>
#include <cuda_bf16.h>
#include <cublasLt.h>
#include <stdio.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>

typedef __nv_bfloat16 bf16;

// ------------------------------------------------------------------------------------------------
// Errors: every failure leaves "what: where: why" here and returns -1.

static thread_local char gpt2_cuda_error_text[1024];

static int fail(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(gpt2_cuda_error_text, sizeof gpt2_cuda_error_text, fmt, ap);
    va_end(ap);
    return -1;
}

extern "C" const char *gpt2_cuda_last_error(void) { return gpt2_cuda_error_text; }

#define CU(call) do { cudaError_t e_ = (call); \
    if (e_ != cudaSuccess) return fail("%s:%d: %s: %s", __FILE__, __LINE__, #call, cudaGetErrorString(e_)); } while (0)
// after every kernel launch: a bad configuration shows here, a fault at the next synchronization
#define LAUNCHED() CU(cudaGetLastError())

// ------------------------------------------------------------------------------------------------
// Element types: fp32 or bf16 storage, fp32 arithmetic.

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(bf16 x) { return __bfloat162float(x); }
template <typename T> __device__ __forceinline__ T from_float(float x);
template <> __device__ __forceinline__ float from_float<float>(float x) { return x; }
template <> __device__ __forceinline__ bf16 from_float<bf16>(float x) { return __float2bfloat16_rn(x); }

template <typename T> static cudaDataType cuda_type(void);
template <> cudaDataType cuda_type<float>(void) { return CUDA_R_32F; }
template <> cudaDataType cuda_type<bf16>(void) { return CUDA_R_16BF; }

// W elements in one 16-byte access (W = 1: the scalar fallback for odd sizes or alignments).
template <typename T, int W> struct alignas(sizeof(T) * W) Pack { T v[W]; };

__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}
__device__ __forceinline__ float warp_max(float v) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}
// Sum or max over the block (blockDim.x a multiple of 32); every thread gets the result.
__device__ float block_reduce(float v, bool is_max) {
    __shared__ float shared[32];
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
    v = is_max ? warp_max(v) : warp_sum(v);
    __syncthreads();                      // a previous call may still be reading shared
    if (lane == 0) shared[warp] = v;
    __syncthreads();
    v = lane < nwarps ? shared[lane] : (is_max ? -INFINITY : 0.0f);
    return is_max ? warp_max(v) : warp_sum(v);
}

// ------------------------------------------------------------------------------------------------
// Kernels

// Encoder, three modes over (N, C), t = row % T:
// 0: out = wte[token] + wpe[t]   1: out += wpe[t] (StableEmbedding, after its LayerNorm)   2: out = wte[token]
template <typename T>
__global__ void encoder_forward_kernel(T *out, const T *wte, const T *wpe, const int *inputs, int64_t N, int T_,
                                       int C, int mode) {
    int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
    if (i >= N * C) return;
    int64_t row = i / C, c = i % C, t = row % T_;
    float tok = mode == 1 ? to_float(out[i]) : to_float(wte[(int64_t)inputs[row] * C + c]);
    out[i] = from_float<T>(mode == 2 ? tok : tok + to_float(wpe[t * C + c]));
}

// out (N, C) = (inp - mean) * rstd * weight + bias per row; mean, rstd (N) kept. One warp per row.
template <typename T>
__global__ void layernorm_forward_kernel(T *out, float *mean, float *rstd, const T *inp, const T *weight,
                                         const T *bias, int64_t N, int C) {
    int64_t row = blockIdx.x * (int64_t)(blockDim.x / 32) + threadIdx.x / 32;
    int lane = threadIdx.x % 32;
    if (row >= N) return;
    const T *x = inp + row * C;
    float s = 0.0f;
    for (int i = lane; i < C; i += 32) s += to_float(x[i]);
    float m = warp_sum(s) / (float)C;
    float v = 0.0f;
    for (int i = lane; i < C; i += 32) { float d = to_float(x[i]) - m; v += d * d; }
    v = warp_sum(v) / (float)C;
    float r = 1.0f / sqrtf(v + 1e-5f);
    T *y = out + row * C;
    for (int i = lane; i < C; i += 32)
        y[i] = from_float<T>((to_float(x[i]) - m) * r * to_float(weight[i]) + to_float(bias[i]));
    if (lane == 0) { mean[row] = m; rstd[row] = r; }
}

// dinp (N, C) (+)= d(layernorm)/d(inp) . dout, one warp per row. The parameter gradients are
// column sums: colsum_* below.
template <typename T>
__global__ void layernorm_backward_dx_kernel(T *dinp, const T *dout, const T *inp, const T *weight,
                                             const float *mean, const float *rstd, int64_t N, int C,
                                             int accumulate) {
    int64_t row = blockIdx.x * (int64_t)(blockDim.x / 32) + threadIdx.x / 32;
    int lane = threadIdx.x % 32;
    if (row >= N) return;
    const T *x = inp + row * C, *dy = dout + row * C;
    float m = mean[row], s = rstd[row], dmean = 0.0f, dnorm_mean = 0.0f;
    for (int i = lane; i < C; i += 32) {
        float norm = (to_float(x[i]) - m) * s, dn = to_float(weight[i]) * to_float(dy[i]);
        dmean += dn;
        dnorm_mean += dn * norm;
    }
    dmean = warp_sum(dmean) / (float)C;
    dnorm_mean = warp_sum(dnorm_mean) / (float)C;
    T *dx = dinp + row * C;
    for (int i = lane; i < C; i += 32) {
        float norm = (to_float(x[i]) - m) * s, dn = to_float(weight[i]) * to_float(dy[i]);
        float d = (dn - dmean - norm * dnorm_mean) * s;
        dx[i] = from_float<T>(accumulate ? to_float(dx[i]) + d : d);
    }
}

// Column sums of (N, OC) in two deterministic passes. Pass 1: block (32 columns, 8 row lanes) sums
// rows [chunk * COLSUM_ROWS, +COLSUM_ROWS) into partial (nchunks, W, OC). LN = 0: W = 1, the sum of
// dout (a bias gradient); LN = 1: W = 2, the sums of dout * xhat and of dout (LayerNorm weight, bias).
#define COLSUM_ROWS 256
template <typename T, int LN>
__global__ void colsum_partial_kernel(float *partial, const T *dout, const T *inp, const float *mean,
                                      const float *rstd, int64_t N, int OC) {
    __shared__ float sh[2][8][32];
    int tx = threadIdx.x, ty = threadIdx.y;
    int64_t c = blockIdx.x * 32 + tx, chunk = blockIdx.y;
    int64_t r0 = chunk * COLSUM_ROWS, r1 = r0 + COLSUM_ROWS < N ? r0 + COLSUM_ROWS : N;
    float s0 = 0.0f, s1 = 0.0f;
    if (c < OC)
        for (int64_t r = r0 + ty; r < r1; r += 8) {
            float dy = to_float(dout[r * OC + c]);
            if (LN) { s0 += dy * ((to_float(inp[r * OC + c]) - mean[r]) * rstd[r]); s1 += dy; }
            else s0 += dy;
        }
    sh[0][ty][tx] = s0;
    sh[1][ty][tx] = s1;
    __syncthreads();
    if (ty == 0 && c < OC) {
        float t0 = 0.0f, t1 = 0.0f;
        for (int y = 0; y < 8; y++) { t0 += sh[0][y][tx]; t1 += sh[1][y][tx]; }
        if (LN) { partial[(chunk * 2) * OC + c] = t0; partial[(chunk * 2 + 1) * OC + c] = t1; }
        else partial[chunk * OC + c] = t0;
    }
}
// Pass 2: g0 (and g1 for W = 2) (+)= the chunks' partials, summed in chunk order.
template <typename G>
__global__ void colsum_finish_kernel(G *g0, G *g1, const float *partial, int nchunks, int OC, int W, int accumulate) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= W * OC) return;
    int w = i / OC, c = i % OC;
    float s = 0.0f;
    for (int k = 0; k < nchunks; k++) s += partial[((int64_t)k * W + w) * OC + c];
    G *g = w == 0 ? g0 : g1;
    g[c] = from_float<G>(accumulate ? to_float(g[c]) + s : s);
}

// Heads layout for the batched products: src (B, T, P, NH, hs) -> dst (P, B, NH, T, hs), P = 3 for
// q, k, v out of qkv (B, T, 3C), P = 1 for one (B, T, C) tensor. unpermute is the inverse.
template <typename T>
__global__ void permute_heads_kernel(T *dst, const T *src, int B, int T_, int P, int NH, int hs) {
    int64_t n = (int64_t)P * B * NH * T_ * hs, i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
    if (i >= n) return;
    int64_t d = i % hs, r = i / hs, t = r % T_; r /= T_;
    int64_t h = r % NH; r /= NH;
    int64_t b = r % B, p = r / B, C = (int64_t)NH * hs;
    dst[i] = src[((b * T_ + t) * P + p) * C + h * hs + d];
}
template <typename T>
__global__ void unpermute_heads_kernel(T *dst, const T *src, int B, int T_, int P, int NH, int hs) {
    int64_t C = (int64_t)NH * hs, n = (int64_t)B * T_ * P * C, i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
    if (i >= n) return;
    int64_t d = i % hs, h = (i / hs) % NH, p = (i / C) % P, bt = i / (P * C), b = bt / T_, t = bt % T_;
    dst[i] = src[(((p * B + b) * NH + h) * T_ + t) * hs + d];
}

// Causal softmax in place over rows of att (B*NH*T, T) holding scaled scores: row t keeps columns
// 0..t (only those are read), the rest become 0. One warp per row.
template <typename T>
__global__ void softmax_causal_forward_kernel(T *att, int64_t rows, int T_) {
    int64_t row = blockIdx.x * (int64_t)(blockDim.x / 32) + threadIdx.x / 32;
    int lane = threadIdx.x % 32;
    if (row >= rows) return;
    int t = (int)(row % T_);
    T *x = att + row * T_;
    float mx = -INFINITY;
    for (int j = lane; j <= t; j += 32) mx = fmaxf(mx, to_float(x[j]));
    mx = warp_max(mx);
    float s = 0.0f;
    for (int j = lane; j <= t; j += 32) s += expf(to_float(x[j]) - mx);
    float inv = 1.0f / warp_sum(s);
    for (int j = lane; j < T_; j += 32) x[j] = from_float<T>(j <= t ? expf(to_float(x[j]) - mx) * inv : 0.0f);
}

// Through the softmax, in place of datt (B*NH*T, T): a (datt - sum a datt) * scale on 0..t, else 0.
template <typename T>
__global__ void softmax_causal_backward_kernel(T *datt, const T *att, int64_t rows, int T_, float scale) {
    int64_t row = blockIdx.x * (int64_t)(blockDim.x / 32) + threadIdx.x / 32;
    int lane = threadIdx.x % 32;
    if (row >= rows) return;
    int t = (int)(row % T_);
    T *d = datt + row * T_;
    const T *a = att + row * T_;
    float dot = 0.0f;
    for (int j = lane; j <= t; j += 32) dot += to_float(a[j]) * to_float(d[j]);
    dot = warp_sum(dot);
    for (int j = lane; j < T_; j += 32)
        d[j] = from_float<T>(j <= t ? to_float(a[j]) * (to_float(d[j]) - dot) * scale : 0.0f);
}

// ---- 16-byte versions of the row kernels above (the same math): each lane moves W = 16 / sizeof(T)
// elements per access, so a row of C = 768 bf16 is 3 accesses per lane instead of 24 dependent ones.
// Used when the row length is a multiple of W (rows then stay 16-byte aligned); else the scalar ones.
template <typename T> struct VecW { static constexpr int W = 16 / sizeof(T); };
template <typename T>
__device__ __forceinline__ void load_pack(float *v, const T *src) {
    Pack<T, VecW<T>::W> p = *(const Pack<T, VecW<T>::W> *)src;
    #pragma unroll
    for (int k = 0; k < VecW<T>::W; k++) v[k] = to_float(p.v[k]);
}
template <typename T>
__device__ __forceinline__ void store_pack(T *dst, const float *v) {
    Pack<T, VecW<T>::W> p;
    #pragma unroll
    for (int k = 0; k < VecW<T>::W; k++) p.v[k] = from_float<T>(v[k]);
    *(Pack<T, VecW<T>::W> *)dst = p;
}

template <typename T>
__global__ void layernorm_forward_vec_kernel(T *__restrict__ out, float *__restrict__ mean, float *__restrict__ rstd,
                                             const T *__restrict__ inp, const T *__restrict__ weight,
                                             const T *__restrict__ bias, int64_t N, int C) {
    constexpr int W = VecW<T>::W;
    int64_t row = blockIdx.x * (int64_t)(blockDim.x / 32) + threadIdx.x / 32;
    int lane = threadIdx.x % 32;
    if (row >= N) return;
    const T *x = inp + row * C;
    float s = 0.0f, v[W], w[W], b[W];
    for (int i = lane * W; i < C; i += 32 * W) { load_pack(v, x + i); for (int k = 0; k < W; k++) s += v[k]; }
    float m = warp_sum(s) / (float)C, var = 0.0f;
    for (int i = lane * W; i < C; i += 32 * W) { load_pack(v, x + i); for (int k = 0; k < W; k++) { float d = v[k] - m; var += d * d; } }
    var = warp_sum(var) / (float)C;
    float r = 1.0f / sqrtf(var + 1e-5f);
    for (int i = lane * W; i < C; i += 32 * W) {
        load_pack(v, x + i); load_pack(w, weight + i); load_pack(b, bias + i);
        for (int k = 0; k < W; k++) v[k] = (v[k] - m) * r * w[k] + b[k];
        store_pack(out + row * C + i, v);
    }
    if (lane == 0) { mean[row] = m; rstd[row] = r; }
}

template <typename T>
__global__ void layernorm_backward_dx_vec_kernel(T *__restrict__ dinp, const T *__restrict__ dout, const T *__restrict__ inp,
                                                 const T *__restrict__ weight, const float *__restrict__ mean,
                                                 const float *__restrict__ rstd, int64_t N, int C, int accumulate) {
    constexpr int W = VecW<T>::W;
    int64_t row = blockIdx.x * (int64_t)(blockDim.x / 32) + threadIdx.x / 32;
    int lane = threadIdx.x % 32;
    if (row >= N) return;
    const T *x = inp + row * C, *dy = dout + row * C;
    float m = mean[row], s = rstd[row], dmean = 0.0f, dnorm_mean = 0.0f, xv[W], wv[W], dv[W], o[W];
    for (int i = lane * W; i < C; i += 32 * W) {
        load_pack(xv, x + i); load_pack(wv, weight + i); load_pack(dv, dy + i);
        for (int k = 0; k < W; k++) { float norm = (xv[k] - m) * s, dn = wv[k] * dv[k]; dmean += dn; dnorm_mean += dn * norm; }
    }
    dmean = warp_sum(dmean) / (float)C;
    dnorm_mean = warp_sum(dnorm_mean) / (float)C;
    for (int i = lane * W; i < C; i += 32 * W) {
        load_pack(xv, x + i); load_pack(wv, weight + i); load_pack(dv, dy + i);
        if (accumulate) load_pack(o, dinp + row * C + i);
        for (int k = 0; k < W; k++) {
            float norm = (xv[k] - m) * s, dn = wv[k] * dv[k], d = (dn - dmean - norm * dnorm_mean) * s;
            o[k] = accumulate ? o[k] + d : d;
        }
        store_pack(dinp + row * C + i, o);
    }
}

// Causal softmax rows, 16 bytes at a time: packs that start past column t are not read.
template <typename T>
__global__ void softmax_causal_forward_vec_kernel(T *__restrict__ att, int64_t rows, int T_) {
    constexpr int W = VecW<T>::W;
    int64_t row = blockIdx.x * (int64_t)(blockDim.x / 32) + threadIdx.x / 32;
    int lane = threadIdx.x % 32;
    if (row >= rows) return;
    int t = (int)(row % T_);
    T *x = att + row * T_;
    float v[W], mx = -INFINITY, s = 0.0f;
    for (int j = lane * W; j <= t; j += 32 * W) { load_pack(v, x + j); for (int k = 0; k < W; k++) if (j + k <= t) mx = fmaxf(mx, v[k]); }
    mx = warp_max(mx);
    for (int j = lane * W; j <= t; j += 32 * W) { load_pack(v, x + j); for (int k = 0; k < W; k++) if (j + k <= t) s += expf(v[k] - mx); }
    float inv = 1.0f / warp_sum(s);
    for (int j = lane * W; j < T_; j += 32 * W) {
        if (j <= t) load_pack(v, x + j);
        for (int k = 0; k < W; k++) v[k] = j + k <= t ? expf(v[k] - mx) * inv : 0.0f;
        store_pack(x + j, v);
    }
}

template <typename T>
__global__ void softmax_causal_backward_vec_kernel(T *__restrict__ datt, const T *__restrict__ att, int64_t rows, int T_,
                                                   float scale) {
    constexpr int W = VecW<T>::W;
    int64_t row = blockIdx.x * (int64_t)(blockDim.x / 32) + threadIdx.x / 32;
    int lane = threadIdx.x % 32;
    if (row >= rows) return;
    int t = (int)(row % T_);
    T *d = datt + row * T_;
    const T *a = att + row * T_;
    float av[W], dv[W], dot = 0.0f;
    for (int j = lane * W; j <= t; j += 32 * W) {
        load_pack(av, a + j); load_pack(dv, d + j);
        for (int k = 0; k < W; k++) if (j + k <= t) dot += av[k] * dv[k];
    }
    dot = warp_sum(dot);
    for (int j = lane * W; j < T_; j += 32 * W) {
        if (j <= t) { load_pack(av, a + j); load_pack(dv, d + j); }
        for (int k = 0; k < W; k++) dv[k] = j + k <= t ? av[k] * (dv[k] - dot) * scale : 0.0f;
        store_pack(d + j, dv);
    }
}

// Softmax + cross-entropy, 16 bytes at a time (Vp a multiple of W), max and sum in one pass (a running
// max, the sum rescaled when it grows), then the gradient pass: two reads of the logits, not three.
template <typename T>
__global__ void crossentropy_vec_kernel(T *__restrict__ logits, float *__restrict__ losses, const int *__restrict__ targets,
                                        int V, int Vp, int write_grad, float dloss) {
    constexpr int W = VecW<T>::W;
    int64_t row = blockIdx.x;
    T *x = logits + row * Vp;
    int target = targets[row];
    float target_logit = to_float(x[target]), v[W], mx = -INFINITY, s = 0.0f;
    for (int i = threadIdx.x * W; i < V; i += blockDim.x * W) {
        load_pack(v, x + i);
        for (int k = 0; k < W; k++) {
            if (i + k >= V) break;
            if (v[k] > mx) { s = s * expf(mx - v[k]) + 1.0f; mx = v[k]; }
            else s += expf(v[k] - mx);
        }
    }
    float M = block_reduce(mx, true);
    float S = block_reduce(mx == -INFINITY ? 0.0f : s * expf(mx - M), false);
    if (threadIdx.x == 0) losses[row] = logf(S) - (target_logit - M);
    if (!write_grad) return;
    float inv = 1.0f / S;
    for (int i = threadIdx.x * W; i < Vp; i += blockDim.x * W) {
        load_pack(v, x + i);
        for (int k = 0; k < W; k++)
            v[k] = i + k < V ? (expf(v[k] - M) * inv - (i + k == target ? 1.0f : 0.0f)) * dloss : 0.0f;
        store_pack(x + i, v);
    }
}

// Heads layout, 16 bytes at a time (hs a multiple of W), 32-bit index arithmetic (n < 2^32): the
// scalar version's six 64-bit divisions per element cost more than its memory traffic.
template <typename T>
__global__ void permute_heads_vec_kernel(T *__restrict__ dst, const T *__restrict__ src, int B, int T_, int P, int NH,
                                         int hs, int inverse) {
    constexpr int W = VecW<T>::W;
    unsigned npack = (unsigned)P * B * NH * T_ * (hs / W), i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= npack) return;
    unsigned hw = hs / W, d = (i % hw) * W, r = i / hw, t = r % T_;   // i indexes the heads layout
    r /= T_;
    unsigned h = r % NH;
    r /= NH;
    unsigned b = r % B, p = r / B;
    int64_t heads = (int64_t)i * W, flat = (((int64_t)b * T_ + t) * P + p) * ((int64_t)NH * hs) + (int64_t)h * hs + d;
    typedef Pack<T, W> PW;
    if (inverse) *(PW *)(dst + flat) = *(const PW *)(src + heads);
    else *(PW *)(dst + heads) = *(const PW *)(src + flat);
}

// GELU, tanh approximation (the CPU model's formula); backward multiplies d in place by GELU'(x).
#define GELU_SCALE 0.7978845608028654f
__device__ __forceinline__ float gelu(float x) {
    return 0.5f * x * (1.0f + tanhf(GELU_SCALE * (x + 0.044715f * x * x * x)));
}
__device__ __forceinline__ float gelu_grad(float x) {
    float th = tanhf(GELU_SCALE * (x + 0.044715f * x * x * x));
    return 0.5f * (1.0f + th) + 0.5f * x * (1.0f - th * th) * GELU_SCALE * (1.0f + 3.0f * 0.044715f * x * x);
}
// op 0: out = gelu(a); op 1: out = out * gelu'(a); op 2: out = out + a (residual). npack packs of W.
template <typename T, int W>
__global__ void elementwise_kernel(T *out, const T *a, int64_t npack, int op) {
    int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
    if (i >= npack) return;
    Pack<T, W> x = ((const Pack<T, W> *)a)[i], y;
    if (op != 0) y = ((Pack<T, W> *)out)[i];
    #pragma unroll
    for (int k = 0; k < W; k++) {
        float v = to_float(x.v[k]);
        y.v[k] = from_float<T>(op == 0 ? gelu(v) : op == 1 ? to_float(y.v[k]) * gelu_grad(v) : to_float(y.v[k]) + v);
    }
    ((Pack<T, W> *)out)[i] = y;
}

// out (N, OC) += bias (OC): only when cuBLASLt offers no algorithm with the bias epilogue.
template <typename T>
__global__ void add_bias_kernel(T *out, const T *bias, int64_t N, int OC) {
    int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
    if (i < N * OC) out[i] = from_float<T>(to_float(out[i]) + to_float(bias[i % OC]));
}

// Softmax + cross-entropy over the first V of Vp columns, one block per row: losses (N) =
// -log p[target]; with write_grad, logits become d(mean loss)/d(logits) = (p - onehot) * dloss in
// place (padding columns 0).
template <typename T>
__global__ void crossentropy_kernel(T *logits, float *losses, const int *targets, int V, int Vp, int write_grad,
                                    float dloss) {
    int64_t row = blockIdx.x;
    T *x = logits + row * Vp;
    int target = targets[row];
    float target_logit = to_float(x[target]);
    float mx = -INFINITY;
    for (int i = threadIdx.x; i < V; i += blockDim.x) mx = fmaxf(mx, to_float(x[i]));
    mx = block_reduce(mx, true);
    float s = 0.0f;
    for (int i = threadIdx.x; i < V; i += blockDim.x) s += expf(to_float(x[i]) - mx);
    s = block_reduce(s, false);
    if (threadIdx.x == 0) losses[row] = logf(s) - (target_logit - mx);
    if (!write_grad) return;
    float inv = 1.0f / s;
    for (int i = threadIdx.x; i < Vp; i += blockDim.x) {
        float g = 0.0f;
        if (i < V) g = (expf(to_float(x[i]) - mx) * inv - (i == target ? 1.0f : 0.0f)) * dloss;
        x[i] = from_float<T>(g);
    }
}

// dwpe (maxT, C) (+)= sum over b of dres (B, T, C), b in order; rows t >= T get 0 when overwriting.
template <typename T, typename G>
__global__ void wpe_backward_kernel(G *dwpe, const T *dres, int B, int T_, int maxT, int C, int accumulate) {
    int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x;
    if (i >= (int64_t)maxT * C) return;
    int64_t t = i / C, c = i % C;
    if (t >= T_) { if (!accumulate) dwpe[i] = from_float<G>(0.0f); return; }
    float s = 0.0f;
    for (int b = 0; b < B; b++) s += to_float(dres[((int64_t)b * T_ + t) * C + c]);
    dwpe[i] = from_float<G>(accumulate ? to_float(dwpe[i]) + s : s);
}

// dwte[token] += the dtok rows of every position holding that token, in position order (the CPU
// model's order). One block per distinct token; the positions come sorted by token (host CSR).
template <typename T, typename G>
__global__ void wte_backward_kernel(G *dwte, const T *dtok, const int *uniq, const int *start, const int *pos, int C) {
    int u = blockIdx.x;
    int64_t row = (int64_t)uniq[u] * C;
    for (int c = threadIdx.x; c < C; c += blockDim.x) {
        float s = to_float(dwte[row + c]);
        for (int k = start[u]; k < start[u + 1]; k++) s += to_float(dtok[(int64_t)pos[k] * C + c]);
        dwte[row + c] = from_float<G>(s);
    }
}

// Sum of squares of x (n), one partial per block (grid-stride, then the block's tree).
template <typename G>
__global__ void sumsq_kernel(float *partial, const G *x, int64_t n) {
    float s = 0.0f;
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
        float v = to_float(x[i]);
        s += v * v;
    }
    s = block_reduce(s, false);
    if (threadIdx.x == 0) partial[blockIdx.x] = s;
}
#define NORM_BLOCKS 1024

// Clipping group by group (gpt2_cuda_clip_group): per tensor of the group CLIP_BLOCKS partial sums of
// squares, in double, of the finite elements; each sum over the block in one fixed order.
#define CLIP_BLOCKS 128
#define CLIP_MAX_TENSORS 16
static_assert(CLIP_BLOCKS * CLIP_MAX_TENSORS == GPT2_CUDA_CLIP_PARTIALS, "gpt2_cuda.h's count of a rank's partials");
typedef struct { const void *p[CLIP_MAX_TENSORS]; int64_t n[CLIP_MAX_TENSORS]; } ClipGroup;
static_assert(2 * CLIP_MAX_TENSORS * CLIP_BLOCKS <= GPT2_NUM_PARAMS * NORM_BLOCKS, "the clip partials fit the partials");
__device__ double block_sum_fixed(double v) {
    __shared__ double warps[32];
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    if ((threadIdx.x & 31) == 0) warps[threadIdx.x >> 5] = v;
    __syncthreads();
    double s = 0.0;
    if (threadIdx.x == 0) for (int w = 0; w < (int)(blockDim.x >> 5); w++) s += warps[w];
    return s;   // thread 0's
}
template <typename G>
__global__ void clip_sumsq_kernel(double *partial, ClipGroup g) {
    const G *x = (const G *)g.p[blockIdx.y];
    const int64_t n = g.n[blockIdx.y];
    double s = 0.0;
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
        float v = to_float(x[i]);
        if (fabsf(v) <= 0x1.fffffep127f) s += (double)v * v;   // finite elements, as the optimizer's sums
    }
    s = block_sum_fixed(s);
    if (threadIdx.x == 0) partial[blockIdx.y * gridDim.x + blockIdx.x] = s;
}
// One block: the group's sum into sums[k]; the prefix sums[0..k] in order; *scale = step_scale's
// arithmetic (clip.c) for the norm sqrt(prefix / share) / accum.
__global__ void clip_scale_kernel(const double *partial, int parts, double *sums, int k, double share, float clip,
                                  int64_t accum, float *scale) {
    double s = 0.0;
    for (int i = threadIdx.x; i < parts; i += blockDim.x) s += partial[i];
    s = block_sum_fixed(s);
    if (threadIdx.x != 0) return;
    sums[k] = s;
    double prefix = 0.0;
    for (int j = 0; j <= k; j++) prefix += sums[j];
    double norm = sqrt(prefix / share) / (double)accum;
    float f = clip > 0.0f && norm > clip ? (float)(clip / norm) : 1.0f;
    f /= (float)accum;
    *scale = f > 0.0f ? f : 0x1p-149f;   // never 0: the least positive float (FLT_TRUE_MIN)
}

// ------------------------------------------------------------------------------------------------
// The model

// A layer's activations that its backward reads (A_LN1 .. A_FCH_GELU) come in two blocks, one of them
// empty: every layer's (L, ...), or with recompute one layer's, the same order from A_ONE_LAYER (the
// report lists both, so a name always says the real shape). residual3 (L, B, T, C) is kept either way.
enum {
    A_ENCODED, A_TOKEMB, A_LNE_MEAN, A_LNE_RSTD, A_LN1, A_LN1_MEAN, A_LN1_RSTD, A_QKV, A_ATTY, A_ATT, A_RES2,
    A_LN2, A_LN2_MEAN, A_LN2_RSTD, A_FCH, A_FCH_GELU, A_ONE_LAYER, A_RES3 = A_ONE_LAYER + (A_ONE_LAYER - A_LN1),
    A_LNF, A_LNF_MEAN, A_LNF_RSTD, A_LOGITS,
    A_LOSSES, A_DRES, A_DBUF, A_DBUF4, A_DQKV, A_QKVP, A_DQKVP, A_YP, A_DATT, A_PARTIAL, A_TOKENS, A_WORKSPACE,
    NUM_ACTS
};
#define NUM_LAYER_ACTS (A_ONE_LAYER - A_LN1)
static const char *act_names[NUM_ACTS] = {
    "encoded (B,T,C)", "tokemb (B,T,C)", "lne_mean (B,T)", "lne_rstd (B,T)", "ln1 (L,B,T,C)", "ln1_mean (L,B,T)",
    "ln1_rstd (L,B,T)", "qkv (L,B,T,3C)", "atty (L,B,T,C)", "att (L,B,NH,T,T)", "residual2 (L,B,T,C)",
    "ln2 (L,B,T,C)", "ln2_mean (L,B,T)", "ln2_rstd (L,B,T)", "fch (L,B,T,4C)", "fch_gelu (L,B,T,4C)",
    "ln1 (B,T,C) one layer", "ln1_mean (B,T) one layer", "ln1_rstd (B,T) one layer", "qkv (B,T,3C) one layer",
    "atty (B,T,C) one layer", "att (B,NH,T,T) one layer", "residual2 (B,T,C) one layer", "ln2 (B,T,C) one layer",
    "ln2_mean (B,T) one layer", "ln2_rstd (B,T) one layer", "fch (B,T,4C) one layer", "fch_gelu (B,T,4C) one layer",
    "residual3 (L,B,T,C)", "lnf (B,T,C)", "lnf_mean (B,T)", "lnf_rstd (B,T)", "logits (B,T,Vp)", "losses (B,T)",
    "dres (B,T,C) grad", "dbuf (B,T,C) grad", "dbuf4 (B,T,4C) grad", "dqkv (B,T,3C) grad",
    "qkv heads (3,B,NH,T,hs)", "dqkv heads (3,B,NH,T,hs)", "y / dy heads (B,NH,T,hs)", "datt (B,NH,T,T) grad",
    "reduction partials", "tokens + wte CSR (ints)", "cuBLASLt workspace"};

#define MAX_EVENTS 8192
#define MAX_PHASES 64
#define ALGO_CACHE 256
#define WORKSPACE_BYTES ((size_t)32 << 20)

typedef struct {
    int64_t key[24];
    cublasLtMatmulAlgo_t algo;
} AlgoEntry;

struct GPT2Cuda {
    GPT2CudaConfig c;
    int precision;
    size_t elem;                               // bytes of one parameter / activation element
    int64_t param_sizes[GPT2_NUM_PARAMS], num_parameters;
    void *params_memory;
    void *params[GPT2_NUM_PARAMS];        // views into params_memory
    int64_t Bmax, Tmax, B, T;                  // allocated for (Bmax, Tmax); last forward (B, T)
    size_t act_bytes[NUM_ACTS], acts_total;
    void *acts_memory;
    void *act[NUM_ACTS];                       // views into acts_memory
    int64_t partial_floats;
    int has_targets, has_dlogits;
    int64_t one_layer;                         // recompute: the layer the one-layer buffers hold (-1: none)
    int *host_tokens;                          // mirror of A_TOKENS, then counts and slots (Vp each)
    int n_uniq;
    uint16_t *host_stage;                      // fp32 <-> bf16 conversions, STAGE elements
    cudaStream_t stream;
    cublasLtHandle_t lt;
    AlgoEntry cache[ALGO_CACHE];
    int ncache;
    // profiling: events in stream order, the phase each one starts, totals by phase name; prof_hold:
    // phases ignored (the layer forward's own, inside backward's recomputation phase)
    int prof_on, prof_hold, nev, nphase;
    cudaEvent_t *ev;
    const char *ev_name[MAX_EVENTS];
    const char *phase_name[MAX_PHASES];
    double phase_ms[MAX_PHASES];
    int phase_count[MAX_PHASES];
};
#define STAGE ((int64_t)1 << 22)

static int phase(GPT2Cuda *m, const char *name) {
    if (!m->prof_on || m->prof_hold || m->nev >= MAX_EVENTS) return 0;
    CU(cudaEventRecord(m->ev[m->nev], m->stream));
    m->ev_name[m->nev++] = name;
    return 0;
}
#define PHASE(name) do { if (phase(m, name)) return -1; } while (0)
#define TRY(call) do { if ((call) != 0) return -1; } while (0)

static int64_t cdiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Offsets of the token region (ints): inputs, targets, uniq, start (+1), pos; each BTmax long.
static int *tok_inputs(GPT2Cuda *m, int *base) { (void)m; return base; }
static int *tok_targets(GPT2Cuda *m, int *base) { return base + m->Bmax * m->Tmax; }
static int *tok_uniq(GPT2Cuda *m, int *base) { return base + 2 * m->Bmax * m->Tmax; }
static int *tok_start(GPT2Cuda *m, int *base) { return base + 3 * m->Bmax * m->Tmax; }
static int *tok_pos(GPT2Cuda *m, int *base) { return base + 4 * m->Bmax * m->Tmax + 1; }
static int64_t tok_ints(GPT2Cuda *m) { return 5 * m->Bmax * m->Tmax + 1; }

// ------------------------------------------------------------------------------------------------
// Matrix products (cuBLASLt, column-major): D (M, N) = alpha op(A) op(B) + beta D [+ bias (M)],
// batched with strides. Returns 1 (message set) when no algorithm exists with the bias epilogue.

static uint32_t alignment_of(const void *p, int64_t stride_bytes) {
    uint64_t a = (uint64_t)(uintptr_t)p | (uint64_t)stride_bytes | 256u;
    return (uint32_t)(a & (~a + 1));     // lowest set bit, at most 256
}

static int matmul(GPT2Cuda *m, int ta, int tb, int64_t M, int64_t N, int64_t K, const void *A, int64_t lda,
                  int64_t sA, const void *Bm, int64_t ldb, int64_t sB, void *D, int64_t ldd, int64_t sD, int batch,
                  float alpha, float beta, const void *bias, cudaDataType abt, cudaDataType dt) {
    cublasLtMatmulDesc_t op = NULL;
    cublasLtMatrixLayout_t la = NULL, lb = NULL, ld = NULL;
    cublasLtMatmulPreference_t pref = NULL;
    cublasLtMatmulHeuristicResult_t heur;
    cublasStatus_t st = CUBLAS_STATUS_SUCCESS;
    const char *what = "";
    int status = -1, found = 0, hit = -1;
    size_t ab = abt == CUDA_R_32F ? 4 : 2, db = dt == CUDA_R_32F ? 4 : 2, ws = WORKSPACE_BYTES;
    uint32_t al[4] = {alignment_of(A, batch > 1 ? sA * (int64_t)ab : 0), alignment_of(Bm, batch > 1 ? sB * (int64_t)ab : 0),
                      alignment_of(D, batch > 1 ? sD * (int64_t)db : 0), bias ? alignment_of(bias, 0) : 0};
    cublasOperation_t opa = ta ? CUBLAS_OP_T : CUBLAS_OP_N, opb = tb ? CUBLAS_OP_T : CUBLAS_OP_N;
    cublasLtEpilogue_t epi = bias ? CUBLASLT_EPILOGUE_BIAS : CUBLASLT_EPILOGUE_DEFAULT;
    int64_t key[24] = {ta, tb, M, N, K, lda, ldb, ldd, sA, sB, sD, batch, bias != NULL, beta != 0.0f, abt, dt,
                       al[0], al[1], al[2], al[3], 0, 0, 0, 0};
    cublasLtMatrixLayout_t layouts[3];
    int64_t strides[3] = {sA, sB, sD};
    int32_t batch32 = batch;
#define LT(call) do { st = (call); if (st != CUBLAS_STATUS_SUCCESS) { what = #call; goto done; } } while (0)
    LT(cublasLtMatmulDescCreate(&op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    LT(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSA, &opa, sizeof opa));
    LT(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSB, &opb, sizeof opb));
    if (bias) {
        LT(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_EPILOGUE, &epi, sizeof epi));
        LT(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias, sizeof bias));
    }
    LT(cublasLtMatrixLayoutCreate(&la, abt, ta ? K : M, ta ? M : K, lda));
    LT(cublasLtMatrixLayoutCreate(&lb, abt, tb ? N : K, tb ? K : N, ldb));
    LT(cublasLtMatrixLayoutCreate(&ld, dt, M, N, ldd));
    layouts[0] = la; layouts[1] = lb; layouts[2] = ld;
    if (batch > 1)
        for (int i = 0; i < 3; i++) {
            LT(cublasLtMatrixLayoutSetAttribute(layouts[i], CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &batch32, sizeof batch32));
            LT(cublasLtMatrixLayoutSetAttribute(layouts[i], CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &strides[i],
                                                sizeof strides[i]));
        }
    // the algorithm, by shape, types and alignments: the heuristic query costs host time per call
    for (int i = 0; i < m->ncache && hit < 0; i++)
        if (memcmp(m->cache[i].key, key, sizeof key) == 0) hit = i;
    if (hit >= 0) {
        heur.algo = m->cache[hit].algo;
    } else {
        LT(cublasLtMatmulPreferenceCreate(&pref));
        LT(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof ws));
        LT(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &al[0], sizeof al[0]));
        LT(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &al[1], sizeof al[1]));
        LT(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &al[2], sizeof al[2]));
        LT(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &al[2], sizeof al[2]));
        st = cublasLtMatmulAlgoGetHeuristic(m->lt, op, la, lb, ld, ld, pref, 1, &heur, &found);
        if (st != CUBLAS_STATUS_SUCCESS || found == 0) {
            fail("no cuBLASLt algorithm for %s%s M=%lld N=%lld K=%lld batch %d%s (%s)", ta ? "T" : "N", tb ? "T" : "N",
                 (long long)M, (long long)N, (long long)K, batch, bias ? " with bias epilogue" : "",
                 cublasLtGetStatusString(st));
            status = bias ? 1 : -1;
            st = CUBLAS_STATUS_SUCCESS;
            goto done;
        }
        if (m->ncache < ALGO_CACHE) {
            memcpy(m->cache[m->ncache].key, key, sizeof key);
            m->cache[m->ncache++].algo = heur.algo;
        }
    }
    LT(cublasLtMatmul(m->lt, op, &alpha, A, la, Bm, lb, &beta, D, ld, D, ld, &heur.algo,
                      m->act[A_WORKSPACE], WORKSPACE_BYTES, m->stream));
    status = 0;
done:
#undef LT
    if (st != CUBLAS_STATUS_SUCCESS)
        fail("%s:%d: %s: %s (M=%lld N=%lld K=%lld batch %d)", __FILE__, __LINE__, what, cublasLtGetStatusString(st),
             (long long)M, (long long)N, (long long)K, batch);
    if (pref) cublasLtMatmulPreferenceDestroy(pref);
    if (ld) cublasLtMatrixLayoutDestroy(ld);
    if (lb) cublasLtMatrixLayoutDestroy(lb);
    if (la) cublasLtMatrixLayoutDestroy(la);
    if (op) cublasLtMatmulDescDestroy(op);
    return status;
}

// Row-major products, as the model uses them (R rows out, O columns out, K summed), batched:
//   mm_nt: out (R, O) = A (R, K) @ W (O, K)^T [+ bias (O)]    the linear layer's forward
//   mm_nn: out (R, O) = A (R, K) @ W (K, O)                   its input gradient
//   mm_tn: out (R, O) = A (K, R)^T @ W (K, O), + beta out      its weight gradient
template <typename T, typename D>
static int mm_nt(GPT2Cuda *m, D *out, const T *A, const T *W, const T *bias, int64_t R, int64_t O, int64_t K,
                 int batch = 1, int64_t sOut = 0, int64_t sA = 0, int64_t sW = 0, float alpha = 1.0f) {
    int s = matmul(m, 1, 0, O, R, K, W, K, sW, A, K, sA, out, O, sOut, batch, alpha, 0.0f, bias, cuda_type<T>(), cuda_type<D>());
    if (s == 1) {    // no algorithm with the bias epilogue here: the product, then the bias
        s = matmul(m, 1, 0, O, R, K, W, K, sW, A, K, sA, out, O, sOut, batch, alpha, 0.0f, NULL, cuda_type<T>(), cuda_type<D>());
        if (s) return -1;
        add_bias_kernel<T><<<(unsigned)cdiv(R * O, 256), 256, 0, m->stream>>>((T *)out, bias, R, (int)O);
        LAUNCHED();
    }
    return s ? -1 : 0;
}
template <typename T, typename D>
static int mm_nn(GPT2Cuda *m, D *out, const T *A, const T *W, int64_t R, int64_t O, int64_t K, int batch = 1,
                 int64_t sOut = 0, int64_t sA = 0, int64_t sW = 0) {
    return matmul(m, 0, 0, O, R, K, W, O, sW, A, K, sA, out, O, sOut, batch, 1.0f, 0.0f, NULL, cuda_type<T>(),
                  cuda_type<D>()) ? -1 : 0;
}
template <typename T, typename D>
static int mm_tn(GPT2Cuda *m, D *out, const T *A, const T *W, int64_t R, int64_t O, int64_t K, float beta, int batch = 1,
                 int64_t sOut = 0, int64_t sA = 0, int64_t sW = 0) {
    return matmul(m, 0, 1, O, R, K, W, O, sW, A, R, sA, out, O, sOut, batch, 1.0f, beta, NULL, cuda_type<T>(),
                  cuda_type<D>()) ? -1 : 0;
}

// ------------------------------------------------------------------------------------------------
// Launchers

template <typename T>
static int layernorm_forward(GPT2Cuda *m, T *out, float *mean, float *rstd, const T *inp, const T *w, const T *b,
                             int64_t N, int C) {
    if (C % VecW<T>::W == 0) layernorm_forward_vec_kernel<T><<<(unsigned)cdiv(N, 8), 256, 0, m->stream>>>(out, mean, rstd, inp, w, b, N, C);
    else layernorm_forward_kernel<T><<<(unsigned)cdiv(N, 8), 256, 0, m->stream>>>(out, mean, rstd, inp, w, b, N, C);
    LAUNCHED();
    return 0;
}

// dinp (N, C) (+)= LayerNorm's input gradient of dout.
template <typename T>
static int layernorm_backward_dx(GPT2Cuda *m, T *dinp, const T *dout, const T *inp, const T *w, const float *mean,
                                 const float *rstd, int64_t N, int C, int accumulate) {
    if (C % VecW<T>::W == 0)
        layernorm_backward_dx_vec_kernel<T><<<(unsigned)cdiv(N, 8), 256, 0, m->stream>>>(dinp, dout, inp, w, mean, rstd, N, C, accumulate);
    else
        layernorm_backward_dx_kernel<T><<<(unsigned)cdiv(N, 8), 256, 0, m->stream>>>(dinp, dout, inp, w, mean, rstd, N, C, accumulate);
    LAUNCHED();
    return 0;
}

template <typename T>
static int softmax_causal(GPT2Cuda *m, T *att_or_datt, const T *att, int64_t rows, int T_, float scale, int backward) {
    unsigned grid = (unsigned)cdiv(rows, 8);
    int vec = T_ % VecW<T>::W == 0;
    if (backward && vec) softmax_causal_backward_vec_kernel<T><<<grid, 256, 0, m->stream>>>(att_or_datt, att, rows, T_, scale);
    else if (backward) softmax_causal_backward_kernel<T><<<grid, 256, 0, m->stream>>>(att_or_datt, att, rows, T_, scale);
    else if (vec) softmax_causal_forward_vec_kernel<T><<<grid, 256, 0, m->stream>>>(att_or_datt, rows, T_);
    else softmax_causal_forward_kernel<T><<<grid, 256, 0, m->stream>>>(att_or_datt, rows, T_);
    LAUNCHED();
    return 0;
}

// Column sums of dout (N, OC) into g0 (bias) or, with inp/mean/rstd, LayerNorm's g0 (weight), g1 (bias).
template <typename T, typename G>
static int colsum(GPT2Cuda *m, G *g0, G *g1, const T *dout, const T *inp, const float *mean, const float *rstd,
                  int64_t N, int OC, int accumulate) {
    int nchunks = (int)cdiv(N, COLSUM_ROWS), W = inp ? 2 : 1;
    float *partial = (float *)m->act[A_PARTIAL];
    if ((int64_t)nchunks * W * OC > m->partial_floats) return fail("colsum: %d x %d x %d partials exceed the scratch", nchunks, W, OC);
    dim3 grid((unsigned)cdiv(OC, 32), (unsigned)nchunks), block(32, 8);
    if (inp) colsum_partial_kernel<T, 1><<<grid, block, 0, m->stream>>>(partial, dout, inp, mean, rstd, N, OC);
    else colsum_partial_kernel<T, 0><<<grid, block, 0, m->stream>>>(partial, dout, NULL, NULL, NULL, N, OC);
    LAUNCHED();
    colsum_finish_kernel<G><<<(unsigned)cdiv(W * OC, 256), 256, 0, m->stream>>>(g0, g1, partial, nchunks, OC, W, accumulate);
    LAUNCHED();
    return 0;
}

// op 0: out = gelu(a); 1: out *= gelu'(a); 2: out += a. 16-byte packs when size and addresses allow.
template <typename T>
static int elementwise(GPT2Cuda *m, T *out, const T *a, int64_t n, int op) {
    const int W = 16 / sizeof(T);
    if (n % W == 0 && ((uintptr_t)out | (uintptr_t)a) % 16 == 0)
        elementwise_kernel<T, W><<<(unsigned)cdiv(n / W, 256), 256, 0, m->stream>>>(out, a, n / W, op);
    else
        elementwise_kernel<T, 1><<<(unsigned)cdiv(n, 256), 256, 0, m->stream>>>(out, a, n, op);
    LAUNCHED();
    return 0;
}

template <typename T>
static int permute(GPT2Cuda *m, T *dst, const T *src, int P, int inverse) {
    int64_t n = P * m->B * m->T * m->c.channels;
    int NH = m->c.num_heads, hs = m->c.channels / NH;
    if (hs % VecW<T>::W == 0 && n / VecW<T>::W < ((int64_t)1 << 32)) {
        permute_heads_vec_kernel<T><<<(unsigned)cdiv(n / VecW<T>::W, 256), 256, 0, m->stream>>>(dst, src, (int)m->B, (int)m->T, P, NH, hs, inverse);
        LAUNCHED();
        return 0;
    }
    if (inverse) unpermute_heads_kernel<T><<<(unsigned)cdiv(n, 256), 256, 0, m->stream>>>(dst, src, (int)m->B, (int)m->T, P, NH, hs);
    else permute_heads_kernel<T><<<(unsigned)cdiv(n, 256), 256, 0, m->stream>>>(dst, src, (int)m->B, (int)m->T, P, NH, hs);
    LAUNCHED();
    return 0;
}

// ------------------------------------------------------------------------------------------------
// Forward

// Layer l's activations: its slices of the (L, ...) arrays, or with recompute the one-layer buffers.
template <typename T>
struct LayerActs {
    const T *residual;                          // (B, T, C) the layer's input: encoded or residual3[l - 1]
    T *ln1, *qkv, *atty, *att, *res2;           // (B, T, C), (B, T, 3C), (B, T, C), (B, NH, T, T), (B, T, C)
    T *ln2, *fch, *fchg, *res3;                 // (B, T, C), (B, T, 4C), (B, T, 4C), (B, T, C) its output
    float *ln1_mean, *ln1_rstd, *ln2_mean, *ln2_rstd;   // (B, T)
};

template <typename T>
static LayerActs<T> layer_acts(GPT2Cuda *m, int64_t l) {
    int64_t B = m->B, T_ = m->T, BT = B * T_, BTC = BT * m->c.channels, NH = m->c.num_heads;
    int64_t k = m->c.recompute ? 0 : l;                         // the slot in the arrays
    int o = m->c.recompute ? NUM_LAYER_ACTS : 0;                // the block
    LayerActs<T> a;
    a.residual = l == 0 ? (const T *)m->act[A_ENCODED] : (const T *)m->act[A_RES3] + (l - 1) * BTC;
    a.ln1 = (T *)m->act[o + A_LN1] + k * BTC;
    a.qkv = (T *)m->act[o + A_QKV] + k * 3 * BTC;
    a.atty = (T *)m->act[o + A_ATTY] + k * BTC;
    a.att = (T *)m->act[o + A_ATT] + k * B * NH * T_ * T_;
    a.res2 = (T *)m->act[o + A_RES2] + k * BTC;
    a.ln2 = (T *)m->act[o + A_LN2] + k * BTC;
    a.fch = (T *)m->act[o + A_FCH] + k * 4 * BTC;
    a.fchg = (T *)m->act[o + A_FCH_GELU] + k * 4 * BTC;
    a.res3 = (T *)m->act[A_RES3] + l * BTC;
    a.ln1_mean = (float *)m->act[o + A_LN1_MEAN] + k * BT;
    a.ln1_rstd = (float *)m->act[o + A_LN1_RSTD] + k * BT;
    a.ln2_mean = (float *)m->act[o + A_LN2_MEAN] + k * BT;
    a.ln2_rstd = (float *)m->act[o + A_LN2_RSTD] + k * BT;
    return a;
}

// Layer l's forward from a.residual into a. out: the layer's output (a.res3), or NULL to stop before
// the MLP's output projection, as backward's recomputation does (it reads everything up to fch_gelu,
// and residual3 is kept). The same kernels on the same inputs: a recomputation gives the same bits.
template <typename T>
static int layer_forward(GPT2Cuda *m, int64_t l, const LayerActs<T> &a, T *out) {
    int64_t B = m->B, T_ = m->T, C = m->c.channels, NH = m->c.num_heads, BT = B * T_, hs = C / NH, BTC = BT * C;
    T **p = (T **)m->params;
    T *qkvp = (T *)m->act[A_QKVP], *yp = (T *)m->act[A_YP];
    float scale = 1.0f / sqrtf((float)hs);
    m->one_layer = -1;

    PHASE("fwd layernorm ln1/ln2");
    TRY(layernorm_forward(m, a.ln1, a.ln1_mean, a.ln1_rstd, a.residual, p[GPT2_LN1W] + l * C, p[GPT2_LN1B] + l * C, BT, (int)C));
    PHASE("fwd matmul qkv");
    TRY(mm_nt(m, a.qkv, a.ln1, p[GPT2_QKVW] + l * 3 * C * C, p[GPT2_QKVB] + l * 3 * C, BT, 3 * C, C));
    // attention: q, k, v to (B, NH, T, hs); att (B, NH, T, T) = softmax(q k^T / sqrt(hs)); y = att v
    PHASE("fwd attn permute qkv");
    TRY(permute(m, qkvp, a.qkv, 3, 0));
    PHASE("fwd attn q@k");
    TRY(mm_nt(m, a.att, qkvp, qkvp + BTC, (const T *)NULL, T_, T_, hs, (int)(B * NH), T_ * T_, T_ * hs, T_ * hs, scale));
    PHASE("fwd attn softmax");
    TRY(softmax_causal(m, a.att, (const T *)NULL, B * NH * T_, (int)T_, 0.0f, 0));
    PHASE("fwd attn att@v");
    TRY(mm_nn(m, yp, a.att, qkvp + 2 * BTC, T_, hs, T_, (int)(B * NH), T_ * hs, T_ * T_, T_ * hs));
    PHASE("fwd attn unpermute y");
    TRY(permute(m, a.atty, yp, 1, 1));
    PHASE("fwd matmul attproj");
    TRY(mm_nt(m, a.res2, a.atty, p[GPT2_ATTPROJW] + l * C * C, p[GPT2_ATTPROJB] + l * C, BT, C, C));
    PHASE("fwd residual");
    TRY(elementwise(m, a.res2, a.residual, BTC, 2));
    PHASE("fwd layernorm ln1/ln2");
    TRY(layernorm_forward(m, a.ln2, a.ln2_mean, a.ln2_rstd, a.res2, p[GPT2_LN2W] + l * C, p[GPT2_LN2B] + l * C, BT, (int)C));
    PHASE("fwd matmul fc");
    TRY(mm_nt(m, a.fch, a.ln2, p[GPT2_FCW] + l * 4 * C * C, p[GPT2_FCB] + l * 4 * C, BT, 4 * C, C));
    PHASE("fwd gelu");
    TRY(elementwise(m, a.fchg, a.fch, 4 * BTC, 0));
    if (out) {
        PHASE("fwd matmul fcproj");
        TRY(mm_nt(m, out, a.fchg, p[GPT2_FCPROJW] + l * 4 * C * C, p[GPT2_FCPROJB] + l * C, BT, C, 4 * C));
        PHASE("fwd residual");
        TRY(elementwise(m, out, a.res2, BTC, 2));
    }
    if (m->c.recompute) m->one_layer = l;
    return 0;
}

template <typename T>
static int forward_impl(GPT2Cuda *m, int has_targets, int for_backward) {
    const GPT2CudaConfig *c = &m->c;
    int64_t B = m->B, T_ = m->T, C = c->channels, L = c->num_layers, BT = B * T_;
    int64_t Vp = c->padded_vocab_size, BTC = BT * C;
    T **p = (T **)m->params;
    T *encoded = (T *)m->act[A_ENCODED];
    int *tokens = (int *)m->act[A_TOKENS];

    // encoded (B, T, C) = wte[token] (through StableEmbedding's LayerNorm) + wpe[t]
    PHASE("fwd encoder");
    unsigned eb = (unsigned)cdiv(BTC, 256);
    if (c->stable_embedding) {
        T *tokemb = (T *)m->act[A_TOKEMB];
        encoder_forward_kernel<T><<<eb, 256, 0, m->stream>>>(tokemb, p[GPT2_WTE], p[GPT2_WPE], tok_inputs(m, tokens), BT, (int)T_, (int)C, 2);
        LAUNCHED();
        TRY(layernorm_forward(m, encoded, (float *)m->act[A_LNE_MEAN], (float *)m->act[A_LNE_RSTD], tokemb, p[GPT2_LNEW], p[GPT2_LNEB], BT, (int)C));
        encoder_forward_kernel<T><<<eb, 256, 0, m->stream>>>(encoded, p[GPT2_WTE], p[GPT2_WPE], tok_inputs(m, tokens), BT, (int)T_, (int)C, 1);
    } else {
        encoder_forward_kernel<T><<<eb, 256, 0, m->stream>>>(encoded, p[GPT2_WTE], p[GPT2_WPE], tok_inputs(m, tokens), BT, (int)T_, (int)C, 0);
    }
    LAUNCHED();

    for (int64_t l = 0; l < L; l++) {
        LayerActs<T> a = layer_acts<T>(m, l);
        TRY(layer_forward(m, l, a, a.res3));
    }
    PHASE("fwd layernorm");
    T *lnf = (T *)m->act[A_LNF], *logits = (T *)m->act[A_LOGITS];
    TRY(layernorm_forward(m, lnf, (float *)m->act[A_LNF_MEAN], (float *)m->act[A_LNF_RSTD],
                          (T *)m->act[A_RES3] + (L - 1) * BTC, p[GPT2_LNFW], p[GPT2_LNFB], BT, (int)C));
    PHASE("fwd lm_head");
    TRY(mm_nt(m, logits, lnf, p[GPT2_WTE], (const T *)NULL, BT, Vp, C));     // tied: wte is the lm_head
    if (has_targets) {
        PHASE("fwd softmax+xent");
        if (Vp % VecW<T>::W == 0)
            crossentropy_vec_kernel<T><<<(unsigned)BT, 512, 0, m->stream>>>(logits, (float *)m->act[A_LOSSES], tok_targets(m, tokens),
                                                                              c->vocab_size, (int)Vp, for_backward, 1.0f / (float)BT);
        else
            crossentropy_kernel<T><<<(unsigned)BT, 512, 0, m->stream>>>(logits, (float *)m->act[A_LOSSES], tok_targets(m, tokens),
                                                                          c->vocab_size, (int)Vp, for_backward, 1.0f / (float)BT);
        LAUNCHED();
    }
    PHASE(NULL);
    return 0;
}

// Host side of the forward: checks and uploads the tokens, sorts positions by token for wte's
// gradient (CSR: distinct tokens, their start, positions in order).
extern "C" int gpt2_cuda_forward(GPT2Cuda *m, const int *inputs, const int *targets, int B, int T, int for_backward) {
    if (!m || !inputs) return fail("gpt2_cuda_forward: NULL model or inputs");
    if (B < 1 || T < 1 || B > m->Bmax || T > m->Tmax)
        return fail("gpt2_cuda_forward: (B, T) = (%d, %d) outside the allocated (%lld, %lld)", B, T, (long long)m->Bmax,
                    (long long)m->Tmax);
    int64_t BT = (int64_t)B * T, V = m->c.vocab_size, Vp = m->c.padded_vocab_size;
    int *h = m->host_tokens, *counts = h + tok_ints(m), *slot = counts + Vp;
    for (int64_t i = 0; i < BT; i++) {
        if (inputs[i] < 0 || inputs[i] >= V) return fail("gpt2_cuda_forward: inputs[%lld] = %d is not a token id below %lld", (long long)i, inputs[i], (long long)V);
        if (targets && (targets[i] < 0 || targets[i] >= V))
            return fail("gpt2_cuda_forward: targets[%lld] = %d is not a token id below %lld", (long long)i, targets[i], (long long)V);
    }
    m->B = B; m->T = T;
    memcpy(tok_inputs(m, h), inputs, sizeof(int) * (size_t)BT);
    if (targets) memcpy(tok_targets(m, h), targets, sizeof(int) * (size_t)BT);
    memset(counts, 0, sizeof(int) * (size_t)Vp);
    for (int64_t i = 0; i < BT; i++) counts[inputs[i]]++;
    int *uniq = tok_uniq(m, h), *start = tok_start(m, h), *pos = tok_pos(m, h), nu = 0, run = 0;
    for (int64_t v = 0; v < Vp; v++)
        if (counts[v]) { uniq[nu] = (int)v; start[nu++] = run; slot[v] = run; run += counts[v]; }
    start[nu] = run;
    for (int64_t i = 0; i < BT; i++) pos[slot[inputs[i]]++] = (int)i;
    m->n_uniq = nu;
    // pageable source: the copy is staged before this returns, so the host arrays are free again
    CU(cudaMemcpyAsync(m->act[A_TOKENS], h, sizeof(int) * (size_t)tok_ints(m), cudaMemcpyHostToDevice, m->stream));
    m->has_targets = targets != NULL;
    m->has_dlogits = targets != NULL && for_backward;
    return m->precision == GPT2_CUDA_BF16 ? forward_impl<bf16>(m, targets != NULL, for_backward)
                                          : forward_impl<float>(m, targets != NULL, for_backward);
}

// ------------------------------------------------------------------------------------------------
// Backward

template <typename T, typename G>
static int backward_impl(GPT2Cuda *m, const GPT2CudaGrads *g, int acc, gpt2_grads_ready ready, void *ctx) {
    const GPT2CudaConfig *c = &m->c;
    int64_t B = m->B, T_ = m->T, C = c->channels, L = c->num_layers, NH = c->num_heads, BT = B * T_, hs = C / NH;
    int64_t Vp = c->padded_vocab_size, BTC = BT * C;
    T **p = (T **)m->params;
    G *gw[GPT2_NUM_PARAMS];
    for (int i = 0; i < GPT2_NUM_PARAMS; i++) gw[i] = (G *)g->tensor[i];
    T *dres = (T *)m->act[A_DRES], *dbuf = (T *)m->act[A_DBUF], *dbuf4 = (T *)m->act[A_DBUF4], *dqkv = (T *)m->act[A_DQKV];
    T *qkvp = (T *)m->act[A_QKVP], *dqkvp = (T *)m->act[A_DQKVP], *dyp = (T *)m->act[A_YP], *datt = (T *)m->act[A_DATT];
    T *dlogits = (T *)m->act[A_LOGITS], *lnf = (T *)m->act[A_LNF];
    int *tokens = (int *)m->act[A_TOKENS];
    float beta = acc ? 1.0f : 0.0f, scale = 1.0f / sqrtf((float)hs);
    // layer l's slice of per-layer tensor i (slice 0, reused, under gradient release)
    auto slice = [&](int i, int64_t l) { return gw[i] + (g->reuse_layer_slice ? 0 : l * (m->param_sizes[i] / L)); };
    auto done = [&](int which) -> int {
        if (!ready) return 0;
        PHASE("bwd callbacks");
        int rc = ready(ctx, which, m->stream);
        if (rc) return fail("gpt2_cuda_backward: the grads_ready callback returned %d for group %d", rc, which);
        return 0;
    };

    // lm_head (tied to wte): dlnf = dlogits @ wte; dwte (+)= dlogits^T @ lnf (the encoder adds the rest)
    PHASE("bwd lm_head dx");
    TRY(mm_nn(m, dbuf, dlogits, p[GPT2_WTE], BT, C, Vp));
    PHASE("bwd lm_head dW");
    TRY(mm_tn(m, gw[GPT2_WTE], dlogits, lnf, Vp, C, BT, beta));
    PHASE("bwd layernorm lnf");
    const T *res_last = (T *)m->act[A_RES3] + (L - 1) * BTC;
    const float *lnf_mean = (float *)m->act[A_LNF_MEAN], *lnf_rstd = (float *)m->act[A_LNF_RSTD];
    TRY(layernorm_backward_dx(m, dres, dbuf, res_last, p[GPT2_LNFW], lnf_mean, lnf_rstd, BT, (int)C, 0));
    PHASE("bwd layernorm params");
    TRY(colsum(m, gw[GPT2_LNFW], gw[GPT2_LNFB], dbuf, res_last, lnf_mean, lnf_rstd, BT, (int)C, acc));
    TRY(done(GPT2_GRADS_LNF));

    for (int64_t l = L - 1; l >= 0; l--) {
        LayerActs<T> a = layer_acts<T>(m, l);
        if (m->c.recompute && m->one_layer != l) {
            // the layer's activations again, from its input (kept in residual3) and its own parameters
            PHASE("bwd recompute forward");
            m->prof_hold = 1;
            int rc = layer_forward(m, l, a, (T *)NULL);
            m->prof_hold = 0;
            TRY(rc);
        }
        // dres holds d(residual3[l]): the gradient of both residual2[l] and the MLP's output
        const T *residual = a.residual, *ln1 = a.ln1, *qkv = a.qkv, *atty = a.atty, *att = a.att, *res2 = a.res2;
        const T *ln2 = a.ln2, *fch = a.fch, *fchg = a.fchg;
        const float *ln1_mean = a.ln1_mean, *ln1_rstd = a.ln1_rstd, *ln2_mean = a.ln2_mean, *ln2_rstd = a.ln2_rstd;

        // MLP: fcproj, GELU, fc
        PHASE("bwd matmul fcproj dx");
        TRY(mm_nn(m, dbuf4, dres, p[GPT2_FCPROJW] + l * 4 * C * C, BT, 4 * C, C));
        PHASE("bwd matmul fcproj dW");
        TRY(mm_tn(m, slice(GPT2_FCPROJW, l), dres, fchg, C, 4 * C, BT, beta));
        PHASE("bwd bias");
        TRY(colsum(m, slice(GPT2_FCPROJB, l), (G *)NULL, dres, (const T *)NULL, NULL, NULL, BT, (int)C, acc));
        PHASE("bwd gelu");
        TRY(elementwise(m, dbuf4, fch, 4 * BTC, 1));
        PHASE("bwd matmul fc dx");
        TRY(mm_nn(m, dbuf, dbuf4, p[GPT2_FCW] + l * 4 * C * C, BT, C, 4 * C));
        PHASE("bwd matmul fc dW");
        TRY(mm_tn(m, slice(GPT2_FCW, l), dbuf4, ln2, 4 * C, C, BT, beta));
        PHASE("bwd bias");
        TRY(colsum(m, slice(GPT2_FCB, l), (G *)NULL, dbuf4, (const T *)NULL, NULL, NULL, BT, (int)(4 * C), acc));
        PHASE("bwd layernorm ln2");
        TRY(layernorm_backward_dx(m, dres, dbuf, res2, p[GPT2_LN2W] + l * C, ln2_mean, ln2_rstd, BT, (int)C, 1));
        PHASE("bwd layernorm params");
        TRY(colsum(m, slice(GPT2_LN2W, l), slice(GPT2_LN2B, l), dbuf, res2, ln2_mean, ln2_rstd, BT, (int)C, acc));

        // attention: dres now holds d(residual2[l]), the gradient of both residual and attproj's output
        PHASE("bwd matmul attproj dx");
        TRY(mm_nn(m, dbuf, dres, p[GPT2_ATTPROJW] + l * C * C, BT, C, C));
        PHASE("bwd matmul attproj dW");
        TRY(mm_tn(m, slice(GPT2_ATTPROJW, l), dres, atty, C, C, BT, beta));
        PHASE("bwd bias");
        TRY(colsum(m, slice(GPT2_ATTPROJB, l), (G *)NULL, dres, (const T *)NULL, NULL, NULL, BT, (int)C, acc));
        PHASE("bwd attn permute qkv, dy");
        TRY(permute(m, qkvp, qkv, 3, 0));
        TRY(permute(m, dyp, dbuf, 1, 0));
        const T *q = qkvp, *k = qkvp + BTC, *v = qkvp + 2 * BTC;
        int nb = (int)(B * NH);
        PHASE("bwd attn bmm");
        TRY(mm_nt(m, datt, dyp, v, (const T *)NULL, T_, T_, hs, nb, T_ * T_, T_ * hs, T_ * hs));   // datt = dy v^T
        TRY(mm_tn(m, dqkvp + 2 * BTC, att, dyp, T_, hs, T_, 0.0f, nb, T_ * hs, T_ * T_, T_ * hs));  // dv = att^T dy
        PHASE("bwd attn softmax");
        TRY(softmax_causal(m, datt, att, B * NH * T_, (int)T_, scale, 1));
        PHASE("bwd attn bmm");
        TRY(mm_nn(m, dqkvp, datt, k, T_, hs, T_, nb, T_ * hs, T_ * T_, T_ * hs));                  // dq = dpre k
        TRY(mm_tn(m, dqkvp + BTC, datt, q, T_, hs, T_, 0.0f, nb, T_ * hs, T_ * T_, T_ * hs));      // dk = dpre^T q
        PHASE("bwd attn unpermute dqkv");
        TRY(permute(m, dqkv, dqkvp, 3, 1));
        PHASE("bwd matmul qkv dx");
        TRY(mm_nn(m, dbuf, dqkv, p[GPT2_QKVW] + l * 3 * C * C, BT, C, 3 * C));
        PHASE("bwd matmul qkv dW");
        TRY(mm_tn(m, slice(GPT2_QKVW, l), dqkv, ln1, 3 * C, C, BT, beta));
        PHASE("bwd bias");
        TRY(colsum(m, slice(GPT2_QKVB, l), (G *)NULL, dqkv, (const T *)NULL, NULL, NULL, BT, (int)(3 * C), acc));
        PHASE("bwd layernorm ln1");
        TRY(layernorm_backward_dx(m, dres, dbuf, residual, p[GPT2_LN1W] + l * C, ln1_mean, ln1_rstd, BT, (int)C, 1));
        PHASE("bwd layernorm params");
        TRY(colsum(m, slice(GPT2_LN1W, l), slice(GPT2_LN1B, l), dbuf, residual, ln1_mean, ln1_rstd, BT, (int)C, acc));
        TRY(done((int)l));
    }

    // encoder: dres = d(encoded), to wpe by position and to wte (through StableEmbedding's LayerNorm)
    PHASE("bwd encoder");
    wpe_backward_kernel<T, G><<<(unsigned)cdiv(c->max_seq_len * C, 256), 256, 0, m->stream>>>(gw[GPT2_WPE], dres, (int)B, (int)T_, c->max_seq_len, (int)C, acc);
    LAUNCHED();
    const T *dtok = dres;
    if (c->stable_embedding) {
        const T *tokemb = (T *)m->act[A_TOKEMB];
        const float *lne_mean = (float *)m->act[A_LNE_MEAN], *lne_rstd = (float *)m->act[A_LNE_RSTD];
        TRY(layernorm_backward_dx(m, dbuf, dres, tokemb, p[GPT2_LNEW], lne_mean, lne_rstd, BT, (int)C, 0));
        TRY(colsum(m, gw[GPT2_LNEW], gw[GPT2_LNEB], dres, tokemb, lne_mean, lne_rstd, BT, (int)C, acc));
        dtok = dbuf;
    }
    wte_backward_kernel<T, G><<<(unsigned)m->n_uniq, 256, 0, m->stream>>>(gw[GPT2_WTE], dtok, tok_uniq(m, tokens), tok_start(m, tokens),
                                                                          tok_pos(m, tokens), (int)C);
    LAUNCHED();
    TRY(done(GPT2_GRADS_EMBED));
    PHASE(NULL);
    return 0;
}

extern "C" int gpt2_cuda_backward(GPT2Cuda *m, const GPT2CudaGrads *g, int accumulate, gpt2_grads_ready ready, void *ctx) {
    if (!m || !g) return fail("gpt2_cuda_backward: NULL model or gradients");
    if (!m->has_dlogits) return fail("gpt2_cuda_backward: the last forward had no targets or for_backward = 0");
    for (int i = 0; i < GPT2_NUM_PARAMS; i++)
        if (m->param_sizes[i] && !g->tensor[i]) return fail("gpt2_cuda_backward: gradient tensor %d is NULL", i);
    if (g->dtype == GPT2_CUDA_FP32 && m->precision == GPT2_CUDA_FP32) return backward_impl<float, float>(m, g, accumulate != 0, ready, ctx);
    if (g->dtype == GPT2_CUDA_FP32 && m->precision == GPT2_CUDA_BF16) return backward_impl<bf16, float>(m, g, accumulate != 0, ready, ctx);
    if (g->dtype == GPT2_CUDA_BF16 && m->precision == GPT2_CUDA_BF16) return backward_impl<bf16, bf16>(m, g, accumulate != 0, ready, ctx);
    return fail("gpt2_cuda_backward: gradient dtype %d with a %s model (bf16 gradients need a bf16 model)", g->dtype,
                m->precision == GPT2_CUDA_FP32 ? "fp32" : "bf16");
}

// ------------------------------------------------------------------------------------------------
// Creation, parameters, losses, memory

// What is wrong with a configuration (gpt2.h's shape limits), NULL when nothing is.
static const char *config_problem(const GPT2CudaConfig *c) {
    GPT2Config shape = {c->max_seq_len, c->vocab_size, c->padded_vocab_size, c->num_layers, c->num_heads, c->channels,
                        c->stable_embedding};
    const char *why = gpt2_shape_problem(&shape);
    return why ? why : c->recompute != 0 && c->recompute != 1 ? "recompute must be 0 or 1" : NULL;
}

static int create_inner(GPT2Cuda *m, int B, int T) {
    const GPT2CudaConfig *c = &m->c;
    int64_t Vp = c->padded_vocab_size, C = c->channels, L = c->num_layers, NH = c->num_heads;
    int64_t st = c->stable_embedding ? 1 : 0;
    GPT2Config shape = {c->max_seq_len, c->vocab_size, c->padded_vocab_size, c->num_layers, c->num_heads, c->channels,
                        c->stable_embedding};
    int64_t *sizes = m->param_sizes;
    gpt2_param_sizes(&shape, sizes);
    m->num_parameters = 0;
    for (int i = 0; i < GPT2_NUM_PARAMS; i++) m->num_parameters += sizes[i];
    m->elem = m->precision == GPT2_CUDA_BF16 ? 2 : 4;
    m->Bmax = B; m->Tmax = T;
    // The sizes in double, where nothing overflows, checked against gpt2.h's limit before any is used
    // as an integer: below it every partial product is an exact integer in double.
    double BT = (double)B * T, X = (double)m->elem, F = 4, b = B, t = T, nchunks = (double)cdiv((int64_t)B * T, COLSUM_ROWS);
    double partial = nchunks * 2 * 4 * C > GPT2_NUM_PARAMS * NORM_BLOCKS ? nchunks * 2 * 4 * C : GPT2_NUM_PARAMS * NORM_BLOCKS;
    double clip_floats = 2.0 * (L + 2) + 2.0;   // after the partials: gpt2_cuda_clip_group's sums (L + 2 doubles), scale
    // one layer's activations, A_LN1 .. A_FCH_GELU: L of them, or one with recompute (the other block empty)
    double layer[NUM_LAYER_ACTS] = {X * BT * C, F * BT, F * BT, X * BT * 3 * C, X * BT * C, X * b * NH * t * t,
                                    X * BT * C, X * BT * C, F * BT, F * BT, X * BT * 4 * C, X * BT * 4 * C};
    double bytes[NUM_ACTS] = {X * BT * C, X * st * BT * C, F * st * BT, F * st * BT};
    for (int i = 0; i < NUM_LAYER_ACTS; i++) {
        bytes[A_LN1 + i] = c->recompute ? 0 : L * layer[i];
        bytes[A_ONE_LAYER + i] = c->recompute ? layer[i] : 0;
    }
    double rest[NUM_ACTS - A_RES3] = {
        X * L * BT * C, X * BT * C, F * BT, F * BT, X * BT * Vp, F * BT,
        X * BT * C, X * BT * C, X * BT * 4 * C, X * BT * 3 * C, X * 3 * BT * C, X * 3 * BT * C, X * BT * C,
        X * b * NH * t * t, F * (partial + clip_floats), 4 * (5 * BT + 1), (double)WORKSPACE_BYTES};
    memcpy(bytes + A_RES3, rest, sizeof rest);
    double total = 0.0;
    for (int i = 0; i < NUM_ACTS; i++) total += bytes[i] + 256;
    if (total > (double)GPT2_MAX_ACT_BYTES)
        return fail("gpt2_cuda_create: activations for B=%d, T=%d: %.3g bytes, more than the limit of 2^52 bytes "
                    "(GPT2_MAX_ACT_BYTES)", B, T, total);
    m->partial_floats = (int64_t)partial;
    CU(cudaMalloc(&m->params_memory, m->elem * (size_t)m->num_parameters));
    CU(cudaMemset(m->params_memory, 0, m->elem * (size_t)m->num_parameters));
    char *pp = (char *)m->params_memory;
    for (int i = 0; i < GPT2_NUM_PARAMS; i++) { m->params[i] = sizes[i] ? pp : NULL; pp += m->elem * (size_t)sizes[i]; }
    m->acts_total = 0;
    for (int i = 0; i < NUM_ACTS; i++) {
        m->act_bytes[i] = (size_t)bytes[i];
        m->acts_total += (size_t)cdiv((int64_t)bytes[i], 256) * 256;     // every tensor 256-byte aligned
    }
    CU(cudaMalloc(&m->acts_memory, m->acts_total));
    // poison: a read of anything not written shows as NaN (0xffff.. is NaN in fp32 and bf16)
    CU(cudaMemset(m->acts_memory, 0xff, m->acts_total));
    char *ap = (char *)m->acts_memory;
    for (int i = 0; i < NUM_ACTS; i++) { m->act[i] = m->act_bytes[i] ? ap : NULL; ap += cdiv(bytes[i], 256) * 256; }

    m->host_tokens = (int *)malloc(sizeof(int) * (size_t)(tok_ints(m) + 2 * Vp));
    m->host_stage = (uint16_t *)malloc(sizeof(uint16_t) * (size_t)STAGE);
    if (!m->host_tokens || !m->host_stage) return fail("gpt2_cuda_create: out of host memory");
    CU(cudaStreamCreate(&m->stream));
    cublasStatus_t s = cublasLtCreate(&m->lt);
    if (s != CUBLAS_STATUS_SUCCESS) return fail("gpt2_cuda_create: cublasLtCreate: %s", cublasLtGetStatusString(s));
    return 0;
}

extern "C" int gpt2_cuda_create(GPT2Cuda **out, const GPT2CudaConfig *c, int precision, int B, int T) {
    if (!out || !c) return fail("gpt2_cuda_create: NULL argument");
    *out = NULL;
    if (config_problem(c))
        return fail("gpt2_cuda_create: bad model shape maxT=%d V=%d Vp=%d L=%d NH=%d C=%d (stable_embedding %d, recompute %d): %s",
                    c->max_seq_len, c->vocab_size, c->padded_vocab_size, c->num_layers, c->num_heads, c->channels,
                    c->stable_embedding, c->recompute, config_problem(c));
    if (precision != GPT2_CUDA_FP32 && precision != GPT2_CUDA_BF16) return fail("gpt2_cuda_create: precision %d", precision);
    if (B < 1 || T < 1 || T > c->max_seq_len) return fail("gpt2_cuda_create: B=%d, T=%d (need T <= maxT = %d)", B, T, c->max_seq_len);
    GPT2Cuda *m = (GPT2Cuda *)calloc(1, sizeof(GPT2Cuda));
    if (!m) return fail("gpt2_cuda_create: out of host memory");
    m->c = *c;
    m->precision = precision;
    m->one_layer = -1;
    if (create_inner(m, B, T)) {
        char keep[sizeof gpt2_cuda_error_text];
        memcpy(keep, gpt2_cuda_error_text, sizeof keep);
        gpt2_cuda_free(m);
        memcpy(gpt2_cuda_error_text, keep, sizeof keep);
        return -1;
    }
    *out = m;
    return 0;
}

extern "C" void gpt2_cuda_free(GPT2Cuda *m) {
    if (!m) return;
    if (m->stream) cudaStreamSynchronize(m->stream);
    if (m->ev) { for (int i = 0; i < MAX_EVENTS; i++) if (m->ev[i]) cudaEventDestroy(m->ev[i]); free(m->ev); }
    if (m->lt) cublasLtDestroy(m->lt);
    if (m->stream) cudaStreamDestroy(m->stream);
    cudaFree(m->params_memory);
    cudaFree(m->acts_memory);
    free(m->host_tokens);
    free(m->host_stage);
    free(m);
}

extern "C" int gpt2_cuda_precision(const GPT2Cuda *m) { return m->precision; }
extern "C" struct CUstream_st *gpt2_cuda_stream(const GPT2Cuda *m) { return m->stream; }
extern "C" int64_t gpt2_cuda_num_parameters(const GPT2Cuda *m) { return m->num_parameters; }
extern "C" void gpt2_cuda_param_sizes(const GPT2Cuda *m, int64_t sizes[GPT2_NUM_PARAMS]) {
    memcpy(sizes, m->param_sizes, sizeof m->param_sizes);
}
extern "C" void *gpt2_cuda_params(GPT2Cuda *m) { return m->params_memory; }
extern "C" void *gpt2_cuda_param_tensor(GPT2Cuda *m, int i) {
    return i >= 0 && i < GPT2_NUM_PARAMS ? m->params[i] : NULL;
}

// fp32 host <-> device parameters; bf16 through a host staging buffer, STAGE elements at a time.
extern "C" int gpt2_cuda_set_params(GPT2Cuda *m, const float *host) {
    if (!m || !host) return fail("gpt2_cuda_set_params: NULL argument");
    CU(cudaStreamSynchronize(m->stream));
    if (m->precision == GPT2_CUDA_FP32) {
        CU(cudaMemcpy(m->params_memory, host, 4 * (size_t)m->num_parameters, cudaMemcpyHostToDevice));
        return 0;
    }
    for (int64_t i0 = 0; i0 < m->num_parameters; i0 += STAGE) {
        int64_t n = m->num_parameters - i0 < STAGE ? m->num_parameters - i0 : STAGE;
        #pragma omp parallel for schedule(static)   // a 30e9 model's conversion: seconds, not a minute
        for (int64_t i = 0; i < n; i++) m->host_stage[i] = bnb8_f32_to_bf16(host[i0 + i]);
        CU(cudaMemcpy((uint16_t *)m->params_memory + i0, m->host_stage, 2 * (size_t)n, cudaMemcpyHostToDevice));
    }
    return 0;
}

extern "C" int gpt2_cuda_get_params(GPT2Cuda *m, float *host) {
    if (!m || !host) return fail("gpt2_cuda_get_params: NULL argument");
    CU(cudaStreamSynchronize(m->stream));
    if (m->precision == GPT2_CUDA_FP32) {
        CU(cudaMemcpy(host, m->params_memory, 4 * (size_t)m->num_parameters, cudaMemcpyDeviceToHost));
        return 0;
    }
    for (int64_t i0 = 0; i0 < m->num_parameters; i0 += STAGE) {
        int64_t n = m->num_parameters - i0 < STAGE ? m->num_parameters - i0 : STAGE;
        CU(cudaMemcpy(m->host_stage, (uint16_t *)m->params_memory + i0, 2 * (size_t)n, cudaMemcpyDeviceToHost));
        #pragma omp parallel for schedule(static)
        for (int64_t i = 0; i < n; i++) host[i0 + i] = bnb8_bf16_to_f32(m->host_stage[i]);
    }
    return 0;
}

extern "C" int gpt2_cuda_loss(GPT2Cuda *m, float *mean_loss, float *losses) {
    if (!m) return fail("gpt2_cuda_loss: NULL model");
    if (!m->has_targets) return fail("gpt2_cuda_loss: the last forward had no targets");
    int64_t BT = m->B * m->T;
    float *buf = losses ? losses : (float *)malloc(sizeof(float) * (size_t)BT);
    if (!buf) return fail("gpt2_cuda_loss: out of host memory");
    cudaError_t e = cudaMemcpyAsync(buf, m->act[A_LOSSES], sizeof(float) * (size_t)BT, cudaMemcpyDeviceToHost, m->stream);
    if (e == cudaSuccess) e = cudaStreamSynchronize(m->stream);
    double sum = 0.0;
    for (int64_t i = 0; i < BT && e == cudaSuccess; i++) sum += buf[i];
    if (mean_loss) *mean_loss = (float)(sum / (double)BT);
    if (!losses) free(buf);
    if (e != cudaSuccess) return fail("gpt2_cuda_loss: %s", cudaGetErrorString(e));
    return 0;
}

extern "C" int gpt2_cuda_get_logits(GPT2Cuda *m, float *host, int64_t row0, int64_t count) {
    if (!m || !host) return fail("gpt2_cuda_get_logits: NULL argument");
    if (m->has_dlogits) return fail("gpt2_cuda_get_logits: the last forward (for_backward) replaced the logits by their gradient");
    int64_t Vp = m->c.padded_vocab_size;
    if (row0 < 0 || count < 0 || row0 + count > m->B * m->T) return fail("gpt2_cuda_get_logits: rows %lld..+%lld", (long long)row0, (long long)count);
    CU(cudaStreamSynchronize(m->stream));
    if (m->precision == GPT2_CUDA_FP32) {
        CU(cudaMemcpy(host, (float *)m->act[A_LOGITS] + row0 * Vp, 4 * (size_t)(count * Vp), cudaMemcpyDeviceToHost));
        return 0;
    }
    for (int64_t i0 = 0; i0 < count * Vp; i0 += STAGE) {
        int64_t n = count * Vp - i0 < STAGE ? count * Vp - i0 : STAGE;
        CU(cudaMemcpy(m->host_stage, (uint16_t *)m->act[A_LOGITS] + row0 * Vp + i0, 2 * (size_t)n, cudaMemcpyDeviceToHost));
        for (int64_t i = 0; i < n; i++) host[i0 + i] = bnb8_bf16_to_f32(m->host_stage[i]);
    }
    return 0;
}

extern "C" int gpt2_cuda_grads_point(const GPT2Cuda *m, GPT2CudaGrads *g, void *memory, int dtype) {
    if (!m || !g || !memory) return fail("gpt2_cuda_grads_point: NULL argument");
    if (dtype != GPT2_CUDA_FP32 && dtype != GPT2_CUDA_BF16) return fail("gpt2_cuda_grads_point: dtype %d", dtype);
    size_t es = dtype == GPT2_CUDA_BF16 ? 2 : 4;
    char *p = (char *)memory;
    for (int i = 0; i < GPT2_NUM_PARAMS; i++) { g->tensor[i] = m->param_sizes[i] ? p : NULL; p += es * (size_t)m->param_sizes[i]; }
    g->dtype = dtype;
    g->reuse_layer_slice = 0;
    g->memory = NULL;
    return 0;
}

extern "C" int gpt2_cuda_grads_alloc(const GPT2Cuda *m, GPT2CudaGrads *g, int dtype, int reuse_layer_slice, size_t *bytes) {
    if (!m || !g) return fail("gpt2_cuda_grads_alloc: NULL argument");
    memset(g, 0, sizeof *g);
    if (dtype != GPT2_CUDA_FP32 && dtype != GPT2_CUDA_BF16) return fail("gpt2_cuda_grads_alloc: dtype %d", dtype);
    if (dtype == GPT2_CUDA_BF16 && m->precision != GPT2_CUDA_BF16) return fail("gpt2_cuda_grads_alloc: bf16 gradients need a bf16 model");
    size_t es = dtype == GPT2_CUDA_BF16 ? 2 : 4, total = 0;
    int64_t n[GPT2_NUM_PARAMS];
    for (int i = 0; i < GPT2_NUM_PARAMS; i++) {
        int layer = i >= GPT2_FIRST_LAYER_PARAM && i <= GPT2_LAST_LAYER_PARAM;
        n[i] = reuse_layer_slice && layer ? m->param_sizes[i] / m->c.num_layers : m->param_sizes[i];
        total += (size_t)cdiv(es * (size_t)n[i], 256) * 256;    // every tensor 256-byte aligned
    }
    CU(cudaMalloc(&g->memory, total));
    CU(cudaMemset(g->memory, 0, total));
    char *p = (char *)g->memory;
    for (int i = 0; i < GPT2_NUM_PARAMS; i++) { g->tensor[i] = n[i] ? p : NULL; p += cdiv(es * (size_t)n[i], 256) * 256; }
    g->dtype = dtype;
    g->reuse_layer_slice = reuse_layer_slice;
    if (bytes) *bytes = total;
    return 0;
}

extern "C" void gpt2_cuda_grads_free(GPT2CudaGrads *g) {
    if (g && g->memory) cudaFree(g->memory);
    if (g) memset(g, 0, sizeof *g);
}

extern "C" int gpt2_cuda_device(char *name, size_t name_size, size_t *free_bytes, size_t *total_bytes) {
    int count = 0, dev = 0;
    cudaError_t e = cudaGetDeviceCount(&count);
    if (e != cudaSuccess || count < 1)
        return fail("no GPU: %s", e != cudaSuccess ? cudaGetErrorString(e) : "cudaGetDeviceCount found none");
    cudaDeviceProp prop;
    CU(cudaGetDevice(&dev));
    CU(cudaGetDeviceProperties(&prop, dev));
    size_t f = 0, t = 0;
    CU(cudaMemGetInfo(&f, &t));
    if (name && name_size) snprintf(name, name_size, "%s", prop.name);
    if (free_bytes) *free_bytes = f;
    if (total_bytes) *total_bytes = t;
    return 0;
}

// The sum of squares of count buffers, each in NORM_BLOCKS float partials (grid-stride, the block's
// tree), added in double in buffer and block order: the same bits for the same buffers, run to run.
extern "C" int gpt2_cuda_sum_squares(GPT2Cuda *m, const void *const *bufs, const int64_t *n, int count, int dtype, double *sum) {
    if (!m || !sum || (count > 0 && (!bufs || !n))) return fail("gpt2_cuda_sum_squares: NULL argument");
    if (count < 0 || (dtype != GPT2_CUDA_BF16 && dtype != GPT2_CUDA_FP32)) return fail("gpt2_cuda_sum_squares: %d buffers of dtype %d", count, dtype);
    float *partial = (float *)m->act[A_PARTIAL];
    static float host[GPT2_NUM_PARAMS * NORM_BLOCKS];
    double s = 0.0;
    for (int first = 0; first < count; first += GPT2_NUM_PARAMS) {   // as many buffers as the partials hold at once
        int k = count - first < GPT2_NUM_PARAMS ? count - first : GPT2_NUM_PARAMS;
        for (int i = 0; i < k; i++) {
            if (!n[first + i]) continue;
            if (dtype == GPT2_CUDA_BF16)
                sumsq_kernel<bf16><<<NORM_BLOCKS, 256, 0, m->stream>>>(partial + i * NORM_BLOCKS, (const bf16 *)bufs[first + i], n[first + i]);
            else
                sumsq_kernel<float><<<NORM_BLOCKS, 256, 0, m->stream>>>(partial + i * NORM_BLOCKS, (const float *)bufs[first + i], n[first + i]);
            LAUNCHED();
        }
        CU(cudaMemcpyAsync(host, partial, sizeof(float) * NORM_BLOCKS * (size_t)k, cudaMemcpyDeviceToHost, m->stream));
        CU(cudaStreamSynchronize(m->stream));
        for (int i = 0; i < k; i++)
            if (n[first + i])
                for (int b = 0; b < NORM_BLOCKS; b++) s += host[i * NORM_BLOCKS + b];
    }
    *sum = s;
    return 0;
}

extern "C" int gpt2_cuda_grad_norm(GPT2Cuda *m, const GPT2CudaGrads *g, double *norm) {
    if (!m || !g || !norm) return fail("gpt2_cuda_grad_norm: NULL argument");
    if (g->reuse_layer_slice) return fail("gpt2_cuda_grad_norm: needs full gradients, not per-layer slices (gradient release)");
    const void *bufs[GPT2_NUM_PARAMS];
    double s = 0.0;
    for (int i = 0; i < GPT2_NUM_PARAMS; i++) bufs[i] = g->tensor[i];
    if (gpt2_cuda_sum_squares(m, bufs, m->param_sizes, GPT2_NUM_PARAMS, g->dtype, &s)) return -1;
    *norm = sqrt(s);
    return 0;
}

// The clipping buffers after the partials: L + 2 sums, then the scale.
static double *clip_sums(GPT2Cuda *m) { return (double *)((float *)m->act[A_PARTIAL] + m->partial_floats); }
extern "C" float *gpt2_cuda_clip_scale(GPT2Cuda *m) { return (float *)(clip_sums(m) + m->c.num_layers + 2); }

// The checks of both clipping calls: count buffers (0 allowed for a rank's partials), group k, share.
static int clip_args(const GPT2Cuda *m, const char *fn, int count, int min_count, int dtype, int k, double share, int64_t accum) {
    if (count < min_count || count > CLIP_MAX_TENSORS || k < 0 || k >= m->c.num_layers + 2 || !(share > 0.0 && share <= 1.0) ||
        accum < 1 || (dtype != GPT2_CUDA_BF16 && dtype != GPT2_CUDA_FP32) || (dtype == GPT2_CUDA_BF16 && m->precision != GPT2_CUDA_BF16))
        return fail("%s: %d tensors (%d..%d), group %d (0..%d), share %g ((0, 1]), accum %lld, dtype %d", fn, count, min_count,
                    CLIP_MAX_TENSORS, k, m->c.num_layers + 1, share, (long long)accum, dtype);
    return 0;
}
// count * CLIP_BLOCKS partial sums of the buffers into partial (stream s).
static int clip_partials(GPT2Cuda *m, void *const *bufs, const int64_t *n, int count, int dtype, double *partial, cudaStream_t s) {
    ClipGroup g = {};
    for (int i = 0; i < count; i++) { g.p[i] = bufs[i]; g.n[i] = n[i]; }
    dim3 grid(CLIP_BLOCKS, (unsigned)count);
    if (count == 0) return 0;
    if (dtype == GPT2_CUDA_BF16) clip_sumsq_kernel<bf16><<<grid, 256, 0, s>>>(partial, g);
    else clip_sumsq_kernel<float><<<grid, 256, 0, s>>>(partial, g);
    LAUNCHED();
    return 0;
}

extern "C" int gpt2_cuda_clip_group(GPT2Cuda *m, void *const *bufs, const int64_t *n, int count, int dtype, int k,
                                    double share, float clip, int64_t accum) {
    if (!m || !bufs || !n) return fail("gpt2_cuda_clip_group: NULL argument");
    if (clip_args(m, "gpt2_cuda_clip_group", count, 1, dtype, k, share, accum)) return -1;
    double *partial = (double *)m->act[A_PARTIAL];   // CLIP_MAX_TENSORS x CLIP_BLOCKS doubles fit the partials
    if (clip_partials(m, bufs, n, count, dtype, partial, m->stream)) return -1;
    clip_scale_kernel<<<1, 256, 0, m->stream>>>(partial, count * CLIP_BLOCKS, clip_sums(m), k, share, clip, accum,
                                                gpt2_cuda_clip_scale(m));
    LAUNCHED();
    return 0;
}

extern "C" int gpt2_cuda_clip_partials(GPT2Cuda *m, void *const *bufs, const int64_t *n, int count, int dtype, double *partial,
                                       struct CUstream_st *stream) {
    if (!m || !partial || (count > 0 && (!bufs || !n))) return fail("gpt2_cuda_clip_partials: NULL argument");
    if (clip_args(m, "gpt2_cuda_clip_partials", count, 0, dtype, 0, 1.0, 1)) return -1;
    CU(cudaMemsetAsync(partial, 0, sizeof(double) * GPT2_CUDA_CLIP_PARTIALS, (cudaStream_t)stream));
    return clip_partials(m, bufs, n, count, dtype, partial, (cudaStream_t)stream);
}

extern "C" int gpt2_cuda_clip_scale_parts(GPT2Cuda *m, const double *partial, int ranks, int k, double share, float clip,
                                          int64_t accum, struct CUstream_st *stream) {
    if (!m || !partial) return fail("gpt2_cuda_clip_scale_parts: NULL argument");
    if (ranks < 1 || clip_args(m, "gpt2_cuda_clip_scale_parts", 1, 1, m->precision, k, share, accum))
        return ranks < 1 ? fail("gpt2_cuda_clip_scale_parts: %d ranks", ranks) : -1;
    clip_scale_kernel<<<1, 256, 0, (cudaStream_t)stream>>>(partial, ranks * GPT2_CUDA_CLIP_PARTIALS, clip_sums(m), k, share, clip,
                                                           accum, gpt2_cuda_clip_scale(m));
    LAUNCHED();
    return 0;
}

extern "C" int gpt2_cuda_clip_sums(GPT2Cuda *m, double *host) {
    if (!m || !host) return fail("gpt2_cuda_clip_sums: NULL argument");
    CU(cudaMemcpyAsync(host, clip_sums(m), sizeof(double) * (size_t)(m->c.num_layers + 2), cudaMemcpyDeviceToHost, m->stream));
    CU(cudaStreamSynchronize(m->stream));
    return 0;
}

extern "C" size_t gpt2_cuda_param_bytes(const GPT2Cuda *m) { return m->elem * (size_t)m->num_parameters; }
extern "C" size_t gpt2_cuda_act_bytes(const GPT2Cuda *m) { return m->acts_total; }
extern "C" int gpt2_cuda_num_act_tensors(void) { return NUM_ACTS; }
extern "C" const char *gpt2_cuda_act_name(int i) { return i >= 0 && i < NUM_ACTS ? act_names[i] : ""; }
extern "C" size_t gpt2_cuda_act_tensor_bytes(const GPT2Cuda *m, int i) { return i >= 0 && i < NUM_ACTS ? m->act_bytes[i] : 0; }

// ------------------------------------------------------------------------------------------------
// Profiling

extern "C" int gpt2_cuda_profile(GPT2Cuda *m, int on) {
    if (!m) return fail("gpt2_cuda_profile: NULL model");
    if (on && !m->ev) {
        m->ev = (cudaEvent_t *)calloc(MAX_EVENTS, sizeof(cudaEvent_t));
        if (!m->ev) return fail("gpt2_cuda_profile: out of host memory");
        for (int i = 0; i < MAX_EVENTS; i++) CU(cudaEventCreate(&m->ev[i]));
    }
    m->prof_on = on;
    m->nev = 0;
    m->nphase = 0;
    return 0;
}

extern "C" int gpt2_cuda_profile_read(GPT2Cuda *m, const char **names, double *ms, int *counts, int max) {
    if (!m) return fail("gpt2_cuda_profile_read: NULL model");
    CU(cudaStreamSynchronize(m->stream));
    for (int i = 0; i + 1 < m->nev; i++) {
        const char *name = m->ev_name[i];
        if (!name) continue;
        float t = 0.0f;
        CU(cudaEventElapsedTime(&t, m->ev[i], m->ev[i + 1]));
        int k = 0;
        while (k < m->nphase && strcmp(m->phase_name[k], name) != 0) k++;
        if (k == m->nphase) {
            if (m->nphase == MAX_PHASES) continue;
            m->phase_name[k] = name; m->phase_ms[k] = 0.0; m->phase_count[k] = 0; m->nphase++;
        }
        m->phase_ms[k] += t;
        m->phase_count[k]++;
    }
    m->nev = 0;
    int n = m->nphase < max ? m->nphase : max;
    for (int k = 0; k < n; k++) {
        if (names) names[k] = m->phase_name[k];
        if (ms) ms[k] = m->phase_ms[k];
        if (counts) counts[k] = m->phase_count[k];
    }
    return n;
}
