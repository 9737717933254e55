#!/bin/bash
# Run the host-level part of servestack's verification suite on a real NVIDIA GPU host and keep
# everything it saw. Made for the workplace's device machine (one H200, Ubuntu 24.04, driver 580,
# CUDA 13.0 from NVIDIA's Ubuntu packages, torch 2.11.0+cu130 in /opt/torch/.venv, no systemd),
# run as root from the repository root with the wheels of pyinfra, pytest-testinfra and their
# dependencies in .whl/ (cp312, manylinux; docs/validation/h200-refactor-2026-12-01.md lists them):
#
#     OUT=/some/dir EXPECTED_GPUS=1 bash docs/validation/run_on_device.sh
#
# It reads the host and changes nothing of it but servestack's own verification record
# (<servestack_state_dir>/verified.json, written by the verify step in part 6).
#
# Expectations for that host go in an @local inventory (part 2): compute capability 9.0,
# EXPECTED_GPUS GPUs (default 1), the toolkit at /usr/local/cuda-13.0 accepted as installed (it
# comes from NVIDIA's packages, not servestack's runfile: cuda_existing_toolkit 'accept'),
# /usr/local/cuda resolving to it (cuda_link_policy 'new'), the torch venv as venv_path. Checks
# marked `deployed` (servestack's records, the release, the service) need servestack's deploy and
# are left out (-m "not deployed") except in the one run of the whole suite.
#
# Parts: 1 the tools' own output and the CUDA sample built by hand; 2 the inventory; 3 the facts
# the deploy and the checks read (facts/batch.py FactBatch with bash and with sh, and each fact
# alone with sh, as pyinfra runs it), raw outputs and parsed values; 4 the suite (inventory,
# --hosts=local://, `servestack verify`, the whole suite); 5 `servestack doctor`; 6 the deploy's
# verify step through pyinfra, twice.
#
# Writes to $OUT: run.log (all output), junit.xml (the suite), facts.json (per fact: exit status,
# seconds, bytes, parsed value; per batch: the same, and whether each value equals the fact read
# alone), captures.tar.gz (raw outputs: the tools' own output, each fact's raw output, the pytest,
# `servestack verify`, doctor and pyinfra output).
set -u

OUT=${OUT:-/tmp/servestack-validation}
CAP="$OUT/captures"
mkdir -p "$CAP"
exec > >(tee "$OUT/run.log") 2>&1

cd "$(dirname "$0")/../.." || exit 1
REPO=$(pwd)
echo "== servestack device validation, $(date -u +%Y-%m-%dT%H:%M:%SZ), repo $REPO"

# NVLink multicast stays off in everything started here (a program using it can take the host's
# shared GPUs out of service); nothing here resets or reconfigures the GPU.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1

