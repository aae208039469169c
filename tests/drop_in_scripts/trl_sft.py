"""A TRL SFTTrainer script, as a user writes it: a word-level tokenizer trained on the fly, a tiny Llama from a config.

Run as ``torchrun --nproc-per-node 2 trl_sft.py --output_dir DIR [SFTConfig flags]`` (torch's DDP) or with
``-m miniddp.drop_in`` before it (miniddp's). Nothing is downloaded: the sentences are generated from a seed, the
tokenizer is trained on them (Hugging Face ``tokenizers``) and wrapped as a ``PreTrainedTokenizerFast``.
Each rank writes what it saw to ``DIR/rankR.json`` and its final weights to ``DIR/rankR.pt``.
"""

import json
import os
import random

import torch
import torch.distributed as dist
from datasets import Dataset
from tokenizers import Tokenizer, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
from trl import SFTConfig, SFTTrainer, TrlParser

WORDS = "the a cat dog bird sat ran flew on under over mat tree roof quickly slowly today".split()


def sentences(n, seed=0):
    rng = random.Random(seed)  # the same sentences on every rank: seeded by the data, not the rank
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 10))) for _ in range(n)]


def word_tokenizer(texts):
    tokenizer = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.train_from_iterator(texts, trainers.WordLevelTrainer(special_tokens=["[PAD]", "[UNK]", "[EOS]"]))
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="[PAD]", unk_token="[UNK]",
                                   eos_token="[EOS]")


(args,) = TrlParser((SFTConfig,)).parse_args_and_config()
texts = sentences(64)
tokenizer = word_tokenizer(texts)
torch.manual_seed(0)
config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32,
                     pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, bos_token_id=None)
model = LlamaForCausalLM(config)
forwarded = []  # the samples each forward took (a forward pre-hook: what reached the model)
model.register_forward_pre_hook(lambda m, a, kw: forwarded.append(len(kw["input_ids"])), with_kwargs=True)
trainer = SFTTrainer(model=model, args=args, train_dataset=Dataset.from_dict({"text": texts}),
                     processing_class=tokenizer)
result = trainer.train()

rank, wrapped = dist.get_rank(), trainer.model_wrapped
torch.save(model.state_dict(), os.path.join(args.output_dir, f"rank{rank}.pt"))
accumulation = args.gradient_accumulation_steps
seen = {"class": f"{type(wrapped).__module__}.{type(wrapped).__name__}", "backend": dist.get_backend(),
        "world_size": args.world_size, "global_step": trainer.state.global_step, "train_loss": result.training_loss,
        "samples_per_step": [sum(forwarded[i:i + accumulation]) for i in range(0, len(forwarded), accumulation)],
        "logged_losses": [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]}
with open(os.path.join(args.output_dir, f"rank{rank}.json"), "w") as f:
    json.dump(seen, f)

# The end of a job, as torch's docs ask: destroy the group, once nothing holds it (the trainer, through its DDP
# wrapper, does). Left alive, gloo's threads can abort a finished job at interpreter teardown (pytorch#190489).
del trainer, wrapped
dist.destroy_process_group()
