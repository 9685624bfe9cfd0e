#!/usr/bin/env bash
# Launch this recipe on an Atlas A3 cluster. Run the same command on every node:
#   NNODES=16 NODE_RANK=<0..15> MASTER_ADDR=<head node IP> bash launch.sh [extra `rlrecipes run` args]
# Node 0 starts the Ray head, waits for all nodes and their NPUs, then runs the recipe;
# the other nodes join the head and stay in the foreground until the head stops Ray.
set -euo pipefail

RECIPE_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
NNODES="${NNODES:?set NNODES to the number of nodes}"
NODE_RANK="${NODE_RANK:?set NODE_RANK (0 on the head node)}"
MASTER_ADDR="${MASTER_ADDR:?set MASTER_ADDR to the head node IP}"
RAY_PORT="${RAY_PORT:-6379}"
NPUS_PER_NODE="${NPUS_PER_NODE:-16}"          # dies visible to Ray on each A3 node
JOIN_TIMEOUT_S="${JOIN_TIMEOUT_S:-600}"
RAY_START_ARGS="${RAY_START_ARGS:-}"          # extra `ray start` flags, e.g. "--num-cpus 32 --temp-dir /data/ray"

# --- Ray token authentication -------------------------------------------------------------
# Ray >= 2.5x turns token auth on for `ray start --head` when a token exists (~/.ray/auth_token,
# RAY_AUTH_TOKEN_PATH or RAY_AUTH_TOKEN), but a joining `ray start --address` does not and is refused:
# use one mode on every node (copy the token file to every node with the same path).
if [[ -z "${RAY_AUTH_MODE:-}" && ( -n "${RAY_AUTH_TOKEN:-}" || -f "${RAY_AUTH_TOKEN_PATH:-${HOME}/.ray/auth_token}" ) ]]; then
  export RAY_AUTH_MODE=token
fi

# --- Ascend / HCCL environment -----------------------------------------------------------
if [[ -f /usr/local/Ascend/ascend-toolkit/set_env.sh ]]; then
  # shellcheck disable=SC1091
  source /usr/local/Ascend/ascend-toolkit/set_env.sh
fi
export HCCL_CONNECT_TIMEOUT="${HCCL_CONNECT_TIMEOUT:-1800}"
export HCCL_EXEC_TIMEOUT="${HCCL_EXEC_TIMEOUT:-3600}"
export HCCL_IF_BASE_PORT="${HCCL_IF_BASE_PORT:-48000}"
export HCCL_BUFFSIZE="${HCCL_BUFFSIZE:-512}"
export HCCL_SOCKET_IFNAME="${HCCL_SOCKET_IFNAME:-${SOCKET_IFNAME:-eth0}}"
export GLOO_SOCKET_IFNAME="${GLOO_SOCKET_IFNAME:-${SOCKET_IFNAME:-eth0}}"
export TP_SOCKET_IFNAME="${TP_SOCKET_IFNAME:-${SOCKET_IFNAME:-eth0}}"
export PYTORCH_NPU_ALLOC_CONF="${PYTORCH_NPU_ALLOC_CONF:-expandable_segments:True}"
export TASK_QUEUE_ENABLE="${TASK_QUEUE_ENABLE:-2}"
export CPU_AFFINITY_CONF="${CPU_AFFINITY_CONF:-1}"
# --- vllm-ascend ----------------------------------------------------------------------------
export VLLM_USE_V1="${VLLM_USE_V1:-1}"
export VLLM_ENABLE_GRAPH_MODE="${VLLM_ENABLE_GRAPH_MODE:-1}"
# DeepSeek rollout: MLA + MoE multistream and the NZ KV cache are set in recipe.yaml (rollout.inference)
export HCCL_OP_EXPANSION_MODE="${HCCL_OP_EXPANSION_MODE:-AIV}"
export VLLM_ASCEND_ENABLE_MLAPO="${VLLM_ASCEND_ENABLE_MLAPO:-1}"
export VLLM_WORKER_MULTIPROC_METHOD="${VLLM_WORKER_MULTIPROC_METHOD:-spawn}"

wait_for_cluster() {
  local deadline=$((SECONDS + JOIN_TIMEOUT_S))
  local want_npus=$((NNODES * NPUS_PER_NODE))
  while true; do
    read -r nodes npus < <(RAY_HEAD="${MASTER_ADDR}:${RAY_PORT}" python3 - <<'PY'
import os
import ray
from rlrecipes.cluster import connect  # joins as `ray start` does (token auth included)
connect(os.environ["RAY_HEAD"])
alive = [n for n in ray.nodes() if n["Alive"]]
print(len(alive), int(sum(n["Resources"].get("NPU", 0) for n in alive)))
PY
)
    echo "[launch] ${nodes}/${NNODES} nodes, ${npus}/${want_npus} NPUs joined"
    if (( nodes >= NNODES && npus >= want_npus )); then return 0; fi
    if (( SECONDS > deadline )); then
      echo "[launch] timed out after ${JOIN_TIMEOUT_S}s waiting for ${NNODES} nodes" >&2
      return 1
    fi
    sleep 10
  done
}

if [[ "${NODE_RANK}" == "0" ]]; then
  ray start --head --port="${RAY_PORT}" --node-ip-address="${MASTER_ADDR}" \
    --resources="{\"NPU\": ${NPUS_PER_NODE}}" --disable-usage-stats ${RAY_START_ARGS}
  wait_for_cluster
  status=0
  rlrecipes run "${RECIPE_DIR}" --address "${MASTER_ADDR}:${RAY_PORT}" --nodes "${NNODES}" \
    --devices-per-node "${NPUS_PER_NODE}" "$@" || status=$?
  ray stop
  exit "${status}"
else
  ray start --address="${MASTER_ADDR}:${RAY_PORT}" \
    --resources="{\"NPU\": ${NPUS_PER_NODE}}" --disable-usage-stats ${RAY_START_ARGS} --block
fi
