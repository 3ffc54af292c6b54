"""The exchange inside a process: the output and input sides of a task over the
core's queues and gates, and buffer debloating (see README.md). The remote side
is ``pyflowbuf.net``."""
