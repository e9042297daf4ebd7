// nccl.h — the CUDA backend's device messaging (pd_comm_*, backend.h) over NCCL, loaded at run
// time. Only cuda.c includes this (it puts these functions in the backend's vtable).
#pragma once
#include "backend/cuda/cuda_impl.h"

pd_status pd_cuda_comm_id_new(pd_backend *b, pd_comm_id *out, pd_err *err);
void *pd_cuda_comm_new(pd_backend *b, const pd_comm_id *id, int n_ranks, int rank, int timeout_ms, pd_err *err);
void pd_cuda_comm_free(pd_backend *b, void *c);
pd_status pd_cuda_comm_post(pd_backend *b, void *c, void *buf, size_t n, int peer, int op, pd_err *err);
void pd_cuda_comm_kv_copy(pd_backend *b, void *c, const pd_kv_copy_params *p);
pd_status pd_cuda_comm_wait(pd_backend *b, void *c, int timeout_ms, pd_err *err);
