#!/usr/bin/env bash
# Launch this recipe on a cluster: run the same command on every node,
#   NNODES=1 NODE_RANK=0 MASTER_ADDR=<head node IP> bash launch.sh [extra `rlrecipes run` args]
# Node 0 starts the Ray head, waits for every node, runs this folder's recipe and stops Ray; the
# others join the head. Variables and defaults: `rlrecipes launch --help`.
set -euo pipefail
exec rlrecipes launch "$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)" "$@"
