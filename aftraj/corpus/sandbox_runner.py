"""The sandbox's runner process (stdlib only). `aftraj.corpus.sandbox.Sandbox` starts it as
`python -I -S -B -c <this file's text>` with an empty environment; it is never imported by the
package and never runs candidate code itself.

Protocol on its stdin/stdout: messages framed as a 4-byte big-endian length + JSON.
  parent -> runner  {"isolation": "auto"|"namespaces"|"none", "base": DIR}   (once)
  runner -> parent  {"isolation": "namespaces"|"none", "why": "..."}
  parent -> runner  {"code", "tests", "timeout", "nonce", "memory_mb", "file_mb", "cpu_s", "wall_s"}
  runner -> parent  {"status": waitstatus, "timed_out": bool, "output": latin-1 text}

For every sample the runner forks a child (a fresh copy of this pristine interpreter: nothing of an
earlier sample survives) which confines itself and then runs the sample; the runner keeps the
wall-clock deadline and reads the child's output pipe. See sandbox.py for the threat model.
"""

import os
import select
import signal
import struct
import sys
import time

import json  # noqa: E402  (requests only; never used after candidate code starts)

# Pre-imported so a sample does not pay for them (a fork shares them copy-on-write).
import bisect, collections, fractions, functools, heapq, io, itertools, math, operator, random, re, resource, statistics, string, typing  # noqa: E401,F401,E501

import ctypes  # only the confining child uses it, before candidate code runs; removed from sys.modules after

_libc = ctypes.CDLL(None, use_errno=True)
_MACHINE = os.uname().machine
_SYS = {"x86_64": {"pivot_root": 155, "capset": 126}, "aarch64": {"pivot_root": 41, "capset": 91}}.get(_MACHINE)
CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWIPC = 0x00020000, 0x04000000, 0x08000000
CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x10000000, 0x20000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 1, 2, 4, 8, 32, 4096, 16384, 1 << 18
MS_NOATIME, MS_NODIRATIME, MS_RELATIME = 1024, 2048, 1 << 21
MNT_DETACH, PR_SET_PDEATHSIG, PR_CAPBSET_DROP, PR_SET_NO_NEW_PRIVS = 2, 1, 24, 38
OUTPUT_CAP = 1 << 20       # bytes of a child's output kept (the rest is drained and dropped)
# read-only views of the host inside the namespace root (the stdlib's folders are added)
HOST_BINDS = ("/usr", "/lib", "/lib32", "/lib64", "/libx32", "/bin", "/etc/ld.so.cache")


# --------------------------------------------------------------------------- framing

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


# --------------------------------------------------------------------------- confinement (child only)

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


NOBODY = 65534
_MAPPED_NOBODY = False       # set by _confine_runner: namespace uid 1 is the host's nobody


def _confine_runner(root, binds):
    """Put this process (the runner, or the probe) into new user, network, mount, ipc and uts
    namespaces whose root is a read-only tmpfs holding read-only binds of the system libraries
    and the stdlib, empty /work and /tmp mount points, and nothing else (no /proc, /etc, /home,
    repository). Done once per runner; each sample then only adds a mount and a pid namespace.

    As the host's root, a helper forked first (still in the host's namespaces) writes the maps:
    0 -> root for the setup, 1 -> nobody for the samples (the host's uid 0 is exempt from
    RLIMIT_NPROC, nobody is not). Otherwise the process maps its own uid to 0."""
    global _MAPPED_NOBODY
    if _SYS is None:
        raise OSError(f"namespaces: no syscall numbers for {_MACHINE}")
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
        _ok(_libc.unshare(CLONE_NEWUSER | CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWIPC | CLONE_NEWUTS), "unshare")
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


def _enter_sample_namespaces(tmpfs_mb):
    """In the sample's child: its own mount namespace with fresh tmpfs /work and /tmp (nothing
    of an earlier sample's files), and a pid namespace the next fork starts."""
    _ok(_libc.unshare(CLONE_NEWNS | CLONE_NEWPID), "unshare")
    for path, mode in ((b"/work", b"0755"), (b"/tmp", b"1777")):
        _ok(_libc.mount(b"tmpfs", path, b"tmpfs", MS_NOSUID | MS_NODEV, b"size=%dm,mode=%s" % (tmpfs_mb, mode)),
            f"mount tmpfs {path.decode()}")


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]


