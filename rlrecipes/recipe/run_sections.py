"""Recipe sections of the run itself: resharding, the resources it is placed on, and the trainer loop."""
from __future__ import annotations

from typing import Literal, Optional

from pydantic import Field, field_validator, model_validator

from .base import _Strict, registered_name




class ReshardConfig(_Strict):
    @field_validator("strategy")
    @classmethod
    def _registered_strategy(cls, v: str) -> str:
        from ..core.resharder import AUTO, STRATEGIES  # the resharder's one list of strategies

        return registered_name(v, (AUTO, *STRATEGIES), "resharding.strategy", "reshard strategy")

    strategy: str = "auto"
    """How trained weights reach the rollout layout each step: auto, or one of the resharder's
    ``STRATEGIES`` (allgather_naive, allgather_swap, alltoallv_experts, tp_allgather_pp_alltoall)."""
    bucket_mb: int = Field(512, ge=1)
    """Bucket size of the bucketed strategies."""
    swap_grads: bool = False
    """Also swap gradients to host during rollout (the native engine swaps params, grads and optimizer together)."""
    swap_optimizer: bool = True
    """Swap training state to host during rollout so the KV cache gets the room (no-op on CPU)."""


class ResourcesConfig(_Strict):
    @model_validator(mode="before")
    @classmethod
    def _removed_dock_transport(cls, data):
        """``dock_transport`` was removed (issue 47): the dock has one transport, its channels. Old
        run folders' config.yaml hold ``direct`` (what still happens): taken and dropped; ``ray``
        asks for what no longer exists."""
        if isinstance(data, dict) and "dock_transport" in data:
            if data["dock_transport"] != "direct":
                raise ValueError(
                    f"resources.dock_transport={data['dock_transport']!r}: this key was removed; the "
                    "TransferDock has one transport, ZeroMQ channels from every worker to the warehouses "
                    "(Ray still places and supervises the actors). Delete the key; where the nodes' ephemeral "
                    "TCP ports are firewalled from each other, open them (docs/transfer_dock.md)")
            data = {k: v for k, v in data.items() if k != "dock_transport"}
        return data

    @field_validator("hardware")
    @classmethod
    def _known_hardware(cls, v: Optional[str]) -> Optional[str]:
        from ..hardware import get_hardware

        if v is not None:
            try:
                get_hardware(v)
            except KeyError as e:
                raise ValueError(e.args[0]) from None
        return v

    def hardware_name(self) -> str:
        """The hardware table row this recipe is predicted on (``hardware`` or the device's default)."""
        from ..hardware import default_hardware

        return self.hardware or default_hardware(self.device, self.dies_per_card)

    nodes: int = Field(1, ge=1, le=65536)
    """Nodes the pinned layout was published on (`--nodes` overrides)."""
    devices_per_node: int = Field(16, ge=1, le=1024)
    """Ray accelerator resources per node (an Atlas A3 node: 8 cards = 16 dies)."""
    device: Literal["auto", "npu", "cuda", "cpu"] = "npu"
    """Device type the recipe targets."""
    dies_per_card: int = Field(2, ge=1)
    """Ray devices per card; TPS/card divides by cards (A3: 2 dies per card)."""
    device_memory_gb: float = Field(64.0, gt=0)
    """Memory of one device, for the planner's fit check (A3 die: 64 GB HBM)."""
    hardware: Optional[str] = None
    """The machine ``plan`` predicts the step time on: a row of the hardware table
    (``rlrecipes/hardware.py``: atlas-a2, atlas-a3, h100, h200, h20, cpu). Null: from ``device``
    and ``dies_per_card`` (npu with 2 dies per card: atlas-a3; 1: atlas-a2; cuda: h100; cpu: cpu)."""
    cpus_per_worker: float = Field(1.0, gt=0)
    """Ray CPUs reserved per worker actor."""
    placement: Literal["colocated", "disaggregated"] = "colocated"
    """colocated: every device holds the actor (ref, critic) and the rollout, in turn (weights
    resharded in place, training state swapped out while generating). disaggregated: the rollout
    gets resources.rollout_devices devices of its own (the last ranks), training the rest; weights
    move across once per step and generation can run ahead (algorithm.max_staleness)."""
    rollout_devices: Optional[int] = Field(None, ge=1)
    """disaggregated: devices given to the rollout (rollout TP x EP x DP fills exactly these);
    the actor, ref and critic layouts fill the other world - rollout_devices. Null when colocated."""
    dock_encryption: bool = True
    """Encrypt and authenticate the dock's connections between machines with ZeroMQ CURVE (keys made
    per run, passed only through Ray). false: traffic in clear, peers still checked by a per-run
    token; turn off only inside a trusted network (docs/transfer_dock.md has the measured cost)."""


