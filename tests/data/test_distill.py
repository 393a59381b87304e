"""Self-distillation: batched greedy generation equals unbatched greedy; regenerate; resuming a
killed run from its journal; the stage."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import GenerationConfig

from eyas.data.conversations import DataError, read_jsonl, write_jsonl
from eyas.data.distill import Journal, fit_prompt, generate_batch, plan_prompts, regenerate, turn_prompts
from eyas.eval.speculative import greedy_generate
from eyas.params.full import ParamsError, load_params
from stages import self_distill
from tests.tiny import VOCAB, tiny_target

LENGTHS = (3, 17, 9, 30, 1, 12)


@pytest.fixture(scope="module")
def target():
    return tiny_target()


@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in LENGTHS]


@pytest.fixture(scope="module")
def reference(target, prompts):
    """Unbatched greedy (one prompt, no padding, KV cache): the eval stage's reference decoder."""
    return [greedy_generate(target.model, p, max_new_tokens=16, stop_ids=[]) for p in prompts]


def test_batched_equals_unbatched_greedy(target, prompts, reference):
    # one batch with lengths 1..30: up to 29 left pads per row; exact token equality required
    assert generate_batch(target.model, prompts, 16, pad_id=0, stop_ids=[]) == reference
    # other batchings and another pad id give the same tokens
    for bs in (1, 4):
        out = [o for i in range(0, len(prompts), bs)
               for o in generate_batch(target, prompts[i:i + bs], 16, pad_id=VOCAB - 1, stop_ids=[])]
        assert out == reference


def test_a_static_cache_gives_the_same_tokens(target, prompts, reference):
    """transformers' preallocated cache (dev/bench/bench_generate.py times it on a GPU): the same
    left-padded batch decodes to the unbatched reference token for token."""
    assert generate_batch(target.model, prompts, 16, pad_id=0, stop_ids=[], cache_implementation="static",
                          decode="dynamic") == reference


def test_the_comparison_can_fail(target, prompts, reference):
    """Sanity: the same batch with the pads made visible (attention mask all ones) diverges, so
    the equality above really checks that padding is masked."""
    T = max(LENGTHS)
    ids = torch.tensor([[0] * (T - len(p)) + p for p in prompts])
    gc = GenerationConfig(do_sample=False, max_new_tokens=16, pad_token_id=0, eos_token_id=None)
    out = target.model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                                generation_config=gc)[:, T:].tolist()
    assert out != reference


def test_stops_at_eos_per_row(target, prompts, reference):
    eos = reference[1][3]  # a token the second prompt generates at step 3
    expected = [r[: r.index(eos) + 1] if eos in r else r for r in reference]
    out = generate_batch(target.model, prompts, 16, pad_id=0, stop_ids=[eos])
    assert out == expected
    assert out[1][-1] == eos and len(out[1]) <= 4
    assert any(len(o) == 16 for o in out)  # rows without eos run the full budget


def test_stops_at_any_id_of_the_stop_set(target, prompts, reference):
    """Two stop ids (a tokenizer EOS and a generation-config end-of-turn): each row ends at the
    first of either, as HF generate does with a list ``eos_token_id``."""
    a, b = reference[1][3], reference[3][5]
    stops = {a, b}
    expected = [next((r[: j + 1] for j, x in enumerate(r) if x in stops), r) for r in reference]
    assert generate_batch(target.model, prompts, 16, pad_id=0, stop_ids=[a, b]) == expected
    assert expected != [next((r[: j + 1] for j, x in enumerate(r) if x == a), r) for r in reference]


class StubTokenizer:
    """Characters <-> tiny-vocab ids; a 'chat template' that joins contents with '|'."""

    chat_template = "stub"
    pad_token_id = None

    def __init__(self, eos_token_id: int):
        self.eos_token_id = eos_token_id

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=False):
        return "|".join(m["content"] for m in messages) + ("|" if add_generation_prompt else "")

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [ord(c) % VOCAB for c in text]}

    def decode(self, ids, skip_special_tokens=False):
        return "".join("" if (skip_special_tokens and i == self.eos_token_id) else chr(33 + i % 90)
                       for i in ids)


