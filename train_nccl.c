/*
train_nccl.c — the trainer on several GPUs: data parallel over NCCL with the optimizer states
sharded (ZeRO-1; DESIGN.md §8.8). One process per GPU, launched by `mpirun -np N` (OpenMPI's
OMPI_COMM_WORLD_* variables; the trainer does not link MPI) or by hand with BNB8_RANK / BNB8_RANKS
(and BNB8_LOCAL_RANK, default the rank); rank 0 hands NCCL's id to the others through a file
(BNB8_NCCL_ID, default /tmp/bnb8_nccl_<job>.id). The path is on whenever those variables say so,
with one rank too (the parity test against the plain GPU path).

Each step: every rank runs forward and backward on its share of the batch (the r-th of every N
batches of the loader); the gradients of every optimizer tensor are copied into one flat buffer G
where each tensor starts at a multiple of 4096 elements, G is reduce-scattered (average) so that
rank r holds [r S, (r + 1) S) of it; the rank's optimizer holds exactly its shards of the tensors
(cfg.shard_offset / shard_total: boundaries at multiples of 4096 of each tensor, so every state
format's blocks stay whole) and steps them all in one launch; the updated weights of its shards go
into its part of G, G is all-gathered, and every tensor is copied back into the model's weights.
The clip norm is the previous step's (-N prev): the optimizer sums g^2 of its shards as it reads
them; ranks all-gather their sums and add them in rank order.

Built with -DTRAIN_NCCL when the Makefile finds nccl.h and libnccl; without it, asking for ranks is
refused with a message. Not yet: gradient release (-R 1), checkpoints (-o), -X with several ranks.
*/
#define _POSIX_C_SOURCE 200809L
#include "train_gpt2_8bit.h"
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>
#include <time.h>
#include <unistd.h>
#include <sys/stat.h>

#define NCCL_ALIGN 4096   // elements: a multiple of every 8-bit block size and of flash's groups of 32

static const char *env_first(const char *a, const char *b) { const char *v = getenv(a); return v ? v : getenv(b); }

// G's layout: tensor j (n[j] elements) at at[j], a multiple of NCCL_ALIGN; the elements per rank S,
// a multiple of NCCL_ALIGN, ranks S >= the end of the last tensor.
int64_t nccl_layout(const int64_t *n, int count, int ranks, int64_t *at) {
    int64_t end = 0;
    for (int j = 0; j < count; j++) { at[j] = end; end += (n[j] + NCCL_ALIGN - 1) / NCCL_ALIGN * NCCL_ALIGN; }
    return (end / NCCL_ALIGN + ranks - 1) / ranks * NCCL_ALIGN;
}

// The part of a tensor at `at` of n elements that rank holds, [*offset, *offset + *count) of the
// tensor; 0 when none.
int nccl_part(int64_t at, int64_t n, int64_t S, int rank, int64_t *offset, int64_t *count) {
    int64_t lo = rank * S, hi = lo + S, from = at > lo ? at : lo, to = at + n < hi ? at + n : hi;
    if (from >= to) return 0;
    *offset = from - at;
    *count = to - from;
    return 1;
}

#ifndef TRAIN_NCCL
int nccl_setup(Trainer *t) {
    const char *ranks = env_first("OMPI_COMM_WORLD_SIZE", "BNB8_RANKS");
    t->nccl = NULL;
    if (ranks) return train_fail("%s=%s asks for data parallel training over NCCL: this trainer was built without NCCL "
                                 "(make on a machine with the CUDA toolkit's nccl.h and libnccl)",
                                 getenv("OMPI_COMM_WORLD_SIZE") ? "OMPI_COMM_WORLD_SIZE" : "BNB8_RANKS", ranks);
    return 0;
}
void nccl_pick_device(void) {}
int nccl_open(Trainer *t) { (void)t; return train_fail("built without NCCL"); }
int nccl_share(Trainer *t, int j, int64_t *offset, int64_t *count, void **grad) {
    (void)t; (void)j; (void)offset; (void)count; (void)grad; return 1;
}
int nccl_step(Trainer *t, float lr, double *norm, int *skipped) {
    (void)t; (void)lr; (void)norm; (void)skipped; return train_fail("built without NCCL");
}
void nccl_batch(Trainer *t) { loader_next(&t->loader); }
int nccl_mean_loss(Trainer *t, float *loss) { (void)t; (void)loss; return 0; }
double nccl_extra_bytes(const Trainer *t) { (void)t; return 0.0; }
void nccl_print_memory(const Trainer *t) { (void)t; }
void nccl_free(Trainer *t) { (void)t; }
#else
#include <cuda_runtime_api.h>
#include <nccl.h>