def _drop_capabilities():
    """Root of the new user namespace gives up every capability (no mount, no chroot, no
    remount of the read-only binds), and can never regain one through execve."""
    for cap in range(64):
        if _libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) != 0:
            break
    _ok(_libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "no_new_privs")
    hdr, data = _CapHeader(0x20080522, 0), (_CapData * 2)()
    _ok(_libc.syscall(_SYS["capset"], ctypes.byref(hdr), ctypes.byref(data)), "capset")


def _set_limits(req):
    import resource
    mem = int(req["memory_mb"]) << 20
    cpu = int(req["cpu_s"])
    for lim, val in ((resource.RLIMIT_AS, (mem, mem)), (resource.RLIMIT_CPU, (cpu, cpu + 1)),
                     (resource.RLIMIT_FSIZE, (int(req["file_mb"]) << 20,) * 2), (resource.RLIMIT_NPROC, (0, 0)),
                     (resource.RLIMIT_NOFILE, (64, 64)), (resource.RLIMIT_CORE, (0, 0))):
        resource.setrlimit(lim, val)
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)    # an oversized write fails with EFBIG


# --------------------------------------------------------------------------- the audit hook

def _make_hook(workdir, read_roots, confine_files):
    """The hook judges real types only (an argument of a str subclass is refused, never str()-ed).
    confine_files: without namespaces, file access is confined here to workdir (read/write) and
    the stdlib folders (read), after resolving symlinks with functions bound now."""
    lstat, readlink, getcwd = os.lstat, os.readlink, os.getcwd
    islnk = __import__("stat").S_ISLNK
    write_flags = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
    blocked = frozenset((
        "subprocess.Popen", "os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.fork", "os.forkpty",
        "pty.spawn", "os.kill", "os.killpg", "signal.pthread_kill", "resource.setrlimit", "resource.prlimit",
        "gc.get_objects", "gc.get_referrers", "gc.get_referents", "sys._current_frames", "sys.settrace",
        "sys.setprofile", "_thread.start_new_thread", "os.chroot", "winreg", "webbrowser.open"))
    frame_attrs = frozenset(("tb_frame", "gi_frame", "cr_frame", "ag_frame", "f_back", "f_code"))
    modules = frozenset(("_posixsubprocess", "_ctypes", "ctypes", "_testcapi", "_testinternalcapi",
                         "_xxsubinterpreters", "_xxinterpchannels"))
    # event -> (indices of path arguments, indices of dir_fd arguments, writes?)
    fs_events = {
        "open": ((0,), (), None), "os.listdir": ((0,), (), False), "os.scandir": ((0,), (), False),
        "os.chdir": ((0,), (), False), "os.getxattr": ((0,), (), False), "os.listxattr": ((0,), (), False),
        "os.remove": ((0,), (1,), True), "os.rmdir": ((0,), (1,), True), "os.mkdir": ((0,), (2,), True),
        "os.rename": ((0, 1), (2, 3), True), "os.symlink": ((0, 1), (2,), True), "os.link": ((0, 1), (2, 3), True),
        "os.truncate": ((0,), (), True), "os.chmod": ((0,), (2,), True), "os.chown": ((0,), (3,), True),
        "os.utime": ((0,), (3,), True), "os.setxattr": ((0,), (), True), "os.removexattr": ((0,), (), True),
        "os.chflags": ((0,), (), True), "os.lchflags": ((0,), (), True), "os.mkfifo": ((0,), (), True),
        "os.mknod": ((0,), (), True), "shutil.rmtree": ((0,), (), True)}

    def resolve(p, _str=str, _bytes=bytes, _type=type):
        if _type(p) is _bytes:
            p = p.decode("utf-8", "surrogateescape")
        if not p.startswith("/"):
            p = getcwd() + "/" + p
        parts, done, hops = p.split("/"), [], 0
        while parts:
            part = parts.pop(0)
            if part in ("", "."):
                continue
            if part == "..":
                if done:
                    done.pop()
                continue
            cur = "/" + "/".join(done + [part])
            try:
                st = lstat(cur)
            except OSError:
                done.append(part)
                continue
            if islnk(st.st_mode):
                hops += 1
                if hops > 40:
                    raise PermissionError("sandbox: too many symbolic links")
                target = readlink(cur)
                if target.startswith("/"):
                    done = []
                parts = [x for x in target.split("/")] + parts
                continue
            done.append(part)
        return "/" + "/".join(done)

    def under(path, roots):
        for r in roots:
            if path == r or path.startswith(r + "/"):
                return True
        return False

    def hook(event, args, _type=type, _str=str, _bytes=bytes, _int=int, _deny=PermissionError, _valueerror=ValueError,
             _len=len, _tuple=tuple):
        if event in blocked or event.startswith(("socket.", "ctypes.")):
            raise _deny("sandbox: " + event + " is not allowed")
        if event == "sys._getframe":
            # a ValueError, as for a too-deep frame, so stdlib callers (namedtuple, typing) fall back
            raise _valueerror("sandbox: sys._getframe is not allowed")
        if event == "object.__getattr__" and _len(args) > 1 and (_type(args[1]) is not _str or args[1] in frame_attrs):
            raise _deny("sandbox: this attribute is not allowed")
        if event == "object.__setattr__" and _len(args) > 1 and (_type(args[1]) is not _str or args[1] == "__code__"):
            raise _deny("sandbox: replacing code is not allowed")
        if event == "import" and args:
            name = args[0]
            if _type(name) is not _str:
                raise _deny("sandbox: import of a non-str name is not allowed")
            if name.rpartition(".")[2] in modules:
                raise _deny("sandbox: import " + name + " is not allowed")
        if confine_files and event in fs_events:
            paths, dirfds, writes = fs_events[event]
            for i in dirfds:    # absent: None, or AT_FDCWD (-100) as some events pass it
                if i < _len(args) and _type(args[i]) is _int and args[i] >= 0:
                    raise _deny("sandbox: " + event + " with dir_fd is not allowed")
            if writes is None:     # open(path, mode, flags)
                flags = args[2] if _len(args) > 2 else 0
                writes = _type(flags) is _int and bool(flags & write_flags)
            for i in paths:
                if i >= _len(args):
                    continue
                p = args[i]
                if p is None or _type(p) is _int:
                    continue   # the current folder, or a descriptor the sample already holds
                if _type(p) is not _str and _type(p) is not _bytes:
                    raise _deny("sandbox: " + event + " of a " + _type(p).__name__ + " path is not allowed")
                real = resolve(p)
                if not (under(real, (workdir,)) or (not writes and under(real, read_roots))):
                    raise _deny("sandbox: " + event + " outside the sample's folder is not allowed")

    return hook


