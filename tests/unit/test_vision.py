"""Vision-language (Qwen2.5-VL): the processor and M-RoPE against transformers, the family's specs
against the HF model, images from verl-format Parquet and JSONL, and the native rollout's log-probs
on image inputs against the trainer's. Tiny models from config; every image is made here."""
import json
import random

import numpy as np
import pytest
import torch

from rlrecipes.data import DataError, PromptDataset, load_prompt_rows
from rlrecipes.data.images import COLORS, decode_image, decode_png, draw_shape, encode_png, vision_smoke_dataset
from rlrecipes.models import SMOKE, hf_config, param_specs
from rlrecipes.models.catalog import dims_from_hf_config
from rlrecipes.models.vision import VisionSettings, mrope_positions
from rlrecipes.rewards.smoke import smoke_vision_reward

DIMS = SMOKE["qwen2_5_vl"]


@pytest.fixture(scope="module")
def tok(vl_tokenizer):  # tests/conftest.py
    return vl_tokenizer


@pytest.fixture(scope="module")
def hf_model():
    from transformers import AutoModelForImageTextToText

    torch.manual_seed(0)
    return AutoModelForImageTextToText.from_config(hf_config(DIMS)).eval()


def test_family_specs_cover_the_hf_model_and_dims_round_trip(hf_model):
    hf = {n: tuple(p.shape) for n, p in hf_model.named_parameters()}
    specs = {s.name: s for s in param_specs(DIMS)}
    assert {n: s.shape for n, s in specs.items()} == hf
    assert DIMS.total_params() == sum(p.numel() for p in hf_model.parameters())
    assert dims_from_hf_config(hf_model.config) == DIMS
    vis = [s for n, s in specs.items() if ".visual." in n]
    assert vis and all(s.kind == "replicated" and s.pp_stage == 0 for s in vis)
    assert specs["model.language_model.layers.0.self_attn.q_proj.weight"].kind == "column"


def test_processor_matches_transformers_patch_order():
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    img = np.random.default_rng(0).integers(0, 256, (56, 84, 3), dtype=np.uint8)  # multiples of 28: no resize
    ref = Qwen2VLImageProcessorPil()(images=[img], return_tensors="pt")
    mine = VisionSettings().process(img)
    assert torch.equal(mine.grid_thw, ref["image_grid_thw"])
    torch.testing.assert_close(mine.pixel_values, ref["pixel_values"].float(), atol=1e-5, rtol=1e-5)
    assert VisionSettings().tokens_for(56, 84) == 6
    assert VisionSettings().tokens_for(4000, 4000) <= 1280  # max_pixels caps an image's tokens


def test_mrope_positions_match_get_rope_index(hf_model, tok):
    rows = vision_smoke_dataset(3, seed=1)
    rows[1]["prompt"] = "ab<image>c?="
    rows[2]["images"] = rows[2]["images"] * 2
    ds = PromptDataset(rows, tok, vision=VisionSettings())
    ids = [torch.tensor(ds[i]["prompt_ids"]) for i in range(3)]
    P = max(len(x) for x in ids)
    batch = torch.zeros((3, P), dtype=torch.long)
    mask = torch.zeros((3, P), dtype=torch.long)
    for i, x in enumerate(ids):  # left padded, as the rollout lays prompts out
        batch[i, P - len(x):], mask[i, P - len(x):] = x, 1
    grids = torch.cat([ds[i]["vision"].grid_thw for i in range(3)])
    ref, _ = hf_model.model.get_rope_index(batch, mm_token_type_ids=(batch == DIMS.image_token_id).int(),
                                           image_grid_thw=grids, attention_mask=mask)
    for i, x in enumerate(ids):
        mine = mrope_positions(x, ds[i]["vision"].grid_thw, DIMS.image_token_id, DIMS.spatial_merge)
        assert torch.equal(mine, ref[:, i, P - len(x):])


def test_png_codec_and_image_errors(tmp_path):
    img = draw_shape(random.Random(0), COLORS[2])
    assert np.array_equal(decode_png(encode_png(img)), img)
    assert np.array_equal(decode_image({"bytes": encode_png(img), "path": None}, "row 1"), img)
    (tmp_path / "a.png").write_bytes(encode_png(img))
    assert np.array_equal(decode_image("a.png", "row 1", tmp_path), img)
    with pytest.raises(DataError, match=r"row 7: image file .*missing.png does not exist.*relative to the data"):
        decode_image("missing.png", "row 7", tmp_path)
    with pytest.raises(DataError, match="row 2: truncated PNG|row 2: damaged PNG"):
        decode_png(encode_png(img)[:60], "row 2")


