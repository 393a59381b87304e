"""Tests for eyas.data.conversations: sources, splits, JSONL I/O, the assistant-only loss mask, eval prompts;
and the data recipe's faults (docs/data-recipe.md), on the embedded target's real tokenizer: the stop
set, and training on the ids the target generated (not decoded, stripped and re-tokenized text)."""

from __future__ import annotations

import copy
import hashlib
import json
import os
from types import SimpleNamespace

import pytest

from eyas.data.conversations import (
    DataError,
    chat_prompts,
    humaneval_prompts,
    load_conversations,
    prompt_messages,
    read_jsonl,
    render_prompt,
    render_with_loss_mask,
    split_conversations,
    write_jsonl,
)
from eyas.target.model import load_tokenizer_and_config, stop_token_ids
from stages.extract import render_split, sample_of

# The assistant's first reply also appears in the user's turn: the mask must find the right copy.
CHAT = [
    {"role": "user", "content": "Say Hello there, please."},
    {"role": "assistant", "content": "Hello there"},
    {"role": "user", "content": "And now say goodbye in French."},
    {"role": "assistant", "content": "Au revoir !\nA bientot."},
]

# Meta's Llama-3 instruct template (tokenizer_config.json of Meta-Llama-3-8B-Instruct).
LLAMA3_TEMPLATE = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'"
    "+ message['content'] | trim + '<|eot_id|>' %}"
    "{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}"
    "{{ content }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}"
    "{% endif %}"
)


def supervised_spans(tok, out) -> list[str]:
    """Decode each maximal run of loss_mask == 1 separately."""
    spans, cur = [], []
    for i, m in zip(out["input_ids"], out["loss_mask"]):
        if m:
            cur.append(i)
        elif cur:
            spans.append(cur)
            cur = []
    if cur:
        spans.append(cur)
    return [tok.decode(s, skip_special_tokens=False) for s in spans]


def unsupervised_text(tok, out) -> str:
    ids = [i for i, m in zip(out["input_ids"], out["loss_mask"]) if not m]
    return tok.decode(ids, skip_special_tokens=False)


