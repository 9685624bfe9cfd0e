"""Single-process GRPO check that the smoke task is learnable by a tiny random model on CPU.

Run: ``python benchmarks/smoke_task_check.py --steps 30``. Prints one JSON line per step and a
summary with the mean reward of the first 5 and the last 5 steps. Plain torch + rlrecipes.algos,
a transformers Qwen2 model built from config (hidden 64, 2 layers, 4 heads, vocab 32), sampling
with a simple loop. Not used by tests (it takes minutes); it documents how the task was chosen.
"""
from __future__ import annotations

import argparse
import json
import tempfile
import time

import torch


def sample(model, prompt_ids: torch.Tensor, max_new: int, eos_id: int, pad_id: int, temperature: float = 1.0):
    """Sample responses for equal-length prompts ``[batch, prompt]``.

    Returns ``(response_ids [batch, max_new], response_mask [batch, max_new])``; the mask covers
    the tokens up to and including ``<eos>``.
    """
    ids = prompt_ids
    bsz = ids.shape[0]
    done = torch.zeros(bsz, dtype=torch.bool)
    out, mask = [], []
    past = None
    with torch.no_grad():
        inp = ids
        for _ in range(max_new):
            res = model(input_ids=inp, past_key_values=past, use_cache=True)
            past = res.past_key_values
            logits = res.logits[:, -1].float() / temperature  # [batch, vocab]
            tok = torch.multinomial(torch.softmax(logits, -1), 1).squeeze(-1)  # [batch]
            tok = torch.where(done, torch.full_like(tok, pad_id), tok)
            mask.append(~done)
            out.append(tok)
            done = done | (tok == eos_id)
            inp = tok.unsqueeze(-1)
            if bool(done.all()):
                break
    resp = torch.stack(out, 1)
    m = torch.stack(mask, 1)
    if resp.shape[1] < max_new:
        padn = max_new - resp.shape[1]
        resp = torch.cat([resp, torch.full((bsz, padn), pad_id)], 1)
        m = torch.cat([m, torch.zeros(bsz, padn, dtype=torch.bool)], 1)
    return resp, m


def main(argv=None) -> dict:
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    from rlrecipes.algos import grpo_advantage, logprobs_from_logits, ppo_clip_policy_loss
    from rlrecipes.data.smoke import build_smoke_tokenizer, smoke_task_dataset
    from rlrecipes.rewards.smoke import smoke_reward

    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--n", type=int, default=8)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--task", default="copy")
    p.add_argument("--digits", type=int, default=3)
    p.add_argument("--max-new", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    torch.manual_seed(a.seed)

    tmp = tempfile.mkdtemp(prefix="smoke_tok_")
    tok = AutoTokenizer.from_pretrained(str(build_smoke_tokenizer(tmp)))
    cfg = Qwen2Config(vocab_size=32, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      tie_word_embeddings=True, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                      pad_token_id=tok.pad_token_id)
    model = Qwen2ForCausalLM(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, weight_decay=0.0)
    data = smoke_task_dataset(a.steps * a.prompts, a.seed, task=a.task, num_digits=a.digits)
    rewards = []
    t0 = time.time()
    for step in range(a.steps):
        rows = data[step * a.prompts:(step + 1) * a.prompts]
        enc = tok([r["prompt"] for r in rows for _ in range(a.n)], return_tensors="pt", padding=True)
        prompt_ids = enc["input_ids"]  # [B, P] (equal lengths for the smoke task)
        model.eval()
        resp, rmask = sample(model, prompt_ids, a.max_new, tok.eos_token_id, tok.pad_token_id)
        texts = tok.batch_decode(resp.masked_fill(~rmask, tok.pad_token_id), skip_special_tokens=True)
        answers = [r["answer"] for r in rows for _ in range(a.n)]
        scores = torch.tensor([smoke_reward(c, ans) for c, ans in zip(texts, answers)])
        adv, _ = grpo_advantage(scores, rmask, group_size=a.n)
        model.train()
        full = torch.cat([prompt_ids, resp], 1)  # [B, P+R]
        logits = model(input_ids=full).logits[:, prompt_ids.shape[1] - 1:-1]  # [B, R, V]
        logp = logprobs_from_logits(logits, resp)  # [B, R]
        loss, m = ppo_clip_policy_loss(logp, logp.detach(), adv, rmask, clip_ratio_low=0.2,
                                       clip_ratio_high=0.28, loss_agg_mode="token-mean")
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        rewards.append(scores.mean().item())
        print(json.dumps({"step": step, "reward": round(rewards[-1], 4), "exact": round((scores == 1).float().mean().item(), 3),
                          "resp_len": round(rmask.sum(-1).float().mean().item(), 2), "sample": texts[0],
                          "t": round(time.time() - t0, 1)}), flush=True)
    k = min(5, len(rewards))
    summary = {"first5": sum(rewards[:k]) / k, "last5": sum(rewards[-k:]) / k, "seconds": round(time.time() - t0, 1),
               "args": vars(a)}
    print(json.dumps(summary), flush=True)
    return summary


if __name__ == "__main__":
    main()
