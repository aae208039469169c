#!/bin/bash
# Two nodes, 8 GPUs each: one `miniddp launch` (one torchrun) per node, started by srun.
#SBATCH --job-name=miniddp
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1          # ONE launcher per node; torchrun starts the 8 workers
#SBATCH --gpus-per-node=8
#SBATCH --time=01:00:00

# main_process_ip may stay empty in the YAML: the first host of SLURM_JOB_NODELIST is used.
# machine_rank in the YAML is ignored under SLURM: each node's rank is its SLURM_NODEID
# (a fixed machine_rank would make every node claim to be node 0 and the rendezvous hang).
# Your own script instead of the trainer: `srun miniddp launch --config_file two_machines.yaml train.py --lr 1e-3`.
srun miniddp launch --config_file two_machines.yaml -m miniddp.train \
    --output_dir "$SLURM_SUBMIT_DIR/run-$SLURM_JOB_ID" --ddp_backend nccl --ddp_timeout 3600

# The same without the YAML:
# srun torchrun --nnodes "$SLURM_NNODES" --node-rank "$SLURM_NODEID" --nproc-per-node 8 \
#     --master-addr "$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)" --master-port 29500 \
#     -m miniddp.train --output_dir run --ddp_backend nccl