typedef struct { int j; int64_t offset, count; } Share;   // a shard this rank registered
struct Nccl {
    int rank, ranks, local;
    ncclComm_t comm;
    ncclDataType_t type;
    size_t es;                 // bytes of a weight and of a gradient (the same on the GPU)
    int count;                 // optimizer tensors (the plain path's numbering)
    void **param, **grad;      // (count) where the model keeps each tensor's weights and gradients
    int64_t *n, *at;           // (count) its elements and its offset in G
    int64_t S;                 // elements of G per rank; G holds ranks * S
    void *G;                   // the flat buffer the gradients and weights pass through
    Share *shares;             // (num_shares) in registration order
    int num_shares;
    double *dev_sums;          // (ranks + 1) device: this rank's sum, then everyone's
    float *dev_loss;           // (1) device
    int *inputs, *targets;     // (B T) this rank's batch
};

static int nccl_check(ncclResult_t r, const char *what) {
    return r == ncclSuccess ? 0 : train_fail("NCCL %s: %s", what, ncclGetErrorString(r));
}
static int cuda_check(cudaError_t e, const char *what) {
    return e == cudaSuccess ? 0 : train_fail("CUDA %s: %s", what, cudaGetErrorString(e));
}

// The id file: BNB8_NCCL_ID, or one per OpenMPI job in /tmp.
static void nccl_id_path(char *path, size_t size) {
    const char *given = getenv("BNB8_NCCL_ID"), *job = env_first("PMIX_NAMESPACE", "OMPI_MCA_ess_base_jobid");
    if (given) { snprintf(path, size, "%s", given); return; }
    snprintf(path, size, "/tmp/bnb8_nccl_%s.id", job ? job : "run");
    for (char *p = path + 5; *p; p++) if (*p == '/' || *p == ' ') *p = '_';
}

// Rank 0 writes the id (tmp + rename); the others wait for a file no older than a minute before
// their start (a crashed run's is older, or removed: rank 0 removes it once every rank has joined).
static int nccl_rendezvous(Nccl *c, ncclUniqueId *id) {
    char path[512];
    nccl_id_path(path, sizeof path);
    if (c->rank == 0) {
        char tmp[600];
        snprintf(tmp, sizeof tmp, "%s.tmp", path);
        if (nccl_check(ncclGetUniqueId(id), "ncclGetUniqueId")) return -1;
        FILE *f = fopen(tmp, "wb");
        int ok = f && fwrite(id, sizeof *id, 1, f) == 1;
        if (f) ok &= fclose(f) == 0;
        if (!ok || rename(tmp, path) != 0) return train_fail("NCCL rendezvous: cannot write %s", path);
        return 0;
    }
    time_t start = time(NULL);
    for (int tries = 0; tries < 1200; tries++) {   // 120 s
        struct stat st;
        FILE *f = stat(path, &st) == 0 && st.st_mtime >= start - 60 ? fopen(path, "rb") : NULL;
        int ok = f && fread(id, sizeof *id, 1, f) == 1;
        if (f) fclose(f);
        if (ok) return 0;
        nanosleep(&(struct timespec){0, 100000000L}, NULL);
    }
    return train_fail("NCCL rendezvous: rank %d waited 120 s for rank 0's %s (BNB8_NCCL_ID)", c->rank, path);
}

// Before anything touches CUDA (main): the rank's GPU, so that no rank makes a context on GPU 0.
// The GPU of this rank on its host: the local rank (OpenMPI's, BNB8_LOCAL_RANK), else the rank.
static int nccl_local_rank(void) {
    const char *v = env_first("OMPI_COMM_WORLD_LOCAL_RANK", "BNB8_LOCAL_RANK");
    if (!v) v = env_first("OMPI_COMM_WORLD_RANK", "BNB8_RANK");
    return v ? atoi(v) : 0;
}
void nccl_pick_device(void) {
    int devices = 0;
    if (env_first("OMPI_COMM_WORLD_SIZE", "BNB8_RANKS") && cudaGetDeviceCount(&devices) == cudaSuccess && devices > 0)
        cudaSetDevice(nccl_local_rank() % devices);
}

