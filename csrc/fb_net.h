/* Socket primitives of the remote exchange, for loops that run without the
 * GIL: Flink's NettyMessage framing of the two hot frames (BufferResponse
 * header, AddCredit), a send lock shared by every thread that writes to a
 * connection, and system-call loops that survive EINTR and partial transfers.
 * Everything else on the wire stays in pyflowbuf/net/frames.py. */
#ifndef FB_NET_H
#define FB_NET_H
#include <errno.h>
#include <pthread.h>
#include <stdint.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/uio.h>

#define FB_NET_MAGIC 0xBADC0FFEu
#define FB_NET_FRAME_HEADER 9
#define FB_NET_BUFFER_HEADER 49
#define FB_NET_ADD_CREDIT_SIZE 29
#define FB_NET_RID 16
#define FB_NET_MSG_BUFFER_RESPONSE 0
#define FB_NET_MSG_ADD_CREDIT 6
#define FB_NET_IOV_MAX 1024 /* Linux's IOV_MAX: more per sendmsg is EMSGSIZE */

#ifndef MSG_NOSIGNAL
#define MSG_NOSIGNAL 0
#endif

static inline void fb_be32_put(unsigned char *p, uint32_t v) {
    p[0] = (unsigned char)(v >> 24);
    p[1] = (unsigned char)(v >> 16);
    p[2] = (unsigned char)(v >> 8);
    p[3] = (unsigned char)v;
}

static inline uint32_t fb_be32_get(const unsigned char *p) {
    return ((uint32_t)p[0] << 24) | ((uint32_t)p[1] << 16) | ((uint32_t)p[2] << 8) | (uint32_t)p[3];
}

/* The 49 bytes before a buffer's payload (frames.encode_buffer_header). */
typedef struct fb_buffer_header {
    const unsigned char *rid; /* 16 bytes, points into the frame */
    int32_t length;
    uint32_t magic;
    uint8_t msg_id;
    int32_t subpartition;
    int32_t seq;
    int32_t backlog;
    uint8_t data_type;
    uint8_t compressed;
    int32_t size;
    uint32_t width;
    uint16_t flags;
} fb_buffer_header;

static inline void fb_buffer_header_put(unsigned char *p, const unsigned char *rid, int32_t subpartition,
                                        int32_t seq, int32_t backlog, uint8_t data_type, int32_t size,
                                        uint32_t width, uint16_t flags) {
    fb_be32_put(p, (uint32_t)(FB_NET_BUFFER_HEADER + size));
    fb_be32_put(p + 4, FB_NET_MAGIC);
    p[8] = FB_NET_MSG_BUFFER_RESPONSE;
    memcpy(p + 9, rid, FB_NET_RID);
    fb_be32_put(p + 25, (uint32_t)subpartition);
    fb_be32_put(p + 29, (uint32_t)seq);
    fb_be32_put(p + 33, (uint32_t)backlog);
    p[37] = data_type;
    p[38] = 0;
    fb_be32_put(p + 39, (uint32_t)size);
    fb_be32_put(p + 43, width);
    p[47] = (unsigned char)(flags >> 8);
    p[48] = (unsigned char)flags;
}

static inline void fb_buffer_header_get(const unsigned char *p, fb_buffer_header *h) {
    h->length = (int32_t)fb_be32_get(p);
    h->magic = fb_be32_get(p + 4);
    h->msg_id = p[8];
    h->rid = p + 9;
    h->subpartition = (int32_t)fb_be32_get(p + 25);
    h->seq = (int32_t)fb_be32_get(p + 29);
    h->backlog = (int32_t)fb_be32_get(p + 33);
    h->data_type = p[37];
    h->compressed = p[38];
    h->size = (int32_t)fb_be32_get(p + 39);
    h->width = fb_be32_get(p + 43);
    h->flags = (uint16_t)((p[47] << 8) | p[48]);
}

static inline void fb_add_credit_put(unsigned char *p, int32_t credit, const unsigned char *rid) {
    fb_be32_put(p, FB_NET_ADD_CREDIT_SIZE);
    fb_be32_put(p + 4, FB_NET_MAGIC);
    p[8] = FB_NET_MSG_ADD_CREDIT;
    fb_be32_put(p + 9, (uint32_t)credit);
    memcpy(p + 13, rid, FB_NET_RID);
}

/* Writes every byte of iov[0..n) (the array is consumed). Returns 0 or an errno. */
static inline int fb_sendv_all(int fd, struct iovec *iov, int n) {
    while (n > 0) {
        struct msghdr m;
        memset(&m, 0, sizeof m);
        m.msg_iov = iov;
        m.msg_iovlen = (size_t)(n < FB_NET_IOV_MAX ? n : FB_NET_IOV_MAX);
        ssize_t sent = sendmsg(fd, &m, MSG_NOSIGNAL);
        if (sent < 0) {
            if (errno == EINTR) continue;
            return errno ? errno : EIO;
        }
        size_t left = (size_t)sent;
        while (n > 0 && left >= iov->iov_len) {
            left -= iov->iov_len;
            iov++;
            n--;
        }
        if (n > 0) {
            iov->iov_base = (char *)iov->iov_base + left;
            iov->iov_len -= left;
        }
    }
    return 0;
}

/* One recvmsg into up to two pieces. Returns bytes read (0: peer closed) or
 * -errno (-EAGAIN only with MSG_DONTWAIT in flags). */
static inline int64_t fb_recv2(int fd, void *a, size_t alen, void *b, size_t blen, int flags) {
    struct iovec v[2];
    struct msghdr m;
    memset(&m, 0, sizeof m);
    v[0].iov_base = a;
    v[0].iov_len = alen;
    v[1].iov_base = b;
    v[1].iov_len = blen;
    m.msg_iov = v;
    m.msg_iovlen = blen ? 2 : 1;
    for (;;) {
        ssize_t got = recvmsg(fd, &m, flags);
        if (got >= 0) return (int64_t)got;
        if (errno != EINTR) return -(int64_t)(errno ? errno : EIO);
    }
}
#endif
