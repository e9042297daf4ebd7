// trace.c — traceparent parsing/formatting and the Chrome-trace-file span exporter (trace.h).
#include "metrics/trace.h"

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/time.h>
#include <time.h>
#include <unistd.h>

static struct {
    pthread_mutex_t mu;
    FILE *f;
    char service[32];
    int64_t mono_to_unix_us;  // add to pd_time_us() for Unix µs
    int pid;
    pd_rng rng;               // span / trace ids (under mu)
    bool is_seeded;
} g_trace = {.mu = PTHREAD_MUTEX_INITIALIZER};

static int hexval(char c) {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    return -1;  // W3C: lowercase only
}

static bool parse_hex(const char *s, uint8_t *out, int n) {
    bool nonzero = false;
    for (int i = 0; i < n; i++) {
        int hi = hexval(s[2 * i]), lo = hexval(s[2 * i + 1]);
        if (hi < 0 || lo < 0) return false;
        out[i] = (uint8_t)(hi << 4 | lo);
        nonzero |= out[i] != 0;
    }
    return nonzero;
}

pd_status pd_traceparent_parse(const char *s, pd_trace_ctx *out) {
    memset(out, 0, sizeof *out);
    if (!s || strlen(s) < PD_TRACEPARENT_LEN) return PD_ERR_INVALID;
    // version 00 is exactly 55 chars; a future version may append fields after a '-'
    if (s[0] != '0' || s[1] != '0' || s[2] != '-' || s[35] != '-' || s[52] != '-') return PD_ERR_INVALID;
    if (strlen(s) != PD_TRACEPARENT_LEN) return PD_ERR_INVALID;
    uint8_t flags;
    if (!parse_hex(s + 3, out->trace_id, 16) || !parse_hex(s + 36, out->span_id, 8)) {
        memset(out, 0, sizeof *out);
        return PD_ERR_INVALID;
    }
    if (hexval(s[53]) < 0 || hexval(s[54]) < 0) {
        memset(out, 0, sizeof *out);
        return PD_ERR_INVALID;
    }
    flags = (uint8_t)(hexval(s[53]) << 4 | hexval(s[54]));
    PD_UNUSED(flags);
    out->is_valid = true;
    return PD_OK;
}

void pd_trace_hex(const uint8_t *b, int n, char *out) {
    static const char H[] = "0123456789abcdef";
    for (int i = 0; i < n; i++) {
        out[2 * i] = H[b[i] >> 4];
        out[2 * i + 1] = H[b[i] & 15];
    }
    out[2 * n] = 0;
}

void pd_traceparent_format(const uint8_t trace_id[16], const uint8_t span_id[8], char out[PD_TRACEPARENT_LEN + 1]) {
    char t[33], sp[17];
    pd_trace_hex(trace_id, 16, t);
    pd_trace_hex(span_id, 8, sp);
    snprintf(out, PD_TRACEPARENT_LEN + 1, "00-%s-%s-01", t, sp);
}

static void random_bytes(uint8_t *out, int n) {
    pthread_mutex_lock(&g_trace.mu);
    if (!g_trace.is_seeded) {
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        pd_rng_seed(&g_trace.rng, (uint64_t)ts.tv_nsec ^ ((uint64_t)ts.tv_sec << 20) ^ ((uint64_t)getpid() << 40));
        g_trace.is_seeded = true;
    }
    for (int i = 0; i < n; i += 8) {
        uint64_t x = pd_rng_next(&g_trace.rng);
        if (!x) x = 1;
        memcpy(out + i, &x, (size_t)PD_MIN(8, n - i));
    }
    pthread_mutex_unlock(&g_trace.mu);
}

void pd_trace_new_span_id(uint8_t out[8]) { random_bytes(out, 8); }
void pd_trace_new_trace_id(uint8_t out[16]) { random_bytes(out, 16); }

