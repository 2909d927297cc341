"""A web view of live runs, served by the gateway: `GET /v1/runs` (the caller's runs, paged) and
pages under /ui (server-rendered HTML and one small script, no build step).

    aftraj serve gateway --config configs/serve/gateway-local.yaml
    open http://127.0.0.1:8080/ui            # sign in with an API key of the gateway
    curl -H "Authorization: Bearer $KEY" "http://127.0.0.1:8080/v1/runs?limit=20"

- `/ui`: the caller's runs, each with its state (running, ended and how, ALARM at step t), its
  steps and verdicts. `/ui/runs/{id}`: the run's timeline, one row per step (agent, kind,
  content, tool, error) with the verdict given at that step; the first ALARM is marked where it
  was raised and at its decisive step k; the fold's findings are listed with their evidence
  steps (marked in the timeline too). The page follows the run live: its script listens to
  `/ui/runs/{id}/stream` (the run's verdicts as server-sent events, as `/v1/runs/{id}/stream`
  sends them) and, at each verdict, fetches the timeline again, rendered by the server
  (`/ui/runs/{id}/fragment`). One renderer, no client-side templates.
- Behind the same keys: every /ui route takes the key from the `Authorization: Bearer` header or
  from the `aftraj_key` cookie the sign-in form sets (HttpOnly, SameSite=Strict, Path=/ui; the
  browser sends it to /ui only, where EventSource cannot send a header). The key's rate limit
  and failure limit apply as on /v1. A run of another key is a 404, as on /v1.
- `GET /v1/runs?limit=N&after=RUN_ID`: runs in run-id order, at most `limit` (1-100, default 50),
  and `next` (pass it as `after` for the next page; null at the end). Per run: task, agents,
  category, steps, last seq, termination, verdict count, the last verdict (t, decision, auditor)
  and the first ALARM (t, k, agent, reason), and `state`.
"""

from __future__ import annotations

import asyncio
import html
import urllib.parse

import orjson
from fastapi import FastAPI, Header, Query, Request
from fastapi.responses import HTMLResponse, JSONResponse, RedirectResponse, Response, StreamingResponse

from aftraj.events import event_to_step, is_synthetic, parse_event
from serve.service import GatewayError, GatewayService

try:                                    # runs are stored under "owner/run_id" (serve.service)
    from serve.service import storage_key
except ImportError:                     # pragma: no cover - a gateway that keys runs by id alone
    def storage_key(owner: str, run_id: str) -> str:
        return run_id

COOKIE = "aftraj_key"
MAX_PAGE = 100
MAX_STEPS_SHOWN = 1000
CONTENT_SHOWN = 600         # characters of a step's content in the timeline (the rest: "… (N more)")


# --------------------------------------------------------------------------- reading (blocking)

def _public_id(owner: str, key: str) -> str:
    prefix = storage_key(owner, "")
    return key[len(prefix):] if prefix and key.startswith(prefix) else key


def _summaries(svc: GatewayService, owner: str, keys_records: list[tuple[str, bytes]]) -> list[dict]:
    """One summary per run: counts from the ledger, the verdicts' last and first ALARM."""
    sa = svc._sa
    ev, vt = svc.ledger.table, svc.verdicts_table
    keys = [k for k, _ in keys_records]
    out = {k: {"steps": 0, "last_seq": 0, "termination": None, "verdicts": 0, "last_verdict": None, "alarm": None}
           for k in keys}
    if not keys:
        return []
    with svc.ledger.reader.connect() as conn:
        for k, n, last in conn.execute(sa.select(ev.c.run_id, sa.func.count(), sa.func.max(ev.c.seq))
                                       .where(ev.c.run_id.in_(keys), ev.c.seq > 0).group_by(ev.c.run_id)):
            out[k].update(steps=int(n), last_seq=int(last))
        for k, rec in conn.execute(sa.select(ev.c.run_id, ev.c.record)
                                   .where(ev.c.run_id.in_(keys), ev.c.kind == "termination")):
            out[k]["termination"] = orjson.loads(rec)["payload"]["reason"]
        for k, rec in conn.execute(sa.select(vt.c.run_id, vt.c.record).where(vt.c.run_id.in_(keys))
                                   .order_by(vt.c.run_id, vt.c.seq)):
            v = orjson.loads(rec)
            s = out[k]
            s["verdicts"] += 1
            s["last_verdict"] = {"t": v.get("t"), "seq": v.get("seq"), "decision": v.get("decision"),
                                 "auditor": v.get("auditor"), "action": v.get("action")}
            if s["alarm"] is None and v.get("decision") == "ALARM":
                s["alarm"] = {"t": v.get("t"), "k": v.get("k"), "agent": v.get("agent"), "reason": v.get("reason")}
    runs = []
    for k, rec in keys_records:
        r = orjson.loads(rec)
        s = out[k]
        state = (f"ALARM at step {s['alarm']['t']}" if s["alarm"] else
                 f"ended ({s['termination']})" if s["termination"] else "running")
        runs.append({"run_id": _public_id(owner, k), "task": r.get("task"), "agents": r.get("agents") or [],
                     "category": r.get("category"), "state": state, **s})
    return runs


