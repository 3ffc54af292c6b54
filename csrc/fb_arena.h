/* Segment arena (NetworkBufferPool) and LocalBufferPool accounting.
 *
 * The arena is one aligned allocation of num_segments segments; free segment
 * indices live in a lock-free MPMC queue. Pools do not cache segments; they
 * hold *tokens*:
 *   - a pool's guaranteed minimum is reserved at creation (taken out of the
 *     arena's `unreserved` count), so the first `min` segments it requests can
 *     always be had;
 *   - beyond its minimum, a pool takes a token from `unreserved` per segment
 *     and gives it back on recycle, so spare segments flow to whichever pool
 *     needs them.
 * A pool's in-use count and minimum share one 64-bit word so request, recycle,
 * resize and destroy decide on a consistent snapshot with a single CAS.
 * Invariant: free-list size == unreserved + sum over pools of max(0, min - in_use). */
#ifndef FB_ARENA_H
#define FB_ARENA_H
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>
#include "fb_atomic.h"
#include "fb_debug.h"
#include "fb_errors.h"
#include "fb_mpmc.h"
#include "fb_park.h"

/* Segment sizes: the one definition of the default (32 KiB, as Flink's
 * taskmanager.memory.segment-size) and of the range a NetworkBufferPool takes;
 * Python reads them from pyflowbuf._core.memory (DEFAULT_SEGMENT_SIZE...). */
#define FB_DEFAULT_SEGMENT_SIZE (32u * 1024u)
#define FB_MIN_SEGMENT_SIZE 256u
#define FB_MAX_SEGMENT_SIZE (1u << 20)

static inline void *fb_aligned_zalloc(size_t size) {
    void *mem = NULL;
    if (posix_memalign(&mem, FB_CACHELINE, size) != 0) return NULL;
    memset(mem, 0, size);
    return mem;
}

typedef struct fb_arena {
    char *base;
    uint64_t segment_size;
    uint32_t num_segments;
    uint32_t segment_shift;
    fb_mpmc free_list;
    int64_t unreserved FB_ALIGNED;
    uint32_t refs;          /* 1 for the owner + 1 per live pool */
    uint32_t live_pools;
    fb_event available;     /* notified on recycle when a requester is parked */
} fb_arena;

/* state word: bits 0..30 in_use, bit 31 destroyed, bits 32..63 min */
#define FB_POOL_INUSE(s) ((uint32_t)((s) & 0x7fffffffu))
#define FB_POOL_DESTROYED(s) (((s) >> 31) & 1u)
#define FB_POOL_MIN(s) ((uint32_t)((s) >> 32))
#define FB_POOL_STATE(min, destroyed, inuse) \
    (((uint64_t)(min) << 32) | ((uint64_t)(destroyed) << 31) | (uint64_t)(inuse))

typedef struct fb_pool {
    uint64_t state FB_ALIGNED;
    uint32_t max;
    fb_arena *arena;
    fb_event *listener;     /* optional: a task's notifier, told when a segment comes back */
    /* Statistics: relaxed, not atomic read-modify-writes. They share the line
     * the fast path CASes anyway; a separate line or locked adds cost 10x
     * under two threads (measured), for counts that may only undercount. */
    uint64_t requested;
    uint64_t recycled;
} fb_pool;

static inline char *fb_segment_ptr(fb_arena *a, uint32_t seg) {
    return a->base + ((uint64_t)seg << a->segment_shift);
}

static inline int fb_arena_create(uint32_t num_segments, uint64_t segment_size, fb_arena **out) {
    if (num_segments == 0 || segment_size == 0 || (segment_size & (segment_size - 1))) return FB_E_INVALID;
    fb_arena *a = (fb_arena *)fb_aligned_zalloc(sizeof(fb_arena));
    if (!a) return FB_E_NOMEM;
    uint64_t total = (uint64_t)num_segments * segment_size;
    size_t align = segment_size < 4096 ? 4096 : (size_t)segment_size;
    if (posix_memalign((void **)&a->base, align, total) != 0) {
        free(a);
        return FB_E_NOMEM;
    }
    a->segment_size = segment_size;
    a->segment_shift = (uint32_t)__builtin_ctzll(segment_size);
    a->num_segments = num_segments;
    if (fb_mpmc_init(&a->free_list, num_segments) != FB_OK || fb_event_init(&a->available) != FB_OK) {
        free(a->base);
        free(a);
        return FB_E_NOMEM;
    }
    for (uint32_t i = 0; i < num_segments; i++) fb_mpmc_push(&a->free_list, i);
    a->unreserved = num_segments;
    a->refs = 1;
    *out = a;
    return FB_OK;
}

