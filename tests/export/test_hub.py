"""Hub ids for target.path (eyas/target/hub.py), offline against a real HF cache layout; `eyas push`.

The cache is made here, in huggingface_hub's layout (``models--org--name/{refs/main,
snapshots/<sha>/}``), from the embedded target's tokenizer and config (a small random model of its
vocabulary, saved as safetensors by transformers) and from a drafter eyas exports (what `eyas push`
checks); every load runs in a subprocess with ``HF_HUB_OFFLINE=1`` and ``HF_HUB_CACHE`` pointing at
it (huggingface_hub reads both at import), so no network is touched and the real snapshot resolution
runs.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # ~1 min on 2 idle cores: the GGUF tokenizer, one subprocess's imports and loads

SHA = "0123456789abcdef0123456789abcdef01234567"
OTHER_SHA = "fedcba9876543210fedcba9876543210fedcba98"
ROOT = Path(__file__).resolve().parents[2]


def _repo(cache: Path, repo_id: str, sha: str, branch: str | None = "main", make: bool = True) -> Path:
    base = cache / ("models--" + repo_id.replace("/", "--"))
    snap = base / "snapshots" / sha
    snap.parent.mkdir(parents=True, exist_ok=True)
    if make:
        snap.mkdir()
    if branch:
        (base / "refs").mkdir(exist_ok=True)
        (base / "refs" / branch).write_text(sha)
    return snap


@pytest.fixture(scope="module")
def hub_cache(tmp_path_factory, smollm_tokenizer):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from eyas.drafter.model import DrafterConfig, Eagle3Drafter
    from eyas.export.eagle import save_drafter

    cache = tmp_path_factory.mktemp("hf_cache")
    tok = smollm_tokenizer
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=16, intermediate_size=32, num_hidden_layers=4,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256,
                      bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, tie_word_embeddings=True)
    model = LlamaForCausalLM(cfg)
    snap = _repo(cache, "eyas-test/tiny-chat", SHA)
    model.save_pretrained(snap, safe_serialization=True)
    tok.save_pretrained(snap)
    # the same model with pickled weights only: must be refused, never unpickled
    bin_snap = _repo(cache, "eyas-test/tiny-chat-bin", SHA)
    for f in snap.iterdir():
        if not f.name.endswith(".safetensors"):
            (bin_snap / f.name).write_bytes(f.read_bytes())
    torch.save(model.state_dict(), bin_snap / "pytorch_model.bin")
    # two revisions whose chat templates differ: main (OTHER_SHA) as saved, the pinned SHA marked
    for sha, branch in ((OTHER_SHA, "main"), (SHA, None)):
        two = _repo(cache, "eyas-test/two-templates", sha, branch=branch)
        for f in snap.iterdir():
            (two / f.name).write_bytes(f.read_bytes())
    template = tok.chat_template
    tok.chat_template = "PINNED " + template
    tok.save_pretrained(cache / "models--eyas-test--two-templates" / "snapshots" / SHA)
    tok.chat_template = template
    # a drafter in the eyas/SGLang layout under a tag-less repo, pinned by commit only
    dcfg = DrafterConfig(hidden_size=16, intermediate_size=32, num_attention_heads=2, num_key_value_heads=1,
                         head_dim=8, vocab_size=len(tok), draft_vocab_size=8, target_hidden_size=16,
                         num_target_layers=4, aux_layer_ids=[1, 2, 3])
    drafter = Eagle3Drafter(dcfg)
    ids = torch.arange(0, 80, 10)
    t2d = torch.zeros(len(tok), dtype=torch.bool)
    t2d[ids] = True
    drafter.set_vocab(ids - torch.arange(8), t2d)
    save_drafter(drafter, _repo(cache, "eyas-test/drafter", OTHER_SHA, branch=None, make=False))
    return cache


def _offline(cache: Path, code: str) -> dict:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(cache), "PYTHONPATH": str(ROOT)}
    r = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                       env=env, cwd=ROOT, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def offline(hub_cache):
    """Every hub load, in one offline subprocess (imports once): what each returned or raised."""
    return _offline(hub_cache, f"""
        import json
        from eyas.target.model import TargetError, load_target, load_tokenizer_and_config
        res = {{}}
        t = load_target("eyas-test/tiny-chat", revision="{SHA}")
        res["identity"] = t.identity
        res["weight0"] = float(t.model.model.embed_tokens.weight[5, 3])
        res["main"] = load_target("eyas-test/tiny-chat", revision=None).identity["commit"]
        tok, cfg = load_tokenizer_and_config("eyas-test/tiny-chat", revision="main")
        res["template"] = bool(tok.chat_template)
        for name, kw in [("missing_rev", dict(revision="{OTHER_SHA}")),
                         ("missing_repo", dict(revision="{SHA}", path="eyas-test/nope")),
                         ("pickle_only", dict(revision="{SHA}", path="eyas-test/tiny-chat-bin")),
                         ("missing_gguf", dict(revision="{SHA}", gguf_file="model.Q4.gguf")),
                         ("mistyped_local", dict(revision=None, path="models/stand-in"))]:
            try:
                load_target(kw.pop("path", "eyas-test/tiny-chat"), **kw)
                res[name] = None
            except TargetError as e:
                res[name] = str(e)
        # self-distill renders its prompts with the tokenizer at target.revision, not main's
        import tempfile
        from pathlib import Path
        from eyas.params.full import load_params
        from eyas.data.conversations import render_prompt
        from stages import self_distill
        ws = Path(tempfile.mkdtemp())
        (ws / "params.yaml").write_text(json.dumps({{
            "target": {{"path": "eyas-test/two-templates", "revision": "{SHA}"}},
            "distill": {{"enabled": True, "backend": "hf", "splits": ["train"]}}}}))
        (ws / "conv").mkdir()
        (ws / "conv" / "train.jsonl").write_text(json.dumps({{"id": "c1", "messages": [
            {{"role": "user", "content": "hi"}}, {{"role": "assistant", "content": "yo"}}]}}) + "\\n")
        seen = {{}}
        def stop_at_load(*a, tokenizer=None, revision=None, **k):
            seen["prompt"] = tokenizer.decode(render_prompt(tokenizer, [{{"role": "user", "content": "hi"}}]))
            seen["revision"] = revision
            raise KeyboardInterrupt
        try:
            self_distill.run(load_params(ws / "params.yaml"), ws / "conv", ws / "out", ws / "m.json",
                             load_target=stop_at_load, work_dir=ws / "work")
        except KeyboardInterrupt:
            pass
        main_tok, _ = load_tokenizer_and_config("eyas-test/two-templates", revision=None)
        seen["main_prompt"] = main_tok.decode(render_prompt(main_tok, [{{"role": "user", "content": "hi"}}]))
        res["self_distill"] = seen
        print(json.dumps(res))
    """)


def _offline(cache: Path, code: str) -> dict:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(cache), "PYTHONPATH": str(ROOT)}
    r = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                       env=env, cwd=ROOT, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_a_hub_target_loads_offline_from_the_cache_at_its_revision(hub_cache, offline):
    ident = offline["identity"]
    assert ident["path"] == "eyas-test/tiny-chat" and ident["revision"] == SHA and ident["commit"] == SHA
    assert offline["main"] == SHA  # unpinned: refs/main resolved to the commit it names
    assert offline["template"]
    from safetensors.torch import load_file  # the weights are the ones saved, not a fresh init
    w = load_file(next((hub_cache / "models--eyas-test--tiny-chat" / "snapshots" / SHA).glob("*.safetensors")))
    assert offline["weight0"] == pytest.approx(float(w["model.embed_tokens.weight"][5, 3]))


def test_self_distill_renders_prompts_with_the_pinned_revision_tokenizer(offline):
    sd = offline["self_distill"]
    assert sd["revision"] == SHA
    assert sd["prompt"].startswith("PINNED ") and "hi" in sd["prompt"]
    assert not sd["main_prompt"].startswith("PINNED ") and sd["prompt"] == "PINNED " + sd["main_prompt"]


def test_a_missing_revision_repo_or_file_and_pickled_weights_are_refused_by_name(offline):
    for name in ("missing_rev", "missing_repo", "pickle_only", "missing_gguf"):
        assert offline[name] is not None, name
        assert "target.path" in offline[name], offline[name]
    assert "eyas-test/tiny-chat" in offline["missing_rev"] and OTHER_SHA in offline["missing_rev"]
    assert "eyas-test/nope" in offline["missing_repo"] and SHA in offline["missing_repo"]
    # an org/name-shaped path that is neither a local directory nor cached says both
    assert offline["mistyped_local"].startswith("target.path 'models/stand-in' at revision 'main': no local "
                                                "directory 'models/stand-in', and the hub repo is not in the "
                                                "local HF cache"), offline["mistyped_local"]
    assert "safetensors" in offline["pickle_only"] and ".bin" in offline["pickle_only"]
    assert "model.Q4.gguf" in offline["missing_gguf"] and SHA in offline["missing_gguf"]


def test_push_dry_run_checks_the_drafter_and_plans_exactly_the_served_files(hub_cache, tmp_path):
    import hashlib
    import shutil

    src = hub_cache / "models--eyas-test--drafter" / "snapshots" / OTHER_SHA
    d = tmp_path / "drafter"
    shutil.copytree(src, d)
    (d / "fingerprint.json").write_text("{}")  # local provenance: not published
    r = subprocess.run([sys.executable, "-m", "eyas.cli", "push", str(d), "--repo", "org/new-drafter", "--dry-run"],
                       capture_output=True, text=True, cwd=ROOT, env={**os.environ, "HF_HUB_OFFLINE": "1"}, timeout=300)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["repo"] == "org/new-drafter" and out["revision"] == "main" and out["dry_run"] is True
    assert [f["file"] for f in out["files"]] == ["config.json", "model.safetensors"]
    for f in out["files"]:
        data = (d / f["file"]).read_bytes()
        assert f["bytes"] == len(data) and f["sha256"] == hashlib.sha256(data).hexdigest()
    (d / "model.safetensors").unlink()
    r = subprocess.run([sys.executable, "-m", "eyas.cli", "push", str(d), "--repo", "org/x", "--dry-run"],
                       capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert r.returncode == 2 and "missing ['model.safetensors']" in r.stderr


def _push(d: Path, *args: str, cache: Path | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", **({"HF_HUB_CACHE": str(cache)} if cache else {})}
    return subprocess.run([sys.executable, "-m", "eyas.cli", "push", str(d), "--dry-run", *args],
                          capture_output=True, text=True, cwd=ROOT, env=env, timeout=300)


def test_push_checks_the_drafter_against_the_target_it_is_published_for(hub_cache):
    d = hub_cache / "models--eyas-test--drafter" / "snapshots" / OTHER_SHA  # 4 layers, hidden 16
    ok = _push(d, "--repo", "org/d", "--target", "eyas-test/tiny-chat", cache=hub_cache)
    assert ok.returncode == 0, ok.stderr
    # the embedded SmolLM2 target: 30 layers, hidden 576, vocab 49,152 (its GGUF's metadata)
    r = _push(d, "--repo", "org/d", "--target", "embedded")
    assert r.returncode == 2
    for wrong in ("hidden_size (target_hidden_size) 16 (drafter) != 576 (target)",
                  "num_target_layers 4 (drafter) != 30 (target)"):
        assert wrong in r.stderr, r.stderr


@pytest.mark.parametrize("repo, message", [
    ("bad name/x", "must use alphanumeric chars"),
    ("a/b/c", "in the form 'repo_name' or 'namespace/repo_name'"),
    ("org/x--y", "Cannot have -- or .."),
    ("x", "give the owner too, as org/name"),
])
def test_a_repo_id_the_hub_would_refuse_fails_the_dry_run(hub_cache, repo, message, capsys):
    from eyas.cli import main

    d = hub_cache / "models--eyas-test--drafter" / "snapshots" / OTHER_SHA
    assert main(["push", str(d), "--repo", repo, "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert f"--repo {repo!r}: " in err and message in err, err


def test_push_shows_the_context_and_rope_warnings_of_a_drafter_the_target_runs_otherwise(hub_cache, tmp_path, capsys):
    import shutil

    from eyas.cli import main

    target = hub_cache / "models--eyas-test--tiny-chat" / "snapshots" / SHA  # max_position_embeddings 256
    d = tmp_path / "drafter"
    shutil.copytree(hub_cache / "models--eyas-test--drafter" / "snapshots" / OTHER_SHA, d)
    assert main(["push", str(d), "--repo", "org/d", "--target", str(target), "--dry-run"]) == 0
    before = json.loads(capsys.readouterr().out)["warnings"]  # the fixture's own (aux layer ids, context)
    assert not [w for w in before if "RoPE" in w or "< the target's" in w], before
    cfg = json.loads((d / "config.json").read_text())
    theta = cfg.get("rope_theta") or cfg["rope_parameters"]["rope_theta"]
    cfg.update(max_position_embeddings=128, rope_theta=theta * 2)
    cfg.pop("rope_parameters", None)
    (d / "config.json").write_text(json.dumps(cfg))
    assert main(["push", str(d), "--repo", "org/d", "--target", str(target), "--dry-run"]) == 0
    out = capsys.readouterr()
    warnings = json.loads(out.out)["warnings"]
    context = [w for w in warnings if "max_position_embeddings 128 < the target's 256" in w]
    rope = [w for w in warnings if f"RoPE theta {theta * 2:g}" in w and f"!= theta {theta:g}" in w]
    assert len(context) == 1 and len(rope) == 1, warnings
    assert out.err.splitlines() == [f"eyas push: warning: {w}" for w in warnings]


def _not_a_target(t: Path, kind: str) -> str:
    """A ``--target`` argument of ``kind`` under ``t`` (created as needed)."""
    if kind == "manifest":
        (t / "manifest.json").write_text('{"splits": []}')
    if kind == "file":
        (t / "x.safetensors").write_bytes(b"")
    if kind == "gguf":
        (t / "x.gguf").write_bytes(b"GGUF\x03\x00")  # the magic and a truncated header
    return {"missing": str(t / "missing"), "relative": "data/features/nope", "file": str(t / "x.safetensors"),
            "gguf": str(t / "x.gguf")}.get(kind, str(t))


@pytest.mark.parametrize("kind, message", [
    ("missing", "{t}/missing: no such file or directory (nor a hub id, org/name)"),
    ("relative", "data/features/nope: no such file or directory (nor a hub id, org/name)"),
    ("empty", "{t}: a directory with neither config.json (an HF target) nor manifest.json"),
    ("manifest", "{t}/manifest.json: no target_config mapping (not an eyas feature manifest)"),
    ("file", "{t}/x.safetensors: not a target"),
    ("gguf", "{t}/x.gguf: not a GGUF file transformers can read"),
])
def test_push_and_inspect_name_a_target_that_is_not_one(hub_cache, tmp_path, kind, message, capsys):
    from eyas.cli import main

    d = hub_cache / "models--eyas-test--drafter" / "snapshots" / OTHER_SHA
    target = _not_a_target(tmp_path, kind)
    for cmd in (["push", str(d), "--repo", "org/d", "--dry-run"], ["inspect", str(d)]):
        assert main([*cmd, "--target", target]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"eyas {cmd[0]}: error: cannot read the target {target}: ")
        assert message.format(t=tmp_path) in err, err
