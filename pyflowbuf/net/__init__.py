"""Remote exchange: ResultSubpartitions in one process feed InputChannels in
another over TCP, with Flink's framing and credit-based flow control.

Producer process::

    server = NetworkServer(secret)            # 127.0.0.1, any free port
    host, port = server.start()
    server.export("job1/map-0", 0, queue)     # the BufferQueue a RecordWriter fills

Consumer process::

    mgr = ConnectionManager(secret)
    excl, floating = mgr.create_input_pools(network_pool, num_channels=1)
    q = BufferQueue(network_pool)
    ch = mgr.create_channel((host, port), "job1/map-0", 0, q, excl[0], floating)
    gate = InputGate([q]); ch.attach_gate(gate)
    reader = RecordReader(gate)               # reads as from a local channel
"""
from pyflowbuf.net.client import ConnectionManager, RemoteInputChannel
from pyflowbuf.net.credit import ReceiverCredit, SenderView
from pyflowbuf.net.protocol import new_secret
from pyflowbuf.net.server import NetworkServer
from pyflowbuf.net.tls import TLSConfig

__all__ = ["ConnectionManager", "NetworkServer", "ReceiverCredit", "RemoteInputChannel", "SenderView",
           "TLSConfig", "new_secret"]
