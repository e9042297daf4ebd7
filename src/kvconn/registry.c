// registry.c — the KV transports. A new transport: one file defining a kvc_transport, one entry
// here (and its wire id in wire/kv.h).
#include "kvconn/kvconn_impl.h"

static const kvc_transport *const TRANSPORTS[] = {&kvc_tcp, &kvc_shm, &kvc_cuda_ipc, &kvc_nccl, &kvc_ucx};

const kvc_transport *kvc_transport_find(pd_kvw_transport id) {
    for (size_t i = 0; i < PD_ARRAY_LEN(TRANSPORTS); i++)
        if (TRANSPORTS[i]->id == id) return TRANSPORTS[i];
    return NULL;
}
