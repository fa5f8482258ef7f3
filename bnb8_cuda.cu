/*
bnb8_cuda.cu — the GPU back end: the twin of every CPU entry point of bnb8.c, using the same
per-element math from bnb8.h so that results are bit-identical. Build with -fmad=false and without
--use_fast_math. Every launch goes on the caller's stream; nothing here synchronizes.
*/
#include "bnb8.h"
#include <cuda_runtime.h>

#define BNB8_THREADS 256

static int bnb8_cuda_status(const char *fn, cudaError_t err) {
    if (err == cudaSuccess) return BNB8_OK;
    return bnb8_fail(BNB8_ERR_CUDA, "%s: %s", fn, cudaGetErrorString(err));
}

// A pointer the CPU gave where device memory is needed is an error, not a crash.
static int bnb8_cuda_check_device_ptr(const char *fn, const void *p) {
    cudaPointerAttributes attr;
    cudaError_t err = cudaPointerGetAttributes(&attr, p);
    if (err != cudaSuccess) return bnb8_cuda_status(fn, err);
    if (attr.type != cudaMemoryTypeDevice && attr.type != cudaMemoryTypeManaged)
        return bnb8_fail(BNB8_ERR_DEVICE, "%s: pointer %p is not device memory", fn, p);
    return BNB8_OK;
}

// ------------------------------------------------------------------------------------------------
// Layout shared by the kernels. A CUDA block of 256 threads works on chunks of R rows of 1024
// elements. Warp w owns the contiguous segment [w * 128R, (w + 1) * 128R) of a chunk; lane l holds
// elements r * 128 + 4l .. 4l + 3 of it for r < R (one 16-byte access per fp32 row, every warp
// access contiguous). With R = 2 an 8-bit block of 256 elements is exactly one warp's segment, so
// its absmax is a warp shuffle, with no shared memory and no barrier.

#define BNB8_V 4
#define BNB8_ROW (BNB8_THREADS * BNB8_V)
#define BNB8_WARPS (BNB8_THREADS / 32)

__device__ int bnb8_log2(int64_t b) { return 63 - __clzll((unsigned long long)b); }

// Index, within a chunk, of this thread's first element of row r.
template <int R> __device__ int64_t bnb8_offset(int r) {
    return (int64_t)(threadIdx.x / 32) * 128 * R + r * 128 + (threadIdx.x % 32) * BNB8_V;
}

// Elements i..i+3 of x as float (zero past n): one vector access when vec allows. The data is
// streamed once: loads and stores may be marked evict-first (build with -DBNB8_NO_STREAMING to
// compare).
#ifdef BNB8_NO_STREAMING
#define BNB8_LD(p) (*(p))
#define BNB8_ST(p, v) (*(p) = (v))
#else
#define BNB8_LD(p) __ldcs(p)
#define BNB8_ST(p, v) __stcs((p), (v))
#endif
__device__ void bnb8_load4(const void *x, int dtype, int64_t i, int64_t n, bool vec, float v[4]) {
    if (vec && i + 4 <= n) {
        if (dtype == BNB8_F32) {
            float4 f = BNB8_LD((const float4 *)((const float *)x + i));
            v[0] = f.x; v[1] = f.y; v[2] = f.z; v[3] = f.w;
        } else {
            uint2 w = BNB8_LD((const uint2 *)((const uint16_t *)x + i));
            uint16_t h[4] = {(uint16_t)w.x, (uint16_t)(w.x >> 16), (uint16_t)w.y, (uint16_t)(w.y >> 16)};
            #pragma unroll
            for (int j = 0; j < 4; j++) v[j] = dtype == BNB8_BF16 ? bnb8_bf16_to_f32(h[j]) : bnb8_f16_to_f32(h[j]);
        }
        return;
    }
    #pragma unroll
    for (int j = 0; j < 4; j++) v[j] = i + j < n ? bnb8_load(x, (bnb8_dtype)dtype, i + j) : 0.0f;
}

__device__ void bnb8_store4(void *x, int dtype, int64_t i, int64_t n, bool vec, const float v[4]) {
    if (vec && i + 4 <= n) {
        if (dtype == BNB8_F32) {
            BNB8_ST((float4 *)((float *)x + i), make_float4(v[0], v[1], v[2], v[3]));
        } else {
            uint16_t h[4];
            #pragma unroll
            for (int j = 0; j < 4; j++) h[j] = dtype == BNB8_BF16 ? bnb8_f32_to_bf16(v[j]) : bnb8_f32_to_f16(v[j]);
            BNB8_ST((uint2 *)((uint16_t *)x + i), make_uint2(h[0] | ((uint32_t)h[1] << 16), h[2] | ((uint32_t)h[3] << 16)));
        }
        return;
    }
    #pragma unroll
    for (int j = 0; j < 4; j++) if (i + j < n) bnb8_store(x, (bnb8_dtype)dtype, i + j, v[j]);
}

