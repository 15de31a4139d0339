/*
 * libFuzzer target for the record codec. Input: two bytes, then a msgpack
 * payload. The first byte is the record type (1..12 are ring records, 32 and
 * up connector-to-connector records, the rest invalid and must be rejected);
 * the second is the rank that picks the element of `rdma_ports`.
 *
 * A record that decodes must re-encode, and the re-encoding must decode to
 * the same record (so the fuzzer checks the encoder too): an engine reads
 * back what a kvferry process wrote from what it decoded. "The same" is
 * checked twice: field by field for the fields named below, and as equal
 * bytes when encoded again, which covers every field the tables carry,
 * including ones added after this file was written. Decoding must fail with
 * -EBADMSG and a message, never anything else.
 *
 * Seeds: fuzz/corpus/records/ (tests/records_python.py corpus DIR writes them).
 */
#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "err.h"
#include "record_fields.h"
#include "records.h"

static void die(const char *what, const struct kvf_record *a, const struct kvf_record *b)
{
        fprintf(stderr, "fuzz_records: %s (type %u '%s', request_id '%s' / '%s', last error: %s)\n",
                what, a->type, kvf_rec_type_name(a->type), a->request_id, b ? b->request_id : "",
                kvf_err_msg());
        abort();
}

static bool ids_equal(const uint32_t *a, uint32_t na, const uint32_t *b, uint32_t nb)
{
        return na == nb && (na == 0 || !memcmp(a, b, (size_t)na * sizeof(*a)));
}

/* Everything the encoder carries (tests/record_fields.h): the first field that differs, or NULL. */
static const char *differs(const struct kvf_record *a, const struct kvf_record *b)
{
#define SAME_NUM(f)                                                                                \
        if (a->f != b->f)                                                                          \
                return #f;
#define SAME_STR(f)                                                                                \
        if (strcmp(a->f, b->f))                                                                    \
                return #f;
#define SAME_BIN(f)                                                                                \
        if (memcmp(a->f, b->f, sizeof(a->f)))                                                      \
                return #f;
#define SAME_IDS(p, n, name)                                                                       \
        if (!ids_equal(a->p, a->n, b->p, b->n))                                                    \
                return name;
        KVF_RECORD_FIELDS(SAME_NUM, SAME_STR, SAME_BIN, SAME_IDS)
#undef SAME_NUM
#undef SAME_STR
#undef SAME_BIN
#undef SAME_IDS
        return NULL;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
        struct kvf_record a, b;
        uint8_t *enc = NULL;
        size_t len;

        if (size < 2)
                return 0;
        int type = data[0];
        uint32_t rank = data[1];

        kvf_err_clear();
        int rc = kvf_record_decode(type, data + 2, size - 2, rank, &a);
        if (rc < 0) {
                /* -ENOMEM is allowed (a huge id array under a memory limit); nothing else. */
                if ((rc != -EBADMSG && rc != -ENOMEM) || kvf_err_msg()[0] == '\0')
                        die("decode failed without -EBADMSG and a message", &a, NULL);
                kvf_record_free(&a);
                return 0;
        }
        if (!strcmp(kvf_rec_type_name(type), "unknown"))
                die("decoded an invalid record type", &a, NULL);

        rc = kvf_record_encode_alloc(&a, &enc, &len);
        if (rc < 0)
                die("decoded record does not encode", &a, NULL);
        /* The length is exact: one byte less does not fit. */
        if (len > 0 && kvf_record_encode(&a, enc, len - 1) != -ENOSPC)
                die("encode fits in fewer bytes than it produced", &a, NULL);

        /* Any rank: the re-encoding carries `peer` itself, never rdma_ports. */
        rc = kvf_record_decode(type, enc, len, rank ^ 1, &b);
        if (rc < 0)
                die("re-encoded record does not decode", &a, NULL);
        const char *f = differs(&a, &b);
        if (f) {
                fprintf(stderr, "fuzz_records: field '%s' differs after re-encoding\n", f);
                die("round trip changed the record", &a, &b);
        }
        uint8_t *enc2;
        size_t len2;
        if (kvf_record_encode_alloc(&b, &enc2, &len2) < 0)
                die("re-decoded record does not encode", &b, NULL);
        if (len2 != len || memcmp(enc, enc2, len))
                die("encoding is not stable across a round trip", &a, &b);
        free(enc2);
        kvf_record_free(&b);
        kvf_record_free(&a);
        free(enc);
        return 0;
}
