"""Write a model repository that serves the model as pipeline stages, one Triton model each.

    python -m orca_backend.serving.stages.repository --stages 2 --kind gpu --gpus 0,1 \
        --model PATH --output DIR
    # 2 stages of 2 tensor-parallel ranks each, on GPUs 0-1 and 2-3:
    python -m orca_backend.serving.stages.repository --stages 2 --tp 2 --kind gpu --gpus 0,2 ...
    tritonserver --model-repository DIR
    # or: python -m orca_backend.serving.launch --model-repository DIR

The repository holds `orca` (the serving model, with the I/O of the single-process one, set
to the `stages` executor), `orca_stage_<i>` (one Python-backend model per stage, exactly one
instance, on the i-th GPU of `--gpus` or on the CPU; with `--tp T` on GPUs a KIND_MODEL
instance over T GPUs from there) and `orca_pipeline` (the ensemble that chains the stages,
used when `stage_transport` is `ensemble`). Layers are split evenly unless `--layers`
chooses, e.g. `--layers 0:20,20:30`. With `--hosts`, one repository per server (`host<k>`),
the stages spread over the servers in order, called over gRPC, and `START.md` saying what
to start where.
"""
from __future__ import annotations

import argparse
import re
from dataclasses import dataclass, field
from pathlib import Path

from ...checkpoint.config import ModelConfig
from ...checkpoint.store import model_folder
from ...core.config import STAGE_TRANSPORTS, auto_dtype
from ...core.errors import ConfigError
from ...executors.stages import NUM_STAGE_CALL_VALUES, check_layer_split, ensemble_model, split_layers, stage_model
from ..launch import REPO_ROOT

TEMPLATE = REPO_ROOT / "model_repository" / "orca" / "config.pbtxt"
_TRITON_TYPES = {"float32": "TYPE_FP32", "bfloat16": "TYPE_BF16", "float16": "TYPE_FP16"}


@dataclass(slots=True)
class PipelineLayout:
    """What the repository is made of; `write_repository` turns it into files."""

    num_stages: int
    name: str = "orca"  # the serving model; its stages are <name>_stage_<i>, the ensemble <name>_pipeline
    kind: str = "cpu"  # "cpu" or "gpu"
    gpus: list[int] | None = None  # stage i on gpus[i] (its first, with T ranks); default: each
    # server's stages on its GPUs 0, T, 2T, ...
    model: str | None = None  # a Hugging Face-format folder; None: the default model
    layers: list[tuple[int, int]] | None = None  # None: an even split
    dtype: str | None = None  # None: bfloat16 on GPUs, float32 on the CPU ("auto")
    threads_per_stage: int = 0  # torch threads per CPU stage; 0: torch's default
    tensor_parallel_size: int = 1  # ranks of each stage (stage i on GPUs gpus[i] .. gpus[i] + T - 1)
    hosts: list[str] | None = None  # host:grpc_port of each server; None: one server
    orca_parameters: dict[str, str] = field(default_factory=dict)  # more `orca` parameters

    def __post_init__(self) -> None:
        if self.kind not in ("cpu", "gpu"):
            raise ConfigError(f"--kind must be cpu or gpu, got {self.kind!r}")
        if self.dtype is None:
            self.dtype = auto_dtype("cuda" if self.kind == "gpu" else "cpu")
        if self.dtype not in _TRITON_TYPES:
            raise ConfigError(f"--dtype must be one of {', '.join(_TRITON_TYPES)}, got {self.dtype!r}")
        if self.kind == "cpu" and self.dtype != "float32":
            raise ConfigError("stages on the CPU run in float32")
        if self.hosts is not None and not 1 <= len(self.hosts) <= self.num_stages:
            raise ConfigError(f"--hosts names {len(self.hosts)} servers for {self.num_stages} stages "
                              f"(each server needs at least one stage)")
        for host in self.hosts or []:
            if not re.fullmatch(r"[\w.\-\[\]:]+:\d+", host):
                raise ConfigError(f"--hosts entries must be host:grpc_port, got {host!r}")
        if self.gpus is None:  # numbered within each server: its stages from GPU 0, T apiece
            first = {self.host_of(i): i for i in reversed(range(self.num_stages))}
            self.gpus = [(i - first[self.host_of(i)]) * self.tensor_parallel_size for i in range(self.num_stages)]
        if self.kind == "gpu" and len(self.gpus) != self.num_stages:
            raise ConfigError(f"--gpus names {len(self.gpus)} GPUs for {self.num_stages} stages")

    def host_of(self, stage: int) -> int:
        """The server of each stage: consecutive stages share one, the first servers taking one
        more when they do not divide."""
        bounds = split_layers(self.num_stages, len(self.hosts or [""]))
        return next(h for h, (start, stop) in enumerate(bounds) if start <= stage < stop)


