"""Serve a checkpoint with the embedded engine over SGLang's HTTP protocol.

    python -m vlmrl.rollout.serve --model DIR --port N [--host 127.0.0.1]
        [--min-pixels 3136 --max-pixels 12544] [--dtype float32] [--device cpu]
        [--max-batch-size 64] [--sglang-version 0.5.17] [--api-key-file FILE]

With a key (`--api-key-file`, a file readable by its owner only, e.g. a run's `engine.key`;
or the environment variable VLMRL_ENGINE_KEY) every call but /health needs
`Authorization: Bearer <key>`, as SGLang's `--api-key`. Without one the server binds only a
loopback address: a non-loopback `--host` without a key is refused.

It speaks the protocol of SGLang `--sglang-version` (default: the newest release vlmrl has
a contract for; one it has none for is refused before the model loads), prints
`vlmrl.rollout.serve: listening on http://HOST:PORT (SGLang VERSION protocol)` once the model
is loaded and the socket is bound, then serves until SIGINT / SIGTERM.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys

KEY_ENV = "VLMRL_ENGINE_KEY"


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
    p.add_argument("--api-key-file", default=None,
                   help="file holding the key callers must send (default: $VLMRL_ENGINE_KEY, else none)")
    return p.parse_args(argv)


def _key(args: argparse.Namespace) -> str | None:
    from .auth import read_key

    if args.api_key_file:
        return read_key(args.api_key_file)
    return os.environ.get(KEY_ENV) or None


def _loopback(host: str) -> bool:
    import ipaddress

    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


async def _serve(args: argparse.Namespace) -> None:
    from .embedded import EmbeddedEngine
    from .server import start_server

    engine = EmbeddedEngine(args.model, device=args.device, dtype=args.dtype, min_pixels=args.min_pixels,
                            max_pixels=args.max_pixels, max_batch_size=args.max_batch_size)
    server = await start_server(engine, args.host, args.port, sglang_version=args.sglang_version, api_key=args.key)
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
    from ..contracts.sglang_contract import protocol

    try:
        args.sglang_version = protocol(args.sglang_version).version
    except ValueError as e:  # a release vlmrl has no contract for
        print(f"--sglang-version: {e}", file=sys.stderr)
        return 2
    try:
        args.key = _key(args)
    except (OSError, ValueError) as e:
        print(f"--api-key-file: {e}", file=sys.stderr)
        return 2
    if args.key is None and not _loopback(args.host):
        print(f"--host {args.host} is reachable from other machines: give a key (--api-key-file or "
              f"${KEY_ENV}), or bind 127.0.0.1", file=sys.stderr)
        return 2
    asyncio.run(_serve(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
