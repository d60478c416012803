"""Start and stop a real TorchServe (Java frontend + Python workers).

One ``TorchServeProcess`` is one isolated server: its own loopback ports, its
own config file, log directory and pid file.  TorchServe keeps its pid file in
``tempfile.gettempdir()`` and refuses to start a second server while it is
there, so each instance gets a private ``TMPDIR``; that is what lets tests and
benchmarks run servers side by side.  The server runs in its own process
group, so stopping it also stops the worker processes the frontend spawned.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import requests

from serving_harness.clients import InferenceClient, ManagementClient, MetricsClient
from serving_harness.jsonfile import write_json_atomic
from serving_harness.log_config import write_log_config
from serving_harness.processes import pid_alive

REPO_CONFIG = Path(__file__).resolve().parent.parent / "config.properties"


class TorchServeError(RuntimeError):
    """TorchServe failed to start or to answer."""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def read_properties(path: Path) -> dict[str, str]:
    props: dict[str, str] = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#") and "=" in line:
            key, value = line.split("=", 1)
            props[key.strip()] = value.strip()
    return props


@dataclass(frozen=True)
class Ports:
    inference: int
    management: int
    metrics: int
    # TorchServe always starts its gRPC servers too (7070/7071 by default);
    # two instances on one machine must not share those either.
    grpc_inference: int = 7070
    grpc_management: int = 7071

    @classmethod
    def free(cls, exclude: Iterable[int | None] = ()) -> Ports:
        """Five ports free now, none of ``exclude``: ports the caller will bind itself later (a status
        server), which the kernel may hand out again while they are still unbound."""
        taken = {port for port in exclude if port is not None}
        ports: set[int] = set()
        while len(ports) < 5:
            port = free_port()
            if port not in taken:
                ports.add(port)
        return cls(*sorted(ports))

    @classmethod
    def default(cls) -> Ports:
        return cls(8080, 8081, 8082)


class TorchServeProcess:
    """A TorchServe instance rooted in ``workdir``.

    ``workdir`` receives ``config.properties`` (the repo's file with this
    instance's ports and model store), ``log4j2.xml``, ``logs/`` and ``tmp/``.
    Extra properties override the repo's.  ``log_config`` is a log4j2 file of
    the caller's; without one the server logs as ``log_config.log4j2_xml``
    says: TorchServe's files, rolled by size and never at midnight.
    """

    def __init__(
        self,
        workdir: Path,
        model_store: Path,
        ports: Ports | None = None,
        base_config: Path = REPO_CONFIG,
        extra_properties: dict[str, str] | None = None,
        env: dict[str, str] | None = None,
        inference_host: str = "127.0.0.1",
        log_config: Path | None = None,
    ) -> None:
        self.workdir = Path(workdir).resolve()
        # Where the inference API listens (0.0.0.0 in a container that serves its pod's traffic); the
        # management and metrics APIs stay on loopback, and clients here use loopback either way.
        self.inference_host = inference_host
        self.model_store = Path(model_store).resolve()
        self.ports = ports or Ports.free()
        self.base_config = base_config
        self.extra_properties = extra_properties or {}
        self.extra_env = env or {}
        self.log_dir = self.workdir / "logs"
        self.config_path = self.workdir / "config.properties"
        self.log_config = Path(log_config).resolve() if log_config is not None else self.workdir / "log4j2.xml"
        self._own_log_config = log_config is None
        self.proc: subprocess.Popen | None = None
        self._stdout = None
        self.attached_pid: int | None = None  # a server an earlier process of this workdir left running

    # -- URLs and clients ----------------------------------------------------

    @property
    def inference_url(self) -> str:
        return f"http://127.0.0.1:{self.ports.inference}"

    @property
    def management_url(self) -> str:
        return f"http://127.0.0.1:{self.ports.management}"

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.ports.metrics}"

    def inference(self) -> InferenceClient:
        return InferenceClient(self.inference_url)

    def management(self) -> ManagementClient:
        return ManagementClient(self.management_url)

    def metrics(self) -> MetricsClient:
        return MetricsClient(self.metrics_url)

    # -- lifecycle -------------------------------------------------------------

    def write_config(self) -> Path:
        props = read_properties(self.base_config)
        props.update(
            {
                "inference_address": f"http://{self.inference_host}:{self.ports.inference}",
                "management_address": self.management_url,
                "metrics_address": self.metrics_url,
                "grpc_inference_port": str(self.ports.grpc_inference),
                "grpc_management_port": str(self.ports.grpc_management),
                "model_store": str(self.model_store),
            }
        )
        props.update(self.extra_properties)
        self.config_path.write_text("".join(f"{k}={v}\n" for k, v in props.items()))
        return self.config_path

    def start(self, timeout_s: float = 120.0) -> TorchServeProcess:
        if self.proc is not None:
            raise TorchServeError("already started")
        torchserve = shutil.which("torchserve", path=str(Path(sys.executable).parent)) or shutil.which("torchserve")
        if torchserve is None:
            raise TorchServeError("torchserve not found; run `make setup`")
        if shutil.which("java") is None:
            raise TorchServeError("java not found; TorchServe needs a Java 17 runtime on PATH")
        taken = [port for port in (self.ports.inference, self.ports.management) if _listening(port)]
        if taken:
            # A frontend that cannot bind exits, while /ping answers from whatever holds the port: the
            # registrations then land on that server (409 for a version it already has).  Say so instead.
            raise TorchServeError(f"port {taken[0]} is already in use on 127.0.0.1 (another TorchServe?): stop it "
                                  f"or choose other ports")  # fmt: skip
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.model_store.mkdir(parents=True, exist_ok=True)
        self.log_dir.mkdir(exist_ok=True)
        tmp = self.workdir / "tmp"
        tmp.mkdir(exist_ok=True)
        self.write_config()
        if self._own_log_config:
            write_log_config(self.log_config)
        elif not self.log_config.is_file():
            raise TorchServeError(f"log config {self.log_config} does not exist")
        env = dict(os.environ)
        env.update(
            {
                "TMPDIR": str(tmp),
                # The launcher passes TEMP to the JVM as java.io.tmpdir, where the
                # frontend unpacks every registered archive (<tmp>/models/<uuid>);
                # left at /tmp, those directories outlive the server (53 GB
                # gathered on a development VM over a few days of test runs).
                "TEMP": str(tmp),
                "LOG_LOCATION": str(self.log_dir),
                "METRICS_LOCATION": str(self.log_dir),
                "PYTHONUNBUFFERED": "1",
            }
        )
        env.update(self.extra_env)
        cmd = [
            torchserve, "--start", "--foreground",
            "--ts-config", str(self.config_path),
            "--model-store", str(self.model_store),
            "--log-config", str(self.log_config),
            "--ncs", "--disable-token-auth", "--enable-model-api",
        ]  # fmt: skip
        self._stdout = open(self.log_dir / "torchserve.stdout.log", "wb")  # noqa: SIM115 (lives as long as the server)
        self.proc = subprocess.Popen(
            cmd, cwd=self.workdir, env=env, stdout=self._stdout, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            self.wait_ready(timeout_s)
        except BaseException:
            self.stop()
            raise
        # Where a later process finds this server to attach to (``attach``): the frontend outlives a killed
        # controller, which started it in a session of its own.
        write_json_atomic(self.pid_file, {"pid": self.proc.pid, **dataclasses.asdict(self.ports)})
        return self

    @property
    def pid_file(self) -> Path:
        return self.workdir / "torchserve.pid.json"

    def attach(self) -> bool:
        """Take over the TorchServe an earlier process of this workdir started and left running (it was
        killed, or restarted by a supervisor): its pid file names a live process whose management API
        answers on the ports it recorded.  False where there is none; ``start`` then launches one."""
        try:
            record = json.loads(self.pid_file.read_text())
            pid, ports = int(record["pid"]), Ports(**{k: int(v) for k, v in record.items() if k != "pid"})
        except (FileNotFoundError, ValueError, KeyError, TypeError):
            return False
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:  # alive, but not ours to manage
            return False
        previous, self.ports = self.ports, ports
        try:
            requests.get(f"{self.management_url}/models", timeout=5).raise_for_status()
        except requests.RequestException:
            self.ports = previous
            return False
        self.attached_pid = pid
        return True

    def wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise TorchServeError(f"TorchServe exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                if requests.get(f"{self.inference_url}/ping", timeout=2).status_code == 200:
                    requests.get(f"{self.management_url}/models", timeout=2).raise_for_status()
                    return
            except requests.RequestException:
                pass
            time.sleep(0.5)
        raise TorchServeError(f"TorchServe did not answer /ping within {timeout_s:.0f} s:\n{self.log_tail()}")

    def stop(self, timeout_s: float = 30.0) -> None:
        """SIGTERM the whole process group (frontend and workers), then SIGKILL."""
        if self.attached_pid is not None:
            self._stop_attached(self.attached_pid, timeout_s)
            return
        if self.proc is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=timeout_s)
        # The frontend may have exited while workers linger in the group.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        self.proc = None
        self.pid_file.unlink(missing_ok=True)
        if self._stdout is not None:
            self._stdout.close()
            self._stdout = None

    def detach(self) -> None:
        """Forget an attached server without stopping it (it was found not to be ours to manage)."""
        self.attached_pid = None

    def _stop_attached(self, pid: int, timeout_s: float) -> None:
        """``stop`` for an attached server: not our child, so its group is signalled and polled until gone."""
        for sig, wait_s in ((signal.SIGTERM, timeout_s), (signal.SIGKILL, 10.0)):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, sig)
            deadline = time.monotonic() + wait_s
            while time.monotonic() < deadline and pid_alive(pid):
                time.sleep(0.1)
        self.attached_pid = None
        self.pid_file.unlink(missing_ok=True)

    def __enter__(self) -> TorchServeProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- diagnostics -----------------------------------------------------------

    def log_tail(self, lines: int = 80) -> str:
        chunks = []
        for name in ("torchserve.stdout.log", "model_log.log", "ts_log.log"):
            path = self.log_dir / name
            if path.exists():
                tail = path.read_text(errors="replace").splitlines()[-lines:]
                chunks.append(f"--- {name} (last {len(tail)} lines) ---\n" + "\n".join(tail))
        return "\n".join(chunks) or "(no logs)"

    @property
    def model_log(self) -> Path:
        """The workers' stdout and stderr as the frontend logs them (one file for the server's life: see
        ``log_config``)."""
        return self.log_dir / "model_log.log"

    def model_log_size(self) -> int:
        """Where the model log ends now: pass it to ``model_log_lines`` to read only what comes after."""
        return self.model_log.stat().st_size if self.model_log.exists() else 0

    def model_log_text(self, since: int = 0) -> str:
        """The model log's whole lines from byte ``since`` on ('' while it does not exist)."""
        return self.model_log_read(since)[0]

    def model_log_read(self, since: int = 0) -> tuple[str, int]:
        """The model log's whole lines from byte ``since`` on, and the byte where they end: the ``since``
        of the next read.  A line the frontend is still writing is left for that read, so a caller
        reading as the log grows sees each line once and whole.  ('', ``since``) while there is none."""
        if not self.model_log.exists():
            return "", since
        with self.model_log.open("rb") as f:
            f.seek(since)
            data = f.read()
        data = data[: data.rfind(b"\n") + 1]
        return data.decode(errors="replace"), since + len(data)

    def model_log_lines(self, containing: str, since: int = 0, timeout_s: float = 10.0) -> list[str]:
        """The model log's lines after byte ``since`` that contain ``containing``, waiting up to ``timeout_s``.

        A worker's output reaches ``model_log.log`` through the frontend's reader thread for that
        worker's stdout, which runs beside the thread answering the API: a management or inference
        answer can arrive before the line the worker printed on its way.  So a caller that looks for
        a line right after an answer polls, and gets an empty list only when the line never came.
        """
        deadline = time.monotonic() + timeout_s
        while True:
            found = [line for line in self.model_log_text(since).splitlines() if containing in line]
            if found or time.monotonic() >= deadline:
                return found
            time.sleep(0.1)


def _listening(port: int) -> bool:
    """Whether something accepts connections on ``port`` on loopback."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.settimeout(0.5)
        return sock.connect_ex(("127.0.0.1", port)) == 0
