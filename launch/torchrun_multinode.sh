#!/usr/bin/env bash
# kfac-bench on several machines without SLURM: run this on every node with the same settings.
#
#   NNODES=2 MASTER_ADDR=node0 GPUS_PER_NODE=8 RUN_ID=exp1 launch/torchrun_multinode.sh +recipe=...
#
# Node ranks are assigned by the c10d rendezvous at MASTER_ADDR, so no NODE_RANK is needed (one set is
# ignored).
# Environment: NNODES and MASTER_ADDR (the first node; required), MASTER_PORT (29500), GPUS_PER_NODE
# (default: the node's CUDA devices, as torchrun's --nproc-per-node=gpu counts them; on a node without one
# the script stops with one line: set it and pass train.device=cpu to train on CPUs on purpose), RUN_ID
# (rendezvous id and run dir name), RUN_DIR (runs/<RUN_ID>, on a shared filesystem so a restarted job
# resumes from its checkpoint), MAX_RESTARTS (0), PYTHON (python).
# kfac_bench.launcher.agent is torchrun that passes SIGTERM/SIGUSR1 on to the ranks: they checkpoint and stop,
# and this script exits 75 (run it again to resume).
set -euo pipefail
: "${NNODES:?set NNODES to the number of nodes}"
: "${MASTER_ADDR:?set MASTER_ADDR to the first node}"
RUN_ID=${RUN_ID:-kfac-bench}
# hydra.run.dir='RUN_DIR', quoted for Hydra's override grammar (spaces, ',', '=', non-ASCII).
run_dir_arg=$("${PYTHON:-python}" -m kfac_bench.launcher.torchrun "${RUN_DIR:-runs/${RUN_ID}}")

exec "${PYTHON:-python}" -m kfac_bench.launcher.agent \
  --nnodes="${NNODES}" --nproc-per-node="${GPUS_PER_NODE:-gpu}" \
  --rdzv-backend=c10d --rdzv-endpoint="${MASTER_ADDR}:${MASTER_PORT:-29500}" --rdzv-id="${RUN_ID}" \
  --max-restarts="${MAX_RESTARTS:-0}" \
  -m kfac_bench.cli train "${run_dir_arg}" "$@"
