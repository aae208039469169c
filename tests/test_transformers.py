"""Real Transformers models, built from a config (nothing downloaded): the Trainer and DDP as a user meets them.

GPT-2 (``GPT2LMHeadModel``: labels shifted inside the model, ``-100`` padding, embeddings tied to the LM
head, a ``ModelOutput`` back) and a BERT-style classifier. Two multi-rank sessions hold every check.
"""

import warnings

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import miniddp
from miniddp import Trainer, TrainingConfig
from miniddp.launching.spawn import run_on_ranks

transformers = pytest.importorskip("transformers", reason="transformers is not installed: pip install -e '.[hf]'")

VOCAB, LENGTH, SAMPLES = 64, 12, 64
SPLITS = {1: (16, 1), 2: (4, 2)}  # world size -> (per_device_train_batch_size, gradient_accumulation_steps): 16 a step


# --8<-- [start:gpt2]
def gpt2():
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=LENGTH,
                                     bos_token_id=0, eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return transformers.GPT2LMHeadModel(config)


def bert_classifier():
    config = transformers.BertConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=2, intermediate_size=64,
                                     vocab_size=VOCAB, max_position_embeddings=LENGTH, num_labels=3,
                                     hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    return transformers.BertForSequenceClassification(config)


class Sentences(torch.utils.data.Dataset):
    """Token sequences of varying real length, padded with 0; the padding's labels are -100."""

    def __init__(self, n=SAMPLES, seed=0):
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(1, VOCAB, (n, LENGTH), generator=g)
        self.lengths = torch.randint(3, LENGTH + 1, (n,), generator=g)
        self.classes = torch.randint(0, 3, (n,), generator=g)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        mask = torch.arange(LENGTH) < self.lengths[i]
        ids = torch.where(mask, self.ids[i], 0)
        return {"input_ids": ids, "attention_mask": mask.long(), "labels": torch.where(mask, ids, -100)}


# --8<-- [end:gpt2]


def _quiet():
    transformers.logging.set_verbosity_error()
    warnings.filterwarnings("ignore", category=FutureWarning)


def _fit(out, world_size, loss_kwargs=True, **overrides):
    torch.manual_seed(0)  # the same initial weights in every run
    model = gpt2().double()
    if not loss_kwargs:  # the negative control: the model's loss is a per-micro-batch mean again
        model.accepts_loss_kwargs = False
    per_device, accumulation = SPLITS[world_size]
    args = TrainingConfig(output_dir=out, per_device_train_batch_size=per_device,
                          gradient_accumulation_steps=accumulation, max_steps=3, learning_rate=1e-2,
                          logging_steps=100, disable_tqdm=True, eval_size=0, **overrides)
    trainer = Trainer(model=model, args=args, train_dataset=Sentences())
    trainer.train()
    assert model.is_gradient_checkpointing == args.gradient_checkpointing
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    if args.torch_compile:  # and the pieces of each graph dynamo captured, and the buckets
        return state, trainer.compiler.pieces, len(trainer.ddp.bucket_assignment)
    return state


def _side_by_side(rank, make, batches):
    """miniddp's DDP and torch's on the same model and batches: every gradient of three steps."""
    grads = []
    for wrap in (miniddp.DistributedDataParallel, TorchDDP):
        torch.manual_seed(0)
        model = make().double()
        ddp = wrap(model)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        mine = []
        for batch in batches:
            outputs = ddp(**{k: v[rank::2] for k, v in batch.items()})  # a ModelOutput with .loss
            outputs.loss.backward()
            mine.append({n: p.grad.clone() for n, p in model.named_parameters()})
            optimizer.step()
            optimizer.zero_grad()
        grads.append(mine)
    return grads


