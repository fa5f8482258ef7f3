/*
trainer/nccl.c — the trainer on several GPUs: data parallel over NCCL with the optimizer states
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
The clip norm is this step's (-N exact, the default without release): after the reduce-scatter each
rank sums the squares of its part of G (gpt2_cuda_sum_squares), the ranks all-gather their sums and add
them in rank order, so that every rank steps (or skips a non-finite step) alike; or the previous
step's (-N prev, the default under release): the optimizer sums g^2 of its shards as it reads them,
added across ranks the same way.

Gradient release (-R 1): G is laid out group by group (backward's groups: the final LayerNorm, each
layer, the embeddings; each group's tensors at multiples of 4096, its own elements per rank), in two
buffers of the largest group, group g in buffer g % 2. As backward finishes group g (its callback, on
the model's stream), the group's gradients are copied out of the model's shared slices into the
buffer on that stream (backward overwrites them next); the exchange stream then reduce-scatters the
buffer, steps this rank's shards of the group, all-gathers their weights and copies them back into
the model, while backward goes on with the layers below (which read only their own weights). Every
NCCL call of a release run is on the exchange stream, so the ranks issue them in one order; the model's
stream waits for the last exchange before the next forward. Per GPU: the bf16 weights, the release
slices, the two buffers, and 1/N of the master and states.

Checkpoints (-o): each rank writes its optimizer file (its shards: optim_s.rank<r>of<N>.bin); once
every rank has reported its file written, rank 0 writes the trainer state, bound to the ranks' files by
their digests, and DONE_s. Rank 0 alone holds the directory's lock. On resume every rank opens the
newest complete checkpoint; if one rank's files are damaged or missing, every rank falls back to the
one before (nccl_agree); then the ranks all-gather the weights (each restored only its shards).
Another number of ranks is refused with a message.

Built with -DTRAIN_NCCL when the Makefile finds nccl.h and libnccl; without it, asking for ranks is
refused with a message. The fp32 parity model (-P fp32) is refused here, and -N exact with release
everywhere. The final weights (-X) of several ranks: rank 0 gathers every rank's fp32 masters
(nccl_gather_masters).

-N est (the default under release): each backward group's sum of squares over the ranks: each rank's
fixed partial sums of its shards (gpt2_cuda_clip_partials), all-gathered, added in one fixed order on
every rank into the group's sum and scale (gpt2_cuda_clip_scale_parts), which the group's step reads.
*/
#define _POSIX_C_SOURCE 200809L
#include "nccl.h"
#include "tensors.h"
#include "checkpoint.h"
#include "clip.h"
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>
#include <time.h>
#include <unistd.h>
#include <sys/stat.h>

static const char *env_first(const char *a, const char *b) { const char *v = getenv(a); return v ? v : getenv(b); }

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
int nccl_open(Trainer *t) { (void)t; return 0; }
int nccl_share(Trainer *t, int j, int64_t *offset, int64_t *count, void **grad) {
    (void)t; (void)j; (void)offset; (void)count; (void)grad; return 1;
}
int nccl_step(Trainer *t, float lr, double *norm, int *skipped) {
    (void)t; (void)lr; (void)norm; (void)skipped; return train_fail("built without NCCL");
}
int nccl_release_group(Trainer *t, int g, float lr, float scale, struct CUstream_st *stream) {
    (void)t; (void)g; (void)lr; (void)scale; (void)stream; return train_fail("built without NCCL");
}
void nccl_batch(Trainer *t) { loader_next(&t->loader); }
int nccl_mean_loss(Trainer *t, float *loss) { (void)t; (void)loss; return 0; }
int nccl_total_count(Trainer *t, int64_t *count) { (void)t; (void)count; return 0; }
double nccl_extra_bytes(const Trainer *t) { (void)t; return 0.0; }
void nccl_print_memory(const Trainer *t) { (void)t; }
void nccl_free(Trainer *t) { (void)t; }
int nccl_ranks(const Trainer *t, int *rank) { (void)t; if (rank) *rank = 0; return 0; }
int nccl_agree(Trainer *t, int status) { (void)t; return status; }
int nccl_gather_weights(Trainer *t) { (void)t; return 0; }
int nccl_masters(Trainer *t, char *where, size_t size) { (void)t; (void)where; (void)size; return train_fail("built without NCCL"); }
int nccl_barrier(Trainer *t) { (void)t; return 0; }
int nccl_gather_masters(Trainer *t, float *out) { (void)t; (void)out; return train_fail("built without NCCL"); }
int nccl_checkpoint_save(Trainer *t, const TrainerState *s, int64_t *bytes, int64_t *own) {
    (void)t; (void)s; (void)bytes; (void)own; return train_fail("built without NCCL");
}
void nccl_hint(void) {}
#else
#include <cuda_runtime_api.h>
#include <nccl.h>

