from libc.stdint cimport int32_t, int64_t, uint8_t, uint16_t, uint32_t

cdef extern from "<sys/uio.h>" nogil:
    struct iovec:
        void *iov_base
        size_t iov_len

cdef extern from "<pthread.h>" nogil:
    ctypedef struct pthread_mutex_t:
        pass
    int pthread_mutex_init(pthread_mutex_t *m, const void *attr)
    int pthread_mutex_destroy(pthread_mutex_t *m)
    int pthread_mutex_lock(pthread_mutex_t *m)
    int pthread_mutex_trylock(pthread_mutex_t *m)
    int pthread_mutex_unlock(pthread_mutex_t *m)

cdef extern from "fb_net.h" nogil:
    enum:
        FB_NET_MAGIC
        FB_NET_FRAME_HEADER
        FB_NET_BUFFER_HEADER
        FB_NET_ADD_CREDIT_SIZE
        FB_NET_RID
        FB_NET_MSG_BUFFER_RESPONSE
        FB_NET_MSG_ADD_CREDIT
    ctypedef struct fb_buffer_header:
        const unsigned char *rid
        int32_t length
        uint32_t magic
        uint8_t msg_id
        int32_t subpartition
        int32_t seq
        int32_t backlog
        uint8_t data_type
        uint8_t compressed
        int32_t size
        uint32_t width
        uint16_t flags
    void fb_buffer_header_put(unsigned char *p, const unsigned char *rid, int32_t subpartition, int32_t seq,
                              int32_t backlog, uint8_t data_type, int32_t size, uint32_t width, uint16_t flags)
    void fb_buffer_header_get(const unsigned char *p, fb_buffer_header *h)
    uint32_t fb_be32_get(const unsigned char *p)
    void fb_add_credit_put(unsigned char *p, int32_t credit, const unsigned char *rid)
    int fb_sendv_all(int fd, iovec *iov, int n)
    int64_t fb_recv2(int fd, void *a, size_t alen, void *b, size_t blen, int flags)
