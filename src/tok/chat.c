// chat.c — chat templates over the Jinja engine: finding a model's template and special tokens on
// disk, and building the render context exactly as transformers' apply_chat_template does
// (messages, tools, documents, add_generation_prompt, special tokens, then the caller's kwargs).
#include <string.h>

#include "tok/chat.h"

struct pd_chat_template {
    pd_jinja_tmpl *tmpl;  // owned
    char *bos;            // owned
    char *eos;            // owned
};

pd_chat_template *pd_chat_template_new(const char *src, size_t len, const char *bos_token,
                                       const char *eos_token, pd_err *err) {
    pd_chat_template *ct = pd_calloc(1, sizeof *ct);
    if (!ct) goto nomem;
    ct->bos = pd_strdup(bos_token ? bos_token : "");
    ct->eos = pd_strdup(eos_token ? eos_token : "");
    if (!ct->bos || !ct->eos) goto nomem;
    ct->tmpl = pd_jinja_parse(src, len, err);
    if (!ct->tmpl) {
        pd_chat_template_free(ct);
        return NULL;
    }
    return ct;
nomem:
    pd_chat_template_free(ct);
    pd_err_set(err, PD_ERR_NOMEM, "out of memory loading chat template");
    return NULL;
}

void pd_chat_template_free(pd_chat_template *ct) {
    if (!ct) return;
    pd_jinja_free(ct->tmpl);
    pd_free(ct->bos);
    pd_free(ct->eos);
    pd_free(ct);
}

const char *pd_chat_template_bos(const pd_chat_template *ct) { return ct->bos; }
const char *pd_chat_template_eos(const pd_chat_template *ct) { return ct->eos; }
const pd_jinja_tmpl *pd_chat_template_jinja(const pd_chat_template *ct) { return ct->tmpl; }

pd_status pd_chat_template_from_config(json_t *config, const char *name, const char **out,
                                       pd_err *err) {
    json_t *t = json_is_object(config) ? json_object_get(config, "chat_template") : NULL;
    if (!t || json_is_null(t)) return pd_err_set(err, PD_ERR_NOTFOUND, "no chat_template");
    if (json_is_string(t)) {
        *out = json_string_value(t);
        return PD_OK;
    }
    if (!json_is_array(t)) return pd_err_set(err, PD_ERR_INVALID, "chat_template is neither a string nor a list");
    size_t i;
    json_t *e;
    json_array_foreach(t, i, e) {
        json_t *n = json_object_get(e, "name"), *src = json_object_get(e, "template");
        if (json_is_string(n) && json_is_string(src) && !strcmp(json_string_value(n), name ? name : "default")) {
            *out = json_string_value(src);
            return PD_OK;
        }
    }
    return pd_err_set(err, PD_ERR_NOTFOUND, "no chat_template named '%s'", name ? name : "default");
}

// Parses dir/name as JSON. NULL + PD_ERR_NOTFOUND if the file does not exist.
static json_t *load_json(const char *dir, const char *name, pd_err *err) {
    char *path = pd_path_join(dir, name), *text = NULL;
    size_t len = 0;
    if (!path) {
        pd_err_set(err, PD_ERR_NOMEM, "out of memory");
        return NULL;
    }
    json_t *j = NULL;
    if (pd_file_read_all(path, &text, &len, err) == PD_OK) {
        json_error_t jerr;
        j = json_loadb(text, len, 0, &jerr);
        if (!j) pd_err_set(err, PD_ERR_INVALID, "%s:%d: %s", path, jerr.line, jerr.text);
    }
    pd_free(text);
    pd_free(path);
    return j;
}

// A special token from tokenizer_config.json / special_tokens_map.json: a string or {"content"}.
static const char *token_string(json_t *cfg, const char *key) {
    json_t *t = json_object_get(cfg, key);
    if (json_is_object(t)) t = json_object_get(t, "content");
    return json_is_string(t) ? json_string_value(t) : NULL;
}