# --------------------------------------------------------------------------- the sample (child only)

def _run_sample(req, workdir, read_roots, confine_files):
    """Runs in the confined child. Everything used after the candidate code starts is bound here
    as a local first: a sample can rebind module attributes and builtins, not these."""
    import builtins
    import io
    import sys as _sys
    nonce = req["nonce"]
    code, tests, timeout = req["code"], list(req["tests"]), float(req["timeout"])
    _write, _exit, _exec, _compile, _eval, _repr, _dict, _len, _type, _str = (
        os.write, os._exit, exec, compile, eval, repr, dict, len, type, str)
    _setitimer, _signal, _ITIMER_REAL, _SIGALRM = signal.setitimer, signal.signal, signal.ITIMER_REAL, signal.SIGALRM
    _BaseException, _AssertionError = BaseException, AssertionError
    _StringIO = io.StringIO
    for name in ("ctypes", "_ctypes", "ctypes._endian", "json", "json.decoder", "json.encoder", "json.scanner",
                 "_json", "struct", "_struct", "select"):
        sys.modules.pop(name, None)
    sys.stdin = sys.__stdin__ = _StringIO("")
    sys.stdout = sys.stderr = sys.__stdout__ = sys.__stderr__ = _StringIO()
    sys.argv = ["sandbox"]
    hook = _make_hook(workdir, read_roots, confine_files)
    # nothing of the runner's module is left for the sample to read or call
    main = sys.modules.get("__main__")
    if main is not None:
        for k in [k for k in vars(main) if not k.startswith("__")]:
            delattr(main, k)

    class _Timeout(_BaseException):
        pass

    def _alarm(signum, frame):
        raise _Timeout()

    def _short(e):
        s = _type(e).__name__ + ": " + _str(e)
        return s if _len(s) <= 300 else s[:300] + "..."

    _sys.addaudithook(hook)
    del hook, main
    results = []
    ns = {"__name__": "__sandbox__", "__builtins__": builtins}
    _signal(_SIGALRM, _alarm)
    _setitimer(_ITIMER_REAL, timeout)
    try:
        try:
            _exec(_compile(code, "<candidate>", "exec"), ns)
            load_err = None
        except _Timeout:
            load_err = "timeout"
        except _BaseException as e:
            try:
                load_err = "error: " + _short(e)
            except _BaseException:
                load_err = "error: " + _type(e).__name__
        finally:
            _setitimer(_ITIMER_REAL, 0)
    except _Timeout:
        load_err = "timeout"
    for test in tests:
        if load_err is not None:
            results.append(load_err)
            continue
        try:
            _signal(_SIGALRM, _alarm)
            _setitimer(_ITIMER_REAL, timeout)
            try:
                _exec(_compile(test, "<test>", "exec"), _dict(ns))
                res = "pass"
            except _Timeout:
                res = "timeout"
            except _AssertionError:
                got = ""
                if test.startswith("assert ") and " == " in test:
                    try:
                        got = " got " + _repr(_eval(test[7:].split(" == ", 1)[0], _dict(ns)))[:200]
                    except _BaseException:
                        got = ""
                res = "fail: assertion failed" + got
            except _BaseException as e:
                try:
                    res = "error: " + _short(e)
                except _BaseException:
                    res = "error: " + _type(e).__name__
            finally:
                _setitimer(_ITIMER_REAL, 0)
        except _Timeout:
            res = "timeout"
        if _type(res) is not _str:
            res = "error: the sample returned a non-text error"
        results.append(res)
    try:
        line = nonce + ":" + ",".join([r.encode("utf-8", "backslashreplace").hex() for r in results]) + "\n"
        data = line.encode()
        while data:
            data = data[_write(1, data):]
    finally:
        _exit(0)