__device__ void bnb8_load_codes4(const uint8_t *q, int64_t i, int64_t n, bool vec, uint8_t c[4]) {
    if (vec && i + 4 <= n) { uint32_t w = BNB8_LD((const unsigned int *)(q + i)); memcpy(c, &w, 4); return; }
    #pragma unroll
    for (int j = 0; j < 4; j++) c[j] = i + j < n ? q[i + j] : 0;
}

__device__ void bnb8_store_codes4(uint8_t *q, int64_t i, int64_t n, bool vec, const uint8_t c[4]) {
    if (vec && i + 4 <= n) { uint32_t w; memcpy(&w, c, 4); BNB8_ST((unsigned int *)(q + i), w); return; }
    #pragma unroll
    for (int j = 0; j < 4; j++) if (i + j < n) q[i + j] = c[j];
}

// Fills a codebook in shared memory, all threads of the block together.
__device__ void bnb8_codebook_fill(bnb8_codebook *cb, const float *code) {
    for (int k = threadIdx.x; k < 256; k += blockDim.x) cb->t[k] = bnb8_threshold(code, k);
    __syncthreads();
    for (int b = threadIdx.x; b < BNB8_LOOKUP_SIZE; b += blockDim.x) cb->entry[b] = bnb8_codebook_entry(cb->t, b);
    __syncthreads();
}

// amax[r] of each of this thread's R rows becomes the max over its whole 8-bit block of B
// elements: lanes, then rows of the warp's segment, then (B > 128R) warps through scratch. All
// threads of the block call it with the same B.
template <int R>
__device__ void bnb8_block_max(float amax[R], int B, float *scratch) {
    int lanes = B / BNB8_V < 32 ? B / BNB8_V : 32;
    #pragma unroll
    for (int r = 0; r < R; r++)
        for (int off = 1; off < lanes; off <<= 1) amax[r] = fmaxf(amax[r], __shfl_xor_sync(0xffffffffu, amax[r], off));
    if (B <= 128) return;
    int rows = B / 128 < R ? B / 128 : R;
    float m[R];
    #pragma unroll
    for (int r = 0; r < R; r++) {
        m[r] = 0.0f;
        #pragma unroll
        for (int rr = 0; rr < R; rr++) if (rr / rows == r / rows) m[r] = fmaxf(m[r], amax[rr]);
    }
    #pragma unroll
    for (int r = 0; r < R; r++) amax[r] = m[r];
    if (B <= 128 * R) return;
    int warp = threadIdx.x / 32, warps = B / (128 * R), w0 = warp / warps * warps;
    __syncthreads();                                   // scratch may still be read by a former call
    if (threadIdx.x % 32 == 0) scratch[warp] = amax[0];
    __syncthreads();
    float w = 0.0f;
    for (int k = w0; k < w0 + warps; k++) w = fmaxf(w, scratch[k]);
    #pragma unroll
    for (int r = 0; r < R; r++) amax[r] = w;
}

// Rows per chunk for a block size: 2, or 4 for blocks of 4096 (a chunk holds whole blocks).
static int bnb8_rows_for(int64_t blocksize) { return blocksize > 2 * BNB8_ROW ? 4 : 2; }

// ------------------------------------------------------------------------------------------------
// Block-wise quantization: a persistent grid over chunks.

template <int R>
__global__ void __launch_bounds__(BNB8_THREADS)
bnb8_quantize_kernel(const void *x, int dtype, int64_t n, const float *code, int64_t blocksize,
                     uint8_t *q, float *absmax, unsigned long long *nonfinite) {
    __shared__ bnb8_codebook cb;
    __shared__ float scratch[BNB8_WARPS];
    bnb8_codebook_fill(&cb, code);
    int zero_code = bnb8_nearest_code(cb.t, 0.0f), shift = bnb8_log2(blocksize);
    bool vec = ((uintptr_t)x & 15) == 0 && ((uintptr_t)q & 3) == 0;
    unsigned bad = 0;
    int64_t chunks = (n + (int64_t)R * BNB8_ROW - 1) / ((int64_t)R * BNB8_ROW);
    for (int64_t chunk = blockIdx.x; chunk < chunks; chunk += gridDim.x) {
        float v[R][4], amax[R];
        #pragma unroll
        for (int r = 0; r < R; r++) bnb8_load4(x, dtype, chunk * R * BNB8_ROW + bnb8_offset<R>(r), n, vec, v[r]);
        #pragma unroll
        for (int r = 0; r < R; r++) {
            amax[r] = 0.0f;
            #pragma unroll
            for (int j = 0; j < 4; j++) {
                if (bnb8_isfinite(v[r][j])) amax[r] = fmaxf(amax[r], fabsf(v[r][j]));
                else bad++;
            }
        }
        bnb8_block_max<R>(amax, (int)blocksize, scratch);
        #pragma unroll
        for (int r = 0; r < R; r++) {
            int64_t i = chunk * R * BNB8_ROW + bnb8_offset<R>(r);
            if (i < n && (i & (blocksize - 1)) == 0) absmax[i >> shift] = amax[r];
            uint8_t c[4];
            #pragma unroll
            for (int j = 0; j < 4; j++)
                c[j] = (uint8_t)(amax[r] > 0.0f && bnb8_isfinite(v[r][j]) ? bnb8_nearest_code_fast(&cb, v[r][j] / amax[r]) : zero_code);
            bnb8_store_codes4(q, i, n, vec, c);
        }
    }
    if (nonfinite) {
        for (int off = 16; off > 0; off >>= 1) bad += __shfl_xor_sync(0xffffffffu, bad, off);
        if (threadIdx.x % 32 == 0 && bad) atomicAdd(nonfinite, (unsigned long long)bad);
    }
}

