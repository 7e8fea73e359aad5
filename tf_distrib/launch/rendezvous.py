"""Which hosts of a static multi-host launch take part in each attempt.

Host 0's launcher serves the rendezvous, on host 0's address; every host's launcher
(host 0's too) joins a round before each attempt. A round closes as soon as every host
has joined, or after `timeout` seconds with at least `min_hosts` of them; its members
start the attempt, numbered in host order. A host that joins while a round runs
waits for the next one, and the members learn (they poll between their checks) that
the group can grow back: they stop their workers as on preemption, and everyone
joins the next round. Fewer than `min_hosts` within the timeout: every waiting
launcher gets an error naming the hosts that did not come; nothing hangs.

Messages are JSON lines, signed with HMAC-SHA256 under TF_DISTRIB_SECRET when it is
set (it must then be the same on every host); unsigned or badly signed ones are refused.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import math
import socket
import threading
import time

from tf_distrib.launch.errors import LaunchError

#: Seconds between a running host's checks for hosts waiting to join.
POLL_SECONDS = 2.0


def _sign(message: dict, secret: bytes | None) -> bytes:
    body = json.dumps(message, sort_keys=True)
    mac = hmac.new(secret, body.encode(), hashlib.sha256).hexdigest() if secret else ""
    return (json.dumps({"body": body, "mac": mac}) + "\n").encode()


def _open(line: bytes, secret: bytes | None) -> dict:
    envelope = json.loads(line)
    body = envelope["body"]
    if secret and not hmac.compare_digest(
            envelope.get("mac", ""), hmac.new(secret, body.encode(), hashlib.sha256).hexdigest()):
        raise LaunchError("a rendezvous message failed its HMAC check (TF_DISTRIB_SECRET "
                          "differs between hosts?)")
    return json.loads(body)


class RendezvousServer:
    """Host 0's side: forms each round's membership.

    Args:
        address: (host, port) to listen on.
        num_hosts: Hosts in the launch.
        min_hosts: The fewest hosts a round may start with.
        timeout: Seconds a round waits for missing hosts once it has opened.
        secret: Signs messages (None: unsigned).
    """

    def __init__(self, address: tuple[str, int], num_hosts: int, min_hosts: int,
                 timeout: float, secret: bytes | None):
        self.num_hosts, self.min_hosts, self.timeout, self.secret = (num_hosts, min_hosts,
                                                                     timeout, secret)
        self._lock = threading.Condition()
        self._rounds: list[list[int]] = []  # members of each closed round
        self._joined: set[int] = set()  # hosts waiting for the open round
        self._opened: float | None = None  # when the open round's clock started
        self._finished = False  # the last round's workers all succeeded
        self._listener = socket.create_server(address)
        self._listener.settimeout(0.5)
        self._closed = False
        threading.Thread(target=self._serve, name="tf_distrib-rendezvous", daemon=True).start()

    def close(self) -> None:
        self._closed = True
        self._listener.close()

    def _serve(self) -> None:
        while not self._closed:
            try:
                connection, _ = self._listener.accept()
            except OSError:
                continue
            threading.Thread(target=self._answer, args=(connection,), daemon=True).start()

    def _answer(self, connection: socket.socket) -> None:
        with connection, contextlib.suppress(OSError, ValueError, LaunchError, KeyError):
            connection.settimeout(30)
            request = _open(connection.makefile("rb").readline(), self.secret)
            with self._lock:
                if "join" in request:
                    reply = self._join(int(request["join"]))
                elif "done" in request:
                    self._finished = request["done"] == len(self._rounds) - 1
                    self._lock.notify_all()
                    reply = {}
                else:  # poll: should round `poll` stop so that waiting hosts join?
                    reply = {"regrow": bool(self._joined) and request["poll"] == len(
                        self._rounds) - 1 and len(self._rounds[-1]) < self.num_hosts}
            connection.sendall(_sign(reply, self.secret))

    def _join(self, host: int) -> dict:
        """Called with the lock held; waits (releasing it) until `host` has a round."""
        self._joined.add(host)
        # The clock starts with a host of the last round (or the first join of all): a
        # host that comes while a round runs waits for that round's hosts to come back.
        if self._opened is None and (not self._rounds or host in self._rounds[-1]):
            self._opened = time.monotonic()
        self._lock.notify_all()
        number = len(self._rounds)
        while len(self._rounds) == number:
            if self._finished:
                self._joined.discard(host)
                return {"done": True}
            left = (math.inf if self._opened is None
                    else self._opened + self.timeout - time.monotonic())
            if len(self._joined) == self.num_hosts or (left <= 0
                                                       and len(self._joined) >= self.min_hosts):
                self._rounds.append(sorted(self._joined))
                self._joined.clear()
                self._opened = None
                self._finished = False
                self._lock.notify_all()
                break
            if left <= 0:
                missing = sorted(set(range(self.num_hosts)) - self._joined)
                return {"error": f"only {len(self._joined)} host(s) joined within "
                                 f"{self.timeout:g} s, fewer than min_hosts={self.min_hosts}; "
                                 f"missing: host(s) {missing}"}
            self._lock.wait(min(left, 0.5))
        return {"round": number, "members": self._rounds[number]}


def join(address: tuple[str, int], host: int, timeout: float,
         secret: bytes | None) -> tuple[int, list[int]]:
    """Joins the next round from host `host`; returns (round, member hosts).

    (-1, []) means the job finished while this host waited to join.

    Raises:
        LaunchError: the rendezvous host cannot be reached within `timeout`, or the round
            could not start (too few hosts).
    """
    deadline = time.monotonic() + timeout
    while True:
        try:
            with socket.create_connection(address, timeout=5) as connection:
                connection.sendall(_sign({"join": host}, secret))
                connection.settimeout(None)
                reply = _open(connection.makefile("rb").readline(), secret)
            break
        except (OSError, ValueError) as e:
            if time.monotonic() >= deadline:
                raise LaunchError(f"cannot reach the rendezvous on host 0 at "
                                  f"{address[0]}:{address[1]} within {timeout:g} s ({e}); "
                                  "start host 0's launcher, or check the address and "
                                  "firewall.") from None
            time.sleep(0.5)
    if "error" in reply:
        raise LaunchError(f"rendezvous failed: {reply['error']}")
    if reply.get("done"):
        return -1, []
    return reply["round"], reply["members"]


def _ask(address: tuple[str, int], message: dict, secret: bytes | None) -> dict:
    with contextlib.suppress(OSError, ValueError, LaunchError, KeyError):
        with socket.create_connection(address, timeout=5) as connection:
            connection.sendall(_sign(message, secret))
            connection.settimeout(5)
            return _open(connection.makefile("rb").readline(), secret)
    return {}


def should_regrow(address: tuple[str, int], round_number: int, secret: bytes | None) -> bool:
    """Whether a host waits to join while round `round_number` runs without it."""
    return bool(_ask(address, {"poll": round_number}, secret).get("regrow"))


def report_done(address: tuple[str, int], round_number: int, secret: bytes | None) -> None:
    """Tells the rendezvous that round `round_number`'s workers all finished."""
    _ask(address, {"done": round_number}, secret)
