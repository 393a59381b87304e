"""Synthesized prompts (eyas/data/synth.py, stage synthesize-prompts): the near-duplicate and overlap
filters against brute-force values computed here, one user turn's filters on the embedded target's
tokenizer, the rounds, the params, and the stage end to end on the embedded target (CPU)."""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import random
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from eyas.data.synth import NearDupIndex, Overlap, SynthError, clean_turn, jaccard, shingles, synthesize, user_prefix
from eyas.params.full import ParamsError, default_params, parse_params

REPO = Path(__file__).resolve().parents[2]


def words3(text: str) -> set[tuple[str, ...]]:
    """Word trigrams, written apart from eyas.data.synth.shingles (split on non-alphanumerics by hand)."""
    w = "".join(c.lower() if c.isalnum() or c == "_" else " " for c in text).split()
    return {tuple(w)} if 0 < len(w) < 3 else {tuple(w[i:i + 3]) for i in range(len(w) - 2)}


# ------------------------------------------------------------------------------- shingles, Jaccard


def test_shingles_and_jaccard_by_hand():
    assert shingles("The cat sat on the mat.") == {"the cat sat", "cat sat on", "sat on the", "on the mat"}
    assert shingles("Hi there") == {"hi there"} and shingles("?!") == frozenset()
    a, b = shingles("the cat sat on the mat"), shingles("the cat sat on a mat")
    # a: the cat sat, cat sat on, sat on the, on the mat; b: the cat sat, cat sat on, sat on a, on a mat
    assert jaccard(a, b) == 2 / 6
    assert jaccard(frozenset(), frozenset()) == 0.0


def _corpus(n: int, seed: int) -> list[str]:
    """Texts of 12 words from a 40-word vocabulary, a third of them edited copies of an earlier one
    (0-4 words replaced), so Jaccard values spread over (0, 1]."""
    rng = random.Random(seed)
    vocab = [f"w{i}" for i in range(40)]
    out: list[str] = []
    for _ in range(n):
        if out and rng.random() < 0.35:
            w = rng.choice(out).split()
            for _ in range(rng.randint(0, 4)):  # 0: an exact copy
                w[rng.randrange(len(w))] = rng.choice(vocab)
        else:
            w = [rng.choice(vocab) for _ in range(12)]
        out.append(" ".join(w))
    return out


@pytest.mark.parametrize("threshold", [0.3, 0.5, 0.8, 1.0])
def test_near_dup_index_keeps_what_brute_force_keeps(threshold):
    """Greedy dedup in order through the MinHash index equals the O(n^2) dedup by exact Jaccard of
    word trigrams computed here; the corpus holds pairs on both sides of each threshold."""
    texts = _corpus(300, seed=7)
    sets = [words3(t) for t in texts]
    kept_brute: list[int] = []
    for i, s in enumerate(sets):
        if all(len(s & sets[j]) / len(s | sets[j]) < threshold for j in kept_brute):
            kept_brute.append(i)
    index, kept = NearDupIndex(threshold), []
    for i, t in enumerate(texts):
        sh = shingles(t)
        if index.find(sh) is None:
            index.add(sh)
            kept.append(i)
    assert kept == kept_brute
    # not a vacuous test: both kinds occur
    assert 0 < len(kept) < len(texts)


def test_near_dup_negative_controls():
    index = NearDupIndex(0.5)
    index.add(shingles("how do I sort a list of dictionaries by a key in python"))
    assert index.find(shingles("How do I sort a list of dictionaries by a key in Python?")) == 0  # exact, case
    # one word changed of 12: 7 of 10 trigrams shared + 3 new: J = 7 / 13 = 0.54 >= 0.5
    assert index.find(shingles("how do I sort a list of dictionaries by a value in python")) == 0
    assert index.find(shingles("what is the capital of france and why is it famous")) is None
    assert NearDupIndex(1.0).find(shingles("a b c")) is None  # nothing kept yet
    with pytest.raises(ValueError, match=r"in \(0, 1\]"):
        NearDupIndex(0.0)


# ------------------------------------------------------------------------------- overlap with the eval