pd_chat_template *pd_chat_template_load(const char *model_dir, pd_err *err) {
    pd_err local = {0};
    json_t *cfg = load_json(model_dir, "tokenizer_config.json", &local);
    if (!cfg && local.status != PD_ERR_NOTFOUND) {
        if (err) *err = local;
        return NULL;
    }
    json_t *stm = load_json(model_dir, "special_tokens_map.json", &local);
    const char *bos = cfg ? token_string(cfg, "bos_token") : NULL;
    const char *eos = cfg ? token_string(cfg, "eos_token") : NULL;
    if (!bos && stm) bos = token_string(stm, "bos_token");
    if (!eos && stm) eos = token_string(stm, "eos_token");

    pd_chat_template *ct = NULL;
    char *path = pd_path_join(model_dir, "chat_template.jinja"), *text = NULL;
    size_t len = 0;
    pd_status st = path ? pd_file_read_all(path, &text, &len, &local) : PD_ERR_NOMEM;
    if (st == PD_OK) {
        ct = pd_chat_template_new(text, len, bos, eos, err);
    } else if (st != PD_ERR_NOTFOUND) {
        pd_err_set(err, st, "%s", st == PD_ERR_NOMEM ? "out of memory" : local.msg);
    } else {
        json_t *ctj = load_json(model_dir, "chat_template.json", &local);
        const char *src = NULL;
        if (ctj && pd_chat_template_from_config(ctj, NULL, &src, err) == PD_OK)
            ct = pd_chat_template_new(src, strlen(src), bos, eos, err);
        else if (!ctj && local.status != PD_ERR_NOTFOUND && err)
            *err = local;
        else if (!ctj && cfg && pd_chat_template_from_config(cfg, NULL, &src, err) == PD_OK)
            ct = pd_chat_template_new(src, strlen(src), bos, eos, err);
        else if (!ctj && !cfg)
            pd_err_set(err, PD_ERR_NOTFOUND, "%s has no chat template", model_dir);
        json_decref(ctj);
    }
    pd_free(text);
    pd_free(path);
    json_decref(stm);
    json_decref(cfg);
    return ct;
}

pd_status pd_chat_template_apply(const pd_chat_template *ct, json_t *messages,
                                 bool add_generation_prompt, json_t *extra_kwargs,
                                 const pd_jinja_limits *limits, char **out, size_t *out_len,
                                 pd_err *err) {
    *out = NULL;
    if (!json_is_array(messages)) return pd_err_set(err, PD_ERR_INVALID, "messages must be an array");
    if (extra_kwargs && !json_is_object(extra_kwargs))
        return pd_err_set(err, PD_ERR_INVALID, "chat template kwargs must be an object");
    json_t *ctx = json_object();
    if (!ctx || json_object_set(ctx, "messages", messages) ||
        json_object_set_new(ctx, "tools", json_null()) ||
        json_object_set_new(ctx, "documents", json_null()) ||
        json_object_set_new(ctx, "add_generation_prompt", json_boolean(add_generation_prompt)) ||
        json_object_set_new(ctx, "bos_token", json_string_nocheck(ct->bos)) ||
        json_object_set_new(ctx, "eos_token", json_string_nocheck(ct->eos)) ||
        (extra_kwargs && json_object_update(ctx, extra_kwargs))) {
        json_decref(ctx);
        return pd_err_set(err, PD_ERR_NOMEM, "out of memory building the chat template context");
    }
    pd_status st = pd_jinja_render_ex(ct->tmpl, ctx, limits, out, out_len, err);
    json_decref(ctx);
    return st;
}

pd_status pd_chat_apply(const char *template_src, json_t *messages, bool add_generation_prompt,
                        const char *bos_token, const char *eos_token, json_t *extra_kwargs,
                        char **out, pd_err *err) {
    *out = NULL;
    if (!template_src) return pd_err_set(err, PD_ERR_INVALID, "no chat template");
    pd_err local = {0};
    pd_chat_template *ct = pd_chat_template_new(template_src, strlen(template_src), bos_token,
                                                eos_token, &local);
    if (!ct) {
        if (err) *err = local;
        return local.status;
    }
    pd_status st = pd_chat_template_apply(ct, messages, add_generation_prompt, extra_kwargs, NULL,
                                          out, NULL, err);
    pd_chat_template_free(ct);
    return st;
}
