"""The README's preset table is zoo.math's, not hand-typed numbers that drift; its reliability table
names test files that exist."""

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


def reliability_rows() -> list[tuple[str, list[pathlib.Path]]]:
    """(bad inputs, test files) of each row of the README's reliability table; a bare file name
    is in the directory of the path before it, as the table writes them."""
    section = README.read_text().split("## Reliability", 1)[1].split("\n## ", 1)[0]
    rows = []
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split(" | ")]
        if len(cells) != 2 or not cells[1].startswith("tests/"):
            continue
        files, folder = [], None
        for name in cells[1].split(", "):
            folder = pathlib.PurePosixPath(name).parent if "/" in name else folder
            files.append(README.parent / folder / pathlib.PurePosixPath(name).name)
        rows.append((cells[0], files))
    return rows


def test_the_reliability_table_names_tests_that_exist():
    rows = reliability_rows()
    assert len(rows) >= 20  # the table was found and read
    missing = [(what[:40], str(f)) for what, files in rows for f in files if not f.is_file()]
    assert not missing