def list_runs(svc: GatewayService, owner: str, limit: int = 50, after: str | None = None) -> dict:
    """The owner's runs in run-id order after `after` (a run id), at most `limit` (see the module docstring)."""
    if not 1 <= limit <= MAX_PAGE:
        raise GatewayError(422, f"limit: must be in 1..{MAX_PAGE}, got {limit}", field="limit")
    sa, t = svc._sa, svc.runs_table
    q = sa.select(t.c.run_id, t.c.record).where(t.c.owner == owner)
    if after:
        q = q.where(t.c.run_id > storage_key(owner, after))
    with svc.ledger.reader.connect() as conn:
        rows = [(k, bytes(rec)) for k, rec in conn.execute(q.order_by(t.c.run_id).limit(limit + 1))]
    more = len(rows) > limit
    runs = _summaries(svc, owner, rows[:limit])
    return {"runs": runs, "next": runs[-1]["run_id"] if more and runs else None}


def run_page_data(svc: GatewayService, owner: str, run_id: str) -> dict:
    """Everything a run's page shows: the run's record, its steps (the last MAX_STEPS_SHOWN), its
    verdicts and the last verdict's findings. 404 for a run the owner did not create."""
    sa, t = svc._sa, svc.runs_table
    key = storage_key(owner, run_id)
    with svc.ledger.reader.connect() as conn:
        row = conn.execute(sa.select(t.c.owner, t.c.record).where(t.c.run_id == key)).first()
        if row is None or row[0] != owner:
            raise GatewayError(404, f"no run {run_id!r}")
        ev, vt = svc.ledger.table, svc.verdicts_table
        steps, skipped = [], 0
        for (rec,) in conn.execute(sa.select(ev.c.record).where(ev.c.run_id == key).order_by(ev.c.seq)):
            e = parse_event(orjson.loads(rec))
            if is_synthetic(e):
                continue
            s = event_to_step(e, len(steps) + skipped, key)
            steps.append({"index": s.index, "agent": s.agent, "kind": e.kind, "content": s.content, "tool": s.tool,
                          "arguments": None if s.arguments is None else orjson.dumps(s.arguments).decode(),
                          "error": s.error, "seq": e.seq,
                          "reason": e.payload.get("reason") if e.kind == "termination" else None})
            if len(steps) > MAX_STEPS_SHOWN:
                steps.pop(0)
                skipped += 1
        verdicts = [orjson.loads(rec) for (rec,) in conn.execute(
            sa.select(vt.c.record).where(vt.c.run_id == key).order_by(vt.c.seq))]
    rec = orjson.loads(row[1])
    return {"run_id": run_id, "task": rec.get("task") or "", "agents": rec.get("agents") or [],
            "category": rec.get("category"), "steps": steps, "skipped": skipped, "verdicts": verdicts,
            "findings": verdicts[-1].get("findings", []) if verdicts else [],
            "alarm": next((v for v in verdicts if v.get("decision") == "ALARM"), None)}


# --------------------------------------------------------------------------- rendering

def _e(x) -> str:
    return html.escape("" if x is None else str(x), quote=True)


