/*
trainer/checkpoint.c — the checkpoints (checkpoint.h, DESIGN.md §8.4, §8.5): the trainer state file, the
checkpoint directory (paths, save, the newest complete step, its lock, the temporaries a killed run
left) and the resume from them. Apart from the run so that every file format of the trainer is in one
place, read by the tests and the fuzzers without a model or a device.
*/
#define _POSIX_C_SOURCE 200809L   // mkdir, opendir
#define _DEFAULT_SOURCE           // flock
#include <stdlib.h>
#include <string.h>
#include <math.h>
#include <errno.h>
#include <limits.h>
#include <signal.h>
#include <dirent.h>
#include <sys/types.h>
#include <sys/stat.h>
#include <unistd.h>
#include <fcntl.h>
#include <sys/file.h>
#include "checkpoint.h"
#include "settings.h"
#include "tensors.h"

// FNV-1a, 64 bits: len bytes at p folded into h (start with FNV_START).
#define FNV_START 0xcbf29ce484222325ull
static uint64_t fnv1a(uint64_t h, const void *p, size_t len) {
    for (size_t i = 0; i < len; i++) h = (h ^ ((const uint8_t *)p)[i]) * 0x100000001b3ull;
    return h;
}

// The trainer state's checksum, of its words before the last: a damaged file is refused.
static int64_t state_checksum(const int64_t *w, int words) { return (int64_t)fnv1a(FNV_START, w, sizeof(int64_t) * (size_t)words); }

int state_writer(FILE *f, const void *state) {
    const TrainerState *s = (const TrainerState *)state;
    const GPT2Config *c = &s->config;
    int64_t w[STATE_WORDS] = {STATE_MAGIC, STATE_VERSION, s->step, s->position, (int64_t)s->rng, s->B, s->T,
                              s->recipe, s->optimizer, c->stable_embedding, (int64_t)s->seed, s->steps, s->release,
                              s->accum, s->weight_bytes, c->max_seq_len, c->vocab_size, c->padded_vocab_size,
                              c->num_layers, c->num_heads, c->channels, s->opt_steps, s->clip_rule};
    memcpy(&w[23], &s->prev_norm, sizeof(double));
    w[24] = s->scale_dtype;
    w[25] = s->train_tokens;
    w[26] = s->train_digest;
    w[27] = s->ranks;
    memcpy(&w[28], s->est_profile, sizeof s->est_profile);
    memcpy(&w[31], &s->lr, sizeof(double));
    w[32] = s->warmup;
    memcpy(&w[33], &s->final_lr_frac, sizeof(double));
    memcpy(&w[34], &s->weight_decay, sizeof(double));
    memcpy(&w[35], &s->grad_clip, sizeof(double));
    w[36] = s->map;
    w[37] = s->blocksize;
    w[38] = s->optim_digest;
    w[39] = s->rank1;
    w[STATE_WORDS - 1] = state_checksum(w, STATE_WORDS - 1);
    return fwrite(w, sizeof w, 1, f) == 1 ? 0 : -1;
}

// The words of a trainer state file of this version: 16 (version 1), 32 (2), 40 (3), STATE_WORDS (4).
static int64_t state_words(int64_t version) { return version == 1 ? 16 : version == 2 ? 32 : version == 3 ? 40 : STATE_WORDS; }

// The words of a trainer state file into w (STATE_WORDS; those an older version lacks left as they
// are), checked: its size by its version, magic, version and checksum.
static int state_read_words(int64_t *w, const char *path) {
    FILE *f = open_input(path, "trainer state");
    if (!f) return -1;
    int64_t size;
    int status = file_size_of(f, path, &size);
    if (!status && size >= 16 && fread(w, 16, 1, f) != 1) status = train_fail("%s: read failed", path);
    if (!status && size >= 16 && w[0] != STATE_MAGIC) status = train_fail("%s: not a trainer state file (magic %lld)", path, (long long)w[0]);
    if (!status && size >= 16 && (w[1] < 1 || w[1] > STATE_VERSION))
        status = train_fail("%s: trainer state version %lld, expected 1..%d", path, (long long)w[1], STATE_VERSION);
    int64_t words = state_words(w[1]);
    if (!status && size != 8 * words)
        status = train_fail("%s: %s trainer state file: %lld bytes, expected %lld", path,
                            size < 8 * words ? "truncated" : "oversized", (long long)size, (long long)(8 * words));
    int64_t sum = 0;   // version 2's checksum is its last word, where version 3 goes on
    if (!status && fread(w + 2, 8 * (size_t)(words - 3), 1, f) != 1) status = train_fail("%s: read failed", path);
    if (!status && fread(words == 16 ? &w[15] : &sum, 8, 1, f) != 1) status = train_fail("%s: read failed", path);
    fclose(f);
    if (!status && words > 16 && sum != state_checksum(w, (int)words - 1))
        status = train_fail("%s: trainer state checksum mismatch (a damaged file)", path);
    return status;
}

