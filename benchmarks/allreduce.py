"""The allreduce sweep (`syncsgd bench allreduce`): hand-written algorithms against the library.

    python benchmarks/allreduce.py --help
    mpiexec -n 2 python benchmarks/allreduce.py

The measuring code lives in `syncsgd.apps.bench.allreduce`; this script runs
`syncsgd bench allreduce`.
"""

import sys

from syncsgd.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", "allreduce", *sys.argv[1:]]))