// From the environment: the ranks, this process's GPU, the communicator; the settings the path
// does not support yet refused. t->nccl stays NULL when no rank variables are set.
int nccl_setup(Trainer *t) {
    TrainArgs *a = &t->a;
    const char *size = env_first("OMPI_COMM_WORLD_SIZE", "BNB8_RANKS"), *rank = env_first("OMPI_COMM_WORLD_RANK", "BNB8_RANK");
    t->nccl = NULL;
    if (!size) return 0;
    int ranks = atoi(size), r = rank ? atoi(rank) : -1, devices = 0;
    if (ranks < 1 || r < 0 || r >= ranks) return train_fail("NCCL: rank %s of %s (BNB8_RANK, BNB8_RANKS): need 0 <= rank < ranks", rank ? rank : "unset", size);
    if (a->device != 2) return train_fail("data parallel training over NCCL (%d ranks) runs on the GPU (-D gpu)", ranks);
    if (a->release) return train_fail("gradient release (-R 1) over NCCL is not there yet: use -R 0 with %d ranks", ranks);
    if (a->clip_rule == CLIP_EXACT || a->clip_rule == CLIP_EST)
        return train_fail("-N %s over NCCL is not there yet (the norm of the reduced gradients): use -N prev",
                          a->clip_rule == CLIP_EXACT ? "exact" : "est");
    if (a->out_dir[0] || a->resume) return train_fail("checkpoints (-o) over NCCL are not there yet");
    if (a->parity) return train_fail("-P fp32 over NCCL is not there yet");
    Nccl *c = (Nccl *)calloc(1, sizeof *c);
    if (!c) return train_fail("out of memory");
    t->nccl = c;
    c->rank = r; c->ranks = ranks; c->local = nccl_local_rank();
    t->rule = CLIP_PREV;
    if (r > 0) a->verbose = 0;   // rank 0 prints
    if (cuda_check(cudaGetDeviceCount(&devices), "cudaGetDeviceCount")) return -1;
    if (devices < 1) return train_fail("NCCL: no GPU");
    if (cuda_check(cudaSetDevice(c->local % devices), "cudaSetDevice")) return -1;
    ncclUniqueId id;
    if (nccl_rendezvous(c, &id)) return -1;
    if (nccl_check(ncclCommInitRank(&c->comm, ranks, id, r), "ncclCommInitRank")) return -1;
    if (r == 0) {   // every rank has joined: the id file has served
        char path[512];
        nccl_id_path(path, sizeof path);
        remove(path);
    }
    c->inputs = (int *)malloc(sizeof(int) * (size_t)(a->B * a->T));
    c->targets = (int *)malloc(sizeof(int) * (size_t)(a->B * a->T));
    if (!c->inputs || !c->targets) return train_fail("out of memory");
    return 0;
}

// G's layout over the optimizer tensors of the GPU model (t->param, t->grad set): each at a
// multiple of NCCL_ALIGN, ranks S elements each. Called before the optimizer is built.
int nccl_open(Trainer *t) {
    Nccl *c = t->nccl;
    const GPT2 *m = &t->model;
    c->es = bnb8_dtype_size(t->lay.weights);
    if (bnb8_dtype_size(t->lay.grads) != c->es) return train_fail("NCCL: weights and gradients of different sizes");
    c->type = t->lay.weights == BNB8_BF16 ? ncclBfloat16 : ncclFloat32;
    c->count = 0;
    for (int i = 0; i < GPT2_NUM_PARAMS; i++) if (m->param_sizes[i]) c->count += (int)tensor_slices(t, i);
    c->param = (void **)calloc((size_t)c->count, sizeof(void *));
    c->grad = (void **)calloc((size_t)c->count, sizeof(void *));
    c->n = (int64_t *)calloc((size_t)c->count, sizeof(int64_t));
    c->at = (int64_t *)calloc((size_t)c->count, sizeof(int64_t));
    c->shares = (Share *)calloc((size_t)c->count, sizeof(Share));
    if (!c->param || !c->grad || !c->n || !c->at || !c->shares) return train_fail("out of memory");
    int j = 0;
    for (int i = 0; i < GPT2_NUM_PARAMS; i++) {
        if (!m->param_sizes[i]) continue;
        int64_t slices = tensor_slices(t, i), n = m->param_sizes[i] / slices;
        for (int64_t l = 0; l < slices; l++, j++) {
            c->param[j] = (char *)t->param[i] + c->es * (size_t)(l * n);
            c->grad[j] = (char *)t->grad[i] + c->es * (size_t)(l * n);
            c->n[j] = n;
        }
    }
    c->S = nccl_layout(c->n, c->count, c->ranks, c->at);
    size_t bytes = c->es * (size_t)(c->S * c->ranks);
    if (cuda_check(cudaMalloc(&c->G, bytes), "cudaMalloc of the gradient and weight exchange buffer") ||
        cuda_check(cudaMemset(c->G, 0, bytes), "cudaMemset") ||
        cuda_check(cudaMalloc((void **)&c->dev_sums, sizeof(double) * (size_t)(c->ranks + 1)), "cudaMalloc") ||
        cuda_check(cudaMalloc((void **)&c->dev_loss, sizeof(float)), "cudaMalloc"))
        return -1;
    return 0;
}

