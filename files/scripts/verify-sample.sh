# verify-sample.sh  (NVCC, WORK_PARENT and SOURCE in the environment; facts/verify.py CudaSample)
#
# Builds the CUDA sample SOURCE (files/verify/vector_add.cu) with NVCC, the toolkit under test,
# for the architecture of each GPU present (nvidia-smi's compute capabilities), and runs it: it
# adds two vectors on every GPU and prints `device N ...: PASS|FAIL ...`, then `devices N: PASS|FAIL`.
# The work directory is made under WORK_PARENT when writable (/tmp may be mounted noexec), else
# under /tmp, and removed afterwards.
#
# Output: `nvcc -gencode ...` (the flags used), then nvcc's and the sample's output.
# Exit: the sample's exit status (0: every device added correctly); 4 no /dev/nvidiactl (no GPU the
# CUDA runtime could open); 5 nvidia-smi reported no compute capability; 6 no work directory;
# 7 nvcc failed.
set -u
test -e /dev/nvidiactl || { echo 'no /dev/nvidiactl'; exit 4; }
caps=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader | tr -d ' .' | sort -u)
[ -n "$caps" ] || { echo 'nvidia-smi reported no compute capability'; exit 5; }
flags=()
for cap in $caps; do flags+=(-gencode "arch=compute_$cap,code=sm_$cap"); done
if [ -w "$WORK_PARENT" ]; then
    work=$(mktemp -d "$WORK_PARENT/verify-sample.XXXXXX") || exit 6
else
    work=$(mktemp -d) || exit 6
fi
trap 'rm -rf -- "$work"' EXIT
printf '%s\n' "$SOURCE" > "$work/vector_add.cu"
echo "nvcc ${flags[*]}"
"$NVCC" "${flags[@]}" -o "$work/vector_add" "$work/vector_add.cu" || { echo 'nvcc failed'; exit 7; }
"$work/vector_add"
