/* Mutual TLS 1.3 inside the exchange's own loops (libssl), for code that runs
 * without the GIL.
 *
 * One fb_tls per connection: an SSL object over one BIO of our own. Reading,
 * the BIO does recv(MSG_DONTWAIT) of up to FB_TLS_INBUF bytes on the
 * connection's socket into `in`, and hands libssl what it asks for from
 * there; when nothing is there libssl says WANT_READ and the caller polls
 * the socket without holding anything. libssl's own read-ahead buffer stays
 * at its own size (one record): before each record libssl moves what it
 * read ahead to the buffer's start (to align the payload), so a larger one
 * costs a memmove of up to all of it per 16 KiB record (a 256 KiB one made
 * the receiver spend more on that than on AES). Reading into it directly
 * cost a recv per record instead; `in` costs one copy, from a buffer still
 * in cache, and a recv per up to 16 records: the receiving thread's CPU per
 * byte of a loopback stream went from 0.61 to 0.50 ns (medians of 11 pairs). Writing, the BIO appends the records
 * libssl makes to an output buffer, and a whole batch of frames leaves in one
 * send of up to FB_TLS_FLUSH bytes. (Sending each record from libssl's own
 * buffer saves that copy but cost the sender more CPU per byte, 0.56 -> 0.73
 * ns: each send is a trip through TCP, which on loopback also delivers.)
 *
 * Threads: a connection is read by one thread and written by several (the
 * loop, AddCredit, control frames). libssl's object must not be used by two
 * at once, so `mu` is held around every SSL_* call, and never across a system
 * call that may wait: a writer blocked on a full socket must not keep the
 * reader from draining its own (both peers could wait forever). `wmu`
 * orders the writers, so records leave in the order they were made.
 * Lock order: wmu, then mu.
 *
 * Errors: functions return 0 / a byte count, or a negated errno, or
 * -FB_TLS_ETLS (the reason is in fb_tls.reason) or -FB_TLS_EEOF (the TCP
 * stream ended inside the handshake). netio's one translator turns them into
 * exceptions. Built without libssl (FB_HAVE_TLS 0) the same names exist and
 * every call fails with -FB_TLS_ENOTLS, so the Python side falls back. */
#ifndef FB_TLS_H
#define FB_TLS_H
#include <errno.h>
#include <poll.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <time.h>

#ifndef FB_HAVE_TLS
#define FB_HAVE_TLS 0
#endif
#ifndef MSG_NOSIGNAL
#define MSG_NOSIGNAL 0
#endif

#define FB_TLS_ETLS 100001   /* a TLS failure: fb_tls.reason says which */
#define FB_TLS_EEOF 100002   /* the TCP stream ended inside the handshake */
#define FB_TLS_ENOTLS 100003 /* the core was built without libssl */
#define FB_TLS_RECORD 16384  /* TLS's largest record payload */
#define FB_TLS_FLUSH (256 * 1024)
#define FB_TLS_INBUF (256 * 1024)   /* one recv's worth of ciphertext; allocated at a connection's first read */
#define FB_TLS_REASON 320

typedef struct fb_tls {
    void *ssl;              /* SSL* */
    int fd;
    int server;
    pthread_mutex_t mu;     /* the SSL object and `out` */
    pthread_mutex_t wmu;    /* one writer at a time: records leave in order */
    unsigned char *out;     /* records made, not yet sent (under mu) */
    size_t out_len, out_cap;
    unsigned char *spare;   /* the batch being sent (under wmu only) */
    size_t spare_cap;
    unsigned char *in;      /* ciphertext received, not yet taken by libssl (under mu) */
    size_t in_pos, in_len;
    int eof;                /* recv returned 0 */
    int peer_closed;        /* close_notify received */
    int sys_errno;          /* the errno of a failed recv */
    int failed;             /* sticky: a TLS error ended the connection */
    char reason[FB_TLS_REASON];
    uint64_t bytes_in, bytes_out;          /* ciphertext */
    uint64_t records_out;                  /* SSL_write calls */
    uint64_t recv_calls, send_calls;
} fb_tls;

static inline int64_t fb_tls_now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