QUESTIONS = ("why?", "tell me more", "ok then", "what is up", "zz")  # varied first greedy tokens


def _conversations():
    convs = [{"id": f"c{i}", "messages": [
        {"role": "user", "content": "hi " * (i + 1)},
        {"role": "assistant", "content": "human reply"},
        {"role": "user", "content": QUESTIONS[i]},
        {"role": "assistant", "content": "another human reply"},
        {"role": "user", "content": "trailing user turn is dropped"}]} for i in range(5)]
    convs.insert(2, {"id": "no-prompt", "messages": [{"role": "assistant", "content": "hello"}]})
    return convs


def _stub_target(convs, eos_from: int):
    """Tiny target + stub tokenizer whose EOS is the first greedy token of conversation
    ``eos_from``: that reply is decoded empty and must be dropped."""
    t = tiny_target()
    tok = StubTokenizer(eos_token_id=-1)
    first = greedy_generate(t.model, tok(tok.apply_chat_template(convs[eos_from]["messages"][:3],
                                                                 add_generation_prompt=True))["input_ids"],
                            max_new_tokens=1, stop_ids=[])[0]
    tok.eos_token_id = first
    t.tokenizer = tok
    return t


def test_regenerate_replaces_last_turn_and_drops_empty(target):
    convs = _conversations()
    t = _stub_target(convs, eos_from=1)
    tok = t.tokenizer
    items, plan = plan_prompts(tok, convs, turns="last", max_prompt_tokens=None)
    new, stats = regenerate(t, items, max_new_tokens=8, batch_size=2)
    # expected, from the unbatched reference decoder
    exp, empty, trunc = [], 0, 0
    for c in convs:
        if c["id"] == "no-prompt":
            continue
        msgs = c["messages"][:3]
        prompt = tok(tok.apply_chat_template(msgs, add_generation_prompt=True))["input_ids"]
        ids = greedy_generate(t.model, prompt, max_new_tokens=8, stop_ids=[tok.eos_token_id])
        trunc += ids[-1] != tok.eos_token_id
        text = tok.decode(ids, skip_special_tokens=True).strip()
        if not text:
            empty += 1
            continue
        exp.append({"id": c["id"], "messages": msgs + [{"role": "assistant", "content": text}],
                    "prompt_ids": prompt, "reply_ids": ids,
                    "finish_reason": "stop" if ids[-1] == tok.eos_token_id else "length"})
    assert 1 <= empty < 5 and 1 <= trunc < 5
    assert new == exp  # input order, ids kept, prompt + one generated assistant turn + the exact ids
    assert stats["dropped_empty"] == empty and plan["dropped_no_prompt"] == 1
    assert plan["prompts"] == 5 and stats["kept"] == 5 - empty and stats["truncated"] == trunc
    assert all(c["messages"][1]["content"] == "human reply" for c in new)  # earlier turns kept
    # a cut reply ends without the stop token: nothing teaches a stop the target never made
    assert all((r["reply_ids"][-1] == tok.eos_token_id) == (r["finish_reason"] == "stop") for r in new)


def test_all_turns_makes_one_sample_per_assistant_turn():
    convs = _conversations()
    tok = StubTokenizer(eos_token_id=-1)
    assert turn_prompts(convs[0]["messages"], "all") == [(1, convs[0]["messages"][:1]),
                                                         (3, convs[0]["messages"][:3])]
    assert turn_prompts(convs[0]["messages"], "last") == [(3, convs[0]["messages"][:3])]
    assert turn_prompts(convs[2]["messages"], "all") == []  # an assistant turn with no user turn before it
    items, plan = plan_prompts(tok, convs, turns="all", max_prompt_tokens=None)
    assert [it["id"] for it in items] == [f"c{i}#{j}" for i in range(5) for j in (1, 3)]
    assert plan["prompts"] == 10 and plan["dropped_no_prompt"] == 1
    assert items[1]["prompt_ids"] == tok(tok.apply_chat_template(convs[0]["messages"][:3],
                                                                 add_generation_prompt=True))["input_ids"]
    with pytest.raises(ValueError, match="distill.turns"):
        turn_prompts(convs[0]["messages"], "every")


