"""tracekit inside vLLM's OpenAI API server: live-control routes, the worker method they reach,
and tracekit's log lines in the server's log.

Why through vLLM's endpoint plugin (`vllm/plugins/endpoint_plugins/interface.py`) and a worker
method called by name through `collective_rpc`: docs/GUIDE.md, "Live control of a running server"
(the same in the 0.26, 0.32 and 0.34 series). What the method and routes do is decided above this
layer (`tracekit.record.live`); this module only carries requests and answers.
"""

import hashlib
import logging
import secrets
from typing import Any, Callable

from tracekit.errors import UsageError

logger = logging.getLogger("tracekit.record")

WORKER_METHOD = "tracekit_live"
API_KEY_VARIABLE = "VLLM_API_KEY"  # the server's API key where `--api-key` is not given (and the client's)
ROUTE_PREFIX = "/v1/tracekit"
OPERATIONS = {"arm": "POST", "status": "GET", "disarm": "POST"}
RPC_TIMEOUT_S = 120.0


def route_logs_to_vllm() -> None:
    """Send tracekit's log lines where vLLM sends its own, at vLLM's level: vLLM configures only
    its own logger, so without this tracekit's INFO lines never reach the server's log. Where the
    operator turned vLLM's logging configuration off, tracekit's lines go to the root logger."""
    vllm_logger = logging.getLogger("vllm")
    if not vllm_logger.handlers:
        return
    tracekit_logger = logging.getLogger("tracekit")
    tracekit_logger.handlers = list(vllm_logger.handlers)
    tracekit_logger.setLevel(vllm_logger.getEffectiveLevel())
    tracekit_logger.propagate = False


def install_worker_method(handle: Callable[[Any, str, dict], dict]) -> None:
    """Give vLLM's worker classes `tracekit_live(op, payload)`, which calls `handle(model_runner,
    op, payload)`: what the live-control routes reach through `collective_rpc`."""
    from tracekit.integrations.vllm.releases.installed import installed_release

    def tracekit_live(worker: Any, op: str, payload: dict) -> dict:
        return handle(worker.model_runner, op, payload)

    for worker_class in installed_release().worker_classes_here():
        setattr(worker_class, WORKER_METHOD, tracekit_live)


class LiveControlEndpoint:
    """vLLM's `EndpointPlugin`: routes `/v1/tracekit/{arm,status,disarm}`, each passing its request
    to `control` (a `tracekit.record.live.ServerControl`: `request` checks it and says what
    every worker gets, `answer` combines the workers' answers) and the workers between."""

    name = "tracekit"
    required_tasks = ("generate",)

    def __init__(self, control: Any):
        self.control = control
        self._engine: Any = None
        self._keys: list[bytes] = []

    def attach_router(self, app: Any) -> None:
        from fastapi import APIRouter

        router = APIRouter()
        for op, method in OPERATIONS.items():
            router.add_api_route(f"{ROUTE_PREFIX}/{op}", self._route(op), methods=[method])
        app.include_router(router)

    async def init_state(self, engine_client: Any, state: Any, args: Any) -> None:
        import vllm.envs as envs

        self._engine = engine_client
        # vLLM's own rule: --api-key, else VLLM_API_KEY (api_server.py / middleware/register.py)
        keys = [key for key in (getattr(args, "api_key", None) or [getattr(envs, API_KEY_VARIABLE)]) if key]
        self._keys = [hashlib.sha256(key.encode()).digest() for key in keys]

    def _authorized(self, authorization: str | None) -> bool:
        """The key checked here too: vLLM's middleware guards `/v1`, a release might guard less."""
        if not self._keys:
            return True
        scheme, _, token = (authorization or "").partition(" ")
        given = hashlib.sha256(token.encode()).digest()
        matched = [secrets.compare_digest(given, key) for key in self._keys]  # every key, in constant time
        return scheme.lower() == "bearer" and any(matched)

    def _route(self, op: str) -> Callable:
        from fastapi import Request
        from fastapi.responses import JSONResponse

        async def route(request: Request) -> JSONResponse:
            if not self._authorized(request.headers.get("Authorization")):
                return JSONResponse({"error": "Unauthorized"}, status_code=401)
            if self._engine is None:
                return JSONResponse({"error": "this server has no engine"}, status_code=503)
            by = f"{request.method} {request.url.path}"
            try:
                body = await request.json() if op == "arm" else {}
                sent = self.control.request(op, body, by)
            except ValueError:
                return JSONResponse({"error": "the body must be a JSON object of settings"}, status_code=400)
            except UsageError as error:
                return JSONResponse({"error": str(error)}, status_code=400)
            try:
                results = await self._call_workers(op, sent)
                status, reply, then = self.control.answer(op, sent, results)
                if then is not None:  # undo what some ranks did where another refused
                    await self._call_workers(then, {"by": f"{by} (refused on another rank)"})
            except Exception as error:  # the engine did not answer: say so, serving goes on
                logger.error("tracekit: live control %s failed: %s: %s", op, type(error).__name__, error)
                return JSONResponse({"error": f"the engine did not answer: {type(error).__name__}: {error}"},
                                    status_code=500)
            return JSONResponse(reply, status_code=status)

        route.__name__ = f"tracekit_{op}"
        return route

    async def _call_workers(self, op: str, payload: dict) -> list[dict]:
        return list(await self._engine.collective_rpc(WORKER_METHOD, timeout=RPC_TIMEOUT_S, args=(op, payload)))


class LiveControlOff:
    """The endpoint plugin where the operator did not name a bundle folder: no routes."""

    name = "tracekit"
    required_tasks = ("generate",)

    def __init__(self, why: str):
        self.why = why

    def attach_router(self, app: Any) -> None:
        logger.warning("tracekit: live control is off, no routes added: %s", self.why)

    async def init_state(self, engine_client: Any, state: Any, args: Any) -> None:
        return None
