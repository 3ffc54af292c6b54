"""Credit-based flow control for one remote InputChannel, both ends.

Credit is a buffer the receiver has reserved for a channel. ReceiverCredit
(the receiving end) and SenderView (the sending end) hold all the accounting
and no sockets, so the model-based tests drive them directly; they live in
the C core (pyflowbuf/_core/netio.pyx) because the GIL-free receive and send
loops share their books. tests/credit_model.py is the pure-Python reference
they are checked against.

Invariant (credit mode), per channel::

    receiver.available == sender.credit + AddCredit in flight
                          + receiver.unannounced + data BufferResponses in flight

so every data buffer that reaches the receiver finds a reserved segment, and
the sender's credit never goes negative.
"""
from pyflowbuf._core.netio import BACKLOG, DATA, EVENT, ReceiverCredit, SenderView

__all__ = ["BACKLOG", "DATA", "EVENT", "ReceiverCredit", "SenderView"]
