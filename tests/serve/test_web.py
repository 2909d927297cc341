"""The gateway's web view (serve/web.py): `GET /v1/runs` (the caller's runs, paged, behind the
keys) and the /ui pages, tested in a real headless browser (Debian's chromium, started here and
driven over the DevTools protocol): sign in with a key, open a run, post events, see the verdict
appear live (SSE) and the ALARM marked, take a screenshot and check what it shows. The browser
test skips, saying why, only when no chromium binary is found (apt-get install chromium)."""

from __future__ import annotations

import base64
import io
import itertools
import json
import os
import re
import shutil
import socket
import subprocess
import threading
import time
from pathlib import Path

import httpx
import pytest

pytest.importorskip("uvicorn")

KEY, OTHER = "web-test-key", "web-other-key"
_STEP = re.compile(r'<step index=(\d+) agent="((?:[^"\\]|\\.)*)"')


def _auditor(trigger: str):
    """A scripted vLLM stand-in: ALARM at the first shown step holding `trigger`."""
    def handle(request: httpx.Request) -> httpx.Response:
        user = json.loads(request.content)["messages"][-1]["content"]
        steps = [(int(m.group(1)), json.loads(f'"{m.group(2)}"')) for m in _STEP.finditer(user)]
        blocks = user.split("<step index=")[1:]
        bad = next(((k, a) for (k, a), b in zip(steps, blocks, strict=True) if trigger in b), None)
        ans = ({"answer": "SAFE", "agent": None, "reason": None} if bad is None else
               {"answer": bad[0], "agent": bad[1], "reason": f"{trigger} is wrong"})
        return httpx.Response(200, json={"choices": [{"message": {"role": "assistant", "content":
                              f"<think>checked</think><answer>{json.dumps(ans)}</answer>"}, "finish_reason": "stop"}],
                              "usage": {"prompt_tokens": 10, "completion_tokens": 5}})
    return handle


def _web_gateway(tmp_path, serve_app, **cfg_kw) -> str:
    """A gateway (two keys, a scripted auditor that alarms on "418") served on 127.0.0.1."""
    from serve.config import ApiKey, AuditorConfig, GatewayConfig, hash_key
    from serve.router import build_app
    from serve.service import GatewayService
    cfg = GatewayConfig(ledger_url=f"sqlite:///{tmp_path / 'ledger.db'}",
                        api_keys=(ApiKey("team-a", hash_key(KEY)), ApiKey("team-b", hash_key(OTHER))),
                        auditor=AuditorConfig(backend="openai", base_url="http://auditor.test/v1", model="auditor",
                                              deadline_s=5.0, tokenizer="approx"), **cfg_kw)
    return serve_app(build_app(GatewayService(cfg, transport=httpx.MockTransport(_auditor("418")))))


@pytest.fixture
def gateway(tmp_path, serve_app):
    return _web_gateway(tmp_path, serve_app)


def _events(run, steps):
    return [{"event_id": f"{run}/{i}", "kind": k, "agent": a, "payload": p} for i, (a, k, p) in steps]


PLAN = [(1, ("planner", "message", {"content": "Plan: count the pens (17 * 24), then multiply by 0.5."})),
        (2, ("calculator", "tool_call", {"content": "", "tool": "compute", "arguments": {"expression": "17*24"}})),
        (3, ("calculator", "tool_result", {"content": "408", "tool": "compute"}))]
SLIP = [(4, ("calculator", "message", {"content": "17 * 24 = 418 pens."}))]
# the same call twice more, results without ids: the fold's insufficient_loop_evidence (not an alarm)
AGAIN = [(i, PLAN[1 + (i % 2 == 1)][1]) for i in range(4, 8)]
SLIP_LATE = [(8, SLIP[0][1])]


