#!/usr/bin/env python
"""Unbounded sources: the classic socket word count (Flink's socketTextStream,
Spark's socket source), fed by a small loopback writer this program starts.

    python examples/socket_wordcount.py

Against a server of your own: ``nc -lk 9999`` in a shell, then
``env.socket_text("localhost", 9999)`` and type lines. The source reconnects
when the server restarts and ends once the server has closed and
``max_retries`` tries failed (here 0: the stream ends with the connection);
see docs/connectors.md, "Reading from a socket"."""
import socket
import threading
import time

import pyflowbuf as fb

TEXT = ["to be or not to be", "that is the question"] * 50


def start_writer():
    """A TCP server on a free loopback port that sends TEXT in small pieces
    (lines cut across sends arrive whole) and closes. Returns its port."""
    server = socket.create_server(("127.0.0.1", 0))
    data = "".join(line + "\n" for line in TEXT).encode()

    def serve():
        with server:
            server.settimeout(60)
            conn, _ = server.accept()
            with conn:
                for i in range(0, len(data), 100):
                    conn.sendall(data[i:i + 100])
                    time.sleep(0.001)
    threading.Thread(target=serve, daemon=True).start()
    return server.getsockname()[1]


def main():
    port = start_writer()
    env = fb.Environment(parallelism=2)
    counts = (env.socket_text("127.0.0.1", port, max_retries=0)     # str lines
                 .flat_map(str.split)
                 .map(lambda w: (w, 1))
                 .key_by(lambda kv: kv[0])
                 .reduce(lambda a, b: (a[0], a[1] + b[1]))
                 .collect())
    env.execute(timeout=120)                 # ends when the writer has closed
    final = {}
    for word, n in counts.result:            # running counts: keep the last per word
        final[word] = max(n, final.get(word, 0))
    assert final == {"to": 100, "be": 100, "or": 50, "not": 50, "that": 50, "is": 50, "the": 50,
                     "question": 50}, final
    return final


if __name__ == "__main__":
    print(main())
