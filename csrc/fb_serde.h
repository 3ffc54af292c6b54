/* Record wire format: a 4-byte little-endian length, then the payload. Records
 * span buffers freely (the length prefix included). Fixed-width buffers carry
 * records back to back with no prefix; the width travels in the descriptor. */
#ifndef FB_SERDE_H
#define FB_SERDE_H
#include <stdint.h>
#include <string.h>

static inline void fb_store_le32(char *p, uint32_t v) {
#if __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
    v = __builtin_bswap32(v);
#endif
    memcpy(p, &v, 4);
}

static inline uint32_t fb_load_le32(const char *p) {
    uint32_t v;
    memcpy(&v, p, 4);
#if __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
    v = __builtin_bswap32(v);
#endif
    return v;
}

static inline void fb_store_le64(char *p, uint64_t v) {
#if __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
    v = __builtin_bswap64(v);
#endif
    memcpy(p, &v, 8);
}

static inline uint64_t fb_load_le64(const char *p) {
    uint64_t v;
    memcpy(&v, p, 8);
#if __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
    v = __builtin_bswap64(v);
#endif
    return v;
}

/* Key hash that is the same in every process (Python's str hash is salted per
 * process, which would send one key to different subtasks from different
 * worker processes). FNV-1a over bytes, then a 64-bit finalizer. */
static inline uint64_t fb_mix64(uint64_t h) {
    h ^= h >> 33;
    h *= 0xff51afd7ed558ccdULL;
    h ^= h >> 33;
    h *= 0xc4ceb9fe1a85ec53ULL;
    h ^= h >> 33;
    return h;
}

static inline uint64_t fb_hash_bytes(const char *p, size_t n) {
    uint64_t h = 0xcbf29ce484222325ULL;
    for (size_t i = 0; i < n; i++) {
        h ^= (unsigned char)p[i];
        h *= 0x100000001b3ULL;
    }
    return fb_mix64(h);
}
/* Key groups (Flink's KeyGroupRangeAssignment): the one definition of which
 * subtask owns a key. Routing (the RecordWriter's key_by) and state
 * assignment (pyflowbuf.checkpoint.keygroups, through pyflowbuf._core.serde)
 * both call these, so "the subtask a key is sent to holds its state" cannot
 * drift between two copies of the arithmetic. A key's group is its stable
 * hash modulo max_parallelism; subtask i of parallelism p owns the contiguous
 * groups [ceil(i*M/p), ceil((i+1)*M/p)), which is exactly the set of groups g
 * with g*p/M == i. Products are taken in 64 bits: M <= 1 << 15 and p <= M. */
static inline uint32_t fb_key_group(uint64_t hash, uint32_t max_parallelism) {
    return (uint32_t)(hash % max_parallelism);
}

static inline uint32_t fb_key_group_owner(uint32_t group, uint32_t parallelism, uint32_t max_parallelism) {
    return (uint32_t)((uint64_t)group * parallelism / max_parallelism);
}

static inline uint32_t fb_key_group_range_start(uint32_t index, uint32_t parallelism, uint32_t max_parallelism) {
    return (uint32_t)(((uint64_t)index * max_parallelism + parallelism - 1) / parallelism);
}

/* The owner of each key of a batch, with the divisions set up once per
 * batch: for a power-of-two max_parallelism (the default 128) a mask and a
 * shift give the same numbers as fb_key_group and fb_key_group_owner without
 * two divisions per record. max_parallelism 0 routes by hash modulo the
 * channels (an exchange outside a job's key groups). */
typedef struct {
    uint64_t max_parallelism;
    uint64_t channels;
    uint32_t shift;      /* log2(max_parallelism) when it is a power of two */
    int pow2;
} fb_key_router;

static inline void fb_key_router_init(fb_key_router *r, uint32_t channels, uint32_t max_parallelism) {
    r->max_parallelism = max_parallelism;
    r->channels = channels;
    r->pow2 = max_parallelism != 0 && (max_parallelism & (max_parallelism - 1)) == 0;
    r->shift = r->pow2 ? (uint32_t)__builtin_ctz(max_parallelism) : 0;
}

static inline uint32_t fb_key_router_channel(const fb_key_router *r, uint64_t hash) {
    if (r->pow2)
        return (uint32_t)(((hash & (r->max_parallelism - 1)) * r->channels) >> r->shift);
    if (r->max_parallelism)
        return fb_key_group_owner(fb_key_group(hash, (uint32_t)r->max_parallelism),
                                  (uint32_t)r->channels, (uint32_t)r->max_parallelism);
    return (uint32_t)(hash % r->channels);
}
#endif
