"""Your own model and dataset, trained through ``miniddp.Trainer`` with Hugging Face's conventions.

    python examples/custom_model_trainer.py --output_dir out                                # 1 process
    torchrun --standalone --nproc-per-node 2 examples/custom_model_trainer.py --output_dir out
    miniddp launch --num_processes 2 examples/custom_model_trainer.py --output_dir out
    # two machines, 8 processes each: run on both, --node-rank 1 on the second
    torchrun --nnodes 2 --node-rank 0 --nproc-per-node 8 --master-addr 10.0.0.1 --master-port 29500 \
        examples/custom_model_trainer.py --output_dir out

The conventions are ``transformers.Trainer``'s: the dataset yields dicts, the
default collator stacks them into a dict batch, the Trainer calls
``model(**batch)``, and the model, given ``labels``, computes its own loss and
returns it under ``"loss"``. The Trainer does the distributed part: it joins the
job, shards the data, wraps the model in ``miniddp.DistributedDataParallel``,
accumulates with ``no_sync``, and writes ``output_dir/metrics.json`` and
``output_dir/final_model.pt`` (the plain model's ``state_dict``).
"""

import argparse
import os

import torch
import torch.distributed as dist
from torch.utils.data import Dataset

import miniddp


class NoisySine(Dataset):
    """y = sin(3x) + noise, x in [-2, 2]. Samples are dicts, as the rows of a Hugging Face dataset are."""

    def __init__(self, size: int, seed: int):
        g = torch.Generator().manual_seed(seed)  # from a seed, not the rank: every rank holds the same data
        self.x = torch.rand(size, 1, generator=g) * 4 - 2
        self.y = torch.sin(3 * self.x) + 0.05 * torch.randn(size, 1, generator=g)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"features": self.x[i], "labels": self.y[i]}  # the keys are the model's argument names


class SineRegressor(torch.nn.Module):
    """Given ``labels``, returns its loss under ``"loss"``, as a transformers model does."""

    def __init__(self, hidden: int = 64):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(1, hidden), torch.nn.Tanh(),
                                       torch.nn.Linear(hidden, hidden), torch.nn.Tanh(), torch.nn.Linear(hidden, 1))

    def forward(self, features, labels=None):
        logits = self.net(features)  # "logits" even for a regression, as transformers names them
        if labels is None:
            return {"logits": logits}
        return {"loss": torch.nn.functional.mse_loss(logits, labels), "logits": logits}


def compute_metrics(prediction) -> dict:
    """Every held-out sample's logits and labels (numpy), as transformers' EvalPrediction; reported as eval_mae."""
    return {"mae": float(abs(prediction.predictions - prediction.label_ids).mean())}


def main() -> dict:
    parser = argparse.ArgumentParser(description="Train a custom model with miniddp.Trainer.")
    parser.add_argument("--output_dir", default="custom-model-output")
    parser.add_argument("--max_steps", type=int, default=300)
    parser.add_argument("--per_device_train_batch_size", type=int, default=16)
    parser.add_argument("--gradient_accumulation_steps", type=int, default=1)
    parser.add_argument("--learning_rate", type=float, default=1e-2)
    args = parser.parse_args()

    config = miniddp.TrainingConfig(
        output_dir=args.output_dir,
        per_device_train_batch_size=args.per_device_train_batch_size,  # effective batch: x world size x accumulation
        gradient_accumulation_steps=args.gradient_accumulation_steps,
        max_steps=args.max_steps,
        learning_rate=args.learning_rate,
        logging_steps=50,
        seed=0,
        # what `miniddp launch --config_file` read from the YAML (accelerate passes ACCELERATE_* the same way)
        mixed_precision=os.environ.get("MINIDDP_MIXED_PRECISION", "no"),
        use_cpu=os.environ.get("MINIDDP_USE_CPU") == "true",
    )
    torch.manual_seed(0)  # the wrap copies rank 0's weights to every rank; the seed makes the run repeat
    # Building the Trainer joins the job (init_distributed) and wraps the model in DistributedDataParallel.
    trainer = miniddp.Trainer(model=SineRegressor(), args=config, train_dataset=NoisySine(2048, seed=0),
                              eval_dataset=NoisySine(256, seed=1), compute_metrics=compute_metrics)
    metrics = trainer.train()  # the same on every rank; rank 0 writes metrics.json and final_model.pt
    if dist.get_rank() == 0:  # every rank returns the same metrics: print them once
        print({k: v for k, v in metrics.items() if k != "log_history"})
    dist.destroy_process_group()
    return metrics


if __name__ == "__main__":
    main()
