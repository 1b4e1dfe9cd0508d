"""What the gateway adds: latency, streaming latency, throughput and CPU per request.

    python benchmarks/bench_gateway.py [--json] [--duration S | --quick] [--repeat N] [--no-pin]
        [--peer-cmd CMD [--peer-name NAME] [--peer-ready-path PATH]]

Starts a stub upstream (benchmarks/stub_upstream.py, a fast vLLM stand-in) and one
gateway process (``python -m kvgate.cli serve``, route headers on, auth off, a budget
and node capacity far above the load), then drives both with ``wrk`` using the same
POST body (a completions request with a ~1.5 KB prompt) and the same settings:

1. latency, non-streamed and streamed, each run straight at the stub and then through
   the gateway, at ``--latency-connections`` (default 1: a closed loop with more
   connections saturates the slower path and its latency becomes queueing, not cost);
   ``added = via - direct`` per percentile;
2. throughput: ``--rps-connections`` (default 64) through the gateway (``max_rps``) and
   straight at the stub (``direct_max_rps``, to show the load side was not the limit);
   ``cpu_ms_per_request`` is the gateway's CPU time over that run divided by the
   requests wrk completed. Both count only answers without an error status (a gateway
   answering 503 fast is not serving); ``max_rps_errors`` is the non-2xx answers plus
   socket errors of that measurement's runs.

CPU and RSS are summed over the gateway command's whole process group (utime + stime,
with the children it reaped, and VmRSS from /proc of every process in it; shared pages
count once per process), so a wrapper (``sh -c '...'``) or a multi-process proxy is
measured whole, and stopping sends SIGTERM (then SIGKILL) to the whole group.

Keys printed (one JSON object with --json): added_p50_ms, added_p75_ms, added_p90_ms,
added_p99_ms, stream_added_p50_ms ... stream_added_p99_ms, max_rps, max_rps_errors,
direct_max_rps, cpu_ms_per_request, stub_cpu_ms_per_request, gateway_cpu_util,
load_core_util, gateway_rss_mb, the reported runs under ``runs`` (percentiles in ms,
rps, errors; ``repeats``, ``error_free_repeats``, ``errors_all_repeats``), ``errors``
(non-2xx + socket errors per measurement, all repeats), ``goals`` (goal, value, errors
and ok per key), ``all_goals_ok``, ``peer`` and ``vs_peer`` (None without a peer),
``pinning``, ``settings`` and ``loadavg_1m`` at the end. Percentiles are wrk's
(benchmarks/benchstats.py says how they relate to the other benchmarks' nearest rank).
Goals: added p50 <= 1 ms, p99 <= 3 ms, streaming the same; >= 2000 req/s;
<= 0.3 ms CPU per request. A goal is missed when a run it is measured on had any
error, in any repeat (``--strict`` then exits 1).

Peer: with ``--peer-cmd`` (same placeholders as ``--gateway-cmd``; it must answer GET
``--peer-ready-path``, default /health) another proxy, e.g. sglang-router, runs beside
the gateway on the same stub, pinned to the gateway's core (each idles while the other
is measured), and every via-run is made through it too, with the same wrk settings,
interleaved: ``peer`` holds its figures (added latency, max_rps, cpu_ms_per_request
...) and ``vs_peer`` the ratios gateway / peer. Without it there is no peer run and no
peer figure: this script quotes none it did not measure.

Pinning (2 cores): gateway alone on core 0, stub + wrk on core 1. The gateway never
competes with the load, but the direct runs have wrk and the stub on one core, which
inflates the direct baseline a little and so slightly *understates* ``added``.
The machine may be shared: read p99 with care, see ``loadavg_1m``, and use
``--repeat N`` to make every measurement N times and keep the best error-free run of
each (lowest p50; for throughput, most answers without an error per second); the errors
of all N runs are counted (``errors``) and fail the goals measured on them.

A warm-up (1 s of each kind of request on each target) is never counted. Ctrl-C,
SIGTERM and SIGHUP stop the stub, the gateway (and the peer), remove the scratch folder
and print one line on stderr (exit 130, 143, 129).

Needs ``wrk`` (Debian: ``apt-get install wrk``). ``--gateway-cmd`` runs another proxy
instead (placeholders {python} {port} {upstream} {config}, and {aux_port}, a second
free port, e.g. for a metrics listener); it must answer GET /ready. For example, with
sglang-router installed in a venv (it listens on 0.0.0.0 unless told otherwise)::

    --peer-name sglang-router --peer-cmd "VENV/bin/python -m sglang_router.launch_router
      --host 127.0.0.1 --port {port} --worker-urls {upstream} --policy cache_aware
      --prometheus-host 127.0.0.1 --prometheus-port {aux_port} --log-level warn"
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import os
import re
import resource
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
STUB = HERE / "stub_upstream.py"
MODEL = "stub-model"
HOST = "127.0.0.1"
PERCENTILES = (50, 75, 90, 99)
READY_TIMEOUT_S = 30.0
GOALS: dict[str, tuple[str, float]] = {
    "added_p50_ms": ("<=", 1.0),
    "added_p99_ms": ("<=", 3.0),
    "stream_added_p50_ms": ("<=", 1.0),
    "stream_added_p99_ms": ("<=", 3.0),
    "max_rps": (">=", 2000.0),
    "cpu_ms_per_request": ("<=", 0.3),
}
# the wrk runs each goal is measured on: a goal is missed when any of them had errors
GOAL_RUNS: dict[str, tuple[str, ...]] = {
    **{f"added_p{p}_ms": ("direct_unary", "via_unary") for p in PERCENTILES},
    **{f"stream_added_p{p}_ms": ("direct_stream", "via_stream") for p in PERCENTILES},
    "max_rps": ("via_max_rps",),
    "cpu_ms_per_request": ("via_max_rps",),
}
DEFAULT_GATEWAY_CMD = (
    "{python} -m kvgate.cli serve --config {config} --port {port} --budget 100000 "
    "--route-headers --metrics-interval 1 --log-level warning"
)
WORDS = (
    "the", "cache", "of", "a", "node", "holds", "the", "prefix", "blocks", "of", "earlier",
    "prompts", "so", "a", "request", "that", "shares", "them", "skips", "part", "of", "its",
    "prefill", "and", "answers", "sooner",
)


class BenchError(Exception):
    """A setup failure: printed as one line, exit code 2."""


class Stopped(BaseException):
    """SIGTERM or SIGHUP: unwinds like KeyboardInterrupt (through every ``finally``)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class SignalGuard:
    """Turns SIGINT/SIGTERM/SIGHUP into an exception once, so cleanup runs; while
    :meth:`hold` is active (cleanup itself) a signal is only noted, and raised after."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)

    def __init__(self) -> None:
        self.fired = False
        self.holding = False
        self.pending: int | None = None

    def handler(self, signum: int, frame: object) -> None:
        if self.fired:  # already unwinding: let the cleanup finish
            return
        if self.holding:
            self.pending = signum
            return
        self.fire(signum)

    def fire(self, signum: int) -> None:
        self.fired = True
        if signum == signal.SIGINT:
            raise KeyboardInterrupt
        raise Stopped(signum)

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        self.fired, self.holding, self.pending = False, False, None
        previous = {sig: signal.signal(sig, self.handler) for sig in self.SIGNALS}
        try:
            yield
        finally:
            for sig, old in previous.items():
                signal.signal(sig, old)

    @contextlib.contextmanager
    def hold(self) -> Iterator[None]:
        self.holding = True
        try:
            yield
        finally:
            self.holding = False
        if self.pending is not None and not self.fired:
            self.fire(self.pending)


GUARD = SignalGuard()


# --------------------------------------------------------------------------- workload
def make_body(*, stream: bool, prompt_chars: int = 1500, max_tokens: int = 16) -> bytes:
    """A typical client's completions request (no stream_options: the SDK's default)."""
    words: list[str] = []
    n = 0
    i = 0
    while n < prompt_chars:
        w = WORDS[(i * 7 + i // len(WORDS)) % len(WORDS)]
        words.append(w)
        n += len(w) + 1
        i += 1
    prompt = "You are a helpful assistant. " + " ".join(words)
    return json.dumps({
        "model": MODEL, "prompt": prompt[:prompt_chars], "max_tokens": max_tokens,
        "temperature": 0, "stream": stream,
    }).encode()


def lua_script(body: bytes) -> str:
    """wrk: POST ``body``; at the end one line ``KVGATE_WRK {json}`` (latency in us)."""
    text = body.decode()
    if "]==]" in text:
        raise BenchError("the request body cannot be embedded in a Lua long string")
    pct = ",".join(f'"p{p}_us":%.1f' for p in (*PERCENTILES, 99.9))
    args = ", ".join(f"latency:percentile({p})" for p in (*PERCENTILES, 99.9))
    return f"""wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
