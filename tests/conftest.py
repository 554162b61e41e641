"""Shared fixtures: the default model and tiny random checkpoints made with transformers."""
from __future__ import annotations

import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest

from budgets import record_test_time
from orca_backend.checkpoint.store import prepare_default_model

TEST_LOAD_TIMEOUT_SECONDS = 240  # under `serving`'s 600 s wait
TINY_VOCAB = 512  # token ids below this decode with the default model's tokenizer
SERVER_FIXTURES = {"server", "hostile", "feature_server"}  # a test that takes one is in the slow group `server`
# A test that takes one of these (a checkpoint to run) is in the slow group `engine`, unless in `server`.
ENGINE_FIXTURES = {"default_model", "tiny_models", "tiny_vocab_llama", "lora_adapters"}


@pytest.fixture(scope="module", autouse=True)
def _give_memory_back():
    """After each module, the heap its engines freed goes back to the system: one process runs
    every module, beside the servers, on a machine of 24 GB."""
    yield
    import ctypes
    import gc

    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:  # not glibc
        pass


def pytest_addoption(parser) -> None:
    parser.addoption("--stalled-steps", action="store_true",
                     help="every engine step in this process waits until all its iterations in flight have "
                          "returned (or a second has passed: a test may hold one out), as a step after a stall "
                          "does: a test that decides by how many a step collects fails under it (make test-stalled)")


STALL_SECONDS = 1.0  # --stalled-steps: the longest a step waits for all its iterations


def pytest_configure(config) -> None:
    if config.getoption("--stalled-steps"):
        _stall_every_step()


def _stall_every_step() -> None:
    from concurrent.futures import ALL_COMPLETED, wait

    from orca_backend.engine.llm_engine import LLMEngine

    returned = LLMEngine._returned

    def stalled(self):
        wait([future for _, future in self._in_flight.values()], STALL_SECONDS, ALL_COMPLETED)
        return returned(self)

    LLMEngine._returned = stalled


def pytest_runtest_logreport(report) -> None:
    record_test_time(report.nodeid, report.duration)  # for make test's slowest tests (tests/budgets.py)


def pytest_collection_modifyitems(items) -> None:
    for item in items:
        if SERVER_FIXTURES & set(item.fixturenames):
            item.add_marker(pytest.mark.server)
        elif ENGINE_FIXTURES & set(item.fixturenames):
            item.add_marker(pytest.mark.engine)
    # The tests of one session server run together: it is stopped after its last one (below),
    # so that the two are never up at once but for the tests that take both.
    items.sort(key=lambda item: _SERVER_ORDER[tuple(name in item.fixturenames for name in SESSION_SERVERS)])


SESSION_SERVERS = ("server", "feature_server")
_SERVER_ORDER = {(True, False): 0, (True, True): 1, (False, True): 2, (False, False): 3}
_last_users: dict[str, list[str]] = {}  # a test's nodeid -> the session servers it is the last to take
_running: dict[str, object] = {}  # a session server's fixture name -> its Server, while it runs


def pytest_collection_finish(session) -> None:
    last = {name: item.nodeid for item in session.items for name in SESSION_SERVERS if name in item.fixturenames}
    for name, nodeid in last.items():
        _last_users.setdefault(nodeid, []).append(name)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item, nextitem):
    """After the last test that takes a session server (and its module's fixtures, which may
    talk to it), the server stops: its stubs give their memory back for the rest of the run."""
    yield
    for name in _last_users.get(item.nodeid, []):
        if name in _running:
            _running.pop(name).stop()


def _session_server(name: str, server):
    """`server` once ready, for the fixture `name`; stopped after its last test, or at the end."""
    from helpers import serving

    with serving(server):
        _running[name] = server
        try:
            yield server
        finally:
            _running.pop(name, None)


@pytest.fixture(scope="session")
def default_model() -> Path:
    return prepare_default_model()