// Version 3's run settings (-l, -u, -q, -c, -g, -M, -K; version 4's -V) against the ranges the
// trainer writes: the message names the first out of it.
static int state_check_run_settings(const TrainerState *s, const char *path) {
    const struct { const char *name; double v, hi; const char *range; } d[] = {
        {"the peak learning rate (-l)", s->lr, INFINITY, "finite and >= 0"},
        {"the final learning rate fraction (-q)", s->final_lr_frac, 1.0, "in [0, 1]"},
        {"the weight decay (-c)", s->weight_decay, INFINITY, "finite and >= 0"},
        {"the clip norm (-g)", s->grad_clip, INFINITY, "finite and >= 0"}};
    for (size_t i = 0; i < sizeof d / sizeof d[0]; i++)
        if (!(d[i].v >= 0.0 && d[i].v <= d[i].hi && isfinite(d[i].v)))
            return train_fail("%s: inconsistent trainer state: %s is %g, expected %s", path, d[i].name, d[i].v, d[i].range);
    if (s->warmup < 0) return train_fail("%s: inconsistent trainer state: the warm-up (-u) is %lld steps", path, (long long)s->warmup);
    if (s->map < 0 || s->map >= BNB8_NUM_MAPS)
        return train_fail("%s: inconsistent trainer state: the 8-bit states' map (-M) is %lld, an unknown map", path, (long long)s->map);
    int64_t b = s->blocksize;
    if (b != 0 && !(b >= 64 && b <= 4096 && (b & (b - 1)) == 0))
        return train_fail("%s: inconsistent trainer state: the block size (-K) is %lld, expected 0 or a power of two in "
                          "64..4096", path, (long long)b);
    if (s->rank1 != 0 && s->rank1 != 1)
        return train_fail("%s: inconsistent trainer state: the second moment's normalization (-V) is %lld, expected 0 "
                          "(block) or 1 (rank1)", path, (long long)s->rank1);
    return 0;
}

// Each field against its range, the message naming the first that is out of it.
static int state_check_fields(const TrainerState *s, const char *path) {
    int flash = s->recipe >= 0 && s->recipe < num_recipes && recipes[s->recipe].states == BNB8_STATE_FLASH;
    const struct { const char *name; int64_t v, lo, hi; } f_[] = {
        {"step", s->step, 1, INT64_MAX}, {"data position", s->position, 0, INT64_MAX}, {"B", s->B, 1, 1 << 20},
        {"T", s->T, 1, 1 << 20}, {"recipe", s->recipe, 0, num_recipes - 1}, {"optimizer", s->optimizer, 0, num_optimizers - 1},
        {"release", s->release, 0, 1}, {"micro-batches", s->accum, 1, 1 << 20}, {"StableEmbedding", s->stable_embedding, 0, 1},
        {"optimizer steps", s->opt_steps, 0, s->step}, {"clipping rule", s->clip_rule, CLIP_EXACT, CLIP_EST},
        {"training token count", s->train_tokens, 0, INT64_MAX}, {"ranks", s->ranks, 0, 1 << 20},
        {"scale dtype", s->scale_dtype, 0, flash ? num_scale_dtypes - 1 : 0}, {"total steps (-n)", s->steps, s->step, INT64_C(1) << 40},
        {"weight bytes", s->weight_bytes, s->version >= 2 ? 2 : 0, 4}};
    size_t last = sizeof f_ / sizeof f_[0] - 1;
    for (size_t i = 0; i <= last; i++)
        if (f_[i].v < f_[i].lo || f_[i].v > f_[i].hi || (i == last && f_[i].v != 0 && f_[i].v != 2 && f_[i].v != 4))
            return train_fail("%s: inconsistent trainer state: %s is %lld, expected %s%lld..%lld", path, f_[i].name,
                              (long long)f_[i].v, i == last ? "0, 2 or 4 in " : "", (long long)f_[i].lo, (long long)f_[i].hi);
    if (!(isnan(s->prev_norm) || s->prev_norm >= 0.0))
        return train_fail("%s: inconsistent trainer state: the previous step's norm is %g", path, s->prev_norm);
    const double *p = s->est_profile;   // est: none yet, or three shares that add up to at most 1
    int none_yet = isnan(p[0]) && isnan(p[1]) && isnan(p[2]);
    if (s->clip_rule == CLIP_EST && !none_yet && !(p[0] >= 0.0 && p[1] >= 0.0 && p[2] >= 0.0 && p[0] + p[1] + p[2] <= 1.0 + 1e-9))
        return train_fail("%s: inconsistent trainer state: the est rule's shares are %g, %g, %g", path, p[0], p[1], p[2]);
    return s->version >= 3 ? state_check_run_settings(s, path) : 0;
}

// Version 4 (STATE_WORDS words), 3 (40: without word 39, -V, read as 0), 2 (32: without words 31..38)
// or 1 (16, the shape in the checkpoint's model file), each field checked against its range.
int state_load(TrainerState *s, const char *path) {
    int64_t w[STATE_WORDS] = {0};   // version 1 (16 words): the exact rule, no norm (word 23 NaN)
    double none[3] = {NAN, NAN, NAN};
    memcpy(&w[23], none, sizeof(double));
    memcpy(&w[28], none, sizeof none);
    memcpy(&w[31], none, sizeof(double));   // versions 1 and 2: no -l, -q, -c, -g recorded
    memcpy(&w[33], none, sizeof none);
    if (state_read_words(w, path)) return -1;
    s->version = w[1];
    s->step = w[2]; s->position = w[3]; s->rng = (uint64_t)w[4]; s->B = w[5]; s->T = w[6]; s->recipe = w[7];
    s->optimizer = w[8]; s->stable_embedding = w[9]; s->seed = (uint64_t)w[10]; s->steps = w[11]; s->release = w[12];
    s->accum = w[13] == 0 ? 1 : w[13]; s->weight_bytes = w[14]; s->opt_steps = w[21]; s->clip_rule = w[22];
    memcpy(&s->prev_norm, &w[23], sizeof(double));
    s->train_tokens = w[25]; s->train_digest = w[26]; s->ranks = w[27];
    int flash = s->recipe >= 0 && s->recipe < num_recipes && recipes[s->recipe].states == BNB8_STATE_FLASH;
    s->scale_dtype = s->version == 1 ? flash : w[24];   // version 1 (before e6m10): bf16 scales
    memcpy(s->est_profile, &w[28], sizeof s->est_profile);
    memcpy(&s->lr, &w[31], sizeof(double));
    s->warmup = w[32];
    memcpy(&s->final_lr_frac, &w[33], sizeof(double));
    memcpy(&s->weight_decay, &w[34], sizeof(double));
    memcpy(&s->grad_clip, &w[35], sizeof(double));
    s->map = w[36]; s->blocksize = w[37]; s->optim_digest = w[38]; s->rank1 = w[39];
    if (state_check_fields(s, path)) return -1;
    int64_t shape[6] = {w[15], w[16], w[17], w[18], w[19], w[20]};
    int shape_ok = 1;
    for (int k = 0; k < 6; k++) shape_ok &= shape[k] >= 0 && shape[k] <= INT32_MAX;
    GPT2Config c = {(int)shape[0], (int)shape[1], (int)shape[2], (int)shape[3], (int)shape[4], (int)shape[5], (int)w[9]};
    s->config = c;
    if (s->version >= 2 && !shape_ok) return train_fail("%s: inconsistent trainer state (model shape out of range)", path);
    if (s->version >= 2 && gpt2_config_check(&s->config, path)) return -1;
    return 0;
}

