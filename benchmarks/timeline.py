"""Draw one DDP step of a ~29 MB MLP on 2 gloo ranks: backward vs bucket all-reduces.

Run:  python benchmarks/timeline.py [--bucket-cap-mb 4]

Writes ``benchmarks/results/ddp-trace.json`` (open it in chrome://tracing or
ui.perfetto.dev) and ``docs/img/ddp-timeline.png`` (the picture on the DDP page).
The step shown is the third one: after the warm-up and the one-time bucket rebuild.
"""

import argparse
from pathlib import Path

import torch
import torch.nn.functional as F

import miniddp
from miniddp.testing import run_on_ranks
from miniddp.trace import Tracer, plot_timeline, save_chrome_trace

HERE = Path(__file__).parent


def traced_steps(rank, world_size, cap, hidden, layers):
    torch.manual_seed(0)
    blocks = [torch.nn.Linear(256, hidden), torch.nn.ReLU()]
    for _ in range(layers - 2):
        blocks += [torch.nn.Linear(hidden, hidden), torch.nn.ReLU()]
    model = torch.nn.Sequential(*blocks, torch.nn.Linear(hidden, 10))
    tracer = Tracer(rank)
    ddp = miniddp.DistributedDataParallel(model, bucket_cap_mb=cap, tracer=tracer)
    opt = torch.optim.SGD(ddp.parameters(), lr=1e-3)
    x, y = torch.randn(64, 256), torch.randint(0, 10, (64,))
    for _ in range(3):
        tracer.clear()
        F.cross_entropy(ddp(x), y).backward()
        opt.step()
        tracer.step()
        opt.zero_grad()
    return tracer.events


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bucket-cap-mb", type=float, default=4)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=9)
    args = parser.parse_args()
    events = run_on_ranks(traced_steps, 2, args=(args.bucket_cap_mb, args.hidden, args.layers), timeout=300)
    (HERE / "results").mkdir(exist_ok=True)
    save_chrome_trace(events, HERE / "results" / "ddp-trace.json")
    png = HERE.parent / "docs" / "img" / "ddp-timeline.png"
    plot_timeline(events, png, title=f"one step, 2 gloo ranks, bucket_cap_mb={args.bucket_cap_mb:g}")
    print(f"wrote {png} and {HERE / 'results' / 'ddp-trace.json'}")


if __name__ == "__main__":
    main()