def _session(rank, world_size, out):
    _quiet()
    results = {"plain": _fit(f"{out}/plain-{world_size}", world_size),
               "checkpointed": _fit(f"{out}/ckpt-{world_size}", world_size, gradient_checkpointing=True),
               "per_batch_mean": _fit(f"{out}/mean-{world_size}", world_size, loss_kwargs=False),
               "reentrant_static": _fit(f"{out}/reentrant-{world_size}", world_size, gradient_checkpointing=True,
                                        gradient_checkpointing_kwargs='{"use_reentrant": true}', ddp_static_graph=True)}
    if world_size == 2:
        data = Sentences(12, seed=1)
        lm = [{k: torch.stack([data[i][k] for i in range(4 * s, 4 * s + 4)]) for k in data[0]} for s in range(3)]
        classify = [{"input_ids": b["input_ids"], "attention_mask": b["attention_mask"],
                     "labels": data.classes[4 * s:4 * s + 4]} for s, b in enumerate(lm)]
        results["gpt2_ddp"] = _side_by_side(rank, gpt2, lm)
        results["bert_ddp"] = _side_by_side(rank, bert_classifier, classify)
        results["compiled"] = _fit(f"{out}/compiled", world_size, torch_compile_backend="aot_eager",
                                   ddp_bucket_cap_mb=0.01)
    return results if rank == 0 else None


@pytest.fixture(scope="module")
def runs(once, tmp_path_factory):
    def both():
        out = tmp_path_factory.mktemp("hf")
        return {n: run_on_ranks(_session, n, args=(str(out),), init=False, timeout=240)[0] for n in (1, 2)}
    return once("transformers_runs", both)  # one session for the suite, whichever worker asks first


def _assert_same_model(a, b):
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=0, atol=1e-9, msg=name)


def test_gpt2_trains_the_same_model_on_1x16x1_and_2x4x2(runs):
    _assert_same_model(runs[1]["plain"], runs[2]["plain"])
    assert not torch.equal(runs[1]["plain"]["lm_head.weight"], gpt2().double().state_dict()["lm_head.weight"])


def test_without_num_items_in_batch_the_splits_differ(runs):
    # the negative control: per-micro-batch means of sequences with different numbers of real tokens
    a, b = runs[1]["per_batch_mean"], runs[2]["per_batch_mean"]
    assert max((a[k] - b[k]).abs().max().item() for k in a) > 1e-6


def test_gpt2_with_gradient_checkpointing_trains_the_same_model(runs):
    _assert_same_model(runs[1]["checkpointed"], runs[2]["checkpointed"])
    _assert_same_model(runs[1]["plain"], runs[1]["checkpointed"])


def test_reentrant_checkpointing_with_ddp_static_graph_trains_the_same_model(runs):
    # the command line's form: JSON text, as --gradient_checkpointing_kwargs takes it
    _assert_same_model(runs[1]["plain"], runs[2]["reentrant_static"])
    _assert_same_model(runs[1]["reentrant_static"], runs[2]["reentrant_static"])


def test_a_compiled_gpt2_is_split_into_one_piece_per_bucket_and_trains_the_same_model(runs):
    state, pieces, buckets = runs[2]["compiled"]
    assert buckets > 2 and max(pieces) == buckets  # the transformer's graph; DDP's own Python breaks it elsewhere
    _assert_same_model(runs[1]["plain"], state)


def test_tied_embeddings_stay_tied_and_are_averaged_once(runs):
    model = runs[2]["plain"]
    torch.testing.assert_close(model["lm_head.weight"], model["transformer.wte.weight"], rtol=0, atol=0)


@pytest.mark.parametrize("model", ["gpt2_ddp", "bert_ddp"])
def test_miniddp_ddp_equals_torch_ddp_on_a_transformers_model(runs, model):
    ours, theirs = runs[2][model]
    for step, (o, t) in enumerate(zip(ours, theirs)):
        assert o.keys() == t.keys()
        for name in o:
            torch.testing.assert_close(o[name], t[name], rtol=0, atol=1e-12, msg=f"step {step}: {name}")


def test_checkpointing_a_model_with_constant_buffers_is_allowed_and_batchnorm_is_refused():
    from miniddp.training.prepare import enable_gradient_checkpointing  # noqa: PLC0415 - one test's helper

    _quiet()
    bert = bert_classifier()
    assert any(True for _ in bert.buffers())  # position_ids, token_type_ids: never changed by a forward
    enable_gradient_checkpointing(bert, broadcast_buffers=True)
    assert bert.is_gradient_checkpointing

    class WithBatchNorm(torch.nn.BatchNorm1d):
        def gradient_checkpointing_enable(self):
            pass

    with pytest.raises(ValueError, match="ddp_broadcast_buffers"):
        enable_gradient_checkpointing(WithBatchNorm(4), broadcast_buffers=True)
