"""The step-time model's efficiency factors (:class:`Factors`) and where each comes from.

A few are set once from stated public sources (decode bandwidth, communication bandwidth, the dock's
round trip); the rest are the project's own measurements, each read at plan time from the newest
committed results file under ``benchmarks/results/`` that holds it, so the factors follow the
engines as they get faster:

- ``gpu_suite-*.json`` of an accelerator: each engine's train MFU, the MoE shape's MFU scale, the
  eager decoder's host seconds per layer;
- ``host_pass_cost-cpu-*.json`` and ``decode_host_cost-cpu-*.json``: this CPU's pass costs per
  model family, one process;
- ``layout_pass_cost-cpu-*.json``: the same passes of the native engines split over gloo processes
  at a layout (``dp2``, ``tp2``, ``tp2ep2``), their collectives included.

An item no file holds, or an installed package without that folder, takes ``measured.json`` (the
same extraction, recorded; a test keeps the two equal), and every factor's ``source`` names the
file it came from.
"""
from __future__ import annotations

import functools
import json
from dataclasses import asdict, dataclass
from pathlib import Path

from ..device import is_accelerator

RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results"


@dataclass(frozen=True)
class Factor:
    value: float
    source: str


@dataclass
class Factors:
    """The model's efficiency factors: few, named, one set for every recipe."""

    mfu: dict[str, Factor]
    """Matmul FLOP/s reached over peak, by engine, on a dense model (train passes; prefill and
    compute-bound decode of the rollout engine)."""
    moe_mfu_scale: Factor
    """What a MoE model's MFU is of a dense one's (grouped expert matmuls, routing, all-to-all)."""
    decode_bandwidth: Factor
    """Memory bandwidth a decode iteration's weight and KV reads reach over the peak."""
    comm_bandwidth: Factor
    """Bus bandwidth collectives reach over the link's peak."""
    eager_layer_s: dict[str, Factor]
    """Host seconds one transformer layer adds to an eager pass where the host bounds it, by
    ``<hardware kind>/<pass>[/<engine>]``: ``accelerator/decode`` (a GPU's host launching the
    kernels of a decode iteration: every eager engine, only one is measured) and ``cpu/forward``,
    ``cpu/train``, ``cpu/decode/<engine>`` (this CPU, its kernels included)."""
    eager_fixed_s: dict[str, Factor]
    """The same passes' cost outside the layers (embedding, head, loss, optimizer), on this CPU."""
    dock_round_trip_s: Factor
    """Seconds of one TransferDock round trip (a stage's put or take, its metadata and wait)."""

    def to_json(self) -> dict:
        def one(f: Factor) -> dict:
            return {"value": round(f.value, 6), "source": f.source}

        out: dict = {}
        for k, v in asdict(self).items():
            out[k] = {n: {"value": round(x["value"], 6), "source": x["source"]} for n, x in v.items()} \
                if isinstance(v, dict) and "value" not in v else one(Factor(**v))
        return out


def _newest_first(results: Path, pattern: str, keep=lambda data: True) -> list[tuple[dict, str]]:
    """Results files matching ``pattern`` that ``keep`` accepts, newest first (by ``started``)."""
    found = []
    for path in sorted(results.glob(pattern)) if results.is_dir() else []:
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(data, dict) and keep(data):
            found.append((data, f"benchmarks/results/{path.name}"))
    return sorted(found, key=lambda x: str(x[0].get("started", "")), reverse=True)


def _on_accelerator(suite: dict) -> bool:
    return is_accelerator(str(suite.get("device_type")))  # a CPU run of the suite measures no accelerator


