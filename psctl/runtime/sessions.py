"""Request and answer over long-lived bidirectional gRPC streams ("sessions").

gRPC Python spends much of a unary call on the call itself: setting it up and tearing it down, on both ends.
On a stream that stays open, each request gets its answer for less (``python -m benchmarks.sessions``, 2-core
machine, 2 clients; CPU ms per call, session against unary: 325 KB each way, server 0.25 against 0.39, client
0.28 alike; 4 MiB, server 2.2 against 3.5, client 1.9 against 5.4). A worker's step makes one such call per ps.

A session carries one exchange at a time: a request message, then its answer, in order. A
:class:`SessionPool` keeps the idle sessions of one rpc on one channel and opens another when all are busy (a
pipelined worker has two steps in flight). The server answers each request as its unary twin would; a failure
ends the session with the status the unary call would have ended with, so callers see the same errors.

Every session is opened with a gRPC deadline of twice the exchange timeout and is used only while a whole
timeout is left of it: an exchange waits at most two timeouts, as a unary call waits one (a dead host fails it
sooner, by keepalive). Expired and failed sessions, and idle ones the server ended (it restarted), are closed,
never reused.

A server holds a thread per open session (gRPC Python's synchronous server), so it limits them
(:class:`SessionSlots`) and refuses more with RESOURCE_EXHAUSTED before reading any request; the pool then
makes its calls unary for a while. A server without the session rpcs (UNIMPLEMENTED) is treated alike.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import grpc

#: Sessions a PS serves at once (a thread each; a worker holds up to two per PS, four when pipelined).
SESSIONS_PER_PS = 128
#: After a refusal, calls go unary for this long before a session is tried again.
REFUSED_BACKOFF = 30.0
#: The refusal's details (the client recognises a server that is full by them).
SESSIONS_FULL = "sessions: this server holds as many open sessions as it serves"

_END = object()  # closes a session's request stream


class SessionEnded(Exception):
    """The server ended a session without an answer (it is shutting down)."""


class _Session:
    """One open stream, used for one exchange at a time."""

    def __init__(self, method: grpc.StreamStreamMultiCallable, lifetime: float) -> None:
        self._requests: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self.expires = time.monotonic() + lifetime
        #: Answers received: a refusal of a session with none means the server ran nothing of the request.
        self.answered = 0
        self._answers = method(iter(self._requests.get, _END), timeout=lifetime)

    def usable(self, now: float, timeout: float) -> bool:
        """Open (the server may have ended it while it was idle: it restarted) with ``timeout`` s of life left."""
        return self.expires - now > timeout and not self._answers.done()

    def send(self, request: Any) -> None:
        self._requests.put(request)

    def receive(self) -> Any:
        try:
            answer = next(self._answers)
        except StopIteration:
            raise SessionEnded("the server ended the session") from None
        self.answered += 1
        return answer

    def close(self) -> None:
        """End it: its request stream (else gRPC's thread that reads it waits forever), and the call."""
        self._requests.put(_END)
        self._answers.cancel()


def _refused(exc: grpc.RpcError) -> bool:
    code = exc.code()  # type: ignore[attr-defined]
    return code == grpc.StatusCode.UNIMPLEMENTED or (
        code == grpc.StatusCode.RESOURCE_EXHAUSTED and (exc.details() or "").startswith(SESSIONS_FULL)  # type: ignore[attr-defined]
    )


class Exchange:
    """One request in flight on a session (or unary, where sessions are refused): ``result()`` waits for its
    answer; ``cancel()`` gives up on it (an answer never read would leave the session out of step)."""

    def __init__(self, pool: SessionPool, request: Any, timeout: float) -> None:
        self._pool, self._request, self._timeout = pool, request, timeout
        self._session: _Session | None = None
        self._unary: grpc.Future | None = None
        if pool.refused():
            self._unary = pool.unary.future(request, timeout=timeout)
        else:
            self._session = pool.take(timeout)
            self._session.send(request)

    def result(self) -> Any:
        if self._unary is not None:
            return self._unary.result()
        session, self._session = self._session, None
        assert session is not None
        try:
            answer = session.receive()
        except BaseException as exc:
            session.close()  # a failed session is never reused
            if isinstance(exc, grpc.RpcError) and not session.answered and _refused(exc):
                self._pool.refuse()  # nothing of this request ran: send it unary
                return self._pool.unary(self._request, timeout=self._timeout)
            raise
        self._pool.give_back(session)
        return answer

    def cancel(self) -> None:
        if self._session is not None:
            self._session.close()
            self._session = None
        if self._unary is not None:
            self._unary.cancel()


class SessionPool:
    """The sessions of one stream-stream rpc on one channel; ``unary`` is the same rpc as a unary call. Called
    as that unary rpc is (``pool(request, timeout=...)``, ``pool.future(request, timeout=...)``)."""

    def __init__(self, method: grpc.StreamStreamMultiCallable, unary: grpc.UnaryUnaryMultiCallable) -> None:
        self._method = method
        self.unary = unary
        self._idle: list[_Session] = []
        self._lock = threading.Lock()
        self._closed = False
        self._refused_until = 0.0

    def future(self, request: Any, *, timeout: float) -> Exchange:
        """Send ``request``; its answer is the returned exchange's ``result()``."""
        return Exchange(self, request, timeout)

    def __call__(self, request: Any, *, timeout: float) -> Any:
        return self.future(request, timeout=timeout).result()

    def refused(self) -> bool:
        return time.monotonic() < self._refused_until

    def refuse(self) -> None:
        self._refused_until = time.monotonic() + REFUSED_BACKOFF

    def take(self, timeout: float) -> _Session:
        """An idle session that can carry an exchange of ``timeout`` seconds, or a new one."""
        expired = []
        session = None
        now = time.monotonic()
        with self._lock:
            while self._idle and session is None:
                candidate = self._idle.pop()
                if candidate.usable(now, timeout):
                    session = candidate
                else:
                    expired.append(candidate)
        for old in expired:
            old.close()
        return session if session is not None else _Session(self._method, lifetime=2 * timeout)

    def give_back(self, session: _Session) -> None:
        with self._lock:
            if not self._closed:
                self._idle.append(session)
                return
        session.close()

    def close(self) -> None:
        """Close the idle sessions; those in use are closed when given back."""
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for session in idle:
            session.close()


class SessionSlots:
    """A server's count of open sessions, refusing those beyond its limit before they read a request."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.open = 0
        #: Sessions opened so far, and those refused (the server was full).
        self.opened = 0
        self.refused = 0
        self._lock = threading.Lock()

    @contextmanager
    def held(self, context: grpc.ServicerContext) -> Iterator[None]:
        with self._lock:
            full = self.open >= self.limit
            if full:
                self.refused += 1
            else:
                self.open += 1
                self.opened += 1
        if full:
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"{SESSIONS_FULL} ({self.limit})")
        try:
            yield
        finally:
            with self._lock:
                self.open -= 1

    def serve(
        self, requests: Iterator[Any], context: grpc.ServicerContext, answer: Callable[[Any, Any], Any]
    ) -> Iterator[Any]:
        """A session's handler: each request's answer as ``answer`` (the unary handler) gives it."""
        with self.held(context):
            for request in requests:
                yield answer(request, context)
