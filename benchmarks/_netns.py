"""Two simulated nodes as Linux network namespaces joined by one bandwidth-shaped veth pair.

::

    netns <ns0>                                          netns <ns1>
      ranks 0 .. N-1                                       ranks N .. 2N-1
      veth <dev0> 10.231.0.1/24  ======================  veth <dev1> 10.231.0.2/24
             tc tbf rate R (egress)                             tc tbf rate R (egress)

Ranks of one node talk to each other through their namespace's own address, which the kernel
routes over that namespace's loopback (unshaped); the other node is reachable only through the
veth pair, shaped in both directions by a token bucket on each end's egress. Addresses exist
only inside the two namespaces. Deleting a namespace deletes its veth end, and with it the pair,
so cleanup is two commands, safe to repeat.

Every command goes through a :class:`Shell`, which either runs it or, with ``dry_run``, only
prints it: the setup and cleanup paths are testable without root.
"""

from __future__ import annotations

import atexit
import os
import shutil
import signal
import subprocess
from dataclasses import dataclass
from typing import Callable, List, Optional, Sequence

Command = List[str]


@dataclass(frozen=True)
class NetPlan:
    """Names and addresses of one run's two namespaces (unique per ``tag``)."""

    tag: str
    """Suffix that keeps concurrent runs apart (e.g. the launcher's pid)."""
    subnet: str = "10.231.0"
    """First three octets of the /24 the veth ends get (namespace-only)."""
    mtu: Optional[int] = None
    """MTU of both veth ends (None: the kernel's default, 1500)."""
    bin_dir: Optional[str] = None
    """Directory holding the ``ip`` and ``tc`` to use (None: the ones on PATH)."""
    burst_seconds: float = 0.01
    """Token-bucket depth as seconds of traffic at the shaped rate..."""
    min_burst: int = 64 * 1024
    """...but never fewer bytes than this."""
    latency_ms: int = 100
    """Queueing delay tbf allows before it drops packets."""

    def __post_init__(self):
        # Interface names are limited to 15 characters: "zpp" + tag + "v0".
        if not self.tag.isalnum() or len(self.tag) > 10:
            raise ValueError(f"tag must be 1-10 alphanumeric characters, got {self.tag!r}")
        octets = self.subnet.split(".")
        if len(octets) != 3 or not all(o.isdigit() and int(o) < 256 for o in octets):
            raise ValueError(f"subnet must be three octets like '10.231.0', got {self.subnet!r}")
        if self.mtu is not None and not 576 <= self.mtu <= 65535:
            raise ValueError(f"mtu must be in 576..65535 or None, got {self.mtu!r}")
        if not (self.burst_seconds > 0 and self.min_burst > 0 and self.latency_ms > 0):
            raise ValueError(f"burst_seconds, min_burst and latency_ms must be > 0, got "
                             f"{self.burst_seconds!r}, {self.min_burst!r}, {self.latency_ms!r}")

    @property
    def ip(self) -> str:
        return os.path.join(self.bin_dir, "ip") if self.bin_dir else "ip"

    @property
    def tc(self) -> str:
        return os.path.join(self.bin_dir, "tc") if self.bin_dir else "tc"

    nodes = 2

    def ns(self, node: int) -> str:
        return f"zpp{self.tag}n{self._check(node)}"

    def dev(self, node: int) -> str:
        return f"zpp{self.tag}v{self._check(node)}"

    def addr(self, node: int) -> str:
        return f"{self.subnet}.{self._check(node) + 1}"

    def _check(self, node: int) -> int:
        if node not in (0, 1):
            raise ValueError(f"node must be 0 or 1 (two namespaces), got {node!r}")
        return node

    def setup_commands(self) -> List[Command]:
        """Create both namespaces, the veth pair between them, addresses, links up."""
        ip = self.ip
        cmds: List[Command] = [[ip, "netns", "add", self.ns(i)] for i in (0, 1)]
        cmds.append([ip, "link", "add", self.dev(0), "type", "veth", "peer", "name",
                     self.dev(1)])
        mtu = ["mtu", str(self.mtu)] if self.mtu is not None else []
        for i in (0, 1):
            cmds += [
                [ip, "link", "set", self.dev(i), "netns", self.ns(i)],
                [ip, "-n", self.ns(i), "addr", "add", f"{self.addr(i)}/24", "dev", self.dev(i)],
                [ip, "-n", self.ns(i), "link", "set", "lo", "up"],
                [ip, "-n", self.ns(i), "link", "set", self.dev(i)] + mtu + ["up"],
            ]
        return cmds

    def shape_commands(self, rate_mbit: Optional[float]) -> List[Command]:
        """Token-bucket both veth ends to ``rate_mbit`` Mbit/s; ``None`` = no shaping."""
        cmds = []
        for i in (0, 1):
            tc = [self.ip, "netns", "exec", self.ns(i), self.tc, "qdisc"]
            if rate_mbit is None:
                cmds.append(tc + ["replace", "dev", self.dev(i), "root", "pfifo", "limit", "10000"])
                continue
            if not rate_mbit > 0:
                raise ValueError(f"rate must be > 0 Mbit/s or None, got {rate_mbit!r}")
            # The bucket must hold at least one timer tick of traffic at this rate, or tbf cannot
            # reach it (defaults: 10 ms worth, at least 64 KiB, 100 ms of queue before drops).
            burst = max(self.min_burst, int(rate_mbit * 1e6 / 8 * self.burst_seconds))
            cmds.append(tc + ["replace", "dev", self.dev(i), "root", "tbf", "rate",
                              f"{rate_mbit:g}mbit", "burst", str(burst), "latency",
                              f"{self.latency_ms}ms"])
        return cmds

    def cleanup_commands(self) -> List[Command]:
        """Delete both namespaces (the veth pair goes with them)."""
        return [[self.ip, "netns", "del", self.ns(i)] for i in (0, 1)]

    def exec_prefix(self, node: int) -> Command:
        """Run a command inside ``node``'s namespace with gloo bound to its veth."""
        return [self.ip, "netns", "exec", self.ns(node), "env",
                f"GLOO_SOCKET_IFNAME={self.dev(node)}"]


