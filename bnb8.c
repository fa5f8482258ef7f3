/*
bnb8.c — the CPU back end: maps, block-wise quantization, optimizers (OpenMP), files.
See bnb8.h for the API. Build with -ffp-contract=off so the math matches the GPU bit for bit
(DESIGN.md §2).
*/
#define _POSIX_C_SOURCE 200809L   // fsync, fileno
#define BNB8_INTERNAL             // the shared per-element math and bnb8_fail
#include "bnb8.h"
#include <stdio.h>
#include <stdlib.h>
#include <stdarg.h>
#include <errno.h>
#include <unistd.h>
#include <fcntl.h>
#include <sys/stat.h>
#ifdef _OPENMP
#include <omp.h>
#endif

// ------------------------------------------------------------------------------------------------
// Errors

static _Thread_local char bnb8_error_text[512];

static const char *bnb8_error_names[BNB8_NUM_ERRORS] = {
    "ok",
    "a required pointer is NULL",
    "a size is negative or out of range",
    "block size is not a power of two in 64..4096",
    "unknown or unsupported dtype",
    "an argument is out of range",
    "out of memory",
    "file could not be opened, read or written",
    "file is malformed, truncated or does not match",
    "a CUDA call failed",
    "a pointer is on the wrong device for this call",
};

const char *bnb8_strerror(bnb8_status status) {
    if ((int)status < 0 || (int)status >= BNB8_NUM_ERRORS) return "unknown bnb8 status";
    return bnb8_error_names[status];
}

const char *bnb8_last_error(void) { return bnb8_error_text; }

// Records the detailed message of a failure and returns its status, so callers write
// `return bnb8_fail(BNB8_ERR_SIZE, "bnb8_quantize_blockwise: n = %lld < 0", n);`.
bnb8_status bnb8_fail(bnb8_status status, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    int len = vsnprintf(bnb8_error_text, sizeof bnb8_error_text, fmt, ap);
    va_end(ap);
    if (len >= 0 && (size_t)len < sizeof bnb8_error_text - 4)
        snprintf(bnb8_error_text + len, sizeof bnb8_error_text - (size_t)len, " (%s)", bnb8_strerror(status));
    return status;
}

size_t bnb8_dtype_size(bnb8_dtype dtype) {
    if (dtype == BNB8_F32) return 4;
    if (dtype == BNB8_F16 || dtype == BNB8_BF16 || dtype == BNB8_E6M10) return 2;
    return 0;
}

static int bnb8_blocksize_ok(int64_t blocksize) {
    return blocksize >= 64 && blocksize <= 4096 && (blocksize & (blocksize - 1)) == 0;
}

static bnb8_status bnb8_check_blocksize(const char *fn, int64_t blocksize) {
    if (!bnb8_blocksize_ok(blocksize))
        return bnb8_fail(BNB8_ERR_BLOCKSIZE, "%s: blocksize %lld", fn, (long long)blocksize);
    return BNB8_OK;
}

// The dtype of a tensor (f32, f16, bf16: e6m10 holds group scales only), of group scales (any).
static bnb8_status bnb8_check_dtype(const char *fn, bnb8_dtype dtype) {
    if (bnb8_dtype_size(dtype) == 0 || dtype == BNB8_E6M10)
        return bnb8_fail(BNB8_ERR_DTYPE, "%s: dtype %d is not f32, f16 or bf16", fn, (int)dtype);
    return BNB8_OK;
}
static bnb8_status bnb8_check_scale_dtype(const char *fn, bnb8_dtype dtype) {
    if (bnb8_dtype_size(dtype) == 0)
        return bnb8_fail(BNB8_ERR_DTYPE, "%s: scale_dtype %d is not e6m10, f32, f16 or bf16", fn, (int)dtype);
    return BNB8_OK;
}

// ------------------------------------------------------------------------------------------------
// Quantization maps

// bitsandbytes builds the dynamic maps with float32 linspace, whose rounding differs from the exact
// formula 10^(i-6) (0.1 + 0.9 (2k+1)/2^(i+1)) by up to 2 ulp in some entries. These are the values
// its users get (float32 bit patterns, index = stored byte); test/test_quant.c checks them against
// the golden files and against the exact formula.
static const uint32_t bnb8_dynamic_signed_bits[256] = {
    0xbf7e3333, 0xbf7a999a, 0xbf770000, 0xbf736666, 0xbf6fcccd, 0xbf6c3333, 0xbf68999a, 0xbf650000,
    0xbf616666, 0xbf5dcccd, 0xbf5a3333, 0xbf56999a, 0xbf530000, 0xbf4f6666, 0xbf4bcccd, 0xbf483333,
    0xbf44999a, 0xbf410000, 0xbf3d6666, 0xbf39cccd, 0xbf363334, 0xbf32999a, 0xbf2f0000, 0xbf2b6666,
    0xbf27cccd, 0xbf243334, 0xbf20999a, 0xbf1d0000, 0xbf196666, 0xbf15cccd, 0xbf123334, 0xbf0e999a,
    0xbf0b0000, 0xbf076666, 0xbf03cccc, 0xbf003333, 0xbef93332, 0xbef20000, 0xbeeacccc, 0xbee3999a,
    0xbedc6666, 0xbed53333, 0xbece0000, 0xbec6cccc, 0xbebf999a, 0xbeb86666, 0xbeb13333, 0xbeaa0000,
    0xbea2cccc, 0xbe9b999a, 0xbe946666, 0xbe8d3334, 0xbe860000, 0xbe7d9999, 0xbe6f3333, 0xbe60cccd,
    0xbe526666, 0xbe440000, 0xbe35999a, 0xbe273333, 0xbe18cccd, 0xbe0a6666, 0xbdf80000, 0xbddb3334,
    0xbdc9eb85, 0xbdc428f7, 0xbdbe6667, 0xbdb8a3d7, 0xbdb2e148, 0xbdad1eb8, 0xbda75c2a, 0xbda1999a,
    0xbd9bd70a, 0xbd96147b, 0xbd9051eb, 0xbd8a8f5d, 0xbd84cccd, 0xbd7e147b, 0xbd728f5d, 0xbd670a3d,
    0xbd5b851f, 0xbd500000, 0xbd447ae1, 0xbd38f5c3, 0xbd2d70a3, 0xbd21eb85, 0xbd166667, 0xbd0ae148,
    0xbcfeb852, 0xbce7ae15, 0xbcd0a3d7, 0xbcb9999a, 0xbca28f5d, 0xbc8b851f, 0xbc68f5c3, 0xbc3ae148,
    0xbc1f3b64, 0xbc160418, 0xbc0ccccd, 0xbc039581, 0xbbf4bc6a, 0xbbe24dd3, 0xbbcfdf3b, 0xbbbd70a4,
    0xbbab020d, 0xbb989374, 0xbb8624dd, 0xbb676c8a, 0xbb428f5c, 0xbb1db22d, 0xbaf1a9fc, 0xbaa7ef9d,
    0xba7765ff, 0xba59e83e, 0xba3c6a80, 0xba1eecc1, 0xba016f01, 0xb9c7e283, 0xb98ce705, 0xb923d70b,
    0xb8ba1f4b, 0xb88aefb3, 0xb8378034, 0xb7b24206, 0xb70205ff, 0xb65a1a94, 0xb513a3b7, 0x00000000,
    0x3513a3b7, 0x365a1a94, 0x370205ff, 0x37b24206, 0x38378034, 0x388aefb3, 0x38ba1f4b, 0x3923d70b,
    0x398ce705, 0x39c7e283, 0x3a016f01, 0x3a1eecc1, 0x3a3c6a80, 0x3a59e83e, 0x3a7765ff, 0x3aa7ef9d,
    0x3af1a9fc, 0x3b1db22d, 0x3b428f5c, 0x3b676c8a, 0x3b8624dd, 0x3b989374, 0x3bab020d, 0x3bbd70a4,
    0x3bcfdf3b, 0x3be24dd3, 0x3bf4bc6a, 0x3c039581, 0x3c0ccccd, 0x3c160418, 0x3c1f3b64, 0x3c3ae148,
    0x3c68f5c3, 0x3c8b851f, 0x3ca28f5d, 0x3cb9999a, 0x3cd0a3d7, 0x3ce7ae15, 0x3cfeb852, 0x3d0ae148,
    0x3d166667, 0x3d21eb85, 0x3d2d70a3, 0x3d38f5c3, 0x3d447ae1, 0x3d500000, 0x3d5b851f, 0x3d670a3d,
    0x3d728f5d, 0x3d7e147b, 0x3d84cccd, 0x3d8a8f5d, 0x3d9051eb, 0x3d96147b, 0x3d9bd70a, 0x3da1999a,
    0x3da75c2a, 0x3dad1eb8, 0x3db2e148, 0x3db8a3d7, 0x3dbe6667, 0x3dc428f7, 0x3dc9eb85, 0x3ddb3334,
    0x3df80000, 0x3e0a6666, 0x3e18cccd, 0x3e273333, 0x3e35999a, 0x3e440000, 0x3e526666, 0x3e60cccd,
    0x3e6f3333, 0x3e7d9999, 0x3e860000, 0x3e8d3334, 0x3e946666, 0x3e9b999a, 0x3ea2cccc, 0x3eaa0000,
    0x3eb13333, 0x3eb86666, 0x3ebf999a, 0x3ec6cccc, 0x3ece0000, 0x3ed53333, 0x3edc6666, 0x3ee3999a,
    0x3eeacccc, 0x3ef20000, 0x3ef93332, 0x3f003333, 0x3f03cccc, 0x3f076666, 0x3f0b0000, 0x3f0e999a,
    0x3f123334, 0x3f15cccd, 0x3f196666, 0x3f1d0000, 0x3f20999a, 0x3f243334, 0x3f27cccd, 0x3f2b6666,
    0x3f2f0000, 0x3f32999a, 0x3f363334, 0x3f39cccd, 0x3f3d6666, 0x3f410000, 0x3f44999a, 0x3f483333,
    0x3f4bcccd, 0x3f4f6666, 0x3f530000, 0x3f56999a, 0x3f5a3333, 0x3f5dcccd, 0x3f616666, 0x3f650000,
    0x3f68999a, 0x3f6c3333, 0x3f6fcccd, 0x3f736666, 0x3f770000, 0x3f7a999a, 0x3f7e3333, 0x3f800000,
};
static const uint32_t bnb8_dynamic_unsigned_bits[256] = {
    0x00000000, 0x34ae7baa, 0x35500998, 0x360e9b38, 0x3692ccf6, 0x36de4c51, 0x3714e5d5, 0x3783126e,
    0x37e171a0, 0x381fe868, 0x384f1800, 0x387e479a, 0x3896bb99, 0x38ae5364, 0x38c5eb31, 0x3906594b,
    0x394154ca, 0x397c5049, 0x399ba5e4, 0x39b923a2, 0x39d6a163, 0x39f41f22, 0x3a08ce71, 0x3a178d50,
    0x3a264c30, 0x3a350b10, 0x3a43c9ef, 0x3a5288d0, 0x3a6147af, 0x3a70068e, 0x3a7ec56e, 0x3a958106,
    0x3aba5e35, 0x3adf3b64, 0x3b020c4a, 0x3b147ae1, 0x3b26e978, 0x3b395810, 0x3b4bc6a7, 0x3b5e3540,
    0x3b70a3d7, 0x3b818937, 0x3b8ac082, 0x3b93f7cf, 0x3b9d2f1a, 0x3ba66666, 0x3baf9db2, 0x3bb8d4fd,
    0x3bc20c4a, 0x3bcb4395, 0x3bd47ae1, 0x3bddb22e, 0x3be6e978, 0x3bf020c5, 0x3bf9580f, 0x3c0147ae,
    0x3c05e354, 0x3c0a7ef9, 0x3c0f1aa0, 0x3c13b645, 0x3c1851eb, 0x3c1ced92, 0x3c218937, 0x3c2f5c2a,
    0x3c466667, 0x3c5d70a3, 0x3c747ae2, 0x3c85c28f, 0x3c9147af, 0x3c9ccccd, 0x3ca851eb, 0x3cb3d70b,
    0x3cbf5c29, 0x3ccae147, 0x3cd66667, 0x3ce1eb87, 0x3ced70a3, 0x3cf8f5c3, 0x3d023d70, 0x3d080000,
    0x3d0dc28f, 0x3d13851f, 0x3d1947af, 0x3d1f0a3d, 0x3d24cccd, 0x3d2a8f5c, 0x3d3051eb, 0x3d36147b,
    0x3d3bd70a, 0x3d41999a, 0x3d475c28, 0x3d4d1eb8, 0x3d52e147, 0x3d58a3d7, 0x3d5e6667, 0x3d6428f7,
    0x3d69eb87, 0x3d6fae15, 0x3d7570a3, 0x3d7b3333, 0x3d807ae2, 0x3d835c2a, 0x3d863d71, 0x3d891eb8,
    0x3d8c0000, 0x3d8ee148, 0x3d91c290, 0x3d94a3d7, 0x3d97851f, 0x3d9a6667, 0x3d9d47af, 0x3da028f6,
    0x3da30a3e, 0x3da5eb85, 0x3da8cccd, 0x3dabae15, 0x3dae8f5c, 0x3db170a4, 0x3db451eb, 0x3db73333,
    0x3dba147b, 0x3dbcf5c3, 0x3dbfd70b, 0x3dc2b852, 0x3dc5999a, 0x3dc87ae2, 0x3dcb5c29, 0x3dd40000,
    0x3de26666, 0x3df0cccd, 0x3dff3333, 0x3e06cccc, 0x3e0e0000, 0x3e153334, 0x3e1c6666, 0x3e23999a,
    0x3e2acccc, 0x3e320000, 0x3e393334, 0x3e406666, 0x3e47999a, 0x3e4ecccc, 0x3e560000, 0x3e5d3334,
    0x3e646666, 0x3e6b999a, 0x3e72cccc, 0x3e7a0000, 0x3e809999, 0x3e843333, 0x3e87cccd, 0x3e8b6666,
    0x3e8f0000, 0x3e92999a, 0x3e963333, 0x3e99cccc, 0x3e9d6666, 0x3ea10000, 0x3ea4999a, 0x3ea83333,
    0x3eabcccc, 0x3eaf6666, 0x3eb30000, 0x3eb6999a, 0x3eba3333, 0x3ebdcccc, 0x3ec16666, 0x3ec50000,
    0x3ec8999a, 0x3ecc3333, 0x3ecfcccc, 0x3ed36666, 0x3ed70000, 0x3eda999a, 0x3ede3333, 0x3ee1cccc,
    0x3ee56666, 0x3ee90000, 0x3eec999a, 0x3ef03333, 0x3ef3cccc, 0x3ef76666, 0x3efb0000, 0x3efe9999,
    0x3f01199a, 0x3f02e666, 0x3f04b333, 0x3f068000, 0x3f084ccc, 0x3f0a199a, 0x3f0be666, 0x3f0db334,
    0x3f0f8000, 0x3f114ccd, 0x3f13199a, 0x3f14e666, 0x3f16b334, 0x3f188000, 0x3f1a4ccd, 0x3f1c199a,
    0x3f1de666, 0x3f1fb334, 0x3f218000, 0x3f234ccd, 0x3f25199a, 0x3f26e666, 0x3f28b334, 0x3f2a8000,
    0x3f2c4ccd, 0x3f2e199a, 0x3f2fe666, 0x3f31b334, 0x3f338000, 0x3f354ccd, 0x3f37199a, 0x3f38e666,
    0x3f3ab334, 0x3f3c8000, 0x3f3e4ccd, 0x3f40199a, 0x3f41e666, 0x3f43b334, 0x3f458000, 0x3f474ccc,
    0x3f49199a, 0x3f4ae666, 0x3f4cb334, 0x3f4e8000, 0x3f504ccc, 0x3f52199a, 0x3f53e666, 0x3f55b334,
    0x3f578000, 0x3f594ccc, 0x3f5b199a, 0x3f5ce666, 0x3f5eb334, 0x3f608000, 0x3f624ccc, 0x3f64199a,
    0x3f65e666, 0x3f67b334, 0x3f698000, 0x3f6b4ccc, 0x3f6d199a, 0x3f6ee666, 0x3f70b334, 0x3f728000,
    0x3f744ccc, 0x3f76199a, 0x3f77e666, 0x3f79b334, 0x3f7b8000, 0x3f7d4ccc, 0x3f7f199a, 0x3f800000,
};

bnb8_status bnb8_map_dynamic(int is_signed, float code[256]) {
    if (!code) return bnb8_fail(BNB8_ERR_NULL, "bnb8_map_dynamic: code is NULL");
    const uint32_t *bits = is_signed ? bnb8_dynamic_signed_bits : bnb8_dynamic_unsigned_bits;
    for (int i = 0; i < 256; i++) code[i] = bnb8_bits_f32(bits[i]);
    return BNB8_OK;
}

bnb8_status bnb8_map_linear(int is_signed, float code[256]) {
    if (!code) return bnb8_fail(BNB8_ERR_NULL, "bnb8_map_linear: code is NULL");
    if (!is_signed) {
        for (int i = 0; i < 256; i++) code[i] = (float)((double)i / 255.0);
        return BNB8_OK;
    }
    // 255 values -1 + 2k/254 (k = 127 is zero), with a second zero after index 127.
    for (int i = 0; i < 256; i++) {
        int k = i <= 127 ? i : i - 1;
        code[i] = (float)(-1.0 + 2.0 * k / 254.0);
    }
    return BNB8_OK;
}

static int bnb8_compare_floats(const void *a, const void *b) {
    float x = *(const float *)a, y = *(const float *)b;
    return (x > y) - (x < y);
}

