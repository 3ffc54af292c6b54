/* Event codes: the kind of an event buffer (fb_bufdesc.width of an
 * FB_DATA_EVENT descriptor) and its flags. The one place they are defined;
 * Cython code cimports them from pyflowbuf/includes/events.pxd and Python
 * code imports them from pyflowbuf._core.events. The values travel over the
 * network and are stored in checkpoints (in-flight input), so they never
 * change; new kinds take new values. */
#ifndef FB_EVENTS_H
#define FB_EVENTS_H

enum {
    FB_EVT_END_OF_PARTITION = 0, /* a producer's subpartition has ended */
    FB_EVT_BARRIER = 1,          /* checkpoint barrier; aux: checkpoint id */
    FB_EVT_CANCEL_BARRIER = 4,   /* checkpoint aborted; aux: checkpoint id */
    FB_EVT_END_OF_DATA = 8,
    FB_EVT_USER = 16,            /* the first code free for events above the core */
    /* the inferred record kind of a stream, sent before its first data
     * buffer; aux: the kind's name, <= 8 ASCII bytes, little-endian */
    FB_EVT_KIND = FB_EVT_USER + 1,
    /* a watermark (event time); aux: the bits of a float64 of seconds,
     * +/-inf included; one NaN pattern marks the channel idle */
    FB_EVT_WATERMARK = FB_EVT_USER + 2,
};

/* barrier flags: an unaligned barrier (it overtook queued data); the
 * barrier of a stop-with-savepoint (a task that forwards it sends nothing
 * after it) */
enum { FB_EVT_FLAG_UNALIGNED = 1, FB_EVT_FLAG_STOP = 2 };

#endif