/* Wait for `events` on fd until deadline_ns (CLOCK_MONOTONIC; < 0: forever).
 * 0 when ready (or hung up: the next call says how), ETIMEDOUT. */
static inline int fb_tls_wait(int fd, short events, int64_t deadline_ns) {
    struct pollfd p;
    for (;;) {
        int ms = -1;
        if (deadline_ns >= 0) {
            int64_t left = deadline_ns - fb_tls_now_ns();
            if (left <= 0) return ETIMEDOUT;
            ms = (int)((left + 999999) / 1000000);
        }
        p.fd = fd;
        p.events = events;
        p.revents = 0;
        int rc = poll(&p, 1, ms);
        if (rc > 0) return 0;
        if (rc == 0) {
            if (deadline_ns >= 0 && fb_tls_now_ns() >= deadline_ns) return ETIMEDOUT;
            continue;
        }
        if (errno != EINTR) return errno ? errno : EIO;
    }
}

/* All of buf onto the socket by deadline_ns. 0, an errno, or ETIMEDOUT. */
static inline int fb_tls_send_raw(fb_tls *t, const unsigned char *buf, size_t len, int64_t deadline_ns) {
    while (len > 0) {
        int fd = t->fd;
        if (fd < 0) return EBADF;
        ssize_t n = send(fd, buf, len, MSG_DONTWAIT | MSG_NOSIGNAL);
        if (n > 0) {
            buf += n;
            len -= (size_t)n;
            t->bytes_out += (uint64_t)n;
            t->send_calls++;
            continue;
        }
        if (n < 0 && errno == EINTR) continue;
        if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
            int w = fb_tls_wait(fd, POLLOUT, deadline_ns);
            if (w) return w;
            continue;
        }
        return (n < 0 && errno) ? errno : EIO;
    }
    return 0;
}

#if FB_HAVE_TLS
#include <openssl/bio.h>
#include <openssl/err.h>
#include <openssl/pem.h>
#include <openssl/ssl.h>
#include <openssl/x509.h>
#include <openssl/x509_vfy.h>

#define FB_TLS_SSL(t) ((SSL *)(t)->ssl)

static int fb_tls_reserve(fb_tls *t, size_t more) {
    if (t->out_len + more <= t->out_cap) return 0;
    size_t cap = t->out_cap ? t->out_cap : 64 * 1024;
    while (cap < t->out_len + more) cap *= 2;
    unsigned char *p = (unsigned char *)realloc(t->out, cap);
    if (p == NULL) return -1;
    t->out = p;
    t->out_cap = cap;
    return 0;
}

static int fb_tls_bio_write(BIO *bio, const char *buf, int len) {
    fb_tls *t = (fb_tls *)BIO_get_data(bio);
    BIO_clear_retry_flags(bio);
    if (len <= 0) return 0;
    if (fb_tls_reserve(t, (size_t)len)) return -1;
    memcpy(t->out + t->out_len, buf, (size_t)len);
    t->out_len += (size_t)len;
    return len;
}

static int fb_tls_bio_read(BIO *bio, char *buf, int len) {
    fb_tls *t = (fb_tls *)BIO_get_data(bio);
    BIO_clear_retry_flags(bio);
    if (len <= 0) return 0;
    if (t->in_pos < t->in_len) {
        size_t k = t->in_len - t->in_pos;
        if (k > (size_t)len) k = (size_t)len;
        memcpy(buf, t->in + t->in_pos, k);
        t->in_pos += k;
        return (int)k;
    }
    if (t->fd < 0) {
        t->eof = 1;
        return 0;
    }
    if (t->in == NULL && (t->in = (unsigned char *)malloc(FB_TLS_INBUF)) == NULL) {
        t->sys_errno = ENOMEM;
        return -1;
    }
    for (;;) {
        ssize_t n = recv(t->fd, t->in, FB_TLS_INBUF, MSG_DONTWAIT);
        t->recv_calls++;
        if (n > 0) {
            t->bytes_in += (uint64_t)n;
            t->in_pos = 0;
            t->in_len = (size_t)n;
            size_t k = (size_t)n < (size_t)len ? (size_t)n : (size_t)len;
            memcpy(buf, t->in, k);
            t->in_pos = k;
            return (int)k;
        }
        if (n == 0) {
            t->eof = 1;
            return 0;
        }
        if (errno == EINTR) continue;
        if (errno == EAGAIN || errno == EWOULDBLOCK) {
            BIO_set_retry_read(bio);
            return -1;
        }
        t->sys_errno = errno;
        return -1;
    }
}