# SKIP_WHEELS=1: a rehearsal where python3 already has the packages (e.g. the project's .venv on PATH).
if [ -z "${SKIP_WHEELS:-}" ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        || { echo "wheel install failed"; exit 1; }
fi
export PYTHONPATH="/tmp/site:$REPO" PYTHONUNBUFFERED=1 PATH="/tmp/site/bin:$PATH"
GPUS=${EXPECTED_GPUS:-1}  # the nvidia-h200 kind: one GPU (an expectation, not a reading)
echo "== python $(python3 --version 2>&1) at $(command -v python3); nvidia-smi -L: $(nvidia-smi -L 2>&1 | head -8)"
python3 - <<'EOF'
import importlib.metadata as m
print("== packages:", ", ".join(f"{n} {m.version(n)}" for n in ("pyinfra", "pytest-testinfra", "pytest", "paramiko",
                                                                 "gevent", "pydantic", "rich", "packaging")))
EOF

# Seconds since the script started, for the write-up's timings.
STARTED=$(date +%s.%N)
mark() { echo "== [$(python3 -c "import sys; print(f'{float(sys.argv[2]) - float(sys.argv[1]):.1f}')" "$STARTED" "$(date +%s.%N)") s] $*"; }

# -- 1. the tools' own output, first line the command, last line its exit status ------------------
capture() {
    local name=$1; shift
    { echo "\$ $*"; "$@"; echo "[exit $?]"; } > "$CAP/$name.txt" 2>&1
}
mark "1. the tools"
capture nvidia-smi-query nvidia-smi --query-gpu=index,name,compute_cap,driver_version,memory.total,uuid,pci.bus_id --format=csv,noheader
capture nvidia-smi-version nvidia-smi --version
capture nvcc-version /usr/local/cuda-13.0/bin/nvcc --version
capture cuda-links sh -c 'ls -la /usr/local/ | grep cuda; readlink -f /usr/local/cuda; ls -la /etc/alternatives/ | grep -i cuda; update-alternatives --display cuda 2>&1 | head -8'
capture version-json cat /usr/local/cuda-13.0/version.json
capture toolkit-owner sh -c 'ls /usr/local/cuda-13.0; dpkg -S /usr/local/cuda-13.0/bin/nvcc; dpkg-query -W cuda-nvcc-13-0 cuda-toolkit-13-0 cuda-compiler-13-0 2>&1'
capture device-nodes sh -c 'ls -la /dev/nvidia*; cat /proc/driver/nvidia/version'
capture os sh -c 'cat /etc/os-release | head -3; uname -r; cat /proc/1/comm; test -d /run/systemd/system && echo systemd || echo no-systemd; ls -l /bin/sh'
capture torch /opt/torch/.venv/bin/python -c 'import torch; print(torch.__version__, torch.version.cuda, torch.cuda.is_available(), torch.cuda.device_count(), [torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count())])'

# The verification sample built for the GPU's own architecture and for the wrong one: the second
# must be caught by the sample's own result check.
SAMPLE=$(mktemp -d)
cp files/verify/vector_add.cu "$SAMPLE/"
CAPS=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | tr -d ' .' | sort -u | head -1)
capture sample-own-arch sh -c "cd $SAMPLE && /usr/local/cuda-13.0/bin/nvcc -gencode arch=compute_$CAPS,code=sm_$CAPS -o own vector_add.cu && ./own"
capture sample-sm120 sh -c "cd $SAMPLE && /usr/local/cuda-13.0/bin/nvcc -gencode arch=compute_120,code=sm_120 -o sm120 vector_add.cu && ./sm120"
rm -rf "$SAMPLE"

# -- 2. the inventory: this host, with expectations for it -----------------------------------------
INV_DIR=$(mktemp -d)
cat > "$INV_DIR/inventory.py" <<EOF
device = [("@local", {
    "servestack_allow_local": True,
    "gpu_compute_capability": "9.0",
    "gpu_count": ${GPUS},
    "service_tp": 1,
    "cuda_link_policy": "new",
    "cuda_existing_toolkit": "accept",
    "venv_path": "/opt/torch/.venv",
})]
EOF
INV="$INV_DIR/inventory.py"
cp "$INV" "$CAP/inventory.py"
# The fleet's defaults (files/stack.toml: 8 SM120 GPUs), for the doctor's refusal in part 5.
mkdir -p "$INV_DIR/fleet"
echo 'device = [("@local", {"servestack_allow_local": True})]' > "$INV_DIR/fleet/inventory.py"

# -- 3. the facts the deploy and the checks read: raw outputs (parser fixtures) and values ---------
# Two batches, each one remote command as servestack.reads and the suite send it (facts/batch.py
# FactBatch): "deploy-prepare", every step's host_reads (what deploy.py reads at prepare), and
# "verify", the checks' host-level groups (servestack/checks/readings.py) with the verification
# record. Each batch runs with bash and with sh (pyinfra and testinfra run commands with sh); each
# fact also runs alone with sh, as `host.get_fact` would. Values are compared across the three.
mark "3. the facts, batched and alone"
timeout 300 python3 - "$INV" "$CAP" "$OUT/facts.json" <<'EOF'
import json, re, subprocess, sys, time
from pathlib import Path