wrk.body = [==[{text}]==]

done = function(summary, latency, requests)
  local e = summary.errors
  io.write(string.format(
    'KVGATE_WRK {{"requests":%d,"duration_us":%d,"bytes":%d,"mean_us":%.1f,"max_us":%.1f,'
    .. '{pct},'
    .. '"errors":{{"connect":%d,"read":%d,"write":%d,"status":%d,"timeout":%d}}}}\\n',
    summary.requests, summary.duration, summary.bytes, latency.mean, latency.max,
    {args},
    e.connect, e.read, e.write, e.status, e.timeout))
end
"""


_UNIT_MS = {"us": 0.001, "ms": 1.0, "s": 1000.0, "m": 60_000.0, "h": 3_600_000.0}
_DIST_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)%\s+(\d+(?:\.\d+)?)(us|ms|s|m|h)\s*$", re.M)
_REQS_RE = re.compile(r"^\s*(\d+) requests in (\d+(?:\.\d+)?)(us|ms|s|m|h)", re.M)
_RPS_RE = re.compile(r"^Requests/sec:\s+(\d+(?:\.\d+)?)", re.M)
_NON2XX_RE = re.compile(r"Non-2xx or 3xx responses:\s+(\d+)")
_SOCKERR_RE = re.compile(
    r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)")


def parse_wrk(output: str) -> dict[str, Any]:
    """wrk's result: percentiles (ms), rps, requests, errors.

    Reads the ``KVGATE_WRK`` line of :func:`lua_script` (microsecond precision) when
    there is one, else wrk's own ``--latency`` text (Latency Distribution 50/75/90/99%).
    """
    for line in output.splitlines():
        if line.startswith("KVGATE_WRK "):
            raw = json.loads(line[len("KVGATE_WRK "):])
            secs = raw["duration_us"] / 1e6
            out: dict[str, Any] = {
                f"p{p}_ms".replace(".", "_"): raw[f"p{p}_us"] / 1000
                for p in (*PERCENTILES, 99.9)
            }
            out.update(
                mean_ms=raw["mean_us"] / 1000, max_ms=raw["max_us"] / 1000,
                requests=raw["requests"], duration_s=secs,
                rps=raw["requests"] / secs if secs > 0 else 0.0,
                non2xx=raw["errors"]["status"],
                socket_errors=sum(v for k, v in raw["errors"].items() if k != "status"),
            )
            return out
    dist = {float(p): float(v) * _UNIT_MS[u] for p, v, u in _DIST_RE.findall(output)}
    reqs = _REQS_RE.search(output)
    rps = _RPS_RE.search(output)
    if not dist or reqs is None or rps is None:
        raise BenchError(f"cannot parse wrk's output:\n{output}")
    non2xx = _NON2XX_RE.search(output)
    sock = _SOCKERR_RE.search(output)
    out = {f"p{p}_ms": dist.get(float(p)) for p in PERCENTILES}
    out.update(
        requests=int(reqs.group(1)),
        duration_s=float(reqs.group(2)) * _UNIT_MS[reqs.group(3)] / 1000,
        rps=float(rps.group(1)),
        non2xx=int(non2xx.group(1)) if non2xx else 0,
        socket_errors=sum(int(g) for g in sock.groups()) if sock else 0,
    )
    return out


# --------------------------------------------------------------------------- processes
def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


def _stat_fields(pid: int) -> list[str] | None:
    """/proc/<pid>/stat from field 3 (state) on, or None when the process is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat[stat.rindex(")") + 2:].split()


