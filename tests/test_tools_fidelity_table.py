"""tools/fidelity_table.py prints one row per published looped layout and depth, each the
numbers tests/test_hf_fidelity.py holds to its floors (a short prompt here, on numpy)."""
import os
import re
import sys

from hf_reference import LOGITS

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "tools"))
import fidelity_table                                           # noqa: E402


def test_every_layout_gets_a_row_at_two_depths(capsys):
    fidelity_table.main(["--backend", "numpy", "--positions", "12"])
    text = capsys.readouterr().out
    rows = re.findall(r"^\| (\S+) \| (\d+) \| ([\d.]+) \| ([\d.]+) \| ([\d.]+) \| (.+) \|$", text,
                      re.M)
    assert sorted({r[0] for r in rows}) == sorted(LOGITS)
    assert len(rows) == 2 * len(LOGITS)
    for layout, depth, mean, low, top1, source in rows:
        assert 0.99 <= float(low) <= float(mean) <= 1 and 0.5 <= float(top1) <= 1, (layout, depth)
        assert source == fidelity_table.SOURCES[layout]
    depths = [(r[0], int(r[1])) for r in rows]
    assert ("RavenForCausalLM:retrofit-llama", 8) in depths and ("IQuestLoopCoderForCausalLM", 3) \
        in depths
