/* Bounded multi-producer/multi-consumer queue of 32-bit values (segment
 * indices), after Dmitry Vyukov's design: each cell carries a sequence number
 * that tells a producer whether the cell is free for lap `pos` and a consumer
 * whether it has been published. No lock; one CAS per operation. */
#ifndef FB_MPMC_H
#define FB_MPMC_H
#include <stdint.h>
#include <stdlib.h>
#include "fb_atomic.h"
#include "fb_errors.h"

typedef struct fb_mpmc_cell {
    uint64_t seq;
    uint32_t value;
    uint32_t _pad;
} fb_mpmc_cell;

typedef struct fb_mpmc {
    uint64_t enqueue_pos FB_ALIGNED;
    uint64_t dequeue_pos FB_ALIGNED;
    uint64_t mask FB_ALIGNED;
    fb_mpmc_cell *cells;
} fb_mpmc;

static inline uint64_t fb_pow2_at_least(uint64_t n) {
    uint64_t c = 1;
    while (c < n) c <<= 1;
    return c;
}

static inline int fb_mpmc_init(fb_mpmc *q, uint64_t min_capacity) {
    uint64_t cap = fb_pow2_at_least(min_capacity < 2 ? 2 : min_capacity);
    q->cells = (fb_mpmc_cell *)calloc(cap, sizeof(fb_mpmc_cell));
    if (!q->cells) return FB_E_NOMEM;
    for (uint64_t i = 0; i < cap; i++) q->cells[i].seq = i;
    q->mask = cap - 1;
    q->enqueue_pos = 0;
    q->dequeue_pos = 0;
    return FB_OK;
}

static inline void fb_mpmc_free(fb_mpmc *q) {
    free(q->cells);
    q->cells = NULL;
}

static inline int fb_mpmc_push(fb_mpmc *q, uint32_t value) {
    fb_mpmc_cell *cell;
    uint64_t pos = fb_load_relaxed(&q->enqueue_pos);
    for (;;) {
        cell = &q->cells[pos & q->mask];
        uint64_t seq = fb_load_acquire(&cell->seq);
        int64_t dif = (int64_t)seq - (int64_t)pos;
        if (dif == 0) {
            if (fb_cas(&q->enqueue_pos, &pos, pos + 1)) break;
        } else if (dif < 0) {
            return FB_E_FULL;
        } else {
            pos = fb_load_relaxed(&q->enqueue_pos);
        }
    }
    cell->value = value;
    fb_store_release(&cell->seq, pos + 1);
    return FB_OK;
}

static inline int fb_mpmc_pop(fb_mpmc *q, uint32_t *value) {
    fb_mpmc_cell *cell;
    uint64_t pos = fb_load_relaxed(&q->dequeue_pos);
    for (;;) {
        cell = &q->cells[pos & q->mask];
        uint64_t seq = fb_load_acquire(&cell->seq);
        int64_t dif = (int64_t)seq - (int64_t)(pos + 1);
        if (dif == 0) {
            if (fb_cas(&q->dequeue_pos, &pos, pos + 1)) break;
        } else if (dif < 0) {
            return FB_E_UNAVAILABLE;
        } else {
            pos = fb_load_relaxed(&q->dequeue_pos);
        }
    }
    *value = cell->value;
    fb_store_release(&cell->seq, pos + q->mask + 1);
    return FB_OK;
}

static inline uint64_t fb_mpmc_size(fb_mpmc *q) {
    uint64_t d = fb_load_acquire(&q->dequeue_pos);
    uint64_t e = fb_load_acquire(&q->enqueue_pos);
    return e > d ? e - d : 0;
}
#endif