def measured_from_results(results: Path = RESULTS) -> dict:
    """What the model takes from the project's own measurements, each item from the newest
    committed results file that holds it: each engine's train MFU on a dense shape (default
    options) and what a MoE shape's MFU is of the dense one's (accelerator suites only), an eager
    decoder's seconds per layer per iteration, and this CPU's pass costs. Items no file holds are
    left out (:func:`load_factors` takes them from ``measured.json``)."""
    out: dict = {}
    suites = _newest_first(results, "gpu_suite-*.json", _on_accelerator)
    for suite, name in suites:
        dense, moe = {}, {}
        for ln in suite.get("lines", []):
            if ln.get("part") != "train" or ln.get("options") != {} or "error" in ln or "mfu" not in ln:
                continue
            is_moe = ln.get("active_params") not in (None, ln.get("params"))
            (moe if is_moe else dense).setdefault(ln["engine"], (ln["mfu"], ln.get("shape")))
        for e, (v, shape) in dense.items():
            out.setdefault("train_mfu", {}).setdefault(e, {"value": v, "shape": shape, "source": name,
                                                           "device": suite.get("device")})
        both = next((e for e in sorted(dense) if e in moe), None)
        if both and "moe_mfu_scale" not in out:
            out["moe_mfu_scale"] = {"value": round(moe[both][0] / dense[both][0], 4), "engine": both, "source": name,
                                    "moe": moe[both][0], "moe_shape": moe[both][1], "dense": dense[both][0]}
        decs = [ln for ln in suite.get("lines", []) if ln.get("part") == "decode" and ln.get("native_tokens_per_s")
                and ln.get("batch") and not ln.get("options")]  # the default path; batch 64 where it ran
        dec = next((ln for ln in decs if ln["batch"] == 64), max(decs, key=lambda ln: ln["batch"], default=None))
        if dec and "eager_decode" not in out:
            layers = dec.get("layers", 28)  # the suite's Qwen2.5-1.5B shape (recorded in the line from 2026-11-29)
            out["eager_decode"] = {"value": round(dec["batch"] / dec["native_tokens_per_s"] / layers, 6),
                                   "tokens_per_s": dec["native_tokens_per_s"], "batch": dec["batch"], "layers": layers,
                                   "source": name}
    for host, name in _newest_first(results, "host_pass_cost-cpu-*.json"):
        for ln in host.get("lines", []):  # per model family (a file before families: its qwen2 shape)
            if ln.get("part") == "summary":
                out.setdefault("cpu", {}).setdefault(ln.get("family", "qwen2"), {
                    **{k: ln[k] for k in sorted(ln) if k.endswith(("_per_layer_s", "_fixed_s"))
                       and not k.startswith("decode")}, "source": name})
    for lpc, name in _newest_first(results, "layout_pass_cost-cpu-*.json"):
        for ln in lpc.get("lines", []):  # per model family and layout: the native engines in gloo processes
            if ln.get("part") == "pass":
                cell = out.setdefault("cpu_layout", {}).setdefault(
                    f"{ln['engine']}/{ln['family']}/{ln['layout']}", {"source": name})
                if cell["source"] == name:
                    cell[f"{ln['kind']}_per_layer_s"] = ln["per_layer_s"]
                    cell[f"{ln['kind']}_fixed_s"] = ln["fixed_s"]
    for dhc, name in _newest_first(results, "decode_host_cost-cpu-*.json"):
        for ln in dhc.get("lines", []):
            if ln.get("part") == "decode_iteration":
                out.setdefault("cpu_decode", {}).setdefault(ln["engine"], {}).setdefault(ln.get("family", "qwen2"), {
                    "per_layer_s": ln["per_layer_s"], "fixed_s": ln["fixed_s"], "source": name})
    return out


#: the same extraction, recorded for an installed package without benchmarks/results/ (a test keeps
#: it equal to what the newest results give)
RECORDED = Path(__file__).with_name("measured.json")


_LAYOUT_KINDS = ("forward", "train", "decode")


def layout_key(kind: str, engine_fam_layout: str) -> str:
    """The factor key of a pass measured at a layout: ``cpu/<kind>/<engine>/<family>/<layout>``
    (the engine the measurement ran, recorded in its results line)."""
    return f"cpu/{kind}/{engine_fam_layout}"


