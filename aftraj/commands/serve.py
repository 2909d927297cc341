"""`aftraj serve gateway|vllm|key|openapi`: run the gateway, launch the auditor's vLLM server,
make an API key, print the gateway's OpenAPI schema.

    aftraj serve key --name team-a                 # a new key (shown once) and its sha256 for the config
    aftraj serve gateway --config configs/serve/gateway-local.yaml
    aftraj serve vllm --config configs/serve/vllm-cpu-tiny.yaml
    aftraj serve openapi > serve/openapi.json
"""

from __future__ import annotations

import sys


# the listen queue: a flood of connections (20,000 half-sent requests from two addresses) filled
# uvicorn's 2,048 and a legitimate client's SYN was dropped (retransmitted after 1, 3, 7 s); the
# kernel caps it at net.core.somaxconn
LISTEN_BACKLOG = 8192


def register(sub) -> None:
    p = sub.add_parser("serve", help="serve the auditor: gateway, vLLM launcher, keys, schema")
    s = p.add_subparsers(dest="serve_cmd", required=True)
    g = s.add_parser("gateway", help="run the gateway (FastAPI + uvicorn) from a kind: gateway config")
    g.add_argument("--config", required=True, help="configs/serve/<name>.yaml (kind: gateway)")
    g.add_argument("--port", type=int, help="override the config's port")
    g.set_defaults(func=run_gateway)
    v = s.add_parser("vllm", help="launch vLLM for the auditor from a kind: vllm config; waits for health")
    v.add_argument("--config", required=True, help="configs/serve/<name>.yaml (kind: vllm)")
    v.add_argument("--log", help="write the server's output here")
    v.set_defaults(func=run_vllm)
    k = s.add_parser("key", help="print a new API key and the sha256 line for the config")
    k.add_argument("--name", required=True)
    k.set_defaults(func=run_key)
    o = s.add_parser("openapi", help="print the gateway's OpenAPI schema (JSON)")
    o.set_defaults(func=run_openapi)


def _load(path, kind):
    from serve.config import ConfigError, load_serve_config

    try:
        cfg = load_serve_config(path)
    except ConfigError as e:
        print(f"aftraj serve {kind}: {e}", file=sys.stderr)
        return None
    if cfg.kind != kind:
        print(f"aftraj serve {kind}: {path}: kind: is {cfg.kind!r}, this command needs {kind!r}", file=sys.stderr)
        return None
    return cfg


def build_auditor(a):
    """The in-process auditor an `auditor:` section names (`backend`: a registered auditor, its
    `options` as keyword arguments), or None for `none` and `openai`. An unknown name is a
    ConfigError on `auditor.backend`; an option the auditor does not take (the one rule,
    `eval.auditors.check_options`) one on `auditor.options.<option>`; a value it refuses one on
    `auditor.options`."""
    from aftraj.config import ConfigError
    from serve.config import AUDITOR_BACKENDS

    if a.backend in AUDITOR_BACKENDS:
        return None
    from eval.auditors import UnknownOptionError, available_auditors, get_auditor

    known = available_auditors()
    if a.backend not in known:
        raise ConfigError(f"must be one of {AUDITOR_BACKENDS} or a registered auditor ({', '.join(known)}), "
                          f"got {a.backend!r}", key="auditor.backend")
    try:
        return get_auditor(a.backend, **a.options)      # checks the options first (check_options)
    except UnknownOptionError as e:
        raise ConfigError(str(e), key=f"auditor.options.{e.options[0]}") from None
    except (TypeError, ValueError, FileNotFoundError) as e:
        raise ConfigError(f"{a.backend} auditor: {e}", key="auditor.options") from None


def _service(cfg, source=None):
    """The gateway's service; a ledger URL that names no installed database driver, a database
    that cannot be reached, or an `auditor.tokenizer` that is not a folder, is a usage error
    (one line naming the config file and key), not a traceback."""
    import sqlalchemy as sa

    from aftraj.errors import UsageError
    from serve.service import GatewayService

    url = cfg.ledger_url.split("@")[-1] if "@" in cfg.ledger_url else cfg.ledger_url   # no password echoed
    from aftraj.config import ConfigError

    try:
        return GatewayService(cfg, auditor=build_auditor(cfg.auditor))
    except ConfigError as e:           # a config value the service could not use: name the file too
        raise ConfigError(e.message, key=e.key, source=e.source or source) from None
    except (sa.exc.ArgumentError, sa.exc.NoSuchModuleError) as e:
        raise UsageError(f"ledger_url: {url!r} is not a database URL SQLAlchemy can open "
                         f"(sqlite:///path.db, postgresql+psycopg://…): {e}") from None
    except ModuleNotFoundError as e:
        raise UsageError(f"ledger_url: the driver for {url!r} is not installed ({e.name})") from None
    except sa.exc.OperationalError as e:
        raise UsageError(f"ledger_url: cannot open the database at {url!r}: "
                         f"{str(e.orig or e).strip().splitlines()[0][:300]}") from None


