"""The OpenAI-compatible API as a server: uvicorn running :func:`~.app.create_app` in a
thread of the calling process (``tandem serve``, a test, a benchmark), so it can never
outlive it: :meth:`OpenAIFrontend.stop` ends it, and so does the process's end.

>>> with OpenAIFrontend("127.0.0.1:8001", ["tandem"], port=9000) as api:   # doctest: +SKIP
...     print(api.base_url)
http://127.0.0.1:9000/v1
"""
from __future__ import annotations

import threading
import time
from pathlib import Path

DEFAULT_PORT = 9000


class FrontendError(RuntimeError):
    """The frontend could not start (the port is taken, the app failed to start up)."""


class OpenAIFrontend:
    """uvicorn serving the OpenAI API for ``models`` of the tritonserver at gRPC ``triton_url``."""

    def __init__(self, triton_url: str, models: list[str], model_dir: str | Path | None = None, *,
                 host: str = "127.0.0.1", port: int = DEFAULT_PORT, log_level: str = "warning",
                 request_timeout_s: float = 600.0, api_key: str | None = None,
                 tool_call_parser: str | None = None, lora=None):
        if not 0 < port < 65536:
            raise FrontendError(f"port {port}; allowed: 1..65535")
        self.triton_url, self.models, self.model_dir = triton_url, list(models), model_dir
        self.host, self.port, self.log_level = host, port, log_level
        self.request_timeout_s = request_timeout_s
        self._api_key = api_key
        self.tool_call_parser = tool_call_parser
        self.lora = lora          # the server's adapters (client/openai/lora.py), or None
        self._server = None
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}/v1"

    def __enter__(self) -> "OpenAIFrontend":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self, timeout_s: float = 30.0) -> "OpenAIFrontend":
        import uvicorn

        from .app import create_app
        app = create_app(self.triton_url, self.models, self.model_dir, request_timeout_s=self.request_timeout_s,
                         api_key=self._api_key, tool_call_parser=self.tool_call_parser, lora=self.lora)
        # asyncio's loop (grpc.aio is made for it), no access log, and open streams get
        # 3 s to end at stop before they are cancelled (which cancels their gRPC streams)
        config = uvicorn.Config(app, host=self.host, port=self.port, loop="asyncio", log_level=self.log_level,
                                access_log=False, lifespan="on", timeout_graceful_shutdown=3)
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._run, name="tandem-openai", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self.stop()
                why = f": {self._error!r}" if self._error is not None and not isinstance(self._error, SystemExit) \
                    else " (is the port in use?)"
                raise FrontendError(f"the OpenAI API could not start on {self.host}:{self.port}{why}")
            time.sleep(0.02)
        return self

    def _run(self) -> None:
        try:
            self._server.run()
        except BaseException as exc:   # noqa: BLE001 - uvicorn exits with SystemExit on a bind error
            self._error = exc

    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def stop(self, timeout_s: float = 15.0) -> None:
        """Stop serving; returns when the thread has ended (open streams are cancelled)."""
        if self._server is None or self._thread is None:
            return
        self._server.should_exit = True
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            self._server.force_exit = True
            self._thread.join(5)
        self._thread = None


# ensembles that take token ids, not text, and the text ensembles' direct twins (the
# path the API streams from, not another model): nothing for the OpenAI API to list
TOKEN_ENSEMBLES = frozenset({"tandem_tokens"})


def text_models(options) -> list[str]:
    """The text ensembles a :class:`~tandem.client.serve.options.ServeOptions` serves
    (an ``--ensemble-name`` alias included), the OpenAI API's model ids."""
    from tandem.client.serve.options import DIRECT
    return [m for m in options.ensembles if m not in TOKEN_ENSEMBLES and m not in DIRECT.values()]


def start_for(server, port: int, log_level: str = "warning", api_key: str | None = None,
              tool_call_parser: str | None = None) -> OpenAIFrontend | None:
    """Start the frontend for a started :class:`~tandem.client.serve.triton_server.TritonServer`
    on its host (``tandem serve``); None when ``port`` is 0 or the server has no text
    ensemble (``--mode prefill``). With ``api_key``, ``/v1/*`` requires it;
    ``tool_call_parser`` reads ``tool_choice: "auto"`` answers."""
    models = text_models(server.options)
    if port == 0 or not models:
        return None
    return OpenAIFrontend(server.grpc_url, models, server.options.engine.model_dir, host=server.host, port=port,
                          log_level=log_level, api_key=api_key, tool_call_parser=tool_call_parser,
                          lora=lora_serving(server.options.engine)).start()


def lora_serving(engine):
    """The frontend's view of the server's LoRA adapters (None: the server serves none)."""
    registry = engine.adapters()
    if registry is None:
        return None
    from .lora import LoRAServing
    return LoRAServing(registry)
