"""The sandbox's runner process (stdlib only). `aftraj.corpus.sandbox.Sandbox` starts it as
`python -I -S -B -c <this file's text>` with an empty environment; it is never imported by the
package and never runs candidate code, nor is any sample's process a copy of it: it holds ctypes
(for unshare, mount, pivot_root, capset, prctl), which a sample must never reach.

Protocol on its stdin/stdout: messages framed as a 4-byte big-endian length + JSON.
  parent -> runner  {"isolation": "auto"|"namespaces"|"none", "base": DIR, "zygote": SOURCE, "uid": N}  (once)
  runner -> parent  {"isolation": "namespaces"|"none", "why": "...", "nproc": bool, "uid": int|None,
                     "error": "..." (only when this runner cannot run samples)}
  parent -> runner  {"code", "tests", "timeout", "nonce", "memory_mb", "file_mb", "cpu_s", "wall_s"}
  runner -> parent  {"status": waitstatus, "timed_out": bool, "output": latin-1 text}

Once per runner it confines itself (namespaces mode: new user, network, mount, ipc and uts
namespaces around a read-only root), then starts the zygote (`sandbox_zygote.py`): a fork that
drops every capability (and, as the host's root in namespaces mode, becomes the namespace's uid 1,
the host's nobody), starts a new pid namespace for its children (namespaces mode) and executes a
fresh interpreter, which never imports ctypes. For every sample the runner makes a fresh working
folder (namespaces: new tmpfs /work and /tmp mounted over the last ones; none: a new folder), hands
the zygote one end of a new socket pair, and talks to the sample's process on the other end: frame
1 (the code), then the tests only once the sample says ("loaded:<nonce>") that it is loaded and
frozen. The zygote forks the sample's process, keeps the wall-clock deadline and reports the wait
status; the runner keeps a second deadline over the zygote. See sandbox.py for the threat model.
"""

import os
import select
import signal
import socket
import struct
import sys
import time

import json  # noqa: E402

import ctypes  # the runner's only: never in a sample's process (the zygote is a fresh interpreter)

_libc = ctypes.CDLL(None, use_errno=True)
_MACHINE = os.uname().machine
_SYS = {"x86_64": {"pivot_root": 155, "capset": 126}, "aarch64": {"pivot_root": 41, "capset": 91}}.get(_MACHINE)
CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWIPC = 0x00020000, 0x04000000, 0x08000000
CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x10000000, 0x20000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 1, 2, 4, 8, 32, 4096, 16384, 1 << 18
MS_NOATIME, MS_NODIRATIME, MS_RELATIME = 1024, 2048, 1 << 21
MNT_DETACH, PR_CAPBSET_DROP, PR_SET_NO_NEW_PRIVS = 2, 24, 38
OUTPUT_CAP = 1 << 20       # bytes of a sample's output kept (the rest is drained and dropped)
GRACE_S = 5.0              # past the sample's wall limit, how long the zygote has to report it
# read-only views of the host inside the namespace root (the interpreter and the stdlib's folders are added)
HOST_BINDS = ("/usr", "/lib", "/lib32", "/lib64", "/libx32", "/bin", "/etc/ld.so.cache")
NOBODY = 65534
_PY = os.path.realpath(sys.executable)


# --------------------------------------------------------------------------- framing (parent)

# sandbox_zygote.py keeps its own copy of _read_exact on purpose: it runs alone (`python -c` text)
# and must never import this file, which holds ctypes.
def _read_exact(fd, n):
    buf = b""
    while len(buf) < n:
        chunk = os.read(fd, n - len(buf))
        if not chunk:
            raise EOFError
        buf += chunk
    return buf


def _recv():
    (n,) = struct.unpack(">I", _read_exact(0, 4))
    return json.loads(_read_exact(0, n))


def _send(obj):
    data = json.dumps(obj).encode()
    data = struct.pack(">I", len(data)) + data
    while data:
        data = data[os.write(1, data):]


def _frame(obj):
    data = json.dumps(obj).encode()
    return struct.pack(">I", len(data)) + data


# --------------------------------------------------------------------------- confinement (runner)

