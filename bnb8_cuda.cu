/*
bnb8_cuda.cu — the GPU back end: the twin of every CPU entry point of bnb8.c, using the same
per-element math from bnb8.h so that results are bit-identical. Build with -fmad=false and without
--use_fast_math (DESIGN.md §2). Every launch goes on the caller's stream, and no call waits for the
device except the few DESIGN.md §9 lists (copies to and from the host, growing scratch).
*/
#define BNB8_INTERNAL             // the shared per-element math and the GPU step interface
#include "bnb8.h"
#include <cuda_runtime.h>
#include <cuda_bf16.h>
#include <limits.h>
#include <stdlib.h>
#include <mutex>

#define BNB8_THREADS 256

static bnb8_status bnb8_cuda_status(const char *fn, cudaError_t err) {
    if (err == cudaSuccess) return BNB8_OK;
    return bnb8_fail(BNB8_ERR_CUDA, "%s: %s", fn, cudaGetErrorString(err));
}

// A pointer the CPU gave where device memory is needed is an error, not a crash.
static bnb8_status bnb8_cuda_check_device_ptr(const char *fn, const void *p) {
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
// its absmax is a warp shuffle, with no shared memory and no barrier (DESIGN.md §9).

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
// Asks L2 for the line holding x: a line of the block's next chunk, while this one computes, so
// that the warp's next loads wait for L2 rather than memory. A hint: nothing waits for it and no
// register holds it (prefetching through shared memory or registers spilled).
__device__ void bnb8_prefetch(const void *x) { asm volatile("prefetch.global.L2 [%0];" :: "l"(x)); }

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

// Codes i..i+3 packed in a word (byte j = code i + j; zero past n).
__device__ uint32_t bnb8_load_codes4(const uint8_t *q, int64_t i, int64_t n, bool vec) {
    if (vec && i + 4 <= n) return BNB8_LD((const unsigned int *)(q + i));
    uint32_t w = 0;
    #pragma unroll
    for (int j = 0; j < 4; j++) if (i + j < n) w |= (uint32_t)q[i + j] << (8 * j);
    return w;
}

__device__ void bnb8_store_codes4(uint8_t *q, int64_t i, int64_t n, bool vec, uint32_t w) {
    if (vec && i + 4 <= n) { BNB8_ST((unsigned int *)(q + i), w); return; }
    #pragma unroll
    for (int j = 0; j < 4; j++) if (i + j < n) q[i + j] = (uint8_t)(w >> (8 * j));
}

// 4-bit codes i..i+3 (i even) packed in a 16-bit word (nibble j = code i + j), bytes i/2 and i/2 + 1:
// a byte is read, and written, when its first element lies inside n (the caller puts the pad code
// in the nibbles past n), so that each byte is written once, by one thread.
__device__ uint32_t bnb8_load_nibbles4(const uint8_t *q, int64_t i, int64_t n, bool vec) {
    if (vec && i + 4 <= n) return BNB8_LD((const unsigned short *)(q + i / 2));
    uint32_t w = 0;
    if (i < n) w = q[i / 2];
    if (i + 2 < n) w |= (uint32_t)q[i / 2 + 1] << 8;
    return w;
}
__device__ void bnb8_store_nibbles4(uint8_t *q, int64_t i, int64_t n, bool vec, uint32_t w) {
    if (vec && i + 4 <= n) { BNB8_ST((unsigned short *)(q + i / 2), (unsigned short)w); return; }
    if (i < n) q[i / 2] = (uint8_t)w;
    if (i + 2 < n) q[i / 2 + 1] = (uint8_t)(w >> 8);
}

// A codebook (bnb8_codebook_init) built on the device into global memory, one entry per thread,
// so that the kernels using it copy it rather than each block building its own.
__global__ void bnb8_codebook_kernel(const float *code, int zero_code, bnb8_codebook *cb) {
    __shared__ float t[256];
    t[threadIdx.x] = bnb8_threshold(code, threadIdx.x);
    __syncthreads();
    if (blockIdx.x == 0) cb->t[threadIdx.x] = t[threadIdx.x];
    int b = blockIdx.x * blockDim.x + threadIdx.x;
    if (b < BNB8_LOOKUP_SIZE) cb->entry[b] = bnb8_codebook_entry(t, b, zero_code);
}
#define BNB8_CODEBOOK_BLOCKS ((BNB8_LOOKUP_SIZE + BNB8_THREADS - 1) / BNB8_THREADS)

// Copies a codebook into shared memory, all threads of the block together, and sets its search
// flag from its entries.
__device__ void bnb8_codebook_load(bnb8_codebook *dst, const bnb8_codebook *src) {
    static_assert(sizeof(bnb8_codebook) % 16 == 0, "bnb8_codebook is copied as uint4");
    for (int w = threadIdx.x; w < (int)(sizeof(bnb8_codebook) / 16); w += blockDim.x)
        ((uint4 *)dst)[w] = ((const uint4 *)src)[w];
    int search = 0;
    for (int b = threadIdx.x; b < BNB8_NEAR_ENTRIES; b += blockDim.x) search |= bnb8_entry_searches(src->entry[b], b);
    search = __syncthreads_or(search);
    if (threadIdx.x == 0) dst->search = search;
    __syncthreads();
}

// amax[r] of each of this thread's R rows becomes the max over its whole 8-bit block of B
// elements. All threads of the block call it with the same B, a power of two (the divisions below
// are shifts and masks).
template <int R>
__device__ void bnb8_block_max(float amax[R], int B, float *scratch) {
    if (B < 128 * R) {                   // blocks inside the warp's segment: lanes, then rows
        int lanes = B / BNB8_V < 32 ? B / BNB8_V : 32;
        #pragma unroll
        for (int off = 1; off < 32; off <<= 1) {
            if (off >= lanes) break;
            #pragma unroll
            for (int r = 0; r < R; r++) amax[r] = fmaxf(amax[r], __shfl_xor_sync(0xffffffffu, amax[r], off));
        }
        if (B <= 128) return;
        int rows = B >> 7;               // rows of one block in the warp's segment
        float m[R];
        #pragma unroll
        for (int r = 0; r < R; r++) {
            m[r] = 0.0f;
            #pragma unroll
            for (int rr = 0; rr < R; rr++) if ((rr ^ r) < rows) m[r] = fmaxf(m[r], amax[rr]);
        }
        #pragma unroll
        for (int r = 0; r < R; r++) amax[r] = m[r];
        return;
    }
    // The warp's whole segment lies in one block: one max over rows and lanes, then over warps.
    float m = amax[0];
    #pragma unroll
    for (int r = 1; r < R; r++) m = fmaxf(m, amax[r]);
    #pragma unroll
    for (int off = 1; off < 32; off <<= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, off));
    if (B > 128 * R) {
        int warp = threadIdx.x / 32, warps = B / (128 * R), w0 = warp & ~(warps - 1);
        __syncthreads();                 // scratch may still be read by a former call
        if (threadIdx.x % 32 == 0) scratch[warp] = m;
        __syncthreads();
        m = 0.0f;
        if (warps == BNB8_WARPS) {       // one block over the CUDA block: all of scratch, as vectors
            static_assert(BNB8_WARPS == 8, "two float4 reads");
            float4 a = ((const float4 *)scratch)[0], b = ((const float4 *)scratch)[1];
            m = fmaxf(fmaxf(fmaxf(a.x, a.y), fmaxf(a.z, a.w)), fmaxf(fmaxf(b.x, b.y), fmaxf(b.z, b.w)));
        } else {
            for (int k = w0; k < w0 + warps; k++) m = fmaxf(m, scratch[k]);
        }
    }
    #pragma unroll
    for (int r = 0; r < R; r++) amax[r] = m;
}

// Rows per chunk for a block size: 2, or 4 for blocks of 4096 (a chunk holds whole blocks).
static int bnb8_rows_for(int64_t blocksize) { return blocksize > 2 * BNB8_ROW ? 4 : 2; }

// ------------------------------------------------------------------------------------------------
// Block-wise quantization: a persistent grid over chunks.

// One chunk of R rows at element base. FULL: the chunk lies inside n and the arrays allow vector
// accesses (no bounds tests). next >= 0 (FULL only): the block's next chunk, a full one, starts
// at element next; its lines are asked of L2 once this chunk's loads are out (bnb8_prefetch), at 4
// rows only (blocks of 4096): at 2 rows more blocks fit per SM and already keep enough loads in
// flight, so the prefetch costs more than it hides (dev/results/kernels.md).
template <int R, bool FULL>
__device__ void bnb8_quantize_chunk(const bnb8_codebook &cb, int zero_code, const void *x, int dtype, int64_t n,
                                    bool vec, int64_t base, int64_t next, int64_t blocksize, uint8_t *q,
                                    float *absmax, float *scratch, unsigned &bad) {
    const int64_t end = FULL ? INT64_MAX : n;
    float v[R][4], amax[R], check = 0.0f;
    #pragma unroll
    for (int r = 0; r < R; r++) bnb8_load4(x, dtype, base + bnb8_offset<R>(r), end, FULL || vec, v[r]);
    if (FULL && R == 4 && next >= 0) {
        const int64_t size = dtype == BNB8_F32 ? 4 : 2;
        #pragma unroll
        for (int r = 0; r < R; r++) bnb8_prefetch((const char *)x + (next + bnb8_offset<R>(r)) * size);
    }
    // The max of |v| over all values, and check = sum of v * 0: NaN exactly when some value is
    // not finite (rare); then the max again over the finite ones, and their count.
    #pragma unroll
    for (int r = 0; r < R; r++) {
        amax[r] = 0.0f;
        #pragma unroll
        for (int j = 0; j < 4; j++) { amax[r] = fmaxf(amax[r], fabsf(v[r][j])); check = fmaf(v[r][j], 0.0f, check); }
    }
    if (check != 0.0f) {
        #pragma unroll
        for (int r = 0; r < R; r++) {
            amax[r] = 0.0f;
            #pragma unroll
            for (int j = 0; j < 4; j++) {
                if (bnb8_isfinite(v[r][j])) amax[r] = fmaxf(amax[r], fabsf(v[r][j]));
                else bad++;
            }
        }
    }
    bnb8_block_max<R>(amax, (int)blocksize, scratch);
    // A block over the warp's whole segment: one absmax for all rows, one reciprocal.
    const bool one = blocksize >= 128 * R;
    const float rec0 = bnb8_reciprocal(amax[0]);
    const int shift = bnb8_log2(blocksize);
    #pragma unroll
    for (int r = 0; r < R; r++) {
        int64_t i = base + bnb8_offset<R>(r);
        if ((r == 0 || !one) && (FULL || i < n) && (i & (blocksize - 1)) == 0) absmax[i >> shift] = amax[r];
        // Codes without dividing, no branch per value; a row with a value next to a threshold,
        // a zero block or a non-finite value (rare) is redone with the division.
        float rec = r == 0 || one ? rec0 : bnb8_reciprocal(amax[r]);
        uint32_t c = 0;
        int redo = cb.search;
        #pragma unroll
        for (int j = 0; j < 4; j++) c |= (uint32_t)bnb8_code_near(&cb, v[r][j] * rec, &redo) << (8 * j);
        if (redo) {
            c = 0;
            #pragma unroll
            for (int j = 0; j < 4; j++) c |= (uint32_t)bnb8_quantize_code(&cb, zero_code, v[r][j], amax[r]) << (8 * j);
        }
        bnb8_store_codes4(q, i, end, FULL || vec, c);
    }
}

// On GPUs with 2048 threads per SM, ask for 8 resident blocks per SM: the kernel fits their share
// of the register file (32 per thread) without spilling, and without the bound ptxas takes more
// registers and fewer blocks fit, which leaves less memory traffic in flight (dev/results/kernels.md).
// Elsewhere (1024 or 1536 threads per SM) the registers do not limit the blocks, and ptxas would warn.
#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ == 800 || __CUDA_ARCH__ == 870 || __CUDA_ARCH__ == 900 || \
                               __CUDA_ARCH__ == 1000 || __CUDA_ARCH__ == 1030)
#define BNB8_QUANTIZE_BLOCKS_PER_SM 8
#else
#define BNB8_QUANTIZE_BLOCKS_PER_SM 1
#endif
template <int R>
__global__ void __launch_bounds__(BNB8_THREADS, BNB8_QUANTIZE_BLOCKS_PER_SM)
bnb8_quantize_kernel(const void *x, int dtype, int64_t n, const bnb8_codebook *book, int64_t blocksize,
                     uint8_t *q, float *absmax, unsigned long long *nonfinite) {
    __shared__ __align__(16) bnb8_codebook cb;
    __shared__ __align__(16) float scratch[BNB8_WARPS];
    bnb8_codebook_load(&cb, book);
    int zero_code = bnb8_nearest_code(cb.t, 0.0f);
    bool vec = ((uintptr_t)x & 15) == 0 && ((uintptr_t)q & 3) == 0;
    unsigned bad = 0;
    int64_t chunks = (n + (int64_t)R * BNB8_ROW - 1) / ((int64_t)R * BNB8_ROW);
    for (int64_t chunk = blockIdx.x; chunk < chunks; chunk += gridDim.x) {
        int64_t base = chunk * R * BNB8_ROW, next = base + gridDim.x * (int64_t)(R * BNB8_ROW);
        if (vec && base + R * BNB8_ROW <= n)
            bnb8_quantize_chunk<R, true>(cb, zero_code, x, dtype, n, vec, base, next + R * BNB8_ROW <= n ? next : -1,
                                         blocksize, q, absmax, scratch, bad);
        else
            bnb8_quantize_chunk<R, false>(cb, zero_code, x, dtype, n, vec, base, -1, blocksize, q, absmax, scratch, bad);
    }
    if (nonfinite) {
        for (int off = 16; off > 0; off >>= 1) bad += __shfl_xor_sync(0xffffffffu, bad, off);
        if (threadIdx.x % 32 == 0 && bad) atomicAdd(nonfinite, (unsigned long long)bad);
    }
}

// Dequantization: a block per chunk of 4 rows of 1024 elements (blocks beyond the grid's limit
// loop), each thread's 4 code words loaded before use. Not a persistent grid: blocks launched in
// order keep the chunks in flight close together in memory, which a wave of persistent blocks each
// walking its own chunks does not (measured slower: dev/results/kernels.md).
#define BNB8_DEQUANT_ROWS 4
__global__ void __launch_bounds__(BNB8_THREADS)
bnb8_dequantize_kernel(const uint8_t *q, const float *absmax, int64_t n, const float *code, int shift,
                       void *out, int dtype) {
    __shared__ float c[256];
    c[threadIdx.x] = code[threadIdx.x];
    __syncthreads();
    const int R = BNB8_DEQUANT_ROWS;
    bool vec = ((uintptr_t)out & 15) == 0 && ((uintptr_t)q & 3) == 0;
    int64_t chunks = (n + (int64_t)R * BNB8_ROW - 1) / ((int64_t)R * BNB8_ROW);
    for (int64_t chunk = blockIdx.x; chunk < chunks; chunk += gridDim.x) {
        uint32_t w[R];
        float a[R];
        #pragma unroll
        for (int r = 0; r < R; r++) {
            int64_t i = chunk * R * BNB8_ROW + bnb8_offset<R>(r);
            w[r] = bnb8_load_codes4(q, i, n, vec);
            a[r] = i < n ? absmax[i >> shift] : 0.0f;
        }
        #pragma unroll
        for (int r = 0; r < R; r++) {
            float v[4];
            #pragma unroll
            for (int j = 0; j < 4; j++) v[j] = c[(w[r] >> (8 * j)) & 255u] * a[r];
            bnb8_store4(out, dtype, chunk * R * BNB8_ROW + bnb8_offset<R>(r), n, vec, v);
        }
    }
}

static bnb8_status bnb8_cuda_check_blockwise(const char *fn, const void *a, const void *b, const void *c,
                                             const void *d, int64_t n, int64_t blocksize, bnb8_dtype dtype) {
    if (n < 0) return bnb8_fail(BNB8_ERR_SIZE, "%s: n = %lld < 0", fn, (long long)n);
    if (blocksize < 64 || blocksize > 4096 || (blocksize & (blocksize - 1)))
        return bnb8_fail(BNB8_ERR_BLOCKSIZE, "%s: blocksize %lld", fn, (long long)blocksize);
    if (bnb8_dtype_size(dtype) == 0 || dtype == BNB8_E6M10)   // e6m10 holds group scales only
        return bnb8_fail(BNB8_ERR_DTYPE, "%s: dtype %d is not f32, f16 or bf16", fn, (int)dtype);
    if (n == 0) return BNB8_OK;
    if (!a || !b || !c || !d) return bnb8_fail(BNB8_ERR_NULL, "%s: NULL array", fn);
    const void *ptrs[4] = {a, b, c, d};
    for (int i = 0; i < 4; i++) {
        bnb8_status status = bnb8_cuda_check_device_ptr(fn, ptrs[i]);
        if (status) return status;
    }
    return BNB8_OK;
}

