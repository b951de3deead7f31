"""Hosts for multi-host tests on one machine: Linux network namespaces joined by veth links, and
a TCP relay that delays what it forwards (a stand-in for ``tc netem``, which not every kernel
has). Needs root (or CAP_NET_ADMIN) and iproute2; ``Hosts`` raises ``HostsUnavailable`` otherwise.
"""

from __future__ import annotations

import ctypes
import math
import os
import queue
import re
import socket
import subprocess
import threading
import time
from collections.abc import Callable

NETNS_DIR = "/var/run/netns"
_CLONE_NEWNET = 0x40000000
_TAG = re.compile(r"pdi(\d+)")  # what Hosts names start with: "pdi" and the test process's pid


class HostsUnavailable(RuntimeError):
    """Network namespaces cannot be made here (not root, no iproute2, a sandbox)."""


def ip(*args: str) -> None:
    try:
        subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=30)
    except subprocess.CalledProcessError as exc:
        raise RuntimeError(f"ip {' '.join(args)}: {exc.stderr.strip()}") from None


class Hosts:
    """Namespaces ``pdi<pid>-<name>`` (one per host), a bridge in this process's namespace for
    the hosts' control LAN (this process reaches every host over it), and point-to-point links
    between hosts. ``close`` removes them all; namespaces left by a killed test run are removed
    by the next one."""

    def __init__(self) -> None:
        self.tag = f"pdi{os.getpid()}"
        self.namespaces: list[str] = []
        self.bridge = ""
        _remove_stale()

    def add(self, name: str) -> str:
        """A new host: its namespace's name (loopback up, for the processes' own sockets).
        ``HostsUnavailable`` if the first one cannot be made."""
        netns = f"{self.tag}-{name}"
        try:
            ip("netns", "add", netns)
        except (OSError, RuntimeError) as exc:
            if self.namespaces:
                raise
            raise HostsUnavailable(f"cannot make network namespaces here: {exc}") from None
        self.namespaces.append(netns)
        ip("-n", netns, "link", "set", "lo", "up")
        return netns

    def lan(self, members: dict[str, int]) -> dict[str, str]:
        """A bridge on a /24 of 10/8 no route here uses, with this process at ``.254`` and each
        namespace of ``members`` at its number, on its device ``lan``: {namespace: address}."""
        routes = subprocess.run(["ip", "-4", "route"], capture_output=True, text=True).stdout
        subnet = next(
            s
            for i in range(os.getpid(), os.getpid() + 25600)
            if (s := f"10.{100 + i % 100}.{i // 100 % 256}") + ".0/" not in routes
        )
        self.bridge = f"{self.tag}br"
        ip("link", "add", self.bridge, "type", "bridge")
        ip("addr", "add", f"{subnet}.254/24", "dev", self.bridge)
        ip("link", "set", self.bridge, "up")
        addresses = {}
        for netns, number in members.items():
            port = f"{self.tag}p{number}"  # the bridge's end, in this namespace
            ip("link", "add", port, "type", "veth", "peer", "name", "lan", "netns", netns)
            ip("link", "set", port, "master", self.bridge, "up")
            addresses[netns] = self.address(netns, "lan", f"{subnet}.{number}/24")
        return addresses

    def link(self, a: str, b: str, subnet: str) -> tuple[str, str]:
        """A point-to-point link between namespaces ``a`` (``subnet.1``, a /30) and ``b``
        (``subnet.2``); each end is named after the other host. Their addresses."""
        end_a, end_b = _short(b), _short(a)
        ip("link", "add", end_a, "netns", a, "type", "veth", "peer", "name", end_b, "netns", b)
        return self.address(a, end_a, f"{subnet}.1/30"), self.address(b, end_b, f"{subnet}.2/30")

    def address(self, netns: str, device: str, cidr: str) -> str:
        ip("-n", netns, "addr", "add", cidr, "dev", device)
        ip("-n", netns, "link", "set", device, "up")
        return cidr.split("/")[0]

    def set_link(self, netns: str, device: str, up: bool) -> None:
        ip("-n", netns, "link", "set", device, "up" if up else "down")

    def close(self) -> None:
        """Remove everything; a namespace's links go with it. Stop its processes first."""
        for netns in self.namespaces:
            _quietly("netns", "del", netns)
        self.namespaces = []
        if self.bridge:
            _quietly("link", "del", self.bridge)
            self.bridge = ""


def _short(netns: str) -> str:
    return netns.rsplit("-", 1)[1][:15]


def _quietly(*args: str) -> None:
    try:
        ip(*args)
    except (OSError, RuntimeError):
        pass


def _remove_stale() -> None:
    """Namespaces and bridges of test processes that no longer run (killed before teardown)."""

    def dead(name: str) -> bool:
        match = _TAG.match(name)
        return match is not None and not os.path.exists(f"/proc/{match.group(1)}")

    for netns in os.listdir(NETNS_DIR) if os.path.isdir(NETNS_DIR) else []:
        if dead(netns):
            _quietly("netns", "del", netns)
    try:
        bridges = subprocess.run(["ip", "-o", "link", "show", "type", "bridge"], capture_output=True, text=True).stdout
    except OSError:
        return
    for bridge in re.findall(r"^\d+: (pdi\d+br)", bridges, re.M):
        if dead(bridge):
            _quietly("link", "del", bridge)


