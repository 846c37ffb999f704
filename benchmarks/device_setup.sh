# Sourced by the device scripts (gpu_*.sh), run from the repository root: installs the carried wheels
# (.whl: fla, pyzmq, nixl; .whl/srv: the server's) into /tmp/site, puts them and the checkout on
# PYTHONPATH, sets `logs` to $OUT (or /tmp) and prints the GPU.
shopt -s nullglob
wheels=(.whl/*.whl .whl/srv/*.whl)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
  "${wheels[@]}" >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
logs=${OUT:-/tmp}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
