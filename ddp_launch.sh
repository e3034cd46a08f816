#!/usr/bin/env bash
# ddp_launch.sh SCRIPT NPROC [ARGS...]: run a script of this project under torchrun, on one node or many.
# The script detects torchrun from RANK/LOCAL_RANK/WORLD_SIZE; everything after NPROC is its own
# flags. Without torchrun on PATH it runs `python -m torch.distributed.run` (python3 if there is no python).
set -euo pipefail

usage() {
    cat <<'EOF'
usage: ddp_launch.sh SCRIPT NPROC [ARGS...]

Run SCRIPT with NPROC processes per node under torchrun; ARGS go to SCRIPT.

environment:
  NNODES       number of nodes (default 1: torchrun --standalone, which picks a free port itself)
  NODE_RANK    this node's rank, 0 .. NNODES-1 (default 0)
  MASTER_ADDR  address of node 0, reachable from every node (default 127.0.0.1)
  MASTER_PORT  free port on node 0 (default 29500)

examples:
  # one node, 8 GPUs
  ddp_launch.sh gpt.py 8 --data hh_sft --init_from gpt2

  # two nodes of 8 GPUs: run on each node, NODE_RANK 0 on the node at MASTER_ADDR
  NNODES=2 NODE_RANK=0 MASTER_ADDR=10.0.0.1 ddp_launch.sh gpt.py 8 --data hh_sft --init_from gpt2 --parallel fsdp
  NNODES=2 NODE_RANK=1 MASTER_ADDR=10.0.0.1 ddp_launch.sh gpt.py 8 --data hh_sft --init_from gpt2 --parallel fsdp

  # CPU smoke test: 2 processes on this machine (gloo)
  ddp_launch.sh gpt.py 2 --device cpu --max_steps 20
EOF
}

fail() {
    echo "ddp_launch.sh: error: $1 (see --help)" >&2
    exit 2
}

if [[ $# -ge 1 && ($1 == "-h" || $1 == "--help") ]]; then
    usage
    exit 0
fi
[[ $# -ge 2 ]] || fail "expected SCRIPT NPROC [ARGS...]"
script=$1
nproc=$2
shift 2
[[ -f $script ]] || fail "no script at $script"
[[ $nproc =~ ^[1-9][0-9]*$ ]] || fail "NPROC must be a positive integer (got '$nproc')"

nnodes=${NNODES:-1}
node_rank=${NODE_RANK:-0}
[[ $nnodes =~ ^[1-9][0-9]*$ ]] || fail "NNODES must be a positive integer (got '$nnodes')"
[[ $node_rank =~ ^[0-9]+$ && $node_rank -lt $nnodes ]] || fail "NODE_RANK must be in 0..$((nnodes - 1)) (got '$node_rank')"

if command -v torchrun >/dev/null 2>&1; then
    launcher=(torchrun)
elif command -v python >/dev/null 2>&1; then
    launcher=(python -m torch.distributed.run)
else
    launcher=(python3 -m torch.distributed.run)
fi
if [[ $nnodes -eq 1 ]]; then
    topology=(--standalone)
else
    topology=(--nnodes="$nnodes" --node_rank="$node_rank" --master_addr="${MASTER_ADDR:-127.0.0.1}"
        --master_port="${MASTER_PORT:-29500}")
fi
exec "${launcher[@]}" "${topology[@]}" --nproc_per_node="$nproc" "$script" "$@"
