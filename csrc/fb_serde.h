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
#endif
