"""What the engine does besides a plain forward, on a quantized base (an AutoAWQ int4
checkpoint packed from known integers, `test_quant_formats`): a LoRA adapter over it
(QLoRA-style serving) against PEFT's merged model on the weights it stands for; two
tensor-parallel ranks, each with its groups of inputs and their scales, against
transformers; n-gram speculation, prefix caching, preemption and structured outputs keeping
the plain run's tokens."""
from __future__ import annotations

import json

import pytest
import torch

from orca_backend import LLM, SamplingParams, StructuredOutputsParams
from orca_backend.lora import LoRARequest
from tests.test_quant_formats import PROMPTS, _checkpoints, dense  # noqa: F401 (a fixture)
from tests.test_quantized import LOGPROB_TOL, check_greedy

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
pytestmark = pytest.mark.numerics


@pytest.fixture(scope="module")
def awq(dense, tmp_path_factory):  # noqa: F811
    return _checkpoints(dense, tmp_path_factory.mktemp("awq"), "awq")


def _reference_check(model, outs, what: str) -> None:
    check_greedy(model, PROMPTS, outs, 12, what)


def test_a_lora_adapter_over_a_quantized_base_equals_peft_on_its_weights(awq, tmp_path):
    import transformers as tf
    from peft import LoraConfig, get_peft_model

    quantized, known = awq
    torch.manual_seed(0)
    peft = get_peft_model(tf.AutoModelForCausalLM.from_pretrained(known, dtype=torch.float32),
                          LoraConfig(r=8, lora_alpha=16, init_lora_weights=False,
                                     target_modules=["q_proj", "v_proj", "o_proj", "down_proj"]))
    peft.save_pretrained(tmp_path / "adapter")
    merged = peft.merge_and_unload().eval()
    with LLM(str(quantized), enable_lora=True, max_loras=1, max_lora_rank=8) as llm:
        outs = llm.generate(PROMPTS, GREEDY, lora_request=LoRARequest("a", 0, str(tmp_path / "adapter")))
        base = llm.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] != [o.token_ids for o in base]  # the adapter changes the output
    _reference_check(merged, outs, "LoRA over AWQ")


def test_two_tensor_parallel_ranks_of_a_quantized_model_agree_with_transformers(awq):
    import transformers as tf

    quantized, known = awq
    with LLM(str(quantized), tensor_parallel_size=2) as llm:
        outs = llm.generate(PROMPTS, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, prompt_logprobs=0))
    model = tf.AutoModelForCausalLM.from_pretrained(known, dtype=torch.float32).eval()
    _reference_check(model, outs, "2 ranks")
    ids = PROMPTS[0]
    with torch.no_grad():
        rows = model(torch.tensor([ids])).logits[0].log_softmax(-1)
    errors = [abs(next(iter(outs[0].prompt_logprobs[i].values()))[0] - rows[i - 1, ids[i]].item())
              for i in range(1, len(ids))]
    assert max(errors) < LOGPROB_TOL


def test_speculation_prefix_caching_preemption_and_structured_outputs_keep_the_tokens(awq):
    quantized, _ = awq
    prompts = [PROMPTS[0], PROMPTS[0] + [5, 6], PROMPTS[1]]  # the second shares the first's prefix
    with LLM(str(quantized)) as llm:
        plain = [o.token_ids for o in llm.generate(prompts, GREEDY)]
    features = dict(kv_cache_tokens=48, block_size=4, max_num_batched_tokens=8, enable_prefix_caching=True,
                    speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
                                        "prompt_lookup_max": 2})
    with LLM(str(quantized), **features) as llm:
        outs = llm.generate(prompts, GREEDY)
        choice = SamplingParams(max_tokens=4, temperature=0, structured_outputs=StructuredOutputsParams(
            json=json.dumps({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]})))
        shaped = llm.generate(PROMPTS[:1], choice)[0]
        assert llm.engine.kv.num_used_blocks == 0
    assert [o.token_ids for o in outs] == plain
    assert shaped.error is None and shaped.text.startswith("{")