CSS = """
body{font:14px/1.45 system-ui,sans-serif;margin:1.5em;color:#222}
h1{font-size:1.3em;margin:.2em 0} table{border-collapse:collapse;width:100%} td,th{border-bottom:1px solid #ddd;
padding:4px 6px;text-align:left;vertical-align:top} th{background:#f4f4f4}
.state,.decision{font-weight:600;padding:1px 6px;border-radius:3px}
.s-running{background:#e6f0ff}.s-ended{background:#eee}.s-alarm,.d-ALARM{background:#c62828;color:#fff}
.d-CONTINUE{background:#e8f5e9;color:#1b5e20}
tr.alarm-raised{outline:3px solid #c62828} tr.decisive{background:#ffebee} tr.evidence td:first-child{border-left:4px solid #ef6c00}
.content{white-space:pre-wrap;max-width:60em} .muted{color:#777} .finding.alarm{color:#b71c1c}
#live{float:right} body[data-live=on] #live::after{content:"live";color:#2e7d32}
body[data-live=reconnecting] #live::after{content:"reconnecting…";color:#ef6c00}
"""


def _page(title: str, body: str, *, script: bool = False) -> str:
    js = '<script src="/ui/app.js" defer></script>' if script else ""
    return (f"<!doctype html><html lang=en><head><meta charset=utf-8><title>{_e(title)}</title>"
            f"<style>{CSS}</style>{js}</head><body><span id=live></span>{body}</body></html>")


def login_page(msg: str = "") -> str:
    return _page("AgentForesight: sign in", (
        "<h1>AgentForesight gateway</h1>"
        + (f"<p class=muted>{_e(msg)}</p>" if msg else "")
        + "<form method=post action=/ui/login><label>API key <input name=key type=password autocomplete=off "
          "size=40></label> <button>Sign in</button></form>"))


def _state_class(state: str) -> str:
    return "s-alarm" if state.startswith("ALARM") else "s-ended" if state.startswith("ended") else "s-running"


def runs_page(data: dict, owner: str) -> str:
    rows = "".join(
        f"<tr><td><a href=\"/ui/runs/{_e(urllib.parse.quote(r['run_id'], safe=''))}\">{_e(r['run_id'])}</a></td>"
        f"<td><span class=\"state {_state_class(r['state'])}\">{_e(r['state'])}</span></td>"
        f"<td>{r['steps']}</td><td>{r['verdicts']}</td><td>{_e(', '.join(r['agents']))}</td>"
        f"<td>{_e((r['task'] or '')[:120])}</td></tr>" for r in data["runs"])
    more = (f"<p><a href=\"/ui?after={_e(urllib.parse.quote(data['next'], safe=''))}\">next page</a></p>"
            if data["next"] else "")
    return _page("AgentForesight: runs", (
        f"<form method=post action=/ui/logout style=float:right><button>Sign out ({_e(owner)})</button></form>"
        f"<h1>Runs</h1><table id=runs><tr><th>run</th><th>state</th><th>steps</th><th>verdicts</th><th>agents</th>"
        f"<th>task</th></tr>{rows or '<tr><td colspan=6 class=muted>no runs yet</td></tr>'}</table>{more}"))


def _verdict_cell(v: dict | None) -> str:
    if v is None:
        return ""
    d = v.get("decision")
    out = f"<span class=\"decision d-{_e(d)}\">{_e(d)}</span> <span class=muted>auditor {_e(v.get('auditor'))}"
    if v.get("latency_ms") is not None:
        out += f", {v['latency_ms']:.0f} ms"
    out += "</span>"
    if d == "ALARM":
        out += f"<br>k={_e(v.get('k'))} agent={_e(v.get('agent'))}: {_e(v.get('reason'))}"
    return out


