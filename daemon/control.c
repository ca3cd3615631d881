/* control.c - trainer requests on the control socket: hello, register, step,
 * sync, resume, detach; the replies, the trainers' buffer maps, and when a
 * step runs (job.c runs it).  Every refusal is an error reply with a
 * message; nothing a trainer sends can stop the daemon serving the others. */
#define _POSIX_C_SOURCE 200809L
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "log.h"
#include "plan.h"
#include "scape_wire.h"
#include "server_internal.h"
#include "try.h"

#define SCAPED_VERSION "0.1.0"
#define REGISTER_NAME_MAX 255 /* bytes of a tensor name */
#define IDENTITY_SHOWN 80     /* bytes of a trainer's identity kept */
_Static_assert(IDENTITY_SHOWN < sizeof(((trainer *)0)->identity), "identity buffer");
#define MAX_TENSORS (1u << 20)

static trainer *find(server *s, const unsigned char *rid, size_t rid_len)
{
    for (int i = 0; i < SRV_MAX_SLOTS; i++) {
        trainer *t = &s->slots[i];
        if (t->used && t->rid_len == rid_len && memcmp(t->rid, rid, rid_len) == 0)
            return t;
    }
    return NULL;
}

/* ---- replies and the trainers' buffer maps ------------------------------------ */

scape_rc ctl_reply(server *s, const unsigned char *rid, size_t rid_len, const Scape__Reply *r)
{
    size_t len = scape__reply__get_packed_size(r);
    uint8_t *buf = malloc(len ? len : 1);
    if (buf == NULL)
        return scape_set_error(SCAPE_NOMEM, "reply: out of memory");
    scape__reply__pack(r, buf);
    scape_rc rc = SCAPE_OK;
    /* A peer that is gone makes these fail; that is not the daemon's error. */
    if (zmq_send(s->ctrl, rid, rid_len, ZMQ_SNDMORE | ZMQ_DONTWAIT) < 0 ||
        zmq_send(s->ctrl, buf, len, ZMQ_DONTWAIT) < 0) {
        rc = scape_set_error(SCAPE_ZMQ, "reply: %s", zmq_strerror(zmq_errno()));
        LOG_DEBUG(SUB_CTRL, "%s", scape_last_error());
    }
    free(buf);
    return rc;
}

void ctl_reply_error(server *s, const unsigned char *rid, size_t rid_len, scape_rc rc)
{
    Scape__Error e;
    Scape__Reply r;
    wire_error_reply(&r, &e, rc);
    ctl_reply(s, rid, rid_len, &r);
}

/* Nothing on the comm's streams or the executor's device can still touch a
 * trainer's mapped buffer. */
static int maps_idle(const server *s)
{
    return comm_quiet(s->comm) && !job_device_stuck(&s->job);
}

void ctl_close_map(server *s, shm_map *m, int unlink_it)
{
    /* closing a CUDA mapping (and unregistering pinned memory) synchronises,
     * and one that kernels may still use must stay open: it waits among the
     * graves, its detach unanswered, so the trainer does not free it either */
    if ((m->dev == NULL && !m->pinned) || maps_idle(s)) {
        shm_map_close(m, unlink_it);
        return;
    }
    if (s->ngraves == s->cap_graves) {
        int cap = s->cap_graves ? 2 * s->cap_graves : 8;
        grave *g = realloc(s->graves, (size_t)cap * sizeof *g);
        if (g == NULL) { /* no room to wait: close now, and maybe wait there */
            LOG_WARN(SUB_CTRL, "out of memory: closing a CUDA IPC buffer while the comm is busy");
            shm_map_close(m, unlink_it);
            return;
        }
        s->graves = g;
        s->cap_graves = cap;
    }
    s->graves[s->ngraves++] = (grave){ .map = *m };
    memset(m, 0, sizeof *m);
    LOG_DEBUG(SUB_CTRL, "a CUDA IPC buffer waits for the comm to be quiet and the device "
                        "idle before it is closed");
}

static void reply_ok_rid(server *s, const unsigned char *rid, size_t rid_len)
{
    Scape__Reply r = SCAPE__REPLY__INIT;
    r.status = SCAPE__STATUS__OK;
    ctl_reply(s, rid, rid_len, &r);
}

void ctl_reply_detached(server *s, int graves_before, const unsigned char *rid, size_t rid_len)
{
    if (s->ngraves == graves_before || rid_len > SRV_RID_MAX) {
        reply_ok_rid(s, rid, rid_len);
        return;
    }
    grave *g = &s->graves[s->ngraves - 1];
    memcpy(g->rid, rid, rid_len);
    g->rid_len = rid_len;
}

void ctl_reap_maps(server *s, int force)
{
    if (s->ngraves == 0 || !(force || maps_idle(s)))
        return;
    for (int i = 0; i < s->ngraves; i++)
        shm_map_close(&s->graves[i].map, 0);
    for (int i = 0; i < s->ngraves; i++)
        if (s->graves[i].rid_len && s->ctrl)
            reply_ok_rid(s, s->graves[i].rid, s->graves[i].rid_len);
    s->ngraves = 0;
}

static void reply_ok(server *s, const trainer *t, Scape__Reply *r)
{
    r->status = SCAPE__STATUS__OK;
    ctl_reply(s, t->rid, t->rid_len, r);
}

/* ---- hello ------------------------------------------------------------- */

static scape_rc pick_slot(server *s, int want, int *out)
{
    if (want < -1 || want >= s->cfg.max_trainers)
        return scape_set_error(SCAPE_INVALID, "slot %d is outside [0, %d) (max_trainers)",
                               want, s->cfg.max_trainers);
    if (want >= 0) {
        /* a trainer restarted at once may ask for its slot before the
         * liveness check has seen the old process go: drop that one now */
        if (s->slots[want].used && wire_pid_gone(s->slots[want].pid))
            ctl_drop(s, &s->slots[want], 1);
        if (s->slots[want].used)
            return scape_set_error(SCAPE_INVALID, "slot %d is taken by %s", want,
                                   s->slots[want].identity);
        *out = want;
        return SCAPE_OK;
    }
    for (int i = 0; i < s->cfg.max_trainers; i++)
        if (!s->slots[i].used) {
            *out = i;
            return SCAPE_OK;
        }
    return scape_set_error(SCAPE_INVALID, "all %d trainer slots are taken", s->cfg.max_trainers);
}

static scape_rc on_hello(server *s, const unsigned char *rid, size_t rid_len,
                         const Scape__Hello *h)
{
    if (find(s, rid, rid_len))
        return scape_set_error(SCAPE_INVALID, "this connection already said hello");
    if (h->protocol != 1)
        return scape_set_error(SCAPE_PROTO,
                               "protocol version %u is not supported (scaped speaks 1)",
                               h->protocol);
    if (h->pid == 0 || h->pid > (uint32_t)INT32_MAX)
        return scape_set_error(SCAPE_INVALID, "hello: pid %u is not a process id", h->pid);
    if (rid_len > SRV_RID_MAX)
        return scape_set_error(SCAPE_PROTO, "routing id of %zu bytes is too long", rid_len);
    int slot = -1;
    scape_rc rc = pick_slot(s, h->index, &slot);
    if (rc != SCAPE_OK)
        return rc;
    trainer *t = &s->slots[slot];
    memset(t, 0, sizeof *t);
    t->used = 1;
    t->index = slot;
    t->pid = (pid_t)h->pid;
    memcpy(t->rid, rid, rid_len);
    t->rid_len = rid_len;
    /* Shown in logs and status replies: printable UTF-8 only. */
    scape_text_clean(t->identity, IDENTITY_SHOWN + 1, h->trainer ? h->trainer : "", (size_t)-1);
    Scape__Welcome w = SCAPE__WELCOME__INIT;
    w.protocol = 1;
    w.index = (uint32_t)slot;
    w.rank = (uint32_t)s->cfg.rank;
    w.world = (uint32_t)s->cfg.world;
    w.version = SCAPED_VERSION;
    w.next_step = s->job.next_step;
    Scape__Reply r = SCAPE__REPLY__INIT;
    r.body_case = SCAPE__REPLY__BODY_WELCOME;
    r.welcome = &w;
    reply_ok(s, t, &r);
    LOG_INFO(SUB_CTRL, "trainer %d attached: %s (pid %d)", slot, t->identity, (int)t->pid);
    return SCAPE_OK;
}

