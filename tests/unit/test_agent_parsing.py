"""Tool-call parsing (qwen and smoke formats) and observation rendering through a chat template.

The Qwen-style tokenizer is built here: a small byte-level BPE trained on a few lines, the chat
special tokens, and a chat template written for this test in the Qwen2.5 layout (tools in the
system turn, ``<tool_call>`` blocks in assistant turns, consecutive tool results grouped in one
user turn of ``<tool_response>`` blocks). No hub access.
"""
from __future__ import annotations

import json

import pytest

from rlrecipes.agent import (
    SMOKE_ALPHABET,
    QwenFormat,
    SmokeFormat,
    ToolCall,
    ToolExecutor,
    ToolRegistry,
    ToolResult,
    get_format,
    render_tool_turn,
)

# ---------------------------------------------------------------------------------------------
# qwen format


def test_qwen_parses_several_calls_in_one_turn():
    text = ('Let me compute both.\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "2+3"}}\n'
            '</tool_call>\n<tool_call>\n{"name": "lookup", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>')
    turn = QwenFormat().parse(text)
    assert [(c.name, c.arguments, c.error) for c in turn.calls] == [
        ("calculator", {"expression": "2+3"}, None), ("lookup", {"city": "Paris", "days": 2}, None)]
    assert turn.content == "Let me compute both."
    assert turn.calls[0].raw.startswith("<tool_call>") and turn.calls[0].raw.endswith("</tool_call>")
    assert QwenFormat().parse("The answer is 5.").calls == []
    assert not QwenFormat().call_complete(text)  # a qwen turn ends at <|im_end|>


def test_qwen_malformed_calls_are_errors_not_exceptions():
    text = ('<tool_call>\n{"name": "calculator", "arguments": {"expression": "2+3"}\n</tool_call>'  # missing }
            '<tool_call>\n["calculator"]\n</tool_call>'
            '<tool_call>{"name": "calculator", "arguments": [1, 2]}</tool_call>'
            '<tool_call>{"name": "calculator", "arguments": "{\\"expression\\": \\"1+1\\"}"}</tool_call>'
            '<tool_call>{"name": "python", "arguments": {"code": "print(1)"')  # cut off by the token limit
    calls = QwenFormat().parse(text).calls
    assert len(calls) == 5
    assert calls[0].name == "calculator" and "not valid JSON (Expecting ',' delimiter at line 1" in calls[0].error
    assert 'no "name" string' in calls[1].error
    assert "must be a JSON object, got list" in calls[2].error
    assert (calls[3].arguments, calls[3].error) == ({"expression": "1+1"}, None)  # arguments as a JSON string
    assert "unterminated tool call" in calls[4].error

    # through the pool each call still gets exactly one observation, in order
    results = ToolExecutor(ToolRegistry(["calculator"]), max_workers=2).run(calls)
    assert [(r.ok, r.error) for r in results] == [(False, "parse_error")] * 3 + [(True, None), (False, "parse_error")]
    assert results[3].content == "2"


def test_qwen_ignores_calls_inside_reasoning():
    text = ('<think>\nI could write <tool_call>{"name": "python", "arguments": {}}</tool_call> but no.\n</think>\n\n'
            '<tool_call>\n{"name": "calculator", "arguments": {"expression": "1"}}\n</tool_call>')
    calls = QwenFormat().parse(text).calls
    assert [c.name for c in calls] == ["calculator"]


QWEN_STYLE_TEMPLATE = (
    "{%- if tools -%}"
    "{{- '<|im_start|>system\\n' -}}"
    "{%- if messages[0].role == 'system' -%}{{- messages[0].content + '\\n\\n' -}}{%- endif -%}"
    "{{- 'You may call functions. Their signatures:\\n<tools>' -}}"
    "{%- for t in tools -%}{{- '\\n' + (t | tojson) -}}{%- endfor -%}"
    "{{- '\\n</tools>\\nFor each call write <tool_call>\\n{\"name\": <name>, \"arguments\": <object>}\\n"
    "</tool_call>.<|im_end|>\\n' -}}"
    "{%- elif messages[0].role == 'system' -%}"
    "{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- for m in messages -%}"
    "{%- if m.role == 'system' and loop.first -%}"
    "{%- elif m.role == 'assistant' -%}"
    "{{- '<|im_start|>assistant\\n' + (m.content or '') -}}"
    "{%- for c in (m.tool_calls or []) -%}"
    "{%- if m.content or not loop.first -%}{{- '\\n' -}}{%- endif -%}"
    "{{- '<tool_call>\\n{\"name\": \"' + c.function.name + '\", \"arguments\": ' + (c.function.arguments | tojson)"
    " + '}\\n</tool_call>' -}}"
    "{%- endfor -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- elif m.role == 'tool' -%}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' -%}{{- '<|im_start|>user' -}}{%- endif -%}"
    "{{- '\\n<tool_response>\\n' + m.content + '\\n</tool_response>' -}}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' -%}{{- '<|im_end|>\\n' -}}{%- endif -%}"
    "{%- else -%}"
    "{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>", "<tool_response>",
            "</tool_response>"]