// A shard this rank registered: [offset, offset + count) of tensor j, and its place in its group's
// buffer (the gradients the optimizer reads after the reduce-scatter; the weights before the all-gather).
typedef struct { int j; int64_t offset, count; char *place; } Share;
struct Nccl {
    int rank, ranks, local;
    ncclComm_t comm;
    ncclDataType_t type;
    size_t es;                 // bytes of a weight and of a gradient (the same on the GPU)
    int count;                 // optimizer tensors (the plain path's numbering)
    void **param, **grad;      // (count) where the model keeps each tensor's weights and gradients
    int64_t *n, *at;           // (count) its elements and its offset in its group's layout
    int64_t S;                 // elements of G per rank; G holds ranks * S (release: the largest group's)
    void *G;                   // the flat buffer the gradients and weights pass through
    Share *shares;             // (num_shares) in registration order: share k is the optimizer's id k
    int num_shares;
    int *share_of;             // (count) tensor j's share index (its optimizer id), -1: none on this rank
    int groups;                // 1 (every tensor at once), or under release backward's L + 2 groups
    int *group;                // (count) tensor j's group
    int64_t *group_S;          // (groups) each group's elements per rank
    void *G2;                  // release: the second buffer (odd groups)
    cudaStream_t xs;           // release: the exchange stream
    cudaEvent_t ready[2], done[2];   // release: a buffer's gradients copied in; its exchange finished
    int events;                // release: the events and the stream exist
    float *dev_loss;           // (1) device
    int *inputs, *targets;     // (B T) this rank's batch
    double *dev_gather;        // (NCCL_GATHER (ranks + 1)) device: nccl_gather's, made at its first call
    double *dev_partial;       // -N est: (ranks + 1) x GPT2_CUDA_CLIP_PARTIALS device: this rank's, then everyone's
};
#define NCCL_GATHER 4           // doubles per rank at most in one nccl_gather

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
    if (a->clip_rule == CLIP_EXACT && a->release)
        return train_fail("-N exact with -R 1 over NCCL: release steps each layer before this step's norm exists; use -N est "
                          "(the default with -R 1) or -N prev");
    if (a->parity) return train_fail("-P fp32 over NCCL is not there yet");
    Nccl *c = (Nccl *)calloc(1, sizeof *c);
    if (!c) return train_fail("out of memory");
    t->nccl = c;
    c->rank = r; c->ranks = ranks; c->local = nccl_local_rank();
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
// multiple of SHARD_ALIGN, ranks S elements each; under release one layout per backward group, two
// buffers of the largest. Called before the optimizer is built.
int nccl_open(Trainer *t) {
    Nccl *c = t->nccl;
    if (!c) return 0;
    const GPT2 *m = &t->model;
    int L = m->config.num_layers;
    c->es = bnb8_dtype_size(t->lay.weights);
    if (bnb8_dtype_size(t->lay.grads) != c->es) return train_fail("NCCL: weights and gradients of different sizes");
    c->type = t->lay.weights == BNB8_BF16 ? ncclBfloat16 : ncclFloat32;
    c->count = 0;
    for (int i = 0; i < GPT2_NUM_PARAMS; i++) if (m->param_sizes[i]) c->count += (int)tensor_slices(t, i);
    c->groups = t->a.release ? L + 2 : 1;
    size_t count = (size_t)c->count;
    c->param = (void **)calloc(count, sizeof(void *));
    c->grad = (void **)calloc(count, sizeof(void *));
    c->n = (int64_t *)calloc(count, sizeof(int64_t));
    c->at = (int64_t *)calloc(count, sizeof(int64_t));
    c->shares = (Share *)calloc(count, sizeof(Share));
    c->share_of = (int *)calloc(count, sizeof(int));
    c->group = (int *)calloc(count, sizeof(int));
    c->group_S = (int64_t *)calloc((size_t)c->groups, sizeof(int64_t));
    int *members = (int *)calloc(count, sizeof(int));
    int64_t *n = (int64_t *)calloc(count, sizeof(int64_t)), *at = (int64_t *)calloc(count, sizeof(int64_t));
    int bad = !c->param || !c->grad || !c->n || !c->at || !c->shares || !c->share_of || !c->group || !c->group_S ||
              !members || !n || !at;
    for (int i = 0, j = 0; !bad && i < GPT2_NUM_PARAMS; i++) {
        if (!m->param_sizes[i]) continue;
        int64_t slices = tensor_slices(t, i), size = m->param_sizes[i] / slices;
        for (int64_t l = 0; l < slices; l++, j++) {
            c->param[j] = (char *)t->param[i] + c->es * (size_t)(l * size);
            c->grad[j] = slice_grad(t, i, l, size);
            c->n[j] = size;
            c->share_of[j] = -1;
        }
    }
    // each group's tensors laid out on their own (one group: every tensor, in order)
    c->S = 0;
    for (int g = 0; !bad && g < c->groups; g++) {
        int k = 0;
        if (c->groups == 1) for (; k < c->count; k++) members[k] = k;
        else {
            void *grads[GPT2_NUM_PARAMS];
            k = group_tensors(t, g, members, grads, n);
        }
        for (int q = 0; q < k; q++) { n[q] = c->n[members[q]]; c->group[members[q]] = g; }
        c->group_S[g] = shard_layout(n, k, c->ranks, at);
        for (int q = 0; q < k; q++) c->at[members[q]] = at[q];
        if (c->group_S[g] > c->S) c->S = c->group_S[g];
    }
    free(members); free(n); free(at);
    if (bad) return train_fail("out of memory");
    if (t->rule == CLIP_EST &&
        cuda_check(cudaMalloc((void **)&c->dev_partial, sizeof(double) * GPT2_CUDA_CLIP_PARTIALS * (size_t)(c->ranks + 1)), "cudaMalloc"))
        return -1;
    size_t bytes = c->es * (size_t)(c->S * c->ranks);
    if (cuda_check(cudaMalloc(&c->G, bytes), "cudaMalloc of the gradient and weight exchange buffer") ||
        cuda_check(cudaMemset(c->G, 0, bytes), "cudaMemset") ||
        cuda_check(cudaMalloc((void **)&c->dev_loss, sizeof(float)), "cudaMalloc"))
        return -1;
    if (!t->a.release) return 0;
    if (cuda_check(cudaMalloc(&c->G2, bytes), "cudaMalloc of the second exchange buffer") ||
        cuda_check(cudaMemset(c->G2, 0, bytes), "cudaMemset") ||
        cuda_check(cudaStreamCreate(&c->xs), "cudaStreamCreate"))
        return -1;
    for (int b = 0; b < 2; b++)
        if (cuda_check(cudaEventCreateWithFlags(&c->ready[b], cudaEventDisableTiming), "cudaEventCreate") ||
            cuda_check(cudaEventCreateWithFlags(&c->done[b], cudaEventDisableTiming), "cudaEventCreate"))
            return -1;
    c->events = 1;
    return 0;
}

