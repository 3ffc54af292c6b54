/* Eventcount: lets a thread park until "something changed" without a lost
 * wake-up, while the notifying side pays one load when nobody waits.
 *
 * Waiter:   t = fb_event_prepare(e); if (ready()) fb_event_cancel(e);
 *           else fb_event_wait(e, t, timeout);
 * Notifier: make the change visible; fb_event_notify(e);
 *
 * prepare() publishes the waiter before it re-checks the condition and the
 * notifier re-reads the waiter count after publishing its change (both
 * seq_cst), so at least one side sees the other. */
#ifndef FB_PARK_H
#define FB_PARK_H
#include <errno.h>
#include <pthread.h>
#include <stdint.h>
#include <time.h>
#include <fcntl.h>
#include <unistd.h>
#if defined(__linux__)
#include <linux/futex.h>
#include <sys/eventfd.h>
#include <sys/syscall.h>
#endif
#include "fb_atomic.h"
#include "fb_errors.h"

#define FB_EVENT_MAX_FDS 16

typedef struct fb_event {
    uint32_t epoch;
    uint32_t waiters;
    int nfds;           /* descriptors a wake also signals (fb_event_fd_open), under fds_mu */
    int fds_w[FB_EVENT_MAX_FDS];
    pthread_mutex_t fds_mu;
    pthread_mutex_t mu;
    pthread_cond_t cv;
} fb_event;

static inline int fb_event_init(fb_event *e) {
    e->epoch = 0;
    e->waiters = 0;
    e->nfds = 0;
    if (pthread_mutex_init(&e->fds_mu, NULL) != 0) return FB_E_NOMEM;
    if (pthread_mutex_init(&e->mu, NULL) != 0) return FB_E_NOMEM;
    pthread_condattr_t attr;
    pthread_condattr_init(&attr);
#if defined(__linux__)
    pthread_condattr_setclock(&attr, CLOCK_MONOTONIC);
#endif
    int rc = pthread_cond_init(&e->cv, &attr);
    pthread_condattr_destroy(&attr);
    return rc == 0 ? FB_OK : FB_E_NOMEM;
}

static inline void fb_event_destroy(fb_event *e) {
    pthread_mutex_destroy(&e->fds_mu);
    pthread_cond_destroy(&e->cv);
    pthread_mutex_destroy(&e->mu);
}

static inline uint32_t fb_event_prepare(fb_event *e) {
    fb_fetch_add_seqcst(&e->waiters, 1);
    return fb_load_seqcst(&e->epoch);
}

static inline void fb_event_cancel(fb_event *e) { fb_fetch_add_seqcst(&e->waiters, (uint32_t)-1); }

static inline int64_t fb_monotonic_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

/* Lets a thread wait for an event and a socket at once (poll both): each
 * such thread opens its own descriptor with fb_event_fd_open (an eventfd on
 * Linux, a non-blocking pipe elsewhere; *wr is the end a wake writes to, the
 * same eventfd on Linux). After fb_event_prepare(), poll the read end: it
 * becomes readable on the next wake and stays so until fb_event_fd_drain.
 * One descriptor per waiting thread, so one thread draining its own never
 * swallows another's wake-up. The list is guarded by a mutex that a wake
 * takes only when descriptors are registered, and fb_event_fd_close
 * unregisters under it before closing, so no wake writes to a closed (or
 * reused) descriptor number. */
static inline void fb_event_signal_fds(fb_event *e) {
    if (__atomic_load_n(&e->nfds, __ATOMIC_ACQUIRE) == 0) return;
    uint64_t one = 1;
    pthread_mutex_lock(&e->fds_mu);
    for (int i = 0; i < e->nfds; i++) {
        ssize_t rc = write(e->fds_w[i], &one, sizeof one);   /* EAGAIN: it is signalled already */
        (void)rc;
    }
    pthread_mutex_unlock(&e->fds_mu);
}
/* Returns the read end (>= 0), or -1 when no descriptor could be made or
 * FB_EVENT_MAX_FDS are registered already. */
