#!/usr/bin/env bash
# The GPU tier, one prepared script for a bare GPU machine with no network: it has python3
# with torch (CUDA) and NVIDIA's NCCL wheel, and none of our other dependencies.
#
#   bash scripts/gpu_check.sh --wheels WHEEL_DIR [PYTHON_VERSION]
#       beforehand, where PyPI is reachable: this project's wheel and every dependency the
#       GPU tier needs but torch (the project's own, pytest, pytest-asyncio, pytest-timeout,
#       pytest-xdist) as wheels for CPython PYTHON_VERSION (default 3.12, the GPU machine's)
#       on x86-64 Linux into WHEEL_DIR (~15 MB).
#   bash scripts/gpu_check.sh OUT_DIR [WHEEL_DIR]
#       on the GPU machine, from this checkout: installs the project and its missing
#       dependencies from WHEEL_DIR (default ./.gpu-wheels) alone into a throwaway venv that
#       sees python3's own packages (torch, NCCL) and changes none of them, then runs
#       `pytest -m gpu tests/` (from the checkout) and the installed `xpyd doctor`, all within
#       8 minutes, and writes every result under OUT_DIR (7 files: summary.txt first).
#
# Exit: 0 install, GPU tests and doctor all passed; 3 no GPU here (the doctor's device-free
# checks passed, the GPU tests skipped); 1 anything failed; 2 usage.
# PYTHON names the interpreter (default python3). TIME_LIMIT_S (default 480) bounds the run.
set -uo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
PY=${PYTHON:-python3}
EXTRA=(pytest pytest-asyncio pytest-timeout pytest-xdist)

usage() {
  sed -n '2,18p' "$0" >&2
  exit 2
}

make_wheels() {  # WHEEL_DIR [PYTHON_VERSION]
  local dir=$1 pyver=${2:-3.12} plats=() n
  mkdir -p "$dir" || return 1
  dir=$(cd "$dir" && pwd)
  # The project's runtime dependencies from pyproject.toml, torch excepted (the machine has
  # its CUDA build; a resolve would pull another).
  mapfile -t reqs < <("$PY" - "$REPO/pyproject.toml" <<'EOF'
import re, sys, tomllib
deps = tomllib.load(open(sys.argv[1], "rb"))["project"]["dependencies"]
print("\n".join(d for d in deps if re.split(r"[\s;<>=!~\[]", d, maxsplit=1)[0].lower() != "torch"))
EOF
  ) || return 1
  for n in 17 24 27 28 31 34 35 39; do plats+=(--platform "manylinux_2_${n}_x86_64"); done
  plats+=(--platform manylinux2014_x86_64 --platform manylinux1_x86_64)
  echo "gpu_check: this project's wheel into $dir"
  "$PY" -m pip wheel -q --no-deps -w "$dir" "$REPO" || return 1
  echo "gpu_check: for CPython $pyver: ${reqs[*]} ${EXTRA[*]} and what they need"
  "$PY" -m pip download -q --only-binary=:all: --python-version "$pyver" --implementation cp "${plats[@]}" \
    -d "$dir" "${reqs[@]}" "${EXTRA[@]}" || return 1
  echo "gpu_check: $(ls "$dir"/*.whl | wc -l) wheels, $(du -sh "$dir" | cut -f1) in $dir"
}

