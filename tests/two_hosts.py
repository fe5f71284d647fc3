"""Two hosts on one machine: two Linux network namespaces joined by one veth pair.

    with TwoHosts(rate="100mbit") as hosts:          # needs root (see `why_not()`)
        a = hosts.start("a", "torchrun ... --rdzv-endpoint hostA:29500 ...", cwd=folder, log=path)
        b = hosts.start("b", "...", cwd=folder, log=path)
        hosts.wait(a, timeout_seconds=60)
        hosts.cut()                                    # `ip link set <veth> down`: the cable pulled

Each host is a namespace with its own loopback and one end of the veth pair
(10.213.0.1/24 on host A, 10.213.0.2/24 on host B: addresses that exist only inside the
namespaces made here).  A command runs there as

    ip netns exec NS unshare --uts sh -c 'hostname hostA || exit 97; COMMAND'

so that it has its own hostname: torchrun's c10d rendezvous hosts its store on the
machine whose *hostname* is the endpoint's, and namespaces otherwise share the machine's
name.  `ip netns exec` mounts /etc/netns/NS/hosts over /etc/hosts, which is where hostA
and hostB get their addresses.

An optional rate limit is a token bucket filter (`tc qdisc ... tbf`) on both ends of the
link, so each direction carries at most `rate`.  Everything made here carries one prefix,
`pl2h<pid><n>` (at most 15 characters, Linux's limit for an interface name), and is
removed by that name on leaving: every process group started, both namespaces (a
namespace's veth end goes with it), the two /etc/netns folders (and /etc/netns itself when it was
made here and is empty).  A sysctl set with `give_up_on_tcp_after` lives in its namespace and goes
with it.  Nothing else is touched.
"""

from __future__ import annotations

import itertools
import os
import shlex
import shutil
import signal
import subprocess
import time
from pathlib import Path

NETNS_ETC = Path("/etc/netns")
ADDRESSES = {"a": "10.213.0.1", "b": "10.213.0.2"}
HOSTNAMES = {"a": "hostA", "b": "hostB"}
_made = itertools.count()


