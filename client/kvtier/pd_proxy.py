"""``kvtier pd-proxy``: disaggregated prefill/decode in front of vLLM OpenAI servers.

    kvtier pd-proxy --prefill http://p1:8100 http://p2:8100 --decode http://d1:8200 --port 8000

Every ``POST /v1/completions`` and ``POST /v1/chat/completions`` goes twice:

1. to the next **prefill** server (round-robin), as a non-streaming request for one token
   (``max_tokens``/``max_completion_tokens`` 1, ``n`` 1).  That server runs the kvtier
   connector as ``kv_producer``: by the time it answers, every full block of the prompt is
   committed in its kvtierd (the connector saves a producer's blocks within the step).
2. to the next **decode** server with the client's request unchanged, plus the
   ``kv_transfer_params`` the prefill answer carried (the number of blocks the producer
   holds, so a consumer can wait for blocks still on their way through the cluster tier
   instead of recomputing them).  The decode server (``kv_consumer``) finds the prompt's
   blocks by its keys, loads them and decodes; its answer -- streamed or not, status and
   body -- goes back to the client as it comes.

A server that cannot be reached, times out or answers 5xx makes the proxy answer
``502`` with a JSON body naming the phase, the server and the reason; a prefill answer of
4xx (a bad request: too long a prompt, an unknown model) is passed through as is, since
the decode server would refuse it the same way.  Nothing is retried on another server: a
prompt is never prefilled twice behind the client's back.  ``GET /v1/models`` is the next
decode server's; ``GET /health`` is 200 while at least one prefill and one decode server
answer their own ``/health``, else 503 with each one's state.

It needs ``aiohttp`` (``pip install kvtier[pd]``; vLLM installs it too).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import logging
import sys
import urllib.parse
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any, Final

if TYPE_CHECKING:
    import aiohttp
    from aiohttp import web

logger = logging.getLogger("kvtier.pd_proxy")

#: Paths the proxy splits into a prefill and a decode request.
GENERATE_PATHS: Final = ("/v1/completions", "/v1/chat/completions")
#: Request headers passed on to the servers (others are hop-by-hop or the proxy's own).
FORWARD_HEADERS: Final = ("authorization", "x-request-id", "traceparent", "tracestate")
#: Fields of a request that make no sense for the one-token prefill request.
_PREFILL_DROP: Final = ("stream_options", "min_tokens", "logprobs", "top_logprobs",
                        "echo", "best_of", "response_format")
#: A server that accepts no connection within this many seconds is down.
CONNECT_TIMEOUT: Final = 10.0


class BackendError(Exception):
    """A server could not serve its part; becomes a 502 naming ``phase`` and ``url``."""

    def __init__(self, phase: str, url: str, why: str) -> None:
        super().__init__(f"{phase} server {url}: {why}")
        self.phase, self.url, self.why = phase, url, why

    def body(self) -> dict[str, Any]:
        return {"error": {"message": str(self), "type": "bad_gateway", "code": 502,
                          "phase": self.phase, "server": self.url, "reason": self.why}}


def normalize_url(url: str) -> str:
    """``http://host:port`` of a server URL; ValueError for anything else."""
    parts = urllib.parse.urlsplit(url.strip())
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ValueError(f"not an http(s) server URL: {url!r}")
    if parts.path not in ("", "/") or parts.query or parts.fragment:
        raise ValueError(f"give the server's base URL, without a path: {url!r}")
    return f"{parts.scheme}://{parts.netloc}"


def prefill_body(body: dict[str, Any], path: str) -> dict[str, Any]:
    """The one-token, non-streaming request the prefill server gets."""
    out = {k: v for k, v in body.items() if k not in _PREFILL_DROP}
    out["stream"] = False
    out["n"] = 1
    if path.endswith("/chat/completions") and "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    out["max_tokens"] = 1
    return out


def decode_body(body: dict[str, Any], prefill_answer: Any) -> dict[str, Any]:
    """The client's request, with the producer's ``kv_transfer_params`` if it sent any."""
    params = prefill_answer.get("kv_transfer_params") if isinstance(prefill_answer, dict) \
        else None
    if not isinstance(params, dict):
        return body
    merged = dict(body.get("kv_transfer_params") or {})
    merged.update(params)
    return {**body, "kv_transfer_params": merged}


