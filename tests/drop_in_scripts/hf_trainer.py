"""A Transformers Trainer script, as a user writes it: a tiny GPT-2 built from a config, data made in memory.

Run as ``torchrun --nproc-per-node 2 hf_trainer.py --output_dir DIR [TrainingArguments flags]`` (torch's DDP,
built by the Trainer through Accelerate) or with ``-m miniddp.drop_in`` before it (miniddp's). Every
TrainingArguments flag is read from the command line (``HfArgumentParser``, as Transformers' own examples do);
``--unused_layer`` adds a layer the forward never calls; ``--extra_all_reduce_on_rank R`` has rank R alone issue
one more all-reduce at the first step (a collective the other rank never issues).
Each rank writes what it saw to ``DIR/rankR.json`` and its final weights to ``DIR/rankR.pt``.
"""

import json
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from transformers import GPT2Config, GPT2LMHeadModel, HfArgumentParser, Trainer, TrainerCallback, TrainingArguments

VOCAB, LENGTH = 1024, 16


@dataclass
class ScriptArguments:
    samples: int = 32
    unused_layer: bool = False
    extra_all_reduce_on_rank: int = -1


class Tokens(torch.utils.data.Dataset):
    """Random token sequences, the same on every rank (seeded by the data, not the rank)."""

    def __init__(self, n):
        self.ids = torch.randint(0, VOCAB, (n, LENGTH), generator=torch.Generator().manual_seed(0))

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class GPT2WithAnUnusedLayer(GPT2LMHeadModel):
    def __init__(self, config):
        super().__init__(config)
        self.unused_head = torch.nn.Linear(config.n_embd, 2)  # never called by forward


class Record(TrainerCallback):
    """How many samples this rank's forwards took for each optimizer step; optionally one collective on one rank."""

    def __init__(self, model, extra_on_rank):
        self.extra_on_rank, self.per_step, self.forwarded = extra_on_rank, [], 0
        model.register_forward_pre_hook(self.count, with_kwargs=True)

    def count(self, module, args, kwargs):
        self.forwarded += len(kwargs["input_ids"])

    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step == 0 and dist.get_rank() == self.extra_on_rank:
            dist.all_reduce(torch.ones(3))  # a metric summed on this rank alone

    def on_step_end(self, args, state, control, **kwargs):
        self.per_step.append(self.forwarded)
        self.forwarded = 0


script, args = HfArgumentParser((ScriptArguments, TrainingArguments)).parse_args_into_dataclasses()
torch.manual_seed(0)
config = GPT2Config(n_layer=2, n_embd=128, n_head=2, vocab_size=VOCAB, n_positions=LENGTH, bos_token_id=0,
                    eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
model = (GPT2WithAnUnusedLayer if script.unused_layer else GPT2LMHeadModel)(config)
data = Tokens(script.samples)
record = Record(model, script.extra_all_reduce_on_rank)
trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[record])
result = trainer.train()

rank = dist.get_rank()
wrapped = trainer.model_wrapped
backend = dist.distributed_c10d._get_default_group()._get_backend(torch.device("cpu"))  # the group's timeout
torch.save(model.state_dict(), os.path.join(args.output_dir, f"rank{rank}.pt"))
seen = {"class": f"{type(wrapped).__module__}.{type(wrapped).__name__}", "backend": dist.get_backend(),
        "world_size": args.world_size, "global_step": trainer.state.global_step, "train_loss": result.training_loss,
        "samples_per_step": record.per_step, "static_graph": getattr(wrapped, "static_graph", None),
        "find_unused_parameters": getattr(wrapped, "find_unused_parameters", None),
        "broadcast_buffers": getattr(wrapped, "broadcast_buffers", None),
        "timeout_s": backend.options._timeout.total_seconds() if hasattr(backend, "options") else None}
with open(os.path.join(args.output_dir, f"rank{rank}.json"), "w") as f:
    json.dump(seen, f)

# The end of a job, as torch's docs ask: destroy the group, once nothing holds it (the Trainer, through its DDP
# wrapper, does). Left alive, gloo's threads can abort a finished job at interpreter teardown (pytorch#190489).
del trainer, wrapped, backend
dist.destroy_process_group()