// The buffer group g's gradients and weights pass through.
static char *group_buffer(const Nccl *c, int g) { return (char *)(g % 2 ? c->G2 : c->G); }
// The stream of every NCCL call: the exchange stream under release, else the model's (none yet
// while the run opens: the default).
static cudaStream_t nccl_stream(const Trainer *t) {
    return t->nccl->events ? t->nccl->xs : t->gpu.model ? (cudaStream_t)gpt2_cuda_stream(t->gpu.model) : 0;
}

// Optimizer tensor j's part on this rank: [*offset, *offset + *count) of its n elements, its
// gradients in G. 0 when the rank holds none of it (then it is not registered here).
int nccl_share(Trainer *t, int j, int64_t *offset, int64_t *count, void **grad) {
    Nccl *c = t->nccl;
    if (!c) return 1;
    if (!shard_part(c->at[j], c->n[j], c->group_S[c->group[j]], c->rank, offset, count)) return 0;
    char *place = group_buffer(c, c->group[j]) + c->es * (size_t)(c->at[j] + *offset);
    *grad = place;
    c->share_of[j] = c->num_shares;
    c->shares[c->num_shares++] = (Share){j, *offset, *count, place};
    return 1;
}

// This rank's batch: the rank-th of the next ranks batches of the loader (one rank: the next).
void nccl_batch(Trainer *t) {
    Nccl *c = t->nccl;
    if (!c) { loader_next(&t->loader); return; }
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
    if (!c) return 0;
    float sum = 0.0f;
    cudaStream_t s = nccl_stream(t);
    if (cuda_check(cudaMemcpyAsync(c->dev_loss, loss, sizeof(float), cudaMemcpyHostToDevice, s), "loss copy") ||
        nccl_check(ncclAllReduce(c->dev_loss, c->dev_loss, 1, ncclFloat32, ncclSum, c->comm, s), "ncclAllReduce") ||
        cuda_check(cudaMemcpyAsync(&sum, c->dev_loss, sizeof(float), cudaMemcpyDeviceToHost, s), "loss copy") ||
        cuda_check(cudaStreamSynchronize(s), "cudaStreamSynchronize"))
        return -1;
    *loss = sum / (float)c->ranks;
    return 0;
}

// Group g's gradients (every tensor's when there is one group) into its buffer, on stream s.
static int gradients_in(const Nccl *c, int g, cudaStream_t s) {
    char *X = group_buffer(c, g);
    for (int j = 0; j < c->count; j++)
        if (c->group[j] == g &&
            cuda_check(cudaMemcpyAsync(X + c->es * (size_t)c->at[j], c->grad[j], c->es * (size_t)c->n[j], cudaMemcpyDeviceToDevice, s),
                       "gradient copy"))
            return -1;
    return 0;
}
// Group g's buffer reduce-scattered (the ranks' mean): rank r's part is its shards' gradients.
static int reduce_gradients(const Nccl *c, int g, cudaStream_t s) {
    char *X = group_buffer(c, g);
    size_t S = (size_t)c->group_S[g];
    return nccl_check(ncclReduceScatter(X, X + c->es * (size_t)c->rank * S, S, c->type, ncclAvg, c->comm, s), "ncclReduceScatter");
}
// After the step of group g's shards: their weights into the buffer, all-gathered, and every tensor
// of the group copied back into the model's weights.
static int weights_out(const Nccl *c, int g, cudaStream_t s) {
    char *X = group_buffer(c, g);
    size_t S = (size_t)c->group_S[g];
    for (int k = 0; k < c->num_shares; k++) {
        const Share *h = &c->shares[k];
        if (c->group[h->j] == g &&
            cuda_check(cudaMemcpyAsync(h->place, (char *)c->param[h->j] + c->es * (size_t)h->offset, c->es * (size_t)h->count,
                                       cudaMemcpyDeviceToDevice, s), "weight copy"))
            return -1;
    }
    if (nccl_check(ncclAllGather(X + c->es * (size_t)c->rank * S, X, S, c->type, c->comm, s), "ncclAllGather")) return -1;
    for (int j = 0; j < c->count; j++)
        if (c->group[j] == g &&
            cuda_check(cudaMemcpyAsync(c->param[j], X + c->es * (size_t)c->at[j], c->es * (size_t)c->n[j], cudaMemcpyDeviceToDevice, s),
                       "weight copy"))
            return -1;
    return 0;
}

