"""TRL's table of equivalent configurations, as loss curves of real runs (seconds).

Run:  python benchmarks/trl_splits.py

TRL's distributed-training page says 1 GPU x 32 x 1, 1 x 4 x 8 and 8 x 4 x 1 (processes x
per-device batch x accumulation) train the same model. Each split here trains the built-in ``lm``
task (variable-length sequences) for ``STEPS`` optimizer steps through ``miniddp.Trainer``, with
``--loss_normalization global_tokens`` (the loss divided by ``num_items_in_batch``), and logs every
step. A fourth run, 1 x 4 x 8 with per-micro-batch means averaged over the window (``per_batch``,
the pre-2024 gradient-accumulation bug), is drawn beside them. Writes ``docs/img/trl-splits.svg``
and ``benchmarks/results/trl_splits.json``.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from miniddp import Trainer, TrainingConfig  # noqa: E402
from miniddp.launching.spawn import run_on_ranks  # noqa: E402
from miniddp.training.tasks import make_task  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
STEPS = 40
RUNS = [  # (label, processes, per-device batch, accumulation, loss_normalization)
    ("1 × 32 × 1", 1, 32, 1, "global_tokens"),
    ("1 × 4 × 8", 1, 4, 8, "global_tokens"),
    ("8 × 4 × 1", 8, 4, 1, "global_tokens"),
    ("1 × 4 × 8, per-batch means (wrong)", 1, 4, 8, "per_batch"),
]


def _losses(rank, world_size, out, per_device, accumulation, normalization):
    config = TrainingConfig(output_dir=out, model="lm", per_device_train_batch_size=per_device,
                            gradient_accumulation_steps=accumulation, loss_normalization=normalization,
                            max_steps=STEPS, logging_steps=1, eval_size=0, disable_tqdm=True)
    metrics = Trainer(args=config, **make_task(config)).train()
    return [entry["loss"] for entry in metrics["log_history"]] if rank == 0 else None


def main() -> None:
    curves = {}
    with tempfile.TemporaryDirectory() as tmp:
        for label, processes, per_device, accumulation, normalization in RUNS:
            out = f"{tmp}/{processes}-{per_device}-{accumulation}-{normalization}"
            curves[label] = run_on_ranks(_losses, processes, args=(out, per_device, accumulation, normalization),
                                         init=False, timeout=600)[0]
    reference = curves[RUNS[0][0]]
    gaps = {label: max(abs(a - b) for a, b in zip(curve, reference)) for label, curve in curves.items()}
    results = ROOT / "benchmarks" / "results" / "trl_splits.json"
    results.write_text(json.dumps({"steps": STEPS, "runs": [r[:4] + (r[4],) for r in RUNS], "loss": curves,
                                   "max_gap_to_1x32x1": gaps}, indent=2) + "\n")
    draw(curves, reference, ROOT / "docs" / "img" / "trl-splits.svg")
    for label, gap in gaps.items():
        print(f"{label:40s} largest |loss - 1x32x1| over {STEPS} steps: {gap:.2e}")


def draw(curves: dict, reference: list, path: Path) -> None:
    matplotlib.rcParams["svg.fonttype"] = "none"
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 6.4), sharex=True, height_ratios=[3, 2])
    steps = range(1, len(reference) + 1)
    styles = [dict(lw=5, alpha=0.35, color="#1f77b4"), dict(lw=2.5, ls="--", color="#ff7f0e"),
              dict(lw=1.5, ls=":", color="#2ca02c"), dict(lw=1.5, color="#d62728")]
    for (label, curve), style in zip(curves.items(), styles):
        top.plot(steps, curve, label=label, **style)
        if curve is not reference:
            gap = [max(abs(a - b), 1e-9) for a, b in zip(curve, reference)]
            bottom.semilogy(steps, gap, label=label, **{k: v for k, v in style.items() if k != "alpha"})
    top.set_ylabel("training loss (mean over ranks)")
    top.set_title("Same effective batch (32), same training: TRL's table, run")
    top.legend(frameon=False)
    bottom.set_ylabel("|loss − loss of 1 × 32 × 1|")
    bottom.set_xlabel("optimizer step")
    bottom.axhline(1e-9, color="grey", lw=0.5)
    bottom.text(1, 1.5e-9, "identical (floor of the log scale)", color="grey", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, bbox_inches="tight")


if __name__ == "__main__":
    main()