static inline void fb_arena_decref(fb_arena *a) {
    if (__atomic_sub_fetch(&a->refs, 1, __ATOMIC_ACQ_REL) == 0) {
        fb_event_destroy(&a->available);
        fb_mpmc_free(&a->free_list);
        free(a->base);
        free(a);
    }
}

static inline int fb_arena_take_tokens(fb_arena *a, int64_t n) {
    int64_t t = fb_load_relaxed(&a->unreserved);
    while (t >= n) {
        if (fb_cas(&a->unreserved, &t, t - n)) return 1;
    }
    return 0;
}

static inline void fb_arena_give_tokens(fb_arena *a, int64_t n) { fb_fetch_add(&a->unreserved, n); }

/* A snapshot: under concurrent pops and pushes the two queue positions are read
 * at different moments, so clamp to what can be true. */
static inline uint64_t fb_arena_available(fb_arena *a) {
    uint64_t n = fb_mpmc_size(&a->free_list);
    return n < a->num_segments ? n : a->num_segments;
}

static inline int fb_pool_create(fb_arena *a, uint32_t min, uint32_t max, fb_pool **out) {
    if (min > max || max == 0) return FB_E_INVALID;
    fb_pool *p = (fb_pool *)fb_aligned_zalloc(sizeof(fb_pool));
    if (!p) return FB_E_NOMEM;
    if (!fb_arena_take_tokens(a, min)) {
        free(p);
        return FB_E_INSUFFICIENT;
    }
    p->state = FB_POOL_STATE(min, 0, 0);
    p->max = max;
    p->arena = a;
    __atomic_add_fetch(&a->refs, 1, __ATOMIC_ACQ_REL);
    __atomic_add_fetch(&a->live_pools, 1, __ATOMIC_ACQ_REL);
    *out = p;
    return FB_OK;
}

static inline void fb_pool_free(fb_pool *p) {
    fb_arena *a = p->arena;
    free(p);
    fb_arena_decref(a);
}

/* Non-blocking request. FB_E_UNAVAILABLE when the pool is at its cap or the
 * arena has no segment to spare beyond the reservations. */
static inline int fb_pool_request(fb_pool *p, uint32_t *seg) {
    fb_arena *a = p->arena;
    uint64_t s = fb_load_acquire(&p->state);
    for (;;) {
        if (FB_POOL_DESTROYED(s)) return FB_E_DESTROYED;
        uint32_t inuse = FB_POOL_INUSE(s);
        if (inuse >= fb_load_relaxed(&p->max)) return FB_E_UNAVAILABLE;
        if (inuse < FB_POOL_MIN(s)) {
            if (fb_cas(&p->state, &s, s + 1)) break;
            continue;
        }
        if (!fb_arena_take_tokens(a, 1)) return FB_E_UNAVAILABLE;
        if (fb_cas(&p->state, &s, s + 1)) break;
        fb_arena_give_tokens(a, 1);
    }
    /* The token guarantees a segment is in the list; a pop can only miss one
     * whose recycler has claimed a cell but not yet published it. */
    while (fb_mpmc_pop(&a->free_list, seg) != FB_OK) fb_cpu_relax();
    fb_store_relaxed(&p->requested, fb_load_relaxed(&p->requested) + 1);
    return FB_OK;
}

/* Gives the segment back; the wake-ups it owes are left in *listener and
 * *available (NULL: none) for the caller to deliver. Returns 1 when this
 * recycle freed the pool (it was destroyed and this was its last segment; the
 * arena was told already), so the caller must not touch it again. */