@pytest.fixture(scope="module")
def llama3_tokenizer(smollm_tokenizer):
    tok = copy.deepcopy(smollm_tokenizer)
    tok.add_special_tokens({"additional_special_tokens": [
        "<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]})
    tok.bos_token = "<|begin_of_text|>"
    tok.chat_template = LLAMA3_TEMPLATE
    return tok


# ------------------------------------------------------------------ loss mask, real tokenizers


def test_chatml_golden_mask(smollm_tokenizer):
    tok = smollm_tokenizer
    out = render_with_loss_mask(tok, CHAT, max_length=4096)
    assert out["truncated"] is False
    assert len(out["input_ids"]) == len(out["loss_mask"])
    # The ids are exactly the template's own tokenization.
    assert out["input_ids"] == list(tok.apply_chat_template(CHAT, tokenize=True)["input_ids"])
    assert supervised_spans(tok, out) == [
        "Hello there<|im_end|>", "Au revoir !\nA bientot.<|im_end|>"]
    # Everything else (default system prompt, user turns, headers, the '\n' after <|im_end|>)
    # is unsupervised, and in full.
    rest = unsupervised_text(tok, out)
    assert rest == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
        "<|im_end|>\n<|im_start|>user\nSay Hello there, please.<|im_end|>\n<|im_start|>assistant\n"
        "\n<|im_start|>user\nAnd now say goodbye in French.<|im_end|>\n<|im_start|>assistant\n\n"
    )


def test_chatml_explicit_system_not_supervised(smollm_tokenizer):
    msgs = [{"role": "system", "content": "Be brief."}] + CHAT[:2]
    out = render_with_loss_mask(smollm_tokenizer, msgs, max_length=4096)
    assert supervised_spans(smollm_tokenizer, out) == ["Hello there<|im_end|>"]
    assert "SmolLM" not in smollm_tokenizer.decode(out["input_ids"])


def test_llama3_golden_mask(llama3_tokenizer):
    tok = llama3_tokenizer
    msgs = [dict(m) for m in CHAT]
    msgs[1]["content"] = "  Hello there \n"  # the template trims it
    out = render_with_loss_mask(tok, msgs, max_length=4096)
    assert out["input_ids"] == list(tok.apply_chat_template(msgs, tokenize=True)["input_ids"])
    assert out["input_ids"][0] == tok.convert_tokens_to_ids("<|begin_of_text|>")
    assert supervised_spans(tok, out) == [
        "Hello there<|eot_id|>", "Au revoir !\nA bientot.<|eot_id|>"]
    assert unsupervised_text(tok, out) == (
        "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nSay Hello there, please."
        "<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n"
        "<|start_header_id|>user<|end_header_id|>\n\nAnd now say goodbye in French.<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )


def test_truncation(smollm_tokenizer):
    full = render_with_loss_mask(smollm_tokenizer, CHAT, max_length=4096)
    n = len(full["input_ids"]) - 3
    cut = render_with_loss_mask(smollm_tokenizer, CHAT, max_length=n)
    assert cut["truncated"] is True
    assert cut["input_ids"] == full["input_ids"][:n]
    assert cut["loss_mask"] == full["loss_mask"][:n]
    exact = render_with_loss_mask(smollm_tokenizer, CHAT, max_length=len(full["input_ids"]))
    assert exact["truncated"] is False


def test_no_chat_template_raises(smollm_tokenizer):
    tok = copy.deepcopy(smollm_tokenizer)
    tok.chat_template = None
    with pytest.raises(DataError, match="no chat template"):
        render_with_loss_mask(tok, CHAT, max_length=64)
    with pytest.raises(DataError, match="no chat template"):
        render_prompt(tok, CHAT[:1])


def test_render_prompt(smollm_tokenizer):
    tok = smollm_tokenizer
    ids = render_prompt(tok, prompt_messages(CHAT))
    assert tok.decode(ids).endswith(
        "<|im_start|>user\nAnd now say goodbye in French.<|im_end|>\n<|im_start|>assistant\n")
    assert "Au revoir" not in tok.decode(ids)


# ------------------------------------------------------------------ eval prompts


def test_prompt_messages():
    assert prompt_messages(CHAT) == CHAT[:3]
    trailing_user = CHAT + [{"role": "user", "content": "thanks"}]
    assert prompt_messages(trailing_user) == CHAT[:3]
    sys_first = [{"role": "system", "content": "S"}] + CHAT[:2]
    assert prompt_messages(sys_first) == sys_first[:2]
    assert prompt_messages([{"role": "assistant", "content": "hi"}]) == []


def test_chat_prompts_skip_empty():
    convs = [
        {"id": "a", "messages": [{"role": "assistant", "content": "no user"}]},
        {"id": "b", "messages": CHAT},
        {"id": "c", "messages": CHAT[:2]},
        {"id": "d", "messages": CHAT[:2]},
    ]
    assert chat_prompts(convs, 2) == [CHAT[:3], CHAT[:1]]
    assert len(chat_prompts(convs, 10)) == 3


def test_humaneval_prompts():
    ps = humaneval_prompts(3)
    assert len(ps) == 3 and all(len(p) == 1 and p[0]["role"] == "user" for p in ps)
    c = ps[0][0]["content"]
    head = "Complete the following Python function. Reply with code only.\n\n```python\n"
    assert c.startswith(head)
    assert "def has_close_elements(" in c and c.endswith('    """\n```')
    assert len(humaneval_prompts(164)) == 164
    with pytest.raises(DataError):
        humaneval_prompts(165)


# ------------------------------------------------------------------ JSONL sources


def _write(path, lines: list[str | bytes]) -> str:
    with open(path, "wb") as f:
        for line in lines:
            f.write((line if isinstance(line, bytes) else line.encode()) + b"\n")
    return str(path)


SHAREGPT = {"id": "sg1", "conversations": [
    {"from": "system", "value": "Be kind."},
    {"from": "human", "value": "Hi"},
    {"from": "gpt", "value": "Hello!"},
]}
OPENAI = {"messages": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]}
NO_ASSISTANT = {"id": "na", "messages": [{"role": "user", "content": "anyone?"}]}


def test_jsonl_sharegpt_and_messages(tmp_path):
    src = _write(tmp_path / "mix.jsonl", [json.dumps(SHAREGPT), "", json.dumps(OPENAI),
                                          json.dumps(NO_ASSISTANT)])
    convs, stats = load_conversations(src)
    assert convs == [
        {"id": "sg1", "messages": [{"role": "system", "content": "Be kind."},
                                   {"role": "user", "content": "Hi"},
                                   {"role": "assistant", "content": "Hello!"}]},
        {"id": "mix.jsonl:3", "messages": OPENAI["messages"]},
    ]
    assert stats["read"] == 3 and stats["kept"] == 2
    assert stats["skipped_no_assistant"] == 1 and stats["skipped_bad_line"] == 0


def test_jsonl_malformed_line_names_file_and_line(tmp_path):
    lines = [json.dumps(OPENAI), '{"messages": [', json.dumps(SHAREGPT)]
    src = _write(tmp_path / "bad.jsonl", lines)
    with pytest.raises(DataError, match=r"bad\.jsonl:2: malformed JSON"):
        load_conversations(src)
    convs, stats = load_conversations(src, on_bad_line="skip")
    assert [c["id"] for c in convs] == ["bad.jsonl:1", "sg1"]
    assert stats["skipped_bad_line"] == 1 and stats["kept"] == 2 and stats["read"] == 3


def test_jsonl_unknown_role(tmp_path):
    bad = {"conversations": [{"from": "human", "value": "x"}, {"from": "bing", "value": "y"}]}
    src = _write(tmp_path / "r.jsonl", [json.dumps(OPENAI), json.dumps(bad)])
    with pytest.raises(DataError, match=r"r\.jsonl:2: .*unknown role 'bing'"):
        load_conversations(src)
    bad2 = {"messages": [{"role": "tool", "content": "x"}]}
    src2 = _write(tmp_path / "r2.jsonl", [json.dumps(bad2)])
    with pytest.raises(DataError, match=r"r2\.jsonl:1: .*unknown role 'tool'"):
        load_conversations(src2)


def test_jsonl_non_utf8(tmp_path):
    src = _write(tmp_path / "enc.jsonl", [json.dumps(OPENAI), b'{"messages": "caf\xe9"}'])
    with pytest.raises(DataError, match=r"enc\.jsonl:2: not valid UTF-8"):
        load_conversations(src)
    _, stats = load_conversations(src, on_bad_line="skip")
    assert stats["skipped_bad_line"] == 1


def test_jsonl_empty_text_and_empty_result(tmp_path):
    empty = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": " "}]}
    src = _write(tmp_path / "e.jsonl", [json.dumps(empty)])
    with pytest.raises(DataError, match=r"e\.jsonl:1: .*empty text"):
        load_conversations(src)
    with pytest.raises(DataError, match="no usable conversations"):
        load_conversations(src, on_bad_line="skip")
    src2 = _write(tmp_path / "n.jsonl", [json.dumps(NO_ASSISTANT)])
    with pytest.raises(DataError, match="no usable conversations"):
        load_conversations(src2)


def test_missing_source_and_bad_mode(tmp_path):
    with pytest.raises(DataError, match="no such file"):
        load_conversations(str(tmp_path / "nope.jsonl"))
    with pytest.raises(DataError, match="on_bad_line"):
        load_conversations("chitchat", on_bad_line="ignore")


def test_write_read_jsonl_roundtrip(tmp_path):
    rows = [{"id": "a", "messages": [{"role": "user", "content": "héllo ✓"}]}, {"id": "b"}]
    path = tmp_path / "sub" / "x.jsonl"
    assert write_jsonl(path, rows) == 2
    assert read_jsonl(path) == rows
    assert [p.name for p in path.parent.iterdir()] == ["x.jsonl"]  # no temp file left
    umask = os.umask(0)
    os.umask(umask)
    assert path.stat().st_mode & 0o777 == 0o666 & ~umask  # not mkstemp's 0600
    path.write_text('{"a": 1}\n{oops\n')
    with pytest.raises(DataError, match=r"x\.jsonl:2: malformed JSON"):
        read_jsonl(path)


def test_write_jsonl_unencodable_row_names_file_line_id_and_keeps_the_file(tmp_path):
    path = tmp_path / "x.jsonl"
    path.write_text("previous\n")
    good = {"id": "a", "messages": [{"role": "user", "content": "hi"}]}
    for row, reason in [
        ({"id": "b", "messages": [{"role": "user", "content": "bad \ud800 x"}]},
         "'utf-8' codec can't encode character '\\ud800' in position 58: surrogates not allowed"),
        ({"id": 7, "tags": {"x"}}, "Object of type set is not JSON serializable"),
    ]:
        with pytest.raises(DataError) as e:
            write_jsonl(path, [good, row])
        assert str(e.value) == f"{path}:2: conversation {str(row['id'])!r}: cannot be written as UTF-8 JSON: {reason}"
        assert path.read_text() == "previous\n"  # nothing written
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x.jsonl"]  # no temp file left


def test_read_jsonl_unparseable_lines_name_file_and_line(tmp_path):
    path = tmp_path / "x.jsonl"
    for line, reason in [("[" * 200000 + "]" * 200000, "JSON nested too deeply to parse"),
                         ('{"id": ' + "1" * 5000 + "}", "JSON not parseable: Exceeds the limit (4300 digits)")]:
        path.write_text('{"id": "a"}\n' + line + "\n")
        with pytest.raises(DataError) as e:
            read_jsonl(path)
        assert str(e.value).startswith(f"{path}:2: {reason}")


# ------------------------------------------------------------------ splits and chitchat


def _convs(n):
    return [{"id": f"c{i}", "messages": CHAT[:2]} for i in range(n)]


def test_split_deterministic_and_disjoint():
    convs = _convs(50)
    a = split_conversations(convs, val=5, test=4, publish=6, max_conversations=40, seed=7)
    b = split_conversations(list(reversed(convs)), val=5, test=4, publish=6,
                            max_conversations=40, seed=7)
    assert a == b  # independent of input order
    sizes = {k: len(v) for k, v in a.items()}
    assert sizes == {"train": 25, "val": 5, "test": 4, "publish": 6}
    ids = [c["id"] for v in a.values() for c in v]
    assert len(ids) == len(set(ids)) == 40
    # Independently computed: the first val id is the smallest sha256("7:<id>").
    order = sorted(c["id"] for c in convs)
    order.sort(key=lambda i: hashlib.sha256(f"7:{i}".encode()).hexdigest())
    assert [c["id"] for c in a["val"]] == order[:5]
    assert sorted(c["id"] for c in a["train"]) == sorted(order[15:40])
    other = split_conversations(convs, val=5, test=4, publish=6, max_conversations=40, seed=8)
    assert other["val"] != a["val"]
    everything = split_conversations(convs, val=1, test=1, publish=1, max_conversations=0, seed=0)
    assert len(everything["train"]) == 47


def test_split_empty_train_raises():
    with pytest.raises(DataError) as e:
        split_conversations(_convs(10), val=5, test=3, publish=2, max_conversations=0, seed=0)
    assert str(e.value) == (
        "train split is empty: 10 conversations taken, val+test+publish = 10 (data.val 5 + data.test 3 "
        "+ data.publish 2); in params.yaml lower data.val, data.test or data.publish, or raise "
        "data.max_conversations (now 0, 0 = all), or add conversations to data.source")


def test_chitchat_source():
    convs, stats = load_conversations("chitchat")
    assert stats["read"] == 7168
    assert stats["kept"] == len(convs) == 7168 - stats["skipped_no_assistant"]
    assert len({c["id"] for c in convs}) == len(convs)
    for c in convs:
        roles = [m["role"] for m in c["messages"]]
        assert roles[0] == "user" and "assistant" in roles
        assert all(a != b for a, b in zip(roles, roles[1:]))  # turns alternate
        assert all(m["content"].strip() for m in c["messages"])
    first = next(c for c in convs if c["id"] == "a07edb12-6b91-4138-b11e-02421888d699")
    assert first["messages"][:2] == [
        {"role": "user", "content": "Hello\nHow are you doing today?"},
        {"role": "assistant", "content": "whats up MD\nim doing good\nhow are you doing?"},
    ]


# --- the data recipe's faults, on the embedded target's tokenizer -------------------------------

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