bnb8_status bnb8_map_quantile(const float *x, int64_t n, float code[256]) {
    if (!x || !code) return bnb8_fail(BNB8_ERR_NULL, "bnb8_map_quantile: x or code is NULL");
    if (n <= 0 || n > BNB8_MAX_ELEMENTS) return bnb8_fail(BNB8_ERR_SIZE, "bnb8_map_quantile: n = %lld", (long long)n);
    float *sorted = (float *)malloc((size_t)n * sizeof(float));
    if (!sorted) return bnb8_fail(BNB8_ERR_NOMEM, "bnb8_map_quantile: %lld floats", (long long)n);
    int64_t m = 0;
    for (int64_t i = 0; i < n; i++)
        if (bnb8_isfinite(x[i])) sorted[m++] = x[i];
    qsort(sorted, (size_t)m, sizeof(float), bnb8_compare_floats);
    // Quantile at probability p: linear interpolation between order statistics at p (m - 1).
    const double offset = 1.0 / 512.0;
    double quantile[255], biggest = 0.0;
    for (int j = 0; j < 255 && m > 0; j++) {
        double p = offset + j * (1.0 - 2.0 * offset) / 254.0, pos = p * (double)(m - 1);
        int64_t lo = (int64_t)pos, hi = lo + 1 < m ? lo + 1 : lo;
        double frac = pos - (double)lo;
        quantile[j] = (1.0 - frac) * sorted[lo] + frac * sorted[hi];
        biggest = fmax(biggest, fabs(quantile[j]));
    }
    if (biggest == 0.0) {
        free(sorted);
        return bnb8_fail(BNB8_ERR_ARG, "bnb8_map_quantile: no finite non-zero quantile in the sample");
    }
    // Normalized by the largest quantile magnitude, so the map spans [-1, 1] as bitsandbytes' does.
    for (int j = 0; j < 255; j++) code[j] = (float)(quantile[j] / biggest);
    free(sorted);
    code[255] = 0.0f;
    qsort(code, 256, sizeof(float), bnb8_compare_floats);
    return BNB8_OK;
}

// ------------------------------------------------------------------------------------------------
// Block-wise quantization

// An element count of an array function: 0..BNB8_MAX_ELEMENTS.
static bnb8_status bnb8_check_count(const char *fn, int64_t n) {
    if (n < 0 || n > BNB8_MAX_ELEMENTS) return bnb8_fail(BNB8_ERR_SIZE, "%s: n = %lld not in 0..2^52", fn, (long long)n);
    return BNB8_OK;
}

static bnb8_status bnb8_check_blockwise(const char *fn, const void *a, const void *b, const void *c,
                                        const void *d, int64_t n, int64_t blocksize, bnb8_dtype dtype) {
    if (bnb8_check_count(fn, n)) return BNB8_ERR_SIZE;
    if (n > 0 && (!a || !b || !c || !d)) return bnb8_fail(BNB8_ERR_NULL, "%s: NULL array", fn);
    bnb8_status status = bnb8_check_blocksize(fn, blocksize);
    return status ? status : bnb8_check_dtype(fn, dtype);
}

bnb8_status bnb8_quantize_blockwise_ex(const void *x, bnb8_dtype dtype, int64_t n, const float *code,
                                       int64_t blocksize, uint8_t *q, float *absmax, int64_t *nonfinite) {
    bnb8_status status = bnb8_check_blockwise("bnb8_quantize_blockwise", x, code, q, absmax, n, blocksize, dtype);
    if (status) return status;
    if (n == 0) { if (nonfinite) *nonfinite = 0; return BNB8_OK; }
    bnb8_codebook *cb = (bnb8_codebook *)malloc(sizeof *cb);
    if (!cb) return bnb8_fail(BNB8_ERR_NOMEM, "bnb8_quantize_blockwise: codebook");
    bnb8_codebook_init(cb, code, 0);
    int zero_code = bnb8_nearest_code(cb->t, 0.0f);
    int64_t nblocks = (n + blocksize - 1) / blocksize, bad = 0;
    #pragma omp parallel for schedule(static) reduction(+:bad)
    for (int64_t b = 0; b < nblocks; b++) {
        int64_t start = b * blocksize, end = start + blocksize < n ? start + blocksize : n;
        float amax = 0.0f;
        for (int64_t i = start; i < end; i++) {
            float v = bnb8_load(x, dtype, i);
            if (bnb8_isfinite(v)) amax = fmaxf(amax, fabsf(v));
            else bad++;
        }
        absmax[b] = amax;
        float r = bnb8_reciprocal(amax);
        for (int64_t i = start; i < end; i++) {
            // A zero block (r is NaN) and a non-finite v are redone too.
            float v = bnb8_load(x, dtype, i);
            int redo = cb->search, c = bnb8_code_near(cb, v * r, &redo);
            q[i] = (uint8_t)(redo ? bnb8_quantize_code(cb, zero_code, v, amax) : c);
        }
    }
    free(cb);
    if (nonfinite) *nonfinite = bad;
    return BNB8_OK;
}

bnb8_status bnb8_quantize_blockwise(const void *x, bnb8_dtype dtype, int64_t n, const float *code,
                                    int64_t blocksize, uint8_t *q, float *absmax) {
    return bnb8_quantize_blockwise_ex(x, dtype, n, code, blocksize, q, absmax, NULL);
}

bnb8_status bnb8_dequantize_blockwise(const uint8_t *q, const float *absmax, int64_t n, const float *code,
                                      int64_t blocksize, void *out, bnb8_dtype dtype) {
    bnb8_status status = bnb8_check_blockwise("bnb8_dequantize_blockwise", q, absmax, code, out, n, blocksize, dtype);
    if (status) return status;
    #pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < n; i++) bnb8_store(out, dtype, i, code[q[i]] * absmax[i / blocksize]);
    return BNB8_OK;
}

bnb8_status bnb8_nest_absmax(const float *absmax, int64_t nblocks, int64_t blocksize, uint8_t *q2,
                             float *absmax2, float *mean) {
    if (nblocks < 0 || nblocks > BNB8_MAX_ELEMENTS)
        return bnb8_fail(BNB8_ERR_SIZE, "bnb8_nest_absmax: nblocks = %lld not in 0..2^52", (long long)nblocks);
    if (!absmax || !q2 || !absmax2 || !mean) return bnb8_fail(BNB8_ERR_NULL, "bnb8_nest_absmax: NULL argument");
    bnb8_status status = bnb8_check_blocksize("bnb8_nest_absmax", blocksize);
    if (status) return status;
    double sum = 0.0;
    for (int64_t i = 0; i < nblocks; i++) sum += absmax[i];
    *mean = nblocks > 0 ? (float)(sum / (double)nblocks) : 0.0f;
    float *centered = (float *)malloc((size_t)(nblocks > 0 ? nblocks : 1) * sizeof(float));
    if (!centered) return bnb8_fail(BNB8_ERR_NOMEM, "bnb8_nest_absmax: %lld floats", (long long)nblocks);
    for (int64_t i = 0; i < nblocks; i++) centered[i] = absmax[i] - *mean;
    float code[256];
    bnb8_map_dynamic(1, code);
    status = bnb8_quantize_blockwise(centered, BNB8_F32, nblocks, code, blocksize, q2, absmax2);
    free(centered);
    return status;
}

bnb8_status bnb8_unnest_absmax(const uint8_t *q2, const float *absmax2, float mean, int64_t nblocks,
                               int64_t blocksize, float *absmax) {
    float code[256];
    bnb8_map_dynamic(1, code);
    bnb8_status status = bnb8_dequantize_blockwise(q2, absmax2, nblocks, code, blocksize, absmax, BNB8_F32);
    if (status) return status;
    for (int64_t i = 0; i < nblocks; i++) absmax[i] += mean;
    return BNB8_OK;
}

// ------------------------------------------------------------------------------------------------
// Master weight correction and companded states as arrays (DESIGN.md §6.1, §6.2): the per-element
// functions of bnb8.h over whole arrays

static bnb8_status bnb8_check_ecc(const char *fn, const void *a, const void *b, int64_t n, bnb8_dtype narrow,
                                  const void *corr, int corr_bytes) {
    if (bnb8_check_count(fn, n)) return BNB8_ERR_SIZE;
    if (n > 0 && (!a || !b)) return bnb8_fail(BNB8_ERR_NULL, "%s: NULL array", fn);
    if (narrow != BNB8_BF16 && narrow != BNB8_F16)
        return bnb8_fail(BNB8_ERR_DTYPE, "%s: narrow dtype %d is not bf16 or f16", fn, (int)narrow);
    if (corr && corr_bytes != 1 && corr_bytes != 2 && corr_bytes != 4)
        return bnb8_fail(BNB8_ERR_ARG, "%s: corr_bytes %d is not 1 (int8), 2 (int16) or 4 (fp32 master)", fn, corr_bytes);
    return BNB8_OK;
}

bnb8_status bnb8_ecc_encode(const float *x, int64_t n, void *narrow, bnb8_dtype narrow_dtype, void *corr, int corr_bytes) {
    bnb8_status status = bnb8_check_ecc("bnb8_ecc_encode", x, narrow, n, narrow_dtype, corr, corr_bytes);
    if (status) return status;
    int bytes = corr ? corr_bytes : 0;
    #pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < n; i++) bnb8_master_store(narrow, narrow_dtype, corr, bytes, i, x[i]);
    return BNB8_OK;
}

bnb8_status bnb8_ecc_decode(const void *narrow, bnb8_dtype narrow_dtype, const void *corr, int corr_bytes, int64_t n, float *out) {
    bnb8_status status = bnb8_check_ecc("bnb8_ecc_decode", narrow, out, n, narrow_dtype, corr, corr_bytes);
    if (status) return status;
    int bytes = corr ? corr_bytes : 0;
    #pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < n; i++) out[i] = bnb8_master_load(narrow, narrow_dtype, corr, bytes, i);
    return BNB8_OK;
}

static bnb8_status bnb8_check_compand(const char *fn, const void *a, const void *b, const void *c, int64_t n, bnb8_dtype dt) {
    if (bnb8_check_count(fn, n)) return BNB8_ERR_SIZE;
    if (n > 0 && (!a || !b || !c)) return bnb8_fail(BNB8_ERR_NULL, "%s: NULL array", fn);
    return bnb8_check_scale_dtype(fn, dt);
}

// Group g of count (<= 32) values x: its scale, the group absmax of the values' magnitudes rounded
// in scale_dtype, into scales[g], and their codes, a byte each (DESIGN.md §6.2): 8-bit ones, or with
// four the 4-bit ones of flash4 (§5.7). The array function and the CPU flash steps.
static void bnb8_compand_group(const float *x, int64_t count, int is_signed, int four, bnb8_dtype scale_dtype,
                               void *scales, int64_t g, uint8_t *codes) {
    float m[BNB8_FLASH_GROUP], amax = 0.0f;
    for (int64_t i = 0; i < count; i++) {
        m[i] = bnb8_compand_magnitude(x[i], is_signed);
        amax = fmaxf(amax, m[i]);
    }
    float scale = bnb8_scale_round(amax, scale_dtype);
    bnb8_scale_store(scales, scale_dtype, g, scale);
    for (int64_t i = 0; i < count; i++)
        codes[i] = four ? (uint8_t)bnb8_compand4_code(x[i], m[i], scale, is_signed) : bnb8_compand_code(x[i], m[i], scale, is_signed);
}

bnb8_status bnb8_compand(const float *x, int64_t n, int is_signed, bnb8_dtype scale_dtype, uint8_t *codes, void *scales) {
    bnb8_status status = bnb8_check_compand("bnb8_compand", x, codes, scales, n, scale_dtype);
    if (status) return status;
    int64_t ngroups = (n + BNB8_FLASH_GROUP - 1) / BNB8_FLASH_GROUP;
    is_signed = is_signed != 0;
    #pragma omp parallel for schedule(static)
    for (int64_t g = 0; g < ngroups; g++) {
        int64_t start = g * BNB8_FLASH_GROUP, end = start + BNB8_FLASH_GROUP < n ? start + BNB8_FLASH_GROUP : n;
        bnb8_compand_group(x + start, end - start, is_signed, 0, scale_dtype, scales, g, codes + start);
    }
    return BNB8_OK;
}

bnb8_status bnb8_expand(const uint8_t *codes, const void *scales, int64_t n, int is_signed, bnb8_dtype scale_dtype, float *out) {
    bnb8_status status = bnb8_check_compand("bnb8_expand", codes, scales, out, n, scale_dtype);
    if (status) return status;
    is_signed = is_signed != 0;
    #pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < n; i++)
        out[i] = bnb8_expand_value(codes[i], bnb8_scale_load(scales, scale_dtype, i / BNB8_FLASH_GROUP), is_signed);
    return BNB8_OK;
}

// ------------------------------------------------------------------------------------------------
// Optimizers

typedef struct { char *name; bnb8_config cfg; } bnb8_override;

typedef struct {
    char *name;
    void *param, *grad;
    bnb8_dtype param_dtype, grad_dtype;
    int64_t n;
    int64_t offset, total;      // elements [offset, offset + n) of a tensor of total (whole: 0, n)
    int on_gpu;
    bnb8_config cfg;            // the base configuration or this tensor's override
    bnb8_state_format format;   // 8-bit, flash or 4-bit only from cfg.min_8bit_size elements on
    int64_t block;              // elements per absmax of 8-bit and 4-bit states: cfg.blocksize, or n for blocksize 0
    int64_t rows, row_size;     // 4-bit states of a matrix (cfg.row_size): its non-negative state is rank-1; else 0
    int rank1_k;                // that state (bnb8_rank1_state), when row_size > 0
    int nstates;
    int64_t step;
    void *state[3];             // (n) floats, (n) codes, or (ceil(n / 2)) bytes of 4-bit codes, per state
    float *absmax[3];           // (ceil(n / block)) per 8-bit or 4-bit state; a rank-1 state (rows + row_size)
    const float *code[3];       // 8-bit, 4-bit: each state's map (the optimizer's code or four[map][is_signed])
    void *scale[3];             // (ceil(n / 32)) of scale_dtype per flash or flash4 state
    bnb8_dtype scale_dtype;
    int correction_bytes;       // bf16/fp16 weights: cfg's 1, 2 or 4; fp32 weights: 0
    int stochastic;             // bf16/fp16 weights rounded stochastically (no correction: 0 bytes)
    uint64_t seed, identity;    // then its seed (cfg's, or a loaded file's) and FNV-1a of its name
    bnb8_rounding rounding;     // this step's (bnb8_rounding_of)
    void *correction;           // (n) int8, int16 or fp32 (the master)
    float *gnorm_history;       // (100) squared gradient norms, for percentile clipping
    double sum_squares;         // CPU tensors, cfg.sum_squares: the sum of g^2 of the latest step
    void *memory;               // the one allocation all of the above live in
    size_t memory_bytes;
    float *rank1_work;          // CPU rank-1 tensors: the step's new maxima and each thread's, not state
    int64_t rank1_work_floats;
} bnb8_tensor;

struct bnb8_optimizer {
    bnb8_optim kind;
    bnb8_config cfg;
    bnb8_override *overrides;   // (num_overrides) name -> configuration, for tensors not added yet
    int num_overrides;
    bnb8_tensor *tensors;       // (num_tensors) in the order of bnb8_optimizer_add; ids index it
    int num_tensors, tensors_capacity;
    int64_t nonfinite;          // non-finite gradient elements since the last take
    void *gpu_context;          // bnb8_cuda.cu's device scratch, made on the first GPU step
    double *gpu_sums;           // (gpu_sums_count) device: cfg.sum_squares of GPU tensors, by id
    int gpu_sums_count;
    float code[BNB8_NUM_MAPS][2][256];          // [map][is_signed]: the maps of 8-bit states
    bnb8_codebook books[BNB8_NUM_MAPS][2];      // their thresholds and lookup tables
    float four[BNB8_NUM_MAPS][2][BNB8_FOUR_CODES];     // [map][is_signed]: the maps of 4-bit states
    bnb8_four_book four_book[BNB8_NUM_MAPS][2];          // their thresholds and lookups
};

// The GPU path lives in bnb8_cuda.cu. Built with -DBNB8_CUDA, bnb8.c needs it; without, weak
// references let a CPU-only program link alone (they are NULL then, and every pointer is taken for
// host memory: passing a GPU tensor is the caller's error) and still use the GPU when bnb8_cuda.o
// is linked beside it.
#ifndef BNB8_CUDA
#pragma weak bnb8_cuda_is_device_pointer
#pragma weak bnb8_cuda_alloc_zeroed
#pragma weak bnb8_cuda_free
#pragma weak bnb8_cuda_copy
#pragma weak bnb8_cuda_masters
#pragma weak bnb8_cuda_step
#pragma weak bnb8_cuda_take_nonfinite
#pragma weak bnb8_cuda_context_free
#define bnb8_cuda_linked() (bnb8_cuda_step != NULL)
#else
#define bnb8_cuda_linked() 1
#endif

bnb8_config bnb8_config_default(bnb8_optim kind) {
    bnb8_config c = {0};
    c.lr = 1e-3f; c.beta1 = 0.9f; c.beta2 = 0.999f; c.beta3 = 0.9999f; c.eps = 1e-8f;
    c.alpha = 0.99f; c.percentile_clipping = 100; c.format = BNB8_STATE_8BIT;
    c.blocksize = 256; c.min_8bit_size = 4096;
    c.correction_bytes = BNB8_CORRECTION_AUTO; c.scale_dtype = BNB8_E6M10;
    switch (kind) {
    case BNB8_ADAMW: c.weight_decay = 1e-2f; break;
    case BNB8_LAMB: c.max_unorm = 1.0f; break;
    case BNB8_SGD: c.lr = 1e-2f; c.momentum = 0.9f; break;
    case BNB8_LARS: c.lr = 1e-2f; c.momentum = 0.9f; c.max_unorm = 0.02f; break;
    case BNB8_LION: c.lr = 1e-4f; c.beta2 = 0.99f; break;
    case BNB8_RMSPROP: c.lr = 1e-2f; break;
    case BNB8_ADAGRAD: c.lr = 1e-2f; c.eps = 1e-10f; break;
    case BNB8_ADEMAMIX: c.weight_decay = 1e-2f; c.alpha = 5.0f; break;
    default: break;
    }
    return c;
}

// The optimizers with a flash form (DESIGN.md §5.1).
static int bnb8_flash_kind(bnb8_optim kind) {
    return kind == BNB8_ADAMW || kind == BNB8_ADAM || kind == BNB8_SGD || kind == BNB8_LION;
}
// The formats of 4-bit codes, two per byte (DESIGN.md §5.7), and the companded ones (a scale per 32).
static int bnb8_four_format(int format) { return format == BNB8_STATE_4BIT || format == BNB8_STATE_FLASH4; }
static int bnb8_companded_format(int format) { return format == BNB8_STATE_FLASH || format == BNB8_STATE_FLASH4; }
// The state of an optimizer kind that rank-1 normalization applies to: its non-negative one (the Adam
// family's v, RMSprop's and Adagrad's accumulators, AdEMAMix's v), or -1 when it has none.
static int bnb8_rank1_state(bnb8_optim kind) {
    for (int k = 0; k < bnb8_state_count(kind, 1.0f); k++) if (!bnb8_state_signed(kind, k)) return k;
    return -1;
}