def _ok(rc, what):
    if rc != 0:
        e = ctypes.get_errno()
        raise OSError(e, f"{what}: {os.strerror(e)}")


def _put(path, text):
    with open(path, "w") as f:
        f.write(text)


def _mount_flags(path):
    """The flags a read-only remount must keep (a user namespace may not clear locked ones)."""
    f = os.statvfs(path).f_flag
    return sum(ms for st, ms in ((os.ST_NOSUID, MS_NOSUID), (os.ST_NODEV, MS_NODEV), (os.ST_NOEXEC, MS_NOEXEC),
                                 (os.ST_NOATIME, MS_NOATIME), (os.ST_NODIRATIME, MS_NODIRATIME),
                                 (os.ST_RELATIME, MS_RELATIME)) if f & st)


_MAPPED_NOBODY = False       # set by _confine_runner: namespace uid 1 is the host's nobody


def _python_files():
    """The interpreter binary and its shared library: bound into the namespace root for the zygote."""
    import sysconfig
    out = [_PY]
    lib = sysconfig.get_config_var("LIBDIR") or ""
    for name in (sysconfig.get_config_var("INSTSONAME"), sysconfig.get_config_var("LDLIBRARY")):
        if name and ".so" in name:
            path = os.path.realpath(os.path.join(lib, name))
            if os.path.isfile(path) and path not in out:
                out.append(path)
    return out


def _unshare_user():
    """New user, network, mount, ipc and uts namespaces. As the host's root, a helper forked first
    (still in the host's namespaces) writes the maps: 0 -> root for the set-up, 1 -> nobody for
    the zygote and the samples (the host's uid 0 is exempt from RLIMIT_NPROC, nobody is not).
    Otherwise the process maps its own uid to 0. Returns False (nothing changed) if refused."""
    global _MAPPED_NOBODY
    uid, gid = os.geteuid(), os.getegid()
    helper = None
    if uid == 0:
        up_r, up_w = os.pipe()
        down_r, down_w = os.pipe()
        helper = os.fork()
        if helper == 0:          # the helper: waits for the unshare, writes the maps, exits
            code = 1
            try:
                os.close(up_w)
                os.close(down_r)
                if os.read(up_r, 1) == b"u":
                    for kind in ("uid", "gid"):
                        _put(f"/proc/{os.getppid()}/{kind}_map", f"0 0 1\n1 {NOBODY} 1\n")
                    os.write(down_w, b"k")
                    code = 0
            finally:
                os._exit(code)
        os.close(up_r)
        os.close(down_w)
    try:
        if _libc.unshare(CLONE_NEWUSER | CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWIPC | CLONE_NEWUTS) != 0:
            e = ctypes.get_errno()
            raise _Refused(f"unshare: {os.strerror(e)}")
        if helper is None:
            _put("/proc/self/setgroups", "deny")
            _put("/proc/self/uid_map", f"0 {uid} 1")
            _put("/proc/self/gid_map", f"0 {gid} 1")
        else:
            os.write(up_w, b"u")
            if os.read(down_r, 1) != b"k":
                raise OSError("namespaces: the helper could not write the uid map")
            _MAPPED_NOBODY = True
    finally:
        if helper is not None:
            os.close(up_w)
            os.close(down_r)
            os.waitpid(helper, 0)


class _Refused(Exception):
    """The kernel refused the namespaces before anything changed: mode none is still possible."""