def run_gateway(args) -> int:
    import socket

    import uvicorn

    from aftraj.errors import UsageError
    from serve.router import build_app
    from serve.timeouts import header_timeout_protocol

    cfg = _load(args.config, "gateway")
    if cfg is None:
        return 2
    port = args.port if args.port is not None else cfg.port
    if not 0 <= port <= 65535:
        raise UsageError(f"--port {port}: must be a TCP port (0-65535)")
    # IPPROTO_TCP named: asyncio sets TCP_NODELAY only on sockets whose proto says TCP (with
    # proto 0 every response waited ~40 ms for the client's delayed ACK)
    sock = socket.socket(socket.AF_INET6 if ":" in cfg.host else socket.AF_INET, socket.SOCK_STREAM,
                         socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((cfg.host, port))
    except OSError as e:
        sock.close()
        raise UsageError(f"cannot listen on {cfg.host}:{port}: {e.strerror or e}"
                         + (" (another process holds the port: stop it or give --port)"
                            if e.errno in (98, 48) else "")) from None
    # the event loop and the service's threads share the GIL: a short switch interval keeps a
    # thread that holds it (parsing, folding) from delaying the loop by the default 5 ms a turn
    sys.setswitchinterval(0.0005)
    svc = _service(cfg, args.config)
    app = build_app(svc)
    # what the start made (modules, the app: ~all objects at first) is never traversed again by
    # a full collection: those paused every thread (p50 59 ms, max 84 ms at 1,000 events/s)
    import gc

    gc.collect()
    gc.freeze()
    config = uvicorn.Config(app, log_level="warning", access_log=False,
                            http=header_timeout_protocol(
                                cfg.limits.header_timeout_s, cfg.limits.max_connections_per_address,
                                _max_connections(cfg.limits.max_connections),
                                lambda: svc.metrics.inc("aftraj_gateway_connections_refused_total")),
                            timeout_keep_alive=5, backlog=LISTEN_BACKLOG)
    host, bound = sock.getsockname()[:2]
    print(f"aftraj gateway: listening on http://{f'[{host}]' if ':' in host else host}:{bound} "
          f"(API /v1, web view /ui)", flush=True)
    uvicorn.Server(config).run(sockets=[sock])
    return 0


def _max_connections(configured: int) -> int:
    """`limits.max_connections`, kept 512 below the process's open-file limit (the ledger, the
    logs, the listening socket and `serve.timeouts.RESERVE` connections need files too)."""
    try:
        import resource

        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    except (ImportError, OSError, ValueError):
        return configured
    return configured if soft == resource.RLIM_INFINITY else max(16, min(configured, soft - 512))


def run_vllm(args) -> int:
    from pathlib import Path

    from serve.vllm import launch

    cfg = _load(args.config, "vllm")
    if cfg is None:
        return 2
    return launch(cfg, log=Path(args.log) if args.log else None)


def run_key(args) -> int:
    import re
    import secrets

    from aftraj.errors import UsageError
    from serve.config import hash_key

    if re.fullmatch(r"[\w.-]{1,64}", args.name, flags=re.ASCII) is None:
        raise UsageError(f"--name {args.name!r}: a key name is 1-64 letters, digits, '_', '.' or '-' "
                         f"(it is written into the config line and names the key's runs)")
    key = "aft_" + secrets.token_urlsafe(32)
    print(f"key (give it to the client, it is not stored): {key}")
    print(f"config line: - {{name: {args.name}, sha256: {hash_key(key)}}}")
    return 0


def run_openapi(args) -> int:
    from serve.config import GatewayConfig
    from serve.router import build_app, openapi_json
    from serve.service import GatewayService

    svc = GatewayService(GatewayConfig(ledger_url="sqlite:///:memory:"))
    sys.stdout.write(openapi_json(build_app(svc)))
    return 0
