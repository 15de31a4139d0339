/* Status names: what completions and arrivals carry, FastDeploy-compatible where it has one. */
#include <string.h>

#include "kvferry.h"

static const char *const names[KVF_STATUS_COUNT] = {
        [KVF_STATUS_FINISHED] = "finished",
        [KVF_STATUS_BAD_TASK] = "bad task",
        [KVF_STATUS_BLOCK_RANGE] = "block id out of range",
        [KVF_STATUS_UNKNOWN_PEER] = "unknown peer",
        [KVF_STATUS_CONNECTION] = "connection error",
        [KVF_STATUS_LAYOUT_MISMATCH] = "peer layout mismatch",
        [KVF_STATUS_CANCELLED] = "cancelled",
        [KVF_STATUS_TIMEOUT] = "timed out",
        [KVF_STATUS_WRITE] = "write error",
        [KVF_STATUS_AUTH] = "authentication failed",
        [KVF_STATUS_ENGINE_GONE] = "engine gone",
        [KVF_STATUS_PEER_ROLE] = "peer role mismatch",
};

const char *kvf_status_name(int status)
{
        return status >= 0 && status < KVF_STATUS_COUNT ? names[status] : "unknown status";
}

int kvf_status_from_name(const char *name)
{
        for (int i = 0; i < KVF_STATUS_COUNT; i++)
                if (!strcmp(names[i], name))
                        return i;
        return -1;
}