def test_overlap_by_hand_and_negative_controls():
    test_turn = "can you recommend a good book about the history of rome"
    he = "Complete the following Python function. Reply with code only.\n\n```python\ndef add(a, b):\n```"
    ov = Overlap({"chat": [test_turn, "how are you"], "humaneval": [he]}, 0.5)
    # the candidate's 9 trigrams: 8 shared with the test turn (8 / 9 >= 0.5)
    assert ov.hit(shingles("Can you recommend a good book about the history of Rome please")) == "chat"
    # a long candidate holding the whole test turn: 9 of the turn's 9 trigrams (reverse containment)
    long = "I have a long train ride ahead of me next week and I wonder, " + test_turn + " for the trip?"
    sh = shingles(long)
    assert len(sh & shingles(test_turn)) / len(sh) < 0.5 and ov.hit(sh) == "chat"
    # a HumanEval prompt copied into a request
    assert ov.hit(shingles("Complete the following Python function. Reply with code only. def add(a, b):")) == \
        "humaneval"
    # negative controls: an unrelated request; a request holding a short test turn (1 trigram < 6)
    assert ov.hit(shingles("Write a haiku about autumn leaves falling in the park")) is None
    assert ov.hit(shingles("Hi, how are you? I need help planning a birthday party for my sister")) is None


def test_overlap_matches_brute_force_containment():
    texts = _corpus(120, seed=3)
    bench, cands = texts[:40], texts[40:]
    ov = Overlap({"chat": bench}, 0.5)
    bsets = [words3(b) for b in bench]
    hits = 0
    for c in cands:
        a = words3(c)
        want = any(len(a & b) / len(a) >= 0.5 or (len(b) >= 6 and len(a & b) / len(b) >= 0.5) for b in bsets)
        assert (ov.hit(shingles(c)) == "chat") == want, c
        hits += want
    assert 0 < hits < len(cands)


# ------------------------------------------------------------------------------- sampled decode


@pytest.mark.parametrize("decode", ["dynamic", "static"])
def test_generate_batch_samples_with_its_seed(decode):
    """Self-distill's batched decode, sampled (transformers' generate, and the static-cache decode the
    CUDA graphs replay): a seed repeats its draw and another seed draws another; a nucleus so small that
    only the argmax is left gives the greedy reply (HF keeps one token at least)."""
    from eyas.data.distill import generate_batch
    from tests.tiny import tiny_target

    model = tiny_target().model
    prompts = [[1, 2, 3], [4, 5], [6]]
    greedy = generate_batch(model, prompts, 12, 0, [], decode=decode)
    a = generate_batch(model, prompts, 12, 0, [], decode=decode, temperature=1.0, top_p=1.0, seed=3)
    assert generate_batch(model, prompts, 12, 0, [], decode=decode, temperature=1.0, top_p=1.0, seed=3) == a
    assert generate_batch(model, prompts, 12, 0, [], decode=decode, temperature=1.0, top_p=1.0, seed=4) != a
    assert a != greedy
    assert generate_batch(model, prompts, 12, 0, [], decode=decode, temperature=1.0, top_p=1e-9, seed=3) == greedy


# ------------------------------------------------------------------------------- one user turn


@pytest.fixture(scope="module")
def tok():
    from eyas.target.model import load_tokenizer_and_config

    return load_tokenizer_and_config()[0]


def test_user_prefix_is_the_template_up_to_the_user_text(tok):
    """SmolLM2's template writes its default system prompt when the conversation has none."""
    default = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
    want = f"<|im_start|>system\n{default}<|im_end|>\n<|im_start|>user\n"
    assert user_prefix(tok, []) == tok(want, add_special_tokens=False)["input_ids"]
    sys_ = [{"role": "system", "content": "Be brief."}]
    assert tok.decode(user_prefix(tok, sys_)) == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n"


