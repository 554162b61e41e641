"""The part of TensorRT's network API the engine builder uses, and two implementations.

`Network` is the narrow interface `trt_plugins.builder` writes its graph against:
- `TensorRTNetwork` adds each op as a TensorRT layer of an `INetworkDefinition`;
- `TorchGraph` records the ops and evaluates them with torch (our plugin by its own entry,
  interpreted on the CPU). It is how the graph is checked against the PyTorch model where
  TensorRT cannot run, and a CPU stand-in for an engine (`tensorrt_runtime: torch`).

dtypes are torch's names: "float32", "float16", "bfloat16", "int32", "int64".
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

ELEMENTWISE = ("sum", "prod", "sub")
UNARY = ("sqrt", "recip", "cos", "sin")


class Network(Protocol):
    def input(self, name: str, dtype: str, shape: tuple[int, ...]) -> Any:
        """A network input; -1 marks a dimension the optimisation profile sizes."""

    def constant(self, value: torch.Tensor) -> Any: ...

    def matmul(self, a, b, transpose_b: bool = False) -> Any:
        """a @ b (a @ b^T with transpose_b), batched over leading dims with broadcasting."""

    def elementwise(self, op: str, a, b) -> Any:
        """One of ELEMENTWISE, broadcasting dims of size 1 (same rank)."""

    def unary(self, op: str, x) -> Any:
        """One of UNARY."""

    def sigmoid(self, x) -> Any: ...

    def mean(self, x, axis: int) -> Any:
        """Mean over one (non-negative) axis, kept as size 1."""

    def gather(self, data, indices, axis: int) -> Any: ...

    def reshape(self, x, shape: tuple[int, ...]) -> Any:
        """0 copies the input's dimension, -1 is inferred (TensorRT's shuffle)."""

    def cast(self, x, dtype: str) -> Any: ...

    def plugin(self, plugin_id: str, inputs: list, fields: dict) -> Any:
        """A plugin's one output."""

    def output(self, name: str, x) -> None: ...


class TensorRTNetwork:
    """`Network` over a TensorRT `INetworkDefinition` (created strongly typed, so each op's
    type follows from its inputs as in torch). `trt` is the `tensorrt` module, `trtp` its
    `tensorrt.plugin`; both are passed in, so that tests can record the calls."""

    def __init__(self, trt, trtp, network) -> None:
        self.trt, self.trtp, self.network = trt, trtp, network
        self.kept: list[torch.Tensor] = []  # host copies the weights point into, until the build ends

    def _dtype(self, name: str):
        return getattr(self.trt, name)  # trt.float32, trt.bfloat16, trt.int32, ...

    def input(self, name, dtype, shape):
        return self.network.add_input(name, self._dtype(dtype), tuple(shape))

    def constant(self, value):
        host = value.detach().to("cpu").contiguous()
        self.kept.append(host)
        weights = self.trt.Weights(self._dtype(str(host.dtype).removeprefix("torch.")),
                                   host.data_ptr(), host.numel())
        return self.network.add_constant(tuple(host.shape), weights).get_output(0)

    def matmul(self, a, b, transpose_b=False):
        op = self.trt.MatrixOperation
        return self.network.add_matrix_multiply(a, op.NONE, b, op.TRANSPOSE if transpose_b else op.NONE).get_output(0)

    def elementwise(self, op, a, b):
        ops = self.trt.ElementWiseOperation
        kind = {"sum": ops.SUM, "prod": ops.PROD, "sub": ops.SUB}[op]
        return self.network.add_elementwise(a, b, kind).get_output(0)

    def unary(self, op, x):
        ops = self.trt.UnaryOperation
        kind = {"sqrt": ops.SQRT, "recip": ops.RECIP, "cos": ops.COS, "sin": ops.SIN}[op]
        return self.network.add_unary(x, kind).get_output(0)

    def sigmoid(self, x):
        return self.network.add_activation(x, self.trt.ActivationType.SIGMOID).get_output(0)

    def mean(self, x, axis):
        return self.network.add_reduce(x, self.trt.ReduceOperation.AVG, 1 << axis, True).get_output(0)

    def gather(self, data, indices, axis):
        return self.network.add_gather(data, indices, axis).get_output(0)

    def reshape(self, x, shape):
        layer = self.network.add_shuffle(x)
        layer.reshape_dims = tuple(shape)
        return layer.get_output(0)

    def cast(self, x, dtype):
        return self.network.add_cast(x, self._dtype(dtype)).get_output(0)

    def plugin(self, plugin_id, inputs, fields):
        namespace, name = plugin_id.split("::")
        op = getattr(getattr(self.trtp.op, namespace), name)
        # aot=True: TensorRT embeds the PTX our aot_impl returns; running needs no Python.
        return self.network.add_plugin(op(*inputs, **fields), aot=True).get_output(0)

    def output(self, name, x):
        x.name = name
        self.network.mark_output(x)


@dataclass(frozen=True, slots=True)
class Node:
    op: str
    args: tuple
    attrs: dict = field(default_factory=dict)


_TORCH_ELEMENTWISE = {"sum": torch.add, "prod": torch.mul, "sub": torch.sub}
_TORCH_UNARY = {"sqrt": torch.sqrt, "recip": torch.reciprocal, "cos": torch.cos, "sin": torch.sin}


