"""Self-distill through a real inference engine (distill.backend: server, eyas/serving.py).

llama.cpp's ``llama-server`` (built by scripts/build_llama_server.sh, which scripts/install.sh runs)
serves the embedded SmolLM2 GGUF on CPU; the stage sends it token-id prompts and keeps the token
ids it generates. The ids are checked against HF greedy decoding of the same GGUF, against the
text the server itself reports, and against the stop rule; failures (server down, timeout, HTTP
error, a model it does not serve) name the prompt and the URL, and the journal keeps what finished.
"""

from __future__ import annotations

import json
import re
import shutil
import socket
import subprocess
import sysconfig
import time
import urllib.request
from pathlib import Path

import pytest

from eyas.config import load_params
from eyas.data import read_jsonl, write_jsonl
from eyas.distill import Journal, plan_prompts
from eyas.serving import ServerError, check_reply, parse_reply, regenerate_via_server
from eyas.target import embedded_target
from stages import self_distill

ALIAS = "smollm2"
MAX_NEW = 24
QUESTIONS = ["Hi! How are you?", "What is the capital of France?", "Name three colours.",
             "Write a long story about a dragon who learns to cook.", "Say just the word yes.",
             "Explain photosynthesis in detail, step by step.", "What is 2 + 2?", "Tell me a joke."]