def _geometry3k_parquet(path, n=4):
    """verl's geometry3k columns: data_source, prompt (chat), images [{bytes, path}], ability,
    reward_model {ground_truth, style}, extra_info."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = random.Random(0)
    recs = []
    for i in range(n):
        k = i % len(COLORS)
        recs.append({"data_source": "hiyouga/geometry3k",
                     "prompt": [{"role": "user", "content": "<image>Which colour? Answer with its digit."}],
                     "images": [{"bytes": encode_png(draw_shape(rng, COLORS[k])), "path": None}],
                     "ability": "math", "reward_model": {"ground_truth": str(k), "style": "rule"},
                     "extra_info": {"index": i, "split": "train"}})
    pq.write_table(pa.Table.from_pylist(recs), path)
    return path


def test_geometry3k_parquet_and_jsonl_load_with_images(tmp_path, tok):
    f = _geometry3k_parquet(tmp_path / "train.parquet")
    rows, skipped = load_prompt_rows(f, prompt_key="prompt", answer_key="reward_model.ground_truth",
                                     image_key="images")
    assert skipped == 0 and len(rows) == 4 and rows[3]["answer"] == "3"
    ds = PromptDataset(rows, tok, vision=VisionSettings())
    item = ds[0]
    assert item["prompt_ids"].count(DIMS.image_token_id) == 4  # 56x56 -> 2x2 merged patches
    assert item["vision"].pixel_values.shape == (16, 1176)
    with pytest.raises(DataError, match=r"no column 'image'.*did you mean 'images'.*data.image_key"):
        load_prompt_rows(f, prompt_key="prompt", answer_key="reward_model.ground_truth", image_key="image")
    # JSONL with image paths relative to the file
    (tmp_path / "img0.png").write_bytes(encode_png(draw_shape(random.Random(1), COLORS[0])))
    j = tmp_path / "train.jsonl"
    j.write_text(json.dumps({"prompt": "<image>?=", "answer": "0", "images": ["img0.png"]}) + "\n"
                 + json.dumps({"prompt": "<image>?=", "answer": "1", "images": ["nope.png"]}) + "\n")
    rows, _ = load_prompt_rows(j, image_key="images")
    assert PromptDataset(rows[:1], tok, vision=VisionSettings())[0]["vision"].num_images == 1
    with pytest.raises(DataError, match=r"train.jsonl:2: image 0: image file .*nope.png does not exist"):
        PromptDataset(rows, tok, vision=VisionSettings())
    with pytest.raises(DataError, match="text-only"):
        PromptDataset(rows[:1], tok)


def test_blank_images_keep_the_grid_and_drop_the_content(tok):
    rows = vision_smoke_dataset(2, seed=3)
    a = PromptDataset(rows, tok, vision=VisionSettings())[0]
    b = PromptDataset(rows, tok, vision=VisionSettings(), blank_images=True)[0]
    assert a["prompt_ids"] == b["prompt_ids"] and torch.equal(a["vision"].grid_thw, b["vision"].grid_thw)
    assert not torch.equal(a["vision"].pixel_values, b["vision"].pixel_values)
    pv = b["vision"].pixel_values
    assert torch.equal(pv, pv[:1].expand_as(pv))  # every patch the same: black everywhere


def test_vision_reward_is_chance_corrected():
    assert smoke_vision_reward("2", "2") == 1.0
    assert smoke_vision_reward("1", "2") == pytest.approx(-1 / 3)
    assert smoke_vision_reward("x", "2") == 0.0
    for guess in "0123":  # an image-blind answer scores 0 on average over the classes
        assert sum(smoke_vision_reward(guess, str(k)) for k in range(4)) == pytest.approx(0.0)


def test_model_stages_read_the_image_reference():
    from rlrecipes.algos.spec import get_algorithm
    from rlrecipes.recipe import load_recipe

    alg = load_recipe("qwen25_vl_7b", smoke=True).algorithm
    st = {s.name: s for s in get_algorithm("grpo").stages(alg, use_ref=True, skip_old=False, vision=True)}
    for name in ("ref", "old", "update"):
        assert "prompt_index" in st[name].reads
    plain = {s.name: s for s in get_algorithm("grpo").stages(alg, use_ref=True, skip_old=False)}
    assert "prompt_index" not in plain["ref"].reads


@pytest.mark.usefixtures("one_rank_group")
def test_native_rollout_log_probs_equal_the_trainers_on_images(tok):
    from rlrecipes.engines.base import SamplingParams, SeqBatch
    from rlrecipes.engines.native.rollout import NativeRolloutEngine
    from rlrecipes.engines.native.train import NativeTrainEngine

    rows = vision_smoke_dataset(4, seed=2)
    rows[1]["prompt"] = "ab<image>?="
    rows[2]["images"] = rows[2]["images"] * 2
    ds = PromptDataset(rows, tok, vision=VisionSettings())
    prompts = [torch.tensor(ds[i]["prompt_ids"]) for i in range(4)]
    images = [ds[i]["vision"] for i in range(4)]
    roll = NativeRolloutEngine(DIMS, device="cpu", seed=0)
    train = NativeTrainEngine(DIMS, device="cpu", micro_batch_size=3, seed=0)
    out = roll.generate(prompts, SamplingParams(max_new_tokens=6, eos_token_id=2), seed=5, images=images)
    assert all(DIMS.image_token_id not in r.tolist() for r in out.responses)  # never sampled
    logp, _ = train.forward(SeqBatch(prompts, out.responses, images=images))
    for a, b in zip(out.log_probs, logp):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    # the pixels matter: the same tokens with blank images score differently
    blank = PromptDataset(rows, tok, vision=VisionSettings(), blank_images=True)
    logp_blank, _ = train.forward(SeqBatch(prompts, out.responses, images=[blank[i]["vision"] for i in range(4)]))
    assert any(not torch.allclose(a, b) for a, b in zip(logp, logp_blank))


@pytest.mark.usefixtures("one_rank_group")
def test_multi_turn_session_keeps_the_first_turns_images(tok):
    """An image-bearing first turn, then a text observation: every turn is re-prefilled with the images,
    and the trainer scores the whole conversation (observation tokens included) as the sampler did."""
    from rlrecipes.engines.base import SamplingParams, SeqBatch
    from rlrecipes.engines.native.rollout import NativeRolloutEngine
    from rlrecipes.engines.native.train import NativeTrainEngine

    ds = PromptDataset(vision_smoke_dataset(2, seed=4), tok, vision=VisionSettings())
    prompts = [torch.tensor(ds[i]["prompt_ids"]) for i in range(2)]
    images = [ds[i]["vision"] for i in range(2)]
    roll = NativeRolloutEngine(DIMS, device="cpu", seed=0)
    sess = roll.open_session(prompts, SamplingParams(max_new_tokens=3, eos_token_id=2), seed=1, images=images)
    first = sess.generate([0, 1], [None, None], [3, 3])
    obs = torch.tensor(tok("=7")["input_ids"][1:])  # a text tool turn
    second = sess.generate([0, 1], [obs, obs], [3, 3])
    train = NativeTrainEngine(DIMS, device="cpu", micro_batch_size=2, seed=0)
    responses = [torch.cat([first.responses[i], obs, second.responses[i]]) for i in range(2)]
    logp, _ = train.forward(SeqBatch(prompts, responses, images=images))
    for i in range(2):
        a, n = len(first.responses[i]), len(obs)
        torch.testing.assert_close(logp[i][:a], first.log_probs[i], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(logp[i][a + n:], second.log_probs[i], atol=1e-5, rtol=1e-5)


def test_resharder_plans_the_vision_weights():
    """The vision tower and merger move with the decoder: replicated over TP, every rollout rank
    receives them whole (colocated TP2 -> TP1 DP2, and DP2 -> one disaggregated rollout rank)."""
    from rlrecipes.core.parallel import ParallelLayout
    from rlrecipes.core.resharder import plan_reshard

    specs = param_specs(DIMS)
    vision = sum(s.numel for s in specs if ".visual." in s.name)
    assert vision == DIMS.vision_params()
    co = plan_reshard(ParallelLayout.of(2), ParallelLayout.of(1, dp=2), specs, dtype_bytes=4)
    assert all(co.rollout_bytes(r) == sum(s.numel for s in specs) * 4 for r in range(2))
    dis = plan_reshard(ParallelLayout.of(1, dp=2), ParallelLayout.of(1), specs, dtype_bytes=4, placement="disaggregated")
    assert dis.recv_bytes(2) == sum(s.numel for s in specs) * 4


def _vl_batch(tok, n=4):
    """Image prompts of different lengths (one with two images, one with text before its image) and
    ragged random responses."""
    from rlrecipes.engines.base import SeqBatch

    rows = vision_smoke_dataset(n, seed=3)
    rows[1]["prompt"] = "ab<image>?="
    rows[2]["images"] = rows[2]["images"] * 2
    ds = PromptDataset(rows, tok, vision=VisionSettings())
    g = torch.Generator().manual_seed(1)
    prompts = [torch.tensor(ds[i]["prompt_ids"]) for i in range(n)]
    responses = [torch.randint(3, 30, (r,), generator=g) for r in (5, 2, 15, 1)[:n]]
    return SeqBatch(prompts, responses, per_sample={"advantages": torch.randn(n, generator=g)},
                    images=[ds[i]["vision"] for i in range(n)])


@pytest.mark.usefixtures("one_rank_group")
@pytest.mark.parametrize("budget", [45, 200])  # two micro-batches; one of three rows, one holding two samples
def test_packed_micro_batches_carry_each_samples_images_and_positions(tok, budget):
    """Token-budget packing on a VL model: the pixels follow the samples' layout order and each sample
    keeps its own M-RoPE positions, so log-probs and gradients equal the padded micro-batches'."""
    from rlrecipes.engines.native.batching import packed_micro_batches
    from rlrecipes.engines.native.train import NativeTrainEngine

    batch = _vl_batch(tok)
    packed = NativeTrainEngine(DIMS, device="cpu", max_tokens_per_micro_batch=budget, seed=0, dtype="fp32",
                               freeze_vision_tower=False)
    padded_tower = NativeTrainEngine(DIMS, device="cpu", micro_batch_size=4, seed=0, dtype="fp32",
                                     freeze_vision_tower=False)
    mbs = packed_micro_batches(batch, budget, 0, collective=False, vision=packed._vision)
    assert all(mb["mrope_position_ids"].shape[0] == 4 for mb in mbs)  # text positions + 3 M-RoPE axes
    if budget == 200:
        assert any(mb["input_ids"].shape[0] > 1 and len(mb["sample_index"]) > mb["input_ids"].shape[0]
                   for mb in mbs)  # some row holds two samples
    want, _ = padded_tower.forward(batch)
    got, _ = packed.forward(batch)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)

    def loss(logp, ent, mb):
        m = mb["response_mask"]
        return -(logp * mb["advantages"] * m).sum(), {}

    before = {n: p.detach().clone() for n, p in packed.model.named_parameters() if "visual.blocks" in n}
    got_m, want_m = packed.train_step(batch, loss), padded_tower.train_step(batch, loss)
    assert got_m["actor/loss"] * got_m["actor/micro_batches"] == pytest.approx(
        want_m["actor/loss"] * want_m["actor/micro_batches"], rel=1e-5)  # the same summed loss
    assert got_m["actor/grad_norm"] == pytest.approx(want_m["actor/grad_norm"], rel=1e-5)
    # the trained tower learned through the packed pixels
    assert any(not torch.equal(p, before[n]) for n, p in packed.model.named_parameters() if n in before)