/* ---- register ------------------------------------------------------------ */

static scape_rc parse_dtype(Scape__DType d, kern_dtype *out)
{
    if (d != SCAPE__DTYPE__F32 && d != SCAPE__DTYPE__BF16)
        return scape_set_error(SCAPE_INVALID, "register: unknown dtype %d", (int)d);
    *out = d == SCAPE__DTYPE__F32 ? KERN_F32 : KERN_BF16;
    return SCAPE_OK;
}

/* Validate the registered tensors by planning them; fills ts (names borrowed)
 * and the parameter groups. */
static scape_rc parse_layout(const Scape__Register *g, eng_tensor *ts, size_t *numel,
                             eng_group *groups, size_t *ngroups)
{
    if (g->n_group_weight_decay > ENG_MAX_GROUPS)
        return scape_set_error(SCAPE_INVALID, "register: %zu parameter groups (at most %d)",
                               g->n_group_weight_decay, ENG_MAX_GROUPS);
    *ngroups = g->n_group_weight_decay;
    for (size_t q = 0; q < *ngroups; q++) {
        float wd = g->group_weight_decay[q];
        if (!isnan(wd) && (!(wd >= 0.0f) || !isfinite(wd)))
            return scape_set_error(SCAPE_INVALID, "register: parameter group %zu: "
                                   "weight_decay %g must be finite and >= 0", q, (double)wd);
        groups[q].weight_decay = wd;
    }
    for (size_t i = 0; i < g->n_tensors; i++) {
        const Scape__Tensor *x = g->tensors[i];
        if (x->name == NULL || x->name[0] == '\0')
            return scape_set_error(SCAPE_INVALID, "register: tensor %zu has no name", i);
        if (strlen(x->name) > REGISTER_NAME_MAX || !scape_text_is_clean(x->name))
            return scape_set_error(SCAPE_INVALID, "register: tensor %zu's name \"%.64s\" is "
                                   "not printable UTF-8 of at most %d bytes", i, x->name,
                                   REGISTER_NAME_MAX);
        ts[i] = (eng_tensor){ x->name, (size_t)x->offset, (size_t)x->length,
                              x->has_group ? x->group : 0 };
        if (ts[i].group >= (*ngroups ? *ngroups : 1))
            return scape_set_error(SCAPE_INVALID, "register: tensor %s is in parameter group "
                                   "%u, but %zu group(s) are registered", x->name,
                                   (unsigned)ts[i].group, *ngroups ? *ngroups : 1);
    }
    plan *p = NULL;
    scape_rc rc = plan_build(&p, ts, g->n_tensors, 1, 1.0);
    if (rc == SCAPE_OK)
        *numel = p->n;
    plan_destroy(&p);
    return rc;
}

/* The first registration fixes the layout; later ones must match it. */
static scape_rc agree_layout(server *s, const eng_tensor *ts, size_t nt, kern_dtype pdt,
                             kern_dtype gdt, const eng_group *groups, size_t ngroups)
{
    if (s->layout == NULL) {
        memcpy(s->groups, groups, ngroups * sizeof *groups);
        s->ngroups = ngroups;
        s->layout = calloc(nt, sizeof *s->layout);
        if (s->layout == NULL)
            return scape_set_error(SCAPE_NOMEM, "register: out of memory");
        for (size_t i = 0; i < nt; i++) {
            s->layout[i] = ts[i];
            s->layout[i].name = strdup(ts[i].name);
        }
        s->ntensors = nt;
        s->pdt = pdt;
        s->gdt = gdt;
        return SCAPE_OK;
    }
    if (nt != s->ntensors)
        return scape_set_error(SCAPE_INVALID,
                               "register: %zu tensors, but the node's layout has %zu", nt,
                               s->ntensors);
    for (size_t i = 0; i < nt; i++)
        if (strcmp(ts[i].name, s->layout[i].name) != 0 || ts[i].offset != s->layout[i].offset ||
            ts[i].length != s->layout[i].length)
            return scape_set_error(SCAPE_INVALID,
                                   "register: tensor %zu is %s@%zu+%zu, but the node's layout "
                                   "has %s@%zu+%zu",
                                   i, ts[i].name, ts[i].offset, ts[i].length,
                                   s->layout[i].name, s->layout[i].offset, s->layout[i].length);
    if (pdt != s->pdt || gdt != s->gdt)
        return scape_set_error(SCAPE_INVALID, "register: dtypes differ from the node's layout");
    if (ngroups != s->ngroups)
        return scape_set_error(SCAPE_INVALID, "register: %zu parameter group(s), but the "
                               "node's layout has %zu", ngroups, s->ngroups);
    for (size_t q = 0; q < ngroups; q++)
        if (memcmp(&groups[q].weight_decay, &s->groups[q].weight_decay, sizeof(float)) != 0)
            return scape_set_error(SCAPE_INVALID, "register: parameter group %zu has "
                                   "weight_decay %g, but the node's layout has %g", q,
                                   (double)groups[q].weight_decay,
                                   (double)s->groups[q].weight_decay);
    for (size_t i = 0; i < nt; i++)
        if (ts[i].group != s->layout[i].group)
            return scape_set_error(SCAPE_INVALID, "register: tensor %s is in parameter group "
                                   "%u, but in the node's layout in group %u", ts[i].name,
                                   (unsigned)ts[i].group, (unsigned)s->layout[i].group);
    return SCAPE_OK;
}

/* The handle's size and its range [offset, offset + bytes). */
static scape_rc ipc_range(const trainer *t, const Scape__MemHandle *h, const char *what,
                          size_t *off, size_t *bytes)
{
    if (!h->has_ipc_handle || h->ipc_handle.len != SHM_IPC_HANDLE_BYTES)
        return scape_set_error(SCAPE_INVALID, "register: trainer %d's %s: a CUDA IPC handle "
                               "has %d bytes, not %zu", t->index, what, SHM_IPC_HANDLE_BYTES,
                               h->has_ipc_handle ? h->ipc_handle.len : 0);
    *off = h->has_offset ? (size_t)h->offset : 0;
    *bytes = (size_t)h->bytes;
    if (*off + *bytes < *off)
        return scape_set_error(SCAPE_INVALID, "register: trainer %d's %s: offset %zu and %zu "
                               "bytes overflow", t->index, what, *off, *bytes);
    return SCAPE_OK;
}

