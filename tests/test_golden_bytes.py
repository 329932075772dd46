"""Not one byte of output changes: every file calibrate/export/quantize/import-encodings/report write for a fixed
set of inputs has the sha256 recorded in tests/golden_bytes.json (see tests/golden_bytes.py).

No manifest field is exempt: the inputs are named by relative paths from the working directory, the manifests hold
no timestamps, and the versions are pinned by constraints.txt. If this fails after a torch/transformers upgrade
(or on another CPU kind), regenerate the table with ``python -m tests.golden_bytes --write`` at a commit whose
outputs are known to be right, and say so in the commit; a refactor must never need that.
"""

import json

import pytest

from tests.golden_bytes import TABLE, produce

pytest.importorskip("transformers")


def test_every_output_byte_is_unchanged(tmp_path):
    expected = json.loads(TABLE.read_text())
    got = produce(tmp_path / "w")
    missing = sorted(set(expected) - set(got))
    extra = sorted(set(got) - set(expected))
    changed = sorted(k for k in expected if k in got and got[k] != expected[k])
    assert not missing and not extra and not changed, (
        f"{len(changed)} changed: {changed[:20]}; {len(missing)} missing: {missing[:10]}; "
        f"{len(extra)} new: {extra[:10]}")
