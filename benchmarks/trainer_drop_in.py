"""The Transformers Trainer on torch's DistributedDataParallel and on miniddp's (the drop-in), in one run.

Run:  python benchmarks/trainer_drop_in.py [--pairs 10] [--steps 12] [--warmup 3] [--accumulation 1 4]
                                           [--bucket-cap-mb MB] [--no-find-unused]

The real ``transformers.Trainer`` trains a small GPT-2 built from a config (4 layers, 256 wide, an 8192-token
vocabulary: 5.3 M parameters, 20 MiB of fp32 gradients) on synthetic token sequences, on 2 gloo ranks of this
machine. Its own loop runs ``--warmup`` + ``--steps`` optimizer steps (``max_steps``) per chunk; chunks take turns:
one on torch's DDP (``undo()``), one on miniddp's (``miniddp.drop_in.install()``: Accelerate then builds
miniddp's class under torch's name), a fresh Trainer, model and optimizer each time, from the same seed on the
same data, the order flipped every pair (A/B, B/A, ...) so drift and machine noise hit both alike. A
``TrainerCallback`` times each step from ``on_step_begin`` (after a barrier: both ranks start together) to
``on_step_end`` (forward and backward of every micro-batch, clipping, AdamW, scheduler, ``zero_grad``); a
step's time is the max over ranks; the first ``--warmup`` steps of each chunk are dropped. The result is the
median of the per-step ratios miniddp / torch (step i of one chunk against step i of its partner) with their
quartiles, and the per-pair ratios of the chunks' medians. The Trainer's defaults stand unless an option
changes them, ``find_unused_parameters=True`` for a ``PreTrainedModel`` among them (``--no-find-unused`` turns
it off). As a sanity check, not a claim, the losses the Trainer logged at each step are compared between the
two. Writes ``benchmarks/results/trainer_drop_in.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

import miniddp.drop_in as drop_in
from miniddp.launching.spawn import run_on_ranks

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("OMP_NUM_THREADS", "1")  # else Accelerate sets the threads itself, from the cores it sees
from transformers import (  # noqa: E402
    GPT2Config,
    GPT2LMHeadModel,
    PrinterCallback,
    Trainer,
    TrainerCallback,
    TrainingArguments,
)

WRAPPERS = ("miniddp", "torch")


def make_model(args) -> GPT2LMHeadModel:
    """A small GPT-2 from a config (nothing downloaded), dropout off so the two runs' losses can be compared."""
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=args.vocab, n_positions=args.seq_len, n_embd=args.n_embd, n_layer=args.n_layer,
                        n_head=args.n_head, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, loss_type="ForCausalLM")
    return GPT2LMHeadModel(config)


def make_data(args, accumulation: int, world_size: int) -> list[dict]:
    """Learnable synthetic sequences (start + i * stride mod vocab), enough for one chunk without a second epoch."""
    g = torch.Generator().manual_seed(1234)
    count = (args.warmup + args.steps) * args.batch * accumulation * world_size
    starts = torch.randint(0, args.vocab, (count, 1), generator=g)
    strides = torch.randint(1, 8, (count, 1), generator=g)
    tokens = (starts + strides * torch.arange(args.seq_len)) % args.vocab
    return [{"input_ids": t, "labels": t} for t in tokens]


class StepTimer(TrainerCallback):
    """Each optimizer step's wall time on this rank, from a barrier at its beginning to its end."""

    def __init__(self):
        self.times, self.start = [], None

    def on_step_begin(self, args, state, control, **kwargs):
        dist.barrier()  # start together: measure the step, not the previous one's stragglers
        self.start = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        self.times.append(time.perf_counter() - self.start)