/* A trainer's two CUDA IPC buffers in one allocation must not overlap. */
static scape_rc check_own_ranges(const trainer *t, const Scape__Register *g)
{
    if (g->params->kind != SCAPE__MEM_KIND__CUDA_IPC ||
        g->grads->kind != SCAPE__MEM_KIND__CUDA_IPC)
        return SCAPE_OK;
    size_t po = 0, pb = 0, go = 0, gb = 0;
    TRY(ipc_range(t, g->params, "params", &po, &pb));
    TRY(ipc_range(t, g->grads, "grads", &go, &gb));
    if (memcmp(g->params->ipc_handle.data, g->grads->ipc_handle.data,
               SHM_IPC_HANDLE_BYTES) == 0 && po < go + gb && go < po + pb)
        return scape_set_error(SCAPE_INVALID, "register: trainer %d's grads [%zu, +%zu) "
                               "overlap its params [%zu, +%zu) in the same CUDA allocation",
                               t->index, go, gb, po, pb);
    return SCAPE_OK;
}

/* A CUDA IPC buffer must not share bytes with another trainer's: a handle
 * names the whole allocation, so two buffers in one allocation are told
 * apart only by their offsets.  Checked before anything is opened. */
static scape_rc check_ipc_range(const server *s, const trainer *t, const Scape__MemHandle *h,
                                const char *what)
{
    size_t off = 0, bytes = 0;
    TRY(ipc_range(t, h, what, &off, &bytes));
    for (int i = 0; i < SRV_MAX_SLOTS; i++) {
        const trainer *o = &s->slots[i];
        if (o == t || !o->used)
            continue;
        const shm_map *theirs[2] = { &o->params, &o->grads };
        for (int b = 0; b < 2; b++)
            if (shm_map_ipc_overlap(h->ipc_handle.data, off, bytes, theirs[b]))
                return scape_set_error(SCAPE_INVALID, "register: trainer %d's %s [%zu, +%zu) "
                                       "overlaps trainer %d's %s in the same CUDA allocation",
                                       t->index, what, off, bytes, o->index,
                                       b ? "grads" : "params");
    }
    return SCAPE_OK;
}

/* One buffer: host shared memory by name, or a CUDA IPC handle.  The cuda
 * executor works on a CUDA IPC buffer in place and needs shared memory
 * registered; the others work on host memory (a pinned copy of the former). */
static scape_rc map_one(const server *s, const trainer *t, const Scape__MemHandle *h,
                        size_t need, const char *what, shm_map *m)
{
    int cuda = s->cfg.engine.executor == ENG_EXEC_CUDA;
    char named[64]; /* every refusal below names the trainer and the buffer */
    snprintf(named, sizeof named, "register: trainer %d's %s", t->index, what);
    if (h->kind == SCAPE__MEM_KIND__SHM) {
        TRY(shm_map_open(m, h->shm_name, (size_t)h->bytes, need, named));
        scape_rc rc = cuda ? shm_map_pin(m, named) : SCAPE_OK;
        if (rc != SCAPE_OK)
            shm_map_close(m, 0);
        return rc;
    }
    if (h->kind != SCAPE__MEM_KIND__CUDA_IPC)
        return scape_set_error(SCAPE_INVALID, "%s: unknown memory kind %d", named,
                               (int)h->kind);
    if (h->has_device_uuid && h->device_uuid.len != SHM_GPU_UUID_BYTES)
        return scape_set_error(SCAPE_INVALID, "%s: a GPU UUID has %d bytes, not %zu", named,
                               SHM_GPU_UUID_BYTES, h->device_uuid.len);
    TRY(check_ipc_range(s, t, h, what));
    int from = h->has_device ? h->device : -1; /* the trainer's numbering */
    if (h->has_device_uuid) /* ours, whatever CUDA_VISIBLE_DEVICES each process has */
        TRY(shm_map_cuda_device(h->device_uuid.data, &from, named));
    return shm_map_open_cuda(m, h->ipc_handle.data, h->ipc_handle.len,
                             h->has_offset ? (size_t)h->offset : 0, (size_t)h->bytes, need,
                             s->cfg.cuda_device, from, !cuda, named);
}

static scape_rc map_buffers(server *s, const Scape__Register *g, size_t numel,
                            kern_dtype pdt, kern_dtype gdt, trainer *t)
{
    TRY(check_own_ranges(t, g));
    scape_rc rc = map_one(s, t, g->params, numel * kern_dtype_size(pdt), "params", &t->params);
    if (rc == SCAPE_OK)
        rc = map_one(s, t, g->grads, numel * kern_dtype_size(gdt), "grads", &t->grads);
    if (rc != SCAPE_OK)
        ctl_close_map(s, &t->params, 0);
    return rc;
}

/* Another trainer's parameters into t's buffer, through host memory. */
static scape_rc copy_params(const shm_map *from, shm_map *to, size_t bytes)
{
    void *tmp = malloc(bytes ? bytes : 1);
    if (tmp == NULL)
        return scape_set_error(SCAPE_NOMEM, "register: out of memory");
    scape_rc rc = shm_map_read(from, tmp, bytes);
    if (rc == SCAPE_OK)
        rc = shm_map_write(to, tmp, bytes);
    free(tmp);
    return rc;
}

/* A trainer joining a running job gets the current parameters. */
static scape_rc seed_params(server *s, trainer *t)
{
    size_t pb = s->numel * kern_dtype_size(s->pdt);
    for (int i = 0; i < SRV_MAX_SLOTS; i++) {
        const trainer *o = &s->slots[i];
        if (o != t && o->used && o->synced)
            return copy_params(&o->params, &t->params, pb);
    }
    /* Nobody here holds them: the buffer of the last trainer that left. */
    if (s->spare.addr) {
        scape_rc rc = copy_params(&s->spare, &t->params, pb);
        shm_map_close(&s->spare, 1);
        return rc;
    }
    /* A sharded rank's master copy is only its shard. */
    if (s->cfg.engine.mode == ENG_MODE_SHARDED && s->cfg.world > 1)
        return scape_set_error(SCAPE_INVALID, "sync: this daemon holds no copy of the job's "
                               "parameters to give a new trainer");
    float *theta = malloc(s->numel * sizeof *theta);
    unsigned char *have = malloc(s->numel);
    scape_rc rc = theta && have ? job_params(&s->job, theta, have)
                                : scape_set_error(SCAPE_NOMEM, "register: out of memory");
    /* bf16 in place: element i's two bytes land below element i's float */
    if (rc == SCAPE_OK && s->pdt == KERN_BF16)
        for (size_t i = 0; i < s->numel; i++)
            ((uint16_t *)theta)[i] = kern_bf16_from_f32(theta[i]);
    if (rc == SCAPE_OK)
        rc = shm_map_write(&t->params, theta, pb);
    free(theta);
    free(have);
    return rc;
}

/* Bucketed hand-over's flags: the trainer's posted tensors, and the
 * daemon's (for the layout, once). */
static scape_rc alloc_buckets(server *s, trainer *t)
{
    if (s->early == NULL) {
        s->early = calloc(s->ntensors, 1);
        s->take = calloc(s->ntensors, 1);
    }
    free(t->bucket);
    t->bucket = calloc(s->ntensors, 1);
    if (s->early == NULL || s->take == NULL || t->bucket == NULL)
        return scape_set_error(SCAPE_NOMEM, "register: out of memory");
    return SCAPE_OK;
}

