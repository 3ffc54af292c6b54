from libc.stdint cimport int64_t, uint64_t

from pyflowbuf.includes.net cimport iovec


cdef extern from "fb_tls.h" nogil:
    enum:
        FB_HAVE_TLS
        FB_TLS_ETLS
        FB_TLS_EEOF
        FB_TLS_ENOTLS
        FB_TLS_REASON
    ctypedef struct fb_tls:
        int fd
        int eof
        int peer_closed
        int failed
        char reason[1]
        uint64_t bytes_in
        uint64_t bytes_out
        uint64_t records_out
        uint64_t recv_calls
        uint64_t send_calls
    int64_t fb_tls_now_ns()
    void fb_tls_ctx_free(void *ctx)
    void *fb_tls_ctx_new(int server, const char *cert, size_t cert_len, const char *key, size_t key_len,
                         const char *ca, size_t ca_len, char *err, size_t err_len)
    int fb_tls_init(fb_tls *t, void *ctx, int fd, int server)
    void fb_tls_destroy(fb_tls *t)
    int fb_tls_handshake(fb_tls *t, int64_t deadline_ns)
    int64_t fb_tls_recv2(fb_tls *t, void *a, size_t alen, void *b, size_t blen, int flags)
    int64_t fb_tls_recv_by(fb_tls *t, void *a, size_t alen, void *b, size_t blen, int64_t deadline_ns)
    int fb_tls_sendv(fb_tls *t, const iovec *iov, int n, int64_t deadline_ns)
    void fb_tls_close_notify(fb_tls *t)
    void fb_tls_flush_alert(fb_tls *t)
    int fb_tls_peer_der(fb_tls *t, unsigned char **der)
    void fb_tls_free(void *p)
    const char *fb_tls_cipher(fb_tls *t)
    const char *fb_tls_library()
