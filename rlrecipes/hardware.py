"""What one device of each supported machine can do: the numbers ``plan``'s step-time model uses.

One :class:`Hardware` row per machine, per *device*: the unit Ray schedules (an Atlas A3 die, a
GPU). A card is ``devices_per_card`` devices (an A3 card holds 2 dies); TPS/card divides by cards.
Every number carries its public source in ``sources``; where sources disagree the row says which
one it took. Peak FLOP/s is dense BF16 (no 2:4 sparsity); bandwidths are one direction, per device.

A recipe names its row with ``resources.hardware``; without one, the device type picks it
(:func:`default_hardware`). ``rlrecipes plan <recipe> resources.hardware=h100`` predicts a step on a
machine that no recipe pins.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Optional

TB, GB = 1e12, 1e9


@dataclass(frozen=True)
class Hardware:
    name: str
    title: str
    device: str
    """The device type it runs as (``resources.device``): npu, cuda or cpu."""
    bf16_flops: float
    """Peak dense BF16 FLOP/s of one device (the CPU row: FP32, which the smoke runs use)."""
    hbm_bytes_s: float
    """Memory bandwidth of one device, bytes/s."""
    hbm_gb: float
    """Memory capacity of one device, GB."""
    intra_node_bytes_s: float
    """Device-to-device bandwidth inside a node (HCCS / NVLink), one direction, per device."""
    inter_node_bytes_s: float
    """Bandwidth from one device to other nodes (RoCE / InfiniBand NICs), one direction, per device."""
    host_bytes_s: float
    """Device <-> host link (PCIe), one direction: what swapping optimizer state out and in crosses."""
    devices_per_card: int = 1
    devices_per_node: int = 8
    collective_latency_s: float = 50e-6
    """Seconds a small collective (an all-reduce of a decode step's activations, a MoE dispatch) takes
    between two devices; a group of g devices takes log2(g) of them."""
    scale_up_devices: int = 8
    """Devices that reach each other at ``intra_node_bytes_s`` (a node; an A3 SuperPoD's unified bus
    spans 384 cards = 768 dies); beyond it, ``inter_node_bytes_s``."""
    sources: dict = field(default_factory=dict)
    """Where each number comes from: field name -> source."""

    def to_json(self) -> dict:
        return asdict(self)


_NV_H100 = "NVIDIA H100 Tensor Core GPU datasheet (SXM5: 989 TFLOPS BF16 dense, 80 GB HBM3 at 3.35 TB/s, NVLink 900 GB/s)"
_NV_H200 = "NVIDIA H200 Tensor Core GPU datasheet (SXM: 989 TFLOPS BF16 dense, 141 GB HBM3e at 4.8 TB/s, NVLink 900 GB/s)"
_NV_H20 = ("NVIDIA H20 specifications as published by server vendors (e.g. the HGX H20 spec sheets): 148 TFLOPS "
           "BF16 dense, 96 GB HBM3 at 4.0 TB/s, NVLink 900 GB/s")
_NVLINK = "NVLink 4: 900 GB/s bidirectional per GPU = 450 GB/s one way"
_IB = "one ConnectX-7 400 Gb/s NIC per GPU in HGX reference nodes = 50 GB/s"
_PCIE5 = "PCIe Gen5 x16: 64 GB/s one way"
_LAT = ("nccl-tests / HCCL small-message all-reduce inside an 8- or 16-device node: 20-100 us; DeepEP's and "
        "HCCL's low-latency MoE dispatch: ~100-200 us over 8-64 ranks, i.e. ~50 us per log2 step; 50 us taken")
_A2 = ("Huawei Atlas 800T A2 / Ascend 910B datasheets and the Ascend 910B figures widely cited (910B2/B3: "
       "~313-376 TFLOPS FP16, 64 GB HBM2e at 1.6 TB/s); 313 TFLOPS (910B3, the lower) taken")
_A2_HCCS = "Atlas 800T A2: 8 NPUs in an HCCS full mesh, 7 links x 56 GB/s = 392 GB/s per NPU (bidirectional): 196 GB/s one way"
_A2_NIC = "Atlas 800T A2: 8 x 200 GE RoCE ports, one per NPU = 25 GB/s"
_A3 = ("Huawei CloudMatrix384 technical report (arXiv 2506.12708) on the Ascend 910C: 2 dies per package, "
       "~752 TFLOPS BF16 and 128 GB HBM at 3.2 TB/s per package, i.e. ~376 TFLOPS, 64 GB, 1.6 TB/s per die")
_A3_UB = ("CloudMatrix384 report: unified bus (UB) 392 GB/s one way per 910C package across the supernode "
          "= 196 GB/s per die")
_A3_NIC = "CloudMatrix384 report: RDMA plane 400 Gb/s per 910C package = 25 GB/s per die"

HARDWARE: dict[str, Hardware] = {h.name: h for h in (
    Hardware("atlas-a2", "Huawei Atlas 800T A2 (Ascend 910B)", "npu", 313 * TB, 1.6 * TB, 64, 196 * GB, 25 * GB,
             64 * GB, devices_per_card=1, devices_per_node=8,
             sources={"bf16_flops": _A2, "hbm_bytes_s": _A2, "hbm_gb": _A2, "intra_node_bytes_s": _A2_HCCS,
                      "inter_node_bytes_s": _A2_NIC, "host_bytes_s": _PCIE5, "collective_latency_s": _LAT}),
    Hardware("atlas-a3", "Huawei Atlas A3 (Ascend 910C), per die", "npu", 376 * TB, 1.6 * TB, 64, 196 * GB, 25 * GB,
             32 * GB, devices_per_card=2, devices_per_node=16, scale_up_devices=768,
             sources={"bf16_flops": _A3, "hbm_bytes_s": _A3, "hbm_gb": _A3, "intra_node_bytes_s": _A3_UB,
                      "inter_node_bytes_s": _A3_NIC,
                      "scale_up_devices": "CloudMatrix384 report: the UB plane joins 384 910C packages (768 dies) "
                                          "of an Atlas 900 A3 SuperPoD at full UB bandwidth",
                      "host_bytes_s": "PCIe Gen5 x16 per 910C package (64 GB/s), shared by its 2 dies",
                      "collective_latency_s": _LAT}),
    Hardware("h100", "NVIDIA H100 SXM5", "cuda", 989 * TB, 3.35 * TB, 80, 450 * GB, 50 * GB, 64 * GB,
             sources={"bf16_flops": _NV_H100, "hbm_bytes_s": _NV_H100, "hbm_gb": _NV_H100,
                      "intra_node_bytes_s": _NVLINK, "inter_node_bytes_s": _IB, "host_bytes_s": _PCIE5, "collective_latency_s": _LAT}),
    Hardware("h200", "NVIDIA H200 SXM", "cuda", 989 * TB, 4.8 * TB, 141, 450 * GB, 50 * GB, 64 * GB,
             sources={"bf16_flops": _NV_H200, "hbm_bytes_s": _NV_H200, "hbm_gb": _NV_H200,
                      "intra_node_bytes_s": _NVLINK, "inter_node_bytes_s": _IB, "host_bytes_s": _PCIE5, "collective_latency_s": _LAT}),
    Hardware("h20", "NVIDIA H20", "cuda", 148 * TB, 4.0 * TB, 96, 450 * GB, 50 * GB, 64 * GB,
             sources={"bf16_flops": _NV_H20, "hbm_bytes_s": _NV_H20, "hbm_gb": _NV_H20,
                      "intra_node_bytes_s": _NVLINK, "inter_node_bytes_s": _IB, "host_bytes_s": _PCIE5, "collective_latency_s": _LAT}),
    Hardware("cpu", "this CI machine: 2 cores of an AMD EPYC (Zen 3), one core per smoke worker", "cpu",
             80 * GB, 10 * GB, 24, 1 * GB, 1 * GB, 10 * GB, devices_per_card=1, devices_per_node=2, scale_up_devices=2,
             collective_latency_s=500e-6,
             sources={"bf16_flops": "AMD Zen 3 (Software Optimization Guide for family 19h): 2 x 256-bit FMA per "
                                    "cycle = 32 FP32 FLOP/cycle; x 2.5 GHz (lscpu gives no clock; EPYC 7003 base "
                                    "2.3-3.0 GHz) = 80 GFLOP/s per core, the unit a smoke worker runs on",
                      "hbm_bytes_s": "measured here: torch copy of 256 MiB, 2 threads, ~11 GB/s read + write; "
                                     "10 GB/s per core taken",
                      "hbm_gb": "this machine: 24 GiB",
                      "intra_node_bytes_s": "measured here: gloo all-reduce of 16 MB between 2 processes, bus "
                                            "bandwidth 0.65 GB/s with the machine loaded; 1 GB/s taken",
                      "collective_latency_s": "measured here: gloo all-reduce of 4 KB between 2 processes, 0.3-0.9 ms "
                                              "(idle / loaded); 0.5 ms taken",
                      "inter_node_bytes_s": "one node: not used", "host_bytes_s": "same memory: a copy"}),
)}


def default_hardware(device: str, dies_per_card: int = 1) -> str:
    """The row a recipe without ``resources.hardware`` is predicted on: an NPU recipe with 2 dies per
    card is an Atlas A3, with 1 an Atlas A2; CUDA an H100; the CPU this machine."""
    if device == "npu":
        return "atlas-a3" if dies_per_card == 2 else "atlas-a2"
    if device == "cuda":
        return "h100"
    return "cpu"


#: a device's reported name (``device.device_name``: the GPU's product name, the NPU's SoC name) -> its row; the
#: first match wins, so a longer name comes before its prefix (H200 before H20)
_BY_DEVICE_NAME = (("H200", "h200"), ("H100", "h100"), ("H20", "h20"), ("910C", "atlas-a3"),
                   ("910_93", "atlas-a3"), ("910B", "atlas-a2"))


def hardware_of_device(device_name: str, device_type: str) -> Optional[str]:
    """The row of a device a benchmark ran on, from its reported name (the CPU row for a CPU run);
    None for a device the table has no row for."""
    if device_type == "cpu":
        return "cpu"
    upper = device_name.upper()
    return next((row for key, row in _BY_DEVICE_NAME if key in upper), None)


def get_hardware(name: str) -> Hardware:
    """The row named ``name``; a clear error naming ``resources.hardware`` and the rows otherwise."""
    if name not in HARDWARE:
        raise KeyError(f"resources.hardware={name!r} is not in the hardware table; one of: {', '.join(HARDWARE)} "
                       "(rlrecipes/hardware.py; add a row with its sources for another machine)")
    return HARDWARE[name]


__all__ = ["HARDWARE", "Hardware", "default_hardware", "get_hardware", "hardware_of_device"]
