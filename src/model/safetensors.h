// safetensors — memory-mapped reader of Hugging Face `.safetensors` files, single or sharded
// (`model.safetensors.index.json`). The header is untrusted input: its length, every offset and
// every shape product are checked before use, and a tensor's byte range must match its dtype and
// shape exactly. Tensor data is never copied here; pointers stay valid until pd_st_free.
#pragma once
#include "backend/backend.h"
#include "base/base.h"

#ifdef __cplusplus
extern "C" {
#endif

#define PD_ST_MAX_DIMS 8

typedef enum pd_st_dtype {
    PD_ST_F32 = 0, PD_ST_F16, PD_ST_BF16, PD_ST_OTHER,  // OTHER: I64, U8, F64... listed, not loadable
} pd_st_dtype;

typedef struct pd_st_tensor {
    char *name;               // owned
    pd_st_dtype dtype;
    char dtype_name[16];      // as written in the header ("BF16")
    int n_dims;
    int64_t shape[PD_ST_MAX_DIMS];
    const void *data;         // into the mapping; valid until pd_st_free
    size_t n_bytes;
    int file_idx;
} pd_st_tensor;

typedef struct pd_st pd_st;

// Opens dir/model.safetensors.index.json if present (all shards it names), else
// dir/model.safetensors. NULL with err naming the file and the problem.
pd_st *pd_st_open_dir(const char *dir, pd_err *err);
// Opens one file.
pd_st *pd_st_open_file(const char *path, pd_err *err);
void pd_st_free(pd_st *st);

int pd_st_n_tensors(const pd_st *st);
const pd_st_tensor *pd_st_get(const pd_st *st, int i);
// NULL if absent.
const pd_st_tensor *pd_st_find(const pd_st *st, const char *name);

// Parses a header from memory: buf holds the whole file (8-byte length + JSON + data).
// Appends tensors to st with data pointers into buf. Exposed for the fuzzer and tests.
pd_status pd_st_parse(pd_st *st, const uint8_t *buf, size_t len, int file_idx, const char *what, pd_err *err);
pd_st *pd_st_new_empty(void);

// Element count of a tensor's shape (1 for a scalar).
int64_t pd_st_numel(const pd_st_tensor *t);
// Converts a tensor's elements to f32 / bf16 into dst (n = numel). Returns PD_ERR_UNSUPPORTED for OTHER.
pd_status pd_st_to_f32(const pd_st_tensor *t, float *dst);
pd_status pd_st_to_bf16(const pd_st_tensor *t, uint16_t *dst);

#ifdef __cplusplus
}
#endif