static int empty_writer(FILE *f, const void *ctx) { (void)f; (void)ctx; return 0; }

// The DONE marker of step, written last: the checkpoint is complete.
int checkpoint_done(const char *dir, int64_t step) {
    char path[TRAIN_PATH_MAX];
    checkpoint_path(path, sizeof path, dir, "DONE", step, "");
    return write_atomically(path, empty_writer, NULL);
}

void checkpoint_path(char *buf, size_t size, const char *dir, const char *kind, int64_t step, const char *ext) {
    snprintf(buf, size, "%s/%s_%08lld%s", dir, kind, (long long)step, ext);
}

void checkpoint_optim_path(char *buf, size_t size, const char *dir, int64_t step, int rank, int ranks) {
    char ext[64] = ".bin";
    if (ranks > 0) snprintf(ext, sizeof ext, ".rank%dof%d.bin", rank, ranks);
    checkpoint_path(buf, size, dir, "optim", step, ext);
}

int checkpoint_missing_rank(const char *dir, int64_t step, int ranks) {
    char path[TRAIN_PATH_MAX];
    for (int r = 0; r < ranks; r++) {
        checkpoint_optim_path(path, sizeof path, dir, step, r, ranks);
        if (access(path, F_OK) != 0) return r;
    }
    return -1;
}

int64_t path_size(const char *path) { struct stat st; return stat(path, &st) == 0 ? (int64_t)st.st_size : 0; }

int checkpoint_optim_digest(const char *dir, int64_t step, int ranks, int64_t *digest) {
    char path[TRAIN_PATH_MAX];
    uint64_t one = 0, folded = FNV_START;   // over ranks: FNV-1a of their digests, rank 0 first
    for (int r = 0; r < (ranks ? ranks : 1); r++) {
        checkpoint_optim_path(path, sizeof path, dir, step, r, ranks);
        if (bnb8_optimizer_file_digest(path, &one)) return train_fail("%s", bnb8_last_error());
        folded = fnv1a(folded, &one, sizeof one);
    }
    *digest = (int64_t)(ranks ? folded : one);
    return 0;
}

int checkpoint_state_save(const char *dir, const TrainerState *s, int ranks) {
    char path[TRAIN_PATH_MAX];
    TrainerState bound = *s;
    checkpoint_path(path, sizeof path, dir, "state", s->step, ".bin");
    return checkpoint_optim_digest(dir, s->step, ranks, &bound.optim_digest) || write_atomically(path, state_writer, &bound) ? -1 : 0;
}

// The optimizer file holds every weight as the run keeps it (with its master) and the states; the
// trainer state the rest, with the model's shape: each piece once (DESIGN.md §8.4).
int checkpoint_save(const char *dir, const float *masters, bnb8_optimizer *opt, const TrainerState *s, int64_t *bytes) {
    char path[TRAIN_PATH_MAX], where[160];
    // Weights that are no longer finite are never saved: the newest checkpoint stays a good one.
    if (gpt2_params_nonfinite(&s->config, masters, where, sizeof where))
        return train_fail("step %lld: the weights are not finite (%s): checkpoint not written; the newest complete "
                          "checkpoint in %s is the last good one", (long long)s->step, where, dir);
    static const char *kinds[2] = {"optim", "state"};
    int status = 0;
    int64_t total = 0;
    checkpoint_path(path, sizeof path, dir, "optim", s->step, ".bin");
    if (bnb8_optimizer_save(opt, path)) status = train_fail("%s", bnb8_last_error());
    total += path_size(path);
    if (!status) status = checkpoint_state_save(dir, s, 0);
    checkpoint_path(path, sizeof path, dir, "state", s->step, ".bin");
    total += path_size(path);
    if (!status) status = checkpoint_done(dir, s->step);
    if (status)    // no DONE: the files of this step are useless; a full disk gets their space back
        for (int k = 0; k < 2; k++) { checkpoint_path(path, sizeof path, dir, kinds[k], s->step, ".bin"); remove(path); }
    if (bytes) *bytes = status ? 0 : total;
    return status;
}

// The step a DONE marker's name gives: exactly what checkpoint_path writes ("DONE_" and the step in
// at least 8 digits, no more leading zeros), else 0.
int64_t checkpoint_done_step(const char *name) {
    size_t len = strlen(name);
    if (strncmp(name, "DONE_", 5) != 0 || len < 13 || len > 5 + 13) return 0;   // steps up to 2^40: 13 digits
    int64_t v = 0;
    for (size_t i = 5; i < len; i++) {
        if (name[i] < '0' || name[i] > '9') return 0;
        v = 10 * v + (name[i] - '0');
    }
    char canonical[32];
    snprintf(canonical, sizeof canonical, "DONE_%08lld", (long long)v);
    return strcmp(canonical, name) == 0 ? v : 0;
}