// Where an update divides (DESIGN.md §5.3): by the bias corrections 1 - beta1^t and 1 - beta2^t
// (the Adam family and AdEMAMix: betas below 1), and by sqrt(v) + eps where v may be 0 (eps > 0).
static int bnb8_bias_corrected(bnb8_optim kind) {
    return kind == BNB8_ADAMW || kind == BNB8_ADAM || kind == BNB8_LAMB || kind == BNB8_ADEMAMIX;
}
static int bnb8_divides_by_eps(bnb8_optim kind) {
    return bnb8_bias_corrected(kind) || kind == BNB8_RMSPROP || kind == BNB8_ADAGRAD;
}

// Weight decay: wd >= 0 (PyTorch's rule) and lr wd < 1 at the tensor's learning rate: at 1 or more
// the decay factor 1 - lr wd (AdamW, Lion, LAMB, AdEMAMix), and SGD's L2 step alike, zeroes the
// weights or flips their sign every step.
static bnb8_status bnb8_check_decay(const char *fn, const char *name, double lr, float wd) {
    if (!bnb8_isfinite(wd) || !(wd >= 0.0f))
        return bnb8_fail(BNB8_ERR_ARG, "%s: %s%sweight_decay %g must be finite and >= 0", fn, name, name[0] ? ": " : "", (double)wd);
    if (lr * wd >= 1.0)
        return bnb8_fail(BNB8_ERR_ARG, "%s: %s%slr %g x weight_decay %g = %g must be below 1 (the decay factor 1 - lr wd "
                         "would zero or flip the weights)", fn, name, name[0] ? ": " : "", lr, (double)wd, lr * wd);
    return BNB8_OK;
}

// What no optimizer of kind can use is refused with a message naming the field (doc/guarantees.md,
// "The library").
static bnb8_status bnb8_check_config(const char *fn, bnb8_optim kind, const bnb8_config *c) {
    const char *names[] = {"beta1", "beta2", "beta3", "momentum", "dampening"};
    const float in01[] = {c->beta1, c->beta2, c->beta3, c->momentum, c->dampening};
    for (int i = 0; i < 5; i++) {
        int below_one = i < 2 && bnb8_bias_corrected(kind);   // 1 - beta^t would be 0
        if (!(in01[i] >= 0.0f && (in01[i] < 1.0f || (in01[i] == 1.0f && !below_one))))
            return bnb8_fail(BNB8_ERR_ARG, "%s: %s = %g must be in [0, 1%s", fn, names[i], (double)in01[i],
                             below_one ? ") (the bias correction divides by 1 - beta^t)" : "]");
    }
    if (!bnb8_isfinite(c->lr) || !(c->lr >= 0.0f))
        return bnb8_fail(BNB8_ERR_ARG, "%s: lr = %g must be finite and >= 0", fn, (double)c->lr);
    if (!bnb8_isfinite(c->eps) || !(c->eps > 0.0f || (c->eps == 0.0f && !bnb8_divides_by_eps(kind))))
        return bnb8_fail(BNB8_ERR_ARG, "%s: eps = %g must be finite and %s", fn, (double)c->eps,
                         bnb8_divides_by_eps(kind) ? "> 0 (the update divides by sqrt(v) + eps, and v may be 0)" : ">= 0");
    if (!bnb8_isfinite(c->alpha) || (kind == BNB8_RMSPROP && !(c->alpha >= 0.0f && c->alpha <= 1.0f)))
        return bnb8_fail(BNB8_ERR_ARG, "%s: alpha = %g must be finite%s", fn, (double)c->alpha,
                         kind == BNB8_RMSPROP ? " and in [0, 1] (RMSprop's smoothing)" : "");
    if (!bnb8_isfinite(c->max_unorm) || !(c->max_unorm >= 0.0f))
        return bnb8_fail(BNB8_ERR_ARG, "%s: max_unorm = %g must be finite and >= 0", fn, (double)c->max_unorm);
    bnb8_status status = bnb8_check_decay(fn, "", (double)c->lr, c->weight_decay);
    if (status) return status;
    if (c->percentile_clipping < 1 || c->percentile_clipping > 100)
        return bnb8_fail(BNB8_ERR_ARG, "%s: percentile_clipping %d not in 1..100", fn, c->percentile_clipping);
    if (c->sum_squares != 0 && c->sum_squares != 1)
        return bnb8_fail(BNB8_ERR_ARG, "%s: sum_squares %d is not 0 or 1", fn, c->sum_squares);
    if ((int)c->format < BNB8_STATE_32BIT || c->format > BNB8_STATE_FLASH4)
        return bnb8_fail(BNB8_ERR_ARG, "%s: unknown state format %d", fn, (int)c->format);
    if (bnb8_companded_format(c->format) && !bnb8_flash_kind(kind))
        return bnb8_fail(BNB8_ERR_ARG, "%s: the %s state format exists for AdamW, Adam, SGD and Lion only, "
                         "not optimizer kind %d", fn, c->format == BNB8_STATE_FLASH ? "flash" : "flash4", (int)kind);
    int cb = c->correction_bytes;
    if (cb != BNB8_CORRECTION_AUTO && cb != BNB8_CORRECTION_STOCHASTIC && cb != 0 && cb != 1 && cb != 2 && cb != 4)
        return bnb8_fail(BNB8_ERR_ARG, "%s: correction_bytes %d not BNB8_CORRECTION_AUTO (-1), BNB8_CORRECTION_STOCHASTIC "
                         "(-2), 0 (none), 1 (int8), 2 (int16) or 4 (fp32 master)", fn, cb);
    if (bnb8_check_scale_dtype(fn, c->scale_dtype)) return BNB8_ERR_DTYPE;
    if (c->t_alpha < 0 || c->t_beta3 < 0 || c->min_8bit_size < 0 || c->stacked < 0)
        return bnb8_fail(BNB8_ERR_ARG, "%s: t_alpha, t_beta3, min_8bit_size and stacked must be >= 0", fn);
    if (c->shard_total < 0 || c->shard_total > BNB8_MAX_ELEMENTS || c->shard_offset < 0 ||
        (c->shard_total == 0 ? c->shard_offset != 0 : c->shard_offset >= c->shard_total))
        return bnb8_fail(BNB8_ERR_ARG, "%s: shard_offset %lld, shard_total %lld: a shard starts in 0..shard_total - 1 "
                         "(shard_total 0..2^52; 0 with offset 0: a whole tensor)", fn, (long long)c->shard_offset,
                         (long long)c->shard_total);
    if ((int)c->map < 0 || c->map >= BNB8_NUM_MAPS)
        return bnb8_fail(BNB8_ERR_ARG, "%s: unknown map %d (0 dynamic, 1 linear)", fn, (int)c->map);
    if (c->blocksize != 0 && !bnb8_blocksize_ok(c->blocksize))
        return bnb8_fail(BNB8_ERR_BLOCKSIZE, "%s: blocksize %lld is neither a power of two in 64..4096 nor 0 (one "
                         "absmax per tensor)", fn, (long long)c->blocksize);
    // Flash and 4-bit states have their own codes, flash ones a scale per group of 32: asking them for
    // a map (but 4-bit v's map with zero, BNB8_MAP_LINEAR) or for one absmax per tensor is a mistake,
    // not a no-op.
    const char *own = c->format == BNB8_STATE_FLASH ? "flash states have companded codes"
                    : c->format == BNB8_STATE_FLASH4 ? "flash4 states have companded codes"
                    : c->format == BNB8_STATE_4BIT ? "4-bit states have their own 16-value maps" : NULL;
    if (own && c->map != BNB8_MAP_DYNAMIC && c->format != BNB8_STATE_4BIT)
        return bnb8_fail(BNB8_ERR_ARG, "%s: map %d is for the 8-bit format; %s", fn, (int)c->map, own);
    if (own && c->blocksize == 0)
        return bnb8_fail(BNB8_ERR_ARG, "%s: blocksize 0 (one absmax per tensor) is for the 8-bit format; %s%s", fn, own,
                         c->format == BNB8_STATE_4BIT ? " and blocks (the paper's: 128)" : " and a scale per group of 32");
    // Rank-1 normalization is of the 4-bit format's non-negative state (DESIGN.md §5.7).
    if (c->row_size < 0 || c->row_size >= (INT64_C(1) << 47))   // a state file keeps it in 47 bits (DESIGN.md §7)
        return bnb8_fail(BNB8_ERR_ARG, "%s: row_size %lld not in 0..2^47 - 1", fn, (long long)c->row_size);
    if (c->row_size > 0 && c->format != BNB8_STATE_4BIT)
        return bnb8_fail(BNB8_ERR_ARG, "%s: row_size %lld (rank-1 normalization) is for the 4-bit format "
                         "(BNB8_STATE_4BIT), not format %d", fn, (long long)c->row_size, (int)c->format);
    if (c->row_size > 0 && bnb8_rank1_state(kind) < 0)
        return bnb8_fail(BNB8_ERR_ARG, "%s: row_size %lld: rank-1 normalization is of a non-negative state (Adam's v); "
                         "optimizer kind %d has none", fn, (long long)c->row_size, (int)kind);
    return BNB8_OK;
}

bnb8_status bnb8_optimizer_create(bnb8_optimizer **opt, bnb8_optim kind, const bnb8_config *cfg) {
    if (!opt) return bnb8_fail(BNB8_ERR_NULL, "bnb8_optimizer_create: opt is NULL");
    *opt = NULL;
    if ((int)kind < 0 || kind >= BNB8_NUM_OPTIMIZERS)
        return bnb8_fail(BNB8_ERR_ARG, "bnb8_optimizer_create: unknown optimizer %d", (int)kind);
    bnb8_config c = cfg ? *cfg : bnb8_config_default(kind);
    bnb8_status status = bnb8_check_config("bnb8_optimizer_create", kind, &c);
    if (status) return status;
    bnb8_optimizer *o = (bnb8_optimizer *)calloc(1, sizeof *o);
    if (!o) return bnb8_fail(BNB8_ERR_NOMEM, "bnb8_optimizer_create");
    o->kind = kind;
    o->cfg = c;
    for (int is_signed = 0; is_signed < 2; is_signed++) {
        bnb8_map_dynamic(is_signed, o->code[BNB8_MAP_DYNAMIC][is_signed]);
        bnb8_map_linear(is_signed, o->code[BNB8_MAP_LINEAR][is_signed]);
        for (int map = 0; map < BNB8_NUM_MAPS; map++) bnb8_codebook_init(&o->books[map][is_signed], o->code[map][is_signed], bnb8_zero_code(is_signed));
        for (int map = 0; map < BNB8_NUM_MAPS; map++) {
            for (int c = 0; c < BNB8_FOUR_CODES; c++) o->four[map][is_signed][c] = bnb8_four_map(map, is_signed, c);
            bnb8_four_book_init(&o->four_book[map][is_signed], o->four[map][is_signed]);
        }
    }
    *opt = o;
    return BNB8_OK;
}

void bnb8_optimizer_free(bnb8_optimizer *opt) {
    if (!opt) return;
    for (int i = 0; i < opt->num_tensors; i++) {
        free(opt->tensors[i].name);
        free(opt->tensors[i].rank1_work);
        if (opt->tensors[i].on_gpu) bnb8_cuda_free(opt->tensors[i].memory);
        else free(opt->tensors[i].memory);
    }
    free(opt->tensors);
    for (int i = 0; i < opt->num_overrides; i++) free(opt->overrides[i].name);
    free(opt->overrides);
    if (opt->gpu_context) bnb8_cuda_context_free(opt->gpu_context);
    if (opt->gpu_sums) bnb8_cuda_free(opt->gpu_sums);
    free(opt);
}

static bnb8_override *bnb8_find_override(bnb8_optimizer *opt, const char *name) {
    for (int i = 0; i < opt->num_overrides; i++)
        if (strcmp(opt->overrides[i].name, name) == 0) return &opt->overrides[i];
    return NULL;
}

// The fields that lay out a tensor's states, fixed once it is added: the first of them in which a
// differs from b, or NULL when none does.
static const char *bnb8_layout_difference(const bnb8_config *a, const bnb8_config *b) {
    if (a->format != b->format) return "format";
    if (a->blocksize != b->blocksize) return "blocksize";
    if (a->map != b->map) return "map";
    if (a->row_size != b->row_size) return "row_size";
    if (a->min_8bit_size != b->min_8bit_size) return "min_8bit_size";
    if (a->stacked != b->stacked) return "stacked";
    if (a->correction_bytes != b->correction_bytes) return "correction_bytes";
    if (a->scale_dtype != b->scale_dtype) return "scale_dtype";
    if (a->percentile_clipping != b->percentile_clipping) return "percentile_clipping";
    if (a->sum_squares != b->sum_squares) return "sum_squares";
    if (a->shard_offset != b->shard_offset || a->shard_total != b->shard_total) return "shard_offset / shard_total";
    if (a->seed != b->seed) return "seed";
    return NULL;
}

// The fields a trainer may change from step to step (bnb8_optimizer_override after the add).
static void bnb8_copy_hyperparameters(bnb8_config *to, const bnb8_config *from) {
    to->lr = from->lr; to->beta1 = from->beta1; to->beta2 = from->beta2; to->beta3 = from->beta3;
    to->eps = from->eps; to->weight_decay = from->weight_decay; to->momentum = from->momentum;
    to->dampening = from->dampening; to->nesterov = from->nesterov; to->alpha = from->alpha;
    to->t_alpha = from->t_alpha; to->t_beta3 = from->t_beta3; to->max_unorm = from->max_unorm;
    to->gnorm_scale_at = from->gnorm_scale_at;
}

// Whether an added tensor can take from's hyperparameters: SGD's momentum may not come or go (it
// is a state), a part of a tensor has no trust ratio, and the gnorm_scale_at float lives where the
// tensor does.
static bnb8_status bnb8_check_hyperparameters(const char *fn, const bnb8_optimizer *opt, const bnb8_tensor *t,
                                              const bnb8_config *from) {
    if (bnb8_state_count(opt->kind, from->momentum) != t->nstates)
        return bnb8_fail(BNB8_ERR_ARG, "%s: '%s': momentum %g would %s a state the tensor was added %s", fn, t->name,
                         (double)from->momentum, t->nstates ? "drop" : "need", t->nstates ? "with" : "without");
    if (from->max_unorm > 0.0f && t->n < t->total)
        return bnb8_fail(BNB8_ERR_ARG, "%s: '%s' is a part of a tensor: a trust ratio (max_unorm > 0) needs the whole", fn, t->name);
    if (from->gnorm_scale_at && (bnb8_cuda_linked() && bnb8_cuda_is_device_pointer(from->gnorm_scale_at)) != t->on_gpu)
        return bnb8_fail(BNB8_ERR_DEVICE, "%s: '%s' is %s memory, cfg.gnorm_scale_at is not", fn, t->name, t->on_gpu ? "GPU" : "host");
    return BNB8_OK;
}

// Every tensor's hyperparameters, and those of tensors added later: cfg's layout is the optimizer's,
// and every tensor is checked before any changes.
static bnb8_status bnb8_override_all(bnb8_optimizer *opt, const bnb8_config *cfg) {
    const char *field = bnb8_layout_difference(&opt->cfg, cfg);
    if (field)
        return bnb8_fail(BNB8_ERR_ARG, "bnb8_optimizer_override: cfg's %s is not the optimizer's (every tensor's "
                         "hyperparameters: pass the configuration it was created with, changed there)", field);
    for (int i = 0; i < opt->num_tensors; i++) {
        bnb8_status status = bnb8_check_hyperparameters("bnb8_optimizer_override", opt, &opt->tensors[i], cfg);
        if (status) return status;
    }
    for (int i = 0; i < opt->num_tensors; i++) bnb8_copy_hyperparameters(&opt->tensors[i].cfg, cfg);
    for (int i = 0; i < opt->num_overrides; i++) bnb8_copy_hyperparameters(&opt->overrides[i].cfg, cfg);
    bnb8_copy_hyperparameters(&opt->cfg, cfg);
    return BNB8_OK;
}

bnb8_status bnb8_optimizer_override(bnb8_optimizer *opt, const char *name, const bnb8_config *cfg) {
    const char *fn = "bnb8_optimizer_override";
    if (!opt || !cfg) return bnb8_fail(BNB8_ERR_NULL, "%s: opt or cfg is NULL", fn);
    if (name && !name[0]) return bnb8_fail(BNB8_ERR_ARG, "%s: an empty name", fn);
    bnb8_status status = bnb8_check_config(fn, opt->kind, cfg);
    if (status) return status;
    if (!name) return bnb8_override_all(opt, cfg);
    for (int i = 0; i < opt->num_tensors; i++) {
        bnb8_tensor *t = &opt->tensors[i];
        if (strcmp(t->name, name) != 0) continue;
        const char *field = bnb8_layout_difference(&t->cfg, cfg);
        if (field)
            return bnb8_fail(BNB8_ERR_ARG, "%s: '%s' is already added: its %s lays out its states and cannot change "
                             "(override it before bnb8_optimizer_add)", fn, name, field);
        if ((status = bnb8_check_hyperparameters(fn, opt, t, cfg))) return status;
        bnb8_copy_hyperparameters(&t->cfg, cfg);
        return BNB8_OK;
    }
    bnb8_override *o = bnb8_find_override(opt, name);
    if (o) {   // a second override of a name replaces the first
        o->cfg = *cfg;
        return BNB8_OK;
    }
    char *copy = (char *)malloc(strlen(name) + 1);
    o = (bnb8_override *)realloc(opt->overrides, (opt->num_overrides + 1) * sizeof *o);
    if (!copy || !o) {
        free(copy);
        return bnb8_fail(BNB8_ERR_NOMEM, "bnb8_optimizer_override");
    }
    opt->overrides = o;
    opt->overrides[opt->num_overrides++] = (bnb8_override){strcpy(copy, name), *cfg};
    return BNB8_OK;
}

static int64_t bnb8_block_count(int64_t n, int64_t blocksize) { return (n + blocksize - 1) / blocksize; }

// A tensor's identity for stochastic rounding (DESIGN.md §6.6): FNV-1a, 64 bits, of its name, the
// same in every process and on every rank that holds a shard of it.
static uint64_t bnb8_name_identity(const char *name) {
    uint64_t h = 0xcbf29ce484222325ull;
    for (const unsigned char *c = (const unsigned char *)name; *c; c++) h = (h ^ *c) * 0x100000001b3ull;
    return h;
}

