// registry.c — the one file that knows which backends are compiled in (PD_USE_CUDA is defined
// for this file alone by the Makefile, as ggml does for its registry target).
#include <string.h>

#include "backend/backend_impl.h"

bool pd_backend_has_cuda(void) {
#ifdef PD_USE_CUDA
    return pd_backend_cuda_available();
#else
    return false;
#endif
}

pd_backend *pd_backend_new(const char *name, int device, pd_err *err) {
    if (!name || !strcmp(name, "auto")) name = pd_backend_has_cuda() ? "cuda" : "cpu";
    if (!strcmp(name, "cpu")) {
        pd_backend *b = pd_backend_cpu_new(0);
        if (!b) pd_err_set(err, PD_ERR_NOMEM, "out of memory creating the CPU backend");
        return b;
    }
    if (!strcmp(name, "cuda")) {
#ifdef PD_USE_CUDA
        return pd_backend_cuda_new(device, err);
#else
        (void)device;
        pd_err_set(err, PD_ERR_UNSUPPORTED, "this pdserve was built without CUDA (rebuild with make CUDA=1)");
        return NULL;
#endif
    }
    pd_err_set(err, PD_ERR_INVALID, "unknown device '%s' (expected cpu, cuda or auto)", name);
    return NULL;
}
