#!/bin/bash
# Run the host-level part of servestack's verification suite on a real NVIDIA GPU host and keep
# everything it saw. Made for the workplace's device machine (one H200, Ubuntu 24.04, driver 580,
# CUDA 13.0 from NVIDIA's Ubuntu packages, torch 2.11.0+cu130 in /opt/torch/.venv), run as root
# from the repository root with the wheels of pyinfra, pytest-testinfra and their dependencies in
# .whl/ (cp312, manylinux):
#
#     OUT=/some/dir bash docs/validation/run_on_device.sh
#
# Expectations for that host go in an @local inventory (below): compute capability 9.0, one GPU,
# the toolkit at /usr/local/cuda-13.0 accepted as installed (it comes from NVIDIA's packages, not
# servestack's runfile: cuda_existing_toolkit 'accept'), /usr/local/cuda resolving to it
# (cuda_link_policy 'new'), the torch venv as venv_path. Checks marked `deployed` (servestack's records, the release, the
# service) need servestack's deploy and are left out (-m "not deployed").
#
# Writes to $OUT: run.log (all output), junit.xml (the suite), captures.tar.gz (raw outputs: the
# tools' own output, each probe's raw output, the pytest and `servestack verify` output).
set -u

OUT=${OUT:-/tmp/servestack-validation}
CAP="$OUT/captures"
mkdir -p "$CAP"
exec > >(tee "$OUT/run.log") 2>&1

cd "$(dirname "$0")/../.." || exit 1
REPO=$(pwd)
echo "== servestack device validation, $(date -u +%Y-%m-%dT%H:%M:%SZ), repo $REPO"

# SKIP_WHEELS=1: a rehearsal where python3 already has the packages (e.g. the project's .venv on PATH).
if [ -z "${SKIP_WHEELS:-}" ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        || { echo "wheel install failed"; exit 1; }
fi
export PYTHONPATH="/tmp/site:$REPO" PYTHONUNBUFFERED=1 PATH="/tmp/site/bin:$PATH"
GPUS=${EXPECTED_GPUS:-1}  # the nvidia-h200 kind: one GPU (an expectation, not a reading)
echo "== python $(python3 --version 2>&1) at $(command -v python3); nvidia-smi -L: $(nvidia-smi -L 2>&1 | head -8)"

# -- 1. the tools' own output, first line the command, last line its exit status ------------------
capture() {
    local name=$1; shift
    { echo "\$ $*"; "$@"; echo "[exit $?]"; } > "$CAP/$name.txt" 2>&1
}
capture nvidia-smi-query nvidia-smi --query-gpu=index,name,compute_cap,driver_version,memory.total,uuid,pci.bus_id --format=csv,noheader
capture nvidia-smi-version nvidia-smi --version
capture nvcc-version /usr/local/cuda-13.0/bin/nvcc --version
capture cuda-links sh -c 'ls -la /usr/local/ | grep cuda; readlink -f /usr/local/cuda; ls -la /etc/alternatives/ | grep -i cuda; update-alternatives --display cuda 2>&1 | head -8'
capture version-json cat /usr/local/cuda-13.0/version.json
capture toolkit-owner sh -c 'ls /usr/local/cuda-13.0; dpkg -S /usr/local/cuda-13.0/bin/nvcc; dpkg-query -W cuda-nvcc-13-0 cuda-toolkit-13-0 2>&1'
capture device-nodes sh -c 'ls -la /dev/nvidia*; cat /proc/driver/nvidia/version'
capture os sh -c 'cat /etc/os-release | head -3; uname -r; cat /proc/1/comm; test -d /run/systemd/system && echo systemd || echo no-systemd'
capture torch /opt/torch/.venv/bin/python -c 'import torch; print(torch.__version__, torch.version.cuda, torch.cuda.is_available(), torch.cuda.device_count(), [torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count())])'

# The verification sample built for the GPU's own architecture and for the wrong one: the second
# must be caught by the sample's own result check.
SAMPLE=$(mktemp -d)
cp files/verify/vector_add.cu "$SAMPLE/"
CAPS=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader | tr -d ' .' | sort -u | head -1)
capture sample-own-arch sh -c "cd $SAMPLE && /usr/local/cuda-13.0/bin/nvcc -gencode arch=compute_$CAPS,code=sm_$CAPS -o own vector_add.cu && ./own"
capture sample-sm120 sh -c "cd $SAMPLE && /usr/local/cuda-13.0/bin/nvcc -gencode arch=compute_120,code=sm_120 -o sm120 vector_add.cu && ./sm120"
rm -rf "$SAMPLE"