static long fb_tls_bio_ctrl(BIO *bio, int cmd, long num, void *ptr) {
    (void)bio; (void)num; (void)ptr;
    return cmd == BIO_CTRL_FLUSH ? 1 : 0;
}

static BIO_METHOD *fb_tls_bio_method_ = NULL;
static pthread_once_t fb_tls_once_ = PTHREAD_ONCE_INIT;

static void fb_tls_make_method(void) {
    BIO_METHOD *m = BIO_meth_new(BIO_get_new_index() | BIO_TYPE_SOURCE_SINK, "pyflowbuf connection");
    if (m == NULL) return;
    BIO_meth_set_write(m, fb_tls_bio_write);
    BIO_meth_set_read(m, fb_tls_bio_read);
    BIO_meth_set_ctrl(m, fb_tls_bio_ctrl);
    fb_tls_bio_method_ = m;
}

/* The first OpenSSL error (and the certificate check's verdict, if it was
 * that), as text; the queue is cleared. */
static void fb_tls_capture(fb_tls *t, const char *what) {
    unsigned long e = ERR_get_error(), first = e;
    while (e) e = ERR_get_error();
    const char *r = first ? ERR_reason_error_string(first) : NULL;
    char code[32] = "";
    if (first && r == NULL) {
        snprintf(code, sizeof code, "error %lx", first);
        r = code;
    }
    long v = t->ssl ? SSL_get_verify_result(FB_TLS_SSL(t)) : X509_V_OK;
    if (v != X509_V_OK && (r == NULL || strstr(r, "certificate verify failed")))
        snprintf(t->reason, sizeof t->reason, "certificate verify failed: %s", X509_verify_cert_error_string(v));
    else
        snprintf(t->reason, sizeof t->reason, "%s", r ? r : what);
}

static int fb_tls_no_password(char *buf, int size, int rw, void *u) {
    (void)buf; (void)size; (void)rw; (void)u;
    return 0;
}

static void fb_tls_ctx_free(void *ctx) {
    if (ctx) SSL_CTX_free((SSL_CTX *)ctx);
}

/* An SSL_CTX for one side from PEM in memory: the certificate (and its
 * chain), the key (NULL: in the certificate's PEM), the CA. NULL on error,
 * with the reason in err. */
