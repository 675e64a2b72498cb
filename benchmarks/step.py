"""The training step's time split into compute, allreduce and update (`syncsgd bench step`).

    python benchmarks/step.py --help
    mpiexec -n 2 python benchmarks/step.py

The measuring code lives in `syncsgd.apps.bench.step`; this script is `syncsgd bench step`.
"""

import sys

from syncsgd.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", "step", *sys.argv[1:]]))
