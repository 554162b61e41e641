"""Start a real `tritonserver` on a model repository, with or without the NGC image.

Uses `tritonserver` from PATH when there is one (the NGC image). Otherwise it uses the binary
shipped in the `nvidia-pytriton` wheel: a writable copy of the wheel's backends/ gets the Python
backend stub for the running Python, and the environment lets that stub find the wheel's
libraries, libpython, and our package with its dependencies.

    python -m orca_backend.serving.launch [--model-repository model_repository] [--triton-address A]
Ports come from HTTP_PORT, GRPC_PORT and METRICS_PORT (defaults 8000, 8001, 8002); the
OpenAI-compatible API starts beside it on OPENAI_PORT (9000) unless --no-openai. Options it
does not know go to tritonserver (--grpc-restricted-protocol, --http-restricted-api, ...).
Tests and benchmarks run `server_command`'s tritonserver as a child process (benchmarks/servers.py).
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import shutil
import signal
import site
import subprocess
import sys
import sysconfig
import time
import urllib.request
from pathlib import Path

from ..core.errors import ConfigError

REPO_ROOT = Path(__file__).resolve().parents[2]  # the folder that holds orca_backend/


def _wheel_root() -> Path:
    # Never import pytriton: its __init__ needs packages (and a numpy) we do not install.
    spec = importlib.util.find_spec("pytriton")
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError("no tritonserver on PATH and the nvidia-pytriton wheel is not installed")
    return Path(spec.submodule_search_locations[0])


def _prepare_backends(work_dir: Path) -> tuple[Path, Path]:
    """Copy the wheel's backends/ and put this Python's stub in it; returns (binary, backends)."""
    root = _wheel_root() / "tritonserver"
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    stub = root / "python_backend_stubs" / version / "triton_python_backend_stub"
    if not stub.exists():
        raise ConfigError(f"the nvidia-pytriton wheel has no Python backend stub for Python {version}")
    backends = work_dir / "backends"
    shutil.rmtree(backends, ignore_errors=True)
    shutil.copytree(root / "backends", backends)
    shutil.copy2(stub, backends / "python" / "triton_python_backend_stub")
    return root / "bin" / "tritonserver", backends


def _join(*parts: str | os.PathLike | None) -> str:
    return os.pathsep.join(str(p) for p in parts if p)


def server_command(model_repository: Path | list[Path], work_dir: Path, http_port: int, grpc_port: int,
                   metrics_port: int, extra_args: list[str] = ()) -> tuple[list[str], dict[str, str]]:
    """The argv and environment that run tritonserver on `model_repository` (or several)."""
    env = dict(os.environ)
    python_paths = [REPO_ROOT, *site.getsitepackages(), sysconfig.get_paths()["purelib"]]
    env["PYTHONPATH"] = _join(*dict.fromkeys(python_paths), env.get("PYTHONPATH"))
    # The stub's embedded Python finds its prefix (and a virtualenv's packages) from the
    # first `python3` on PATH: make that the interpreter running us.
    env["PATH"] = _join(Path(sys.executable).parent, env.get("PATH"))
    repositories = [model_repository] if isinstance(model_repository, (str, os.PathLike)) else model_repository
    # Every model of ours has a complete config.pbtxt. With auto-complete on, the Python backend
    # starts a stub per model only to import model.py (and torch) and ask it for a config: 4 s
    # of a 10.5 s start of model_repository/ here. `--strict-model-config=false` turns it on
    # (tritonserver takes a prefix of an option's name, so a prefix is looked for).
    auto_complete_asked = any(arg.startswith("--strict-model") for arg in extra_args)
    args = [*(f"--model-repository={r}" for r in repositories), f"--http-port={http_port}",
            f"--grpc-port={grpc_port}", f"--metrics-port={metrics_port}",
            *([] if auto_complete_asked else ["--disable-auto-complete-config"]), *extra_args]
    binary = shutil.which("tritonserver")
    if binary is None:
        binary, backends = _prepare_backends(work_dir)
        libs = _wheel_root().parent / "nvidia_pytriton.libs"
        env["LD_LIBRARY_PATH"] = _join(libs, sysconfig.get_config_var("LIBDIR"), env.get("LD_LIBRARY_PATH"))
        args.append(f"--backend-directory={backends}")
    return [str(binary), *args], env


def _answers_200(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.status == 200
    except OSError:  # HTTPError included: 503 while it starts
        return False


_RESTRICTED = ("--grpc-restricted-protocol", "--http-restricted-api")  # VALUE: <protocols>:<key>=<value>


def _restricted(argv: list[str]) -> list[tuple[int, str, str]]:
    """(index of the value, flag, value) of each restricted-protocol option, in either form."""
    found = []
    for i, arg in enumerate(argv):
        flag, eq, value = arg.partition("=")
        if flag in _RESTRICTED and eq:
            found.append((i, flag, value))
        elif arg in _RESTRICTED and i + 1 < len(argv):
            found.append((i + 1, arg, argv[i + 1]))
    return found


def restricted_headers(triton_args: list[str]) -> list[str]:
    """The frontend's --grpc-header options for tritonserver's --grpc-restricted-protocol ones,
    so that the frontend may make the calls they restrict (the server prefixes each key)."""
    return [part for _, flag, value in _restricted(triton_args) if flag == "--grpc-restricted-protocol"
            for part in ("--grpc-header", f"triton-grpc-protocol-{value.partition(':')[2]}")]


def shown(argv: list[str]) -> str:
    """The command line to print, the restricted protocols' values hidden."""
    shown = list(argv)
    for i, _, value in _restricted(argv):
        secret = value.partition(":")[2].partition("=")[2]
        if secret:
            shown[i] = shown[i][:len(shown[i]) - len(secret)] + "***"
    return " ".join(shown)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-repository", type=Path, action="append",
                        help="a Triton model repository (repeatable; default: model_repository)")
    parser.add_argument("--work-dir", type=Path, default=REPO_ROOT / "build" / "triton")
    parser.add_argument("--triton-address", metavar="ADDRESS",
                        help="bind tritonserver's HTTP, gRPC and metrics ports to ADDRESS only (127.0.0.1: "
                             "reachable from this host alone, the OpenAI API the one door from outside)")
    parser.add_argument("--no-openai", action="store_true", help="do not start the OpenAI-compatible API")
    parser.add_argument("--openai-host", default="0.0.0.0", help="address the OpenAI API listens on")
    parser.add_argument("--openai-workers", type=int, default=1, help="processes serving the OpenAI API")
    parser.add_argument("--tool-call-parser", metavar="NAME",
                        help="the OpenAI API's parser of the model's tool calls (hermes, llama3_json, pythonic, mistral)")
    parser.add_argument("--reasoning-parser", metavar="NAME",
                        help="the OpenAI API's reasoning parser (deepseek_r1, qwen3)")
    parser.add_argument("--lora-separator", metavar="SEP",
                        help="the OpenAI API names LoRA adapters <model><SEP><adapter> (default: by their own name)")
    args, extra = parser.parse_known_args()
    args.work_dir.mkdir(parents=True, exist_ok=True)
    if args.triton_address:
        extra = [f"--{kind}-address={args.triton_address}" for kind in ("http", "grpc", "metrics")] + extra
    grpc_port = int(os.environ.get("GRPC_PORT", 8001))
    argv, env = server_command(
        [r.resolve() for r in args.model_repository or [REPO_ROOT / "model_repository"]], args.work_dir.resolve(),
        int(os.environ.get("HTTP_PORT", 8000)), grpc_port, int(os.environ.get("METRICS_PORT", 8002)), extra)
    print(shown(argv), flush=True)
    if args.no_openai:
        os.execve(argv[0], argv, env)
    # OPENAI_PORT and ORCA_API_KEY reach the frontend through the environment.
    grpc_host = "127.0.0.1" if args.triton_address in (None, "0.0.0.0") else args.triton_address
    frontend = subprocess.Popen([sys.executable, "-m", "orca_backend.serving.openai_api",
                                 "--url", f"{grpc_host}:{grpc_port}", "--host", args.openai_host,
                                 "--workers", str(args.openai_workers), *_frontend_options(args),
                                 *restricted_headers(extra)],
                                cwd=REPO_ROOT, start_new_session=True)
    server = subprocess.Popen(argv, env=env, start_new_session=True)
    openai_host = "127.0.0.1" if args.openai_host in ("0.0.0.0", "::") else args.openai_host
    ready_url = f"http://{openai_host}:{os.environ.get('OPENAI_PORT', 9000)}/health/ready"
    sys.exit(_supervise(server, frontend, ready_url, _ready_line(grpc_port)))