def test_v1_runs_lists_the_callers_runs_paged(gateway):
    from serve.client import GatewayClient
    with GatewayClient(gateway, KEY) as a, GatewayClient(gateway, OTHER) as b:
        for i in range(5):
            a.create_run(f"task {i}", agents=["planner"], run_id=f"run-{i}")
        b.create_run("theirs", run_id="run-b")
        a.post_events("run-1", _events("run-1", PLAN))
        a.post_events("run-1", _events("run-1", SLIP))
        h = {"Authorization": f"Bearer {KEY}"}
        first = httpx.get(f"{gateway}/v1/runs", params={"limit": 2}, headers=h).json()
        assert [r["run_id"] for r in first["runs"]] == ["run-0", "run-1"] and first["next"] == "run-1"
        r1 = first["runs"][1]
        assert (r1["steps"], r1["verdicts"], r1["state"]) == (4, 2, "ALARM at step 3")
        assert r1["alarm"] == {"t": 3, "k": 3, "agent": "calculator", "reason": "418 is wrong"}
        assert r1["last_verdict"]["decision"] == "ALARM" and first["runs"][0]["state"] == "running"
        rest = httpx.get(f"{gateway}/v1/runs", params={"limit": 2, "after": "run-1"}, headers=h).json()
        last = httpx.get(f"{gateway}/v1/runs", params={"limit": 2, "after": rest["next"]}, headers=h).json()
        assert [r["run_id"] for r in rest["runs"] + last["runs"]] == ["run-2", "run-3", "run-4"]
        assert last["next"] is None
        theirs = httpx.get(f"{gateway}/v1/runs", headers={"Authorization": f"Bearer {OTHER}"}).json()
        assert [r["run_id"] for r in theirs["runs"]] == ["run-b"]          # another key's runs never show
        assert httpx.get(f"{gateway}/v1/runs").status_code == 401
        assert httpx.get(f"{gateway}/v1/runs", params={"limit": 0}, headers=h).status_code == 422


def test_ui_pages_are_behind_the_keys(gateway):
    from serve.client import GatewayClient
    with GatewayClient(gateway, KEY) as a:
        a.create_run("mine", run_id="run-a")
        a.post_events("run-a", _events("run-a", PLAN))
    r = httpx.get(f"{gateway}/ui")
    assert r.status_code == 401 and "Sign in" in r.text and "run-a" not in r.text
    assert httpx.get(f"{gateway}/ui/runs/run-a").status_code == 401
    assert httpx.post(f"{gateway}/ui/login", data={"key": "wrong"}).status_code == 401
    with httpx.Client(base_url=gateway) as c:
        r = c.post("/ui/login", data={"key": KEY})
        assert r.status_code == 303 and "httponly" in r.headers["set-cookie"].lower()
        assert "samesite=strict" in r.headers["set-cookie"].lower()
        page = c.get("/ui/runs/run-a")
        assert page.status_code == 200 and "compute" in page.text and "408" in page.text
        assert "run-a" in c.get("/ui").text
    with httpx.Client(base_url=gateway) as c:        # the other key: the run does not exist for it
        c.post("/ui/login", data={"key": OTHER})
        assert c.get("/ui/runs/run-a").status_code == 404 and "run-a" not in c.get("/ui").text
    # the header works too (no cookie), for scripts
    assert httpx.get(f"{gateway}/ui/runs/run-a/fragment", headers={"Authorization": f"Bearer {KEY}"}).status_code == 200


def _chromium() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome", "chrome"):
        found = shutil.which(name)
        if found:
            return found
    return None