def _confine_runner(root, binds):
    """Put this process into new user, network, mount, ipc and uts namespaces whose root is a
    read-only tmpfs holding read-only binds of the system libraries, the interpreter and the
    stdlib, empty /work and /tmp mount points, and nothing else (no /proc, /etc, /home,
    repository). Done once per runner; each sample then gets fresh tmpfs /work and /tmp."""
    if _SYS is None:
        raise _Refused(f"namespaces: no syscall numbers for {_MACHINE}")
    _unshare_user()
    _ok(_libc.mount(b"none", b"/", None, MS_REC | MS_PRIVATE, None), "mount --make-rprivate /")
    r = root.encode()
    _ok(_libc.mount(b"tmpfs", r, b"tmpfs", MS_NOSUID | MS_NODEV, b"size=1m,mode=0755"), "mount tmpfs")
    for src in binds:
        dst = root + src
        if os.path.islink(src):
            os.makedirs(os.path.dirname(dst), exist_ok=True)
            os.symlink(os.readlink(src), dst)
            continue
        if os.path.isdir(src):
            os.makedirs(dst, exist_ok=True)
        elif os.path.isfile(src):
            os.makedirs(os.path.dirname(dst), exist_ok=True)
            open(dst, "w").close()
        else:
            continue
        _ok(_libc.mount(src.encode(), dst.encode(), None, MS_BIND | MS_REC, None), f"bind {src}")
        _ok(_libc.mount(None, dst.encode(), None, MS_REMOUNT | MS_BIND | MS_RDONLY | _mount_flags(src), None),
            f"read-only {src}")
    os.mkdir(root + "/work", 0o755)
    os.mkdir(root + "/tmp", 0o1777)
    _ok(_libc.mount(None, r, None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV, b"size=1m,mode=0755"),
        "read-only root")
    os.chdir(root)
    _ok(_libc.syscall(_SYS["pivot_root"], b".", b"."), "pivot_root")
    _ok(_libc.umount2(b".", MNT_DETACH), "umount old root")
    os.chdir("/")


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]


def _drop_capabilities():
    """Give up every capability (no mount, no chroot, no remount of the read-only binds) and the
    means to regain one through execve: an empty bounding set, no_new_privs, capset to nothing."""
    for cap in range(64):
        if _libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) != 0:
            break
    _ok(_libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "no_new_privs")
    hdr, data = _CapHeader(0x20080522, 0), (_CapData * 2)()
    _ok(_libc.syscall(_SYS["capset"], ctypes.byref(hdr), ctypes.byref(data)), "capset")


# --------------------------------------------------------------------------- the zygote and one sample