static void *fb_tls_ctx_new(int server, const char *cert, size_t cert_len, const char *key, size_t key_len,
                            const char *ca, size_t ca_len, char *err, size_t err_len) {
    SSL_CTX *ctx = NULL;
    BIO *b = NULL;
    X509 *x = NULL;
    EVP_PKEY *pk = NULL;
    const char *step = "create the context";
    int n = 0;
    ERR_clear_error();
    ctx = SSL_CTX_new(server ? TLS_server_method() : TLS_client_method());
    if (ctx == NULL) goto fail;
    step = "set TLS 1.3";
    if (!SSL_CTX_set_min_proto_version(ctx, TLS1_3_VERSION) || !SSL_CTX_set_max_proto_version(ctx, TLS1_3_VERSION))
        goto fail;
    /* AES-128-GCM first: as safe here, and faster than the default AES-256 */
    step = "set the ciphersuites";
    if (!SSL_CTX_set_ciphersuites(ctx, "TLS_AES_128_GCM_SHA256:TLS_AES_256_GCM_SHA384:TLS_CHACHA20_POLY1305_SHA256"))
        goto fail;
    SSL_CTX_set_options(ctx, SSL_OP_NO_RENEGOTIATION | SSL_OP_CIPHER_SERVER_PREFERENCE | SSL_OP_NO_TICKET);
    SSL_CTX_set_session_cache_mode(ctx, SSL_SESS_CACHE_OFF);
    if (server) SSL_CTX_set_num_tickets(ctx, 0);   /* every connection authenticates in full */
    SSL_CTX_set_verify(ctx, SSL_VERIFY_PEER | SSL_VERIFY_FAIL_IF_NO_PEER_CERT, NULL);
    SSL_CTX_set_default_passwd_cb(ctx, fb_tls_no_password);

    step = "read the certificate";
    b = BIO_new_mem_buf(cert, (int)cert_len);
    if (b == NULL || (x = PEM_read_bio_X509_AUX(b, NULL, fb_tls_no_password, NULL)) == NULL) goto fail;
    step = "use the certificate";
    if (!SSL_CTX_use_certificate(ctx, x)) goto fail;
    X509_free(x);
    x = NULL;
    while ((x = PEM_read_bio_X509(b, NULL, fb_tls_no_password, NULL)) != NULL) {
        step = "add the certificate chain";
        if (!SSL_CTX_add0_chain_cert(ctx, x)) goto fail;
        x = NULL;
    }
    ERR_clear_error();   /* the end of the PEM */
    BIO_free(b);
    b = NULL;

    step = "read the private key (an unencrypted PEM key)";
    b = key ? BIO_new_mem_buf(key, (int)key_len) : BIO_new_mem_buf(cert, (int)cert_len);
    if (b == NULL || (pk = PEM_read_bio_PrivateKey(b, NULL, fb_tls_no_password, NULL)) == NULL) goto fail;
    step = "use the private key";
    if (!SSL_CTX_use_PrivateKey(ctx, pk)) goto fail;
    EVP_PKEY_free(pk);
    pk = NULL;
    step = "match the key to the certificate";
    if (!SSL_CTX_check_private_key(ctx)) goto fail;
    BIO_free(b);
    b = NULL;

    step = "read the CA certificates";
    b = BIO_new_mem_buf(ca, (int)ca_len);
    if (b == NULL) goto fail;
    X509_STORE *store = SSL_CTX_get_cert_store(ctx);
    while ((x = PEM_read_bio_X509(b, NULL, fb_tls_no_password, NULL)) != NULL) {
        if (!X509_STORE_add_cert(store, x)) goto fail;
        X509_free(x);
        x = NULL;
        n++;
    }
    if (n == 0) goto fail;
    ERR_clear_error();
    BIO_free(b);
    return ctx;
fail: {
        unsigned long e = ERR_peek_last_error();
        const char *r = e ? ERR_reason_error_string(e) : NULL;
        snprintf(err, err_len, "cannot %s%s%s", step, r ? ": " : "", r ? r : "");
        ERR_clear_error();
    }
    if (x) X509_free(x);
    if (pk) EVP_PKEY_free(pk);
    if (b) BIO_free(b);
    if (ctx) SSL_CTX_free(ctx);
    return NULL;
}

static int fb_tls_init(fb_tls *t, void *ctx, int fd, int server) {
    memset(t, 0, sizeof *t);
    t->fd = fd;
    t->server = server;
    if (pthread_mutex_init(&t->mu, NULL)) return ENOMEM;
    if (pthread_mutex_init(&t->wmu, NULL)) {
        pthread_mutex_destroy(&t->mu);
        return ENOMEM;
    }
    pthread_once(&fb_tls_once_, fb_tls_make_method);
    SSL *ssl = fb_tls_bio_method_ ? SSL_new((SSL_CTX *)ctx) : NULL;
    BIO *bio = ssl ? BIO_new(fb_tls_bio_method_) : NULL;
    if (bio == NULL) {
        if (ssl) SSL_free(ssl);
        pthread_mutex_destroy(&t->mu);
        pthread_mutex_destroy(&t->wmu);
        ERR_clear_error();
        return ENOMEM;
    }
    BIO_set_data(bio, t);
    BIO_set_init(bio, 1);
    SSL_set_bio(ssl, bio, bio);
    SSL_set_read_ahead(ssl, 1);
    if (server)
        SSL_set_accept_state(ssl);
    else
        SSL_set_connect_state(ssl);
    t->ssl = ssl;
    return 0;
}

static void fb_tls_destroy(fb_tls *t) {
    if (t->ssl == NULL) return;
    SSL_free(FB_TLS_SSL(t));
    t->ssl = NULL;
    free(t->out);
    free(t->spare);
    free(t->in);
    t->out = t->spare = t->in = NULL;
    pthread_mutex_destroy(&t->mu);
    pthread_mutex_destroy(&t->wmu);
}

