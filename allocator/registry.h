/*
 * The allocator's registry of the engine's caches (backend "engine"): a
 * thread that answers the registration socket (common/registration.h),
 * checks and holds at most one registration, publishes it in the header
 * (reg_* fields), hands its descriptors to the roles, and drops it when the
 * registering process unregisters or dies (watched through a pidfd).
 */
#ifndef KVF_ALLOCATOR_REGISTRY_H
#define KVF_ALLOCATOR_REGISTRY_H

#include "ctl.h"

/* Start answering for the instance of ctl (its header published or not). 0 or -errno (kvf_err). */
int kvf_registry_start(struct kvf_ctl *ctl);
/* Stop the thread and drop the registration (the allocator stops). */
void kvf_registry_stop(void);

#endif
