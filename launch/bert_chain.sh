#!/usr/bin/env bash
# The BERT-Large chain on SLURM: phase 1 -> phase 2 -> SQuAD v1.1 fine-tuning, three launch/slurm.sbatch jobs,
# each starting only when the one before finished successfully (--dependency=afterok) from its
# checkpoints/last.pt. Arms name each pretraining phase's optimizer (TPDS §6.3.3, Tables 3-4):
#
#   launch/bert_chain.sh lamb lamb     # the LAMB baseline (Table 3)
#   launch/bert_chain.sh lamb kfac     # K-FAC in phase 2 (Table 4a); kfac lamb: 4b; kfac kfac: 4c
#
# Then: kfac-bench compare --chain lamb=runs/bert-chain-lamb-lamb/phase1,...,.../squad --chain kfac=...
# (the script prints the exact line). Requeued jobs resume from their fixed run directories.
# Environment: CHAIN_DIR (runs/bert-chain-<p1>-<p2>; no ','), NODES (2) x GPUS_PER_NODE (8): the paper's
# 16 A100 for pretraining, SQUAD_GPUS (1: the authors' run_squad.sh), SQUAD_ARGS (the SQuAD files, e.g.
# "dataset.train_file=... dataset.vocab_file=..."), P1_ARGS / P2_ARGS (e.g. P1_ARGS=train.max_steps=6000
# for Table 4b), CPUS_PER_GPU (5: the BERT recipes' 4 DataLoader workers + 1; each job asks for
# --cpus-per-task = its GPUs per node x CPUS_PER_GPU), SBATCH (sbatch).
set -euo pipefail

if [ "$#" -ne 2 ] || [[ ! "$1 $2" =~ ^(lamb|kfac)\ (lamb|kfac)$ ]]; then
  echo "usage: launch/bert_chain.sh lamb|kfac lamb|kfac   (phase-1 and phase-2 optimizer)" >&2
  exit 2
fi
recipe() { if [ "$2" = kfac ]; then echo "bert_large_pretrain_phase$1"; else echo "bert_large_pretrain_phase$1_lamb"; fi; }
dir=${CHAIN_DIR:-runs/bert-chain-$1-$2}
case "${dir}" in
  *,*)  # sbatch --export=ALL,RUN_DIR=... would split it into more variables
    echo "kfac-bench: error: CHAIN_DIR '${dir}' contains ',', which sbatch --export splits;" \
      "choose a folder without ','" >&2
    exit 2 ;;
  *\'* | *\\* | *\$\{*)  # what the single-quoted Hydra values below cannot hold as they are
    echo "kfac-bench: error: CHAIN_DIR '${dir}' contains a quote, a backslash or '\${';" \
      "choose a folder without them" >&2
    exit 2 ;;
esac
# The previous stage's checkpoint, quoted for Hydra's override grammar (spaces, '=', non-ASCII).
ckpt() { echo "model.init_checkpoint='${dir}/$1/checkpoints/last.pt'"; }
nodes=${NODES:-2}
read -r -a p1_args <<< "${P1_ARGS:-}"
read -r -a p2_args <<< "${P2_ARGS:-}"
read -r -a squad_args <<< "${SQUAD_ARGS:-}"

submit() {  # sbatch --parsable prints "jobid" or "jobid;cluster"
  local out
  out=$("${SBATCH:-sbatch}" --parsable "$@")
  echo "${out%%;*}"
}
gpus=${GPUS_PER_NODE:-8}
cpus=${CPUS_PER_GPU:-5}
job1=$(submit --nodes="${nodes}" --gpus-per-node="${gpus}" --cpus-per-task="$((gpus * cpus))" \
  --export="ALL,RUN_DIR=${dir}/phase1" \
  launch/slurm.sbatch "+recipe=$(recipe 1 "$1")" "${p1_args[@]}")
job2=$(submit --nodes="${nodes}" --gpus-per-node="${gpus}" --cpus-per-task="$((gpus * cpus))" \
  --dependency="afterok:${job1}" \
  --export="ALL,RUN_DIR=${dir}/phase2" launch/slurm.sbatch "+recipe=$(recipe 2 "$2")" "$(ckpt phase1)" \
  "${p2_args[@]}")
job3=$(submit --nodes=1 --gpus-per-node="${SQUAD_GPUS:-1}" --cpus-per-task="$((${SQUAD_GPUS:-1} * cpus))" \
  --dependency="afterok:${job2}" \
  --export="ALL,RUN_DIR=${dir}/squad,GPUS_PER_NODE=${SQUAD_GPUS:-1}" launch/slurm.sbatch \
  "+recipe=bert_large_squad" "$(ckpt phase2)" "${squad_args[@]}")
echo "submitted the $1/$2 chain: jobs ${job1} -> ${job2} -> ${job3} in ${dir}"
echo "when it is done: kfac-bench compare --chain $1-$2=${dir}/phase1,${dir}/phase2,${dir}/squad --chain ..."
