"""A multi-host test bed on one Linux machine: emulated hosts that are network namespaces on one
bridge, each with its own address in 198.18.0.0/24 (the benchmarking range; no other address is
ever used), its own host name (resolving to 127.0.0.1, as the default /etc/hosts of Debian and
Ubuntu images and of many containers has it), its own /tmp (a tmpfs in a private mount
namespace) and a link shaped on both ends of its veth with tc `tbf` (these kernels have no netem:
bandwidth only, no added delay). A directory outside /tmp is the same on every host, as /dbfs,
/Volumes or an NFS mount are on real clusters.

On it: a Spark standalone master on its own host, one worker per worker host (pyspark's own
bin/spark-class), drivers on their own host, and a client host (a Spark Connect client, say). Needs root (CAP_NET_ADMIN, CAP_SYS_ADMIN);
`why_not()` says why a machine cannot host it. Everything started is stopped by PID, and every
namespace and link removed, also when a test fails.

Hosts may differ in CPU as well as links: `cpus={n: cores}` (or `set_cpu`) gives worker host n a
CPU capacity (a cgroup of its own, tests/support/cpu_capacity.py: cgroup v2 cpu.max, else v1 CFS
quota) that its Spark Worker and every executor and Python worker under it share;
`noisy_neighbour` changes a host's capacity at seeded random times. `cpu_why_not()` says why a
machine cannot.
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyspark

import cpu_capacity
from bed_cpu import BedCpu
from standalone import descendants

SPARK_CLASS = Path(pyspark.__file__).parent / "bin" / "spark-class"
SUBNET = "198.18.0"  # RFC 2544 benchmarking range: only addresses in it are assigned
MASTER_PORT = 7077
GBIT = 1_000_000_000


@dataclass(frozen=True)
class Host:
    name: str  # its host name (what `hostname` prints on it; resolves to 127.0.0.1 there)
    address: str  # 198.18.0.x
    rate_bps: int  # its link's rate, both directions
    namespace: str
    index: int


@dataclass
class Started:
    host: Host
    process: subprocess.Popen[Any]
    log: Path


def why_not() -> str | None:
    """None when this machine can host the bed, else why not (the tests skip with it)."""
    if not sys.platform.startswith("linux"):
        return "the multi-host bed needs Linux network and mount namespaces"
    if os.geteuid() != 0:
        return "the multi-host bed needs root (CAP_NET_ADMIN for namespaces and links, CAP_SYS_ADMIN for mounts)"
    for tool in ("ip", "tc", "unshare", "mount"):
        if shutil.which(tool) is None:
            return f"the multi-host bed needs `{tool}` (iproute2 / util-linux)"
    probe = f"sdlprobe{os.getpid() % 100000}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"cannot create a network namespace here: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def cpu_why_not() -> str | None:
    """None when hosts' CPU capacities can be set here (Bed(cpus=...), set_cpu), else why not."""
    return cpu_capacity.why_not()