class RefusingTokenizer(StubTokenizer):
    """A Gemma-2-style template: raises on a system turn (as its ``raise_exception`` does)."""

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=False):
        if any(m["role"] == "system" for m in messages):
            from jinja2.exceptions import TemplateError
            raise TemplateError("System role not supported")
        return super().apply_chat_template(messages, tokenize, add_generation_prompt)


def test_a_template_refusal_names_the_conversation_or_is_skipped_and_counted():
    convs = _conversations()
    convs[3] = {"id": "sys-1", "messages": [{"role": "system", "content": "be brief"}] + convs[3]["messages"]}
    tok = RefusingTokenizer(eos_token_id=-1)
    with pytest.raises(DataError, match=r"conversation 'sys-1'.*System role not supported.*on_bad_line"):
        plan_prompts(tok, convs, turns="last", max_prompt_tokens=None)
    items, plan = plan_prompts(tok, convs, turns="all", max_prompt_tokens=None, on_bad_line="skip")
    assert plan["skipped_template"] == 1 and plan["skipped_template_ids"] == ["sys-1"]
    assert len(items) == 8 and not any(it["id"].startswith("sys-1") for it in items)


class AlternationTokenizer(StubTokenizer):
    """A template that refuses two turns of one role in a row (as Llama-2's and Gemma's do)."""

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=False):
        if any(a["role"] == b["role"] for a, b in zip(messages, messages[1:])):
            raise ValueError("Conversation roles must alternate user/assistant/user/assistant/...")
        return super().apply_chat_template(messages, tokenize, add_generation_prompt)


def test_a_refusal_early_in_a_conversation_counts_whatever_the_budget_keeps():
    """Two user turns in a row at the start: the conversation is refused (or skipped and counted) even
    when the prompt budget keeps only its last turn, which the template alone would accept."""
    turns = [("user", "hi"), ("user", "hello?"), ("assistant", "a" * 30), ("user", "b" * 30),
             ("assistant", "c" * 30), ("user", "why"), ("assistant", "d")]
    convs = [{"id": "bad-start", "messages": [{"role": r, "content": c} for r, c in turns]}]
    tok = AlternationTokenizer(eos_token_id=-1)
    assert fit_prompt(tok, convs[0]["messages"][:6], 5)[0] == [convs[0]["messages"][5]]  # 'why|' alone fits
    for turns_mode in ("last", "all"):
        with pytest.raises(DataError, match=r"conversation 'bad-start'.*roles must alternate"):
            plan_prompts(tok, convs, turns=turns_mode, max_prompt_tokens=5)
        items, plan = plan_prompts(tok, convs, turns=turns_mode, max_prompt_tokens=5, on_bad_line="skip")
        assert items == [] and plan["skipped_template_ids"] == ["bad-start"]


class BrokenTokenizer(StubTokenizer):
    """A template that fails for a reason other than refusing the conversation (a bug, not a refusal)."""

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=False):
        if any(m["content"].startswith("b") for m in messages):
            raise TypeError("can only concatenate str (not \"NoneType\") to str")
        return super().apply_chat_template(messages, tokenize, add_generation_prompt)


