"""Only rlrecipes/device.py may name cuda / npu specifics."""
import re
from pathlib import Path

import rlrecipes

PATTERN = re.compile(r"torch\.(cuda|npu)\b|import torch_npu|\"cuda:\d|'cuda:\d|\.cuda\(\)|\.npu\(\)")


def test_no_device_specific_code_outside_device_py():
    root = Path(rlrecipes.__file__).parent
    offenders = []
    for f in root.rglob("*.py"):
        if f.name == "device.py" and f.parent == root:
            continue
        for i, line in enumerate(f.read_text().splitlines(), 1):
            if PATTERN.search(line):
                offenders.append(f"{f.relative_to(root)}:{i}: {line.strip()}")
    assert not offenders, "\n".join(offenders)


def test_pattern_catches_offences():
    assert PATTERN.search("x = torch.cuda.is_available()")
    assert PATTERN.search("t.cuda()")
    assert not PATTERN.search("device.torch_device('cpu')")
