#include "mp_read.h"

#include <errno.h>
#include <string.h>

static uint64_t be(const uint8_t *p, unsigned n)
{
        uint64_t v = 0;
        for (unsigned i = 0; i < n; i++)
                v = (v << 8) | p[i];
        return v;
}

/* Take n bytes, or fail. */
static int take(struct kvf_mp *m, uint64_t n, const uint8_t **out)
{
        if (n > kvf_mp_left(m))
                return -EBADMSG;
        *out = m->p;
        m->p += n;
        return 0;
}

enum kvf_mp_kind kvf_mp_peek(const struct kvf_mp *m)
{
        if (m->p >= m->end)
                return KVF_MP_NONE;
        uint8_t b = *m->p;
        if (b <= 0x7f || b == 0xcc || b == 0xcd || b == 0xce || b == 0xcf)
                return KVF_MP_UINT;
        if (b >= 0xe0 || (b >= 0xd0 && b <= 0xd3))
                return KVF_MP_NINT; /* sign decided when read */
        if ((b & 0xf0) == 0x80 || b == 0xde || b == 0xdf)
                return KVF_MP_MAP;
        if ((b & 0xf0) == 0x90 || b == 0xdc || b == 0xdd)
                return KVF_MP_ARRAY;
        if ((b & 0xe0) == 0xa0 || (b >= 0xd9 && b <= 0xdb))
                return KVF_MP_STR;
        switch (b) {
        case 0xc0:
                return KVF_MP_NIL;
        case 0xc2:
        case 0xc3:
                return KVF_MP_BOOL;
        case 0xc4:
        case 0xc5:
        case 0xc6:
                return KVF_MP_BIN;
        case 0xca:
        case 0xcb:
                return KVF_MP_FLOAT;
        case 0xc7:
        case 0xc8:
        case 0xc9:
        case 0xd4:
        case 0xd5:
        case 0xd6:
        case 0xd7:
        case 0xd8:
                return KVF_MP_EXT;
        default:
                return KVF_MP_INVALID;
        }
}

const char *kvf_mp_kind_name(enum kvf_mp_kind k)
{
        static const char *names[] = {"end of data", "nil",   "boolean", "integer",
                                      "negative integer", "float", "string",  "binary",
                                      "array",       "map",   "extension", "invalid byte 0xc1"};
        return (unsigned)k < sizeof(names) / sizeof(names[0]) ? names[k] : "?";
}

static int container(struct kvf_mp *m, uint8_t fix, uint8_t b16, uint8_t b32, uint32_t *n)
{
        const uint8_t *q;
        if (m->p >= m->end)
                return -EBADMSG;
        uint8_t b = *m->p;
        if ((b & 0xf0) == fix) {
                m->p++;
                *n = b & 0x0f;
                return 0;
        }
        unsigned w = b == b16 ? 2 : b == b32 ? 4 : 0;
        if (!w || take(m, 1 + w, &q) < 0)
                return -EBADMSG;
        *n = (uint32_t)be(q + 1, w);
        return 0;
}

int kvf_mp_map(struct kvf_mp *m, uint32_t *n)
{
        if (container(m, 0x80, 0xde, 0xdf, n) < 0)
                return -EBADMSG;
        /* Each entry needs at least two bytes. */
        return (uint64_t)*n * 2 <= kvf_mp_left(m) ? 0 : -EBADMSG;
}

int kvf_mp_array(struct kvf_mp *m, uint32_t *n)
{
        if (container(m, 0x90, 0xdc, 0xdd, n) < 0)
                return -EBADMSG;
        return *n <= kvf_mp_left(m) ? 0 : -EBADMSG;
}

int kvf_mp_str(struct kvf_mp *m, const char **s, uint32_t *len)
{
        const uint8_t *q;
        uint64_t n;
        if (m->p >= m->end)
                return -EBADMSG;
        uint8_t b = *m->p;
        if ((b & 0xe0) == 0xa0) {
                m->p++;
                n = b & 0x1f;
        } else {
                unsigned w = b == 0xd9 ? 1 : b == 0xda ? 2 : b == 0xdb ? 4 : 0;
                if (!w || take(m, 1 + w, &q) < 0)
                        return -EBADMSG;
                n = be(q + 1, w);
        }
        if (take(m, n, &q) < 0)
                return -EBADMSG;
        *s = (const char *)q;
        *len = (uint32_t)n;
        return 0;
}

