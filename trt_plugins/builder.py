"""The TensorRT engine of a Llama-family model: its graph, optimisation profile and build.

The graph is one iteration of selective batching, as `orca_backend.runner.models.decoder` runs it:
every op on the flattened [num_tokens, hidden] rows, except attention, which is our plugin
(`orca::paged_attention`) reading and writing the paged K/V pool. It is written against the
narrow `Network` interface (`trt_plugins.network`), so the same code builds a TensorRT network
or a torch-evaluated graph; `tensorrt` is imported only by `build_engine`.

Engine inputs (T tokens of B requests, S sampled rows, L layers, W block-table columns):
  input_ids int32 [T], positions int32 [T]
  cu_seqlens_q int32 [B+1], seq_lens int32 [B], block_tables int32 [B, W]  (the kernel's metadata)
  kv_cache_ptrs int64 [1+L, 2]  the guard row, then each layer's K and V cache addresses
  logit_rows int32 [S]        rows whose logits are wanted (each sampling request's last row)
Output: logits float32 [S, vocab].
"""
from __future__ import annotations

import hashlib
import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from trt_plugins.network import Network, TensorRTNetwork
from trt_plugins.plugin import PLUGIN_ID, import_tensorrt, plugin_fields, register_plugin

ENGINE_INPUTS = ("input_ids", "positions", "cu_seqlens_q", "seq_lens", "block_tables",
                 "kv_cache_ptrs", "logit_rows")
ENGINE_OUTPUT = "logits"
# What the graph builds: Llama-shaped layers (pre-norm RMSNorm, q/k/v with or without biases,
# gated SiLU MLP) and a RoPE whose frequencies do not change with the length.
_STATIC_ROPE = ("default", "linear", "llama3", "yarn")
# Sources whose change changes what an engine computes: part of the cache key.
_SOURCES = ("kernel.py", "tiles.py", "aot.py", "plugin.py", "network.py", "builder.py")


class EngineBuildError(RuntimeError):
    """No engine could be built (no TensorRT builder here, or TensorRT refused the network)."""


def unsupported_by_tensorrt(config) -> str | None:
    """What of a model (`ModelConfig`) the TensorRT graph does not build, named; None if it
    builds all of it (engine 'torch' runs every supported model)."""
    if config.positions != "rope":
        return f"engine 'tensorrt' builds the RoPE decoders, not {config.architecture} (use engine 'torch')"
    ropes = [config.rope_of(i) for i in range(config.num_layers)]
    checks = [
        (any(config.window_of(i) for i in range(config.num_layers)), "sliding-window attention"),
        (config.attn_softcap, "attention logit soft-capping"),
        (config.final_softcap, "final logit soft-capping"),
        (config.qk_norm != "none", "query/key norms"),
        (config.norm != "rms" or config.norm_layout != "pre", f"{config.norm} norms ({config.norm_layout})"),
        (config.mlp_bias or config.activation != "silu" or not config.gated_mlp, "an MLP other than gated SiLU"),
        (config.moe is not None, "mixture-of-experts layers"),
        (config.kernel_gap, config.kernel_gap),
        (config.attention_sinks, "attention sinks"),
        (None in ropes or len(set(ropes)) > 1, "layers without RoPE or with RoPEs of their own"),
        (any(r is not None and (r.kind not in _STATIC_ROPE or r.rotary_dim != config.head_dim) for r in ropes),
         "a RoPE that changes with the sequence's length or rotates part of each head"),
        (config.embedding_multiplier != 1 or config.residual_multiplier != 1 or config.logits_divisor != 1,
         "embedding, residual or logit multipliers"),
    ]
    found = [what for failed, what in checks if failed]
    return f"engine 'tensorrt' does not build {'; '.join(found)} (use engine 'torch')" if found else None


