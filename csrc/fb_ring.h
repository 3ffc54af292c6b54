/* Single-producer/single-consumer ring of buffer descriptors: the queue of
 * finished buffers in a ResultSubpartition / local InputChannel. Each side
 * keeps a cached copy of the other side's index and only re-reads the shared
 * one when the cache says full/empty, so the common case touches no line the
 * peer writes. */
#ifndef FB_RING_H
#define FB_RING_H
#include <stdint.h>
#include <stdlib.h>
#include "fb_atomic.h"
#include "fb_errors.h"

struct fb_pool;

enum { FB_DATA_RECORDS = 0, FB_DATA_FIXED = 1, FB_DATA_EVENT = 2 };

typedef struct fb_bufdesc {
    struct fb_pool *pool; /* where the segment goes back; NULL for inline events */
    uint32_t seg;         /* segment index in the arena */
    uint32_t size;        /* bytes written */
    uint32_t width;       /* FIXED: record width; EVENT: event kind */
    uint16_t type;        /* FB_DATA_* */
    uint16_t flags;
    int64_t aux;          /* EVENT: payload (checkpoint id, ...) */
} fb_bufdesc;

typedef struct fb_ring {
    uint64_t head FB_ALIGNED;        /* consumer-owned */
    uint64_t tail_cache;
    uint64_t tail FB_ALIGNED;        /* producer-owned */
    uint64_t head_cache;
    uint64_t mask FB_ALIGNED;
    fb_bufdesc *slots;
} fb_ring;

static inline int fb_ring_init(fb_ring *r, uint64_t min_capacity) {
    uint64_t cap = 2;
    while (cap < min_capacity) cap <<= 1;
    r->slots = (fb_bufdesc *)calloc(cap, sizeof(fb_bufdesc));
    if (!r->slots) return FB_E_NOMEM;
    r->mask = cap - 1;
    r->head = r->tail = r->tail_cache = r->head_cache = 0;
    return FB_OK;
}

static inline void fb_ring_free(fb_ring *r) {
    free(r->slots);
    r->slots = NULL;
}

/* Rings live on their own cache lines; Python objects are only 16-byte
 * aligned, so a ring embedded in one would lose its padding (and be UB). */
static inline fb_ring *fb_ring_new(uint64_t min_capacity) {
    void *mem = NULL;
    if (posix_memalign(&mem, FB_CACHELINE, sizeof(fb_ring)) != 0) return NULL;
    fb_ring *r = (fb_ring *)mem;
    if (fb_ring_init(r, min_capacity) != FB_OK) {
        free(r);
        return NULL;
    }
    return r;
}

static inline void fb_ring_delete(fb_ring *r) {
    if (r) {
        fb_ring_free(r);
        free(r);
    }
}

static inline int fb_ring_push(fb_ring *r, const fb_bufdesc *d) {
    uint64_t t = r->tail;
    if (t - r->head_cache > r->mask) {
        r->head_cache = fb_load_acquire(&r->head);
        if (t - r->head_cache > r->mask) return FB_E_FULL;
    }
    r->slots[t & r->mask] = *d;
    fb_store_release(&r->tail, t + 1);
    return FB_OK;
}

static inline int fb_ring_pop(fb_ring *r, fb_bufdesc *d) {
    uint64_t h = r->head;
    if (h == r->tail_cache) {
        r->tail_cache = fb_load_acquire(&r->tail);
        if (h == r->tail_cache) return FB_E_UNAVAILABLE;
    }
    *d = r->slots[h & r->mask];
    fb_store_release(&r->head, h + 1);
    return FB_OK;
}

/* Producer side, right after a push: whether the consumer had taken every
 * earlier descriptor, i.e. the ring went from empty to non-empty, the only
 * case where a parked consumer needs a wake-up (one that still has
 * descriptors to take polls again before it parks). The fence pairs with the
 * seq_cst prepare() a consumer does before its last poll: either that poll
 * sees this push, or this load sees the consumer's pops. */
static inline int fb_ring_was_empty(fb_ring *r) {
    fb_fence_seqcst();
    uint64_t h = fb_load_acquire(&r->head);
    r->head_cache = h;
    return r->tail - h <= 1;
}

/* Consumer side: look at the next descriptor without taking it. */
static inline fb_bufdesc *fb_ring_peek(fb_ring *r) {
    uint64_t h = r->head;
    if (h == r->tail_cache) {
        r->tail_cache = fb_load_acquire(&r->tail);
        if (h == r->tail_cache) return NULL;
    }
    return &r->slots[h & r->mask];
}

/* Positions, for unaligned checkpoints. A priority barrier carries the
 * producer's push count at the moment it was pushed; the consumer compares it
 * with its own pop count to know how many queued descriptors it overtook. */
static inline uint64_t fb_ring_tail(fb_ring *r) { return r->tail; }           /* producer side */
static inline uint64_t fb_ring_head(fb_ring *r) { return r->head; }           /* consumer side */

/* Consumer side: the i-th descriptor after the head (i < size), left in place. */
static inline fb_bufdesc *fb_ring_at(fb_ring *r, uint64_t i) {
    return &r->slots[(r->head + i) & r->mask];
}

static inline uint64_t fb_ring_size(fb_ring *r) {
    uint64_t h = fb_load_acquire(&r->head);
    uint64_t t = fb_load_acquire(&r->tail);
    return t > h ? t - h : 0;
}
#endif
