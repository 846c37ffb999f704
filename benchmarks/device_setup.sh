# Sourced by the device scripts (gpu_*.sh), run from the repository root: installs the carried wheels
# (.whl: fla, pyzmq, nixl; .whl/srv: the server's) into /tmp/site, puts them and the checkout on
# PYTHONPATH, sets `logs` to $OUT (or /tmp), prints the GPU and defines run_gpu_tests.
shopt -s nullglob
wheels=(.whl/*.whl .whl/srv/*.whl)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
  "${wheels[@]}" >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
logs=${OUT:-/tmp}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader

# run_gpu_tests LIMIT "FILE [-k EXPR]"...: each pytest selection under a time limit, its log in $logs, the
# failures and the summary printed
run_gpu_tests() {
  local limit=$1 spec log
  shift
  for spec in "$@"; do
    log="$logs/$(echo "$spec" | tr ' /:' '___').log"
    # shellcheck disable=SC2086  # the selection is words
    timeout "$limit" python3 -m pytest -q -p no:cacheprovider -s -rfEs $spec >"$log" 2>&1
    echo "== $spec rc=$?"
    grep -E "FAILED|ERROR|Error|assert" "$log" | head -n 12
    tail -n 2 "$log"
  done
}
