"""The docs' explanatory pictures, drawn from miniddp's own code (no timing, a few seconds).

Run:  python benchmarks/figures.py

* ``docs/img/ring-allreduce.svg``: ``ring_all_reduce`` on 4 ranks, step by step. The
  chunks and the order come from ``miniddp.by_hand.averaging.ring_schedule``: each panel is one
  step, each column a rank, each cell a chunk, coloured by how many ranks' values it holds.
* ``docs/img/sharding.svg``: ``ShardSampler`` with 10 samples on 3 ranks, shuffle off and
  on (seed 0, epoch 0): the padded index list and which positions each rank takes.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import FancyArrowPatch, Rectangle  # noqa: E402

from miniddp.by_hand.averaging import ring_schedule  # noqa: E402
from miniddp.data.sharding import ShardSampler  # noqa: E402

IMG = Path(__file__).resolve().parents[1] / "docs" / "img"
matplotlib.rcParams["svg.fonttype"] = "none"  # text stays text
RANK_COLOURS = ["#4e79a7", "#f28e2b", "#59a14f", "#b07aa1"]


def ring_states(n: int) -> list[tuple[str, list[list[frozenset]], dict]]:
    """Replay ``ring_schedule``: after each step, which ranks' values each (rank, chunk) holds.

    Returns (title, holds[rank][chunk], received {rank: chunk}) for the start and each step.
    """
    holds = [[frozenset([r]) for _ in range(n)] for r in range(n)]
    states = [("start: each rank's own gradient", [row[:] for row in holds], {})]
    schedules = [ring_schedule(r, n) for r in range(n)]
    for step in range(2 * (n - 1)):
        new = [row[:] for row in holds]
        received = {}
        for r in range(n):
            phase, _, recv_i = schedules[r][step]
            left = (r - 1) % n
            assert schedules[left][step][1] == recv_i  # what the left neighbour sends is what r receives
            incoming = holds[left][recv_i]
            new[r][recv_i] = holds[r][recv_i] | incoming if phase == "reduce-scatter" else incoming
            received[r] = recv_i
        holds = new
        s = step if phase == "reduce-scatter" else step - (n - 1)
        what = "receive, add" if phase == "reduce-scatter" else "receive, copy"
        states.append((f"{phase} step {s}: {what}", [row[:] for row in holds], received))
    return states


def draw_ring(path: Path, n: int = 4) -> None:
    states = ring_states(n)
    cmap = matplotlib.colormaps["Blues"]
    colour = lambda k: cmap(0.18 + 0.62 * (k - 1) / (n - 1))  # noqa: E731  k = ranks' values held
    cols = n  # start + (n-1) reduce-scatter steps on the first row, (n-1) all-gather steps on the second
    fig, axes = plt.subplots(2, cols, figsize=(10.5, 6.2))
    layout = [(0, i) for i in range(n)] + [(1, i) for i in range(1, n)]
    axes[1][0].axis("off")
    for (row, col), (title, holds, received) in zip(layout, states):
        ax = axes[row][col]
        for r in range(n):
            for c in range(n):
                held = holds[r][c]
                new = received.get(r) == c
                ax.add_patch(Rectangle((r, n - 1 - c), 0.86, 0.8, facecolor=colour(len(held)),
                                       edgecolor="black" if new else "white", linewidth=2.0 if new else 0.5))
                text = "".join(str(x) for x in sorted(held))
                dark = len(held) > n / 2
                ax.text(r + 0.43, n - 1 - c + 0.4, text, ha="center", va="center", fontsize=9.5,
                        color="white" if dark else "black")
        if received:  # arrows: each rank to its right neighbour, the last one back to rank 0
            for r in range(n - 1):
                ax.add_patch(FancyArrowPatch((r + 0.7, n + 0.15), (r + 1.15, n + 0.15), arrowstyle="-|>",
                                             mutation_scale=9, color="0.35", linewidth=0.9))
            ax.add_patch(FancyArrowPatch((n - 1 + 0.45, n + 0.05), (0.4, n + 0.05), arrowstyle="-|>",
                                         connectionstyle="arc3,rad=0.25", mutation_scale=9, color="0.6",
                                         linewidth=0.8, linestyle="--"))
        ax.set_xlim(-0.1, n)
        ax.set_ylim(-0.15, n + 0.75)
        ax.set_xticks([r + 0.43 for r in range(n)], [f"rank {r}" for r in range(n)], fontsize=9)
        ax.set_yticks([n - 1 - c + 0.4 for c in range(n)], [f"c{c}" for c in range(n)] if col in (0, 1) else [],
                      fontsize=9)
        ax.tick_params(length=0)
        for side in ax.spines.values():
            side.set_visible(False)
        ax.set_title(title, fontsize=9.5)
    legend = axes[1][0]
    legend.set_xlim(0, 1)
    legend.set_ylim(0, n + 2)
    for k in range(1, n + 1):
        y = n + 1 - k
        legend.add_patch(Rectangle((0.05, y), 0.18, 0.7, facecolor=colour(k), edgecolor="white"))
        whose = "1 rank's values" if k == 1 else f"{k} ranks' values" + (": done" if k == n else "")
        legend.text(0.28, y + 0.35, f"sum of {whose}", va="center", fontsize=9)
    legend.add_patch(Rectangle((0.05, 0.0), 0.18, 0.7, facecolor="white", edgecolor="black", linewidth=2.0))
    legend.text(0.28, 0.35, "received this step", va="center", fontsize=9)
    fig.suptitle(f"ring_all_reduce on {n} ranks: {n - 1} reduce-scatter steps, then {n - 1} all-gather steps "
                 "(digits: whose values a chunk holds)", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, bbox_inches="tight")
    plt.close(fig)


def draw_sharding(path: Path, n: int = 10, ranks: int = 3) -> None:
    fig, axes = plt.subplots(2, 1, figsize=(9, 4.6))
    for ax, shuffle in zip(axes, (False, True)):
        shards = [list(ShardSampler(range(n), num_replicas=ranks, rank=r, shuffle=shuffle, seed=0))
                  for r in range(ranks)]
        total = len(shards[0]) * ranks
        order = [shards[pos % ranks][pos // ranks] for pos in range(total)]  # the padded list, position by position
        for pos, index in enumerate(order):
            r = pos % ranks
            padded = pos >= n
            ax.add_patch(Rectangle((pos, 1.4), 0.9, 0.9, facecolor="white" if padded else RANK_COLOURS[r],
                                   hatch="///" if padded else None, edgecolor=RANK_COLOURS[r],
                                   linewidth=1.5 if padded else 0.5))
            ax.text(pos + 0.45, 1.85, str(index), ha="center", va="center", fontsize=11, fontweight="bold",
                    color=RANK_COLOURS[r] if padded else "white",
                    bbox=dict(facecolor="white", edgecolor="none", pad=1) if padded else None)
            ax.text(pos + 0.45, 2.55, str(pos), ha="center", va="center", fontsize=8.5, color="0.4")
        ax.text(-0.25, 2.55, "position", ha="right", va="center", fontsize=8.5, color="0.4")
        ax.text(-0.25, 1.85, "index", ha="right", va="center", fontsize=10)
        ax.annotate("padding: wraps around\nto the start", xy=(n + (total - n) / 2 - 0.05, 1.4),
                    xytext=(n + 2.6, 1.2), fontsize=9, ha="left", va="center",
                    arrowprops=dict(arrowstyle="-|>", color="0.3", linewidth=0.8))
        for r in range(ranks):
            y = 0.7 - 0.55 * r
            ax.text(-0.25, y, f"rank {r}", ha="right", va="center", fontsize=10, color=RANK_COLOURS[r],
                    fontweight="bold")
            positions = list(range(r, total, ranks))
            ax.text(0.0, y, f"positions {', '.join(map(str, positions))}  ->  indices {shards[r]}", va="center",
                    fontsize=10, family="monospace")
        title = ("shuffle=False: dataset order" if not shuffle else
                 "shuffle=True, seed=0, set_epoch(0): randperm seeded with seed + epoch, the same on every rank")
        ax.set_title(title, fontsize=10, loc="left")
        ax.set_xlim(-2.2, total + 4.2)
        ax.set_ylim(-0.75, 2.9)
        ax.axis("off")
    fig.suptitle(f"ShardSampler: {n} samples on {ranks} ranks, padded to {total} and strided by rank",
                 fontsize=11, x=0.02, ha="left")
    fig.tight_layout()
    fig.savefig(path, bbox_inches="tight")
    plt.close(fig)


def main():
    draw_ring(IMG / "ring-allreduce.svg")
    draw_sharding(IMG / "sharding.svg")
    print(f"wrote {IMG / 'ring-allreduce.svg'} and {IMG / 'sharding.svg'}")


if __name__ == "__main__":
    main()