def test_an_error_that_is_not_a_refusal_is_not_counted_as_one():
    """Only a refusal (jinja2's TemplateError, or ValueError) is skipped and counted under
    ``on_bad_line: skip``; any other error from the tokenizer propagates as itself."""
    convs = [{"id": "ok", "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]},
             {"id": "bug", "messages": [{"role": "user", "content": "bad"}, {"role": "assistant", "content": "x"}]}]
    tok = BrokenTokenizer(eos_token_id=-1)
    with pytest.raises(TypeError, match="concatenate"):
        plan_prompts(tok, convs, turns="all", max_prompt_tokens=None, on_bad_line="skip")
    # jinja's own errors for a broken template (not its raise_exception) propagate too
    from jinja2.exceptions import TemplateSyntaxError, UndefinedError
    for err in (TemplateSyntaxError("unexpected '}'", 1), UndefinedError("'dict object' has no attribute 'nope'")):
        def broken(*_a, err=err, **_k):
            raise err
        tok.apply_chat_template = broken
        with pytest.raises(type(err)):
            plan_prompts(tok, convs, turns="all", max_prompt_tokens=None, on_bad_line="skip")
    tok = BrokenTokenizer(eos_token_id=-1)
    # negative control: the conversation without the failing content plans as usual
    items, plan = plan_prompts(tok, convs[:1], turns="all", max_prompt_tokens=None, on_bad_line="skip")
    assert [it["id"] for it in items] == ["ok#1"] and plan["skipped_template"] == 0


def test_fit_prompt_drops_earliest_turns():
    tok = StubTokenizer(eos_token_id=-1)  # one character = one token
    msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "u" * 50},
            {"role": "assistant", "content": "a" * 50}, {"role": "user", "content": "v" * 10},
            {"role": "assistant", "content": "b" * 10}, {"role": "user", "content": "w" * 10}]
    assert fit_prompt(tok, msgs, None)[0] == msgs
    assert fit_prompt(tok, msgs, 200)[0] == msgs  # fits: unchanged (S|u50|a50|v10|b10|w10| = 136)
    kept, ids = fit_prompt(tok, msgs, 40)
    assert kept == [msgs[0]] + msgs[3:] and len(ids) == 35 <= 40  # system kept, starts at a user turn
    assert fit_prompt(tok, msgs, 20) == ([msgs[0], msgs[5]], tok(tok.apply_chat_template(
        [msgs[0], msgs[5]], add_generation_prompt=True))["input_ids"])
    assert fit_prompt(tok, msgs, 5) is None  # even the last user turn is too long


class CountingTokenizer(StubTokenizer):
    """Records the length of every text it renders."""

    def __init__(self):
        super().__init__(eos_token_id=-1)
        self.rendered: list[int] = []

    def __call__(self, text, add_special_tokens=False):
        self.rendered.append(len(text))
        return super().__call__(text, add_special_tokens)


def _leftmost_fitting(tok, msgs, budget):
    """The reference: render every candidate start (whole prompt, then each later user turn) in
    order and take the first that fits."""
    n_sys = next((i for i, m in enumerate(msgs) if m["role"] != "system"), len(msgs))
    for s in [n_sys] + [i for i in range(n_sys + 1, len(msgs)) if msgs[i]["role"] == "user"]:
        kept = msgs if s == n_sys else msgs[:n_sys] + msgs[s:]
        text = tok.apply_chat_template(kept, add_generation_prompt=True)
        if len(text) <= budget:
            return kept, tok(text)["input_ids"]
    return None


def test_fit_prompt_is_the_leftmost_fitting_start_without_rendering_long_histories():
    import random

    rng = random.Random(0)
    tok = StubTokenizer(eos_token_id=-1)
    for case in range(300):  # histories of 1-40 turns, a system turn or not, turns of 1-30 characters
        msgs = [{"role": "system", "content": "S" * rng.randint(1, 5)}] if case % 3 == 0 else []
        for t in range(rng.randint(1, 40)):
            msgs.append({"role": ("user", "assistant")[t % 2], "content": "x" * rng.randint(1, 30)})
        if msgs[-1]["role"] == "assistant":
            msgs.append({"role": "user", "content": "q"})
        for budget in (1, 5, 20, 60, 200, 2000):
            assert fit_prompt(tok, msgs, budget) == _leftmost_fitting(tok, msgs, budget), (case, budget)
    # a 400-turn history against a 40-token budget: no render is more than a few times the budget
    # (the whole history is 4,800 characters; rendering it for each of its prompts is what made
    # distill.turns: all slow)
    msgs = [{"role": ("user", "assistant")[t % 2], "content": "y" * 11} for t in range(401)]
    counting = CountingTokenizer()
    kept, ids = fit_prompt(counting, msgs, 40)
    assert kept == msgs[-3:] and len(ids) == 36  # three turns of 11 and three '|'
    assert max(counting.rendered) < 4 * 40 and len(counting.rendered) <= 6


