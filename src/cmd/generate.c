// generate.c — the offline subcommands: `tokenize`, `generate` and `model-info`.
#include <getopt.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend/backend.h"
#include "base/buf.h"
#include "cmd/cmd.h"
#include "model/generate.h"
#include "model/model.h"
#include "tok/tok.h"

static void progress(void *ud, size_t done, size_t total) {
    static int last = -1;
    if (total < (256u << 20)) return;  // small models load instantly
    int pct = (int)(100.0 * (double)done / (double)total);
    if (pct == last) return;
    last = pct;
    fprintf(stderr, "\rloading weights: %3d%% (%.2f / %.2f GB)%s", pct, (double)done / 1e9, (double)total / 1e9,
            done >= total ? "\n" : "");
}

// ---- tokenize ----------------------------------------------------------------------------------
int pd_cmd_tokenize(int argc, char **argv) {
    static const struct option opts[] = {{"model", required_argument, 0, 'm'},
                                         {"no-special", no_argument, 0, 'n'},
                                         {"help", no_argument, 0, 'h'},
                                         {0, 0, 0, 0}};
    const char *model = NULL;
    bool add_special = true;
    int c;
    optind = 1;
    while ((c = getopt_long(argc, argv, "", opts, NULL)) != -1) {
        switch (c) {
        case 'm': model = optarg; break;
        case 'n': add_special = false; break;
        case 'h': printf("usage: pdserve tokenize [--model DIR] [--no-special] TEXT\n"); return 0;
        default: return 2;
        }
    }
    if (optind != argc - 1) return pd_cmd_usage_error("tokenize", "expected exactly one TEXT argument");
    if (!model) model = pd_cmd_default_model(argv[0]);
    pd_err err = {0};
    pd_tok *t = pd_tok_load(model, &err);
    if (!t) {
        fprintf(stderr, "pdserve tokenize: %s\n", err.msg);
        return 1;
    }
    pd_tok_ids ids = {0};
    const char *text = argv[optind];
    pd_status st = pd_tok_encode(t, text, strlen(text), add_special, true, &ids);
    if (st) {
        fprintf(stderr, "pdserve tokenize: cannot encode: %s\n", st == PD_ERR_INVALID ? "text is not valid UTF-8" : pd_status_str(st));
    } else {
        printf("[");
        for (int i = 0; i < ids.n; i++) printf("%s%d", i ? ", " : "", ids.ids[i]);
        printf("]\n");
    }
    pd_tok_ids_free(&ids);
    pd_tok_free(t);
    return st ? 1 : 0;
}

// ---- model-info --------------------------------------------------------------------------------
int pd_cmd_model_info(int argc, char **argv) {
    static const struct option opts[] = {{"model", required_argument, 0, 'm'}, {"help", no_argument, 0, 'h'}, {0, 0, 0, 0}};
    const char *model = NULL;
    int c;
    optind = 1;
    while ((c = getopt_long(argc, argv, "", opts, NULL)) != -1) {
        if (c == 'm') model = optarg;
        else if (c == 'h') {
            printf("usage: pdserve model-info [--model DIR]\n");
            return 0;
        } else
            return 2;
    }
    if (!model) model = pd_cmd_default_model(argv[0]);
    pd_model_config cfg;
    pd_err err = {0};
    if (pd_model_config_load(model, &cfg, &err)) {
        fprintf(stderr, "pdserve model-info: %s\n", err.msg);
        return 1;
    }
    json_t *o = json_pack("{s:s,s:s,s:I,s:s,s:i,s:i,s:i,s:i,s:i,s:i,s:i,s:i,s:f,s:s,s:b,s:b,s:I,s:I}", "model", model,
                          "architecture", cfg.arch_name, "parameters", (json_int_t)pd_model_config_n_params(&cfg), "dtype",
                          pd_dtype_name(cfg.torch_dtype), "vocab_size", cfg.vocab_size, "hidden_size", cfg.hidden_size,
                          "intermediate_size", cfg.intermediate_size, "layers", cfg.n_layers, "attention_heads", cfg.n_heads,
                          "kv_heads", cfg.n_kv_heads, "head_dim", cfg.head_dim, "max_position_embeddings",
                          cfg.max_position_embeddings, "rope_theta", cfg.rope_theta, "rope_scaling",
                          cfg.rope_type == PD_ROPE_LLAMA3 ? "llama3" : cfg.rope_type == PD_ROPE_LINEAR ? "linear" : "none",
                          "tie_word_embeddings", cfg.tie_word_embeddings, "attention_bias", cfg.attention_bias,
                          "kv_bytes_per_token_bf16", (json_int_t)pd_model_config_kv_bytes_per_token(&cfg, 2),
                          "kv_bytes_per_token_f32", (json_int_t)pd_model_config_kv_bytes_per_token(&cfg, 4));
    char *s = json_dumps(o, JSON_INDENT(2) | JSON_PRESERVE_ORDER);
    printf("%s\n", s);
    free(s);
    json_decref(o);
    return 0;
}

