"""Self-distill through a real inference engine (distill.backend: server, eyas/data/remote.py).

llama.cpp's ``llama-server`` (built by scripts/build_llama_server.sh, which scripts/install.sh runs)
serves the embedded SmolLM2 GGUF on CPU; the stage sends it token-id prompts and keeps the token
ids it generates. The ids are checked against HF greedy decoding of the same GGUF, against the
text the server itself reports, and against the stop rule; failures (server down, timeout, HTTP
error, a model it does not serve) name the prompt and the URL, and the journal keeps what finished.

Malformed replies (a body cut off mid-reply, a port that speaks no HTTP, non-JSON, a missing field,
ids outside the vocabulary, a reply past the budget) come from real local servers
(``http.server`` / ``socketserver`` in a thread) that answer exactly those bytes.
"""

from __future__ import annotations

import contextlib
import http.server
import json
import re
import shutil
import socketserver
import subprocess
import sysconfig
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from eyas.data.conversations import read_jsonl, write_jsonl
from eyas.data.distill import Journal, plan_prompts
from eyas.data.remote import RemoteError, check_reply, generate_ids, hosted_models, parse_reply, regenerate_remote
from eyas.data.synth import user_prefix
from eyas.params.full import DistillServerParams, load_params
from eyas.target.model import embedded_target
from stages import self_distill
from tests import team_servers

ALIAS = "smollm2"
MAX_NEW = 24
QUESTIONS = ["Hi! How are you?", "What is the capital of France?", "Name three colours.",
             "Write a long story about a dragon who learns to cook.", "Say just the word yes.",
             "Explain photosynthesis in detail, step by step.", "What is 2 + 2?", "Tell me a joke."]


def _server_binary() -> str | None:
    exe = Path(sysconfig.get_path("scripts")) / "llama-server"
    return str(exe) if exe.is_file() else shutil.which("llama-server")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """A llama-server on 127.0.0.1 serving the embedded GGUF as ``smollm2`` (2 slots, 2 threads)."""
    exe = _server_binary()
    if exe is None:
        pytest.skip("llama-server is not built: bash scripts/build_llama_server.sh")
    d, gguf = embedded_target()
    port = team_servers.free_port()
    log = tmp_path_factory.mktemp("llama_server") / "server.log"
    with open(log, "w") as f:
        proc = subprocess.Popen([exe, "-m", str(Path(d) / gguf), "--alias", ALIAS, "--host", "127.0.0.1",
                                 "--port", str(port), "-c", "2048", "-np", "2", "-t", "2", "--no-webui"],
                                stdout=f, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        team_servers.wait_healthy(url, proc, 120, log)  # the model loads first
        yield url
    finally:
        team_servers.stop(proc, 30)


def _conversations() -> list[dict]:
    return [{"id": f"c{i}", "messages": [{"role": "user", "content": q}, {"role": "assistant", "content": "-"}]}
            for i, q in enumerate(QUESTIONS)]


def _params(tmp_path, url: str, **server) -> object:
    cfg = {"distill": {"backend": "server", "splits": ["train"], "max_new_tokens": MAX_NEW, "max_prompt_tokens": 128,
                       "server": {"api": "llamacpp", "url": url, "model": ALIAS, "revision": "embedded-q4_1",
                                  "concurrency": 2, **server}}}
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
                               load_tokenizer=lambda *a, **k: (smollm_tokenizer, None))
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

    from eyas.target.model import load_target

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
def test_sampled_requests_vary_with_the_seed_and_repeat_with_it(server, smollm_tokenizer):
    """Synthesized prompts through the engine (eyas.data.synth): the same Magpie prefix sampled four
    times gives requests that differ (seed + k per prompt), the same seed gives the same ids again; the
    negative control, greedy, gives one reply four times."""
    srv = DistillServerParams(api="llamacpp", url=server, model=ALIAS, revision="r", concurrency=1, timeout=120.0)
    prefix = user_prefix(smollm_tokenizer, [])
    args = ([prefix] * 4, 16, [2], len(smollm_tokenizer))
    a = generate_ids(srv, *args, temperature=1.0, top_p=1.0, seed=11)
    assert len({tuple(x) for x in a}) > 1
    assert generate_ids(srv, *args, temperature=1.0, top_p=1.0, seed=11) == a
    assert generate_ids(srv, *args, temperature=1.0, top_p=1.0, seed=12)[:3] == a[1:]  # prompt k: seed + k
    assert len({tuple(x) for x in generate_ids(srv, *args)}) == 1