// Whether state k of tensor t is rank-1 normalized (4-bit states of a matrix, its non-negative state).
static int bnb8_rank1(const bnb8_tensor *t, int k) { return t->row_size > 0 && k == t->rank1_k; }
// Bytes of one state's codes: a byte per element, or two 4-bit codes per byte.
static size_t bnb8_code_bytes(const bnb8_tensor *t) { return bnb8_four_format(t->format) ? (size_t)(t->n + 1) / 2 : (size_t)t->n; }
// Floats of state k's absmax: one per block, or a rank-1 state's row and column maxima.
static int64_t bnb8_absmax_count(const bnb8_tensor *t, int k) {
    return bnb8_rank1(t, k) ? t->rows + t->row_size : bnb8_block_count(t->n, t->block);
}

// Bytes of one tensor's states: per state n floats, or its codes plus an absmax per block (8-bit,
// 4-bit; a rank-1 state's row and column maxima) or a scale per group of 32 (flash, flash4); plus
// the weights' correction (n int8, int16 or fp32).
static size_t bnb8_state_bytes(const bnb8_tensor *t) {
    size_t states = 0, groups = (size_t)bnb8_block_count(t->n, BNB8_FLASH_GROUP);
    for (int k = 0; k < t->nstates; k++)
        states += t->format == BNB8_STATE_32BIT ? sizeof(float) * (size_t)t->n
                : bnb8_companded_format(t->format) ? bnb8_code_bytes(t) + bnb8_dtype_size(t->scale_dtype) * groups
                : bnb8_code_bytes(t) + sizeof(float) * (size_t)bnb8_absmax_count(t, k);
    size_t history = t->cfg.percentile_clipping < 100 ? 100 * sizeof(float) : 0;
    return states + history + (size_t)t->correction_bytes * (size_t)t->n;
}

// Points a tensor's state arrays into its one allocation, widest elements first so that each is
// aligned: history, an fp32 master, absmax (8-bit, 4-bit) or scales (flash, flash4), 32-bit states,
// an int8 or int16 correction, codes.
static void bnb8_layout_states(bnb8_tensor *t) {
    uint8_t *p = (uint8_t *)t->memory;
    int64_t ngroups = bnb8_block_count(t->n, BNB8_FLASH_GROUP);
    if (t->cfg.percentile_clipping < 100) { t->gnorm_history = (float *)p; p += 100 * sizeof(float); }
    if (t->correction_bytes == 4) { t->correction = p; p += sizeof(float) * (size_t)t->n; }
    for (int k = 0; k < t->nstates; k++) {
        if (t->format == BNB8_STATE_8BIT || t->format == BNB8_STATE_4BIT) {
            t->absmax[k] = (float *)p;
            p += sizeof(float) * (size_t)bnb8_absmax_count(t, k);
        }
        if (bnb8_companded_format(t->format)) { t->scale[k] = p; p += bnb8_dtype_size(t->scale_dtype) * (size_t)ngroups; }
    }
    for (int k = 0; k < t->nstates && t->format == BNB8_STATE_32BIT; k++) {
        t->state[k] = p;
        p += sizeof(float) * (size_t)t->n;
    }
    if (t->correction_bytes && t->correction_bytes < 4) { t->correction = p; p += (size_t)t->correction_bytes * (size_t)t->n; }
    for (int k = 0; k < t->nstates && t->format != BNB8_STATE_32BIT; k++) {
        t->state[k] = p;
        p += bnb8_code_bytes(t);
    }
}

// A shard (DESIGN.md §5.6) steps as its part of the whole tensor only where it holds whole blocks
// of its states (the last one may end at the tensor's end) and needs nothing of the rest of it.
static bnb8_status bnb8_check_shard(const char *fn, bnb8_optim kind, const bnb8_tensor *t, const char *name) {
    if (t->offset + t->n > t->total)
        return bnb8_fail(BNB8_ERR_SIZE, "%s: '%s': a shard of %lld elements at %lld runs past shard_total %lld", fn, name,
                         (long long)t->n, (long long)t->offset, (long long)t->total);
    if (t->n == t->total) return BNB8_OK;
    const char *whole = t->format == BNB8_STATE_8BIT && t->cfg.blocksize == 0 ? "one absmax per tensor (blocksize 0)"
                      : t->row_size > 0 ? "rank-1 normalization (row_size > 0: its column maxima)"
                      : t->cfg.percentile_clipping < 100 ? "percentile clipping"
                      : (kind == BNB8_LAMB || kind == BNB8_LARS) && t->cfg.max_unorm > 0.0f ? "a LAMB/LARS trust ratio (max_unorm > 0)"
                      : NULL;
    if (whole)
        return bnb8_fail(BNB8_ERR_ARG, "%s: '%s' is a shard (elements [%lld, %lld) of %lld): %s needs the whole tensor", fn,
                         name, (long long)t->offset, (long long)(t->offset + t->n), (long long)t->total, whole);
    int blocks = t->format == BNB8_STATE_8BIT || t->format == BNB8_STATE_4BIT;
    int64_t unit = blocks ? t->block : bnb8_companded_format(t->format) ? BNB8_FLASH_GROUP : 1;
    int64_t end = t->offset + t->n;
    if (t->offset % unit || (end % unit && end != t->total))
        return bnb8_fail(BNB8_ERR_ARG, "%s: '%s': a shard of elements [%lld, %lld) of %lld splits a %s of %lld: shards "
                         "start and end at multiples of %lld (the last ends at the tensor's end)", fn, name,
                         (long long)t->offset, (long long)end, (long long)t->total,
                         blocks ? "block" : "group", (long long)unit, (long long)unit);
    return BNB8_OK;
}

// fp32 masters of a tensor to or from fp32 values where the tensor lives (host memory, or device
// memory for a GPU tensor): to_weights 1 stores fp32 into the weights and correction, 0 loads them
// into fp32; corr_bytes 0 with to_weights 0: the weights widened. One per-element function on either
// device, so the bits do not depend on it.
static bnb8_status bnb8_masters_in_place(const bnb8_tensor *t, void *corr, int corr_bytes, float *fp32, int to_weights) {
    if (t->on_gpu) return bnb8_cuda_masters(t->param, t->param_dtype, corr, corr_bytes, t->n, fp32, to_weights);
    if (to_weights) {
        #pragma omp parallel for schedule(static)
        for (int64_t i = 0; i < t->n; i++) bnb8_master_store(t->param, t->param_dtype, corr, corr_bytes, i, fp32[i]);
    } else {
        #pragma omp parallel for schedule(static)
        for (int64_t i = 0; i < t->n; i++) fp32[i] = bnb8_master_load(t->param, t->param_dtype, corr, corr_bytes, i);
    }
    return BNB8_OK;
}

bnb8_status bnb8_optimizer_add(bnb8_optimizer *opt, const char *name, void *param, bnb8_dtype param_dtype,
                               void *grad, bnb8_dtype grad_dtype, int64_t n, int *id) {
    const char *fn = "bnb8_optimizer_add";
    if (!opt || !name || !param) return bnb8_fail(BNB8_ERR_NULL, "%s: opt, name or param is NULL", fn);
    if (!name[0]) return bnb8_fail(BNB8_ERR_ARG, "%s: an empty name (names tell tensors apart in state files)", fn);
    if (n <= 0 || n > BNB8_MAX_ELEMENTS) return bnb8_fail(BNB8_ERR_SIZE, "%s: '%s' has n = %lld", fn, name, (long long)n);
    if (strlen(name) > BNB8_MAX_NAME)   // the state file's limit: a longer name would save but not load
        return bnb8_fail(BNB8_ERR_ARG, "%s: a name of %zu bytes (at most %d)", fn, strlen(name), BNB8_MAX_NAME);
    bnb8_status status = bnb8_check_dtype(fn, param_dtype);
    if (!status) status = bnb8_check_dtype(fn, grad_dtype);
    if (status) return status;
    for (int i = 0; i < opt->num_tensors; i++)
        if (strcmp(opt->tensors[i].name, name) == 0)
            return bnb8_fail(BNB8_ERR_ARG, "%s: a tensor named '%s' is already added", fn, name);
    bnb8_tensor t = {0};
    t.param = param; t.grad = grad; t.param_dtype = param_dtype; t.grad_dtype = grad_dtype; t.n = n;
    t.on_gpu = bnb8_cuda_linked() && bnb8_cuda_is_device_pointer(param);
    if (grad && bnb8_cuda_linked() && bnb8_cuda_is_device_pointer(grad) != t.on_gpu)
        return bnb8_fail(BNB8_ERR_DEVICE, "%s: '%s' has param and grad on different devices", fn, name);
    const bnb8_override *o = bnb8_find_override(opt, name);
    t.cfg = o ? o->cfg : opt->cfg;
    if (t.cfg.gnorm_scale_at && (bnb8_cuda_linked() && bnb8_cuda_is_device_pointer(t.cfg.gnorm_scale_at)) != t.on_gpu)
        return bnb8_fail(BNB8_ERR_DEVICE, "%s: '%s' is %s memory, its cfg.gnorm_scale_at is not", fn, name,
                         t.on_gpu ? "GPU" : "host");
    t.offset = t.cfg.shard_offset;
    t.total = t.cfg.shard_total ? t.cfg.shard_total : n;
    // the whole tensor's format: every shard of it has the same states; a stack of tensors, each's size
    int64_t each = t.cfg.stacked > 1 ? t.total / t.cfg.stacked : t.total;
    t.format = t.cfg.format != BNB8_STATE_32BIT && each >= t.cfg.min_8bit_size ? t.cfg.format : BNB8_STATE_32BIT;
    t.block = t.cfg.blocksize > 0 ? t.cfg.blocksize : n;
    if (t.format == BNB8_STATE_4BIT && t.cfg.row_size > 0) {   // the rank-1 normalization of a matrix
        if (t.total % t.cfg.row_size)
            return bnb8_fail(BNB8_ERR_ARG, "%s: '%s' has %lld elements, not a matrix of rows of row_size %lld (rank-1 "
                             "normalization)", fn, name, (long long)t.total, (long long)t.cfg.row_size);
        t.row_size = t.cfg.row_size;
        t.rows = t.total / t.row_size;
        t.rank1_k = bnb8_rank1_state(opt->kind);
    }
    if ((status = bnb8_check_shard(fn, opt->kind, &t, name))) return status;
    for (int k = 0; k < 3; k++)
        t.code[k] = t.format == BNB8_STATE_4BIT ? opt->four[t.cfg.map][bnb8_state_signed(opt->kind, k)]
                  : opt->code[t.cfg.map][bnb8_state_signed(opt->kind, k)];
    // The GPU steps every tensor of a launch with one pair of maps (the optimizer's).
    if (t.on_gpu && (t.format == BNB8_STATE_8BIT || t.format == BNB8_STATE_4BIT) && t.cfg.map != opt->cfg.map)
        return bnb8_fail(BNB8_ERR_ARG, "%s: '%s' is GPU memory: its map must be the optimizer's (a per-tensor "
                         "map is CPU-only for now)", fn, name);
    t.nstates = bnb8_state_count(opt->kind, t.cfg.momentum);
    t.scale_dtype = t.cfg.scale_dtype;
    t.stochastic = t.cfg.correction_bytes == BNB8_CORRECTION_STOCHASTIC;
    if (t.stochastic && param_dtype == BNB8_F32)
        return bnb8_fail(BNB8_ERR_DTYPE, "%s: '%s' has fp32 weights: stochastic rounding (BNB8_CORRECTION_STOCHASTIC) "
                         "stores bf16/fp16 weights, fp32 ones have nothing to round (set correction_bytes 0 for them)", fn, name);
    t.seed = t.cfg.seed;
    t.identity = bnb8_name_identity(name);
    if (param_dtype != BNB8_F32 && !t.stochastic)   // automatic: int8 for a flash configuration (small tensors too), else none
        t.correction_bytes = t.cfg.correction_bytes != BNB8_CORRECTION_AUTO ? t.cfg.correction_bytes
                           : bnb8_companded_format(t.cfg.format) ? 1 : 0;
    // The GPU carries corrections and 4-bit states in the launches of the kinds with a flash form (their tables).
    if (t.on_gpu && t.correction_bytes && !bnb8_flash_kind(opt->kind))
        return bnb8_fail(BNB8_ERR_ARG, "%s: '%s': a master weight correction on the GPU needs AdamW, Adam, SGD or Lion "
                         "(CPU-only for the other kinds for now)", fn, name);
    if (t.on_gpu && bnb8_four_format(t.format) && !bnb8_flash_kind(opt->kind))
        return bnb8_fail(BNB8_ERR_ARG, "%s: '%s': 4-bit states on the GPU need AdamW, Adam, SGD or Lion (CPU-only for "
                         "the other kinds for now)", fn, name);
    t.memory_bytes = bnb8_state_bytes(&t);
    if (t.memory_bytes > 0) {
        if (t.on_gpu) status = bnb8_cuda_alloc_zeroed(&t.memory, t.memory_bytes);
        else if (!(t.memory = calloc(1, t.memory_bytes)))
            status = bnb8_fail(BNB8_ERR_NOMEM, "%s: %zu bytes of state for '%s'", fn, t.memory_bytes, name);
        if (status) return status;
    }
    bnb8_layout_states(&t);
    // An fp32 master starts as the weights it stands beside, widened (exact): left zeroed, the first
    // step would write zero into every weight. An import_fp32 afterwards replaces it.
    if (t.correction_bytes == 4 && (status = bnb8_masters_in_place(&t, NULL, 0, (float *)t.correction, 0))) {
        if (t.on_gpu) bnb8_cuda_free(t.memory); else free(t.memory);
        return status;
    }
    // Zeroed memory is the all-zero state once the codes of signed 8-bit and 4-bit states say zero.
    if (t.format == BNB8_STATE_8BIT || t.format == BNB8_STATE_4BIT) {
        for (int k = 0; k < t.nstates; k++) {
            int is_signed = bnb8_state_signed(opt->kind, k), pad = bnb8_four_pad(t.format, is_signed);
            int zero_code = t.format == BNB8_STATE_8BIT ? bnb8_zero_code(is_signed) : bnb8_nibble_pair(pad, pad);
            size_t bytes = bnb8_code_bytes(&t);
            if (!zero_code) continue;
            if (t.on_gpu) {
                uint8_t *codes = (uint8_t *)malloc(bytes);
                if (!codes) { bnb8_cuda_free(t.memory); return bnb8_fail(BNB8_ERR_NOMEM, "%s", fn); }
                memset(codes, zero_code, bytes);
                status = bnb8_cuda_copy(t.state[k], codes, bytes, 1);
                free(codes);
                if (status) { bnb8_cuda_free(t.memory); return status; }
            } else {
                memset(t.state[k], zero_code, bytes);
            }
        }
    }
    if (opt->num_tensors == opt->tensors_capacity) {   // grow by doubling
        int capacity = opt->tensors_capacity ? 2 * opt->tensors_capacity : 16;
        bnb8_tensor *grown = (bnb8_tensor *)realloc(opt->tensors, (size_t)capacity * sizeof *grown);
        if (grown) { opt->tensors = grown; opt->tensors_capacity = capacity; }
    }
    t.name = opt->num_tensors < opt->tensors_capacity ? (char *)malloc(strlen(name) + 1) : NULL;
    if (!t.name) {
        if (t.on_gpu) bnb8_cuda_free(t.memory); else free(t.memory);
        return bnb8_fail(BNB8_ERR_NOMEM, "%s", fn);
    }
    strcpy(t.name, name);
    opt->tensors[opt->num_tensors] = t;
    if (id) *id = opt->num_tensors;
    opt->num_tensors++;
    return BNB8_OK;
}

bnb8_status bnb8_optimizer_set_grad(bnb8_optimizer *opt, int id, void *grad) {
    if (!opt) return bnb8_fail(BNB8_ERR_NULL, "bnb8_optimizer_set_grad: opt is NULL");
    if (id < 0 || id >= opt->num_tensors)
        return bnb8_fail(BNB8_ERR_ARG, "bnb8_optimizer_set_grad: no tensor %d", id);
    opt->tensors[id].grad = grad;
    return BNB8_OK;
}

int bnb8_optimizer_count(const bnb8_optimizer *opt) { return opt ? opt->num_tensors : 0; }

int64_t bnb8_optimizer_step_count(const bnb8_optimizer *opt, int id) {
    return opt && id >= 0 && id < opt->num_tensors ? opt->tensors[id].step : -1;
}

bnb8_status bnb8_optimizer_set_step_count(bnb8_optimizer *opt, int id, int64_t count) {
    const char *fn = "bnb8_optimizer_set_step_count";
    if (!opt) return bnb8_fail(BNB8_ERR_NULL, "%s: opt is NULL", fn);
    if (id < -1 || id >= opt->num_tensors) return bnb8_fail(BNB8_ERR_ARG, "%s: no tensor %d", fn, id);
    if (count < 0 || count > BNB8_MAX_ELEMENTS)   // the state file's limit: stepping on could overflow
        return bnb8_fail(BNB8_ERR_ARG, "%s: count %lld not in 0..2^52", fn, (long long)count);
    for (int i = 0; i < opt->num_tensors; i++)
        if (id == -1 || id == i) opt->tensors[i].step = count;
    return BNB8_OK;
}

bnb8_status bnb8_optimizer_take_nonfinite(bnb8_optimizer *opt, int64_t *count) {
    if (!opt || !count) return bnb8_fail(BNB8_ERR_NULL, "bnb8_optimizer_take_nonfinite: opt or count is NULL");
    int64_t on_gpu = 0;
    bnb8_status status = opt->gpu_context ? bnb8_cuda_take_nonfinite(opt->gpu_context, &on_gpu) : BNB8_OK;
    if (status) return status;   // the host's count stays for the next call
    *count = opt->nonfinite + on_gpu;
    opt->nonfinite = 0;
    return BNB8_OK;
}

bnb8_status bnb8_optimizer_sum_squares(const bnb8_optimizer *opt, double *out) {
    if (!opt || !out) return bnb8_fail(BNB8_ERR_NULL, "bnb8_optimizer_sum_squares: opt or out is NULL");
    for (int i = 0; i < opt->num_tensors; i++) out[i] = opt->tensors[i].on_gpu ? 0.0 : opt->tensors[i].sum_squares;
    if (!opt->gpu_sums) return BNB8_OK;
    double *dev = (double *)malloc(sizeof(double) * (size_t)opt->gpu_sums_count);
    if (!dev) return bnb8_fail(BNB8_ERR_NOMEM, "bnb8_optimizer_sum_squares");
    bnb8_status status = bnb8_cuda_copy(dev, opt->gpu_sums, sizeof(double) * (size_t)opt->gpu_sums_count, 0);
    for (int i = 0; !status && i < opt->gpu_sums_count; i++) if (opt->tensors[i].on_gpu) out[i] = dev[i];
    free(dev);
    return status;
}