// Backward's group g (its order: the plain path's tensor order) stepped on stream s after the
// reduce-scatter: this rank's shards of it, at scale; under the est rule at the group's own scale,
// first formed over the ranks: each rank's partial sums of squares of its shards, every rank's
// gathered, the group's sum and scale set where the optimizer reads it (cfg.gnorm_scale_at). One rank
// gives the plain path's bits.
static int group_step(Trainer *t, int g, float lr, float scale, cudaStream_t s) {
    Nccl *c = t->nccl;
    int plain[GPT2_NUM_PARAMS], ids[GPT2_NUM_PARAMS], k = 0;
    void *grads[GPT2_NUM_PARAMS], *bufs[GPT2_NUM_PARAMS];
    int64_t sizes[GPT2_NUM_PARAMS], n[GPT2_NUM_PARAMS];
    int count = group_tensors(t, g, plain, grads, sizes);
    for (int q = 0; q < count; q++) {
        int h = c->share_of[plain[q]];
        if (h < 0) continue;
        bufs[k] = c->shares[h].place;
        n[k] = c->shares[h].count;
        ids[k++] = h;
    }
    if (t->rule == CLIP_EST) {
        GPT2Cuda *m = t->gpu.model;
        double *mine = c->dev_partial, *all = c->dev_partial + GPT2_CUDA_CLIP_PARTIALS;
        if (gpt2_cuda_clip_partials(m, bufs, n, k, c->type == ncclBfloat16 ? GPT2_CUDA_BF16 : GPT2_CUDA_FP32, mine, (struct CUstream_st *)s) ||
            nccl_check(ncclAllGather(mine, all, GPT2_CUDA_CLIP_PARTIALS, ncclFloat64, c->comm, s), "ncclAllGather") ||
            gpt2_cuda_clip_scale_parts(m, all, c->ranks, g, t->shares[g], t->a.grad_clip, t->a.accum, (struct CUstream_st *)s))
            return train_fail("GPU clipping: %s", gpt2_cuda_last_error());
        scale = 1.0f;   // the optimizer reads the group's scale where it lies
    }
    if (k && bnb8_optimizer_step_tensors(t->opt, ids, k, lr, scale, (struct CUstream_st *)s))
        return train_fail("optimizer step: %s", bnb8_last_error());
    return 0;
}

// Gradient release: backward finished group g (model's stream `stream`). Its gradients leave the
// shared slices on that stream, once the buffer's previous group has left the buffer; the exchange
// stream reduce-scatters them, steps this rank's shards of the group (group_step: at scale, the
// previous step's clip, or est's), and gathers the weights back into the model.
int nccl_release_group(Trainer *t, int g, float lr, float scale, struct CUstream_st *stream) {
    Nccl *c = t->nccl;
    cudaStream_t s = (cudaStream_t)stream;
    int b = g % 2;
    if (cuda_check(cudaStreamWaitEvent(s, c->done[b], 0), "cudaStreamWaitEvent") || gradients_in(c, g, s) ||
        cuda_check(cudaEventRecord(c->ready[b], s), "cudaEventRecord") ||
        cuda_check(cudaStreamWaitEvent(c->xs, c->ready[b], 0), "cudaStreamWaitEvent") || reduce_gradients(c, g, c->xs) ||
        group_step(t, g, lr, scale, c->xs))
        return -1;
    if (weights_out(c, g, c->xs) || cuda_check(cudaEventRecord(c->done[b], c->xs), "cudaEventRecord")) return -1;
    return 0;
}

// Every rank's k (1..NCCL_GATHER) doubles mine into all (ranks x k, in rank order), on every rank. Waits.
static int nccl_gather(Nccl *c, const double *mine, int k, double *all, cudaStream_t s) {
    size_t bytes = sizeof(double) * (size_t)k;
    if (!c->dev_gather && cuda_check(cudaMalloc((void **)&c->dev_gather, sizeof(double) * NCCL_GATHER * (size_t)(c->ranks + 1)), "cudaMalloc"))
        return -1;
    if (cuda_check(cudaMemcpyAsync(c->dev_gather, mine, bytes, cudaMemcpyHostToDevice, s), "copy to the device") ||
        nccl_check(ncclAllGather(c->dev_gather, c->dev_gather + k, (size_t)k, ncclFloat64, c->comm, s), "ncclAllGather") ||
        cuda_check(cudaMemcpyAsync(all, c->dev_gather + k, bytes * (size_t)c->ranks, cudaMemcpyDeviceToHost, s), "copy to the host") ||
        cuda_check(cudaStreamSynchronize(s), "cudaStreamSynchronize"))
        return -1;
    return 0;
}