@pytest.mark.slow  # the server, the GGUF load and real generation
def test_failures_name_the_prompt_and_url_and_the_journal_keeps_what_finished(tmp_path, server, smollm_tokenizer):
    items, _ = plan_prompts(smollm_tokenizer, _conversations()[:3], turns="last", max_prompt_tokens=None)
    bad = {"id": "bad-conv", "messages": [], "prompt_ids": [10 ** 7]}  # no such token id: HTTP error
    p = _params(tmp_path, server, concurrency=1)
    journal = Journal(tmp_path / "j.jsonl", {"k": 1})
    with pytest.raises(RemoteError) as e:
        regenerate_remote(p.distill.server, smollm_tokenizer, [2], items + [bad], max_new_tokens=8,
                              journal=journal)
    msg = str(e.value)
    assert "bad-conv" in msg and f"{server}/completion" in msg and re.search(r"HTTP [45]\d\d", msg), msg
    assert len(Journal(tmp_path / "j.jsonl", {"k": 1}).done) == 3
    rows, stats = regenerate_remote(p.distill.server, smollm_tokenizer, [2], items, max_new_tokens=8,
                                        journal=Journal(tmp_path / "j.jsonl", {"k": 1}))
    assert stats["resumed"] == 3 and stats["tokens_per_second"] is None and len(rows) == 3

    down = _params(tmp_path, f"http://127.0.0.1:{team_servers.free_port()}").distill.server
    with pytest.raises(RemoteError, match="c0.*cannot reach the server"):
        regenerate_remote(down, smollm_tokenizer, [2], items[:1], max_new_tokens=8)
    slow = _params(tmp_path, server, timeout=0.001).distill.server
    with pytest.raises(RemoteError, match="c0.*no reply within distill.server.timeout 0.001"):
        regenerate_remote(slow, smollm_tokenizer, [2], items[:1], max_new_tokens=8)
    other = _params(tmp_path, server, model="another-model").distill.server
    with pytest.raises(RemoteError, match=r"lists \['smollm2'\], not distill.server.model 'another-model'"):
        self_distill.check_hosted_model(other)


def test_reply_checks_follow_the_stop_rule():
    """The documented reply shapes of each engine, and the stop rule every reply must satisfy."""
    assert parse_reply("vllm", {"choices": [{"token_ids": [5, 2], "finish_reason": "stop"}]}) == ([5, 2], "stop")
    assert parse_reply("sglang", {"output_ids": [5, 6], "meta_info": {"finish_reason": {"type": "length"}}}) \
        == ([5, 6], "length")
    assert parse_reply("llamacpp", {"tokens": [5, 2], "stop_type": "eos"}) == ([5, 2], "stop")
    with pytest.raises(RemoteError, match="return_token_ids"):
        parse_reply("vllm", {"choices": [{"token_ids": None, "finish_reason": "stop"}]})
    with pytest.raises(RemoteError, match="'word'"):
        parse_reply("llamacpp", {"tokens": [5], "stop_type": "word"})
    assert check_reply([5, 2, 7], "length", [2], 3, 8) == [5, 2]  # kept going past a stop id: cut there
    assert check_reply([0, 7, 2], "stop", [2], 3, 8) == [0, 7, 2]  # the vocabulary's first and last ids
    with pytest.raises(RemoteError, match="no tokens"):
        check_reply([], "stop", [2], 3, 8)
    with pytest.raises(RemoteError, match="not one of the target's stop ids"):
        check_reply([5, 0], "stop", [2], 3, 8)
    with pytest.raises(RemoteError, match="cut the reply at 2"):
        check_reply([5, 6], "length", [2], 3, 8)
    with pytest.raises(RemoteError, match=r"id 8 \(position 1\) is outside the target's vocabulary \[0, 8\)"):
        check_reply([5, 8], "length", [2], 2, 8)


# --- malformed replies from real local servers -------------------------------------------------

CHARS = [chr(c) for c in range(32, 127)] + ["\n"]  # 96 ids, then 2 special tokens: vocabulary 98
VOCAB = len(CHARS) + 2


