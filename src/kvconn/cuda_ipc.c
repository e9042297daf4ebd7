// cuda_ipc.c — the cuda-ipc KV transport (same host, GPU pools): the decode pool is exported as a
// CUDA IPC handle (sent only after authentication); the prefill worker opens it (the allocation's
// real size is checked against the announced one) and copies the request's rows device to device
// into the destination blocks, layer by layer, checking its connection before each layer.
#include "kvconn/kvconn_impl.h"

static pd_status ipc_attach(pd_kvconn *c, kvc_peer *p, const pd_kvw_hello *h, int fd, pd_err *err) {
    return kvc_direct_attach(c, p, h, fd, "cuda", err);
}

static pd_status ipc_save_rest(pd_kvconn *c, pd_kvconn_save *s) {
    return kvc_direct_write(c, s, s->n_layers_saved, c->p.cache.n_layers);
}

const kvc_transport kvc_cuda_ipc = {
    .id = PD_KVW_TRANSPORT_CUDA_IPC,
    .name = "cuda-ipc",
    .export_pool = kvc_direct_export,
    .attach = ipc_attach,
    .detach = kvc_direct_detach,
    .save_rest = ipc_save_rest,
};
