// shutdown.c — graceful shutdown of a serving loop (`serve`, `router`) on SIGTERM / SIGINT.
//
// Signals are caught by libevent (evsignal: the handler only wakes the loop) and handled here on
// the loop thread, so nothing async-signal-unsafe runs in a signal handler.
//
//   first signal ─► drain(): /health 503 "draining", new requests 503 + Retry-After, running
//                   requests continue; a 50 ms tick checks is_drained()
//   drained ─────────────────────────────────────────────────────────► loop exits, caller frees
//   --shutdown-timeout passed, or a second signal ─► end_all(): streams get an SSE error event
//                   and close without [DONE]; then up to 2 s for those bytes to be written ─► exit
#include <event2/event.h>
#include <signal.h>
#include <stdio.h>

#include "cmd/cmd.h"

#define TICK_MS 50
#define FLUSH_S 2

static void end_now(pd_cmd_shutdown *s) {
    s->is_ended = true;
    s->t_flush_deadline_us = pd_time_us() + (int64_t)FLUSH_S * 1000000;
    s->end_all(s->ud, "the server is shutting down; the request was cut short");
}

static void on_tick(evutil_socket_t fd, short what, void *arg) {
    pd_cmd_shutdown *s = arg;
    PD_UNUSED(fd);
    PD_UNUSED(what);
    int64_t now = pd_time_us();
    if (s->is_drained(s->ud)) {
        fprintf(stderr, "%s: drained in %.1f s\n", s->who, (double)(now - s->t_signal_us) / 1e6);
        event_base_loopbreak(s->base);
    } else if (!s->is_ended && now >= s->t_deadline_us) {
        fprintf(stderr, "%s: shutdown timeout (%d s): ending the requests still running\n", s->who, s->timeout_s);
        end_now(s);
    } else if (s->is_ended && now >= s->t_flush_deadline_us) {
        event_base_loopbreak(s->base);
    }
}

static void on_signal(evutil_socket_t sig, short what, void *arg) {
    pd_cmd_shutdown *s = arg;
    PD_UNUSED(what);
    const char *name = sig == SIGINT ? "SIGINT" : "SIGTERM";
    if (s->n_signals++ == 0) {
        s->t_signal_us = pd_time_us();
        s->t_deadline_us = s->t_signal_us + (int64_t)s->timeout_s * 1000000;
        fprintf(stderr, "\n%s: caught %s: draining (new requests get 503; running ones have up to %d s; "
                        "signal again to stop now)\n", s->who, name, s->timeout_s);
        s->drain(s->ud);
        struct timeval tv = {0, TICK_MS * 1000};
        if (event_add(s->tick, &tv)) event_base_loopbreak(s->base);
        on_tick(-1, 0, s);
    } else if (!s->is_ended) {
        fprintf(stderr, "%s: caught %s again: ending the running requests now\n", s->who, name);
        end_now(s);
    }
}

pd_status pd_cmd_shutdown_install(pd_cmd_shutdown *s) {
    s->sigint = evsignal_new(s->base, SIGINT, on_signal, s);
    s->sigterm = evsignal_new(s->base, SIGTERM, on_signal, s);
    s->tick = event_new(s->base, -1, EV_PERSIST, on_tick, s);
    if (!s->sigint || !s->sigterm || !s->tick || event_add(s->sigint, NULL) || event_add(s->sigterm, NULL)) {
        pd_cmd_shutdown_fini(s);
        return PD_ERR_IO;
    }
    return PD_OK;
}

void pd_cmd_shutdown_fini(pd_cmd_shutdown *s) {
    if (s->sigint) event_free(s->sigint);
    if (s->sigterm) event_free(s->sigterm);
    if (s->tick) event_free(s->tick);
    s->sigint = s->sigterm = s->tick = NULL;
}
