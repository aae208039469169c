"""TRL's table of equivalent configurations, run with TRL's own SFTTrainer on miniddp's engine (a minute or two).

Run:  python benchmarks/trl_effective_batch.py

TRL's distributed-training page says that 1 GPU x 32 x 1, 1 x 4 x 8 and 8 x 4 x 1 (processes x
per_device_train_batch_size x gradient_accumulation_steps) are equivalent: effective batch 32, the same training.
Each row here runs the unchanged user script ``tests/drop_in_scripts/trl_sft.py`` (a word-level tokenizer trained
on the fly, a tiny Llama from a config) under ``torchrun --nproc-per-node P -m miniddp.drop_in``, on gloo ranks of
this machine, for ``STEPS`` optimizer steps. Measured per row: the samples that reached the model's forward in the
first optimizer step, summed over the ranks (a forward pre-hook in the script), the loss the Trainer logged at each
step, and the largest difference of the final weights from the first row's. Writes
``benchmarks/results/trl_effective_batch.json`` and prints the table as Markdown.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "drop_in_scripts" / "trl_sft.py"
STEPS = 4
ROWS = [(1, 32, 1), (1, 4, 8), (8, 4, 1), (2, 16, 1), (2, 4, 4)]  # TRL's three, then two on 2 ranks


def run(processes: int, per_device: int, accumulation: int, out: Path) -> dict:
    command = [str(Path(sys.executable).parent / "torchrun"), "--standalone", "--nproc-per-node", str(processes),
               "-m", "miniddp.drop_in", str(SCRIPT), "--output_dir", str(out), "--use_cpu", "true",
               "--report_to", "none", "--save_strategy", "no", "--disable_tqdm", "true", "--logging_steps", "1",
               "--max_steps", str(STEPS), "--max_length", "16", "--per_device_train_batch_size", str(per_device),
               "--gradient_accumulation_steps", str(accumulation)]
    done = subprocess.run(command, capture_output=True, text=True, env={**os.environ, "MINIDDP_DROP_IN_QUIET": "1"})
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(command)}\n{done.stderr[-3000:]}")
    seen = [json.loads((out / f"rank{r}.json").read_text()) for r in range(processes)]
    return {"command": f"torchrun --standalone --nproc-per-node {processes} -m miniddp.drop_in "
                       f"tests/drop_in_scripts/trl_sft.py {' '.join(command[9:])}",
            "processes": processes, "per_device_train_batch_size": per_device,
            "gradient_accumulation_steps": accumulation, "class": seen[0]["class"],
            "world_size": seen[0]["world_size"], "global_step": seen[0]["global_step"],
            "samples_in_first_step": sum(s["samples_per_step"][0] for s in seen),
            "logged_losses": seen[0]["logged_losses"]}


def main() -> None:
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for processes, per_device, accumulation in ROWS:
            out = Path(tmp) / f"{processes}x{per_device}x{accumulation}"
            rows.append(run(processes, per_device, accumulation, out))
            rows[-1]["weights"] = torch.load(out / "rank0.pt", weights_only=True)
    first = rows[0]["weights"]
    for row in rows:
        weights = row.pop("weights")
        row["max_weight_diff_to_first_row"] = max((weights[k] - first[k]).abs().max().item() for k in first)
        row["max_loss_diff_to_first_row"] = max(abs(a - b) for a, b in zip(row["logged_losses"],
                                                                              rows[0]["logged_losses"]))
    results = ROOT / "benchmarks" / "results" / "trl_effective_batch.json"
    results.write_text(json.dumps({"steps": STEPS, "torch": torch.__version__, "rows": rows}, indent=2) + "\n")
    print("| processes | per-device batch | accumulation | samples per optimizer step (measured) | loss, step 1 | "
          f"loss, step {STEPS} | largest weight difference to the first row |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        losses = r["logged_losses"]
        print(f"| {r['processes']} | {r['per_device_train_batch_size']} | {r['gradient_accumulation_steps']} | "
              f"{r['samples_in_first_step']} | {losses[0]:.6f} | {losses[-1]:.6f} | "
              f"{r['max_weight_diff_to_first_row']:.1e} |")

if __name__ == "__main__":
    main()
