/*
 * A bounded msgpack reader: a cursor over a byte buffer that checks every
 * length against the bytes left before it looks at them and allocates
 * nothing. Records come from other processes and from the network, so the
 * decoder must not trust a declared array or string length (msgpack-c's C
 * unpacker sizes its allocation from the declared length before reading the
 * elements). msgpack-c is used for encoding.
 *
 * Every function returns 0 or -EBADMSG; on failure kvf_mp_what() names what
 * was found, for messages like "must be a string, found integer".
 */
#ifndef KVF_MP_READ_H
#define KVF_MP_READ_H

#include <stdbool.h>
#include <stdint.h>

struct kvf_mp {
        const uint8_t *p;
        const uint8_t *end;
};

enum kvf_mp_kind {
        KVF_MP_NONE = 0, /* end of buffer */
        KVF_MP_NIL,
        KVF_MP_BOOL,
        KVF_MP_UINT,
        KVF_MP_NINT, /* negative integer */
        KVF_MP_FLOAT,
        KVF_MP_STR,
        KVF_MP_BIN,
        KVF_MP_ARRAY,
        KVF_MP_MAP,
        KVF_MP_EXT,
        KVF_MP_INVALID, /* 0xc1, the never-used byte */
};

enum kvf_mp_kind kvf_mp_peek(const struct kvf_mp *m);
const char *kvf_mp_kind_name(enum kvf_mp_kind k);

int kvf_mp_map(struct kvf_mp *m, uint32_t *n);
int kvf_mp_array(struct kvf_mp *m, uint32_t *n);
/* A string; *s points into the buffer and is not NUL-terminated. */
int kvf_mp_str(struct kvf_mp *m, const char **s, uint32_t *len);
int kvf_mp_uint(struct kvf_mp *m, uint64_t *v);
/* Any integer, signed or not, that fits int64. */
int kvf_mp_int(struct kvf_mp *m, int64_t *v);
int kvf_mp_bool(struct kvf_mp *m, bool *v);
/* A binary blob; *b points into the buffer. */
int kvf_mp_bin(struct kvf_mp *m, const uint8_t **b, uint32_t *len);
/* Skip one object of any kind, nested at most max_depth deep. */
int kvf_mp_skip(struct kvf_mp *m, unsigned max_depth);

static inline uint64_t kvf_mp_left(const struct kvf_mp *m)
{
        return (uint64_t)(m->end - m->p);
}

#endif
