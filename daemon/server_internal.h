/* server_internal.h - state shared by server.c (lifecycle, loop), control.c
 * (trainer requests, replies, buffer maps), status.c (the status plane) and
 * checkpoint.c.  They call one another downwards only: server -> control ->
 * status -> checkpoint -> job -> engine.  The server holds the sockets, the
 * trainers and the layout; the engine and the step counter are the job's
 * (struct job, job.h), and these files reach the engine only through job.c. */
#ifndef SCAPE_SERVER_INTERNAL_H
#define SCAPE_SERVER_INTERNAL_H

#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>
#include <zmq.h>

#include "ckpt.h"
#include "config.h"
#include "engine.h"
#include "job.h"
#include "scape.pb-c.h"
#include "server.h"
#include "shm.h"

#define SRV_MAX_SLOTS 64
#define SRV_RID_MAX 256
#define SRV_HARD_MAX_MESSAGE (64u << 20) /* ZeroMQ drops peers past this */

/* A CUDA IPC map waiting for the comm to be quiet before it is closed, and
 * the trainer owed a detach reply once it is (rid_len 0: none). */
typedef struct grave {
    shm_map map;
    unsigned char rid[SRV_RID_MAX];
    size_t rid_len;
} grave;

/* A StepDone message and the storage it points into. */
typedef struct step_done_msg {
    Scape__StepDone d;
    Scape__Phases ph;
    Scape__CollectiveCount coll[COMM_OP_COUNT];
    Scape__CollectiveCount *coll_p[COMM_OP_COUNT];
} step_done_msg;

typedef struct trainer {
    int used;
    int registered;
    int wants_sync;                 /* sent Sync, not yet answered */
    int wants_resume;               /* sent Resume, not yet answered */
    int synced;                     /* holds the job's parameters; may step */
    unsigned char rid[SRV_RID_MAX]; /* ZeroMQ routing id */
    size_t rid_len;
    char identity[96];
    pid_t pid;
    int index;
    shm_map params, grads;
    int posted;                     /* has posted the pending step */
    float lr[ENG_MAX_GROUPS];       /* its learning rate per parameter group */
    int has_loss;
    float loss;
    uint64_t last_step;             /* last step it posted */
    size_t step_msg_bytes;          /* size of its Step message */
    double posted_at;
    double queued;                 /* its Step's wait before it was read; < 0: unknown */
    int clip_run;                   /* max_grad_norm: consecutive steps whose own
                                       gradient norm was the bound itself */
    int clip_warned;                /* that was logged (once per trainer) */
    unsigned char *bucket;          /* registered tensors it posted (Post) for the next step */
    char post_refused[256];         /* a Post refused: its next Step is answered so */
} trainer;

struct server {
    scaped_config cfg;
    char dir[256];
    char ep_control[300], ep_status[300], ep_events[300];
    int lock_fd;
    int locked;                     /* we own the runtime directory */
    void *zctx, *ctrl, *status, *events;
    double started_at;

    trainer slots[SRV_MAX_SLOTS];

    /* The layout every trainer must register (set by the first). */
    eng_tensor *layout;
    size_t ntensors;
    eng_group groups[ENG_MAX_GROUPS]; /* and its parameter groups (ngroups 0: none) */
    size_t ngroups;
    size_t numel;
    kern_dtype pdt, gdt;
    /* Bucketed hand-over: the registered tensors given to the engine early
     * for the next step, and the scratch of what to give it now. */
    unsigned char *early, *take;

    comm_t *comm;
    char data_ep[256];             /* host backend: the bound data-plane address */
    uint64_t rdv_refused;           /* rank 0: joins its rendezvous refused */
    int auth_mode;                 /* auth_mode the job's daemons use (world > 1) */
    int curve;                     /* the data plane runs CURVE */
    uint64_t foreign_seen;          /* comm_foreign count already logged */
    uint64_t refused_seen;          /* comm_refused count already logged */
    char curve_public[41];          /* the data plane's CURVE public key ("": none) */
    shm_map spare;                  /* params of the last trainer that left, for the next */
    struct grave *graves;           /* CUDA IPC maps of gone trainers, closed once the */
    int ngraves, cap_graves;        /*   comm is quiet (ctl_close_map) */
    int stopping;
    double next_check;            /* job_now() of the next trainer liveness check */
    size_t msg_bytes;               /* size of the request being handled */

