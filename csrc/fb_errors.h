/* Error codes returned by the C core. pyflowbuf/_core/errors.pyx turns them into
 * typed exceptions; nothing else interprets them. */
#ifndef FB_ERRORS_H
#define FB_ERRORS_H
enum {
    FB_OK = 0,
    FB_E_UNAVAILABLE = -1,   /* no segment (or queue slot) right now; try again or wait */
    FB_E_TIMEOUT = -2,       /* a blocking wait ran out of time */
    FB_E_NOMEM = -3,         /* the allocator said no */
    FB_E_INVALID = -4,       /* bad argument (caught in Python first; this is the backstop) */
    FB_E_DESTROYED = -5,     /* the pool was destroyed */
    FB_E_INSUFFICIENT = -6,  /* not enough segments to guarantee a pool's minimum */
    FB_E_FULL = -7,          /* a bounded queue is full */
    FB_E_CLOSED = -8,        /* the channel was closed / cancelled */
    FB_E_RECORD_TOO_LARGE = -9,
    FB_E_CORRUPT = -10,      /* a record length that cannot be right */
    FB_E_CANCELLED = -11
};
#endif