// Optimizer tensor j's part on this rank: [*offset, *offset + *count) of its n elements, its
// gradients in G. 0 when the rank holds none of it (then it is not registered here).
int nccl_share(Trainer *t, int j, int64_t *offset, int64_t *count, void **grad) {
    Nccl *c = t->nccl;
    if (!nccl_part(c->at[j], c->n[j], c->S, c->rank, offset, count)) return 0;
    *grad = (char *)c->G + c->es * (size_t)(c->at[j] + *offset);
    c->shares[c->num_shares++] = (Share){j, *offset, *count};
    return 1;
}

// This rank's batch: the rank-th of the next ranks batches of the loader (one rank: the next).
void nccl_batch(Trainer *t) {
    Nccl *c = t->nccl;
    size_t bt = sizeof(int) * (size_t)(t->a.B * t->a.T);
    for (int r = 0; r < c->ranks; r++) {
        loader_next(&t->loader);
        if (r == c->rank) { memcpy(c->inputs, t->loader.inputs, bt); memcpy(c->targets, t->loader.targets, bt); }
    }
    memcpy(t->loader.inputs, c->inputs, bt);
    memcpy(t->loader.targets, c->targets, bt);
}

// The mean of the ranks' losses (one rank: its own, unchanged).
int nccl_mean_loss(Trainer *t, float *loss) {
    Nccl *c = t->nccl;
    float sum = 0.0f;
    struct CUstream_st *s = gpt2_cuda_stream(t->gpu.model);
    if (cuda_check(cudaMemcpyAsync(c->dev_loss, loss, sizeof(float), cudaMemcpyHostToDevice, (cudaStream_t)s), "loss copy") ||
        nccl_check(ncclAllReduce(c->dev_loss, c->dev_loss, 1, ncclFloat32, ncclSum, c->comm, (cudaStream_t)s), "ncclAllReduce") ||
        cuda_check(cudaMemcpyAsync(&sum, c->dev_loss, sizeof(float), cudaMemcpyDeviceToHost, (cudaStream_t)s), "loss copy") ||
        cuda_check(cudaStreamSynchronize((cudaStream_t)s), "cudaStreamSynchronize"))
        return -1;
    *loss = sum / (float)c->ranks;
    return 0;
}