def group_pids(pgid: int, *, zombies: bool = False) -> list[int]:
    """The processes of process group ``pgid`` (zombies only when asked)."""
    pids = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            f = _stat_fields(int(entry.name))
            # f[0] state, f[2] pgrp
            if f is not None and int(f[2]) == pgid and (zombies or f[0] != "Z"):
                pids.append(int(entry.name))
    return pids


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process (all its threads) and of the children it reaped
    (cutime + cstime), from /proc/<pid>/stat; 0 when it is gone."""
    f = _stat_fields(pid)
    if f is None:
        return 0.0
    return sum(int(x) for x in f[11:15]) / os.sysconf("SC_CLK_TCK")


def group_cpu_seconds(pgid: int) -> float:
    """CPU time of every process in group ``pgid`` (see :func:`cpu_seconds`)."""
    return sum(cpu_seconds(pid) for pid in group_pids(pgid, zombies=True))


def rss_mb(pid: int) -> float | None:
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return None


def group_rss_mb(pgid: int) -> float | None:
    """VmRSS summed over the live processes of group ``pgid`` (None: none left)."""
    sizes = [r for r in (rss_mb(pid) for pid in group_pids(pgid)) if r is not None]
    return sum(sizes) if sizes else None


@dataclass
class Proc:
    """A command started in a session (and process group) of its own, led by ``pid``."""

    name: str
    popen: subprocess.Popen[bytes]
    log: Path

    @property
    def pid(self) -> int:
        return self.popen.pid

    @property
    def pgid(self) -> int:
        return self.popen.pid  # start_new_session: the leader's pid names the group

    def cpu_seconds(self) -> float:
        return group_cpu_seconds(self.pgid)

    def rss_mb(self) -> float | None:
        return group_rss_mb(self.pgid)

    def tail(self, n: int = 20) -> str:
        with contextlib.suppress(OSError):
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])
        return ""

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM to the whole group, SIGKILL to what is left after ``timeout``."""
        for sig, wait_s in ((signal.SIGTERM, timeout), (signal.SIGKILL, 5.0)):
            self.popen.poll()  # reap the leader, so a dead one is no member
            if not group_pids(self.pgid):
                return
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.pgid, sig)
            deadline = time.monotonic() + wait_s
            while time.monotonic() < deadline:
                self.popen.poll()
                if not group_pids(self.pgid):
                    return
                time.sleep(0.02)