int64_t checkpoint_before(const char *dir, int64_t limit) {
    DIR *d = opendir(dir);
    if (!d) return 0;
    int64_t best = 0;
    struct dirent *e;
    while ((e = readdir(d))) {
        int64_t v = checkpoint_done_step(e->d_name);
        if (v > best && v < limit) best = v;
    }
    closedir(d);
    return best;
}
int64_t checkpoint_latest(const char *dir) { return checkpoint_before(dir, INT64_MAX); }

// The -o directory, before anything trains (DESIGN.md §8.4): made if missing, its path short enough
// for every checkpoint file, writable (a probe file made and removed), and this run's alone: an
// exclusive lock on its LOCK file (lock 1), held until the run ends (trainer_free closes *lock_fd).
// Over NCCL rank 0 holds the lock for every rank (the others may make the directory at the same moment).
int checkpoint_dir_open(const char *dir, int lock, int *lock_fd) {
    struct stat st;
    size_t len = strlen(dir);
    if (len > TRAIN_PATH_MAX - 64)
        return train_fail("the output directory's path is %zu bytes, at most %d are supported: use a shorter -o", len,
                          TRAIN_PATH_MAX - 64);
    if (stat(dir, &st) == 0 && !S_ISDIR(st.st_mode)) return train_fail("output path %s is not a directory", dir);
    if (stat(dir, &st) != 0 && mkdir(dir, 0755) != 0 && errno != EEXIST) return train_fail("cannot create output directory %s: %s", dir, strerror(errno));
    char path[TRAIN_PATH_MAX];
    snprintf(path, sizeof path, "%s/.probe_%ld", dir, (long)getpid());
    int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC, 0644);
    if (fd < 0 || close(fd) != 0 || remove(path) != 0)
        return train_fail("cannot write into the output directory %s (%s): found before training, so that the run "
                          "does not end without its checkpoints", dir, strerror(errno));
    if (!lock) return 0;
    snprintf(path, sizeof path, "%s/LOCK", dir);
    *lock_fd = open(path, O_RDWR | O_CREAT, 0644);
    if (*lock_fd < 0) return train_fail("cannot create %s: %s", path, strerror(errno));
    if (flock(*lock_fd, LOCK_EX | LOCK_NB) != 0)
        return train_fail("%s is in use by another run (it holds %s): give each run its own -o", dir, path);
    return 0;
}

// A name checkpoint_path and checkpoint_optim_path write: optim, state, model (version 1's) or DONE,
// "_" and the step, and its extension, exactly as they write it (one name, one file).
static int checkpoint_file_name(const char *name) {
    static const char *kinds[4] = {"optim", "state", "model", "DONE"};
    for (int k = 0; k < 4; k++) {
        size_t n = strlen(kinds[k]);
        if (strncmp(name, kinds[k], n) != 0 || name[n] != '_' || name[n + 1] < '0' || name[n + 1] > '9') continue;
        char *end, canonical[TRAIN_PATH_MAX];
        long long step = strtoll(name + n + 1, &end, 10);
        int rank = 0, ranks = 0, used = 0;
        if (k == 0 && !(sscanf(end, ".rank%dof%d.bin%n", &rank, &ranks, &used) == 2 && end[used] == 0)) ranks = 0;
        if (k == 0) checkpoint_optim_path(canonical, sizeof canonical, ".", step, rank, ranks);
        else checkpoint_path(canonical, sizeof canonical, ".", kinds[k], step, k == 3 ? "" : ".bin");
        return strcmp(canonical + 2, name) == 0;   // the names those write, less "./"
    }
    return 0;
}

static int temporary_suffix(const char *suffix, long long *pid);

// A temporary of a checkpoint file: its name and ".tmp.<pid>.<n>" (bnb8_write_atomically), or ".tmp"
// (the trainer's older form).
static int checkpoint_temporary_name(const char *name) {
    const char *tmp = strstr(name, ".tmp");
    char base[TRAIN_PATH_MAX];
    long long pid;
    if (!tmp || (size_t)(tmp - name) >= sizeof base || !temporary_suffix(tmp, &pid)) return 0;
    memcpy(base, name, (size_t)(tmp - name));
    base[tmp - name] = 0;
    return checkpoint_file_name(base);
}

int checkpoint_own_name(const char *name) {
    return checkpoint_file_name(name) || checkpoint_temporary_name(name) || strcmp(name, "LOCK") == 0;
}

// Removes the temporaries a run killed while writing left in dir (a kill or SIGXFSZ between create
// and rename): regular files named as a checkpoint file's temporary, and nothing else, for -o may be
// a directory that other programs' files share (doc/guarantees.md). Called at start, once the run
// holds dir's lock.
void checkpoint_remove_temporaries(const char *dir, int verbose) {
    DIR *d = opendir(dir);
    if (!d) return;
    struct dirent *e;
    struct stat st;
    char path[TRAIN_PATH_MAX];
    while ((e = readdir(d)))
        if (checkpoint_temporary_name(e->d_name) && snprintf(path, sizeof path, "%s/%s", dir, e->d_name) < (int)sizeof path &&
            lstat(path, &st) == 0 && S_ISREG(st.st_mode) && unlink(path) == 0 && verbose)
            printf("note: removed %s, a temporary file an interrupted run left\n", path);
    closedir(d);
}

// The same file: both exist and are one (device and inode).
static int same_file(const char *a, const char *b) {
    struct stat x, y;
    return stat(a, &x) == 0 && stat(b, &y) == 0 && x.st_dev == y.st_dev && x.st_ino == y.st_ino;
}