class TorchGraph:
    """`Network` that records the ops (a value is the index of the node that makes it) and
    evaluates them with torch. It refuses what TensorRT would: inputs of another dtype or rank
    than declared, and matmul or elementwise inputs of different ranks or types."""

    def __init__(self) -> None:
        self.nodes: list[Node] = []
        self.inputs: dict[str, tuple[str, tuple[int, ...]]] = {}
        self.outputs: dict[str, int] = {}

    def _add(self, kind: str, *args, **attrs) -> int:
        self.nodes.append(Node(kind, args, attrs))
        return len(self.nodes) - 1

    def input(self, name, dtype, shape):
        self.inputs[name] = (dtype, tuple(shape))
        return self._add("input", name=name)

    def constant(self, value):
        return self._add("constant", value=value)

    def matmul(self, a, b, transpose_b=False):
        return self._add("matmul", a, b, transpose_b=transpose_b)

    def elementwise(self, op, a, b):
        if op not in ELEMENTWISE:
            raise ValueError(f"elementwise op {op!r} is not one of {ELEMENTWISE}")
        return self._add("elementwise", a, b, op=op)

    def unary(self, op, x):
        if op not in UNARY:
            raise ValueError(f"unary op {op!r} is not one of {UNARY}")
        return self._add("unary", x, op=op)

    def sigmoid(self, x):
        return self._add("sigmoid", x)

    def mean(self, x, axis):
        return self._add("mean", x, axis=axis)

    def gather(self, data, indices, axis):
        return self._add("gather", data, indices, axis=axis)

    def reshape(self, x, shape):
        return self._add("reshape", x, shape=tuple(shape))

    def cast(self, x, dtype):
        return self._add("cast", x, dtype=dtype)

    def plugin(self, plugin_id, inputs, fields):
        return self._add("plugin", *inputs, plugin_id=plugin_id, fields=dict(fields))

    def output(self, name, x):
        self.outputs[name] = x

    def count(self, op: str) -> int:
        return sum(node.op == op for node in self.nodes)

    @torch.inference_mode()
    def evaluate(self, feeds: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Every output for these inputs (by name), evaluated node by node."""
        missing = set(self.inputs) - set(feeds)
        if missing:
            raise ValueError(f"inputs not given: {', '.join(sorted(missing))}")
        values: list[Any] = []
        for node in self.nodes:
            args = [values[i] for i in node.args]
            values.append(self._run(node, args, feeds))
        return {name: values[i] for name, i in self.outputs.items()}

    def _run(self, node: Node, args: list, feeds: dict[str, torch.Tensor]):
        a = node.attrs
        if node.op == "input":
            x = feeds[a["name"]]
            dtype, shape = self.inputs[a["name"]]
            if str(x.dtype).removeprefix("torch.") != dtype or x.dim() != len(shape) or any(
                    d != -1 and d != n for d, n in zip(shape, x.shape)):
                raise ValueError(f"input {a['name']!r} must be {dtype} {shape}, got {x.dtype} {tuple(x.shape)}")
            return x
        if node.op == "constant":
            return a["value"]
        if node.op in ("matmul", "elementwise"):
            # TensorRT broadcasts only between inputs of the same rank, and a strongly typed
            # network has no implicit casts: both inputs must have one type.
            if args[0].dim() != args[1].dim():
                raise ValueError(f"{node.op} of ranks {args[0].dim()} and {args[1].dim()}")
            if args[0].dtype != args[1].dtype:
                raise ValueError(f"{node.op} of {args[0].dtype} and {args[1].dtype} (no implicit casts)")
        if node.op == "matmul":
            x, y = args
            return torch.matmul(x, y.transpose(-1, -2) if a["transpose_b"] else y)
        if node.op == "elementwise":
            return _TORCH_ELEMENTWISE[a["op"]](*args)
        if node.op == "unary":
            return _TORCH_UNARY[a["op"]](args[0])
        if node.op == "sigmoid":
            return torch.sigmoid(args[0])
        if node.op == "mean":
            return args[0].mean(dim=a["axis"], keepdim=True)
        if node.op == "gather":
            data, indices = args
            return torch.index_select(data, a["axis"], indices.long().flatten()).reshape(
                *data.shape[:a["axis"]], *indices.shape, *data.shape[a["axis"] + 1:])
        if node.op == "reshape":
            x = args[0]
            shape = [x.shape[i] if d == 0 else d for i, d in enumerate(a["shape"])]
            return x.reshape(shape)
        if node.op == "cast":
            return args[0].to(getattr(torch, a["dtype"]))
        if node.op == "plugin":
            return _run_plugin(a["plugin_id"], args, a["fields"])
        raise ValueError(f"unknown op {node.op!r}")


def _run_plugin(plugin_id: str, args: list, fields: dict):
    from trt_plugins.paged_attention import paged_attention_plugin
    from trt_plugins.plugin import PLUGIN_ID

    if plugin_id != PLUGIN_ID:
        raise ValueError(f"no torch evaluation for plugin {plugin_id!r}")
    return paged_attention_plugin(*args, **fields)
