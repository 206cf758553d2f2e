"""docs/user-guide.md holds the settings table generated from eddis.settings; keep them in step.

Regenerate after registering a setting:  python tests/test_launch_docs.py --update
"""
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
GUIDE = REPO / "docs" / "user-guide.md"
BEGIN = "<!-- settings-table: generated from eddis.settings.markdown_table(); tests/test_launch_docs.py --update -->"
END = "<!-- settings-table-end -->"


def table_in_guide(text):
    match = re.search(re.escape(BEGIN) + r"\n(.*?)" + re.escape(END), text, re.S)
    assert match, f"{GUIDE} lost its settings-table markers"
    return match.group(1).strip()


def test_user_guide_settings_table_is_current():
    from eddis import settings

    assert table_in_guide(GUIDE.read_text()) == settings.markdown_table(), \
        "docs/user-guide.md settings table is stale: run `python tests/test_launch_docs.py --update`"


def test_user_guide_documents_every_rank_variable():
    from eddis.launch.rankenv import RankInfo

    text = GUIDE.read_text()
    info = RankInfo(0, 1, 0, 1, 0, 1, 1, "h", "cpu", "0", "slurm")
    for name in info.environ("/r"):
        assert f"`{name}`" in text, f"{name} is exported to the ranks but not documented in the user guide"


def update():
    sys.path.insert(0, str(REPO / "src"))
    from eddis import settings

    text = GUIDE.read_text()
    start = text.index(BEGIN) + len(BEGIN)
    GUIDE.write_text(text[:start] + "\n" + settings.markdown_table() + "\n" + text[text.index(END):])


if __name__ == "__main__":
    if sys.argv[1:] == ["--update"]:
        update()
    else:
        print(__doc__)