// *total: every rank's mine added in rank order: the same bits on every rank.
static int ranks_sum(Trainer *t, double mine, double *total) {
    Nccl *c = t->nccl;
    double sum = 0.0, *all = (double *)malloc(sizeof(double) * (size_t)c->ranks);
    if (!all) return train_fail("out of memory");
    int bad = nccl_gather(c, &mine, 1, all, nccl_stream(t));
    for (int r = 0; !bad && r < c->ranks; r++) sum += all[r];
    free(all);
    if (bad) return -1;
    *total = sum;
    return 0;
}

// *norm: the norm of the step's mean gradient from each rank's sum of squares (mine).
static int nccl_total(Trainer *t, double mine, double *norm) {
    double total = 0.0;
    if (ranks_sum(t, mine, &total)) return -1;
    *norm = sqrt(total) / (double)t->a.accum;
    return 0;
}

// A count of this rank's own made the ranks' total (exact below 2^53): the run stops on it, and every
// rank must stop at the same step, or the others wait in their next exchange for ever.
int nccl_total_count(Trainer *t, int64_t *count) {
    double total = 0.0;
    if (!t->nccl) return 0;
    if (ranks_sum(t, (double)*count, &total)) return -1;
    *count = (int64_t)total;
    return 0;
}

// -N prev: this rank's sums of g^2 (the optimizer's, of its shards) in tensor order, then the ranks'.
static int rank_order_norm(Trainer *t, double *norm) {
    int count = bnb8_optimizer_count(t->opt);
    if (bnb8_optimizer_sum_squares(t->opt, t->sums)) return train_fail("gradient norm: %s", bnb8_last_error());
    double mine = 0.0;
    for (int i = 0; i < count; i++) mine += t->sums[i];
    return nccl_total(t, mine, norm);
}

// -N exact: this rank's sum of squares of the reduced gradients of its shards in G (one rank: the
// plain path's gpt2_cuda_grad_norm, bit for bit), then every rank's. Waits.
static int exact_norm(Trainer *t, double *norm) {
    Nccl *c = t->nccl;
    const void **bufs = (const void **)malloc(sizeof(void *) * (size_t)(c->num_shares + 1));
    int64_t *n = (int64_t *)malloc(sizeof(int64_t) * (size_t)(c->num_shares + 1));
    double mine = 0.0;
    int bad = !bufs || !n ? train_fail("out of memory") : 0;
    for (int k = 0; !bad && k < c->num_shares; k++) {
        bufs[k] = c->shares[k].place;
        n[k] = c->shares[k].count;
    }
    if (!bad && gpt2_cuda_sum_squares(t->gpu.model, bufs, n, c->num_shares, c->type == ncclBfloat16 ? GPT2_CUDA_BF16 : GPT2_CUDA_FP32, &mine))
        bad = train_fail("gradient norm: %s", gpt2_cuda_last_error());
    free(bufs); free(n);
    return bad ? -1 : nccl_total(t, mine, norm);
}

// The step: gradients into G, reduce-scatter (average), this rank's shards stepped in one launch,
// their weights into G, all-gather, every tensor's weights back into the model; under release
// backward did all that group by group, and the model's stream waits for the last exchange. *norm:
// the norm of this step's mean gradient: -N exact forms it before the step (skipped on every rank
// when it is not finite), -N prev after (the next step clips with it).
int nccl_step(Trainer *t, float lr, double *norm, int *skipped) {
    Nccl *c = t->nccl;
    cudaStream_t s = (cudaStream_t)gpt2_cuda_stream(t->gpu.model);
    *norm = NAN;
    *skipped = 0;
    if (c->events) {
        if (cuda_check(cudaEventRecord(c->done[0], c->xs), "cudaEventRecord") ||
            cuda_check(cudaStreamWaitEvent(s, c->done[0], 0), "cudaStreamWaitEvent"))
            return -1;
    } else {
        if (gradients_in(c, 0, s) || reduce_gradients(c, 0, s)) return -1;
        if (t->rule == CLIP_EXACT) {
            if (exact_norm(t, norm)) return -1;
            *skipped = !isfinite(*norm);
            if (*skipped) return 0;   // every rank has the same norm: none steps, the weights stay
        }
        for (int g = 0; t->rule == CLIP_EST && g < t->model.config.num_layers + 2; g++)   // in backward's order
            if (group_step(t, g, lr, 1.0f, s)) return -1;
        if (t->rule != CLIP_EST &&
            bnb8_optimizer_step(t->opt, lr, step_scale(clip_norm(t, *norm), t->a.grad_clip, t->a.accum),
                                (struct CUstream_st *)s))
            return train_fail("optimizer step: %s", bnb8_last_error());
        if (weights_out(c, 0, s)) return -1;
        if (t->rule == CLIP_EXACT) return 0;
    }
    return t->rule == CLIP_EST ? 0 : rank_order_norm(t, norm);   // est: clip.c's est_finish forms the norm
}