// ---- generate ----------------------------------------------------------------------------------
typedef struct gen_cli {
    pd_tok *tok;
    pd_tok_stream *stream;
    pd_tok_stop *stop;
    bool print;  // stream text to stdout as it comes
    pd_buf text;  // accumulated visible text
    json_t *logprobs;  // array, or NULL
} gen_cli;

static void emit(gen_cli *g, const char *s, size_t n) {
    if (!n) return;
    if (pd_buf_append(&g->text, s, n) != PD_OK) return;
    if (g->print) {
        fwrite(s, 1, n, stdout);
        fflush(stdout);
    }
}

static bool on_token(void *ud, int seq, const pd_sample_result *r) {
    gen_cli *g = ud;
    if (g->logprobs) {
        json_t *top = json_array();
        for (int i = 0; i < r->n_top; i++)
            json_array_append_new(top, json_pack("{s:i,s:f}", "id", r->top_ids[i], "logprob", (double)r->top_logprobs[i]));
        json_array_append_new(g->logprobs, json_pack("{s:i,s:f,s:o}", "id", r->token, "logprob", (double)r->logprob, "top", top));
    }
    const char *t;
    size_t n;
    if (pd_tok_stream_feed(g->stream, r->token, &t, &n)) return true;
    if (!g->stop) {
        emit(g, t, n);
        return false;
    }
    pd_tok_stop_result sr;
    pd_tok_stop_feed(g->stop, t, n, &sr);
    emit(g, sr.text, sr.len);
    return sr.is_stopped;
}

static int parse_ids(const char *s, pd_tok_ids *out) {
    while (*s) {
        char *end;
        long v = strtol(s, &end, 10);
        if (end == s || v < 0 || v > 1 << 30) return -1;
        pd_tok_ids_push(out, (int32_t)v);
        s = end;
        while (*s == ',' || *s == ' ') s++;
    }
    return out->n > 0 ? 0 : -1;
}