def write_repository(layout: PipelineLayout, output: Path) -> Path:
    """Write the repository into `output` (created; its existing stage models are replaced).
    With `hosts`, one repository per server: `output/host<k>` (the serving model in host0)."""
    given = Path(layout.model).resolve() if layout.model else None  # a GGUF file: each host makes its own folder
    model_path = model_folder(given)
    config = ModelConfig.from_folder(model_path)
    layers = layout.layers or split_layers(config.num_layers, layout.num_stages)
    if len(layers) != layout.num_stages:
        raise ConfigError(f"--layers gives {len(layers)} ranges for {layout.num_stages} stages")
    try:
        check_layer_split(layers, config.num_layers)
    except ConfigError as e:
        raise ConfigError(f"--layers: {e}") from None
    output.mkdir(parents=True, exist_ok=True)
    on_gpu = layout.kind == "gpu"
    tp = layout.tensor_parallel_size
    config.check_tensor_parallel(tp)
    orca = {"model": str(given or ""), "executor": "stages",
            "pipeline_stages": str(layout.num_stages), "dtype": layout.dtype,
            "device": "cuda" if on_gpu else "cpu", "tensor_parallel_size": str(tp)}
    folder = lambda stage: output / f"host{layout.host_of(stage)}" if layout.hosts else output  # noqa: E731
    if layout.hosts:
        urls = ["" if layout.host_of(i) == 0 else layout.hosts[layout.host_of(i)] for i in range(len(layers))]
        orca |= {"stage_transport": "grpc", "stage_urls": ",".join(urls)}
    orca |= layout.orca_parameters
    serving = set_parameters(TEMPLATE.read_text(), orca).replace('name: "orca"', f'name: "{layout.name}"', 1)
    _write_model(folder(0) / layout.name, serving, "orca_backend.serving.triton_model")
    hidden_type = _TRITON_TYPES[layout.dtype]
    for i, (start, stop) in enumerate(layers):
        last = i == len(layers) - 1
        parameters = {"stage": str(i), "layer_start": str(start), "layer_end": str(stop),
                      "model": orca["model"], "dtype": layout.dtype,
                      "num_threads": str(layout.threads_per_stage), "tensor_parallel_size": str(tp),
                      "FORCE_CPU_ONLY_INPUT_TENSORS": "no"}
        instance = _instance(on_gpu, tp, layout.gpus[i], parameters)
        text = _STAGE_CONFIG.format(
            name=stage_model(layout.name, i), hidden_type=hidden_type, hidden=config.hidden_size,
            last_output=('{ name: "output" data_type: TYPE_UINT8 dims: [ -1 ] }' if last else
                         f'{{ name: "hidden" data_type: {hidden_type} dims: [ -1, {config.hidden_size} ] }}'),
            instance=instance, parameters=_parameters(parameters), num_stats=NUM_STAGE_CALL_VALUES)
        _write_model(folder(i) / stage_model(layout.name, i), text, "orca_backend.serving.stages.model")
    if layout.hosts:
        (output / "START.md").write_text(start_commands(layout, output))
        return output
    ensemble = output / ensemble_model(layout.name)  # Triton chains it in one server only
    (ensemble / "1").mkdir(parents=True, exist_ok=True)
    (ensemble / "config.pbtxt").write_text(_ensemble(layout.name, len(layers)))
    return output


