/* ckpt.h - checkpoints on disk (docs/operations.md, "Checkpoints").
 *
 * A checkpoint after step t is the directory <root>/step-<t>/ (step-<t>.<k>
 * for a later attempt at the same step, so nothing complete is overwritten)
 * holding one file per rank (rank-<r>.ckpt: a header with the engine's meta
 * and a table
 * of sections, each with its 64-bit checksum, then the sections) and, from
 * rank 0, a text MANIFEST listing every rank's file with its size and header
 * checksum.  <root>/LATEST names the newest complete checkpoint.  Every file
 * is written to a temporary name, fsync'ed and renamed, and LATEST moves only
 * after every rank's file and the manifest are down: a crash at any moment
 * leaves the previous checkpoint whole.  The root must be one directory that
 * every daemon of the job sees (a shared file system across nodes).
 */
#ifndef SCAPE_CKPT_H
#define SCAPE_CKPT_H

#include <stddef.h>
#include <stdint.h>

#include "comm.h"
#include "engine.h"

#define CKPT_PATH_MAX 1024

typedef struct ckpt_ref {
    char dir[CKPT_PATH_MAX];  /* the step directory */
    char file[CKPT_PATH_MAX]; /* this rank's file in it */
    uint64_t step;
    uint32_t world;           /* of the job that took it */
    int reshard;              /* taken by another number of daemons */
} ckpt_ref;

/* Collective: write this rank's state after its last step into a fresh step
 * directory that rank 0 names; rank 0 writes the manifest and moves LATEST
 * once every rank succeeded, then checkpoints beyond the newest `keep` are
 * removed.  On
 * success *step_out is t and dir_out the step directory. */
scape_rc ckpt_save(const char *root, eng_t *e, comm_t *comm, int keep, uint64_t *step_out,
                   char *dir_out, size_t dir_len);
/* Resolve path (a checkpoint root with LATEST, or one step directory), read
 * its manifest, and check this rank's file completely (size, header, every
 * section's checksum).  A checkpoint of another world size is resharded:
 * then every rank's file is checked, and out->reshard is set. */
scape_rc ckpt_open(const char *path, int rank, int world, ckpt_ref *out);
/* Collective: restore a freshly created engine from the checked checkpoint
 * and write its parameters into every trainer's buffer.  Every rank learns
 * whether every rank succeeded; on failure the engine must be destroyed.
 * Resharding reads every old rank's file: m, v and theta are taken whole per
 * coordinate, the old ranks' residuals are summed onto the new ranks (old
 * rank q's onto new rank q mod R), so their total is kept, and the masks are
 * re-laid for the new owners. */
scape_rc ckpt_restore(const ckpt_ref *ref, eng_t *e, comm_t *comm, void *const *params);
/* A state_dict named the checkpoint in step directory dir: prune keeps it
 * while it is among the newest `keep` so named. */
scape_rc ckpt_mark_handed_out(const char *dir);
/* dir's name relative to root ("step-25"), or "" when dir is not under root
 * (compared as given, then with symbolic links resolved). */
void ckpt_relative(const char *root, const char *dir, char *name, size_t len);
/* Always an error: why step directory `name` is not in root (pruned by
 * checkpoint_keep, per root's PRUNED list, or never there). */
scape_rc ckpt_missing(const char *root, const char *name, int keep);
/* Between steps, several daemons: a state_dict after `step` asks the others
 * to checkpoint with it in between-steps round `round` through a file in
 * root (ckpt_want); they look for it (ckpt_wanted) while idle; rank 0 removes
 * it after the round (ckpt_unwant). */
scape_rc ckpt_want(const char *root, uint64_t step, uint32_t round);
int ckpt_wanted(const char *root, uint64_t step, uint32_t round);
void ckpt_unwant(const char *root, uint64_t step, uint32_t round);
/* Leaving together (several daemons): each rank marks in root whether it
 * has no trainer (CKPT_IDLE) or is stopping (CKPT_LEAVING), or neither
 * (CKPT_NO_MARK, which removes its marker).  ckpt_marks counts the ranks of
 * `world` with neither (their list, comma-separated, in missing) and those
 * leaving (*leaving); with len 0 it stops at the first such rank (1). */
#define CKPT_NO_MARK 0
#define CKPT_IDLE 1
#define CKPT_LEAVING 2
scape_rc ckpt_mark(const char *root, uint32_t job, int rank, int kind);
int ckpt_marks(const char *root, uint32_t job, int world, int *leaving, char *missing,
               size_t len);
/* 64-bit checksum of n bytes, continuing from h (start with CKPT_HASH_SEED):
 * a change confined to one 8-byte word always changes it. */
#define CKPT_HASH_SEED 0x5343415045434b50ull
uint64_t ckpt_hash(uint64_t h, const void *buf, size_t n);

#endif /* SCAPE_CKPT_H */