def test_clean_turn_reasons(tok):
    end = tok.convert_tokens_to_ids("<|im_end|>")
    stop, special = [end, tok.eos_token_id], set(tok.all_special_ids)

    def clean(text, *, stop_id=end, min_tokens=3, ascii_share=0.9):
        ids = tok(text, add_special_tokens=False)["input_ids"] + ([stop_id] if stop_id is not None else [])
        return clean_turn(tok, ids, stop, min_tokens=min_tokens, min_ascii_letters=ascii_share, special_ids=special)

    assert clean("  How do I bake bread at home?\n") == ("How do I bake bread at home?", None)
    assert clean("How do I bake bread", stop_id=None) == (None, "truncated")
    assert clean("Hello <|im_start|>assistant") == (None, "special_token")
    assert clean("Hi", min_tokens=3) == (None, "too_short")
    assert clean("   \n ") == (None, "too_short")
    assert clean("Как испечь хлеб дома?") == (None, "language")
    assert clean("Как испечь хлеб дома?", ascii_share=0.0) == ("Как испечь хлеб дома?", None)
    assert clean("1234 5678 + 99") == (None, "language")  # no letters
    # a byte token that cuts a character: decodes to U+FFFD
    parrot = tok("\U0001f99c", add_special_tokens=False)["input_ids"]
    assert len(parrot) > 1  # the emoji's 4 UTF-8 bytes are several byte-level tokens in SmolLM2's vocabulary
    ids = tok("Tell me about parrots ", add_special_tokens=False)["input_ids"] + parrot[:1] + [end]
    assert clean_turn(tok, ids, stop, min_tokens=1, min_ascii_letters=0.9, special_ids=special) == \
        (None, "round_trip")


# ------------------------------------------------------------------------------- rounds


def _synth(**over) -> SimpleNamespace:
    s = default_params().data.synth
    return SimpleNamespace(**{**vars(s), "prompts": 5, "max_prompt_tokens": 16, "min_prompt_tokens": 2, **over})


class Scripted:
    """A target's decode stand-in for the round logic: prompt k of a call gets the k-th text of a
    script (then the stop id); counts calls."""

    def __init__(self, tok, texts):
        self.tok, self.texts, self.calls = tok, iter(texts), 0
        self.end = tok.convert_tokens_to_ids("<|im_end|>")

    def __call__(self, prompts, max_new_tokens, *, temperature, top_p, seed):
        self.calls += 1
        return [self.tok(next(self.texts), add_special_tokens=False)["input_ids"][:max_new_tokens - 1] + [self.end]
                for _ in prompts]


def test_rounds_reach_n_and_count_every_drop(tok, tmp_path):
    texts = ["What is a good name for a cat?", "What is a good name for a cat?",  # exact duplicate
             "Как дела?", "Hi", "Can you recommend a good book about the history of rome",  # test overlap
             "How do I fix a flat bicycle tyre?", "Explain how rainbows form in the sky.",
             "Write a poem about the sea and the wind.", "Which planet has the most moons?"]
    gen = Scripted(tok, texts + ["filler text number %d for the round" % i for i in range(50)])
    bench = {"chat": ["can you recommend a good book about the history of rome"], "humaneval": []}
    end = gen.end
    convs, stats = synthesize(gen, tok, [end], _synth(prompts=5, code_share=0.0), benchmarks=bench, reply_tokens=8,
                              batch_size=4, resume_key={"t": 1}, work_dir=tmp_path / "w")
    # round 0 asks ceil(5 / 0.8 * 1.1) = 7: two drop as duplicate/language, one too short, one overlaps
    assert stats["dropped"] == {"truncated": 0, "special_token": 0, "too_short": 1, "round_trip": 0, "language": 1,
                                "overlap_chat": 1, "overlap_humaneval": 0, "near_duplicate": 1}
    assert [c["messages"][-2]["content"] for c in convs] == [
        "What is a good name for a cat?", "How do I fix a flat bicycle tyre?", "Explain how rainbows form in the sky.",
        "Write a poem about the sea and the wind.", "Which planet has the most moons?"]
    assert [c["id"] for c in convs] == [f"synth-chat-{i:06d}" for i in range(5)]
    assert all(c["messages"][-1] == {"role": "assistant", "content": ""} for c in convs)
    # drawn = kept + surplus + dropped
    assert stats["generated"] == 5 + stats["surplus"] + sum(stats["dropped"].values())
    assert stats["rounds"] == 2 and stats["resumed_rounds"] == 0


