// queue.c — see queue.h.
#include "engine/queue.h"

#include <string.h>
#include <time.h>
#include <sys/eventfd.h>
#include <unistd.h>

pd_status pd_queue_init(pd_queue *q) {
    memset(q, 0, sizeof *q);
    q->efd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (q->efd < 0) return PD_ERR_IO;
    pthread_mutex_init(&q->mu, NULL);
    pthread_cond_init(&q->cv, NULL);
    return PD_OK;
}

void pd_cmd_free(pd_cmd *c) {
    if (!c) return;
    pd_free(c->prompt);
    pd_sample_ctl_free(c->req.ctl);  // a SUBMIT the engine never took over
    if (c->kev) {
        pd_kvconn_event_fini(c->kev);
        pd_free(c->kev);
    }
    pd_free(c);
}

void pd_queue_fini(pd_queue *q) {
    if (q->efd <= 0 && !q->out) return;
    for (pd_cmd *c = q->in_head, *n; c; c = n) {
        n = c->next;
        pd_cmd_free(c);
    }
    pd_free(q->out);
    if (q->efd > 0) close(q->efd);
    pthread_mutex_destroy(&q->mu);
    pthread_cond_destroy(&q->cv);
    memset(q, 0, sizeof *q);
}

pd_status pd_queue_push_cmd(pd_queue *q, pd_cmd *c) {
    c->next = NULL;
    pthread_mutex_lock(&q->mu);
    if (q->in_tail) q->in_tail->next = c;
    else q->in_head = c;
    q->in_tail = c;
    if (c->kind == PD_CMD_SUBMIT) q->n_in_submits++;
    pthread_cond_signal(&q->cv);
    pthread_mutex_unlock(&q->mu);
    return PD_OK;
}

pd_cmd *pd_queue_pop_cmds(pd_queue *q, int64_t wait_us, bool *stopping) {
    pthread_mutex_lock(&q->mu);
    if (wait_us < 0) {
        while (!q->in_head && !q->stopping) pthread_cond_wait(&q->cv, &q->mu);
    } else if (wait_us > 0 && !q->in_head && !q->stopping) {
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        int64_t ns = ts.tv_nsec + wait_us * 1000;
        ts.tv_sec += ns / 1000000000;
        ts.tv_nsec = ns % 1000000000;
        pthread_cond_timedwait(&q->cv, &q->mu, &ts);
    }
    pd_cmd *h = q->in_head;
    q->in_head = q->in_tail = NULL;
    q->n_in_submits = 0;
    *stopping = q->stopping;
    pthread_mutex_unlock(&q->mu);
    return h;
}

pd_status pd_queue_push_events(pd_queue *q, const pd_engine_event *ev, int n) {
    if (n <= 0) return PD_OK;
    pthread_mutex_lock(&q->mu);
    if (PD_ARRAY_RESERVE(q->out, q->cap_out, (size_t)q->n_out + (size_t)n)) {
        pthread_mutex_unlock(&q->mu);
        return PD_ERR_NOMEM;
    }
    bool was_empty = q->n_out == 0;
    memcpy(q->out + q->n_out, ev, sizeof *ev * (size_t)n);
    q->n_out += n;
    if (was_empty) {
        uint64_t one = 1;
        ssize_t w = write(q->efd, &one, sizeof one);
        (void)w;  // EAGAIN only if the counter is saturated: it is readable anyway
    }
    pthread_mutex_unlock(&q->mu);
    return PD_OK;
}

int pd_queue_poll_events(pd_queue *q, pd_engine_event *out, int max) {
    pthread_mutex_lock(&q->mu);
    int n = PD_MIN(max, q->n_out);
    if (n > 0) {
        memcpy(out, q->out, sizeof *out * (size_t)n);
        memmove(q->out, q->out + n, sizeof *out * (size_t)(q->n_out - n));
    }
    q->n_out -= n;
    if (q->n_out == 0) {
        uint64_t v;
        ssize_t r = read(q->efd, &v, sizeof v);  // reset: not readable until the next push
        (void)r;
    }
    pthread_mutex_unlock(&q->mu);
    return n;
}

void pd_queue_stop(pd_queue *q) {
    pthread_mutex_lock(&q->mu);
    q->stopping = true;
    pthread_cond_broadcast(&q->cv);
    pthread_mutex_unlock(&q->mu);
}
