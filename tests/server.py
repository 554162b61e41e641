"""Start and stop a real tritonserver on free ports for end-to-end tests."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

from orca_backend.launch import REPO_ROOT, server_command


def free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


class Server:
    def __init__(self, work_dir: Path, model_repository: Path = REPO_ROOT / "model_repository",
                 extra_args: list[str] = ()) -> None:
        self.http_port, self.grpc_port, self.metrics_port = free_ports(3)
        argv, env = server_command(model_repository, work_dir, self.http_port, self.grpc_port,
                                   self.metrics_port, ["--log-verbose=0", *extra_args])
        self.log_path = work_dir / "tritonserver.log"
        self._log = open(self.log_path, "wb")
        self.process = subprocess.Popen(argv, env=env, stdout=self._log, stderr=subprocess.STDOUT,
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
                raise RuntimeError(f"tritonserver exited; log:\n{self.log_path.read_text(errors='replace')[-3000:]}")
            if self.is_ready():
                return
            time.sleep(0.5)
        raise TimeoutError(f"tritonserver not ready in {timeout} s")

    def metric(self, name: str, model: str = "orca") -> float:
        _, text = self.http("/metrics", port=self.metrics_port)
        for line in text.splitlines():
            if line.startswith(f'{name}{{model="{model}"}}'):
                return float(line.rsplit(" ", 1)[1])
        raise KeyError(name)

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