__global__ void __launch_bounds__(BNB8_THREADS)
bnb8_dequantize_kernel(const uint8_t *q, const float *absmax, int64_t n, const float *code, int shift,
                       void *out, int dtype) {
    __shared__ float c[256];
    c[threadIdx.x] = code[threadIdx.x];
    __syncthreads();
    bool vec = ((uintptr_t)out & 15) == 0 && ((uintptr_t)q & 3) == 0;
    for (int64_t i = ((int64_t)blockIdx.x * BNB8_THREADS + threadIdx.x) * BNB8_V; i < n;
         i += (int64_t)gridDim.x * BNB8_ROW) {
        uint8_t k[4];
        bnb8_load_codes4(q, i, n, vec, k);
        float a = absmax[i >> shift], v[4];
        #pragma unroll
        for (int j = 0; j < 4; j++) v[j] = c[k[j]] * a;
        bnb8_store4(out, dtype, i, n, vec, v);
    }
}

static int bnb8_cuda_check_blockwise(const char *fn, const void *a, const void *b, const void *c,
                                     const void *d, int64_t n, int64_t blocksize, bnb8_dtype dtype) {
    if (n < 0) return bnb8_fail(BNB8_ERR_SIZE, "%s: n = %lld < 0", fn, (long long)n);
    if (blocksize < 64 || blocksize > 4096 || (blocksize & (blocksize - 1)))
        return bnb8_fail(BNB8_ERR_BLOCKSIZE, "%s: blocksize %lld", fn, (long long)blocksize);
    if (bnb8_dtype_size(dtype) == 0) return bnb8_fail(BNB8_ERR_DTYPE, "%s: dtype %d", fn, (int)dtype);
    if (n == 0) return BNB8_OK;
    if (!a || !b || !c || !d) return bnb8_fail(BNB8_ERR_NULL, "%s: NULL array", fn);
    const void *ptrs[4] = {a, b, c, d};
    for (int i = 0; i < 4; i++) {
        int status = bnb8_cuda_check_device_ptr(fn, ptrs[i]);
        if (status) return status;
    }
    return BNB8_OK;
}

// Blocks for a persistent grid: enough to fill every SM several times over, no more than needed.
static int64_t bnb8_persistent_grid(int64_t chunks, int per_sm) {
    int device = 0, sms = 132;
    cudaGetDevice(&device);
    cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
    int64_t most = (int64_t)sms * per_sm;
    return chunks < most ? (chunks > 0 ? chunks : 1) : most;
}

int bnb8_cuda_quantize_blockwise_ex(const void *x, bnb8_dtype dtype, int64_t n, const float *code,
                                    int64_t blocksize, uint8_t *q, float *absmax, int64_t *nonfinite,
                                    cudaStream_t stream) {
    const char *fn = "bnb8_cuda_quantize_blockwise";
    int status = bnb8_cuda_check_blockwise(fn, x, code, q, absmax, n, blocksize, dtype);
    if (status) return status;
    unsigned long long *count = (unsigned long long *)nonfinite;
    if (count && (status = bnb8_cuda_status(fn, cudaMemsetAsync(count, 0, sizeof *count, stream)))) return status;
    if (n == 0) return BNB8_OK;
    int rows = bnb8_rows_for(blocksize);
    int64_t grid = bnb8_persistent_grid((n + (int64_t)rows * BNB8_ROW - 1) / ((int64_t)rows * BNB8_ROW), 8);
    if (rows == 2) bnb8_quantize_kernel<2><<<grid, BNB8_THREADS, 0, stream>>>(x, dtype, n, code, blocksize, q, absmax, count);
    else bnb8_quantize_kernel<4><<<grid, BNB8_THREADS, 0, stream>>>(x, dtype, n, code, blocksize, q, absmax, count);
    return bnb8_cuda_status(fn, cudaGetLastError());
}

int bnb8_cuda_quantize_blockwise(const void *x, bnb8_dtype dtype, int64_t n, const float *code,
                                 int64_t blocksize, uint8_t *q, float *absmax, cudaStream_t stream) {
    return bnb8_cuda_quantize_blockwise_ex(x, dtype, n, code, blocksize, q, absmax, NULL, stream);
}