class _Pool:
    """Round-robin over the servers of one phase."""

    def __init__(self, phase: str, urls: Sequence[str]) -> None:
        if not urls:
            raise ValueError(f"at least one {phase} server is needed")
        self.phase = phase
        self.urls = [normalize_url(u) for u in urls]
        self._next: Iterator[str] = itertools.cycle(self.urls)

    def pick(self) -> str:
        return next(self._next)


class PDProxy:
    """The proxy's state: two pools and one HTTP client session."""

    def __init__(self, prefill: Sequence[str], decode: Sequence[str], *,
                 timeout: float = 600.0) -> None:
        self.prefill = _Pool("prefill", prefill)
        self.decode = _Pool("decode", decode)
        self.timeout = timeout
        self._session: aiohttp.ClientSession | None = None

    # ------------------------------------------------------------ app wiring
    def app(self) -> web.Application:
        from aiohttp import web

        app = web.Application(client_max_size=64 << 20)
        for path in GENERATE_PATHS:
            app.router.add_post(path, self.generate)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        app.on_startup.append(self._open)
        app.on_cleanup.append(self._close)
        return app

    async def _open(self, _app: web.Application) -> None:
        import aiohttp

        # No overall deadline: a long generation streams for as long as it takes; a
        # server that stops sending for ``timeout`` seconds is a failure.
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(
            total=None, connect=CONNECT_TIMEOUT, sock_read=self.timeout), auto_decompress=False)

    async def _close(self, _app: web.Application) -> None:
        if self._session is not None:
            await self._session.close()

    @property
    def session(self) -> aiohttp.ClientSession:
        assert self._session is not None, "the proxy's app has not started"
        return self._session

    # ------------------------------------------------------------ handlers
    async def generate(self, request: web.Request) -> web.StreamResponse:
        from aiohttp import web

        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            return _error(400, f"the request body is not JSON: {exc}")
        if not isinstance(body, dict):
            return _error(400, "the request body must be a JSON object")
        headers = {k: v for k, v in request.headers.items() if k.lower() in FORWARD_HEADERS}
        path = request.path
        try:
            answer = await self._prefill(path, body, headers)
        except BackendError as exc:
            logger.warning("%s", exc)
            return web.json_response(exc.body(), status=502)
        if isinstance(answer, web.Response):
            return answer  # the prefill server refused the request (4xx): the client's error
        return await self._decode(request, path, decode_body(body, answer), headers)

    async def _prefill(self, path: str, body: dict[str, Any], headers: dict[str, str]
                       ) -> Any:
        """The prefill server's JSON answer; a Response to pass on for a 4xx."""
        import aiohttp
        from aiohttp import web

        url = self.prefill.pick()
        try:
            async with self.session.post(url + path, json=prefill_body(body, path),
                                         headers=headers) as resp:
                raw = await resp.read()
                if 400 <= resp.status < 500:
                    return web.Response(status=resp.status, body=raw,
                                        content_type=resp.content_type or "application/json")
                if resp.status != 200:
                    raise BackendError("prefill", url, f"HTTP {resp.status}: "
                                       f"{raw[:300].decode(errors='replace')}")
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            raise BackendError("prefill", url, _why(exc)) from None
        try:
            return json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise BackendError("prefill", url, "its answer is not JSON") from None

    async def _decode(self, request: web.Request, path: str, body: dict[str, Any],
                      headers: dict[str, str]) -> web.StreamResponse:
        import aiohttp
        from aiohttp import web

        url = self.decode.pick()
        out: web.StreamResponse | None = None
        try:
            async with self.session.post(url + path, json=body, headers=headers) as resp:
                if resp.status >= 500:
                    raw = await resp.read()
                    raise BackendError("decode", url, f"HTTP {resp.status}: "
                                       f"{raw[:300].decode(errors='replace')}")
                out = web.StreamResponse(status=resp.status)
                for name in ("Content-Type", "Content-Encoding", "Cache-Control"):
                    if name in resp.headers:
                        out.headers[name] = resp.headers[name]
                await out.prepare(request)
                async for chunk in resp.content.iter_any():
                    await out.write(chunk)
                await out.write_eof()
                return out
        except (aiohttp.ClientError, TimeoutError, OSError, BackendError) as exc:
            err = exc if isinstance(exc, BackendError) else \
                BackendError("decode", url, _why(exc))
            logger.warning("%s", err)
            if out is None:
                return web.json_response(err.body(), status=502)
            # Headers went out already: the client sees the stream end early.
            raise ConnectionResetError(str(err)) from None

    async def models(self, request: web.Request) -> web.StreamResponse:
        import aiohttp
        from aiohttp import web

        url = self.decode.pick()
        headers = {k: v for k, v in request.headers.items() if k.lower() in FORWARD_HEADERS}
        try:
            async with self.session.get(url + "/v1/models", headers=headers) as resp:
                raw = await resp.read()
                return web.Response(status=resp.status, body=raw,
                                    content_type=resp.content_type or "application/json")
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            return web.json_response(BackendError("decode", url, _why(exc)).body(), status=502)

    async def health(self, _request: web.Request) -> web.StreamResponse:
        from aiohttp import web

        urls = [(p.phase, u) for p in (self.prefill, self.decode) for u in p.urls]
        states = await asyncio.gather(*(self._probe(u) for _, u in urls))
        report: dict[str, dict[str, str]] = {"prefill": {}, "decode": {}}
        for (phase, url), state in zip(urls, states, strict=True):
            report[phase][url] = state
        ok = all(any(s == "ok" for s in report[phase].values()) for phase in report)
        return web.json_response({"status": "ok" if ok else "unavailable", **report},
                                 status=200 if ok else 503)

    async def _probe(self, url: str) -> str:
        import aiohttp

        try:
            async with self.session.get(url + "/health",
                                        timeout=aiohttp.ClientTimeout(total=5)) as resp:
                return "ok" if resp.status == 200 else f"HTTP {resp.status}"
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            return _why(exc)