static void export_remove_temporaries(const char *dir, const char *name, int verbose);

int export_check(const TrainArgs *a) {
    const char *path = a->export_path;
    if (!path[0]) return 0;
    // its directory and its name in it: the file is written as a temporary there, then renamed
    char dir[TRAIN_PATH_MAX], probe[TRAIN_PATH_MAX + 32];
    const char *slash = strrchr(path, '/'), *name = slash ? slash + 1 : path;
    if (strlen(path) >= sizeof dir) return train_fail("-X %s: the path is longer than %d bytes", path, TRAIN_PATH_MAX - 1);
    if (!slash) snprintf(dir, sizeof dir, ".");
    else if (slash == path) snprintf(dir, sizeof dir, "/");
    else snprintf(dir, sizeof dir, "%.*s", (int)(slash - path), path);
    struct stat st;
    if (!name[0] || (stat(path, &st) == 0 && S_ISDIR(st.st_mode)))
        return train_fail("-X %s is a directory: name the model file to write", path);
    // the run's own files: its inputs, by identity, and -o's checkpoint files, those of any step,
    // written or to come (the directory by identity, the name by the names the trainer writes)
    size_t m = strlen(a->model);   // a descriptor names no file
    const char *model = m > 4 && strcmp(a->model + m - 4, ".bin") == 0 ? a->model : "";
    const char *inputs[4][2] = {{a->train_path, "-i"}, {a->val_path, "-j"}, {a->tokenizer_path, "-z"}, {model, "-e"}};
    for (int k = 0; k < 4; k++)
        if (inputs[k][0] && inputs[k][0][0] && (strcmp(inputs[k][0], path) == 0 || same_file(inputs[k][0], path)))
            return train_fail("-X %s is the run's input %s %s: exporting would replace it; name another file", path,
                              inputs[k][1], inputs[k][0]);
    if (a->out_dir[0] && same_file(dir, a->out_dir) && checkpoint_own_name(name))
        return train_fail("-X %s is a file of the checkpoint directory -o %s: exporting would replace it; name another "
                          "file", path, a->out_dir);
    // writable: a probe file made and removed, found before training as -o's is
    snprintf(probe, sizeof probe, "%s/.probe_%ld", dir, (long)getpid());
    int fd = open(probe, O_WRONLY | O_CREAT | O_EXCL, 0644);
    if (fd < 0 || close(fd) != 0 || remove(probe) != 0)
        return train_fail("-X %s: cannot write into %s (%s): found before training, so that the run does not end "
                          "without its export", path, dir, strerror(errno));
    export_remove_temporaries(dir, name, a->verbose);
    return 0;
}

// What follows a file's name in the name of its temporary: ".tmp.<pid>.<n>" (bnb8_write_atomically;
// *pid the writer's, 0 when the digits are too many for one) or ".tmp" (the trainer's older form,
// *pid 0: no writer named).
static int temporary_suffix(const char *suffix, long long *pid) {
    *pid = 0;
    if (strncmp(suffix, ".tmp", 4) != 0) return 0;
    const char *p = suffix + 4;
    for (int part = 0; *p && part < 2; part++) {   // ".<digits>" twice, or nothing
        if (*p++ != '.' || *p < '0' || *p > '9') return 0;
        const char *digits = p;
        while (*p >= '0' && *p <= '9') p++;
        if (part == 0 && p - digits <= 18) *pid = strtoll(digits, NULL, 10);
        if (part == 0 && *p != '.') return 0;
    }
    return *p == 0;
}

// The writer of a temporary is gone: no process has its pid (kill's ESRCH). A pid that a process has,
// or that cannot be one, or a process this one may not signal, counts as alive.
static int temporary_writer_gone(long long pid) {
    return pid > 0 && pid <= INT_MAX && kill((pid_t)pid, 0) != 0 && errno == ESRCH;
}

// Removes the temporaries of the export to dir/name that a run killed while writing it left: regular
// files named name.tmp.<pid>.<n> whose writer is gone. Another run exporting to the same path at this
// moment keeps its own (its pid is alive); a name.tmp without a pid names no writer and stays.
static void export_remove_temporaries(const char *dir, const char *name, int verbose) {
    char file[TRAIN_PATH_MAX + 256];
    size_t n = strlen(name);
    DIR *d = opendir(dir);
    if (!d) return;
    struct dirent *e;
    struct stat st;
    long long pid;
    while ((e = readdir(d)))
        if (strncmp(e->d_name, name, n) == 0 && temporary_suffix(e->d_name + n, &pid) && temporary_writer_gone(pid) &&
            snprintf(file, sizeof file, "%s/%s", dir, e->d_name) < (int)sizeof file && lstat(file, &st) == 0 &&
            S_ISREG(st.st_mode) && unlink(file) == 0 && verbose)
            printf("note: removed %s, a temporary file of -X that an interrupted run (pid %lld) left\n", file, pid);
    closedir(d);
}

// ------------------------------------------------------------------------------------------------
// Resume