def test_plan_applies_the_prompt_budget():
    convs = _conversations()
    tok = StubTokenizer(eos_token_id=-1)
    # c4's prompt 'hi hi hi hi hi |human reply|zz|' has 31 tokens; its last user turn alone 'zz|' 3
    items, stats = plan_prompts(tok, convs, turns="last", max_prompt_tokens=20)
    assert stats["prompts_shortened"] == 5 and stats["dropped_long_prompt"] == 0
    assert all(it["messages"][0]["content"] in QUESTIONS for it in items)
    items, stats = plan_prompts(tok, convs, turns="last", max_prompt_tokens=3)
    assert stats["dropped_long_prompt"] == 4 and stats["prompts"] == 1  # only 'zz|' fits


class Killed(Exception):
    pass


def test_killed_run_resumes_from_its_journal(tmp_path):
    """A run killed after its first batch, rerun with the same journal: the replies equal an
    uninterrupted run's, and only the prompts not yet answered reach the model."""
    convs = _conversations()
    t = _stub_target(convs, eos_from=1)
    convs, _ = plan_prompts(t.tokenizer, convs, turns="last", max_prompt_tokens=None)
    want, _ = regenerate(t, convs, max_new_tokens=8, batch_size=2)
    real = t.model.generate
    seen, kill_at = [], [2]

    def generate(*a, **k):
        seen.append(k["input_ids"].shape[0])
        if len(seen) in kill_at:
            raise Killed
        return real(*a, **k)

    t.model.generate = generate
    key = {"target": "tiny", "max_new_tokens": 8}
    with pytest.raises(Killed):
        regenerate(t, convs, max_new_tokens=8, batch_size=2, journal=Journal(tmp_path / "j.jsonl", key))
    assert len(Journal(tmp_path / "j.jsonl", key).done) == 2  # the first batch (2 prompts) survived
    seen.clear()
    kill_at.clear()
    got, stats = regenerate(t, convs, max_new_tokens=8, batch_size=2, journal=Journal(tmp_path / "j.jsonl", key))
    assert got == want
    assert stats["resumed"] == 2 and sum(seen) == 5 - 2


def test_journal_drops_a_torn_tail_and_a_foreign_key(tmp_path):
    path = tmp_path / "j.jsonl"
    j = Journal(path, {"target": "a"})
    j.add([([1, 2], [7, 8]), ([3], [9])])
    j.remove()
    assert not path.exists()
    j = Journal(path, {"target": "a"})
    j.add([([1, 2], [7, 8]), ([3], [9])])
    with open(path, "a") as f:
        f.write('{"prompt": "abc", "ids": [1')  # killed mid-write
    again = Journal(path, {"target": "a"})
    assert again.get([1, 2]) == [7, 8] and again.get([3]) == [9] and len(again.done) == 2
    again.add([([4], [5])])  # appends after the dropped tail, not onto it
    assert Journal(path, {"target": "a"}).get([4]) == [5]
    assert Journal(path, {"target": "b"}).done == {}  # other target: start afresh
    assert Journal(path, {"target": "a"}).done == {}


def _workspace(tmp_path, distill: dict):
    (tmp_path / "params.yaml").write_text(json.dumps({"distill": distill}))
    conv = tmp_path / "conversations"
    for split in ("train", "val", "publish", "test"):
        write_jsonl(conv / f"{split}.jsonl", _conversations())
    # non-canonical bytes (spacing, unicode escapes): a copy must keep them exactly
    (conv / "val.jsonl").write_bytes(b'{"id": "v",  "messages": [{"role": "user", "content": "caf\\u00e9"},'
                                     b' {"role": "assistant", "content": "ok"}]}\n\n')
    return load_params(tmp_path / "params.yaml"), conv, tmp_path / "distilled", tmp_path / "m.json"


def _no_target(*a, **k):
    raise AssertionError("disabled self-distill must not load the target")