bnb8_memory bnb8_optimizer_memory(const bnb8_optimizer *opt, int with_grads) {
    bnb8_memory m = {0};
    for (int i = 0; opt && i < opt->num_tensors; i++) {
        const bnb8_tensor *t = &opt->tensors[i];
        m.params += t->n;
        m.weights += (double)t->n * (double)bnb8_dtype_size(t->param_dtype);
        if (with_grads) m.gradients += (double)t->n * (double)bnb8_dtype_size(t->grad_dtype);
        m.correction += (double)t->correction_bytes * (double)t->n;
        m.states += (double)t->memory_bytes - (double)t->correction_bytes * (double)t->n;
    }
    return m;
}

// Export and import of the fp32 master (DESIGN.md §6.5), for fp32 values in host memory or, for a
// GPU tensor, device memory. A GPU tensor's masters with host values go through host copies of its
// weights and correction (device memory of the tensor's size is not asked for); the per-element
// functions are one, so the bits do not depend on the path.
static bnb8_status bnb8_masters(const char *fn, const bnb8_tensor *t, float *fp32, int to_weights) {
    int fp32_on_gpu = bnb8_cuda_linked() && bnb8_cuda_is_device_pointer(fp32);
    if (fp32_on_gpu && !t->on_gpu)
        return bnb8_fail(BNB8_ERR_DEVICE, "%s: '%s' is in host memory, its fp32 values in GPU memory", fn, t->name);
    if (fp32_on_gpu || !t->on_gpu) return bnb8_masters_in_place(t, t->correction, t->correction_bytes, fp32, to_weights);
    size_t wbytes = bnb8_dtype_size(t->param_dtype) * (size_t)t->n, cbytes = (size_t)t->correction_bytes * (size_t)t->n;
    bnb8_tensor host = *t;
    host.on_gpu = 0;
    host.param = malloc(wbytes);
    host.correction = cbytes ? malloc(cbytes) : NULL;
    bnb8_status status = host.param && (host.correction || !cbytes) ? BNB8_OK
                       : bnb8_fail(BNB8_ERR_NOMEM, "%s: host copy of '%s'", fn, t->name);
    if (!status && !to_weights) status = bnb8_cuda_copy(host.param, t->param, wbytes, 0);
    if (!status && !to_weights && cbytes) status = bnb8_cuda_copy(host.correction, t->correction, cbytes, 0);
    if (!status) status = bnb8_masters_in_place(&host, host.correction, t->correction_bytes, fp32, to_weights);
    if (!status && to_weights) status = bnb8_cuda_copy(t->param, host.param, wbytes, 1);
    if (!status && to_weights && cbytes) status = bnb8_cuda_copy(t->correction, host.correction, cbytes, 1);
    free(host.param);
    free(host.correction);
    return status;
}

bnb8_status bnb8_optimizer_export_fp32(const bnb8_optimizer *opt, int id, float *out) {
    const char *fn = "bnb8_optimizer_export_fp32";
    if (!opt || !out) return bnb8_fail(BNB8_ERR_NULL, "%s: opt or out is NULL", fn);
    if (id < 0 || id >= opt->num_tensors) return bnb8_fail(BNB8_ERR_ARG, "%s: no tensor %d", fn, id);
    return bnb8_masters(fn, &opt->tensors[id], out, 0);
}

bnb8_status bnb8_optimizer_import_fp32(bnb8_optimizer *opt, int id, const float *in) {
    const char *fn = "bnb8_optimizer_import_fp32";
    if (!opt || !in) return bnb8_fail(BNB8_ERR_NULL, "%s: opt or in is NULL", fn);
    if (id < 0 || id >= opt->num_tensors) return bnb8_fail(BNB8_ERR_ARG, "%s: no tensor %d", fn, id);
    return bnb8_masters(fn, &opt->tensors[id], (float *)in, 1);   // read only: to_weights stores into the tensor
}

// Tensor t's learning rate when the step's is lr: lr * c->lr / base->lr in double, exactly lr when
// the tensor has the base lr (the product of two floats is exact in double): a tensor without its
// own lr keeps the scheduled lr bit for bit.
static double bnb8_tensor_lr(const bnb8_config *base, const bnb8_tensor *t, float lr) {
    return base->lr == 0.0f ? lr : (double)lr * t->cfg.lr / base->lr;
}

// The per-element constants of one step of tensor t (its step count already advanced), computed
// in double: bias corrections, AdEMAMix's schedules, and the lr that follows the base schedule.
static bnb8_step_args bnb8_step_args_for(bnb8_optim kind, const bnb8_config *base, const bnb8_tensor *t,
                                         float lr, float gnorm_scale) {
    const bnb8_config *c = &t->cfg;
    double lr_t = bnb8_tensor_lr(base, t, lr);
    double step = (double)t->step, bc1 = 1.0 - pow(c->beta1, step), bc2 = 1.0 - pow(c->beta2, step);
    bnb8_step_args a = {0};
    a.kind = kind;
    a.nstates = t->nstates;
    a.first = t->step == 1;
    a.nesterov = c->nesterov;
    a.gnorm_scale = gnorm_scale;
    a.beta1 = c->beta1; a.one_minus_beta1 = (float)(1.0 - c->beta1);
    a.beta2 = c->beta2; a.one_minus_beta2 = (float)(1.0 - c->beta2);
    a.beta3 = c->beta3; a.one_minus_beta3 = (float)(1.0 - c->beta3);
    a.inv_sqrt_bc2 = (float)(1.0 / sqrt(bc2));
    a.inv_bc1 = (float)(1.0 / bc1);
    a.eps = c->eps;
    a.alpha = c->alpha;
    a.momentum = c->momentum;
    a.one_minus_dampening = (float)(1.0 - c->dampening);
    a.max_unorm = c->max_unorm;
    int decoupled = bnb8_decoupled_decay(kind);
    a.decay = decoupled ? (float)(1.0 - lr_t * c->weight_decay) : 1.0f;
    a.l2 = decoupled ? 0.0f : c->weight_decay;
    int adam = kind == BNB8_ADAMW || kind == BNB8_ADAM || kind == BNB8_LAMB;
    a.step_size = (float)(adam ? lr_t / bc1 : lr_t);
    if (kind == BNB8_RMSPROP) { a.beta2 = c->alpha; a.one_minus_beta2 = (float)(1.0 - c->alpha); }
    if (kind == BNB8_ADEMAMIX) {
        // alpha rises linearly over t_alpha steps; beta3 follows the paper's warm-up from beta1.
        if (c->t_alpha > 0 && step < c->t_alpha) a.alpha = (float)(c->alpha * step / c->t_alpha);
        if (c->t_beta3 > 0 && step < c->t_beta3) {
            double f = step / c->t_beta3, lb1 = log(c->beta1), lb3 = log(c->beta3);
            double b3 = exp(lb1 * lb3 / ((1.0 - f) * lb3 + f * lb1));
            b3 = b3 < c->beta3 ? b3 : c->beta3;
            a.beta3 = (float)b3; a.one_minus_beta3 = (float)(1.0 - b3);
        }
    }
    return a;
}

// The rounding of tensor t's step (its step count already advanced; DESIGN.md §6.6).
static bnb8_rounding bnb8_rounding_of(const bnb8_tensor *t) {
    bnb8_rounding r = {0, 0, 0, 0};
    if (!t->stochastic) return r;
    r.key = bnb8_round_key(t->seed, t->identity, t->step);
    r.base = t->offset;
    r.on = 1;
    return r;
}

// Element i's update on the CPU: p and s[] become the new weight (as the weights will hold it under
// stochastic rounding) and states and 1 is returned, or they stay and 0 is returned when the gradient
// g or a result is not finite (counted by the caller).
static int bnb8_step_element(const bnb8_step_args *a, const bnb8_rounding *r, bnb8_dtype dtype, int nstates, float trust,
                             float g, int64_t i, float *p, float s[3]) {
    if (!bnb8_isfinite(g)) return 0;
    float sn[3] = {s[0], s[1], s[2]}, pn = bnb8_apply(a, *p, bnb8_direction(a, *p, g, sn), trust);
    pn = bnb8_round_result(r, pn, dtype, i);
    if (!bnb8_results_finite(pn, dtype, sn, nstates)) return 0;
    *p = pn;
    for (int k = 0; k < 3; k++) s[k] = sn[k];
    return 1;
}

// The scale of element i of an 8-bit or 4-bit state k: its block's absmax, or its rank-1 scale.
static float bnb8_absmax_of(const bnb8_tensor *t, int k, int64_t i) {
    return bnb8_rank1(t, k) ? bnb8_rank1_scale(t->absmax[k], t->rows, t->row_size, i) : t->absmax[k][i / t->block];
}

// The states of element i, read from 32-bit, 8-bit or 4-bit states (flash ones: bnb8_step_flash_cpu).
static void bnb8_load_states(const bnb8_tensor *t, int64_t i, float s[3]) {
    for (int k = 0; k < t->nstates; k++) {
        const uint8_t *q = (const uint8_t *)t->state[k];
        if (t->format == BNB8_STATE_32BIT) s[k] = ((const float *)t->state[k])[i];
        else if (t->format == BNB8_STATE_4BIT) s[k] = t->code[k][bnb8_nibble(q, i)] * bnb8_absmax_of(t, k, i);
        else s[k] = t->code[k][q[i]] * t->absmax[k][i / t->block];
    }
}

// Stores count codes (one per byte in codes) of state k from element start on: bytes, or nibble pairs
// (start is even: a block or group start), an odd end's high nibble the pad (bnb8_four_pad).
static void bnb8_store_codes(const bnb8_tensor *t, int k, int is_signed, int64_t start, int64_t count, const uint8_t *codes) {
    uint8_t *q = (uint8_t *)t->state[k];
    if (!bnb8_four_format(t->format)) { memcpy(q + start, codes, (size_t)count); return; }
    int pad = bnb8_four_pad(t->format, is_signed);
    for (int64_t j = 0; j < count; j += 2) q[(start + j) / 2] = bnb8_nibble_pair(codes[j], j + 1 < count ? codes[j + 1] : pad);
}

// LAMB / LARS: squared norms of the parameter and of the update this step would make (the states
// are read, not written), summed in double.
static float bnb8_trust_cpu(const bnb8_tensor *t, const bnb8_step_args *a) {
    double p2 = 0.0, u2 = 0.0;
    #pragma omp parallel for schedule(static) reduction(+:p2, u2)
    for (int64_t i = 0; i < t->n; i++) {
        float p = bnb8_load(t->param, t->param_dtype, i), g = bnb8_load(t->grad, t->grad_dtype, i), s[3];
        p2 += (double)p * p;
        if (!bnb8_isfinite(g)) continue;
        bnb8_load_states(t, i, s);
        float u = bnb8_direction(a, p, g, s);
        u2 += (double)u * u;
    }
    return bnb8_trust_ratio(a->max_unorm, (float)p2, (float)u2);
}

// One flash or flash4 step of a CPU tensor (DESIGN.md §6.3, §5.7), group by group of 32 in the order
// bnb8.h describes for both back ends: reconstruct each master weight, expand its states with the
// group's old scales, update in fp32, store the weight and its correction; then per state the
// group's new absmax, its stored (rounded) scale and the codes against that scale.
static void bnb8_step_flash_cpu(bnb8_optimizer *opt, bnb8_tensor *t, const bnb8_step_args *a) {
    const int64_t G = BNB8_FLASH_GROUP, per_chunk = 4096 / BNB8_FLASH_GROUP;
    int64_t ngroups = bnb8_block_count(t->n, G), nchunks = bnb8_block_count(ngroups, per_chunk), bad = 0;
    int is_signed[3], four = t->format == BNB8_STATE_FLASH4;
    for (int k = 0; k < t->nstates; k++) is_signed[k] = bnb8_state_signed(opt->kind, k);
    #pragma omp parallel for schedule(static) reduction(+:bad)
    for (int64_t c = 0; c < nchunks; c++) {
        int64_t last = (c + 1) * per_chunk < ngroups ? (c + 1) * per_chunk : ngroups;
        for (int64_t grp = c * per_chunk; grp < last; grp++) {
            int64_t start = grp * G, end = start + G < t->n ? start + G : t->n;
            float fresh[3][BNB8_FLASH_GROUP], old[3];
            for (int k = 0; k < t->nstates; k++) old[k] = bnb8_scale_load(t->scale[k], t->scale_dtype, grp);
            for (int64_t i = start; i < end; i++) {
                float p = bnb8_master_load(t->param, t->param_dtype, t->correction, t->correction_bytes, i);
                float g = bnb8_load(t->grad, t->grad_dtype, i), s[3] = {0.0f, 0.0f, 0.0f};
                for (int k = 0; k < t->nstates; k++) {
                    const uint8_t *q = (const uint8_t *)t->state[k];
                    s[k] = four ? bnb8_expand4_value(bnb8_nibble(q, i), old[k], is_signed[k]) : bnb8_expand_value(q[i], old[k], is_signed[k]);
                }
                if (bnb8_step_element(a, &t->rounding, t->param_dtype, t->nstates, 1.0f, g, i, &p, s))
                    bnb8_master_store(t->param, t->param_dtype, t->correction, t->correction_bytes, i, p);
                else
                    bad++;           // the element keeps its weight, correction and states
                for (int k = 0; k < t->nstates; k++) fresh[k][i - start] = s[k];
            }
            for (int k = 0; k < t->nstates; k++) {
                uint8_t codes[BNB8_FLASH_GROUP];
                bnb8_compand_group(fresh[k], end - start, is_signed[k], four, t->scale_dtype, t->scale[k], grp, codes);
                bnb8_store_codes(t, k, is_signed[k], start, end - start, codes);
            }
        }
    }
    opt->nonfinite += bad;
}

// Elements [start, end) of a step (at most 4096): each element's master and states updated in
// float32. With store, the new weights are written (a non-finite gradient's element keeps its
// weight and states, and is counted in *bad) and 32-bit states too; 8-bit and 4-bit states go to
// fresh[k] when it is given (the element at start first). Either way amax[k] grows to the largest
// |fresh state|. Without store nothing is written: pass 1 of a per-tensor absmax or rank-1 maxima.
static void bnb8_step_range(bnb8_tensor *t, const bnb8_step_args *a, float trust,
                            int64_t start, int64_t end, int store, float fresh[3][4096], float amax[3], int64_t *bad) {
    float m[3] = {amax[0], amax[1], amax[2]};   // locals: stores through t's arrays cannot alias them
    int64_t skipped = 0;
    for (int64_t i = start; i < end; i++) {
        float p = bnb8_master_load(t->param, t->param_dtype, t->correction, t->correction_bytes, i);
        float g = bnb8_load(t->grad, t->grad_dtype, i), s[3] = {0.0f, 0.0f, 0.0f};
        bnb8_load_states(t, i, s);
        if (!bnb8_step_element(a, &t->rounding, t->param_dtype, t->nstates, trust, g, i, &p, s)) skipped++;
        else if (store) bnb8_master_store(t->param, t->param_dtype, t->correction, t->correction_bytes, i, p);
        for (int k = 0; k < t->nstates; k++) {
            if (t->format == BNB8_STATE_32BIT) { if (store) ((float *)t->state[k])[i] = s[k]; continue; }
            if (fresh) fresh[k][i - start] = s[k];
            m[k] = fmaxf(m[k], fabsf(s[k]));
        }
    }
    for (int k = 0; k < 3; k++) amax[k] = m[k];
    if (store) *bad += skipped;
}

// The codes of count fresh values v of state k under absmax amax (DESIGN.md §5.2): without
// dividing where the lookup table allows, else with the exact division.
static void bnb8_requantize(const bnb8_optimizer *opt, const bnb8_tensor *t, int k, const float *v, int64_t count,
                            float amax, uint8_t *codes) {
    int is_signed = bnb8_state_signed(opt->kind, k), zero_code = bnb8_zero_code(is_signed);
    const bnb8_codebook *book = &opt->books[t->cfg.map][is_signed];
    float r = bnb8_reciprocal(amax);
    for (int64_t i = 0; i < count; i++) {
        int redo = book->search, c = bnb8_quantize_value_near(book, v[i], r, &redo);   // a zero block: redone
        codes[i] = (uint8_t)(redo ? bnb8_quantize_value(book, zero_code, v[i], amax) : c);
    }
}

// The 4-bit codes of count fresh values v of state k from element start on (even): under absmax
// amax, or for a rank-1 state under its scale from maxima, the step's new row and column maxima.
static void bnb8_requantize_four(const bnb8_optimizer *opt, const bnb8_tensor *t, int k, const float *v, int64_t count,
                                 float amax, const float *maxima, int64_t start) {
    int is_signed = bnb8_state_signed(opt->kind, k), rank1 = bnb8_rank1(t, k);
    uint8_t codes[4096];
    for (int64_t j = 0; j < count; j++) {
        float a = rank1 ? bnb8_rank1_scale(maxima, t->rows, t->row_size, start + j) : amax;
        codes[j] = (uint8_t)bnb8_four_code(&opt->four_book[t->cfg.map][is_signed], is_signed, v[j], a);
    }
    bnb8_store_codes(t, k, is_signed, start, count, codes);
}

// The codes of a block of fresh states of 8-bit or 4-bit tensor t (elements [start, end), one block):
// each state's new absmax is the block's max, a rank-1 state's scale the step's maxima.
static void bnb8_requantize_block(const bnb8_optimizer *opt, bnb8_tensor *t, int64_t start, int64_t end,
                                  float fresh[3][4096], const float amax[3], const float *maxima) {
    for (int k = 0; k < t->nstates; k++) {
        if (t->format == BNB8_STATE_8BIT) {
            t->absmax[k][start / t->block] = amax[k];
            bnb8_requantize(opt, t, k, fresh[k], end - start, amax[k], (uint8_t *)t->state[k] + start);
            continue;
        }
        if (!bnb8_rank1(t, k)) t->absmax[k][start / t->block] = amax[k];
        bnb8_requantize_four(opt, t, k, fresh[k], end - start, amax[k], maxima, start);
    }
}