// A checkpoint is resumed by as many ranks as wrote it (ranks 0: a single process): each optimizer
// file holds one rank's shards (the library refuses another sharding, file by file).
static int ranks_refused(const char *path, const TrainerState *st, int ranks) {
    char was[96], now[64], how[160];
    if (st->ranks) snprintf(was, sizeof was, "%lld ranks over NCCL (one optimizer file per rank)", (long long)st->ranks);
    else snprintf(was, sizeof was, "a single process (one optimizer file)");
    if (ranks) snprintf(now, sizeof now, "%d ranks", ranks);
    else snprintf(now, sizeof now, "a single process");
    if (st->ranks) snprintf(how, sizeof how, "with %lld ranks (mpirun -np %lld, or BNB8_RANKS=%lld and BNB8_RANK=0..%lld)",
                            (long long)st->ranks, (long long)st->ranks, (long long)st->ranks, (long long)st->ranks - 1);
    else snprintf(how, sizeof how, "as a single process (no OMPI_COMM_WORLD_SIZE or BNB8_RANKS)");
    return train_fail("%s: the checkpoint of step %lld was written by %s, this run is %s: resume it %s, or train "
                      "afresh in another -o (a checkpoint is not re-sharded)", path, (long long)st->step, was, now, how);
}

// A flag's value as the messages print it: -M's name, the integers' digits, the floats' shortest
// decimal that reads back as the same float.
static const char *flag_value_text(char *buf, size_t size, char flag, double v) {
    if (flag == 'M') snprintf(buf, size, "%s", v == BNB8_MAP_LINEAR ? "linear" : "dynamic");
    else if (flag == 'V') snprintf(buf, size, "%s", v == 1 ? "rank1" : "block");
    else if (flag == 'n' || flag == 'u' || flag == 'K') snprintf(buf, size, "%lld", (long long)v);
    else
        for (int digits = 6; digits <= 9; digits++) {
            snprintf(buf, size, "%.*g", digits, v);
            if ((float)strtod(buf, NULL) == (float)v) break;
        }
    return buf;
}

// The flags that define the run beside those resume_state compares: its schedule (-n, -l, -u, -q),
// its decay and clip (-c, -g) and its states (-M, -K, -V). One left out takes the checkpoint's value,
// whatever default it would have had (the GPU's too); one given with another value is refused,
// naming both. Versions 1 and 2 record -n only: the others are this run's, unchecked (noted); version
// 3 has no word of -V, which was always block then (read as 0, and compared).
static int resume_run_settings(Trainer *t, const char *path) {
    TrainArgs *a = &t->a;
    const TrainerState *st = &t->resumed;
    const struct { char flag; double run, kept; } f[] = {
        {'n', (double)a->steps, (double)st->steps}, {'l', t->lr, st->lr}, {'u', (double)a->warmup, (double)st->warmup},
        {'q', a->final_lr_frac, st->final_lr_frac}, {'c', t->wd, st->weight_decay}, {'g', a->grad_clip, st->grad_clip},
        {'M', a->map, (double)st->map}, {'K', (double)a->blocksize, (double)st->blocksize}, {'V', a->rank1, (double)st->rank1}};
    int recorded = st->version >= 3 ? (int)(sizeof f / sizeof f[0]) : 1;
    char kept[32], run[32];
    for (int i = 0; i < recorded; i++)
        if (a->given[(int)f[i].flag] && f[i].run != f[i].kept)
            return train_fail("%s: the checkpoint's run has -%c %s, this run gives -%c %s: leave -%c out to resume with "
                              "the checkpoint's, or train with -%c %s afresh in another -o%s", path, f[i].flag,
                              flag_value_text(kept, sizeof kept, f[i].flag, f[i].kept), f[i].flag,
                              flag_value_text(run, sizeof run, f[i].flag, f[i].run), f[i].flag, f[i].flag, run,
                              a->export_path[0] ? " (-x 1 -X exports the checkpoint without training)" : "");
    a->steps = st->steps;
    if (st->version < 3) {
        if (a->verbose)
            printf("note: %s is of trainer state version %lld, which records no -l, -u, -q, -c, -g, -M, -K, -V and binds no "
                   "optimizer file: this run's values are used, unchecked\n", path, (long long)st->version);
        return 0;
    }
    t->lr = (float)st->lr; a->warmup = st->warmup; a->final_lr_frac = (float)st->final_lr_frac;
    t->wd = (float)st->weight_decay; a->grad_clip = (float)st->grad_clip;
    a->map = (int)st->map; a->blocksize = st->blocksize; a->rank1 = (int)st->rank1;
    return 0;
}

// The optimizer files of the checkpoint are those its trainer state was written with (version 3
// binds them by their digest): a backup restored into the wrong directory gives files of two runs at
// one step, whose states do not belong together. A mismatch is the checkpoint's (t->damaged).
static int resume_bound_files(Trainer *t, const char *path, int ranks) {
    const TrainerState *st = &t->resumed;
    int64_t digest = 0;
    if (st->version < 3) return 0;
    if (checkpoint_optim_digest(t->a.out_dir, t->start, ranks, &digest)) return -1;
    if (digest != st->optim_digest)
        return train_fail("%s: the trainer state was written with other optimizer files than %s%s (digest %016llx, "
                          "theirs %016llx): files of different checkpoints", path, t->model_path,
                          ranks ? " and the other ranks'" : "", (unsigned long long)st->optim_digest,
                          (unsigned long long)digest);
    return 0;
}

// A file's bytes, refused when it is not a regular file (a directory's stat size means nothing).
static int regular_file_size(const char *path, const char *what, int64_t *size) {
    FILE *f = open_input(path, what);
    if (!f) return -1;
    int status = file_size_of(f, path, size);
    fclose(f);
    return status;
}