def why_not() -> str | None:
    """Why two hosts cannot be made here (None: they can): root, `ip`, `unshare` and namespaces are needed."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return "two hosts in network namespaces need root (ip netns, veth, tc)"
    for tool in ("ip", "unshare", "tc"):
        if shutil.which(tool) is None:
            return f"two hosts need the `{tool}` command (iproute2 / util-linux)"
    probe = f"pl2h{os.getpid():x}p"
    made = _run(["ip", "netns", "add", probe], check=False)
    if made.returncode != 0:
        return f"network namespaces are unavailable here: ip netns add said {made.stderr.strip()!r}"
    try:
        uts = _run(["ip", "netns", "exec", probe, "unshare", "--uts", "true"], check=False)
        if uts.returncode != 0:
            return f"unshare --uts fails inside a namespace: {uts.stderr.strip()!r}"
    finally:
        _run(["ip", "netns", "del", probe], check=False)
    return None


def _run(command: list[str], check: bool = True) -> subprocess.CompletedProcess:
    done = subprocess.run(command, capture_output=True, text=True, timeout=30, check=False)
    if check and done.returncode != 0:
        raise RuntimeError(f"{shlex.join(command)} failed ({done.returncode}): {done.stderr.strip()}")
    return done


class TwoHosts:
    """Host A and host B, one veth pair between them (module docstring)."""

    def __init__(self, rate: str | None = None, burst: str = "32kbit", queue_latency: str = "400ms"):
        self.prefix = f"pl2h{os.getpid():x}{next(_made)}"  # e.g. pl2h1a2b30: unique to this process and call
        self.namespace = {"a": self.prefix + "a", "b": self.prefix + "b"}
        self.interface = {"a": self.prefix + "A", "b": self.prefix + "B"}  # the veth end in each namespace
        self.rate, self.burst, self.queue_latency = rate, burst, queue_latency
        self.processes: list[subprocess.Popen] = []
        self.made_namespaces: list[str] = []
        self.made_folders: list[Path] = []

    # making and removing ------------------------------------------------------------------------------
    def __enter__(self) -> TwoHosts:
        try:
            self._make()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _make(self) -> None:
        for side in "ab":
            _run(["ip", "netns", "add", self.namespace[side]])
            self.made_namespaces.append(self.namespace[side])
        # made in namespace A with its peer there too, then the peer moved to B: nothing appears outside
        _run(["ip", "-n", self.namespace["a"], "link", "add", self.interface["a"], "type", "veth",
              "peer", "name", self.interface["b"]])
        _run(["ip", "-n", self.namespace["a"], "link", "set", self.interface["b"], "netns", self.namespace["b"]])
        hosts_file = "127.0.0.1 localhost\n" + "".join(f"{ADDRESSES[s]} {HOSTNAMES[s]}\n" for s in "ab")
        for side in "ab":
            ns, dev = self.namespace[side], self.interface[side]
            _run(["ip", "-n", ns, "link", "set", "lo", "up"])
            _run(["ip", "-n", ns, "addr", "add", f"{ADDRESSES[side]}/24", "dev", dev])
            _run(["ip", "-n", ns, "link", "set", dev, "up"])
            if not NETNS_ETC.exists():
                NETNS_ETC.mkdir()
                self.made_folders.append(NETNS_ETC)  # removed last, if empty by then
            folder = NETNS_ETC / ns
            folder.mkdir(exist_ok=False)
            self.made_folders.append(folder)
            (folder / "hosts").write_text(hosts_file)
        if self.rate is not None:
            self.limit(self.rate)

    def limit(self, rate: str) -> None:
        """Put (or replace) a token bucket of `rate` (tc's units: 100mbit, 1gbit) on both ends of the link."""
        for side in "ab":
            _run(["ip", "netns", "exec", self.namespace[side], "tc", "qdisc", "replace", "dev",
                  self.interface[side], "root", "tbf", "rate", rate, "burst", self.burst, "latency",
                  self.queue_latency])
        self.rate = rate

    def close(self) -> None:
        """End every process group started here, then remove exactly what was made (by name)."""
        for process in self.processes:
            self.kill(process)
        for ns in self.made_namespaces:
            _run(["ip", "netns", "del", ns], check=False)
        for folder in reversed(self.made_folders):
            if folder == NETNS_ETC:
                try:
                    folder.rmdir()  # only when empty: another run may be using it
                except OSError:
                    pass
            else:
                shutil.rmtree(folder, ignore_errors=True)
        self.made_namespaces, self.made_folders = [], []

    # running ------------------------------------------------------------------------------------------
    def command(self, side: str, command: str) -> list[str]:
        """`command` (shell text) as it runs on host `side`: its namespace, its own hostname."""
        inner = f"hostname {HOSTNAMES[side]} || exit 97\n{command}"
        return ["ip", "netns", "exec", self.namespace[side], "unshare", "--uts", "sh", "-c", inner]

    def start(self, side: str, command: str, cwd: Path | str, log: Path | str,
              env: dict | None = None) -> subprocess.Popen:
        """Start `command` on host `side` in a new session (so its whole group can be killed); output to `log`."""
        with open(log, "w") as out:
            process = subprocess.Popen(self.command(side, command), cwd=cwd, stdout=out, stderr=subprocess.STDOUT,
                                       stdin=subprocess.DEVNULL, start_new_session=True,
                                       env=None if env is None else {**os.environ, **env})
        self.processes.append(process)
        return process

    def run(self, side: str, command: str, timeout_seconds: float = 30) -> subprocess.CompletedProcess:
        """Run a short command on host `side` and wait for it."""
        return subprocess.run(self.command(side, command), capture_output=True, text=True, timeout=timeout_seconds,
                              check=False)

    @staticmethod
    def kill(process: subprocess.Popen) -> None:
        """SIGKILL the process group `process` leads (it was started in its own session), then reap it."""
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass

    def wait_all(self, processes: list[subprocess.Popen], timeout_seconds: float) -> list[int | None]:
        """Wait for every process until a shared deadline; the return codes (None: still running then)."""
        deadline = time.monotonic() + timeout_seconds
        codes = []
        for process in processes:
            try:
                codes.append(process.wait(timeout=max(0.1, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                codes.append(None)
        return codes

    def cut(self, side: str = "b") -> None:
        """Pull the cable: `ip link set <veth> down` on host `side` (the pair's other end goes down with it)."""
        _run(["ip", "-n", self.namespace[side], "link", "set", self.interface[side], "down"])

    def give_up_on_tcp_after(self, side: str, retries: int) -> None:
        """Set host `side`'s `net.ipv4.tcp_retries2` (a per-namespace sysctl; Linux's default is 15): how many
        times TCP retransmits unacknowledged data before the connection fails with "Connection timed out".
        With the 200 ms minimum retransmission timeout doubling each time, 5 retries give up after about
        13 s and 15 after about 15 minutes."""
        _run(["ip", "netns", "exec", self.namespace[side], "sysctl", "-q", "-w", f"net.ipv4.tcp_retries2={retries}"])

    def survivors(self) -> list[int]:
        """Pids still alive in any namespace made here (`ip netns pids`): what a clean end leaves is []."""
        pids = []
        for ns in self.made_namespaces:
            found = _run(["ip", "netns", "pids", ns], check=False)
            pids += [int(p) for p in found.stdout.split()]
        return pids
