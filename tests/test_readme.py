"""The README's preset table is zoo.math's, not hand-typed numbers that drift."""

import pathlib
import re

import zoo
from zoo.policy import Policy

README = pathlib.Path(__file__).resolve().parent.parent / "README.md"


def test_readme_lists_every_preset_with_its_parameter_count_and_kv_bytes():
    row = re.compile(
        r"^\| `([\w.-]+)` \|.*\| ([\d,]+)[^|]* \| ([\d,.]+) \| [\d,]+ \| ([\d,]+) \|$",
        re.MULTILINE,
    )
    rows = {
        name: (kv, row_mib, count) for name, kv, row_mib, count in row.findall(README.read_text())
    }
    assert set(rows) == set(zoo.presets())
    bf16 = Policy.of_dtype("bfloat16")
    for name, (kv, row_mib, count) in rows.items():
        config = zoo.preset(name)
        assert int(count.replace(",", "")) == zoo.math.param_count(config), name
        assert int(kv.replace(",", "")) == zoo.math.kv_cache_bytes_per_token(config, bf16), name
        row_bytes = zoo.math.kv_cache_bytes(config, config.max_seq_len, bf16)
        assert row_mib.replace(",", "") == f"{row_bytes / 2**20:.1f}", name
