"""A lying regional tier for tests: passes requests on to the hub and damages the answers.

``python -m tests.helpers.bad_tier --listen HOST:PORT --upstream HOST:PORT --mode MODE``:

- ``flip``: one byte in the middle of every blob and pack answer is changed (a bad disk or
  a buggy cache);
- ``truncate``: every blob answer announces its full length, sends half and closes;
- ``other-slice``: every blob answer for a range carries the bytes at the next offset of
  the same length (a cache that mixed up its slices), status and headers unchanged.
"""

from __future__ import annotations

import argparse

import aiohttp
from aiohttp import web

_PASSED = ("Content-Type", "Content-Range", "ETag", "Cache-Control", "Accept-Ranges",
           "X-Spokefs-Error")


def make_app(upstream: str, mode: str) -> web.Application:
    session: dict[str, aiohttp.ClientSession] = {}

    async def startup(app: web.Application) -> None:
        session["s"] = aiohttp.ClientSession(auto_decompress=False)

    async def cleanup(app: web.Application) -> None:
        await session["s"].close()

    async def fetch(path: str, headers: dict[str, str]) -> tuple[int, dict[str, str], bytes]:
        async with session["s"].get(f"http://{upstream}{path}", headers=headers) as resp:
            body = await resp.read()
            return resp.status, {k: resp.headers[k] for k in _PASSED if k in resp.headers}, body

    async def handle(request: web.Request) -> web.StreamResponse:
        headers = {k: v for k, v in request.headers.items()
                   if k in ("Range", "Authorization")}
        status, out_headers, body = await fetch(request.path_qs, headers)
        data_route = request.path.startswith(("/v2/blob/", "/v2/pack/"))
        if status in (200, 206) and data_route and body:
            if mode == "flip":
                damaged = bytearray(body)
                damaged[len(body) // 2] ^= 0x40
                body = bytes(damaged)
            elif mode == "other-slice" and "Range" in headers:
                first, last = map(int, headers["Range"].removeprefix("bytes=").split("-"))
                n = last - first + 1
                _, _, other = await fetch(request.path, {"Range": f"bytes={first + n}-"
                                                                  f"{first + 2 * n - 1}"})
                if len(other) == len(body):
                    body = other
            elif mode == "truncate" and request.path.startswith("/v2/blob/"):
                resp = web.StreamResponse(status=status, headers=out_headers)
                resp.content_length = len(body)
                await resp.prepare(request)
                await resp.write(body[: len(body) // 2])
                if request.transport is not None:
                    request.transport.close()
                return resp
        return web.Response(status=status, headers=out_headers, body=body)

    app = web.Application()
    app.on_startup.append(startup)
    app.on_cleanup.append(cleanup)
    app.router.add_route("GET", "/{tail:.*}", handle)
    return app


def main() -> None:
    p = argparse.ArgumentParser(prog="bad_tier")
    p.add_argument("--listen", required=True)
    p.add_argument("--upstream", required=True)
    p.add_argument("--mode", choices=["flip", "truncate", "other-slice"], required=True)
    args = p.parse_args()
    host, port = args.listen.rsplit(":", 1)
    web.run_app(make_app(args.upstream, args.mode), host=host, port=int(port),
                print=None, handle_signals=True)


if __name__ == "__main__":
    main()