// ------------------------------------------------------------------------------------------------
// Checkpoints and resume over NCCL (checkpoint.h; DESIGN.md §8.8)

int nccl_ranks(const Trainer *t, int *rank) {
    if (rank) *rank = t->nccl ? t->nccl->rank : 0;
    return t->nccl ? t->nccl->ranks : 0;
}

// After a resume (each rank restored only its shards' weights): every group's shards all-gathered
// into every rank's model; waits, so that the first forward finds them.
int nccl_gather_weights(Trainer *t) {
    Nccl *c = t->nccl;
    if (!c) return 0;
    cudaStream_t s = nccl_stream(t);
    for (int g = 0; g < c->groups; g++) if (weights_out(c, g, s)) return -1;
    return cuda_check(cudaStreamSynchronize(s), "cudaStreamSynchronize");
}

// Each rank's outcome (0 opened, 1 failed on the checkpoint's files, 2 failed otherwise) and the
// checkpoint it opened, gathered: one rank's damaged files make every rank fall back; ranks that
// found different newest checkpoints (an -o that is not one shared directory) fall back below the
// newest until they agree.
int nccl_agree(Trainer *t, int status) {
    Nccl *c = t->nccl;
    if (!c || !c->comm) return status;
    double mine[2] = {status == 0 ? 0.0 : t->damaged ? 1.0 : 2.0, (double)t->start}, lo = INFINITY, hi = -INFINITY;
    double *all = (double *)malloc(sizeof(double) * 2 * (size_t)c->ranks);
    int damaged = -1, failed = -1;
    if (!all || nccl_gather(c, mine, 2, all, nccl_stream(t))) {
        free(all);
        t->damaged = 0;
        return all ? -1 : train_fail("out of memory");
    }
    for (int r = c->ranks - 1; r >= 0; r--) {
        if (all[2 * r] == 1.0) damaged = r;
        if (all[2 * r] == 2.0) failed = r;
        lo = fmin(lo, all[2 * r + 1]);
        hi = fmax(hi, all[2 * r + 1]);
    }
    free(all);
    if (damaged < 0 && failed < 0 && lo == hi) return 0;
    t->damaged = failed < 0;
    if (failed >= 0) return status ? -1 : train_fail("rank %d of %d could not open the run (its error is in its output)", failed, c->ranks);
    if (!status && damaged >= 0)
        train_fail("rank %d's files of the checkpoint of step %lld are damaged or missing (its warning says which)", damaged, (long long)hi);
    else if (!status)
        train_fail("the ranks found different newest checkpoints in %s (steps %lld to %lld): is it one directory that every rank "
                   "shares?", t->a.out_dir, (long long)lo, (long long)hi);
    t->start = (int64_t)hi;   // every rank tries the checkpoint before the newest one found
    return -1;
}

// Tensor j of the plain numbering is slice l of parameter tensor *param: its first element in the
// model's layout (the return) and in that parameter tensor (*within).
static int64_t tensor_place(const Trainer *t, int j, int *param, int64_t *within) {
    const GPT2 *m = &t->model;
    int64_t base = 0;
    for (int i = 0; i < GPT2_NUM_PARAMS; base += m->param_sizes[i], i++) {
        int64_t slices = m->param_sizes[i] ? tensor_slices(t, i) : 0;
        if (j < slices) {
            *param = i;
            *within = j * (m->param_sizes[i] / slices);
            return base + *within;
        }
        j -= (int)slices;
    }
    *param = 0;
    *within = 0;
    return 0;
}

// The most elements of one share this rank holds (at least 1): the host buffer of one share at a time.
static int64_t largest_share(const Nccl *c) {
    int64_t most = 1;
    for (int k = 0; k < c->num_shares; k++) if (c->shares[k].count > most) most = c->shares[k].count;
    return most;
}

int nccl_masters(Trainer *t, char *where, size_t size) {
    Nccl *c = t->nccl;
    float *out = (float *)malloc(sizeof(float) * (size_t)largest_share(c));   // one share at a time: the host holds no model
    if (!out) return train_fail("out of memory");
    where[0] = 0;
    for (int k = 0; k < c->num_shares; k++) {   // share k is the optimizer's tensor k
        const Share *h = &c->shares[k];
        int i;
        int64_t first;
        tensor_place(t, h->j, &i, &first);
        first += h->offset;   // in the whole parameter tensor
        if (bnb8_optimizer_export_fp32(t->opt, k, out)) {
            free(out);
            return train_fail("export of '%s': %s", gpt2_param_names[i], bnb8_last_error());
        }
        for (int64_t e = 0; !where[0] && e < h->count; e++)
            if (!isfinite(out[e]))
                snprintf(where, size, "tensor '%s' element %lld is %g", gpt2_param_names[i], (long long)(first + e), (double)out[e]);
    }
    free(out);
    return 0;
}