def test_stage_disabled_copies_inputs_byte_identically(tmp_path):
    p, conv, out, m = _workspace(tmp_path, {"enabled": False})
    metrics = self_distill.run(p, conv, out, m, load_target=_no_target)
    for split in ("train", "val", "publish"):
        assert (out / f"{split}.jsonl").read_bytes() == (conv / f"{split}.jsonl").read_bytes()
    assert not (out / "test.jsonl").exists()
    assert metrics["enabled"] is False and all(s["copied"] for s in metrics["splits"].values())
    assert json.loads(m.read_text())["splits"]["val"]["conversations"] == 1


def test_stage_enabled_regenerates_listed_splits_only(tmp_path):
    p, conv, out, m = _workspace(tmp_path, {"splits": ["train"], "max_new_tokens": 4, "batch_size": 3})
    t = _stub_target(_conversations(), eos_from=1)
    metrics = self_distill.run(p, conv, out, m, load_target=lambda *a, **k: t, work_dir=tmp_path / "work",
                               load_tokenizer=lambda *a, **k: (t.tokenizer, None))
    assert (out / "val.jsonl").read_bytes() == (conv / "val.jsonl").read_bytes()
    assert (out / "publish.jsonl").read_bytes() == (conv / "publish.jsonl").read_bytes()
    train = read_jsonl(out / "train.jsonl")
    assert train and all(c["messages"][-1]["role"] == "assistant" and len(c["messages"]) == 4 for c in train)
    assert metrics["splits"]["train"]["copied"] is False and metrics["generated_tokens"] > 0
    assert metrics["splits"]["train"]["resumed"] == 0
    assert list((tmp_path / "work").iterdir()) == []  # the journal goes once the split is written


def test_unknown_split_is_refused_with_the_params_before_the_stage(tmp_path):
    with pytest.raises(ParamsError, match=r"params\.yaml: 'distill\.splits' must be .* among .*'test'\] "
                                          r"\(line \d+ of params\.yaml\)$"):
        _workspace(tmp_path, {"splits": ["train", "test"]})


def test_stage_warns_when_the_budget_drops_prompts(tmp_path, capsys):
    # max_prompt_tokens 3: of the 5 train conversations only c4's last user turn 'zz|' fits
    # (test_plan_applies_the_prompt_budget), so 4 prompts are lost; the stage says so and why
    p, conv, out, m = _workspace(tmp_path, {"splits": ["train"], "max_new_tokens": 4, "max_prompt_tokens": 3})
    t = _stub_target(_conversations(), eos_from=1)
    metrics = self_distill.run(p, conv, out, m, load_target=lambda *a, **k: t, work_dir=tmp_path / "work",
                               load_tokenizer=lambda *a, **k: (t.tokenizer, None))
    assert metrics["splits"]["train"]["dropped_long_prompt"] == 4
    warned = [line for line in capsys.readouterr().out.splitlines() if "WARNING" in line]
    assert warned == ["self-distill train: WARNING 4 of 5 prompts dropped: even their last user turn is longer than "
                      "the prompt budget of 3 tokens (distill.max_prompt_tokens; 0 = extract.max_length - "
                      "distill.max_new_tokens), so the drafter never trains on prompts like them"]


@pytest.mark.parametrize("decode", ["dynamic", "static"])
def test_generate_batch_empty_stop_ids_mean_none_and_no_pad_comes_back(decode):
    """``stop_ids=[]`` stops nothing, whatever the model's own generation_config says: with its eos set to
    a token the greedy replies generate, every reply still equals unbatched greedy decoding without stop
    ids, full length, and no pad id fills a row (negative control: before the fix the dynamic decode took
    the model's eos, stopped row 0 there and returned pads after it)."""
    from tests.tiny import VOCAB, tiny_target

    t = tiny_target()
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, VOCAB, (8,), generator=g).tolist() for _ in range(3)]
    ref = [greedy_generate(t, p, max_new_tokens=24, stop_ids=[]) for p in prompts]
    pad = next(i for i in range(VOCAB) if all(i not in r for r in ref))  # an id no reply holds
    t.model.generation_config.eos_token_id = ref[0][5]
    out = generate_batch(t.model, prompts, 24, pad_id=pad, stop_ids=[], decode=decode)
    assert out == ref
    assert all(len(o) == 24 and pad not in o for o in out)
    assert t.model.generation_config.eos_token_id == ref[0][5]  # the model's config is left as it was