static scape_rc on_register(server *s, trainer *t, const Scape__Register *g)
{
    if (t->registered)
        return scape_set_error(SCAPE_INVALID, "trainer %d is already registered", t->index);
    if (g->n_tensors == 0 || g->n_tensors > MAX_TENSORS)
        return scape_set_error(SCAPE_INVALID, "register: %zu tensors (1..%u allowed)",
                               g->n_tensors, MAX_TENSORS);
    if (g->has_max_grad_norm && g->max_grad_norm != s->cfg.engine.max_grad_norm)
        return scape_set_error(SCAPE_INVALID, "register: trainer %d expects max_grad_norm "
                               "%g, but this daemon clips at %g (0: not at all): configure "
                               "the daemon with max_grad_norm: %g, or give the trainer %g",
                               t->index, (double)g->max_grad_norm,
                               (double)s->cfg.engine.max_grad_norm, (double)g->max_grad_norm,
                               (double)s->cfg.engine.max_grad_norm);
    if (g->has_grad_event && (g->grads->kind != SCAPE__MEM_KIND__CUDA_IPC ||
                              g->params->kind != SCAPE__MEM_KIND__CUDA_IPC))
        return scape_set_error(SCAPE_INVALID, "register: trainer %d sent a gradient-ready "
                               "event, but its buffers are not both CUDA IPC buffers (events "
                               "order device memory only)", t->index);
    if (g->has_grad_event && g->grad_event.len != SHM_IPC_HANDLE_BYTES)
        return scape_set_error(SCAPE_INVALID, "register: trainer %d's grad_event: an "
                               "interprocess event handle has %d bytes, not %zu", t->index,
                               SHM_IPC_HANDLE_BYTES, g->grad_event.len);
    eng_group groups[ENG_MAX_GROUPS];
    size_t ngroups = 0;
    kern_dtype pdt = KERN_F32, gdt = KERN_F32;
    scape_rc rc = parse_dtype(g->param_dtype, &pdt);
    if (rc == SCAPE_OK)
        rc = parse_dtype(g->grad_dtype, &gdt);
    eng_tensor *ts = calloc(g->n_tensors, sizeof *ts);
    size_t numel = 0;
    if (rc == SCAPE_OK)
        rc = ts ? parse_layout(g, ts, &numel, groups, &ngroups)
                : scape_set_error(SCAPE_NOMEM, "out of memory");
    int had_layout = s->layout != NULL;
    if (rc == SCAPE_OK)
        rc = agree_layout(s, ts, g->n_tensors, pdt, gdt, groups, ngroups);
    free(ts);
    if (rc == SCAPE_OK) {
        s->numel = numel;
        rc = map_buffers(s, g, numel, pdt, gdt, t);
    }
    if (rc == SCAPE_OK)
        rc = alloc_buckets(s, t);
    unsigned char pev[SHM_IPC_HANDLE_BYTES];
    if (rc == SCAPE_OK && g->has_grad_event) {
        char what[64];
        snprintf(what, sizeof what, "register: trainer %d's grad_event", t->index);
        rc = shm_map_open_event(&t->grads, g->grad_event.data, g->grad_event.len, what);
        snprintf(what, sizeof what, "register: trainer %d's params_event", t->index);
        if (rc == SCAPE_OK)
            rc = shm_map_export_event(&t->params, pev, what);
    }
    if (rc != SCAPE_OK) {
        if (!had_layout && s->layout && srv_trainers(s, 0) == 0 && !job_started(&s->job)) {
            for (size_t i = 0; i < s->ntensors; i++)
                free((char *)s->layout[i].name);
            free(s->layout);
            s->layout = NULL;
            free(s->early);
            free(s->take);
            s->early = s->take = NULL;
        }
        free(t->bucket);
        t->bucket = NULL;
        ctl_close_map(s, &t->grads, 0);
        ctl_close_map(s, &t->params, 0);
        return rc;
    }
    t->registered = 1;
    Scape__Registered rg = SCAPE__REGISTERED__INIT;
    rg.numel = numel;
    rg.trainers = (uint32_t)srv_trainers(s, 0);
    rg.has_params_event = g->has_grad_event;
    rg.params_event.data = pev;
    rg.params_event.len = g->has_grad_event ? sizeof pev : 0;
    Scape__Reply r = SCAPE__REPLY__INIT;
    r.body_case = SCAPE__REPLY__BODY_REGISTERED;
    r.registered = &rg;
    reply_ok(s, t, &r);
    LOG_INFO(SUB_CTRL, "trainer %d registered %zu tensors, N=%zu", t->index, s->ntensors, numel);
    return SCAPE_OK;
}

/* ---- step ---------------------------------------------------------------- */

static scape_rc on_step(server *s, trainer *t, const Scape__Step *st)
{
    if (!t->synced)
        return scape_set_error(SCAPE_INVALID, "step: trainer %d has not synced its parameters "
                               "(scape_sync) yet", t->index);
    if (s->job.broken)
        return scape_set_error(SCAPE_REMOTE,
                               "step: the optimizer failed part-way through a step (%s); "
                               "restart the job from a checkpoint", s->job.broken_why);
    if (t->posted)
        return scape_set_error(SCAPE_INVALID, "step %llu: already posted by trainer %d",
                               (unsigned long long)st->step, t->index);
    if (t->post_refused[0]) {
        scape_set_error(SCAPE_INVALID, "step %llu: a post of this step was refused: %s",
                        (unsigned long long)st->step, t->post_refused);
        t->post_refused[0] = '\0';
        memset(t->bucket, 0, s->ntensors);
        return SCAPE_INVALID;
    }
    if (st->step != s->job.next_step)
        return scape_set_error(SCAPE_INVALID, "step %llu is out of order: expected step %llu",
                               (unsigned long long)st->step,
                               (unsigned long long)s->job.next_step);
    if (!isfinite(st->lr) || st->lr < 0.0f)
        return scape_set_error(SCAPE_INVALID, "step: lr=%g must be finite and >= 0",
                               (double)st->lr);
    if (st->n_group_lr != s->ngroups && !(st->n_group_lr == 0 && s->ngroups <= 1))
        return scape_set_error(SCAPE_INVALID, "step: %zu group learning rates for %zu "
                               "parameter group(s)", st->n_group_lr, s->ngroups);
    for (size_t q = 0; q < st->n_group_lr; q++)
        if (!isfinite(st->group_lr[q]) || st->group_lr[q] < 0.0f)
            return scape_set_error(SCAPE_INVALID, "step: parameter group %zu: lr=%g must be "
                                   "finite and >= 0", q, (double)st->group_lr[q]);
    t->posted = 1;
    for (size_t q = 0; q < ENG_MAX_GROUPS; q++)
        t->lr[q] = q < st->n_group_lr ? st->group_lr[q] : st->lr;
    t->has_loss = st->has_loss;
    t->loss = st->loss;
    t->last_step = st->step;
    t->posted_at = job_now();
    /* How long the message waited for the daemon: the sender's clock is this
     * host's CLOCK_MONOTONIC.  A stamp from the future or from over an hour
     * ago is not that clock's (another host's, a forged one): unknown. */
    t->queued = -1.0;
    if (st->has_sent_ns) {
        double q = t->posted_at - 1e-9 * (double)st->sent_ns;
        if (q >= -1e-3 && q < 3600.0)
            t->queued = q > 0.0 ? q : 0.0;
    }
    t->step_msg_bytes = s->msg_bytes;
    ctl_maybe_step(s);
    return SCAPE_OK;
}

