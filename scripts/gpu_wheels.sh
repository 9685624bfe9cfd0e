#!/usr/bin/env bash
# Wheels that benchmarks/gpu_suite.py needs on a GPU machine that has only Python 3.12 and a
# preinstalled torch (CUDA build), and no internet: everything the suite's processes import beyond
# torch and torch's own requirements (filelock, fsspec, jinja2, MarkupSafe, networkx, setuptools,
# sympy, mpmath, typing-extensions). See docs/gpu_suite.md.
#
#   bash scripts/gpu_wheels.sh [FOLDER] [--megatron]
#
# FOLDER defaults to tmp/gpu-wheels under the repository root (tmp/ is git-ignored, so the wheels are
# never committed, and a call to the GPU machine can carry the folder). --megatron adds megatron-core
# (its GPU tests and the megatron throughput line). PYTHON_VERSION=3.11 fetches the same list for
# another Python (the list was checked that way: a virtual environment holding only torch and these
# wheels runs `python benchmarks/gpu_suite.py --cpu`).
#
# One binary wheel per package (cp312, manylinux x86_64), fetched without dependencies; the set is
# then checked against its own requirements (pydantic pins pydantic-core exactly), a matching
# version is fetched where one is off, and each wheel's size and the total are printed. On the GPU
# machine:
#
#   python -m pip install --no-index --no-deps FOLDER/*.whl && python benchmarks/gpu_suite.py
#
# Ray is not in the list: the suite's whole-RL-step part drives the workflow's worker without Ray,
# and ray's own wheel is larger than all of these together.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DEST="$ROOT/tmp/gpu-wheels"
MEGATRON=0
for a in "$@"; do
    case "$a" in
        --megatron) MEGATRON=1 ;;
        -*) echo "unknown option $a" >&2; exit 2 ;;
        *) DEST="$a" ;;
    esac
done
PYV="${PYTHON_VERSION:-3.12}"

PACKAGES=(
    # transformers and what importing it needs (its CLI's typer / rich / click and the hub's hf-xet
    # downloader are never imported by the suite, so they are left out)
    "transformers>=5.5" "huggingface-hub" "tokenizers" "safetensors" "numpy" "regex" "tqdm" "packaging"
    "pyyaml" "httpx2" "httpcore2" "h11" "anyio" "idna" "truststore"
    # rlrecipes: the recipe schema, the TransferDock's channels
    "pydantic" "pydantic-core" "annotated-types" "typing-inspection" "pyzmq"
    # the GPU tests
    "pytest" "pluggy" "iniconfig" "pygments"
    # the RL part's lora case (actor.lora.rank > 0): peft, and what importing it needs
    "peft" "accelerate" "psutil"
    # newer than a torch install may hold: pydantic needs typing-extensions >= 4.16 (0.05 MiB)
    "typing-extensions"
)
if [ "$MEGATRON" = 1 ]; then
    PACKAGES+=("megatron-core>=0.16.1,<0.20")
fi

mkdir -p "$DEST"
python3 -m pip download --quiet --only-binary=:all: --python-version "$PYV" --implementation cp \
    --abi "cp${PYV/./}" --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux_2_28_x86_64 --no-deps -d "$DEST" "${PACKAGES[@]}"

python3 - "$DEST" "$PYV" <<'PY'
import os, subprocess, sys, zipfile
try:
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name, parse_wheel_filename
except ImportError:
    from pip._vendor.packaging.requirements import Requirement
    from pip._vendor.packaging.utils import canonicalize_name, parse_wheel_filename

dest, pyv = sys.argv[1], sys.argv[2]
# what a torch wheel installs beside itself (its own requirements): not fetched here
TORCH_BRINGS = {"torch", "filelock", "fsspec", "jinja2", "markupsafe", "networkx", "setuptools", "sympy", "mpmath",
                "typing-extensions", "triton"}
ENV = {"python_version": pyv, "python_full_version": pyv + ".0", "sys_platform": "linux", "platform_system": "Linux",
       "platform_machine": "x86_64", "implementation_name": "cpython", "platform_python_implementation": "CPython",
       "os_name": "posix", "extra": ""}
PIP = [sys.executable, "-m", "pip", "download", "--quiet", "--only-binary=:all:", "--python-version", pyv,
       "--implementation", "cp", "--abi", "cp" + pyv.replace(".", ""), "--platform", "manylinux2014_x86_64",
       "--platform", "manylinux_2_17_x86_64", "--platform", "manylinux_2_28_x86_64", "--no-deps", "-d", dest]


def wheels() -> dict:
    out = {}
    for f in sorted(os.listdir(dest)):
        if f.endswith(".whl"):
            name, version, _, _ = parse_wheel_filename(f)
            out[canonicalize_name(name)] = (f, version)
    return out


def requirements(f: str):
    with zipfile.ZipFile(os.path.join(dest, f)) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        for line in z.read(meta).decode().splitlines():
            if line.startswith("Requires-Dist:"):
                req = Requirement(line.split(":", 1)[1].strip())
                if req.marker is None or req.marker.evaluate(ENV):
                    yield req


for _ in range(3):
    have, off, missing = wheels(), {}, {}
    for name, (f, _v) in have.items():
        for req in requirements(f):
            n = canonicalize_name(req.name)
            if n in have and not req.specifier.contains(have[n][1], prereleases=True):
                off.setdefault(n, []).append(str(req.specifier))
            elif n not in have and n not in TORCH_BRINGS:
                missing.setdefault(n, set()).add(name)
    if not off:
        break
    for n, specs in off.items():
        print(f"{n} {have[n][1]} does not satisfy {', '.join(specs)} (required in the set): fetching a matching one")
        os.remove(os.path.join(dest, have[n][0]))
        subprocess.run(PIP + [n + ",".join(specs)], check=True)
else:
    sys.exit(f"the wheels' requirements are still off after 3 rounds: {off}")

total = 0
for name, (f, _v) in wheels().items():
    size = os.path.getsize(os.path.join(dest, f))
    total += size
    print(f"{size / 2**20:8.2f} MiB  {f}")
print(f"{total / 2**20:8.2f} MiB  total, {len(wheels())} wheels in {dest}")
if missing:
    print("left out (named in a wheel's requirements, never imported by the suite): "
          + ", ".join(f"{n} (by {', '.join(sorted(by))})" for n, by in sorted(missing.items())))
PY
