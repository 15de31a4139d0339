/* SIGBUS inside a guarded copy: back to the guard (busguard.h). */
#include "busguard.h"

#include <pthread.h>
#include <signal.h>
#include <string.h>

static __thread struct kvf_busguard *cur;
static __thread void *fault_addr;
static struct sigaction prev_action;
static pthread_once_t once = PTHREAD_ONCE_INIT;

static void on_bus(int sig, siginfo_t *si, void *uc)
{
        struct kvf_busguard *g = cur;
        if (g) {
                fault_addr = si->si_addr;
                cur = g->prev; /* the guard that caught it is done */
                siglongjmp(g->jb, 1);
        }
        /* Not a guarded copy: whoever handled SIGBUS before us, or the default action (the
         * faulting instruction runs again and kills the process as if we were not here). */
        if ((prev_action.sa_flags & SA_SIGINFO) && prev_action.sa_sigaction) {
                prev_action.sa_sigaction(sig, si, uc);
                return;
        }
        if (prev_action.sa_handler != SIG_DFL && prev_action.sa_handler != SIG_IGN) {
                prev_action.sa_handler(sig);
                return;
        }
        struct sigaction dfl;
        memset(&dfl, 0, sizeof(dfl));
        dfl.sa_handler = SIG_DFL;
        sigaction(SIGBUS, &dfl, NULL);
}

static void install(void)
{
        struct sigaction sa;
        memset(&sa, 0, sizeof(sa));
        sa.sa_sigaction = on_bus;
        sa.sa_flags = SA_SIGINFO | SA_NODEFER | SA_ONSTACK;
        sigemptyset(&sa.sa_mask);
        sigaction(SIGBUS, &sa, &prev_action);
}

void kvf_busguard_enter(struct kvf_busguard *g)
{
        pthread_once(&once, install);
        g->prev = cur;
        cur = g;
        /* The compiler keeps the store before the guarded accesses that may fault. */
        __atomic_signal_fence(__ATOMIC_SEQ_CST);
}

void kvf_busguard_leave(struct kvf_busguard *g)
{
        __atomic_signal_fence(__ATOMIC_SEQ_CST);
        if (cur == g)
                cur = g->prev;
}

void *kvf_busguard_addr(void)
{
        return fault_addr;
}
