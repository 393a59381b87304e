"""The engine on a GPU with a tiny pair (dev/gpu/engine_gpu.sh ``tiny``): a target GGUF and an eyas drafter GGUF made
on a workstation, with eyas' own figures (``smoke.json``), served by llama-server-cuda over a k sweep and by the CPU
build at k = 4; the agreement of each with eyas' loop, of the two backends with each other, and the CUDA build
refusing a start with no GPU visible.

    python3 dev/gpu/serve_tiny.py DIR OUT.json
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from eyas.eval.llamacpp import agreement, serve_benchmark  # noqa: E402

NO_GPU = """import sys
from pathlib import Path
from eyas.eval.llamacpp import EngineError, LlamaServer
try:
    with LlamaServer(Path(sys.argv[1]), None, k=4, threads=4, ctx=256, log=Path("/tmp/no_gpu.log"), backend="cuda"):
        print("NOT REFUSED: served with no GPU visible")
except EngineError as err:
    print(str(err).splitlines()[0][:300])
"""


def main(d: Path, out: Path) -> None:
    ref = json.loads((d / "smoke.json").read_text())
    prompts, n_new = ref["prompts"], max(len(y) for y in ref["outputs"])
    kw = {"max_new_tokens": n_new, "log_dir": Path("/tmp/serve_tiny")}
    cuda = serve_benchmark(d / "target.gguf", d / "drafter.gguf", prompts, k=4, threads=4, backend="cuda",
                           k_sweep=list(range(1, 9)), **kw)
    cpu = serve_benchmark(d / "target.gguf", d / "drafter.gguf", prompts, k=4, threads=14, backend="cpu", **kw)
    doc = {"eyas_accept": ref["eyas_accept"], "backends": {}}
    for name, e in (("cuda", cuda), ("cpu", cpu)):
        a = agreement(e["per_prompt"], ref["eyas_per_prompt_k4"])
        doc["backends"][name] = {**{k: v for k, v in e.items() if k != "per_prompt"}, "agreement": a}
        print(f"tiny {name} on {e['device']}: accept {e['accept_len']:.3f} (eyas {ref['eyas_accept']['4']:.3f}), "
              f"{e['tokens_per_second']:.1f} tok/s vs {e['tokens_per_second_plain']:.1f} plain ({e['speedup']:.2f}x), "
              f"plain {e['plain_ms_per_token']:.2f} ms/token, draft {e['draft_ms_per_step']} ms/step, verify "
              f"{e['verify_ms_per_step']} ms/step, lossless {e['lossless']}; agreement {a['ok']} "
              f"({a['exact']}/{a['compared']} exact)", flush=True)
    if cuda.get("k_sweep"):
        rows = {k: (round(v["accept_len"], 2), round(v["speedup"], 2)) for k, v in cuda["k_sweep"]["rows"].items()}
        print("tiny cuda sweep (accept, speedup):", rows, "recommended", cuda["k_sweep"]["recommended_k"])
    doc["cuda_vs_cpu"] = agreement(cuda["per_prompt"], cpu["per_prompt"])
    print("tiny cuda vs cpu:", {k: doc["cuda_vs_cpu"][k] for k in ("compared", "exact", "ok")}, flush=True)
    no_gpu = subprocess.run([sys.executable, "-c", NO_GPU, str(d / "target.gguf")], capture_output=True, text=True,
                            env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    doc["no_gpu_refused"] = no_gpu.stdout.strip() or no_gpu.stderr.strip()[-300:]
    print("tiny no GPU visible:", doc["no_gpu_refused"], flush=True)
    out.write_text(json.dumps(doc, indent=1, default=str))


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
