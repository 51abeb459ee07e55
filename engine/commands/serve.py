"""`forgebench serve`: the workspace's models over an OpenAI-compatible HTTP API
(engine/server/http.py) on Starlette + uvicorn.

`--cartridge FILE` serves a cartridge (an lm-cartridge run's trained KV rows) beside the base
it was trained on (`--model FILE.gguf` or a library id) as a model of its own,
`BASE+RUN/CHECKPOINT` (engine/server/catalog.py); one trained on another base is refused
before the socket opens.

Loopback only by default; any other address needs `--api-key` (clients send
`Authorization: Bearer KEY`), and the server says what it exposes at start. Its stdout is one
JSON line per event, which the app's Serve switch reads: `{"event": "listening", "url",
"api_key", "models"}` once the socket is bound, then `{"event": "request", ...}` per request
(model, endpoint, status, tokens, tokens/s). Ctrl-C, SIGTERM or end of the app stops it.
"""

from __future__ import annotations

import json
import sys
import threading

from engine.errors import ForgebenchError
from engine.server import is_loopback

_OUT = threading.Lock()      # request lines come from every model's engine thread


def _emit(line: dict) -> None:
    with _OUT:
        sys.stdout.write(json.dumps(line) + "\n")
        sys.stdout.flush()


def cmd_serve(args) -> int:
    try:
        import uvicorn
    except ImportError:
        raise ForgebenchError("the HTTP server needs starlette and uvicorn", where="serve",
                              hint="pip install starlette uvicorn (forgebench's dependencies)") \
            from None
    from engine.commands.models import find_workspace
    from engine.server.catalog import Catalog
    from engine.server.http import Server, create_app

    if not is_loopback(args.host) and not args.api_key:
        raise ForgebenchError(f"binding {args.host} exposes the models beyond this machine",
                              where="--host", hint="pass --api-key KEY (clients then send "
                                                   "'Authorization: Bearer KEY'), or keep "
                                                   "the default 127.0.0.1")
    if args.slots < 1 or args.queue < 0:
        raise ForgebenchError("--slots must be at least 1 and --queue at least 0",
                              where="--slots")
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    workspace = find_workspace(args.workspace)
    catalog = Catalog.build(workspace, args.model, getattr(args, "cartridge", None))
    if not catalog.entries:
        raise ForgebenchError("nothing to serve", where="--model",
                              hint="add a model (forgebench models add FILE.gguf) or pass "
                                   "--model FILE.gguf")
    limits = {"max_body": args.max_body} if args.max_body else {}
    server = Server(catalog, api_key=args.api_key, slots=args.slots, queue_limit=args.queue,
                    on_log=lambda entry: _emit({"event": "request", **entry}),
                    token_delay=getattr(args, "token_delay", 0.0), **limits)
    app = create_app(server)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level="warning",
                            access_log=False, timeout_graceful_shutdown=5)
    web = uvicorn.Server(config)

    started = web.startup

    async def startup(sockets=None):
        await started(sockets)
        if web.started:
            port = web.servers[0].sockets[0].getsockname()[1] if web.servers else args.port
            host = f"[{args.host}]" if ":" in args.host else args.host
            url = f"http://{host}:{port}/v1"
            exposed = "loopback only" if is_loopback(args.host) else \
                f"reachable from other machines at {args.host}, Bearer key required"
            print(f"serving {len(catalog.entries)} model(s) at {url} ({exposed})",
                  file=sys.stderr)
            _emit({"event": "listening", "url": url, "api_key": args.api_key,
                   "loopback": is_loopback(args.host), "models": list(catalog.entries)})

    web.startup = startup
    web.run()
    server.close()
    return 0 if web.started else 1