int bnb8_cuda_dequantize_blockwise(const uint8_t *q, const float *absmax, int64_t n, const float *code,
                                   int64_t blocksize, void *out, bnb8_dtype dtype, cudaStream_t stream) {
    const char *fn = "bnb8_cuda_dequantize_blockwise";
    int status = bnb8_cuda_check_blockwise(fn, q, absmax, code, out, n, blocksize, dtype);
    if (status || n == 0) return status;
    int shift = 63 - __builtin_clzll((unsigned long long)blocksize);
    int64_t grid = bnb8_persistent_grid((n + BNB8_ROW - 1) / BNB8_ROW, 16);
    bnb8_dequantize_kernel<<<grid, BNB8_THREADS, 0, stream>>>(q, absmax, n, code, shift, out, dtype);
    return bnb8_cuda_status(fn, cudaGetLastError());
}

// ------------------------------------------------------------------------------------------------
// Memory helpers for bnb8.c

extern "C" int bnb8_cuda_is_device_pointer(const void *p) {
    cudaPointerAttributes attr;
    if (cudaPointerGetAttributes(&attr, p) != cudaSuccess) { cudaGetLastError(); return 0; }
    return attr.type == cudaMemoryTypeDevice || attr.type == cudaMemoryTypeManaged;
}

extern "C" int bnb8_cuda_alloc_zeroed(void **p, size_t bytes) {
    int status = bnb8_cuda_status("bnb8_cuda_alloc_zeroed", cudaMalloc(p, bytes));
    if (!status) status = bnb8_cuda_status("bnb8_cuda_alloc_zeroed", cudaMemset(*p, 0, bytes));
    return status;
}

extern "C" void bnb8_cuda_free(void *p) { cudaFree(p); }

extern "C" int bnb8_cuda_copy(void *dst, const void *src, size_t bytes, int to_device) {
    return bnb8_cuda_status("bnb8_cuda_copy",
                            cudaMemcpy(dst, src, bytes, to_device ? cudaMemcpyHostToDevice : cudaMemcpyDeviceToHost));
}

// ------------------------------------------------------------------------------------------------
// Optimizer step: every tensor of a step in one launch. The tensors are cut into chunks of R rows
// (R = 2, or 4 when a tensor has 4096-element blocks); a persistent grid walks the chunks and finds
// each chunk's tensor by binary search over first_chunk.

typedef struct {
    float code[2][256];          // [0] unsigned, [1] signed dynamic map
    int64_t total_chunks;
    int count;
} bnb8_step_header;

// Per tensor, on the device: [0] sum g^2, [1] sum p^2, [2] sum u^2 (double atomics: the order
// differs from the CPU's double sums only in the last bits of a double), [3] percentile scale.
#define BNB8_NORMS 4

typedef struct {
    void *staging[2];            // pinned host buffers: header + tensors, alternating
    cudaEvent_t staged[2];       // the upload of staging[i] is done
    size_t capacity;             // bytes of each staging and of upload
    int next;
    void *upload;                // device copy of the current header + tensors
    double *norms;               // (count, BNB8_NORMS)
    int norm_capacity;
    unsigned long long *nonfinite;
    int sms;
    int update_per_sm[2][BNB8_NUM_OPTIMIZERS];   // resident blocks per SM of each update kernel
} bnb8_cuda_context;

// The tensor of a chunk: the last one whose first_chunk <= chunk. A block's chunks only grow, so
// the search walks on from the block's previous tensor (ti, 0 at the start).
__device__ int bnb8_find_tensor(const bnb8_gpu_tensor *t, int count, int64_t chunk, int ti) {
    while (ti + 1 < count && t[ti + 1].first_chunk <= chunk) ti++;
    return ti;
}

// Whether a tensor's arrays all allow vector accesses.
__device__ bool bnb8_tensor_vec(const bnb8_gpu_tensor *t) {
    uintptr_t bits = (uintptr_t)t->param | (uintptr_t)t->grad;
    for (int k = 0; k < t->args.nstates; k++) bits |= (uintptr_t)t->state[k];
    return (bits & 15) == 0;
}

// Sum over the CUDA block of v, added atomically to *out (one atomic per block).
__device__ void bnb8_block_sum_atomic(double v, double *out, double *scratch) {
    for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
    __syncthreads();
    if (threadIdx.x % 32 == 0) scratch[threadIdx.x / 32] = v;
    __syncthreads();
    if (threadIdx.x == 0) {
        double s = 0.0;
        for (int w = 0; w < BNB8_WARPS; w++) s += scratch[w];
        if (s != 0.0) atomicAdd(out, s);
    }
}

// The states of 4 elements at i: dequantized (8-bit) or loaded (32-bit).
__device__ void bnb8_load_states4(const bnb8_gpu_tensor *t, const float (*code)[256], int64_t i, bool vec,
                                  float s[3][4]) {
    #pragma unroll
    for (int k = 0; k < 3; k++) {
        if (k >= t->args.nstates) break;
        if (!t->eight_bit) { bnb8_load4(t->state[k], BNB8_F32, i, t->n, vec, s[k]); continue; }
        uint8_t c[4];
        bnb8_load_codes4((const uint8_t *)t->state[k], i, t->n, vec, c);
        float a = i < t->n ? t->absmax[k][i >> bnb8_log2(t->blocksize)] : 0.0f;
        const float *map = code[bnb8_state_signed(t->args.kind, k)];
        #pragma unroll
        for (int j = 0; j < 4; j++) s[k][j] = map[c[j]] * a;
    }
}