// Rank-1 4-bit states (DESIGN.md §5.7): the codes of the non-negative state need the new row and
// column maxima of the whole tensor. Pass 1 computes every fresh state and keeps only those maxima
// (each thread its own in t->rank1_work, then merged: fmaxf is exact in any order); pass 2 computes
// the same floats again and stores weights and codes block by block (the other states' blocks as
// bnb8_step_tensor_cpu's); then the maxima become the state's.
static int64_t bnb8_step_rank1_cpu(const bnb8_optimizer *opt, bnb8_tensor *t, const bnb8_step_args *a, float trust) {
    const int64_t span = t->rows + t->row_size, chunk = 4096, nchunks = bnb8_block_count(t->n, chunk);
    const int k1 = t->rank1_k;
    float *maxima = t->rank1_work;   // the merged maxima, then one array per thread
    int64_t bad = 0;
    for (int64_t j = 0; j < span; j++) maxima[j] = 0.0f;
    #pragma omp parallel
    {
#ifdef _OPENMP
        float *mine = maxima + span * (1 + omp_get_thread_num());
#else
        float *mine = maxima + span;
#endif
        float fresh[3][4096], unused[3] = {0.0f, 0.0f, 0.0f};
        for (int64_t j = 0; j < span; j++) mine[j] = 0.0f;
        #pragma omp for schedule(static)
        for (int64_t c = 0; c < nchunks; c++) {
            int64_t start = c * chunk, end = start + chunk < t->n ? start + chunk : t->n;
            bnb8_step_range(t, a, trust, start, end, 0, fresh, unused, NULL);
            for (int64_t i = start; i < end; i++) {
                int64_t r = i / t->row_size;
                float v = fabsf(fresh[k1][i - start]);
                mine[r] = fmaxf(mine[r], v);
                mine[t->rows + (i - r * t->row_size)] = fmaxf(mine[t->rows + (i - r * t->row_size)], v);
            }
        }
        #pragma omp critical
        for (int64_t j = 0; j < span; j++) maxima[j] = fmaxf(maxima[j], mine[j]);
    }
    int64_t nblocks = bnb8_block_count(t->n, t->block);
    #pragma omp parallel for schedule(static) reduction(+:bad)
    for (int64_t b = 0; b < nblocks; b++) {
        int64_t start = b * t->block, end = start + t->block < t->n ? start + t->block : t->n;
        float fresh[3][4096], amax[3] = {0.0f, 0.0f, 0.0f};
        bnb8_step_range(t, a, trust, start, end, 1, fresh, amax, &bad);
        bnb8_requantize_block(opt, t, start, end, fresh, amax, maxima);
    }
    memcpy(t->absmax[k1], maxima, sizeof(float) * (size_t)span);
    return bad;
}

// 8-bit states with one absmax per tensor (blocksize 0): the codes need the new absmax of the whole
// tensor. Pass 1 computes every fresh state and keeps only their max; pass 2 computes the same
// floats again (nothing was written in between) and stores weights and codes; then the absmax.
// fmaxf is exact in any order, so the result does not depend on the number of threads.
static int64_t bnb8_step_per_tensor_cpu(const bnb8_optimizer *opt, bnb8_tensor *t, const bnb8_step_args *a, float trust) {
    const int64_t chunk = 4096, nchunks = bnb8_block_count(t->n, chunk);
    float amax[3] = {0.0f, 0.0f, 0.0f};
    int64_t bad = 0;
    #pragma omp parallel
    {
        float mine[3] = {0.0f, 0.0f, 0.0f};
        #pragma omp for schedule(static)
        for (int64_t c = 0; c < nchunks; c++)
            bnb8_step_range(t, a, trust, c * chunk, c * chunk + chunk < t->n ? c * chunk + chunk : t->n, 0, NULL, mine, NULL);
        #pragma omp critical
        for (int k = 0; k < t->nstates; k++) amax[k] = fmaxf(amax[k], mine[k]);
    }
    #pragma omp parallel for schedule(static) reduction(+:bad)
    for (int64_t c = 0; c < nchunks; c++) {
        int64_t start = c * chunk, end = start + chunk < t->n ? start + chunk : t->n;
        float fresh[3][4096], unused[3] = {0.0f, 0.0f, 0.0f};
        bnb8_step_range(t, a, trust, start, end, 1, fresh, unused, &bad);
        for (int k = 0; k < t->nstates; k++)
            bnb8_requantize(opt, t, k, fresh[k], end - start, amax[k], (uint8_t *)t->state[k] + start);
    }
    for (int k = 0; k < t->nstates; k++) t->absmax[k][0] = amax[k];
    return bad;
}

// The sum of g^2 of a CPU tensor in bnb8.h's order ([math.sumsq]: the GPU's, bit for bit), in a
// loop of its own (on the GPU the update kernel sums as it reads).
static double bnb8_butterfly32(double *v) {
    double w[32];
    for (int d = 16; d > 0; d >>= 1) {
        for (int k = 0; k < 32; k++) w[k] = v[k] + v[k ^ d];
        memcpy(v, w, sizeof w);
    }
    return v[0];
}
static double bnb8_sum_squares_cpu(const bnb8_tensor *t) {
    const int64_t U = BNB8_SUMSQ_UNIT, units = (t->n + U - 1) / U;
    double strand[BNB8_SUMSQ_STRANDS], total = 0.0;
    #pragma omp parallel for schedule(static)
    for (int s = 0; s < BNB8_SUMSQ_STRANDS; s++) {
        double acc = 0.0, v[32];
        for (int64_t u = s; u < units; u += BNB8_SUMSQ_STRANDS) {
            for (int q = 0; q < 32; q++) {
                float g[4];
                for (int j = 0; j < 4; j++) {
                    int64_t i = u * U + 4 * q + j;
                    g[j] = i < t->n ? bnb8_load(t->grad, t->grad_dtype, i) : 0.0f;
                }
                v[q] = bnb8_sumsq_quad(g);
            }
            acc += bnb8_butterfly32(v);
        }
        strand[s] = acc;
    }
    for (int w = 0; w < BNB8_SUMSQ_STRANDS / 32; w++) total += bnb8_butterfly32(strand + 32 * w);
    return total;
}

// One step of one CPU tensor. 32-bit states are updated in place; 8-bit and 4-bit states block by
// block: dequantize with the old absmax, update, new absmax from the fresh states, requantize.
static void bnb8_step_tensor_cpu(bnb8_optimizer *opt, bnb8_tensor *t, float lr, float gnorm_scale) {
    t->step++;
    t->rounding = bnb8_rounding_of(t);
    if (t->cfg.gnorm_scale_at) gnorm_scale *= *t->cfg.gnorm_scale_at;   // before the percentile's, as on the GPU
    if (t->cfg.sum_squares) t->sum_squares = bnb8_sum_squares_cpu(t);
    if (t->cfg.percentile_clipping < 100) {
        double g2 = 0.0;
        #pragma omp parallel for schedule(static) reduction(+:g2)
        for (int64_t i = 0; i < t->n; i++) {
            float g = bnb8_load(t->grad, t->grad_dtype, i);
            if (bnb8_isfinite(g)) g2 += (double)g * g;
        }
        gnorm_scale *= bnb8_percentile_scale(t->gnorm_history, t->step, (float)g2, t->cfg.percentile_clipping);
    }
    bnb8_step_args a = bnb8_step_args_for(opt->kind, &opt->cfg, t, lr, gnorm_scale);
    if (bnb8_companded_format(t->format)) { bnb8_step_flash_cpu(opt, t, &a); return; }
    float trust = (opt->kind == BNB8_LAMB || opt->kind == BNB8_LARS) ? bnb8_trust_cpu(t, &a) : 1.0f;
    if (t->format == BNB8_STATE_8BIT && t->cfg.blocksize == 0) { opt->nonfinite += bnb8_step_per_tensor_cpu(opt, t, &a, trust); return; }
    if (t->row_size > 0) { opt->nonfinite += bnb8_step_rank1_cpu(opt, t, &a, trust); return; }
    int64_t blocksize = t->format == BNB8_STATE_32BIT ? 4096 : t->block;
    int64_t nblocks = bnb8_block_count(t->n, blocksize), bad = 0;
    #pragma omp parallel for schedule(static) reduction(+:bad)
    for (int64_t b = 0; b < nblocks; b++) {
        int64_t start = b * blocksize, end = start + blocksize < t->n ? start + blocksize : t->n;
        float fresh[3][4096], amax[3] = {0.0f, 0.0f, 0.0f};
        bnb8_step_range(t, &a, trust, start, end, 1, fresh, amax, &bad);
        if (t->format != BNB8_STATE_32BIT) bnb8_requantize_block(opt, t, start, end, fresh, amax, NULL);
    }
    opt->nonfinite += bad;
}

// A CPU rank-1 tensor's scratch for its step (bnb8_step_rank1_cpu): the merged row and column
// maxima and each thread's, allocated before any tensor steps, so that a step fails whole or not at all.
static bnb8_status bnb8_rank1_work(bnb8_tensor *t) {
    if (t->on_gpu || t->row_size == 0) return BNB8_OK;
#ifdef _OPENMP
    int64_t threads = omp_get_max_threads();
#else
    int64_t threads = 1;
#endif
    int64_t floats = (t->rows + t->row_size) * (threads + 1);
    if (floats <= t->rank1_work_floats) return BNB8_OK;
    float *grown = (float *)realloc(t->rank1_work, sizeof(float) * (size_t)floats);
    if (!grown) return bnb8_fail(BNB8_ERR_NOMEM, "bnb8_optimizer_step: %lld floats of row and column maxima for '%s'",
                                 (long long)floats, t->name);
    t->rank1_work = grown;
    t->rank1_work_floats = floats;
    return BNB8_OK;
}

// Tensor t (id) stepped on the GPU: its step count advanced, its arrays and this step's constants in *g.
static void bnb8_describe_gpu(bnb8_optimizer *opt, bnb8_tensor *t, int id, float lr, float gnorm_scale, bnb8_gpu_tensor *g) {
    t->step++;
    t->rounding = bnb8_rounding_of(t);
    g->param = t->param;
    g->grad = t->grad;
    for (int k = 0; k < 3; k++) { g->state[k] = t->state[k]; g->absmax[k] = t->absmax[k]; }
    g->history = t->gnorm_history;
    g->n = t->n;
    g->step = t->step;
    g->param_dtype = t->param_dtype;
    g->grad_dtype = t->grad_dtype;
    g->eight_bit = t->format == BNB8_STATE_8BIT;
    g->blocksize = (int32_t)t->cfg.blocksize;
    g->rows = t->rows;
    g->row_size = t->row_size;
    g->rank1_k = t->rank1_k;
    g->percentile = t->cfg.percentile_clipping;
    g->args = bnb8_step_args_for(opt->kind, &opt->cfg, t, lr, gnorm_scale);
    g->format = t->format;
    g->correction_bytes = t->correction_bytes;
    g->scale_dtype = t->scale_dtype;
    g->correction = t->correction;
    for (int k = 0; k < 2; k++) g->scale[k] = t->scale[k];
    g->sum_squares = t->cfg.sum_squares ? opt->gpu_sums + id : NULL;
    g->gnorm_scale_at = t->cfg.gnorm_scale_at;
    g->rounding = t->rounding;
}

// The GPU tensors among ids, described for bnb8_cuda_step and stepped in one launch (two when some
// round stochastically and some do not).
static bnb8_status bnb8_step_gpu(bnb8_optimizer *opt, const int *ids, int count, float lr, float gnorm_scale,
                                 struct CUstream_st *stream) {
    bnb8_status status = BNB8_OK;
    int sums = 0;
    for (int i = 0; i < count; i++) sums |= opt->tensors[ids[i]].on_gpu && opt->tensors[ids[i]].cfg.sum_squares;
    if (sums && opt->gpu_sums_count < opt->num_tensors) {   // one slot per tensor; those before kept
        double *grown = NULL, *old = (double *)calloc((size_t)opt->num_tensors, sizeof(double));
        if (!old) return bnb8_fail(BNB8_ERR_NOMEM, "bnb8_optimizer_step");
        if (opt->gpu_sums) status = bnb8_cuda_copy(old, opt->gpu_sums, sizeof(double) * (size_t)opt->gpu_sums_count, 0);
        if (!status) status = bnb8_cuda_alloc_zeroed((void **)&grown, sizeof(double) * (size_t)opt->num_tensors);
        if (!status) status = bnb8_cuda_copy(grown, old, sizeof(double) * (size_t)opt->num_tensors, 1);
        free(old);
        if (status) { if (grown) bnb8_cuda_free(grown); return status; }
        if (opt->gpu_sums) bnb8_cuda_free(opt->gpu_sums);
        opt->gpu_sums = grown;
        opt->gpu_sums_count = opt->num_tensors;
    }
    bnb8_gpu_tensor *d = (bnb8_gpu_tensor *)calloc((size_t)count, sizeof *d);
    if (!d) return bnb8_fail(BNB8_ERR_NOMEM, "bnb8_optimizer_step: %d tensor descriptors", count);
    // The tensors rounded to nearest first, then those rounded stochastically: a launch each (the
    // latter's kernels are their own, so that the others keep their registers; DESIGN.md §6.6).
    int m = 0, nearest = 0;
    for (int stochastic = 0; stochastic < 2; stochastic++) {
        for (int i = 0; i < count; i++) {
            bnb8_tensor *t = &opt->tensors[ids[i]];
            if (t->on_gpu && t->stochastic == stochastic) bnb8_describe_gpu(opt, t, ids[i], lr, gnorm_scale, &d[m++]);
        }
        if (!stochastic) nearest = m;
    }
    int map = opt->cfg.map;   // bnb8_optimizer_add keeps GPU tensors on the optimizer's map
    const float (*four)[BNB8_FOUR_CODES] = (const float (*)[BNB8_FOUR_CODES])opt->four[map];
    if (nearest > 0)
        status = bnb8_cuda_step(&opt->gpu_context, d, nearest, opt->code[map][0], opt->code[map][1], four, opt->books[map], stream);
    if (!status && m > nearest)
        status = bnb8_cuda_step(&opt->gpu_context, d + nearest, m - nearest, opt->code[map][0], opt->code[map][1], four,
                                opt->books[map], stream);
    free(d);
    return status;
}

bnb8_status bnb8_optimizer_step_tensors(bnb8_optimizer *opt, const int *ids, int count, float lr,
                                        float gnorm_scale, struct CUstream_st *stream) {
    const char *fn = "bnb8_optimizer_step";
    if (!opt || (count > 0 && !ids)) return bnb8_fail(BNB8_ERR_NULL, "%s: opt or ids is NULL", fn);
    if (count < 0) return bnb8_fail(BNB8_ERR_SIZE, "%s: count %d < 0", fn, count);
    if (!bnb8_isfinite(lr) || !(lr >= 0.0f))
        return bnb8_fail(BNB8_ERR_ARG, "%s: lr %g must be finite and >= 0", fn, (double)lr);
    if (!(gnorm_scale >= 0.0f))
        return bnb8_fail(BNB8_ERR_ARG, "%s: gnorm_scale %g must be >= 0 (0: a zero gradient; inf: every element "
                         "left unchanged)", fn, (double)gnorm_scale);
    int gpu_tensors = 0;
    bnb8_status status = BNB8_OK;
    uint8_t *seen = (uint8_t *)calloc((size_t)opt->num_tensors + 1, 1);   // a tensor stepped twice in one call
    if (!seen) return bnb8_fail(BNB8_ERR_NOMEM, "%s", fn);
    for (int i = 0; i < count && !status; i++) {
        if (ids[i] < 0 || ids[i] >= opt->num_tensors) { status = bnb8_fail(BNB8_ERR_ARG, "%s: no tensor %d", fn, ids[i]); break; }
        const bnb8_tensor *t = &opt->tensors[ids[i]];
        if (seen[ids[i]]++) status = bnb8_fail(BNB8_ERR_ARG, "%s: tensor %d ('%s') twice in ids", fn, ids[i], t->name);
        else if (!t->grad) status = bnb8_fail(BNB8_ERR_NULL, "%s: '%s' has no gradient", fn, t->name);
        else status = bnb8_check_decay(fn, t->name, bnb8_tensor_lr(&opt->cfg, t, lr), t->cfg.weight_decay);
        gpu_tensors += t->on_gpu;
    }
    free(seen);
    for (int i = 0; i < count && !status; i++) status = bnb8_rank1_work(&opt->tensors[ids[i]]);
    if (status) return status;
    for (int i = 0; i < count; i++)
        if (!opt->tensors[ids[i]].on_gpu) bnb8_step_tensor_cpu(opt, &opt->tensors[ids[i]], lr, gnorm_scale);
    return gpu_tensors ? bnb8_step_gpu(opt, ids, count, lr, gnorm_scale, stream) : BNB8_OK;
}

bnb8_status bnb8_optimizer_step(bnb8_optimizer *opt, float lr, float gnorm_scale, struct CUstream_st *stream) {
    if (!opt) return bnb8_fail(BNB8_ERR_NULL, "bnb8_optimizer_step: opt is NULL");
    int count = opt->num_tensors;
    int *ids = (int *)malloc(sizeof(int) * (size_t)(count > 0 ? count : 1));
    if (!ids) return bnb8_fail(BNB8_ERR_NOMEM, "bnb8_optimizer_step");
    for (int i = 0; i < count; i++) ids[i] = i;
    bnb8_status status = bnb8_optimizer_step_tensors(opt, ids, count, lr, gnorm_scale, stream);
    free(ids);
    return status;
}

// ------------------------------------------------------------------------------------------------
// Optimizer state files (DESIGN.md §7). Little-endian:
//   header: "BNB8OPT\0", u32 version, u32 optimizer kind, u32 tensor count, u32 CRC-32 of the above
//   per tensor: u32 name length, name, i64 n, [version 3, 4: i64 shard offset, i64 shard total,]
//               u32 format, u32 states, i64 block size, i64 step, [version 4: u64 rounding seed,]
//               u64 bytes, then the tensor's state memory as it lies (gradient-norm history, an
//               fp32 master, absmax (8-bit) or scales (flash) per state, 32-bit states, an int8 or
//               int16 correction, code bytes per state), then the weights as the tensor keeps them
//               (fp32, bf16 or fp16; with a correction the exact weights it corrects), except
//               beside an fp32 master, whose weights are RNE(master) and are rebuilt on load;
//               u32 CRC-32 of the record
//   format: the state format in bits 0..7 (0 32-bit, 1 8-bit, 2 flash, 3 4-bit, 4 flash4); bits 8..15
//           the scale dtype of flash and flash4 states, the map of 8-bit and 4-bit states (0 dynamic, 1 linear);
//           bits 16..23 the correction bytes, or 0x80 for stochastic rounding (no correction); bits
//           24..31 the weights' dtype. Block size: the 8-bit block size (0: one absmax per tensor), 32
//           for flash and flash4 states, the 4-bit block size + row_size 2^16 (rank-1; 0 without).
// A file holds every byte the optimizer needs once: load restores the weights too, so a checkpoint
// needs no other copy of them. Version 1 files (before the weights of every tensor were in them)
// still load: they hold only corrected tensors' weights (all of them, masters' too), and their
// format word gives the dtype only there; the other weights stay as they are.
// Version 3 is version 2 with each record's shard (DESIGN.md §5.6): written when a tensor is a part
// of one (n < total), so that a file of whole tensors stays version 2 (read as offset 0, total n).
// Version 4 is version 3 with each record's rounding seed (DESIGN.md §6.6, 0 for a tensor rounded to
// nearest): written when a tensor is rounded stochastically, whose weights' next roundings it decides.

