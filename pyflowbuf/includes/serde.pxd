from libc.stdint cimport uint32_t, uint64_t

cdef extern from "fb_serde.h" nogil:
    void fb_store_le32(char *p, uint32_t v)
    uint32_t fb_load_le32(const char *p)
    void fb_store_le64(char *p, uint64_t v)
    uint64_t fb_load_le64(const char *p)
    uint64_t fb_mix64(uint64_t h)
    uint64_t fb_hash_bytes(const char *p, size_t n)
    uint32_t fb_key_group(uint64_t hash, uint32_t max_parallelism)
    uint32_t fb_key_group_owner(uint32_t group, uint32_t parallelism, uint32_t max_parallelism)
    uint32_t fb_key_group_range_start(uint32_t index, uint32_t parallelism, uint32_t max_parallelism)
    ctypedef struct fb_key_router:
        uint64_t max_parallelism
        uint64_t channels
        uint32_t shift
        int pow2
    void fb_key_router_init(fb_key_router *r, uint32_t channels, uint32_t max_parallelism)
    uint32_t fb_key_router_channel(const fb_key_router *r, uint64_t hash)
