// shm.c — the shm KV transport (same host, CPU pools): the decode pool is an anonymous memfd,
// handed to the prefill worker with SCM_RIGHTS over the authenticated unix-socket connection
// (xfer); the prefill worker maps exactly the size it checked and copies the request's rows
// straight into the destination blocks, layer by layer, checking its connection before each.
#include "kvconn/kvconn_impl.h"

static pd_status shm_attach(pd_kvconn *c, kvc_peer *p, const pd_kvw_hello *h, int fd, pd_err *err) {
    if (fd < 0) return pd_err_set(err, PD_ERR_PROTO, "no pool descriptor came with the HELLO");
    return kvc_direct_attach(c, p, h, fd, "memfd", err);
}

const kvc_transport kvc_shm = {
    .id = PD_KVW_TRANSPORT_SHM,
    .name = "shm",
    .export_pool = kvc_direct_export,
    .attach = shm_attach,
    .detach = kvc_direct_detach,
    .is_layerwise = true,
    .save_layer = kvc_direct_save_layer,
    .save_rest = kvc_direct_save_rest,
};
