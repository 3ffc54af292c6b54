/* Debug switch: PYFLOWBUF_DEBUG=1 at build time defines FB_DEBUG=1. */
#ifndef FB_DEBUG_H
#define FB_DEBUG_H
#ifndef FB_DEBUG
#define FB_DEBUG 0
#endif
#if FB_DEBUG
#include <assert.h>
#define FB_ASSERT(x) assert(x)
#else
#define FB_ASSERT(x) ((void)0)
#endif
#endif