def timeline(data: dict) -> str:
    """The part of a run's page the script refreshes: state, findings, the step timeline."""
    alarm, verdicts = data["alarm"], data["verdicts"]
    by_t: dict[int, dict] = {}
    for v in verdicts:
        by_t[v.get("t")] = v          # a resent batch keeps one verdict per step (the last)
    evidence = {s for f in data["findings"] for s in f.get("steps", [])}
    last = data["steps"][-1] if data["steps"] else None
    ended = next((s for s in reversed(data["steps"]) if s["kind"] == "termination"), None)
    state = (f"ALARM at step {alarm['t']}" if alarm else
             f"ended ({ended['reason']})" if ended else "running")
    head = (f"<p>state: <span id=state class=\"state {_state_class(state)}\">{_e(state)}</span> "
            f"<span class=muted>{len(data['steps']) + data['skipped']} steps, {len(verdicts)} verdicts"
            + (f", last at step {last['index']}" if last else "") + "</span></p>")
    if alarm:
        head += (f"<p id=alarm class=\"finding alarm\">ALARM raised at step {_e(alarm['t'])}: decisive step "
                 f"{_e(alarm.get('k'))}, agent {_e(alarm.get('agent'))}: {_e(alarm.get('reason'))}</p>")
    fl = "".join(
        f"<li class=\"finding{' alarm' if f.get('alarm') else ''}\"><b>{_e(f.get('kind'))}</b>: {_e(f.get('reason'))} "
        f"<span class=muted>evidence steps " + ", ".join(f"<a href=\"#step-{s}\">{s}</a>" for s in f.get("steps", []))
        + "</span></li>" for f in data["findings"])
    head += f"<h2>Findings</h2><ul id=findings>{fl or '<li class=muted>none</li>'}</ul>"
    rows = []
    if data["skipped"]:
        rows.append(f"<tr><td colspan=5 class=muted>the first {data['skipped']} steps are not shown</td></tr>")
    for s in data["steps"]:
        i = s["index"]
        cls = [c for c, on in (("alarm-raised", alarm is not None and alarm.get("t") == i),
                               ("decisive", alarm is not None and alarm.get("k") == i),
                               ("evidence", i in evidence)) if on]
        content = s["content"] or ""
        if s["kind"] == "termination":
            content = f"run ended ({s['reason']})" + (f": {content}" if content else "")
        shown = _e(content[:CONTENT_SHOWN]) + (f"<span class=muted>… ({len(content) - CONTENT_SHOWN} more "
                                                f"characters)</span>" if len(content) > CONTENT_SHOWN else "")
        extra = "".join(f"<br><span class=muted>{k}: {_e(s[k])}</span>" for k in ("tool", "arguments", "error")
                        if s.get(k))
        rows.append(f"<tr id=step-{i} class=\"{' '.join(cls)}\" data-step={i}><td>{i}</td><td>{_e(s['agent'])}</td>"
                    f"<td>{_e(s['kind'])}</td><td class=content>{shown}{extra}</td>"
                    f"<td class=verdict>{_verdict_cell(by_t.get(i))}</td></tr>")
    return (head + "<h2>Timeline</h2><table id=timeline><tr><th>step</th><th>agent</th><th>kind</th><th>content</th>"
            "<th>verdict</th></tr>" + "".join(rows) + "</table>")


def run_page(data: dict) -> str:
    return _page(f"run {data['run_id']}", (
        "<p><a href=/ui>all runs</a></p>"
        f"<h1>Run {_e(data['run_id'])}</h1><p class=muted>task: {_e(data['task'][:500])}<br>agents: "
        f"{_e(', '.join(data['agents']))}" + (f"; category {_e(data['category'])}" if data["category"] else "")
        + f"</p><div id=run data-run=\"{_e(data['run_id'])}\">{timeline(data)}</div>"), script=True)


APP_JS = """// AgentForesight run page: follow the run's verdicts (SSE) and re-fetch the server-rendered timeline.
(function () {
  var root = document.getElementById("run");
  if (!root) return;
  var base = "/ui/runs/" + encodeURIComponent(root.dataset.run);
  var busy = false, again = false;
  function refresh() {
    if (busy) { again = true; return; }
    busy = true;
    fetch(base + "/fragment", {credentials: "same-origin", cache: "no-store"})
      .then(function (r) { return r.ok ? r.text() : null; })
      .then(function (html) { if (html !== null) root.innerHTML = html; })
      .finally(function () { busy = false; if (again) { again = false; refresh(); } });
  }
  var es = new EventSource(base + "/stream");
  es.addEventListener("verdict", refresh);
  es.onopen = function () { document.body.dataset.live = "on"; };
  es.onerror = function () { document.body.dataset.live = "reconnecting"; };
})();
"""


# --------------------------------------------------------------------------- routes

def verdict_emitter(svc: GatewayService):
    """`emit(verdict, run_id)`: each new verdict as an OTel span / Langfuse score when `AFTRAJ_EMIT`
    names them (aftraj/adapters/emit.py; a resent batch's stored verdict is not emitted again);
    a no-op otherwise. Fails open: an emitter's error is logged, never raised into a request."""
    import logging

    from aftraj.adapters.emit import from_env
    try:
        emitters = from_env()
    except (ValueError, ImportError) as e:     # a bad AFTRAJ_EMIT is the operator's to fix: say so once
        logging.getLogger("aftraj.gateway").error("AFTRAJ_EMIT: %s; verdicts are not emitted", e)
        emitters = None
    model = svc.cfg.auditor.model if svc.cfg.auditor.backend == "openai" else None
    svc.emitters = emitters

    def emit(v, run_id: str) -> None:
        if emitters and isinstance(v, dict) and v.get("accepted", 1) > 0:
            emitters.emit(v, run_id=run_id, model=model)
    return emit


