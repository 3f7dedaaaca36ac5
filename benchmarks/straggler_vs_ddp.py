"""The paper-style comparison against Lightning's DDP: ``lightning-prague bench --preset full``.

    python benchmarks/straggler_vs_ddp.py                       # 8 workers, 4 epochs, 3 profiles
    python benchmarks/straggler_vs_ddp.py --strategies decent_adam --profiles jitter homogeneous

Any option of ``lightning-prague bench`` can be given; results go to ``bench-out/bench-full/`` unless
``--out`` says otherwise. See ``lightning_prague/tools/bench.py`` and ``docs/benchmarks.md``.
"""

import sys

from lightning_prague.tools.bench import main

if __name__ == "__main__":
    argv = sys.argv[1:]
    main(["--preset", "full", "--out", "bench-out/bench-full", *argv])
