"""An independent reference of the EAGLE-3 draft forward, written here from the description of
SGLang's ``python/sglang/srt/models/llama_eagle3.py`` (``sgl-project/sglang``), reading ONLY the
exported ``config.json`` and ``model.safetensors`` (no eyas code on the reference side), against
eyas' drafter on the same inputs.

SGLang, as read: ``hidden = fc(aux)`` when the hidden width differs from the embedding's;
``residual = hidden`` (un-normed); attention input ``cat([input_layernorm(embed),
hidden_norm(hidden)])`` (embedding first); Llama attention with RoPE (rotate-half) and GQA;
``h = residual + o_proj(attn)``; ``post_attention_layernorm`` then MLP, added to ``h``; the
final ``norm`` then ``lm_head``; draft logits land at target ids ``hot_token_id = d2t + arange``.
RoPE as the engines build it from the config (``get_rope`` with ``rope_theta`` and ``rope_scaling``):
plain RoPE written out here, a scaled one from transformers' ``ROPE_INIT_FUNCTIONS``.
"""

import json
import math

import pytest
import torch
from safetensors.torch import load_file

from eyas.drafter.model import DrafterConfig, Eagle3Drafter, KVCache
from eyas.export.eagle import save_drafter

V, VD, H, TH = 96, 12, 32, 48