def register(app: FastAPI, svc: GatewayService):
    """Add `GET /v1/runs` and the /ui pages to the gateway's app (called by serve.router.build_app);
    returns the verdict emitter the events route calls (`verdict_emitter`)."""

    def _ui_owner(request: Request) -> str:
        auth = request.headers.get("authorization")
        if not auth and request.cookies.get(COOKIE):
            auth = f"Bearer {request.cookies[COOKIE]}"
        client = request.client
        return svc.authenticate(auth, client.host if client else None)

    async def _blocking(fn, *args):
        return await asyncio.to_thread(fn, *args)

    def _html(body: str, status: int = 200) -> HTMLResponse:
        return HTMLResponse(body, status_code=status, headers={"Cache-Control": "no-store"})

    @app.get("/v1/runs", responses={401: {}, 422: {}, 429: {}})
    async def runs(request: Request, limit: int = Query(50, ge=1, le=MAX_PAGE), after: str | None = Query(None),
                   authorization: str | None = Header(None)):
        """The caller's runs, paged in run-id order: `{"runs": [...], "next": run_id | null}`."""
        data = await _blocking(list_runs, svc, request.scope["aftraj.owner"], limit, after)
        return JSONResponse(data)

    @app.get("/ui", include_in_schema=False)
    async def ui_runs(request: Request, after: str | None = None):
        try:
            owner = _ui_owner(request)
        except GatewayError as e:
            return _html(login_page("" if e.status == 401 and not request.cookies.get(COOKIE) else e.detail),
                         e.status)
        return _html(runs_page(await _blocking(list_runs, svc, owner, MAX_PAGE, after), owner))

    @app.post("/ui/login", include_in_schema=False)
    async def ui_login(request: Request):
        form = urllib.parse.parse_qs((await request.body()).decode("utf-8", "replace"))
        key = (form.get("key") or [""])[0].strip()
        client = request.client
        try:
            svc.authenticate(f"Bearer {key}", client.host if client else None)
        except GatewayError as e:
            return _html(login_page(e.detail), e.status)
        resp = RedirectResponse("/ui", status_code=303)
        resp.set_cookie(COOKIE, key, httponly=True, samesite="strict", path="/ui")
        return resp

    @app.post("/ui/logout", include_in_schema=False)
    async def ui_logout():
        resp = RedirectResponse("/ui", status_code=303)
        resp.delete_cookie(COOKIE, path="/ui")
        return resp

    @app.get("/ui/app.js", include_in_schema=False)
    async def ui_js():
        return Response(APP_JS, media_type="text/javascript", headers={"Cache-Control": "no-cache"})

    async def _data(request: Request, run_id: str):
        try:
            owner = _ui_owner(request)
        except GatewayError as e:
            return None, _html(login_page(e.detail), e.status)
        try:
            return await _blocking(run_page_data, svc, owner, run_id), None
        except GatewayError as e:
            return None, _html(_page("not found", f"<p>{_e(e.detail)}</p><p><a href=/ui>all runs</a></p>"), e.status)

    @app.get("/ui/runs/{run_id}", include_in_schema=False)
    async def ui_run(request: Request, run_id: str):
        data, err = await _data(request, run_id)
        return err or _html(run_page(data))

    @app.get("/ui/runs/{run_id}/fragment", include_in_schema=False)
    async def ui_fragment(request: Request, run_id: str):
        data, err = await _data(request, run_id)
        return err or _html(timeline(data))

    @app.get("/ui/runs/{run_id}/stream", include_in_schema=False)
    async def ui_stream(request: Request, run_id: str, last_event_id: str | None = Header(None)):
        owner = _ui_owner(request)           # 401/429 as a Problem (EventSource retries)
        after = int(last_event_id) if last_event_id and last_event_id.isdigit() and len(last_event_id) < 20 else -1
        items = await svc.stream(owner, run_id, after)

        async def gen():
            async for seq, data in items:
                yield b": keep-alive\n\n" if seq is None else b"event: verdict\nid: %d\ndata: " % seq + data + b"\n\n"

        return StreamingResponse(gen(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    return verdict_emitter(svc)


__all__ = ["list_runs", "register", "run_page_data", "timeline"]