def chunk(wrapper: str, args, accumulation: int, data, out: str) -> dict:
    """One fresh Trainer, ``warmup + steps`` optimizer steps on ``wrapper``'s DDP; its step times and losses."""
    undo = drop_in.install() if wrapper == "miniddp" else None
    try:
        timer = StepTimer()
        training = TrainingArguments(
            output_dir=out, max_steps=args.warmup + args.steps, per_device_train_batch_size=args.batch,
            gradient_accumulation_steps=accumulation, learning_rate=1e-3, lr_scheduler_type="constant",
            logging_steps=1, save_strategy="no", report_to="none", disable_tqdm=True, use_cpu=True,
            ddp_backend="gloo", ddp_bucket_cap_mb=args.bucket_cap_mb, dataloader_num_workers=0, seed=0,
            ddp_find_unused_parameters=False if args.no_find_unused else None)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer = Trainer(model=make_model(args), args=training, train_dataset=data, callbacks=[timer])
            trainer.remove_callback(PrinterCallback)  # the per-step log lines; the losses are read from its state
            trainer.train()
        used = type(trainer.model_wrapped)
    finally:
        if undo is not None:
            undo()
    expected = drop_in.DistributedDataParallel if wrapper == "miniddp" else drop_in.TORCH_DDP
    if used is not expected:
        raise RuntimeError(f"the {wrapper} chunk trained on {used.__module__}.{used.__qualname__}")
    times = torch.tensor(timer.times, dtype=torch.float64)
    dist.all_reduce(times, op=dist.ReduceOp.MAX)  # the slowest rank's time is the step's time
    losses = {e["step"]: e["loss"] for e in trainer.state.log_history if "loss" in e}
    return {"times": times.tolist()[args.warmup:], "losses": [losses.get(s) for s in range(1, len(times) + 1)],
            "class": f"{used.__module__}.{used.__qualname__}"}


def bench(rank, world_size, args, accumulation):
    torch.set_num_threads(1)
    data = make_data(args, accumulation, world_size)
    model = make_model(args)
    params = sum(p.numel() for p in model.parameters())
    chunks = []
    with tempfile.TemporaryDirectory() as out:
        for pair in range(args.pairs):
            order = WRAPPERS if pair % 2 == 0 else WRAPPERS[::-1]  # A/B, B/A, ...: drift hits both alike
            chunks.append({wrapper: chunk(wrapper, args, accumulation, data, out) for wrapper in order})
            chunks[-1]["first"] = order[0]
    return {"chunks": chunks, "params": params, "grad_mb": 4 * params / 2**20}