def _server_binary() -> str | None:
    exe = Path(sysconfig.get_path("scripts")) / "llama-server"
    return str(exe) if exe.is_file() else shutil.which("llama-server")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """A llama-server on 127.0.0.1 serving the embedded GGUF as ``smollm2`` (2 slots, 2 threads)."""
    exe = _server_binary()
    if exe is None:
        pytest.skip("llama-server is not built: bash scripts/build_llama_server.sh")
    d, gguf = embedded_target()
    port = _free_port()
    log = tmp_path_factory.mktemp("llama_server") / "server.log"
    with open(log, "w") as f:
        proc = subprocess.Popen([exe, "-m", str(Path(d) / gguf), "--alias", ALIAS, "--host", "127.0.0.1",
                                 "--port", str(port), "-c", "2048", "-np", "2", "-t", "2", "--no-webui"],
                                stdout=f, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(240):  # up to 120 s for the model to load
            if proc.poll() is not None:
                pytest.fail(f"llama-server exited {proc.returncode}: {log.read_text()[-2000:]}")
            try:
                with urllib.request.urlopen(url + "/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            time.sleep(0.5)
        else:
            pytest.fail(f"llama-server did not become healthy in 120 s: {log.read_text()[-2000:]}")
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(30)


def _conversations() -> list[dict]:
    return [{"id": f"c{i}", "messages": [{"role": "user", "content": q}, {"role": "assistant", "content": "-"}]}
            for i, q in enumerate(QUESTIONS)]


def _params(tmp_path, url: str, **server) -> object:
    cfg = {"distill": {"backend": "server", "splits": ["train"], "max_new_tokens": MAX_NEW, "max_prompt_tokens": 128,
                       "server": {"api": "llamacpp", "url": url, "model": ALIAS, "concurrency": 2, **server}}}
    (tmp_path / "params.yaml").write_text(json.dumps(cfg))
    return load_params(tmp_path / "params.yaml")


@pytest.fixture(scope="module")
def distilled(tmp_path_factory, server, smollm_tokenizer):
    """The self-distill stage through the server on QUESTIONS: (rows, metrics)."""
    tmp = tmp_path_factory.mktemp("distill_server")
    conv = tmp / "conversations"
    for split in ("train", "val", "publish"):
        write_jsonl(conv / f"{split}.jsonl", _conversations())
    p = _params(tmp, server)
    metrics = self_distill.run(p, conv, tmp / "distilled", tmp / "m.json", work_dir=tmp / "work",
                               load_tokenizer=lambda *a: (smollm_tokenizer, None))
    return read_jsonl(tmp / "distilled" / "train.jsonl"), metrics


@pytest.mark.slow  # the server, the GGUF load and real generation
def test_the_stage_keeps_the_engines_ids_and_stop_reasons(distilled):
    rows, metrics = distilled
    stop = set(metrics["stop_ids"])
    assert metrics["stop_ids"] == [2]  # <|im_end|>, as the HF target's generation config says
    assert metrics["server"]["model"] == ALIAS and metrics["server"]["served"]["id"] == ALIAS
    assert len(rows) == len(QUESTIONS)
    reasons = [r["finish_reason"] for r in rows]
    assert set(reasons) == {"stop", "length"}, reasons  # both kinds occur in QUESTIONS at MAX_NEW
    for r in rows:
        ids = r["reply_ids"]
        assert not any(t in stop for t in ids[:-1])
        assert (ids[-1] in stop) == (r["finish_reason"] == "stop")
        if r["finish_reason"] == "length":
            assert len(ids) == MAX_NEW
    split = metrics["splits"]["train"]
    assert split["generated_tokens"] == sum(len(r["reply_ids"]) for r in rows) and split["concurrency"] == 2


@pytest.mark.slow  # the server, the GGUF load and real generation
def test_the_ids_are_what_the_server_generated_for_those_prompt_ids(distilled, server, smollm_tokenizer):
    """Independently of eyas' client: the same prompt ids posted by hand give the same tokens, and
    the text the server reports is those tokens decoded (its stop token's text excluded)."""
    rows, _ = distilled
    for r in rows[:3]:
        body = {"prompt": r["prompt_ids"], "n_predict": MAX_NEW, "return_tokens": True, "top_k": 1,
                "cache_prompt": False}
        req = urllib.request.Request(server + "/completion", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=300) as resp:
            out = json.loads(resp.read())
        assert out["tokens"] == r["reply_ids"]
        assert out["content"] == smollm_tokenizer.decode(r["reply_ids"], skip_special_tokens=True)
        assert out["stop_type"] == {"stop": "eos", "length": "limit"}[r["finish_reason"]]


@pytest.mark.slow  # the server, the GGUF load and real generation
def test_the_ids_are_greedy_under_hf_scoring_of_the_same_gguf(distilled):
    """HF de-quantises the GGUF to fp32; llama.cpp multiplies the Q4_1 blocks with Q8 activations:
    free-running greedy replies part at near-ties (measured: 2 of 8 identical). Teacher-forced, the
    server's every token is scored by HF: it is HF's argmax at most positions and always among
    HF's top 10, which a reply of another model, another prompt or shifted ids would not be."""
    import torch

    from eyas.target import load_target

    rows, _ = distilled
    t = load_target()
    agree = total = 0
    for r in rows:
        p, y = r["prompt_ids"], r["reply_ids"]
        with torch.no_grad():
            logits = t.model(input_ids=torch.tensor([p + y])).logits[0, len(p) - 1: len(p) + len(y) - 1]
        top = logits.topk(10, dim=-1).indices
        assert all(y[j] in top[j].tolist() for j in range(len(y))), r["id"]
        agree += sum(int(top[j, 0]) == y[j] for j in range(len(y)))
        total += len(y)
    assert agree / total >= 0.75, (agree, total)


@pytest.mark.slow  # the server, the GGUF load and real generation
def test_failures_name_the_prompt_and_url_and_the_journal_keeps_what_finished(tmp_path, server, smollm_tokenizer):
    items, _ = plan_prompts(smollm_tokenizer, _conversations()[:3], turns="last", max_prompt_tokens=None)
    bad = {"id": "bad-conv", "messages": [], "prompt_ids": [10 ** 7]}  # no such token id: HTTP error
    p = _params(tmp_path, server, concurrency=1)
    journal = Journal(tmp_path / "j.jsonl", {"k": 1})
    with pytest.raises(ServerError) as e:
        regenerate_via_server(p.distill.server, smollm_tokenizer, [2], items + [bad], max_new_tokens=8,
                              journal=journal)
    msg = str(e.value)
    assert "bad-conv" in msg and f"{server}/completion" in msg and re.search(r"HTTP [45]\d\d", msg), msg
    assert len(Journal(tmp_path / "j.jsonl", {"k": 1}).done) == 3
    rows, stats = regenerate_via_server(p.distill.server, smollm_tokenizer, [2], items, max_new_tokens=8,
                                        journal=Journal(tmp_path / "j.jsonl", {"k": 1}))
    assert stats["resumed"] == 3 and stats["tokens_per_second"] is None and len(rows) == 3

    down = _params(tmp_path, f"http://127.0.0.1:{_free_port()}").distill.server
    with pytest.raises(ServerError, match="c0.*cannot reach the server"):
        regenerate_via_server(down, smollm_tokenizer, [2], items[:1], max_new_tokens=8)
    slow = _params(tmp_path, server, timeout=0.001).distill.server
    with pytest.raises(ServerError, match="c0.*no reply within distill.server.timeout 0.001"):
        regenerate_via_server(slow, smollm_tokenizer, [2], items[:1], max_new_tokens=8)
    other = _params(tmp_path, server, model="another-model").distill.server
    with pytest.raises(ServerError, match=r"serves \['smollm2'\], not distill.server.model 'another-model'"):
        self_distill.check_served_model(other)


def test_reply_checks_follow_the_stop_rule():
    """The documented reply shapes of each engine, and the stop rule every reply must satisfy."""
    assert parse_reply("vllm", {"choices": [{"token_ids": [5, 2], "finish_reason": "stop"}]}) == ([5, 2], "stop")
    assert parse_reply("sglang", {"output_ids": [5, 6], "meta_info": {"finish_reason": {"type": "length"}}}) \
        == ([5, 6], "length")
    assert parse_reply("llamacpp", {"tokens": [5, 2], "stop_type": "eos"}) == ([5, 2], "stop")
    with pytest.raises(ServerError, match="return_token_ids"):
        parse_reply("vllm", {"choices": [{"token_ids": None, "finish_reason": "stop"}]})
    with pytest.raises(ServerError, match="'word'"):
        parse_reply("llamacpp", {"tokens": [5], "stop_type": "word"})
    assert check_reply([5, 2, 7], "length", [2], 3) == [5, 2]  # kept going past a stop id: cut there
    with pytest.raises(ServerError, match="no tokens"):
        check_reply([], "stop", [2], 3)
    with pytest.raises(ServerError, match="not one of the target's stop ids"):
        check_reply([5, 0], "stop", [2], 3)
    with pytest.raises(ServerError, match="cut the reply at 2"):
        check_reply([5, 6], "length", [2], 3)