from facts.batch import FactBatch, FactRequest, batches, section_name
from facts.framing import Section, split
from facts.verify import VerificationRecord
from operations import patches, preflight, service, toolkit, venv, verify
from servestack.checks.readings import requests
from servestack.paths import verification_record_path
from servestack.verify import targets_from_inventory

inventory, out, summary_path = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
settings = targets_from_inventory(inventory)[0].settings
wanted = {
    "deploy-prepare": [r for step in (preflight, toolkit, venv, patches, service, verify)
                       for r in step.host_reads(settings)],
    "verify": [r for group in ("gpu", "toolkit", "kept", "host", "python", "sample")
               for r in requests(settings, group)]
              + [FactRequest.of(VerificationRecord, path=verification_record_path(settings))],
}


def run(shell: str, command: str):
    started = time.monotonic()
    done = subprocess.run([shell, "-c", command], capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=240)
    return done, round(time.monotonic() - started, 3)


def shown(value) -> str:
    return repr(value)[:4000]


def slug(name: str) -> str:
    return re.sub(r"(?<!^)(?=[A-Z])", "-", name).lower()


summary = {"facts": {}, "batches": {}}
alone_values, seen_names = {}, {}
for batch_name, reqs in wanted.items():
    for request in reqs:
        if request.key in alone_values:
            continue
        done, seconds = run("sh", request.command())
        count = seen_names[request.name] = seen_names.get(request.name, 0) + 1
        file = f"fact-{slug(request.name)}{'' if count == 1 else f'-{count}'}.txt"
        (out / file).write_text(done.stdout)
        try:
            value = request.value(Section(done.returncode, tuple(done.stdout.splitlines())))
            alone_values[request.key] = value
        except Exception as error:   # noqa: BLE001 -- reported, the run goes on
            value = f"<{type(error).__name__}: {error}>"
            alone_values[request.key] = value
        summary["facts"][file] = {"fact": request.name, "rc": done.returncode, "seconds": seconds,
                                  "bytes": len(done.stdout), "command_chars": len(request.command()),
                                  "stderr": done.stderr[-500:], "value": shown(value)}
        print(f"fact {request.name:<20} alone (sh): rc {done.returncode}, {seconds:6.2f} s, "
              f"{len(done.stdout):6d} bytes -> {file}")
for batch_name, reqs in wanted.items():
    for shell in ("bash", "sh"):
        for number, group in enumerate(batches(reqs)):
            done, seconds = run(shell, FactBatch().command(group))
            file = f"batch-{batch_name}-{shell}{'' if number == 0 else f'-{number}'}.txt"
            (out / file).write_text(done.stdout)
            sections = split(done.stdout.splitlines())
            facts = []
            for index, request in enumerate(group):
                section = sections.get(section_name(index), Section(None, ()))
                try:
                    value = request.value(section)
                except Exception as error:   # noqa: BLE001
                    value = f"<{type(error).__name__}: {error}>"
                same = shown(value) == shown(alone_values[request.key])
                facts.append({"fact": request.name, "rc": section.rc, "same_as_alone": same,
                              **({} if same else {"value": shown(value)})})
            summary["batches"][file] = {"rc": done.returncode, "seconds": seconds, "bytes": len(done.stdout),
                                        "command_chars": len(FactBatch().command(group)), "facts": facts,
                                        "stderr": done.stderr[-500:]}
            differ = [f["fact"] for f in facts if not f["same_as_alone"]]
            print(f"batch {batch_name:<15} {shell:<4}: rc {done.returncode}, {seconds:6.2f} s, {len(group)} facts, "
                  f"sections rc {[f['rc'] for f in facts]}, values as alone: "
                  f"{'all' if not differ else 'NOT ' + ', '.join(differ)} -> {file}")