static int resume_state(Trainer *t, int rank, int ranks) {
    const TrainArgs *a = &t->a;
    TrainerState *st = &t->resumed;
    char path[TRAIN_PATH_MAX];
    checkpoint_path(path, sizeof path, a->out_dir, "state", t->start, ".bin");
    t->damaged = 1;   // a failure of the checkpoint's files (not of this run's settings): trainer_open falls back
    if (state_load(st, path)) return -1;
    if (st->step != t->start)
        return train_fail("%s: the trainer state of step %lld: files of different checkpoints", path, (long long)st->step);
    t->damaged = 0;
    if (st->ranks != ranks) return ranks_refused(path, st, ranks);
    int missing = checkpoint_missing_rank(a->out_dir, t->start, ranks);
    if (missing >= 0) {
        checkpoint_optim_path(t->model_path, sizeof t->model_path, a->out_dir, t->start, missing, ranks);
        t->damaged = 1;
        return train_fail("%s: rank %d's optimizer file of this checkpoint is missing: an incomplete checkpoint", t->model_path, missing);
    }
    int ri = (int)(t->recipe - recipes), oi = (int)(t->oc - optimizers);
    if (st->clip_rule != t->rule)
        return train_fail("%s: the checkpoint was made with clipping rule %s, this run asks for %s (-N)", path,
                          clip_rule_names[st->clip_rule], clip_rule_names[t->rule]);
    t->prev_norm = st->prev_norm;
    // the checkpoint's group scales; version 1 records none (bf16 before e6m10): -S may name them
    if (a->scale_dtype >= 0 && a->scale_dtype != st->scale_dtype && st->version >= 2)
        return train_fail("%s: the checkpoint's flash group scales are %s, this run asks for %s (-S): leave -S out to "
                          "resume with the checkpoint's", path, scale_dtypes[st->scale_dtype].name, scale_dtypes[a->scale_dtype].name);
    t->scale = a->scale_dtype >= 0 ? a->scale_dtype : (int)st->scale_dtype;
    memcpy(t->profile, st->est_profile, sizeof t->profile);
    if (st->B != a->B || st->T != a->T || st->recipe != ri || st->optimizer != oi ||
        st->release != a->release || st->accum != a->accum)
        return train_fail("%s: the checkpoint was made with step %lld, B=%lld, T=%lld, A=%lld, recipe %s, optimizer %s, "
                          "release %lld; this run asks for B=%lld, T=%lld, A=%lld, recipe %s, optimizer %s, release %d", path,
                          (long long)st->step, (long long)st->B, (long long)st->T, (long long)st->accum,
                          recipes[st->recipe].name, optimizers[st->optimizer].name, (long long)st->release, (long long)a->B,
                          (long long)a->T, (long long)a->accum, t->recipe->name, t->oc->name, a->release);
    // the optimizer file holds the weights as the run kept them (files without word 14: fp32 for the
    // fp32-master recipes, bf16 for the others)
    int64_t wb = st->weight_bytes ? st->weight_bytes : recipes[st->recipe].correction_bytes == 4 ? 4 : 2;
    if (wb != (int64_t)bnb8_dtype_size(t->lay.weights))
        return train_fail("%s: the checkpoint keeps %s weights, this run %s ones: resume it on the model it was made "
                          "with (-D, -P)", path, wb == 4 ? "fp32" : "bf16", dtype_name(t->lay.weights));
    if (resume_run_settings(t, path)) return -1;
    t->damaged = 1;
    if (st->version == 1) {   // the older layout: the fp32 masters in an llm.c model file beside it
        checkpoint_path(t->model_path, sizeof t->model_path, a->out_dir, "model", t->start, ".bin");
        if (access(t->model_path, F_OK) != 0)
            return train_fail("%s: a checkpoint of the older layout (trainer state version 1), whose model file %s is "
                              "missing: restore that file, or resume from a newer checkpoint", path, t->model_path);
        if (gpt2_load(&t->model, t->model_path)) return -1;
        t->damaged = 0;
        return 0;
    }
    // Every weight comes from the optimizer file: until then they are NaN, so that one it did not
    // restore cannot pass for a weight (checked after the load, optimizer_open).
    checkpoint_optim_path(t->model_path, sizeof t->model_path, a->out_dir, t->start, rank, ranks);
    if (resume_bound_files(t, path, ranks)) return -1;
    int64_t held = rank_weights(t, &st->config, rank, ranks), least = held * wb, size = 0;
    if (held < 0 || regular_file_size(t->model_path, "optimizer state", &size)) return -1;
    if (size < least)   // checked before allocating: a bad shape cannot ask for terabytes
        return train_fail("%s: %lld bytes, too few for the %lld weights the trainer state %s describes%s: a damaged or "
                          "mismatched checkpoint", t->model_path, (long long)size, (long long)held, path,
                          ranks ? " (this rank's shards)" : "");
    t->damaged = 0;
    if (gpt2_create(&t->model, &st->config)) return -1;
    for (int64_t i = 0; i < t->model.num_parameters; i++) t->model.params_memory[i] = NAN;
    return 0;
}

// "L=12 C=768 NH=12 V=50257 (padded 50304) maxT=1024", for messages.
static const char *shape_text(char *buf, size_t size, const GPT2Config *c) {
    snprintf(buf, size, "L=%d C=%d NH=%d V=%d (padded %d) maxT=%d", c->num_layers, c->channels, c->num_heads,
             c->vocab_size, c->padded_vocab_size, c->max_seq_len);
    return buf;
}

