"""The TensorRT plugin without TensorRT's builder: registration with the lean bindings, the PTX
its aot_impl hands TensorRT, its kernel entry (interpreted) against the reference, and every
TensorRT name the builder and the runtime wrapper use, checked against the bindings."""
from __future__ import annotations

import gc
import importlib
import importlib.util
import re
import weakref
from pathlib import Path

import pytest
import torch

from trt_plugins.aot import PLUGIN_PTX_PARAMS, compile_plugin_ptx, drop_unused_params
from trt_plugins.builder import EngineShapes, build_engine
from trt_plugins.kernel import KV_TABLE_GUARD
from trt_plugins.network import TensorRTNetwork
from trt_plugins.paged_attention import kv_cache_table, paged_attention_plugin
from trt_plugins.plugin import (FIELDS, INPUTS, PLUGIN_ID, SCALARS, import_tensorrt, plugin_fields,
                                register_plugin)
from trt_plugins.reference import SENTINEL, TOLERANCES, make_paged_batch, reference_paged_attention

pytest.importorskip("tensorrt_lean_bindings")


@pytest.fixture(scope="module")
def qdp():
    """(tensorrt, tensorrt.plugin, our plugin's definition in its registry)."""
    register_plugin()
    trt = import_tensorrt()
    import tensorrt.plugin as trtp
    from tensorrt.plugin._lib import QDP_REGISTRY

    return trt, trtp, QDP_REGISTRY[PLUGIN_ID]


def _desc(trtp, shape, dtype):
    return trtp.TensorDesc(trtp.ShapeExprs.from_tuple(shape), dtype)


def test_registry_has_the_plugin_with_its_fields(qdp):
    trt, _, definition = qdp
    creator = register_plugin()  # a second call registers nothing new
    assert (creator.name, creator.plugin_namespace, creator.plugin_version) == ("paged_attention", "orca", "1")
    kinds = {int: trt.PluginFieldType.INT64, float: trt.PluginFieldType.FLOAT64}
    assert [(f.name, f.type) for f in creator.field_names] == [(n, kinds[t]) for n, t in FIELDS.items()]
    assert trt.get_plugin_registry().get_creator("paged_attention", "1", "orca") is not None
    assert tuple(definition.input_tensor_names) == INPUTS and definition.num_outputs == 1


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_output_is_like_q(qdp, dtype):
    trt, trtp, definition = qdp
    q = _desc(trtp, (37, 576), getattr(trt, dtype))
    kv = _desc(trtp, (37, 192), getattr(trt, dtype))
    index = [_desc(trtp, (5,), trt.int32), _desc(trtp, (4,), trt.int32), _desc(trtp, (4, 9), trt.int32)]
    (out,) = definition.register_func(q, kv, kv, _desc(trtp, (30, 2), trt.int64), *index,
                                      **plugin_fields(3, 3, 64, 16, 2, 0.125))
    assert out.dtype == getattr(trt, dtype)
    with pytest.raises(ValueError, match="kv_cache_ptrs must be int64"):
        definition.register_func(q, kv, kv, _desc(trtp, (30, 2), trt.int32), *index,
                                 **plugin_fields(3, 3, 64, 16, 2, 0.125))
    with pytest.raises(ValueError, match="k is .*, q is"):
        definition.register_func(q, _desc(trtp, (37, 192), trt.int8), kv, _desc(trtp, (30, 2), trt.int64),
                                 *index, **plugin_fields(3, 3, 64, 16, 2, 0.125))


def test_aot_impl_hands_tensorrt_ptx_whose_parameters_are_the_plugins(qdp):
    """Inputs (pointers), the scalars TensorRT computes (u32), the output (pointer): nothing
    else, in that order, which is how TensorRT launches an AOT plugin's kernel."""
    trt, trtp, definition = qdp
    q = _desc(trtp, (37, 576), trt.bfloat16)
    kv = _desc(trtp, (37, 192), trt.bfloat16)
    index = [_desc(trtp, (5,), trt.int32), _desc(trtp, (4,), trt.int32), _desc(trtp, (4, 9), trt.int32)]
    name, ptx, launch, scalars = definition.aot_impl_func(
        q, kv, kv, _desc(trtp, (30, 2), trt.int64), *index, **plugin_fields(3, 3, 64, 16, 2, 0.125),
        outputs=(q.like(),), tactic=0)
    header = re.search(rf"\.entry\s+{name}\s*\((.*?)\)", ptx, re.S).group(1)
    assert re.findall(r"\.param\s+\.(\w+)", header) == [t for _, t in PLUGIN_PTX_PARAMS]
    assert [n for n, _ in PLUGIN_PTX_PARAMS] == [*INPUTS, *SCALARS, "out"]
    assert len(scalars) == len(SCALARS) and isinstance(launch, trtp.KernelLaunchParams)
    assert ".target sm_90a" in ptx