class _Zygote:
    """The zygote process (sandbox_zygote.py, a fresh interpreter) and its control socket."""

    def __init__(self, isolation, uid, read_roots, source):
        self.isolation, self.uid, self.read_roots, self.source = isolation, uid, read_roots, source
        self.pid = None
        self.sock = None
        self.buf, self.fds = b"", []

    @property
    def alive(self):
        return self.pid is not None

    def start(self, timeout=60.0):
        a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        pid = os.fork()
        if pid == 0:
            try:
                os.dup2(b.fileno(), 0)
                os.dup2(2, 1)            # the runner's stderr (the parent's /dev/null)
                os.closerange(3, 1 << 16)
                os.chdir("/")
                if self.isolation == "namespaces":
                    _ok(_libc.unshare(CLONE_NEWPID), "unshare pid")   # for the zygote's children
                    if _MAPPED_NOBODY:   # the namespace's uid 1, the host's nobody
                        for cap in range(64):
                            if _libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) != 0:
                                break
                        os.setgroups([])
                        os.setresgid(1, 1, 1)
                        os.setresuid(1, 1, 1)
                    _drop_capabilities()
                else:
                    _ok(_libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "no_new_privs")
                os.execve(_PY, [_PY, "-I", "-S", "-B", "-c", self.source], {})
            finally:
                os._exit(70)
        b.close()
        self.pid, self.sock, self.buf, self.fds = pid, a, b"", []
        self.sock.sendall(_frame({"isolation": self.isolation, "uid": self.uid, "read_roots": self.read_roots}))
        msg = self._next(time.monotonic() + timeout)
        if not msg or not msg[0].get("ready"):
            self.stop()
            raise OSError("the sandbox zygote did not start")
        return msg[0]

    def stop(self):
        if self.pid is None:
            return
        try:
            os.kill(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        os.waitpid(self.pid, 0)
        self.sock.close()
        for fd in self.fds:
            os.close(fd)
        self.pid, self.sock, self.fds = None, None, []

    def _frames(self):
        """Complete frames already received: [(obj, fds)]; descriptors go with the first frame."""
        out = []
        while len(self.buf) >= 4:
            (n,) = struct.unpack(">I", self.buf[:4])
            if len(self.buf) < 4 + n:
                break
            out.append((json.loads(self.buf[4:4 + n]), self.fds))
            self.buf, self.fds = self.buf[4 + n:], []
        return out

    def _fill(self):
        """Read what the zygote sent; EOFError when it is gone."""
        data, fds, _, _ = socket.recv_fds(self.sock, 1 << 16, 4)
        self.fds += fds
        if not data:
            raise EOFError
        self.buf += data

    def _next(self, deadline):
        while True:
            got = self._frames()
            if got:
                return got[0]
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self.sock], [], [], left)[0]:
                return None
            try:
                self._fill()
            except (EOFError, OSError):
                return None

    def run(self, req, workdir):
        """One sample: (wait status, timed out?, output). The zygote is stopped when it fails."""
        a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        control = {k: req[k] for k in ("wall_s", "memory_mb", "cpu_s", "file_mb")}
        control["workdir"] = workdir
        try:
            socket.send_fds(self.sock, [_frame(control)], [b.fileno()])
        except OSError:
            a.close()
            b.close()
            self.stop()
            return 9, False, b""           # as if killed: a crash
        b.close()
        a.setblocking(False)
        nonce = req["nonce"]
        pending = _frame({"code": req["code"], "nonce": nonce, "timeout": req["timeout"]})
        tests = _tests_payload(req["tests"])
        marker = ("loaded:" + nonce + "\n").encode()
        out, scan, sent_tests, a_open = b"", b"", False, True
        status, timed_out, pidfd = None, False, None
        deadline = time.monotonic() + float(req["wall_s"]) + GRACE_S
        while a_open or status is None:
            left = deadline - time.monotonic()
            if left <= 0:                  # the zygote did not report in time: end both
                self._kill_sample(pidfd)
                self.stop()
                status, timed_out = status if status is not None else 9, True
                break
            rlist = [self.sock] + ([a] if a_open else [])
            wlist = [a] if a_open and pending else []
            rr, ww, _ = select.select(rlist, wlist, [], left)
            if ww:
                try:
                    pending = pending[a.send(pending):]
                except BlockingIOError:
                    pass
                except OSError:
                    pending = b""
            if a in rr:
                chunk = _recv_some(a)
                if chunk == b"":
                    a_open = False
                elif chunk:
                    if not sent_tests:
                        scan += chunk
                        if marker in scan:     # loaded and frozen: now, and only now, the tests
                            pending += tests
                            sent_tests = True
                        scan = scan[-(len(marker) - 1):]
                    if len(out) < OUTPUT_CAP:
                        out += chunk[:OUTPUT_CAP - len(out)]
            if self.sock in rr:
                try:
                    self._fill()
                except (EOFError, OSError):  # the zygote died (a sample cannot kill it; a bug can)
                    self._kill_sample(pidfd)
                    pidfd = None
                    self.stop()
                    if status is None:
                        status = 9
                    a_open = False
                    break
                pidfd, status, timed_out = self._reports(pidfd, status, timed_out)
        a.close()
        if pidfd is not None:
            os.close(pidfd)
        return status, timed_out, out

    def _reports(self, pidfd, status, timed_out):
        """The zygote's frames received so far: the sample's pidfd, then its wait status."""
        for msg, fds in self._frames():
            if "pid" in msg and fds:
                pidfd = fds[0]
                for fd in fds[1:]:
                    os.close(fd)
            elif "status" in msg:
                status, timed_out = msg["status"], msg["timed_out"]
                for fd in fds:
                    os.close(fd)
        return pidfd, status, timed_out

    @staticmethod
    def _kill_sample(pidfd):
        if pidfd is not None:
            try:
                signal.pidfd_send_signal(pidfd, signal.SIGKILL)
            except OSError:
                pass


def _tests_payload(tests):
    """The tests as the sample reads them: an 8-byte length, then each test hex-encoded, comma-separated."""
    hexed = b",".join(t.encode("utf-8", "surrogatepass").hex().encode() for t in tests)
    return len(hexed).to_bytes(8, "big") + hexed


def _recv_some(a):
    """What the sample's socket holds: bytes, b"" at its end (or an error), None when nothing yet."""
    try:
        return a.recv(1 << 16)
    except BlockingIOError:
        return None
    except OSError:
        return b""


# --------------------------------------------------------------------------- the runner