summary_path.write_text(json.dumps(summary, indent=1, sort_keys=True))
EOF
echo "facts: exit $?"

# -- 4. the suite: host-level checks, as a user runs it --------------------------------------------
mark "4. pytest tests/verify --inventory (host-level)"
timeout 240 python3 -m pytest tests/verify --inventory "$INV" -m "not deployed" -v -rA -p no:cacheprovider \
    --junitxml="$OUT/junit.xml" 2>&1 | tee "$CAP/pytest-inventory.txt"
mark "4. pytest tests/verify --hosts=local:// (plain testinfra)"
timeout 240 python3 -m pytest tests/verify --hosts=local:// --host-data 'gpu_compute_capability="9.0"' \
    --host-data gpu_count="${GPUS}" --host-data service_tp=1 --host-data cuda_link_policy=new --host-data cuda_existing_toolkit=accept \
    --host-data venv_path=/opt/torch/.venv -m "not deployed" -q -rA -p no:cacheprovider 2>&1 \
    | tee "$CAP/pytest-hosts.txt"
mark "4. servestack verify (the per-host table, host-level checks)"
COLUMNS=140 timeout 240 python3 -c 'import sys; from servestack.verify import verify_main; sys.exit(verify_main(sys.argv[1], extra_args=["-m", "not deployed"]))' \
    "$INV" 2>&1 | tee "$CAP/servestack-verify.txt"
echo "servestack verify: exit ${PIPESTATUS[0]}"
mark "4. the full suite (deployed checks too: this host never had servestack's deploy)"
timeout 240 python3 -m pytest tests/verify --inventory "$INV" -q -rA -p no:cacheprovider --junitxml="$CAP/junit-full.xml" \
    > "$CAP/pytest-full.txt" 2>&1
tail -n 40 "$CAP/pytest-full.txt"

# -- 5. servestack doctor: the preflight checks, read from the deploy's own facts; changes nothing ---
SERVESTACK='import sys; from servestack.cli import main; sys.exit(main(sys.argv[1:]))'
mark "5. servestack doctor (this host's expectations)"
COLUMNS=140 timeout 120 python3 -c "$SERVESTACK" doctor "$INV" 2>&1 | tee "$CAP/doctor-h200.txt"
echo "doctor: exit ${PIPESTATUS[0]}"
timeout 120 python3 -c "$SERVESTACK" doctor "$INV" --json > "$CAP/doctor-h200.json" 2> "$CAP/doctor-h200.err"
echo "doctor --json: exit $?"
mark "5. servestack doctor (the fleet's defaults: expected to refuse this host)"
COLUMNS=140 timeout 120 python3 -c "$SERVESTACK" doctor "$INV_DIR/fleet/inventory.py" 2>&1 | tee "$CAP/doctor-fleet-defaults.txt"
echo "doctor (fleet defaults): exit ${PIPESTATUS[0]}"

# -- 6. the deploy's last step, through pyinfra (the same checks read via facts) --------------------
# Only where a real NVIDIA driver answers: never a pyinfra run against a machine without a GPU.
if nvidia-smi -L > /dev/null 2>&1; then
    for run in 1 2; do
        mark "6. pyinfra: operations/verify.py (host-level checks), run $run"
        timeout 120 python3 -m pyinfra -y -v "$INV" docs/validation/verify_host_level.py > "$CAP/pyinfra-run$run.txt" 2>&1
        echo "pyinfra run $run: exit $?"
        tail -n 25 "$CAP/pyinfra-run$run.txt"
    done
    cp /var/lib/servestack/verified.json "$CAP/verified.json" 2>/dev/null
fi

mark "done"
tar -czf "$OUT/captures.tar.gz" -C "$OUT" captures && rm -rf "$CAP"
echo "== done"