# --- a delaying TCP relay -------------------------------------------------------------------------
_libc = ctypes.CDLL(None, use_errno=True)


def socket_in(netns: str) -> socket.socket:
    """A TCP socket of namespace ``netns``. setns moves only the calling thread, so a thread of
    its own enters the namespace and makes the socket, which stays there when the thread ends."""
    made: list = []

    def make() -> None:
        with open(f"{NETNS_DIR}/{netns}") as f:
            if _libc.setns(f.fileno(), _CLONE_NEWNET) != 0:
                made.append(OSError(ctypes.get_errno(), f"setns into {netns} failed"))
                return
        made.append(socket.socket())

    thread = threading.Thread(target=make)
    thread.start()
    thread.join(timeout=30)
    if not made:
        raise OSError(f"making a socket in {netns} did not finish")
    if isinstance(made[0], OSError):
        raise made[0]
    return made[0]


class DelayRelay:
    """Accepts TCP connections at ``listen`` in namespace ``netns`` and forwards each to
    ``target``, every chunk ``delay_s`` late in each direction. Latency, as netem's delay, not a
    throughput cap: chunks keep flowing while earlier ones wait out their delay. ``delay_s`` may
    change at any time (it applies to chunks read from then on). ``min_hold_s``: the least time
    a forwarded chunk spent in the relay (set it to ``math.inf`` to measure a stretch).
    ``trip``: ``(bytes, action)``; the relay runs ``action`` once, in its writer thread, as soon as
    ``bytes_to_target`` reaches ``bytes``, and forwards nothing toward the target until it returns
    (a test's link cut lands at that point however loaded the machine is)."""

    CHUNK_BYTES = 1 << 16

    def __init__(self, netns: str, listen: tuple[str, int], target: tuple[str, int], delay_s: float = 0.0):
        self.netns, self.target, self.delay_s = netns, target, delay_s
        self.bytes_to_target = 0  # what went from clients to the target
        self.bytes_from_target = 0
        self.trip: tuple[int, Callable[[], None]] | None = None
        self.min_hold_s = math.inf
        self.connections = 0
        self._sockets: list[socket.socket] = []
        self._pairs: list[tuple[socket.socket, socket.socket]] = []  # (client, upstream) of live connections
        self._silent: set[socket.socket] = set()  # upstreams that must not hear their client went away
        self._lock = threading.Lock()
        self._closed = False
        self._server = socket_in(netns)
        self._server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._server.bind(listen)
        self._server.listen(16)
        self._server.settimeout(0.2)
        threading.Thread(target=self._accept, name="relay-accept", daemon=True).start()

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._server.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            client.settimeout(None)
            upstream = socket_in(self.netns)
            try:
                upstream.connect(self.target)
            except OSError:
                client.close()
                upstream.close()
                continue
            with self._lock:
                self._sockets += [client, upstream]
                self._pairs.append((client, upstream))
                self.connections += 1
            self._pipe(client, upstream, to_target=True)
            self._pipe(upstream, client, to_target=False)

    def _pipe(self, src: socket.socket, dst: socket.socket, to_target: bool) -> None:
        chunks: queue.Queue[tuple[float, float, bytes]] = queue.Queue()

        def read() -> None:
            while True:
                try:
                    data = src.recv(self.CHUNK_BYTES)
                except OSError:
                    data = b""
                now = time.monotonic()
                chunks.put((now, now + self.delay_s, data))
                if not data:
                    return

        def write() -> None:
            while True:
                read_at, due, data = chunks.get()
                time.sleep(max(0.0, due - time.monotonic()))
                try:
                    if not data:
                        if dst not in self._silent:
                            dst.shutdown(socket.SHUT_WR)
                        return
                    dst.sendall(data)
                except OSError:
                    if src not in self._silent:
                        _shutdown(src)  # the other side is gone: end this direction's reader too
                    return
                with self._lock:
                    self.min_hold_s = min(self.min_hold_s, time.monotonic() - read_at)
                    if to_target:
                        self.bytes_to_target += len(data)
                    else:
                        self.bytes_from_target += len(data)
                    trip = self.trip if to_target else None
                    if trip is not None and self.bytes_to_target >= trip[0]:
                        self.trip = None
                    else:
                        trip = None
                if trip is not None:
                    with self._lock:  # every writer toward the target waits for the action
                        trip[1]()

        threading.Thread(target=read, name="relay-read", daemon=True).start()
        threading.Thread(target=write, name="relay-write", daemon=True).start()

    def reset(self) -> None:
        """Close every connection on the clients' side (they see it end, and reconnect) while the
        target hears nothing: its side stays open and silent, as behind a restarted NAT."""
        with self._lock:
            pairs, self._pairs = self._pairs, []
            self._silent.update(upstream for _, upstream in pairs)
        for client, _ in pairs:
            _shutdown(client)

    def close(self) -> None:
        self._closed = True
        self._server.close()
        with self._lock:
            for sock in self._sockets:
                _shutdown(sock)
                sock.close()


def _shutdown(sock: socket.socket) -> None:
    """Shut both ways: this wakes a thread blocked reading it (``close`` alone would not)."""
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
