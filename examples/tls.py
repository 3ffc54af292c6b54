#!/usr/bin/env python
"""Mutual TLS between the workers with your own certificate files.

    python examples/tls.py CERT KEY CA

CERT and KEY are this host's certificate and private key (PEM), CA the
certificate of the CA that signed every process's certificate (it may be
CERT itself for one self-signed certificate shared by all processes). Every
connection of the job (the exchange between the two worker processes) is
then mutual TLS 1.3. Without arguments the program makes a throwaway CA and
certificate in a temporary directory, the files your PKI would give you, and
uses those. ``Environment(tls=True)`` instead makes them in memory, one
certificate per attempt. See docs/workers.md ("Encryption: mutual TLS")."""
import os
import sys
import tempfile

import pyflowbuf as fb
from pyflowbuf.net import TLSConfig


def throwaway_files(folder):
    """cert.pem, key.pem, ca.pem, as a CA of your own would issue them."""
    from pyflowbuf.net.tls import JobCertificates

    issued = JobCertificates("examples/tls.py").for_attempt(0)
    paths = []
    for name, pem in (("cert.pem", issued.cert), ("key.pem", issued.key), ("ca.pem", issued.ca)):
        path = os.path.join(folder, name)
        with open(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "wb") as f:
            f.write(pem)
        paths.append(path)
    return paths


def main(cert, key, ca, records=50_000):
    env = fb.Environment(workers=2, parallelism=2, tls=TLSConfig(cert, key, ca))
    sums = (env.from_sequence(0, records, parallelism=2)
               .map(lambda x: (x % 10, x), kind="struct")
               .key_by(lambda kv: kv[0])
               .reduce(lambda a, b: (a[0], a[1] + b[1]), kind="struct")
               .collect())
    env.execute(120)
    final = {}
    for key, total in sums.result:              # running sums: the largest per key is the total
        final[key] = max(final.get(key, 0), total)
    assert sum(final.values()) == sum(range(records)), final
    return final


if __name__ == "__main__":
    if len(sys.argv) == 4:
        print(main(*sys.argv[1:]))
    else:
        with tempfile.TemporaryDirectory() as folder:
            print(main(*throwaway_files(folder)))
