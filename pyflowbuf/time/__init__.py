"""Time: the processing-time clock, watermarks and timestamps, keyed timers and
the keyed process operator (see README.md)."""