def test_turns_alternate_with_the_targets_replies(tok):
    """turns 2: the target answers each first turn (greedy), then writes the next user turn; a later turn
    that fails its filters ends the conversation before it (its reply goes too)."""
    script = ["Which cat breeds are calm?", "How do dogs learn tricks?", "Why do fish school together?",  # turn 0
              "Ragdolls.", "With rewards.", "For safety.",  # the replies
              "Are they good with children?", "Как дела?", "Do sharks do it too?"]  # turn 1
    calls = []

    def gen(prompts, max_new_tokens, *, temperature, top_p, seed):
        calls.append((len(prompts), max_new_tokens, temperature))
        end = tok.convert_tokens_to_ids("<|im_end|>")
        return [tok(script.pop(0), add_special_tokens=False)["input_ids"] + [end] for _ in prompts]

    convs, stats = synthesize(gen, tok, [tok.convert_tokens_to_ids("<|im_end|>")],
                              _synth(prompts=2, turns=2, code_share=0.0), benchmarks={}, reply_tokens=8,
                              batch_size=8, resume_key={})
    # round 0 asks ceil(2 * 1.1 / 0.8) = 3: users sampled, replies greedy at the reply budget, users again
    assert calls == [(3, 16, 1.0), (3, 8, 0.0), (3, 16, 1.0)]
    assert [c["messages"] for c in convs] == [
        [{"role": "user", "content": "Which cat breeds are calm?"}, {"role": "assistant", "content": "Ragdolls."},
         {"role": "user", "content": "Are they good with children?"}, {"role": "assistant", "content": ""}],
        [{"role": "user", "content": "How do dogs learn tricks?"}, {"role": "assistant", "content": ""}]]
    assert stats["later_turns_dropped"] == 1 and stats["surplus"] == 1 and stats["kept_user_turns"] == 3


def test_rounds_give_up_with_the_counts_and_resume(tok, tmp_path):
    """Prompts that always run past the budget: the error names the key and the counts; the rounds are
    saved, and a rerun with more rounds reuses them (the decode is not called for them again)."""
    long = "word " * 40
    gen = Scripted(tok, [long] * 1000)
    gen_trunc = lambda prompts, n, **kw: [ids[:-1] for ids in gen(prompts, n + 1, **kw)]  # noqa: E731 no stop id
    s = _synth(prompts=3, max_rounds=2, code_share=0.0)
    with pytest.raises(SynthError) as e:
        synthesize(gen_trunc, tok, [gen.end], s, benchmarks={}, reply_tokens=8, batch_size=64, resume_key={},
                   work_dir=tmp_path)
    # round 0 asks ceil(3 * 1.1 / 0.8) = 5, round 1 (nothing survived: the rate's floor 0.1) 3 * 1.1 / 0.1 = 33
    assert str(e.value).startswith("data.synth.prompts: 0 of 3 synthesized prompts survived the filters after 2 "
                                   "rounds (data.synth.max_rounds) of 38 drawn; dropped {'truncated': 38,")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["round_000.json", "round_001.json"]
    calls = gen.calls
    with pytest.raises(SynthError, match="after 3 rounds"):
        synthesize(gen_trunc, tok, [gen.end], _synth(prompts=3, max_rounds=3, code_share=0.0), benchmarks={},
                   reply_tokens=8, batch_size=64, resume_key={}, work_dir=tmp_path)
    assert gen.calls == calls + 1  # rounds 0 and 1 reused, round 2 generated (one batch)


# ------------------------------------------------------------------------------- params


@pytest.mark.parametrize("synth, msg", [
    ({"top_p": 1.5}, r"^params\.yaml: 'data\.synth\.top_p' must be in \(0, 1\], got 1\.5$"),
    ({"temperature": 0.0}, r"'data\.synth\.temperature' must be in \(0, 10\] \(prompts are sampled"),
    ({"mode": "replace"}, r"'data\.synth\.mode' must be 'add' .* or 'only'"),
    ({"near_dup": 0.0}, r"'data\.synth\.near_dup' must be in \(0, 1\]"),
    ({"topics": ["x", "x"]}, r"'data\.synth\.topics' must be a list of distinct non-empty strings"),
    ({"system_prompts": []}, r"'data\.synth\.system_prompts' must be a non-empty list"),
    ({"prompts": 4, "min_prompt_tokens": 50, "max_prompt_tokens": 40},
     r"'data\.synth\.min_prompt_tokens' \(50\) must be <= 'data\.synth\.max_prompt_tokens' \(40\)"),
    ({"prompts": 4, "mode": "only"}, r"'data\.synth\.prompts' \(4\) must be > 'data\.val' \(20\)"),
    ({"promtps": 4}, r"unknown key 'data\.synth\.promtps'"),
])
def test_bad_synth_params_name_the_key(synth, msg):
    with pytest.raises(ParamsError, match=msg):
        parse_params({"data": {"synth": synth}})


