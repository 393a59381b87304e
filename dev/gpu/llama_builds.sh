# llama.cpp's builds on a lent GPU machine, installed where eyas looks for them: beside python3's console
# scripts, each binary with its build record <binary>.eyas-build.json (eyas.eval.llamacpp.server_binary and
# build_info), from the xz-compressed binaries a call carries or parks. Sourced (functions only) by
# dev/gpu/engine_gpu.sh and dev/gpu/h200_profile.sh: one install path for both.
#
# A build's files in a folder DIR, as scripts/build_llama_server.sh makes them and dev/gpu/engine_gpu.sh
# (park-build: keep_build) brings the CUDA one back:
#   llama-server        DIR/llama-server.xz            DIR/llama-server.eyas-build.json       (record backend cpu)
#   llama-server-cuda   DIR/cuda.xz.aa, .ab, ... (one  DIR/llama-server-cuda.eyas-build.json  (record backend cuda)
#                       xz stream split in parts)
# Each function prints what is wrong, naming the file, and returns non-zero; none exits.

llama_bin() {  # the folder eyas finds the builds in: python3's console scripts
  python3 -c 'import sysconfig; print(sysconfig.get_path("scripts"))'
}

llama_xz() {  # llama_xz DIR NAME: the compressed files of build NAME in DIR, one a line, in order (none: nothing)
  case "$2" in
    llama-server) [ ! -f "$1/llama-server.xz" ] || echo "$1/llama-server.xz" ;;
    llama-server-cuda)  # pathname expansion sorts its matches: aa, ab, ac (compgen -G does not)
      local f; for f in "$1"/cuda.xz.a?; do [ ! -f "$f" ] || echo "$f"; done ;;
    *) return 2 ;;
  esac
}

llama_check() {  # llama_check DIR NAME: NAME's compressed binary (whole: xz -t over its parts) and build record
  # (a JSON object whose backend is NAME's) in DIR
  local d=$1 name=$2 backend first xs=()
  case "$name" in
    llama-server) backend=cpu; first=$d/llama-server.xz ;;
    llama-server-cuda) backend=cuda; first=$d/cuda.xz.aa ;;
    *) echo "no llama.cpp build named '$name' (llama-server, llama-server-cuda)"; return 2 ;;
  esac
  [ -f "$first" ] || { echo "no $first"; return 1; }
  [ -f "$d/$name.eyas-build.json" ] || { echo "no $d/$name.eyas-build.json (the build record)"; return 1; }
  mapfile -t xs < <(llama_xz "$d" "$name")
  cat "${xs[@]}" | xz -t 2>/dev/null \
    || { echo "$(printf '%s ' "${xs[@]}")do not decompress whole (a part missing, cut or of another build?)"; return 1; }
  python3 - "$d/$name.eyas-build.json" "$backend" 2>&1 <<'EOF' || return 1
import json
import sys

f, backend = sys.argv[1], sys.argv[2]
try:
    rec = json.load(open(f))
except (OSError, UnicodeDecodeError, ValueError) as e:
    sys.exit(f"{f}: no build record ({type(e).__name__}: {e})")
if not isinstance(rec, dict) or rec.get("backend") != backend:
    got = rec.get("backend") if isinstance(rec, dict) else type(rec).__name__
    sys.exit(f"{f}: the build record names backend {got!r}, not {backend!r}")
EOF
}

llama_install() {  # llama_install DIR NAME: NAME from DIR (llama_check first) into llama_bin, with its record;
  # whole, or the one installed before left in place
  local d=$1 name=$2 bin xs=()
  llama_check "$d" "$name" || return 1
  bin=$(llama_bin) || return 1
  mapfile -t xs < <(llama_xz "$d" "$name")
  if cat "${xs[@]}" | xz -dc > "$bin/$name.tmp" && chmod 755 "$bin/$name.tmp" \
      && cp "$d/$name.eyas-build.json" "$bin/$name.eyas-build.json.tmp" \
      && mv "$bin/$name.tmp" "$bin/$name" && mv "$bin/$name.eyas-build.json.tmp" "$bin/$name.eyas-build.json"; then
    echo "installed $bin/$name from $d"
  else
    rm -f "$bin/$name.tmp" "$bin/$name.eyas-build.json.tmp"
    echo "$name from $d did not install in $bin"; return 1
  fi
}

llama_installed() {  # llama_installed NAME: NAME and its build record in llama_bin
  local bin
  bin=$(llama_bin) || return 1
  [ -x "$bin/$1" ] && [ -f "$bin/$1.eyas-build.json" ] || { echo "no $1 with its build record in $bin"; return 1; }
}

llama_libgomp() {  # llama_libgomp FILE: the CPU build's OpenMP runtime where the loader finds it, unless it has one
  ldconfig -p | grep -q libgomp.so.1 || { cp "$1" /usr/local/lib/ && ldconfig; } \
    || { echo "libgomp.so.1 from $1 did not install"; return 1; }
}

llama_cuda_device() {  # the first CUDA device llama-server-cuda lists (common/arg.cpp: "  CUDA0: NAME (..."), else fail
  local bin out
  bin=$(llama_bin) || return 1
  out=$("$bin"/llama-server-cuda --list-devices 2>&1)
  echo "$out" | grep -E "^\s*CUDA0: " || { echo "llama-server-cuda lists no CUDA device: $out" | tail -5; return 1; }
}