/* Under wmu and mu: send what libssl made so far. mu is let go during the
 * send (the reader may go on) and held again after. */
static int fb_tls_send_out(fb_tls *t, int64_t deadline_ns) {
    if (t->out_len == 0) return 0;
    unsigned char *batch = t->out;
    size_t len = t->out_len;
    size_t cap = t->out_cap;
    t->out = t->spare;
    t->out_cap = t->spare_cap;
    t->out_len = 0;
    pthread_mutex_unlock(&t->mu);
    int rc = fb_tls_send_raw(t, batch, len, deadline_ns);
    pthread_mutex_lock(&t->mu);
    /* keep the larger buffer for the next batch */
    if (t->out_len == 0 && cap > t->out_cap) {
        unsigned char *o = t->out;
        size_t oc = t->out_cap;
        t->out = batch;
        t->out_cap = cap;
        batch = o;
        cap = oc;
    }
    t->spare = batch;
    t->spare_cap = cap;
    return rc;
}

/* SSL_get_error needs an empty error queue before each SSL_* call. OpenSSL 3
 * clears a queue by wiping every slot, empty or not, which showed in
 * profiles at a call per record; looking costs less. */
static inline void fb_tls_clear_errors(void) {
    if (ERR_peek_error()) ERR_clear_error();
}

/* Under mu: encrypt len bytes into `out`. 0 or -FB_TLS_ETLS. */
static int fb_tls_write_locked(fb_tls *t, const void *p, size_t len) {
    size_t done;
    fb_tls_clear_errors();
    if (SSL_write_ex(FB_TLS_SSL(t), p, len, &done) == 1 && done == len) {
        t->records_out++;
        return 0;
    }
    if (!t->failed) {
        fb_tls_capture(t, "SSL_write failed");
        t->failed = 1;
    }
    return -FB_TLS_ETLS;
}

/* The TLS handshake, all of it by deadline_ns (< 0: none). 0, -ETIMEDOUT,
 * -FB_TLS_ETLS, -FB_TLS_EEOF or -errno. */
static int fb_tls_handshake(fb_tls *t, int64_t deadline_ns) {
    for (;;) {
        pthread_mutex_lock(&t->wmu);
        pthread_mutex_lock(&t->mu);
        ERR_clear_error();
        int rc = SSL_do_handshake(FB_TLS_SSL(t));
        int e = rc == 1 ? SSL_ERROR_NONE : SSL_get_error(FB_TLS_SSL(t), rc);
        if (e == SSL_ERROR_SSL) fb_tls_capture(t, "the handshake failed");
        /* our flight, or the alert that tells the peer why */
        int frc = fb_tls_send_out(t, deadline_ns);
        pthread_mutex_unlock(&t->mu);
        pthread_mutex_unlock(&t->wmu);
        if (e == SSL_ERROR_SSL) {
            if (t->eof && strstr(t->reason, "unexpected eof")) return -FB_TLS_EEOF;
            t->failed = 1;
            return -FB_TLS_ETLS;
        }
        if (frc) return -frc;
        if (rc == 1) return 0;
        if (e == SSL_ERROR_WANT_READ) {
            if (t->eof) return -FB_TLS_EEOF;
            int w = fb_tls_wait(t->fd, POLLIN, deadline_ns);
            if (w) return -w;
            continue;
        }
        if (e == SSL_ERROR_WANT_WRITE) continue;
        if (t->eof || e == SSL_ERROR_ZERO_RETURN) return -FB_TLS_EEOF;
        if (e == SSL_ERROR_SYSCALL && t->sys_errno) return -t->sys_errno;
        fb_tls_capture(t, "the handshake failed");
        t->failed = 1;
        return -FB_TLS_ETLS;
    }
}

/* Decrypt what is there, without waiting, into a then b: bytes (> 0), 0 at
 * the end of the stream (close_notify or EOF), -EAGAIN, -errno, -FB_TLS_ETLS. */