def summarize(result, accumulation: int) -> dict:
    chunks = result["chunks"]
    per_step = [m / t for c in chunks for m, t in zip(c["miniddp"]["times"], c["torch"]["times"])]
    per_pair = [statistics.median(c["miniddp"]["times"]) / statistics.median(c["torch"]["times"]) for c in chunks]
    steps = {w: [t for c in chunks for t in c[w]["times"]] for w in WRAPPERS}
    losses = {w: chunks[0][w]["losses"] for w in WRAPPERS}
    same_within_wrapper = {w: all(c[w]["losses"] == losses[w] for c in chunks) for w in WRAPPERS}
    gaps = [abs(a - b) for a, b in zip(losses["miniddp"], losses["torch"]) if a is not None and b is not None]
    return {"gradient_accumulation_steps": accumulation,
            "median_step_s": {w: statistics.median(v) for w, v in steps.items()},
            "step_quartiles_s": {w: statistics.quantiles(v, n=4) for w, v in steps.items()},
            "median_ratio": statistics.median(per_step), "ratio_quartiles": statistics.quantiles(per_step, n=4),
            "pair_ratios": per_pair, "median_pair_ratio": statistics.median(per_pair),
            "losses": losses, "max_loss_gap": max(gaps) if gaps else None,
            "losses_repeat_across_chunks": same_within_wrapper,
            "classes": {w: chunks[0][w]["class"] for w in WRAPPERS}}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--pairs", type=int, default=10, help="chunk pairs (one torch chunk, one miniddp chunk each)")
    parser.add_argument("--steps", type=int, default=12, help="timed optimizer steps per chunk")
    parser.add_argument("--warmup", type=int, default=3, help="optimizer steps dropped at each chunk's start")
    parser.add_argument("--accumulation", type=int, nargs="+", default=[1, 4],
                        help="gradient_accumulation_steps values, one run of the pairs each")
    parser.add_argument("--batch", type=int, default=4, help="per_device_train_batch_size")
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--n-layer", type=int, default=4)
    parser.add_argument("--n-embd", type=int, default=256)
    parser.add_argument("--n-head", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--bucket-cap-mb", type=int, default=None, help="ddp_bucket_cap_mb (default: DDP's 25)")
    parser.add_argument("--no-find-unused", action="store_true",
                        help="ddp_find_unused_parameters=False (the Trainer's default is True for a PreTrainedModel)")
    args = parser.parse_args()
    os.environ.setdefault("MINIDDP_DROP_IN_QUIET", "1")
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")  # torch's find_unused_parameters advice, once a chunk
    started, rows, load = time.monotonic(), [], [os.getloadavg()[0]]
    for accumulation in args.accumulation:
        [result, *_] = run_on_ranks(bench, args.world_size, args=(args, accumulation), timeout=3600)
        rows.append({**summarize(result, accumulation), "chunks": result["chunks"]})
        load.append(os.getloadavg()[0])
    import transformers

    print(f"{args.world_size} gloo ranks, torch {torch.__version__}, transformers {transformers.__version__}, "
          f"GPT-2 {args.n_layer}x{args.n_embd} ({result['params'] / 1e6:.1f} M parameters, "
          f"{result['grad_mb']:.1f} MiB of gradients), batch {args.batch}x{args.seq_len} tokens per rank, "
          f"bucket_cap_mb={args.bucket_cap_mb}, find_unused_parameters={not args.no_find_unused}; {args.pairs} "
          f"pairs of chunks, {args.steps} timed steps each after {args.warmup} warm-up "
          f"({time.monotonic() - started:.0f} s; 1-minute load average {', '.join(f'{x:.1f}' for x in load)} "
          f"before and after each run: 2 is our ranks)\n")
    print("| accumulation | miniddp step (ms) | torch DDP step (ms) | median ratio miniddp/torch | IQR "
          "| per-pair ratios of the chunks' medians |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        q, s = r["ratio_quartiles"], r["median_step_s"]
        pairs = ", ".join(f"{p:.3f}" for p in r["pair_ratios"])
        print(f"| {r['gradient_accumulation_steps']} | {1e3 * s['miniddp']:.1f} | {1e3 * s['torch']:.1f} | "
              f"{r['median_ratio']:.3f} | {q[0]:.3f} – {q[2]:.3f} | {pairs} |")
    print("\nsanity check (not a claim): the loss the Trainer logged at a few steps, first chunk of each wrapper\n")
    for r in rows:
        loss = r["losses"]
        shown = [0, len(loss["torch"]) // 2, len(loss["torch"]) - 1]
        print(f"| accumulation {r['gradient_accumulation_steps']}, step | " + " | ".join(str(i + 1) for i in shown)
              + " | largest gap, all steps | every chunk the same |")
        print("|---|" + "---|" * (len(shown) + 2))
        for w in WRAPPERS:
            print(f"| {w} | " + " | ".join(f"{loss[w][i]:.5f}" for i in shown)
                  + f" | {r['max_loss_gap']:.2g} | {r['losses_repeat_across_chunks'][w]} |")
        print()
    print(f"classes: {rows[0]['classes']}")
    out = Path(__file__).parent / "results" / "trainer_drop_in.json"
    out.write_text(json.dumps({"args": vars(args), "torch": torch.__version__,
                               "transformers": transformers.__version__, "params": result["params"],
                               "grad_mb": result["grad_mb"], "load_average": load, "rows": rows}, indent=2) + "\n")
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
