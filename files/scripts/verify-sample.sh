# verify-sample.sh  (NVCC, WORK_PARENT, SMI_TIMEOUT in the environment; facts/verify.py CudaSample)
#
# Builds the CUDA sample (files/verify/vector_add.cu, which it carries) with NVCC, the toolkit under test,
# for the architecture of each GPU present (nvidia-smi's compute capabilities), and runs it: it
# adds two vectors on every GPU and prints `device N ...: PASS|FAIL ...`, then `devices N: PASS|FAIL`.
# The work directory is made under WORK_PARENT when writable (/tmp may be mounted noexec), else
# under /tmp, and removed afterwards. nvidia-smi gets SMI_TIMEOUT seconds (coreutils' timeout, where
# there is one), as the GPU fact gives it: a hung driver fails the check instead of the run.
#
# Output: `nvcc -gencode ...` (the flags used), then nvcc's and the sample's output.
# Exit: the sample's exit status (0: every device added correctly); 4 no /dev/nvidiactl (no GPU the
# CUDA runtime could open); 5 nvidia-smi reported no compute capability (or did not answer in
# time); 6 no work directory; 7 nvcc failed.
set -u
source "${BASH_SOURCE[0]%/*}/helpers.sh"
USAGE='verify-sample.sh  (NVCC, WORK_PARENT, SMI_TIMEOUT in the environment; facts/verify.py CudaSample)'
need_env NVCC WORK_PARENT SMI_TIMEOUT
sample_source=$(<"${BASH_SOURCE[0]%/*}/../verify/vector_add.cu")
test -e /dev/nvidiactl || { echo 'no /dev/nvidiactl'; exit 4; }
smi=(nvidia-smi)
if command -v timeout >/dev/null 2>&1; then smi=(timeout "$SMI_TIMEOUT" nvidia-smi); fi
caps=$("${smi[@]}" --query-gpu=compute_cap --format=csv,noheader | tr -d ' .' | sort -u)
[ -n "$caps" ] || { echo "nvidia-smi reported no compute capability within $SMI_TIMEOUT s"; exit 5; }
flags=()
for cap in $caps; do flags+=(-gencode "arch=compute_$cap,code=sm_$cap"); done
if [ -w "$WORK_PARENT" ]; then
    work=$(mktemp -d "$WORK_PARENT/verify-sample.XXXXXX") || exit 6
else
    work=$(mktemp -d) || exit 6
fi
trap 'rm -rf -- "$work"' EXIT
printf '%s\n' "$sample_source" > "$work/vector_add.cu"
echo "nvcc ${flags[*]}"
"$NVCC" "${flags[@]}" -o "$work/vector_add" "$work/vector_add.cu" || { echo 'nvcc failed'; exit 7; }
"$work/vector_add"