@pytest.fixture(scope="module")
def qwen_style_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    corpus = ["What is 407 + 512? Use the calculator.", '{"name": "calculator", "arguments": {"expression": "1+2"}}',
              "system user assistant tools functions signatures call"] * 20
    tok.train_from_iterator(corpus, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   additional_special_tokens=SPECIALS[1:])
    fast.chat_template = QWEN_STYLE_TEMPLATE
    return fast


def test_observation_is_the_chat_templates_tool_turn(qwen_style_tokenizer):
    tok = qwen_style_tokenizer
    reg = ToolRegistry(["calculator"])
    tools = reg.schemas()
    call = {"expression": "407+512"}
    results = [ToolResult("calculator", "919"),
               ToolResult("calculator", "Error: division by zero", False, "tool_error")]
    calls = [ToolCall("calculator", call), ToolCall("calculator", {"expression": "1/0"})]
    obs = get_format("qwen").render_observation(results, calls, tokenizer=tok, tools=tools)
    assert obs == ("\n<|im_start|>user\n<tool_response>\n919\n</tool_response>\n<tool_response>\n"
                   "Error: division by zero\n</tool_response><|im_end|>\n<|im_start|>assistant\n")

    # what the rollout builds (prompt, generated turn ending in EOS, observation, next turn) is
    # exactly the template's rendering of the whole conversation, as text and as token ids
    user = [{"role": "user", "content": "What is 407 + 512?"}]
    prompt = tok.apply_chat_template(user, tools=tools, add_generation_prompt=True, tokenize=False)
    gen1 = ('<tool_call>\n{"name": "calculator", "arguments": {"expression": "407+512"}}\n</tool_call>'
            '\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "1/0"}}\n</tool_call><|im_end|>')
    gen2 = "919<|im_end|>"
    parsed = QwenFormat().parse(gen1.removesuffix("<|im_end|>"))
    assert [c.arguments for c in parsed.calls] == [call, {"expression": "1/0"}]
    full = tok.apply_chat_template(
        user + [{"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": c.name, "arguments": c.arguments}} for c in parsed.calls]}]
        + [{"role": "tool", "content": r.content} for r in results] + [{"role": "assistant", "content": "919"}],
        tools=tools, tokenize=False)
    assert prompt + gen1 + obs + gen2 + "\n" == full

    def ids(s):
        return tok(s, add_special_tokens=False)["input_ids"]

    assert ids(prompt) + ids(gen1) + ids(obs) + ids(gen2) == ids(full.removesuffix("\n"))
    get_format("qwen").check(tok, tools)


def test_templates_that_cannot_render_tool_turns_are_refused(qwen_style_tokenizer):
    with pytest.raises(ValueError, match="no chat template"):
        QwenFormat().check(None)
    tok = qwen_style_tokenizer
    saved = tok.chat_template
    try:
        # a template that drops tool messages
        tok.chat_template = ("{%- for m in messages -%}{%- if m.role != 'tool' -%}"
                             "{{- '<|im_start|>' + m.role + '\\n' + (m.content or '') + '<|im_end|>\\n' -}}"
                             "{%- endif -%}{%- endfor -%}"
                             "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}")
        with pytest.raises(ValueError, match="does not render 'tool' messages"):
            QwenFormat().check(tok)
        # Qwen3's quirk: the last assistant turn gets an empty <think> block, an earlier one does not
        tok.chat_template = ("{%- for m in messages -%}"
                             "{{- '<|im_start|>' + m.role + '\\n' -}}"
                             "{%- if m.role == 'assistant' and loop.last -%}"
                             "{{- '<think>\\n\\n</think>\\n\\n' -}}{%- endif -%}"
                             "{{- (m.content or '') + '<|im_end|>\\n' -}}{%- endfor -%}"
                             "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}")
        obs = render_tool_turn(tok, [ToolResult("calculator", "1")])
        assert obs == "\n<|im_start|>tool\n1<|im_end|>\n<|im_start|>assistant\n"
        # a template that closes turns with another token than the EOS
        tok.chat_template = ("{%- for m in messages -%}"
                             "{{- '<|im_start|>' + m.role + '\\n' + (m.content or '') + '<|endoftext|>\\n' -}}"
                             "{%- endfor -%}")
        with pytest.raises(ValueError, match="does not end an assistant turn with '<\\|im_end\\|>'"):
            render_tool_turn(tok, [ToolResult("calculator", "1")])
    finally:
        tok.chat_template = saved