def _save_tiny(kind: str, folder: Path, tokenizer_json: Path) -> Path:
    import torch
    import transformers as tf

    common = dict(vocab_size=TINY_VOCAB, initializer_range=0.2)
    if kind == "gpt2":
        config = tf.GPT2Config(n_positions=256, n_embd=64, n_layer=2, n_head=4,
                               bos_token_id=0, eos_token_id=2, **common)
        cls = tf.GPT2LMHeadModel
    else:
        arch = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, max_position_embeddings=256, rope_theta=10000.0,
                    tie_word_embeddings=kind == "qwen2", **common)
        config = (tf.Qwen2Config if kind == "qwen2" else tf.LlamaConfig)(**arch)
        cls = tf.Qwen2ForCausalLM if kind == "qwen2" else tf.LlamaForCausalLM
    torch.manual_seed(0)
    model = cls(config).float()
    with torch.no_grad():  # perturb biases and norm weights too, so a dropped one would show
        for param in model.parameters():
            if param.dim() == 1:
                param.add_(torch.randn_like(param) * 0.2)
    model.save_pretrained(folder)
    shutil.copy(tokenizer_json, folder / "tokenizer.json")
    return folder


@pytest.fixture(scope="session")
def server(tmp_path_factory, default_model):
    """A real tritonserver on free ports with model_repository/ (every model)."""
    from benchmarks.servers import Server

    yield from _session_server("server", Server(tmp_path_factory.mktemp("triton")))


@pytest.fixture(scope="module")
def frontend(server, tmp_path_factory):
    """The OpenAI-compatible API in front of `server`, serving `orca`."""
    from benchmarks.servers import Frontend

    f = Frontend(tmp_path_factory.mktemp("openai"), server.grpc_url, args=["--model", "orca"])
    try:
        f.wait_ready()
        yield f
    finally:
        f.stop()


@pytest.fixture(scope="module")
def api(frontend):
    """The `openai` package's client of `frontend`."""
    import openai

    return openai.OpenAI(base_url=frontend.url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory, default_model) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny")
    return {kind: _save_tiny(kind, root / kind, default_model / "tokenizer.json")
            for kind in ("llama", "qwen2", "gpt2")}


@pytest.fixture(scope="session")
def tiny_vocab_llama(tmp_path_factory, default_model):
    """A tiny random Llama with the default model's vocabulary (49152, which 2 ranks split),
    so that any text prompt is in range; its greedy text is nonsense, but reproducible."""
    return save_tiny_vocab_llama(tmp_path_factory.mktemp("tiny_vocab_llama"), default_model, 0.2)


def save_tiny_vocab_llama(folder: Path, default_model: Path, initializer_range: float) -> Path:
    """A tiny random Llama (seed 0) with the default model's vocabulary and tokenizer, saved in
    `folder`; the smaller `initializer_range`, the likelier its greedy text loops."""
    import torch
    import transformers as tf

    config = tf.LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                            initializer_range=initializer_range, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    tf.LlamaForCausalLM(config).save_pretrained(folder)
    shutil.copy(default_model / "tokenizer.json", folder / "tokenizer.json")
    return folder


@pytest.fixture(scope="module")
def engine(default_model):
    """The default model with a small K/V pool, one per test module."""
    from orca_backend import EngineConfig, LLMEngine

    return LLMEngine(EngineConfig(model=str(default_model), kv_cache_tokens=2048))


@pytest.fixture
def loop(engine):
    """A running serving loop over `engine`; it must leave no K/V block behind."""
    from orca_backend.serving.loop import EngineLoop

    loop = EngineLoop(engine)
    loop.start()
    yield loop
    loop.shutdown()
    assert engine.kv.num_used_blocks == 0


LORA_PROMPTS = ("The capital of France is", "def fibonacci(n):")
LORA_MAX_TOKENS = 10


ALL_PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_lora_adapters(model_folder: Path, root: Path, specs: dict[str, dict]) -> SimpleNamespace:
    """PEFT adapters for the model in `model_folder`, one per `specs` entry (LoraConfig's
    arguments; A and B random, B not zero), saved under `root`. `.paths[name]`, and
    `.greedy[(name, prompt)]`: LORA_MAX_TOKENS greedy tokens of each LORA_PROMPTS prompt
    with PEFT's merged model under transformers (name None: the base model)."""
    import torch
    import transformers as tf
    from peft import LoraConfig, get_peft_model

    tokenizer = tf.PreTrainedTokenizerFast(tokenizer_file=str(model_folder / "tokenizer.json"))
    paths, greedy = {}, {}
    for seed, name in enumerate([None, *specs]):
        model = tf.AutoModelForCausalLM.from_pretrained(model_folder, dtype=torch.float32)
        if name is not None:
            torch.manual_seed(seed)
            peft_model = get_peft_model(model, LoraConfig(init_lora_weights=False, **specs[name]))
            paths[name] = root / name
            peft_model.save_pretrained(paths[name])
            model = peft_model.merge_and_unload()
        for prompt in LORA_PROMPTS:
            greedy[(name, prompt)] = _argmax_tokens(model, tokenizer(prompt).input_ids, LORA_MAX_TOKENS)
    return SimpleNamespace(paths=paths, greedy=greedy)


