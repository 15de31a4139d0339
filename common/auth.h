/*
 * Peer authentication: SHA-256 and HMAC-SHA-256 (FIPS 180-4, RFC 2104), and
 * the challenge-response both connectors run over a new connection.
 *
 * Both sides hold the same token (a secret file, never sent). The client
 * sends a fresh nonce; the server answers with its own nonce and
 * HMAC(token, "kvferry-server" | client nonce | server nonce); the client
 * checks it and answers HMAC(token, "kvferry-client" | server nonce | client
 * nonce). Each side has proven it holds the token against a nonce it did not
 * choose, so a recorded exchange cannot be replayed.
 */
#ifndef KVF_AUTH_H
#define KVF_AUTH_H

#include <stddef.h>
#include <stdint.h>

#define KVF_SHA256_LEN 32u
#define KVF_NONCE_LEN 32u
#define KVF_TOKEN_MAX 256u

struct kvf_sha256 {
        uint32_t h[8];
        uint64_t len;
        uint8_t buf[64];
        size_t used;
};

void kvf_sha256_init(struct kvf_sha256 *s);
void kvf_sha256_update(struct kvf_sha256 *s, const void *p, size_t n);
void kvf_sha256_final(struct kvf_sha256 *s, uint8_t out[KVF_SHA256_LEN]);
void kvf_hmac_sha256(const void *key, size_t keylen, const void *msg, size_t n,
                     uint8_t out[KVF_SHA256_LEN]);

/* The proof one side sends: HMAC(token, label | a | b). */
void kvf_auth_proof(const void *token, size_t toklen, const char *label,
                    const uint8_t a[KVF_NONCE_LEN], const uint8_t b[KVF_NONCE_LEN],
                    uint8_t out[KVF_SHA256_LEN]);
/* Constant-time comparison; 1 if equal. */
int kvf_auth_equal(const uint8_t *a, const uint8_t *b, size_t n);
/* Fresh random bytes from the kernel; 0 or -errno. */
int kvf_random(void *p, size_t n);
/*
 * Read a token file: must be a regular file owned by us, not readable by
 * group or others, 16 to 256 bytes (trailing newline dropped). 0 or -errno
 * with kvf_err set.
 */
int kvf_token_load(const char *path, uint8_t *tok, size_t *len);
/* Where the token is when no --token-file names it: $KVFERRY_TOKEN_FILE if set and not
 * empty, else $HOME/.config/kvferry/token. */
void kvf_token_default_path(char *buf, size_t len);

#endif
