#!/usr/bin/env bash
# Install what vLLM 0.33.0's scheduler tests need into the active virtual
# environment (the one gpukv is installed in, or any other), CPU only:
#
#   . .venv/bin/activate && bash tests/vllm/install.sh
#
# - torch==2.13.0+cpu, with torch's own dependencies pinned by requirements.txt.
#   Only the "+cpu" build is accepted: a plain "torch" requirement would let pip
#   pick a CUDA build of several GB. The wheel must be reachable by pip (this
#   machine's pip configuration has it in a local find-links folder; elsewhere
#   point PIP_FIND_LINKS or PIP_EXTRA_INDEX_URL at a location that has it).
# - vllm==0.33.0 and its import-time closure, all with --no-deps (vLLM's declared
#   dependencies would pull CUDA torch and GPU kernels).
# - pytest, if the environment has none (any pytest >= 8; not pinned, so that
#   gpukv's own test tooling keeps its version).
#
# Idempotent: when every pin is already installed it checks and exits without
# calling pip (well under a second after Python starts).
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
req="$here/requirements.txt"
torch_pin="torch==2.13.0+cpu"
py="${PYTHON:-python}"

if ! "$py" -c 'import sys; sys.exit(0 if sys.prefix != sys.base_prefix else 1)'; then
    echo "install.sh: activate a virtual environment first (refusing to install into $("$py" -c 'import sys; print(sys.prefix)'))" >&2
    exit 2
fi

# Pins that are missing or at another version; empty when all are satisfied.
missing() {
    "$py" - "$req" "$torch_pin" <<'EOF'
import sys
from importlib import metadata

def norm(name):
    return name.lower().replace("_", "-").replace(".", "-")

installed = {}
for dist in metadata.distributions():
    name = dist.metadata["Name"]
    if name:
        installed.setdefault(norm(name), dist.version)
pins = [sys.argv[2]]
with open(sys.argv[1], encoding="utf-8") as f:
    for line in f:
        line = line.split("#", 1)[0].strip()
        if line:
            pins.append(line)
for pin in pins:
    name, _, version = pin.partition("==")
    if installed.get(norm(name)) != version:
        print(pin)
try:
    import pytest  # noqa: F401
except ImportError:
    print("pytest")
EOF
}

todo="$(missing)"
if [ -z "$todo" ]; then
    echo "install.sh: torch, vllm and the test closure are already installed"
    exit 0
fi
echo "install.sh: to install: $(echo "$todo" | tr '\n' ' ')"

if echo "$todo" | grep -qx "$torch_pin"; then
    # -c: torch's dependencies resolve to the pins in requirements.txt.
    if ! "$py" -m pip install --disable-pip-version-check -c "$req" "$torch_pin"; then
        echo "install.sh: could not install $torch_pin; pip must be able to reach the CPU wheel" \
             "(PIP_FIND_LINKS or PIP_EXTRA_INDEX_URL)" >&2
        exit 1
    fi
fi

"$py" -m pip install --disable-pip-version-check --no-deps -r "$req"

if ! "$py" -c 'import pytest' 2>/dev/null; then
    "$py" -m pip install --disable-pip-version-check "pytest>=8"
fi

todo="$(missing)"
if [ -n "$todo" ]; then
    echo "install.sh: still not at the pinned versions: $(echo "$todo" | tr '\n' ' ')" >&2
    exit 1
fi
# The scheduler must import (vLLM warns that vllm._C is missing on CPU; fine).
if ! out="$(VLLM_TARGET_DEVICE=cpu "$py" -c 'import vllm.v1.core.sched.scheduler' 2>&1)"; then
    echo "$out" >&2
    echo "install.sh: vllm.v1.core.sched.scheduler does not import" >&2
    exit 1
fi
echo "install.sh: done"
