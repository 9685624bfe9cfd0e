"""Device-strict mode: a whole RL step on the host, with the engine's tensors on a device that is not it.

A CPU test cannot see a host/device mix when the engine's device is the host: ``cpu`` meets ``cpu``
everywhere. The first whole step on a GPU failed on exactly such a mix, which 1,029 CPU tests had
passed. This mode gives a CPU run the accelerator's rules without the accelerator:

* :func:`simulate` makes ``rlrecipes.device`` answer as if a ``cuda`` (or ``npu``) device existed
  (``resources.device=cuda`` resolves, ``device.torch_device`` is ``cuda:0``, the comm backend is gloo,
  memory figures are the host's) and installs :class:`StrictDeviceMode`;
* a tensor created on, or moved to, that device is a :class:`DeviceTensor`: its data live in host
  memory and every op on it computes on the host, but it reports ``cuda:0``;
* every op checks its operands as a CUDA / NPU kernel does: tensors of one device only (a 0-dim host
  tensor may join device tensors as a scalar; indices may stay on the host; ``copy_`` and ``to`` cross
  devices). A mix raises :class:`DeviceMixError`,
  naming the op, the Python line in rlrecipes that called it, each operand's shape and device, and
  where each device tensor came from (the rlrecipes line that moved or made it, and the column when
  that line was handling one).

What it leaves out: the compute is the host's (fp32, no FSDP2 mixed precision: FSDP2 drives CUDA
streams, which a CPU build lacks), a generator's device is not checked (a dispatch mode sees a new
Python object for it at every op, so a simulated device's generator cannot be told from the host's),
collectives are gloo's (so buffers that a NCCL group would keep on
the device go through the host, as the code does for gloo), and no kernel, stream or memory limit of
the real device is modelled. It checks placement, not speed or memory.
"""
from __future__ import annotations

import contextlib
import sys
import threading
from pathlib import Path
from typing import Any, Iterator, Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode
from torch.utils._pytree import tree_flatten, tree_map

from . import device as dev

_PACKAGE = str(Path(__file__).resolve().parent)
_aten = torch.ops.aten

#: ops that may read operands of two devices (a copy between them, or a scalar read)
_CROSSING = {_aten.copy_.default, _aten._to_copy.default, _aten._local_scalar_dense.default,
             _aten.is_pinned.default, _aten.lift_fresh.default}
#: ops whose index operands may stay on the host (CUDA moves host indices to the device)
_INDEXING = {_aten.index.Tensor, _aten.index_put_.default, _aten.index_put.default,
             _aten._index_put_impl_.default, _aten._unsafe_index.Tensor, _aten._unsafe_index_put.default}


def _histc(x, *args, **kwargs):
    if x.is_floating_point():
        return _aten.histc.default(x, *args, **kwargs)
    return _aten.histc.default(x.float(), *args, **kwargs).to(x.dtype)


#: what the device computes that the host's kernels refuse (transformers' MoE takes an integer
#: ``histc`` on every device but the CPU and MPS): the same result through a host-supported dtype
_HOST_KERNELS = {_aten.histc.default: _histc}


class DeviceMixError(RuntimeError):
    """An op met tensors of two devices, as a CUDA / NPU kernel would refuse them."""


def _caller() -> str:
    """``file:line in function`` of the innermost rlrecipes frame outside this module."""
    f = sys._getframe(1)
    while f is not None:
        path = f.f_code.co_filename
        if path.startswith(_PACKAGE) and not path.endswith("device_strict.py"):
            rel = Path(path).relative_to(Path(_PACKAGE).parent)
            column = f.f_locals.get("column", f.f_locals.get("c"))
            what = f", column {column!r}" if isinstance(column, str) else ""
            return f"{rel}:{f.f_lineno} in {f.f_code.co_name}{what}"
        f = f.f_back
    return "outside rlrecipes"