/* Trainers with flag set (synced, or registered), by slot index: trainer 0
 * is the lowest. */
static int collect(server *s, trainer **ts, int synced)
{
    int n = 0;
    for (int i = 0; i < SRV_MAX_SLOTS; i++) {
        trainer *t = &s->slots[i];
        if (t->used && (synced ? t->synced : t->registered))
            ts[n++] = t;
    }
    return n;
}

/* ---- bucketed hand-over ------------------------------------------------------ */

/* Forget the buckets of the step in flight (it ran, or was abandoned): the
 * engine's early packs were used by the step or are undone here. */
static void early_forget(server *s, int undo)
{
    if (undo && s->job.eng && job_pack_undo(&s->job) != SCAPE_OK) {
        job_mark_broken(&s->job);
        LOG_ERROR(SUB_ENGINE, "step %llu: undoing the early packs failed: %s",
                  (unsigned long long)s->job.next_step, scape_last_error());
    }
    if (s->early)
        memset(s->early, 0, s->ntensors);
}

/* The trainers of the step changed (one left, one joined): what the engine
 * packed early summed the others' gradients; undo it, the step packs all. */
static void early_restart(server *s)
{
    size_t any = 0;
    for (size_t i = 0; s->early && i < s->ntensors; i++)
        any += s->early[i];
    if (any == 0)
        return;
    LOG_INFO(SUB_ENGINE, "step %llu: undid the early packs of %zu tensor(s) (the step's "
             "trainers changed, or a post was refused): the step packs them",
             (unsigned long long)s->job.next_step, any);
    early_forget(s, 1);
    size_t kept = job_early_kept(&s->job);
    if (kept)
        LOG_INFO(SUB_ENGINE, "step %llu: kept %zu tensor(s) (comm order) packed: their chunks "
                 "were reduced already, with every daemon (reduce_chunk); the step packs "
                 "only the rest", (unsigned long long)s->job.next_step, kept);
}

/* Tensors that every trainer of the step has posted go to the engine now,
 * before the Steps come. */
static void pack_early(server *s)
{
    trainer *ts[SRV_MAX_SLOTS];
    int n = collect(s, ts, 1);
    if (n == 0 || !job_started(&s->job) || s->job.broken || n != s->job.trainers)
        return;
    size_t any = 0;
    for (size_t i = 0; i < s->ntensors; i++) {
        int all = !s->early[i];
        for (int k = 0; all && k < n; k++)
            all = ts[k]->bucket[i];
        s->take[i] = (unsigned char)all;
        any += (size_t)all;
    }
    if (any == 0)
        return;
    job_part parts[SRV_MAX_SLOTS];
    for (int i = 0; i < n; i++)
        parts[i] = (job_part){ .params = &ts[i]->params, .grads = &ts[i]->grads,
                               .pid = ts[i]->pid, .index = ts[i]->index };
    int dead = -1;
    scape_rc rc = job_pack_early(&s->job, parts, n, s->take, s->cfg.comm_timeout_ms, &dead);
    if (rc == SCAPE_OK && dead >= 0) {
        LOG_INFO(SUB_ENGINE, "step %llu: trainer %d died before its posted gradients were "
                 "ready: nothing packed early; its step finds it gone",
                 (unsigned long long)s->job.next_step, ts[dead]->index);
        return;
    }
    if (rc != SCAPE_OK) {
        job_mark_broken(&s->job);
        LOG_ERROR(SUB_ENGINE, "step %llu: packing a bucket early failed: %s",
                  (unsigned long long)s->job.next_step, scape_last_error());
        return;
    }
    for (size_t i = 0; i < s->ntensors; i++)
        s->early[i] |= s->take[i];
}

static scape_rc check_post(server *s, const trainer *t, const Scape__Post *p)
{
    if (!t->synced)
        return scape_set_error(SCAPE_INVALID, "post: trainer %d has not synced its parameters "
                               "(scape_sync) yet", t->index);
    if (s->job.broken)
        return scape_set_error(SCAPE_REMOTE, "post: the optimizer failed part-way through a "
                               "step (%s)", s->job.broken_why);
    if (t->posted)
        return scape_set_error(SCAPE_INVALID, "post: trainer %d posted tensors after its step "
                               "%llu", t->index, (unsigned long long)t->last_step);
    if (p->step != s->job.next_step)
        return scape_set_error(SCAPE_INVALID, "post: tensors of step %llu, but the next step "
                               "is %llu", (unsigned long long)p->step,
                               (unsigned long long)s->job.next_step);
    if (p->count == 0 || p->first >= s->ntensors || p->count > s->ntensors - p->first)
        return scape_set_error(SCAPE_INVALID, "post: tensors [%u, %u + %u) of step %llu: the "
                               "layout has tensors [0, %zu)", p->first, p->first, p->count,
                               (unsigned long long)p->step, s->ntensors);
    for (size_t i = p->first; i < (size_t)p->first + p->count; i++)
        if (t->bucket[i])
            return scape_set_error(SCAPE_INVALID, "post: tensor %zu (%s) of step %llu posted "
                                   "twice by trainer %d (a bucket posted twice, or "
                                   "overlapping another)", i, s->layout[i].name,
                                   (unsigned long long)p->step, t->index);
    return SCAPE_OK;
}

/* A Post is one-way: a refusal is logged and kept for the trainer's Step,
 * and what was packed early is undone (the step packs everything). */
static void on_post(server *s, trainer *t, const Scape__Post *p)
{
    if (t->bucket == NULL || check_post(s, t, p) != SCAPE_OK) {
        if (t->bucket == NULL)
            scape_set_error(SCAPE_INVALID, "post: trainer %d has not registered", t->index);
        LOG_WARN(SUB_CTRL, "refused a post from trainer %d (%s): %s", t->index, t->identity,
                 scape_last_error());
        if (t->post_refused[0] == '\0')
            snprintf(t->post_refused, sizeof t->post_refused, "%s", scape_last_error());
        early_restart(s);
        return;
    }
    memset(t->bucket + p->first, 1, p->count);
    pack_early(s);
}

/* Start the job: the engine, with trainer 0's parameters in every buffer. */
static scape_rc start_job(server *s, trainer **ts, int n)
{
    eng_layout lay = { s->layout, s->ntensors, s->pdt, s->gdt, s->groups, s->ngroups };
    void *params[SRV_MAX_SLOTS];
    job_part parts[SRV_MAX_SLOTS];
    for (int i = 0; i < n; i++) {
        params[i] = shm_map_engine(&ts[i]->params);
        parts[i] = (job_part){ .params = &ts[i]->params, .grads = &ts[i]->grads };
    }
    size_t pb = job_bytes(s->numel, s->pdt);
    scape_rc rc = job_pull(parts, 1, 0, pb, NULL); /* trainer 0's initial parameters */
    if (rc == SCAPE_OK)
        rc = job_open(&s->job, &s->cfg.engine, &lay, s->comm, n);
    if (rc == SCAPE_OK)
        rc = ckp_start(s, params);
    if (rc == SCAPE_OK)
        rc = job_push(parts, n, pb, NULL);
    if (rc != SCAPE_OK) {
        job_close(&s->job);
        return rc;
    }
    ckp_started(s);
    if (s->resumed_from)
        LOG_INFO(SUB_ENGINE, "job resumed: %s, %s, rho=%g, N=%zu, %d trainer(s), next step %llu",
                 eng_optimizer_name(s->cfg.engine.optimizer), eng_mode_name(s->cfg.engine.mode),
                 s->cfg.engine.rho, s->numel, n, (unsigned long long)s->job.next_step);
    else
        LOG_INFO(SUB_ENGINE, "job started: %s, %s, rho=%g, N=%zu, %d trainer(s), parameters "
                 "of trainer %d", eng_optimizer_name(s->cfg.engine.optimizer),
                 eng_mode_name(s->cfg.engine.mode), s->cfg.engine.rho, s->numel, n,
                 ts[0]->index);
    return SCAPE_OK;
}

