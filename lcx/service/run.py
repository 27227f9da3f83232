"""Running the app under uvicorn, with a drain on SIGTERM: the first signal stops new requests (503) and lets the
running ones finish, then the process exits; a second signal exits at once (uvicorn's own handling).

Connections are guarded (``guarded_protocol``): each holds a file descriptor, so idle or half-sent ones (a slow
client, or thousands of them on purpose) must not pile up - at most ``max_connections`` are open (more are closed
at once), and a connection on which no request head completes within ``header_timeout`` seconds is closed."""

from __future__ import annotations

import logging
import threading
import time

import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger("lcx.serve")


class DrainingServer(uvicorn.Server):
    """``uvicorn.Server`` whose first exit signal drains the engine before exiting."""

    def __init__(self, config: uvicorn.Config, service):
        super().__init__(config)
        self.service = service

    def handle_exit(self, sig, frame) -> None:
        engine = self.service.engine
        if engine.draining:  # a second signal: exit now
            return super().handle_exit(sig, frame)
        engine.draining = True
        log.warning("draining: new requests get 503; exiting when the running ones are done")
        threading.Thread(target=self._exit_when_idle, args=(sig, frame), daemon=True).start()

    def _exit_when_idle(self, sig, frame) -> None:
        while not self.service.engine.idle:
            time.sleep(0.05)
        # not uvicorn's handle_exit: it records the signal and raises it again after shutdown, whose default action
        # would kill the process (exit -15, no clean-up) after a clean drain
        self.should_exit = True


class _GuardedH11(H11Protocol):
    """uvicorn's h11 protocol with the two guards of the module docstring (set by ``guarded_protocol``)."""

    max_connections = 1024
    header_timeout = 10.0

    def connection_made(self, transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._seen = self._guard = None
        if len(self.connections) > self.max_connections:
            transport.close()
            return
        self._guard = self.loop.call_later(self.header_timeout, self._check_head)

    def _check_head(self) -> None:
        # No request in progress and none begun since the last check: the client sends no complete head. (A
        # request running for long - a stream - has a cycle in progress; an idle keep-alive connection is closed by
        # uvicorn's own keep-alive timeout, unless it has begun a head, which this check catches.)
        idle = self.cycle is None or self.cycle.response_complete
        if idle and self.cycle is self._seen:
            self.transport.close()
            return
        self._seen = self.cycle
        self._guard = self.loop.call_later(self.header_timeout, self._check_head)

    def connection_lost(self, exc) -> None:
        if self._guard is not None:
            self._guard.cancel()
        super().connection_lost(exc)


def guarded_protocol(max_connections: int, header_timeout: float) -> type:
    """The protocol class for ``uvicorn.Config(http=...)`` with these guards."""
    return type("GuardedH11", (_GuardedH11,), {"max_connections": max_connections, "header_timeout": header_timeout})


def uvicorn_config(service, host: str, port: int, log_level: str = "info") -> uvicorn.Config:
    from lcx.service.app import create_app

    config = service.config
    return uvicorn.Config(create_app(service), host=host, port=port, log_level=log_level, access_log=False,
                          timeout_graceful_shutdown=5,
                          http=guarded_protocol(config.max_connections, config.header_timeout))


def serve(service, host: str, port: int, log_level: str = "info") -> None:
    DrainingServer(uvicorn_config(service, host, port, log_level), service).run()


__all__ = ["DrainingServer", "guarded_protocol", "serve", "uvicorn_config"]