def test_synth_needs_self_distill():
    with pytest.raises(ParamsError, match=r"'data\.synth\.prompts' \(4\) > 0 needs 'distill\.enabled' true"):
        parse_params({"data": {"synth": {"prompts": 4}}, "distill": {"enabled": False}})
    with pytest.raises(ParamsError, match="holding train and val"):
        parse_params({"data": {"synth": {"prompts": 4}}, "distill": {"splits": ["train"]}})
    assert parse_params({"data": {"synth": {"prompts": 4}}}).data.synth.prompts == 4
    assert default_params().data.synth.prompts == 0  # off by default


# ------------------------------------------------------------------------------- the stage, end to end


def _stage(module: str, cwd: Path, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", module], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=1500)


@pytest.mark.slow
def test_stage_end_to_end_on_the_embedded_target(tmp_path):
    """8 prompts the embedded SmolLM2-135M writes (CPU), through prepare-data and self-distill: the set
    holds no near-duplicate pair and copies no test prompt (checked here by brute force), joins train,
    gets the target's replies, and a set made for other params is refused by prepare-data."""
    synth = {"prompts": 8, "max_prompt_tokens": 40, "min_prompt_tokens": 4, "temperature": 0.8, "top_p": 0.95,
             "seed": 1}
    params = {"data": {"max_conversations": 20, "val": 4, "test": 3, "publish": 2, "code_prompts": 0,
                       "synth": synth},
              "distill": {"batch_size": 16, "max_new_tokens": 8}}
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params))
    env = {**os.environ, "PYTHONPATH": str(REPO), "EYAS_TRACKING": "off"}
    for module in ("stages.identify_inputs", "stages.synthesize_prompts", "stages.prepare_data",
                   "stages.self_distill"):
        r = _stage(module, tmp_path, env)
        assert r.returncode == 0, f"{module}: {r.stdout[-2000:]}{r.stderr[-3000:]}"
    m = json.loads((tmp_path / "metrics/synthesize_prompts.json").read_text())
    rows = [json.loads(x) for x in (tmp_path / "data/synth/conversations.jsonl").read_text().splitlines()]
    assert len(rows) == 8 == m["kept"]["chat"] + m["kept"]["code"]
    assert m["generated"] == 8 + m["surplus"] + sum(m["dropped"].values())
    assert m["benchmark_texts"]["humaneval"] == 164 and m["benchmark_texts"]["chat"] > 0
    assert m["seconds_per_1m_kept_user_tokens"] > 0
    assert m["backend"] == "hf" and m["decode"] == "dynamic"  # the decode generate_batch ran (a CPU: generate)
    users = [[x["content"] for x in c["messages"] if x["role"] == "user"][0] for c in rows]
    assert all(u.strip() == u and u for u in users)
    assert all(c["messages"][-1] == {"role": "assistant", "content": ""} for c in rows)
    for a, b in itertools.combinations(users, 2):
        sa, sb = words3(a), words3(b)
        assert len(sa & sb) / len(sa | sb) < 0.5, (a, b)
    test = [json.loads(x) for x in (tmp_path / "data/conversations/test.jsonl").read_text().splitlines()]
    for u in users:
        a = words3(u)
        for t in (x["content"] for c in test for x in c["messages"] if x["role"] == "user"):
            b = words3(t)
            assert len(a & b) / len(a) < 0.5 and not (len(b) >= 6 and len(a & b) / len(b) >= 0.5), (u, t)
    pm = json.loads((tmp_path / "metrics/prepare_data.json").read_text())
    # train 20 - 4 - 3 - 2 = 11 chat; val's share 8 * 4 // 15 = 2
    assert pm["synth"] == {"train": 6, "val": 2, "test": 0, "publish": 0}
    assert pm["conversations"] == {"train": 17, "val": 6, "test": 3, "publish": 2}
    distilled = [json.loads(x) for s in ("train", "val")
                 for x in (tmp_path / f"data/distilled/{s}.jsonl").read_text().splitlines()]
    got = {c["id"]: c for c in distilled if c["id"].startswith("synth-")}
    assert len(got) == 8  # every synthesized prompt got the target's reply (its token ids kept)
    assert all(c["messages"][-1]["role"] == "assistant" and c["reply_ids"] for c in got.values())
    # a set made for other params is refused, naming the key and the stage to rerun
    params["data"]["synth"]["seed"] = 2
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params))
    r = _stage("stages.prepare_data", tmp_path, env)
    assert r.returncode == 1 and r.stderr.startswith(
        "prepare-data: error: prepare-data: data/synth was built by synthesize-prompts with data.synth.seed = 1, "
        "params.yaml now has data.synth.seed = 2: rerun `dvc repro synthesize-prompts`"), r.stderr


