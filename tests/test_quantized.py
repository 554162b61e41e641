"""Quantized checkpoints served as stored: GGUF blocks read against the `gguf` package's own
dequantization, the CPU kernels against the dequantized weights, whole models against
transformers loading the same file, resident bytes against the file's, refusals by name."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from orca_backend import LLM, ConfigError, SamplingParams
from orca_backend.runner.models.gguf_tensors import read_tensor
from orca_backend.checkpoint.store import default_gguf
from orca_backend.runner.models import quantized
from orca_backend.runner.models.quantized import (Int4Groups, Int8Groups, Int8Kernel, cat_rows, int8_per_channel,
                                                  cpu_supports_bfloat16, kernel_for)
from tests.gguf_files import quantized_bytes, write_gguf
from tests.models import first_difference

# Our kernels take bfloat16 activations and bfloat16 scales (docs/quantization.md): a first
# differing greedy token counts as a near-tie when transformers' top two logits are this close,
# and prompt logprobs agree within LOGPROB_TOL.
NEAR_TIE = 0.5
LOGPROB_TOL = 0.15


class _Tensor:  # what gguf.GGUFReader hands out: a name, a type, the raw data, dims fastest first
    def __init__(self, kind: str, data: np.ndarray, shape: tuple[int, int]) -> None:
        import gguf

        self.name, self.tensor_type, self.data, self.shape = "t", gguf.GGMLQuantizationType[kind], data, list(reversed(shape))


def _gguf_dequantized(t: _Tensor) -> np.ndarray:
    import gguf

    return gguf.quants.dequantize(t.data, t.tensor_type).reshape(tuple(reversed(t.shape)))


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q4_K", "Q8_0"])
def test_gguf_blocks_keep_their_integers_and_scales(kind):
    rng = np.random.default_rng(0)
    t = _Tensor(kind, quantized_bytes(rng.standard_normal((64, 512)).astype(np.float32), kind, rng), (64, 512))
    ours = read_tensor(t, "test").dequantize().numpy()
    np.testing.assert_allclose(ours, _gguf_dequantized(t), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("kind", ["Q5_0", "Q5_1", "Q5_K", "Q6_K"])
def test_other_gguf_blocks_are_requantized_to_int8_within_half_a_step(kind):
    rng = np.random.default_rng(0)
    t = _Tensor(kind, quantized_bytes(rng.standard_normal((64, 512)).astype(np.float32), kind, rng), (64, 512))
    ours, ref = read_tensor(t, "test"), _gguf_dequantized(t)
    assert ours.kind == "int8" and ours.group == 512
    step = np.abs(ref).max(axis=1, keepdims=True) / 127
    assert (np.abs(ours.dequantize().numpy() - ref) <= step / 2 + 1e-6).all()


def test_unread_gguf_types_are_refused_by_name():
    t = _Tensor("Q2_K", np.zeros((64, 2 * 84), dtype=np.uint8), (64, 512))
    with pytest.raises(ConfigError, match="tensor t is Q2_K, a GGUF type this engine does not read"):
        read_tensor(t, "test")


def _int4(n=128, k=256, group=32) -> Int4Groups:
    g = torch.Generator().manual_seed(0)
    return Int4Groups(torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8),
                      torch.rand(n, k // group, generator=g) / 50, group,
                      zero=torch.randn(n, k // group, generator=g) / 50)


@pytest.mark.parametrize("rows", [1, 5, 300])  # 300: past the dense crossover, dequantized for the call
def test_kernels_multiply_by_the_dequantized_weight(rows):
    bias = torch.randn(128)
    for weight in (_int4(), int8_per_channel(torch.randn(128, 256))):
        kernel = kernel_for(weight, bias, torch.float32)
        x = torch.randn(rows, 256)
        ref = F.linear(x, kernel.dequantize(torch.float32), bias)  # its weights: scales in bfloat16
        error = float((kernel(x) - ref).norm() / ref.norm())
        assert error < 5e-3, f"{weight.kind}, {rows} rows: relative error {error:.2e}"
        exact = F.linear(x, weight.dequantize(), bias)  # the scales as stored
        assert float((kernel(x) - exact).norm() / exact.norm()) < 1e-2


def test_a_long_call_dequantizes_a_slice_of_its_weight_at_a_time(monkeypatch):
    """Past the crossover, a call holds one slice of the weight in full precision (128 output
    channels here), never the whole weight, and gives the whole weight's product."""
    monkeypatch.setattr(quantized, "DENSE_SLICE_BYTES", 128 * 256 * 4)
    bias = torch.randn(448)
    # 448: the last slice is short, in whole int4 blocks of 32 (AVX2) or 64 (AVX-512) channels
    for weight in (_int4(n=448), int8_per_channel(torch.randn(448, 256))):
        kernel = kernel_for(weight, bias, torch.float32)
        x = torch.randn(300, 256)
        whole = F.linear(x, kernel.dequantize(torch.float32), bias)
        held, dequantize = [], kernel.dequantize

        def recorded(*args):
            w = dequantize(*args)
            held.append(w.shape[0])
            return w
        monkeypatch.setattr(kernel, "dequantize", recorded)
        assert torch.equal(kernel(x), whole), weight.kind
        assert held == [128, 128, 128, 64], (weight.kind, held)


