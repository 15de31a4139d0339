/* SHA-256 and HMAC-SHA-256 against published test vectors; the proof and the token file rules. */
#include <errno.h>
#include <fcntl.h>
#include <stdint.h>
#include <sys/stat.h>
#include <unistd.h>

#include "auth.h"
#include "check.h"
#include "layout.h"

static void hex(const uint8_t *b, size_t n, char *out)
{
        for (size_t i = 0; i < n; i++)
                sprintf(out + 2 * i, "%02x", b[i]);
}

static void sha(const char *msg, size_t n, const char *want)
{
        struct kvf_sha256 s;
        uint8_t d[32];
        char h[65];
        kvf_sha256_init(&s);
        kvf_sha256_update(&s, msg, n);
        kvf_sha256_final(&s, d);
        hex(d, 32, h);
        if (strcmp(h, want)) {
                fprintf(stderr, "sha256 mismatch: %s != %s\n", h, want);
                exit(1);
        }
}

static void hmac(const void *key, size_t kl, const char *msg, const char *want)
{
        uint8_t d[32];
        char h[65];
        kvf_hmac_sha256(key, kl, msg, strlen(msg), d);
        hex(d, 32, h);
        if (strcmp(h, want)) {
                fprintf(stderr, "hmac mismatch: %s != %s\n", h, want);
                exit(1);
        }
}

int main(void)
{
        /* FIPS 180-4 examples */
        sha("", 0, "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
        sha("abc", 3, "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
        sha("abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq", 56,
            "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1");
        static char mil[1000000];
        memset(mil, 'a', sizeof(mil));
        sha(mil, sizeof(mil), "cdc76e5c9914fb9281a1c7e284d73e67f1809a48a497200e046d39ccc7112cd0");
        /* RFC 4231 test cases 1, 2 and 6 (a key longer than the block) */
        uint8_t k1[20];
        memset(k1, 0x0b, sizeof(k1));
        hmac(k1, 20, "Hi There", "b0344c61d8db38535ca8afceaf0bf12b881dc200c9833da726e9376c2e32cff7");
        hmac("Jefe", 4, "what do ya want for nothing?",
             "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843");
        uint8_t k6[131];
        memset(k6, 0xaa, sizeof(k6));
        hmac(k6, sizeof(k6), "Test Using Larger Than Block-Size Key - Hash Key First",
             "60e431591ee0b67f0d8a26aacbf5b77f8e0bc6213728c5140546040f0ee37f54");

        /* Proofs: both nonces and the label matter; equal tokens agree. */
        uint8_t a[32], b[32], p1[32], p2[32], p3[32], p4[32];
        CHECK_EQ(kvf_random(a, 32), 0);
        CHECK_EQ(kvf_random(b, 32), 0);
        kvf_auth_proof("token-one-1234567", 17, "kvferry-server", a, b, p1);
        kvf_auth_proof("token-one-1234567", 17, "kvferry-server", a, b, p2);
        kvf_auth_proof("token-one-1234567", 17, "kvferry-client", a, b, p3);
        kvf_auth_proof("token-two-1234567", 17, "kvferry-server", a, b, p4);
        CHECK(kvf_auth_equal(p1, p2, 32));
        CHECK(!kvf_auth_equal(p1, p3, 32));
        CHECK(!kvf_auth_equal(p1, p4, 32));
        kvf_auth_proof("token-one-1234567", 17, "kvferry-server", b, a, p2);
        CHECK(!kvf_auth_equal(p1, p2, 32));

        /* Token files: private, ours, long enough. */
        char path[64];
        uint8_t tok[KVF_TOKEN_MAX];
        size_t tl;
        snprintf(path, sizeof(path), "/tmp/kvf-token-%d", (int)getpid());
        int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC, 0600);
        CHECK(fd >= 0 && write(fd, "0123456789abcdef0123\n", 21) == 21);
        close(fd);
        CHECK_EQ(kvf_token_load(path, tok, &tl), 0);
        CHECK_EQ(tl, 20);
        chmod(path, 0644);
        CHECK_EQ(kvf_token_load(path, tok, &tl), -EPERM);
        CHECK_ERR_HAS("must be owned by us and private");
        fd = open(path, O_WRONLY | O_TRUNC);
        CHECK(fd >= 0 && write(fd, "short", 5) == 5);
        close(fd);
        chmod(path, 0600);
        CHECK_EQ(kvf_token_load(path, tok, &tl), -EINVAL);
        CHECK_ERR_HAS("at least 16 are needed");
        unlink(path);
        CHECK(kvf_token_load(path, tok, &tl) == -ENOENT);

        /* Layout math and compatibility messages. */
        struct kvf_cache_layout l1, l2;
        char why[160];
        CHECK_EQ(kvf_layout_make(&l1, 32, 0, 100, 8, 64, 128, KVF_DTYPE_BF16, 0), 0);
        CHECK_EQ(l1.block_bytes, 8 * 64 * 128 * 2);
        CHECK_EQ(l1.cache_bytes, 32ull * 2 * 100 * l1.block_bytes);
        CHECK_EQ(kvf_layout_offset(&l1, 1, 1, 3), ((1ull * 2 + 1) * 100 + 3) * l1.block_bytes);
        CHECK_EQ(kvf_layout_make(&l2, 28, 0, 50, 8, 64, 128, KVF_DTYPE_BF16, 0), 0);
        CHECK_EQ(kvf_layout_compatible(&l1, &l2, why, sizeof(why)), -EPROTO);
        CHECK(!strcmp(why, "32 layers here, 28 there"));
        CHECK_EQ(kvf_layout_make(&l2, 32, 0, 50, 8, 64, 128, KVF_DTYPE_FP8, 0), 0);
        CHECK_EQ(kvf_layout_compatible(&l1, &l2, why, sizeof(why)), -EPROTO);
        CHECK(!strcmp(why, "dtype bf16 here, fp8 there"));
        CHECK_EQ(kvf_layout_make(&l2, 32, 0, 50, 8, 64, 128, KVF_DTYPE_BF16, 0), 0);
        CHECK_EQ(kvf_layout_compatible(&l1, &l2, why, sizeof(why)), 0); /* block counts may differ */
        CHECK_EQ(kvf_layout_make(&l2, 0, 0, 50, 8, 64, 128, KVF_DTYPE_BF16, 0), -EINVAL);
        CHECK_EQ(kvf_layout_make(&l2, 61, 0, 10, 1, 64, 576, KVF_DTYPE_BF16, 1), 0);
        CHECK_EQ(l2.cache_bytes, 61ull * 1 * 10 * 64 * 576 * 2);
        printf("auth_test: SHA-256, HMAC, proofs, token files and layout math passed\n");
        return 0;
}
