// fuzz_chat_template.c — libFuzzer target for the Jinja engine and chat templates (src/tok/jinja*,
// src/tok/chat.c).
//
// Input: byte 0 selects the mode, the rest is the payload.
//   * even: the payload is a template. It is parsed and, if it parses, rendered against a fixed
//     chat-like context under small limits. Checked: no crash/leak/UB (ASan+UBSan), output within
//     max_output_bytes and valid UTF-8, and a second render gives the same bytes (determinism).
//   * odd: the payload is JSON: an array of messages, or {"messages": [...], ...kwargs}. It is
//     rendered with the ChatML template, whose output is also computed here directly and must
//     match byte for byte when every message is an object with string role and content (and the
//     render must fail otherwise), then with a richer built-in template (namespace, loop.*,
//     selectattr, tojson, slicing, raise_exception) for crashes only.
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tok/chat.h"
#include "tok/jinja.h"

static const char k_chatml[] =
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + "
    "'<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}";

static const char k_rich[] =
    "{%- set ns = namespace(sys='', n=0) -%}\n"
    "{%- for m in messages if m is mapping -%}\n"
    "  {%- if m.role == 'system' %}{% set ns.sys = ns.sys ~ (m.content | string | trim) %}{% continue %}{% endif -%}\n"
    "  {%- set ns.n = ns.n + 1 -%}\n"
    "  {%- if (m.role == 'user') != (ns.n % 2 == 1) and strict is defined -%}\n"
    "    {{- raise_exception('roles must alternate') -}}\n"
    "  {%- endif -%}\n"
    "  [{{ loop.index }}/{{ loop.length }}{{ '*' if loop.last }}] {{ m.role | upper }}: "
    "{{ m.content if m.content is string else m.content | tojson(indent=1) }}\n"
    "  {%- if m.tool_calls is defined and m.tool_calls %}{% for t in m.tool_calls %} <{{ t.function.name | default('?') }}"
    "({{ t.function.arguments | tojson }})>{% endfor %}{% endif %}\n"
    "{%- endfor -%}\n"
    "{{ ns.sys[:20] }}|{{ (messages | selectattr('role', 'defined') | map(attribute='role') | unique | list)[::-1] }}"
    "|{{ tools | tojson if tools else '' }}{{ (messages | length) * 2 }}\n";

static pd_jinja_tmpl *g_chatml, *g_rich;
static json_t *g_ctx;

static pd_jinja_limits fuzz_limits(void) {
    pd_jinja_limits lim = pd_jinja_limits_default();
    lim.max_output_bytes = 1 << 16;
    lim.max_steps = 200000;
    lim.max_items = 10000;
    lim.max_depth = 16;
    lim.now_unix = 1700000000;
    return lim;
}

static bool utf8_valid(const char *s, size_t n) {
    const unsigned char *p = (const unsigned char *)s;
    for (size_t i = 0; i < n;) {
        unsigned c = p[i];
        size_t k = c < 0x80 ? 0 : (c & 0xE0) == 0xC0 ? 1 : (c & 0xF0) == 0xE0 ? 2 : (c & 0xF8) == 0xF0 ? 3 : 9;
        if (k == 9 || i + k >= n + (k ? 0 : 1)) return false;
        uint32_t cp = k ? c & (0x3F >> k) : c;
        for (size_t j = 1; j <= k; j++) {
            if ((p[i + j] & 0xC0) != 0x80) return false;
            cp = (cp << 6) | (p[i + j] & 0x3F);
        }
        if ((k == 1 && cp < 0x80) || (k == 2 && cp < 0x800) || (k == 3 && cp < 0x10000) || cp > 0x10FFFF ||
            (cp >= 0xD800 && cp <= 0xDFFF))
            return false;
        i += k + 1;
    }
    return true;
}

static void init(void) {
    if (g_ctx) return;
    pd_err err = {0};
    g_chatml = pd_jinja_parse(k_chatml, sizeof k_chatml - 1, &err);
    g_rich = pd_jinja_parse(k_rich, sizeof k_rich - 1, &err);
    if (!g_chatml || !g_rich) {
        fprintf(stderr, "fuzz_chat_template: built-in template does not parse: %s\n", err.msg);
        abort();
    }
    g_ctx = json_loads(
        "{\"messages\": [{\"role\": \"system\", \"content\": \"  Be brief. \\u00e9 \"},"
        " {\"role\": \"user\", \"content\": \"Hi \\ud83d\\ude00 <b>\\n\"},"
        " {\"role\": \"assistant\", \"content\": null, \"tool_calls\": [{\"id\": \"abc123xyz\", \"type\": \"function\","
        "   \"function\": {\"name\": \"f\", \"arguments\": {\"x\": 1.5, \"y\": [true, null, -3]}}}]},"
        " {\"role\": \"tool\", \"content\": \"42\"}, {\"role\": \"user\", \"content\": \"ok\"}],"
        " \"tools\": [{\"type\": \"function\", \"function\": {\"name\": \"f\", \"parameters\": {\"type\": \"object\"}}}],"
        " \"add_generation_prompt\": true, \"bos_token\": \"<s>\", \"eos_token\": \"</s>\", \"n\": 7, \"f\": 0.1,"
        " \"nested\": {\"a\": [1, {\"b\": \"c\"}]}, \"s\": \"  Hello, World  \"}",
        0, NULL);
    if (!g_ctx) abort();
}