def _argmax_tokens(model, prompt_ids: list[int], num_tokens: int) -> list[int]:
    """num_tokens tokens of plain argmax with transformers' K/V cache; EOS does not stop it (as
    with ignore_eos)."""
    import torch

    ids, cache, tokens = torch.tensor([prompt_ids]), None, []
    with torch.no_grad():
        while len(tokens) < num_tokens:
            out = model(ids, cache=cache, use_cache=True, logits_to_keep=1)
            cache = out.cache
            tokens.append(int(out.logits[0, -1].argmax()))
            ids = torch.tensor([tokens[-1:]])
    return tokens


@pytest.fixture(scope="session")
def lora_adapters(tmp_path_factory, default_model):
    """Three adapters for the default model: "a" rank 8 on q and v, "b" rank 16 on every
    projection, "c" rank 8 on o, gate and down with rsLoRA (see make_lora_adapters)."""
    return make_lora_adapters(default_model, tmp_path_factory.mktemp("lora"), {
        "a": dict(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]),
        "b": dict(r=16, lora_alpha=16, target_modules=ALL_PROJECTIONS),
        "c": dict(r=8, lora_alpha=8, use_rslora=True, target_modules=["o_proj", "gate_proj", "down_proj"])})


def write_model(repo: Path, name: str, parameters: dict, files: dict[str, str] | None = None) -> Path:
    """A copy of model_repository/orca named `name` with these parameters and files in its
    version folder; returns the version folder."""
    from orca_backend.serving.stages.repository import TEMPLATE, set_parameters

    # A stage of a load that hangs is named, with its stacks, before `serving` gives up waiting.
    parameters = {"load_timeout_seconds": str(TEST_LOAD_TIMEOUT_SECONDS), **parameters}
    config = set_parameters(TEMPLATE.read_text(), parameters).replace('name: "orca"', f'name: "{name}"', 1)
    version = repo / name / "1"
    version.mkdir(parents=True)
    (repo / name / "config.pbtxt").write_text(config)
    (version / "model.py").write_text("from orca_backend.serving.triton_model import TritonPythonModel  # noqa\n")
    for file, text in (files or {}).items():
        (version / file).write_text(text)
    return version


