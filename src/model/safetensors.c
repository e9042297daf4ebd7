// safetensors.c — see safetensors.h. Layout of a file:
//   [u64 little-endian N][N bytes of JSON header][data]
//   header: {"name": {"dtype": "BF16", "shape": [..], "data_offsets": [begin, end]}, ...,
//            "__metadata__": {...}}   offsets are relative to the start of data.
#include "base/buf.h"
#include "model/safetensors.h"

#include <errno.h>
#include <fcntl.h>
#include <jansson.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#define MAX_FILES 256

struct pd_st {
    pd_st_tensor *tensors;  // owned
    int n;
    size_t cap;
    void *maps[MAX_FILES];  // owned mappings
    size_t map_len[MAX_FILES];
    int n_files;
};

pd_st *pd_st_new_empty(void) { return pd_calloc(1, sizeof(pd_st)); }

void pd_st_free(pd_st *st) {
    if (!st) return;
    for (int i = 0; i < st->n; i++) pd_free(st->tensors[i].name);
    pd_free(st->tensors);
    for (int i = 0; i < st->n_files; i++)
        if (st->maps[i]) munmap(st->maps[i], st->map_len[i]);
    pd_free(st);
}

int pd_st_n_tensors(const pd_st *st) { return st->n; }
const pd_st_tensor *pd_st_get(const pd_st *st, int i) { return &st->tensors[i]; }
const pd_st_tensor *pd_st_find(const pd_st *st, const char *name) {
    for (int i = 0; i < st->n; i++)
        if (!strcmp(st->tensors[i].name, name)) return &st->tensors[i];
    return NULL;
}

int64_t pd_st_numel(const pd_st_tensor *t) {
    int64_t n = 1;
    for (int i = 0; i < t->n_dims; i++) n *= t->shape[i];
    return n;
}

static size_t dtype_size(const char *d, pd_st_dtype *out) {
    static const struct { const char *name; size_t size; pd_st_dtype t; } tab[] = {
        {"F32", 4, PD_ST_F32}, {"F16", 2, PD_ST_F16}, {"BF16", 2, PD_ST_BF16}, {"F64", 8, PD_ST_OTHER},
        {"I64", 8, PD_ST_OTHER}, {"I32", 4, PD_ST_OTHER}, {"I16", 2, PD_ST_OTHER}, {"I8", 1, PD_ST_OTHER},
        {"U8", 1, PD_ST_OTHER}, {"BOOL", 1, PD_ST_OTHER}, {"U16", 2, PD_ST_OTHER}, {"U32", 4, PD_ST_OTHER},
        {"U64", 8, PD_ST_OTHER}, {"F8_E4M3", 1, PD_ST_OTHER}, {"F8_E5M2", 1, PD_ST_OTHER},
    };
    for (size_t i = 0; i < PD_ARRAY_LEN(tab); i++)
        if (!strcmp(tab[i].name, d)) {
            *out = tab[i].t;
            return tab[i].size;
        }
    return 0;
}

static pd_status parse_entry(pd_st *st, const char *name, json_t *e, const uint8_t *data, size_t data_len,
                             int file_idx, const char *what, pd_err *err) {
    if (!json_is_object(e)) return pd_err_set(err, PD_ERR_PROTO, "%s: tensor '%s': entry is not an object", what, name);
    json_t *dt = json_object_get(e, "dtype"), *shape = json_object_get(e, "shape"), *offs = json_object_get(e, "data_offsets");
    if (!json_is_string(dt) || !json_is_array(shape) || !json_is_array(offs) || json_array_size(offs) != 2)
        return pd_err_set(err, PD_ERR_PROTO, "%s: tensor '%s': needs dtype, shape and data_offsets[2]", what, name);
    pd_st_tensor t = {0};
    size_t esz = dtype_size(json_string_value(dt), &t.dtype);
    if (!esz) return pd_err_set(err, PD_ERR_UNSUPPORTED, "%s: tensor '%s': unknown dtype '%s'", what, name, json_string_value(dt));
    snprintf(t.dtype_name, sizeof t.dtype_name, "%s", json_string_value(dt));
    if (json_array_size(shape) > PD_ST_MAX_DIMS)
        return pd_err_set(err, PD_ERR_PROTO, "%s: tensor '%s': too many dimensions", what, name);
    t.n_dims = (int)json_array_size(shape);
    size_t numel = 1;
    for (int i = 0; i < t.n_dims; i++) {
        json_t *d = json_array_get(shape, (size_t)i);
        if (!json_is_integer(d) || json_integer_value(d) < 0)
            return pd_err_set(err, PD_ERR_PROTO, "%s: tensor '%s': bad shape", what, name);
        t.shape[i] = json_integer_value(d);
        if (pd_mul_overflow(numel, (size_t)t.shape[i], &numel))
            return pd_err_set(err, PD_ERR_PROTO, "%s: tensor '%s': shape overflows", what, name);
    }
    size_t n_bytes;
    if (pd_mul_overflow(numel, esz, &n_bytes)) return pd_err_set(err, PD_ERR_PROTO, "%s: tensor '%s': size overflows", what, name);
    json_t *b = json_array_get(offs, 0), *en = json_array_get(offs, 1);
    if (!json_is_integer(b) || !json_is_integer(en) || json_integer_value(b) < 0 || json_integer_value(en) < json_integer_value(b))
        return pd_err_set(err, PD_ERR_PROTO, "%s: tensor '%s': bad data_offsets", what, name);
    size_t begin = (size_t)json_integer_value(b), end = (size_t)json_integer_value(en);
    if (end - begin != n_bytes)
        return pd_err_set(err, PD_ERR_PROTO, "%s: tensor '%s': data_offsets span %zu bytes but dtype and shape need %zu", what,
                          name, end - begin, n_bytes);
    if (end > data_len)
        return pd_err_set(err, PD_ERR_PROTO, "%s: truncated file: tensor '%s' ends at byte %zu of a %zu-byte data section", what,
                          name, end, data_len);
    if (PD_ARRAY_RESERVE(st->tensors, st->cap, (size_t)st->n + 1) != PD_OK)
        return pd_err_set(err, PD_ERR_NOMEM, "out of memory");
    t.name = pd_strdup(name);
    if (!t.name) return pd_err_set(err, PD_ERR_NOMEM, "out of memory");
    t.data = data + begin;
    t.n_bytes = n_bytes;
    t.file_idx = file_idx;
    st->tensors[st->n++] = t;
    return PD_OK;
}

