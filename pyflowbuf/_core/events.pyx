"""Event codes for Python code: the kinds of events that travel in a
subpartition next to the data (``BufferQueue.push_event``,
``RecordWriter.broadcast_event``, ``RecordReader.take_event``) and their
flags. They are defined once, in csrc/fb_events.h; Cython code cimports them
from pyflowbuf.includes.events."""
from pyflowbuf.includes.events cimport *

END_OF_PARTITION = FB_EVT_END_OF_PARTITION
BARRIER = FB_EVT_BARRIER
CANCEL_BARRIER = FB_EVT_CANCEL_BARRIER
END_OF_DATA = FB_EVT_END_OF_DATA
USER_EVENT = FB_EVT_USER
EVT_KIND = FB_EVT_KIND
EVT_WATERMARK = FB_EVT_WATERMARK
# barrier flag: an unaligned barrier (it overtook queued data; see BufferQueue.overtaken)
BARRIER_UNALIGNED = FB_EVT_FLAG_UNALIGNED
# barrier flag: the barrier of a stop-with-savepoint; a task that forwards it
# sends nothing after it (see pyflowbuf.runtime.task.checkpoints)
BARRIER_STOP = FB_EVT_FLAG_STOP
