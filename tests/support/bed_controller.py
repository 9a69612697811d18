"""What a driver script on the multi-host bed (tests/support/bed_driver.py) asks of the network while
it runs: its hosts cannot change their own links, so the test process carries out its requests."""
from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from multihost import Bed, Host, kill_group

EPHEMERAL_PORTS = "32768-60999"  # Linux's ip_local_port_range: where listeners on port 0 land


class Controller:
    """Carries out what a driver script on the bed asks of the network while it runs (its hosts
    cannot change their own links): each request is `<ask>/<n>.json`, answered by `<n>.done` (JSON).
    Requests: {"do": "shape", "host" or "last_worker", "mbit"}; {"do": "network", "mbit", "islands",
    "across_mbit"} (every worker link; see _network); {"do": "cut", "host", "seconds"}
    (cut now, mended after); {"do": "firewall", "on", "between": "workers" or "client", "host"} (the
    worker hosts reject each other's connections to ports the OS picks, or every connection to the
    asking host); {"do": "sniff", "host"} (record
    what reaches that host); {"do": "attack", "host", "port"} (stop recording, then bed_attacker.py
    on the master host); {"do": "lose", "worker": n or "host"} (a host gone for good: its Worker and
    executors killed, its link cut); {"do": "return", "worker": n or "host"} (link mended, a new
    Worker registered)."""

    def __init__(self, bed: Bed, ask: Path) -> None:
        self.bed, self.ask = bed, ask
        ask.mkdir(parents=True, exist_ok=True)
        self.log: list[dict[str, Any]] = []  # what was done, with monotonic times
        self._stop = threading.Event()
        self._timers: list[threading.Timer] = []
        self._sniffer: subprocess.Popen[Any] | None = None
        self._thread = threading.Thread(target=self._serve, daemon=True, name="bed-controller")

    def __enter__(self) -> "Controller":
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join(10)
        for timer in self._timers:
            timer.cancel()
        for host in self.bed.workers:
            self.bed.mend(host)
        self._stop_sniffer()

    def _serve(self) -> None:
        while not self._stop.is_set():
            for request in sorted(self.ask.glob("*.json")):
                done = request.with_suffix(".done")
                if done.exists():
                    continue
                asked = json.loads(request.read_text())
                try:
                    answer = self._do(asked)
                except Exception as exc:  # noqa: BLE001 - the driver script reports it
                    answer = {"error": f"{type(exc).__name__}: {exc}"}
                self.log.append({**asked, "at": time.monotonic(), "answer": answer})
                done.with_suffix(".part").write_text(json.dumps(answer))
                done.with_suffix(".part").replace(done)
            time.sleep(0.05)

    def _do(self, asked: dict[str, Any]) -> dict[str, Any]:
        bed, what = self.bed, asked["do"]
        if what == "shape":
            host = bed.workers[-1] if asked.get("last_worker") else bed.host_named(asked["host"])
            bed.shape(host, int(asked["mbit"] * 1_000_000))
            return {"host": host.address}
        elif what == "cut":
            host = bed.host_named(asked["host"])
            bed.cut(host)
            cut_at = time.time()  # the driver script compares it with its own time.time()
            timer = threading.Timer(float(asked["seconds"]), self._mend, args=(host,))
            self._timers.append(timer)
            timer.start()
            return {"host": host.address, "cut_at": cut_at}
        elif what == "firewall":
            if asked.get("between", "workers") == "workers":  # the OS-chosen ports; Spark's fixed ones pass
                bed.reject(bed.workers, bed.workers, bool(asked["on"]), ports=EPHEMERAL_PORTS)
            else:  # the asking host (a Connect client): no executor reaches it at all
                bed.reject(bed.workers, [bed.host_named(asked["host"])], bool(asked["on"]))
        elif what == "lose":  # a worker host gone for good (its Worker and executors killed, its link cut)
            host = bed.workers[int(asked["worker"]) - 1] if "worker" in asked else bed.host_named(asked["host"])
            bed.lose_host(host)
            return {"host": host.address, "at": time.time()}
        elif what == "return":  # a replacement Worker on that host, registered when this answers
            host = bed.workers[int(asked["worker"]) - 1] if "worker" in asked else bed.host_named(asked["host"])
            bed.return_host(host)
            return {"host": host.address, "at": time.time()}
        elif what == "network":  # every worker host's link; with "islands", slow links between groups
            return self._network(asked)
        elif what == "sniff":
            return self._start_sniffer(bed.host_named(asked["host"]))
        elif what == "attack":
            return self._attack(asked["host"], int(asked["port"]))
        else:
            raise ValueError(f"unknown request {what!r}")
        return {}

    def _network(self, asked: dict[str, Any]) -> dict[str, Any]:
        """{"mbit"}: each worker host's link at that rate; {"islands": [[1, 2], [3, 4]] (worker numbers),
        "mbit" (inside), "across_mbit"}: besides, each host reaches the other islands' hosts at
        across_mbit (a class of its own on both ends of its link, shared by those peers)."""
        rate = int(float(asked["mbit"]) * 1_000_000)
        islands = [[self.bed.workers[n - 1] for n in group] for group in asked.get("islands", [])]
        for host in self.bed.workers:
            others = [h for group in islands if host not in group for h in group]
            if others:
                self.bed.shape_apart(host, others, rate, int(float(asked["across_mbit"]) * 1_000_000))
            else:
                self.bed.shape(host, rate)
        return {"islands": [[h.address for h in group] for group in islands]}

    def _mend(self, host: Host) -> None:
        self.bed.mend(host)
        self.log.append({"do": "mend", "host": host.name, "at": time.monotonic()})

    def _start_sniffer(self, host: Host) -> dict[str, Any]:
        capture = self.ask / "capture.json"
        script = Path(__file__).with_name("bed_attacker.py")
        self._sniffer = subprocess.Popen(["ip", "netns", "exec", self.bed.switch, sys.executable, str(script), "sniff",
                                          f"p{host.index}", host.address, str(capture), str(self.ask / "stop-sniffing")],
                                         start_new_session=True)
        deadline = time.monotonic() + 30
        while not capture.with_suffix(".ready").exists():
            if self._sniffer.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the sniffer did not start")
            time.sleep(0.05)
        return {}

    def _stop_sniffer(self) -> None:
        if self._sniffer is not None and self._sniffer.poll() is None:
            (self.ask / "stop-sniffing").touch()
            try:
                self._sniffer.wait(10)
            except subprocess.TimeoutExpired:
                kill_group(self._sniffer)

    def _attack(self, host: str, port: int) -> dict[str, Any]:
        self._stop_sniffer()
        report = self.ask / "attack.json"
        script = Path(__file__).with_name("bed_attacker.py")
        done = self.bed.run_on(self.bed.master, [sys.executable, str(script), "attack", host, str(port),
                                                 str(self.ask / "capture.json"), str(report)], timeout=120)
        if not report.exists():
            raise RuntimeError(f"the attacker wrote nothing ({done.returncode}): {done.stderr[-2000:]}")
        return json.loads(report.read_text())