if [ "${1:-}" = --wheels ]; then
  [ $# -ge 2 ] && [ $# -le 3 ] || usage
  make_wheels "$2" "${3:-}"
  exit $?
fi
[ $# -ge 1 ] && [ $# -le 2 ] && [ "${1#-}" = "$1" ] || usage

OUT=$1
WHEELS=${2:-$REPO/.gpu-wheels}
LIMIT=${TIME_LIMIT_S:-480}
mkdir -p "$OUT" || exit 1
OUT=$(cd "$OUT" && pwd)
rm -f "$OUT"/{summary.txt,env.txt,install.log,pytest-gpu.log,pytest-gpu.xml,doctor.log,doctor.json}
T0=$SECONDS
say() { echo "gpu_check: $*" | tee -a "$OUT/summary.txt"; }
left() { echo $((LIMIT - (SECONDS - T0))); }
finish() {  # CODE VERDICT
  say "verdict: $2 (exit $1, $((SECONDS - T0)) s)"
  exit "$1"
}
say "$(date -u +%FT%TZ) on $(hostname), checkout $(git -C "$REPO" rev-parse --short HEAD 2>/dev/null || echo '?'); limit ${LIMIT} s"
[ -d "$WHEELS" ] || finish 1 "no wheel folder $WHEELS: make it with bash scripts/gpu_check.sh --wheels $WHEELS"

# ---- install: a venv that sees python3's packages through a .pth (pip too), filled from WHEELS
# only. pip never uninstalls what lies outside the venv: python3's torch and NCCL stay as they are.
WORK=$(mktemp -d "${TMPDIR:-/tmp}/xpyd-gpu-check.XXXXXX") || exit 1
trap 'rm -rf "$WORK"' EXIT
VENV=$WORK/venv
(
  # Only WHEEL_DIR: no index, no pip configuration, no PIP_* variable of this machine.
  for v in $(compgen -e | grep '^PIP_'); do unset "$v"; done
  export PIP_CONFIG_FILE=/dev/null PIP_DISABLE_PIP_VERSION_CHECK=1
  set -x
  "$PY" -m venv --without-pip "$VENV" &&
    "$PY" - "$VENV" <<'EOF' &&
import site, subprocess, sys
# python3's own package folders (torch, NCCL, ...), with their .pth files, after the venv's.
dirs = [p for p in sys.path if p.endswith(("site-packages", "dist-packages"))]
venv_site = subprocess.check_output([sys.argv[1] + "/bin/python", "-c",
                                     "import sysconfig; print(sysconfig.get_paths()['purelib'])"], text=True).strip()
with open(venv_site + "/_xpyd_base.pth", "w") as f:
    f.write("".join(f"import site; site.addsitedir({d!r})\n" for d in dirs))
print("base packages from:", dirs)
EOF
    timeout -k 10 300 "$VENV/bin/python" -m pip install --no-index --find-links "$WHEELS" \
      --no-cache-dir --progress-bar off xpyd "${EXTRA[@]}"
) >"$OUT/install.log" 2>&1
rc=$?
[ $rc -eq 0 ] || { tail -n 5 "$OUT/install.log" | tee -a "$OUT/summary.txt"; finish 1 "install from $WHEELS failed (install.log)"; }
VPY=$VENV/bin/python
say "install: ok in $((SECONDS - T0)) s (install.log)"

# ---- what this machine is (env.txt)
{
  "$VPY" - <<'EOF'
import importlib.metadata as md, platform, sys
print("python", sys.version.split()[0], platform.platform())
for name in ("xpyd", "torch", "nvidia-nccl-cu13", "nvidia-nccl-cu12", "pyzmq", "fastapi", "uvicorn", "httpx",
             "msgpack", "orjson", "uvloop", "pytest", "pytest-asyncio", "pytest-timeout", "pytest-xdist"):
    try:
        print(f"{name} {md.version(name)}")
    except md.PackageNotFoundError:
        print(f"{name} -")
import torch
print("cuda", torch.version.cuda, "available", torch.cuda.is_available(), "devices", torch.cuda.device_count())
EOF
  echo
  if command -v nvidia-smi >/dev/null; then nvidia-smi 2>&1; else echo "nvidia-smi: not here"; fi
} >"$OUT/env.txt" 2>&1
say "env: $(grep -m1 '^cuda ' "$OUT/env.txt") (env.txt)"
gpu=$("$VPY" -c 'import torch; print(int(torch.cuda.is_available()))' 2>/dev/null || echo 0)

# ---- pytest -m gpu, from the checkout (its tests and conftest), at most 240 s
budget=$(( $(left) - 240 ))  # the doctor's share: ~1 min without a GPU, 3.5 min on one H200
[ "$budget" -gt 240 ] && budget=240
[ "$budget" -lt 30 ] && budget=30  # (timeout 0 would mean none)
xdist=()
"$VPY" -c "import xdist" 2>/dev/null && [ "$gpu" = 1 ] && xdist=(-n 6)  # the engine pairs share the GPU
t=$SECONDS
(cd "$REPO" && timeout -k 10 "$budget" "$VPY" -m pytest -m gpu tests/ -p no:cacheprovider -q -rfEs \
  "${xdist[@]}" --junitxml="$OUT/pytest-gpu.xml") >"$OUT/pytest-gpu.log" 2>&1
pytest_rc=$?
say "pytest -m gpu: exit $pytest_rc in $((SECONDS - t)) s: $(grep -E '(passed|failed|skipped|error|no tests ran).* in [0-9.]+s' "$OUT/pytest-gpu.log" | tail -n 1) (pytest-gpu.log, pytest-gpu.xml)"

# ---- the doctor, installed (run outside the checkout), in the time left
t=$SECONDS
budget=$(( $(left) - 5 ))
[ "$budget" -gt 30 ] || budget=30
(cd "$OUT" && timeout -k 10 "$budget" "$VENV/bin/xpyd" doctor --json "$OUT/doctor.json") >"$OUT/doctor.log" 2>&1
doctor_rc=$?
say "doctor: exit $doctor_rc in $((SECONDS - t)) s: $(grep '^xpyd doctor:' "$OUT/doctor.log" | tail -n 1) (doctor.log, doctor.json)"

tests_ok=0
[ $pytest_rc -eq 0 ] || [ $pytest_rc -eq 5 ] && tests_ok=1
if [ $tests_ok = 1 ] && [ $doctor_rc -eq 0 ]; then
  finish 0 "every GPU test and every doctor check passed"
elif [ $tests_ok = 1 ] && [ $doctor_rc -eq 3 ] && [ "$gpu" = 0 ]; then
  finish 3 "no GPU here: the install worked, the GPU tests skipped, the doctor's device-free checks passed"
elif [ $pytest_rc -eq 124 ] || [ $doctor_rc -eq 124 ]; then
  finish 1 "a step ran out of its time (124 above)"
else
  finish 1 "FAILED: see the logs named above"
fi