@pytest.fixture(scope="module")
def char_tokenizer():
    """A character-level fast tokenizer of VOCAB ids (the rows' ``content`` decodes with it)."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(CHARS)}, merges=[]))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, additional_special_tokens=["<|im_start|>", "<|im_end|>"])
    assert len(fast) == VOCAB
    return fast


class _Canned(http.server.BaseHTTPRequestHandler):
    """Answers every request with ``server.reply(request JSON or None for a GET)``: ``(status,
    body bytes, declared Content-Length)``; a declared length past the body closes mid-reply."""

    def do_GET(self):
        self._answer(None)

    def do_POST(self):
        self._answer(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))

    def _answer(self, request):
        with self.server.lock:
            self.server.sent.append(request)
        status, raw, declared = self.server.reply(request)
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(declared))
        self.end_headers()
        self.wfile.write(raw)
        self.close_connection = True

    def log_message(self, *args):
        pass


class _NotHttp(socketserver.BaseRequestHandler):
    def handle(self):
        self.request.recv(65536)
        self.request.sendall(b"SSH-2.0-OpenSSH_9\r\n")


@contextlib.contextmanager
def _local(reply=None, handler=_Canned):
    cls = http.server.ThreadingHTTPServer if handler is _Canned else socketserver.ThreadingTCPServer
    srv = cls(("127.0.0.1", 0), handler)
    srv.daemon_threads = True
    srv.reply, srv.sent, srv.lock = reply, [], threading.Lock()
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    try:
        yield srv, f"http://127.0.0.1:{srv.server_address[1]}"
    finally:
        srv.shutdown()
        srv.server_close()
        t.join()


def _body(obj, cut: int | None = None):
    raw = obj if isinstance(obj, bytes) else json.dumps(obj).encode()
    return lambda request: (200, raw[:cut], len(raw))


def _server(url: str, api: str = "llamacpp", concurrency: int = 1) -> DistillServerParams:
    return DistillServerParams(api=api, url=url, model="m", revision="r", concurrency=concurrency, timeout=30.0)


ONE = [{"id": "conv-7", "messages": [], "prompt_ids": [40, 41]}]
PATHS = {"llamacpp": "/completion", "vllm": "/v1/completions", "sglang": "/generate"}


@pytest.mark.parametrize("api, reply, message", [
    ("llamacpp", _body({"tokens": [5, 2], "stop_type": "eos"}, cut=8), r"IncompleteRead"),
    ("llamacpp", _body(b"<html>Bad gateway</html>"), r"the reply is not JSON: b'<html>"),
    ("llamacpp", _body(b"\xff\xfe\xfa"), r"the reply is not JSON"),
    ("llamacpp", _body([1, 2]), r"the reply is not a JSON object: b'\[1, 2\]'"),
    ("vllm", _body({"choices": []}), r"field `choices\[0\]` is missing \(vllm protocol\)"),
    ("vllm", _body({"choices": [{"finish_reason": "stop"}]}), r"no `choices\[0\].token_ids`.*return_token_ids"),
    ("vllm", _body({"choices": [{"token_ids": [5, 2], "finish_reason": None}]}),
     r"field `choices\[0\].finish_reason` is null"),
    ("sglang", _body({"output_ids": [5, 2], "meta_info": {"finish_reason": None}}),
     r"field `meta_info.finish_reason` is null \(sglang protocol\)"),
    ("sglang", _body({"output_ids": [5, 2], "meta_info": {"finish_reason": "stop"}}),
     r"field `meta_info.finish_reason.type` is missing"),
    ("llamacpp", _body({"tokens": [5, -3], "stop_type": "limit"}),
     rf"id -3 \(position 1\) is outside the target's vocabulary \[0, {VOCAB}\)"),
    ("llamacpp", _body({"tokens": [5, 10 ** 12], "stop_type": "limit"}),
     rf"id {10 ** 12} \(position 1\) is outside the target's vocabulary \[0, {VOCAB}\)"),
    ("llamacpp", _body({"tokens": [5, VOCAB, 2], "stop_type": "eos"}), rf"id {VOCAB} \(position 1\)"),
    ("llamacpp", _body({"tokens": [True, False], "stop_type": "limit"}), r"not a list of ints: \[true, false\]"),
    ("llamacpp", _body({"tokens": [5, 6, 7, 8, 9, 2], "stop_type": "eos"}),
     r"the reply is 6 tokens, longer than distill.max_new_tokens 4"),
    ("llamacpp", lambda request: (500, b"engine died", 11), r"HTTP 500 .*engine died"),
])
def test_every_failed_request_is_a_remote_error_naming_the_conversation_and_url(api, reply, message,
                                                                                char_tokenizer):
    with _local(reply) as (srv, url):
        with pytest.raises(RemoteError, match=message) as e:
            regenerate_remote(_server(url, api), char_tokenizer, [2], ONE, max_new_tokens=4)
    assert str(e.value).startswith(f"self-distill prompt 'conv-7': {url}{PATHS[api]}: "), str(e.value)
    assert len(srv.sent) == 1 and srv.sent[0] is not None


def test_sampled_request_bodies():
    """temperature > 0: that temperature and top_p, the other truncations off, a seed per prompt (llama-server's
    defaults are top_k 40, min_p 0.05); temperature 0: the greedy body, as self-distill sends it."""
    reply = _body({"tokens": [5, 2], "stop_type": "eos"})
    with _local(reply) as (srv, url):
        assert generate_ids(_server(url), [[1], [1, 3]], 4, [2], VOCAB, temperature=0.7, top_p=0.9, seed=5) == \
            [[5, 2], [5, 2]]
        greedy = generate_ids(_server(url), [[1]], 4, [2], VOCAB)
    assert greedy == [[5, 2]]
    sampled = sorted(srv.sent[:2], key=lambda b: b["seed"])
    for body, seed, prompt in zip(sampled, (5, 6), ([1], [1, 3])):
        assert body == {"model": "m", "prompt": prompt, "n_predict": 4, "return_tokens": True, "cache_prompt": False,
                        "stream": False, "repeat_penalty": 1.0, "frequency_penalty": 0.0, "presence_penalty": 0.0,
                        "top_k": 0, "top_p": 0.9, "min_p": 0.0, "seed": seed, "temperature": 0.7}
    assert srv.sent[2] == {"model": "m", "prompt": [1], "n_predict": 4, "return_tokens": True, "cache_prompt": False,
                           "stream": False, "repeat_penalty": 1.0, "frequency_penalty": 0.0, "presence_penalty": 0.0,
                           "top_k": 1, "temperature": 0.0}


def test_a_port_without_http_and_an_invalid_url_are_remote_errors(char_tokenizer):
    with _local(handler=_NotHttp) as (_, url):
        with pytest.raises(RemoteError, match=r"^self-distill prompt 'conv-7': .*/completion: .*BadStatusLine.*SSH-2"):
            regenerate_remote(_server(url), char_tokenizer, [2], ONE, max_new_tokens=4)
        with pytest.raises(RemoteError, match=rf"^{url}/v1/models: .*BadStatusLine"):
            hosted_models(url, 30.0)
    invalid = r"^self-distill prompt 'conv-7': http://exa mple:80/completion: .*InvalidURL"
    with pytest.raises(RemoteError, match=invalid):
        regenerate_remote(_server("http://exa mple:80"), char_tokenizer, [2], ONE, max_new_tokens=4)


@pytest.mark.parametrize("reply, message", [
    (_body([1, 2]), "not a JSON object"),
    (_body({"data": [1, 2]}), "no 'data' list of objects"),
    (_body({"data": None}), "no 'data' list of objects"),
    (_body({"data": [{"id": "m"}]}, cut=5), "IncompleteRead"),
])
def test_hosted_models_refuses_what_is_not_a_model_list(reply, message):
    with _local(reply) as (_, url):
        with pytest.raises(RemoteError, match=rf"^{url}/v1/models: .*{message}"):
            hosted_models(url, 30.0)


def test_the_first_failure_cancels_the_queue_and_the_finished_replies_are_journaled(tmp_path, char_tokenizer):
    """40 prompts, 2 in flight, the first reply cut off mid-body: the requests still queued are
    never sent, and every reply that did come back is in the journal."""
    items = [{"id": f"c{i}", "messages": [], "prompt_ids": [10 + i]} for i in range(40)]

    def reply(request):
        if request["prompt"] == [10]:
            return 200, b'{"tokens": [5', 100
        time.sleep(0.05)  # the good replies are slower than the cut one (never asserted on)
        raw = json.dumps({"tokens": [5, 2], "stop_type": "eos"}).encode()
        return 200, raw, len(raw)

    journal = Journal(tmp_path / "j.jsonl", {"k": 1})
    with _local(reply) as (srv, url):
        with pytest.raises(RemoteError, match=r"^self-distill prompt 'c0': .*/completion: .*IncompleteRead"):
            regenerate_remote(_server(url, concurrency=2), char_tokenizer, [2], items, max_new_tokens=4,
                                  journal=journal)
        sent = [r["prompt"] for r in srv.sent]
    assert [10] in sent and len(sent) <= 4, sent  # the cut one, the one in flight, at most one per worker racing
    done = Journal(tmp_path / "j.jsonl", {"k": 1}).done
    assert sorted(done) == sorted(Journal.key(p) for p in sent if p != [10])
    assert all(ids == [5, 2] for ids in done.values())
