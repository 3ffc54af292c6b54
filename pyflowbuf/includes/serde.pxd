from libc.stdint cimport uint32_t, uint64_t

cdef extern from "fb_serde.h" nogil:
    void fb_store_le32(char *p, uint32_t v)
    uint32_t fb_load_le32(const char *p)
    void fb_store_le64(char *p, uint64_t v)
    uint64_t fb_load_le64(const char *p)
    uint64_t fb_mix64(uint64_t h)
    uint64_t fb_hash_bytes(const char *p, size_t n)
