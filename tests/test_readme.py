"""The README's preset table is zoo.math's, not hand-typed numbers that drift."""

import pathlib
import re

import zoo

README = pathlib.Path(__file__).resolve().parent.parent / "README.md"


def test_readme_lists_every_preset_with_its_parameter_count():
    row = re.compile(r"^\| `([\w.-]+)` \|.*\| ([\d,]+) \|$", re.MULTILINE)
    rows = dict(row.findall(README.read_text()))
    assert set(rows) == set(zoo.presets())
    for name, count in rows.items():
        assert int(count.replace(",", "")) == zoo.math.param_count(zoo.preset(name)), name