/* Trainers come and go between steps: keep T_r in step with them. */
static scape_rc follow_trainers(server *s, int n)
{
    int was = s->job.trainers;
    if (n == was)
        return SCAPE_OK;
    scape_rc rc = job_set_trainers(&s->job, n);
    if (rc != SCAPE_OK)
        return rc;
    LOG_INFO(SUB_ENGINE, "step %llu: now %d trainer(s) (was %d)",
             (unsigned long long)s->job.next_step, n, was);
    return SCAPE_OK;
}

static void finish_step(server *s, trainer **ts, int n, scape_rc rc)
{
    Scape__Reply r = SCAPE__REPLY__INIT;
    step_done_msg m;
    if (rc == SCAPE_OK) {
        status_step_done(&s->job, &m);
        r.status = SCAPE__STATUS__OK;
        r.body_case = SCAPE__REPLY__BODY_STEP_DONE;
        r.step_done = &m.d;
    }
    /* Latest poster first: it is the straggler, on the job's critical path,
     * while the others only get back to work earlier (and, where trainers
     * share cores, would take the cores the straggler needs to wake up on). */
    trainer *order[SRV_MAX_SLOTS];
    for (int i = 0; i < n; i++) {
        int j = i;
        for (; j > 0 && order[j - 1]->posted_at < ts[i]->posted_at; j--)
            order[j] = order[j - 1];
        order[j] = ts[i];
    }
    early_forget(s, rc != SCAPE_OK); /* used by the step, or undone for its retry */
    for (int i = 0; i < n; i++) {
        order[i]->posted = 0;
        memset(order[i]->bucket, 0, s->ntensors);
        if (rc == SCAPE_OK)
            ctl_reply(s, order[i]->rid, order[i]->rid_len, &r);
        else
            ctl_reply_error(s, order[i]->rid, order[i]->rid_len, rc);
    }
}

/* Log what the data plane dropped as not of this job, and the connections
 * it refused at the handshake, since the last look. */
static void note_strangers(server *s)
{
    char why[256];
    uint64_t n = comm_foreign(s->comm, why, sizeof why);
    if (n > s->foreign_seen)
        LOG_WARN(SUB_COMM, "dropped %llu message(s) on the data socket that are not of this "
                 "job (%llu in all); the last: %s", (unsigned long long)(n - s->foreign_seen),
                 (unsigned long long)n, why);
    s->foreign_seen = n;
    n = comm_refused(s->comm, why, sizeof why);
    if (n > s->refused_seen)
        LOG_WARN(SUB_COMM, "refused %llu connection(s) to the data socket at the handshake "
                 "(%llu in all); the last: %s", (unsigned long long)(n - s->refused_seen),
                 (unsigned long long)n, why);
    s->refused_seen = n;
}

/* defer_select: the trainers have their parameters; select the next mask
 * while they compute.  Its time is the step's after_reply phase in status
 * and the events (the replies went out before it).  A trainer that posts the
 * next step meanwhile waits in the socket: the next step's queued phase. */
static scape_rc select_after_reply(server *s, uint64_t t)
{
    scape_rc rc = job_step_finish(&s->job, s->cfg.engine.defer_select);
    if (rc != SCAPE_OK) {
        job_mark_broken(&s->job);
        LOG_ERROR(SUB_ENGINE, "step %llu: selecting the next mask failed: %s",
                  (unsigned long long)t, scape_last_error());
    }
    return rc;
}

/* Steps in a row on which a trainer's own gradient norm must equal
 * max_grad_norm before the daemon says that something upstream clips it. */
#define CLIP_UPSTREAM_STEPS 5

/* max_grad_norm: a trainer whose own gradient's norm is the daemon's bound
 * (to float rounding: torch scales by C / (norm + 1e-6), bf16 rounds each
 * value) on CLIP_UPSTREAM_STEPS steps in a row was clipped before it
 * posted, so the daemon's clip compares a clipped gradient: say so, once. */
static void note_upstream_clip(server *s, trainer **ts, int n, uint64_t t)
{
    double c = (double)s->cfg.engine.max_grad_norm;
    for (int i = 0; c > 0.0 && i < n; i++) {
        double g = job_grad_norm(&s->job, i);
        ts[i]->clip_run = g >= 0.0 && fabs(g - c) <= 1e-3 * c ? ts[i]->clip_run + 1 : 0;
        if (ts[i]->clip_run < CLIP_UPSTREAM_STEPS || ts[i]->clip_warned)
            continue;
        ts[i]->clip_warned = 1;
        LOG_WARN(SUB_CTRL, "step %llu: trainer %d (%s) posted gradients of norm %.6g, "
                 "max_grad_norm itself, on %d steps in a row: something in the trainer "
                 "clips them before step() (the HF Trainer's max_grad_norm, Lightning's "
                 "gradient_clip_val, clip_grad_norm_), so this daemon's clipping sees an "
                 "already clipped gradient; turn the trainer's own clipping off (0 / None) "
                 "and leave it to the daemon", (unsigned long long)t, ts[i]->index,
                 ts[i]->identity, g, CLIP_UPSTREAM_STEPS);
    }
}

/* Several trainers posting other learning rates: trainer 0's count. */
static void note_lr(const server *s, trainer **ts, int n, uint64_t t)
{
    for (int i = 0; i < n; i++)
        for (size_t q = 0; q < job_groups(&s->job); q++)
            if (ts[i]->lr[q] != ts[0]->lr[q]) {
                LOG_WARN(SUB_CTRL, "step %llu: trainer %d posted lr=%g, trainer %d lr=%g%s; "
                         "using %g", (unsigned long long)t, ts[i]->index,
                         (double)ts[i]->lr[q], ts[0]->index, (double)ts[0]->lr[q],
                         job_groups(&s->job) > 1 ? " (a parameter group's)" : "",
                         (double)ts[0]->lr[q]);
                break;
            }
}

