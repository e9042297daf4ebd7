// tok_nfc.c — Unicode NFC for the NFC normalizer (Qwen2 and others), UAX #15, by libutf8proc:
// utf8proc_decompose (full canonical decomposition + canonical reordering) into a code-point
// buffer of ours, utf8proc_normalize_utf32 (canonical composition) in place, then UTF-8 out.
// The buffer comes from pd_malloc, so the fault tier covers this path; utf8proc_map (which
// mallocs its own result) is not used.
//
// Text made only of code points below U+0300 is already NFC (nothing there decomposes into, or
// composes with, anything below U+0300), so it is copied as is: the common case costs one scan.
// NOTE: the Unicode version is libutf8proc's (utf8proc_unicode_version(); Debian 12: 15.0), as
// recent as or newer than HF's unicode-normalization crate for every character a vocabulary uses.
#include <utf8proc.h>

#include "tok/tok_impl.h"

static const utf8proc_option_t NFC = UTF8PROC_STABLE | UTF8PROC_COMPOSE;

pd_status pd_tok_nfc(const char *s, size_t n, pd_buf *out) {
    const unsigned char *p = (const unsigned char *)s;
    size_t i = 0;
    while (i < n && (p[i] < 0xcc)) i++;  // bytes below 0xCC start code points below U+0300
    if (i == n) return pd_buf_append(out, s, n);
    if (n > (size_t)PTRDIFF_MAX) return PD_ERR_NOMEM;
    // First pass sizes the code-point buffer; the input is valid UTF-8 (checked at the edge), so
    // an error here is a bug or OOM inside utf8proc, reported as invalid input.
    utf8proc_ssize_t need = utf8proc_decompose(p, (utf8proc_ssize_t)n, NULL, 0, NFC);
    if (need < 0) return need == UTF8PROC_ERROR_NOMEM ? PD_ERR_NOMEM : PD_ERR_INVALID;
    utf8proc_int32_t *cps = NULL;
    size_t cap = 0;
    if (PD_ARRAY_RESERVE(cps, cap, (size_t)need + 1) != PD_OK) return PD_ERR_NOMEM;
    pd_status st = PD_OK;
    utf8proc_ssize_t m = utf8proc_decompose(p, (utf8proc_ssize_t)n, cps, need, NFC);
    if (m >= 0 && m <= need) m = utf8proc_normalize_utf32(cps, m, NFC);
    if (m < 0 || m > need) st = PD_ERR_INVALID;
    // Reserve the worst case (4 bytes a code point) once, then encode in place.
    if (st == PD_OK) st = pd_buf_reserve(out, (size_t)m * 4);
    for (utf8proc_ssize_t k = 0; k < m && st == PD_OK; k++)
        out->len += (size_t)utf8proc_encode_char(cps[k], (utf8proc_uint8_t *)out->p + out->len);
    if (st == PD_OK) out->p[out->len] = 0;
    pd_free(cps);
    return st;
}