__device__ bool bnb8_needs_trust(const bnb8_gpu_tensor *t) {
    return (t->args.kind == BNB8_LAMB || t->args.kind == BNB8_LARS) && t->args.max_unorm > 0.0f;
}

// Pass before the update, for the tensors that need norms: sum g^2 (mode 0, percentile clipping)
// or sum p^2 and sum u^2 of the update this step would make (mode 1, LAMB and LARS).
template <int R>
__global__ void __launch_bounds__(BNB8_THREADS)
bnb8_norms_kernel(const bnb8_step_header *h, const bnb8_gpu_tensor *tensors, double *norms, int mode) {
    __shared__ float code[2][256];
    __shared__ double scratch[BNB8_WARPS];
    code[0][threadIdx.x] = h->code[0][threadIdx.x];
    code[1][threadIdx.x] = h->code[1][threadIdx.x];
    __syncthreads();
    int ti = 0;
    for (int64_t chunk = blockIdx.x; chunk < h->total_chunks; chunk += gridDim.x) {
        ti = bnb8_find_tensor(tensors, h->count, chunk, ti);
        const bnb8_gpu_tensor *t = &tensors[ti];
        if (mode == 0 ? t->percentile >= 100 : !bnb8_needs_trust(t)) continue;   // uniform over the block
        bool vec = bnb8_tensor_vec(t);
        bnb8_step_args args = t->args;
        if (t->percentile < 100) args.gnorm_scale *= (float)norms[ti * BNB8_NORMS + 3];
        double a = 0.0, b = 0.0;
        for (int r = 0; r < R; r++) {
            int64_t i = (chunk - t->first_chunk) * R * BNB8_ROW + bnb8_offset<R>(r);
            float g[4], p[4], s[3][4];
            bnb8_load4(t->grad, t->grad_dtype, i, t->n, vec, g);
            if (mode == 0) {
                for (int j = 0; j < 4; j++) if (bnb8_isfinite(g[j])) a += (double)g[j] * g[j];
                continue;
            }
            bnb8_load4(t->param, t->param_dtype, i, t->n, vec, p);
            bnb8_load_states4(t, code, i, vec, s);
            for (int j = 0; j < 4; j++) {
                if (i + j >= t->n) break;
                a += (double)p[j] * p[j];
                if (!bnb8_isfinite(g[j])) continue;
                float sj[3] = {s[0][j], s[1][j], s[2][j]};
                float u = bnb8_direction(&args, p[j], g[j], sj);
                b += (double)u * u;
            }
        }
        bnb8_block_sum_atomic(a, &norms[ti * BNB8_NORMS + (mode == 0 ? 0 : 1)], scratch);
        if (mode == 1) bnb8_block_sum_atomic(b, &norms[ti * BNB8_NORMS + 2], scratch);
    }
}

// One thread per tensor: update the gradient-norm history and store the percentile scale.
__global__ void bnb8_percentile_kernel(const bnb8_step_header *h, const bnb8_gpu_tensor *tensors, double *norms) {
    int ti = blockIdx.x * blockDim.x + threadIdx.x;
    if (ti >= h->count) return;
    const bnb8_gpu_tensor *t = &tensors[ti];
    float scale = 1.0f;
    if (t->percentile < 100)
        scale = bnb8_percentile_scale(t->history, t->step, (float)norms[ti * BNB8_NORMS + 0], t->percentile);
    norms[ti * BNB8_NORMS + 3] = scale;
}

// The update: per chunk, load p, g and the states of R rows of 4 elements per thread, update in
// float32 with the shared math, store p; 8-bit states get their block's new absmax and are
// requantized from the fresh values. Shared memory (dynamic, above the 48 KB static limit): the
// unsigned and signed codebooks, then both maps for dequantization.
struct bnb8_update_smem {
    bnb8_codebook books[2];
    float code[2][256];
    float scratch[BNB8_WARPS];
};