def _child(req, base, isolation, read_roots):
    """The forked child: confine, then run the sample. Never returns."""
    try:
        os.setsid()
        _libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if isolation == "namespaces":
            _enter_sample_namespaces(max(16, int(req["file_mb"]) * 2))
            pid = os.fork()         # the sample runs as pid 1 of the new pid namespace
            if pid:
                os.close(1)
                os.close(2)
                _, status = os.waitpid(pid, 0)
                os._exit(os.waitstatus_to_exitcode(status) & 0xFF if os.WIFEXITED(status) else 128 + os.WTERMSIG(status))
            _libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
            if _MAPPED_NOBODY:      # become uid 1 of the namespace (the host's nobody)
                os.chown("/work", 1, 1)
                for cap in range(64):
                    if _libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) != 0:
                        break
                os.setgroups([])
                os.setresgid(1, 1, 1)
                os.setresuid(1, 1, 1)
            _drop_capabilities()
            workdir, confine = "/work", False
        else:
            workdir, confine = req["workdir"], True
            if req.get("as_nobody"):    # the host's root is exempt from RLIMIT_NPROC; nobody is not
                os.chown(workdir, NOBODY, NOBODY)
                os.setgroups([])
                os.setresgid(NOBODY, NOBODY, NOBODY)
                os.setresuid(NOBODY, NOBODY, NOBODY)
        os.chdir(workdir)
        _set_limits(req)
        _run_sample(req, workdir, read_roots, confine)
    except BaseException as e:  # confinement failed: say so on the pipe, report no result
        try:
            os.write(1, f"\nsandbox setup failed: {type(e).__name__}: {e}\n".encode())
        finally:
            os._exit(70)
    os._exit(71)


def _spawn_child(req, base, isolation, read_roots):
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        os.dup2(w, 1)
        os.dup2(w, 2)
        os.close(0)
        os.closerange(3, 65536)
        _child(req, base, isolation, read_roots)
    os.close(w)
    return pid, r