static int64_t fb_tls_read_now(fb_tls *t, void *a, size_t alen, void *b, size_t blen) {
    size_t got = 0, n;
    int64_t res;
    pthread_mutex_lock(&t->mu);
    if (t->failed) {
        pthread_mutex_unlock(&t->mu);
        return -FB_TLS_ETLS;
    }
    for (;;) {
        if (got >= alen + blen) {
            res = (int64_t)got;
            break;
        }
        char *dst = got < alen ? (char *)a + got : (char *)b + (got - alen);
        size_t room = got < alen ? alen - got : alen + blen - got;
        fb_tls_clear_errors();
        if (SSL_read_ex(FB_TLS_SSL(t), dst, room, &n) == 1) {
            got += n;
            continue;
        }
        int e = SSL_get_error(FB_TLS_SSL(t), 0);
        if (e == SSL_ERROR_WANT_READ || e == SSL_ERROR_WANT_WRITE) {
            res = got ? (int64_t)got : -EAGAIN;
        } else if (e == SSL_ERROR_ZERO_RETURN) {
            t->peer_closed = 1;
            res = (int64_t)got;
        } else if (e == SSL_ERROR_SYSCALL && !t->eof && t->sys_errno) {
            res = got ? (int64_t)got : -(int64_t)t->sys_errno;
        } else if (t->eof && (e == SSL_ERROR_SYSCALL || ERR_GET_REASON(ERR_peek_error()) == SSL_R_UNEXPECTED_EOF_WHILE_READING)) {
            /* the peer went away without close_notify (killed): a lost
             * connection, said as the plain exchange says it */
            ERR_clear_error();
            res = (int64_t)got;
        } else {
            fb_tls_capture(t, "a TLS record was refused");
            t->failed = 1;
            res = got ? (int64_t)got : -FB_TLS_ETLS;
        }
        break;
    }
    pthread_mutex_unlock(&t->mu);
    return res;
}

/* Encrypt and send iov[0..n): small pieces (frame headers) share a record
 * with what follows them up to FB_TLS_RECORD bytes; large ones (segments)
 * are encrypted where they lie. 0, an errno, ETIMEDOUT or FB_TLS_ETLS. */
static int fb_tls_sendv(fb_tls *t, const struct iovec *iov, int n, int64_t deadline_ns) {
    unsigned char stage[1024];
    size_t staged = 0;
    int rc = 0;
    pthread_mutex_lock(&t->wmu);
    pthread_mutex_lock(&t->mu);
    if (t->failed) rc = FB_TLS_ETLS;
    for (int i = 0; i < n && !rc; i++) {
        const unsigned char *p = (const unsigned char *)iov[i].iov_base;
        size_t len = iov[i].iov_len;
        if (len <= sizeof stage - staged) {
            memcpy(stage + staged, p, len);
            staged += len;
            continue;
        }
        if (staged) {   /* a frame header: its own short record, the payload is not copied */
            rc = -fb_tls_write_locked(t, stage, staged);
            staged = 0;
        }
        while (len && !rc) {
            size_t w = len < FB_TLS_FLUSH ? len : FB_TLS_FLUSH;
            rc = -fb_tls_write_locked(t, p, w);
            p += w;
            len -= w;
            if (!rc && t->out_len >= FB_TLS_FLUSH) rc = fb_tls_send_out(t, deadline_ns);
        }
    }
    if (!rc && staged) rc = -fb_tls_write_locked(t, stage, staged);
    if (!rc) rc = fb_tls_send_out(t, deadline_ns);
    pthread_mutex_unlock(&t->mu);
    pthread_mutex_unlock(&t->wmu);
    return rc;
}

/* close_notify, best effort and without waiting (the connection is ending). */
static void fb_tls_close_notify(fb_tls *t) {
    if (pthread_mutex_trylock(&t->wmu)) return;   /* a writer is stuck on the socket: skip it */
    pthread_mutex_lock(&t->mu);
    if (!t->failed && SSL_is_init_finished(FB_TLS_SSL(t))) {
        ERR_clear_error();
        SSL_shutdown(FB_TLS_SSL(t));
        ERR_clear_error();
        fb_tls_send_out(t, fb_tls_now_ns());
    }
    pthread_mutex_unlock(&t->mu);
    pthread_mutex_unlock(&t->wmu);
}