static inline int fb_pool_recycle_quiet(fb_pool *p, uint32_t seg, fb_event **listener, fb_event **available) {
    fb_arena *a = p->arena;
    FB_ASSERT(seg < a->num_segments);
    /* The list can hold every segment, so "full" only means a popper has
     * claimed the cell one lap back and not yet released it (Vyukov's queue
     * reports that as full): wait the few instructions, never drop the segment. */
    while (fb_mpmc_push(&a->free_list, seg) != FB_OK) fb_cpu_relax();
    fb_store_relaxed(&p->recycled, fb_load_relaxed(&p->recycled) + 1);
    uint64_t s = fb_load_acquire(&p->state);
    while (!fb_cas(&p->state, &s, s - 1)) {
    }
    uint32_t inuse = FB_POOL_INUSE(s) - 1;
    if (inuse >= FB_POOL_MIN(s)) fb_arena_give_tokens(a, 1);
    *listener = __atomic_load_n(&p->listener, __ATOMIC_ACQUIRE);
    *available = &a->available;
    if (FB_POOL_DESTROYED(s) && inuse == 0) {
        /* notify first: freeing the pool may drop the arena's last reference */
        fb_event_notify(&a->available);
        fb_pool_free(p);
        *listener = *available = NULL;
        return 1;
    }
    return 0;
}

/* Returns 1 when this recycle freed the pool (it was destroyed and this was its
 * last segment), so the caller must not touch it again. */
static inline int fb_pool_recycle(fb_pool *p, uint32_t seg) {
    fb_event *l, *av;
    int freed = fb_pool_recycle_quiet(p, seg, &l, &av);
    if (l) fb_event_notify(l);
    if (av) fb_event_notify(av);
    return freed;
}

/* Recycles n segments, then wakes each distinct listener and arena once: a
 * thread parked for a segment costs one wake-up per batch, not one system
 * call per segment while it is still on its way to run. */
static inline void fb_pool_recycle_many(fb_pool *const *pools, const uint32_t *segs, int n) {
    fb_event *owed[64];
    int k = 0;
    for (int i = 0; i < n; i++) {
        fb_event *ev[2];
        fb_pool_recycle_quiet(pools[i], segs[i], &ev[0], &ev[1]);
        for (int j = 0; j < 2; j++) {
            if (!ev[j]) continue;
            int seen = 0;
            for (int m = 0; m < k && !seen; m++) seen = owed[m] == ev[j];
            if (seen) continue;
            if (k == 64) {          /* more distinct waiters than slots: wake now */
                fb_event_notify(ev[j]);
                continue;
            }
            owed[k++] = ev[j];
        }
    }
    for (int m = 0; m < k; m++) fb_event_notify(owed[m]);
}

/* Changes the guaranteed minimum; raising it takes tokens from the arena and
 * fails with FB_E_INSUFFICIENT when the arena cannot promise them. */
static inline int fb_pool_set_min(fb_pool *p, uint32_t new_min) {
    fb_arena *a = p->arena;
    uint64_t s = fb_load_acquire(&p->state);
    for (;;) {
        if (FB_POOL_DESTROYED(s)) return FB_E_DESTROYED;
        uint32_t inuse = FB_POOL_INUSE(s), old_min = FB_POOL_MIN(s);
        int64_t before = inuse > old_min ? inuse : old_min;
        int64_t after = inuse > new_min ? inuse : new_min;
        int64_t delta = after - before;
        if (delta > 0 && !fb_arena_take_tokens(a, delta)) return FB_E_INSUFFICIENT;
        uint64_t ns = FB_POOL_STATE(new_min, 0, inuse);
        if (fb_cas(&p->state, &s, ns)) {
            if (delta < 0) {
                fb_arena_give_tokens(a, -delta);
                fb_event_notify(&a->available);
            }
            return FB_OK;
        }
        if (delta > 0) fb_arena_give_tokens(a, delta);
    }
}

static inline void fb_pool_set_max(fb_pool *p, uint32_t new_max) {
    fb_store_release(&p->max, new_max);
    /* a higher cap may unblock a parked requester */
    if (p->listener) fb_event_notify(p->listener);
    fb_event_notify(&p->arena->available);
}

