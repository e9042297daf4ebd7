// prep.c — request preparation on a worker pool (see prep.h).
#include "api/prep.h"

#include <errno.h>
#include <event2/event.h>
#include <jansson.h>
#include <pthread.h>
#include <stdatomic.h>
#include <string.h>
#include <sys/eventfd.h>
#include <unistd.h>

#define PREP_MAX_THREADS 4

struct pd_api_prep {
    pd_api_prep_params params;
    struct event *ev;  // the eventfd, readable while finished jobs wait for the loop
    int efd;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    api_prep_job *q_head, *q_tail;        // waiting for a worker (mu)
    api_prep_job *done_head, *done_tail;  // prepared, waiting for the loop (mu)
    bool is_stopping;                     // (mu)
    int n_threads;
    pthread_t threads[PREP_MAX_THREADS];
    int n_pending;     // loop thread only
    long n_cancelled;  // loop thread only
};

static void (*_Atomic g_test_hook)(const char *body, size_t len);

void pd_api_prep_set_test_hook(void (*fn)(const char *body, size_t len)) { atomic_store(&g_test_hook, fn); }

static void push(api_prep_job **head, api_prep_job **tail, api_prep_job *j) {
    j->next = NULL;
    if (*tail) (*tail)->next = j;
    else *head = j;
    *tail = j;
}

static void job_free(api_prep_job *j) {
    pd_api_prompts_fini(&j->pr);
    pd_api_request_fini(&j->rq);
    pd_free(j->body);
    pd_free(j);
}

// Worker side: everything here reads only the job and read-only model state.
static void prepare(pd_api_prep *p, api_prep_job *j) {
    if (atomic_load(&j->is_cancelled)) return;
    void (*hook)(const char *, size_t) = atomic_load(&g_test_hook);
    if (hook) hook(j->body, j->len);
    if (j->detect_kind) {
        json_t *probe = json_loadb(j->body, j->len, 0, NULL);
        j->kind = json_object_get(probe, "messages") ? PD_API_CHAT : PD_API_COMPLETION;
        json_decref(probe);
    }
    const pd_api_prep_params *pp = &p->params;
    j->status = pd_api_request_parse(j->kind, j->body, j->len, pp->model_name, &j->rq, &j->e);
    if (j->status == PD_OK) {
        j->rq.tool_format = pp->tool_format;
        j->status = pd_api_request_tokenize(&j->rq, pp->tok, pp->tmpl, pp->max_model_len, &j->pr, &j->e);
    }
}

static void *worker(void *arg) {
    pd_api_prep *p = arg;
    pthread_mutex_lock(&p->mu);
    for (;;) {
        while (!p->q_head && !p->is_stopping) pthread_cond_wait(&p->cv, &p->mu);
        if (p->is_stopping) break;  // queued jobs are freed by pd_api_prep_free
        api_prep_job *j = p->q_head;
        p->q_head = j->next;
        if (!p->q_head) p->q_tail = NULL;
        pthread_mutex_unlock(&p->mu);
        prepare(p, j);
        pthread_mutex_lock(&p->mu);
        push(&p->done_head, &p->done_tail, j);
        uint64_t one = 1;
        ssize_t k = write(p->efd, &one, sizeof one);  // never blocks: eventfd counters saturate far away
        PD_UNUSED(k);
    }
    pthread_mutex_unlock(&p->mu);
    return NULL;
}

// Loop side: hands each finished job to its done callback (or drops it if its client left).
static void on_ready(evutil_socket_t fd, short what, void *arg) {
    pd_api_prep *p = arg;
    PD_UNUSED(what);
    uint64_t n;
    while (read(fd, &n, sizeof n) < 0 && errno == EINTR) {
    }
    pthread_mutex_lock(&p->mu);
    api_prep_job *list = p->done_head;
    p->done_head = p->done_tail = NULL;
    pthread_mutex_unlock(&p->mu);
    while (list) {
        api_prep_job *j = list;
        list = j->next;
        p->n_pending--;
        if (j->http && !atomic_load(&j->is_cancelled)) {
            pd_http_req_set_close_cb(j->http, NULL, NULL);
            j->done(j, j->ud);
        }
        job_free(j);
    }
}

