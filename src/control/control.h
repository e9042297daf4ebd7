// control — the cluster control plane over NATS (libnats, Debian libnats-dev; docs/design.md,
// "Cluster mode"). With `--control nats://HOST:PORT`:
//
//   * workers publish PRESENCE on "pdserve.presence.<role>.<instance>" every heartbeat: their URL,
//     role, load, the KV events since their previous presence and their disaggregation model
//     (wire/link.h), and answer "pdserve.resync.<instance>" requests (a STATE since N: the same
//     reply as GET /internal/state) when a router saw a gap in their event numbers;
//   * the router subscribes to "pdserve.presence.>" instead of polling each worker over HTTP;
//   * a JetStream work queue (stream PDSERVE_PREFILL, subject "pdserve.prefill.jobs", WorkQueue
//     retention, one durable pull consumer shared by the prefill workers) carries prefill jobs:
//     decode workers push, prefill workers fetch and ack; a job not acked within ack_wait (its
//     prefill worker died) is redelivered to another one.
//
// Authentication, two layers:
//   * the NATS connection presents a token (the worker's --auth-token-file contents; nats-server
//     runs with `authorization { token: ... }`) or, with nkey_seed_file, signs the server's nonce
//     with an ed25519 nkey (nats-server lists the user's public key; control/nkey.h makes pairs):
//     a client without it is refused ("Authorization Violation") and pd_ctl_connect fails;
//   * every message pdserve publishes (presence, resync and its answer, claims and their answers,
//     prefill jobs) carries a NATS header Pd-Mac = hex HMAC-SHA256(sign_key, "pdctl1" NUL subject
//     NUL payload), sign_key being the KV shared secret. A message without a valid one never
//     reaches the inbox, a request's reply or a fetched job (counted in bad_mac): holding NATS
//     credentials (an nkey handed to a monitoring tool, say) is not enough to speak for a worker.
//     The MAC binds the subject, not the time: replays are the consumer's business (presences
//     carry a per-instance counter, "pseq", the router keeps the highest).
//
// Reconnection: libnats reconnects forever (reconnect wait reconnect_wait_ms, buffered publishes
// while down); the consumer learns of "down" and "up" through the inbox (PD_CTL_SUBJ_CONN).
//
// Threads: libnats delivers on its own threads. Subscribed messages and connection changes are
// copied into a mutex-protected inbox and signalled on an eventfd, which the consumer's event loop
// watches (pd_ctl_inbox_fd) and drains (pd_ctl_inbox_take) on its own thread. Publishing is
// thread-safe (libnats). The job queue's fetch blocks: call it on a thread of its own.
#pragma once

#include <stdbool.h>
#include <stdint.h>

#include "base/base.h"

