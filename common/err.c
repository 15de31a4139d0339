#include "err.h"

#include <stdarg.h>
#include <stdio.h>
#include <string.h>

static _Thread_local char msg[KVF_ERR_MAX];

int kvf_err_set(int rc, const char *fmt, ...)
{
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(msg, sizeof(msg), fmt, ap);
        va_end(ap);
        return rc;
}

int kvf_err_ctx(int rc, const char *fmt, ...)
{
        char ctx[KVF_ERR_MAX], old[KVF_ERR_MAX];
        va_list ap;

        if (msg[0] == '\0')
                snprintf(old, sizeof(old), "%s", strerror(rc < 0 ? -rc : rc));
        else
                memcpy(old, msg, sizeof(old));
        va_start(ap, fmt);
        vsnprintf(ctx, sizeof(ctx), fmt, ap);
        va_end(ap);
        /* "<ctx>: <old>", cut at the buffer's end */
        size_t n = strnlen(ctx, sizeof(ctx) - 1);
        memcpy(msg, ctx, n);
        if (n + 2 < sizeof(msg)) {
                msg[n++] = ':';
                msg[n++] = ' ';
        }
        size_t m = strnlen(old, sizeof(old) - 1);
        if (m > sizeof(msg) - 1 - n)
                m = sizeof(msg) - 1 - n;
        memcpy(msg + n, old, m);
        msg[n + m] = '\0';
        return rc;
}

const char *kvf_err_msg(void)
{
        return msg;
}

void kvf_err_clear(void)
{
        msg[0] = '\0';
}