// KIND: every tensor of an optimizer has its kind, so the kernel is compiled per kind and the
// shared math's switch folds away.
template <int R, int KIND>
__global__ void __launch_bounds__(BNB8_THREADS, R == 2 ? 3 : 2)
bnb8_update_kernel(const bnb8_step_header *h, const bnb8_gpu_tensor *tensors, const double *norms,
                   unsigned long long *nonfinite) {
    extern __shared__ __align__(16) unsigned char bnb8_smem[];
    bnb8_update_smem &sm = *(bnb8_update_smem *)bnb8_smem;
    for (int k = threadIdx.x; k < 512; k += blockDim.x) (&sm.code[0][0])[k] = (&h->code[0][0])[k];
    __syncthreads();
    bnb8_codebook_fill(&sm.books[0], sm.code[0]);
    bnb8_codebook_fill(&sm.books[1], sm.code[1]);
    const int zero_unsigned = bnb8_nearest_code(sm.books[0].t, 0.0f), zero_signed = bnb8_nearest_code(sm.books[1].t, 0.0f);
    unsigned bad = 0;
    int ti = 0;
    for (int64_t chunk = blockIdx.x; chunk < h->total_chunks; chunk += gridDim.x) {
        ti = bnb8_find_tensor(tensors, h->count, chunk, ti);
        const bnb8_gpu_tensor *t = &tensors[ti];
        int64_t n = t->n, base = (chunk - t->first_chunk) * R * BNB8_ROW;
        bool vec = bnb8_tensor_vec(t), full = base + R * BNB8_ROW <= n;   // full: no element past n
        bnb8_step_args args = t->args;
        args.kind = KIND;
        if (t->percentile < 100) args.gnorm_scale *= (float)norms[ti * BNB8_NORMS + 3];
        float trust = bnb8_needs_trust(t)
            ? bnb8_trust_ratio(args.max_unorm, (float)norms[ti * BNB8_NORMS + 1], (float)norms[ti * BNB8_NORMS + 2]) : 1.0f;
        float p[R][4], g[R][4], s[R][3][4];
        #pragma unroll
        for (int r = 0; r < R; r++) {
            int64_t i = base + bnb8_offset<R>(r);
            bnb8_load4(t->param, t->param_dtype, i, n, vec, p[r]);
            bnb8_load4(t->grad, t->grad_dtype, i, n, vec, g[r]);
            bnb8_load_states4(t, sm.code, i, vec, s[r]);
        }
        #pragma unroll
        for (int r = 0; r < R; r++) {
            int64_t i = base + bnb8_offset<R>(r);
            #pragma unroll
            for (int j = 0; j < 4; j++) {
                if (!full && i + j >= n) continue;
                if (!bnb8_isfinite(g[r][j])) { bad++; continue; }   // the element keeps p and its states
                float sj[3] = {s[r][0][j], s[r][1][j], s[r][2][j]};
                float u = bnb8_direction(&args, p[r][j], g[r][j], sj);
                p[r][j] = bnb8_apply(&args, p[r][j], u, trust);
                s[r][0][j] = sj[0]; s[r][1][j] = sj[1]; s[r][2][j] = sj[2];
            }
            bnb8_store4(t->param, t->param_dtype, i, n, vec, p[r]);
        }
        #pragma unroll
        for (int k = 0; k < 3; k++) {
            if (k >= args.nstates) break;
            if (!t->eight_bit) {
                #pragma unroll
                for (int r = 0; r < R; r++) bnb8_store4(t->state[k], BNB8_F32, base + bnb8_offset<R>(r), n, vec, s[r][k]);
                continue;
            }
            float amax[R];
            #pragma unroll
            for (int r = 0; r < R; r++) {
                int64_t i = base + bnb8_offset<R>(r);
                amax[r] = 0.0f;
                #pragma unroll
                for (int j = 0; j < 4; j++) if (full || i + j < n) amax[r] = fmaxf(amax[r], fabsf(s[r][k][j]));
            }
            bnb8_block_max<R>(amax, t->blocksize, sm.scratch);
            int is_signed = bnb8_state_signed(args.kind, k), shift = bnb8_log2(t->blocksize);
            int zero_code = is_signed ? zero_signed : zero_unsigned;
            #pragma unroll
            for (int r = 0; r < R; r++) {
                int64_t i = base + bnb8_offset<R>(r);
                if (i < n && (i & (t->blocksize - 1)) == 0) t->absmax[k][i >> shift] = amax[r];
                uint8_t c[4];
                #pragma unroll
                for (int j = 0; j < 4; j++)
                    c[j] = (uint8_t)(amax[r] > 0.0f ? bnb8_quantize_value(&sm.books[is_signed], zero_code, s[r][k][j], amax[r])
                                                    : zero_code);
                bnb8_store_codes4((uint8_t *)t->state[k], i, n, vec, c);
            }
        }
    }
    for (int off = 16; off > 0; off >>= 1) bad += __shfl_xor_sync(0xffffffffu, bad, off);
    if (threadIdx.x % 32 == 0 && bad) atomicAdd(nonfinite, (unsigned long long)bad);
}

