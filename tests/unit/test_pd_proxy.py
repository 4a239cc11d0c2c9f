"""kvtier pd-proxy against stand-in servers (real HTTP on loopback, no engine).

What each server receives, round-robin, streaming passed through as it comes, errors
named; the proxy against real vLLM servers is tests/vllm/test_pd.py.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

import pytest

aiohttp = pytest.importorskip("aiohttp", reason="kvtier pd-proxy needs kvtier[pd]")
from aiohttp import web  # noqa: E402

from kvtier import pd_proxy  # noqa: E402
from kvtier.pd_proxy import PDProxy, decode_body, normalize_url, prefill_body  # noqa: E402
from tests.vllm.pdlab import free_port  # noqa: E402

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class Stand:
    """A stand-in server: records each request's path and JSON body."""

    def __init__(self, name: str, handler: Handler | None = None) -> None:
        self.name = name
        self.seen: list[tuple[str, Any]] = []
        self._handler = handler
        self.runner: web.AppRunner | None = None
        self.url = ""

    async def _any(self, request: web.Request) -> web.StreamResponse:
        body = await request.json() if request.can_read_body else None
        self.seen.append((request.path, body))
        if self._handler is not None:
            return await self._handler(request)
        return web.json_response({"server": self.name, "kv_transfer_params":
                                  {"kvtier": {"blocks": 3}}, "choices": [{"text": "x"}]})

    async def start(self) -> None:
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self._any)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        port = free_port()
        await web.TCPSite(self.runner, "127.0.0.1", port).start()
        self.url = f"http://127.0.0.1:{port}"

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()


async def _proxy(prefill: list[str], decode: list[str]) -> tuple[web.AppRunner, str]:
    runner = web.AppRunner(PDProxy(prefill, decode, timeout=10).app())
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner, f"http://127.0.0.1:{port}"


def run(coro: Callable[[], Coroutine[Any, Any, None]]) -> None:
    asyncio.run(coro())


def test_prefill_gets_one_token_without_streaming_and_decode_the_request_as_sent() -> None:
    body = {"model": "m", "prompt": [5, 6, 7], "max_tokens": 50, "stream": True,
            "stream_options": {"include_usage": True}, "n": 1, "temperature": 0}
    pre = prefill_body(body, "/v1/completions")
    assert pre == {"model": "m", "prompt": [5, 6, 7], "max_tokens": 1, "stream": False,
                   "n": 1, "temperature": 0}
    chat = prefill_body({"messages": [], "max_completion_tokens": 9}, "/v1/chat/completions")
    assert chat["max_completion_tokens"] == 1 and chat["max_tokens"] == 1
    assert body["max_tokens"] == 50  # not modified in place
    answer = {"kv_transfer_params": {"kvtier": {"blocks": 4}}}
    assert decode_body(body, answer) == {**body, "kv_transfer_params": {"kvtier": {"blocks": 4}}}
    assert decode_body(body, {"choices": []}) is body
    mine = {**body, "kv_transfer_params": {"other": 1}}
    assert decode_body(mine, answer)["kv_transfer_params"] == {"other": 1,
                                                               "kvtier": {"blocks": 4}}


def test_round_robin_over_prefill_and_decode_servers() -> None:
    async def go() -> None:
        stands = [Stand("p0"), Stand("p1"), Stand("d0"), Stand("d1")]
        for s in stands:
            await s.start()
        runner, url = await _proxy([stands[0].url, stands[1].url],
                                   [stands[2].url, stands[3].url])
        try:
            async with aiohttp.ClientSession() as c:
                for i in range(4):
                    async with c.post(url + "/v1/completions",
                                      json={"prompt": [i], "max_tokens": 7}) as r:
                        assert r.status == 200
                        assert (await r.json())["server"] == f"d{i % 2}"
        finally:
            await runner.cleanup()
            for s in stands:
                await s.stop()
        for k, s in enumerate(stands):
            assert [b["prompt"] for _, b in s.seen] == [[k % 2], [k % 2 + 2]]
        for _, b in stands[0].seen + stands[1].seen:
            assert b["max_tokens"] == 1 and b["stream"] is False
        for _, b in stands[2].seen + stands[3].seen:
            assert b["max_tokens"] == 7
            assert b["kv_transfer_params"] == {"kvtier": {"blocks": 3}}

    run(go)