#ifdef __cplusplus
extern "C" {
#endif

#define PD_CTL_SUBJ_PRESENCE "pdserve.presence"   // .<role>.<instance hex>
#define PD_CTL_SUBJ_RESYNC "pdserve.resync"       // .<instance hex>
#define PD_CTL_SUBJ_CONN "$pd.conn"               // inbox-only pseudo subject: data "up" / "down"
#define PD_CTL_JOBS_STREAM "PDSERVE_PREFILL"
#define PD_CTL_JOBS_SUBJECT "pdserve.prefill.jobs"
#define PD_CTL_MAX_MSG (4u << 20)                 // inbox messages over this are dropped (counted)
#define PD_CTL_INBOX_MAX_BYTES (64u << 20)        // inbox backlog cap: beyond it messages are dropped
#define PD_CTL_INBOX_MAX_MSGS 65536               // (counted in inbox_full) until the consumer drains
#define PD_CTL_MAC_HEADER "Pd-Mac"

typedef struct pd_ctl pd_ctl;

typedef struct pd_ctl_params {
    const char *url;          // "nats://host:port" (a comma-separated list is allowed)
    const char *token;        // NATS token; or
    const char *nkey_seed_file;  // an nkey user seed file (control/nkey.h): authenticates instead
    const char *sign_key;     // the shared secret every message is signed and checked with (required)
    const char *name;         // connection name shown by the server (may be NULL)
    int reconnect_wait_ms;    // default 250
    int connect_timeout_ms;   // default 2000
} pd_ctl_params;

// Connects (synchronously: an unreachable server or a refused token is an error now, with the
// server's words). Later losses are reconnected in the background. NULL with err on failure.
pd_ctl *pd_ctl_connect(const pd_ctl_params *p, pd_err *err);
// Closes the connection (pending publishes are flushed for at most 500 ms). NULL is a no-op.
void pd_ctl_free(pd_ctl *c);
bool pd_ctl_is_connected(pd_ctl *c);

typedef struct pd_ctl_stats {
    int64_t disconnects, reconnects;      // connection losses and recoveries since connect
    int64_t published, publish_failures;  // pd_ctl_publish calls
    int64_t received, dropped;            // inbox messages (dropped: over PD_CTL_MAX_MSG or OOM)
    int64_t bad_mac;                      // messages, replies and jobs without a valid Pd-Mac: dropped
    int64_t inbox_full;                   // dropped: the inbox backlog was at its cap
    int64_t nkey_zero_sigs;               // nkey connection attempts abandoned and retried: the
                                          // nonce's signature began with 0x00 (control.c, sign_nonce)
} pd_ctl_stats;
void pd_ctl_stats_get(pd_ctl *c, pd_ctl_stats *out);

// ---- publish / subscribe ---------------------------------------------------------------------
// reply may be NULL. Fails (PD_ERR_IO) only when libnats refuses (closed connection, buffer full
// while reconnecting). Any thread.
pd_status pd_ctl_publish(pd_ctl *c, const char *subject, const char *reply, const void *data, int len);
// Request-reply, blocking up to timeout_ms (call on a thread that may block). *reply (pd_malloc'd,
// NUL-terminated) on PD_OK; PD_ERR_NOTFOUND: no responder on subject; PD_ERR_TIMEOUT; PD_ERR_IO.
pd_status pd_ctl_request(pd_ctl *c, const char *subject, const void *data, int len, int timeout_ms, char **reply);
// Messages on subject (wildcards allowed) go to the inbox. PD_OK or PD_ERR_IO.
pd_status pd_ctl_subscribe(pd_ctl *c, const char *subject, pd_err *err);

typedef struct pd_ctl_msg {
    struct pd_ctl_msg *next;
    char *subject;            // owned (pd_ctl_msg_free)
    char *reply;              // owned, NULL if none
    char *data;               // owned, NUL-terminated
    int len;
} pd_ctl_msg;
// Readable when the inbox has something; pd_ctl_inbox_take clears it.
int pd_ctl_inbox_fd(pd_ctl *c);
// Takes every pending message, oldest first (NULL if none). Owner frees with pd_ctl_msg_free.
pd_ctl_msg *pd_ctl_inbox_take(pd_ctl *c);
void pd_ctl_msg_free(pd_ctl_msg *m);  // frees the whole list from m on

// ---- JetStream work queue ------------------------------------------------------------------------
typedef struct pd_ctl_jobq pd_ctl_jobq;
typedef struct pd_ctl_job pd_ctl_job;

// Creates (or reuses) the stream; is_consumer: also binds the durable pull consumer "prefill"
// (ack_wait_ms: redelivery after this long without an ack; max_deliver: give up after so many).
pd_ctl_jobq *pd_ctl_jobq_new(pd_ctl *c, bool is_consumer, int ack_wait_ms, int max_deliver, pd_err *err);
void pd_ctl_jobq_free(pd_ctl_jobq *q);
// Stores a job without waiting (JetStream acks asynchronously; libnats buffers). PD_OK or PD_ERR_IO.
pd_status pd_ctl_jobq_push_async(pd_ctl_jobq *q, const void *data, int len);
// Stores a job (waits for JetStream's ack, at most 2 s). PD_OK or PD_ERR_IO with err.
pd_status pd_ctl_jobq_push(pd_ctl_jobq *q, const void *data, int len, pd_err *err);
// Blocks up to timeout_ms for at most n jobs; returns how many were written to out (0 on timeout
// or while disconnected). A job without a valid Pd-Mac is acked (dropped) and counted in bad_mac.
// Consumer only.
int pd_ctl_jobq_fetch(pd_ctl_jobq *q, pd_ctl_job **out, int n, int timeout_ms);
const char *pd_ctl_job_data(const pd_ctl_job *j, int *len);
int64_t pd_ctl_job_n_delivered(const pd_ctl_job *j);  // 1 on first delivery
// Each of these ends the job handle (frees it). ack: done; nak: redeliver now; progress: extends
// the ack deadline (the handle stays valid: not freed).
pd_status pd_ctl_job_ack(pd_ctl_job *j);
pd_status pd_ctl_job_nak(pd_ctl_job *j);
pd_status pd_ctl_job_progress(pd_ctl_job *j);
void pd_ctl_job_free(pd_ctl_job *j);  // drops the handle without an answer (redelivered after ack_wait)

#ifdef __cplusplus
}
#endif