def start_commands(layout: PipelineLayout, output: Path) -> str:
    """What to start where: a tritonserver per host, the stages' servers first."""
    lines = [f"# Start the servers of `{layout.name}` (written by orca_backend.serving.stages.repository)",
             "", "Each host needs this package, the model at the same path (or the default model),",
             "and the folder for it. Start the stage servers first; then send requests to host0.",
             "The launcher runs the tritonserver `make serve` installs (nvidia-pytriton's) unless one",
             "is on PATH; `tritonserver --model-repository DIR --grpc-port PORT` works as well.", ""]
    for h in reversed(range(len(layout.hosts))):
        stages = [str(i) for i in range(layout.num_stages) if layout.host_of(i) == h]
        host, port = layout.hosts[h].rsplit(":", 1)
        role = f"`{layout.name}` and stage(s) {', '.join(stages)}" if h == 0 else f"stage(s) {', '.join(stages)}"
        extra = "" if h == 0 else " --no-openai"
        lines += [f"- on {host} ({role}):", "",
                  f"      GRPC_PORT={port} python -m orca_backend.serving.launch --model-repository "
                  f"{output / f'host{h}'}{extra}", ""]
    return "\n".join(lines)


def _instance(on_gpu: bool, tensor_parallel_size: int, gpu: int, parameters: dict[str, str]) -> str:
    """A stage of one rank on a GPU is a KIND_GPU instance there. One of T > 1 ranks spans T
    GPUs, which KIND_GPU cannot give (it makes an instance per listed GPU): KIND_MODEL, with
    its first GPU in the `device` parameter and its ranks on the T - 1 after it."""
    if not on_gpu:
        return "{ count: 1 kind: KIND_CPU }"
    if tensor_parallel_size == 1:
        return f"{{ count: 1 kind: KIND_GPU gpus: [ {gpu} ] }}"
    parameters["device"] = f"cuda:{gpu}"
    return "{ count: 1 kind: KIND_MODEL }"


def _write_model(folder: Path, config_text: str, module: str) -> None:
    (folder / "1").mkdir(parents=True, exist_ok=True)
    (folder / "config.pbtxt").write_text(config_text)
    (folder / "1" / "model.py").write_text(
        f"# Written by orca_backend.serving.stages.repository; the model is in orca_backend.\n"
        f"from {module} import TritonPythonModel  # noqa: F401\n")


def set_parameters(text: str, values: dict[str, str]) -> str:
    """Set `parameters` entries of a config.pbtxt; a key it lacks is added."""
    for key, value in values.items():
        pattern = re.compile(r'(parameters: \{ key: "' + re.escape(key) + r'" value: \{ string_value: ")[^"]*(")')
        if pattern.search(text):
            text = pattern.sub(lambda m: m.group(1) + value + m.group(2), text)
        else:
            text += f'parameters: {{ key: "{key}" value: {{ string_value: "{value}" }} }}\n'
    if values.get("device", "cpu") != "cpu":  # the serving model itself stays on the CPU
        text = text.replace("# One instance: the engine batches internally.",
                            "# One instance on the CPU: the stages hold the weights.")
    return text


def _parameters(values: dict[str, str]) -> str:
    return "\n".join(f'parameters: {{ key: "{k}" value: {{ string_value: "{v}" }} }}' for k, v in values.items())


_STAGE_CONFIG = """# One pipeline stage of `orca` (written by orca_backend.serving.stages.repository): exactly
# one instance, since it holds the K/V cache of its layers and per-request state.
name: "{name}"
backend: "python"
max_batch_size: 0

input [
  {{ name: "control" data_type: TYPE_STRING dims: [ 1 ] optional: true }},
  {{ name: "message" data_type: TYPE_UINT8 dims: [ -1 ] optional: true }},
  {{ name: "hidden" data_type: {hidden_type} dims: [ -1, {hidden} ] optional: true }},
  {{ name: "error" data_type: TYPE_STRING dims: [ 1 ] optional: true }}
]
output [
  {last_output},
  {{ name: "error" data_type: TYPE_STRING dims: [ 1 ] }},
  {{ name: "stats" data_type: TYPE_FP64 dims: [ {num_stats} ] }},
  {{ name: "reply" data_type: TYPE_STRING dims: [ 1 ] }}
]

instance_group [ {instance} ]

{parameters}
"""