static void fuzz_template(const char *src, size_t len) {
    pd_err err = {0};
    pd_jinja_tmpl *t = pd_jinja_parse(src, len, &err);
    if (!t) return;
    pd_jinja_limits lim = fuzz_limits();
    char *a = NULL, *b = NULL;
    size_t na = 0, nb = 0;
    pd_status sa = pd_jinja_render_ex(t, g_ctx, &lim, &a, &na, &err);
    if (sa == PD_OK) {
        if (na > lim.max_output_bytes || !utf8_valid(a, na) || strlen(a) > na) abort();
        pd_status sb = pd_jinja_render_ex(t, g_ctx, &lim, &b, &nb, &err);
        if (sb != PD_OK || na != nb || memcmp(a, b, na)) abort();
    }
    pd_free(a);
    pd_free(b);
    pd_jinja_free(t);
}

// The ChatML rendering computed directly; false if some message would make the template fail.
static bool chatml_expected(json_t *msgs, bool gen, char **out, size_t *len) {
    size_t cap = 64, n = 0, i;
    json_t *m;
    char *buf = malloc(cap);
    json_array_foreach(msgs, i, m) {
        json_t *role = json_object_get(m, "role"), *content = json_object_get(m, "content");
        if (!json_is_object(m) || !json_is_string(role) || !json_is_string(content)) {
            free(buf);
            return false;
        }
        const char *parts[] = {"<|im_start|>", json_string_value(role), "\n", json_string_value(content), "<|im_end|>\n"};
        size_t lens[] = {12, json_string_length(role), 1, json_string_length(content), 11};
        for (int k = 0; k < 5; k++) {
            while (n + lens[k] + 1 > cap) buf = realloc(buf, cap *= 2);
            memcpy(buf + n, parts[k], lens[k]);
            n += lens[k];
        }
    }
    if (gen) {
        while (n + 24 > cap) buf = realloc(buf, cap *= 2);
        memcpy(buf + n, "<|im_start|>assistant\n", 22);
        n += 22;
    }
    buf[n] = 0;
    *out = buf;
    *len = n;
    return true;
}

static void fuzz_messages(const char *payload, size_t len, bool gen) {
    json_t *j = json_loadb(payload, len, 0, NULL);
    if (!j) return;
    json_t *msgs = json_is_object(j) ? json_object_get(j, "messages") : j;
    json_t *ctx = json_is_object(j) ? json_deep_copy(j) : json_object();
    if (!json_is_array(msgs) || !ctx) {
        json_decref(ctx);
        json_decref(j);
        return;
    }
    json_object_set(ctx, "messages", msgs);
    json_object_set_new(ctx, "add_generation_prompt", json_boolean(gen));
    pd_jinja_limits lim = fuzz_limits();
    pd_err err = {0};
    char *out = NULL, *want = NULL;
    size_t n_out = 0, n_want = 0;
    pd_status st = pd_jinja_render_ex(g_chatml, ctx, &lim, &out, &n_out, &err);
    bool expect_ok = chatml_expected(msgs, gen, &want, &n_want);
    if (expect_ok && n_want > lim.max_output_bytes) expect_ok = false;
    if (expect_ok != (st == PD_OK)) abort();
    if (expect_ok && (n_out != n_want || memcmp(out, want, n_want))) abort();
    free(want);
    pd_free(out);
    out = NULL;
    if (pd_jinja_render_ex(g_rich, ctx, &lim, &out, &n_out, &err) == PD_OK && !utf8_valid(out, n_out)) abort();
    pd_free(out);
    // The chat API over the same input must not crash either.
    out = NULL;
    pd_chat_apply(k_chatml, msgs, gen, "<s>", "</s>", json_is_object(j) ? j : NULL, &out, &err);
    pd_free(out);
    json_decref(ctx);
    json_decref(j);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    init();
    if (size < 1) return 0;
    const char *payload = (const char *)data + 1;
    size_t len = size - 1;
    if (data[0] & 1) fuzz_messages(payload, len, (data[0] & 2) != 0);
    else fuzz_template(payload, len);
    return 0;
}
