/*
trainer/checkpoint.h — the checkpoints (checkpoint.c): the trainer state file, the checkpoint
directory and the resume from it.

In out_dir, for step s: optim_s.bin (the library's state file: every weight as the run keeps it, with
its master, and the optimizer states), state_s.bin (this trainer's, with the model's shape) and
DONE_s, written last; each written atomically. Each piece of state is in one file once. Resume takes
the newest step that has its DONE. Checkpoints of trainer state version 1 also hold model_s.bin (the
fp32 masters) and a version 1 optimizer file; they still resume. DESIGN.md §8.4.
Over NCCL (N ranks, DESIGN.md §8.8) each rank writes its shards' optimizer file
optim_s.rank<r>of<N>.bin (no optim_s.bin); rank 0 writes state_s.bin (word 27: N) and DONE_s once
every rank has reported its file written. Resume needs the same N (another is refused, saying so).
The trainer state holds the digest of the step's optimizer files (checkpoint_optim_digest): a file of
another checkpoint, of the same step, is not resumed with it.
*/
#ifndef TRAINER_CHECKPOINT_H
#define TRAINER_CHECKPOINT_H

#include "trainer.h"

// The trainer state file: STATE_WORDS little-endian int64, magic and version first, a checksum last.
// Versions 1 (16 words, the weights in the model file, read as the exact rule), 2 (32 words, without
// the words of version 3) and 3 (40 words, without version 4's -V) still load; versions 1 and 2's
// missing fields are not compared on resume, version 3's -V is read as block (all it had).
#define STATE_MAGIC 20251122
#define STATE_VERSION 4
#define STATE_WORDS 41
int state_writer(FILE *f, const void *state);   // a file_writer of a TrainerState
int state_load(TrainerState *s, const char *path);

void checkpoint_path(char *buf, size_t size, const char *dir, const char *kind, int64_t step, const char *ext);
// The optimizer file of step: optim_s.bin (ranks 0, a single process), or rank's of ranks over NCCL,
// optim_s.rank<r>of<N>.bin.
void checkpoint_optim_path(char *buf, size_t size, const char *dir, int64_t step, int rank, int ranks);
// The first rank (0..ranks-1) whose optimizer file of step is not in dir, or -1 when each is there.
int checkpoint_missing_rank(const char *dir, int64_t step, int ranks);
// The digest that binds the optimizer files of step to its trainer state (word 38): the library's
// bnb8_optimizer_file_digest of optim_s.bin, or over N ranks their files' digests folded in rank order.
int checkpoint_optim_digest(const char *dir, int64_t step, int ranks, int64_t *digest);
// The trainer state of step s->step into dir, bound to the step's optimizer files (written before it,
// as by ranks: 0 a single process) by their digest.
int checkpoint_state_save(const char *dir, const TrainerState *s, int ranks);
// Writes the checkpoint of step s->step (s->config is the model's shape): refused, with nothing
// written, when one of the fp32 masters (layout of s->config) is not finite. *bytes (may be NULL):
// the checkpoint's size, its files' bytes.
int checkpoint_save(const char *dir, const float *masters, bnb8_optimizer *opt, const TrainerState *s, int64_t *bytes);
int checkpoint_done(const char *dir, int64_t step);   // the DONE marker of step, written last
int64_t checkpoint_latest(const char *dir);   // the newest step with a DONE marker, or 0
int64_t checkpoint_before(const char *dir, int64_t limit);   // the newest below limit, or 0
int64_t checkpoint_done_step(const char *name);   // the step of a DONE marker's name, or 0
int64_t path_size(const char *path);   // a file's bytes, 0 when there is none

// The -o directory before anything trains: made, checked writable, and (lock 1) locked into *lock_fd.
int checkpoint_dir_open(const char *dir, int lock, int *lock_fd);
// Removes the temporaries a killed run left in dir, saying so (verbose).
void checkpoint_remove_temporaries(const char *dir, int verbose);
// A checkpoint file's name in -o (any step), a temporary of one, or the LOCK: the names the run owns there.
int checkpoint_own_name(const char *name);
// -X before anything trains: refused when it names a directory, an input of the run (-i, -j, -z,
// a .bin -e) or a file of -o's checkpoints, or when its directory is not writable. Else the
// temporaries of this path that a killed run left (path.tmp.<pid>.<n>, regular files whose pid is
// gone) are removed, saying so (verbose).
int export_check(const TrainArgs *a);
// The resume of t->start from t->a.out_dir as rank of ranks (0: a single process): the trainer state
// into t->resumed, checked against the run's settings, and the model of its shape (its weights NaN
// until the optimizer file restores them; a version 1 checkpoint's from its model file). t->damaged
// says whether a failure was the checkpoint's files'.
int checkpoint_resume(Trainer *t, int rank, int ranks);

// -L: once the checkpoint of step is complete, removes the complete checkpoints at or below it beyond
// the newest keep (keep 0: none), each one's DONE first, then its files by the names the run writes
// (ranks: this run's, 0 for a single process); never another file, nor a checkpoint after step or
// one without its DONE. *pruned: how many were removed, the newest and the oldest of their steps.
// -1 when a file could not be removed (the first such in train_error_text); the others are removed.
typedef struct { int64_t count, newest, oldest; } CheckpointsPruned;
int checkpoint_prune(const char *dir, int64_t step, int64_t keep, int ranks, CheckpointsPruned *pruned);

#endif // TRAINER_CHECKPOINT_H