def _ensemble(name: str, num_stages: int) -> str:
    steps = []
    for i in range(num_stages):
        last = i == num_stages - 1
        inputs = ['{ key: "message" value: "message" }']
        if i:
            inputs += [f'{{ key: "hidden" value: "hidden_{i - 1}" }}', f'{{ key: "error" value: "error_{i - 1}" }}']
        outputs = [f'{{ key: "stats" value: "stats_{i}" }}',
                   '{ key: "error" value: "error" }' if last else f'{{ key: "error" value: "error_{i}" }}',
                   '{ key: "output" value: "output" }' if last else f'{{ key: "hidden" value: "hidden_{i}" }}']
        steps.append(f'    {{\n      model_name: "{stage_model(name, i)}"\n      model_version: -1\n'
                     f'      input_map [ {", ".join(inputs)} ]\n      output_map [ {", ".join(outputs)} ]\n    }}')
    stats = ",\n".join(f'  {{ name: "stats_{i}" data_type: TYPE_FP64 dims: [ {NUM_STAGE_CALL_VALUES} ] }}'
                       for i in range(num_stages))
    return (f'# The stages chained inside Triton: `orca` calls this once per iteration when its\n'
            f'# parameter stage_transport is "ensemble" (written by\n'
            f'# orca_backend.serving.stages.repository).\n'
            f'name: "{ensemble_model(name)}"\nplatform: "ensemble"\nmax_batch_size: 0\n\n'
            f'input [ {{ name: "message" data_type: TYPE_UINT8 dims: [ -1 ] }} ]\n'
            f'output [\n  {{ name: "output" data_type: TYPE_UINT8 dims: [ -1 ] }},\n'
            f'  {{ name: "error" data_type: TYPE_STRING dims: [ 1 ] }},\n{stats}\n]\n\n'
            f'ensemble_scheduling {{\n  step [\n' + ",\n".join(steps) + "\n  ]\n}\n")


def parse_layers(text: str) -> list[tuple[int, int]]:
    try:
        return [(int(a), int(b)) for a, b in (part.split(":") for part in text.split(","))]
    except ValueError:
        raise ConfigError(f"--layers must look like 0:15,15:30, got {text!r}") from None


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stages", type=int, required=True, help="number of pipeline stages")
    parser.add_argument("--kind", choices=("cpu", "gpu"), default="cpu")
    parser.add_argument("--gpus", help="GPU of each stage, e.g. 0,1 (default: stage i on GPU i)")
    parser.add_argument("--model", help="Hugging Face-format folder (default: the default model)")
    parser.add_argument("--layers", help="each stage's layers, e.g. 0:15,15:30 (default: even)")
    parser.add_argument("--dtype", help="float32, bfloat16 or float16 (default: bfloat16 on GPUs)")
    parser.add_argument("--transport", choices=STAGE_TRANSPORTS,
                        help="bls (the default) or ensemble; grpc, with --hosts")
    parser.add_argument("--tp", type=int, default=1,
                        help="tensor-parallel ranks of each stage (default 1; on GPUs stage i "
                             "takes T GPUs from the i-th of --gpus)")
    parser.add_argument("--threads-per-stage", type=int, default=0,
                        help="torch threads of each CPU stage (default: torch's own choice)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="another parameter of the orca model, e.g. max_inflight=1")
    parser.add_argument("--hosts", help="host:grpc_port of each server, e.g. 10.0.0.1:8001,10.0.0.2:8001: "
                             "one repository per server, stages spread in order, the serving model "
                             "on the first, stages on the others called over gRPC")
    parser.add_argument("--name", default="orca", help="the serving model's name (default: orca)")
    parser.add_argument("--output", type=Path, required=True)
    args = parser.parse_args(argv)
    extra = dict(item.split("=", 1) for item in args.set)
    if args.hosts and args.transport not in (None, "grpc"):
        raise ConfigError(f"--hosts calls the other servers' stages over gRPC: --transport "
                          f"{args.transport} cannot be used with it")
    layout = PipelineLayout(args.stages, args.name, args.kind, [int(g) for g in args.gpus.split(",")] if args.gpus else None,
                            args.model, parse_layers(args.layers) if args.layers else None, args.dtype,
                            args.threads_per_stage, tensor_parallel_size=args.tp,
                            hosts=args.hosts.split(",") if args.hosts else None,
                            orca_parameters=({} if args.hosts else {"stage_transport": args.transport or "bls"})
                            | extra)
    path = write_repository(layout, args.output)
    if layout.hosts:
        print((path / "START.md").read_text())
        return
    names = [args.name, *(stage_model(args.name, i) for i in range(args.stages)), ensemble_model(args.name)]
    print(f"wrote {path}: {', '.join(names)}")


if __name__ == "__main__":
    main()