class Browser:
    """Headless chromium driven over the DevTools protocol (websockets' sync client)."""

    def __init__(self, binary: str, tmp: Path):
        from websockets.sync.client import connect
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.proc = subprocess.Popen(
            [binary, "--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
             "--no-first-run", "--no-default-browser-check", f"--remote-debugging-port={port}",
             f"--user-data-dir={tmp / 'chromium-profile'}", "--window-size=1280,900", "about:blank"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        t0, page = time.monotonic(), None
        while page is None:
            if self.proc.poll() is not None or time.monotonic() - t0 > 60:
                raise RuntimeError(f"chromium did not start (exit {self.proc.poll()})")
            try:
                page = next((t for t in httpx.get(f"http://127.0.0.1:{port}/json/list", timeout=2).json()
                             if t.get("type") == "page"), None)
            except httpx.HTTPError:
                time.sleep(0.2)
        self.ws = connect(page["webSocketDebuggerUrl"], max_size=64 * 2**20, open_timeout=30)
        self.ids = itertools.count(1)
        self.errors: list[str] = []      # console errors, uncaught exceptions, CSP reports, failed loads
        self.call("Page.enable")
        self.call("Runtime.enable")
        self.call("Log.enable")
        self.call("Emulation.setDeviceMetricsOverride", width=1280, height=900, deviceScaleFactor=1, mobile=False)

    def call(self, method: str, **params):
        i = next(self.ids)
        self.ws.send(json.dumps({"id": i, "method": method, "params": params}))
        while True:
            msg = json.loads(self.ws.recv(timeout=60))
            self._note(msg)
            if msg.get("id") == i:
                if "error" in msg:
                    raise RuntimeError(f"{method}: {msg['error']}")
                return msg.get("result", {})

    def _note(self, msg: dict) -> None:
        m, p = msg.get("method"), msg.get("params") or {}
        if m == "Runtime.consoleAPICalled" and p.get("type") in ("error", "assert"):
            self.errors.append(" ".join(str(a.get("value", a.get("description"))) for a in p.get("args", [])))
        elif m == "Runtime.exceptionThrown":
            self.errors.append(str(p.get("exceptionDetails", {}).get("text")))
        elif m == "Log.entryAdded" and p.get("entry", {}).get("level") == "error":
            e = p["entry"]
            self.errors.append(f"{e.get('source')}: {e.get('text')} {e.get('url', '')}")

    def js(self, expr: str):
        r = self.call("Runtime.evaluate", expression=expr, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in r:
            raise RuntimeError(f"{expr}: {r['exceptionDetails']}")
        return r["result"].get("value")

    def goto(self, url: str) -> None:
        self.call("Page.navigate", url=url)
        self.wait(f"location.href === {json.dumps(url)} && document.readyState === 'complete'")

    def wait(self, cond: str, timeout: float = 20.0):
        t0 = time.monotonic()
        while True:
            try:
                v = self.js(cond)
            except RuntimeError:
                v = None
            if v:
                return v
            if time.monotonic() - t0 > timeout:
                raise AssertionError(f"not true within {timeout} s: {cond}\npage: {self.js('document.body.innerText')}")
            time.sleep(0.1)

    def close(self) -> None:
        try:
            self.ws.close()
        finally:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def test_run_page_shows_the_verdict_live_in_a_real_browser(gateway, tmp_path):
    binary = _chromium()
    if binary is None and os.geteuid() == 0:   # a fresh machine: the test installs what it needs
        subprocess.run(["apt-get", "update", "-q"], capture_output=True, timeout=300)
        subprocess.run(["apt-get", "install", "-y", "-q", "chromium"], capture_output=True, timeout=600)
        binary = _chromium()
    if binary is None:
        pytest.skip("no chromium binary on PATH and apt-get could not install it (Debian: apt-get install chromium)")
    pytest.importorskip("websockets")
    from PIL import Image

    from serve.client import GatewayClient
    b = Browser(binary, tmp_path)
    try:
        with GatewayClient(gateway, KEY) as gw:
            gw.create_run("What do 17 boxes of 24 pens cost at 0.5 dollars a pen?",
                          agents=["planner", "calculator"], category="math", run_id="pens")
            gw.post_events("pens", _events("pens", PLAN[:1]))
            # sign in through the page's own form (the key becomes the HttpOnly cookie)
            b.goto(f"{gateway}/ui")
            b.js(f"document.querySelector('input[name=key]').value = {json.dumps(KEY)}; "
                 f"document.forms[0].submit(); true")
            b.wait("document.querySelector('#runs') !== null")
            assert "pens" in b.js("document.querySelector('#runs').innerText")
            b.goto(f"{gateway}/ui/runs/pens")
            b.wait("document.body.dataset.live === 'on'")             # the SSE stream is open
            assert b.js("document.querySelectorAll('#timeline tr[data-step]').length") == 1
            assert b.js("document.getElementById('state').innerText") == "running"
            # the agent goes on: new steps and verdicts appear without a reload
            marker = b.js("window.__same_page = 1")                   # no reload from here on
            gw.post_events("pens", _events("pens", PLAN[1:]))
            b.wait("document.querySelectorAll('#timeline tr[data-step]').length === 3")
            assert b.js("document.querySelector('#step-2 .verdict').innerText").startswith("CONTINUE")
            for ev in _events("pens", AGAIN):                          # one post a step, as a hook does
                gw.post_events("pens", [ev])
            b.wait("document.querySelectorAll('#timeline tr[data-step]').length === 7")
            # the fold's finding, with its evidence steps listed and marked in the timeline
            # the timeline may show step 6 a render before its fold's finding: wait for the finding
            b.wait("document.getElementById('findings').innerText.includes('insufficient_loop_evidence')")
            assert b.js("[...document.querySelectorAll('tr.evidence')].map(r => r.dataset.step).join()") == "1,2,3,4,5,6"
            v = gw.post_events("pens", _events("pens", SLIP_LATE))
            assert v["decision"] == "ALARM" and v["k"] == 7
            b.wait("document.getElementById('state').innerText.startsWith('ALARM')")
            assert b.js("window.__same_page") == marker
            assert b.js("document.getElementById('state').innerText") == "ALARM at step 7"
            assert b.js("document.querySelector('tr.alarm-raised').dataset.step") == "7"
            assert b.js("document.querySelector('tr.decisive').dataset.step") == "7"
            assert "418 is wrong" in b.js("document.querySelector('#step-7 .verdict').innerText")
            assert "calculator" in b.js("document.getElementById('alarm').innerText")
            verdicts = b.js("[...document.querySelectorAll('#timeline .verdict')].map(c => c.innerText.split(' ')[0])")
            assert verdicts == ["CONTINUE", "", "CONTINUE", "CONTINUE", "CONTINUE", "CONTINUE", "CONTINUE", "ALARM"]
            shot = base64.b64decode(b.call("Page.captureScreenshot", format="png")["data"])
        out = tmp_path / "run-page.png"
        out.write_bytes(shot)
        keep = os.environ.get("AFTRAJ_SCREENSHOT_DIR")
        if keep:
            Path(keep).mkdir(parents=True, exist_ok=True)
            shutil.copy(out, Path(keep) / "run-page.png")
        img = Image.open(io.BytesIO(shot)).convert("RGB")
        assert img.size == (1280, 900)
        # the ALARM badge and the alarm row's outline are drawn in #c62828
        pixels = list(img.get_flattened_data() if hasattr(img, "get_flattened_data") else img.getdata())
        red = sum(1 for p in pixels if abs(p[0] - 0xC6) < 12 and abs(p[1] - 0x28) < 12 and abs(p[2] - 0x28) < 12)
        green = sum(1 for p in pixels if abs(p[0] - 0xE8) < 6 and abs(p[1] - 0xF5) < 6 and abs(p[2] - 0xE9) < 6)
        orange = sum(1 for p in pixels if abs(p[0] - 0xEF) < 12 and abs(p[1] - 0x6C) < 12 and abs(p[2] - 0x00) < 12)
        assert red > 500, red          # ALARM badges and the outlined row
        assert green > 200, green      # the CONTINUE verdicts of steps 0-6
        assert orange > 300, orange    # the evidence bar of the finding's steps 1-6
    finally:
        b.close()


def _chromium_or_skip() -> str:
    binary = _chromium()
    if binary is None and os.geteuid() == 0:   # a fresh machine: the test installs what it needs
        subprocess.run(["apt-get", "update", "-q"], capture_output=True, timeout=300)
        subprocess.run(["apt-get", "install", "-y", "-q", "chromium"], capture_output=True, timeout=600)
        binary = _chromium()
    if binary is None:
        pytest.skip("no chromium binary on PATH and apt-get could not install it (Debian: apt-get install chromium)")
    pytest.importorskip("websockets")
    return binary


@pytest.fixture
def trace_gateway(tmp_path, serve_app):
    """The gateway of `gateway`, with runs stalled after 2 s without an event."""
    return _web_gateway(tmp_path, serve_app, stalled_after_s=2)


def _shot(b: Browser, tmp_path: Path, name: str):
    from PIL import Image

    shot = base64.b64decode(b.call("Page.captureScreenshot", format="png")["data"])
    (tmp_path / name).write_bytes(shot)
    keep = os.environ.get("AFTRAJ_SCREENSHOT_DIR")
    if keep:
        Path(keep).mkdir(parents=True, exist_ok=True)
        shutil.copy(tmp_path / name, Path(keep) / name)
    img = Image.open(io.BytesIO(shot)).convert("RGB")
    assert img.size == (1280, 900)
    return list(img.get_flattened_data() if hasattr(img, "get_flattened_data") else img.getdata())


def _near(pixels, rgb, tol=12) -> int:
    return sum(1 for p in pixels if all(abs(p[i] - rgb[i]) < tol for i in range(3)))


@pytest.mark.slow
def test_the_trace_view_in_a_real_browser(trace_gateway, tmp_path):
    """Issue 47 item 1: runs newest first with times, durations and agents (hook-created runs
    too), filters, search and paging; a run's page with the tenant, step times and durations,
    per-step verdict latency, the lanes of agents and handoffs, content expandable (no silent
    cut), the ALARM naming its agent, ended and stalled states; no console error (CSP included).
    Issue 45 item 6: a sign-in posted from another origin is refused in the browser."""
    gw_url = trace_gateway
    binary = _chromium_or_skip()
    from serve.client import GatewayClient
    b = Browser(binary, tmp_path)
    evil = None
    try:
        with GatewayClient(gw_url, KEY) as gw:
            for i in range(52):
                gw.create_run(f"bulk task {i}", run_id=f"bulk-{i:02d}")
            gw.create_run("What do 17 boxes of 24 pens cost at 0.5 dollars a pen?",
                          agents=["planner", "calculator"], category="math", run_id="pens")
            t0 = time.time() - 30
            evs = _events("pens", PLAN + SLIP)
            for j, e in enumerate(evs):
                e["ts"] = t0 + 2.5 * j
                if j == 0:                  # the planner's model call: its tokens and cost
                    e["usage"] = {"input_tokens": 812, "output_tokens": 40, "cost_usd": 0.0021, "model": "m"}
                gw.post_events("pens", [e])
            gw.create_run("write a report", run_id="hooked")             # as a hook does: no agents named
            long_text = "The findings, in full. " + " ".join(["alpha beta gamma"] * 300) + " THE-END"
            hooked = [(1, ("researcher", "message", {"content": "Searching the sources."})),
                      (2, ("researcher", "handoff", {"content": "", "to": "writer"})),
                      (3, ("writer", "message", {"content": long_text})),
                      (4, ("writer", "termination", {"content": "done", "reason": "completed"}))]
            for e in _events("hooked", hooked):
                gw.post_events("hooked", [e])
            gw.create_run("a run that goes quiet", agents=["solo"], run_id="quiet")
            gw.post_events("quiet", _events("quiet", [(1, ("solo", "message", {"content": "starting"}))]))
        time.sleep(2.5)                                                   # "quiet" is stalled now
        b.goto(f"{gw_url}/ui")
        b.js(f"document.querySelector('input[name=key]').value = {json.dumps(KEY)}; "
             f"document.forms[0].submit(); true")
        b.wait("document.querySelector('#runs') !== null")
        # the sign-in page itself answers 401 (no key yet): the one network error expected
        assert all("status of 401" in e for e in b.errors), b.errors
        b.errors.clear()
        assert b.js("document.getElementById('tenant').innerText") == "team-a"
        first = b.js("[...document.querySelectorAll('#runs tr')].slice(1, 5).map(r => r.cells[0].innerText)")
        assert first == ["quiet", "hooked", "pens", "bulk-51"]              # newest first
        cells = b.js("[...document.querySelectorAll('#runs tr')].slice(1, 4).map(r => [...r.cells].map(c => c.innerText))")
        quiet, hook_row, pens = cells
        assert quiet[1].startswith("stalled (no event for") and hook_row[1] == "ended (completed)"
        assert pens[1] == "ALARM at step 3" and hook_row[7] == "researcher, writer"     # agents from the events
        assert re.fullmatch(r"\d\d-\d\d \d\d:\d\d:\d\d", pens[2]) and pens[3].endswith("ago") and pens[4]
        assert b.js("document.querySelectorAll('#runs tr').length") == 51     # 50 a page, and a way on
        pixels = _shot(b, tmp_path, "web-runs.png")
        assert _near(pixels, (0xC6, 0x28, 0x28)) > 100                      # the ALARM badge
        assert _near(pixels, (0xFF, 0xF3, 0xE0), 4) > 100                   # the stalled badge
        b.js("document.getElementById('older').click(); true")
        b.wait("location.search.includes('after=')")
        b.wait("document.querySelector('#runs') !== null")
        assert b.js("[...document.querySelectorAll('#runs tr')].slice(1).map(r => r.cells[0].innerText)") == \
            ["bulk-04", "bulk-03", "bulk-02", "bulk-01", "bulk-00"]
        # filters and search, through the page's own form
        b.goto(f"{gw_url}/ui")
        b.js("document.querySelector('select[name=state]').value = 'alarm'; document.getElementById('filters')"
             ".submit(); true")
        b.wait("location.search.includes('state=alarm') && document.querySelector('#runs') !== null")
        assert b.js("[...document.querySelectorAll('#runs tr')].slice(1).map(r => r.cells[0].innerText)") == ["pens"]
        b.goto(f"{gw_url}/ui?q=REPORT")
        assert b.js("[...document.querySelectorAll('#runs tr')].slice(1).map(r => r.cells[0].innerText)") == ["hooked"]
        b.goto(f"{gw_url}/ui?agent=writer")
        assert b.js("[...document.querySelectorAll('#runs tr')].slice(1).map(r => r.cells[0].innerText)") == ["hooked"]
        # the run's trace view
        b.goto(f"{gw_url}/ui/runs/pens")
        b.wait("document.body.dataset.live === 'on'")
        assert b.js("document.getElementById('tenant').innerText") == "team-a"
        assert b.js("document.querySelectorAll('#timeline tr[data-step]').length") == 4
        times = b.js("[...document.querySelectorAll('#timeline tr[data-step]')].map(r => r.cells[1].innerText)")
        assert all(re.fullmatch(r"\d\d:\d\d:\d\d\.\d{3}", x) for x in times), times
        deltas = b.js("[...document.querySelectorAll('#timeline tr[data-step]')].map(r => r.cells[2].innerText)")
        assert deltas == ["", "2.5 s", "2.5 s", "2.5 s"]
        tokens = b.js("[...document.querySelectorAll('#timeline tr[data-step]')].map(r => r.cells[6].innerText)")
        assert tokens == ["812→40\n$0.0021", "", "", ""], tokens
        assert all(" ms" in x for x in b.js("[...document.querySelectorAll('#timeline .verdict')].map(c => c.innerText)"))
        assert b.js("document.querySelectorAll('#lanes circle.mark').length") == 4
        assert b.js("document.querySelectorAll('#lanes line.handoff').length") == 1      # planner -> calculator
        alarm = b.js("document.getElementById('alarm').innerText")
        assert "agent calculator" in alarm and "agent :" not in alarm
        assert "duration" in b.js("document.getElementById('summary').innerText")
        pixels = _shot(b, tmp_path, "web-run.png")
        assert _near(pixels, (0xC6, 0x28, 0x28)) > 300 and _near(pixels, (0xE8, 0xF5, 0xE9), 6) > 100
        # the hook-created run: its agents, a handoff, the whole long content behind "show all"
        b.goto(f"{gw_url}/ui/runs/hooked")
        assert b.js("document.getElementById('agents').innerText") == "researcher, writer"
        assert b.js("document.getElementById('state').innerText") == "ended (completed)"
        assert b.js("document.querySelectorAll('#lanes line.handoff').length") == 1
        assert b.js("document.querySelector('#step-2 details').open") is False
        assert not b.js("document.querySelector('#step-2 .content').innerText.includes('THE-END')")
        b.js("document.querySelector('#step-2 details summary').click(); true")
        b.wait("document.querySelector('#step-2 details').open")
        assert b.js("document.querySelector('#step-2 .content').innerText.includes('THE-END')")
        b.js("document.getElementById('step-2').scrollIntoView(); true")
        _shot(b, tmp_path, "web-run-expanded.png")
        assert b.errors == [], b.errors                                    # no console error, no CSP report
        # a page on another origin posts the sign-in form with tenant B's key: refused
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
        page = (f"<form id=f method=post action='{gw_url}/ui/login'><input name=key value='{OTHER}'></form>"
                f"<script>document.getElementById('f').submit()</script>").encode()

        class Evil(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def do_GET(self):
                self.send_response(200)
                self.send_header("Content-Type", "text/html")
                self.send_header("Content-Length", str(len(page)))
                self.end_headers()
                self.wfile.write(page)

        evil = ThreadingHTTPServer(("127.0.0.1", 0), Evil)
        threading.Thread(target=evil.serve_forever, daemon=True).start()
        b.call("Page.navigate", url=f"http://127.0.0.1:{evil.server_address[1]}/")
        b.wait(f"location.href.startsWith({json.dumps(gw_url + '/ui/login')}) && document.readyState === 'complete'")
        assert "refused" in b.js("document.body.innerText")
        b.goto(f"{gw_url}/ui/runs/pens")
        assert b.js("document.getElementById('tenant').innerText") == "team-a"    # still A's sign-in
    finally:
        b.close()
        if evil is not None:
            evil.shutdown()
