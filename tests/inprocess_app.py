"""The daemon's HTTP app in-process (ASGI, no socket): for tests that need to reach into Serving."""

from __future__ import annotations

import asyncio
import os

import httpx


class Controller:
    """What the admin routes call for drain and reload; these tests never drain or reload."""

    async def drain(self, timeout, exit_after=True):
        return {}

    async def reload(self):
        return {}


def as_this_process(app):
    """The app seen from a Unix-socket peer that is this process (the server puts SO_PEERCRED there;
    an in-process transport has no socket), so the admin routes know who asks."""

    async def wrapped(scope, receive, send):
        state = scope.setdefault("state", {})
        state.setdefault("peer", (os.getpid(), os.getuid(), os.getgid()))
        state.setdefault("via", "unix")
        await app(scope, receive, send)

    return wrapped


def run_in_app(check, config: dict, load=(), prepare=None) -> None:
    """Build Serving and the app from a daemon config dict, call `prepare(serving)` (a test's injections),
    load `load`, run `await check(client, serving)`, and stop the engines."""
    from gpuservd.api.metrics import Metrics
    from gpuservd.api.server import build_app
    from gpuservd.serving.daemon_config import daemon_config_from_dict
    from gpuservd.serving.serving import Serving
    from gpuservd.serving.tenants import TenantMap

    config = {**config, "engine": {"isolation": "thread", **config.get("engine", {})}}  # as daemon_harness

    async def main():
        metrics = Metrics()
        serving = Serving(daemon_config_from_dict(config), TenantMap(), metrics)
        metrics.serving = serving
        if prepare is not None:
            prepare(serving)
        for name in load:
            await serving.load(name)
        serving.state = "serving"
        app = build_app(serving, metrics, Controller())
        try:
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=as_this_process(app)),
                                         base_url="http://t") as client:
                await check(client, serving)
        finally:
            await serving.stop_engines()

    asyncio.run(main())