@pytest.fixture(scope="session")
def served_family(tmp_path_factory, default_model) -> Path:
    """A tiny random Qwen3 (q/k norms) whose every layer slides over 16 tokens, with the
    default model's vocabulary, tokenizer and ChatML template: the family the servers' tests
    serve."""
    from tools.model_zoo import save_family

    folder = save_family("qwen3", tmp_path_factory.mktemp("served_family"), default_model / "tokenizer.json",
                         vocab_size=49152, use_sliding_window=True, sliding_window=16, max_window_layers=0,
                         max_position_embeddings=512)
    for name in ("tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(default_model / name, folder / name)
    return folder


@pytest.fixture(scope="session")
def served_moe(tmp_path_factory, default_model) -> Path:
    """A tiny random Qwen3-MoE (top-2 of 5 experts in its sparse layer, dense layers beside it)
    with the default model's vocabulary, tokenizer and ChatML template: the mixture of experts
    the servers' tests serve."""
    from tools.model_zoo import save_family

    folder = save_family("qwen3-moe", tmp_path_factory.mktemp("served_moe"), default_model / "tokenizer.json",
                         vocab_size=49152, num_experts_per_tok=2, max_position_embeddings=512)
    for name in ("tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(default_model / name, folder / name)
    return folder


@pytest.fixture(scope="session")
def served_compressed(tmp_path_factory, default_model) -> Path:
    """A tiny random Qwen3 in compressed-tensors' pack-quantized int4 (groups of 128, zero
    points), packed from known integers (tests/test_quant_formats.py), with the default
    model's vocabulary and tokenizer: the compressed-tensors checkpoint the server serves."""
    from tests.test_quant_formats import _checkpoints
    from tools.model_zoo import save_family

    root = tmp_path_factory.mktemp("served_compressed")
    dense = save_family("qwen3", root / "dense", default_model / "tokenizer.json", vocab_size=49152,
                        hidden_size=256, intermediate_size=512, initializer_range=0.05, max_position_embeddings=512)
    return _checkpoints(dense, root, "ct-int4")[0]


@pytest.fixture(scope="session")
def feature_server(tmp_path_factory, default_model, lora_adapters, served_family, served_moe, served_compressed):
    """One tritonserver for the features that need models of their own configuration:
    `lora`: LoRA options in config.pbtxt, adapters a and b from multi_lora.json, run-time
    loading on; `lora_json`: LoRA on through model.json (as Triton's vLLM backend reads it, a
    vLLM option it does not have included), adapter c from a folder relative to the version;
    `spec`: speculative decoding (n-gram, 4 tokens) from config.pbtxt; `draft`: the default
    model drafting for itself; `prio`: no model (engine null, 20 ms a step), one request at a
    time, for priorities; `embed`: mean pooling for embeddings, prompts in chunks of 8 tokens;
    `family`: `served_family`, in blocks of 4 (the window releases them), chunks of 16; `moe`:
    `served_moe`, in blocks of 4 with prefix caching, chunks of 16, its K/V cache events on
    `kv_events_port` (replay: `kv_replay_port`); `gguf`: the default
    model's own Q4_1 GGUF file, as stored; `compressed`: `served_compressed`; `det`: the default
    model in deterministic mode."""
    import json

    from helpers import free_port
    from benchmarks.servers import Server

    repo = tmp_path_factory.mktemp("feature_repo")
    paths = lora_adapters.paths
    write_model(repo, "lora", {"enable_lora": "true", "max_loras": "2", "max_cpu_loras": "3",
                               "runtime_lora_updating": "true", "kv_cache_tokens": "4096", "max_batch_size": "8"},
                {"multi_lora.json": json.dumps({"a": str(paths["a"]), "b": str(paths["b"])})})
    version = write_model(repo, "lora_json", {"kv_cache_tokens": "2048"}, {
        "model.json": json.dumps({"enable_lora": "true", "max_lora_rank": 16, "max_loras": 1,
                                  "gpu_memory_utilization": 0.5}),
        "multi_lora.json": json.dumps({"c": "adapters/c"})})
    shutil.copytree(paths["c"], version / "adapters" / "c")
    spec = json.dumps({"method": "ngram", "num_speculative_tokens": 4}).replace('"', '\\"')  # quoted for pbtxt
    write_model(repo, "spec", {"speculative_config": spec, "kv_cache_tokens": "4096"})
    draft = json.dumps({"method": "draft_model", "model": str(default_model), "num_speculative_tokens": 3})
    write_model(repo, "draft", {"speculative_config": draft.replace('"', '\\"'), "kv_cache_tokens": "4096"})
    write_model(repo, "prio", {"engine": "null", "null_step_seconds": "0.02", "max_batch_size": "1",
                               "kv_cache_tokens": "4096"})
    write_model(repo, "embed", {"pooling_type": "mean", "kv_cache_tokens": "2048", "max_num_batched_tokens": "8"})
    write_model(repo, "family", {"model": str(served_family), "kv_cache_tokens": "1024", "block_size": "4",
                                 "max_num_batched_tokens": "16"})
    kv_events_port, kv_replay_port = free_port(), free_port()
    write_model(repo, "moe", {"model": str(served_moe), "kv_cache_tokens": "1024", "block_size": "4",
                              "max_num_batched_tokens": "16", "enable_prefix_caching": "true",
                              "kv_events_config": json.dumps({"enable_kv_cache_events": True,
                                                              "endpoint": f"tcp://*:{kv_events_port}",
                                                              "replay_endpoint": f"tcp://*:{kv_replay_port}"})
                              .replace('"', '\\"')})
    from orca_backend.checkpoint.store import default_gguf

    write_model(repo, "gguf", {"model": str(default_gguf()), "kv_cache_tokens": "2048"})
    write_model(repo, "compressed", {"model": str(served_compressed), "kv_cache_tokens": "1024"})
    write_model(repo, "det", {"deterministic": "true", "kv_cache_tokens": "8192"})
    server = Server(tmp_path_factory.mktemp("feature_triton"), repo, ["--exit-timeout-secs=20"])
    server.kv_events_port, server.kv_replay_port = kv_events_port, kv_replay_port
    yield from _session_server("feature_server", server)
