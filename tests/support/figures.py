"""Measured figures of the fault tests, printed one line each (``pytest -s`` shows them)."""

from __future__ import annotations


def figures_text(numbers: dict) -> str:
    """``k=v, ...`` with floats to two decimals."""
    return ", ".join(f"{k}={v:.2f}" if isinstance(v, float) else f"{k}={v}" for k, v in numbers.items())


def report(name: str, **numbers) -> None:
    """Print measured numbers on one line: ``[name] k=v, ...``."""
    print(f"\n[{name}] " + figures_text(numbers))


class Figures:
    """Every scenario's figures, kept for a table at the end; each printed as it is recorded
    (``[tag] scenario: k=v, ...``)."""

    def __init__(self, tag: str):
        self.tag = tag
        self.scenarios: dict[str, dict] = {}

    def record(self, scenario: str, **figures) -> None:
        self.scenarios.setdefault(scenario, {}).update(figures)
        print(f"\n[{self.tag}] {scenario}: " + figures_text(figures), flush=True)

    def print_table(self) -> None:
        """A markdown table of every scenario recorded (docs/operations.md quotes one)."""
        if not self.scenarios:
            return
        print("\n| scenario | measured |\n|---|---|")
        for name, figs in self.scenarios.items():
            cells = ", ".join(f"{k} {v:.2f}" if isinstance(v, float) else f"{k} {v}" for k, v in figs.items())
            print(f"| {name} | {cells} |")