#define BNB8_STATE_MAGIC "BNB8OPT"
#define BNB8_STATE_VERSION 4u
#define BNB8_RECORD_STOCHASTIC 0x80u   // the format word's correction field of stochastic rounding
#define BNB8_ROW_SIZE_UNIT (INT64_C(1) << 16)   // a 4-bit record's block size field: block + row_size 2^16

// Whether a tensor is a shard of one (shards 1) or is rounded stochastically (shards 0).
static int bnb8_has(const bnb8_optimizer *opt, int shards) {
    for (int i = 0; i < opt->num_tensors; i++)
        if (shards ? opt->tensors[i].n != opt->tensors[i].total : opt->tensors[i].stochastic) return 1;
    return 0;
}
static int bnb8_file_version(const bnb8_optimizer *opt) { return bnb8_has(opt, 0) ? 4 : bnb8_has(opt, 1) ? 3 : 2; }

static uint32_t bnb8_record_format(const bnb8_tensor *t, uint32_t version) {
    uint32_t f = (uint32_t)t->format;
    if (bnb8_companded_format(t->format)) f |= (uint32_t)t->scale_dtype << 8;
    if (t->format == BNB8_STATE_8BIT || t->format == BNB8_STATE_4BIT) f |= (uint32_t)t->cfg.map << 8;
    if (t->correction_bytes) f |= (uint32_t)t->correction_bytes << 16;
    if (t->stochastic) f |= BNB8_RECORD_STOCHASTIC << 16;
    if (t->correction_bytes || version >= 2) f |= (uint32_t)t->param_dtype << 24;
    return f;
}
// The master a format word's correction field names, for the message of a load that mixes them.
static const char *bnb8_master_name(uint32_t field) {
    return field == 0 ? "no master (rounded to nearest)" : field == 1 ? "an int8 correction"
         : field == 2 ? "an int16 correction" : field == 4 ? "an fp32 master"
         : field == BNB8_RECORD_STOCHASTIC ? "stochastic rounding (no master)" : "an unknown master";
}
static const char *bnb8_map_name(uint32_t map) {
    return map == BNB8_MAP_DYNAMIC ? "dynamic" : map == BNB8_MAP_LINEAR ? "linear" : "unknown";
}
static const char *bnb8_scale_name(uint32_t dtype) {
    const char *names[4] = {"f32", "f16", "bf16", "e6m10"};
    return dtype < 4 ? names[dtype] : "unknown";
}
// The record's block size field: 32 for the companded formats; the 4-bit block size plus the row
// size (rank-1, else 0) times 2^16 (row_size < 2^47: checked at add).
static int64_t bnb8_record_block(const bnb8_tensor *t) {
    if (t->format == BNB8_STATE_4BIT) return t->cfg.blocksize + t->row_size * BNB8_ROW_SIZE_UNIT;
    return bnb8_companded_format(t->format) ? BNB8_FLASH_GROUP : t->cfg.blocksize;
}
// Bytes of weights after the state memory in a record of this version.
static size_t bnb8_record_weight_bytes(const bnb8_tensor *t, uint32_t version) {
    int stored = version >= 2 ? t->correction_bytes != 4 : t->correction_bytes != 0;
    return stored ? bnb8_dtype_size(t->param_dtype) * (size_t)t->n : 0;
}
// Bytes of weights a load of this version restores: every tensor's (version 2: from the file, or
// RNE of the fp32 master), corrected ones' only (version 1).
static size_t bnb8_restored_weight_bytes(const bnb8_tensor *t, uint32_t version) {
    return version >= 2 || t->correction_bytes ? bnb8_dtype_size(t->param_dtype) * (size_t)t->n : 0;
}
// Where a load stages the weights, after the state memory: 16-byte aligned.
static size_t bnb8_weights_offset(const bnb8_tensor *t) { return (t->memory_bytes + 15) & ~(size_t)15; }
// The bf16/fp16 weights of a tensor with an fp32 master, RNE(master), from its state memory as staged.
static void bnb8_weights_from_master(const bnb8_tensor *t, void *staged) {
    const float *master = (const float *)((const uint8_t *)staged + ((const uint8_t *)t->correction - (const uint8_t *)t->memory));
    uint16_t *w = (uint16_t *)((uint8_t *)staged + bnb8_weights_offset(t));
    #pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < t->n; i++) w[i] = bnb8_f32_to_narrow(master[i], t->param_dtype);
}

// CRC-32 (IEEE, reflected 0xEDB88320), table entry i: i's byte run through the bit-by-bit division.
// A constant, not built at the first call: several threads saving at once would read a table that
// another is still writing.
static const uint32_t bnb8_crc_table[256] = {
    0x00000000u, 0x77073096u, 0xee0e612cu, 0x990951bau, 0x076dc419u, 0x706af48fu, 0xe963a535u, 0x9e6495a3u,
    0x0edb8832u, 0x79dcb8a4u, 0xe0d5e91eu, 0x97d2d988u, 0x09b64c2bu, 0x7eb17cbdu, 0xe7b82d07u, 0x90bf1d91u,
    0x1db71064u, 0x6ab020f2u, 0xf3b97148u, 0x84be41deu, 0x1adad47du, 0x6ddde4ebu, 0xf4d4b551u, 0x83d385c7u,
    0x136c9856u, 0x646ba8c0u, 0xfd62f97au, 0x8a65c9ecu, 0x14015c4fu, 0x63066cd9u, 0xfa0f3d63u, 0x8d080df5u,
    0x3b6e20c8u, 0x4c69105eu, 0xd56041e4u, 0xa2677172u, 0x3c03e4d1u, 0x4b04d447u, 0xd20d85fdu, 0xa50ab56bu,
    0x35b5a8fau, 0x42b2986cu, 0xdbbbc9d6u, 0xacbcf940u, 0x32d86ce3u, 0x45df5c75u, 0xdcd60dcfu, 0xabd13d59u,
    0x26d930acu, 0x51de003au, 0xc8d75180u, 0xbfd06116u, 0x21b4f4b5u, 0x56b3c423u, 0xcfba9599u, 0xb8bda50fu,
    0x2802b89eu, 0x5f058808u, 0xc60cd9b2u, 0xb10be924u, 0x2f6f7c87u, 0x58684c11u, 0xc1611dabu, 0xb6662d3du,
    0x76dc4190u, 0x01db7106u, 0x98d220bcu, 0xefd5102au, 0x71b18589u, 0x06b6b51fu, 0x9fbfe4a5u, 0xe8b8d433u,
    0x7807c9a2u, 0x0f00f934u, 0x9609a88eu, 0xe10e9818u, 0x7f6a0dbbu, 0x086d3d2du, 0x91646c97u, 0xe6635c01u,
    0x6b6b51f4u, 0x1c6c6162u, 0x856530d8u, 0xf262004eu, 0x6c0695edu, 0x1b01a57bu, 0x8208f4c1u, 0xf50fc457u,
    0x65b0d9c6u, 0x12b7e950u, 0x8bbeb8eau, 0xfcb9887cu, 0x62dd1ddfu, 0x15da2d49u, 0x8cd37cf3u, 0xfbd44c65u,
    0x4db26158u, 0x3ab551ceu, 0xa3bc0074u, 0xd4bb30e2u, 0x4adfa541u, 0x3dd895d7u, 0xa4d1c46du, 0xd3d6f4fbu,
    0x4369e96au, 0x346ed9fcu, 0xad678846u, 0xda60b8d0u, 0x44042d73u, 0x33031de5u, 0xaa0a4c5fu, 0xdd0d7cc9u,
    0x5005713cu, 0x270241aau, 0xbe0b1010u, 0xc90c2086u, 0x5768b525u, 0x206f85b3u, 0xb966d409u, 0xce61e49fu,
    0x5edef90eu, 0x29d9c998u, 0xb0d09822u, 0xc7d7a8b4u, 0x59b33d17u, 0x2eb40d81u, 0xb7bd5c3bu, 0xc0ba6cadu,
    0xedb88320u, 0x9abfb3b6u, 0x03b6e20cu, 0x74b1d29au, 0xead54739u, 0x9dd277afu, 0x04db2615u, 0x73dc1683u,
    0xe3630b12u, 0x94643b84u, 0x0d6d6a3eu, 0x7a6a5aa8u, 0xe40ecf0bu, 0x9309ff9du, 0x0a00ae27u, 0x7d079eb1u,
    0xf00f9344u, 0x8708a3d2u, 0x1e01f268u, 0x6906c2feu, 0xf762575du, 0x806567cbu, 0x196c3671u, 0x6e6b06e7u,
    0xfed41b76u, 0x89d32be0u, 0x10da7a5au, 0x67dd4accu, 0xf9b9df6fu, 0x8ebeeff9u, 0x17b7be43u, 0x60b08ed5u,
    0xd6d6a3e8u, 0xa1d1937eu, 0x38d8c2c4u, 0x4fdff252u, 0xd1bb67f1u, 0xa6bc5767u, 0x3fb506ddu, 0x48b2364bu,
    0xd80d2bdau, 0xaf0a1b4cu, 0x36034af6u, 0x41047a60u, 0xdf60efc3u, 0xa867df55u, 0x316e8eefu, 0x4669be79u,
    0xcb61b38cu, 0xbc66831au, 0x256fd2a0u, 0x5268e236u, 0xcc0c7795u, 0xbb0b4703u, 0x220216b9u, 0x5505262fu,
    0xc5ba3bbeu, 0xb2bd0b28u, 0x2bb45a92u, 0x5cb36a04u, 0xc2d7ffa7u, 0xb5d0cf31u, 0x2cd99e8bu, 0x5bdeae1du,
    0x9b64c2b0u, 0xec63f226u, 0x756aa39cu, 0x026d930au, 0x9c0906a9u, 0xeb0e363fu, 0x72076785u, 0x05005713u,
    0x95bf4a82u, 0xe2b87a14u, 0x7bb12baeu, 0x0cb61b38u, 0x92d28e9bu, 0xe5d5be0du, 0x7cdcefb7u, 0x0bdbdf21u,
    0x86d3d2d4u, 0xf1d4e242u, 0x68ddb3f8u, 0x1fda836eu, 0x81be16cdu, 0xf6b9265bu, 0x6fb077e1u, 0x18b74777u,
    0x88085ae6u, 0xff0f6a70u, 0x66063bcau, 0x11010b5cu, 0x8f659effu, 0xf862ae69u, 0x616bffd3u, 0x166ccf45u,
    0xa00ae278u, 0xd70dd2eeu, 0x4e048354u, 0x3903b3c2u, 0xa7672661u, 0xd06016f7u, 0x4969474du, 0x3e6e77dbu,
    0xaed16a4au, 0xd9d65adcu, 0x40df0b66u, 0x37d83bf0u, 0xa9bcae53u, 0xdebb9ec5u, 0x47b2cf7fu, 0x30b5ffe9u,
    0xbdbdf21cu, 0xcabac28au, 0x53b39330u, 0x24b4a3a6u, 0xbad03605u, 0xcdd70693u, 0x54de5729u, 0x23d967bfu,
    0xb3667a2eu, 0xc4614ab8u, 0x5d681b02u, 0x2a6f2b94u, 0xb40bbe37u, 0xc30c8ea1u, 0x5a05df1bu, 0x2d02ef8du,
};

static uint32_t bnb8_crc32(uint32_t crc, const void *data, size_t len) {
    const uint8_t *p = (const uint8_t *)data;
    crc = ~crc;
    for (size_t i = 0; i < len; i++) crc = bnb8_crc_table[(crc ^ p[i]) & 0xff] ^ (crc >> 8);
    return ~crc;
}

static int bnb8_little_endian(void) { uint16_t one = 1; uint8_t first; memcpy(&first, &one, 1); return first == 1; }

// fwrite / fread that also fold the bytes into a running CRC.
static int bnb8_write(FILE *f, const void *p, size_t len, uint32_t *crc) {
    if (len == 0) return 1;     // p may be NULL for an empty record
    *crc = bnb8_crc32(*crc, p, len);
    return fwrite(p, 1, len, f) == len;
}
static int bnb8_read(FILE *f, void *p, size_t len, uint32_t *crc) {
    if (len == 0) return 1;
    if (fread(p, 1, len, f) != len) return 0;
    *crc = bnb8_crc32(*crc, p, len);
    return 1;
}

// A tensor's state memory in host memory: itself on the CPU, a copy for GPU tensors.
static bnb8_status bnb8_state_to_host(const bnb8_tensor *t, void **host) {
    if (!t->on_gpu) { *host = t->memory; return BNB8_OK; }
    if (!(*host = malloc(t->memory_bytes))) return bnb8_fail(BNB8_ERR_NOMEM, "state copy of '%s'", t->name);
    bnb8_status status = bnb8_cuda_copy(*host, t->memory, t->memory_bytes, 0);
    if (status) free(*host);
    return status;
}

bnb8_status bnb8_write_atomically(const char *path, int (*writer)(FILE *f, const void *ctx), const void *ctx) {
    static int counter;   // with the pid, a name that no earlier call made; O_EXCL makes it this call's alone
    size_t size = strlen(path) + 48;
    char *tmp = (char *)malloc(size);
    if (!tmp) return bnb8_fail(BNB8_ERR_NOMEM, "temporary name for %s", path);
    int fd = -1;
    for (int tries = 0; fd < 0 && tries < 1000; tries++) {
        snprintf(tmp, size, "%s.tmp.%ld.%d", path, (long)getpid(), __atomic_fetch_add(&counter, 1, __ATOMIC_RELAXED));
        fd = open(tmp, O_WRONLY | O_CREAT | O_EXCL, 0666);
        if (fd < 0 && errno != EEXIST) break;
    }
    FILE *f = fd >= 0 ? fdopen(fd, "wb") : NULL;
    if (!f) {
        bnb8_status status = bnb8_fail(BNB8_ERR_IO, "cannot create %s: %s", tmp, strerror(errno));
        if (fd >= 0) { close(fd); remove(tmp); }
        free(tmp);
        return status;
    }
    int wrote = writer(f, ctx), ok = wrote == 0;
    ok &= fflush(f) == 0;
    ok &= fsync(fileno(f)) == 0;
    ok &= fclose(f) == 0;
    bnb8_status status = wrote > 0 ? (bnb8_status)wrote : BNB8_OK;
    if (!status && !ok) status = bnb8_fail(BNB8_ERR_IO, "writing %s failed (disk full?)", tmp);
    if (!status && rename(tmp, path) != 0) status = bnb8_fail(BNB8_ERR_IO, "cannot rename %s to %s: %s", tmp, path, strerror(errno));
    if (status) remove(tmp);
    free(tmp);
    return status;
}

// The state file (DESIGN.md §7), a writer for bnb8_write_atomically: 0, -1 (a write failed) or a status.
static int bnb8_state_writer(FILE *f, const void *ctx) {
    const bnb8_optimizer *opt = (const bnb8_optimizer *)ctx;
    const char *fn = "bnb8_optimizer_save";
    int ok = 1, status = BNB8_OK;
    uint32_t version = (uint32_t)bnb8_file_version(opt);
    uint32_t crc = 0, header[3] = {version, (uint32_t)opt->kind, (uint32_t)opt->num_tensors};
    ok &= bnb8_write(f, BNB8_STATE_MAGIC, 8, &crc);
    ok &= bnb8_write(f, header, sizeof header, &crc);
    uint32_t header_crc = crc;
    ok &= bnb8_write(f, &header_crc, 4, &crc);
    for (int i = 0; ok && !status && i < opt->num_tensors; i++) {
        const bnb8_tensor *t = &opt->tensors[i];
        uint32_t name_len = (uint32_t)strlen(t->name), nstates = (uint32_t)t->nstates;
        uint32_t format = bnb8_record_format(t, version);
        size_t weight_bytes = bnb8_record_weight_bytes(t, version);
        uint64_t bytes = t->memory_bytes + weight_bytes;
        int64_t block = bnb8_record_block(t);
        void *host = NULL, *weights = t->param;
        if ((status = bnb8_state_to_host(t, &host))) break;
        if (weight_bytes && t->on_gpu) {
            if (!(weights = malloc(weight_bytes))) status = bnb8_fail(BNB8_ERR_NOMEM, "%s: weights of '%s'", fn, t->name);
            else if ((status = bnb8_cuda_copy(weights, t->param, weight_bytes, 0))) { free(weights); weights = NULL; }
            if (status) { if (host != t->memory) free(host); break; }
        }
        crc = 0;
        ok &= bnb8_write(f, &name_len, 4, &crc);
        ok &= bnb8_write(f, t->name, name_len, &crc);
        ok &= bnb8_write(f, &t->n, 8, &crc);
        if (version >= 3) ok &= bnb8_write(f, &t->offset, 8, &crc) && bnb8_write(f, &t->total, 8, &crc);
        ok &= bnb8_write(f, &format, 4, &crc);
        ok &= bnb8_write(f, &nstates, 4, &crc);
        ok &= bnb8_write(f, &block, 8, &crc);
        ok &= bnb8_write(f, &t->step, 8, &crc);
        uint64_t seed = t->stochastic ? t->seed : 0;
        if (version >= 4) ok &= bnb8_write(f, &seed, 8, &crc);
        ok &= bnb8_write(f, &bytes, 8, &crc);
        ok &= bnb8_write(f, host, t->memory_bytes, &crc);
        ok &= bnb8_write(f, weights, weight_bytes, &crc);
        uint32_t record_crc = crc;
        ok &= bnb8_write(f, &record_crc, 4, &crc);
        if (host != t->memory) free(host);
        if (weights != t->param) free(weights);
    }
    return status ? status : ok ? 0 : -1;
}

