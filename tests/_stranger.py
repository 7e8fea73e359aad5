"""A stranger at worker 0's transport port: two connections that send garbage, queued first."""

import json
import os
import socket

from tf_distrib.transport import wire

SENT = "test/stranger_sent"  # the store key worker 1 waits for before it dials


def send_garbage(store, timeout=60.0) -> list:
    """Connects twice to worker 0's transport port (from `store`), sends random bytes on
    one and a HELLO with a random body on the other, then sets `SENT` in `store`.

    Returns what each connection got back: b"" when closed, None when reset.
    """
    address = json.loads(store.get("tf_distrib/transport/0", timeout))["address"]
    host, _, port = address.rpartition(":")
    blobs = (os.urandom(100), wire.header(wire.Kind.HELLO, length=36) + os.urandom(36))
    sockets = [socket.create_connection((host, int(port)), timeout=timeout) for _ in blobs]
    for s, blob in zip(sockets, blobs, strict=True):
        s.sendall(blob)
    store.set(SENT, "yes")
    replies = []
    for s in sockets:
        with s:
            try:
                replies.append(s.recv(1000))
            except ConnectionResetError:
                replies.append(None)
    return replies
