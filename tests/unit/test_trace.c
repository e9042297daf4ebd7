// test_trace.c — W3C traceparent parsing / formatting and the Chrome-trace file exporter
// (metrics/trace.h).
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <jansson.h>

#include "metrics/trace.h"
#include "test.h"

PD_TEST(traceparent_parse_and_format) {
    pd_trace_ctx c;
    PD_REQUIRE(pd_traceparent_parse("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01", &c) == PD_OK);
    PD_CHECK(c.is_valid);
    PD_CHECK_EQ(c.trace_id[0], 0x4b);
    PD_CHECK_EQ(c.trace_id[15], 0x36);
    PD_CHECK_EQ(c.span_id[7], 0xb7);
    char out[PD_TRACEPARENT_LEN + 1];
    pd_traceparent_format(c.trace_id, c.span_id, out);
    PD_CHECK_STR(out, "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01");
    const char *bad[] = {
        NULL, "", "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7",        // short
        "01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",                // unknown version
        "00-00000000000000000000000000000000-00f067aa0ba902b7-01",                // zero trace id
        "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",                // zero span id
        "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",                // uppercase
        "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-0g",                // bad flags
        "00-4bf92f3577b34da6a3ce929d0e0e4736_00f067aa0ba902b7-01",                // bad separator
        "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra",          // version 00 is exact
    };
    for (size_t i = 0; i < PD_ARRAY_LEN(bad); i++) {
        PD_CHECK_EQ(pd_traceparent_parse(bad[i], &c), PD_ERR_INVALID);
        PD_CHECK(!c.is_valid);
    }
    uint8_t a[16], b[16], s[8];
    pd_trace_new_trace_id(a);
    pd_trace_new_trace_id(b);
    pd_trace_new_span_id(s);
    PD_CHECK(memcmp(a, b, 16) != 0);
    pd_traceparent_format(a, s, out);
    PD_CHECK(pd_traceparent_parse(out, &c) == PD_OK && !memcmp(c.trace_id, a, 16) && !memcmp(c.span_id, s, 8));
}

PD_TEST(trace_file_export) {
    PD_CHECK(!pd_trace_enabled());
    uint8_t t[16] = {1}, s1[8] = {2}, s2[8] = {3};
    pd_trace_span(t, s1, NULL, "ignored", 0, 1, NULL);  // off: a no-op
    char dir[] = "/tmp/pd_test_trace.XXXXXX";
    PD_REQUIRE(mkdtemp(dir) != NULL);
    pd_err err = {0};
    PD_REQUIRE(pd_trace_init("unit", dir, &err) == PD_OK);
    PD_CHECK(pd_trace_enabled());
    int64_t t0 = pd_time_us();
    pd_trace_span(t, s1, NULL, "root \"quoted\"", t0, t0 + 1500, "\"tokens\":5");
    pd_trace_span(t, s2, s1, "child", t0 + 100, t0 + 50, NULL);  // end before start: clamped
    pd_trace_shutdown();
    PD_CHECK(!pd_trace_enabled());
    char path[256];
    snprintf(path, sizeof path, "%s/pdserve-unit-%d.json", dir, (int)getpid());
    json_error_t je;
    json_t *doc = json_load_file(path, 0, &je);  // closed by shutdown: a complete JSON array
    PD_REQUIRE(json_is_array(doc));
    int n_x = 0;
    size_t i;
    json_t *e;
    json_array_foreach(doc, i, e) {
        if (strcmp(json_string_value(json_object_get(e, "ph")), "X")) continue;
        json_t *args = json_object_get(e, "args");
        PD_CHECK_STR(json_string_value(json_object_get(args, "trace_id")), "01000000000000000000000000000000");
        if (n_x == 0) {
            PD_CHECK_STR(json_string_value(json_object_get(e, "name")), "root \"quoted\"");
            PD_CHECK_EQ(json_integer_value(json_object_get(e, "dur")), 1500);
            PD_CHECK_EQ(json_integer_value(json_object_get(args, "tokens")), 5);
            PD_CHECK_STR(json_string_value(json_object_get(args, "parent_span_id")), "");
        } else {
            PD_CHECK_STR(json_string_value(json_object_get(args, "parent_span_id")), "0200000000000000");
            PD_CHECK_EQ(json_integer_value(json_object_get(e, "dur")), 0);
        }
        n_x++;
    }
    PD_CHECK_EQ(n_x, 2);
    json_decref(doc);
    unlink(path);
    rmdir(dir);
}