int kvf_mp_int(struct kvf_mp *m, int64_t *v)
{
        const uint8_t *q;
        if (m->p >= m->end)
                return -EBADMSG;
        uint8_t b = *m->p;
        if (b <= 0x7f || b >= 0xe0) {
                m->p++;
                *v = (int8_t)b;
                if (b <= 0x7f)
                        *v = b;
                return 0;
        }
        unsigned w;
        bool sgn;
        switch (b) {
        case 0xcc: w = 1; sgn = false; break;
        case 0xcd: w = 2; sgn = false; break;
        case 0xce: w = 4; sgn = false; break;
        case 0xcf: w = 8; sgn = false; break;
        case 0xd0: w = 1; sgn = true; break;
        case 0xd1: w = 2; sgn = true; break;
        case 0xd2: w = 4; sgn = true; break;
        case 0xd3: w = 8; sgn = true; break;
        default: return -EBADMSG;
        }
        const uint8_t *save = m->p;
        if (take(m, 1 + w, &q) < 0)
                return -EBADMSG;
        uint64_t u = be(q + 1, w);
        if (sgn) {
                if (w < 8 && (u >> (8 * w - 1)) & 1)
                        u |= ~0ull << (8 * w); /* sign-extend */
                *v = (int64_t)u;
        } else {
                if (u > INT64_MAX) {
                        m->p = save;
                        return -EBADMSG;
                }
                *v = (int64_t)u;
        }
        return 0;
}

int kvf_mp_uint(struct kvf_mp *m, uint64_t *v)
{
        const uint8_t *q;
        if (m->p >= m->end)
                return -EBADMSG;
        uint8_t b = *m->p;
        if (b == 0xcf) {
                if (take(m, 9, &q) < 0)
                        return -EBADMSG;
                *v = be(q + 1, 8);
                return 0;
        }
        const uint8_t *save = m->p;
        int64_t s;
        if (kvf_mp_int(m, &s) < 0 || s < 0) {
                m->p = save;
                return -EBADMSG;
        }
        *v = (uint64_t)s;
        return 0;
}

int kvf_mp_bool(struct kvf_mp *m, bool *v)
{
        if (m->p >= m->end || (*m->p != 0xc2 && *m->p != 0xc3))
                return -EBADMSG;
        *v = *m->p++ == 0xc3;
        return 0;
}

int kvf_mp_skip(struct kvf_mp *m, unsigned max_depth)
{
        const uint8_t *q;
        uint32_t n;
        int64_t i;
        const char *s;

        switch (kvf_mp_peek(m)) {
        case KVF_MP_NIL:
        case KVF_MP_BOOL:
                m->p++;
                return 0;
        case KVF_MP_UINT:
        case KVF_MP_NINT:
                if (*m->p == 0xcf)
                        return take(m, 9, &q);
                return kvf_mp_int(m, &i);
        case KVF_MP_FLOAT:
                return take(m, *m->p == 0xca ? 5 : 9, &q);
        case KVF_MP_STR:
                return kvf_mp_str(m, &s, &n);
        case KVF_MP_BIN: {
                unsigned w = *m->p == 0xc4 ? 1 : *m->p == 0xc5 ? 2 : 4;
                if (take(m, 1 + w, &q) < 0)
                        return -EBADMSG;
                return take(m, be(q + 1, w), &q);
        }
        case KVF_MP_EXT: {
                uint8_t b = *m->p;
                if (b >= 0xd4 && b <= 0xd8)
                        return take(m, 2 + (1u << (b - 0xd4)), &q);
                unsigned w = b == 0xc7 ? 1 : b == 0xc8 ? 2 : 4;
                if (take(m, 1 + w, &q) < 0)
                        return -EBADMSG;
                return take(m, be(q + 1, w) + 1, &q);
        }
        case KVF_MP_ARRAY:
                if (max_depth == 0 || kvf_mp_array(m, &n) < 0)
                        return -EBADMSG;
                for (uint32_t k = 0; k < n; k++)
                        if (kvf_mp_skip(m, max_depth - 1) < 0)
                                return -EBADMSG;
                return 0;
        case KVF_MP_MAP:
                if (max_depth == 0 || kvf_mp_map(m, &n) < 0)
                        return -EBADMSG;
                for (uint64_t k = 0; k < 2ull * n; k++)
                        if (kvf_mp_skip(m, max_depth - 1) < 0)
                                return -EBADMSG;
                return 0;
        default:
                return -EBADMSG;
        }
}

int kvf_mp_bin(struct kvf_mp *m, const uint8_t **b, uint32_t *len)
{
        const uint8_t *q;
        if (m->p >= m->end)
                return -EBADMSG;
        unsigned w = *m->p == 0xc4 ? 1 : *m->p == 0xc5 ? 2 : *m->p == 0xc6 ? 4 : 0;
        if (!w || take(m, 1 + w, &q) < 0)
                return -EBADMSG;
        uint64_t n = be(q + 1, w);
        if (take(m, n, b) < 0)
                return -EBADMSG;
        *len = (uint32_t)n;
        return 0;
}