// Rank r's part of tensor j from rank r (its host copy, mine) to rank 0 (into to), NCCL_CHUNK floats a
// send through dev, in order: rank 0 receives them in the order the sender sends.
#define NCCL_CHUNK ((int64_t)1 << 24)
static int send_part(Nccl *c, int r, const float *mine, float *to, int64_t count, float *dev, cudaStream_t s) {
    for (int64_t e = 0; e < count; e += NCCL_CHUNK) {
        int64_t n = count - e < NCCL_CHUNK ? count - e : NCCL_CHUNK;
        size_t bytes = sizeof(float) * (size_t)n;
        if (c->rank == r ? cuda_check(cudaMemcpyAsync(dev, mine + e, bytes, cudaMemcpyHostToDevice, s), "copy to the device") ||
                           nccl_check(ncclSend(dev, (size_t)n, ncclFloat32, 0, c->comm, s), "ncclSend")
                         : nccl_check(ncclRecv(dev, (size_t)n, ncclFloat32, r, c->comm, s), "ncclRecv") ||
                           cuda_check(cudaMemcpyAsync(to + e, dev, bytes, cudaMemcpyDeviceToHost, s), "copy to the host"))
            return -1;
        if (cuda_check(cudaStreamSynchronize(s), "cudaStreamSynchronize")) return -1;
    }
    return 0;
}

int nccl_gather_masters(Trainer *t, float *out) {
    Nccl *c = t->nccl;
    cudaStream_t s = nccl_stream(t);
    float *mine = c->rank ? (float *)malloc(sizeof(float) * (size_t)largest_share(c)) : NULL, *dev = NULL;
    int ready = c->rank ? mine != NULL : out != NULL;
    if (ready && c->ranks > 1) ready = cudaMalloc((void **)&dev, sizeof(float) * (size_t)NCCL_CHUNK) == cudaSuccess;
    double flag = ready, *all = (double *)malloc(sizeof(double) * (size_t)c->ranks);
    int status = all ? nccl_gather(c, &flag, 1, all, s) : train_fail("out of memory");
    for (int r = 0; !status && r < c->ranks; r++)   // every rank has its buffers, or none goes on
        if (all[r] == 0.0) status = train_fail("the final weights: rank %d of %d has no memory for them", r, c->ranks);
    for (int j = 0; !status && j < c->count; j++) {
        int i;
        int64_t within, place = tensor_place(t, j, &i, &within), offset, count;
        for (int r = 0; !status && r < c->ranks; r++) {
            if (!shard_part(c->at[j], c->n[j], c->group_S[c->group[j]], r, &offset, &count)) continue;
            if (r == c->rank && bnb8_optimizer_export_fp32(t->opt, c->share_of[j], r == 0 ? out + place + offset : mine))
                status = train_fail("export of '%s': %s", gpt2_param_names[i], bnb8_last_error());
            if (!status && r != 0 && (c->rank == 0 || c->rank == r))
                status = send_part(c, r, mine, c->rank == 0 ? out + place + offset : NULL, count, dev, s);
        }
    }
    free(all);
    free(mine);
    if (dev) cudaFree(dev);
    return status;
}

// Every rank has come here (trainer_open's turns).
int nccl_barrier(Trainer *t) {
    Nccl *c = t->nccl;
    if (!c) return 0;
    double mine = 0.0, *all = (double *)malloc(sizeof(double) * (size_t)c->ranks);
    int status = all ? nccl_gather(c, &mine, 1, all, nccl_stream(t)) : train_fail("out of memory");
    free(all);
    return status;
}