pd_status pd_st_parse(pd_st *st, const uint8_t *buf, size_t len, int file_idx, const char *what, pd_err *err) {
    if (len < 8) return pd_err_set(err, PD_ERR_PROTO, "%s: truncated file (%zu bytes, no header)", what, len);
    uint64_t hlen = 0;
    for (int i = 7; i >= 0; i--) hlen = (hlen << 8) | buf[i];
    if (hlen > len - 8 || hlen > (100u << 20))
        return pd_err_set(err, PD_ERR_PROTO, "%s: truncated file or bad header length %llu (file is %zu bytes)", what,
                          (unsigned long long)hlen, len);
    json_error_t je;
    json_t *root = json_loadb((const char *)buf + 8, (size_t)hlen, 0, &je);
    if (!root) return pd_err_set(err, PD_ERR_PROTO, "%s: bad JSON header: %s", what, je.text);
    pd_status st_ = PD_OK;
    if (!json_is_object(root)) {
        st_ = pd_err_set(err, PD_ERR_PROTO, "%s: header is not a JSON object", what);
    } else {
        const char *key;
        json_t *val;
        const uint8_t *data = buf + 8 + hlen;
        size_t data_len = len - 8 - (size_t)hlen;
        json_object_foreach(root, key, val) {
            if (!strcmp(key, "__metadata__")) continue;
            st_ = parse_entry(st, key, val, data, data_len, file_idx, what, err);
            if (st_) break;
        }
    }
    json_decref(root);
    return st_;
}

static pd_status map_file(pd_st *st, const char *path, pd_err *err) {
    if (st->n_files >= MAX_FILES) return pd_err_set(err, PD_ERR_INVALID, "too many safetensors shards (max %d)", MAX_FILES);
    int fd = open(path, O_RDONLY);
    if (fd < 0) {
        int e = errno;
        return pd_err_set(err, e == ENOENT ? PD_ERR_NOTFOUND : PD_ERR_IO, "%s: %s", path, strerror(e));
    }
    struct stat sb;
    if (fstat(fd, &sb) < 0) {
        close(fd);
        return pd_err_set(err, PD_ERR_IO, "%s: %s", path, strerror(errno));
    }
    size_t len = (size_t)sb.st_size;
    void *m = NULL;
    if (len > 0) {
        m = mmap(NULL, len, PROT_READ, MAP_PRIVATE, fd, 0);
        if (m == MAP_FAILED) {
            close(fd);
            return pd_err_set(err, PD_ERR_IO, "%s: mmap: %s", path, strerror(errno));
        }
    }
    close(fd);
    int idx = st->n_files++;
    st->maps[idx] = m;
    st->map_len[idx] = len;
    return pd_st_parse(st, m, len, idx, path, err);
}

pd_st *pd_st_open_file(const char *path, pd_err *err) {
    pd_st *st = pd_st_new_empty();
    if (!st) {
        pd_err_set(err, PD_ERR_NOMEM, "out of memory");
        return NULL;
    }
    if (map_file(st, path, err)) {
        pd_st_free(st);
        return NULL;
    }
    return st;
}