@functools.lru_cache(maxsize=4)
def load_factors(results: Path = RESULTS) -> Factors:
    """The factors: each measured one from the newest committed results that hold it, else from
    ``measured.json`` (the same extraction, recorded: an installed package has no results folder);
    the others from their stated sources (see the module docstring)."""
    m = json.loads(RECORDED.read_text())
    for key, value in measured_from_results(results).items():
        if key in ("train_mfu", "cpu", "cpu_decode", "cpu_layout"):  # per engine / family: the newest of each
            m[key] = {**m.get(key, {}), **value}
        else:
            m[key] = value
    mfu = {e: Factor(v["value"], f"{v['source']}: {e} train, {v['shape']} shape, bf16, default options, "
                                 f"{v.get('device') or 'an accelerator'}") for e, v in m["train_mfu"].items()}
    scale, dec, cpu = m["moe_mfu_scale"], m["eager_decode"], m["cpu"]  # cpu: per model family
    return Factors(
        mfu=mfu,
        moe_mfu_scale=Factor(scale["value"], f"{scale['source']}: {scale['engine']} on the {scale['moe_shape']} MoE shape, MFU "
                                             f"{scale['moe']} over its dense shape's {scale['dense']}"),
        decode_bandwidth=Factor(0.53, "SGLang's Ascend best-practice table: Qwen3-32B bf16 on 4 Atlas A3 cards "
                                      "(8 dies), TPOT 9.46 ms, where reading 8 GB of weights per die at 1.6 TB/s "
                                      "takes 5.0 ms"),
        comm_bandwidth=Factor(0.7, "nccl-tests / HCCL all-reduce bus bandwidth is 70-80 % of the link's peak on "
                                   "8-device NVLink and HCCS nodes; 0.7 taken"),
        eager_layer_s={
            "accelerator/decode": Factor(dec["value"], f"{dec['source']}: eager decode {dec['tokens_per_s']:g} tok/s at batch "
                                                       f"{dec['batch']} on a {dec['layers']}-layer model, "
                                                       f"{1000 * dec['batch'] / dec['tokens_per_s']:.1f} ms per "
                                                       f"iteration, host-bound"),
            **{f"cpu/{kind}/{fam}": Factor(v[f"{kind}_per_layer_s"], f"{v['source']}: {what} of 64 {fam} smoke "
                                                                     "samples, 1 thread")
               for fam, v in cpu.items() for kind, what in (("forward", "forward"),
                                                            ("train", "forward + backward + AdamW"))},
            **{f"cpu/decode/{e}/{fam}": Factor(v["per_layer_s"], f"{v['source']}: one decode iteration of the "
                                                                  f"{e} engine, 64 {fam} smoke rows, 1 thread")
               for e, fams in m["cpu_decode"].items() for fam, v in fams.items()},
            **{layout_key(kind, efl): Factor(v[f"{kind}_per_layer_s"], f"{v['source']}: the {efl.split('/')[0]} "
                                                    f"engine's {kind} at {efl.split('/')[2]} over 2 gloo processes, "
                                                    f"a smoke step of {efl.split('/')[1]}, collectives included")
               for efl, v in m.get("cpu_layout", {}).items() for kind in _LAYOUT_KINDS
               if f"{kind}_per_layer_s" in v},
        },
        eager_fixed_s={  # a fixed part measured below 0 is noise around none
            **{f"cpu/{kind}/{fam}": Factor(max(0.0, v[f"{kind}_fixed_s"]), v["source"])
               for fam, v in cpu.items() for kind in ("forward", "train")},
            **{f"cpu/decode/{e}/{fam}": Factor(max(0.0, v["fixed_s"]), v["source"])
               for e, fams in m["cpu_decode"].items() for fam, v in fams.items()},
            **{layout_key(kind, efl): Factor(max(0.0, v[f"{kind}_fixed_s"]), v["source"])
               for efl, v in m.get("cpu_layout", {}).items() for kind in _LAYOUT_KINDS
               if f"{kind}_fixed_s" in v},
        },
        dock_round_trip_s=Factor(1e-3, "docs/transfer_dock.md (benchmarks/dock_call.py): a direct-channel call is "
                                       "~0.1 ms of CPU each side, a Ray actor call ~1 ms; 1 ms taken"))


__all__ = ["RECORDED", "RESULTS", "Factor", "Factors", "layout_key", "load_factors", "measured_from_results"]