pd_status pd_trace_init(const char *service, const char *trace_dir, pd_err *err) {
    if (!trace_dir || !*trace_dir) return PD_OK;
    struct timeval tv;
    gettimeofday(&tv, NULL);
    int64_t unix_us = (int64_t)tv.tv_sec * 1000000 + tv.tv_usec;
    char path[4096];
    pthread_mutex_lock(&g_trace.mu);
    g_trace.mono_to_unix_us = unix_us - pd_time_us();
    g_trace.pid = (int)getpid();
    snprintf(g_trace.service, sizeof g_trace.service, "%s", service ? service : "pdserve");
    (void)mkdir(trace_dir, 0755);
    snprintf(path, sizeof path, "%s/pdserve-%s-%d.json", trace_dir, g_trace.service, g_trace.pid);
    int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    g_trace.f = fd >= 0 ? fdopen(fd, "w") : NULL;
    if (g_trace.f) {
        // process name metadata so Perfetto labels the track
        fprintf(g_trace.f, "[\n{\"name\":\"process_name\",\"ph\":\"M\",\"pid\":%d,\"tid\":0,\"args\":{\"name\":\"pdserve %s\"}},\n",
                g_trace.pid, g_trace.service);
        fflush(g_trace.f);
    }
    bool ok = g_trace.f != NULL;
    pthread_mutex_unlock(&g_trace.mu);
    if (!ok) return pd_err_set(err, PD_ERR_IO, "trace: cannot create %s: %s", path, strerror(errno));
    PD_LOG_I("trace: writing spans to %s", path);
    return PD_OK;
}

bool pd_trace_enabled(void) { return g_trace.f != NULL; }

// Copies s into a JSON string body (quotes and control characters escaped).
static void json_escape(FILE *f, const char *s) {
    for (; *s; s++) {
        unsigned char c = (unsigned char)*s;
        if (c == '"' || c == '\\') fprintf(f, "\\%c", c);
        else if (c < 0x20) fprintf(f, "\\u%04x", c);
        else fputc(c, f);
    }
}

void pd_trace_span(const uint8_t trace_id[16], const uint8_t span_id[8], const uint8_t *parent_span_id,
                   const char *name, int64_t t_start_us, int64_t t_end_us, const char *attrs_json) {
    if (!g_trace.f) return;
    char t[33], sp[17], pa[17] = "";
    pd_trace_hex(trace_id, 16, t);
    pd_trace_hex(span_id, 8, sp);
    if (parent_span_id) pd_trace_hex(parent_span_id, 8, pa);
    if (t_end_us < t_start_us) t_end_us = t_start_us;
    pthread_mutex_lock(&g_trace.mu);
    FILE *f = g_trace.f;
    if (f) {
        fprintf(f, "{\"name\":\"");
        json_escape(f, name ? name : "span");
        // one Perfetto track per trace: tid = low bits of the trace id
        unsigned tid = (unsigned)(trace_id[15] | trace_id[14] << 8) & 0x7fff;
        fprintf(f, "\",\"cat\":\"pdserve\",\"ph\":\"X\",\"ts\":%lld,\"dur\":%lld,\"pid\":%d,\"tid\":%u,"
                   "\"args\":{\"service\":\"%s\",\"trace_id\":\"%s\",\"span_id\":\"%s\",\"parent_span_id\":\"%s\"%s%s}},\n",
                (long long)(t_start_us + g_trace.mono_to_unix_us), (long long)(t_end_us - t_start_us), g_trace.pid, tid,
                g_trace.service, t, sp, pa, attrs_json && *attrs_json ? "," : "", attrs_json ? attrs_json : "");
        fflush(f);
    }
    pthread_mutex_unlock(&g_trace.mu);
}

void pd_trace_shutdown(void) {
    pthread_mutex_lock(&g_trace.mu);
    if (g_trace.f) {
        // close the array: a metadata event without a trailing comma, then ']'
        fprintf(g_trace.f, "{\"name\":\"trace_end\",\"ph\":\"M\",\"pid\":%d,\"tid\":0,\"args\":{}}\n]\n", g_trace.pid);
        fclose(g_trace.f);
        g_trace.f = NULL;
    }
    pthread_mutex_unlock(&g_trace.mu);
}
