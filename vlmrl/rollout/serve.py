"""Serve a checkpoint with the embedded engine over SGLang's HTTP protocol.

    python -m vlmrl.rollout.serve --model DIR --port N [--host 127.0.0.1]
        [--min-pixels 3136 --max-pixels 12544] [--dtype float32] [--device cpu]
        [--max-batch-size 64] [--sglang-version 0.5.17]

It speaks the protocol of SGLang `--sglang-version` (default: the newest release vlmrl has
a contract for; one it has none for is refused before the model loads), prints
`vlmrl.rollout.serve: listening on http://HOST:PORT (SGLang VERSION protocol)` once the model
is loaded and the socket is bound, then serves until SIGINT / SIGTERM.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m vlmrl.rollout.serve", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="HF checkpoint directory (or hub id in the local cache)")
    p.add_argument("--port", type=int, required=True, help="TCP port (0: pick a free one)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--min-pixels", type=int, default=None, help="image processor lower pixel bound")
    p.add_argument("--max-pixels", type=int, default=None, help="image processor upper pixel bound")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--device", default="cpu", help="cpu | cuda | cuda:N")
    p.add_argument("--max-batch-size", type=int, default=64)
    p.add_argument("--sglang-version", default=None,
                   help="the SGLang release whose protocol to speak (default: the newest with a contract)")
    return p.parse_args(argv)


async def _serve(args: argparse.Namespace) -> None:
    from .embedded import EmbeddedEngine
    from .server import start_server

    engine = EmbeddedEngine(args.model, device=args.device, dtype=args.dtype, min_pixels=args.min_pixels,
                            max_pixels=args.max_pixels, max_batch_size=args.max_batch_size)
    server = await start_server(engine, args.host, args.port, sglang_version=args.sglang_version)
    print(f"vlmrl.rollout.serve: listening on {server.url} (SGLang {server.protocol.version} protocol)", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await server.close()
    await engine.close()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if (args.min_pixels is None) != (args.max_pixels is None):
        print("--min-pixels and --max-pixels go together", file=sys.stderr)
        return 2
    from .sglang_contract import protocol

    try:
        args.sglang_version = protocol(args.sglang_version).version
    except ValueError as e:  # a release vlmrl has no contract for
        print(f"--sglang-version: {e}", file=sys.stderr)
        return 2
    asyncio.run(_serve(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