static inline int fb_event_fd_open(fb_event *e, int *wr) {
    int fds[2];
#if defined(__linux__)
    fds[0] = fds[1] = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (fds[0] < 0) return -1;
#else
    if (pipe(fds) != 0) return -1;
    for (int i = 0; i < 2; i++) {
        fcntl(fds[i], F_SETFL, fcntl(fds[i], F_GETFL) | O_NONBLOCK);
        fcntl(fds[i], F_SETFD, FD_CLOEXEC);
    }
#endif
    pthread_mutex_lock(&e->fds_mu);
    int ok = e->nfds < FB_EVENT_MAX_FDS;
    if (ok) {
        e->fds_w[e->nfds] = fds[1];
        __atomic_store_n(&e->nfds, e->nfds + 1, __ATOMIC_RELEASE);
    }
    pthread_mutex_unlock(&e->fds_mu);
    if (!ok) {
        close(fds[0]);
        if (fds[1] != fds[0]) close(fds[1]);
        return -1;
    }
    *wr = fds[1];
    return fds[0];
}
static inline void fb_event_fd_close(fb_event *e, int rd, int wr) {
    pthread_mutex_lock(&e->fds_mu);
    for (int i = 0; i < e->nfds; i++) {
        if (e->fds_w[i] == wr) {
            e->fds_w[i] = e->fds_w[e->nfds - 1];
            __atomic_store_n(&e->nfds, e->nfds - 1, __ATOMIC_RELEASE);
            break;
        }
    }
    pthread_mutex_unlock(&e->fds_mu);
    if (wr != rd) close(wr);
    close(rd);
}
static inline void fb_event_fd_drain(int rd) {
    unsigned char junk[64];
    while (read(rd, junk, sizeof junk) > 0) {
    }
}

#if defined(__linux__)
/* On Linux the epoch word is a futex: a waiter sleeps in the kernel only
 * while the epoch still equals its token (checked atomically there, so a
 * notify between prepare() and the sleep is never lost), and a notify is one
 * system call, made only when someone waits. A mutex and condition variable
 * cost a woken thread a second round trip for the mutex its notifier still
 * holds. */
static inline int fb_event_wait(fb_event *e, uint32_t token, int64_t timeout_ns) {
    int rc = FB_OK;
    int64_t deadline = timeout_ns >= 0 ? fb_monotonic_ns() + timeout_ns : -1;
    struct timespec rel, *relp = NULL;
    while (fb_load_seqcst(&e->epoch) == token) {
        if (deadline >= 0) {
            int64_t left = deadline - fb_monotonic_ns();
            if (left <= 0) {
                rc = FB_E_TIMEOUT;
                break;
            }
            rel.tv_sec = (time_t)(left / 1000000000LL);
            rel.tv_nsec = (long)(left % 1000000000LL);
            relp = &rel;
        }
        /* EAGAIN: the epoch moved; EINTR/ETIMEDOUT: the loop decides */
        syscall(SYS_futex, &e->epoch, FUTEX_WAIT_PRIVATE, token, relp, NULL, 0);
    }
    fb_event_cancel(e);
    return rc;
}

static inline void fb_event_wake(fb_event *e) {
    fb_fetch_add_seqcst(&e->epoch, 1);
    syscall(SYS_futex, &e->epoch, FUTEX_WAKE_PRIVATE, INT32_MAX, NULL, NULL, 0);
    fb_event_signal_fds(e);
}
#else
/* Parks until the epoch moves past `token` or timeout_ns passes (< 0: no limit).
 * Returns FB_OK or FB_E_TIMEOUT; always retires the waiter registered by prepare(). */
static inline int fb_event_wait(fb_event *e, uint32_t token, int64_t timeout_ns) {
    int rc = FB_OK;
    struct timespec deadline;
    if (timeout_ns >= 0) {
        clock_gettime(CLOCK_REALTIME, &deadline);
        int64_t ns = deadline.tv_nsec + timeout_ns % 1000000000LL;
        deadline.tv_sec += (time_t)(timeout_ns / 1000000000LL + ns / 1000000000LL);
        deadline.tv_nsec = (long)(ns % 1000000000LL);
    }
    pthread_mutex_lock(&e->mu);
    while (fb_load_seqcst(&e->epoch) == token) {
        if (timeout_ns < 0) {
            pthread_cond_wait(&e->cv, &e->mu);
        } else if (pthread_cond_timedwait(&e->cv, &e->mu, &deadline) == ETIMEDOUT) {
            if (fb_load_seqcst(&e->epoch) == token) rc = FB_E_TIMEOUT;
            break;
        }
    }
    pthread_mutex_unlock(&e->mu);
    fb_event_cancel(e);
    return rc;
}

static inline void fb_event_wake(fb_event *e) {
    fb_fetch_add_seqcst(&e->epoch, 1);
    pthread_mutex_lock(&e->mu);
    pthread_cond_broadcast(&e->cv);
    pthread_mutex_unlock(&e->mu);
    fb_event_signal_fds(e);
}
#endif

static inline void fb_event_notify(fb_event *e) {
    fb_fence_seqcst();
    if (fb_load_seqcst(&e->waiters) == 0) return;
    fb_event_wake(e);
}

/* Wakes waiters unconditionally (cancellation, shutdown). */
static inline void fb_event_notify_all(fb_event *e) { fb_event_wake(e); }
#endif