static int bnb8_context_reserve(bnb8_cuda_context *c, size_t bytes, int count) {
    const char *fn = "bnb8_optimizer_step";
    if (bytes > c->capacity) {
        for (int i = 0; i < 2; i++) {
            if (c->staging[i]) { cudaEventSynchronize(c->staged[i]); cudaFreeHost(c->staging[i]); c->staging[i] = NULL; }
        }
        if (c->upload) { cudaFree(c->upload); c->upload = NULL; }
        c->capacity = 0;
        size_t cap = bytes * 2;
        for (int i = 0; i < 2; i++) {
            int status = bnb8_cuda_status(fn, cudaMallocHost(&c->staging[i], cap));
            if (status) return status;
        }
        int status = bnb8_cuda_status(fn, cudaMalloc(&c->upload, cap));
        if (status) return status;
        c->capacity = cap;
    }
    if (count > c->norm_capacity) {
        if (c->norms) cudaFree(c->norms);
        c->norms = NULL;
        c->norm_capacity = 0;
        int status = bnb8_cuda_status(fn, cudaMalloc(&c->norms, sizeof(double) * BNB8_NORMS * (size_t)count * 2));
        if (status) return status;
        c->norm_capacity = count * 2;
    }
    return BNB8_OK;
}

extern "C" void bnb8_cuda_context_free(void *context) {
    bnb8_cuda_context *c = (bnb8_cuda_context *)context;
    if (!c) return;
    for (int i = 0; i < 2; i++) {
        if (c->staging[i]) { cudaEventSynchronize(c->staged[i]); cudaFreeHost(c->staging[i]); }
        cudaEventDestroy(c->staged[i]);
    }
    cudaFree(c->upload);
    cudaFree(c->norms);
    cudaFree(c->nonfinite);
    free(c);
}

static int bnb8_context_create(bnb8_cuda_context **out) {
    const char *fn = "bnb8_optimizer_step";
    bnb8_cuda_context *c = (bnb8_cuda_context *)calloc(1, sizeof *c);
    if (!c) return bnb8_fail(BNB8_ERR_NOMEM, "%s: GPU context", fn);
    int device = 0, status = bnb8_cuda_status(fn, cudaGetDevice(&device));
    if (!status) status = bnb8_cuda_status(fn, cudaDeviceGetAttribute(&c->sms, cudaDevAttrMultiProcessorCount, device));
    for (int i = 0; i < 2 && !status; i++)
        status = bnb8_cuda_status(fn, cudaEventCreateWithFlags(&c->staged[i], cudaEventDisableTiming));
    if (!status) status = bnb8_cuda_status(fn, cudaMalloc(&c->nonfinite, sizeof *c->nonfinite));
    if (!status) status = bnb8_cuda_status(fn, cudaMemset(c->nonfinite, 0, sizeof *c->nonfinite));
    if (status) { bnb8_cuda_context_free(c); return status; }
    *out = c;
    return BNB8_OK;
}