@dataclass(frozen=True, slots=True)
class EngineShapes:
    """What one iteration can hold, from the engine options: the optimisation profile's bounds."""

    num_layers: int
    max_num_tokens: int  # max_num_batched_tokens
    max_batch_size: int
    max_blocks: int  # block-table columns: ceil(max_model_len / block_size)

    @classmethod
    def from_limits(cls, num_layers: int, max_num_batched_tokens: int, max_batch_size: int,
                    max_model_len: int, block_size: int) -> EngineShapes:
        # Every scheduled request has at least one row, so B never exceeds T.
        return cls(num_layers, max_num_batched_tokens, min(max_batch_size, max_num_batched_tokens),
                   -(-max_model_len // block_size))

    def profile(self) -> dict[str, tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]]:
        """(min, opt, max) shape of each dynamic input. The optimum is a full batch of decodes
        (T = B = max_batch_size), what a busy serving engine runs most."""
        t, b, w = self.max_num_tokens, self.max_batch_size, self.max_blocks
        return {
            "input_ids": ((1,), (b,), (t,)),
            "positions": ((1,), (b,), (t,)),
            "cu_seqlens_q": ((2,), (b + 1,), (b + 1,)),
            "seq_lens": ((1,), (b,), (b,)),
            "block_tables": ((1, 1), (b, w), (b, w)),
            "logit_rows": ((1,), (b,), (b,)),
        }

    def input_shapes(self) -> dict[str, tuple[str, tuple[int, ...]]]:
        """Each input's dtype and shape (-1 where the profile sizes it)."""
        shapes = {name: ("int32", tuple(-1 for _ in lo)) for name, (lo, _, _) in self.profile().items()}
        shapes["kv_cache_ptrs"] = ("int64", (1 + self.num_layers, 2))  # the guard row first
        return {name: shapes[name] for name in ENGINE_INPUTS}

    def check(self, feeds: dict[str, torch.Tensor]) -> None:
        """Raise ValueError naming an input whose shape the profile cannot take."""
        for name, (lo, _, hi) in self.profile().items():
            shape = tuple(feeds[name].shape)
            if len(shape) != len(lo) or any(not a <= n <= b for a, n, b in zip(lo, shape, hi)):
                raise ValueError(f"engine input {name!r} has shape {shape}, outside the engine's "
                                 f"profile [{lo}, {hi}]")


class _Graph:
    """Helpers over a `Network` for one model dtype; constants made once per tensor."""

    def __init__(self, net: Network, dtype: str, device: torch.device) -> None:
        self.net, self.dtype, self.device = net, dtype, device  # device: the weights'
        self._constants: dict[tuple[int, tuple], object] = {}

    def const(self, value: torch.Tensor):
        key = (value.data_ptr(), tuple(value.shape))
        if key not in self._constants:
            self._constants[key] = self.net.constant(value)
        return self._constants[key]

    def row(self, value: torch.Tensor):
        """A [n] vector as a [1, n] constant, so that it broadcasts over rows (same rank)."""
        return self.const(value.reshape(1, -1))

    def linear(self, x, weight: torch.Tensor, bias: torch.Tensor | None = None):
        y = self.net.matmul(x, self.const(weight), transpose_b=True)  # x @ W^T, as F.linear
        return y if bias is None else self.net.elementwise("sum", y, self.row(bias))

    def rms_norm(self, x, weight: torch.Tensor, eps: float):
        net = self.net
        x32 = x if self.dtype == "float32" else net.cast(x, "float32")
        mean_sq = net.mean(net.elementwise("prod", x32, x32), axis=1)  # [rows, 1]
        eps_c = self.const(torch.full((1, 1), eps, dtype=torch.float32, device=self.device))
        inv = net.unary("recip", net.unary("sqrt", net.elementwise("sum", mean_sq, eps_c)))
        y = net.elementwise("prod", x32, inv)
        y = y if self.dtype == "float32" else net.cast(y, self.dtype)
        return net.elementwise("prod", self.row(weight), y)

    def rope_factor(self, fn: str, angles, head_dim: int, attention_factor: float = 1.0):
        """cos or sin of the [T, D] angles (times YaRN's `attention_factor`) in the model's
        dtype, as [T, 1, D] (one per head)."""
        y = self.net.unary(fn, angles)
        if attention_factor != 1.0:
            y = self.net.elementwise("prod", y, self.const(
                torch.full((1, 1), attention_factor, dtype=torch.float32, device=self.device)))
        y = y if self.dtype == "float32" else self.net.cast(y, self.dtype)
        return self.net.reshape(y, (0, 1, head_dim))

    def rotate(self, x, num_heads: int, head_dim: int, rope):
        """Rotary embedding of [T, H*D] rows: x*cos + rotate_half(x)*sin, where rotate_half
        (x -> [-x2, x1]) is a matmul by a constant signed permutation (exact, and needs no
        slicing of a dynamic tensor)."""
        net = self.net
        cos, sin, turn = rope
        x3 = net.reshape(x, (0, num_heads, head_dim))
        turned = net.matmul(x3, turn)
        y = net.elementwise("sum", net.elementwise("prod", x3, cos), net.elementwise("prod", turned, sin))
        return net.reshape(y, (0, num_heads * head_dim))


def _half_turn(head_dim: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """R [1, D, D] with x @ R = cat(-x[D/2:], x[:D/2])."""
    half = head_dim // 2
    turn = torch.zeros(head_dim, head_dim, dtype=dtype, device=device)
    idx = torch.arange(half, device=device)
    turn[idx + half, idx] = -1
    turn[idx, idx + half] = 1
    return turn.reshape(1, head_dim, head_dim)


def define_llama(net: Network, model, shapes: EngineShapes, block_size: int) -> None:
    """Add one iteration of a loaded `DecoderModel` (a whole model) to `net`."""
    cfg = model.config
    refusal = unsupported_by_tensorrt(cfg)
    if refusal:
        raise EngineBuildError(f"{cfg.architecture}: {refusal}")
    if len(model.layer_range) != cfg.num_layers or shapes.num_layers != cfg.num_layers:
        raise EngineBuildError("engine 'tensorrt' builds whole models, not pipeline stages")
    torch_dtype, device = model.embed.dtype, model.embed.device
    g = _Graph(net, str(torch_dtype).removeprefix("torch."), device)
    inputs = {name: net.input(name, dtype, shape) for name, (dtype, shape) in shapes.input_shapes().items()}

    h = net.gather(g.const(model.embed), inputs["input_ids"], axis=0)  # [T, hidden]
    positions = net.reshape(net.cast(inputs["positions"], "float32"), (-1, 1))  # [T, 1]
    rotary = model.layer_rotary[0]  # every layer's (checked above)
    inv_freq = torch.cat((rotary.inv_freq, rotary.inv_freq)).float()  # [D], as cat(freqs, freqs)
    angles = net.elementwise("prod", positions, g.row(inv_freq))  # [T, D]
    head_dim = cfg.head_dim
    rope = (*(g.rope_factor(f, angles, head_dim, rotary.spec.attention_factor) for f in ("cos", "sin")),
            g.const(_half_turn(head_dim, torch_dtype, device)))
    metadata = [inputs[n] for n in ("kv_cache_ptrs", "cu_seqlens_q", "seq_lens", "block_tables")]
    q_size, kv_size = cfg.num_heads * head_dim, cfg.num_kv_heads * head_dim
    for i in model.layer_range:
        layer = model.layers[i]
        attn_norm, _, mlp_norm, _ = layer.norms
        x = g.rms_norm(h, attn_norm.weight, attn_norm.eps)
        qkv = layer.attn.qkv
        weights = qkv.weight.split([q_size, kv_size, kv_size])
        biases = qkv.bias.split([q_size, kv_size, kv_size]) if qkv.bias is not None else (None,) * 3
        q, k, v = (g.linear(x, w, b) for w, b in zip(weights, biases))
        q = g.rotate(q, cfg.num_heads, head_dim, rope)
        k = g.rotate(k, cfg.num_kv_heads, head_dim, rope)
        fields = plugin_fields(cfg.num_kv_heads, cfg.num_heads // cfg.num_kv_heads, head_dim,
                               block_size, i, layer.attn.scale)
        attn = net.plugin(PLUGIN_ID, [q, k, v, *metadata], fields)  # [T, Hq * D]
        h = net.elementwise("sum", h, g.linear(attn, layer.attn.o.weight, layer.attn.o_bias))
        x = g.rms_norm(h, mlp_norm.weight, mlp_norm.eps)
        gate_w, up_w = layer.mlp.gate_up.weight.chunk(2)
        gate, up = g.linear(x, gate_w), g.linear(x, up_w)
        act = net.elementwise("prod", net.elementwise("prod", gate, net.sigmoid(gate)), up)  # silu(gate) * up
        h = net.elementwise("sum", h, g.linear(act, layer.mlp.down.weight))
    last = net.gather(h, inputs["logit_rows"], axis=0)  # [S, hidden]: the LM head on sampled rows only
    logits = g.linear(g.rms_norm(last, model.norm.weight, cfg.norm_eps), model.lm_head.weight)
    net.output(ENGINE_OUTPUT, logits if g.dtype == "float32" else net.cast(logits, "float32"))


def build_engine(model, shapes: EngineShapes, block_size: int, trt=None, trtp=None) -> bytes:
    """A serialized TensorRT engine (plan) of the model, our plugin embedded as PTX.

    `trt`/`trtp` default to the installed `tensorrt` and `tensorrt.plugin` (tests pass
    recorders). Needs TensorRT's builder, i.e. the full package, not the lean runtime."""
    if trt is None:
        trt = import_tensorrt()
        if not hasattr(trt, "Builder"):
            raise EngineBuildError(
                f"engine 'tensorrt' needs TensorRT's builder; only the lean runtime bindings "
                f"{trt.__version__} are installed (install the 'tensorrt' package, as the GPU image does)")
        register_plugin()
        import tensorrt.plugin as trtp
    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    network = builder.create_network(1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED))
    # The adapter keeps the host copies its constants point into (TensorRT does not copy
    # weights before the build), so it lives until the build returns.
    net = TensorRTNetwork(trt, trtp, network)
    define_llama(net, model, shapes, block_size)
    config = builder.create_builder_config()
    profile = builder.create_optimization_profile()
    for name, (lo, opt, hi) in shapes.profile().items():
        profile.set_shape(name, lo, opt, hi)
    config.add_optimization_profile(profile)
    plan = builder.build_serialized_network(network, config)
    del net  # only now may the weights' host copies go
    if plan is None:
        raise EngineBuildError("TensorRT could not build the engine (its log says why)")
    return bytes(plan)


def engine_key(model_folder: Path, dtype: str, shapes: EngineShapes, block_size: int,
               tensorrt_version: str, arch: int) -> str:
    """What an engine depends on, hashed: the checkpoint (config, and each weight file's name,
    size and modification time), the options that shape it, TensorRT, Triton (which writes
    the plugin's PTX), the GPU and our sources."""
    import triton

    digest = hashlib.sha256()
    folder = Path(model_folder)
    digest.update((folder / "config.json").read_bytes())
    for f in sorted(folder.glob("*.safetensors")):
        stat = f.stat()
        digest.update(f"{f.name}:{stat.st_size}:{stat.st_mtime_ns}".encode())
    here = Path(__file__).parent
    for name in _SOURCES:
        digest.update((here / name).read_bytes())
    digest.update(json.dumps([dtype, list(shapes.profile().items()), shapes.num_layers, block_size,
                              tensorrt_version, triton.__version__, arch]).encode())
    return digest.hexdigest()[:24]


def cached_engine(cache_dir: Path, key: str, build) -> bytes:
    """The plan cached under `key`, else `build()`'s, written atomically for the next start."""
    path = Path(cache_dir) / f"{key}.engine"
    if path.is_file():
        return path.read_bytes()
    plan = build()
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
    with os.fdopen(fd, "wb") as f:
        f.write(plan)
    os.replace(tmp, path)
    return plan
