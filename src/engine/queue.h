// queue — the one thread boundary of a serving process (llama.cpp: "group all of the
// mutex-related logic into one file"). Other threads push commands (submit, abort) in; the engine
// thread pops them, and pushes events out; the event loop is woken through an eventfd and drains
// the events. Everything here is guarded by one mutex; the engine thread sleeps on a condition
// variable while it has no work.
#pragma once
#include <pthread.h>

#include "base/buf.h"
#include "engine/engine.h"
#include "kvconn/kvconn.h"

typedef enum pd_cmd_kind { PD_CMD_SUBMIT = 1, PD_CMD_ABORT = 2, PD_CMD_XFER = 3 } pd_cmd_kind;

typedef struct pd_cmd {
    pd_cmd_kind kind;
    uint64_t id;
    pd_engine_request req;   // SUBMIT: prompt/stop_ids point into the owned copies below
    int32_t *prompt;         // owned
    int32_t stop_ids[16];
    pd_kvconn_event *kev;    // XFER: a KV connector event (owned)
    struct pd_cmd *next;
} pd_cmd;

typedef struct pd_queue {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    pd_cmd *in_head, *in_tail;  // owned commands, FIFO
    int n_in_submits;
    pd_engine_event *out;       // owned, (cap_out)
    int n_out;
    size_t cap_out;  // PD_ARRAY_RESERVE (base/buf.h)
    int efd;                    // eventfd: readable while out is non-empty
    bool stopping;
    pd_engine_stats stats;      // snapshot written by the engine thread
} pd_queue;

pd_status pd_queue_init(pd_queue *q);
void pd_queue_fini(pd_queue *q);  // frees pending commands and events
// Producer side (any thread).
pd_status pd_queue_push_cmd(pd_queue *q, pd_cmd *c);  // takes ownership
// Engine side: moves all pending commands out (returns the list head, caller frees each with
// pd_cmd_free). If nothing is pending, sleeps up to wait_us (-1: until something arrives or stop).
// *stopping: whether pd_queue_stop was called, read under the lock with the commands.
pd_cmd *pd_queue_pop_cmds(pd_queue *q, int64_t wait_us, bool *stopping);
void pd_cmd_free(pd_cmd *c);
pd_status pd_queue_push_events(pd_queue *q, const pd_engine_event *ev, int n);
int pd_queue_poll_events(pd_queue *q, pd_engine_event *out, int max);
void pd_queue_stop(pd_queue *q);