def test_a_packed_table_gives_back_its_rows():
    weight = _int4(n=192)
    kernel = kernel_for(weight, None, torch.float32)
    ids = torch.tensor([0, 63, 64, 191, 5])
    torch.testing.assert_close(kernel[ids], kernel.dequantize(torch.float32)[ids])
    int8 = int8_per_channel(torch.randn(64, 96))
    torch.testing.assert_close(Int8Kernel(int8, None, torch.float32)[ids[:2]],
                               Int8Kernel(int8, None, torch.float32).dequantize(torch.float32)[ids[:2]])


def test_an_int4_table_whose_rows_cannot_be_read_back_is_refused_at_load():
    kernel = kernel_for(_int4(n=48), None, torch.float32)  # not whole blocks of 64 rows
    with pytest.raises(ConfigError, match="an int4 embedding table of 48 rows"):
        kernel.as_table()
    assert kernel_for(_int4(n=64), None, torch.float32).as_table() is not None


def test_a_rank_takes_whole_groups_only():
    weight = _int4()
    assert weight[(slice(None), slice(64, 128))].shape == (128, 64)
    with pytest.raises(ConfigError, match=r"columns \[16, 80\) of a int4 weight with groups of 32"):
        weight[(slice(None), slice(16, 80))]


def test_projections_of_different_formats_join_as_int8_per_channel():
    """A GGUF Q4_K_M keeps some layers' v in Q6_K: q|k|v joins as int8, each part within half
    an int8 step of its own weight."""
    parts = [_int4(), int8_per_channel(torch.randn(64, 256))]
    joined = cat_rows(parts)
    assert isinstance(joined, Int8Groups) and joined.shape == (192, 256) and joined.group == 256
    ref = torch.cat([p.dequantize() for p in parts])
    step = ref.abs().amax(1, keepdim=True) / 127
    assert ((joined.dequantize() - ref).abs() <= step / 2 + 1e-6).all()


def test_a_weight_with_one_scale_a_row_splits_at_any_column():
    weight = int8_per_channel(torch.randn(64, 96))
    part = weight[(slice(None), slice(0, 48))]
    assert part.group == 48 and torch.equal(part.dequantize(), weight.dequantize()[:, :48])


def test_a_gguf_path_resolves_in_a_fresh_process():
    """What a Triton stub does first, resolving its model path, meets no import cycle."""
    import subprocess
    import sys

    subprocess.run([sys.executable, "-c", "from orca_backend.checkpoint.store import default_gguf, model_folder; "
                    "import orca_backend.checkpoint.gguf; model_folder(str(default_gguf()))"], check=True)


def _check_against_transformers(llm: LLM, path, prompts: list[list[int]], max_tokens: int = 12):
    """Greedy tokens and prompt logprobs of `llm` on the file against transformers' on the same
    file (its loader dequantizes with the `gguf` package)."""
    import transformers as tf

    model = tf.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    outs = llm.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, prompt_logprobs=0))
    for ids, out in zip(prompts, outs):
        with torch.no_grad():
            ref = model.generate(torch.tensor([ids]), max_new_tokens=max_tokens, do_sample=False, output_logits=True,
                                 return_dict_in_generate=True, pad_token_id=0)
            rows = model(torch.tensor([ids])).logits[0].log_softmax(-1)
        j = first_difference(out.token_ids, ref.sequences[0, len(ids):].tolist())
        if j is not None:
            logits = ref.logits[j][0]
            gap = float(logits.max() - logits[out.token_ids[j]])
            assert gap < NEAR_TIE, f"{path.name}: diverges at token {j} where transformers' logits differ by {gap:.3f}"
        errors = [abs(next(iter(out.prompt_logprobs[i].values()))[0] - rows[i - 1, ids[i]].item())
                  for i in range(1, len(ids))]
        assert max(errors) < LOGPROB_TOL, f"{path.name}: prompt logprobs differ by up to {max(errors):.3f}"


