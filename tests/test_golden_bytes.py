"""Not one byte of output changes: every file calibrate/export/quantize/import-encodings/report write for a fixed
set of inputs has the sha256 recorded in tests/golden_bytes.json (see tests/golden_bytes.py).

No manifest field is exempt: the inputs are named by relative paths from the working directory, the manifests hold
no timestamps, and the versions are pinned by constraints.txt. If this fails after a torch/transformers upgrade
regenerate the table with ``python -m tests.golden_bytes --write`` at a commit whose outputs are known to be
right, and say so in the commit; a refactor must never need that. On a machine whose float rounding differs from
every recorded one, record its hashes with ``--write-cpu [LABEL]`` (see tests/golden_bytes.py).
"""

import pytest

from tests.golden_bytes import closest, differences, produce

pytest.importorskip("transformers")


def test_every_output_byte_is_unchanged(tmp_path):
    got = produce(tmp_path / "w")
    key, want = closest(got)
    d = differences(want, got)
    assert not any(d.values()), (
        f"closest recorded table {key!r}: {len(d['changed'])} changed: {d['changed'][:20]}; {len(d['missing'])} "
        f"missing: {d['missing'][:10]}; {len(d['new'])} new: {d['new'][:10]}")