static void on_client_close(pd_http_req *r, void *ud) {
    api_prep_job *j = ud;
    PD_UNUSED(r);
    j->http = NULL;
    atomic_store(&j->is_cancelled, true);
    j->pool->n_cancelled++;
}

pd_status pd_api_prep_submit(pd_api_prep *p, pd_http_req *r, pd_api_kind kind, bool detect_kind,
                             api_prep_done_fn done, void *ud) {
    size_t len;
    const char *body = pd_http_req_body(r, &len);
    api_prep_job *j = pd_calloc(1, sizeof *j);
    if (!j) return PD_ERR_NOMEM;
    j->body = pd_malloc(len + 1);
    if (!j->body) {
        pd_free(j);
        return PD_ERR_NOMEM;
    }
    if (len) memcpy(j->body, body, len);
    j->body[len] = 0;
    j->len = len;
    j->http = r;
    j->kind = kind;
    j->detect_kind = detect_kind;
    j->pool = p;
    j->done = done;
    j->ud = ud;
    atomic_init(&j->is_cancelled, false);
    pd_http_req_set_close_cb(r, on_client_close, j);
    p->n_pending++;
    pthread_mutex_lock(&p->mu);
    push(&p->q_head, &p->q_tail, j);
    pthread_cond_signal(&p->cv);
    pthread_mutex_unlock(&p->mu);
    return PD_OK;
}

pd_api_prep *pd_api_prep_new(struct event_base *base, const pd_api_prep_params *pp, pd_err *err) {
    pd_api_prep *p = pd_calloc(1, sizeof *p);
    if (!p) {
        pd_err_set(err, PD_ERR_NOMEM, "api: out of memory");
        return NULL;
    }
    p->params = *pp;
    // Two at least, so that one maximal prompt being prepared does not hold up the next request
    // (running streams never wait for the pool: they live on the loop).
    int n = pp->n_threads;
    if (n <= 0) n = (int)(sysconf(_SC_NPROCESSORS_ONLN) / 4);
    n = PD_MAX(2, PD_MIN(n, PREP_MAX_THREADS));
    p->efd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    pthread_mutex_init(&p->mu, NULL);
    pthread_cond_init(&p->cv, NULL);
    if (p->efd < 0) {
        pd_err_set(err, PD_ERR_IO, "api: eventfd: %s", strerror(errno));
        goto fail;
    }
    p->ev = event_new(base, p->efd, EV_READ | EV_PERSIST, on_ready, p);
    if (!p->ev || event_add(p->ev, NULL)) {
        pd_err_set(err, PD_ERR_IO, "api: cannot watch the preparation eventfd");
        goto fail;
    }
    for (; p->n_threads < n; p->n_threads++) {
        if (pthread_create(&p->threads[p->n_threads], NULL, worker, p)) {
            if (p->n_threads > 0) break;  // fewer threads than asked still works
            pd_err_set(err, PD_ERR_IO, "api: cannot start a preparation thread");
            goto fail;
        }
    }
    return p;
fail:
    pd_api_prep_free(p);
    return NULL;
}

static void free_list(api_prep_job *j) {
    while (j) {
        api_prep_job *next = j->next;
        if (j->http) pd_http_req_set_close_cb(j->http, NULL, NULL);
        job_free(j);
        j = next;
    }
}

void pd_api_prep_free(pd_api_prep *p) {
    if (!p) return;
    pthread_mutex_lock(&p->mu);
    p->is_stopping = true;
    pthread_cond_broadcast(&p->cv);
    pthread_mutex_unlock(&p->mu);
    for (int i = 0; i < p->n_threads; i++) pthread_join(p->threads[i], NULL);
    free_list(p->q_head);
    free_list(p->done_head);
    if (p->ev) event_free(p->ev);
    if (p->efd >= 0) close(p->efd);
    pthread_cond_destroy(&p->cv);
    pthread_mutex_destroy(&p->mu);
    pd_free(p);
}

int pd_api_prep_n_pending(const pd_api_prep *p) { return p ? p->n_pending : 0; }
int pd_api_prep_n_threads(const pd_api_prep *p) { return p ? p->n_threads : 0; }
long pd_api_prep_n_cancelled(const pd_api_prep *p) { return p ? p->n_cancelled : 0; }