# -- 2. the inventory: this host, with expectations for it -----------------------------------------
INV_DIR=$(mktemp -d)
cat > "$INV_DIR/inventory.py" <<EOF
device = [("@local", {
    "servestack_allow_local": True,
    "gpu_compute_capability": "9.0",
    "gpu_count": ${GPUS:-1},
    "service_tp": 1,
    "cuda_link_policy": "new",
    "cuda_existing_toolkit": "accept",
    "venv_path": "/opt/torch/.venv",
})]
EOF
INV="$INV_DIR/inventory.py"
cp "$INV" "$CAP/inventory.py"

# -- 3. each probe's raw output (parser fixtures) ---------------------------------------------------
timeout 240 python3 - "$INV" "$CAP" <<'EOF'
import sys, time
from pathlib import Path
from servestack import checks
from servestack.verify import targets_from_inventory

inventory, out = sys.argv[1], Path(sys.argv[2])
target = targets_from_inventory(inventory)[0]
for group in ("host", "python", "sample"):
    started = time.monotonic()
    text = target.run_script(checks.SCRIPTS[group](target.settings))
    (out / f"probe-{group}.txt").write_text(text)
    print(f"probe {group}: {time.monotonic() - started:.2f} s, {len(text)} bytes")
EOF

# -- 4. the suite: host-level checks, as a user runs it --------------------------------------------
echo "== pytest tests/verify --inventory (host-level)"
timeout 240 python3 -m pytest tests/verify --inventory "$INV" -m "not deployed" -v -rA -p no:cacheprovider \
    --junitxml="$OUT/junit.xml" 2>&1 | tee "$CAP/pytest-inventory.txt"
echo "== pytest tests/verify --hosts=local:// (plain testinfra)"
timeout 240 python3 -m pytest tests/verify --hosts=local:// --host-data 'gpu_compute_capability="9.0"' \
    --host-data gpu_count="${GPUS:-1}" --host-data service_tp=1 --host-data cuda_link_policy=new --host-data cuda_existing_toolkit=accept \
    --host-data venv_path=/opt/torch/.venv -m "not deployed" -q -rA -p no:cacheprovider 2>&1 \
    | tee "$CAP/pytest-hosts.txt"
echo "== servestack verify (the per-host table)"
COLUMNS=140 timeout 240 python3 -c 'import sys; from servestack.verify import verify_main; sys.exit(verify_main(sys.argv[1], extra_args=["-m", "not deployed"]))' \
    "$INV" 2>&1 | tee "$CAP/servestack-verify.txt"
echo "== the full suite (deployed checks too: this host never had servestack's deploy)"
timeout 240 python3 -m pytest tests/verify --inventory "$INV" -q -rA -p no:cacheprovider --junitxml="$CAP/junit-full.xml" \
    > "$CAP/pytest-full.txt" 2>&1
tail -n 40 "$CAP/pytest-full.txt"

# -- 5. the deploy's last step, through pyinfra (the same checks read via facts) --------------------
# Only where a real NVIDIA driver answers: never a pyinfra run against a machine without a GPU.
if nvidia-smi -L > /dev/null 2>&1; then
    echo "== pyinfra: operations/verify.py (host-level checks), twice"
    for run in 1 2; do
        timeout 120 python3 -m pyinfra -y -v "$INV" docs/validation/verify_host_level.py 2>&1 | tee "$CAP/pyinfra-run$run.txt" | tail -n 25
    done
fi

tar -czf "$OUT/captures.tar.gz" -C "$OUT" captures && rm -rf "$CAP"
echo "== done"
