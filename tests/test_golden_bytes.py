"""Not one byte of output changes: every file calibrate/export/quantize/import-encodings/report write for a fixed
set of inputs has the sha256 recorded in tests/golden_bytes.json (see tests/golden_bytes.py).

No manifest field is exempt: the inputs are named by relative paths from the working directory, the manifests hold
no timestamps, and the versions are pinned by constraints.txt. If this fails after a torch/transformers upgrade
regenerate the table with ``python -m tests.golden_bytes --write`` at a commit whose outputs are known to be
right, and say so in the commit; a refactor must never need that. On a CPU kind whose float rounding differs (a
real model's files only), record that kind's hashes with ``--write-cpu`` (see tests/golden_bytes.py).
"""

import pytest

from tests.golden_bytes import cpu_kind, expected, produce

pytest.importorskip("transformers")


def test_every_output_byte_is_unchanged(tmp_path):
    want = expected()
    got = produce(tmp_path / "w")
    missing = sorted(set(want) - set(got))
    extra = sorted(set(got) - set(want))
    changed = sorted(k for k in want if k in got and got[k] != want[k])
    assert not missing and not extra and not changed, (
        f"on {cpu_kind()}: {len(changed)} changed: {changed[:20]}; {len(missing)} missing: {missing[:10]}; "
        f"{len(extra)} new: {extra[:10]}")
