"""The TensorRT plugin without TensorRT's builder: registration with the lean bindings, the PTX
its aot_impl hands TensorRT, its kernel entry (interpreted) against the reference, and every
TensorRT name the builder and the runtime wrapper use, checked against the bindings."""
from __future__ import annotations

import importlib
import importlib.util
import re
from pathlib import Path

import pytest
import torch

from trt_plugins.aot import PLUGIN_PTX_PARAMS, drop_unused_params
from trt_plugins.builder import EngineShapes, build_engine
from trt_plugins.paged_attention import paged_attention_plugin
from trt_plugins.plugin import (FIELDS, INPUTS, PLUGIN_ID, SCALARS, import_tensorrt, plugin_fields,
                                register_plugin)
from trt_plugins.reference import TOLERANCES, make_paged_batch, reference_paged_attention

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
    table = torch.tensor([[other.data_ptr(), other.data_ptr()],
                          [b.k_cache.data_ptr(), b.v_cache.data_ptr()]], dtype=torch.int64)
    out = paged_attention_plugin(b.q, b.k, b.v, table, b.cu_seqlens_q, b.seq_lens, b.block_tables,
                                 **plugin_fields(2, 2, 16, 16, 1, b.scale))
    tol = TOLERANCES[dtype]
    torch.testing.assert_close(out.double(), expected.out, atol=tol, rtol=tol)
    assert torch.equal(b.k_cache, expected.k_cache) and torch.equal(b.v_cache, expected.v_cache)
    assert not other.any()


def test_plugin_entry_names_a_bad_address_table():
    b = make_paged_batch(query_lens=[1], context_lens=[3])
    with pytest.raises(ValueError, match="kv_cache_ptrs: must be int64 \\[num_layers, 2\\] with a row for layer 2"):
        paged_attention_plugin(b.q, b.k, b.v, torch.zeros(2, 2, dtype=torch.int64), b.cu_seqlens_q,
                               b.seq_lens, b.block_tables, **plugin_fields(2, 2, 16, 16, 2, b.scale))


class _Recorder:
    """Stands in for a TensorRT module: every attribute read or set on it, or on anything it
    returns, is recorded by name."""

    def __init__(self, names: set):
        object.__setattr__(self, "_names", names)

    def __getattr__(self, name):
        self._names.add(name)
        return _Recorder(self._names)

    def __setattr__(self, name, value):
        self._names.add(name)

    def __call__(self, *args, **kwargs):
        return _Recorder(self._names)

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


def test_every_tensorrt_name_the_builder_and_runtime_use_exists(tiny_models, monkeypatch):
    from orca_backend.models import load_model
    from orca_backend.trt_runner import TensorRTEngine

    builder_names, plugin_names, runtime_names = set(), set(), set()
    model = load_model(tiny_models["qwen2"], torch.float32, torch.device("cpu"))
    shapes = EngineShapes.from_limits(2, 64, 4, 256, 16)
    assert build_engine(model, shapes, 16, trt=_Recorder(builder_names), trtp=_Recorder(plugin_names)) == b"plan"
    stream = type("Stream", (), {"cuda_stream": 0})()
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: stream)
    engine = TensorRTEngine(_Recorder(runtime_names), b"plan", shapes, torch.device("cpu"))
    engine.run({name: torch.ones(*lo, dtype=torch.int32) for name, (lo, _, _) in shapes.profile().items()},
               1, 512)
    assert {"add_plugin", "add_matrix_multiply", "build_serialized_network", "set_shape"} <= builder_names
    assert {"deserialize_cuda_engine", "execute_async_v3"} <= runtime_names

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
    import tensorrt.plugin as trtp

    register_plugin()
    assert plugin_names == {"op", "orca", "paged_attention"} and hasattr(trtp, "op")
    assert hasattr(trtp.op.orca, "paged_attention")