class DeviceTensor(torch.Tensor):
    """A tensor on the simulated device: host data (``elem``), the device's identity (``device``)."""

    elem: torch.Tensor
    origin: str

    @staticmethod
    def __new__(cls, elem: torch.Tensor, device: torch.device, origin: str):
        r = torch.Tensor._make_wrapper_subclass(cls, elem.size(), strides=elem.stride(),
                                                storage_offset=elem.storage_offset(), dtype=elem.dtype,
                                                layout=elem.layout, device=device,
                                                requires_grad=elem.requires_grad)
        r.elem, r.origin = elem, origin
        return r

    def tolist(self):  # torch refuses it for subclasses; a device tensor reads back to the host
        return self.elem.tolist()

    def __repr__(self) -> str:  # the data are readable: they are on the host
        return f"DeviceTensor({self.elem!r}, device='{self.device}')"

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        return _dispatch(func, args, kwargs or {})


def _name(device: torch.device) -> str:
    return f"{device} (simulated {dev.simulated()})" if device.type == dev.SIMULATED_TORCH_TYPE else str(device)


def _describe(name: str, t: Any) -> str:
    where = f" (on the device since {t.origin})" if isinstance(t, DeviceTensor) else ""
    return f"{name} {list(t.shape)} {str(t.dtype).removeprefix('torch.')} on {_name(t.device)}{where}"


def _operands(func, args, kwargs) -> list[tuple[str, Any]]:
    """``(argument name, value)`` of every tensor operand, tensors inside lists named ``name[i]``."""
    out = []
    names = [a.name for a in func._schema.arguments]
    for i, v in enumerate(args):
        name = names[i] if i < len(names) else f"arg{i}"
        if isinstance(v, torch.Tensor):
            out.append((name, v))
        elif isinstance(v, (list, tuple)):
            out += [(f"{name}[{j}]", x) for j, x in enumerate(v) if isinstance(x, torch.Tensor)]
    out += [(k, v) for k, v in kwargs.items() if isinstance(v, torch.Tensor)]
    return out


def _mix(func, args, kwargs, detail: str) -> DeviceMixError:
    ops = [_describe(n, t) for n, t in _operands(func, args, kwargs)]
    return DeviceMixError(f"Expected all tensors to be on the same device: {func} at {_caller()}: {detail}; "
                          f"operands: {'; '.join(ops)}")


def _check(func, args, kwargs) -> Optional[torch.device]:
    """The device the op runs on (None: the host), after a CUDA-like check of its operands."""
    target = kwargs.get("device")
    sim = dev.SIMULATED_TORCH_TYPE
    if func in _CROSSING:
        return None
    operands = _operands(func, args, kwargs)
    if func in _INDEXING:
        base = operands[0][1]
        on_dev = isinstance(base, DeviceTensor)
        for name, t in operands[1:]:
            here = isinstance(t, DeviceTensor)
            if here == on_dev or (not here and (name.startswith("indices") or t.dim() == 0)):
                continue  # same device, host indices, or a host scalar value
            raise _mix(func, args, kwargs, f"{name} is on {_name(t.device)}, self on {_name(base.device)}")
        return base.device if on_dev else None
    devices = {t.device for _, t in operands if isinstance(t, DeviceTensor)}
    hosts = [(n, t) for n, t in operands if not isinstance(t, DeviceTensor) and t.device.type == "cpu"]
    if devices:
        mutable = func._schema.is_mutable and operands and not isinstance(operands[0][1], DeviceTensor)
        big = [(n, t) for n, t in hosts if t.dim() > 0 or (mutable and n == operands[0][0])]
        if big:
            d = next(iter(devices))
            raise _mix(func, args, kwargs, f"found at least two devices, {_name(d)} and cpu ({big[0][0]} is on the host)")
    if isinstance(target, torch.device) and target.type == sim:
        devices.add(target)
    elif isinstance(target, torch.device) and target.type == "cpu" and devices:
        return None  # a factory op asked for host memory explicitly
    return next(iter(devices)) if devices else None


def _unwrap(x):
    return x.elem if isinstance(x, DeviceTensor) else x


