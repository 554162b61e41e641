"""tritonserver and the OpenAI-compatible API as child processes on free loopback ports, for
tests and benchmarks: each is ready on entering a `with` block and stopped on leaving it. The
server runs the command `python -m orca_backend.serving.launch` would (`server_command`)."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from orca_backend.serving.launch import REPO_ROOT, server_command


def free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


class _Child:
    """A child process used in a `with` block: ready on entry (else stopped and the error
    raised), stopped on exit."""

    def __enter__(self):
        try:
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


class Server(_Child):
    """A tritonserver child process on free loopback ports (tests and benchmarks).

    `env` adds environment variables for the server and its models (ORCA_ITERATION_TRACE).
    """

    def __init__(self, work_dir: Path, model_repository: Path = REPO_ROOT / "model_repository",
                 extra_args: list[str] = (), env: dict[str, str] | None = None,
                 ports: tuple[int, int, int] | None = None) -> None:
        """`ports`: (http, grpc, metrics), when they must be known before (a server another
        server's repository points at); else free ones."""
        self.http_port, self.grpc_port, self.metrics_port = ports or free_ports(3)
        argv, server_env = server_command(model_repository, work_dir, self.http_port, self.grpc_port,
                                          self.metrics_port, ["--log-verbose=0", *extra_args])
        server_env.update(env or {})
        self.log_path = work_dir / "tritonserver.log"
        self._log = open(self.log_path, "wb")
        self.process = subprocess.Popen(argv, env=server_env, stdout=self._log, stderr=subprocess.STDOUT,
                                        start_new_session=True)

    @property
    def grpc_url(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    def http(self, path: str, body: bytes | None = None, port: int | None = None) -> tuple[int, str]:
        url = f"http://127.0.0.1:{port or self.http_port}{path}"
        try:
            with urllib.request.urlopen(urllib.request.Request(url, data=body), timeout=120) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode()
        except OSError as e:
            return 0, str(e)

    def is_ready(self) -> bool:
        return self.http("/v2/health/ready")[0] == 200

    def wait_ready(self, timeout: float = 300) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"tritonserver exited; log:\n{self.log_path.read_text(errors='replace')[-20000:]}")
            if self.is_ready():
                return
            time.sleep(0.5)
        self.dump_stacks()
        raise TimeoutError(f"tritonserver not ready in {timeout} s; its models' stubs' stacks are at the end of "
                           f"its log:\n{self.log_path.read_text(errors='replace')[-20000:]}")

    def session_pids(self, command_part: str = "") -> list[int]:
        """The processes of the server's session (it, its models' stubs, their children) whose
        command line holds `command_part`."""
        pids = []
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                try:
                    with open(f"/proc/{entry}/stat") as f:  # the session is the 4th field after the name
                        session = int(f.read().rsplit(")", 1)[1].split()[3])
                    with open(f"/proc/{entry}/cmdline", "rb") as f:
                        command = f.read()
                except (OSError, ValueError, IndexError):  # gone meanwhile
                    continue
                if session == self.process.pid and command_part.encode() in command:
                    pids.append(int(entry))
        return pids

    def dump_stacks(self, settle_seconds: float = 2.0) -> None:
        """Every model stub writes every thread's stack into the log (SIGUSR1, which the
        serving model's stub handles with faulthandler)."""
        for pid in self.session_pids("triton_python_backend_stub"):
            try:
                os.kill(pid, signal.SIGUSR1)
            except ProcessLookupError:
                pass
        time.sleep(settle_seconds)

    def metrics(self) -> dict[str, float]:
        """Every sample on /metrics, by its name and labels as written there
        ('vllm:request_success_total{finished_reason="stop",model="orca",version="1"}')."""
        _, text = self.http("/metrics", port=self.metrics_port)
        samples = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                key, _, value = line.rpartition(" ")
                samples[key] = float(value)
        return samples

    def metric(self, name: str, model: str = "orca") -> float:
        try:
            return self.metrics()[f'{name}{{model="{model}"}}']
        except KeyError:
            raise KeyError(name) from None

    def terminate(self) -> None:
        """Ask tritonserver to shut down as Ctrl+C in a terminal does: SIGINT to the group."""
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGINT)

    def stop(self, timeout: float = 60) -> None:
        self.terminate()
        try:
            self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            pass
        # The Python backend's stub processes outlive a killed server: end the whole group.
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.process.wait()
        self._log.close()


class Frontend(_Child):
    """The OpenAI-compatible API as a child process, in front of a tritonserver's gRPC port.

    `api_key` reaches it through ORCA_API_KEY, never its command line; `args` are more options."""

    def __init__(self, work_dir: Path, grpc_url: str, port: int | None = None, api_key: str | None = None,
                 args: list[str] = (), host: str = "127.0.0.1") -> None:
        self.port = port or free_ports(1)[0]
        env = dict(os.environ)
        env.pop("ORCA_API_KEY", None)
        if api_key:
            env["ORCA_API_KEY"] = api_key
        self.log_path = work_dir / f"openai-{self.port}.log"
        self._log = open(self.log_path, "wb")
        self.process = subprocess.Popen(
            [sys.executable, "-m", "orca_backend.serving.openai_api", "--url", grpc_url, "--host", host,
             "--port", str(self.port), *args], env=env, cwd=REPO_ROOT, stdout=self._log, stderr=subprocess.STDOUT)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def status(self, path: str = "/health/ready") -> int:
        try:
            with urllib.request.urlopen(self.url + path, timeout=10) as r:
                return r.status
        except urllib.error.HTTPError as e:
            return e.code
        except OSError:
            return 0

    def wait_ready(self, timeout: float = 120, listening_only: bool = False) -> None:
        """Until /health/ready answers 200 (or anything at all, with `listening_only`)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"the frontend exited; log:\n{self.log_path.read_text(errors='replace')[-3000:]}")
            status = self.status()
            if status == 200 or (listening_only and status):
                return
            time.sleep(0.2)
        raise TimeoutError(f"the frontend was not ready in {timeout} s")

    def stop(self, timeout: float = 20) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._log.close()