@dataclass
class Pinning:
    gateway: list[str] = field(default_factory=list)
    load: list[str] = field(default_factory=list)
    note: str = "none"


def pinning(enabled: bool, gateway_core: int, load_core: int) -> Pinning:
    if not enabled:
        return Pinning(note="off (--no-pin): all processes share all cores")
    taskset = shutil.which("taskset")
    cores = os.sched_getaffinity(0)
    if taskset is None or gateway_core not in cores or load_core not in cores:
        return Pinning(note=f"off (taskset or cores {gateway_core},{load_core} unavailable)")
    return Pinning(
        gateway=[taskset, "-c", str(gateway_core)],
        load=[taskset, "-c", str(load_core)],
        note=(f"gateway on core {gateway_core}; stub + wrk on core {load_core}. The gateway "
              "never competes with the load, but direct runs put wrk and the stub on one "
              "core, which inflates the direct baseline and slightly understates 'added'"),
    )


def spawn(name: str, cmd: list[str], workdir: Path) -> Proc:
    log = workdir / f"{name}.log"
    with log.open("wb") as fh:
        try:
            popen = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=fh,
                                     stderr=subprocess.STDOUT, start_new_session=True)
        except OSError as exc:  # no such program, not executable
            raise BenchError(f"cannot start the {name} ({shlex.join(cmd)}): {exc}") from None
    return Proc(name, popen, log)