/* Gives the kernel back the pages of free segments past their first `keep`
 * bytes (buffer debloating: writers fill at most the debloated size, so the
 * rest of a segment is never touched again until the size grows). Only
 * segments nobody is promised are touched: up to `FB_RELEASE_BATCH` tokens
 * are taken from `unreserved` at a time, so the pops below cannot miss and
 * no pool can be handed a segment while its pages are being dropped; a pool
 * asking for a floating segment meanwhile parks and is woken when the batch
 * is back. Visits at most the segments that were unreserved on entry (the
 * FIFO free list would otherwise cycle forever). Returns the bytes advised
 * away (pages that were not resident count too). */
#define FB_RELEASE_BATCH 64
static inline uint64_t fb_arena_release(fb_arena *a, uint64_t keep) {
    uint64_t page = (uint64_t)sysconf(_SC_PAGESIZE);
    uint64_t from = (keep + page - 1) / page * page;
    if (from >= a->segment_size || a->segment_size < page) return 0;
    uint64_t len = a->segment_size - from, released = 0;
    int64_t todo = fb_load_relaxed(&a->unreserved);
    uint32_t segs[FB_RELEASE_BATCH];
    while (todo > 0) {
        int64_t n = todo < FB_RELEASE_BATCH ? todo : FB_RELEASE_BATCH;
        int64_t t = fb_load_relaxed(&a->unreserved);
        if (t <= 0) break;
        if (n > t) n = t;
        if (!fb_arena_take_tokens(a, n)) continue;
        for (int64_t i = 0; i < n; i++)
            while (fb_mpmc_pop(&a->free_list, &segs[i]) != FB_OK) fb_cpu_relax();
        for (int64_t i = 0; i < n; i++)
            if (madvise(fb_segment_ptr(a, segs[i]) + from, len, MADV_DONTNEED) == 0) released += len;
        for (int64_t i = 0; i < n; i++)
            while (fb_mpmc_push(&a->free_list, segs[i]) != FB_OK) fb_cpu_relax();
        fb_arena_give_tokens(a, n);
        fb_event_notify(&a->available);
        todo -= n;
    }
    return released;
}

/* Bytes of the arena resident in memory now (mincore), for measuring what
 * fb_arena_release gave back; -1 when the kernel cannot tell. */
static inline int64_t fb_arena_resident(fb_arena *a) {
    uint64_t page = (uint64_t)sysconf(_SC_PAGESIZE);
    uint64_t total = (uint64_t)a->num_segments * a->segment_size;
    uint64_t start = (uint64_t)(uintptr_t)a->base / page * page;
    uint64_t span = (uint64_t)(uintptr_t)a->base + total - start;
    uint64_t pages = (span + page - 1) / page;
    unsigned char *vec = (unsigned char *)malloc(pages);
    if (!vec) return -1;
    int64_t resident = -1;
    if (mincore((void *)(uintptr_t)start, pages * page, vec) == 0) {
        resident = 0;
        for (uint64_t i = 0; i < pages; i++) resident += vec[i] & 1;
        resident *= (int64_t)page;
    }
    free(vec);
    return resident;
}

/* Marks the pool destroyed and hands its unused reservation back. Segments
 * still in use return to the arena as they are recycled; the last one frees
 * the pool. Returns 1 when the pool was freed here. */
static inline int fb_pool_destroy(fb_pool *p) {
    fb_arena *a = p->arena;
    uint64_t s = fb_load_acquire(&p->state);
    uint32_t inuse, mn;
    /* The owner's notifier may be freed once the pool object is gone; segments
     * still out must not notify it when they come back. */
    __atomic_store_n(&p->listener, (fb_event *)NULL, __ATOMIC_RELEASE);
    for (;;) {
        if (FB_POOL_DESTROYED(s)) return 0;
        inuse = FB_POOL_INUSE(s);
        mn = FB_POOL_MIN(s);
        if (fb_cas(&p->state, &s, FB_POOL_STATE(0, 1, inuse))) break;
    }
    if (mn > inuse) fb_arena_give_tokens(a, mn - inuse);
    __atomic_sub_fetch(&a->live_pools, 1, __ATOMIC_ACQ_REL);
    fb_event_notify(&a->available);
    if (inuse == 0) {
        fb_pool_free(p);
        return 1;
    }
    return 0;
}
#endif