    job job;                  /* the engine, the next step and the steps' figures
                                 (job.h: only job.c touches the engine) */
    struct mhttp *metrics_http;    /* metrics_listen's HTTP server (NULL: off) */
    Scape__Request *held;           /* a checkpoint request that came during a collective,
                                       answered after it (status_release); NULL: none */

    /* Checkpoints (checkpoint.c). */
    int ckpt_requested;             /* scapectl checkpoint, not yet taken */
    uint64_t ckpt_step;             /* the newest one taken (0: none) */
    char ckpt_dir[CKPT_PATH_MAX];
    char ckpt_error[512];           /* why the last attempt failed ("" = it did not) */
    uint64_t ckpt_count;
    int resuming;                   /* the job starts from `resume` */
    ckpt_ref resume;
    uint64_t resumed_from;
    char resumed_dir[CKPT_PATH_MAX]; /* the checkpoint the job restarted from
                                        at trainers' request ("" = none) */
    char resume_req[CKPT_PATH_MAX]; /* the one trainers ask to restart from */
    char ckpt_name[CKPT_PATH_MAX];  /* ckpt_dir relative to checkpoint_dir ("": not under) */
    uint32_t ckpt_rounds;           /* between-steps checkpoint rounds since the last step */
    double ckpt_look_at;            /* job_now() from which an idle daemon looks for
                                       another's state_dict request */
    int leave_mark;                 /* this daemon's marker in checkpoint_dir: CKPT_NO_MARK,
                                       CKPT_IDLE (no trainer) or CKPT_LEAVING (stopping) */
    int leave_warned;               /* a marker that could not be written was logged */
    int all_ckpt_dirs;              /* every daemon of the job has a checkpoint_dir (agreed at
                                       the start): only then do they leave together */
    int job_over;                   /* every daemon agreed that none can be asked for a
                                       state_dict any more (the leave round) */
};

/* Send an encoded Reply to the trainer with routing id rid. */
scape_rc ctl_reply(server *s, const unsigned char *rid, size_t rid_len, const Scape__Reply *r);
/* Send an error reply with code rc and the current last-error message. */
void ctl_reply_error(server *s, const unsigned char *rid, size_t rid_len, scape_rc rc);
/* Handle one decoded request from the control socket. */
void ctl_handle(server *s, const unsigned char *rid, size_t rid_len, const Scape__Request *q);
/* Drop a trainer (it died or detached); abandons a partly posted step. */
void ctl_drop(server *s, trainer *t, int died);
/* Answer the syncs that can be answered now. */
void ctl_maybe_sync(server *s);
/* Run the pending step if every synced trainer has posted it. */
void ctl_maybe_step(server *s);
/* Number of registered trainers, or (synced) of those that may step. */
static inline int srv_trainers(const server *s, int synced)
{
    int n = 0;
    for (int i = 0; i < SRV_MAX_SLOTS; i++)
        n += s->slots[i].used && (synced ? s->slots[i].synced : s->slots[i].registered);
    return n;
}
/* Close a trainer's buffer map.  A CUDA IPC map is closed only once the
 * comm has no device work in flight (closing synchronises the device, which
 * a collective stalled by a dead peer would never let finish): until then it
 * waits in s->graves, and ctl_reap_maps closes it. */
void ctl_close_map(server *s, shm_map *m, int unlink_it);
/* Close the waiting maps when the comm is quiet, or now when force, and send
 * the detach replies owed for them. */
void ctl_reap_maps(server *s, int force);
/* Answer a detach with OK once this trainer's maps are closed: now if none
 * of them waits (ctl_close_map), else when ctl_reap_maps closes them.  The
 * trainer frees its CUDA buffers on that answer. */
