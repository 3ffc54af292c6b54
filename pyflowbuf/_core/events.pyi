"""Stub for the compiled pyflowbuf._core.events: the event codes of csrc/fb_events.h."""

END_OF_PARTITION: int
BARRIER: int
CANCEL_BARRIER: int
END_OF_DATA: int
USER_EVENT: int
EVT_KIND: int
EVT_WATERMARK: int
BARRIER_UNALIGNED: int
BARRIER_STOP: int
