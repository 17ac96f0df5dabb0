"""``psctl plot``: a cluster's training curves (loss, accuracy, steps/s against the global step) as a PNG; with
several clusters (the runs of a sweep), each panel holds every cluster's curve, labelled by its name.

The data are the chief's ``run/metrics.jsonl`` (progress records: loss and steps/s) and the evaluator's
``run/eval.jsonl`` (accuracy and loss of each checkpoint it evaluated; without an evaluator, the chief's final
evaluation). matplotlib is an optional extra (``pip install 'psctl[plot]'``), imported only here.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

from psctl.errors import UsageError
from psctl.runtime.metrics import read_metrics

Curve = tuple[list[int], list[float]]


def curves(run_dir: Path) -> dict[str, Curve]:
    """``{"loss": (steps, values), "steps_per_sec": ..., "accuracy": ..., "eval_loss": ...}``, each sorted by
    step; a curve without points is left out."""
    out: dict[str, Curve] = {}

    def add(name: str, step: object, value: object) -> None:
        if isinstance(step, int) and isinstance(value, (int, float)) and value == value:
            steps, values = out.setdefault(name, ([], []))
            steps.append(step)
            values.append(float(value))

    for record in read_metrics(run_dir / "metrics.jsonl"):
        if record.get("event") == "progress":
            add("loss", record.get("global_step"), record.get("loss"))
            add("steps_per_sec", record.get("global_step"), record.get("steps_per_sec"))
        elif record.get("event") == "final" and not (run_dir / "eval.jsonl").exists():
            add("accuracy", record.get("global_step"), (record.get("metrics") or {}).get("accuracy"))
    for record in read_metrics(run_dir / "eval.jsonl"):
        add("accuracy", record.get("global_step"), record.get("accuracy"))
        add("eval_loss", record.get("global_step"), record.get("loss"))
    for name, (steps, values) in out.items():
        pairs = sorted(zip(steps, values, strict=True))
        out[name] = ([s for s, _ in pairs], [v for _, v in pairs])
    return out


def resumed_curves(run_dirs: Sequence[Path]) -> dict[str, Curve]:
    """The curves of a cluster's runs (``run/`` folders, oldest first: those kept under ``history/``, then the
    current one) joined into one: each run's points before the first step a later run reported, so that a run
    resumed from a checkpoint continues the curve of the runs before it, and one that started afresh (at a step
    at or below theirs) hides them."""
    out: dict[str, Curve] = {}
    later_from: int | None = None  # the first step of what the later runs reported
    for run_dir in reversed(run_dirs):
        data = curves(run_dir)
        for name, (steps, values) in data.items():
            kept = [(s, v) for s, v in zip(steps, values, strict=True) if later_from is None or s < later_from]
            have_steps, have_values = out.get(name, ([], []))
            out[name] = ([s for s, _ in kept] + have_steps, [v for _, v in kept] + have_values)
        firsts = [steps[0] for steps, _ in data.values() if steps]
        if firsts:
            later_from = min(firsts) if later_from is None else min(later_from, *firsts)
    return {name: curve for name, curve in out.items() if curve[0]}


def plot(runs: Mapping[str, dict[str, Curve]], out: Path) -> list[str]:
    """Draw the curves of each cluster in ``runs`` (name -> its ``curves``) into the PNG ``out``: one panel each
    for loss, accuracy, steps/s. Returns what it drew, a line each: ``"[cluster: ]curve (N points)"`` (``1 point``)."""
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only: no display needed
        import matplotlib.pyplot as plt
    except ImportError:
        raise UsageError("psctl plot needs matplotlib", hint="pip install 'psctl[plot]'") from None
    empty = [name for name, data in runs.items() if not data]
    if empty:
        raise UsageError(f"no training metrics to plot yet for {', '.join(repr(n) for n in empty)}",
                         hint="plot once the chief has reported progress (psctl status shows it)")
    several = len(runs) > 1
    wanted = [("loss", ("loss", "eval_loss")), ("accuracy", ("accuracy",)), ("steps/s", ("steps_per_sec",))]
    panels = [(label, names) for label, names in wanted if any(n in data for data in runs.values() for n in names)]
    fig, axes = plt.subplots(len(panels), 1, figsize=(8, 2.6 * len(panels)), sharex=True, squeeze=False)
    drawn = []
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, (label, names) in zip(axes[:, 0], panels, strict=True):
        for i, (run, data) in enumerate(runs.items()):
            for j, name in enumerate(names):
                if name not in data:
                    continue
                steps, values = data[name]
                curve = f"{run}: {name.replace('_', ' ')}" if several else name.replace("_", " ")
                # several runs: a colour per run, a dash per curve (loss, eval loss); one run: a colour per curve
                style = {"color": colours[i % len(colours)], "linestyle": ("-", "--")[j % 2]} if several else {}
                ax.plot(steps, values, marker="." if len(steps) < 50 else None, label=curve, **style)
                drawn.append(f"{curve} ({len(steps)} point{'s' if len(steps) != 1 else ''})")
        ax.set_ylabel(label)
        ax.grid(True, alpha=0.3)
        if len(ax.get_lines()) > 1:
            ax.legend(fontsize="small")
    axes[-1, 0].set_xlabel("global step")
    fig.suptitle(f"cluster{'s' if several else ''} {', '.join(runs)}")
    fig.tight_layout()
    fig.savefig(out, format="png", dpi=100)
    plt.close(fig)
    return drawn