def http_get(port: int, path: str, timeout: float = 2.0) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection(HOST, port, timeout=timeout)
    try:
        conn.request("GET", path)
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def http_post(port: int, path: str, body: bytes) -> tuple[int, dict[str, str], bytes]:
    conn = http.client.HTTPConnection(HOST, port, timeout=5.0)
    try:
        conn.request("POST", path, body=body, headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()
    finally:
        conn.close()


def wait_ready(proc: Proc, port: int, path: str, timeout: float = READY_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout
    last = "no answer"
    while time.monotonic() < deadline:
        if proc.popen.poll() is not None:
            raise BenchError(f"{proc.name} exited with {proc.popen.returncode}:\n{proc.tail()}")
        try:
            status, body = http_get(port, path, timeout=1.0)
            if status == 200:
                return
            last = f"{status} {body[:200]!r}"
        except OSError as exc:
            last = str(exc)
        time.sleep(0.1)
    raise BenchError(f"{proc.name} not ready on {path} after {timeout:.0f} s ({last}):\n"
                     f"{proc.tail()}")


def check_serve_available() -> None:
    got = subprocess.run([sys.executable, "-m", "kvgate.cli", "serve", "--help"],
                         capture_output=True, text=True, timeout=60, check=False)
    if got.returncode != 0:
        raise BenchError("`kvgate serve` is not available "
                         f"({(got.stderr or got.stdout).strip().splitlines()[-1:]}); "
                         "pass --gateway-cmd to benchmark another proxy")


def run_wrk(port: int, script: Path, *, connections: int, duration: int,
            pin: list[str]) -> dict[str, Any]:
    """One wrk run (wrk takes whole seconds only)."""
    threads = min(connections, 1 if connections < 32 else 2)
    cmd = [*pin, "wrk", f"-t{threads}", f"-c{connections}", f"-d{max(1, duration)}s",
           "--latency", "--timeout", "5s", "-s", str(script), f"http://{HOST}:{port}/v1/completions"]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    got = subprocess.run(cmd, capture_output=True, text=True, timeout=duration + 30,
                         check=False)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if got.returncode != 0:
        raise BenchError(f"wrk failed ({got.returncode}): {(got.stderr or got.stdout).strip()}")
    out = parse_wrk(got.stdout)
    out["wrk_cpu_s"] = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
    out["connections"] = connections
    return out


# --------------------------------------------------------------------------- the benchmark
def _json_obj(body: bytes) -> dict[str, Any]:
    try:
        obj = json.loads(body)
    except ValueError:
        return {}
    return obj if isinstance(obj, dict) else {}


def sanity_checks(stub_port: int, gw_port: int, unary: bytes, stream: bytes,
                  name: str = "gateway") -> dict[str, Any]:
    """One request of each kind, direct and through the proxy ``name``, checked by hand."""
    status, _, body = http_post(stub_port, "/v1/completions", unary)
    if status != 200 or "usage" not in _json_obj(body):
        raise BenchError(f"stub answered {status}: {body[:200]!r}")
    status, headers, body = http_post(gw_port, "/v1/completions", unary)
    if status != 200 or not _json_obj(body).get("choices"):
        raise BenchError(f"{name} answered {status}: {body[:300]!r}")
    node = headers.get("x-kvgate-node")
    status, _, body = http_post(gw_port, "/v1/completions", stream)
    if status != 200 or not body.rstrip().endswith(b"data: [DONE]"):
        raise BenchError(f"{name} stream answered {status}: {body[-300:]!r}")
    return {"route_header_node": node, "stream_bytes": len(body)}


def percent_keys(run: dict[str, Any]) -> dict[str, float]:
    return {f"p{p}_ms": run[f"p{p}_ms"] for p in PERCENTILES}


@dataclass
class Target:
    """A proxy measured through: the gateway (``via``) or the peer (``peer``)."""

    label: str
    port: int
    proc: Proc


def run_errors(run: dict[str, Any]) -> int:
    """Non-2xx answers plus socket errors of one wrk run."""
    return int(run["non2xx"]) + int(run["socket_errors"])


def good_rps(run: dict[str, Any]) -> float:
    """Answers without an error status per second (wrk: status < 400)."""
    return ok_responses(run) / max(float(run["duration_s"]), 1e-9)


def pick_best(key: str, repeats: list[dict[str, Any]]) -> dict[str, Any]:
    """The run of measurement ``key`` to report out of its ``--repeat`` runs.

    Only error-free runs compete when there is one (a fast run of 503s or resets must
    not beat a clean one): the lowest p50 for latency, the most answers without an
    error per second for ``*_max_rps``. ``errors_all_repeats`` counts the errors of
    every run, the dropped ones included, so a goal measured on it still fails.
    """
    clean = [r for r in repeats if run_errors(r) == 0]
    pool = clean or repeats
    if key.endswith("_max_rps"):
        best = max(pool, key=good_rps)
    else:
        best = min(pool, key=lambda r: float(r["p50_ms"]))
    return {**best, "repeats": len(repeats), "error_free_repeats": len(clean),
            "errors_all_repeats": sum(run_errors(r) for r in repeats)}


def run_benchmark(args: argparse.Namespace) -> dict[str, Any]:
    if shutil.which("wrk") is None:
        raise BenchError("wrk is not installed (Debian/Ubuntu: apt-get install -y wrk)")
    if args.gateway_cmd is None:
        check_serve_available()
    peer_cmd_template: str | None = getattr(args, "peer_cmd", None)
    peer_name: str = getattr(args, "peer_name", None) or "peer"
    peer_ready: str = getattr(args, "peer_ready_path", None) or "/health"
    duration = 2 if args.quick else args.duration
    warmup = 1
    pin = pinning(not args.no_pin, args.gateway_core, args.load_core)
    unary = make_body(stream=False, prompt_chars=args.prompt_chars)
    stream = make_body(stream=True, prompt_chars=args.prompt_chars)
    cleanup = contextlib.ExitStack()
    try:
        work = Path(cleanup.enter_context(tempfile.TemporaryDirectory(prefix="kvgate-bench-")))
        scripts = {}
        for name, body in (("unary", unary), ("stream", stream)):
            scripts[name] = work / f"{name}.lua"
            scripts[name].write_text(lua_script(body))
        stub_port, gw_port = free_port(), free_port()
        upstream = f"http://{HOST}:{stub_port}"
        config = work / "gateway.yaml"
        # Node capacity feeds the cluster budget (C = min(budget, capacities)): make
        # it large so admission never queues at the benchmark's concurrency.
        config.write_text(f"nodes:\n  static:\n    - id: stub\n      url: {upstream}\n"
                          f"      capacity: 100000\n")

        def command(template: str, port: int) -> list[str]:
            aux_port = free_port()
            return [part.format(python=sys.executable, port=port, upstream=upstream,
                                config=config, aux_port=aux_port)
                    for part in shlex.split(template)]

        gw_cmd = command(args.gateway_cmd or DEFAULT_GATEWAY_CMD, gw_port)
        stub = spawn("stub", [*pin.load, sys.executable, str(STUB), "--host", HOST,
                              "--port", str(stub_port)], work)
        cleanup.callback(stub.stop)
        wait_ready(stub, stub_port, "/health")
        gw = spawn("gateway", [*pin.gateway, *gw_cmd], work)
        cleanup.callback(gw.stop)
        wait_ready(gw, gw_port, "/ready")
        targets = [Target("via", gw_port, gw)]
        checks = sanity_checks(stub_port, gw_port, unary, stream)
        peer_cmd: list[str] | None = None
        if peer_cmd_template is not None:
            peer_port = free_port()
            peer_cmd = command(peer_cmd_template, peer_port)
            peer = spawn("peer", [*pin.gateway, *peer_cmd], work)
            cleanup.callback(peer.stop)
            wait_ready(peer, peer_port, peer_ready)
            targets.append(Target("peer", peer_port, peer))
            checks["peer"] = sanity_checks(stub_port, peer_port, unary, stream,
                                           name=peer_name)
        lat = args.latency_connections
        # warm connections, caches, the index: never counted
        for port in (stub_port, *(t.port for t in targets)):
            for name in ("unary", "stream"):
                run_wrk(port, scripts[name], connections=lat, duration=warmup,
                        pin=pin.load)
        measured: dict[str, list[dict[str, Any]]] = {}

        def add(key: str, run: dict[str, Any]) -> None:
            measured.setdefault(key, []).append(run)

        for _ in range(args.repeat):  # interleaved, so drift hits every side alike
            for name in ("unary", "stream"):
                add(f"direct_{name}", run_wrk(stub_port, scripts[name], connections=lat,
                                              duration=duration, pin=pin.load))
                for t in targets:
                    add(f"{t.label}_{name}", run_wrk(t.port, scripts[name], connections=lat,
                                                     duration=duration, pin=pin.load))
            for t in targets:
                cpu0, stub0 = t.proc.cpu_seconds(), stub.cpu_seconds()
                run = run_wrk(t.port, scripts["unary"], connections=args.rps_connections,
                              duration=duration, pin=pin.load)
                run["proxy_cpu_s"] = t.proc.cpu_seconds() - cpu0
                run["stub_cpu_s"] = stub.cpu_seconds() - stub0
                add(f"{t.label}_max_rps", run)
            add("direct_max_rps", run_wrk(
                stub_port, scripts["unary"], connections=args.rps_connections,
                duration=duration, pin=pin.load))
        runs = {key: pick_best(key, repeats) for key, repeats in measured.items()}
        rss = {t.label: t.proc.rss_mb() for t in targets}
        for t in targets:
            if t.proc.popen.poll() is not None:
                raise BenchError(f"the {t.proc.name} died during the run:\n{t.proc.tail()}")
    finally:
        with GUARD.hold():  # a signal now waits until everything is stopped and removed
            cleanup.close()
    return summarize(args, runs, checks, duration=duration, pin=pin, gw_cmd=gw_cmd,
                     gw_rss=rss["via"], body_bytes=len(unary), peer_cmd=peer_cmd,
                     peer_name=peer_name, peer_rss=rss.get("peer"))


def ok_responses(run: dict[str, Any]) -> int:
    """Requests of a wrk run answered without an error status (wrk: status < 400)."""
    return max(0, int(run["requests"]) - int(run["non2xx"]))


def _ratio(a: float, b: float) -> float | None:
    return round(a / b, 3) if b > 0 else None


def proxy_figures(runs: dict[str, dict[str, Any]], label: str) -> dict[str, Any]:
    """Added latency, max req/s and CPU per request of the proxy whose runs are
    ``{label}_unary``, ``{label}_stream`` and ``{label}_max_rps``."""
    out: dict[str, Any] = {}
    for prefix, name in (("", "unary"), ("stream_", "stream")):
        d, v = runs[f"direct_{name}"], runs[f"{label}_{name}"]
        for p in PERCENTILES:
            out[f"{prefix}added_p{p}_ms"] = round(v[f"p{p}_ms"] - d[f"p{p}_ms"], 3)
    rps_run = runs[f"{label}_max_rps"]
    proxy_cpu_s, stub_cpu_s = rps_run["proxy_cpu_s"], rps_run["stub_cpu_s"]
    secs = max(rps_run["duration_s"], 1e-9)
    # only answers without an error status count: a gateway answering 503s fast is not
    # serving (wrk's requests include non-2xx answers; socket errors are not requests)
    served = ok_responses(rps_run)
    out["max_rps"] = round(served / secs, 1)
    out["max_rps_errors"] = rps_run.get("errors_all_repeats", run_errors(rps_run))
    out["max_rps_p50_ms"] = round(rps_run["p50_ms"], 3)
    out["max_rps_p99_ms"] = round(rps_run["p99_ms"], 3)
    out["cpu_ms_per_request"] = round(proxy_cpu_s * 1000 / max(1, served), 4)
    out["stub_cpu_ms_per_request"] = round(stub_cpu_s * 1000 / max(1, served), 4)
    out["cpu_util"] = round(proxy_cpu_s / secs, 3)
    out["load_core_util"] = round((stub_cpu_s + rps_run["wrk_cpu_s"]) / secs, 3)
    return out


# gateway / peer, where both are measured: "via_*" are absolute latencies through each
VS_PEER_KEYS = ("cpu_ms_per_request", "max_rps", "via_p50_ms", "via_p99_ms",
                "stream_via_p50_ms", "stream_via_p99_ms")


def summarize(args: argparse.Namespace, runs: dict[str, dict[str, Any]],
              checks: dict[str, Any], *, duration: int, pin: Pinning, gw_cmd: list[str],
              gw_rss: float | None, body_bytes: int, peer_cmd: list[str] | None = None,
              peer_name: str = "peer", peer_rss: float | None = None) -> dict[str, Any]:
    gw = proxy_figures(runs, "via")
    out: dict[str, Any] = {k: v for k, v in gw.items() if k not in ("cpu_util",
                                                                    "load_core_util")}
    # every repeat's errors (pick_best keeps them beside the run it reports)
    errors = {k: r.get("errors_all_repeats", run_errors(r)) for k, r in runs.items()}
    direct = runs["direct_max_rps"]
    out["direct_max_rps"] = round(good_rps(direct), 1)
    out["gateway_cpu_util"] = gw["cpu_util"]
    out["load_core_util"] = gw["load_core_util"]
    out["gateway_rss_mb"] = round(gw_rss, 1) if gw_rss is not None else None
    goals = {}
    for key, (op, goal) in GOALS.items():
        value = out[key]
        n_errors = sum(errors.get(run, 0) for run in GOAL_RUNS[key])
        met = value <= goal if op == "<=" else value >= goal
        goals[key] = {"goal": goal, "op": op, "value": value, "errors": n_errors,
                      "ok": met and n_errors == 0}
    out["goals"] = goals
    out["all_goals_ok"] = all(g["ok"] for g in goals.values())
    out["errors"] = errors
    if peer_cmd is not None and "peer_max_rps" in runs:
        peer = proxy_figures(runs, "peer")
        peer.update(name=peer_name, cmd=shlex.join(peer_cmd),
                    rss_mb=round(peer_rss, 1) if peer_rss is not None else None,
                    errors=sum(v for k, v in errors.items() if k.startswith("peer_")))
        out["peer"] = peer
        mine: dict[str, float] = {"cpu_ms_per_request": out["cpu_ms_per_request"],
                                  "max_rps": out["max_rps"]}
        theirs: dict[str, float] = {"cpu_ms_per_request": peer["cpu_ms_per_request"],
                                    "max_rps": peer["max_rps"]}
        for prefix, name in (("", "unary"), ("stream_", "stream")):
            for p in (50, 99):
                mine[f"{prefix}via_p{p}_ms"] = runs[f"via_{name}"][f"p{p}_ms"]
                theirs[f"{prefix}via_p{p}_ms"] = runs[f"peer_{name}"][f"p{p}_ms"]
        out["vs_peer"] = {k: _ratio(mine[k], theirs[k]) for k in VS_PEER_KEYS}
    else:
        out["peer"] = None
        out["vs_peer"] = None
    out["runs"] = {k: {kk: (round(vv, 4) if isinstance(vv, float) else vv)
                       for kk, vv in r.items()} for k, r in runs.items()}
    out["pinning"] = pin.note
    out["settings"] = {
        "duration_s": duration, "latency_connections": args.latency_connections,
        "rps_connections": args.rps_connections, "prompt_chars": args.prompt_chars,
        "repeat": args.repeat, "warmup_s": 1,
        "body_bytes": body_bytes, "tool": "wrk", "gateway_cmd": shlex.join(gw_cmd),
        "peer_cmd": shlex.join(peer_cmd) if peer_cmd is not None else None,
    }
    out["checks"] = checks
    out["loadavg_1m"] = os.getloadavg()[0]
    return out


# --------------------------------------------------------------------------- output
def print_table(r: dict[str, Any]) -> None:
    runs = r["runs"]
    s = r["settings"]
    print(f"kvgate gateway overhead: wrk, {s['duration_s']:g} s runs, "
          f"{s['latency_connections']} conn (latency) / {s['rps_connections']} conn (rps), "
          f"{s['body_bytes']} B body"
          + (f", best error-free of {s['repeat']} repeats" if s.get("repeat", 1) > 1 else ""))
    print(f"pinning: {r['pinning']}")
    print(f"{'':24}{'direct':>10}{'via gw':>10}{'added':>10}{'goal':>8}  ok")
    for prefix, name, label in (("", "unary", "non-streamed"), ("stream_", "stream", "streamed")):
        for p in PERCENTILES:
            key = f"{prefix}added_p{p}_ms"
            goal = r["goals"].get(key)
            print(f"{label + f' p{p} (ms)':24}{runs[f'direct_{name}'][f'p{p}_ms']:>10.3f}"
                  f"{runs[f'via_{name}'][f'p{p}_ms']:>10.3f}{r[key]:>10.3f}"
                  + (f"{goal['goal']:>8g}  {_verdict(goal)}" if goal else ""))
    for key, label, fmt in (("max_rps", "max req/s (via gw)", ".0f"),
                            ("cpu_ms_per_request", "gateway CPU ms/req", ".3f")):
        g = r["goals"][key]
        print(f"{label:24}{'':20}{r[key]:>10{fmt}}{g['goal']:>8g}  {_verdict(g)}")
    print(f"{'direct max req/s':24}{r['direct_max_rps']:>10.0f}")
    print(f"gateway CPU util at max rps {r['gateway_cpu_util']:.2f} cores; load core "
          f"{r['load_core_util']:.2f}; p50/p99 at max rps {r['max_rps_p50_ms']:.2f}/"
          f"{r['max_rps_p99_ms']:.2f} ms; RSS {r['gateway_rss_mb']} MB; "
          f"load avg {r['loadavg_1m']:.2f}")
    peer = r.get("peer")
    if peer is None:
        print("peer: none measured (no --peer-cmd), so no peer figure")
    else:
        vs = r["vs_peer"]
        print(f"peer {peer['name']!r} (same stub, same wrk settings, interleaved): "
              f"gateway / peer")
        print(f"{'':24}{'gateway':>10}{'peer':>10}{'ratio':>10}")
        rows = [("CPU ms/req", r["cpu_ms_per_request"], peer["cpu_ms_per_request"],
                 "cpu_ms_per_request", ".4f"),
                ("max req/s", r["max_rps"], peer["max_rps"], "max_rps", ".0f")]
        for prefix, name, label in (("", "unary", "non-streamed"),
                                    ("stream_", "stream", "streamed")):
            for p in (50, 99):
                rows.append((f"{label} p{p} (ms)", runs[f"via_{name}"][f"p{p}_ms"],
                             runs[f"peer_{name}"][f"p{p}_ms"], f"{prefix}via_p{p}_ms", ".3f"))
        for label, mine, theirs, key, fmt in rows:
            ratio = vs.get(key)
            print(f"{label:24}{mine:>10{fmt}}{theirs:>10{fmt}}"
                  f"{(f'{ratio:.2f}' if ratio is not None else 'n/a'):>10}")
        print(f"peer added p50/p99 {peer['added_p50_ms']:.3f}/{peer['added_p99_ms']:.3f} ms, "
              f"streamed {peer['stream_added_p50_ms']:.3f}/{peer['stream_added_p99_ms']:.3f} "
              f"ms; CPU util at max rps {peer['cpu_util']:.2f} cores; RSS {peer['rss_mb']} MB"
              + (f"; {peer['errors']} ERRORS" if peer["errors"] else ""))
    bad = {k: v for k, v in r["errors"].items() if v}
    if bad:
        print(f"ERRORS (non-2xx or socket, all repeats): {bad}; a goal measured on a run "
              "with errors is missed, and req/s and CPU ms/req count only answers without "
              "an error")
    print("all goals met" if r["all_goals_ok"] else "some goals missed")


def _verdict(goal: dict[str, Any]) -> str:
    if goal["ok"]:
        return "yes"
    return f"NO ({goal['errors']} errors)" if goal.get("errors") else "NO"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--duration", type=int, default=10, help="seconds per run (default 10)")
    p.add_argument("--quick", action="store_true", help="2 s runs")
    p.add_argument("--repeat", type=int, default=1,
                   help="run every measurement N times (1..20) and keep the best "
                   "error-free run (lowest p50; most answers without an error per "
                   "second); the errors of all N count: for shared, noisy machines")
    p.add_argument("--latency-connections", type=int, default=1,
                   help="wrk connections of the latency runs (default 1: no queueing)")
    p.add_argument("--rps-connections", type=int, default=64,
                   help="wrk connections of the throughput runs (default 64)")
    p.add_argument("--prompt-chars", type=int, default=1500, help="prompt length (1500)")
    p.add_argument("--no-pin", action="store_true", help="do not pin processes to cores")
    p.add_argument("--gateway-core", type=int, default=0)
    p.add_argument("--load-core", type=int, default=1)
    p.add_argument("--gateway-cmd", help="another proxy to measure; placeholders "
                   "{python} {port} {upstream} {config} {aux_port}; must answer GET /ready")
    p.add_argument("--peer-cmd", help="a peer proxy (e.g. sglang-router) measured side "
                   "by side, same placeholders; without it there is no peer run")
    p.add_argument("--peer-name", default="peer", help="the peer's label in the output")
    p.add_argument("--peer-ready-path", default="/health",
                   help="path the peer answers 200 on once ready (default /health)")
    p.add_argument("--strict", action="store_true", help="exit 1 when a goal is missed")
    args = p.parse_args(argv)
    if not 1 <= args.duration <= 600:
        p.error("--duration must be 1..600 (whole seconds, as wrk takes them)")
    if not 1 <= args.repeat <= 20:
        p.error("--repeat must be 1..20")
    for opt in ("latency_connections", "rps_connections"):
        if not 1 <= getattr(args, opt) <= 10_000:
            p.error(f"--{opt.replace('_', '-')} must be 1..10000")
    if not 1 <= args.prompt_chars <= 1_000_000:
        p.error("--prompt-chars must be 1..1000000")
    try:
        with GUARD.installed():
            result = run_benchmark(args)
    except BenchError as exc:
        print(f"bench_gateway: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("bench_gateway: interrupted; the stub and the gateway are stopped",
              file=sys.stderr)
        return 130
    except Stopped as exc:
        print(f"bench_gateway: stopped by {exc}; the stub and the gateway are stopped",
              file=sys.stderr)
        return 128 + exc.signum
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print_table(result)
    return 1 if args.strict and not result["all_goals_ok"] else 0


if __name__ == "__main__":
    sys.exit(main())
