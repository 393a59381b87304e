"""The data recipe's faults, on the embedded target's real tokenizer: the stop set, and training
on the ids the target generated (not decoded, stripped and re-tokenized text)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from eyas.data.conversations import DataError, render_prompt, render_with_loss_mask
from eyas.target.model import load_tokenizer_and_config, stop_token_ids
from stages.extract import render_split, sample_of

IM_END = 2


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer_and_config()[0]


def test_the_stop_set_joins_the_tokenizer_eos_and_the_generation_config(tok):
    assert tok.eos_token_id == IM_END and stop_token_ids(tok, None) == [IM_END]
    # the small input: eos set to <|endoftext|> (id 0), generation_config lists [0, 2]
    eot = SimpleNamespace(eos_token_id=tok.convert_tokens_to_ids("<|endoftext|>"))
    assert eot.eos_token_id == 0
    assert stop_token_ids(eot, SimpleNamespace(eos_token_id=[0, 2])) == [0, 2]
    # Llama-3-Instruct: tokenizer eos <|end_of_text|>, generation_config [128001, 128008, 128009]
    assert stop_token_ids(SimpleNamespace(eos_token_id=128001),
                          SimpleNamespace(eos_token_id=[128001, 128008, 128009])) == [128001, 128008, 128009]
    assert stop_token_ids(SimpleNamespace(eos_token_id=None), SimpleNamespace(eos_token_id=None)) == []


def _row(tok, prompt_text, reply_ids, finish):
    msgs = [{"role": "user", "content": prompt_text}]
    prompt_ids = render_prompt(tok, msgs)
    content = tok.decode(reply_ids, skip_special_tokens=True).strip()
    return {"id": "c1", "messages": msgs + [{"role": "assistant", "content": content}],
            "prompt_ids": prompt_ids, "reply_ids": reply_ids, "finish_reason": finish}


def test_a_cut_reply_carries_no_supervised_end_of_turn(tok):
    reply = tok(" Sure, here is a long answer that", add_special_tokens=False)["input_ids"]
    row = _row(tok, "Tell me a story", reply, "length")
    s = sample_of(tok, row, 512)
    n = len(row["prompt_ids"])
    assert s["input_ids"] == row["prompt_ids"] + reply and s["loss_mask"] == [0] * n + [1] * len(reply)
    assert IM_END not in s["input_ids"][n:]
    # the fault it replaces: rendering the decoded text again supervises <|im_end|> after the cut
    old = render_with_loss_mask(tok, row["messages"], 512)
    assert IM_END in [i for i, m in zip(old["input_ids"], old["loss_mask"]) if m]


def test_a_finished_reply_keeps_the_stop_the_target_wrote(tok):
    reply = tok(" Hi!", add_special_tokens=False)["input_ids"] + [IM_END]
    s = sample_of(tok, _row(tok, "Hello", reply, "stop"), 512)
    sup = [i for i, m in zip(s["input_ids"], s["loss_mask"]) if m]
    assert sup == reply and sup[-1] == IM_END


def test_the_supervised_ids_are_the_generated_ids(tok):
    # a leading space: ' Sure' is 16096; strip + re-tokenize would give 'Sure' (34355)
    sure = tok(" Sure", add_special_tokens=False)["input_ids"]
    assert sure == [16096] and tok("Sure", add_special_tokens=False)["input_ids"] == [34355]
    # a literal '<|im_end|>' the target wrote as ordinary pieces stays ordinary pieces
    pieces = tok(" use <|im_end|> here", add_special_tokens=False, split_special_tokens=True)["input_ids"]
    assert IM_END not in pieces
    reply = sure + pieces + [IM_END]
    row = _row(tok, "Hi", reply, "stop")
    s = sample_of(tok, row, 512)
    sup = [i for i, m in zip(s["input_ids"], s["loss_mask"]) if m]
    assert sup == reply and sup.count(IM_END) == 1
    old = render_with_loss_mask(tok, row["messages"], 512)
    old_sup = [i for i, m in zip(old["input_ids"], old["loss_mask"]) if m]
    assert old_sup[0] == 34355 and old_sup.count(IM_END) == 2  # the faults the ids avoid


def test_a_sample_longer_than_max_length_is_cut_and_counted(tok):
    reply = tok(" one two three four five", add_special_tokens=False)["input_ids"]
    row = _row(tok, "Count", reply, "length")
    n = len(row["prompt_ids"])
    s = sample_of(tok, row, n + 2)
    assert s["truncated"] and s["input_ids"] == row["prompt_ids"] + reply[:2] and sum(s["loss_mask"]) == 2


class _Refusing:
    """Wraps the real tokenizer; its template raises on a system turn (Gemma-2 style)."""

    def __init__(self, tok):
        self._tok = tok

    def __getattr__(self, name):
        return getattr(self._tok, name)

    def __call__(self, *a, **kw):
        return self._tok(*a, **kw)

    def apply_chat_template(self, messages, **kw):
        if any(m["role"] == "system" for m in messages):
            from jinja2.exceptions import TemplateError
            raise TemplateError("System role not supported")
        return self._tok.apply_chat_template(messages, **kw)


def test_extract_names_the_conversation_a_template_refuses(tok, tmp_path):
    good = {"id": "ok", "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
    bad = {"id": "sys-7", "messages": [{"role": "system", "content": "x"}] + good["messages"]}
    with pytest.raises(DataError, match=r"train: conversation 'sys-7'.*System role not supported"):
        render_split(_Refusing(tok), [good, bad], tmp_path / "train", 64)
    rendered, truncated, empty, refused = render_split(_Refusing(tok), [good, bad, good], tmp_path / "train", 64,
                                                       on_bad_line="skip")
    assert refused == ["sys-7"] and len(rendered) == 2 and empty == 0


def test_the_default_trains_on_the_prompts_it_is_evaluated_on(tok):
    """The default's prompt budget must cover the prompts the eval decodes. At 128 tokens (the
    budget before this test) self-distill kept 179 of the default's 320 code prompts of the time (a single-turn prompt
    cannot lose earlier turns: the rest were dropped) and trained on no context longer than 128
    tokens, while 142 of the 164 HumanEval problems, as the eval renders them, and the chat
    prompts (cut at eval.max_prompt_tokens, 256) are longer."""
    from eyas.data.code import code_conversations
    from eyas.data.conversations import humaneval_prompts, prompt_messages
    from eyas.params.full import default_params
    from stages.self_distill import prompt_budget

    p = default_params()
    budget = prompt_budget(p)
    assert budget + p.distill.max_new_tokens <= p.extract.max_length  # the reply is never cut away
    assert budget >= p.eval.max_prompt_tokens > 0  # chat: the eval's context fits the training one

    def within(prompts):
        return sum(len(render_prompt(tok, m)) <= budget for m in prompts)

    code, _ = code_conversations(p.data.code_prompts, p.seed, p.data.code_packages)
    assert (budget, len(code)) == (256, 600)
    assert within([prompt_messages(c["messages"]) for c in code]) == 599  # self-distill keeps them
    assert within(humaneval_prompts(164)) == 141  # HumanEval: whole problems, as the eval decodes them
