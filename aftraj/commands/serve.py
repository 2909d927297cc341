"""`aftraj serve gateway|vllm|key|openapi`: run the gateway, launch the auditor's vLLM server,
make an API key, print the gateway's OpenAPI schema.

    aftraj serve key --name team-a                 # a new key (shown once) and its sha256 for the config
    aftraj serve gateway --config configs/serve/gateway-local.yaml
    aftraj serve vllm --config configs/serve/vllm-cpu-tiny.yaml
    aftraj serve openapi > serve/openapi.json
"""

from __future__ import annotations

import sys


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


def run_gateway(args) -> int:
    import uvicorn

    from serve.router import build_app
    from serve.service import GatewayService

    cfg = _load(args.config, "gateway")
    if cfg is None:
        return 2
    app = build_app(GatewayService(cfg))
    uvicorn.run(app, host=cfg.host, port=args.port if args.port is not None else cfg.port,
                log_level="warning", access_log=False)
    return 0


def run_vllm(args) -> int:
    from pathlib import Path

    from serve.vllm import launch

    cfg = _load(args.config, "vllm")
    if cfg is None:
        return 2
    return launch(cfg, log=Path(args.log) if args.log else None)


def run_key(args) -> int:
    import secrets

    from serve.config import hash_key

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