def test_vllm_placeholders_and_image_hashes():
    """What the vLLM rollout tells vLLM about a prompt's images (rlrecipes/engines/vllm/vision.py, no
    vLLM needed): where each image's tokens are, split like mrope_positions splits them, and a hash
    that changes with the pixels."""
    from rlrecipes.engines.vllm.vision import image_hashes, placeholder_ranges

    vs = VisionSettings()
    a = vs.process(np.zeros((56, 56, 3), dtype=np.uint8))  # 4 tokens
    b = vs.process(np.full((56, 84, 3), 200, dtype=np.uint8))  # 6 tokens
    pad, start, end = DIMS.image_token_id, DIMS.vision_start_token_id, DIMS.vision_end_token_id
    grid = torch.cat([a.grid_thw, b.grid_thw])
    ids = [1, start] + [pad] * 4 + [end, 5, start] + [pad] * 6 + [end, 7]
    assert placeholder_ranges(ids, grid, pad, 2) == [(2, 4), (9, 6)]
    assert placeholder_ranges([pad] * 10, grid, pad, 2) == [(0, 4), (4, 6)]  # one run, two images
    with pytest.raises(ValueError, match="grid"):
        placeholder_ranges([1, 2, 3], a.grid_thw, pad, 2)
    with pytest.raises(ValueError, match="needs 6 image tokens"):
        placeholder_ranges([pad] * 4 + [5] + [pad] * 4, grid, pad, 2)
    two = image_hashes(torch.cat([a.pixel_values, b.pixel_values]), grid)
    assert len(set(two)) == 2 and image_hashes(a.pixel_values, a.grid_thw)[0] == two[0]
    blank = vs.process(np.full((56, 56, 3), 1, dtype=np.uint8))
    assert image_hashes(blank.pixel_values, blank.grid_thw) != image_hashes(a.pixel_values, a.grid_thw)
