"""Wait until a server on 127.0.0.1:PORT answers /health with 200 (at most TIMEOUT_S seconds, default 900);
exit 1 if it never does. Used by the serve_*.sh device scripts.
usage: python3 benchmarks/wait_healthy.py PORT [TIMEOUT_S]"""

import sys
import time
import urllib.request

port, timeout_s = int(sys.argv[1]), float(sys.argv[2]) if len(sys.argv) > 2 else 900.0
deadline = time.monotonic() + timeout_s
while time.monotonic() < deadline:
    try:
        if urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2).status == 200:
            sys.exit(0)
    except OSError:
        pass
    time.sleep(1)
sys.exit(1)
