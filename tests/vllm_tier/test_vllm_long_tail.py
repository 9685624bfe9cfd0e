"""A pooled rollout on vLLM's CPU build: a generation interrupted by new weights continues from its
prefix (re-sent as the prompt: vLLM's prefix cache serves it), and each token's recorded version and
behaviour log-prob are those of the weights that produced it; then a disaggregated run with partial
rollout and over-sampling, with vLLM as the rollout engine, loses no sample between steps."""
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("vllm")
pytestmark = pytest.mark.vllm

from rlrecipes.engines.base import EngineSpec, SamplingParams  # noqa: E402
from rlrecipes.engines.registry import build_rollout_engine  # noqa: E402
from rlrecipes.models import SMOKE, hf_config  # noqa: E402
from rlrecipes.workflow.pool import Group, Sample, _Generation  # noqa: E402

from test_vllm_engine import hf_logprobs, run_smoke  # noqa: E402  (same folder)


def test_an_interrupted_vllm_generation_records_each_tokens_producer():
    from transformers import AutoModelForCausalLM

    eng = build_rollout_engine("vllm", EngineSpec(model=SMOKE["qwen2"], role="rollout", dtype="fp32", seed=0,
                                                  max_model_len=64))
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(hf_config(SMOKE["qwen2"])).eval()
    v0 = {k: t.detach().clone() for k, t in hf.state_dict().items()}
    v1 = {k: t + 0.05 * torch.randn_like(t) for k, t in v0.items()}
    eng.update_weights([list(v0.items())])
    groups = [Group(i, 0, p, [Sample(), Sample()]) for i, p in enumerate([torch.tensor([1, 2, 3]),
                                                                        torch.tensor([4, 5, 6, 7])])]
    ctx = SimpleNamespace(rollout=eng, version=0)
    gen = _Generation(ctx, SamplingParams(max_new_tokens=10, temperature=1.0), seed=5)
    gen.chunk(groups, 4)
    gen.close()
    eng.update_weights([list(v1.items())])  # the interrupt: the new version loads between two chunks
    ctx.version = 1
    gen.chunk(groups, 3)
    gen.chunk(groups, 3)
    gen.close()
    for weights, version in ((v0, 0), (v1, 1)):
        hf.load_state_dict(weights)
        for g in groups:
            for s in g.samples:
                assert s.versions == [0] * 4 + [1] * 6
                got, mine = torch.tensor(s.logps), torch.tensor(s.versions) == version
                want = hf_logprobs(hf, g.prompt, torch.tensor(s.tokens))
                assert torch.allclose(got[mine], want[mine], atol=1e-4)
                assert (got[~mine] - want[~mine]).abs().max() > 1e-3


def test_pooled_disaggregated_run_with_vllm(tmp_path):
    rows = run_smoke(tmp_path / "run", 4, "-d", "2", "--keep-batch", "resources.placement=disaggregated",
                     "resources.rollout_devices=1", "algorithm.max_staleness=1", "data.synthetic=longtail",
                     "rollout.sampling.max_new_tokens=24", "rollout.chunk_tokens=4", "rollout.partial=true",
                     "rollout.oversample=2")
    before = 0
    for r in rows:
        assert r["rollout/pool_carried_in"] == before
        assert r["rollout/pool_carried_in"] + r["rollout/pool_new_groups"] == (
            r["rollout/pool_committed_groups"] + r["rollout/pool_carried_groups"])
        assert r["samples"] == 8 * r["rollout/pool_committed_groups"]
        assert r["rollout/pool_dock_rows"] == 8 * r["rollout/pool_carried_groups"]
        before = r["rollout/pool_carried_groups"]