// One forward over the whole prompt; writes the last position's logits (for comparisons with an
// outside reference, e.g. transformers on the same weights).
static pd_status write_logits(pd_model *m, const pd_tok_ids *ids, const char *path, pd_err *err) {
    int n = ids->n, V = pd_model_get_config(m)->vocab_size, bs = 16, nb = (n + bs - 1) / bs;
    pd_model_cache *kc = pd_model_cache_new(m, nb, bs, err);
    if (!kc) return err->status;
    int32_t qi[2] = {0, n}, kv[1] = {n}, bti[2] = {0, nb}, row[1] = {n - 1};
    int32_t *bt = pd_malloc(sizeof(int32_t) * (size_t)nb);
    float *lg = pd_malloc(sizeof(float) * (size_t)V);
    pd_status st = bt && lg ? PD_OK : PD_ERR_NOMEM;
    if (st == PD_OK) {
        for (int i = 0; i < nb; i++) bt[i] = i;
        pd_batch b = {.n_tokens = n, .tokens = ids->ids, .n_seqs = 1, .q_indptr = qi, .kv_lens = kv, .bt_indptr = bti,
                      .bt_indices = bt, .n_logits = 1, .logit_rows = row};
        st = pd_model_forward(m, kc, &b, lg);
    }
    FILE *f = st == PD_OK ? fopen(path, "wb") : NULL;
    if (st == PD_OK && (!f || fwrite(lg, sizeof(float), (size_t)V, f) != (size_t)V)) st = PD_ERR_IO;
    if (f) fclose(f);
    if (st) pd_err_set(err, st, "cannot write logits to %s: %s", path, pd_status_str(st));
    pd_free(bt);
    pd_free(lg);
    pd_model_cache_free(kc);
    return st;
}

static void gen_usage(void) {
    printf("usage: pdserve generate [--model DIR] (--prompt TEXT | --prompt-ids 1,2,3) [options]\n"
           "  --max-tokens N          tokens to generate (default 64)\n"
           "  --temperature T         0 = greedy (default 1.0)\n"
           "  --top-p P  --top-k K  --min-p P\n"
           "  --presence-penalty X  --frequency-penalty X  --repetition-penalty X\n"
           "  --seed S                reproducible sampling\n"
           "  --stop STR              stop string (repeatable)\n"
           "  --logprobs N            per-token logprobs with N alternatives (json output)\n"
           "  --ignore-eos            do not stop at the model's EOS tokens\n"
           "  --no-bos                do not add the tokenizer's special tokens to --prompt\n"
           "  --device cpu|cuda|auto  (default auto)\n"
           "  --load-format dummy     random weights from config.json (benchmarking)\n"
           "  --output text|json      (default text)\n"
           "  --logits-out FILE       also write the prompt's last-position logits (f32, little-endian)\n"
           "  --kv-cache-dtype auto|fp8  KV cache format (fp8: E4M3 with per-head scales)\n");
}

