"""The control channel: authenticated messages between engines over ZMQ, without ever blocking the
scheduler thread.

Who uses it: each PD engine creates one `ControlChannel` at start-up and hands `.address` to its peers
(the prefill through the bootstrap server, the decode in `Register.reply_addr`). The scheduler thread
calls `send` (enqueue only) and `poll` (drain what arrived) once per loop; `close` at shutdown.

Threading: ONE background I/O thread owns every ZMQ socket (the PULL socket bound at start-up and one
PUSH socket per peer address, created on first use). The scheduler thread touches only two deques
under a lock and a self-pipe that wakes the I/O thread, so `send`/`poll` are O(1)/O(messages) and never
wait on the network. Encoding (msgpack + HMAC, microseconds) runs in the caller so a caller bug raises
at its call site; decoding and verification run in the I/O thread, and anything invalid is dropped and
counted (`num_forged`, `num_malformed`, `num_wrong_version`), never raised to the caller.

Bounded memory whatever the peers do (a dead peer costs at most sndhwm + max_backlog messages):
    outbox   <= max_outbox messages waiting for the I/O thread (beyond: dropped, `num_dropped`)
    per peer <= sndhwm messages inside ZMQ, then <= max_backlog in the peer's FIFO backlog, flushed in
             order when the socket turns writable (a burst to a live peer is delayed, not lost); beyond
             that, dropped and counted in `num_dropped`. Nothing ever waits: every ZMQ send is NOBLOCK,
             LINGER is 0, and at most max_peers sockets exist (the least recently used is closed)
    inbox   <= max_inbox decoded messages waiting for `poll` (beyond: dropped, `num_inbox_dropped`)
    one received message <= max_msg_bytes: ZMQ's MAXMSGSIZE caps each frame (a bigger frame drops that
             connection, uncounted); `messages.decode` caps all frames together (OversizedMessage,
             counted in `num_malformed`) and any message of more than 3 frames (`num_malformed`).
             ZMQ holds a multipart message until its last frame arrives, so frame count x MAXMSGSIZE
             would be unbounded for any peer that can connect: hence the CURVE handshake below.
Two locks. Connections: every socket runs ZMQ's CURVE handshake with a key pair derived from the
cluster secret (`curve_keys`); a peer without the secret never completes it, so ZMQ takes nothing
from it (no frame is buffered, nothing reaches the counters), and the traffic is encrypted. Messages:
each carries an HMAC of the secret, checked on arrival (`num_forged` when wrong).
An exception in the I/O thread is counted (`num_errors`, `last_error`) and the loop goes on; it never
silently stops the channel. The secret proves "holder of the cluster secret", not which peer sent a
message, and does not stop replays; rooms are random, unique while active and ignored once removed,
which bounds what a replay can do.

Length (~420 lines, a third of it this docstring and the limits): one I/O thread and the sockets it
alone owns; split, the bounds above would be spread over files that each see only part of them.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import re
import threading
from collections import OrderedDict, deque

import zmq
import zmq.utils.z85

from pdserve import faults
from pdserve.disagg import messages

log = logging.getLogger(__name__)

_ADDR_RE = re.compile(rf"^({messages.TCP_ADDR}|{messages.IPC_ADDR}|inproc://\S+)\Z")  # + in-process
_RECV_BATCH = 1024  # messages received per loop turn before the outbox is served again


def curve_keys(secret: bytes) -> tuple[bytes, bytes]:
    """(public, secret) CURVE key pair, Z85-encoded, derived from the cluster secret: every engine
    of a cluster derives the same pair. The public key is never sent (a CURVE client must already
    know the server's), so only holders of the cluster secret can connect."""
    seed = hmac.new(bytes(secret), b"pdserve-control-curve\x00", hashlib.sha256).digest()  # 32 bytes
    secret_key = zmq.utils.z85.encode(seed)
    return zmq.curve_public(secret_key), secret_key


def curve_server(sock: zmq.Socket, secret: bytes) -> None:
    """Make `sock` (bound) accept only CURVE clients holding the cluster secret's keys."""
    public, secret_key = curve_keys(secret)
    sock.setsockopt(zmq.CURVE_SERVER, 1)
    sock.setsockopt(zmq.CURVE_SECRETKEY, secret_key)
    sock.setsockopt(zmq.CURVE_PUBLICKEY, public)


def curve_client(sock: zmq.Socket, secret: bytes) -> None:
    """Make `sock` (connecting) a CURVE client of a `curve_server` socket of the same cluster."""
    public, secret_key = curve_keys(secret)
    sock.setsockopt(zmq.CURVE_SERVERKEY, public)
    sock.setsockopt(zmq.CURVE_PUBLICKEY, public)
    sock.setsockopt(zmq.CURVE_SECRETKEY, secret_key)


class _Peer:
    """One peer address: its PUSH socket and the messages ZMQ could not take yet (socket at SNDHWM)."""

    __slots__ = ("sock", "backlog")

    def __init__(self, sock: zmq.Socket) -> None:
        self.sock = sock
        self.backlog: deque[list[bytes]] = deque()


class ControlChannel:
    def __init__(
        self,
        bind_host: str,
        secret: bytes,
        name: str,
        *,
        advertise_host: str | None = None,
        sndhwm: int = 1024,
        max_backlog: int = 8192,
        max_peers: int = 256,
        max_outbox: int = 65536,
        max_inbox: int = 65536,
        max_msg_bytes: int = 64 << 20,
        start_timeout_s: float = 10.0,
    ) -> None:
        if not secret:
            raise ValueError("the cluster secret must be non-empty bytes")
        self.name = name
        self._secret = bytes(secret)
        self._sndhwm = sndhwm
        self._max_backlog = max_backlog
        self._max_peers = max_peers
        self._max_outbox = max_outbox
        self._max_inbox = max_inbox
        self._max_msg_bytes = max_msg_bytes
        # Shared with the I/O thread, guarded by _lock: outbox of (address | None, frames | None) where a
        # None frames entry means "close the socket to address", the inbox, and the wake flag.
        self._lock = threading.Lock()
        self._inbox_ready = threading.Condition(self._lock)
        self._outbox: deque[tuple[str, list[bytes] | None]] = deque()
        self.num_faults_injected = 0
        self._inbox: deque[messages.Envelope] = deque()
        self._wake_pending = False
        self._closed = False
        self._stop = threading.Event()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        # Counters: written by the I/O thread (or under the lock), read by anyone.
        self.num_sent = 0
        self.num_received = 0
        self.num_forged = 0
        self.num_malformed = 0
        self.num_wrong_version = 0
        self._num_outbox_dropped = 0  # caller side, under the lock
        self._num_peer_dropped = 0  # I/O thread only (backlog full, peer closed with a backlog)
        self.num_inbox_dropped = 0
        self.num_errors = 0
        self.last_error = ""

        self._port: int | None = None
        self._start_error: BaseException | None = None
        started = threading.Event()
        self._thread = threading.Thread(
            target=self._run, args=(bind_host, started), name=f"control-{name}", daemon=True
        )
        self._thread.start()
        if not started.wait(start_timeout_s) or self._start_error is not None:
            self.close()
            raise RuntimeError(f"control channel failed to start: {self._start_error!r}")
        host = advertise_host or (bind_host if bind_host not in ("0.0.0.0", "*", "") else "127.0.0.1")
        self._address = f"tcp://{host}:{self._port}"

    # ---- caller API (any thread; never blocks on the network) -----------------------------------
    @property
    def address(self) -> str:
        """Where peers send to: "tcp://HOST:PORT"."""
        return self._address

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self._closed

    def send(self, addr: str, body: messages.Message, room: int) -> bool:
        """Queue one message for `addr`. Returns False (and counts `num_dropped`) when the outbox is full
        or the channel is closed. Raises ValueError / TypeError only on a caller bug (malformed
        address, not a message, room out of range)."""
        if not isinstance(addr, str) or not _ADDR_RE.match(addr):
            raise ValueError(f"not a ZMQ address: {addr!r}")
        frames = messages.encode(body, room, self.name, self._secret)
        if faults.ENABLED and (rule := faults.check("control.send", type(body).__struct_config__.tag)):
            return self._inject(rule, addr, frames)
        return self._enqueue(addr, frames)

    def _inject(self, rule, addr: str, frames: list[bytes]) -> bool:
        """Fault injection (pdserve.faults, off by default): drop / delay / duplicate / reorder."""
        self.num_faults_injected += 1
        if rule.action == "drop":
            return True  # the sender believes it went out
        if rule.action == "duplicate":
            return self._enqueue(addr, frames) and self._enqueue(addr, frames)
        # delay; reorder = held back briefly so the next messages to this peer overtake it
        delay_s = rule.delay_s or (0.05 if rule.action == "reorder" else 0.0)
        timer = threading.Timer(delay_s, self._enqueue, (addr, frames))
        timer.daemon = True
        timer.start()
        return True

    def drop_peer(self, addr: str) -> None:
        """Close the socket to `addr` (its queued messages are discarded). For a peer declared dead."""
        self._enqueue(addr, None)

    def poll(self, timeout_s: float = 0.0) -> list[messages.Envelope]:
        """Valid messages received since the last call, oldest first. With timeout_s > 0, waits up to
        that long for at least one (for helper threads and tests; the scheduler uses the default 0)."""
        with self._inbox_ready:
            if not self._inbox and timeout_s > 0 and not self._closed:
                self._inbox_ready.wait(timeout_s)
            out = list(self._inbox)
            self._inbox.clear()
        return out

    @property
    def num_dropped(self) -> int:
        """Messages we accepted or were asked to send but never handed to ZMQ."""
        return self._num_outbox_dropped + self._num_peer_dropped

    def stats(self) -> dict[str, int]:
        names = (
            "sent",
            "received",
            "forged",
            "malformed",
            "wrong_version",
            "dropped",
            "inbox_dropped",
            "errors",
        )
        return {f"num_{n}": getattr(self, f"num_{n}") for n in names}

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop the I/O thread and close every socket (LINGER 0: queued messages are discarded).
        Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._stop.set()
            self._wake()
            self._inbox_ready.notify_all()
        self._thread.join(timeout_s)
        if self._thread.is_alive():  # stuck (should not happen): leave the pipe to it rather than reuse fds
            log.error("control channel %s: I/O thread did not stop", self.name)
            return
        with self._lock:  # senders write the pipe under the lock and see _closed first: no fd reuse race
            os.close(self._wake_r)
            os.close(self._wake_w)

    def __enter__(self) -> ControlChannel:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _enqueue(self, addr: str, frames: list[bytes] | None) -> bool:
        with self._lock:
            if self._closed or len(self._outbox) >= self._max_outbox:
                self._num_outbox_dropped += 1
                return False
            self._outbox.append((addr, frames))
            if not self._wake_pending:
                self._wake_pending = True
                self._wake()
        return True

    def _wake(self) -> None:
        """Under the lock: one byte into the self-pipe (non-blocking; a few microseconds)."""
        try:
            os.write(self._wake_w, b"\0")
        except (BlockingIOError, OSError):
            pass  # pipe full (the thread will wake anyway) or already closed

    # ---- I/O thread -------------------------------------------------------------------------------
    def _run(self, bind_host: str, started: threading.Event) -> None:
        ctx = zmq.Context(io_threads=1)
        peers: OrderedDict[str, _Peer] = OrderedDict()  # LRU order; owned by this thread only
        try:
            pull = ctx.socket(zmq.PULL)
        except BaseException as e:
            self._start_error = e
            started.set()
            ctx.term()
            return
        try:
            pull.setsockopt(zmq.LINGER, 0)
            pull.setsockopt(zmq.RCVHWM, 65536)
            pull.setsockopt(zmq.MAXMSGSIZE, self._max_msg_bytes)
            curve_server(pull, self._secret)
            self._port = pull.bind_to_random_port(f"tcp://{bind_host}")
        except BaseException as e:
            self._start_error = e
            started.set()
            pull.close(0)
            ctx.term()
            return
        started.set()
        more_to_read = False
        try:
            while not self._stop.is_set():
                try:
                    # Rebuilt each turn: POLLOUT only on peers with a backlog, so a dead peer costs nothing.
                    poller = zmq.Poller()
                    poller.register(pull, zmq.POLLIN)
                    poller.register(self._wake_r, zmq.POLLIN)
                    for peer in peers.values():
                        if peer.backlog:
                            poller.register(peer.sock, zmq.POLLOUT)
                    ready = dict(poller.poll(0 if more_to_read else 1000))
                    if self._wake_r in ready:
                        self._drain_wake_pipe()
                    for peer in peers.values():
                        if peer.backlog and peer.sock in ready:
                            self._flush(peer)
                    self._serve_outbox(ctx, peers)
                    more_to_read = self._receive(pull) if pull in ready or more_to_read else False
                except Exception as e:  # keep serving: one bad turn must not stop the channel
                    self.num_errors += 1
                    self.last_error = repr(e)
                    log.exception("control channel %s: I/O loop error", self.name)
                    more_to_read = False
        finally:
            for peer in peers.values():
                peer.sock.close(0)
            pull.close(0)
            ctx.term()

    def _drain_wake_pipe(self) -> None:
        try:
            while os.read(self._wake_r, 4096):
                pass
        except (BlockingIOError, OSError):
            pass

    def _serve_outbox(self, ctx: zmq.Context, peers: OrderedDict[str, _Peer]) -> None:
        with self._lock:
            batch = list(self._outbox)
            self._outbox.clear()
            self._wake_pending = False  # after the pipe was drained: a later send writes a fresh byte
        for addr, frames in batch:
            if frames is None:
                peer = peers.pop(addr, None)
                if peer is not None:
                    self._num_peer_dropped += len(peer.backlog)
                    peer.sock.close(0)
                continue
            peer = peers.get(addr)
            if peer is None:
                try:
                    peer = self._connect(ctx, peers, addr)
                except zmq.ZMQError as e:
                    # An address our pattern passes but libzmq refuses (e.g. "tcp://-:5" in a peer's
                    # Register): drop this message only; the rest of the batch goes out.
                    self._num_peer_dropped += 1
                    self.num_errors += 1
                    self.last_error = f"connect {addr!r}: {e!r}"
                    continue
            else:
                peers.move_to_end(addr)
            if len(peer.backlog) >= self._max_backlog:
                self._num_peer_dropped += 1  # dead or hopelessly slow peer: bounded memory, never wait
                continue
            peer.backlog.append(frames)
            self._flush(peer)

    def _flush(self, peer: _Peer) -> None:
        """Hand queued messages to ZMQ in order until the socket is at its high-water mark."""
        while peer.backlog:
            try:
                peer.sock.send_multipart(peer.backlog[0], flags=zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            peer.backlog.popleft()
            self.num_sent += 1

    def _connect(self, ctx: zmq.Context, peers: OrderedDict[str, _Peer], addr: str) -> _Peer:
        while len(peers) >= self._max_peers:
            _, old = peers.popitem(last=False)
            self._num_peer_dropped += len(old.backlog)
            old.sock.close(0)
        sock = ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, self._sndhwm)
        sock.setsockopt(zmq.SNDTIMEO, 0)
        sock.setsockopt(zmq.RECONNECT_IVL, 100)
        sock.setsockopt(zmq.RECONNECT_IVL_MAX, 5000)
        sock.setsockopt(zmq.HEARTBEAT_IVL, 2000)  # ZMTP pings find a dead TCP peer and reconnect
        sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, 10000)
        sock.setsockopt(zmq.TCP_KEEPALIVE, 1)
        curve_client(sock, self._secret)
        try:
            sock.connect(addr)  # asynchronous: returns at once even if nobody listens
        except zmq.ZMQError:
            sock.close(0)
            raise
        peers[addr] = peer = _Peer(sock)
        return peer

    def _receive(self, pull: zmq.Socket) -> bool:
        """Read up to _RECV_BATCH messages; returns True when more may be waiting."""
        received: list[messages.Envelope] = []
        more = True
        for _ in range(_RECV_BATCH):
            try:
                frames = pull.recv_multipart(flags=zmq.NOBLOCK)
            except zmq.Again:
                more = False
                break
            try:
                received.append(messages.decode(frames, self._secret, self._max_msg_bytes))
            except messages.ForgedMessage:
                self.num_forged += 1
            except messages.WrongVersion:
                self.num_wrong_version += 1
            except messages.BadMessage:  # OversizedMessage included
                self.num_malformed += 1
            except Exception as e:  # decode raises only the above (fuzzed); never lose the batch anyway
                self.num_malformed += 1
                self.num_errors += 1
                self.last_error = repr(e)
        if received:
            with self._inbox_ready:
                room_left = max(0, self._max_inbox - len(self._inbox))
                self._inbox.extend(received[:room_left])
                self.num_inbox_dropped += len(received) - min(room_left, len(received))
                self.num_received += min(room_left, len(received))
                self._inbox_ready.notify_all()
        return more