def _run(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(list(args), capture_output=True, text=True)
    if check and done.returncode != 0:
        raise RuntimeError(f"{' '.join(args)} failed ({done.returncode}): {done.stderr.strip()}")
    return done


def tbf_burst_bytes(rate_bps: int) -> int:
    """About 1 ms of the rate (a larger bucket lets short transfers ride above the rate), but at
    least two full frames, which tbf needs to pass a packet at all."""
    return max(rate_bps // 8 // 1000, 2 * 1514)


class Bed(BedCpu):
    """`Bed(root, workers=3).start()`; `bed.run_on(bed.driver, [...])`; `bed.stop()` (also a
    context manager). `rates` sets worker host n's link (n from 1, bits/s), default 1 Gbit/s. Besides
    the master, the driver and the workers, a `client` host (for a Spark Connect client, say).
    `cpus` sets worker host n's CPU capacity in cores (0.33: a third of one core), default unlimited."""

    def __init__(self, root: Path, workers: int = 2, rates: dict[int, int] | None = None,
                 worker_cores: int = 1, worker_memory: str = "2g", cpus: dict[int, float] | None = None) -> None:
        if workers < 1:
            raise ValueError("the bed needs at least one worker host")
        self.root = Path(root)
        if str(self.root.resolve()).startswith("/tmp"):
            raise ValueError("the bed's root must lie outside /tmp: every host mounts its own /tmp")
        self.tag = f"sdl{os.getpid() % 100000}"
        self.switch = f"{self.tag}-sw"
        rates = rates or {}
        # master .2, driver .3, client .4 (a second driver-side host: a Connect client, say), workers .11, .12, ...
        roles = [("master", 2, GBIT), ("driver", 3, GBIT), ("client", 4, GBIT)]
        roles += [(f"worker{i}", 10 + i, rates.get(i, GBIT)) for i in range(1, workers + 1)]
        self.hosts = [Host(name=f"{self.tag}-{role}", address=f"{SUBNET}.{octet}", rate_bps=rate,
                           namespace=f"{self.tag}-{role}", index=index)
                      for index, (role, octet, rate) in enumerate(roles)]
        self.worker_cores, self.worker_memory = worker_cores, worker_memory
        self.shared = self.root / "shared"
        self._started: list[Started] = []
        self._namespaces: list[str] = []
        self._cpus = dict(cpus or {})
        self._cpu_groups: cpu_capacity.CpuGroups | None = None
        self._neighbours: list[cpu_capacity.NoisyNeighbour] = []

    # -- hosts -----------------------------------------------------------------------------------
    @property
    def master(self) -> Host:
        return self.hosts[0]

    @property
    def driver(self) -> Host:
        return self.hosts[1]

    @property
    def client(self) -> Host:
        return self.hosts[2]

    @property
    def workers(self) -> list[Host]:
        return self.hosts[3:]

    @property
    def master_url(self) -> str:
        return f"spark://{self.master.address}:{MASTER_PORT}"

    def start(self, spark: bool = True) -> "Bed":
        """The hosts and their links, then (spark) the master and one worker per worker host."""
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            self.shared.mkdir(exist_ok=True)
            self._make_switch()
            for host in self.hosts:
                self._make_host(host)
            if spark:
                self._start_spark()  # at full speed: the capacities apply to the Workers and what they start
            for n, cores in self._cpus.items():
                self.set_cpu(self.workers[n - 1], cores)
        except BaseException:
            self.stop()
            raise
        return self

    def __enter__(self) -> "Bed":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def _add_namespace(self, name: str) -> None:
        _run("ip", "netns", "del", name, check=False)  # a leftover of a killed run of this pid
        _run("ip", "netns", "add", name)
        self._namespaces.append(name)
        _run("ip", "-n", name, "link", "set", "lo", "up")

    def _make_switch(self) -> None:
        self._add_namespace(self.switch)
        _run("ip", "-n", self.switch, "link", "add", "br0", "type", "bridge")
        _run("ip", "-n", self.switch, "link", "set", "br0", "up")

    def _make_host(self, host: Host) -> None:
        self._add_namespace(host.namespace)
        port = f"p{host.index}"
        _run("ip", "-n", self.switch, "link", "add", port, "type", "veth", "peer", "name", "eth0",
             "netns", host.namespace)
        _run("ip", "-n", self.switch, "link", "set", port, "master", "br0")
        _run("ip", "-n", self.switch, "link", "set", port, "up")
        _run("ip", "-n", host.namespace, "addr", "add", f"{host.address}/24", "dev", "eth0")
        _run("ip", "-n", host.namespace, "link", "set", "eth0", "up")
        self.shape(host, host.rate_bps)
        hosts_dir = self.root / "hosts" / host.name
        hosts_dir.mkdir(parents=True, exist_ok=True)
        # Its own name resolves to loopback, as on a stock Debian/Ubuntu image or container.
        (hosts_dir / "etc-hosts").write_text(f"127.0.0.1\tlocalhost\n127.0.0.1\t{host.name}\n")

    def shape(self, host: Host, rate_bps: int) -> None:
        """Set `host`'s link to `rate_bps` both ways (egress of its eth0 and of its switch port)."""
        for namespace, dev in ((host.namespace, "eth0"), (self.switch, f"p{host.index}")):
            _run("tc", "-n", namespace, "qdisc", "replace", "dev", dev, "root", "tbf", "rate", f"{rate_bps}bit",
                 "burst", str(tbf_burst_bytes(rate_bps)), "latency", "200ms")

    def shape_apart(self, host: Host, others: list[Host], rate_bps: int, apart_bps: int) -> None:
        """`host`'s link at `rate_bps`, except what it exchanges with `others`: `apart_bps` each way
        (an htb class of its own on both ends of the link, shared by those peers), as a host reaches
        another rack or zone over a slower path."""
        for namespace, dev, peer in ((host.namespace, "eth0", "dst"), (self.switch, f"p{host.index}", "src")):
            _run("tc", "-n", namespace, "qdisc", "replace", "dev", dev, "root", "handle", "1:", "htb", "default", "10")
            for classid, rate in (("1:10", rate_bps), ("1:20", apart_bps)):
                burst = str(tbf_burst_bytes(rate))
                _run("tc", "-n", namespace, "class", "add", "dev", dev, "parent", "1:", "classid", classid, "htb",
                     "rate", f"{rate}bit", "ceil", f"{rate}bit", "burst", burst, "cburst", burst)
            for other in others:
                _run("tc", "-n", namespace, "filter", "add", "dev", dev, "parent", "1:", "protocol", "ip", "prio", "1",
                     "u32", "match", "ip", peer, f"{other.address}/32", "flowid", "1:20")

    def cut(self, host: Host) -> None:
        """Take `host`'s link down (its switch port): nothing reaches it or leaves it."""
        _run("ip", "-n", self.switch, "link", "set", f"p{host.index}", "down")

    def mend(self, host: Host) -> None:
        _run("ip", "-n", self.switch, "link", "set", f"p{host.index}", "up")

    def reject(self, sources: list[Host], targets: list[Host], on: bool, ports: str = "") -> None:
        """Reject (ICMP "administratively prohibited", as a firewall's REJECT rule) TCP packets from
        `sources` to `targets` (not to themselves): all of them, or with `ports` ("lo-hi") those from
        such a port to such a port, as a firewall that lets through only the ports Spark is
        configured with. Rules see packets, not connections (no conntrack here): the replies of a
        connection to an open port go from it to a port in the range, and pass."""
        match = ["ipproto", "tcp", "sport", ports, "dport", ports] if ports else []
        for host in sources:
            for other in targets:
                if other != host:
                    _run("ip", "-n", host.namespace, "rule", "add" if on else "del", "to", f"{other.address}/32",
                         *match, "prohibit", "priority", "100", check=on)

    def host_named(self, name: str) -> Host:
        """The host whose host name (or address) is `name`."""
        return next(h for h in self.hosts if name in (h.name, h.address))

    # -- processes -------------------------------------------------------------------------------
    def command_on(self, host: Host, argv: list[str]) -> list[str]:
        """argv run on `host`: its network namespace, a private mount namespace with its own /tmp
        and /etc/hosts, and its host name (UTS namespace)."""
        etc_hosts = self.root / "hosts" / host.name / "etc-hosts"
        # The machine's /tmp stays reachable at `original` for what the bed's processes run from
        # there (a checkout cloned under /tmp, its venv): bound back into the host's fresh /tmp.
        original = self.root / "hosts" / host.name / "machine-tmp"
        original.mkdir(parents=True, exist_ok=True)
        keep = " && ".join(f"mkdir -p /tmp/{rel} && mount --bind {original}/{rel} /tmp/{rel}"
                           for rel in _kept_under_tmp())
        setup = (f"mount --bind /tmp {original} && mount -t tmpfs -o size=4g,mode=1777 sparkdl-bed-tmp /tmp && "
                 + (keep + " && " if keep else "")
                 + f"mount --bind {etc_hosts} /etc/hosts && hostname {host.name} && exec \"$@\"")
        return ["ip", "netns", "exec", host.namespace, "unshare", "--mount", "--uts", "--propagation", "private",
                "/bin/sh", "-c", setup, "sh", *argv]

    def start_on(self, host: Host, argv: list[str], name: str, env: dict[str, str] | None = None) -> Started:
        log = self.root / "hosts" / host.name / f"{name}.log"
        with open(log, "ab") as out:
            process = subprocess.Popen(self.command_on(host, argv), stdout=out, stderr=subprocess.STDOUT,
                                       env={**self.environment(), **(env or {})}, start_new_session=True)
        self._join_cpu_group(host, process.pid)
        started = Started(host, process, log)
        self._started.append(started)
        return started

    def run_on(self, host: Host, argv: list[str], timeout: float, env: dict[str, str] | None = None
               ) -> subprocess.CompletedProcess[str]:
        """argv on `host` to its end (its process group killed after `timeout` s)."""
        process = subprocess.Popen(self.command_on(host, argv), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                   text=True, env={**self.environment(), **(env or {})}, start_new_session=True)
        self._join_cpu_group(host, process.pid)
        try:
            out, err = process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            kill_group(process)
            out, err = process.communicate()
            err += f"\n[bed] killed after {timeout} s"
        return subprocess.CompletedProcess(process.args, process.returncode, out, err)

    def environment(self) -> dict[str, str]:
        """Executors run this Python; nothing pins Spark to an address (it finds the host's own)."""
        env = {k: v for k, v in os.environ.items() if k not in ("SPARK_LOCAL_IP", "SPARK_LOCAL_HOSTNAME")}
        env.update(PYSPARK_PYTHON=sys.executable, PYSPARK_DRIVER_PYTHON=sys.executable,
                   PATH=os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]))
        return env

    def _start_spark(self) -> None:
        master = self.start_on(self.master, [str(SPARK_CLASS), "org.apache.spark.deploy.master.Master", "--host",
                                             self.master.address, "--port", str(MASTER_PORT), "--webui-port",
                                             "8080"], "master")
        wait_for_line(master, "I have been elected leader", 90)
        for started in [self._start_worker(host) for host in self.workers]:
            wait_for_line(started, "Successfully registered with master", 90)

    def worker_process(self, host: Host) -> Started:
        """The host's Spark Worker (the latest one started there)."""
        return [s for s in self._started if s.host == host and s.log.name.startswith("worker")][-1]

    def lose_host(self, host: Host) -> None:
        """The host gone for good, as a reclaimed spot instance: its Worker and executors SIGKILLed
        (by PID; nothing relaunches them) and its link cut."""
        worker = self.worker_process(host)
        for pid in [worker.process.pid, *descendants(worker.process.pid)]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        worker.process.wait(timeout=10)
        self.cut(host)

    def return_host(self, host: Host) -> None:
        """A replacement on the same host: its link mended and a new Worker registered."""
        self.mend(host)
        wait_for_line(self._start_worker(host), "Successfully registered with master", 90)

    def use_worker_cores(self, cores: int) -> None:
        """Every worker host's Spark Worker offering `cores` cores: the Workers (and any executors
        under them) replaced when they offer another count. For modules sharing one bed whose
        scenarios need different slots per host; no application may be running."""
        if cores == self.worker_cores:
            return
        for host in self.workers:
            worker = self.worker_process(host)
            for pid in descendants(worker.process.pid):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            kill_group(worker.process)  # a Worker that stops deregisters: the master forgets it at once
        self.worker_cores = cores
        for started in [self._start_worker(host) for host in self.workers]:
            wait_for_line(started, "Successfully registered with master", 90)

    def _start_worker(self, host: Host) -> Started:
        count = sum(1 for s in self._started if s.host == host and s.log.name.startswith("worker"))
        work = self.root / "hosts" / host.name / "work"
        work.mkdir(parents=True, exist_ok=True)
        return self.start_on(host, [str(SPARK_CLASS), "org.apache.spark.deploy.worker.Worker", "--cores",
                                    str(self.worker_cores), "--memory", self.worker_memory, "--work-dir", str(work),
                                    "--webui-port", "8081", self.master_url], f"worker-{count}" if count else "worker")

    def stop(self) -> None:
        self._stop_cpu()
        # Executor JVMs (and their Python workers) run in sessions of their own under the workers:
        # found by parent PID first, then stopped by PID with everything else.
        for started in self._started:
            for pid in descendants(started.process.pid):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for started in reversed(self._started):
            kill_group(started.process)
        self._started.clear()
        for name in reversed(self._namespaces):
            _run("ip", "netns", "del", name, check=False)
        self._namespaces.clear()
        self._remove_cpu_groups()