void ctl_reply_detached(server *s, int graves_before, const unsigned char *rid, size_t rid_len);
/* The job's last step as a StepDone message (filled when it is sent: the
 * trainers' reply, status, metrics and the events). */
void status_step_done(const job *j, step_done_msg *m);
/* 1 when the process that sent msg on an ipc socket (its SO_PEERCRED, which
 * ZeroMQ puts in the Peer-Address property as "...:uid:gid:pid") runs as
 * another user than this daemon's (root excepted): the error is set and
 * logged (what names the socket).  0 when it is this user, or when
 * this libzmq gives no credentials (the 0700 runtime directory still
 * guards the sockets then). */
int status_peer_refused(server *s, zmq_msg_t *msg, const char *what);
/* Answer one request on the status socket.  During a collective (the comm
 * wait hook) a checkpoint request is held until the collective is over. */
void status_serve(server *s);
/* The status plane's poll items into items (room for 1 + MHTTP_MAX_ITEMS):
 * the status socket, unless a held request waits for its answer, and the
 * metrics listener's; returns how many. */
int status_poll_items(server *s, zmq_pollitem_t *items);
/* Serve what the n items of status_poll_items say is ready; returns how many
 * status requests came. */
int status_poll_serve(server *s, const zmq_pollitem_t *items, int n);
/* Between collectives: answer the held checkpoint request, if any. */
void status_release(server *s);
/* After each completed step: publish its Metrics on the events socket. */
void status_publish(server *s);
/* The Prometheus text exposition of a status reply, as scapectl metrics
 * prints it, written to out (metrics_http's render callback; arg: the
 * server).  0, or -1 when it could not be written. */
int status_metrics(void *arg, FILE *out);

/* Check the configured `resume` checkpoint at start-up (before any trainer
 * attaches): the job will continue after its step. */
scape_rc ckp_prepare_resume(server *s);
/* Give the new engine its starting state: the checkpoint when resuming, else
 * trainer 0's parameters (collective). */
scape_rc ckp_start(server *s, void *const *params);
/* The job has started (the trainers have their parameters): a later start
 * (after the engine is lost) is a fresh one. */
void ckp_started(server *s);
/* After a completed step: agree with the other daemons whether a checkpoint
 * is due (requested here or there, SIGUSR1, or the period) and take it. */
void ckp_after_step(server *s, uint64_t step);
/* scapectl checkpoint (after the next step); now: a trainer's state_dict,
 * the state after the last step, on disk when this returns (several daemons
 * write it together in a between-steps round); before step 1 of a fresh job
 * step 0 and no directory.  out: the reply's figures (pointing into s). */
scape_rc ckp_request(server *s, int now, Scape__CheckpointInfo *out);
/* Before step t's engine step, several daemons: between-steps rounds until
 * one where no daemon asks for a checkpoint (a state_dict on another daemon
 * meets this daemon here when it has not seen the request while idle). */
scape_rc ckp_before_step(server *s, uint64_t t);
/* Idle, several daemons: join a between-steps round that a state_dict on
 * another daemon asked for (its request file in checkpoint_dir). */
void ckp_idle(server *s);
/* Stopping, several daemons (checkpoint.c's "Leaving together"): 1 when
 * this daemon must first wait for the others, whose trainers may still ask
 * for a state_dict (it has said so in its log); then the loop serves
 * ckp_idle until ckp_left, or a bound, and ckp_leave_end (why: NULL when
 * every daemon left together, else why this one stops alone). */
int ckp_leave_begin(server *s);
int ckp_left(const server *s);
void ckp_leave_end(server *s, const char *why);
/* load_state_dict's checkpoint: given (relative to checkpoint_dir, or
 * absolute) as a path in dir; a step directory that is gone is refused
 * with the reason (pruned by checkpoint_keep, or never there). */
scape_rc ckp_locate(const server *s, const char *given, char *dir, size_t len);
/* The checkpoint figures of status replies. */
void ckp_info(const server *s, Scape__CheckpointInfo *out);

#endif /* SCAPE_SERVER_INTERNAL_H */
