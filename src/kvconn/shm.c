// shm.c — the shm KV transport (same host, CPU pools): the decode pool is an anonymous memfd,
// handed to the prefill worker with SCM_RIGHTS over the authenticated unix-socket connection
// (xfer); the prefill worker maps exactly the size it checked and copies the request's rows
// straight into the destination blocks, layer by layer, checking its connection before each.
#include "kvconn/kvconn_impl.h"

static pd_status shm_attach(pd_kvconn *c, kvc_peer *p, const pd_kvw_hello *h, int fd, pd_err *err) {
    if (fd < 0) return pd_err_set(err, PD_ERR_PROTO, "no pool descriptor came with the HELLO");
    return kvc_direct_attach(c, p, h, fd, "memfd", err);
}

static pd_status shm_save_rest(pd_kvconn *c, pd_kvconn_save *s) {
    return kvc_direct_write(c, s, s->n_layers_saved, c->p.cache.n_layers);
}

const kvc_transport kvc_shm = {
    .id = PD_KVW_TRANSPORT_SHM,
    .name = "shm",
    .export_pool = kvc_direct_export,
    .attach = shm_attach,
    .detach = kvc_direct_detach,
    .save_rest = shm_save_rest,
};
