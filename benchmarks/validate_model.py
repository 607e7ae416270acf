"""Print the validation table of docs/hardware.md: published measurements, the hardware
models' predictions, the error and what was fitted to what.

    python benchmarks/validate_model.py
"""

from __future__ import annotations

from hpmoe.machine import record
from hpmoe.sim.validate import checks


def main() -> None:
    record()
    print("| measurement | source | measured | model | error | fitted |")
    print("|---|---|---:|---:|---:|---|")
    for c in checks():
        print(f"| {c.name} | {c.source} | {c.measured:g} {c.unit} | {c.predicted:.1f} {c.unit} | "
              f"{c.error * 100:+.1f}% | {c.fitted or 'no'} |")


if __name__ == "__main__":
    main()