int pd_cmd_generate(int argc, char **argv) {
    enum { O_MODEL = 1, O_PROMPT, O_IDS, O_MAX, O_TEMP, O_TOPP, O_TOPK, O_MINP, O_PP, O_FP, O_RP, O_SEED, O_STOP, O_LP, O_EOS, O_BOS,
           O_DEV, O_OUT, O_LF, O_LOGITS, O_KVDT, O_HELP };
    static const struct option opts[] = {
        {"model", required_argument, 0, O_MODEL}, {"prompt", required_argument, 0, O_PROMPT},
        {"prompt-ids", required_argument, 0, O_IDS}, {"max-tokens", required_argument, 0, O_MAX},
        {"temperature", required_argument, 0, O_TEMP}, {"top-p", required_argument, 0, O_TOPP},
        {"top-k", required_argument, 0, O_TOPK}, {"min-p", required_argument, 0, O_MINP},
        {"presence-penalty", required_argument, 0, O_PP}, {"frequency-penalty", required_argument, 0, O_FP},
        {"repetition-penalty", required_argument, 0, O_RP}, {"seed", required_argument, 0, O_SEED},
        {"stop", required_argument, 0, O_STOP}, {"logprobs", required_argument, 0, O_LP},
        {"ignore-eos", no_argument, 0, O_EOS}, {"no-bos", no_argument, 0, O_BOS},
        {"device", required_argument, 0, O_DEV}, {"output", required_argument, 0, O_OUT},
        {"load-format", required_argument, 0, O_LF}, {"logits-out", required_argument, 0, O_LOGITS},
        {"kv-cache-dtype", required_argument, 0, O_KVDT},
        {"help", no_argument, 0, O_HELP}, {0, 0, 0, 0}};
    const char *model = NULL, *prompt = NULL, *prompt_ids = NULL, *device = "auto", *output = "text", *logits_out = NULL;
    const char *stops[16];
    int n_stops = 0;
    long max_tokens = 64;
    bool ignore_eos = false, add_bos = true, dummy = false;
    pd_kv_dtype kv_dtype = PD_KV_ACT;
    pd_sampling_params sp = pd_sampling_params_default();
    int c;
    long lv;
    double dv;
    optind = 1;
    while ((c = getopt_long(argc, argv, "", opts, NULL)) != -1) {
#define NEED_INT(v) do { if (!pd_cmd_parse_int(optarg, &lv)) return pd_cmd_usage_error("generate", "bad integer '%s'", optarg); v; } while (0)
#define NEED_FLT(v) do { if (!pd_cmd_parse_float(optarg, &dv)) return pd_cmd_usage_error("generate", "bad number '%s'", optarg); v; } while (0)
        switch (c) {
        case O_MODEL: model = optarg; break;
        case O_PROMPT: prompt = optarg; break;
        case O_IDS: prompt_ids = optarg; break;
        case O_MAX: NEED_INT(max_tokens = lv); break;
        case O_TEMP: NEED_FLT(sp.temperature = (float)dv); break;
        case O_TOPP: NEED_FLT(sp.top_p = (float)dv); break;
        case O_TOPK: NEED_INT(sp.top_k = (int)lv); break;
        case O_MINP: NEED_FLT(sp.min_p = (float)dv); break;
        case O_PP: NEED_FLT(sp.presence_penalty = (float)dv); break;
        case O_FP: NEED_FLT(sp.frequency_penalty = (float)dv); break;
        case O_RP: NEED_FLT(sp.repetition_penalty = (float)dv); break;
        case O_SEED: NEED_INT((sp.seed = (uint64_t)lv, sp.has_seed = true)); break;
        case O_STOP:
            if (n_stops == 16) return pd_cmd_usage_error("generate", "at most 16 --stop strings");
            stops[n_stops++] = optarg;
            break;
        case O_LP: NEED_INT(sp.n_logprobs = (int)lv); break;
        case O_EOS: ignore_eos = true; break;
        case O_BOS: add_bos = false; break;
        case O_DEV: device = optarg; break;
        case O_OUT: output = optarg; break;
        case O_LF:
            if (strcmp(optarg, "dummy") && strcmp(optarg, "safetensors") && strcmp(optarg, "auto"))
                return pd_cmd_usage_error("generate", "--load-format must be auto, safetensors or dummy");
            dummy = !strcmp(optarg, "dummy");
            break;
        case O_LOGITS: logits_out = optarg; break;
        case O_KVDT:
            if (!pd_kv_dtype_parse(optarg, &kv_dtype))
                return pd_cmd_usage_error("generate", "--kv-cache-dtype is auto or fp8, not '%s'", optarg);
            break;
        case O_HELP: gen_usage(); return 0;
        default: return 2;
        }
#undef NEED_INT
#undef NEED_FLT
    }
    if (optind != argc) return pd_cmd_usage_error("generate", "unexpected argument '%s'", argv[optind]);
    if (!prompt == !prompt_ids) return pd_cmd_usage_error("generate", "give exactly one of --prompt and --prompt-ids");
    if (strcmp(output, "text") && strcmp(output, "json")) return pd_cmd_usage_error("generate", "--output must be text or json");
    if (max_tokens < 0) return pd_cmd_usage_error("generate", "--max-tokens must be >= 0");
    pd_err err = {0};
    if (pd_sampling_params_validate(&sp, &err)) return pd_cmd_usage_error("generate", "%s", err.msg);
    if (!model) model = pd_cmd_default_model(argv[0]);

    int rc = 1;
    pd_backend *be = NULL;
    pd_model *m = NULL;
    gen_cli g = {0};
    pd_tok_ids ids = {0};
    int32_t *out_ids = NULL;
    g.tok = pd_tok_load(model, &err);
    if (!g.tok) goto fail;
    if (prompt) {
        if (pd_tok_encode(g.tok, prompt, strlen(prompt), add_bos, true, &ids)) {
            pd_err_set(&err, PD_ERR_INVALID, "cannot encode the prompt (invalid UTF-8?)");
            goto fail;
        }
    } else if (parse_ids(prompt_ids, &ids)) {
        pd_err_set(&err, PD_ERR_INVALID, "--prompt-ids must be a comma-separated list of token ids");
        goto fail;
    }
    be = pd_backend_new(device, 0, &err);
    if (!be) goto fail;
    pd_model_params mp = pd_model_params_default();
    mp.dir = model;
    mp.backend = be;
    mp.dummy = dummy;
    mp.kv_dtype = kv_dtype;
    mp.progress = progress;
    m = pd_model_load(&mp, &err);
    if (!m) goto fail;
    if (logits_out && write_logits(m, &ids, logits_out, &err)) goto fail;
    g.stream = pd_tok_stream_new(g.tok, true);
    if (n_stops && !(g.stop = pd_tok_stop_new(stops, n_stops, false, &err))) goto fail;
    g.print = !strcmp(output, "text");
    if (!strcmp(output, "json") && sp.n_logprobs >= 0) g.logprobs = json_array();
    out_ids = pd_malloc(sizeof(int32_t) * (size_t)(max_tokens + 1));
    pd_gen_seq s = {.prompt = ids.ids, .n_prompt = ids.n, .max_tokens = (int)max_tokens, .ignore_eos = ignore_eos,
                    .sampling = sp, .out_ids = out_ids};
    pd_gen_params gp = pd_gen_params_default();
    gp.on_token = on_token;
    gp.ud = &g;
    int64_t t0 = pd_time_us();
    if (pd_generate(m, &s, 1, &gp, &err)) goto fail;
    int64_t t1 = pd_time_us();
    const char *t;
    size_t n;
    pd_tok_stream_finish(g.stream, &t, &n);
    if (g.stop) {
        pd_tok_stop_result sr;
        pd_tok_stop_feed(g.stop, t, n, &sr);  // ignored by the matcher after a stop
        emit(&g, sr.text, sr.len);
        pd_tok_stop_finish(g.stop, &sr);
        emit(&g, sr.text, sr.len);
    } else {
        emit(&g, t, n);
    }
    if (g.print) {
        printf("\n");
    } else {
        json_t *pi = json_array(), *oi = json_array();
        for (int i = 0; i < ids.n; i++) json_array_append_new(pi, json_integer(ids.ids[i]));
        for (int i = 0; i < s.n_out; i++) json_array_append_new(oi, json_integer(out_ids[i]));
        json_t *o = json_pack("{s:o,s:o,s:s,s:s,s:f}", "prompt_ids", pi, "output_ids", oi, "text", g.text.p ? g.text.p : "",
                              "finish_reason", s.finish == PD_GEN_FINISH_STOP ? "stop" : "length", "seconds", (double)(t1 - t0) / 1e6);
        if (g.logprobs) json_object_set(o, "logprobs", g.logprobs);
        char *js = json_dumps(o, JSON_PRESERVE_ORDER);
        printf("%s\n", js);
        free(js);
        json_decref(o);
    }
    rc = 0;
fail:
    if (rc) fprintf(stderr, "pdserve generate: %s\n", err.msg[0] ? err.msg : "failed");
    json_decref(g.logprobs);
    pd_buf_free(&g.text);
    pd_free(out_ids);
    pd_tok_ids_free(&ids);
    pd_tok_stop_free(g.stop);
    pd_tok_stream_free(g.stream);
    pd_tok_free(g.tok);
    pd_model_free(m);
    pd_backend_free(be);
    return rc;
}
