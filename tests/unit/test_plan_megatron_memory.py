"""The megatron ("pipeline") memory model against hand computations, at the shape the GPU suite measured
(one H200, megatron-core 0.19.2, Qwen2.5-1.5B shape, TP1, 8 rows of 512 + 512 per micro-batch, bf16, no
recompute: 82.6 GiB peak). The terms the model missed before (65.35 GiB planned): the fp32 softmax
megatron's local attention saves, the fp32 input copies the engine's fp32-weight norms save, and the
head's gradients at the start of backward."""
import json

import pytest

from rlrecipes.plan import build_plan
from rlrecipes.recipe import load_recipe

GiB = 1024 ** 3
SHAPE = dict(vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
             num_attention_heads=12, num_key_value_heads=2, max_position_embeddings=32768,
             tie_word_embeddings=True, rope_theta=1000000.0, rms_norm_eps=1e-6)
MEASURED = 88665361920  # bytes, benchmarks/results/gpu_suite-nvidia-h200-20261128.json


def _plan(tmp_path, shape=SHAPE, rows=8, prompt=512, response=512):
    """The plan the GPU suite compares with (benchmarks/engine_throughput.py plan_memory, megatron)."""
    (tmp_path / "config.json").write_text(json.dumps({**shape, "model_type": "qwen2",
                                                      "architectures": ["Qwen2ForCausalLM"]}))
    recipe = load_recipe("qwen25_7b", overrides=[
        f"model.path={tmp_path}", "model.preset=null", "model.dtype=bf16", "actor.engine=megatron",
        "rollout.engine=native", "actor.layout.tp=1", "actor.layout.pp=1", "actor.layout.ep=1",
        "rollout.layout.tp=1", "resources.device=cuda", "resources.nodes=1", "resources.devices_per_node=1",
        "resources.device_memory_gb=139.8", "resources.dies_per_card=1", "actor.recompute=false",
        "actor.offload_optimizer=false", f"data.max_prompt_length={prompt}",
        f"rollout.sampling.max_new_tokens={response}", f"trainer.max_tokens_per_micro_batch={rows * (prompt + response)}",
        f"trainer.micro_batch={rows}", "trainer.global_batch=8", "trainer.mini_batch=8"])
    return build_plan(recipe).train_memory


def test_activations_are_the_hand_count(tmp_path):
    m = _plan(tmp_path)
    rows, T, R, h, ffn, heads, layers, vocab, c = 8, 1024, 512, 1536, 8960, 12, 28, 151936, 2
    tokens = rows * T  # 8,192
    layer = tokens * c * (10 * h + 4 * ffn)  # hidden-size and MLP-width tensors: 838,860,800
    norms = 2 * tokens * h * (8 - c)  # two composite RMSNorms, 8 bytes saved per element, c of it counted: 150,994,944
    probs = rows * heads * T * T * (4 + c)  # fp32 softmax + its bf16 copy: 603,979,776
    logits = tokens * vocab * (c + 8 + 8 * R / T)  # 14 bytes per element: 17,425,235,968
    assert layer == 838_860_800 and norms == 150_994_944 and probs == 603_979_776
    assert logits == 17_425_235_968
    assert m.activations == pytest.approx(layers * (layer + norms + probs) + logits)
    assert m.transient == pytest.approx(rows * heads * T * T * (2 * c + 4))  # one layer's scores in flight


def test_static_terms_are_18_bytes_per_parameter(tmp_path):
    """bf16 weights (2), the fp32 DDP gradient buffer (grad_reduce_in_fp32: 4), the distributed
    optimizer's fp32 main parameters and Adam's two fp32 moments (12) at DP 1."""
    m = _plan(tmp_path)
    params = 1_543_714_304  # Qwen2.5-1.5B shape, tied embedding (the suite's count)
    assert m.weights == pytest.approx(2 * params)
    assert m.grads == pytest.approx(4 * params)
    assert m.optimizer == pytest.approx(12 * params)


def test_the_suite_shape_is_within_20_percent_of_the_h200_peak(tmp_path):
    m = _plan(tmp_path)
    assert 0.8 < MEASURED / m.total < 1.2, (m.gib(), MEASURED / GiB)
    assert m.total / GiB == pytest.approx(84.42, abs=0.01)  # 65.35 before the three terms
