import sys

from deltaserve.bench.serve.cli import main

sys.exit(main())