// Sharded: index.json {"weight_map": {"tensor": "model-00001-of-00004.safetensors", ...}}.
static pd_st *open_index(const char *dir, const char *index_path, pd_err *err) {
    char *text = NULL;
    size_t len = 0;
    if (pd_file_read_all(index_path, &text, &len, err)) return NULL;
    json_error_t je;
    json_t *root = json_loadb(text, len, 0, &je);
    pd_free(text);
    if (!root) {
        pd_err_set(err, PD_ERR_PROTO, "%s: bad JSON: %s", index_path, je.text);
        return NULL;
    }
    pd_st *st = pd_st_new_empty();
    json_t *wm = json_object_get(root, "weight_map");
    const char *files[MAX_FILES];
    int n_files = 0;
    if (!st) {
        pd_err_set(err, PD_ERR_NOMEM, "out of memory");
        goto fail;
    }
    if (!json_is_object(wm)) {
        pd_err_set(err, PD_ERR_PROTO, "%s: missing 'weight_map'", index_path);
        goto fail;
    }
    const char *key;
    json_t *val;
    json_object_foreach(wm, key, val) {
        if (!json_is_string(val) || strchr(json_string_value(val), '/')) {
            pd_err_set(err, PD_ERR_PROTO, "%s: bad shard name for '%s'", index_path, key);
            goto fail;
        }
        const char *f = json_string_value(val);
        int seen = 0;
        for (int i = 0; i < n_files && !seen; i++) seen = !strcmp(files[i], f);
        if (seen) continue;
        if (n_files == MAX_FILES) {
            pd_err_set(err, PD_ERR_INVALID, "%s: too many shards", index_path);
            goto fail;
        }
        files[n_files++] = f;
    }
    for (int i = 0; i < n_files; i++) {
        char *p = pd_path_join(dir, files[i]);
        pd_status s = p ? map_file(st, p, err) : pd_err_set(err, PD_ERR_NOMEM, "out of memory");
        pd_free(p);
        if (s) goto fail;
    }
    // Every tensor the index names must be present in some shard.
    json_object_foreach(wm, key, val) {
        if (!pd_st_find(st, key)) {
            pd_err_set(err, PD_ERR_PROTO, "%s: tensor '%s' is listed in the index but missing from shard %s", index_path, key,
                       json_string_value(val));
            goto fail;
        }
    }
    json_decref(root);
    return st;
fail:
    json_decref(root);
    pd_st_free(st);
    return NULL;
}

pd_st *pd_st_open_dir(const char *dir, pd_err *err) {
    char *idx = pd_path_join(dir, "model.safetensors.index.json");
    char *single = pd_path_join(dir, "model.safetensors");
    pd_st *st = NULL;
    if (!idx || !single) {
        pd_err_set(err, PD_ERR_NOMEM, "out of memory");
    } else if (access(idx, F_OK) == 0) {
        st = open_index(dir, idx, err);
    } else if (access(single, F_OK) == 0) {
        st = pd_st_open_file(single, err);
    } else {
        pd_err_set(err, PD_ERR_NOTFOUND, "%s: no model.safetensors or model.safetensors.index.json", dir);
    }
    pd_free(idx);
    pd_free(single);
    return st;
}

pd_status pd_st_to_f32(const pd_st_tensor *t, float *dst) {
    int64_t n = pd_st_numel(t);
    const uint8_t *s = t->data;
    switch (t->dtype) {
    case PD_ST_F32: memcpy(dst, s, (size_t)n * 4); return PD_OK;
    case PD_ST_BF16:
        for (int64_t i = 0; i < n; i++) {
            uint16_t h;
            memcpy(&h, s + 2 * i, 2);
            dst[i] = pd_bf16_to_f32(h);
        }
        return PD_OK;
    case PD_ST_F16:
        for (int64_t i = 0; i < n; i++) {
            uint16_t h;
            memcpy(&h, s + 2 * i, 2);
            dst[i] = pd_f16_to_f32(h);
        }
        return PD_OK;
    default: return PD_ERR_UNSUPPORTED;
    }
}

pd_status pd_st_to_bf16(const pd_st_tensor *t, uint16_t *dst) {
    int64_t n = pd_st_numel(t);
    const uint8_t *s = t->data;
    switch (t->dtype) {
    case PD_ST_BF16: memcpy(dst, s, (size_t)n * 2); return PD_OK;
    case PD_ST_F32:
        for (int64_t i = 0; i < n; i++) {
            float f;
            memcpy(&f, s + 4 * i, 4);
            dst[i] = pd_f32_to_bf16(f);
        }
        return PD_OK;
    case PD_ST_F16:
        for (int64_t i = 0; i < n; i++) {
            uint16_t h;
            memcpy(&h, s + 2 * i, 2);
            dst[i] = pd_f32_to_bf16(pd_f16_to_f32(h));
        }
        return PD_OK;
    default: return PD_ERR_UNSUPPORTED;
    }
}
