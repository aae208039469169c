"""Training: the Trainer, its configuration and its CLI, on top of every room below.

What
    The loop: ``trainer.py`` (``Trainer``: any model, data and loss, Hugging Face's keywords), with
    ``trainer_state.py`` (where a run is, one dataclass), ``epoch.py`` (an epoch's micro-batches and
    accumulation windows), ``batches.py`` (batches and losses, Hugging Face's conventions),
    ``prepare.py`` (the model wrapped in DDP or sharded, the data sharded, the optimizer, mixed precision),
    ``nonfinite.py`` (a NaN or inf loss stops every rank) and ``every_rank.py`` (one rank's file error
    raised on all). Its settings: ``config.py`` (``TrainingConfig``, Hugging Face's names, validated),
    ``config_checks.py`` (the fields that name another library's values), ``deepspeed_args.py`` (the
    ``deepspeed`` field: which ZeRO stage), ``fsdp_args.py`` (``fsdp``, ``fsdp_config``, stage 3 or Accelerate's
    variables: how ``fully_shard`` runs) and ``fsdp_keys.py`` (the FSDP keys, read in one place);
    ``sharded_model.py`` (the units, and what the loop calls on a ``fully_shard`` model). Its results:
    ``output_dir.py`` (the output directory, owned by one run), ``checkpointer.py`` (what a checkpoint holds,
    and resuming from one),
    ``checkpoint_format.py`` (one checkpoint's files, atomic and verified), ``checkpoint_timeline.py``
    (the ``checkpoint-<step>`` folders of one run, oldest first), ``resume.py`` (what a bit-exact
    resume restores and refuses), ``reporting.py`` (the logged loss, progress, evaluation) and
    ``report_to.py`` (``report_to``'s destinations). ``tasks.py``: built-in tasks, generated from a
    seed; ``cli.py``: ``miniddp-train``, the CLI torchrun starts.

May import
    the rooms below it in import-linter's layers contract (``pyproject.toml``): ``composed``,
    ``costmodel``, ``diagnostics``, ``zero``, ``fsdp``, ``engine``, ``by_hand``, ``comm_hooks``, ``collectives``,
    ``process_group`` and ``data``. It never starts processes: launching is above it.
"""
