// test_base_buf.c — base/buf: pd_buf against a reference byte array under random appends,
// printf (short and long), truncation and take; pd_array_reserve growth; size overflow refused
// without a crash; every allocation failure leaves the old contents intact.
#include "test.h"

#include "base/buf.h"

PD_TEST(buf_random_against_reference) {
    static char ref[1 << 20];
    size_t n = 0;
    pd_buf b = {0};
    pd_rng rng;
    pd_rng_seed(&rng, 42);
    for (int op = 0; op < 20000; op++) {
        char tmp[700];
        switch (pd_rng_next(&rng) % 5) {
        case 0: {  // append raw bytes, NULs included
            size_t k = pd_rng_next(&rng) % sizeof tmp;
            for (size_t i = 0; i < k; i++) tmp[i] = (char)pd_rng_next(&rng);
            if (n + k >= sizeof ref) break;
            PD_REQUIRE(pd_buf_append(&b, tmp, k) == PD_OK);
            memcpy(ref + n, tmp, k);
            n += k;
            break;
        }
        case 1: {  // printf, sometimes longer than the internal 256-byte fast path
            int w = (int)(pd_rng_next(&rng) % 600);
            int len = snprintf(tmp, sizeof tmp, "%*d|%s", w, op, "x");
            if (n + (size_t)len >= sizeof ref) break;
            PD_REQUIRE(pd_buf_printf(&b, "%*d|%s", w, op, "x") == PD_OK);
            memcpy(ref + n, tmp, (size_t)len);
            n += (size_t)len;
            break;
        }
        case 2:
            if (n + 1 >= sizeof ref) break;
            PD_REQUIRE(pd_buf_putc(&b, 'q') == PD_OK);
            ref[n++] = 'q';
            break;
        case 3:
            if (pd_rng_next(&rng) % 8 == 0) {
                size_t k = n ? pd_rng_next(&rng) % (n + 1) : 0;
                pd_buf_truncate(&b, k);
                n = k;
            }
            break;
        default:
            if (pd_rng_next(&rng) % 50 == 0) {
                pd_buf_clear(&b);
                n = 0;
            }
        }
        PD_CHECK_EQ(b.len, n);
        if (b.p) {
            PD_CHECK(b.cap >= b.len + 1);
            PD_CHECK(b.p[b.len] == 0);
            PD_CHECK(memcmp(b.p, ref, n) == 0);
        }
    }
    char *t = pd_buf_take(&b);
    PD_CHECK(t && memcmp(t, ref, n) == 0 && t[n] == 0);
    PD_CHECK(b.p == NULL && b.len == 0 && b.cap == 0);
    pd_free(t);
    t = pd_buf_take(&b);  // empty: an allocated ""
    PD_CHECK_STR(t, "");
    pd_free(t);
    pd_buf_free(&b);
}

PD_TEST(buf_growth_is_geometric) {
    pd_buf b = {0};
    int n_grow = 0;
    size_t cap = 0;
    for (int i = 0; i < 100000; i++) {
        PD_REQUIRE(pd_buf_putc(&b, 'a') == PD_OK);
        if (b.cap != cap) n_grow++, cap = b.cap;
    }
    PD_CHECK(n_grow <= 20);
    PD_CHECK_EQ(strlen(b.p), 100000);
    pd_buf_free(&b);
}

PD_TEST(buf_overflow_and_oom) {
    pd_buf b = {0};
    PD_REQUIRE(pd_buf_append_str(&b, "keep") == PD_OK);
    PD_CHECK(pd_buf_reserve(&b, SIZE_MAX) == PD_ERR_NOMEM);      // len + extra + 1 overflows
    PD_CHECK(pd_buf_reserve(&b, SIZE_MAX - 8) == PD_ERR_NOMEM);  // too big to allocate
    PD_CHECK_STR(b.p, "keep");
    char big[300];
    memset(big, 'z', sizeof big);
    for (long cd = 0; cd < 4; cd++) {
        pd_mem_fault_set(0, false);
        pd_status st = pd_buf_append(&b, big, sizeof big);  // needs growth: the allocation fails
        PD_CHECK(st == PD_ERR_NOMEM);
        PD_CHECK_EQ(pd_mem_fault_n_failed(), 1);
        pd_mem_fault_set(-1, false);
        PD_CHECK_STR(b.p, "keep");
        PD_CHECK_EQ(b.len, 4);
        pd_mem_fault_set(0, false);
        PD_CHECK(pd_buf_printf(&b, "%0400d", 1) == PD_ERR_NOMEM);
        pd_mem_fault_set(-1, false);
        PD_CHECK_STR(b.p, "keep");
    }
    pd_buf_free(&b);
    pd_buf e = {0};
    pd_mem_fault_set(0, false);
    PD_CHECK(pd_buf_take(&e) == NULL);  // "" could not be allocated
    pd_mem_fault_set(-1, false);
}

PD_TEST(array_reserve) {
    int32_t *a = NULL;
    size_t cap = 0;
    for (int32_t i = 0; i < 5000; i++) {
        PD_REQUIRE(PD_ARRAY_RESERVE(a, cap, (size_t)i + 1) == PD_OK);
        PD_CHECK(cap >= (size_t)i + 1);
        a[i] = i * 3;
    }
    for (int32_t i = 0; i < 5000; i++) PD_CHECK_EQ(a[i], i * 3);
    size_t old = cap;
    int32_t *old_p = a;
    PD_CHECK(PD_ARRAY_RESERVE(a, cap, SIZE_MAX / 2) == PD_ERR_NOMEM);  // elem * n overflows
    PD_CHECK(a == old_p && cap == old);
    pd_mem_fault_set(0, false);
    PD_CHECK(PD_ARRAY_RESERVE(a, cap, cap + 1) == PD_ERR_NOMEM);
    pd_mem_fault_set(-1, false);
    PD_CHECK(a == old_p && cap == old);
    for (int32_t i = 0; i < 5000; i++) PD_CHECK_EQ(a[i], i * 3);
    PD_CHECK(PD_ARRAY_RESERVE(a, cap, 3) == PD_OK);  // already room: nothing changes
    PD_CHECK(a == old_p);
    pd_free(a);
}
