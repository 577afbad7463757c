"""A JSON-lines TCP queue for stream metadata: many producers connect to one listening consumer.

Every message is one JSON object on one line (UTF-8, `\\n`-terminated); nothing is pickled, so producers
can be any process on any host. The server reads each connection on its own thread and merges them into
one in-order event queue: `Event("message", conn, peer, obj)` per line and `Event("closed", conn, peer, reason)` when a
connection ends (EOF, reset, or a malformed line), always after that connection's last message.
`MetaQueueClient.send` raises `QueueClosed` when the consumer is gone or stops reading for `send_timeout_s`.
"""

import itertools
import json
import queue
import socket
import threading
import time
from dataclasses import dataclass, field


class QueueClosed(ConnectionError):
    """The other end of the metadata queue is gone."""


def parse_addr(addr: str) -> tuple[str, int]:
    """`"host:port"` -> `(host, port)`, with a clear error naming the bad address."""
    host, sep, port = addr.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"queue address {addr!r} is not HOST:PORT")
    return host, int(port)


@dataclass(frozen=True)
class Event:
    kind: str  # "message" or "closed"
    conn: int  # connection number, in accept order
    peer: str  # "host:port" of the connection's remote end
    body: dict | str  # the message, or why the connection closed
    t: float = field(default_factory=time.monotonic)  # when it was read off the socket

    @property
    def message(self) -> dict:
        """The body of a "message" event; `{}` for a "closed" one."""
        return self.body if isinstance(self.body, dict) else {}


class MetaQueueServer:
    """Listens on `host:port` (port 0: any free one); `get(timeout)` returns the next `Event` or None."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0, max_line_bytes: int = 16 << 20):
        self._sock = socket.create_server((host, port))
        self.address = f"{host}:{self._sock.getsockname()[1]}"
        self._events: queue.Queue[Event] = queue.Queue()
        self._conns: dict[int, socket.socket] = {}
        self._lock = threading.Lock()
        self._ids = itertools.count()
        self._closed = False
        self._max_line = max_line_bytes
        threading.Thread(target=self._accept_loop, name=f"metaq-accept-{self.address}", daemon=True).start()

    def _accept_loop(self) -> None:
        while True:
            try:
                conn, peer = self._sock.accept()
            except OSError:
                return  # the listening socket was closed
            cid = next(self._ids)
            with self._lock:
                if self._closed:
                    conn.close()
                    return
                self._conns[cid] = conn
            args = (cid, conn, f"{peer[0]}:{peer[1]}")
            threading.Thread(target=self._read_loop, args=args, name=f"metaq-read-{cid}", daemon=True).start()

    def _read_loop(self, cid: int, conn: socket.socket, peer: str) -> None:
        reason = "end of file"
        try:
            with conn.makefile("rb") as f:
                while line := f.readline(self._max_line + 1):
                    if not line.endswith(b"\n"):
                        reason = f"line over {self._max_line} bytes or cut short"
                        break
                    body = json.loads(line)
                    if not isinstance(body, dict):
                        reason = f"message is {type(body).__name__}, not an object"
                        break
                    self._events.put(Event("message", cid, peer, body))
        except (OSError, ValueError) as e:
            reason = f"{type(e).__name__}: {e}"
        finally:
            with self._lock:
                self._conns.pop(cid, None)
            conn.close()
            self._events.put(Event("closed", cid, peer, reason))

    def get(self, timeout: float) -> Event | None:
        try:
            return self._events.get(timeout=timeout)
        except queue.Empty:
            return None

    def get_nowait(self) -> Event | None:
        return self.get(timeout=0) if not self._events.empty() else None

    def close(self) -> None:
        with self._lock:
            self._closed = True
            conns = list(self._conns.values())
        self._sock.close()
        for c in conns:
            try:
                c.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


class MetaQueueClient:
    """One producer's connection; `send` is thread-safe (heartbeats come from another thread)."""

    def __init__(self, addr: str, connect_timeout_s: float = 30.0, send_timeout_s: float = 60.0):
        self.addr = addr
        try:
            self._sock = socket.create_connection(parse_addr(addr), timeout=connect_timeout_s)
        except OSError as e:
            raise QueueClosed(f"cannot connect to the metadata queue at {addr}: {e}") from e
        # A consumer that stops reading fills the kernel buffers; the timeout turns that into an error.
        self._send_timeout = send_timeout_s
        self._sock.settimeout(send_timeout_s)
        self._lock = threading.Lock()
        self._closed = False

    def send(self, body: dict) -> None:
        line = json.dumps(body, separators=(",", ":")).encode() + b"\n"
        with self._lock:
            if self._closed:
                raise QueueClosed(f"metadata queue to {self.addr} is closed")
            try:
                self._sock.sendall(line)
            except OSError as e:
                self._closed = True
                raise QueueClosed(f"metadata queue consumer at {self.addr} went away: {e}") from e

    def peer_closed(self) -> bool:
        """True once the consumer has closed its end (it never sends, so readable means EOF or reset)."""
        with self._lock:
            if self._closed:
                return True
            try:
                self._sock.setblocking(False)
                data = self._sock.recv(1)
            except BlockingIOError:
                return False
            except OSError:
                return True
            finally:
                self._sock.settimeout(self._send_timeout)
            return data == b""

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            try:
                self._sock.shutdown(socket.SHUT_WR)
            except OSError:
                pass
            self._sock.close()