class ShapingUnavailable(RuntimeError):
    """``tc`` could not install the token-bucket shaper (e.g. no sch_tbf in this kernel)."""


class Shell:
    """Runs commands, or only prints them (``dry_run``); ``echo`` receives each command line."""

    def __init__(self, dry_run: bool = False, echo: Optional[Callable[[str], None]] = None,
                 env: Optional[dict] = None):
        self.dry_run = dry_run
        self.echo = echo
        # None: this process's environment; else e.g. LD_LIBRARY_PATH for a private ip/tc build.
        self.env = env
        self.log: List[str] = []

    def run(self, cmd: Sequence[str], check: bool = True) -> bool:
        """Run ``cmd``; returns whether it succeeded. ``check`` raises RuntimeError on failure."""
        line = " ".join(cmd)
        self.log.append(line)
        if self.echo is not None:
            self.echo(("$ " if self.dry_run else "+ ") + line)
        if self.dry_run:
            return True
        proc = subprocess.run(list(cmd), capture_output=True, text=True, env=self.env)
        if proc.returncode and check:
            raise RuntimeError(f"command failed ({proc.returncode}): {line}\n{proc.stderr.strip()}")
        return proc.returncode == 0


def unavailable_reason(shell: Shell, plan: NetPlan) -> Optional[str]:
    """Why namespaces cannot be used here (None if they can): root, iproute2, a probe namespace."""
    if shell.dry_run:
        return None
    if os.geteuid() != 0:
        return "needs root (network namespaces and tc)"
    missing = [t for t in (plan.ip, plan.tc) if shutil.which(t) is None]
    if missing:
        return f"{' and '.join(missing)} not found (apt-get install -y iproute2)"
    probe = f"zpp{plan.tag}probe"
    try:
        shell.run([plan.ip, "netns", "add", probe])
    except RuntimeError as exc:
        return f"cannot create a network namespace here: {exc}"
    shell.run([plan.ip, "netns", "del", probe], check=False)
    return None


class ShapedNetwork:
    """Context manager: set the namespaces up, shape the link, always tear them down.

    Cleanup runs on normal exit, on an exception, on SIGTERM/SIGHUP (turned into SystemExit so
    the ``finally`` blocks run) and, as a last resort, at interpreter exit.
    """

    def __init__(self, plan: NetPlan, shell: Shell):
        self.plan = plan
        self.shell = shell
        self._up = False
        self._old_handlers: dict = {}

    def __enter__(self) -> "ShapedNetwork":
        atexit.register(self.cleanup)
        if not self.shell.dry_run:
            for sig in (signal.SIGTERM, signal.SIGHUP):
                self._old_handlers[sig] = signal.signal(sig, _raise_exit)
        self._up = True
        try:
            for cmd in self.plan.setup_commands():
                self.shell.run(cmd)
        except BaseException:
            self.cleanup()
            raise
        return self

    def shape(self, rate_mbit: Optional[float]) -> None:
        """Shape both directions to ``rate_mbit`` (None: unshaped); replaces the last rate."""
        for cmd in self.plan.shape_commands(rate_mbit):
            try:
                self.shell.run(cmd)
            except RuntimeError as exc:
                raise ShapingUnavailable(str(exc)) from exc

    def cleanup(self) -> None:
        """Delete the namespaces (idempotent; every command runs even if one fails)."""
        if not self._up:
            return
        self._up = False
        for cmd in self.plan.cleanup_commands():
            self.shell.run(cmd, check=False)

    def __exit__(self, *exc) -> None:
        self.cleanup()
        for sig, old in self._old_handlers.items():
            signal.signal(sig, old)
        atexit.unregister(self.cleanup)


def _raise_exit(signum, frame):
    raise SystemExit(128 + signum)