@pytest.mark.parametrize("mode", ["add", "only"])
def test_prepare_data_joins_the_set_or_trains_on_it_alone(tmp_path, monkeypatch, mode):
    """prepare-data with a set the stage would have written (its fingerprint recorded as the stage
    does): `add` joins it to train and val in proportion, `only` makes it train and val (val the first
    data.val); a set of another size, or one made for other params, is refused."""
    import stages.prepare_data as stage
    from eyas.data.conversations import DataError, write_jsonl
    from eyas.pipeline.provenance import FILE, SOURCE_ID, StaleError, read, record

    monkeypatch.chdir(tmp_path)
    raw = {"data": {"max_conversations": 30, "val": 3, "test": 4, "publish": 2, "code_prompts": 0,
                    "synth": {"prompts": 9, "mode": mode}}}
    p = parse_params(raw)
    synth = [{"id": f"synth-chat-{i:06d}", "messages": [{"role": "user", "content": f"q{i}"},
                                                         {"role": "assistant", "content": ""}]} for i in range(9)]
    write_jsonl(tmp_path / "data/synth/conversations.jsonl", synth)
    (tmp_path / "data/synth" / FILE).write_text(json.dumps(record("synthesize-prompts", p, [SOURCE_ID])))
    m = stage.prepare(p)
    # the splits' fingerprint holds the set's digest: a later synthesize-prompts run shows to their readers
    assert read(tmp_path / "data/conversations")["inputs"] == {
        "data/synth/conversations.jsonl": hashlib.sha256((tmp_path / "data/synth/conversations.jsonl").read_bytes())
        .hexdigest()}
    rows = {s: [json.loads(x)["id"] for x in (tmp_path / f"data/conversations/{s}.jsonl").read_text().splitlines()]
            for s in ("train", "val", "test", "publish")}
    ids = [c["id"] for c in synth]
    if mode == "add":  # 30 - 3 - 4 - 2 = 21 train; val's share 9 * 3 // 24 = 1
        assert m["synth"] == {"train": 8, "val": 1, "test": 0, "publish": 0}
        assert rows["val"][3:] == ids[:1] and rows["train"][21:] == ids[1:] and len(rows["train"]) == 29
    else:
        assert m["synth"] == {"train": 6, "val": 3, "test": 0, "publish": 0}
        assert rows["val"] == ids[:3] and rows["train"] == ids[3:]
    assert len(rows["test"]) == 4 and len(rows["publish"]) == 2 and not any(i.startswith("synth-") for i in
                                                                             rows["test"] + rows["publish"])
    with pytest.raises(StaleError, match="with data.test = 4, params.yaml now has data.test = 5: rerun"):
        stage.prepare(parse_params({"data": {**raw["data"], "test": 5}}))
    (tmp_path / "data/synth" / FILE).unlink()  # a set without its fingerprint: its size is still checked
    with pytest.raises(DataError, match=r"data/synth/conversations.jsonl: 9 conversations, data.synth.prompts is 10"):
        stage.prepare(parse_params({"data": {**raw["data"], "synth": {"prompts": 10, "mode": mode}}}))