def _why(exc: BaseException) -> str:
    if isinstance(exc, TimeoutError):
        return "timed out"
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


def _error(status: int, message: str) -> web.Response:
    from aiohttp import web

    return web.json_response({"error": {"message": message, "type": "invalid_request_error",
                                        "code": status}}, status=status)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="kvtier pd-proxy", description=(
        "OpenAI-compatible proxy for disaggregated prefill/decode: each request is "
        "prefilled (one token) on a prefill server, then decoded on a decode server"))
    p.add_argument("--prefill", nargs="+", required=True, metavar="URL",
                   help="prefill servers (vLLM with the kvtier connector, kv_producer)")
    p.add_argument("--decode", nargs="+", required=True, metavar="URL",
                   help="decode servers (vLLM with the kvtier connector, kv_consumer)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default %(default)s)")
    p.add_argument("--port", type=int, default=8000, help="port (default %(default)s)")
    p.add_argument("--timeout", type=float, default=600.0,
                   help="a server silent for this many seconds fails the request "
                   "(default %(default)s)")
    args = p.parse_args(argv)
    try:
        from aiohttp import web
    except ImportError:
        print("kvtier pd-proxy needs aiohttp: pip install 'kvtier[pd]'", file=sys.stderr)
        return 2
    if args.timeout <= 0:
        p.error(f"--timeout must be positive, got {args.timeout:g}")
    try:
        proxy = PDProxy(args.prefill, args.decode, timeout=args.timeout)
    except ValueError as exc:
        p.error(str(exc))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    logger.info("prefill %s; decode %s; listening on %s:%d", ", ".join(proxy.prefill.urls),
                ", ".join(proxy.decode.urls), args.host, args.port)
    web.run_app(proxy.app(), host=args.host, port=args.port, print=None)
    return 0


__all__ = ["BackendError", "PDProxy", "decode_body", "main", "normalize_url", "prefill_body"]