def _collect(pid, r, wall_s):
    deadline = time.monotonic() + wall_s
    out, timed_out = b"", False
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            timed_out = True
            break
        ready, _, _ = select.select([r], [], [], left)
        if not ready:
            continue
        chunk = os.read(r, 65536)
        if not chunk:
            break
        if len(out) < OUTPUT_CAP:
            out += chunk[:OUTPUT_CAP - len(out)]
    os.close(r)
    status = None
    while not timed_out:    # the pipe may close before the child ends (it closed its descriptors)
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return status, False, out
        if time.monotonic() >= deadline:
            timed_out = True
            break
        time.sleep(0.002)
    for kill in (lambda: os.killpg(pid, signal.SIGKILL), lambda: os.kill(pid, signal.SIGKILL)):
        try:
            kill()
        except OSError:
            pass
    _, status = os.waitpid(pid, 0)
    return status, timed_out, out


def _probe(base, binds, read_roots):
    """Can this machine confine the runner in namespaces? A forked copy of the runner tries the
    whole set-up and one trivial sample; the runner follows only if that worked."""
    req = {"code": "", "tests": ["assert 1"], "timeout": 5, "nonce": "probe", "memory_mb": 1024, "file_mb": 1,
           "cpu_s": 5, "wall_s": 10}
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(r)
            _confine_runner(base + "/root", binds)
            cpid, cr = _spawn_child(req, base, "namespaces", read_roots)
            status, _, out = _collect(cpid, cr, 10)
            os.write(w, out[-4000:] or f"wait status {status}".encode())
        except BaseException as e:
            os.write(w, f"{type(e).__name__}: {e}".encode())
        finally:
            os._exit(0)
    os.close(w)
    status, _, out = _collect(pid, r, 30)
    if out.startswith(b"probe:"):
        return True, ""
    return False, out.decode("utf-8", "replace").strip()[-300:] or f"wait status {status}"


def main():
    # No PR_SET_PDEATHSIG here: it fires when the parent *thread* ends, and the Sandbox starts
    # runners from short-lived worker threads. The runner ends when its stdin closes instead.
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    hello = _recv()
    base, wanted = hello["base"], hello["isolation"]
    read_roots = sorted({os.path.realpath(p) for p in sys.path if p and os.path.isdir(p)})
    binds = list(HOST_BINDS) + [p for p in sys.path if p and os.path.isdir(p)
                                and not any(p == b or p.startswith(b + "/") for b in HOST_BINDS)]
    isolation, why = "none", "not asked for"
    was_root = os.geteuid() == 0
    if wanted != "none":
        os.makedirs(base + "/root", exist_ok=True)
        ok, why = _probe(base, binds, read_roots)
        if ok:
            _confine_runner(base + "/root", binds)
            isolation = "namespaces"
    # without namespaces the host's root can drop to nobody only if nobody can read the stdlib
    as_nobody = isolation == "none" and was_root and all(_world_readable(p) for p in read_roots)
    if as_nobody:
        os.chmod(base, 0o711)
    _send({"isolation": isolation, "why": why, "nproc": isolation == "namespaces" or not was_root or as_nobody})
    n = 0
    while True:
        try:
            req = _recv()
        except EOFError:
            return
        workdir = None
        if isolation == "none":
            n += 1
            workdir = f"{base}/s{n}"
            os.mkdir(workdir, 0o700)
            req["workdir"], req["as_nobody"] = workdir, as_nobody
        pid, r = _spawn_child(req, base, isolation, read_roots)
        status, timed_out, out = _collect(pid, r, float(req["wall_s"]))
        if workdir is not None:
            _rmtree(workdir)
        _send({"status": status, "timed_out": timed_out, "output": out.decode("latin-1")})


def _world_readable(path):
    """Every folder from / down to path is searchable by others, and path readable."""
    import stat
    parts = path.rstrip("/").split("/")
    for i in range(1, len(parts) + 1):
        mode = os.stat("/".join(parts[:i]) or "/").st_mode
        if not mode & stat.S_IXOTH or (i == len(parts) and not mode & stat.S_IROTH):
            return False
    return True


def _rmtree(path):
    import shutil
    shutil.rmtree(path, ignore_errors=True)


main()