PROMPTS = [[1, 500, 600, 700, 42, 9000, 123, 4567], [1, 20, 30000, 17, 8, 3999]]


@pytest.mark.numerics
@pytest.mark.parametrize("arch, kind, embed, tied, kinds", [
    ("qwen3", "Q4_K", "Q4_0", True, {}),
    ("llama", "Q4_K", "Q8_0", False, {"attn_v": "Q6_K", "ffn_down": "Q6_K"})])
def test_tiny_gguf_files_agree_with_transformers(tmp_path, arch, kind, embed, tied, kinds):
    """Qwen3 (q/k norms; Llama, with llama.cpp's interleaved q/k rows, is also the default
    model's file below), Q4_K projections, a tied Q4_0 table packed once, for the LM head and
    the lookups. Llama mixed as llama.cpp's Q4_K_M mixes: v and down in Q6_K, so q|k|v join
    int4 groups and a requantized int8 part into one int8 projection."""
    path = write_gguf(tmp_path / f"{arch}-{kind}.gguf", arch, kind, embed, tied=tied, kinds=kinds)
    with LLM(str(path)) as llm:
        model = llm.engine.executor.runner.model
        assert (model.embed is model.lm_head.weight) == tied
        backends = [lin.backend for lin in model.linears()][:4]  # layer 0: q|k|v, o, gate|up, down
        assert backends == (["int8", "int4", "int4", "int8"] if kinds else ["int4"] * 4), backends
        _check_against_transformers(llm, path, PROMPTS)


def _resident_weight_bytes(model) -> int:
    """The bytes the model's weights hold: packed projections, the table, norms."""
    held = {id(lin.weight): lin.weight.nbytes for lin in model.linears()}
    held[id(model.embed)] = model.embed.nbytes
    norms = [layer.norms for layer in model.layers.values()]
    return sum(held.values()) + model.norm.weight.nbytes + sum(n.weight.nbytes for ns in norms for n in ns if n)


@pytest.mark.numerics
def test_the_default_model_is_served_from_its_q4_1_file(default_model):
    """The default model's own GGUF (Q4_1 projections, a Q8_0 table): its weights held at the
    file's size, its greedy tokens transformers' on the same weights dequantized by `gguf`
    (the default model's folder), a first difference only at a near-tie."""
    import gguf
    import transformers as tf
    from tokenizers import Tokenizer

    path = default_gguf()
    stored = sum(int(t.n_bytes) for t in gguf.GGUFReader(str(path)).tensors)
    tokenizer = Tokenizer.from_file(str(default_model / "tokenizer.json"))
    prompts = [tokenizer.encode(t).ids for t in ("The capital of France is", "def fibonacci(n):",
                                                 "Once upon a time", "Water boils at")]
    with LLM(str(path)) as llm:
        held = _resident_weight_bytes(llm.engine.executor.runner.model)
        outs = llm.generate(prompts, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))
    # The int4 kernel's scales and minimums in its compute dtype: bfloat16 where the CPU has a
    # bfloat16 GEMM (the file's size), float32 elsewhere (1/8 byte a weight more: 12% here).
    bound = 0.1 if cpu_supports_bfloat16() else 0.15
    assert abs(held - stored) < bound * stored, f"weights hold {held} bytes; the file's tensors are {stored}"
    model = tf.AutoModelForCausalLM.from_pretrained(default_model, dtype=torch.float32).eval()
    check_greedy(model, prompts, outs, 16, "the Q4_1 file")


def check_greedy(model, prompts: list[list[int]], outs, max_tokens: int, what: str) -> None:
    """Greedy tokens of `outs` against transformers' `model` on `prompts`: equal, or equal up to
    a first difference where transformers' top two logits are within NEAR_TIE."""
    for ids, out in zip(prompts, outs):
        with torch.no_grad():
            ref = model.generate(torch.tensor([ids]), max_new_tokens=max_tokens, do_sample=False, output_logits=True,
                                 return_dict_in_generate=True, pad_token_id=0)
        j = first_difference(out.token_ids, ref.sequences[0, len(ids):].tolist())
        if j is not None:
            logits = ref.logits[j][0]
            assert float(logits.max() - logits[out.token_ids[j]]) < NEAR_TIE, f"{what}: diverges at token {j}"
