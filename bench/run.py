"""Run the quick CPU benchmarks (the `make bench` target): quant_speed, calibrate_overhead, analyzer_speed and
export_throughput. The others in bench/ (accuracy, the GGUF and GPTQ comparisons, the GPU ones in gpu.sh) take
minutes to hours, or a GPU, and are run by hand; docs/performance.md and docs/accuracy.md give their commands.

``bench/scale.py`` (a ~3B-parameter synthetic checkpoint: minutes and ~15 GB of disk) is not part of the default
run; ``python bench/run.py --scale`` adds it at its defaults, or run ``python bench/scale.py --help`` by itself.
"""

import importlib.util
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
BENCHES = ["quant_speed", "calibrate_overhead", "analyzer_speed", "export_throughput"]


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, HERE / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def main() -> None:
    argv = sys.argv[1:]
    if argv and argv != ["--scale"]:  # (each bench reads its own flags: passed to all four, --out X had each
        print(__doc__.strip() + "\n\nusage: run.py [--scale]  (each bench's own options: python bench/NAME.py --help)",
              file=sys.stderr if argv not in (["-h"], ["--help"]) else sys.stdout)  # overwrite the same file X)
        sys.exit(0 if argv in (["-h"], ["--help"]) else 2)
    for name in BENCHES:
        _load(name).main([])
        print()
    if "--scale" in sys.argv[1:]:
        _load("scale").main([])
        print()


if __name__ == "__main__":
    main()
