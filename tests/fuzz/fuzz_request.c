// fuzz_request.c — libFuzzer target for the API's untrusted input: the input is an HTTP request
// body. It is parsed and validated as a /v1/completions and as a /v1/chat/completions request;
// whatever validates is rendered with the ChatML chat template (chat) and, when the kjv-llama-6m
// tokenizer is found (PD_MODELS_DIR, models/, ../shared/models), tokenized and checked against
// the context length, exactly as the server does before it submits to the engine.
// Invariants checked on every input: no crash/UB (ASan+UBSan), no pd_malloc leak, a failure has
// an error status that maps to 400/404/500, a non-empty message and a NUL-terminated param.
// Build: make build/fuzz/fuzz_request; run: build/fuzz/fuzz_request tests/fuzz/corpus/fuzz_request
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "api/api.h"

static pd_tok *g_tok;
static pd_chat_template *g_tmpl;

static const char CHATML[] =
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + "
    "'\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}";

int LLVMFuzzerInitialize(int *argc, char ***argv) {
    (void)argc;
    (void)argv;
    pd_log_set_level(PD_LOG_NONE);
    const char *env = getenv("PD_MODELS_DIR");
    char path[1024];
    const char *cands[] = {env, "models", "../shared/models", "../../shared/models"};
    for (size_t i = 0; i < sizeof cands / sizeof *cands && !g_tok; i++) {
        if (!cands[i]) continue;
        snprintf(path, sizeof path, "%s/kjv-llama-6m", cands[i]);
        g_tok = pd_tok_load(path, NULL);
    }
    const char *src = g_tok && pd_tok_chat_template(g_tok) ? pd_tok_chat_template(g_tok) : CHATML;
    g_tmpl = pd_chat_template_new(src, strlen(src), "<|begin_of_text|>", "<|end_of_text|>", NULL);
    if (!g_tmpl) abort();
    fprintf(stderr, "fuzz_request: tokenizer %s\n", g_tok ? "loaded (full tokenize path)" : "not found (parse + render only)");
    return 0;
}

static void check_error(pd_status st, const pd_api_error *e) {
    int http = pd_api_status_http(st, NULL);
    if (http != 400 && http != 404 && http != 500) abort();
    if (st != PD_ERR_NOMEM && !e->message[0]) abort();
    if (!memchr(e->param, 0, sizeof e->param)) abort();
}

static void one(pd_api_kind kind, const char *body, size_t len) {
    pd_api_request r;
    pd_api_error e;
    pd_status st = pd_api_request_parse(kind, body, len, "kjv-llama-6m", &r, &e);
    if (st) {
        check_error(st, &e);
        if (r.root || r.messages) abort();  // zeroed on failure
        return;
    }
    if (r.n < 1 || r.n > PD_API_MAX_N || r.n_stops > PD_API_MAX_STOPS || r.logprobs > PD_MAX_LOGPROBS) abort();
    if (kind == PD_API_CHAT) {
        char *text = NULL;
        pd_status rs = pd_chat_template_apply(g_tmpl, r.messages, true, NULL, NULL, &text, NULL, NULL);
        if (rs == PD_OK && (!text || strncmp(text, "<|im_start|>", 12))) abort();
        pd_free(text);
    }
    if (g_tok) {
        pd_api_prompts p;
        st = pd_api_request_tokenize(&r, g_tok, g_tmpl, 2048, &p, &e);
        if (st) {
            check_error(st, &e);
        } else {
            for (int i = 0; i < p.n; i++)
                if (p.items[i].n <= 0 || p.items[i].n >= 2048 || p.max_tokens[i] <= 0 || p.items[i].n + p.max_tokens[i] > 2048)
                    abort();
            pd_api_prompts_fini(&p);
        }
    }
    pd_api_request_fini(&r);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    size_t allocs = pd_mem_n_allocs();
    one(PD_API_COMPLETION, (const char *)data, size);
    one(PD_API_CHAT, (const char *)data, size);
    if (pd_mem_n_allocs() != allocs) {
        fprintf(stderr, "fuzz_request: leak of %zu allocations\n", pd_mem_n_allocs() - allocs);
        abort();
    }
    return 0;
}