def test_the_decode_answer_is_streamed_through_as_it_comes() -> None:
    async def slow_stream(request: web.Request) -> web.StreamResponse:
        out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await out.prepare(request)
        for i in range(5):
            await out.write(f"data: {json.dumps({'i': i})}\n\n".encode())
            await asyncio.sleep(0.15)
        await out.write(b"data: [DONE]\n\n")
        return out

    async def go() -> None:
        p, d = Stand("p"), Stand("d", slow_stream)
        await p.start()
        await d.start()
        runner, url = await _proxy([p.url], [d.url])
        times: list[float] = []
        try:
            async with aiohttp.ClientSession() as c:
                t0 = time.perf_counter()
                async with c.post(url + "/v1/completions",
                                  json={"prompt": [1], "stream": True}) as r:
                    assert r.status == 200
                    assert r.headers["Content-Type"].startswith("text/event-stream")
                    async for line in r.content:
                        if line.startswith(b"data: {"):
                            times.append(time.perf_counter() - t0)
        finally:
            await runner.cleanup()
            await p.stop()
            await d.stop()
        assert len(times) == 5
        # The first event reached the client while the server was still writing.
        assert times[-1] - times[0] > 0.4, times

    run(go)


def test_a_prefill_4xx_is_the_clients_answer_and_decode_is_not_asked() -> None:
    async def refuse(request: web.Request) -> web.StreamResponse:
        return web.json_response({"error": {"message": "prompt too long"}}, status=400)

    async def go() -> None:
        p, d = Stand("p", refuse), Stand("d")
        await p.start()
        await d.start()
        runner, url = await _proxy([p.url], [d.url])
        try:
            async with aiohttp.ClientSession() as c, \
                    c.post(url + "/v1/completions", json={"prompt": [1]}) as r:
                assert r.status == 400
                assert (await r.json())["error"]["message"] == "prompt too long"
        finally:
            await runner.cleanup()
            await p.stop()
            await d.stop()
        assert d.seen == []

    run(go)


def test_a_dead_or_failing_server_is_a_502_naming_phase_server_and_reason() -> None:
    async def boom(request: web.Request) -> web.StreamResponse:
        return web.Response(status=500, text="engine dead")

    async def go() -> None:
        ok, bad = Stand("ok"), Stand("bad", boom)
        await ok.start()
        await bad.start()
        dead = f"http://127.0.0.1:{free_port()}"
        cases = [([dead], [ok.url], "prefill", dead, "Connect"),
                 ([bad.url], [ok.url], "prefill", bad.url, "HTTP 500: engine dead"),
                 ([ok.url], [dead], "decode", dead, "Connect"),
                 ([ok.url], [bad.url], "decode", bad.url, "HTTP 500: engine dead")]
        try:
            for pre, dec, phase, server, why in cases:
                runner, url = await _proxy(pre, dec)
                try:
                    async with aiohttp.ClientSession() as c:
                        async with c.post(url + "/v1/completions", json={"prompt": [1]}) as r:
                            assert r.status == 502
                            err = (await r.json())["error"]
                        assert err["phase"] == phase and err["server"] == server
                        assert why in err["reason"], err
                        assert err["message"].startswith(f"{phase} server {server}: ")
                        async with c.get(url + "/health") as r:
                            health = await r.json()
                            if server == dead:
                                assert r.status == 503 and health["status"] == "unavailable"
                                assert health[phase][dead] != "ok"
                finally:
                    await runner.cleanup()
        finally:
            await ok.stop()
            await bad.stop()

    run(go)


def test_models_and_health_and_bad_requests() -> None:
    async def go() -> None:
        p, d = Stand("p"), Stand("d")
        await p.start()
        await d.start()
        runner, url = await _proxy([p.url], [d.url])
        try:
            async with aiohttp.ClientSession() as c:
                async with c.get(url + "/v1/models") as r:
                    assert r.status == 200 and (await r.json())["server"] == "d"
                async with c.get(url + "/health") as r:
                    assert r.status == 200
                    assert await r.json() == {"status": "ok", "prefill": {p.url: "ok"},
                                              "decode": {d.url: "ok"}}
                async with c.post(url + "/v1/completions", data=b"{not json") as r:
                    assert r.status == 400
                    assert "not JSON" in (await r.json())["error"]["message"]
                async with c.post(url + "/v1/completions", json=[1, 2]) as r:
                    assert r.status == 400
        finally:
            await runner.cleanup()
            await p.stop()
            await d.stop()
        assert d.seen == [("/v1/models", None), ("/health", None)]

    run(go)


def test_server_urls_and_the_command_line() -> None:
    assert normalize_url("http://10.0.0.1:8100/") == "http://10.0.0.1:8100"
    for bad in ("10.0.0.1:8100", "ftp://h:1", "http://h:1/v1", "http://"):
        with pytest.raises(ValueError):
            normalize_url(bad)
    with pytest.raises(ValueError, match="at least one decode server"):
        PDProxy(["http://a:1"], [])
    with pytest.raises(SystemExit) as exc:
        pd_proxy.main(["--prefill", "http://a:1", "--decode", "http://b:1/v1"])
    assert exc.value.code == 2