static void run_step(server *s, trainer **ts, int n)
{
    uint64_t t = s->job.next_step;
    note_lr(s, ts, n, t);
    double t0 = job_now();
    job_part parts[SRV_MAX_SLOTS];
    for (int i = 0; i < n; i++)
        parts[i] = (job_part){ &ts[i]->params, &ts[i]->grads, ts[i]->pid, ts[i]->index,
                               ts[i]->has_loss, ts[i]->loss, ts[i]->posted_at,
                               ts[i]->queued, ts[i]->step_msg_bytes };
    scape_rc rc = ckp_before_step(s, t); /* a state_dict asked for since the last step */
    if (rc == SCAPE_OK)
        rc = follow_trainers(s, n);
    int dead = -1, broke = 0;
    if (rc == SCAPE_OK)
        rc = job_await_grads(parts, n, s->cfg.comm_timeout_ms, &dead);
    if (rc == SCAPE_OK && dead >= 0) { /* answers the others: abandoned, post again */
        ctl_drop(s, ts[dead], 1);
        return;
    }
    if (rc == SCAPE_OK)
        rc = job_step_run(&s->job, ts[0]->lr, parts, n, job_bytes(s->numel, s->gdt),
                          job_bytes(s->numel, s->pdt), t0, &broke);
    if (broke) {
        job_mark_broken(&s->job);
        LOG_ERROR(SUB_ENGINE, "step %llu failed: %s", (unsigned long long)t,
                  scape_last_error());
    }
    if (rc == SCAPE_OK)
        note_upstream_clip(s, ts, n, t);
    finish_step(s, ts, n, rc);
    /* After a failure here the step's mask all-gather is not started on this
     * rank; its peers then fail the next collective (the engine is broken
     * and refuses further steps either way). */
    if (rc == SCAPE_OK)
        rc = select_after_reply(s, t);
    note_strangers(s);
    if (rc == SCAPE_OK) {
        job_count(&s->job);
        status_publish(s);
        LOG_DEBUG(SUB_ENGINE, "step %llu done: K=%llu in %.3f ms", (unsigned long long)t,
                  (unsigned long long)s->job.last.eng.k, 1e3 * s->job.last.total);
        ckp_after_step(s, t);
    }
}

void ctl_maybe_step(server *s)
{
    trainer *ts[SRV_MAX_SLOTS];
    int n = collect(s, ts, 1);
    if (n == 0)
        return;
    /* Across daemons a change of T_r would have to happen on every rank at
     * the same step: wait for the missing trainer to re-attach instead. */
    if (s->cfg.world > 1 && job_started(&s->job) && n != s->job.trainers)
        return;
    for (int i = 0; i < n; i++)
        if (!ts[i]->posted)
            return;
    run_step(s, ts, n);
}

/* ---- sync ------------------------------------------------------------------------ */

static void reply_synced(server *s, trainer *t)
{
    Scape__Synced y = SCAPE__SYNCED__INIT;
    y.next_step = s->job.next_step;
    Scape__Reply r = SCAPE__REPLY__INIT;
    r.body_case = SCAPE__REPLY__BODY_SYNCED;
    r.synced = &y;
    t->wants_sync = 0;
    t->synced = 1;
    early_restart(s); /* a trainer joins the step in flight */
    reply_ok(s, t, &r);
}

/* Answer pending syncs: at once in a running job (with its current
 * parameters); at the start once every registered trainer, and at least the
 * configured number, has asked. */
void ctl_maybe_sync(server *s)
{
    trainer *ts[SRV_MAX_SLOTS];
    int n = collect(s, ts, 0);
    if (job_started(&s->job)) {
        for (int i = 0; i < n; i++) {
            if (!ts[i]->wants_sync)
                continue;
            scape_rc rc = seed_params(s, ts[i]);
            if (rc == SCAPE_OK)
                reply_synced(s, ts[i]);
            else
                ctl_reply_error(s, ts[i]->rid, ts[i]->rid_len, rc);
        }
        return;
    }
    if (n == 0 || n < s->cfg.trainers)
        return;
    for (int i = 0; i < n; i++)
        if (!ts[i]->wants_sync)
            return;
    scape_rc rc = start_job(s, ts, n);
    for (int i = 0; i < n; i++) {
        if (rc == SCAPE_OK) {
            reply_synced(s, ts[i]);
        } else {
            ts[i]->wants_sync = 0;
            ctl_reply_error(s, ts[i]->rid, ts[i]->rid_len, rc);
        }
    }
}

/* The job again from the checkpoint in dir, as every daemon of the job
 * does.  A checkpoint the engine refuses (another layout, groups or
 * optimizer) leaves the job to start afresh, as on every daemon alike,
 * with the reason set. */
static scape_rc restart_from(server *s, trainer **ts, int n, const char *dir)
{
    snprintf(s->cfg.resume, sizeof s->cfg.resume, "%s", dir);
    scape_rc rc = ckp_prepare_resume(s);
    s->cfg.resume[0] = '\0';
    if (rc != SCAPE_OK)
        return rc;
    job_close(&s->job);
    rc = start_job(s, ts, n);
    if (rc == SCAPE_OK) {
        snprintf(s->resumed_dir, sizeof s->resumed_dir, "%s", dir);
        return SCAPE_OK;
    }
    char why[1024];
    snprintf(why, sizeof why, "%s", scape_last_error());
    s->resuming = 0;
    s->job.next_step = 1;
    if (start_job(s, ts, n) != SCAPE_OK) {
        job_mark_broken(&s->job);
        LOG_ERROR(SUB_ENGINE, "load_state_dict: the job could not start again: %s",
                  scape_last_error());
    }
    rc = scape_set_error(rc, "load_state_dict: %s refused: %s", dir, why);
    LOG_WARN(SUB_ENGINE, "%s", scape_last_error());
    return rc;
}

/* load_state_dict: once every synced trainer has asked for the same
 * checkpoint, the job restarts from it and each gets Synced with the step
 * after the checkpoint's. */
static void maybe_resume(server *s)
{
    trainer *ts[SRV_MAX_SLOTS];
    int n = collect(s, ts, 1);
    for (int i = 0; i < n; i++)
        if (!ts[i]->wants_resume)
            return;
    char dir[sizeof s->cfg.resume];
    snprintf(dir, sizeof dir, "%.*s", (int)sizeof dir - 1, s->resume_req);
    s->resume_req[0] = '\0';
    scape_rc rc = restart_from(s, ts, n, dir);
    char why[1024];
    snprintf(why, sizeof why, "%s", scape_last_error());
    for (int i = 0; i < n; i++) {
        ts[i]->wants_resume = 0;
        if (rc == SCAPE_OK) {
            reply_synced(s, ts[i]);
        } else {
            scape_set_error(rc, "%s", why); /* each reply sends the reason */
            ctl_reply_error(s, ts[i]->rid, ts[i]->rid_len, rc);
        }
    }
}