// Launches the update kernel of kind KIND with as many blocks as fit at once (each block builds
// its codebooks once); the first launch of each kernel sets its shared memory size.
template <int KIND>
static int bnb8_launch_update(bnb8_cuda_context *c, int rows, int64_t chunks, const bnb8_step_header *dh,
                              const bnb8_gpu_tensor *dt, cudaStream_t stream) {
    const char *fn = "bnb8_optimizer_step";
    const int smem = (int)sizeof(bnb8_update_smem);
    int *per_sm = &c->update_per_sm[rows == 4][KIND], status = BNB8_OK;
    void (*kernel)(const bnb8_step_header *, const bnb8_gpu_tensor *, const double *, unsigned long long *) =
        rows == 2 ? bnb8_update_kernel<2, KIND> : bnb8_update_kernel<4, KIND>;
    if (*per_sm == 0) {
        status = bnb8_cuda_status(fn, cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
        if (!status) status = bnb8_cuda_status(fn, cudaOccupancyMaxActiveBlocksPerMultiprocessor(per_sm, kernel, BNB8_THREADS, smem));
        if (!status && *per_sm < 1) status = bnb8_fail(BNB8_ERR_CUDA, "%s: the update kernel does not fit on this GPU", fn);
        if (status) { *per_sm = 0; return status; }
    }
    int64_t resident = (int64_t)c->sms * *per_sm, grid = chunks < resident ? chunks : resident;
    kernel<<<grid, BNB8_THREADS, smem, stream>>>(dh, dt, c->norms, c->nonfinite);
    return bnb8_cuda_status(fn, cudaGetLastError());
}

extern "C" int bnb8_cuda_step(void **context, const bnb8_gpu_tensor *tensors, int count,
                              const float code_unsigned[256], const float code_signed[256], cudaStream_t stream) {
    const char *fn = "bnb8_optimizer_step";
    if (count <= 0) return BNB8_OK;
    int status = *context ? BNB8_OK : bnb8_context_create((bnb8_cuda_context **)context);
    if (status) return status;
    bnb8_cuda_context *c = (bnb8_cuda_context *)*context;
    size_t header_bytes = (sizeof(bnb8_step_header) + 255) / 256 * 256;
    size_t bytes = header_bytes + sizeof(bnb8_gpu_tensor) * (size_t)count;
    if ((status = bnb8_context_reserve(c, bytes, count))) return status;
    // The staging buffer we fill was uploaded two steps ago; that copy is long done.
    int slot = c->next;
    c->next ^= 1;
    if ((status = bnb8_cuda_status(fn, cudaEventSynchronize(c->staged[slot])))) return status;
    bnb8_step_header *h = (bnb8_step_header *)c->staging[slot];
    bnb8_gpu_tensor *t = (bnb8_gpu_tensor *)((char *)c->staging[slot] + header_bytes);
    memcpy(h->code[0], code_unsigned, sizeof h->code[0]);
    memcpy(h->code[1], code_signed, sizeof h->code[1]);
    // Chunks of 2 rows, or 4 when a tensor has blocks of 4096: a chunk holds whole blocks.
    int rows = 2, need_percentile = 0, need_trust = 0;
    for (int i = 0; i < count; i++) {
        if (tensors[i].eight_bit && bnb8_rows_for(tensors[i].blocksize) == 4) rows = 4;
        need_percentile |= tensors[i].percentile < 100;
        need_trust |= (tensors[i].args.kind == BNB8_LAMB || tensors[i].args.kind == BNB8_LARS) && tensors[i].args.max_unorm > 0.0f;
    }
    int64_t chunks = 0, chunk = (int64_t)rows * BNB8_ROW;
    for (int i = 0; i < count; i++) {
        t[i] = tensors[i];
        t[i].first_chunk = chunks;
        chunks += (t[i].n + chunk - 1) / chunk;
    }
    h->total_chunks = chunks;
    h->count = count;
    const bnb8_step_header *dh = (const bnb8_step_header *)c->upload;
    const bnb8_gpu_tensor *dt = (const bnb8_gpu_tensor *)((char *)c->upload + header_bytes);
    cudaMemcpyAsync(c->upload, c->staging[slot], bytes, cudaMemcpyHostToDevice, stream);
    cudaEventRecord(c->staged[slot], stream);
    int64_t grid = chunks < (int64_t)c->sms * 8 ? chunks : (int64_t)c->sms * 8;
    if (need_percentile || need_trust)
        cudaMemsetAsync(c->norms, 0, sizeof(double) * BNB8_NORMS * (size_t)count, stream);
    if (need_percentile) {
        if (rows == 2) bnb8_norms_kernel<2><<<grid, BNB8_THREADS, 0, stream>>>(dh, dt, c->norms, 0);
        else bnb8_norms_kernel<4><<<grid, BNB8_THREADS, 0, stream>>>(dh, dt, c->norms, 0);
        bnb8_percentile_kernel<<<(count + 127) / 128, 128, 0, stream>>>(dh, dt, c->norms);
    }
    if (need_trust) {
        if (rows == 2) bnb8_norms_kernel<2><<<grid, BNB8_THREADS, 0, stream>>>(dh, dt, c->norms, 1);
        else bnb8_norms_kernel<4><<<grid, BNB8_THREADS, 0, stream>>>(dh, dt, c->norms, 1);
    }
    int kind = tensors[0].args.kind;
    switch (kind) {
    case BNB8_ADAMW: status = bnb8_launch_update<BNB8_ADAMW>(c, rows, chunks, dh, dt, stream); break;
    case BNB8_ADAM: status = bnb8_launch_update<BNB8_ADAM>(c, rows, chunks, dh, dt, stream); break;
    case BNB8_SGD: status = bnb8_launch_update<BNB8_SGD>(c, rows, chunks, dh, dt, stream); break;
    case BNB8_LION: status = bnb8_launch_update<BNB8_LION>(c, rows, chunks, dh, dt, stream); break;
    case BNB8_RMSPROP: status = bnb8_launch_update<BNB8_RMSPROP>(c, rows, chunks, dh, dt, stream); break;
    case BNB8_ADAGRAD: status = bnb8_launch_update<BNB8_ADAGRAD>(c, rows, chunks, dh, dt, stream); break;
    case BNB8_LAMB: status = bnb8_launch_update<BNB8_LAMB>(c, rows, chunks, dh, dt, stream); break;
    case BNB8_LARS: status = bnb8_launch_update<BNB8_LARS>(c, rows, chunks, dh, dt, stream); break;
    case BNB8_ADEMAMIX: status = bnb8_launch_update<BNB8_ADEMAMIX>(c, rows, chunks, dh, dt, stream); break;
    default: return bnb8_fail(BNB8_ERR_ARG, "%s: optimizer kind %d", fn, kind);
    }
    if (status) return status;
    return bnb8_cuda_status(fn, cudaGetLastError());
}

extern "C" int bnb8_cuda_take_nonfinite(void *context, int64_t *count) {
    bnb8_cuda_context *c = (bnb8_cuda_context *)context;
    unsigned long long value = 0;
    int status = bnb8_cuda_status("bnb8_optimizer_take_nonfinite",
                                  cudaMemcpy(&value, c->nonfinite, sizeof value, cudaMemcpyDeviceToHost));
    if (!status) status = bnb8_cuda_status("bnb8_optimizer_take_nonfinite", cudaMemset(c->nonfinite, 0, sizeof value));
    *count = (int64_t)value;
    return status;
}
