"""Run every benchmark in bench/ (the `make bench` target)."""

import importlib.util
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
BENCHES = ["quant_speed", "calibrate_overhead", "analyzer_speed"]


def main() -> None:
    for name in BENCHES:
        spec = importlib.util.spec_from_file_location(name, HERE / f"{name}.py")
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        mod.main(sys.argv[1:])
        print()


if __name__ == "__main__":
    main()
