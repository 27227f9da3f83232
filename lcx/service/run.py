"""Running the app under uvicorn, with a drain on SIGTERM: the first signal stops new requests (503) and lets the
running ones finish, then the process exits; a second signal exits at once (uvicorn's own handling)."""

from __future__ import annotations

import logging
import threading
import time

import uvicorn

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


def serve(service, host: str, port: int, log_level: str = "info") -> None:
    from lcx.service.app import create_app

    config = uvicorn.Config(create_app(service), host=host, port=port, log_level=log_level, access_log=False,
                            timeout_graceful_shutdown=5)
    DrainingServer(config, service).run()


__all__ = ["DrainingServer", "serve"]
