#!/usr/bin/env bash
# Launch this recipe on a cluster: run the same command on every node,
#   NNODES=16 NODE_RANK=<0..15> MASTER_ADDR=<head node IP> bash launch.sh [extra `rlrecipes run` args]
# Node 0 starts the Ray head, waits for every node, runs this folder's recipe and stops Ray; the
# others join the head. Variables and defaults: `rlrecipes launch --help`.
# This recipe's own environment (a node's own setting wins): bigger HCCL buffers for EP128, AIV
# collectives and vllm-ascend's fused MLA preprocessing.
set -euo pipefail
exec rlrecipes launch "$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)" \
  --env HCCL_BUFFSIZE=512 --env HCCL_OP_EXPANSION_MODE=AIV --env VLLM_ASCEND_ENABLE_MLAPO=1 "$@"