def test_generate_batch_refuses_stop_ids_none_by_name():
    from tests.tiny import tiny_target

    with pytest.raises(ValueError, match=r"stop_ids is None: pass the target's stop set .* or \[\]"):
        generate_batch(tiny_target().model, [[1, 2, 3]], 4, pad_id=0, stop_ids=None)


def test_generate_batch_sampled_runs_every_decode_and_refuses_bad_sampling_args():
    """A sampled call (temperature > 0) runs the static-cache decode as well as transformers' generate,
    the same tokens for one seed (decode "graphed" is refused off CUDA, as for greedy: it would otherwise
    run without graphs); a negative or NaN temperature and a top_p outside (0, 1] are refused by name with
    every decode; and the model's own generation_config eos does not leak into a sampled call either (a
    seed repeats its draw with that eos set to a token the draw holds). Negative control: before the
    sampled static decode, decode "static" with temperature > 0 raised 'greedy only'."""
    from tests.tiny import VOCAB, tiny_target

    model = tiny_target().model
    prompts = [[1, 2, 3], [4, 5]]
    a = generate_batch(model, prompts, 16, pad_id=0, stop_ids=[], decode="dynamic", temperature=1.0, seed=5)
    assert all(len(r) == 16 and all(0 <= i < VOCAB for i in r) for r in a)
    assert generate_batch(model, prompts, 16, pad_id=0, stop_ids=[], decode="static", temperature=1.0, seed=5) == a
    with pytest.raises(ValueError, match=r"decode 'graphed' needs the target on CUDA"):
        generate_batch(model, prompts, 4, pad_id=0, stop_ids=[], decode="graphed", temperature=1.0)
    for decode in ("auto", "dynamic", "static"):
        for temperature in (-0.5, float("nan")):
            with pytest.raises(ValueError, match=rf"temperature must be >= 0 \(0 = greedy\), got {temperature}"):
                generate_batch(model, prompts, 4, pad_id=0, stop_ids=[], decode=decode, temperature=temperature)
        for top_p in (0.0, 1.5, float("nan")):
            with pytest.raises(ValueError, match=rf"generate_batch: top_p must be in \(0, 1\], got {top_p}"):
                generate_batch(model, prompts, 4, pad_id=0, stop_ids=[], decode=decode, temperature=1.0, top_p=top_p)
    model.generation_config.eos_token_id = a[0][2]
    for decode in ("auto", "static"):
        assert generate_batch(model, prompts, 16, pad_id=0, stop_ids=[], decode=decode, temperature=1.0, seed=5) == a


@pytest.mark.parametrize("decode", ["dynamic", "static"])
def test_generate_batch_reads_stop_ids_once_whatever_their_kind(decode):
    """A generator or a tensor of stop ids stops the rows as the same list does (negative control: before,
    the dynamic decode read a generator twice, the second time empty, and a tensor's elements never
    matched an int: the pads after the stop came back as tokens)."""
    from tests.tiny import tiny_target

    m = tiny_target().model
    prompts = [[1, 2, 3], [4, 5]]
    stop = generate_batch(m, prompts, 6, 0, [], decode=decode)[0][2]
    want = generate_batch(m, prompts, 6, 0, [stop], decode=decode)
    assert want[0][-1] == stop and len(want[0]) == 3
    assert generate_batch(m, prompts, 6, 0, (t for t in [stop]), decode=decode) == want
    assert generate_batch(m, prompts, 6, 0, torch.tensor([stop]), decode=decode) == want


def test_generate_batch_refuses_an_unknown_decode_sampled_or_not():
    from tests.tiny import tiny_target

    m = tiny_target().model
    for temperature in (0.0, 0.7):
        with pytest.raises(ValueError, match=r"decode 'bogus' is not one of"):
            generate_batch(m, [[1, 2]], 4, 0, [], decode="bogus", temperature=temperature)