class _Dim:
    """A concrete stand-in for TensorRT's IDimensionExpr (an int), for evaluating shape
    expressions without a builder. tensorrt.plugin checks isinstance(x, IDimensionExpr),
    which a pybind11 class cannot be subclassed to pass without its C++ object; `__class__`
    answers it instead."""

    def __init__(self, value: int):
        self.value = value

    @property
    def __class__(self):
        import tensorrt

        return tensorrt.IDimensionExpr

    def is_constant(self) -> bool:
        return True

    def get_constant_value(self) -> int:
        return self.value


class _DimBuilder:
    """Evaluates the dimension operations tensorrt.plugin's expressions use."""

    def __init__(self, trt):
        ops = trt.DimensionOperation
        self.ops = {ops.SUM: int.__add__, ops.SUB: int.__sub__, ops.PROD: int.__mul__,
                    ops.FLOOR_DIV: int.__floordiv__, ops.MAX: max, ops.MIN: min}

    def constant(self, value):
        return _Dim(value)

    def operation(self, op, a, b):
        return _Dim(self.ops[op](a.value, b.value))


def test_aot_launch_and_scalars_evaluate_to_the_kernels_arguments(qdp):
    """The launch and the scalars aot_impl returns, evaluated for concrete shapes (T = 37
    tokens, B = 4 requests, W = 9 block-table columns, layer 2): the grid the kernel's tile
    mapping needs, and num_seqs, the block-table width and the layer, in that order."""
    from tensorrt.plugin._tensor import SymIntExpr

    trt, trtp, definition = qdp
    SymIntExpr._exprBuilder = _DimBuilder(trt)  # what TensorRT sets while it builds
    try:
        q = _desc(trtp, (37, 576), trt.float16)
        kv = _desc(trtp, (37, 192), trt.float16)
        index = [_desc(trtp, (5,), trt.int32), _desc(trtp, (4,), trt.int32), _desc(trtp, (4, 9), trt.int32)]
        fields = plugin_fields(3, 3, 64, 16, 2, 0.125)
        _, _, launch, scalars = definition.aot_impl_func(q, kv, kv, _desc(trtp, (4, 2), trt.int64), *index,
                                                         **fields, outputs=(q.like(),), tactic=0)

        def value(expr):
            return expr if isinstance(expr, int) else expr._expr.get_constant_value()

        build = compile_plugin_ptx("float16", 3, 3, 64, 16, 0.125)
        assert [value(launch.grid_x), value(launch.grid_y)] == [37 // build.block_q + 4, 3]
        assert value(launch.block_x) == 32 * build.num_warps and value(launch.shared_mem) == build.shared_bytes
        assert [value(x) for x in scalars] == [4, 9, 2]
    finally:
        SymIntExpr._exprBuilder = None


def test_dropping_a_parameter_the_kernel_reads_is_refused():
    ptx = (".visible .entry k(\n\t.param .u64 k_param_0,\n\t.param .u64 k_param_1\n)\n{\n"
           "\tld.param.u64 %rd1, [k_param_1];\n}\n")
    with pytest.raises(RuntimeError, match="reads k_param_1"):
        drop_unused_params(ptx, "k", 1)
    kept = drop_unused_params(ptx.replace("[k_param_1]", "[k_param_0]"), "k", 1)
    assert re.findall(r"\.param\s+\.u64\s+(\w+)", kept.split("{")[0]) == ["k_param_0"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_plugin_entry_matches_the_reference_through_cache_addresses(dtype):
    """The entry the engine launches, interpreted: it finds this layer's caches in the address
    table, writes the new K/V there and nowhere else, and attends as the reference does."""
    b = make_paged_batch(query_lens=[1, 7, 1, 12, 40], context_lens=[9, 13, 0, 70, 5], dtype=dtype, seed=1)
    expected = reference_paged_attention(**b.inputs(), scale=b.scale)
    other = torch.zeros_like(b.k_cache)  # layer 0's caches: must stay untouched
    table = kv_cache_table([(other, other), (b.k_cache, b.v_cache)], "cpu")
    assert table.tolist()[0] == [KV_TABLE_GUARD, KV_TABLE_GUARD] and table.shape == (3, 2)
    out = paged_attention_plugin(b.q, b.k, b.v, table, b.cu_seqlens_q, b.seq_lens, b.block_tables,
                                 **plugin_fields(2, 2, 16, 16, 1, b.scale))
    tol = TOLERANCES[dtype]
    torch.testing.assert_close(out.double(), expected.out, atol=tol, rtol=tol)
    assert torch.equal(b.k_cache, expected.k_cache) and torch.equal(b.v_cache, expected.v_cache)
    assert not other.any()


def test_plugin_entry_names_a_bad_address_table():
    b = make_paged_batch(query_lens=[1], context_lens=[3])
    with pytest.raises(ValueError, match="kv_cache_ptrs: must be int64 \\[1 \\+ num_layers, 2\\] with a row for layer 2"):
        paged_attention_plugin(b.q, b.k, b.v, torch.zeros(3, 2, dtype=torch.int64), b.cu_seqlens_q,
                               b.seq_lens, b.block_tables, **plugin_fields(2, 2, 16, 16, 2, b.scale))


def test_without_the_guard_row_the_entry_touches_nothing():
    """TensorRT may time a plugin while it builds, on buffers it fills itself. A table
    whose row 0 is not the guard (zeros here; one off too) makes every program return
    before it follows an address: output and caches as they were."""
    b = make_paged_batch(query_lens=[1, 7], context_lens=[9, 0])
    caches = b.k_cache.clone(), b.v_cache.clone()
    for guard in (0, KV_TABLE_GUARD - 1):
        table = kv_cache_table([(b.k_cache, b.v_cache)], "cpu")
        table[0] = guard
        out = torch.full_like(b.q, SENTINEL)
        paged_attention_plugin(b.q, b.k, b.v, table, b.cu_seqlens_q, b.seq_lens, b.block_tables, out=out,
                               **plugin_fields(2, 2, 16, 16, 0, b.scale))
        assert torch.all(out == SENTINEL)
        assert torch.equal(b.k_cache, caches[0]) and torch.equal(b.v_cache, caches[1])


class _Recorder:
    """Stands in for a TensorRT module: every attribute read or set on it, or on anything it
    returns, is recorded by name. `answers` gives what calls of some names return."""

    def __init__(self, names: set, answers: dict | None = None):
        object.__setattr__(self, "_names", names)
        object.__setattr__(self, "_answers", answers or {})

    def __getattr__(self, name):
        self._names.add(name)
        if name in self._answers:
            return self._answers[name]
        return _Recorder(self._names, self._answers)

    def __setattr__(self, name, value):
        self._names.add(name)

    def __call__(self, *args, **kwargs):
        return _Recorder(self._names, self._answers)

    def __int__(self):
        return 0

    def __bytes__(self):
        return b"plan"


def _binding_strings() -> list[str]:
    """Printable strings of the full TensorRT bindings' library, which installs here but cannot
    load (its libnvinfer does not): pybind11 keeps every class, method and enum name there."""
    spec = importlib.util.find_spec("tensorrt_bindings")
    if spec is None:
        pytest.skip("tensorrt-cu13-bindings is not installed")
    library = Path(spec.submodule_search_locations[0]) / "tensorrt.so"
    return [s.decode() for s in re.findall(rb"[\x20-\x7e]{3,}", library.read_bytes())]


def test_every_tensorrt_name_the_builder_and_runtime_use_exists(qdp, tiny_models, monkeypatch):
    from orca_backend.runner.models import load_model
    from orca_backend.runner.tensorrt_runner import TensorRTEngine

    builder_names, plugin_names, runtime_names = set(), set(), set()
    model = load_model(tiny_models["qwen2"], torch.float32, torch.device("cpu"))
    shapes = EngineShapes.from_limits(2, 64, 4, 256, 16)
    # TensorRT reads constants' host memory when it builds, not when they are added: every
    # Weights pointer must still be held (by a live adapter) when the build starts.
    adapters, pointers, checked = weakref.WeakSet(), [], []
    original_init = TensorRTNetwork.__init__

    def init(self, *args):
        original_init(self, *args)
        adapters.add(self)

    def weights(dtype, ptr, count):
        pointers.append(ptr)
        return _Recorder(builder_names)

    def build(network, config):
        gc.collect()
        held = {t.data_ptr() for net in adapters for t in net.kept}
        checked.append(bool(pointers) and set(pointers) <= held)
        return b"plan"

    monkeypatch.setattr(TensorRTNetwork, "__init__", init)
    builder = _Recorder(builder_names, {"build_serialized_network": build})
    trt_answers = {"Weights": weights, "Builder": lambda logger: builder}
    trt = _Recorder(builder_names, trt_answers)
    assert build_engine(model, shapes, 16, trt=trt, trtp=_Recorder(plugin_names)) == b"plan"
    assert checked == [True], "constants' host memory was freed before the build"

    stream = type("Stream", (), {"cuda_stream": 0})()
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: stream)
    context = _Recorder(runtime_names, {"get_tensor_shape": lambda name: (1, 512)})
    trt_engine = _Recorder(runtime_names, {"create_execution_context": lambda: context})
    runtime = _Recorder(runtime_names, {"deserialize_cuda_engine": lambda plan: trt_engine})
    engine = TensorRTEngine(_Recorder(runtime_names, {"Runtime": lambda logger: runtime}), b"plan", shapes,
                            torch.device("cpu"))
    feeds = {name: torch.ones(*lo, dtype=torch.int32) for name, (lo, _, _) in shapes.profile().items()}
    assert engine.run(feeds, 1, 512).shape == (1, 512)
    # Answered names are recorded too.
    assert {"add_plugin", "add_matrix_multiply", "build_serialized_network", "set_shape", "Weights"} <= builder_names
    assert {"deserialize_cuda_engine", "execute_async_v3", "get_tensor_shape"} <= runtime_names

    # The builder's names: in the full bindings' library (pybind11 may store a short name as
    # the tail of a longer string, e.g. SIGMOID in HARD_SIGMOID).
    strings = _binding_strings()
    missing = sorted(n for n in builder_names if not any(s.endswith(n) for s in strings))
    assert not missing, f"not in TensorRT's bindings: {missing}"

    # The runtime's names: attributes of the lean bindings' own classes, which load here.
    lean = importlib.import_module("tensorrt_lean_bindings")
    scopes = [lean, lean.Logger, lean.Runtime, lean.ICudaEngine, lean.IExecutionContext]
    missing = sorted(n for n in runtime_names if not any(hasattr(c, n) for c in scopes))
    assert not missing, f"not in the lean bindings: {missing}"

    # tensorrt.plugin: `op`, then our namespace and name.
    _, trtp, _ = qdp
    assert plugin_names == {"op", "orca", "paged_attention"} and hasattr(trtp, "op")
    assert hasattr(trtp.op.orca, "paged_attention")


def test_the_builders_plugin_call_passes_tensorrts_schema_check(qdp):
    """`TensorRTNetwork.plugin` as the builder calls it, with the real `tensorrt.plugin`: the
    op accepts the inputs and the fields in their registered order and types (it checks
    both), and what it returns goes to add_plugin with aot=True."""
    trt, trtp, _ = qdp
    calls = []

    class Network:
        def add_plugin(self, created, aot):
            calls.append((created, aot))
            return _Recorder(set())

    tensors = [trt.ITensor() for _ in INPUTS]  # what the lean stand-in has of ITensor
    TensorRTNetwork(trt, trtp, Network()).plugin(PLUGIN_ID, tensors, plugin_fields(8, 4, 128, 16, 31, 128 ** -0.5))
    ((created, aot),) = calls
    assert aot is True and callable(created)
    with pytest.raises(ValueError, match="Unexpected schema"):
        trtp.op.orca.paged_attention(*tensors, scale=0.1, layer=1, num_kv_heads=8, num_queries_per_kv=4,
                                     head_dim=128, block_size=16)
    with pytest.raises(ValueError, match="Unexpected type"):
        trtp.op.orca.paged_attention(*tensors, **{**plugin_fields(8, 4, 128, 16, 31, 0.1), "scale": 1})