def _dispatch(func, args, kwargs):
    sim = dev.SIMULATED_TORCH_TYPE
    if func is _aten._to_copy.default:
        src, want = args[0], kwargs.get("device")
        kw = dict(kwargs)
        kw.pop("device", None)
        out = func(_unwrap(src), **kw)
        on_dev = (want.type == sim) if isinstance(want, torch.device) else isinstance(src, DeviceTensor)
        if not on_dev:
            return out
        origin = src.origin if isinstance(src, DeviceTensor) and want is None else _caller()
        return DeviceTensor(out, want if isinstance(want, torch.device) else src.device, origin)
    target = _check(func, args, kwargs)
    kw = dict(kwargs)
    if isinstance(kw.get("device"), torch.device) and kw["device"].type == sim:
        kw["device"] = torch.device("cpu")
    u_args, u_kw = tree_map(_unwrap, args), tree_map(_unwrap, kw)
    out = (_HOST_KERNELS.get(func, func) if target is not None else func)(*u_args, **u_kw)
    if target is None:
        return out
    # in-place ops return their operand: hand back the DeviceTensor itself, not a new wrapper
    inputs = {id(_unwrap(a)): a for a in tree_flatten((args, kwargs))[0] if isinstance(a, DeviceTensor)}
    origin = next((a.origin for a in inputs.values()), None) or _caller()

    def wrap(x):
        if not isinstance(x, torch.Tensor):
            return x
        if id(x) in inputs:
            return inputs[id(x)]
        return DeviceTensor(x, target, origin)

    return tree_map(wrap, out)


class StrictDeviceMode(TorchDispatchMode):
    """Routes factory ops that name the simulated device, and every op on a :class:`DeviceTensor`,
    through the device check (see the module docstring)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return _dispatch(func, args, kwargs or {})


class _SimulatedDeviceModule:
    """``torch.<device type>`` for the simulated device, as torch's utilities look it up by the device
    type (activation checkpointing saves and restores the device's RNG): the host's RNG, one device."""

    @staticmethod
    def device(index=None):
        return contextlib.nullcontext()

    get_rng_state = staticmethod(torch.get_rng_state)
    set_rng_state = staticmethod(torch.set_rng_state)
    manual_seed = staticmethod(torch.manual_seed)

    @staticmethod
    def current_device() -> int:
        return 0

    @staticmethod
    def device_count() -> int:
        return 1

    @staticmethod
    def is_available() -> bool:
        return True


def _register_device_module() -> None:
    if not hasattr(torch, dev.SIMULATED_TORCH_TYPE):
        torch._register_device_module(dev.SIMULATED_TORCH_TYPE, _SimulatedDeviceModule)


_lock = threading.Lock()


@contextlib.contextmanager
def simulate(kind: str | None = None) -> Iterator[torch.device]:
    """In this block ``rlrecipes.device`` sees one device of type ``kind`` (default
    ``device.SIMULATED_DEFAULT``) whose tensors are :class:`DeviceTensor`, and every op is checked
    (this thread; not nested). Yields the simulated device."""
    kind = kind or dev.SIMULATED_DEFAULT
    with _lock:
        if dev.simulated() is not None:
            raise RuntimeError(f"device_strict.simulate: already simulating {dev.simulated()}")
        dev._set_simulated(kind)  # noqa: SLF001 (the one caller the setter has)
        _register_device_module()
    # ``module.to(device)`` must swap each parameter for its DeviceTensor: the default assigns
    # ``param.data``, which keeps the Parameter's own class and so loses the device's checks
    # ``torch.tensor(data, device=...)`` builds its tensor with the Python dispatch key excluded unless
    # told to build it on the host and move it afterwards (as torch's fake tensors do)
    swap, lift = torch.__future__.get_swap_module_params_on_conversion(), torch._C._only_lift_cpu_tensors()
    torch.__future__.set_swap_module_params_on_conversion(True)
    torch._C._set_only_lift_cpu_tensors(True)
    try:
        with StrictDeviceMode():
            yield torch.device(dev.SIMULATED_TORCH_TYPE, 0)
    finally:
        torch.__future__.set_swap_module_params_on_conversion(swap)
        torch._C._set_only_lift_cpu_tensors(lift)
        dev._set_simulated(None)  # noqa: SLF001


def active() -> bool:
    """A :class:`StrictDeviceMode` is on this thread's dispatch stack."""
    return isinstance(_get_current_dispatch_mode(), StrictDeviceMode)


__all__ = ["DeviceMixError", "DeviceTensor", "StrictDeviceMode", "active", "simulate"]
