"""Kernel mechanism under the lab: `ip`/`tc` commands, setns, TUN devices, process liveness.

Nothing here knows the lab's layout (that is pdd.lab.plan); every function does one kernel
operation and raises LabError with the command's own message when it fails.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import os
import select
import shutil
import signal
import struct
import subprocess
import time
from collections.abc import Iterator, Sequence

from pdd.errors import LabError

NETNS_DIR = "/run/netns"
_CLONE_NEWNET = 0x40000000
_TUNSETIFF = 0x400454CA
_IFF_TUN = 0x0001
_IFF_NO_PI = 0x1000

_libc = ctypes.CDLL(None, use_errno=True)


def check_host() -> None:
    """Raise LabError unless this process can build a lab: root, /dev/net/tun, ip and tc."""
    if os.geteuid() != 0:
        raise LabError("the lab needs root (network namespaces, TUN devices, tc)")
    if not os.path.exists("/dev/net/tun"):
        raise LabError("/dev/net/tun is missing: the kernel has no TUN support")
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            raise LabError(f"`{tool}` is not installed (apt-get install -y iproute2)")


def run(argv: Sequence[str], *, ok_errors: Sequence[str] = ()) -> str:
    """Run a command, return its stdout; raise LabError with its stderr on failure.

    A failure whose stderr contains one of ``ok_errors`` is ignored (idempotent removals).
    """
    proc = subprocess.run(list(argv), capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        err = proc.stderr.strip()
        if any(text in err for text in ok_errors):
            return ""
        raise LabError(f"`{' '.join(argv)}` failed ({proc.returncode}): {err}")
    return proc.stdout


def netns_exists(name: str) -> bool:
    return os.path.exists(os.path.join(NETNS_DIR, name))


def link_exists(ifname: str) -> bool:
    """Whether a network interface of that name exists in this process's namespace."""
    return os.path.exists(os.path.join("/sys/class/net", ifname))


def _setns(fd: int) -> None:
    if _libc.setns(fd, _CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise LabError(f"setns failed: {os.strerror(err)}")


@contextlib.contextmanager
def enter(netns: str) -> Iterator[None]:
    """Move the calling thread (only it) into a network namespace for the block's duration.

    Sockets and TUN devices opened inside stay in that namespace after the block ends. Other
    threads are untouched, so this is safe in a thread of a multi-threaded program; do not use
    it on an asyncio event-loop thread (every coroutine would run inside).
    """
    try:
        target = os.open(os.path.join(NETNS_DIR, netns), os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        raise LabError(f"network namespace {netns!r} does not exist (is the lab up?)") from None
    home = os.open("/proc/thread-self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
    try:
        _setns(target)
        try:
            yield
        finally:
            _setns(home)
    finally:
        os.close(target)
        os.close(home)


def open_tun(netns: str, ifname: str) -> int:
    """Create a TUN device (raw IP packets, no header) in ``netns``; return its non-blocking fd.

    The device lives as long as the fd: closing it (or the owner dying) removes the device.
    The fd is inheritable so a child process can take it over.
    """
    with enter(netns):
        fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK)
    try:
        req = struct.pack("16sH", ifname.encode(), _IFF_TUN | _IFF_NO_PI)
        fcntl.ioctl(fd, _TUNSETIFF, req)
    except OSError as exc:
        os.close(fd)
        raise LabError(f"cannot create TUN {ifname} in {netns}: {exc}") from exc
    os.set_inheritable(fd, True)
    return fd


def pid_alive(pid: int, marker: str | None = None) -> bool:
    """Whether pid runs (zombies count as dead) and, if given, its command line has ``marker``.

    The marker guards against pid reuse: a recycled pid of another program is not ours.
    """
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
        if state in ("Z", "X"):
            return False
        if marker is None:
            return True
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return marker.encode() in f.read()
    except (OSError, IndexError):
        return False


def netns_pids(netns: str) -> list[int]:
    """Pids of the processes whose network namespace is ``netns`` (``ip netns pids``)."""
    if not netns_exists(netns):
        return []
    out = run(["ip", "netns", "pids", netns], ok_errors=("No such file",))
    return [int(p) for p in out.split()]


def stop_pids(pids: Sequence[int], timeout_s: float = 5.0, marker: str | None = None) -> None:
    """SIGTERM each pid, wait up to ``timeout_s`` for all to go, then SIGKILL the rest.

    With ``marker``, only processes whose command line holds it count (see pid_alive).
    """
    pids = [p for p in pids if p != os.getpid() and pid_alive(p, marker)]
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        deadline = time.monotonic() + timeout_s
        while pids and time.monotonic() < deadline:
            # Not by marker here: an exiting process loses its cmdline before it is gone.
            pids = [p for p in pids if pid_alive(p)]
            if pids:
                time.sleep(0.02)
        if not pids:
            return


def await_reply(fd: int, timeout_s: float, who: str) -> str:
    """Read one line from a readiness pipe: ``ok`` or ``error: ...``.

    Raises LabError if the writer closes the pipe without a line or the deadline passes.
    """
    deadline = time.monotonic() + timeout_s
    data = b""
    while not data.endswith(b"\n"):
        left = deadline - time.monotonic()
        if left <= 0:
            raise LabError(f"{who} gave no answer within {timeout_s:.0f} s")
        readable, _, _ = select.select([fd], [], [], left)
        if readable:
            chunk = os.read(fd, 4096)
            if not chunk:
                raise LabError(f"{who} exited before it was ready")
            data += chunk
    return data.decode().strip()