def reference_forward(ckpt_dir, embed_weight, aux, input_ids, positions):
    """From scratch, float64. aux [T, 3*TH], input_ids [T], positions [T] -> (pre-norm hidden [T, H],
    draft logits [T, VD], full-vocab logits [T, V] with -inf outside the draft vocab)."""
    cfg = json.loads((ckpt_dir / "config.json").read_text())
    tensors = load_file(str(ckpt_dir / "model.safetensors"))
    w = {k: v.double() if v.is_floating_point() else v for k, v in tensors.items()}
    Hd, nh, nkv = cfg["head_dim"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    eps, theta = cfg["rms_norm_eps"], cfg["rope_theta"]

    def rms(x, g):
        return g * (x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps))

    scaling = cfg.get("rope_scaling")
    if scaling:  # transformers' own RoPE init for the config as written (no eyas code)
        from transformers import LlamaConfig
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        lc = LlamaConfig(**{k: v for k, v in cfg.items() if k not in ("architectures", "eyas")})
        inv_scaled = ROPE_INIT_FUNCTIONS[scaling["rope_type"]](lc, "cpu")[0].double()

    def rope(x):  # x [heads, T, Hd]; HF Llama rotate-half layout
        inv = inv_scaled if scaling else \
            torch.tensor([1.0 / theta ** (2 * i / Hd) for i in range(Hd // 2)], dtype=torch.float64)
        ang = positions.double()[:, None] * inv[None]
        cos, sin = torch.cat([ang.cos(), ang.cos()], -1), torch.cat([ang.sin(), ang.sin()], -1)
        x1, x2 = x[..., :Hd // 2], x[..., Hd // 2:]
        return x * cos + torch.cat([-x2, x1], -1) * sin

    T = input_ids.shape[0]
    embeds = embed_weight.double()[input_ids]
    hidden = aux.double() @ w["fc.weight"].T if aux.shape[-1] != embeds.shape[-1] else aux.double()
    residual = hidden
    x = torch.cat([rms(embeds, w["midlayer.input_layernorm.weight"]),
                   rms(hidden, w["midlayer.hidden_norm.weight"])], -1)
    q = (x @ w["midlayer.self_attn.q_proj.weight"].T).view(T, nh, Hd).transpose(0, 1)
    k = (x @ w["midlayer.self_attn.k_proj.weight"].T).view(T, nkv, Hd).transpose(0, 1)
    v = (x @ w["midlayer.self_attn.v_proj.weight"].T).view(T, nkv, Hd).transpose(0, 1)
    q, k = rope(q), rope(k)
    heads = []
    for h in range(nh):
        kvh = h // (nh // nkv)  # GQA: query head h reads kv head h // group
        s = q[h] @ k[kvh].T / math.sqrt(Hd)
        s = s.masked_fill(torch.ones(T, T).triu(1).bool(), float("-inf"))
        heads.append(s.softmax(-1) @ v[kvh])
    attn = torch.cat(heads, -1) @ w["midlayer.self_attn.o_proj.weight"].T
    h = residual + attn
    m = rms(h, w["midlayer.post_attention_layernorm.weight"])
    mlp = ((m @ w["midlayer.mlp.gate_proj.weight"].T) * torch.sigmoid(m @ w["midlayer.mlp.gate_proj.weight"].T)
           * (m @ w["midlayer.mlp.up_proj.weight"].T)) @ w["midlayer.mlp.down_proj.weight"].T
    out = h + mlp  # pre-norm: fed back to the next draft step
    logits = rms(out, w["norm.weight"]) @ w["lm_head.weight"].T
    hot = w["d2t"] + torch.arange(len(w["d2t"]))  # SGLang: hot_token_id = d2t + arange
    full = torch.full((T, cfg["vocab_size"]), float("-inf"), dtype=torch.float64)
    full[:, hot] = logits
    return out, logits, full


LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 16}


@pytest.fixture(scope="module", params=[None, LLAMA3], ids=["plain-rope", "llama3-rope"])
def exported(tmp_path_factory, request):
    torch.manual_seed(0)
    c = DrafterConfig(hidden_size=H, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=8, vocab_size=V, draft_vocab_size=VD, target_hidden_size=TH, num_target_layers=8,
                      rope_theta=500.0, rms_norm_eps=1e-6, rope_scaling=request.param)
    d = Eagle3Drafter(c).eval()
    d.reset_parameters(std=0.2)
    for n in (d.midlayer.input_layernorm, d.midlayer.hidden_norm, d.midlayer.post_attention_layernorm, d.norm):
        n.weight.data = 1 + 0.3 * torch.randn(H)
    # a FREQUENCY-ordered mapping (target ids not ascending): conversion must go through d2t
    tids = torch.tensor([40, 3, 77, 12, 95, 0, 58, 21, 9, 66, 30, 81])
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[tids] = True
    d.set_vocab(tids - torch.arange(VD), t2d)
    embed = torch.randn(V, H)
    d.set_embedding(embed)
    out = tmp_path_factory.mktemp("ref") / "drafter"
    save_drafter(d, out)
    return d, embed, out, tids


def test_draft_logits_match_an_independent_reference(exported):
    d, embed, ckpt, tids = exported
    g = torch.Generator().manual_seed(1)
    T = 5
    aux = torch.randn(T, 3 * TH, generator=g)
    ids = torch.randint(0, V, (T,), generator=g)
    pos = torch.arange(3, 3 + T) * 7  # not starting at 0, and past llama3's original 16: RoPE scaling is honoured
    ref_h, ref_logits, ref_full = reference_forward(ckpt, embed, aux, ids, pos)
    with torch.no_grad():
        h = d.decode(aux[None], ids[None], pos[None], KVCache())[0]
        logits = d.logits(h)
        target_ids = d.draft_to_target(torch.arange(VD))
    assert torch.allclose(h.double(), ref_h, atol=1e-4), (h.double() - ref_h).abs().max()
    assert torch.allclose(logits.double(), ref_logits, atol=1e-4), (logits.double() - ref_logits).abs().max()
    assert target_ids.tolist() == tids.tolist()
    # the engines' full-vocab view: the top target token is the same
    full = torch.full((T, V), float("-inf"))
    full[:, target_ids] = logits
    assert torch.equal(full.argmax(-1), ref_full.argmax(-1))
    assert torch.isinf(ref_full[:, 1]).all()  # token 1 is not in the draft vocab


def test_second_step_feeds_back_the_prenorm_hidden(exported):
    """Step 2 input is the draft's own H-wide pre-norm output: fc is skipped (SGLang applies fc only
    when the width differs). One token appended after a 3-token prefix = causal attention."""
    d, embed, ckpt, _ = exported
    g = torch.Generator().manual_seed(2)
    aux = torch.randn(3, 3 * TH, generator=g)
    ids = torch.randint(0, V, (4,), generator=g)
    with torch.no_grad():
        kv = KVCache()
        h0 = d.decode(aux[None], ids[None, :3], torch.arange(3)[None], kv)[0]
        h1 = d.decode(h0[None, 2:3], ids[None, 3:4], torch.tensor([[3]]), kv)[0]
    # reference over the 4 positions at once: rows 0..2 from aux, row 3 from h0[2] (no fc)
    cfg = json.loads((ckpt / "config.json").read_text())
    w = load_file(str(ckpt / "model.safetensors"))
    hidden_in = torch.cat([aux.double() @ w["fc.weight"].double().T, h0[2:3].double()])
    assert cfg["hidden_size"] == H
    ref_h, _, _ = reference_forward(ckpt, embed, hidden_in, ids, torch.arange(4))
    assert torch.allclose(h1[0].double(), ref_h[3], atol=1e-4), (h1[0].double() - ref_h[3]).abs().max()


def test_reference_is_sensitive_to_the_concat_order(exported, tmp_path):
    """Guard: the comparison can fail. Swapping the two halves of the q/k/v input columns
    (hidden first, embedding second) in the file must break agreement."""
    d, embed, ckpt, _ = exported
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text((ckpt / "config.json").read_text())
    w = load_file(str(ckpt / "model.safetensors"))
    from safetensors.torch import save_file
    for p in ("q_proj", "k_proj", "v_proj"):
        t = w[f"midlayer.self_attn.{p}.weight"]
        w[f"midlayer.self_attn.{p}.weight"] = torch.cat([t[:, H:], t[:, :H]], 1).contiguous()
    save_file(w, str(bad / "model.safetensors"))
    g = torch.Generator().manual_seed(1)
    aux, ids, pos = torch.randn(4, 3 * TH, generator=g), torch.randint(0, V, (4,), generator=g), torch.arange(4)
    _, ref_logits, _ = reference_forward(bad, embed, aux, ids, pos)
    with torch.no_grad():
        logits = d.logits(d.decode(aux[None], ids[None], pos[None], KVCache())[0])
    assert not torch.allclose(logits.double(), ref_logits, atol=1e-3)