static scape_rc on_resume(server *s, trainer *t, const Scape__Resume *r)
{
    if (!t->synced || !job_started(&s->job))
        return scape_set_error(SCAPE_INVALID, "load_state_dict: trainer %d has not synced "
                               "yet", t->index);
    if (r->dir == NULL || r->dir[0] == '\0' || strlen(r->dir) >= sizeof s->cfg.resume)
        return scape_set_error(SCAPE_INVALID, "load_state_dict: no checkpoint directory, or "
                               "one of %zu bytes or more", sizeof s->cfg.resume);
    /* restored at this step (scaped --resume, or another trainer's request)
     * and not stepped since: the same step again is a no-op */
    int restored = s->resumed_from > 0 && s->job.next_step == s->resumed_from + 1;
    if (restored && r->has_step && r->step == s->resumed_from &&
        (!r->has_layout_hash || r->layout_hash == job_layout_hash(&s->job))) {
        reply_synced(s, t);
        return SCAPE_OK;
    }
    char dir[sizeof s->cfg.resume];
    TRY(ckp_locate(s, r->dir, dir, sizeof dir));
    if (restored && !r->has_step && s->resumed_dir[0] && strcmp(s->resumed_dir, dir) == 0) {
        reply_synced(s, t); /* another trainer's request restarted the job from it */
        return SCAPE_OK;
    }
    if (restored && r->has_step)
        return scape_set_error(SCAPE_INVALID, "load_state_dict: the job resumed from its "
                               "checkpoint of step %llu (%s), this state_dict is of step %llu: "
                               "a requeued job continues from the daemons' newest checkpoint; "
                               "load a state_dict only when its step is the optimizer's "
                               "resumed_step (then it is a no-op), and restore the data "
                               "position and schedule from resumed_step",
                               (unsigned long long)s->resumed_from, s->ckpt_dir,
                               (unsigned long long)r->step);
    if (s->job.next_step != 1)
        return scape_set_error(SCAPE_INVALID, "load_state_dict: the job is past step %llu; "
                               "a checkpoint loads only before the first step",
                               (unsigned long long)s->job.next_step - 1);
    for (int i = 0; i < SRV_MAX_SLOTS; i++)
        if (s->slots[i].used && s->slots[i].posted)
            return scape_set_error(SCAPE_INVALID, "load_state_dict: trainer %d has already "
                                   "posted step 1", s->slots[i].index);
    if (r->has_layout_hash && r->layout_hash != job_layout_hash(&s->job))
        return scape_set_error(SCAPE_INVALID, "load_state_dict: the state is of another "
                               "layout (hash %016llx; this job's %016llx): other tensors, or "
                               "other parameter groups", (unsigned long long)r->layout_hash,
                               (unsigned long long)job_layout_hash(&s->job));
    if (s->resume_req[0] && strcmp(s->resume_req, dir) != 0)
        return scape_set_error(SCAPE_INVALID, "load_state_dict: trainer %d loads %s, another "
                               "trainer %s", t->index, dir, s->resume_req);
    ckpt_ref ref;
    TRY(ckpt_open(dir, s->cfg.rank, s->cfg.world, &ref));
    if (r->has_step && ref.step != r->step)
        return scape_set_error(SCAPE_INVALID, "load_state_dict: %s holds step %llu, the "
                               "state_dict says step %llu", dir,
                               (unsigned long long)ref.step, (unsigned long long)r->step);
    snprintf(s->resume_req, sizeof s->resume_req, "%s", dir);
    t->wants_resume = 1;
    maybe_resume(s);
    return SCAPE_OK;
}

static scape_rc on_sync(server *s, trainer *t)
{
    if (!t->registered)
        return scape_set_error(SCAPE_INVALID, "sync: trainer %d has not registered", t->index);
    if (t->synced || t->wants_sync)
        return scape_set_error(SCAPE_INVALID, "sync: trainer %d has already synced", t->index);
    t->wants_sync = 1;
    ctl_maybe_sync(s);
    return SCAPE_OK;
}

/* ---- detach and death ------------------------------------------------------- */

void ctl_drop(server *s, trainer *t, int died)
{
    int was_registered = t->registered;
    LOG_INFO(SUB_CTRL, "trainer %d (%s, pid %d) %s", t->index, t->identity, (int)t->pid,
             died ? "died" : "detached");
    /* The last trainer holding the job's parameters leaves: keep its buffer
     * (the parameters after the last completed step) for the next one. */
    int others = 0;
    for (int i = 0; i < SRV_MAX_SLOTS; i++)
        others += &s->slots[i] != t && s->slots[i].used && s->slots[i].synced;
    if (t->synced && job_started(&s->job) && others == 0 && t->params.addr && !t->params.dev) {
        shm_map_close(&s->spare, 1);
        s->spare = t->params;
        memset(&t->params, 0, sizeof t->params);
    }
    ctl_close_map(s, &t->params, died);
    ctl_close_map(s, &t->grads, died);
    int idx = t->index;
    free(t->bucket);
    memset(t, 0, sizeof *t);
    if (was_registered)
        early_restart(s); /* its gradients were in what was packed early */
    if (!was_registered)
        return;
    if (died) {
        /* The others' step can no longer be the step of every trainer: abandon
         * it; the engine still holds the state of the last completed step. */
        for (int i = 0; i < SRV_MAX_SLOTS; i++) {
            trainer *o = &s->slots[i];
            if (!o->used || !o->posted)
                continue;
            o->posted = 0;
            memset(o->bucket, 0, s->ntensors); /* it posts the step again, whole */
            scape_set_error(SCAPE_REMOTE,
                            "step %llu abandoned: trainer %d died mid-step; the optimizer "
                            "kept the state after step %llu, post step %llu again",
                            (unsigned long long)s->job.next_step, idx,
                            (unsigned long long)s->job.next_step - 1,
                            (unsigned long long)s->job.next_step);
            ctl_reply_error(s, o->rid, o->rid_len, SCAPE_REMOTE);
        }
        ctl_maybe_sync(s);
        return;
    }
    ctl_maybe_sync(s);
    ctl_maybe_step(s);
}

static scape_rc on_detach(server *s, trainer *t)
{
    if (t->posted)
        return scape_set_error(SCAPE_INVALID,
                               "detach: trainer %d has a step in flight; wait for it first",
                               t->index);
    /* Unmap first, then answer: a CUDA IPC buffer must be closed here before
     * the trainer frees it, so while the comm is busy the answer waits too. */
    unsigned char rid[SRV_RID_MAX];
    size_t rid_len = t->rid_len;
    memcpy(rid, t->rid, rid_len);
    int graves = s->ngraves;
    ctl_drop(s, t, 0);
    ctl_reply_detached(s, graves, rid, rid_len);
    return SCAPE_OK;
}

/* ---- dispatch ----------------------------------------------------------------- */

void ctl_handle(server *s, const unsigned char *rid, size_t rid_len, const Scape__Request *q)
{
    scape_rc rc;
    trainer *t = find(s, rid, rid_len);
    if (q->body_case == SCAPE__REQUEST__BODY_HELLO) {
        rc = on_hello(s, rid, rid_len, q->hello);
    } else if (t == NULL) {
        rc = scape_set_error(SCAPE_INVALID, "say hello first (request type %d)",
                             (int)q->body_case);
    } else if (s->stopping) {
        rc = scape_set_error(SCAPE_REMOTE, "scaped is shutting down");
    } else {
        switch (q->body_case) {
        case SCAPE__REQUEST__BODY_REGISTER: rc = on_register(s, t, q->register_); break;
        case SCAPE__REQUEST__BODY_STEP: rc = on_step(s, t, q->step); break;
        case SCAPE__REQUEST__BODY_SYNC: rc = on_sync(s, t); break;
        case SCAPE__REQUEST__BODY_RESUME: rc = on_resume(s, t, q->resume); break;
        case SCAPE__REQUEST__BODY_DETACH: rc = on_detach(s, t); break;
        case SCAPE__REQUEST__BODY_POST: on_post(s, t, q->post); rc = SCAPE_OK; break;
        case SCAPE__REQUEST__BODY_STATUS:
        case SCAPE__REQUEST__BODY_METRICS:
        case SCAPE__REQUEST__BODY_SHUTDOWN:
            rc = scape_set_error(SCAPE_INVALID,
                                 "status, metrics and shutdown go to the status endpoint");
            break;
        default:
            rc = scape_set_error(SCAPE_PROTO, "unknown request type");
        }
    }
    if (rc != SCAPE_OK) {
        LOG_WARN(SUB_CTRL, "refused a request from %s: %s", t ? t->identity : "a new peer",
                 scape_last_error());
        ctl_reply_error(s, rid, rid_len, rc);
    }
}