// Every rank's weights checked (none is saved when one rank's are not finite), then each rank's
// optimizer file; once every rank has reported its file written, rank 0 writes the trainer state,
// bound to their digests, and DONE, and says whether it did; on any failure each rank removes what
// it wrote.
int nccl_checkpoint_save(Trainer *t, const TrainerState *s, int64_t *bytes, int64_t *own) {
    Nccl *c = t->nccl;
    cudaStream_t st = nccl_stream(t);
    const char *dir = t->a.out_dir;
    char path[TRAIN_PATH_MAX], state[TRAIN_PATH_MAX], where[160] = "";
    double mine[2], *all = (double *)malloc(sizeof(double) * 2 * (size_t)c->ranks), total = 0.0;
    int status = 0, failed = -1;
    *bytes = *own = 0;
    if (!all) return train_fail("out of memory");
    status = nccl_masters(t, where, sizeof where);
    mine[0] = status || where[0];
    if (nccl_gather(c, mine, 1, all, st)) { free(all); return -1; }
    for (int r = c->ranks - 1; r >= 0; r--) if (all[r] != 0.0) failed = r;
    if (failed >= 0) {
        free(all);
        if (status) return -1;
        if (where[0]) failed = c->rank;
        return train_fail("step %lld: the weights are not finite (rank %d of %d%s%s): checkpoint not written; the newest complete "
                          "checkpoint in %s is the last good one", (long long)s->step, failed, c->ranks, where[0] ? ": " : "", where, dir);
    }
    checkpoint_optim_path(path, sizeof path, dir, s->step, c->rank, c->ranks);
    checkpoint_path(state, sizeof state, dir, "state", s->step, ".bin");
    if (bnb8_optimizer_save(t->opt, path)) status = train_fail("%s", bnb8_last_error());
    *own = path_size(path);
    mine[0] = status != 0;
    mine[1] = (double)*own;
    if (nccl_gather(c, mine, 2, all, st)) { free(all); return -1; }
    for (int r = c->ranks - 1; r >= 0; r--) { if (all[2 * r] != 0.0) failed = r; total += all[2 * r + 1]; }
    // every rank's file is written: rank 0 binds them in the trainer state, and the checkpoint is complete
    if (failed < 0 && c->rank == 0) status = checkpoint_state_save(dir, s, c->ranks) || checkpoint_done(dir, s->step);
    mine[0] = status != 0;   // rank 0's trainer state and DONE
    mine[1] = (double)(c->rank == 0 ? path_size(state) : 0);
    if (failed < 0 && nccl_gather(c, mine, 2, all, st)) { free(all); return -1; }
    if (failed < 0 && all[0] != 0.0) failed = 0;
    total += failed < 0 ? all[1] : 0.0;
    free(all);
    if (failed < 0) { *bytes = (int64_t)total; return 0; }
    remove(path);   // no DONE: this step's files are useless; a full disk gets their space back
    if (c->rank == 0) remove(state);
    *own = 0;
    if (status) return -1;
    return train_fail("step %lld: rank %d of %d could not write its checkpoint files (its error is in its output): checkpoint "
                      "not written; the newest complete checkpoint in %s is the last good one", (long long)s->step, failed, c->ranks, dir);
}

void nccl_hint(void) {
    int devices = 0;
    if (env_first("OMPI_COMM_WORLD_SIZE", "BNB8_RANKS") || cudaGetDeviceCount(&devices) != cudaSuccess || devices < 2) return;
    printf("note     %d GPUs here, this run uses one; to train on all of them, one process per GPU (global batch %d x B x T;\n"
           "         doc/multi_gpu.md): mpirun -np %d ./build/train_gpt2_8bit_cuda <these flags>, or\n"
           "         for r in $(seq 0 %d); do BNB8_RANKS=%d BNB8_RANK=$r NCCL_NVLS_ENABLE=0 ./build/train_gpt2_8bit_cuda <these flags> & done;\n"
           "         for r in $(seq 0 %d); do wait -n || kill $(jobs -p) 2> /dev/null; done   # a rank that fails ends the others\n",
           devices, devices, devices, devices - 1, devices, devices - 1);
}

// The exchange buffers' bytes: G, and under release G2 too.
static double exchange_bytes(const Nccl *c) { return (c->G2 ? 2.0 : 1.0) * (double)c->es * (double)(c->S * c->ranks); }

// Device bytes beyond the optimizer's accounting (which holds this rank's shards): the exchange
// buffers, and the model's weights outside this rank's shards.
double nccl_extra_bytes(const Trainer *t) {
    const Nccl *c = t->nccl;
    if (!c) return 0.0;
    bnb8_memory mem = bnb8_optimizer_memory(t->opt, 0);
    return exchange_bytes(c) + (double)c->es * (double)t->model.num_parameters - mem.weights;
}

void nccl_print_memory(const Trainer *t) {
    const Nccl *c = t->nccl;
    if (!c) return;
    bnb8_memory mem = bnb8_optimizer_memory(t->opt, 0);
    double P = (double)t->model.num_parameters, full = (double)c->es * P, G = exchange_bytes(c), grads = (double)t->gpu.grads_bytes;
    printf("  per GPU, rank %d of %d (NCCL, ZeRO-1: this rank's shards of %lld of %lld parameters, %d tensor parts%s):\n",
           c->rank, c->ranks, (long long)mem.params, (long long)t->model.num_parameters, c->num_shares,
           c->G2 ? "; release: two exchange buffers of the largest group" : "");
    printf("    weights %.3f + gradients %.3f + exchange %.3f + master %.3f + optimizer state %.3f = %.3f bytes per parameter\n",
           full / P, grads / P, G / P, mem.correction / P, mem.states / P, (full + grads + G + mem.correction + mem.states) / P);
}

void nccl_free(Trainer *t) {
    Nccl *c = t->nccl;
    if (!c) return;
    if (c->comm) ncclCommDestroy(c->comm);
    if (c->G) cudaFree(c->G);
    if (c->G2) cudaFree(c->G2);
    for (int b = 0; c->events && b < 2; b++) { cudaEventDestroy(c->ready[b]); cudaEventDestroy(c->done[b]); }
    if (c->events) cudaStreamDestroy(c->xs);
    if (c->dev_gather) cudaFree(c->dev_gather);
    if (c->dev_partial) cudaFree(c->dev_partial);
    if (c->dev_loss) cudaFree(c->dev_loss);
    free(c->param); free(c->grad); free(c->n); free(c->at); free(c->shares); free(c->inputs); free(c->targets);
    free(c->share_of); free(c->group); free(c->group_S);
    free(c);
    t->nccl = NULL;
}
#endif