// Blocks for a persistent grid: as many as fit on the GPU at once (one wave: a second, partial
// wave would leave SMs idle at the end), no more than there are chunks. *per_sm caches the
// occupancy of kernel (0 = not yet asked); shared memory is preferred over L1 for it.
template <typename Kernel>
static bnb8_status bnb8_persistent_grid(Kernel kernel, int smem, int *per_sm, int64_t chunks, int64_t *grid) {
    const char *fn = "bnb8_persistent_grid";
    int device = 0, sms = 0;
    bnb8_status status = bnb8_cuda_status(fn, cudaGetDevice(&device));
    if (!status) status = bnb8_cuda_status(fn, cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
    if (!status && *per_sm == 0) {
        status = bnb8_cuda_status(fn, cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout,
                                                           (int)cudaSharedmemCarveoutMaxShared));
        if (!status && smem > 48 * 1024)
            status = bnb8_cuda_status(fn, cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
        if (!status) status = bnb8_cuda_status(fn, cudaOccupancyMaxActiveBlocksPerMultiprocessor(per_sm, kernel, BNB8_THREADS, smem));
        if (!status && *per_sm < 1) status = bnb8_fail(BNB8_ERR_CUDA, "%s: a kernel does not fit on this GPU", fn);
        if (status) *per_sm = 0;
    }
    if (status) return status;
    int64_t most = (int64_t)sms * *per_sm;
    *grid = chunks < most ? (chunks > 0 ? chunks : 1) : most;
    return BNB8_OK;
}

// The library's own pool for stream-ordered scratch on the current device: it keeps its memory
// between calls (a pool that returns it at every synchronization, as the default one does, makes
// each allocation a mapping), and the caller's default pool is left as it is. *pool is NULL where
// the driver has no memory pools (some vGPU and WDDM setups; BNB8_NO_MEMORY_POOLS=1 pretends so,
// for the tests): the caller then uses cudaMalloc and cudaFree, which waits for the device.
static bnb8_status bnb8_scratch_pool(const char *fn, cudaMemPool_t *pool) {
    static std::mutex lock;
    static cudaMemPool_t pools[64];
    *pool = NULL;
    int device = 0, supported = 0;
    bnb8_status status = bnb8_cuda_status(fn, cudaGetDevice(&device));
    if (!status) status = bnb8_cuda_status(fn, cudaDeviceGetAttribute(&supported, cudaDevAttrMemoryPoolsSupported, device));
    if (status) return status;
    const char *pretend = getenv("BNB8_NO_MEMORY_POOLS");
    if (!supported || (pretend && pretend[0] == '1')) return BNB8_OK;
    if (device < 0 || device >= 64) return bnb8_fail(BNB8_ERR_DEVICE, "%s: device %d (at most 64)", fn, device);
    std::lock_guard<std::mutex> guard(lock);
    if (!pools[device]) {
        cudaMemPoolProps props = {};
        props.allocType = cudaMemAllocationTypePinned;
        props.location.type = cudaMemLocationTypeDevice;
        props.location.id = device;
        cudaMemPool_t created;
        if ((status = bnb8_cuda_status(fn, cudaMemPoolCreate(&created, &props)))) return status;
        uint64_t keep = UINT64_MAX;
        if ((status = bnb8_cuda_status(fn, cudaMemPoolSetAttribute(created, cudaMemPoolAttrReleaseThreshold, &keep)))) {
            cudaMemPoolDestroy(created);
            return status;
        }
        pools[device] = created;
    }
    *pool = pools[device];
    return BNB8_OK;
}

bnb8_status bnb8_cuda_quantize_blockwise_ex(const void *x, bnb8_dtype dtype, int64_t n, const float *code,
                                            int64_t blocksize, uint8_t *q, float *absmax, int64_t *nonfinite,
                                            cudaStream_t stream) {
    const char *fn = "bnb8_cuda_quantize_blockwise";
    bnb8_status status = bnb8_cuda_check_blockwise(fn, x, code, q, absmax, n, blocksize, dtype);
    if (status) return status;
    unsigned long long *count = (unsigned long long *)nonfinite;
    if (count && (status = bnb8_cuda_status(fn, cudaMemsetAsync(count, 0, sizeof *count, stream)))) return status;
    if (n == 0) return BNB8_OK;
    static int per_sm[2];
    int rows = bnb8_rows_for(blocksize);
    int64_t grid, chunks = (n + (int64_t)rows * BNB8_ROW - 1) / ((int64_t)rows * BNB8_ROW);
    if ((status = rows == 2 ? bnb8_persistent_grid(bnb8_quantize_kernel<2>, 0, &per_sm[0], chunks, &grid)
                            : bnb8_persistent_grid(bnb8_quantize_kernel<4>, 0, &per_sm[1], chunks, &grid)))
        return status;
    // The codebook in stream-ordered scratch (plain device memory without pools): built once,
    // copied by every block.
    bnb8_codebook *book = NULL;
    cudaMemPool_t pool;
    if ((status = bnb8_scratch_pool(fn, &pool))) return status;
    status = bnb8_cuda_status(fn, pool ? cudaMallocFromPoolAsync((void **)&book, sizeof *book, pool, stream)
                                       : cudaMalloc((void **)&book, sizeof *book));
    if (status) return status;
    bnb8_codebook_kernel<<<BNB8_CODEBOOK_BLOCKS, BNB8_THREADS, 0, stream>>>(code, 0, book);
    if (rows == 2) bnb8_quantize_kernel<2><<<grid, BNB8_THREADS, 0, stream>>>(x, dtype, n, book, blocksize, q, absmax, count);
    else bnb8_quantize_kernel<4><<<grid, BNB8_THREADS, 0, stream>>>(x, dtype, n, book, blocksize, q, absmax, count);
    status = bnb8_cuda_status(fn, cudaGetLastError());
    bnb8_status freed = bnb8_cuda_status(fn, pool ? cudaFreeAsync(book, stream) : cudaFree(book));
    return status ? status : freed;
}

bnb8_status bnb8_cuda_quantize_blockwise(const void *x, bnb8_dtype dtype, int64_t n, const float *code,
                                         int64_t blocksize, uint8_t *q, float *absmax, cudaStream_t stream) {
    return bnb8_cuda_quantize_blockwise_ex(x, dtype, n, code, blocksize, q, absmax, NULL, stream);
}

bnb8_status bnb8_cuda_dequantize_blockwise(const uint8_t *q, const float *absmax, int64_t n, const float *code,
                                           int64_t blocksize, void *out, bnb8_dtype dtype, cudaStream_t stream) {
    const char *fn = "bnb8_cuda_dequantize_blockwise";
    bnb8_status status = bnb8_cuda_check_blockwise(fn, q, absmax, code, out, n, blocksize, dtype);
    if (status || n == 0) return status;
    int shift = 63 - __builtin_clzll((unsigned long long)blocksize);
    int64_t chunks = (n + (int64_t)BNB8_DEQUANT_ROWS * BNB8_ROW - 1) / ((int64_t)BNB8_DEQUANT_ROWS * BNB8_ROW);
    unsigned grid = chunks < INT_MAX ? (unsigned)chunks : INT_MAX;
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

extern "C" bnb8_status bnb8_cuda_alloc_zeroed(void **p, size_t bytes) {
    bnb8_status status = bnb8_cuda_status("bnb8_cuda_alloc_zeroed", cudaMalloc(p, bytes));
    if (!status) status = bnb8_cuda_status("bnb8_cuda_alloc_zeroed", cudaMemset(*p, 0, bytes));
    return status;
}

extern "C" void bnb8_cuda_free(void *p) { cudaFree(p); }

extern "C" bnb8_status bnb8_cuda_copy(void *dst, const void *src, size_t bytes, int to_device) {
    return bnb8_cuda_status("bnb8_cuda_copy",
                            cudaMemcpy(dst, src, bytes, to_device ? cudaMemcpyHostToDevice : cudaMemcpyDeviceToHost));
}

// fp32 masters <-> weights and correction, element by element with the CPU's functions (the same bits).
__global__ void bnb8_masters_kernel(void *param, bnb8_dtype dtype, void *corr, int corr_bytes, int64_t n, float *fp32,
                                    int to_weights) {
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
        if (to_weights) bnb8_master_store(param, dtype, corr, corr_bytes, i, fp32[i]);
        else fp32[i] = bnb8_master_load(param, dtype, corr, corr_bytes, i);
    }
}

extern "C" bnb8_status bnb8_cuda_masters(void *param, bnb8_dtype dtype, void *corr, int corr_bytes, int64_t n, float *fp32,
                                         int to_weights) {
    const char *fn = "bnb8_cuda_masters";
    int64_t blocks = (n + BNB8_THREADS - 1) / BNB8_THREADS;
    unsigned grid = blocks < 65536 ? (unsigned)blocks : 65536u;   // a grid-stride loop covers the rest
    // on the legacy default stream, which waits for the caller's blocking streams' earlier work
    bnb8_masters_kernel<<<grid, BNB8_THREADS>>>(param, dtype, corr, corr_bytes, n, fp32, to_weights);
    bnb8_status status = bnb8_cuda_status(fn, cudaGetLastError());
    return status ? status : bnb8_cuda_status(fn, cudaDeviceSynchronize());
}

// ------------------------------------------------------------------------------------------------
// Optimizer step: every tensor of a step in one launch (DESIGN.md §10). The tensors are cut into
// chunks of R rows (R = 2, or 4 when a tensor has 4096-element blocks); a persistent grid takes the
// chunks in order and finds each chunk's tensor by a search over first_chunk.
// 8-bit tensors with one absmax per tensor (blocksize 0) come last and get launches of their own,
// the CPU's two passes: the same update kernel first only takes max |fresh state| over the whole
// tensor (BNB8_PASS_MAX), then recomputes the same floats and stores weights and the codes under
// that max (BNB8_PASS_STORE); a last kernel writes it as the tensor's absmax. Nothing is written
// before the second pass, so both passes read the same old states, absmax included.
enum { BNB8_PASS_BLOCKS = 0, BNB8_PASS_MAX = 1, BNB8_PASS_STORE = 2 };
// The update kernels' FLASH modes of a launch with 4-bit tensors, of one whose tensors all round
// stochastically, and of one whose tensors all round stochastically and some have 4-bit states
// (bnb8_update_kernel).
enum { BNB8_FOUR_LAUNCH = 3, BNB8_SR_LAUNCH = 4, BNB8_FOUR_SR_LAUNCH = 5, BNB8_MASTER_LAUNCH = 6 };

typedef struct {
    bnb8_codebook books[2];      // their codebooks (bnb8_codebook_init with the zero codes)
    float code[2][256];          // [0] unsigned, [1] signed map of the optimizer (dynamic or linear)
    // The optimizer's 4-bit maps (bnb8_four_map of cfg.map), made on the host as the 8-bit ones:
    // [0] unsigned, [1] signed. Made in the kernels instead,
    // v's map with zero (c / 15) put an IEEE division, a subroutine call, into every mode-3 kernel and
    // ptxas then spilled 8 / 16 bytes more in each.
    float four[2][BNB8_FOUR_CODES];
    int64_t total_chunks;
    int count;
    int blocked;                 // tensors [0, blocked) have blocks or 32-bit states, the rest blocksize 0
    int64_t blocked_chunks;      // the chunks of tensors [0, blocked)
    unsigned long long taken[3]; // per pass: chunks handed out so far (0 in each upload)
} bnb8_step_header;

// Per tensor, on the device: [0] sum g^2, [1] sum p^2, [2] sum u^2 (double atomics: the order
// differs from the CPU's double sums only in the last bits of a double), [3] percentile scale.
#define BNB8_NORMS 4

// Steps whose uploads may be in flight before a step waits for the oldest: a trainer that steps
// its tensors in many calls (llm.c makes 16 a step) must not wait for the GPU between them.
#define BNB8_STAGING_SLOTS 32

typedef struct {
    void *staging;               // pinned host ring of BNB8_STAGING_SLOTS buffers: header + tensors
    cudaEvent_t staged[BNB8_STAGING_SLOTS];   // the upload of slot i is done
    size_t capacity;             // bytes of each slot and of upload
    int next;
    void *upload;                // device copy of the current header + tensors
    double *norms;               // (count, BNB8_NORMS)
    int norm_capacity;
    unsigned *tensor_max;        // (norm_capacity, 3) blocksize-0 tensors: max |fresh state|, as float bits
    unsigned long long *nonfinite;
    double *units;               // (units_capacity) cfg.sum_squares: the launch's per-unit sums
    int64_t units_capacity;
    int sms;
    int update_per_sm[3][BNB8_MASTER_LAUNCH + 1][2][BNB8_NUM_OPTIMIZERS];   // resident blocks per SM of each update kernel
    unsigned *rank1_max;         // (rank1_capacity) the rank-1 tensors' new row and column maxima, as float bits
    int64_t rank1_capacity;
} bnb8_cuda_context;

// The tensor among [from, end) that holds chunk: the last one whose first_chunk <= chunk, where
// t[from]'s is. A block's chunks only grow, mostly by a few tensors: steps of 1, 2, 4, ... forward
// from the tensor it had, then a binary search between the last two.
__device__ int bnb8_tensor_of(const bnb8_gpu_tensor *t, int from, int end, int64_t chunk) {
    int lo = from, hi = end - 1;
    for (int step = 1; lo + step < end; step *= 2) {
        if (t[lo + step].first_chunk > chunk) { hi = lo + step - 1; break; }
        lo += step;
    }
    while (lo < hi) {
        int mid = (lo + hi + 1) / 2;
        if (t[mid].first_chunk <= chunk) lo = mid; else hi = mid - 1;
    }
    return lo;
}

// 8-bit states with one absmax per tensor (blocksize 0) and rank-1 4-bit states: stepped in two passes.
__host__ __device__ bool bnb8_per_tensor(const bnb8_gpu_tensor *t) { return (t->eight_bit && t->blocksize == 0) || t->row_size > 0; }
static bool bnb8_four_tensor(const bnb8_gpu_tensor *t) { return t->format == BNB8_STATE_4BIT || t->format == BNB8_STATE_FLASH4; }

// Element i's absmax is absmax[k][i >> shift]; for blocksize 0 every i < 2^52 shifts to the one.
__device__ int bnb8_absmax_shift(const bnb8_gpu_tensor *t) { return t->blocksize > 0 ? bnb8_log2(t->blocksize) : 63; }

// Whether a tensor's arrays all allow vector accesses.
__device__ bool bnb8_tensor_vec(const bnb8_gpu_tensor *t) {
    uintptr_t bits = (uintptr_t)t->param | (uintptr_t)t->grad | (uintptr_t)t->correction;
    for (int k = 0; k < t->args.nstates; k++) bits |= (uintptr_t)t->state[k];
    return (bits & 15) == 0;
}

// A tensor in its format's default configuration, for which the chunks compile instances of their own
// (bnb8_flash_chunk_fast, the DEF instances of bnb8_update_chunk and bnb8_four_chunk): bf16 weights
// and gradients; flash with an int8 correction and e6m10 scales; block-wise 8-bit states (any block
// size), or 4-bit ones in blocks of 128 without rank-1, with an int8 correction or stochastic rounding
// (the recipes 8bit-int8, 8bit-sr, 4bit-int8 and 4bit-sr). A launch's tensors all round stochastically
// or none does (bnb8.c), so a default 8-bit or 4-bit tensor of modes 2 and 3 has its int8 correction
// and one of modes 4 and 5 none, as the DEF instances take it.
__device__ bool bnb8_default_tensor(const bnb8_gpu_tensor *t) {
    if (t->param_dtype != BNB8_BF16 || t->grad_dtype != BNB8_BF16) return false;
    if (t->format == BNB8_STATE_FLASH) return t->correction_bytes == 1 && t->scale_dtype == BNB8_E6M10;
    const bool master = t->correction_bytes == 1 || (t->correction_bytes == 0 && t->rounding.on);
    if (t->format == BNB8_STATE_8BIT) return t->eight_bit && t->blocksize > 0 && master;
    return t->format == BNB8_STATE_4BIT && t->blocksize == BNB8_BLOCKSIZE_4BIT && t->row_size == 0 && master;
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

// cfg.sum_squares, bnb8.h's order ([math.sumsq]), as a by-product of the update's gradient loads:
// each 128-element unit of the tensor goes to t.units[unit] (its butterfly as warp shuffles), and
// bnb8_sumsq_kernel sums the units after the launch. The whole warp calls these.
static_assert(BNB8_THREADS == BNB8_SUMSQ_STRANDS && BNB8_ROW / BNB8_WARPS / 4 == 32, "one strand per thread");
// The chunks' layout: row r of warp w is one unit, lane l holds its quad l.
template <int R> __device__ void bnb8_sumsq_rows(const bnb8_gpu_tensor &t, int64_t base, const float (*g)[4]) {
    if (!t.units) return;
    #pragma unroll
    for (int r = 0; r < R; r++) {
        double v = bnb8_sumsq_quad(g[r]);
        for (int d = 16; d > 0; d >>= 1) v += __shfl_xor_sync(0xffffffffu, v, d);
        int64_t u = base / BNB8_SUMSQ_UNIT + (threadIdx.x / 32) * R + r;
        if (threadIdx.x % 32 == 0 && u * BNB8_SUMSQ_UNIT < t.n) t.units[u] = v;
    }
}
// The fast flash layout: lane l holds R consecutive quads, k = R l + r of its warp's 32 R; the
// butterfly's partners k ^ d are lane l ^ (d / R) for d >= R, else quad r ^ d of the same lane.
// Gradient j of a row of 4 as the fast chunks load them, in bf16 pairs.
__device__ __forceinline__ float bnb8_fast_grad(const uint32_t gw[2], int j) {
    return bnb8_bf16_to_f32((uint16_t)(gw[j / 2] >> (16 * (j & 1))));
}
// The fast chunks' gradients are their bf16 pairs.
template <int R> __device__ void bnb8_sumsq_lanes(const bnb8_gpu_tensor &t, int64_t base, const uint32_t (*gw)[2]) {
    if (!t.units) return;
    double v[R], w[R];
    #pragma unroll
    for (int r = 0; r < R; r++) {
        float g[4];
        #pragma unroll
        for (int j = 0; j < 4; j++) g[j] = bnb8_fast_grad(gw[r], j);
        v[r] = bnb8_sumsq_quad(g);
    }
    #pragma unroll
    for (int d = 16; d > 0; d >>= 1) {
        #pragma unroll
        for (int r = 0; r < R; r++) w[r] = d >= R ? v[r] + __shfl_xor_sync(0xffffffffu, v[r], d / R) : v[r] + v[r ^ (d < R ? d : 0)];
        #pragma unroll
        for (int r = 0; r < R; r++) v[r] = w[r];
    }
    const int lane = threadIdx.x % 32;
    int64_t u = base / BNB8_SUMSQ_UNIT + (threadIdx.x / 32) * R + (R * lane) / 32;
    if ((R * lane) % 32 == 0 && u * BNB8_SUMSQ_UNIT < t.n) t.units[u] = v[0];
}
// One block per tensor: strand = thread, then the warps' butterflies, then the 8 in order.
__global__ void bnb8_sumsq_kernel(const bnb8_gpu_tensor *tensors) {
    __shared__ double scratch[BNB8_WARPS];
    const bnb8_gpu_tensor *t = &tensors[blockIdx.x];
    if (!t->sum_squares) return;
    const int64_t units = (t->n + BNB8_SUMSQ_UNIT - 1) / BNB8_SUMSQ_UNIT;
    double acc = 0.0;
    for (int64_t u = threadIdx.x; u < units; u += BNB8_SUMSQ_STRANDS) acc += t->units[u];
    for (int d = 16; d > 0; d >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, d);
    if (threadIdx.x % 32 == 0) scratch[threadIdx.x / 32] = acc;
    __syncthreads();
    if (threadIdx.x == 0) {
        double total = 0.0;
        for (int w = 0; w < BNB8_WARPS; w++) total += scratch[w];
        *t->sum_squares = total;
    }
}

// The states of 4 elements at i: dequantized (8-bit) or loaded (32-bit).
__device__ void bnb8_load_states4(const bnb8_gpu_tensor *t, const float (*code)[256], int64_t i, bool vec,
                                  float s[3][4]) {
    #pragma unroll
    for (int k = 0; k < 3; k++) {
        if (k >= t->args.nstates) break;
        if (!t->eight_bit) { bnb8_load4(t->state[k], BNB8_F32, i, t->n, vec, s[k]); continue; }
        uint32_t c = bnb8_load_codes4((const uint8_t *)t->state[k], i, t->n, vec);
        float a = i < t->n ? t->absmax[k][i >> bnb8_absmax_shift(t)] : 0.0f;
        const float *map = code[bnb8_state_signed(t->args.kind, k)];
        #pragma unroll
        for (int j = 0; j < 4; j++) s[k][j] = map[(c >> (8 * j)) & 255u] * a;
    }
}

__device__ bool bnb8_needs_trust(const bnb8_gpu_tensor *t) {
    return (t->args.kind == BNB8_LAMB || t->args.kind == BNB8_LARS) && t->args.max_unorm > 0.0f;
}

// A tensor's gnorm_scale made final: the step's, times cfg.gnorm_scale_at's device float, times the
// percentile clipping's scale (the CPU's order, bnb8_step_tensor_cpu).
__device__ float bnb8_gnorm_scale(const bnb8_gpu_tensor *t, const double *norms, int ti) {
    float s = t->args.gnorm_scale;
    if (t->gnorm_scale_at) s *= *t->gnorm_scale_at;
    if (t->percentile < 100) s *= (float)norms[ti * BNB8_NORMS + 3];
    return s;
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
        ti = bnb8_tensor_of(tensors, ti, h->count, chunk);     // a block's chunks only grow
        const bnb8_gpu_tensor *t = &tensors[ti];
        if (mode == 0 ? t->percentile >= 100 : !bnb8_needs_trust(t)) continue;   // uniform over the block
        bool vec = bnb8_tensor_vec(t);
        bnb8_step_args args = t->args;
        args.gnorm_scale = bnb8_gnorm_scale(t, norms, ti);
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

// The update. Each CUDA block takes up to BNB8_GRAB consecutive chunks at a time, so the tensor it
// works on changes at most once a grab; the tensor's descriptor and its per-step constants sit in
// shared memory. Per chunk, every global load (p, g, state codes or floats, absmax) is issued
// before any of them is used, so a chunk waits for memory once; then the update in float32 with
// the shared math, the new p, and for 8-bit states the block's new absmax and the codes of the
// fresh values.
// Dynamic shared memory (above the 48 KB static limit): the unsigned and signed codebooks, both
// maps for dequantization, the current tensor.
struct bnb8_update_smem {
    bnb8_codebook books[2];
    float code[2][256];
    alignas(16) float scratch[BNB8_WARPS];   // bnb8_block_max reads it as float4
    bnb8_gpu_tensor t;           // the tensor of the current chunks, gnorm_scale made final (the
                                 // percentile clipping's scale applied as it is copied here)
    float trust;                 // its LAMB / LARS trust ratio (1 when off)
    int shift;                   // log2 of its block size (bnb8_absmax_shift)
    int vec;                     // its arrays allow vector accesses
    int def;                     // its format's default configuration (bnb8_default_tensor)
    int fast;                    // the weights a fast chunk takes it with (bnb8_fast_weights)
    int64_t grab[2][2];          // the block's last two grabs: chunks [first, end)
};

// States an optimizer kind keeps at most (bnb8_state_count with momentum).
__host__ __device__ constexpr int bnb8_max_states(int kind) {
    return kind == BNB8_ADEMAMIX ? 3 : kind == BNB8_ADAMW || kind == BNB8_ADAM || kind == BNB8_LAMB ? 2 : 1;
}
// The kinds with flash states and master weight corrections on the GPU (DESIGN.md §5.1, §6.1).
__host__ __device__ constexpr bool bnb8_flash_form(int kind) {
    return kind == BNB8_ADAMW || kind == BNB8_ADAM || kind == BNB8_SGD || kind == BNB8_LION;
}

// The codes of 4 state values under absmax a with the division (bnb8_quantize_value), packed:
// the rare rows the division-free codes cannot decide. Out of line, so that the hot loop stays
// small in the instruction cache.
__device__ __noinline__ uint32_t bnb8_requantize4(const bnb8_codebook *book, int zero_code, float a,
                                                  float s0, float s1, float s2, float s3) {
    const float v[4] = {s0, s1, s2, s3};
    uint32_t q = 0;
    #pragma unroll
    for (int j = 0; j < 4; j++) q |= (uint32_t)bnb8_quantize_value(book, zero_code, v[j], a) << (8 * j);
    return q;
}

// The tensor's step arguments with what its kind fixes made constants: the kind, its number of
// states (only SGD and LARS may have none), no L2 term with decoupled weight decay.
template <int KIND> __device__ bnb8_step_args bnb8_args_of(const bnb8_gpu_tensor &t) {
    bnb8_step_args a = t.args;
    a.kind = KIND;
    if (KIND != BNB8_SGD && KIND != BNB8_LARS) a.nstates = bnb8_max_states(KIND);
    if (bnb8_decoupled_decay(KIND)) a.l2 = 0.0f;
    return a;
}

// One chunk of R rows at element base of the tensor in sm.t. FULL: the whole chunk lies inside
// the tensor and its arrays allow vector accesses (every chunk but a tensor's last, normally).
// next (FULL only): the chunk after it is a full one of the tensor; its lines are asked of L2 once
// this chunk's loads are out (bnb8_prefetch).
// PASS (blocksize 0 only, tmax the tensor's 3 maxima): BNB8_PASS_MAX writes nothing but the max
// of each state into tmax; BNB8_PASS_STORE stores everything, the codes under tmax's absmax.
// SR: the tensor's weights round stochastically (bnb8_round_result; a launch of such tensors only).
// DEF (MASTER or SR, blocks pass): the tensor is in the default configuration (bnb8_default_tensor:
// block-wise 8-bit, bf16 weights and gradients, an int8 correction or stochastic rounding), which
// this instance takes as constants, so that it holds fewer values live (as bnb8_four_chunk's).
template <int R, int KIND, bool FULL, int PASS, bool MASTER, bool SR, bool DEF = false>
__device__ void bnb8_update_chunk(bnb8_update_smem &sm, int64_t base, bool next, int zero_unsigned, int zero_signed,
                                  unsigned &bad, unsigned *tmax) {
    static_assert(!DEF || ((MASTER || SR) && PASS == BNB8_PASS_BLOCKS), "DEF: an int8 correction or stochastic rounding");
    const bnb8_gpu_tensor &t = sm.t;
    const int64_t n = t.n;
    const bool vec = FULL || sm.vec;
    constexpr int S = bnb8_max_states(KIND);     // states of the kind; SGD and LARS may have none
    const bnb8_step_args args = bnb8_args_of<KIND>(t);
    const int nstates = args.nstates, shift = sm.shift;
    // the passes see 8-bit tensors only
    const int eight_bit = PASS != BNB8_PASS_BLOCKS || DEF ? 1 : t.eight_bit;
    // MASTER (a FLASH launch): bf16/fp16 weights may carry a correction or an fp32 master (cb)
    const int cb = SR || !MASTER ? 0 : DEF ? 1 : t.correction_bytes;
    const bnb8_dtype pdt = DEF ? BNB8_BF16 : (bnb8_dtype)t.param_dtype;
    const int gdt = DEF ? BNB8_BF16 : t.grad_dtype;
    float p[R][4], g[R][4], s[R][3][4] = {}, scale[S][R];
    uint32_t c[S][R], bits[R][2] = {}, corr[R][2] = {};
    // Every load first.
    #pragma unroll
    for (int r = 0; r < R; r++) {
        int64_t i = base + bnb8_offset<R>(r);
        if (MASTER && cb) bnb8_masters_load4(t, pdt, cb, i, FULL ? INT64_MAX : n, vec, p[r], bits[r], corr[r]);
        else bnb8_load4(t.param, pdt, i, FULL ? INT64_MAX : n, vec, p[r]);
        bnb8_load4(t.grad, gdt, i, FULL ? INT64_MAX : n, vec, g[r]);
    }
    if (PASS != BNB8_PASS_MAX) bnb8_sumsq_rows<R>(t, base, g);
    #pragma unroll
    for (int k = 0; k < S; k++) {
        if (k >= nstates) continue;
        #pragma unroll
        for (int r = 0; r < R; r++) {
            int64_t i = base + bnb8_offset<R>(r);
            if (!eight_bit) { bnb8_load4(t.state[k], BNB8_F32, i, FULL ? INT64_MAX : n, vec, s[r][k]); continue; }
            c[k][r] = bnb8_load_codes4((const uint8_t *)t.state[k], i, FULL ? INT64_MAX : n, vec);
            scale[k][r] = FULL || i < n ? BNB8_LD(&t.absmax[k][i >> shift]) : 0.0f;
        }
    }
    if (FULL && next) {          // the same elements of the next chunk (a full one of this tensor)
        const int64_t ps = pdt == BNB8_F32 ? 4 : 2, gs = gdt == BNB8_F32 ? 4 : 2, ss = eight_bit ? 1 : 4;
        #pragma unroll
        for (int r = 0; r < R; r++) {
            int64_t i = base + R * BNB8_ROW + bnb8_offset<R>(r);
            bnb8_prefetch((const char *)t.param + i * ps);
            bnb8_prefetch((const char *)t.grad + i * gs);
            #pragma unroll
            for (int k = 0; k < S; k++) if (k < nstates) bnb8_prefetch((const char *)t.state[k] + i * ss);
        }
    }
    if (MASTER && cb) {
        #pragma unroll
        for (int r = 0; r < R; r++) bnb8_masters_decode4(pdt, cb, bits[r], corr[r], p[r], DEF);
    }
    if (eight_bit) {
        #pragma unroll
        for (int k = 0; k < S; k++) {
            if (k >= nstates) continue;
            const float *map = sm.code[bnb8_state_signed(KIND, k)];
            #pragma unroll
            for (int r = 0; r < R; r++)
                #pragma unroll
                for (int j = 0; j < 4; j++) s[r][k][j] = map[(c[k][r] >> (8 * j)) & 255u] * scale[k][r];
        }
    }
    // The update, without branches: an element whose gradient or result is not finite keeps p and its states.
    const float trust = sm.trust;
    #pragma unroll
    for (int r = 0; r < R; r++) {
        int64_t i = base + bnb8_offset<R>(r);
        uint32_t nb[2] = {bits[r][0], bits[r][1]}, nc[2] = {corr[r][0], corr[r][1]};
        #pragma unroll
        for (int j = 0; j < 4; j++) {
            float sj[3] = {s[r][0][j], s[r][1][j], s[r][2][j]};
            float u = bnb8_direction(&args, p[r][j], g[r][j], sj);
            float pn = bnb8_apply(&args, p[r][j], u, trust);
            if constexpr (SR) pn = bnb8_round_result(&sm.t.rounding, pn, pdt, i + j);   // the value the store keeps
            bool inside = FULL || i + j < n, take = inside && bnb8_isfinite(g[r][j]) && bnb8_results_finite(pn, pdt, sj, nstates);
            bad += PASS != BNB8_PASS_MAX && inside && !take;     // counted once, by the pass that stores
            if (MASTER && cb) bnb8_master_update(pdt, cb, j, take, pn, p[r][j], nb, nc, DEF);
            else p[r][j] = take ? pn : p[r][j];
            #pragma unroll
            for (int k = 0; k < S; k++) s[r][k][j] = take ? sj[k] : s[r][k][j];
        }
        if (PASS != BNB8_PASS_MAX && MASTER && cb) bnb8_masters_store4(t, pdt, cb, i, FULL ? INT64_MAX : n, vec, p[r], nb, nc);
        else if (PASS != BNB8_PASS_MAX) bnb8_store4(t.param, pdt, i, FULL ? INT64_MAX : n, vec, p[r]);
    }
    #pragma unroll
    for (int k = 0; k < S; k++) {
        if (k >= nstates) continue;
        if (!eight_bit) {
            #pragma unroll
            for (int r = 0; r < R; r++) bnb8_store4(t.state[k], BNB8_F32, base + bnb8_offset<R>(r), FULL ? INT64_MAX : n, vec, s[r][k]);
            continue;
        }
        float amax[R];
        if (PASS == BNB8_PASS_STORE) {            // the tensor's new absmax, from the max pass
            #pragma unroll
            for (int r = 0; r < R; r++) amax[r] = bnb8_bits_f32(tmax[k]);
        } else {
            #pragma unroll
            for (int r = 0; r < R; r++) {
                int64_t i = base + bnb8_offset<R>(r);
                amax[r] = 0.0f;
                #pragma unroll
                for (int j = 0; j < 4; j++) if (FULL || i + j < n) amax[r] = fmaxf(amax[r], fabsf(s[r][k][j]));
            }
            if (PASS == BNB8_PASS_MAX) {
                // The chunk's max, then the tensor's: fmaxf is exact in any order, never NaN from 0,
                // and the bits of non-negative floats order as the floats do.
                bnb8_block_max<R>(amax, R * BNB8_ROW, sm.scratch);
                if (threadIdx.x == 0) atomicMax(&tmax[k], bnb8_f32_bits(amax[0]));
                continue;
            }
            bnb8_block_max<R>(amax, t.blocksize, sm.scratch);
        }
        const int is_signed = bnb8_state_signed(KIND, k), zero_code = is_signed ? zero_signed : zero_unsigned;
        // One absmax over the warp's whole segment (a block of at least 128 R, or the tensor's):
        // one reciprocal, and only row 0 can start a block.
        const bool one = PASS != BNB8_PASS_BLOCKS || t.blocksize >= 128 * R;
        const float rec0 = bnb8_reciprocal(amax[0]);
        #pragma unroll
        for (int r = 0; r < R; r++) {
            int64_t i = base + bnb8_offset<R>(r);
            // blocksize 0: the absmax is written after the last pass (this one still reads the old)
            if (PASS == BNB8_PASS_BLOCKS && (r == 0 || !one) && (FULL || i < n) && (i & (t.blocksize - 1)) == 0)
                t.absmax[k][i >> shift] = amax[r];
            // Codes without dividing, no branch per value; a row with a value next to a threshold
            // or a zero block (rare) is redone with the division.
            const bnb8_codebook *book = &sm.books[is_signed];
            float rec = r == 0 || one ? rec0 : bnb8_reciprocal(amax[r]);
            uint32_t q = 0;
            int redo = book->search;
            #pragma unroll
            for (int j = 0; j < 4; j++) q |= (uint32_t)bnb8_quantize_value_near(book, s[r][k][j], rec, &redo) << (8 * j);
            if (redo) q = bnb8_requantize4(book, zero_code, amax[r], s[r][k][0], s[r][k][1], s[r][k][2], s[r][k][3]);
            bnb8_store_codes4((uint8_t *)t.state[k], i, FULL ? INT64_MAX : n, vec, q);
        }
    }
}

// Flash tensors (DESIGN.md §6.3) and 32-bit-state tensors with corrected weights, in a launch that has
// any: the tables that make a code's value one shared-memory read (bit-identical to computing it).
// Static shared memory: the reads need no base address.
struct bnb8_flash_smem {
    float unit[2][256];          // bnb8_expand_unit of each code: [0] unsigned, [1] signed
    float ecc8[256];             // bnb8_ecc8_entry of each int8 correction byte
};
__shared__ bnb8_flash_smem bnb8_flash_tables;

// The max over a flash group of 32 elements: the LANES lanes holding it.
template <int LANES>
__device__ float bnb8_group_max(float m) {
    #pragma unroll
    for (int off = 1; off < LANES; off <<= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, off));
    return m;
}

// Raw 16-bit weights i..i+3 (zero past n), packed two per word.
__device__ void bnb8_load_bits4(const void *x, int64_t i, int64_t n, bool vec, uint32_t w[2]) {
    const uint16_t *h = (const uint16_t *)x;
    if (vec && i + 4 <= n) { uint2 v = BNB8_LD((const uint2 *)(h + i)); w[0] = v.x; w[1] = v.y; return; }
    w[0] = w[1] = 0;
    #pragma unroll
    for (int j = 0; j < 4; j++) if (i + j < n) w[j / 2] |= (uint32_t)h[i + j] << (16 * (j & 1));
}
__device__ void bnb8_store_bits4(void *x, int64_t i, int64_t n, bool vec, const uint32_t w[2]) {
    uint16_t *h = (uint16_t *)x;
    if (vec && i + 4 <= n) { BNB8_ST((uint2 *)(h + i), make_uint2(w[0], w[1])); return; }
    #pragma unroll
    for (int j = 0; j < 4; j++) if (i + j < n) h[i + j] = (uint16_t)(w[j / 2] >> (16 * (j & 1)));
}

// The weights of a row of 4 elements at i as masters (DESIGN.md §6.1): fp32 weights, or bf16/fp16
// weights with an int8 / int16 correction (cb 1, 2; 0: none) or an fp32 master (cb 4). Loads first
// (bits and corr keep what was read, for the elements a step leaves), the masters once they arrive
// (bnb8_masters_decode4), then per element its new master, bits and correction (bnb8_master_update)
// and the stores. The flash tables must be loaded (a FLASH launch). fast (a constant where it is
// called: the default configuration, bf16 weights with int8 corrections): bnb8.h's fast forms of
// the correction ([math.fast]) and the GPU's RNE, with the exact functions for the elements they
// do not vouch for (zero, tiny or huge weights: a branch that rare elements take).
__device__ __forceinline__ void bnb8_masters_load4(const bnb8_gpu_tensor &t, bnb8_dtype pdt, int cb, int64_t i, int64_t lim,
                                                   bool vec, float p[4], uint32_t bits[2], uint32_t corr[2]) {
    if (pdt == BNB8_F32) { bnb8_load4(t.param, BNB8_F32, i, lim, vec, p); return; }
    bnb8_load_bits4(t.param, i, lim, vec, bits);
    if (cb == 4) bnb8_load4(t.correction, BNB8_F32, i, lim, vec, p);
    if (cb == 1) corr[0] = bnb8_load_codes4((const uint8_t *)t.correction, i, lim, vec);
    if (cb == 2) bnb8_load_bits4(t.correction, i, lim, vec, corr);
}
__device__ __forceinline__ void bnb8_masters_decode4(bnb8_dtype pdt, int cb, const uint32_t bits[2], const uint32_t corr[2],
                                                     float p[4], bool fast = false) {
    if (pdt == BNB8_F32 || cb == 4) return;
    #pragma unroll
    for (int j = 0; j < 4; j++) {
        uint16_t h = (uint16_t)(bits[j / 2] >> (16 * (j & 1)));
        int32_t q = cb == 1 ? (int32_t)(int8_t)(corr[0] >> (8 * j))
                  : cb == 2 ? (int32_t)(int16_t)(corr[j / 2] >> (16 * (j & 1))) : 0;
        float unit = cb == 1 ? bnb8_flash_tables.ecc8[(corr[0] >> (8 * j)) & 255u] : bnb8_ecc_unit(q, 32767);
        int ok = fast;
        if (fast) p[j] = bnb8_ecc8_value_fast(h, bnb8_flash_tables.ecc8[(corr[0] >> (8 * j)) & 255u], &ok);
        if (!ok) p[j] = bnb8_ecc_value_unit(h, pdt, q, unit);   // q = 0 (no correction): the weight itself
    }
}
// Element j after the step: the master p becomes pn where take; narrow weights get RNE(pn) and its
// correction there, and keep their bits and correction elsewhere (a select, not a branch).
// fast: where take, pn is finite below bf16's overflow, so that the GPU's RNE is bnb8_f32_to_bf16's.
__device__ __forceinline__ void bnb8_master_update(bnb8_dtype pdt, int cb, int j, bool take, float pn, float &p,
                                                   uint32_t nb[2], uint32_t nc[2], bool fast = false) {
    p = take ? pn : p;
    if (pdt == BNB8_F32) return;
    uint16_t h = fast ? __bfloat16_as_ushort(__float2bfloat16_rn(pn)) : bnb8_f32_to_narrow(pn, pdt);
    int sh = 16 * (j & 1);
    nb[j / 2] = take ? (nb[j / 2] & ~(0xffffu << sh)) | ((uint32_t)h << sh) : nb[j / 2];
    if (cb == 1) {
        int ok = fast;
        int32_t code = fast ? bnb8_ecc8_code_fast(pn, h, &ok) : 0;
        if (!ok) code = bnb8_ecc_code(pn, h, pdt, 127);
        uint32_t q = (uint32_t)(uint8_t)(int8_t)code;
        nc[0] = take ? (nc[0] & ~(255u << (8 * j))) | (q << (8 * j)) : nc[0];
    } else if (cb == 2) {
        uint32_t q = (uint32_t)(uint16_t)(int16_t)bnb8_ecc_code(pn, h, pdt, 32767);
        nc[j / 2] = take ? (nc[j / 2] & ~(0xffffu << sh)) | (q << sh) : nc[j / 2];
    }
}
__device__ __forceinline__ void bnb8_masters_store4(const bnb8_gpu_tensor &t, bnb8_dtype pdt, int cb, int64_t i, int64_t lim,
                                                    bool vec, const float p[4], const uint32_t nb[2], const uint32_t nc[2]) {
    if (pdt == BNB8_F32) { bnb8_store4(t.param, BNB8_F32, i, lim, vec, p); return; }
    bnb8_store_bits4(t.param, i, lim, vec, nb);
    if (cb == 4) bnb8_store4(t.correction, BNB8_F32, i, lim, vec, p);
    if (cb == 1) bnb8_store_codes4((uint8_t *)t.correction, i, lim, vec, nc[0]);
    if (cb == 2) bnb8_store_bits4(t.correction, i, lim, vec, nc);
}

// One chunk of a flash tensor, or of a 32-bit-state tensor whose bf16/fp16 weights carry a
// correction or an fp32 master, in the order bnb8.h gives for both back ends: the masters and the expanded states,
// the update in float32, the new weights and corrections; then per flash state and group of 32
// (8 lanes: a lane holds 4 consecutive elements of a row) the new absmax, its stored scale and the
// codes against it. An element whose gradient or result is not finite keeps its weight bits,
// correction and states.
// DEF: the default configuration (flash states, bf16 weights with int8 corrections, bf16 gradients,
// e6m10 scales), with its dtypes known at compile time: no run-time choice between conversions.
// SR: the weights round stochastically (no correction then; a launch of such tensors only).
template <int R, int KIND, bool FULL, bool DEF, bool SR = false>
__device__ void bnb8_flash_chunk(bnb8_update_smem &sm, int64_t base, unsigned &bad) {
    const bnb8_flash_smem &fs = bnb8_flash_tables;
    const bnb8_gpu_tensor &t = sm.t;
    const int64_t n = t.n, lim = FULL ? INT64_MAX : n;
    const bool vec = FULL || sm.vec;
    const bnb8_step_args args = bnb8_args_of<KIND>(t);
    const int nstates = args.nstates, cb = DEF ? 1 : t.correction_bytes, flash = DEF || t.format == BNB8_STATE_FLASH;
    const bnb8_dtype pdt = DEF ? BNB8_BF16 : (bnb8_dtype)t.param_dtype, sdt = DEF ? BNB8_E6M10 : (bnb8_dtype)t.scale_dtype;
    const int gdt = DEF ? BNB8_BF16 : t.grad_dtype;
    constexpr int S = bnb8_max_states(KIND);
    float p[R][4], g[R][4], s[R][S][4] = {};
    uint32_t bits[R][2] = {}, corr[R][2] = {}, codes[S][R];
    // Every load first.
    #pragma unroll
    for (int r = 0; r < R; r++) {
        int64_t i = base + bnb8_offset<R>(r);
        if (pdt == BNB8_F32) bnb8_load4(t.param, BNB8_F32, i, lim, vec, p[r]);
        else bnb8_load_bits4(t.param, i, lim, vec, bits[r]);
        if (cb == 4) bnb8_load4(t.correction, BNB8_F32, i, lim, vec, p[r]);   // the fp32 master
        if (cb == 1) corr[r][0] = bnb8_load_codes4((const uint8_t *)t.correction, i, lim, vec);
        if (cb == 2) bnb8_load_bits4(t.correction, i, lim, vec, corr[r]);
        bnb8_load4(t.grad, gdt, i, lim, vec, g[r]);
    }
    if (!DEF) bnb8_sumsq_rows<R>(t, base, g);   // DEF: the fast path's fallback, which summed already
    #pragma unroll
    for (int k = 0; k < S; k++) {
        if (k >= nstates) continue;
        #pragma unroll
        for (int r = 0; r < R; r++) {
            int64_t i = base + bnb8_offset<R>(r);
            if (!flash) { bnb8_load4(t.state[k], BNB8_F32, i, lim, vec, s[r][k]); continue; }
            codes[k][r] = bnb8_load_codes4((const uint8_t *)t.state[k], i, lim, vec);
        }
    }
    // Per element its master and expanded states (unpacked here, not all before the loop: as
    // floats they would outlive the registers), the update; per row the new weights and corrections.
    const float trust = sm.trust;
    const int32_t qmax = bnb8_ecc_qmax(cb);
    #pragma unroll
    for (int r = 0; r < R; r++) {
        int64_t i = base + bnb8_offset<R>(r);
        uint32_t nb[2] = {bits[r][0], bits[r][1]}, nc[2] = {corr[r][0], corr[r][1]};
        float scale[S];          // the row's group scale per state, read here: 8 of them loaded first spill
        #pragma unroll
        for (int k = 0; k < S; k++)
            scale[k] = flash && k < nstates && (FULL || i < n) ? bnb8_scale_load(t.scale[k], sdt, i / BNB8_FLASH_GROUP) : 0.0f;
        #pragma unroll
        for (int j = 0; j < 4; j++) {
            if (pdt != BNB8_F32 && cb != 4) {
                uint16_t h = (uint16_t)(bits[r][j / 2] >> (16 * (j & 1)));
                int32_t q = cb == 1 ? (int32_t)(int8_t)(corr[r][0] >> (8 * j))
                          : cb == 2 ? (int32_t)(int16_t)(corr[r][j / 2] >> (16 * (j & 1))) : 0;
                float unit = cb == 1 ? fs.ecc8[(corr[r][0] >> (8 * j)) & 255u] : bnb8_ecc_unit(q, 32767);
                p[r][j] = bnb8_ecc_value_unit(h, pdt, q, unit);   // q = 0 (no correction): the weight itself
            }
            #pragma unroll
            for (int k = 0; k < S; k++) {
                if (k >= nstates || !flash) continue;
                const int is_signed = bnb8_state_signed(KIND, k);
                uint32_t c = (codes[k][r] >> (8 * j)) & 255u;
                s[r][k][j] = c ? bnb8_expand_from_unit(fs.unit[is_signed][c], scale[k], is_signed) : 0.0f;
            }
            float sk[3] = {0.0f, 0.0f, 0.0f};
            #pragma unroll
            for (int k = 0; k < S; k++) sk[k] = s[r][k][j];
            float u = bnb8_direction(&args, p[r][j], g[r][j], sk);
            float pn = bnb8_apply(&args, p[r][j], u, trust);
            if constexpr (SR) pn = bnb8_round_result(&sm.t.rounding, pn, pdt, i + j);   // the value the store keeps
            bool inside = FULL || i + j < n, take = inside && bnb8_isfinite(g[r][j]) && bnb8_results_finite(pn, pdt, sk, nstates);
            bad += inside && !take;
            #pragma unroll
            for (int k = 0; k < S; k++) s[r][k][j] = take ? sk[k] : s[r][k][j];
            if (pdt == BNB8_F32 || cb == 4) p[r][j] = take ? pn : p[r][j];
            if (pdt == BNB8_F32) continue;
            // The new bits and correction are computed for every element and kept where take
            // (else the weight's bits and correction stay): a select, not a branch per element.
            uint16_t h = bnb8_f32_to_narrow(pn, pdt);
            int sh = 16 * (j & 1);
            nb[j / 2] = take ? (nb[j / 2] & ~(0xffffu << sh)) | ((uint32_t)h << sh) : nb[j / 2];
            if (cb == 1) {
                uint32_t q = (uint32_t)(uint8_t)(int8_t)bnb8_ecc_code(pn, h, pdt, qmax);
                nc[0] = take ? (nc[0] & ~(255u << (8 * j))) | (q << (8 * j)) : nc[0];
            } else if (cb == 2) {
                uint32_t q = (uint32_t)(uint16_t)(int16_t)bnb8_ecc_code(pn, h, pdt, qmax);
                nc[j / 2] = take ? (nc[j / 2] & ~(0xffffu << sh)) | (q << sh) : nc[j / 2];
            }
        }
        if (pdt == BNB8_F32) bnb8_store4(t.param, BNB8_F32, i, lim, vec, p[r]);
        else bnb8_store_bits4(t.param, i, lim, vec, nb);
        if (cb == 1) bnb8_store_codes4((uint8_t *)t.correction, i, lim, vec, nc[0]);
        if (cb == 2) bnb8_store_bits4(t.correction, i, lim, vec, nc);
        if (cb == 4) bnb8_store4(t.correction, BNB8_F32, i, lim, vec, p[r]);
    }
    // The states: 32-bit stored as they are; flash requantized per group of 32.
    #pragma unroll
    for (int k = 0; k < S; k++) {
        if (k >= nstates) continue;
        const int is_signed = bnb8_state_signed(KIND, k);
        #pragma unroll
        for (int r = 0; r < R; r++) {
            int64_t i = base + bnb8_offset<R>(r);
            if (!flash) { bnb8_store4(t.state[k], BNB8_F32, i, lim, vec, s[r][k]); continue; }
            float amax = 0.0f, m[4];
            #pragma unroll
            for (int j = 0; j < 4; j++) {
                m[j] = bnb8_compand_magnitude(s[r][k][j], is_signed);
                if (FULL || i + j < n) amax = fmaxf(amax, m[j]);
            }
            amax = bnb8_group_max<BNB8_FLASH_GROUP / 4>(amax);
            float sc = bnb8_scale_round(amax, sdt);
            if ((FULL || i < n) && (i & (BNB8_FLASH_GROUP - 1)) == 0) bnb8_scale_store(t.scale[k], sdt, i / BNB8_FLASH_GROUP, sc);
            uint32_t q = 0;
            #pragma unroll
            for (int j = 0; j < 4; j++) q |= (uint32_t)bnb8_compand_code(s[r][k][j], m[j], sc, is_signed) << (8 * j);
            bnb8_store_codes4((uint8_t *)t.state[k], i, lim, vec, q);
        }
    }
}

// bnb8_flash_chunk in the default configuration on a full chunk, out of line: what the warp runs
// when the fast forms below do not vouch for one of its weights. Returns the non-finite count.
template <int R, int KIND>
__device__ __noinline__ unsigned bnb8_flash_chunk_exact(bnb8_update_smem &sm, int64_t base) {
    unsigned bad = 0;
    bnb8_flash_chunk<R, KIND, true, true>(sm, base, bad);
    return bad;
}

// The codes of a row of 4 state values in a group of stored scale s (an unsigned state's values
// as their square roots): the fast code where it is vouched for, else the exact one. Out of line:
// rows that need it are rare (BNB8_NEAR_CODE).
__device__ __noinline__ uint32_t bnb8_compand_redo4(float scale, int is_signed, float x0, float x1, float x2, float x3) {
    const float x[4] = {x0, x1, x2, x3};
    int scale_ok = 1;
    const float r = bnb8_compand_rcp(scale, &scale_ok);
    uint32_t q = 0;
    #pragma unroll
    for (int j = 0; j < 4; j++) {
        int ok = scale_ok;
        uint32_t c = is_signed ? bnb8_compand_signed_fast(x[j], 254.0f * r, &ok)
                               : bnb8_compand_root_fast(x[j], 255.0f * r, &ok);
        // bnb8_compand_code reads an unsigned value only for its finiteness, which its root shares,
        // and takes the root as its magnitude m.
        if (!ok) c = bnb8_compand_code(x[j], is_signed ? fabsf(x[j]) : x[j], scale, is_signed);
        q |= c << (8 * j);
    }
    return q;
}

// The weights of a tensor on the fast chunks (bnb8_flash_chunk_fast, bnb8_eight_chunk_fast): bf16
// with an int8 correction, bf16 rounded stochastically (no correction), or bf16 with an fp32 master.
// The master holds the weight, so that a fast chunk never reads the bf16 copy: every element of
// it takes its step (else the warp runs the exact chunk, which keeps the bits of those that do not).
enum { BNB8_FAST_INT8, BNB8_FAST_SR, BNB8_FAST_MASTER };

// The weights with which a fast chunk takes a tensor's full chunks of R rows, or -1: bf16 weights
// and gradients, and block-wise 8-bit states in blocks of 128 R, its warps' segments, with an int8
// correction, an fp32 master or stochastic rounding (bnb8_eight_chunk_fast), or 32-bit states with an
// fp32 master (bnb8_wide_chunk_fast).
__device__ int bnb8_fast_weights(const bnb8_gpu_tensor *t, int R) {
    if (t->param_dtype != BNB8_BF16 || t->grad_dtype != BNB8_BF16) return -1;
    if (t->format == BNB8_STATE_32BIT) return t->correction_bytes == 4 ? BNB8_FAST_MASTER : -1;
    if (t->format != BNB8_STATE_8BIT || t->blocksize != 128 * R) return -1;
    if (t->correction_bytes == 1) return BNB8_FAST_INT8;
    if (t->correction_bytes == 4) return BNB8_FAST_MASTER;
    return t->correction_bytes == 0 && t->rounding.on ? BNB8_FAST_SR : -1;
}

// A fast chunk's rows as they are loaded and stored, packed: a lane's 4 R consecutive elements of
// its warp's R * 128 (row r: elements o + 4 r ..), two rows per 16-byte bf16 access. They stay
// packed until the update of their element expands them: unpacked at once (weights, gradients and
// states as floats) they outlive the registers of a 2-row chunk and spill. The fields the weights
// W do not have are never touched, and hold no registers.
template <int R, int S> struct bnb8_fast_rows {
    uint32_t bits[R][2];         // bf16 weight pairs (written only, with an fp32 master)
    uint32_t corr[R];            // 4 int8 corrections (BNB8_FAST_INT8)
    float master[R][4];          // fp32 masters (BNB8_FAST_MASTER)
    uint32_t codes[S][R];        // each state's 4 codes
};

// This thread's first element of a fast chunk.
__device__ __forceinline__ unsigned bnb8_fast_offset(int R) {
    return (threadIdx.x / 32) * 128 * R + (threadIdx.x % 32) * 4 * R;
}

// Every load of a fast chunk at element base: the rows (bnb8_fast_rows) and the bf16 gradient pairs.
template <int R, int S, int W>
__device__ __forceinline__ void bnb8_fast_load(const bnb8_gpu_tensor &t, int64_t base, int nstates, bnb8_fast_rows<R, S> &in,
                                               uint32_t (&gw)[R][2]) {
    static_assert(R % 2 == 0, "a lane holds whole 16-byte pieces of its weights");
    // The arrays from the chunk's first element (block-uniform) plus the thread's 32-bit offset.
    const uint16_t *param = (const uint16_t *)t.param + base, *grad = (const uint16_t *)t.grad + base;
    const uint8_t *corr = (const uint8_t *)t.correction + base;
    const float *master = (const float *)t.correction + base;
    const unsigned o = bnb8_fast_offset(R);
    #pragma unroll
    for (int r = 0; r < R; r += 2) {
        const unsigned i = o + 4 * r;
        if (W == BNB8_FAST_MASTER) {
            const uint4 a = BNB8_LD((const uint4 *)(master + i)), b = BNB8_LD((const uint4 *)(master + i + 4));
            memcpy(in.master[r], &a, 16);
            memcpy(in.master[r + 1], &b, 16);
        } else {
            const uint4 w = BNB8_LD((const uint4 *)(param + i));
            in.bits[r][0] = w.x, in.bits[r][1] = w.y, in.bits[r + 1][0] = w.z, in.bits[r + 1][1] = w.w;
        }
        const uint4 h = BNB8_LD((const uint4 *)(grad + i));
        gw[r][0] = h.x, gw[r][1] = h.y, gw[r + 1][0] = h.z, gw[r + 1][1] = h.w;
        if (W == BNB8_FAST_INT8) {
            const uint2 c = BNB8_LD((const uint2 *)(corr + i));
            in.corr[r] = c.x, in.corr[r + 1] = c.y;
        }
        #pragma unroll
        for (int k = 0; k < S; k++) {
            if (k >= nstates) continue;
            const uint2 q = BNB8_LD((const uint2 *)((const uint8_t *)t.state[k] + base + i));
            in.codes[k][r] = q.x, in.codes[k][r + 1] = q.y;
        }
    }
}

// The same elements of the next chunk (a full one of the tensor), asked of L2 (bnb8_prefetch);
// GROUPS: their e6m10 scales too (a line per chunk at 2 rows).
template <int R, int S, int W, bool GROUPS>
__device__ __forceinline__ void bnb8_fast_prefetch(const bnb8_gpu_tensor &t, int64_t base, int nstates) {
    const int64_t i = base + bnb8_fast_offset(R) + R * BNB8_ROW;
    if (W != BNB8_FAST_MASTER) bnb8_prefetch((const uint16_t *)t.param + i);
    bnb8_prefetch((const uint16_t *)t.grad + i);
    if (W == BNB8_FAST_INT8) bnb8_prefetch((const uint8_t *)t.correction + i);
    if (W == BNB8_FAST_MASTER) bnb8_prefetch((const float *)t.correction + i);
    #pragma unroll
    for (int k = 0; k < S; k++)
        if (k < nstates) {
            bnb8_prefetch((const uint8_t *)t.state[k] + i);
            if (GROUPS) bnb8_prefetch((const uint16_t *)t.scale[k] + i / BNB8_FLASH_GROUP);
        }
}

// Every store of a fast chunk at element base but its states' scales: the new rows.
template <int R, int S, int W>
__device__ __forceinline__ void bnb8_fast_store(const bnb8_gpu_tensor &t, int64_t base, int nstates, const bnb8_fast_rows<R, S> &out) {
    uint16_t *param = (uint16_t *)t.param + base;
    uint8_t *corr = (uint8_t *)t.correction + base;
    float *master = (float *)t.correction + base;
    const unsigned o = bnb8_fast_offset(R);
    #pragma unroll
    for (int r = 0; r < R; r += 2) {
        const unsigned i = o + 4 * r;
        BNB8_ST((uint4 *)(param + i), make_uint4(out.bits[r][0], out.bits[r][1], out.bits[r + 1][0], out.bits[r + 1][1]));
        if (W == BNB8_FAST_INT8) BNB8_ST((uint2 *)(corr + i), make_uint2(out.corr[r], out.corr[r + 1]));
        if (W == BNB8_FAST_MASTER) {
            BNB8_ST((float4 *)(master + i), make_float4(out.master[r][0], out.master[r][1], out.master[r][2], out.master[r][3]));
            BNB8_ST((float4 *)(master + i + 4),
                    make_float4(out.master[r + 1][0], out.master[r + 1][1], out.master[r + 1][2], out.master[r + 1][3]));
        }
        #pragma unroll
        for (int k = 0; k < S; k++)
            if (k < nstates) BNB8_ST((uint2 *)((uint8_t *)t.state[k] + base + i), make_uint2(out.codes[k][r], out.codes[k][r + 1]));
    }
}

// The new bf16 pairs of a row of 4 finite weights below bf16's overflow: the GPU's RNE, which is
// bnb8_f32_to_bf16's for them.
__device__ __forceinline__ void bnb8_fast_bf16_pairs(const float pn[4], uint32_t nb[2]) {
    #pragma unroll
    for (int h = 0; h < 2; h++) {
        __nv_bfloat162 two = __floats2bfloat162_rn(pn[2 * h], pn[2 * h + 1]);
        memcpy(&nb[h], &two, 4);
    }
}

// The default flash configuration on a full chunk: bnb8_flash_chunk<R, KIND, true, true>'s results
// through the fast forms of bnb8.h, with no per-element choice for non-finite values. A code the
// fast forms do not vouch for is redone exactly (bnb8_compand_redo4); a zero, tiny or non-finite
// weight, a non-finite gradient or state, or a scale out of the fast range (all rare) sends the
// whole warp through bnb8_flash_chunk_exact before anything is stored. A lane holds the rows of
// bnb8_fast_rows, so that a group of 32 is 32 / (4 R) lanes: one scale per lane and state.
// next: as bnb8_update_chunk's.
template <int R, int KIND>
__device__ void bnb8_flash_chunk_fast(bnb8_update_smem &sm, int64_t base, bool next, unsigned &bad) {
    const bnb8_gpu_tensor &t = sm.t;
    const bnb8_flash_smem &fs = bnb8_flash_tables;
    const bnb8_step_args args = bnb8_args_of<KIND>(t);
    const int nstates = args.nstates;
    constexpr int S = bnb8_max_states(KIND), N = 4 * R, LANES = BNB8_FLASH_GROUP / N;
    static_assert(LANES >= 1, "a lane holds whole groups' shares");
    const int64_t group = (base + bnb8_fast_offset(R)) / BNB8_FLASH_GROUP;   // this lane's
    bnb8_fast_rows<R, S> in, out;
    uint32_t gw[R][2];
    bnb8_fast_load<R, S, BNB8_FAST_INT8>(t, base, nstates, in, gw);
    // A loaded scale that is subnormal is not vouched for (bnb8_e6m10_fast_to_f32): the exact path.
    int ok = 1;
    float scale[S];
    #pragma unroll
    for (int k = 0; k < S; k++) scale[k] = k < nstates ? bnb8_e6m10_fast_to_f32(((const uint16_t *)t.scale[k])[group], &ok) : 0.0f;
    bnb8_sumsq_lanes<R>(t, base, gw);
    if (next) bnb8_fast_prefetch<R, S, BNB8_FAST_INT8, true>(t, base, nstates);
    // Per element: its master, gradient and expanded states (code 0's unit is 0: its value 0 under
    // every e6m10 scale, all finite), the update; per row the new weights and corrections.
    const float trust = sm.trust;
    float s[R][S][4];
    #pragma unroll
    for (int r = 0; r < R; r++) {
        float pn[4];
        #pragma unroll
        for (int j = 0; j < 4; j++) {
            const float p = bnb8_ecc8_value_fast(in.bits[r][j / 2] >> (16 * (j & 1)), fs.ecc8[(in.corr[r] >> (8 * j)) & 255u], &ok);
            const float g = bnb8_fast_grad(gw[r], j);
            ok &= bnb8_isfinite(g);
            float sk[3] = {0.0f, 0.0f, 0.0f}, root;
            #pragma unroll
            for (int k = 0; k < S; k++)
                if (k < nstates)
                    sk[k] = bnb8_expand_from_unit(fs.unit[bnb8_state_signed(KIND, k)][(in.codes[k][r] >> (8 * j)) & 255u], scale[k],
                                                  bnb8_state_signed(KIND, k));
            pn[j] = bnb8_apply(&args, p, bnb8_direction_root(&args, p, g, sk, &root), trust);
            // a non-finite state goes to the exact path, which counts it (a non-finite weight's
            // bits fail bnb8_ecc8_code_fast's range)
            #pragma unroll
            for (int k = 0; k < S; k++) ok &= k >= nstates || bnb8_isfinite(sk[k]);
            // The unsigned state (the Adam family's second moment) is kept as its square root,
            // which its group's scale and its code need and the direction computed already.
            #pragma unroll
            for (int k = 0; k < S; k++) s[r][k][j] = bnb8_state_signed(KIND, k) ? sk[k] : root;
        }
        bnb8_fast_bf16_pairs(pn, out.bits[r]);
        out.corr[r] = 0;
        #pragma unroll
        for (int j = 0; j < 4; j++)
            out.corr[r] |= ((uint32_t)bnb8_ecc8_code_fast(pn[j], out.bits[r][j / 2] >> (16 * (j & 1)), &ok) & 255u) << (8 * j);
    }
    // The states: per group of 32 (LANES lanes), the scale and the codes. A group max other than 0
    // or in e6m10's normal range (an infinite value, a tiny or saturated scale) sends the warp to the
    // exact path; a NaN (which fmaxf skips) is not vouched for, and its code is redone exactly.
    static_assert(KIND == BNB8_ADAMW || KIND == BNB8_ADAM || KIND == BNB8_SGD || KIND == BNB8_LION,
                  "an unsigned state here is the Adam family's second moment, held as its root");
    uint32_t sc[S];
    #pragma unroll
    for (int k = 0; k < S; k++) {
        if (k >= nstates) continue;
        const int is_signed = bnb8_state_signed(KIND, k);
        float amax = 0.0f;              // of |x| (signed), of the roots (unsigned): the magnitudes
        #pragma unroll
        for (int r = 0; r < R; r++)
            #pragma unroll
            for (int j = 0; j < 4; j++) amax = fmaxf(amax, is_signed ? fabsf(s[r][k][j]) : s[r][k][j]);
        amax = bnb8_group_max<LANES>(amax);
        sc[k] = bnb8_scale_e6m10_fast(amax, &ok);   // = bnb8_scale_round(amax, BNB8_E6M10), vouched
        const float scale_k = bnb8_e6m10_fast_to_f32((uint16_t)sc[k], &ok);
        const float rc = bnb8_compand_rcp(scale_k, &ok) * (is_signed ? 254.0f : 255.0f);
        #pragma unroll
        for (int r = 0; r < R; r++) {
            int vouched = 1;
            uint32_t w = 0;
            #pragma unroll
            for (int j = 0; j < 4; j++)
                w |= (is_signed ? bnb8_compand_signed_fast(s[r][k][j], rc, &vouched)
                                : bnb8_compand_root_fast(s[r][k][j], rc, &vouched)) << (8 * j);
            if (!vouched) w = bnb8_compand_redo4(scale_k, is_signed, s[r][k][0], s[r][k][1], s[r][k][2], s[r][k][3]);
            out.codes[k][r] = w;
        }
    }
    if (__any_sync(0xffffffffu, !ok)) { bad += bnb8_flash_chunk_exact<R, KIND>(sm, base); return; }
    bnb8_fast_store<R, S, BNB8_FAST_INT8>(t, base, nstates, out);
    #pragma unroll
    for (int k = 0; k < S; k++)
        if (k < nstates && bnb8_fast_offset(R) % BNB8_FLASH_GROUP == 0) ((uint16_t *)t.scale[k])[group] = (uint16_t)sc[k];
}

// bnb8_update_chunk on a full chunk of a tensor the fast 8-bit chunk below takes, out of line: what
// a warp runs when that chunk cannot vouch for one of its elements (the DEF instance, or with an
// fp32 master the general one). Its blocks are its warp's segment (blocksize 128 R), so it needs no
// barrier. Returns the non-finite count.
template <int R, int KIND, int W>
__device__ __noinline__ unsigned bnb8_eight_chunk_exact(bnb8_update_smem &sm, int64_t base) {
    constexpr bool SR = W == BNB8_FAST_SR;
    unsigned bad = 0;
    bnb8_update_chunk<R, KIND, true, BNB8_PASS_BLOCKS, !SR, SR, W != BNB8_FAST_MASTER>(sm, base, false, bnb8_zero_code(0),
                                                                                       bnb8_zero_code(1), bad, nullptr);
    return bad;
}

// A block-wise 8-bit tensor with bf16 weights and gradients whose blocks are its warps' segments
// (blocksize 128 R: the trainer's 256 at 2 rows), on a full chunk (bnb8_fast_weights): bnb8_update_chunk's
// results in bnb8_fast_rows' layout (16-byte accesses, one absmax per warp and state) with no
// per-element choice for non-finite values. A weight whose correction the fast forms do not vouch
// for, a non-finite gradient or a result that cannot be kept (all rare) sends the warp through
// bnb8_eight_chunk_exact before anything is stored; a row of 4 with a code next to a threshold is
// redone with the division (bnb8_requantize4), as there. W: the weights (BNB8_FAST_*).
template <int R, int KIND, int W>
__device__ void bnb8_eight_chunk_fast(bnb8_update_smem &sm, int64_t base, bool next, unsigned &bad) {
    const bnb8_gpu_tensor &t = sm.t;
    const bnb8_flash_smem &fs = bnb8_flash_tables;
    const bnb8_step_args args = bnb8_args_of<KIND>(t);
    const int nstates = args.nstates;
    constexpr int S = bnb8_max_states(KIND);
    const int64_t block = (base + bnb8_fast_offset(R)) >> sm.shift;   // its warp's 8-bit block
    bnb8_fast_rows<R, S> in, out;
    uint32_t gw[R][2];
    bnb8_fast_load<R, S, W>(t, base, nstates, in, gw);
    float scale[S];
    #pragma unroll
    for (int k = 0; k < S; k++) scale[k] = k < nstates ? BNB8_LD(&t.absmax[k][block]) : 0.0f;
    bnb8_sumsq_lanes<R>(t, base, gw);
    if (next) bnb8_fast_prefetch<R, S, W, false>(t, base, nstates);
    // Per element: its master, gradient and states, the update; per row the new weights and corrections.
    const float trust = sm.trust;
    int ok = 1;
    float s[R][S][4];
    #pragma unroll
    for (int r = 0; r < R; r++) {
        float pn[4];
        #pragma unroll
        for (int j = 0; j < 4; j++) {
            const uint32_t h = W == BNB8_FAST_MASTER ? 0 : in.bits[r][j / 2] >> (16 * (j & 1));
            const float p = W == BNB8_FAST_MASTER ? in.master[r][j]
                          : W == BNB8_FAST_SR ? bnb8_bf16_to_f32((uint16_t)h)
                          : bnb8_ecc8_value_fast(h, fs.ecc8[(in.corr[r] >> (8 * j)) & 255u], &ok);
            const float g = bnb8_fast_grad(gw[r], j);
            float sk[3] = {0.0f, 0.0f, 0.0f};
            #pragma unroll
            for (int k = 0; k < S; k++)
                if (k < nstates) sk[k] = sm.code[bnb8_state_signed(KIND, k)][(in.codes[k][r] >> (8 * j)) & 255u] * scale[k];
            pn[j] = bnb8_apply(&args, p, bnb8_direction(&args, p, g, sk), trust);
            if constexpr (W == BNB8_FAST_SR) pn[j] = bnb8_round_result(&t.rounding, pn[j], BNB8_BF16, base + bnb8_fast_offset(R) + 4 * r + j);
            ok &= bnb8_isfinite(g) && bnb8_results_finite(pn[j], BNB8_BF16, sk, nstates);
            #pragma unroll
            for (int k = 0; k < S; k++) s[r][k][j] = sk[k];
            if (W == BNB8_FAST_MASTER) out.master[r][j] = pn[j];
        }
        bnb8_fast_bf16_pairs(pn, out.bits[r]);   // pn is finite below bf16's overflow, else the warp redoes it
        out.corr[r] = 0;
        #pragma unroll
        for (int j = 0; j < 4; j++)
            if (W == BNB8_FAST_INT8) out.corr[r] |= ((uint32_t)bnb8_ecc8_code_fast(pn[j], out.bits[r][j / 2] >> (16 * (j & 1)), &ok) & 255u) << (8 * j);
    }
    // The states: per warp (its block) the new absmax and the codes under it.
    float amax[S];
    #pragma unroll
    for (int k = 0; k < S; k++) {
        if (k >= nstates) continue;
        const int is_signed = bnb8_state_signed(KIND, k);
        float m = 0.0f;
        #pragma unroll
        for (int r = 0; r < R; r++)
            #pragma unroll
            for (int j = 0; j < 4; j++) m = fmaxf(m, fabsf(s[r][k][j]));
        amax[k] = bnb8_group_max<32>(m);
        const float rec = bnb8_reciprocal(amax[k]);
        const bnb8_codebook *book = &sm.books[is_signed];
        #pragma unroll
        for (int r = 0; r < R; r++) {
            int redo = book->search;
            uint32_t w = 0;
            #pragma unroll
            for (int j = 0; j < 4; j++) w |= (uint32_t)bnb8_quantize_value_near(book, s[r][k][j], rec, &redo) << (8 * j);
            if (redo) w = bnb8_requantize4(book, bnb8_zero_code(is_signed), amax[k], s[r][k][0], s[r][k][1], s[r][k][2], s[r][k][3]);
            out.codes[k][r] = w;
        }
    }
    if (__any_sync(0xffffffffu, !ok)) { bad += bnb8_eight_chunk_exact<R, KIND, W>(sm, base); return; }
    bnb8_fast_store<R, S, W>(t, base, nstates, out);
    #pragma unroll
    for (int k = 0; k < S; k++)
        if (k < nstates && threadIdx.x % 32 == 0) t.absmax[k][block] = amax[k];
}

// bnb8_flash_chunk on a full chunk of 32-bit states, out of line: what a warp runs when the fast
// 32-bit chunk below cannot vouch for one of its elements. Returns the non-finite count.
template <int R, int KIND>
__device__ __noinline__ unsigned bnb8_wide_chunk_exact(bnb8_update_smem &sm, int64_t base) {
    unsigned bad = 0;
    bnb8_flash_chunk<R, KIND, true, false>(sm, base, bad);
    return bad;
}

// 32-bit states with bf16 weights and gradients and an fp32 master (the trainer's fp32 recipe) on a
// full chunk (bnb8_fast_weights): bnb8_flash_chunk's results in bnb8_fast_rows' layout (16-byte
// accesses), without reading the bf16 weights, which the master holds. A non-finite gradient or a
// result that cannot be kept (rare) sends the warp through bnb8_wide_chunk_exact before anything is
// stored, so that every element here takes its step.
template <int R, int KIND>
__device__ void bnb8_wide_chunk_fast(bnb8_update_smem &sm, int64_t base, bool next, unsigned &bad) {
    const bnb8_gpu_tensor &t = sm.t;
    const bnb8_step_args args = bnb8_args_of<KIND>(t);
    const int nstates = args.nstates;
    constexpr int S = bnb8_max_states(KIND);
    static_assert(R % 2 == 0, "a lane holds whole 16-byte pieces of its weights");
    const unsigned o = bnb8_fast_offset(R);
    float *master = (float *)t.correction + base;                    // (R * 1024) fp32
    const uint16_t *grad = (const uint16_t *)t.grad + base;          // (R * 1024) bf16
    float p[R][4], s[R][S][4];
    uint32_t gw[R][2];
    // Every load first: per row a float4 of each fp32 array, per two rows a uint4 of gradients.
    #pragma unroll
    for (int r = 0; r < R; r++) {
        const unsigned i = o + 4 * r;
        const float4 m = BNB8_LD((const float4 *)(master + i));
        p[r][0] = m.x, p[r][1] = m.y, p[r][2] = m.z, p[r][3] = m.w;
        if (r % 2 == 0) {
            const uint4 h = BNB8_LD((const uint4 *)(grad + i));
            gw[r][0] = h.x, gw[r][1] = h.y, gw[r + 1][0] = h.z, gw[r + 1][1] = h.w;
        }
        #pragma unroll
        for (int k = 0; k < S; k++) {
            if (k >= nstates) continue;
            const float4 v = BNB8_LD((const float4 *)((const float *)t.state[k] + base + i));
            s[r][k][0] = v.x, s[r][k][1] = v.y, s[r][k][2] = v.z, s[r][k][3] = v.w;
        }
    }
    bnb8_sumsq_lanes<R>(t, base, gw);
    if (next) {                  // the same elements of the next chunk (a full one of this tensor)
        const unsigned i = o + R * BNB8_ROW;
        bnb8_prefetch(master + i);
        bnb8_prefetch(grad + i);
        #pragma unroll
        for (int k = 0; k < S; k++)
            if (k < nstates) bnb8_prefetch((const float *)t.state[k] + base + i);
    }
    const float trust = sm.trust;
    int ok = 1;
    uint32_t nb[R][2];
    #pragma unroll
    for (int r = 0; r < R; r++) {
        #pragma unroll
        for (int j = 0; j < 4; j++) {
            const float g = bnb8_fast_grad(gw[r], j);
            float sk[3] = {0.0f, 0.0f, 0.0f};
            #pragma unroll
            for (int k = 0; k < S; k++) if (k < nstates) sk[k] = s[r][k][j];
            p[r][j] = bnb8_apply(&args, p[r][j], bnb8_direction(&args, p[r][j], g, sk), trust);
            ok &= bnb8_isfinite(g) && bnb8_results_finite(p[r][j], BNB8_BF16, sk, nstates);
            #pragma unroll
            for (int k = 0; k < S; k++) s[r][k][j] = sk[k];
        }
        bnb8_fast_bf16_pairs(p[r], nb[r]);   // p is finite below bf16's overflow, else the warp redoes it
    }
    if (__any_sync(0xffffffffu, !ok)) { bad += bnb8_wide_chunk_exact<R, KIND>(sm, base); return; }
    uint16_t *param = (uint16_t *)t.param + base;
    #pragma unroll
    for (int r = 0; r < R; r++) {
        const unsigned i = o + 4 * r;
        if (r % 2 == 0) BNB8_ST((uint4 *)(param + i), make_uint4(nb[r][0], nb[r][1], nb[r + 1][0], nb[r + 1][1]));
        BNB8_ST((float4 *)(master + i), make_float4(p[r][0], p[r][1], p[r][2], p[r][3]));
        #pragma unroll
        for (int k = 0; k < S; k++)
            if (k < nstates) BNB8_ST((float4 *)((float *)t.state[k] + base + i), make_float4(s[r][k][0], s[r][k][1], s[r][k][2], s[r][k][3]));
    }
}

// The fast chunks of a run: a tensor's full chunks [chunk, run_end) from element base. STATES: the
// tensor's states (BNB8_STATE_FLASH, _8BIT or _32BIT: the fast flash, 8-bit or 32-bit chunk); W: the
// 8-bit chunk's weights (BNB8_FAST_*). Returns the non-finite count.
template <int R, int KIND, int STATES, int W = BNB8_FAST_INT8>
__device__ __forceinline__ unsigned bnb8_fast_chunks(bnb8_update_smem &sm, int64_t chunk, int64_t run_end, int64_t base) {
    unsigned bad = 0;
    for (; chunk < run_end; chunk++, base += R * BNB8_ROW) {
        const bool next = chunk + 1 < run_end;
        if constexpr (STATES == BNB8_STATE_FLASH) bnb8_flash_chunk_fast<R, KIND>(sm, base, next, bad);
        else if constexpr (STATES == BNB8_STATE_8BIT) bnb8_eight_chunk_fast<R, KIND, W>(sm, base, next, bad);
        else bnb8_wide_chunk_fast<R, KIND>(sm, base, next, bad);
    }
    return bad;
}

// 4-bit states (DESIGN.md §5.7), in launches that have them (FLASH modes 3 and 5): the 16-value maps
// (the launch's, from the header), their thresholds with the lookup of them (bnb8_four_book) and
// flash4's units, a shared-memory read each (static: only these kernels hold them).
struct bnb8_four_smem {
    float map[2][BNB8_FOUR_CODES];   // bnb8_four_map: [0] unsigned, [1] signed
    bnb8_four_book book[2];          // their thresholds and lookups (bnb8_four_book_init)
    float unit[2][BNB8_FOUR_CODES];  // bnb8_expand4_unit of each flash4 code
};
__shared__ bnb8_four_smem bnb8_four_tables;

// Element i + 1's row and column from element i's (a matrix of rows of cols elements).
__device__ __forceinline__ void bnb8_next_cell(int64_t cols, int64_t &row, int64_t &col) {
    if (++col == cols) { col = 0; row++; }
}

// The max pass of a rank-1 tensor: state k's fresh values (s, bnb8_four_chunk's) into the step's row
// and column maxima t.rank1_max, a thread's elements of one row combined first.
template <int R, bool FULL, int S>
__device__ void bnb8_rank1_maxima(const bnb8_gpu_tensor &t, int64_t base, const float (&s)[R][S][4], int k) {
    #pragma unroll
    for (int r = 0; r < R; r++) {
        int64_t i = base + bnb8_offset<R>(r), row = i / t.row_size, col = i - row * t.row_size, at = row;
        float run = 0.0f;            // the max over this thread's elements of row at
        #pragma unroll
        for (int j = 0; j < 4; j++) {
            if (!(FULL || i + j < t.n)) break;
            const float v = fabsf(s[r][k][j]);
            if (row != at) {
                if (run > 0.0f) atomicMax(&t.rank1_max[at], bnb8_f32_bits(run));
                at = row;
                run = 0.0f;
            }
            if (v > 0.0f) atomicMax(&t.rank1_max[t.rows + col], bnb8_f32_bits(v));
            run = fmaxf(run, v);
            bnb8_next_cell(t.row_size, row, col);
        }
        if (run > 0.0f) atomicMax(&t.rank1_max[at], bnb8_f32_bits(run));
    }
}

// One chunk of a tensor with 4-bit or flash4 states, in bnb8_update_chunk's layout (a lane holds 4
// consecutive elements of a row: two bytes of codes per state, written once, by this thread). Every
// load first; the masters (any weight dtype, with or without a correction or fp32 master), the
// states dequantized (map[code] times the block's absmax or the rank-1 min(row max, column max), or
// flash4's expansion under the group's scale), the update in float32; then per state the new codes:
// 4-bit under each block's new absmax (bnb8_block_max) or the rank-1 scale of the step's maxima,
// flash4 under each group's new scale (8 lanes). PASS: a rank-1 tensor's two passes; BNB8_PASS_MAX
// stores nothing and takes the non-negative state's row and column maxima into t.rank1_max (atomicMax
// of the float bits of values > 0, which order as the floats do: exact in any order; a thread's
// elements of one row combined first), and BNB8_PASS_STORE codes that state under them. Inlined:
// out of line, the function's own spills ran on every chunk, and the 4-bit kernels spilled more in
// all; the cost lands on the other paths of the 4-bit launches only (modes 3 and 5; ptxas -v and
// bench_gpu in dev/results/kernels.md). next: a full chunk of this tensor follows in the run loop
// (bnb8_update_kernel), whose elements are prefetched into L2 as bnb8_update_chunk does.
// SR (FLASH mode 5): the weights round stochastically (bnb8_round_result before the finiteness
// check, as the other chunks); such a tensor has no correction, so cb is 0 at compile time. A
// template argument, so that mode 3's instances hold no trace of it.
// DEF: the tensor is in the default configuration (bnb8_default_tensor: block-wise 4-bit, blocks of
// 128, no rank-1, bf16 weights and gradients, an int8 correction or stochastic rounding), which this
// instance takes as constants: the same arithmetic with the other configurations' branches folded
// away, so that it holds fewer values live and spills less.
template <int R, int KIND, bool FULL, int PASS, bool SR, bool DEF>
__device__ __forceinline__ void bnb8_four_chunk(bnb8_update_smem &sm, int64_t base, bool next, unsigned &bad) {
    static_assert(BNB8_BLOCKSIZE_4BIT == 1 << 7, "DEF's shift is log2 of the default 4-bit block size");
    const bnb8_four_smem &ft = bnb8_four_tables;
    const bnb8_gpu_tensor &t = sm.t;
    const int64_t n = t.n, lim = FULL ? INT64_MAX : n, blocksize = DEF ? BNB8_BLOCKSIZE_4BIT : t.blocksize;
    const bool vec = FULL || sm.vec, rows = !DEF && t.row_size > 0;
    const bnb8_step_args args = bnb8_args_of<KIND>(t);
    const int nstates = args.nstates, cb = SR ? 0 : DEF ? 1 : t.correction_bytes;
    const int flash4 = !DEF && t.format == BNB8_STATE_FLASH4, shift = DEF ? 7 : sm.shift;
    const bnb8_dtype pdt = DEF ? BNB8_BF16 : (bnb8_dtype)t.param_dtype, sdt = (bnb8_dtype)t.scale_dtype;
    const int gdt = DEF ? BNB8_BF16 : t.grad_dtype;
    constexpr int S = bnb8_max_states(KIND);
    float p[R][4], g[R][4], s[R][S][4];
    uint32_t bits[R][2] = {}, corr[R][2] = {}, codes[S][R];
    #pragma unroll
    for (int r = 0; r < R; r++) {
        int64_t i = base + bnb8_offset<R>(r);
        bnb8_masters_load4(t, pdt, cb, i, lim, vec, p[r], bits[r], corr[r]);
        bnb8_load4(t.grad, gdt, i, lim, vec, g[r]);
        #pragma unroll
        for (int k = 0; k < S; k++) if (k < nstates) codes[k][r] = bnb8_load_nibbles4((const uint8_t *)t.state[k], i, lim, vec);
    }
    if (FULL && next) {          // the same elements of the next chunk (a full one of this tensor)
        const int64_t ps = pdt == BNB8_F32 ? 4 : 2, gs = gdt == BNB8_F32 ? 4 : 2;
        #pragma unroll
        for (int r = 0; r < R; r++) {
            const int64_t i = base + R * BNB8_ROW + bnb8_offset<R>(r);
            bnb8_prefetch((const char *)t.param + i * ps);
            bnb8_prefetch((const char *)t.grad + i * gs);
            if (cb) bnb8_prefetch((const char *)t.correction + i * cb);
            #pragma unroll
            for (int k = 0; k < S; k++) if (k < nstates) bnb8_prefetch((const uint8_t *)t.state[k] + i / 2);
        }
    }
    if (PASS != BNB8_PASS_MAX) bnb8_sumsq_rows<R>(t, base, g);
    const float trust = sm.trust;
    #pragma unroll
    for (int r = 0; r < R; r++) {
        int64_t i = base + bnb8_offset<R>(r), row = 0, col = 0;
        if (rows) { row = i / t.row_size; col = i - row * t.row_size; }
        bnb8_masters_decode4(pdt, cb, bits[r], corr[r], p[r], DEF && !SR);
        float scale[S];          // a row's 4 elements share a block and a group
        #pragma unroll
        for (int k = 0; k < S; k++)
            scale[k] = k >= nstates || !(FULL || i < n) ? 0.0f : flash4 ? bnb8_scale_load(t.scale[k], sdt, i / BNB8_FLASH_GROUP)
                     : k == t.rank1_k && rows ? 0.0f : t.absmax[k][i >> shift];
        uint32_t nb[2] = {bits[r][0], bits[r][1]}, nc[2] = {corr[r][0], corr[r][1]};
        #pragma unroll
        for (int j = 0; j < 4; j++) {
            const bool inside = FULL || i + j < n;
            float sj[3] = {0.0f, 0.0f, 0.0f};
            #pragma unroll
            for (int k = 0; k < S; k++) {
                if (k >= nstates) continue;
                const int sg = bnb8_state_signed(KIND, k), c = (codes[k][r] >> (4 * j)) & 15;
                float a = scale[k];
                if (!flash4 && k == t.rank1_k && rows) a = inside ? bnb8_rank1_min(t.absmax[k], t.rows, row, col) : 0.0f;
                sj[k] = flash4 ? bnb8_expand_from_unit(ft.unit[sg][c], a, sg) : ft.map[sg][c] * a;
                s[r][k][j] = sj[k];
            }
            float u = bnb8_direction(&args, p[r][j], g[r][j], sj);
            float pn = bnb8_apply(&args, p[r][j], u, trust);
            if constexpr (SR) pn = bnb8_round_result(&t.rounding, pn, pdt, i + j);   // the value the store keeps
            bool take = inside && bnb8_isfinite(g[r][j]) && bnb8_results_finite(pn, pdt, sj, nstates);
            bad += PASS != BNB8_PASS_MAX && inside && !take;     // counted once, by the pass that stores
            bnb8_master_update(pdt, cb, j, take, pn, p[r][j], nb, nc, DEF && !SR);
            #pragma unroll
            for (int k = 0; k < S; k++) s[r][k][j] = take ? sj[k] : s[r][k][j];
            if (rows) bnb8_next_cell(t.row_size, row, col);
        }
        if (PASS != BNB8_PASS_MAX) bnb8_masters_store4(t, pdt, cb, i, lim, vec, p[r], nb, nc);
    }
    #pragma unroll
    for (int k = 0; k < S; k++) {
        if (k >= nstates) continue;
        const int sg = bnb8_state_signed(KIND, k), pad = bnb8_four_pad(t.format, sg);
        const bool rank1 = !flash4 && k == t.rank1_k && rows;
        if constexpr (PASS == BNB8_PASS_MAX) {   // the other states' blocks are the store pass's
            if (rank1) bnb8_rank1_maxima<R, FULL>(t, base, s, k);
        } else {
            float amax[R];
            #pragma unroll
            for (int r = 0; r < R; r++) {
                int64_t i = base + bnb8_offset<R>(r);
                amax[r] = 0.0f;
                #pragma unroll
                for (int j = 0; j < 4; j++)
                    if (FULL || i + j < n) amax[r] = fmaxf(amax[r], flash4 ? bnb8_compand_magnitude(s[r][k][j], sg) : fabsf(s[r][k][j]));
            }
            const bool one = blocksize >= 128 * R;
            if (!flash4 && !rank1) bnb8_block_max<R>(amax, (int)blocksize, sm.scratch);   // uniform over the block
            #pragma unroll
            for (int r = 0; r < R; r++) {
                int64_t i = base + bnb8_offset<R>(r), row = 0, col = 0;
                if (rank1) { row = i / t.row_size; col = i - row * t.row_size; }
                float sc = amax[r];
                if (flash4) {
                    sc = bnb8_scale_round(bnb8_group_max<BNB8_FLASH_GROUP / 4>(amax[r]), sdt);
                    if ((FULL || i < n) && (i & (BNB8_FLASH_GROUP - 1)) == 0) bnb8_scale_store(t.scale[k], sdt, i / BNB8_FLASH_GROUP, sc);
                } else if (!rank1 && (r == 0 || !one) && (FULL || i < n) && (i & (blocksize - 1)) == 0) {
                    t.absmax[k][i >> shift] = sc;
                }
                uint32_t w = 0;
                #pragma unroll
                for (int j = 0; j < 4; j++) {
                    int c = pad;
                    if (FULL || i + j < n) {
                        const float x = s[r][k][j];
                        if (flash4) c = bnb8_compand4_code(x, bnb8_compand_magnitude(x, sg), sc, sg);
                        else if (rank1) c = bnb8_four_code(&ft.book[sg], sg, x, bnb8_rank1_min((const float *)t.rank1_max, t.rows, row, col));
                        else c = bnb8_four_code(&ft.book[sg], sg, x, sc);
                    }
                    w |= (uint32_t)c << (4 * j);
                    if (rank1) bnb8_next_cell(t.row_size, row, col);
                }
                bnb8_store_nibbles4((uint8_t *)t.state[k], i, lim, vec, w);
            }
        }
    }
}

// Chunks a block takes at most at a time (build with -DBNB8_GRAB=n to compare).
#ifndef BNB8_GRAB
#define BNB8_GRAB 16
#endif

// KIND: every tensor of an optimizer has its kind, so the kernel is compiled per kind and the
// shared math's switch folds away.
// FLASH: 1 when the launch holds flash tensors or corrected weights (only the kinds with a flash
// form), 2 when some of those are 8-bit states with corrected weights: their chunks then carry the
// masters (bnb8_update_chunk's MASTER), which costs the other paths registers where it is compiled;
// BNB8_FOUR_LAUNCH (3) when it holds 4-bit or flash4 tensors (bnb8_four_chunk, and mode 2's paths
// for the others), so that the launches without them compile as before.
// BNB8_SR_LAUNCH (4): every tensor of the launch rounds its weights stochastically (none has a
// correction; bnb8.c steps them in a launch of their own): the rounding is compiled into these
// kernels only, so that the others keep their registers (DESIGN.md §6.6); no fast flash path.
// BNB8_FOUR_SR_LAUNCH (5): mode 4 with 4-bit or flash4 tensors among them: mode 4's paths and
// bnb8_four_chunk's rounding instance, so that modes 3 and 4 compile as without it.
// BNB8_MASTER_LAUNCH (6): every tensor of the launch has bf16 weights and gradients with an fp32
// master, its states 8-bit or 32-bit (the trainer's 8bit and fp32 recipes): the general chunks and
// the fast chunks of fp32 masters (bnb8_eight_chunk_fast's, bnb8_wide_chunk_fast) in place of mode
// 2's flash, int8 and default 8-bit instances, so that modes 1 and 2 compile as without them.
// PASS: BNB8_PASS_BLOCKS steps tensors [0, h->blocked), the blocked and 32-bit ones; the other
// passes the blocksize-0 ones after them (tensor_max: their maxima, 3 per tensor).
template <int R, int KIND, int FLASH, int PASS>
__global__ void __launch_bounds__(BNB8_THREADS, R == 2 ? 3 : 2)
bnb8_update_kernel(bnb8_step_header *h, const bnb8_gpu_tensor *tensors, const double *norms,
                   unsigned long long *nonfinite, unsigned *tensor_max) {
    extern __shared__ __align__(16) unsigned char bnb8_smem[];
    bnb8_update_smem &sm = *(bnb8_update_smem *)bnb8_smem;
    constexpr bool SR = FLASH == BNB8_SR_LAUNCH || FLASH == BNB8_FOUR_SR_LAUNCH;
    constexpr bool FOUR = FLASH == BNB8_FOUR_LAUNCH || FLASH == BNB8_FOUR_SR_LAUNCH;   // 4-bit tensors, their tables
    constexpr bool MASTERS = FLASH == 2 || FLASH == BNB8_FOUR_LAUNCH || FLASH == BNB8_MASTER_LAUNCH;   // chunks of 8-bit states may carry masters
    for (int k = threadIdx.x; k < 512; k += blockDim.x) (&sm.code[0][0])[k] = (&h->code[0][0])[k];
    if (FLASH && (!SR || bnb8_flash_form(KIND))) {   // the tables (an SR launch's flash tensors need them)
        bnb8_flash_tables.unit[0][threadIdx.x] = bnb8_expand_unit((uint8_t)threadIdx.x, 0);
        bnb8_flash_tables.unit[1][threadIdx.x] = bnb8_expand_unit((uint8_t)threadIdx.x, 1);
        bnb8_flash_tables.ecc8[threadIdx.x] = bnb8_ecc8_entry((int32_t)(int8_t)threadIdx.x);
    }
    if (FOUR && threadIdx.x < 2 * BNB8_FOUR_CODES) {
        const int sg = threadIdx.x / BNB8_FOUR_CODES, c = threadIdx.x % BNB8_FOUR_CODES;
        bnb8_four_tables.map[sg][c] = h->four[sg][c];
        bnb8_four_tables.unit[sg][c] = bnb8_expand4_unit(c, sg);
    }
    if (FOUR) __syncthreads();   // the maps, before their thresholds
    if (FOUR && threadIdx.x < 2 * BNB8_FOUR_CODES) {
        const int sg = threadIdx.x / BNB8_FOUR_CODES, c = threadIdx.x % BNB8_FOUR_CODES;
        bnb8_four_tables.book[sg].t[c] = bnb8_threshold_of(bnb8_four_tables.map[sg], BNB8_FOUR_CODES, c);
    }
    if (FOUR) __syncthreads();   // the thresholds, before their lookups (bnb8_four_book_init's order)
    for (int b = threadIdx.x; FOUR && b < 4 * BNB8_FOUR_LOOKUP_HALF; b += blockDim.x) {
        bnb8_four_book &book = bnb8_four_tables.book[b / (2 * BNB8_FOUR_LOOKUP_HALF)];
        book.entry[b % (2 * BNB8_FOUR_LOOKUP_HALF)] = bnb8_four_entry_of(book.t, b % (2 * BNB8_FOUR_LOOKUP_HALF));
    }
    __syncthreads();
    if (PASS != BNB8_PASS_MAX) {                 // the max pass quantizes nothing
        bnb8_codebook_load(&sm.books[0], &h->books[0]);
        bnb8_codebook_load(&sm.books[1], &h->books[1]);
    }
    const int zero_unsigned = bnb8_zero_code(0), zero_signed = bnb8_zero_code(1);   // not nearest(0): bnb8.h says why
    const bool blocks = PASS == BNB8_PASS_BLOCKS;
    const int first = blocks ? 0 : h->blocked, count = blocks ? h->blocked : h->count;
    const int64_t first_chunk = blocks ? 0 : h->blocked_chunks, total = blocks ? h->blocked_chunks : h->total_chunks;
    unsigned bad = 0;
    int64_t next_tensor_chunk = first_chunk;     // the chunk where the descriptor must change
    int ti = first;
    // The chunks are handed out in order to whichever block asks next, up to BNB8_GRAB at a time
    // (a counter in the header): the chunks in flight on the GPU then lie close together in memory,
    // which DRAM serves faster than each block walking a range of its own (measured with
    // `bench_gpu order`: dev/results/kernels.md). Grabs shrink toward the end, to a quarter of what
    // each block would have left after its last, so that the blocks end together. A block's
    // chunks only grow.
    int64_t after = first_chunk;                 // thread 0: the end of the block's last grab
    for (int grabs = 0;; grabs++) {
        if (threadIdx.x == 0) {
            int64_t size = (total - after) / (4 * (int64_t)gridDim.x);
            size = size < 1 ? 1 : size > BNB8_GRAB ? BNB8_GRAB : size;
            const int64_t start = first_chunk + (int64_t)atomicAdd(&h->taken[PASS], (unsigned long long)size);
            after = start + size < total ? start + size : total;
            sm.grab[grabs & 1][0] = start;
            sm.grab[grabs & 1][1] = after;
        }
        __syncthreads();                         // two slots: a slot's next write is a barrier later
        const int64_t grab = sm.grab[grabs & 1][0], end = sm.grab[grabs & 1][1];
        if (grab >= total) break;
        for (int64_t chunk = grab; chunk < end; chunk++) {
            if (chunk >= next_tensor_chunk) {        // uniform over the block
                ti = bnb8_tensor_of(tensors, ti, count, chunk);
                if (chunk != grab) __syncthreads();  // all done with the former tensor (a grab starts so)
                const bnb8_gpu_tensor *t = &tensors[ti];
                const uint32_t *src = (const uint32_t *)t;
                uint32_t *dst = (uint32_t *)&sm.t;
                for (int w = threadIdx.x; w < (int)(sizeof(bnb8_gpu_tensor) / 4); w += blockDim.x) {
                    uint32_t word = src[w];
                    if (w == offsetof(bnb8_gpu_tensor, args.gnorm_scale) / 4) word = bnb8_f32_bits(bnb8_gnorm_scale(t, norms, ti));
                    dst[w] = word;
                }
                if (threadIdx.x == 0) {
                    sm.trust = bnb8_needs_trust(t)
                        ? bnb8_trust_ratio(t->args.max_unorm, (float)norms[ti * BNB8_NORMS + 1], (float)norms[ti * BNB8_NORMS + 2]) : 1.0f;
                    sm.shift = bnb8_absmax_shift(t);
                    sm.vec = bnb8_tensor_vec(t);
                    sm.def = bnb8_default_tensor(t);
                    sm.fast = bnb8_fast_weights(t, R);
                }
                __syncthreads();
                next_tensor_chunk = ti + 1 < count ? tensors[ti + 1].first_chunk : total;
            }
            int64_t base = (chunk - sm.t.first_chunk) * R * BNB8_ROW;
            bool full = sm.vec && base + R * BNB8_ROW <= sm.t.n;
            // A full chunk starts a run, [chunk, run_end): the tensor's full chunks that follow it
            // in this grab, stepped by an inner loop without the bookkeeping above. Default flash
            // tensors and 4-bit ones always: their paths gain more from it than the few register
            // spills it causes in the launch's other paths cost. RUN: the other full chunks, only where the
            // inner loop causes no spills (not in launches with flash tensors, nor for AdEMAMix's
            // 3 states at 4 rows). Spill counts: dev/results/kernels.md.
            constexpr bool RUN = !FLASH && !(R == 4 && bnb8_max_states(KIND) == 3);
            int64_t run_end = sm.t.first_chunk + sm.t.n / (R * BNB8_ROW);
            run_end = run_end < end ? run_end : end;
            run_end = run_end < next_tensor_chunk ? run_end : next_tensor_chunk;
            if constexpr (SR && PASS == BNB8_PASS_BLOCKS && bnb8_flash_form(KIND)) {
                if (sm.t.format == BNB8_STATE_FLASH) {   // no fast path: its weights carry an int8 correction
                    if (full) bnb8_flash_chunk<R, KIND, true, false, true>(sm, base, bad);
                    else bnb8_flash_chunk<R, KIND, false, false, true>(sm, base, bad);
                    continue;
                }
            }
            if constexpr (FOUR) {                                 // 4-bit and flash4 tensors, in any pass
                if (sm.t.format == BNB8_STATE_4BIT || sm.t.format == BNB8_STATE_FLASH4) {
                    const bool def = PASS == BNB8_PASS_BLOCKS && sm.def;   // the passes' tensors are rank-1 ones
                    if (full && def) {
                        for (; chunk < run_end; chunk++, base += R * BNB8_ROW)
                            bnb8_four_chunk<R, KIND, true, PASS, SR, true>(sm, base, chunk + 1 < run_end, bad);
                        chunk--;
                    }
                    else if (full) {
                        for (; chunk < run_end; chunk++, base += R * BNB8_ROW)
                            bnb8_four_chunk<R, KIND, true, PASS, SR, false>(sm, base, chunk + 1 < run_end, bad);
                        chunk--;
                    }
                    else bnb8_four_chunk<R, KIND, false, PASS, SR, false>(sm, base, false, bad);
                    continue;
                }
            }
            if constexpr (FLASH && !SR && PASS == BNB8_PASS_BLOCKS) {   // the passes hold no flash tensors
                if (sm.t.format == BNB8_STATE_FLASH || (sm.t.correction_bytes && !sm.t.eight_bit)) {
                    // Mode 6 holds no flash tensors: its 32-bit ones take the fast 32-bit chunk, at 2 rows
                    // (the values of 4 would spill).
                    constexpr bool WIDE = FLASH == BNB8_MASTER_LAUNCH;
                    if (WIDE && R == 2 && full && sm.t.format == BNB8_STATE_32BIT && sm.fast == BNB8_FAST_MASTER) {
                        if constexpr (WIDE && R == 2) bad += bnb8_fast_chunks<R, KIND, BNB8_STATE_32BIT>(sm, chunk, run_end, base);
                        chunk = run_end - 1;
                    }
                    else if (!WIDE && full && sm.def) {
                        if constexpr (!WIDE) bad += bnb8_fast_chunks<R, KIND, BNB8_STATE_FLASH>(sm, chunk, run_end, base);
                        chunk = run_end - 1;
                    }
                    else if (full) bnb8_flash_chunk<R, KIND, true, false>(sm, base, bad);
                    else bnb8_flash_chunk<R, KIND, false, false>(sm, base, bad);
                    continue;
                }
            }
            // Block-wise 8-bit tensors with bf16 weights whose blocks are the warps' segments take the
            // fast 8-bit chunk, at 2 rows, with its weights' instance: int8 corrections in mode 2,
            // stochastic rounding in mode 4, fp32 masters in mode 6. The 4-bit paths of modes 3 and 5
            // already hold more registers; the fp32 masters' instance beside the others (inline or out
            // of line) made mode 2's paths slower (dev/results/kernels.md).
            constexpr int W8 = FLASH == 2 ? BNB8_FAST_INT8 : FLASH == BNB8_SR_LAUNCH ? BNB8_FAST_SR
                             : FLASH == BNB8_MASTER_LAUNCH ? BNB8_FAST_MASTER : -1;
            constexpr bool FAST8 = W8 >= 0 && PASS == BNB8_PASS_BLOCKS && R == 2;
            if (FAST8 && full && sm.t.eight_bit && sm.fast == W8) {
                if constexpr (FAST8) bad += bnb8_fast_chunks<R, KIND, BNB8_STATE_8BIT, W8>(sm, chunk, run_end, base);
                chunk = run_end - 1;
                continue;
            }
            unsigned *tmax = PASS == BNB8_PASS_BLOCKS ? nullptr : tensor_max + 3 * ti;
            // 8-bit tensors in the default configuration (the 4-bit ones took their branch above)
            constexpr bool DEF8 = (MASTERS || SR) && PASS == BNB8_PASS_BLOCKS && FLASH != BNB8_MASTER_LAUNCH;   // none in mode 6
            if (DEF8 && full && sm.def && sm.t.eight_bit) {
                for (; chunk < run_end; chunk++, base += R * BNB8_ROW)
                    bnb8_update_chunk<R, KIND, true, PASS, MASTERS, SR, DEF8>(sm, base, chunk + 1 < run_end, zero_unsigned, zero_signed, bad, tmax);
                chunk--;
            }
            else if (full && RUN) {
                for (; chunk < run_end; chunk++, base += R * BNB8_ROW)
                    bnb8_update_chunk<R, KIND, true, PASS, MASTERS, SR>(sm, base, chunk + 1 < run_end, zero_unsigned, zero_signed, bad, tmax);
                chunk--;
            }
            else if (full) bnb8_update_chunk<R, KIND, true, PASS, MASTERS, SR>(sm, base, false, zero_unsigned, zero_signed, bad, tmax);
            else bnb8_update_chunk<R, KIND, false, PASS, MASTERS, SR>(sm, base, false, zero_unsigned, zero_signed, bad, tmax);
        }
    }
    for (int off = 16; off > 0; off >>= 1) bad += __shfl_xor_sync(0xffffffffu, bad, off);
    if (threadIdx.x % 32 == 0 && bad) atomicAdd(nonfinite, (unsigned long long)bad);
}

// The pinned ring goes once no upload reads it.
static void bnb8_free_staging(bnb8_cuda_context *c) {
    if (!c->staging) return;
    for (int i = 0; i < BNB8_STAGING_SLOTS; i++) cudaEventSynchronize(c->staged[i]);
    cudaFreeHost(c->staging);
    c->staging = NULL;
}

static bnb8_status bnb8_context_reserve(bnb8_cuda_context *c, size_t bytes, int count) {
    const char *fn = "bnb8_optimizer_step";
    if (bytes > c->capacity) {
        bnb8_free_staging(c);
        if (c->upload) { cudaFree(c->upload); c->upload = NULL; }
        c->capacity = 0;
        size_t cap = (bytes * 2 + 255) / 256 * 256;
        bnb8_status status = bnb8_cuda_status(fn, cudaMallocHost(&c->staging, cap * BNB8_STAGING_SLOTS));
        if (status) return status;
        status = bnb8_cuda_status(fn, cudaMalloc(&c->upload, cap));
        if (status) return status;
        c->capacity = cap;
    }
    if (count > c->norm_capacity) {
        if (c->norms) cudaFree(c->norms);
        if (c->tensor_max) cudaFree(c->tensor_max);
        c->norms = NULL;
        c->tensor_max = NULL;
        c->norm_capacity = 0;
        int capacity = count > INT_MAX / 2 ? count : 2 * count;   // room to grow, without int overflow
        bnb8_status status = bnb8_cuda_status(fn, cudaMalloc(&c->norms, sizeof(double) * BNB8_NORMS * (size_t)capacity));
        if (!status) status = bnb8_cuda_status(fn, cudaMalloc(&c->tensor_max, sizeof(unsigned) * 3 * (size_t)capacity));
        if (status) return status;
        c->norm_capacity = capacity;
    }
    return BNB8_OK;
}

extern "C" void bnb8_cuda_context_free(void *context) {
    bnb8_cuda_context *c = (bnb8_cuda_context *)context;
    if (!c) return;
    bnb8_free_staging(c);
    for (int i = 0; i < BNB8_STAGING_SLOTS; i++) cudaEventDestroy(c->staged[i]);
    cudaFree(c->upload);
    cudaFree(c->norms);
    cudaFree(c->tensor_max);
    cudaFree(c->nonfinite);
    cudaFree(c->units);
    cudaFree(c->rank1_max);
    free(c);
}

static bnb8_status bnb8_context_create(bnb8_cuda_context **out) {
    const char *fn = "bnb8_optimizer_step";
    bnb8_cuda_context *c = (bnb8_cuda_context *)calloc(1, sizeof *c);
    if (!c) return bnb8_fail(BNB8_ERR_NOMEM, "%s: GPU context", fn);
    int device = 0;
    bnb8_status status = bnb8_cuda_status(fn, cudaGetDevice(&device));
    if (!status) status = bnb8_cuda_status(fn, cudaDeviceGetAttribute(&c->sms, cudaDevAttrMultiProcessorCount, device));
    for (int i = 0; i < BNB8_STAGING_SLOTS && !status; i++)
        status = bnb8_cuda_status(fn, cudaEventCreateWithFlags(&c->staged[i], cudaEventDisableTiming));
    if (!status) status = bnb8_cuda_status(fn, cudaMalloc(&c->nonfinite, sizeof *c->nonfinite));
    if (!status) status = bnb8_cuda_status(fn, cudaMemset(c->nonfinite, 0, sizeof *c->nonfinite));
    if (status) { bnb8_cuda_context_free(c); return status; }
    *out = c;
    return BNB8_OK;
}

// Launches the update kernel of kind KIND over its chunks with one wave of blocks (each block
// copies its codebooks once, then takes chunks until none is left).
template <int KIND, int FLASH, int PASS>
static bnb8_status bnb8_launch_update(bnb8_cuda_context *c, int rows, int64_t chunks, bnb8_step_header *dh,
                                      const bnb8_gpu_tensor *dt, cudaStream_t stream) {
    const int smem = (int)sizeof(bnb8_update_smem);
    int *per_sm = &c->update_per_sm[PASS][FLASH][rows == 4][KIND];
    int64_t grid;
    bnb8_status status = rows == 2 ? bnb8_persistent_grid(bnb8_update_kernel<2, KIND, FLASH, PASS>, smem, per_sm, chunks, &grid)
                           : bnb8_persistent_grid(bnb8_update_kernel<4, KIND, FLASH, PASS>, smem, per_sm, chunks, &grid);
    if (status) return status;
    if (rows == 2) bnb8_update_kernel<2, KIND, FLASH, PASS><<<grid, BNB8_THREADS, smem, stream>>>(dh, dt, c->norms, c->nonfinite, c->tensor_max);
    else bnb8_update_kernel<4, KIND, FLASH, PASS><<<grid, BNB8_THREADS, smem, stream>>>(dh, dt, c->norms, c->nonfinite, c->tensor_max);
    return bnb8_cuda_status("bnb8_optimizer_step", cudaGetLastError());
}

// The launch of KIND, with the flash tables when the launch has flash tensors or corrections (flash
// states and corrected weights exist on the GPU for AdamW, Adam, SGD and Lion only). flash: the
// FLASH mode above; the two passes of blocksize 0 take mode 2 when those tensors carry masters,
// BNB8_FOUR_LAUNCH when they hold rank-1 4-bit tensors (AdamW and Adam: the kinds with a second
// moment), and BNB8_SR_LAUNCH, as the first launch, when they round stochastically
// (BNB8_FOUR_SR_LAUNCH with rank-1 4-bit tensors among them).
template <int KIND, int PASS>
static bnb8_status bnb8_launch_kind(bnb8_cuda_context *c, int flash, int rows, int64_t chunks,
                                    bnb8_step_header *dh, const bnb8_gpu_tensor *dt, cudaStream_t stream) {
    if (flash == BNB8_SR_LAUNCH) return bnb8_launch_update<KIND, BNB8_SR_LAUNCH, PASS>(c, rows, chunks, dh, dt, stream);
    if constexpr (bnb8_flash_form(KIND)) {
        if constexpr (PASS == BNB8_PASS_BLOCKS || KIND == BNB8_ADAMW || KIND == BNB8_ADAM) {
            if (flash == BNB8_FOUR_LAUNCH) return bnb8_launch_update<KIND, BNB8_FOUR_LAUNCH, PASS>(c, rows, chunks, dh, dt, stream);
            if (flash == BNB8_FOUR_SR_LAUNCH) return bnb8_launch_update<KIND, BNB8_FOUR_SR_LAUNCH, PASS>(c, rows, chunks, dh, dt, stream);
        } else {
            if (flash == BNB8_FOUR_LAUNCH || flash == BNB8_FOUR_SR_LAUNCH)
                return bnb8_fail(BNB8_ERR_ARG, "bnb8_optimizer_step: rank-1 states for optimizer kind %d", KIND);
        }
        if (flash == 2) return bnb8_launch_update<KIND, 2, PASS>(c, rows, chunks, dh, dt, stream);
        if constexpr (PASS == BNB8_PASS_BLOCKS)
            if (flash == BNB8_MASTER_LAUNCH) return bnb8_launch_update<KIND, BNB8_MASTER_LAUNCH, PASS>(c, rows, chunks, dh, dt, stream);
        if constexpr (PASS == BNB8_PASS_BLOCKS)
            if (flash == 1) return bnb8_launch_update<KIND, 1, PASS>(c, rows, chunks, dh, dt, stream);
    }
    return bnb8_launch_update<KIND, 0, PASS>(c, rows, chunks, dh, dt, stream);
}

// -DBNB8_ONLY_ADAMW (`make ONLY_ADAMW=1`, a development build): the AdamW kernels alone, the same code
// as in the full build, which compiles in a fraction of the time; for the benchmarks, whose optimizer
// rows are AdamW. Every other kind is refused.
template <int PASS>
static bnb8_status bnb8_launch_pass(bnb8_cuda_context *c, int kind, int flash, int rows, int64_t chunks,
                                    bnb8_step_header *dh, const bnb8_gpu_tensor *dt, cudaStream_t stream) {
#ifdef BNB8_ONLY_ADAMW
    if (kind != BNB8_ADAMW)
        return bnb8_fail(BNB8_ERR_ARG, "bnb8_optimizer_step: optimizer kind %d: this bnb8_cuda.cu was built with "
                         "-DBNB8_ONLY_ADAMW (AdamW alone)", kind);
    return bnb8_launch_kind<BNB8_ADAMW, PASS>(c, flash, rows, chunks, dh, dt, stream);
#else
    switch (kind) {
    case BNB8_ADAMW: return bnb8_launch_kind<BNB8_ADAMW, PASS>(c, flash, rows, chunks, dh, dt, stream);
    case BNB8_ADAM: return bnb8_launch_kind<BNB8_ADAM, PASS>(c, flash, rows, chunks, dh, dt, stream);
    case BNB8_SGD: return bnb8_launch_kind<BNB8_SGD, PASS>(c, flash, rows, chunks, dh, dt, stream);
    case BNB8_LION: return bnb8_launch_kind<BNB8_LION, PASS>(c, flash, rows, chunks, dh, dt, stream);
    case BNB8_RMSPROP: return bnb8_launch_kind<BNB8_RMSPROP, PASS>(c, flash, rows, chunks, dh, dt, stream);
    case BNB8_ADAGRAD: return bnb8_launch_kind<BNB8_ADAGRAD, PASS>(c, flash, rows, chunks, dh, dt, stream);
    case BNB8_LAMB: return bnb8_launch_kind<BNB8_LAMB, PASS>(c, flash, rows, chunks, dh, dt, stream);
    case BNB8_LARS: return bnb8_launch_kind<BNB8_LARS, PASS>(c, flash, rows, chunks, dh, dt, stream);
    case BNB8_ADEMAMIX: return bnb8_launch_kind<BNB8_ADEMAMIX, PASS>(c, flash, rows, chunks, dh, dt, stream);
    default: return bnb8_fail(BNB8_ERR_ARG, "bnb8_optimizer_step: optimizer kind %d", kind);
    }
#endif
}

// After both passes of the blocksize-0 tensors [first, end): each state's max becomes its absmax (the
// rank-1 tensors' maxima are copied by bnb8_cuda_step).
__global__ void bnb8_absmax_kernel(const bnb8_gpu_tensor *tensors, int first, int end, const unsigned *tensor_max) {
    int ti = first + blockIdx.x * blockDim.x + threadIdx.x;
    if (ti >= end) return;
    const bnb8_gpu_tensor *t = &tensors[ti];
    if (t->row_size > 0) return;
    for (int k = 0; k < t->args.nstates; k++) t->absmax[k][0] = bnb8_bits_f32(tensor_max[3 * ti + k]);
}

// Scratch of a launch in *pool (grown when a step needs more: cudaFree and cudaMalloc, which wait for
// the device; the contents are not kept), shared out in tensor order: tensor i gets per(&t[i])
// elements at t[i].*field, NULL for none. *total: the elements shared out.
template <typename T>
static bnb8_status bnb8_scratch_share(const char *fn, bnb8_gpu_tensor *t, int count, T **pool, int64_t *capacity,
                                      T *bnb8_gpu_tensor::*field, int64_t (*per)(const bnb8_gpu_tensor *), int64_t *total) {
    int64_t need = 0;
    for (int i = 0; i < count; i++) need += per(&t[i]);
    if (need > *capacity) {
        cudaFree(*pool);
        *pool = NULL;
        *capacity = 0;
        bnb8_status status = bnb8_cuda_status(fn, cudaMalloc((void **)pool, sizeof(T) * (size_t)need));
        if (status) return status;
        *capacity = need;
    }
    for (int64_t i = 0, at = 0; i < count; i++) {
        int64_t k = per(&t[i]);
        t[i].*field = k ? *pool + at : NULL;
        at += k;
    }
    *total = need;
    return BNB8_OK;
}
static int64_t bnb8_units_of(const bnb8_gpu_tensor *t) {
    return t->sum_squares ? (t->n + BNB8_SUMSQ_UNIT - 1) / BNB8_SUMSQ_UNIT : 0;
}
static int64_t bnb8_maxima_of(const bnb8_gpu_tensor *t) { return t->row_size > 0 ? t->rows + t->row_size : 0; }

extern "C" bnb8_status bnb8_cuda_step(void **context, const bnb8_gpu_tensor *tensors, int count,
                                      const float code_unsigned[256], const float code_signed[256],
                                      const float four_maps[2][BNB8_FOUR_CODES], const bnb8_codebook books[2],
                                      cudaStream_t stream) {
    const char *fn = "bnb8_optimizer_step";
    if (count <= 0) return BNB8_OK;
    bnb8_status status = *context ? BNB8_OK : bnb8_context_create((bnb8_cuda_context **)context);
    if (status) return status;
    bnb8_cuda_context *c = (bnb8_cuda_context *)*context;
    size_t header_bytes = (sizeof(bnb8_step_header) + 255) / 256 * 256;
    size_t bytes = header_bytes + sizeof(bnb8_gpu_tensor) * (size_t)count;
    if ((status = bnb8_context_reserve(c, bytes, count))) return status;
    // The slot we fill was uploaded BNB8_STAGING_SLOTS steps ago; that copy is long done.
    int slot = c->next;
    c->next = (c->next + 1) % BNB8_STAGING_SLOTS;
    if ((status = bnb8_cuda_status(fn, cudaEventSynchronize(c->staged[slot])))) return status;
    void *staging = (char *)c->staging + (size_t)slot * c->capacity;
    bnb8_step_header *h = (bnb8_step_header *)staging;
    bnb8_gpu_tensor *t = (bnb8_gpu_tensor *)((char *)staging + header_bytes);
    memcpy(h->code[0], code_unsigned, sizeof h->code[0]);
    memcpy(h->code[1], code_signed, sizeof h->code[1]);
    memcpy(h->four, four_maps, sizeof h->four);
    memcpy(h->books, books, sizeof h->books);
    // Chunks of 2 rows, or 4 when a tensor has blocks of 4096: a chunk holds whole blocks.
    int rows = 2, need_percentile = 0, need_trust = 0, flash = 0, per_tensor_masters = 0, four = 0, rank1 = 0;
    int stochastic = 0, fp32_masters = 1;
    for (int i = 0; i < count; i++) {
        stochastic += tensors[i].rounding.on != 0;
        fp32_masters &= tensors[i].param_dtype == BNB8_BF16 && tensors[i].grad_dtype == BNB8_BF16 && tensors[i].correction_bytes == 4 &&
                        (tensors[i].format == BNB8_STATE_8BIT || tensors[i].format == BNB8_STATE_32BIT);
        int blocks = tensors[i].eight_bit || tensors[i].format == BNB8_STATE_4BIT;
        if (blocks && bnb8_rows_for(tensors[i].blocksize) == 4) rows = 4;
        if (tensors[i].format == BNB8_STATE_FLASH || tensors[i].correction_bytes) flash = flash > 1 ? flash : 1;
        if (tensors[i].eight_bit && tensors[i].correction_bytes) flash = 2;
        four |= bnb8_four_tensor(&tensors[i]);
        rank1 |= tensors[i].row_size > 0;
        need_percentile |= tensors[i].percentile < 100;
        per_tensor_masters |= bnb8_per_tensor(&tensors[i]) && tensors[i].correction_bytes;
        need_trust |= (tensors[i].args.kind == BNB8_LAMB || tensors[i].args.kind == BNB8_LARS) && tensors[i].args.max_unorm > 0.0f;
    }
    // Stochastic rounding has kernels of its own: bnb8.c steps those tensors in a launch of their own.
    if (stochastic && stochastic < count)
        return bnb8_fail(BNB8_ERR_ARG, "%s: %d of %d tensors round stochastically: a launch holds tensors that all "
                         "do or none", fn, stochastic, count);
    // The blocksize-0 tensors last: [0, blocked) keep the single launch, [blocked, count) get the two passes.
    int blocked = 0;
    for (int i = 0; i < count; i++) if (!bnb8_per_tensor(&tensors[i])) t[blocked++] = tensors[i];
    for (int i = 0, m = blocked; i < count; i++) if (bnb8_per_tensor(&tensors[i])) t[m++] = tensors[i];
    int64_t chunks = 0, chunk = (int64_t)rows * BNB8_ROW;
    for (int i = 0; i < count; i++) {
        t[i].first_chunk = chunks;
        chunks += (t[i].n + chunk - 1) / chunk;
    }
    int64_t blocked_chunks = blocked < count ? t[blocked].first_chunk : chunks, units = 0, maxima = 0;
    // The launch's scratch: cfg.sum_squares' units; the rank-1 tensors' new row and column maxima,
    // zeroed before the max pass.
    if ((status = bnb8_scratch_share(fn, t, count, &c->units, &c->units_capacity, &bnb8_gpu_tensor::units, bnb8_units_of, &units)) ||
        (status = bnb8_scratch_share(fn, t, count, &c->rank1_max, &c->rank1_capacity, &bnb8_gpu_tensor::rank1_max,
                                     bnb8_maxima_of, &maxima)))
        return status;
    h->total_chunks = chunks;
    h->count = count;
    h->blocked = blocked;
    h->blocked_chunks = blocked_chunks;
    memset(h->taken, 0, sizeof h->taken);
    bnb8_step_header *dh = (bnb8_step_header *)c->upload;
    const bnb8_gpu_tensor *dt = (const bnb8_gpu_tensor *)((char *)c->upload + header_bytes);
    status = bnb8_cuda_status(fn, cudaMemcpyAsync(c->upload, staging, bytes, cudaMemcpyHostToDevice, stream));
    if (!status) status = bnb8_cuda_status(fn, cudaEventRecord(c->staged[slot], stream));
    if (!status && (need_percentile || need_trust))
        status = bnb8_cuda_status(fn, cudaMemsetAsync(c->norms, 0, sizeof(double) * BNB8_NORMS * (size_t)count, stream));
    if (status) return status;
    int64_t grid = chunks < (int64_t)c->sms * 8 ? chunks : (int64_t)c->sms * 8;
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
    // Flash and 4-bit states and corrected weights exist for AdamW, Adam, SGD and Lion only (bnb8.c checks).
    if (four) flash = BNB8_FOUR_LAUNCH;
    if (flash && !bnb8_flash_form(kind))
        return bnb8_fail(BNB8_ERR_ARG, "%s: flash or 4-bit states for optimizer kind %d", fn, kind);
    if (stochastic) flash = four ? BNB8_FOUR_SR_LAUNCH : BNB8_SR_LAUNCH;   // their kernels (none of their tensors has a correction)
    if (fp32_masters) flash = BNB8_MASTER_LAUNCH;   // bf16 weights with fp32 masters alone: their kernels
    if (blocked > 0) status = bnb8_launch_pass<BNB8_PASS_BLOCKS>(c, kind, flash, rows, blocked_chunks, dh, dt, stream);
    if (!status && blocked < count) {
        status = bnb8_cuda_status(fn, cudaMemsetAsync(c->tensor_max + 3 * (size_t)blocked, 0,
                                                      sizeof(unsigned) * 3 * (size_t)(count - blocked), stream));
        if (!status && maxima) status = bnb8_cuda_status(fn, cudaMemsetAsync(c->rank1_max, 0, sizeof(unsigned) * (size_t)maxima, stream));
        int mode = stochastic ? (rank1 ? BNB8_FOUR_SR_LAUNCH : BNB8_SR_LAUNCH) : rank1 ? BNB8_FOUR_LAUNCH : per_tensor_masters ? 2 : 0;
        if (!status) status = bnb8_launch_pass<BNB8_PASS_MAX>(c, kind, mode, rows, chunks - blocked_chunks, dh, dt, stream);
        if (!status) status = bnb8_launch_pass<BNB8_PASS_STORE>(c, kind, mode, rows, chunks - blocked_chunks, dh, dt, stream);
        if (!status) {
            bnb8_absmax_kernel<<<(count - blocked + 127) / 128, 128, 0, stream>>>(dt, blocked, count, c->tensor_max);
            status = bnb8_cuda_status(fn, cudaGetLastError());
        }
        // Each rank-1 state's maxima become the step's, in stream order after the store pass read the old ones.
        for (int i = blocked; !status && i < count; i++)
            if (t[i].row_size > 0)
                status = bnb8_cuda_status(fn, cudaMemcpyAsync(t[i].absmax[t[i].rank1_k], t[i].rank1_max,
                                                              sizeof(float) * (size_t)(t[i].rows + t[i].row_size),
                                                              cudaMemcpyDeviceToDevice, stream));
    }
    if (!status && units > 0) bnb8_sumsq_kernel<<<count, BNB8_THREADS, 0, stream>>>(dt);
    if (status) return status;
    return bnb8_cuda_status(fn, cudaGetLastError());
}

extern "C" bnb8_status bnb8_cuda_take_nonfinite(void *context, int64_t *count) {
    bnb8_cuda_context *c = (bnb8_cuda_context *)context;
    unsigned long long value = 0;
    bnb8_status status = bnb8_cuda_status("bnb8_optimizer_take_nonfinite",
                                  cudaMemcpy(&value, c->nonfinite, sizeof value, cudaMemcpyDeviceToHost));
    if (!status) status = bnb8_cuda_status("bnb8_optimizer_take_nonfinite", cudaMemset(c->nonfinite, 0, sizeof value));
    *count = (int64_t)value;
    return status;
}