# ---------------------------------------------------------------------------------------------
# smoke format


def test_smoke_format_is_written_in_the_smoke_tokenizers_characters(tmp_path):
    from transformers import AutoTokenizer

    from rlrecipes.data.smoke import CHARS, build_smoke_tokenizer

    assert SMOKE_ALPHABET == set(CHARS)
    tok = AutoTokenizer.from_pretrained(str(build_smoke_tokenizer(tmp_path)))
    SmokeFormat().check(tok, ToolRegistry(["calculator"]).schemas())
    response = "c(407+512)" + SmokeFormat(bare=False).render_observation([ToolResult("calculator", "919")]) + "919"
    assert response == "c(407+512):919=919"
    ids = tok(response, add_special_tokens=False)["input_ids"]
    assert tok.unk_token_id not in ids and tok.decode(ids) == response
    with pytest.raises(ValueError, match="not registered"):
        SmokeFormat({"x": ("python", "code")}).check(tok, ToolRegistry(["calculator"]).schemas())
    with pytest.raises(ValueError, match="alias 'z'"):
        SmokeFormat({"z": ("calculator", "expression")})


def test_smoke_parses_calls_and_pauses_when_one_closes():
    fmt = SmokeFormat(bare=False)
    assert not fmt.call_complete("12")
    assert not fmt.call_complete("c(407+(5")
    assert fmt.call_complete("c(407+(5*2))")
    assert not fmt.call_complete("c(4):14:1")
    turn = fmt.parse("c((1+2)*3)")
    assert [(c.name, c.arguments, c.error) for c in turn.calls] == [("calculator", {"expression": "(1+2)*3"}, None)]
    calls = fmt.parse("c(1+1)a(2)c(3").calls
    assert [c.name for c in calls] == ["calculator", "", "calculator"]
    assert calls[0].error is None and "unknown tool letter 'a'" in calls[1].error and "unterminated" in calls[2].error
    results = ToolExecutor(ToolRegistry(["calculator"])).run(calls)
    assert fmt.render_observation(results) == ":2=:?=:?="
    assert fmt.render_observation([ToolResult("calculator", "0.25"), ToolResult("calculator", "1e+30"),
                                   ToolResult("calculator", "-3")]) == ":0.25=:?=:-3="
    assert fmt.parse("407").calls == [] and fmt.parse("407").content == "407"
    with pytest.raises(ValueError, match="unknown tool format 'hermes'"):
        get_format("hermes")


def test_tool_results_in_json_survive_the_qwen_round_trip():
    """A tool's JSON output inside an observation does not confuse the parser of the next turn."""
    payload = json.dumps({"tool_call": "<tool_call>x</tool_call>"})
    turn = QwenFormat().parse(f"The tool said {payload!s}.")
    assert len(turn.calls) == 1 and turn.calls[0].error  # a call-shaped string in the text is parsed, as an error


def test_smoke_bare_calls_are_one_letter_with_the_samples_arguments():
    fmt = SmokeFormat()
    assert fmt.stop_text() == ["c"] and SmokeFormat(bare=False).stop_text() == [")"]
    assert fmt.call_complete("3c") and not fmt.call_complete("3x") and not fmt.call_complete("")
    turn = fmt.parse("1xc")
    assert turn.content == "1x" and [(c.name, c.arguments, c.error) for c in turn.calls] == [("calculator", {}, None)]
    every = SmokeFormat({ch: ("calculator", "expression") for ch in "abcxy"})
    assert every.stop_text() == list("abcxy") and [c.name for c in every.parse("1xc").calls] == ["calculator"] * 2
    two = SmokeFormat({"c": ("calculator", "expression"), "x": ("python", "code")})
    assert two.stop_text() == ["c", "x"] and [c.name for c in two.parse("xc").calls] == ["python", "calculator"]
