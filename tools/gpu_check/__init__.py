"""Everything worth checking while a GPU is lent, in one command that writes a report.

Sections, run in order (`--sections` picks some):

1. kernel_numerics: `trt_plugins.paged_attention` against the float64 reference of
   `trt_plugins/reference.py` on random decode, prefill and mixed batches (cached prefixes, shuffled block tables), per
   dtype and head shape; the K/V cache writes must be exact.
2. engine_parity: tiny random Llama and Qwen2 checkpoints; our engine (attention "triton",
   CUDA graphs on and off, chunked prefill) against transformers' greedy `generate`, token
   for token, with staggered arrivals so iterations mix prefill and decode. bf16 agreement
   is reported for information.
3. pipeline: the tiny random Llama split into two pipeline stages on GPU 0 (bf16), through the
   in-process `pipeline` executor and through two `StageWorker`s (the `orca_stage_<i>` Triton
   models' Python entry points) called by hand, against the single-stage engine: greedy
   tokens, first divergence and max |logit difference|. Then the cost of handing the hidden
   states on per iteration ([tokens, hidden] copied within the GPU, and GPU->CPU->GPU) next to
   each stage's measured forward.
4. decode_throughput: a Llama-3-8B-shaped random model (bf16). Decode tokens/s per batch
   size next to the HBM bound, CUDA graphs on and off, and a trace of varied output lengths
   through our engine (continuous batching) and transformers (static batches).
5. kernel_vs_sdpa: our kernel against dense flash SDPA on prefill and decode shapes.
6. lora: the multi-LoRA kernels against float64 on a fused q|k|v projection with 8 slots, and
   their time beside the batched products the CPU path uses.
7. families: every model family of the registry (tools/model_zoo.py) through the engine on the
   GPU, the kernel compiled with its windows, soft caps and head sizes, decode CUDA graphs on,
   against transformers' greedy `generate` on the same GPU.
8. plugin_ptx, 9. sampler, 10. moe: see their modules.
11. quantized: the w4a16 Triton kernel and FP8 `_scaled_mm` against F.linear on the weights
    they hold, on an 8B Llama's projection shapes, and their times against bf16 F.linear.

Each section runs in a process of its own, so that a crash or a poisoned CUDA context costs
that section only; a failure is recorded with its traceback and the next section runs. A
global time budget (an alarm inside each section, a kill past it) skips what would overrun;
a short section also has a cap of its own (cli.MAX_SECONDS), so that a hang there cannot eat
the budget of the sections after it.
gpu_check.json, gpu_check.md and gpu_check.log in --out are rewritten as results come in.
`--smoke` is a CPU dry run at tiny sizes (TRITON_INTERPRET=1) that walks every code path
except the CUDA-only calls, and says which those were.

Usage: bash tools/gpu_check.sh [--smoke] [--sections a,b] [--budget-seconds 450] [--layers 32]
(or `python -m tools.gpu_check ...` from the repository root). cli.py parses the arguments and
runs the sections; report.py keeps the report; kernel_sections.py, engine_sections.py,
pipeline_section.py, throughput.py and families_section.py hold the sections, checkpoints.py the
random models they load.
"""
