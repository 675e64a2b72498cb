"""The thread backend at scale: cost per message of a thread-rank ring, and memory per rank.

    python benchmarks/threads.py --help

The measuring code lives in `syncsgd.apps.bench.threads`.
"""

import sys

from syncsgd.apps.bench.threads import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