class _Places:
    """A fresh working folder per sample: namespaces, new tmpfs /work and /tmp; none, a new folder."""

    def __init__(self, isolation, base, uid):
        self.isolation, self.base, self.uid, self.n = isolation, base, uid, 0

    def make(self, req):
        if self.isolation == "namespaces":
            size = max(16, int(req["file_mb"]) * 2)
            owner = 1 if _MAPPED_NOBODY else 0
            for path, mode in ((b"/work", b"0755"), (b"/tmp", b"1777")):
                opts = b"size=%dm,mode=%s,uid=%d,gid=%d" % (size, mode, owner, owner)
                _ok(_libc.mount(b"tmpfs", path, b"tmpfs", MS_NOSUID | MS_NODEV, opts), f"mount tmpfs {path.decode()}")
            return "/work"
        self.n += 1
        workdir = f"{self.base}/s{self.n}"
        os.mkdir(workdir, 0o700)
        if self.uid is not None:
            os.chown(workdir, self.uid, self.uid)
        return workdir

    def drop(self, workdir):
        if self.isolation == "namespaces":
            for path in (b"/work", b"/tmp"):
                _libc.umount2(path, MNT_DETACH)
        else:
            import shutil
            shutil.rmtree(workdir, ignore_errors=True)


def _run(zygote, places, req):
    if not zygote.alive:
        zygote.start()
    workdir = places.make(req)
    try:
        return zygote.run(req, workdir)
    finally:
        places.drop(workdir)


def main():
    # No PR_SET_PDEATHSIG here: it fires when the parent *thread* ends, and the Sandbox starts
    # runners from short-lived worker threads. The runner ends when its stdin closes instead.
    signal.signal(signal.SIGPIPE, signal.SIG_IGN)   # a sample gone mid-write: EPIPE, not the runner's death
    hello = _recv()
    base, wanted, source = hello["base"], hello["isolation"], hello["zygote"]
    read_roots = sorted({os.path.realpath(p) for p in sys.path if p and os.path.isdir(p)})
    binds = list(HOST_BINDS) + [p for p in sys.path + _python_files() if p and os.path.exists(p)
                                and not any(p == b or p.startswith(b + "/") for b in HOST_BINDS)]
    isolation, why, error = "none", "not asked for", None
    if wanted != "none":
        try:
            os.makedirs(base + "/root", exist_ok=True)
            _confine_runner(base + "/root", binds)
            isolation, why = "namespaces", ""
        except _Refused as e:           # nothing changed: mode none
            why = str(e)
        except Exception as e:          # half confined: this runner cannot go on
            isolation, error = "namespaces", f"namespaces set-up failed: {type(e).__name__}: {e}"
    uid = None
    if isolation == "none" and os.geteuid() == 0:
        uid = int(hello.get("uid", NOBODY))   # a sample is never the host's root
        os.chmod(base, 0o711)
    zygote = _Zygote(isolation, uid, read_roots, source)
    places = _Places(isolation, base, uid)
    if error is None:                   # the whole path once, on a trivial sample
        nonce = os.urandom(16).hex()
        req = {"code": "", "tests": ["assert 1"], "timeout": 10, "nonce": nonce, "memory_mb": 1024, "file_mb": 1,
               "cpu_s": 10, "wall_s": 20}
        try:
            status, _, out = _run(zygote, places, req)
            if (nonce + ":" + "pass".encode().hex() + "\n").encode() not in out:
                detail = out.decode("utf-8", "replace").strip()[-300:] or f"wait status {status}"
                error = f"a trivial sample did not run: {detail}"
        except Exception as e:
            error = f"{type(e).__name__}: {e}"
        if error is not None and uid is not None:
            error = (f"isolation 'none' as the host's root runs every sample as uid {uid}, and that failed "
                     f"here: {error}")
    _send({"isolation": isolation, "why": why, "nproc": True, "uid": uid, "error": error})
    if error is not None:
        zygote.stop()
        return
    while True:
        try:
            req = _recv()
        except EOFError:
            zygote.stop()
            return
        status, timed_out, out = _run(zygote, places, req)
        _send({"status": status, "timed_out": timed_out, "output": out.decode("latin-1")})


main()
