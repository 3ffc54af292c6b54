"""A subtask and its parts: ``Subtask`` (the thread and its mailbox loop)
puts together the ``OperatorChain``, the ``InputProcessor``, the
``Mailbox``, ``SubtaskCheckpoints`` and ``EventTime``; see this package's
modules, listed in ``pyflowbuf/runtime/README.md``."""
from pyflowbuf.runtime.task.subtask import Subtask

__all__ = ["Subtask"]
