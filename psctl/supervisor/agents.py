"""The supervisor's endpoint for the hosts' agents: one asyncio thread serves every agent's stream, so the
supervisor's threads do not grow with its hosts.

Reports go into the supervisor's inbox as observations (:class:`~psctl.supervisor.policy.Report`, and
:class:`~psctl.supervisor.policy.Detached` when a stream ends); commands go out with :meth:`AgentHub.send`,
from any thread. With TLS, a stream is taken only from the agent certificate of the host it names.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import grpc

from psctl.proto import psctl_pb2 as pb
from psctl.proto import psctl_pb2_grpc as pb_grpc
from psctl.runtime.cluster import TlsFiles
from psctl.runtime.limits import grpc_options
from psctl.runtime.rpc import SERVER_OPTIONS, caller
from psctl.supervisor.policy import Detached, Observation, Report

log = logging.getLogger("psctl.supervisor")


def agent_member(host: str) -> str:
    """The name of a host's agent in the cluster's PKI (its certificate's common name)."""
    return f"agent-{host}"


class AgentHub(pb_grpc.AgentLinkServicer):
    def __init__(self, inbox: queue.SimpleQueue[Observation], *, get_time: Callable[[], float] = time.monotonic,
                 tls: TlsFiles | None = None, on_change: Callable[[], None] = lambda: None) -> None:
        """``on_change``: called once an observation that the supervisor should act on at once is in ``inbox``:
        an agent attached or went, or reported a role that started, exited or was signalled."""
        self.inbox = inbox
        self.on_change = on_change
        self.time = get_time
        self.tls = tls
        self.port = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopped: asyncio.Event | None = None
        self._thread: threading.Thread | None = None
        #: (host, agent pid) -> that stream's outgoing commands (None ends the stream).
        self._streams: dict[tuple[str, int], asyncio.Queue[pb.AgentCommand | None]] = {}

    # -- life -----------------------------------------------------------------------------------------
    def start(self, bind: str) -> int:
        """Listen on ``bind`` (``127.0.0.1:0`` picks a port) in a thread of its own; returns the port."""
        ready = threading.Event()
        failure: list[BaseException] = []

        def serve() -> None:
            try:
                asyncio.run(self._serve(bind, ready))
            except BaseException as exc:  # reported to start(), which raises it
                failure.append(exc)
                ready.set()

        self._thread = threading.Thread(target=serve, name="psctl-agent-hub", daemon=True)
        self._thread.start()
        ready.wait()
        if failure:
            raise failure[0]
        return self.port

    async def _serve(self, bind: str, ready: threading.Event) -> None:
        self._loop = asyncio.get_running_loop()
        self._stopped = asyncio.Event()
        server = grpc.aio.server(options=[*grpc_options(), *SERVER_OPTIONS])
        pb_grpc.add_AgentLinkServicer_to_server(self, server)
        if self.tls is None:
            self.port = server.add_insecure_port(bind)
        else:
            creds = grpc.ssl_server_credentials(
                [(Path(self.tls.key).read_bytes(), Path(self.tls.cert).read_bytes())],
                root_certificates=Path(self.tls.ca).read_bytes(), require_client_auth=True)
            self.port = server.add_secure_port(bind, creds)
        if self.port == 0:
            raise OSError(f"cannot listen on {bind}")
        await server.start()
        ready.set()
        await self._stopped.wait()
        await server.stop(0.5)

    def stop(self) -> None:
        if self._loop is not None and self._stopped is not None:
            with contextlib.suppress(RuntimeError):  # the loop ended already
                self._loop.call_soon_threadsafe(self._stopped.set)
        if self._thread is not None:
            self._thread.join(timeout=5.0)

    # -- commands -------------------------------------------------------------------------------------
    def send(self, host: str, agent_pid: int, command: pb.AgentCommand | None) -> bool:
        """Queue ``command`` on the stream of that agent (None: end its stream); False if it has none."""
        outbox = self._streams.get((host, agent_pid))
        if outbox is None or self._loop is None:
            return False
        try:
            self._loop.call_soon_threadsafe(outbox.put_nowait, command)
        except RuntimeError:  # the loop is closed: the supervisor is stopping
            return False
        return True

    # -- the stream -----------------------------------------------------------------------------------
    async def Attach(self, request_iterator: AsyncIterator[pb.AgentReport],
                     context: grpc.aio.ServicerContext) -> AsyncIterator[pb.AgentCommand]:
        outbox: asyncio.Queue[pb.AgentCommand | None] = asyncio.Queue()
        hello = await anext(aiter(request_iterator), None)
        if hello is None:
            return
        if not self._certified(hello.host, context):
            await context.abort(grpc.StatusCode.PERMISSION_DENIED,
                                f"only the agent of host {hello.host!r} may attach as that host")
        key = (hello.host, hello.agent_pid)
        self._streams[key] = outbox
        self.inbox.put(Report(hello.host, self.time(), hello))
        self.on_change()
        reason = "its agent's stream ended"

        async def read() -> None:
            nonlocal reason
            try:
                async for report in request_iterator:
                    self.inbox.put(Report(hello.host, self.time(), report))
                    if report.changed:
                        self.on_change()
            except (grpc.RpcError, asyncio.CancelledError) as exc:
                reason = f"its agent's stream broke ({type(exc).__name__})"
            finally:
                outbox.put_nowait(None)

        reader = asyncio.ensure_future(read())
        try:
            while (command := await outbox.get()) is not None:
                yield command
        finally:
            reader.cancel()
            if self._streams.get(key) is outbox:
                del self._streams[key]
            self.inbox.put(Detached(hello.host, hello.agent_pid, reason))
            self.on_change()

    def _certified(self, host: str, context: grpc.aio.ServicerContext) -> bool:
        if self.tls is None:
            return True
        return caller(context) == agent_member(host)