def _frontend_options(args: argparse.Namespace) -> list[str]:
    options = []
    for name in ("tool_call_parser", "reasoning_parser", "lora_separator"):
        if getattr(args, name):
            options += ["--" + name.replace("_", "-"), getattr(args, name)]
    return options


def _ready_line(grpc_port: int) -> str:
    ports = {kind: os.environ.get(f"{kind.upper()}_PORT", default)
             for kind, default in (("http", 8000), ("metrics", 8002), ("openai", 9000))}
    return (f"ready: the OpenAI API on port {ports['openai']} (/v1), tritonserver on {ports['http']} (HTTP), "
            f"{grpc_port} (gRPC), {ports['metrics']} (metrics)")


def _supervise(server: subprocess.Popen, frontend: subprocess.Popen, ready_url: str, ready_line: str) -> int:
    """Wait for both, saying `ready_line` once `ready_url` answers 200 (every model can chat);
    Ctrl+C or SIGTERM here stops both as Ctrl+C in their own terminals would (SIGINT to
    tritonserver's process group: its models end their open streams). If one of them exits
    (the frontend's port taken...), the other is stopped too."""
    def stop(*_) -> None:
        for process in (server, frontend):
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGINT)

    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGTERM, stop)
    said = False
    while server.poll() is None and frontend.poll() is None:
        if not said and _answers_200(ready_url):
            print(ready_line, flush=True)
            said = True
        time.sleep(0.5)
    if server.poll() is None or frontend.poll() is None:
        which = "the OpenAI API" if frontend.poll() is not None else "tritonserver"
        print(f"{which} exited; stopping the other", file=sys.stderr, flush=True)
        stop()
    for process in (server, frontend):
        try:
            process.wait(90)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    return server.returncode or frontend.returncode


if __name__ == "__main__":
    main()