/* Send what a failed read left for the peer (our alert), without waiting. */
static void fb_tls_flush_alert(fb_tls *t) {
    if (pthread_mutex_trylock(&t->wmu)) return;
    pthread_mutex_lock(&t->mu);
    fb_tls_send_out(t, fb_tls_now_ns());
    pthread_mutex_unlock(&t->mu);
    pthread_mutex_unlock(&t->wmu);
}

/* The peer's certificate, DER, in *der (free with fb_tls_free); its length or 0. */
static int fb_tls_peer_der(fb_tls *t, unsigned char **der) {
    *der = NULL;
    pthread_mutex_lock(&t->mu);
    X509 *x = SSL_get1_peer_certificate(FB_TLS_SSL(t));
    pthread_mutex_unlock(&t->mu);
    if (x == NULL) return 0;
    int n = i2d_X509(x, der);
    X509_free(x);
    return n > 0 ? n : 0;
}

static void fb_tls_free(void *p) {
    OPENSSL_free(p);
}

static const char *fb_tls_cipher(fb_tls *t) {
    const char *c = SSL_get_cipher_name(FB_TLS_SSL(t));
    return c ? c : "";
}

static const char *fb_tls_library(void) {
    return OpenSSL_version(OPENSSL_VERSION);
}

#else /* built without libssl: the Python side falls back to its relay */

static void fb_tls_ctx_free(void *ctx) { (void)ctx; }
static void *fb_tls_ctx_new(int server, const char *cert, size_t cert_len, const char *key, size_t key_len,
                            const char *ca, size_t ca_len, char *err, size_t err_len) {
    (void)server; (void)cert; (void)cert_len; (void)key; (void)key_len; (void)ca; (void)ca_len;
    snprintf(err, err_len, "the compiled core was built without libssl");
    return NULL;
}
static int fb_tls_init(fb_tls *t, void *ctx, int fd, int server) {
    (void)ctx; (void)fd; (void)server;
    memset(t, 0, sizeof *t);
    return FB_TLS_ENOTLS;
}
static void fb_tls_destroy(fb_tls *t) { (void)t; }
static int fb_tls_handshake(fb_tls *t, int64_t deadline_ns) { (void)t; (void)deadline_ns; return -FB_TLS_ENOTLS; }
static int64_t fb_tls_read_now(fb_tls *t, void *a, size_t alen, void *b, size_t blen) {
    (void)t; (void)a; (void)alen; (void)b; (void)blen;
    return -FB_TLS_ENOTLS;
}
static int fb_tls_sendv(fb_tls *t, const struct iovec *iov, int n, int64_t deadline_ns) {
    (void)t; (void)iov; (void)n; (void)deadline_ns;
    return FB_TLS_ENOTLS;
}
static void fb_tls_close_notify(fb_tls *t) { (void)t; }
static void fb_tls_flush_alert(fb_tls *t) { (void)t; }
static int fb_tls_peer_der(fb_tls *t, unsigned char **der) { (void)t; *der = NULL; return 0; }
static void fb_tls_free(void *p) { (void)p; }
static const char *fb_tls_cipher(fb_tls *t) { (void)t; return ""; }
static const char *fb_tls_library(void) { return ""; }
#endif

/* recv semantics over TLS: what fb_recv2 is for a plain socket. Waits
 * (poll, no lock held) until something was decrypted unless MSG_DONTWAIT. */
static inline int64_t fb_tls_recv2(fb_tls *t, void *a, size_t alen, void *b, size_t blen, int flags) {
    for (;;) {
        int64_t n = fb_tls_read_now(t, a, alen, b, blen);
        if (n != -EAGAIN || (flags & MSG_DONTWAIT)) return n;
        int w = fb_tls_wait(t->fd, POLLIN, -1);
        if (w) return -(int64_t)w;
    }
}

/* The same, by deadline_ns (< 0: none): -ETIMEDOUT when it passes. */
static inline int64_t fb_tls_recv_by(fb_tls *t, void *a, size_t alen, void *b, size_t blen, int64_t deadline_ns) {
    for (;;) {
        int64_t n = fb_tls_read_now(t, a, alen, b, blen);
        if (n != -EAGAIN) return n;
        int w = fb_tls_wait(t->fd, POLLIN, deadline_ns);
        if (w) return -(int64_t)w;
    }
}
#endif