// The step: gradients into G, reduce-scatter (average), this rank's shards stepped in one launch,
// their weights into G, all-gather, every tensor's weights back into the model. *norm: the norm of
// this step's mean gradient from the ranks' sums of g^2, added in rank order (the next step clips
// with it).
int nccl_step(Trainer *t, float lr, double *norm, int *skipped) {
    Nccl *c = t->nccl;
    cudaStream_t s = (cudaStream_t)gpt2_cuda_stream(t->gpu.model);
    char *G = (char *)c->G;
    *norm = NAN;
    *skipped = 0;
    for (int j = 0; j < c->count; j++)
        if (cuda_check(cudaMemcpyAsync(G + c->es * (size_t)c->at[j], c->grad[j], c->es * (size_t)c->n[j], cudaMemcpyDeviceToDevice, s), "gradient copy")) return -1;
    if (nccl_check(ncclReduceScatter(G, G + c->es * (size_t)(c->rank * c->S), (size_t)c->S, c->type, ncclAvg, c->comm, s), "ncclReduceScatter"))
        return -1;
    if (bnb8_optimizer_step(t->opt, lr, step_scale(t->prev_norm, t->a.grad_clip, t->a.accum), (struct CUstream_st *)s))
        return train_fail("optimizer step: %s", bnb8_last_error());
    for (int k = 0; k < c->num_shares; k++) {
        const Share *h = &c->shares[k];
        size_t off = c->es * (size_t)h->offset;
        if (cuda_check(cudaMemcpyAsync(G + c->es * (size_t)c->at[h->j] + off, (char *)c->param[h->j] + off, c->es * (size_t)h->count,
                                       cudaMemcpyDeviceToDevice, s), "weight copy")) return -1;
    }
    if (nccl_check(ncclAllGather(G + c->es * (size_t)(c->rank * c->S), G, (size_t)c->S, c->type, c->comm, s), "ncclAllGather")) return -1;
    for (int j = 0; j < c->count; j++)
        if (cuda_check(cudaMemcpyAsync(c->param[j], G + c->es * (size_t)c->at[j], c->es * (size_t)c->n[j], cudaMemcpyDeviceToDevice, s), "weight copy")) return -1;
    // the norm: this rank's sums in tensor order, then the ranks' in rank order
    int count = bnb8_optimizer_count(t->opt);
    if (bnb8_optimizer_sum_squares(t->opt, t->sums)) return train_fail("gradient norm: %s", bnb8_last_error());
    double mine = 0.0, total = 0.0, *all = (double *)malloc(sizeof(double) * (size_t)c->ranks);
    if (!all) return train_fail("out of memory");
    for (int i = 0; i < count; i++) mine += t->sums[i];
    int bad = cuda_check(cudaMemcpyAsync(c->dev_sums, &mine, sizeof(double), cudaMemcpyHostToDevice, s), "sum copy") ||
              nccl_check(ncclAllGather(c->dev_sums, c->dev_sums + 1, 1, ncclFloat64, c->comm, s), "ncclAllGather") ||
              cuda_check(cudaMemcpyAsync(all, c->dev_sums + 1, sizeof(double) * (size_t)c->ranks, cudaMemcpyDeviceToHost, s), "sum copy") ||
              cuda_check(cudaStreamSynchronize(s), "cudaStreamSynchronize");
    for (int r = 0; !bad && r < c->ranks; r++) total += all[r];
    free(all);
    if (bad) return -1;
    *norm = sqrt(total) / (double)t->a.accum;
    return 0;
}

// Device bytes beyond the optimizer's accounting (which holds this rank's shards): G, and the
// model's weights outside this rank's shards.
double nccl_extra_bytes(const Trainer *t) {
    const Nccl *c = t->nccl;
    bnb8_memory mem = bnb8_optimizer_memory(t->opt, 0);
    return (double)c->es * (double)(c->S * c->ranks) + (double)c->es * (double)t->model.num_parameters - mem.weights;
}

void nccl_print_memory(const Trainer *t) {
    const Nccl *c = t->nccl;
    bnb8_memory mem = bnb8_optimizer_memory(t->opt, 0);
    double P = (double)t->model.num_parameters, full = (double)c->es * P, G = (double)c->es * (double)(c->S * c->ranks);
    printf("  per GPU, rank %d of %d (NCCL, ZeRO-1: this rank's shards of %lld of %lld parameters, %d tensor parts):\n",
           c->rank, c->ranks, (long long)mem.params, (long long)t->model.num_parameters, c->num_shares);
    printf("    weights %.3f + gradients %.3f + exchange buffer %.3f + master %.3f + optimizer state %.3f = %.3f bytes per parameter\n",
           full / P, full / P, G / P, mem.correction / P, mem.states / P, (2.0 * full + G + mem.correction + mem.states) / P);
}

void nccl_free(Trainer *t) {
    Nccl *c = t->nccl;
    if (!c) return;
    if (c->comm) ncclCommDestroy(c->comm);
    if (c->G) cudaFree(c->G);
    if (c->dev_sums) cudaFree(c->dev_sums);
    if (c->dev_loss) cudaFree(c->dev_loss);
    free(c->param); free(c->grad); free(c->n); free(c->at); free(c->shares); free(c->inputs); free(c->targets);
    free(c);
    t->nccl = NULL;
}
#endif