def _kept_under_tmp() -> list[str]:
    """Paths (relative to /tmp) of this checkout, its interpreter and pyspark, where they lie
    under /tmp: every emulated host mounts a /tmp of its own, and needs them there too."""
    tmp = Path("/tmp").resolve()
    places = {Path(__file__).resolve().parents[2], Path(sys.prefix).resolve(), Path(sys.base_prefix).resolve(),
              Path(pyspark.__file__).resolve().parent}
    relative = sorted(str(p.relative_to(tmp)) for p in places if p.is_relative_to(tmp) and p != tmp)
    # A path inside another kept one comes with it.
    return [r for r in relative if not any(r != o and r.startswith(o + "/") for o in relative)]


def kill_group(process: subprocess.Popen[Any]) -> None:
    if process.poll() is not None:
        return
    try:
        os.killpg(process.pid, signal.SIGTERM)
        process.wait(timeout=10)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        process.wait(timeout=10)


def wait_for_line(started: Started, text: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if started.log.exists() and text in started.log.read_text(errors="replace"):
            return
        if started.process.poll() is not None:
            break
        time.sleep(0.2)
    tail = started.log.read_text(errors="replace")[-3000:] if started.log.exists() else ""
    raise RuntimeError(f"{started.log.name} on {started.host.name} did not print {text!r} within {timeout} s:\n{tail}")