// A resumed run continues its checkpoint's model, RNG and data position (DESIGN.md §8.4): an -e that
// describes another model is refused (-w: open_model, as for a .bin model); a seed (-d) other than
// the checkpoint's is noted; the training tokens (-i) are checked once loaded (open_data).
static int check_resumed_model(Trainer *t) {
    const TrainArgs *a = &t->a;
    const GPT2Config *m = &t->model.config;
    char have[128], want[128];
    if (a->given['e']) {
        GPT2Config c;
        size_t len = strlen(a->model);
        int bin = len > 4 && strcmp(a->model + len - 4, ".bin") == 0;
        if (bin ? gpt2_load_config(&c, a->model) : gpt2_config_from_descriptor(&c, a->model)) return -1;
        if (c.max_seq_len != m->max_seq_len || c.vocab_size != m->vocab_size || c.padded_vocab_size != m->padded_vocab_size ||
            c.num_layers != m->num_layers || c.num_heads != m->num_heads || c.channels != m->channels ||
            (bin && c.stable_embedding != m->stable_embedding))
            return train_fail("-e %s is %s%s; the checkpoint of step %lld in %s holds %s%s: a resumed run continues the "
                              "checkpoint's model (leave -e out, or train the other model in another -o)", a->model,
                              shape_text(want, sizeof want, &c), bin && c.stable_embedding ? " with StableEmbedding" : "",
                              (long long)t->start, a->out_dir, shape_text(have, sizeof have, m),
                              m->stable_embedding ? " with StableEmbedding" : "");
    }
    if (a->seed != t->resumed.seed && a->verbose)
        printf("note: resuming: the random numbers continue from the checkpoint (its run's seed %llu); -d %llu is not "
               "used\n", (unsigned long long)t->resumed.seed, (unsigned long long)a->seed);
    t->a.seed = t->resumed.seed;   // the run's seed, which its next checkpoints record again
    return 0;
}

int checkpoint_resume(Trainer *t, int rank, int ranks) {
    return resume_state(t, rank, ranks) || check_resumed_model(t) ? -1 : 0;
}

// ------------------------------------------------------------------------------------------------
// Pruning (-L)

static int newest_first(const void *a, const void *b) {
    int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
    return x < y ? 1 : x > y ? -1 : 0;
}

// The steps of dir's complete checkpoints at or below step, newest first: *count of them in *steps
// (the caller frees it).
static int complete_steps(const char *dir, int64_t step, int64_t **steps, int64_t *count) {
    DIR *d = opendir(dir);
    int64_t cap = 0;
    *steps = NULL;
    *count = 0;
    if (!d) return train_fail("-L: cannot read the checkpoint directory %s: %s", dir, strerror(errno));
    struct dirent *e;
    while ((e = readdir(d))) {
        int64_t v = checkpoint_done_step(e->d_name);
        if (v == 0 || v > step) continue;
        if (*count == cap) {
            int64_t *more = (int64_t *)realloc(*steps, sizeof(int64_t) * (size_t)(cap = cap ? 2 * cap : 64));
            if (!more) { closedir(d); return train_fail("out of memory"); }
            *steps = more;
        }
        (*steps)[(*count)++] = v;
    }
    closedir(d);
    if (*count) qsort(*steps, (size_t)*count, sizeof(int64_t), newest_first);
    return 0;
}

// Removes one file of a checkpoint; one that is not there is no failure (a version 1 model file, the
// optimizer file of the other layout). What is not a regular file (a directory, a symlink) was not
// written by the run, whatever its name, and stays. after: what a failure leaves, for the message.
static int remove_checkpoint_file(const char *path, const char *after) {
    struct stat st;
    if (lstat(path, &st) != 0) return errno == ENOENT ? 0 : train_fail("-L: cannot read %s (%s): %s", path, strerror(errno), after);
    if (!S_ISREG(st.st_mode))
        return train_fail("-L: %s is not a regular file, so not one the run wrote: left as it is; %s", path, after);
    if (unlink(path) == 0 || errno == ENOENT) return 0;
    return train_fail("-L: cannot remove %s (%s): %s", path, strerror(errno), after);
}

// A checkpoint's files once its DONE is gone, by the names the run writes: the trainer state, a
// version 1 model file, the optimizer file of a single process and those of this run's ranks.
static int remove_checkpoint_files(const char *dir, int64_t step, int ranks) {
    static const char *after = "its checkpoint is no longer complete (its DONE is gone): remove the file by hand";
    char path[TRAIN_PATH_MAX];
    int status = 0;
    checkpoint_path(path, sizeof path, dir, "state", step, ".bin");
    status |= remove_checkpoint_file(path, after);
    checkpoint_path(path, sizeof path, dir, "model", step, ".bin");
    status |= remove_checkpoint_file(path, after);
    for (int r = -1; r < ranks; r++) {   // -1: the single process's optim_s.bin
        checkpoint_optim_path(path, sizeof path, dir, step, r < 0 ? 0 : r, r < 0 ? 0 : ranks);
        status |= remove_checkpoint_file(path, after);
    }
    return status;
}

// Each pruned checkpoint loses its DONE first, so that a kill from then on never leaves a DONE beside
// missing files; a DONE that cannot be removed keeps its checkpoint whole. Every checkpoint is tried;
// the first failure's message is kept.
int checkpoint_prune(const char *dir, int64_t step, int64_t keep, int ranks, CheckpointsPruned *pruned) {
    memset(pruned, 0, sizeof *pruned);
    if (keep <= 0) return 0;
    int64_t count, *steps;
    if (complete_steps(dir, step, &steps, &count)) { free(steps); return -1; }
    char path[TRAIN_PATH_MAX], first_error[sizeof train_error_text] = "";
    for (int64_t i = keep; i < count; i++) {   // steps[0] is this step's: always kept
        checkpoint_path(path, sizeof path, dir, "DONE", steps[i], "");
        int failed = remove_checkpoint_file(path, "its checkpoint is kept, complete");
        if (!failed) {
            pruned->count++;
            pruned->oldest = steps[i];
            if (!pruned->newest) pruned->newest = steps[i];
            failed = remove_checkpoint_files(dir, steps[i], ranks);
        }
        if (failed && !first_error[0]) snprintf(first_error, sizeof first_error, "%s", train_error_text);
    }
    free(steps);
    return first_error[0] ? train_fail("%s", first_error) : 0;
}