bnb8_status bnb8_optimizer_save(const bnb8_optimizer *opt, const char *path) {
    if (!opt || !path) return bnb8_fail(BNB8_ERR_NULL, "bnb8_optimizer_save: opt or path is NULL");
    if (!bnb8_little_endian()) return bnb8_fail(BNB8_ERR_IO, "bnb8_optimizer_save: big-endian hosts are not supported");
    return bnb8_write_atomically(path, bnb8_state_writer, opt);
}

// The header of a state file, checked (magic, its CRC, the version): header[] its version, kind and
// tensor count, or a format error that names fn and path.
static bnb8_status bnb8_read_header(FILE *f, const char *fn, const char *path, uint32_t header[3]) {
    char magic[8];
    uint32_t crc = 0, stored_crc;
    if (!bnb8_read(f, magic, 8, &crc) || memcmp(magic, BNB8_STATE_MAGIC, 8) != 0)
        return bnb8_fail(BNB8_ERR_FORMAT, "%s: %s is not a bnb8 optimizer state file (bad magic)", fn, path);
    if (!bnb8_read(f, header, 12, &crc)) return bnb8_fail(BNB8_ERR_FORMAT, "%s: %s is truncated in its header", fn, path);
    uint32_t header_crc = crc;
    if (!bnb8_read(f, &stored_crc, 4, &crc) || stored_crc != header_crc)
        return bnb8_fail(BNB8_ERR_FORMAT, "%s: %s: header CRC mismatch", fn, path);
    if (header[0] < 1 || header[0] > BNB8_STATE_VERSION)
        return bnb8_fail(BNB8_ERR_FORMAT, "%s: %s has version %u, expected 1..%u", fn, path, header[0], BNB8_STATE_VERSION);
    return BNB8_OK;
}

// FNV-1a, 64 bits: len bytes at p folded into *h.
static void bnb8_fold(uint64_t *h, const void *p, size_t len) {
    for (size_t i = 0; i < len; i++) *h = (*h ^ ((const uint8_t *)p)[i]) * 0x100000001b3ull;
}
// len bytes read from f into p and folded into *h: 0 when the file ends first.
static int bnb8_read_folded(FILE *f, void *p, size_t len, uint64_t *h) {
    if (len && fread(p, 1, len, f) != len) return 0;
    bnb8_fold(h, p, len);
    return 1;
}

// The header's words, then per record the fields before its payload and its CRC-32, which stands for
// the payload: the payload is seeked over, never read (DESIGN.md §7).
bnb8_status bnb8_optimizer_file_digest(const char *path, uint64_t *digest) {
    const char *fn = "bnb8_optimizer_file_digest";
    if (!path || !digest) return bnb8_fail(BNB8_ERR_NULL, "%s: path or digest is NULL", fn);
    if (!bnb8_little_endian()) return bnb8_fail(BNB8_ERR_IO, "%s: big-endian hosts are not supported", fn);
    FILE *f = bnb8_open_regular(path, fn);
    if (!f) return BNB8_ERR_IO;
    struct stat st;
    uint32_t header[3] = {0, 0, 0};
    uint64_t h = 0xcbf29ce484222325ull;
    bnb8_status status = fstat(fileno(f), &st) == 0 ? bnb8_read_header(f, fn, path, header)
                                                    : bnb8_fail(BNB8_ERR_IO, "%s: cannot stat %s", fn, path);
    if (!status) bnb8_fold(&h, header, sizeof header);
    for (uint32_t i = 0; !status && i < header[2]; i++) {
        // name length, name, n, [offset, total,] format, states, block, step, [seed,] (8 + 8 + 8 + 4 + 4 + 8 + 8 + 8), bytes
        uint8_t fields[BNB8_MAX_NAME + 64];
        uint32_t name_len = 0, crc;
        uint64_t bytes = 0;
        size_t rest = (header[0] >= 3 ? 16 : 0) + 32 + (header[0] >= 4 ? 8 : 0);
        int ok = bnb8_read_folded(f, &name_len, 4, &h) && name_len <= BNB8_MAX_NAME &&
                 bnb8_read_folded(f, fields, name_len + rest, &h) && bnb8_read_folded(f, &bytes, 8, &h);
        off_t at = ok ? ftello(f) : -1;
        ok = ok && at >= 0 && bytes <= (uint64_t)(st.st_size - at) && fseeko(f, (off_t)bytes, SEEK_CUR) == 0 &&
             bnb8_read_folded(f, &crc, 4, &h);
        if (!ok) status = bnb8_fail(BNB8_ERR_FORMAT, "%s: %s: tensor %u is truncated or has a bad name", fn, path, i);
    }
    if (!status && fgetc(f) != EOF) status = bnb8_fail(BNB8_ERR_FORMAT, "%s: %s has bytes after its last tensor", fn, path);
    fclose(f);
    if (!status) *digest = h;
    return status;
}

bnb8_status bnb8_optimizer_write(const bnb8_optimizer *opt, FILE *f) {
    if (!opt || !f) return bnb8_fail(BNB8_ERR_NULL, "bnb8_optimizer_write: opt or f is NULL");
    if (!bnb8_little_endian()) return bnb8_fail(BNB8_ERR_IO, "bnb8_optimizer_write: big-endian hosts are not supported");
    int status = bnb8_state_writer(f, opt);
    return status > 0 ? (bnb8_status)status : status < 0 ? bnb8_fail(BNB8_ERR_IO, "bnb8_optimizer_write: a write failed") : BNB8_OK;
}

FILE *bnb8_open_regular(const char *path, const char *who) {
    int fd = open(path, O_RDONLY | O_NONBLOCK);   // non-blocking: a FIFO would wait for a writer
    if (fd < 0) { bnb8_fail(BNB8_ERR_IO, "%s: cannot open %s: %s", who, path, strerror(errno)); return NULL; }
    struct stat st;
    int ok = fstat(fd, &st) == 0;
    if (!ok || !S_ISREG(st.st_mode)) {
        bnb8_fail(BNB8_ERR_IO, "%s: %s is %s, not a regular file", who, path, !ok ? "unreadable (fstat failed)"
                  : S_ISDIR(st.st_mode) ? "a directory" : S_ISFIFO(st.st_mode) ? "a FIFO" : "a device or socket");
        close(fd);
        return NULL;
    }
    FILE *f = fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) & ~O_NONBLOCK) == 0 ? fdopen(fd, "rb") : NULL;
    if (!f) { bnb8_fail(BNB8_ERR_IO, "%s: cannot open %s: %s", who, path, strerror(errno)); close(fd); }
    return f;
}

// One state (DESIGN.md §7) read from f's position into the optimizer, or nothing changed; the
// messages name path (a file's, or "the stream"). f is left after the state's last byte; whole: f
// must end there (a file of bnb8_optimizer_save), checked before anything changes.
static bnb8_status bnb8_state_read(bnb8_optimizer *opt, FILE *f, const char *fn, const char *path, int whole) {
    ptrdiff_t count = opt->num_tensors;
    void **staged = (void **)calloc((size_t)(count > 0 ? count : 1), sizeof(void *));
    int64_t *steps = (int64_t *)calloc((size_t)(count > 0 ? count : 1), sizeof(int64_t));
    uint64_t *seeds = (uint64_t *)calloc((size_t)(count > 0 ? count : 1), sizeof(uint64_t));
    bnb8_status status = staged && steps && seeds ? BNB8_OK : bnb8_fail(BNB8_ERR_NOMEM, "%s", fn);
    char name[BNB8_MAX_NAME + 1];
    uint32_t crc = 0, header[3] = {0, 0, 0}, stored_crc;
    if (!status) status = bnb8_read_header(f, fn, path, header);
    uint32_t version = header[0];
    if (!status && header[1] != (uint32_t)opt->kind)
        status = bnb8_fail(BNB8_ERR_FORMAT, "%s: %s holds optimizer kind %u, this optimizer is %d", fn, path, header[1], (int)opt->kind);
    if (!status && header[2] != (uint32_t)count)
        status = bnb8_fail(BNB8_ERR_FORMAT, "%s: %s holds %u tensors, %lld are registered%s", fn, path, header[2], (long long)count,
                           version >= 3 || bnb8_has(opt, 1) ? " (shards: a file of another sharding, or number of ranks?)" : "");
    for (ptrdiff_t i = 0; !status && i < count; i++) {
        const bnb8_tensor *t = &opt->tensors[i];
        uint32_t name_len = 0, format, nstates;
        int64_t n, blocksize, offset = 0, total;
        uint64_t bytes;
        crc = 0;
        int ok = bnb8_read(f, &name_len, 4, &crc) && name_len <= BNB8_MAX_NAME && bnb8_read(f, name, name_len, &crc);
        if (!ok) { status = bnb8_fail(BNB8_ERR_FORMAT, "%s: %s: tensor %lld: truncated or bad name", fn, path, (long long)i); break; }
        name[name_len] = 0;
        if (strcmp(name, t->name) != 0) {
            status = bnb8_fail(BNB8_ERR_FORMAT, "%s: %s: tensor %lld is '%s', expected '%s'", fn, path, (long long)i, name, t->name);
            break;
        }
        ok = bnb8_read(f, &n, 8, &crc) && (version < 3 || (bnb8_read(f, &offset, 8, &crc) && bnb8_read(f, &total, 8, &crc))) &&
             bnb8_read(f, &format, 4, &crc) && bnb8_read(f, &nstates, 4, &crc) &&
             bnb8_read(f, &blocksize, 8, &crc) && bnb8_read(f, &steps[i], 8, &crc) &&
             (version < 4 || bnb8_read(f, &seeds[i], 8, &crc)) && bnb8_read(f, &bytes, 8, &crc);
        if (!ok) { status = bnb8_fail(BNB8_ERR_FORMAT, "%s: %s: '%s' is truncated", fn, path, name); break; }
        if (version < 3) total = n;
        if (n < 0 || offset < 0 || total < 0 || offset > total || n > total - offset) {
            status = bnb8_fail(BNB8_ERR_FORMAT, "%s: %s: '%s' holds an impossible element range (%lld elements at %lld of %lld)",
                               fn, path, name, (long long)n, (long long)offset, (long long)total);
            break;
        }
        if ((n != total || t->n != t->total) && (offset != t->offset || total != t->total || n != t->n)) {
            // another sharding (another number of ranks): say both, not just that n differs
            status = bnb8_fail(BNB8_ERR_FORMAT, "%s: %s: '%s' was saved as elements [%lld, %lld) of %lld; this optimizer "
                               "holds [%lld, %lld) of %lld: a file of another sharding (number of ranks) or model; "
                               "load it with the sharding that saved it", fn, path, name, (long long)offset,
                               (long long)offset + n, (long long)total, (long long)t->offset,
                               (long long)(t->offset + t->n), (long long)t->total);
            break;
        }
        size_t file_weights = bnb8_record_weight_bytes(t, version), want_bytes = t->memory_bytes + file_weights;
        uint32_t map = (format >> 8) & 0xffu;   // of an 8-bit or 4-bit record; of a flash record, its scale dtype
        uint32_t master = (format >> 16) & 0xffu, own = (bnb8_record_format(t, version) >> 16) & 0xffu;
        if (master != own) {
            // e.g. a run of stochastic rounding resumed without it: its weights would go on differently
            status = bnb8_fail(BNB8_ERR_FORMAT, "%s: %s: '%s' was saved with %s; this optimizer has %s (cfg.correction_bytes "
                               "must be the one that saved it)", fn, path, name, bnb8_master_name(master), bnb8_master_name(own));
            break;
        }
        if (t->format == BNB8_STATE_8BIT && (format & 0xffu) == BNB8_STATE_8BIT &&
            (map != (uint32_t)t->cfg.map || blocksize != t->cfg.blocksize)) {
            // 8-bit states of another map or block size: say so, not just that the fields differ.
            status = bnb8_fail(BNB8_ERR_FORMAT, "%s: %s: '%s' was saved with the %s map and block size %lld; this "
                               "optimizer has the %s map and block size %lld (0: one absmax per tensor)", fn, path, name,
                               bnb8_map_name(map), (long long)blocksize, bnb8_map_name((uint32_t)t->cfg.map),
                               (long long)t->cfg.blocksize);
            break;
        }
        if (t->format == BNB8_STATE_4BIT && (format & 0xffu) == BNB8_STATE_4BIT && map != (uint32_t)t->cfg.map) {
            // 4-bit states whose v has the map with zero (the ablation) or not: say which.
            status = bnb8_fail(BNB8_ERR_FORMAT, "%s: %s: '%s' was saved with the 4-bit %s map; this optimizer has the %s "
                               "map (cfg.map: linear puts zero in v's map)", fn, path, name, bnb8_map_name(map),
                               bnb8_map_name((uint32_t)t->cfg.map));
            break;
        }
        if (t->format == BNB8_STATE_4BIT && (format & 0xffu) == BNB8_STATE_4BIT && blocksize != bnb8_record_block(t)) {
            // 4-bit states of another block size or matrix shape (rank-1): say which.
            status = bnb8_fail(BNB8_ERR_FORMAT, "%s: %s: '%s' was saved with 4-bit blocks of %lld and row_size %lld (0: no "
                               "rank-1 normalization); this optimizer has blocks of %lld and row_size %lld", fn, path, name,
                               (long long)(blocksize % BNB8_ROW_SIZE_UNIT), (long long)(blocksize / BNB8_ROW_SIZE_UNIT),
                               (long long)t->cfg.blocksize, (long long)t->row_size);
            break;
        }
        if (bnb8_companded_format(t->format) && (format & 0xffu) == (uint32_t)t->format && map != (uint32_t)t->scale_dtype) {
            // e.g. a file from before e6m10 became the default: say which scales to configure.
            status = bnb8_fail(BNB8_ERR_FORMAT, "%s: %s: '%s' was saved with %s group scales; this optimizer has %s "
                               "ones (set cfg.scale_dtype to load it)", fn, path, name, bnb8_scale_name(map),
                               bnb8_scale_name((uint32_t)t->scale_dtype));
            break;
        }
        if (n != t->n || format != bnb8_record_format(t, version) || nstates != (uint32_t)t->nstates ||
            (t->format != BNB8_STATE_32BIT && blocksize != bnb8_record_block(t)) || bytes != want_bytes) {
            status = bnb8_fail(BNB8_ERR_FORMAT, "%s: %s: '%s' has n %lld, format 0x%x, %u states, block %lld, %llu bytes; "
                               "registered: n %lld, format 0x%x, %d states, block %lld, %zu bytes", fn, path, name,
                               (long long)n, format, nstates, (long long)blocksize, (unsigned long long)bytes,
                               (long long)t->n, bnb8_record_format(t, version), t->nstates, (long long)bnb8_record_block(t), want_bytes);
            break;
        }
        if (steps[i] < 0 || steps[i] > BNB8_MAX_ELEMENTS) {   // stepping on could overflow a huge count
            status = bnb8_fail(BNB8_ERR_FORMAT, "%s: %s: '%s' has step count %lld", fn, path, name, (long long)steps[i]);
            break;
        }
        // staged: the state memory, then (aligned) the weights the load restores, from the file or
        // rebuilt from an fp32 master
        size_t restored = bnb8_restored_weight_bytes(t, version), at = bnb8_weights_offset(t);
        size_t staged_bytes = restored ? at + restored : t->memory_bytes;
        // at least a byte: a record with no state and no weights still gets a place to read zero bytes into
        if (!(staged[i] = malloc(staged_bytes ? staged_bytes : 1))) { status = bnb8_fail(BNB8_ERR_NOMEM, "%s", fn); break; }
        uint32_t record_crc = 0;
        if (!bnb8_read(f, staged[i], t->memory_bytes, &crc) || !bnb8_read(f, (uint8_t *)staged[i] + at, file_weights, &crc) ||
            (record_crc = crc, !bnb8_read(f, &stored_crc, 4, &crc))) {
            status = bnb8_fail(BNB8_ERR_FORMAT, "%s: %s: '%s' is truncated", fn, path, name);
            break;
        }
        if (stored_crc != record_crc) status = bnb8_fail(BNB8_ERR_FORMAT, "%s: %s: '%s': CRC mismatch", fn, path, name);
        if (!status && restored > file_weights) bnb8_weights_from_master(t, staged[i]);
    }
    if (!status && whole && fgetc(f) != EOF) status = bnb8_fail(BNB8_ERR_FORMAT, "%s: %s has bytes after its last tensor", fn, path);
    // Every record is valid: only now change the optimizer.
    for (ptrdiff_t i = 0; !status && i < count; i++) {
        bnb8_tensor *t = &opt->tensors[i];
        size_t weight_bytes = bnb8_restored_weight_bytes(t, version);
        const uint8_t *weights = weight_bytes ? (const uint8_t *)staged[i] + bnb8_weights_offset(t) : NULL;
        if (t->on_gpu) {
            status = bnb8_cuda_copy(t->memory, staged[i], t->memory_bytes, 1);
            if (!status && weight_bytes) status = bnb8_cuda_copy(t->param, weights, weight_bytes, 1);
        } else {
            if (t->memory_bytes) memcpy(t->memory, staged[i], t->memory_bytes);
            if (weight_bytes) memcpy(t->param, weights, weight_bytes);
        }
        t->step = steps[i];
        if (t->stochastic) t->seed = seeds[i];   // the rounding goes on as the saved run's would
    }
    for (ptrdiff_t i = 0; staged && i < count; i++) free(staged[i]);
    free(staged);
    free(steps);
    free(seeds);
    return status;
}

bnb8_status bnb8_optimizer_read(bnb8_optimizer *opt, FILE *f) {
    const char *fn = "bnb8_optimizer_read";
    if (!opt || !f) return bnb8_fail(BNB8_ERR_NULL, "%s: opt or f is NULL", fn);
    if (!bnb8_little_endian()) return bnb8_fail(BNB8_ERR_IO, "%s: big-endian hosts are not supported", fn);
    return bnb8_state_read(opt, f, fn, "the stream", 0);
}

bnb8_status bnb8_optimizer_load(bnb8_optimizer *opt, const char *path) {
    const char *fn = "bnb8_optimizer_load";
    if (!opt || !path) return bnb8_fail(BNB8_ERR_NULL, "%s: opt or path is NULL", fn);
    if (!bnb8_little_endian()) return bnb8_fail(BNB8_ERR_IO, "%s: big-endian hosts are not supported", fn);
    FILE *f = bnb8_open_regular(path, fn);
    if (!f) return BNB8_ERR_IO;
    bnb8_status status = bnb8_state_read(opt, f, fn, path, 1);
    fclose(f);
    return status;
}