class TrainerConfig(_Strict):
    @field_validator("loggers")
    @classmethod
    def _jsonl_always(cls, v: list) -> list:
        return list(dict.fromkeys(["jsonl", *v]))

    steps: int = Field(100, ge=1, le=100_000_000)
    """Training steps (one rollout batch each)."""
    global_batch: int = Field(32, ge=1)
    """Prompts per step."""
    n_samples_per_prompt: int = Field(8, ge=1)
    """Responses sampled per prompt (the GRPO group size)."""
    mini_batch: int = Field(32, ge=1)
    """Prompts per optimizer step; global_batch / mini_batch optimizer steps per rollout batch."""
    micro_batch: int = Field(4, ge=1)
    """Samples per forward/backward on one DP rank (gradient accumulation), when no token budget is set."""
    max_tokens_per_micro_batch: Optional[int] = Field(None, ge=1)
    """Dynamic batching: pack unpadded samples into micro-batches of at most this many prompt + response
    tokens (replaces micro_batch; null: fixed micro_batch samples, padded). A longer sample (a 32K
    response) forms a micro-batch of its own; ``plan`` counts at least one whole sample per micro-batch."""
    lr: float = Field(1e-6, gt=0)
    """Actor AdamW learning rate."""
    warmup_steps: int = Field(0, ge=0)
    """Linear LR warm-up steps."""
    seed: int = Field(1234, ge=0, le=2**63 - 1)
    """Seed of data order, sampling and initialisation."""
    checkpoint_interval: int = Field(0, ge=0)
    """Save the train state every K steps (0: never)."""
    out_dir: str = "runs"
    """Where run folders are created."""
    export_hf: bool = True
    """At the end of the run, write the trained actor as an HF folder (<run>/actor_hf) that transformers loads."""
    rebalance_tolerance: float = Field(0.1, ge=0)
    """Colocated runs whose actor has one DP rank per worker, as the rollout does: each worker trains on
    the rows it generated while the heaviest worker's prompt + response tokens are at most this fraction
    above the mean; beyond it the update re-balances rows by tokens through the TransferDock (one claim
    and a TensorCache all-to-all). 0: re-balance unless the loads are already even."""
    dock_timeout_s: float = Field(600.0, gt=0)
    """A stage waiting longer than this on the TransferDock fails with a named error."""
    @field_validator("loggers")
    @classmethod
    def _registered_loggers(cls, v: list[str]) -> list[str]:
        from ..loggers import NAMES  # the one list of metric sinks

        return [registered_name(n, NAMES, "trainer.loggers", "logger") for n in v]

    loggers: list[str] = Field(default_factory=lambda: ["jsonl"])
    """Where per-step metrics go: jsonl (<run>/metrics.jsonl, always on), tensorboard (<run>/tensorboard),
    wandb (online when logged in, else offline in <run>/wandb). tensorboard / wandb are extras."""
    fail_when_bad_share: float = Field(1.0, gt=0, le=1)
    """The run exits non-zero when this share of its steps skipped the update (non-finite loss or
    gradient), or this share of its samples' rewards raised; 1.0: only when all of them did."""

    @model_validator(mode="after")
    def _batches(self) -> "TrainerConfig":
        if self.global_batch % self.mini_batch:
            raise ValueError(f"trainer.global_batch={self.global_batch} is not a multiple of trainer.mini_batch={self.mini_batch}")
        return self
